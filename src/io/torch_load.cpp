#include "paratrain/io/torch_load.h"

#include "paratrain/io/safetensors.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>

namespace paratrain {

namespace {

using torch::jit::PickleOpCode;

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open weights file ", path);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool is_zip(const char* bytes, size_t size) {
  return size >= 4 && bytes[0] == 'P' && bytes[1] == 'K' && bytes[2] == 3 && bytes[3] == 4;
}

[[noreturn]] void unreadable(const std::string& name, const c10::Error& e) {
  TORCH_CHECK(false, "cannot read ", name,
              ": libtorch 1.13 cannot unpickle it (an OrderedDict from model.state_dict() "
              "carries attributes it does not read); save a plain dict instead, "
              "torch.save(dict(model.state_dict()), path), or safetensors (libtorch said: ",
              e.what_without_backtrace(), ")");
}

// The archive's bytes for libtorch's zip reader, which asks for byte ranges.
class BytesAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  BytesAdapter(const char* data, size_t size) : data_(data), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what = "") const override {
    if (pos >= size_) {
      return 0;
    }
    n = std::min<size_t>(n, size_ - pos);
    std::memcpy(buf, data_ + pos, n);
    return n;
  }

 private:
  const char* data_;
  size_t size_;
};

// libtorch 1.13's unpickler trusts the pickle it reads: a string's length makes it allocate and
// zero up to 4 GiB before it finds the pickle shorter, a memo index makes it reserve up to 64 GiB,
// and an opcode that finds too few values on its stack, or an odd number of dict items, reads
// outside the stack. Values nested thousands deep overflow the call stack when they are freed.
//
// So the pickle is walked first, as Python's unpickler would walk it: every length must fit what
// is left, every memo index must follow the ones before (as Python's pickler writes them), every
// opcode must find its operands above the last mark, dict items come in pairs, and no value may
// nest more than kMaxNesting deep. To keep nesting countable, a value that another already holds
// may not be changed any more (Python's pickler fills a container before storing it; only
// self-referencing data, which a state dict never is, does otherwise).
class PickleCheck {
 public:
  PickleCheck(const unsigned char* data, size_t size, const std::string& name)
      : p_(data), n_(size), name_(name) {}

  void run() {
    while (true) {
      at_ = i_;
      const auto op = static_cast<PickleOpCode>(take_bytes(1)[0]);
      if (op == PickleOpCode::STOP) {
        need(1, "STOP");
        return;
      }
      // Each family's handler says whether the opcode is one of its own.
      if (stack_op(op) || scalar_op(op) || container_op(op) || fill_op(op) || memo_op(op)) {
        continue;
      }
      TORCH_CHECK(false, damaged("byte " + std::to_string(static_cast<unsigned char>(op)) +
                                 " is not a pickle opcode libtorch reads"));
    }
  }

 private:
  // The stack itself: protocol, frames, marks, and values popped or duplicated.
  bool stack_op(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::PROTO:
        take_bytes(1);
        return true;
      case PickleOpCode::FRAME:
        TORCH_CHECK(number(8) <= n_ - i_, damaged("a frame longer than the pickle"));
        return true;
      case PickleOpCode::MARK:
        marks_.push_back(stack_.size());
        return true;
      case PickleOpCode::POP:
        need(1, "POP");
        stack_.pop_back();
        return true;
      case PickleOpCode::POP_MARK:
        pop_to_mark("POP_MARK");
        return true;
      case PickleOpCode::DUP:
        need(1, "DUP");
        stack_.push_back(stack_.back());
        return true;
      default:
        return false;
    }
  }

  // Scalars, strings and globals, after their argument.
  bool scalar_op(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::NONE:
      case PickleOpCode::NEWTRUE:
      case PickleOpCode::NEWFALSE:
        break;
      case PickleOpCode::BININT1:
      case PickleOpCode::EXT1:
        take_bytes(1);
        break;
      case PickleOpCode::BININT2:
      case PickleOpCode::EXT2:
        take_bytes(2);
        break;
      case PickleOpCode::BININT:
      case PickleOpCode::EXT4:
        take_bytes(4);
        break;
      case PickleOpCode::BINFLOAT:
        take_bytes(8);
        break;
      case PickleOpCode::FLOAT:
      case PickleOpCode::INT:
      case PickleOpCode::LONG:
      case PickleOpCode::STRING:
      case PickleOpCode::UNICODE_:
      case PickleOpCode::PERSID:
        take_line();
        break;
      case PickleOpCode::GLOBAL:
        take_line();
        take_line();
        break;
      case PickleOpCode::SHORT_BINSTRING:
      case PickleOpCode::SHORT_BINBYTES:
      case PickleOpCode::SHORT_BINUNICODE:
      case PickleOpCode::LONG1:
        take_bytes(number(1));
        break;
      case PickleOpCode::BINSTRING:
      case PickleOpCode::BINBYTES:
      case PickleOpCode::BINUNICODE:
      case PickleOpCode::LONG4:
        take_bytes(number(4));
        break;
      case PickleOpCode::BINUNICODE8:
      case PickleOpCode::BINBYTES8:
        take_bytes(number(8));
        break;
      default:
        return false;
    }
    push_new({});
    return true;
  }

  // New containers and objects made of the values they take off the stack.
  bool container_op(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::EMPTY_TUPLE:
      case PickleOpCode::EMPTY_LIST:
      case PickleOpCode::EMPTY_DICT:
      case PickleOpCode::EMPTY_SET:
        push_new({}, 1);
        return true;
      case PickleOpCode::TUPLE1:
        push_new(pop(1, "TUPLE1"));
        return true;
      case PickleOpCode::TUPLE2:
        push_new(pop(2, "TUPLE2"));
        return true;
      case PickleOpCode::TUPLE3:
        push_new(pop(3, "TUPLE3"));
        return true;
      case PickleOpCode::BINPERSID:
        push_new(pop(1, "BINPERSID"));
        return true;
      case PickleOpCode::REDUCE:
      case PickleOpCode::NEWOBJ:
      case PickleOpCode::STACK_GLOBAL:
        push_new(pop(2, "REDUCE"));
        return true;
      case PickleOpCode::NEWOBJ_EX:
        push_new(pop(3, "NEWOBJ_EX"));
        return true;
      case PickleOpCode::TUPLE:
      case PickleOpCode::LIST:
      case PickleOpCode::FROZENSET:
        push_new(pop_to_mark("TUPLE"));
        return true;
      case PickleOpCode::DICT:
        push_new(pop_pairs_to_mark("DICT"));
        return true;
      case PickleOpCode::INST:
        take_line();
        take_line();
        push_new(pop_to_mark("INST"));
        return true;
      case PickleOpCode::OBJ: {
        auto values = pop_to_mark("OBJ");
        TORCH_CHECK(!values.empty(), damaged("OBJ without a class"));
        push_new(values);
        return true;
      }
      default:
        return false;
    }
  }

  // Values put into the container (or object) below them.
  bool fill_op(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::APPEND:
      case PickleOpCode::BUILD: {
        auto values = pop(2, op == PickleOpCode::APPEND ? "APPEND" : "BUILD");
        push_into(values[0], {values[1]});
        return true;
      }
      case PickleOpCode::SETITEM: {
        auto values = pop(3, "SETITEM");
        push_into(values[0], {values[1], values[2]});
        return true;
      }
      case PickleOpCode::APPENDS:
      case PickleOpCode::ADDITEMS: {
        auto values = pop_to_mark("APPENDS");
        push_into(pop(1, "APPENDS")[0], values);
        return true;
      }
      case PickleOpCode::SETITEMS: {
        auto values = pop_pairs_to_mark("SETITEMS");
        push_into(pop(1, "SETITEMS")[0], values);
        return true;
      }
      default:
        return false;
    }
  }

  // The memo.
  bool memo_op(PickleOpCode op) {
    switch (op) {
      case PickleOpCode::BINPUT:
        put(number(1));
        return true;
      case PickleOpCode::LONG_BINPUT:
        put(number(4));
        return true;
      case PickleOpCode::PUT:
        put(decimal_line());
        return true;
      case PickleOpCode::MEMOIZE:
        put(memo_.size());
        return true;
      case PickleOpCode::BINGET:
        get(number(1));
        return true;
      case PickleOpCode::LONG_BINGET:
        get(number(4));
        return true;
      case PickleOpCode::GET:
        get(decimal_line());
        return true;
      default:
        return false;
    }
  }

  static constexpr int kMaxNesting = 100;

  struct Value {
    int depth;    // 0 for scalars, 1 + the deepest value inside for containers and objects
    bool stored;  // held by another value
  };

  std::string damaged(const std::string& what) const {
    return "cannot read " + name_ + ": its pickle (data.pkl) is damaged: " + what + " at byte " +
           std::to_string(at_);
  }
  std::string too_deep() const {
    return "values nested more than " + std::to_string(kMaxNesting) + " deep";
  }
  const unsigned char* take_bytes(uint64_t count) {
    TORCH_CHECK(count <= n_ - i_, damaged("it ends early"));
    const unsigned char* out = p_ + i_;
    i_ += static_cast<size_t>(count);
    return out;
  }
  // A little-endian unsigned number of `bytes` bytes.
  uint64_t number(size_t bytes) {
    const unsigned char* b = take_bytes(bytes);
    uint64_t v = 0;
    for (size_t k = 0; k < bytes; ++k) {
      v |= static_cast<uint64_t>(b[k]) << (8 * k);
    }
    return v;
  }
  std::string take_line() {
    const void* nl = std::memchr(p_ + i_, '\n', n_ - i_);
    TORCH_CHECK(nl != nullptr, damaged("a line that does not end"));
    const auto* end = static_cast<const unsigned char*>(nl);
    std::string line(p_ + i_, end);
    i_ = static_cast<size_t>(end - p_) + 1;
    return line;
  }
  uint64_t decimal_line() {
    const std::string line = take_line();
    TORCH_CHECK(
        !line.empty() && line.size() <= 18 &&
            std::all_of(line.begin(), line.end(), [](char c) { return c >= '0' && c <= '9'; }),
        damaged("a memo index that is not a number"));
    return std::stoull(line);
  }

  void need(size_t count, const char* op) const {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    TORCH_CHECK(stack_.size() - floor >= count, damaged(std::string(op) + " finds too few values"));
  }
  std::vector<size_t> pop(size_t count, const char* op) {
    need(count, op);
    std::vector<size_t> out(stack_.end() - static_cast<std::ptrdiff_t>(count), stack_.end());
    stack_.resize(stack_.size() - count);
    return out;
  }
  std::vector<size_t> pop_to_mark(const char* op) {
    TORCH_CHECK(!marks_.empty(), damaged(std::string(op) + " without a MARK"));
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<size_t> out(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return out;
  }
  std::vector<size_t> pop_pairs_to_mark(const char* op) {
    auto out = pop_to_mark(op);
    TORCH_CHECK(out.size() % 2 == 0, damaged(std::string(op) + " with a key but no value"));
    return out;
  }

  // A new value holding `inside`; `depth` for an empty container.
  void push_new(const std::vector<size_t>& inside, int depth = 0) {
    for (size_t v : inside) {
      values_[v].stored = true;
      depth = std::max(depth, values_[v].depth + 1);
    }
    TORCH_CHECK(depth <= kMaxNesting, damaged(too_deep()));
    values_.push_back({depth, false});
    stack_.push_back(values_.size() - 1);
  }
  // `target` takes `inside` in and goes back on the stack.
  void push_into(size_t target, const std::vector<size_t>& inside) {
    TORCH_CHECK(!values_[target].stored, damaged("a value changed after another took it in"));
    for (size_t v : inside) {
      TORCH_CHECK(v != target, damaged("a value put inside itself"));
      values_[v].stored = true;
      values_[target].depth = std::max(values_[target].depth, values_[v].depth + 1);
    }
    TORCH_CHECK(values_[target].depth <= kMaxNesting, damaged(too_deep()));
    stack_.push_back(target);
  }
  void put(uint64_t id) {
    need(1, "PUT");
    TORCH_CHECK(id <= memo_.size(), damaged("memo index " + std::to_string(id) + " after only " +
                                            std::to_string(memo_.size()) + " entries"));
    if (id == memo_.size()) {
      memo_.push_back(stack_.back());
    } else {
      memo_[id] = stack_.back();
    }
  }
  void get(uint64_t id) {
    TORCH_CHECK(id < memo_.size(), damaged("memo index " + std::to_string(id) + " never stored"));
    stack_.push_back(memo_[id]);
  }

  const unsigned char* p_;
  size_t n_;
  const std::string& name_;
  size_t i_ = 0;
  size_t at_ = 0;  // where the current opcode starts
  std::vector<Value> values_;
  std::vector<size_t> stack_;  // indices into values_
  std::vector<size_t> marks_;  // stack sizes at each MARK
  std::vector<size_t> memo_;   // indices into values_
};

// The unpickler sizes a storage by the element count in the pickle rather than by the bytes of its
// record, and gives a tensor whatever sizes, strides and offset the pickle says: every tensor must
// lie inside the record it was read from.
void check_in_record(const std::string& key,
                     const torch::Tensor& t,
                     const std::map<const void*, size_t>& records,
                     const std::string& name) {
  TORCH_CHECK(t.layout() == torch::kStrided, name, ": '", key, "' is a ", t.layout(),
              " tensor; only dense tensors can be loaded");
  bool negative = t.storage_offset() < 0;
  bool empty = false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    negative |= t.size(d) < 0 || t.stride(d) < 0;
    empty |= t.size(d) == 0;
  }
  TORCH_CHECK(!negative, name, ": '", key, "' has sizes ", t.sizes(), ", strides ", t.strides(),
              " and offset ", t.storage_offset(), ", not a tensor");
  if (empty) {
    return;
  }
  // One past the last byte of the last element: (offset + sum (size - 1) * stride + 1) * item.
  int64_t end = t.storage_offset();
  bool overflow = false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t reach = 0;
    overflow |= __builtin_mul_overflow(t.size(d) - 1, t.stride(d), &reach) ||
                __builtin_add_overflow(end, reach, &end);
  }
  overflow |= __builtin_add_overflow(end, int64_t{1}, &end) ||
              __builtin_mul_overflow(end, static_cast<int64_t>(t.element_size()), &end);
  const auto it = records.find(t.storage().data());
  const uint64_t held = it == records.end() ? 0 : it->second;
  TORCH_CHECK(!overflow && static_cast<uint64_t>(end) <= held, name, ": '", key, "' of sizes ",
              t.sizes(), ", strides ", t.strides(), " and offset ", t.storage_offset(),
              " reaches past the ", held, " bytes of its storage");
  // A bool is a byte that must be 0 or 1: any other value is undefined behaviour to read.
  TORCH_CHECK(t.scalar_type() != torch::kBool || t.view(torch::kUInt8).le(1).all().item<bool>(),
              name, ": '", key, "' holds bool bytes other than 0 and 1");
}

std::map<std::string, torch::Tensor> state_dict_from(const char* data,
                                                     size_t size,
                                                     const std::string& name) {
  TORCH_CHECK(is_zip(data, size), name,
              " is not a torch.save file (no zip header); PyTorch >= 1.6 writes zip archives, "
              "older files need torch.save(..., _use_new_zipfile_serialization=True)");
  // What torch::pickle_load does, with the pickle checked before libtorch unpickles it and each
  // storage's record size noted.
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  at::DataPtr pickle;
  size_t pickle_size = 0;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<BytesAdapter>(data, size));
    std::tie(pickle, pickle_size) = reader->getRecord("data.pkl");
  } catch (const c10::Error& e) {
    unreadable(name, e);
  }
  const auto* pickle_bytes = static_cast<const unsigned char*>(pickle.get());
  PickleCheck(pickle_bytes, pickle_size, name).run();
  std::map<const void*, size_t> records;
  torch::IValue value;
  try {
    size_t done = 0;
    torch::jit::Unpickler unpickler(
        [&](char* out, size_t n) {
          n = std::min(n, pickle_size - done);
          std::memcpy(out, pickle_bytes + done, n);
          done += n;
          return n;
        },
        /*type_resolver=*/nullptr, /*obj_loader=*/nullptr,
        [&](const std::string& key) {
          at::DataPtr record;
          size_t record_size = 0;
          std::tie(record, record_size) = reader->getRecord("data/" + key);
          records[record.get()] = record_size;
          return record;
        },
        // Storages stay where the bytes were read (as torch.load(map_location="cpu")), so that
        // they can be checked against their records.
        torch::Device(torch::kCPU));
    unpickler.set_version(reader->version());
    value = unpickler.parse_ivalue();
  } catch (const c10::Error& e) {
    unreadable(name, e);
  }
  TORCH_CHECK(value.isGenericDict(), name, " holds a ", value.tagKind(),
              ", not a dict of tensors; save torch.save(dict(model.state_dict()), path)");
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : value.toGenericDict()) {
    TORCH_CHECK(kv.key().isString(), name, ": a key is a ", kv.key().tagKind(), ", not a name");
    TORCH_CHECK(kv.value().isTensor(), name, ": '", kv.key().toStringRef(), "' is a ",
                kv.value().tagKind(), ", not a tensor");
    check_in_record(kv.key().toStringRef(), kv.value().toTensor(), records, name);
    out[kv.key().toStringRef()] = kv.value().toTensor();
  }
  return out;
}

}  // namespace

std::map<std::string, torch::Tensor> load_torch_state_dict(const std::string& path) {
  const std::vector<char> bytes = read_file(path);
  return state_dict_from(bytes.data(), bytes.size(), path);
}

std::map<std::string, torch::Tensor> load_torch_state_dict_bytes(const void* data,
                                                                 size_t size,
                                                                 const std::string& name) {
  return state_dict_from(static_cast<const char*>(data), size, name);
}

std::map<std::string, torch::Tensor> load_weights(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "cannot open weights file ", path);
  char head[4] = {0, 0, 0, 0};
  in.read(head, 4);
  if (in.gcount() == 4 && head[0] == 'P' && head[1] == 'K' && head[2] == 3 && head[3] == 4) {
    return load_torch_state_dict(path);
  }
  return load_safetensors(path);
}

}  // namespace paratrain

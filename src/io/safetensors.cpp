#include "paratrain/io/safetensors.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

namespace paratrain {

namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},   {at::kBool, "BOOL"},
};

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) {
      return d.name;
    }
  }
  TORCH_CHECK(false, "safetensors: cannot store tensors of type ", t);
}

// Values nested deeper than this in a header are refused, and so are longer shapes: a header of
// a million '[' must fail with a message.
constexpr int kMaxNesting = 64;

// One tensor's entry in the header.
struct Entry {
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t begin = -1;
  int64_t end = -1;
};

[[noreturn]] void invalid(const std::string& path, const std::string& what) {
  TORCH_CHECK(false, "safetensors: ", path, " is not a valid safetensors file: ", what);
}

int64_t integer(const nlohmann::json& v, const std::string& path, const std::string& what) {
  if (!v.is_number_integer()) {
    invalid(path, what + " holds " + v.dump() + ", not an integer");
  }
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    invalid(path, what + " holds a number beyond 64 bits");
  }
  return v.get<int64_t>();
}

std::vector<int64_t> integers(const nlohmann::json& v,
                              const std::string& path,
                              const std::string& what) {
  if (!v.is_array()) {
    invalid(path, what + " is not an array");
  }
  std::vector<int64_t> out;
  for (const auto& item : v) {
    out.push_back(integer(item, path, what));
  }
  return out;
}

Entry entry(const std::string& name, const nlohmann::json& v, const std::string& path) {
  if (!v.is_object()) {
    invalid(path, "tensor '" + name + "' is not an object");
  }
  Entry e;
  const auto dtype = v.find("dtype");
  const auto offsets = v.find("data_offsets");
  if (dtype == v.end() || !dtype->is_string() || offsets == v.end()) {
    invalid(path, "tensor '" + name + "' lacks dtype or data_offsets");
  }
  e.dtype = dtype->get<std::string>();
  if (const auto shape = v.find("shape"); shape != v.end()) {
    e.shape = integers(*shape, path, "the shape of '" + name + "'");
  }
  const auto range = integers(*offsets, path, "data_offsets of '" + name + "'");
  if (range.size() != 2) {
    invalid(path, "data_offsets of '" + name + "' must hold two numbers");
  }
  e.begin = range[0];
  e.end = range[1];
  return e;
}

// What the JSON parser keeps of a header: each tensor's dtype, shape and data_offsets, in arrays
// of at most kMaxNesting numbers. The rest (__metadata__, unknown fields) is read and dropped as
// it goes, so a header of up to 100 MiB never costs more memory than its tensors' entries; and
// values nested deeper than kMaxNesting are refused.
class HeaderFilter {
 public:
  explicit HeaderFilter(const std::string& path) : path_(path) {}

  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (depth > kMaxNesting) {
      invalid(path_, "values nested more than " + std::to_string(kMaxNesting) + " deep");
    }
    if (event == Event::key && depth == 1) {
      tensor_ = parsed.get<std::string>();
      return tensor_ != "__metadata__";
    }
    const bool in_tensor = tensor_ != "__metadata__";
    if (in_tensor && depth == 1 && event != Event::object_start && event != Event::object_end) {
      invalid(path_, "tensor '" + tensor_ + "' is not an object");
    }
    if (event == Event::key && depth == 2) {
      field_ = parsed.get<std::string>();
      keep_ = field_ == "dtype" || field_ == "shape" || field_ == "data_offsets";
      items_ = 0;
      return keep_;
    }
    if (in_tensor && keep_ && depth >= 3) {
      if (event != Event::value) {
        invalid(path_, "the " + field_ + " of '" + tensor_ + "' holds a nested value");
      }
      if (++items_ > kMaxNesting) {
        invalid(path_, "the " + field_ + " of '" + tensor_ + "' holds more than " +
                           std::to_string(kMaxNesting) + " values");
      }
    }
    return true;
  }

 private:
  const std::string& path_;
  std::string tensor_;  // the top-level key being read
  std::string field_;   // the tensor's field being read
  bool keep_ = false;   // it is one the reader needs
  int items_ = 0;       // values read in that field's array
};

// The header as a JSON object, read with nlohmann-json through `filter` (which drops what the
// reader does not need).
template <typename Filter>
nlohmann::json parse_header(const std::string& text, const std::string& path, Filter filter) {
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, filter);
  } catch (const nlohmann::json::exception& e) {
    const std::string what = e.what();  // "[json.exception.parse_error.101] parse error at ..."
    invalid(path, "the header is not JSON (" + what.substr(what.find("] ") + 2) + ")");
  }
  if (!header.is_object()) {
    invalid(path, "the header is not a JSON object");
  }
  return header;
}

// The header's tensors by name (its __metadata__ aside).
std::map<std::string, Entry> read_header(const std::string& text, const std::string& path) {
  const nlohmann::json header = parse_header(text, path, HeaderFilter(path));
  std::map<std::string, Entry> out;
  for (const auto& item : header.items()) {
    out[item.key()] = entry(item.key(), item.value(), path);
  }
  return out;
}

// The header's __metadata__; the tensors' entries are read past (to the nesting limit) and
// dropped.
std::map<std::string, std::string> read_metadata(const std::string& text, const std::string& path) {
  using Event = nlohmann::json::parse_event_t;
  auto only_metadata = [&path](int depth, Event event, nlohmann::json& parsed) {
    if (depth > kMaxNesting) {
      invalid(path, "values nested more than " + std::to_string(kMaxNesting) + " deep");
    }
    return !(event == Event::key && depth == 1 && parsed.get<std::string>() != "__metadata__");
  };
  const nlohmann::json header = parse_header(text, path, only_metadata);
  std::map<std::string, std::string> out;
  const auto metadata = header.find("__metadata__");
  if (metadata == header.end()) {
    return out;
  }
  if (!metadata->is_object()) {
    invalid(path, "__metadata__ is not an object");
  }
  for (const auto& item : metadata->items()) {
    out[item.key()] =
        item.value().is_string() ? item.value().get<std::string>() : item.value().dump();
  }
  return out;
}

// `text` as a JSON string, quotes included. The format's names are UTF-8, as JSON's strings are:
// another name would make a file that no reader (this one included) accepts.
std::string json_string(const std::string& text, const char* what = "tensor name") {
  try {
    return nlohmann::json(text).dump();
  } catch (const nlohmann::json::exception&) {
    TORCH_CHECK(false, "safetensors: the ", what, " '", text, "' is not valid UTF-8");
  }
}

// The header's length from a file's first 8 bytes, checked against the file's size.
uint64_t header_length(const unsigned char* first8, uint64_t size, const std::string& name) {
  TORCH_CHECK(size >= 8, "safetensors: ", name,
              " is not a valid safetensors file: shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) {
    n |= static_cast<uint64_t>(first8[i]) << (8 * i);
  }
  TORCH_CHECK(n >= 2 && n <= size - 8 && n < (100u << 20), "safetensors: ", name,
              " is not a valid safetensors file: its header length ", n, " does not fit a file of ",
              size, " bytes");
  return n;
}

// The header's text (after its length), which must be a JSON object.
std::string header_text(const unsigned char* bytes, size_t size, const std::string& name) {
  const uint64_t n = header_length(bytes, size, name);
  std::string header(reinterpret_cast<const char*>(bytes) + 8, n);
  TORCH_CHECK(header[0] == '{', "safetensors: ", name,
              " is not a valid safetensors file: the header is not a JSON object");
  return header;
}

}  // namespace

SafetensorsParts encode_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                                    const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> all{{"format", "pt"}};
  for (const auto& kv : metadata) {
    all[kv.first] = kv.second;
  }
  std::ostringstream header;
  header << "{\"__metadata__\":{";
  for (auto it = all.begin(); it != all.end(); ++it) {
    header << (it == all.begin() ? "" : ",") << json_string(it->first, "metadata name") << ":"
           << json_string(it->second, "metadata value");
  }
  header << "}";
  SafetensorsParts parts;
  int64_t offset = 0;
  for (const auto& kv : tensors) {
    torch::Tensor t = kv.second.detach().to(torch::kCPU).contiguous();
    header << "," << json_string(kv.first) << ":{\"dtype\":\"" << dtype_name(t.scalar_type())
           << "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) {
      header << (d ? "," : "") << t.size(d);
    }
    header << "],\"data_offsets\":[" << offset << "," << offset + t.nbytes() << "]}";
    offset += static_cast<int64_t>(t.nbytes());
    parts.tensors.push_back(t);
  }
  header << "}";
  std::string h = header.str();
  while (h.size() % 8 != 0) {
    h += ' ';  // the format pads the header to 8 bytes with spaces
  }
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) {
    parts.header += static_cast<char>(static_cast<unsigned char>(n >> (8 * i)));
  }
  parts.header += h;
  return parts;
}

void save_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                      const std::string& path) {
  const SafetensorsParts parts = encode_safetensors(tensors);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out.good(), "safetensors: cannot write ", path);
  out.write(parts.header.data(), static_cast<std::streamsize>(parts.header.size()));
  for (const auto& t : parts.tensors) {
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
  TORCH_CHECK(out.good(), "safetensors: writing ", path, " failed");
}

std::map<std::string, torch::Tensor> load_safetensors_bytes(const void* data,
                                                            size_t size,
                                                            const std::string& name,
                                                            const SafetensorsFilter& keep) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const std::string header = header_text(bytes, size, name);
  const auto entries = read_header(header, name);
  const unsigned char* payload = bytes + 8 + header.size();
  const int64_t data_size = static_cast<int64_t>(size - 8 - header.size());
  std::map<std::string, torch::Tensor> out;
  for (const auto& kv : entries) {
    if (keep && !keep(kv.first)) {
      continue;
    }
    const auto& e = kv.second;
    at::ScalarType type = at::kFloat;
    bool known = false;
    for (const auto& d : kDtypes) {
      if (e.dtype == d.name) {
        type = d.type;
        known = true;
      }
    }
    TORCH_CHECK(known, "safetensors: ", name, ": tensor '", kv.first, "' has unsupported dtype ",
                e.dtype);
    // Check the byte range against the shape before allocating: a damaged header must not ask
    // for terabytes. An empty tensor's other dimensions must still multiply within 64 bits, as
    // libtorch computes its strides from them.
    int64_t nbytes = static_cast<int64_t>(c10::elementSize(type));
    int64_t span = nbytes;  // the product of the dimensions other than 0
    for (int64_t d : e.shape) {
      TORCH_CHECK(d >= 0 && (d == 0 || nbytes <= std::max<int64_t>(1, data_size) / d) &&
                      !__builtin_mul_overflow(span, std::max<int64_t>(d, 1), &span),
                  "safetensors: ", name, ": tensor '", kv.first, "' has a shape ", e.shape,
                  " larger than the file");
      nbytes *= d;
    }
    TORCH_CHECK(e.begin >= 0 && e.end >= e.begin && e.end <= data_size && e.end - e.begin == nbytes,
                "safetensors: ", name, ": tensor '", kv.first, "' has byte range [", e.begin, ", ",
                e.end, ") that does not match its shape or the file");
    const unsigned char* src = payload + e.begin;
    // A bool is a byte that must be 0 or 1: any other value is undefined behaviour to read.
    TORCH_CHECK(
        type != at::kBool || std::all_of(src, src + nbytes, [](unsigned char b) { return b <= 1; }),
        "safetensors: ", name, ": tensor '", kv.first, "' holds BOOL bytes other than 0 and 1");
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(type));
    if (nbytes > 0) {
      std::memcpy(t.data_ptr(), src, static_cast<size_t>(nbytes));
    }
    out[kv.first] = t;
  }
  return out;
}

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path,
                                                      const SafetensorsFilter& keep) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const std::streamoff size = in.tellg();
  TORCH_CHECK(in.good() && size >= 0, "safetensors: cannot open ", path);
  std::vector<char> bytes(static_cast<size_t>(size));
  in.seekg(0);
  TORCH_CHECK(in.read(bytes.data(), static_cast<std::streamsize>(bytes.size())),
              "safetensors: cannot read ", path);
  return load_safetensors_bytes(bytes.data(), bytes.size(), path, keep);
}

std::map<std::string, std::string> safetensors_metadata_bytes(const void* data,
                                                              size_t size,
                                                              const std::string& name) {
  return read_metadata(header_text(static_cast<const unsigned char*>(data), size, name), name);
}

std::map<std::string, std::string> load_safetensors_metadata(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const std::streamoff size = in.tellg();
  TORCH_CHECK(in.good() && size >= 0, "safetensors: cannot open ", path);
  // Only the header: the length first, then as many bytes as it says (checked against the size).
  unsigned char first8[8] = {};
  in.seekg(0);
  in.read(reinterpret_cast<char*>(first8), std::min<std::streamoff>(size, 8));
  const uint64_t n = header_length(first8, static_cast<uint64_t>(size), path);
  std::vector<unsigned char> head(8 + n);
  in.seekg(0);
  TORCH_CHECK(
      in.read(reinterpret_cast<char*>(head.data()), static_cast<std::streamsize>(head.size())),
      "safetensors: cannot read ", path);
  return read_metadata(header_text(head.data(), head.size(), path), path);
}

std::map<std::string, torch::Tensor> module_state(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> state;
  for (const auto& p : module.named_parameters(true)) {
    state[p.key()] = p.value();
  }
  for (const auto& b : module.named_buffers(true)) {
    state[b.key()] = b.value();
  }
  return state;
}

void load_module_state(torch::nn::Module& module,
                       const std::map<std::string, torch::Tensor>& state,
                       bool strict) {
  auto mine = module_state(module);
  std::string missing, unexpected;
  for (const auto& kv : mine) {
    if (!state.count(kv.first)) {
      missing += (missing.empty() ? "" : ", ") + kv.first;
    }
  }
  for (const auto& kv : state) {
    if (!mine.count(kv.first)) {
      unexpected += (unexpected.empty() ? "" : ", ") + kv.first;
    }
  }
  for (const auto& kv : state) {
    auto it = mine.find(kv.first);
    if (it != mine.end()) {
      TORCH_CHECK(it->second.sizes() == kv.second.sizes(), "weights do not match the model: '",
                  kv.first, "' has shape ", kv.second.sizes(), " in the file but ",
                  it->second.sizes(), " in the model");
    }
  }
  if (strict && (!missing.empty() || !unexpected.empty())) {
    std::string what;
    if (!missing.empty()) {
      what += "missing tensor(s) " + missing;
    }
    if (!unexpected.empty()) {
      what += (what.empty() ? "" : "; ") + std::string("unexpected tensor(s) ") + unexpected;
    }
    TORCH_CHECK(false, "weights do not match the model: ", what);
  }
  torch::NoGradGuard no_grad;
  for (const auto& kv : state) {
    auto it = mine.find(kv.first);
    if (it != mine.end()) {
      it->second.copy_(kv.second);
    }
  }
}

}  // namespace paratrain

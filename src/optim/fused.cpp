#include "paratrain/optim/fused.h"

#include "paratrain/optim/offload.h"

#include "optim/fused_kernels.h"
#include "optim/param_state.h"
#include "optim/step_threads.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace paratrain {
namespace optim {
namespace {

using detail::CopyKind;

// Elements per chunk of a step: 256 KiB of each array, so that threads share a large tensor
// finely while a chunk is long enough for its setup not to count.
constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  size_t arg;  // which parameter's arguments
  int64_t begin, end;
};

// Every parameter's elements in chunks, run over at::get_num_threads() threads as one job.
template <typename Args, typename Kernel>
void run_chunks(const std::vector<Args>& args, const std::vector<int64_t>& sizes, Kernel kernel) {
  std::vector<Chunk> chunks;
  for (size_t a = 0; a < args.size(); ++a) {
    for (int64_t b = 0; b < sizes[a]; b += kChunk) {
      chunks.push_back({a, b, std::min(sizes[a], b + kChunk)});
    }
  }
  detail::StepThreads::instance().run(static_cast<int64_t>(chunks.size()), at::get_num_threads(),
                                      [&](int64_t i) {
                                        const Chunk& c = chunks[static_cast<size_t>(i)];
                                        kernel(args[c.arg], c.begin, c.end);
                                      });
}

// Whether the pass can use `t` (`p`'s values, gradient or state) in place.
bool in_place(const torch::Tensor& t) {
  return t.layout() == torch::kStrided && t.device().is_cpu() && t.is_contiguous();
}

// Whether the offloaded pass can step `t` from a host copy: a strided tensor on the CPU or a GPU
// (not sparse, mkldnn or meta); when it is `written` back (the values), one whose elements do not
// overlap (not an expanded view, which the copy back could not write).
bool stageable(const torch::Tensor& t, bool written) {
  return t.layout() == torch::kStrided && (t.device().is_cpu() || t.device().is_cuda()) &&
         (!written || at::has_internal_overlap(t) != at::MemOverlap::Yes);
}

// Whether the pass takes `t`: in place, or, with `anywhere` (the offloaded pass), any fp32 tensor
// of `p`'s size it can stage through a host copy (on a GPU: ZeRO-Offload's step).
bool fusable(const torch::Tensor& t, const torch::Tensor& p, bool anywhere = false) {
  return t.defined() && t.scalar_type() == torch::kFloat && t.numel() == p.numel() &&
         (anywhere ? stageable(t, /*written=*/t.is_same(p)) : in_place(t));
}

// Why the pass cannot take `p` (with `what` its gradient or a state tensor); "" when it can.
std::string unfusable(const torch::Tensor& t,
                      const torch::Tensor& p,
                      const char* what,
                      bool anywhere = false) {
  if (fusable(t, p, anywhere)) {
    return "";
  }
  std::ostringstream why;
  why << "a parameter of shape " << p.sizes() << " has " << what << " "
      << (t.defined() ? t.toString() : std::string("undefined"))
      << (t.defined() && t.layout() == torch::kStrided && !t.is_contiguous() && !anywhere
              ? ", not contiguous"
              : "")
      << (anywhere ? " (the offloaded pass takes dense fp32 CPU or CUDA tensors)"
                   : " (the pass takes contiguous fp32 CPU tensors)");
  return why.str();
}

// Why some parameter with a gradient, or the state it has, does not suit the pass; "" when all
// do. `state_fusable` checks a parameter's existing state object; `anywhere`: the offloaded pass.
template <typename Map, typename StateCheck>
std::string all_fusable(std::vector<torch::optim::OptimizerParamGroup>& groups,
                        Map& state,
                        StateCheck state_fusable,
                        bool anywhere = false) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& group : groups) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      std::string why = unfusable(p, p, "the values", anywhere);
      why = why.empty() ? unfusable(p.grad(), p, "a gradient", anywhere) : why;
      const auto it = state.find(detail::state_key(state, p));
      if (why.empty() && it != state.end() && !state_fusable(*it->second, p, anywhere)) {
        std::ostringstream text;
        text << "a parameter of shape " << p.sizes() << " has optimizer state that is not "
             << (anywhere ? "an fp32 tensor" : "a contiguous fp32 CPU tensor") << " of its size";
        why = text.str();
      }
      if (why.empty() && !seen.insert(p.unsafeGetTensorImpl()).second) {
        // libtorch steps it twice, one step after the other; the pass would race with itself.
        std::ostringstream text;
        text << "a parameter of shape " << p.sizes() << " is listed twice";
        why = text.str();
      }
      if (!why.empty()) {
        return why;
      }
    }
  }
  return "";
}

// An offloaded moment: the state object holds an empty tensor, the store the values.
bool offloaded(const torch::Tensor& t, const torch::Tensor& p) {
  return t.defined() && t.numel() == 0 && p.numel() > 0;
}

template <typename AdamState>
bool adam_state_fusable(const torch::optim::OptimizerParamState& s,
                        const torch::Tensor& p,
                        bool anywhere) {
  const auto& st = static_cast<const AdamState&>(s);
  auto fits = [&](const torch::Tensor& t) { return fusable(t, p, anywhere) || offloaded(t, p); };
  return fits(st.exp_avg()) && fits(st.exp_avg_sq()) &&
         (!st.max_exp_avg_sq().defined() || fits(st.max_exp_avg_sq()));
}

// Whether `copy` can hold `param` rounded: write_copy's condition, checked again each step.
bool copy_fits(const torch::Tensor& param, const torch::Tensor& copy) {
  return copy.defined() && copy.device().is_cpu() && copy.is_contiguous() &&
         (copy.scalar_type() == torch::kBFloat16 || copy.scalar_type() == torch::kHalf) &&
         copy.sizes() == param.sizes();
}

CopyKind copy_kind(const torch::Tensor& copy) {
  if (!copy.defined()) {
    return CopyKind::kNone;
  }
  return copy.scalar_type() == torch::kBFloat16 ? CopyKind::kBFloat16 : CopyKind::kHalf;
}

uint16_t* copy_bits(const torch::Tensor& copy) {
  return copy.defined() ? static_cast<uint16_t*>(copy.data_ptr()) : nullptr;
}

// Zeros shaped like `p`, as libtorch's state, asked of the kernel in huge pages where the
// system leaves that to the program (transparent_hugepage "madvise", Debian's default): the pass
// streams its state through memory, and 2 MiB pages spare it a TLB miss every 4 KiB. Over 100M
// parameters on 2 cores, a step took 0.026 s in each of 3 processes with every array in huge
// pages, and 0.027 to 0.045 s with them in 4 KiB pages. The advice covers the whole 2 MiB pages
// inside the tensor, before they are touched.
torch::Tensor zero_state_like(const torch::Tensor& p) {
  torch::Tensor t = torch::empty_like(p, at::MemoryFormat::Preserve);
#if defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + t.nbytes()) & ~(kHuge - 1);
  if (last > first) {
    ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only
  }
#endif
  return t.zero_();
}

// The state libtorch's step would make on a parameter's first step (zeros in its layout), or the
// one it has; amsgrad's maximum is added when a state loaded without it meets amsgrad.
template <typename AdamState, typename Map>
AdamState& adam_state(Map& state, const torch::Tensor& p, bool amsgrad) {
  auto key = detail::state_key(state, p);
  auto it = state.find(key);
  if (it == state.end()) {
    auto st = std::make_unique<AdamState>();
    st->step(0);
    st->exp_avg(zero_state_like(p));
    st->exp_avg_sq(zero_state_like(p));
    state[key] = std::move(st);
    it = state.find(key);
  }
  auto& st = static_cast<AdamState&>(*it->second);
  if (amsgrad && !st.max_exp_avg_sq().defined()) {
    st.max_exp_avg_sq(zero_state_like(p));
  }
  return st;
}

// What the pass wrote, marked as written in place (as libtorch's in-place ops mark them), so that
// autograd refuses a graph that saved them before the step.
void bump_versions(const std::vector<torch::Tensor>& written) {
  for (const auto& t : written) {
    if (t.defined()) {
      t.unsafeGetTensorImpl()->bump_version();
    }
  }
}

// A parameter's arguments of the Adam pass: its step counted, the scalars from it, the moments'
// pointers those of the state object (set again by the offloaded pass).
template <typename Options, typename AdamState>
detail::AdamArgs adam_args(const Options& o,
                           AdamState& st,
                           const torch::Tensor& p,
                           bool decoupled,
                           const torch::Tensor& copy) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  st.step(st.step() + 1);
  // In double from the int64 step, as libtorch's Adam computes them; each rounded once.
  const double bias_correction1 = 1 - std::pow(beta1, st.step());
  const double bias_correction2 = 1 - std::pow(beta2, st.step());
  detail::AdamArgs a;
  // An array that lives in a store (an empty state tensor, an FSDP shard without storage, a
  // gradient not in memory) gets its pointer when the offloaded pass has read it.
  auto floats = [](const torch::Tensor& t) {
    return t.defined() && t.numel() > 0 && t.storage().data() != nullptr ? t.data_ptr<float>()
                                                                         : nullptr;
  };
  a.param = floats(p);
  a.grad = floats(p.grad());
  a.exp_avg = floats(st.exp_avg());
  a.exp_avg_sq = floats(st.exp_avg_sq());
  a.max_exp_avg_sq = o.amsgrad() ? floats(st.max_exp_avg_sq()) : nullptr;
  a.copy = copy_bits(copy);
  a.copy_kind = copy_kind(copy);
  a.beta1 = static_cast<float>(beta1);
  a.one_minus_beta1 = static_cast<float>(1 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1 - beta2);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  a.eps = static_cast<float>(o.eps());
  a.neg_step_size = static_cast<float>(-(o.lr() / bias_correction1));
  a.decoupled = decoupled && o.weight_decay() != 0;
  a.decay = a.decoupled ? static_cast<float>(1 - o.lr() * o.weight_decay()) : 1.0f;
  a.weight_decay = decoupled ? 0.0f : static_cast<float>(o.weight_decay());
  return a;
}

// One Adam or AdamW pass over every parameter with a gradient.
template <typename Options, typename AdamState, typename Map>
void adam_pass(std::vector<torch::optim::OptimizerParamGroup>& groups,
               Map& state,
               bool decoupled,
               const std::function<torch::Tensor(const torch::Tensor&)>& copy_of) {
  std::vector<detail::AdamArgs> args;
  std::vector<int64_t> sizes;
  std::vector<torch::Tensor> written;
  for (auto& group : groups) {
    const auto& o = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      AdamState& st = adam_state<AdamState>(state, p, o.amsgrad());
      const torch::Tensor copy = copy_of(p);
      args.push_back(adam_args(o, st, p, decoupled, copy));
      sizes.push_back(p.numel());
      written.insert(written.end(), {p, st.exp_avg(), st.exp_avg_sq(), copy});
      if (o.amsgrad()) {
        written.push_back(st.max_exp_avg_sq());
      }
    }
  }
  run_chunks(args, sizes, detail::kernels().adam);
  bump_versions(written);
}

// What one parameter's offloaded step reads and writes. Each slot is one of its arrays: the
// values, the gradient, the moments. A slot with a key is a block of the store, read into a
// buffer (or, when `held` holds values, copied from it: state loaded into memory moves into the
// store) and written back when `write_back`; a slot without one is `held`, used in place.
enum SlotKind { kValues, kGradient, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kSlotKinds };

struct Slot {
  SlotKind kind;
  std::string key;
  torch::Tensor held;
  bool write_back = true;
};

struct Streamed {
  detail::AdamArgs args;
  int64_t numel = 0;
  std::vector<Slot> slots;
};

float*& slot_pointer(detail::AdamArgs& a, SlotKind kind) {
  switch (kind) {
    case kValues:
      return a.param;
    case kGradient:
      return const_cast<float*&>(a.grad);
    case kExpAvg:
      return a.exp_avg;
    case kExpAvgSq:
      return a.exp_avg_sq;
    default:
      return a.max_exp_avg_sq;
  }
}

// A contiguous host copy of `t`, for the pass to step. A CUDA tensor's goes to pinned memory:
// its copies then run at the bus's full speed, and the caching host allocator keeps the pages
// from one step to the next.
torch::Tensor host_copy(const torch::Tensor& t) {
  torch::Tensor h = torch::empty(
      t.sizes(), torch::TensorOptions().dtype(torch::kFloat).pinned_memory(t.is_cuda()));
  h.copy_(t);
  return h;
}

// The values and gradient of `it` the pass cannot use in place (on a GPU: ZeRO-Offload, whose
// Adam steps on the CPU; or strided) replaced by host copies; returns the values' home, to copy
// the stepped values back into (undefined when they were used in place). The copies are
// synchronous: a stream-ordered copy would need this library to know the device's streams, and a
// step's copies are 12 bytes a parameter against the CPU pass's 28.
torch::Tensor stage(Streamed& it) {
  torch::Tensor home;
  for (Slot& s : it.slots) {
    if (!s.key.empty() || !s.held.defined() || in_place(s.held)) {
      continue;
    }
    if (s.kind == kValues) {
      home = s.held;
    }
    s.held = host_copy(s.held);
  }
  return home;
}

// After the pass: the stepped values of `it` copied back where stage() found them, and the
// slots' references dropped, so that host copies live one parameter at a time.
void unstage(Streamed& it, const torch::Tensor& home) {
  for (Slot& s : it.slots) {
    if (s.kind == kValues && home.defined()) {
      home.copy_(s.held);
    }
    if (s.key.empty()) {
      s.held = torch::Tensor();
    }
  }
}

// Copies `held` (state loaded into memory, which moves into the store) into `dst`: from a host
// copy when it is on a device or strided (a checkpoint loaded onto a GPU's parameters).
void copy_held(const torch::Tensor& held, void* dst) {
  const torch::Tensor src = in_place(held) ? held : held.to(torch::kCPU).contiguous();
  std::memcpy(dst, src.data_ptr(), static_cast<size_t>(src.nbytes()));
}

// The Adam pass over `items` with their blocks in `store`: parameter i is stepped in one of two
// buffer sets while parameter i+1's blocks are read into the other (prefetch) and i-1's written
// from it (write-behind; the store's one I/O thread runs them in the order queued, so i-1's
// writes end before i+1's reads land in the same buffers).
void stream_adam(std::vector<Streamed>& items, OffloadStore& store) {
  int64_t largest = 0;
  for (const auto& it : items) {
    largest = std::max(largest, it.numel);
  }
  std::vector<std::vector<torch::Tensor>> buffers(2, std::vector<torch::Tensor>(kSlotKinds));
  std::vector<std::shared_future<void>> queued;     // every read and write, waited on at the end
  std::vector<std::shared_future<void>> writes[2];  // each buffer set's writes in flight
  auto fetch = [&](size_t i) {
    std::vector<std::shared_future<void>> reads;
    for (const Slot& s : items[i].slots) {
      if (s.key.empty()) {
        continue;
      }
      torch::Tensor& buffer = buffers[i % 2][s.kind];
      if (!buffer.defined()) {
        buffer = OffloadStore::buffer(largest, torch::kFloat);
      }
      if (s.held.defined() && s.held.numel() == items[i].numel) {
        // Copied here, not on the I/O thread: the writes of parameter i-2 from this buffer set
        // must have taken their bytes first.
        for (const auto& w : writes[i % 2]) {
          store.wait(w);
        }
        writes[i % 2].clear();
        copy_held(s.held, buffer.data_ptr());
      } else {
        reads.push_back(store.read(s.key, buffer.data_ptr()));
        queued.push_back(reads.back());
      }
    }
    return reads;
  };
  try {
    std::vector<std::shared_future<void>> next;
    if (!items.empty()) {
      next = fetch(0);
    }
    for (size_t i = 0; i < items.size(); ++i) {
      for (const auto& r : next) {
        store.wait(r);
      }
      next = i + 1 < items.size() ? fetch(i + 1) : std::vector<std::shared_future<void>>{};
      Streamed& it = items[i];
      const torch::Tensor home = stage(it);
      for (const Slot& s : it.slots) {
        slot_pointer(it.args, s.kind) =
            s.key.empty() ? s.held.data_ptr<float>() : buffers[i % 2][s.kind].data_ptr<float>();
      }
      run_chunks(std::vector<detail::AdamArgs>{it.args}, {it.numel}, detail::kernels().adam);
      unstage(it, home);
      writes[i % 2].clear();  // those of parameter i-2, done: its reads came after them
      for (const Slot& s : it.slots) {
        if (!s.key.empty() && s.write_back) {
          queued.push_back(store.write(s.key, buffers[i % 2][s.kind].data_ptr()));
          writes[i % 2].push_back(queued.back());
        }
      }
    }
  } catch (...) {
    for (const auto& q : queued) {
      q.wait();  // the I/O thread must be done with the buffers before they are freed
    }
    throw;
  }
  for (const auto& q : queued) {
    store.wait(q);  // a write's error is the step's
  }
}

// The moments' slots of `st`, every one a block of the store; a state new to this step reads
// zeros (its blocks are discarded: what an earlier state left there is not this one's).
template <typename AdamState>
void moment_slots(AdamState& st,
                  bool amsgrad,
                  bool fresh,
                  const std::function<std::string(const char*)>& key,
                  OffloadStore& store,
                  int64_t numel,
                  std::vector<Slot>& slots) {
  if (amsgrad && !st.max_exp_avg_sq().defined()) {
    st.max_exp_avg_sq(torch::empty({0}));
    store.discard(key("max_exp_avg_sq"));
  }
  const std::pair<SlotKind, const char*> moments[] = {
      {kExpAvg, "exp_avg"}, {kExpAvgSq, "exp_avg_sq"}, {kMaxExpAvgSq, "max_exp_avg_sq"}};
  const torch::Tensor held[] = {st.exp_avg(), st.exp_avg_sq(), st.max_exp_avg_sq()};
  for (size_t k = 0; k < (amsgrad ? 3u : 2u); ++k) {
    const std::string name = key(moments[k].second);
    store.reserve(name, numel * 4);
    if (fresh) {
      store.discard(name);
    }
    slots.push_back({moments[k].first, name, held[k], true});
  }
}

// A parameter's item of the offloaded pass, its state made on its first step; nullopt without a
// gradient. `used_gradient` gets the block of a gradient read from the store.
template <typename Options, typename AdamState, typename Map>
std::optional<Streamed> offload_item(
    const Options& o,
    Map& state,
    const torch::Tensor& p,
    bool decoupled,
    const torch::Tensor& copy,
    const std::function<std::string(const torch::Tensor&, const char*)>& key,
    OffloadStore& store,
    std::string& used_gradient) {
  const std::string grad_key = store.bound(p, "grad");
  const bool stored_grad = !grad_key.empty() && store.written(grad_key);
  if (!p.grad().defined() && !stored_grad) {
    return std::nullopt;
  }
  auto sk = detail::state_key(state, p);
  const bool fresh = !state.count(sk);
  if (fresh) {
    auto st = std::make_unique<AdamState>();
    st->step(0);
    st->exp_avg(torch::empty({0}));
    st->exp_avg_sq(torch::empty({0}));
    state[sk] = std::move(st);
  }
  auto& st = static_cast<AdamState&>(*state[sk]);
  Streamed it;
  it.numel = p.numel();
  moment_slots(
      st, o.amsgrad(), fresh, [&](const char* name) { return key(p, name); }, store, it.numel,
      it.slots);
  const std::string values_key = store.bound(p, "param");
  TORCH_CHECK(!values_key.empty() || p.storage().data() != nullptr,
              "fused optimizer: a parameter of shape ", p.sizes(),
              " has no memory and no block in this optimizer's store: its values are in another "
              "store (give the optimizer the store FSDP offloads into)");
  it.slots.push_back({kValues, values_key, values_key.empty() ? p : torch::Tensor(), true});
  if (stored_grad && !p.grad().defined()) {
    it.slots.push_back({kGradient, grad_key, {}, false});
    used_gradient = grad_key;
  } else {
    it.slots.push_back({kGradient, "", p.grad(), false});
  }
  it.args = adam_args(o, st, p, decoupled, copy);
  return it;
}

// After a parameter's step: its moments are in the store.
template <typename AdamState>
void moments_offloaded(AdamState& st) {
  st.exp_avg(torch::empty({0}));
  st.exp_avg_sq(torch::empty({0}));
  if (st.max_exp_avg_sq().defined()) {
    st.max_exp_avg_sq(torch::empty({0}));
  }
}

// The offloaded Adam or AdamW pass: every parameter with a gradient, in memory or bound in the
// store (FSDP's offloaded gradients), its moments in the store, and its values and gradient
// where FSDP put them, but those in `done` (stepped already, in backward). The gradients read
// from the store are used up, as zero_grad would.
template <typename Options, typename AdamState, typename Map>
void adam_offload_pass(std::vector<torch::optim::OptimizerParamGroup>& groups,
                       Map& state,
                       bool decoupled,
                       const std::function<torch::Tensor(const torch::Tensor&)>& copy_of,
                       const std::function<std::string(const torch::Tensor&, const char*)>& key,
                       OffloadStore& store,
                       const std::unordered_set<const c10::TensorImpl*>& done) {
  std::vector<Streamed> items;
  std::vector<torch::Tensor> written;
  std::vector<std::string> used_gradients;
  for (auto& group : groups) {
    const auto& o = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (done.count(p.unsafeGetTensorImpl())) {
        continue;
      }
      std::string used;
      const torch::Tensor copy = copy_of(p);
      auto it = offload_item<Options, AdamState>(o, state, p, decoupled, copy, key, store, used);
      if (!it) {
        continue;
      }
      items.push_back(std::move(*it));
      written.insert(written.end(), {p, copy});
      if (!used.empty()) {
        used_gradients.push_back(used);
      }
    }
  }
  stream_adam(items, store);
  for (size_t i = 0; i < written.size(); i += 2) {
    moments_offloaded(static_cast<AdamState&>(*state.at(detail::state_key(state, written[i]))));
  }
  for (const std::string& g : used_gradients) {
    store.discard(g);
  }
  bump_versions(written);
}

}  // namespace

namespace detail {

// Buffers and the I/O queued on them, kept until it is done.
struct IoBatch {
  std::vector<torch::Tensor> buffers = std::vector<torch::Tensor>(kSlotKinds);
  std::unordered_set<int> loaded;  // the slot kinds read (or queued) into the buffers
  std::vector<std::shared_future<void>> io;
};

struct InBackward {
  std::unordered_map<const c10::TensorImpl*, IoBatch> prefetched;  // reads queued ahead
  std::vector<IoBatch> in_flight;                                  // writes behind
  std::unordered_set<const c10::TensorImpl*> stepped;
  std::vector<torch::Tensor> order;                                // this round's
  std::unordered_map<const c10::TensorImpl*, torch::Tensor> next;  // the last round's successor
  ~InBackward() {
    // The I/O thread may still use the buffers: never free them under it.
    for (auto* batches : {&in_flight}) {
      for (auto& b : *batches) {
        for (auto& f : b.io) {
          f.wait();
        }
      }
    }
    for (auto& kv : prefetched) {
      for (auto& f : kv.second.io) {
        f.wait();
      }
    }
  }
};

}  // namespace detail

namespace {

// A buffer of slot `kind` in `batch` with room for `numel` floats.
float* batch_buffer(detail::IoBatch& batch, SlotKind kind, int64_t numel) {
  torch::Tensor& b = batch.buffers[kind];
  if (!b.defined() || b.numel() < numel) {
    b = OffloadStore::buffer(numel, torch::kFloat);
  }
  return b.data_ptr<float>();
}

// Reads into `batch` the blocks of `it` it does not hold yet (state held in memory is copied in),
// waits for them, and points the item's arguments at the buffers.
void load_item(Streamed& it, detail::IoBatch& batch, OffloadStore& store) {
  for (const Slot& s : it.slots) {
    if (s.key.empty() || batch.loaded.count(s.kind)) {
      continue;
    }
    float* dst = batch_buffer(batch, s.kind, it.numel);
    if (s.held.defined() && s.held.numel() == it.numel) {
      copy_held(s.held, dst);
    } else {
      batch.io.push_back(store.read(s.key, dst));
    }
    batch.loaded.insert(s.kind);
  }
  for (const auto& f : batch.io) {
    store.wait(f);
  }
  batch.io.clear();
  for (const Slot& s : it.slots) {
    slot_pointer(it.args, s.kind) =
        s.key.empty() ? s.held.data_ptr<float>() : batch.buffers[s.kind].data_ptr<float>();
  }
}

// Queues the reads of `q`'s moments and values, when its state is in the store: what its
// step_parameter will read first. Its gradient is not ready yet.
template <typename AdamState, typename Map>
void prefetch_parameter(const torch::Tensor& q,
                        Map& state,
                        const std::function<std::string(const torch::Tensor&, const char*)>& key,
                        OffloadStore& store,
                        detail::InBackward& ib) {
  const auto it = state.find(detail::state_key(state, q));
  if (it == state.end() || ib.stepped.count(q.unsafeGetTensorImpl()) ||
      ib.prefetched.count(q.unsafeGetTensorImpl())) {
    return;
  }
  auto& st = static_cast<AdamState&>(*it->second);
  if (!offloaded(st.exp_avg(), q)) {
    return;  // in memory (loaded from a checkpoint): copied when it steps
  }
  detail::IoBatch batch;
  std::vector<std::pair<SlotKind, std::string>> blocks = {{kExpAvg, key(q, "exp_avg")},
                                                          {kExpAvgSq, key(q, "exp_avg_sq")}};
  if (st.max_exp_avg_sq().defined()) {
    blocks.emplace_back(kMaxExpAvgSq, key(q, "max_exp_avg_sq"));
  }
  if (!store.bound(q, "param").empty()) {
    blocks.emplace_back(kValues, store.bound(q, "param"));
  }
  for (const auto& [kind, name] : blocks) {
    batch.io.push_back(store.read(name, batch_buffer(batch, kind, q.numel())));
    batch.loaded.insert(kind);
  }
  ib.prefetched.emplace(q.unsafeGetTensorImpl(), std::move(batch));
}

// step_parameter of FusedAdam and FusedAdamW.
template <typename Options, typename AdamState, typename Map>
void adam_step_parameter(std::vector<torch::optim::OptimizerParamGroup>& groups,
                         Map& state,
                         bool decoupled,
                         const torch::Tensor& copy,
                         const std::function<std::string(const torch::Tensor&, const char*)>& key,
                         OffloadStore& store,
                         detail::InBackward& ib,
                         const torch::Tensor& p) {
  const Options* o = nullptr;
  for (auto& group : groups) {
    for (auto& q : group.params()) {
      o = q.is_same(p) ? &static_cast<const Options&>(group.options()) : o;
    }
  }
  TORCH_CHECK(o != nullptr, "fused optimizer: step_parameter names a parameter of shape ",
              p.sizes(), " this optimizer does not step");
  TORCH_CHECK(store.bound(p, "grad").empty(),
              "fused optimizer: step_parameter takes the gradient in memory, and this parameter's "
              "gradients are offloaded (step() reads those)");
  TORCH_CHECK(!ib.stepped.count(p.unsafeGetTensorImpl()),
              "fused optimizer: step_parameter stepped a parameter of shape ", p.sizes(),
              " twice before step()");
  std::string why = store.bound(p, "param").empty() ? unfusable(p, p, "the values", true) : "";
  why = why.empty() && p.grad().defined() ? unfusable(p.grad(), p, "a gradient", true) : why;
  const auto held = state.find(detail::state_key(state, p));
  if (why.empty() && p.grad().defined() && held != state.end() &&
      !adam_state_fusable<AdamState>(*held->second, p, /*anywhere=*/true)) {
    why = "a parameter of shape " + c10::str(p.sizes()) +
          " has optimizer state that is not an fp32 tensor of its size";
  }
  TORCH_CHECK(why.empty(), "fused optimizer: step_parameter: ", why);
  std::string used;
  auto it = offload_item<Options, AdamState>(*o, state, p, decoupled, copy, key, store, used);
  if (!it) {
    return;  // no gradient
  }
  detail::IoBatch batch;
  auto ahead = ib.prefetched.find(p.unsafeGetTensorImpl());
  if (ahead != ib.prefetched.end()) {
    batch = std::move(ahead->second);
    ib.prefetched.erase(ahead);
  }
  const torch::Tensor home = stage(*it);
  load_item(*it, batch, store);
  run_chunks(std::vector<detail::AdamArgs>{it->args}, {it->numel}, detail::kernels().adam);
  unstage(*it, home);
  moments_offloaded(static_cast<AdamState&>(*state.at(detail::state_key(state, p))));
  bump_versions({p, copy});
  for (const Slot& s : it->slots) {
    if (!s.key.empty() && s.write_back) {
      batch.io.push_back(store.write(s.key, batch.buffers[s.kind].data_ptr()));
    }
  }
  ib.in_flight.push_back(std::move(batch));
  ib.stepped.insert(p.unsafeGetTensorImpl());
  ib.order.push_back(p);
  // The batches whose writes are done give their buffers back.
  auto done = [&store](detail::IoBatch& b) {
    for (auto& f : b.io) {
      if (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
        return false;
      }
      store.wait(f);  // its error, if any
    }
    return true;
  };
  ib.in_flight.erase(std::remove_if(ib.in_flight.begin(), ib.in_flight.end(), done),
                     ib.in_flight.end());
  // A disk slower than backward: wait for the oldest writes rather than hold every unit's state.
  while (ib.in_flight.size() > 2) {
    for (auto& f : ib.in_flight.front().io) {
      store.wait(f);
    }
    ib.in_flight.erase(ib.in_flight.begin());
  }
  const auto next = ib.next.find(p.unsafeGetTensorImpl());
  if (next != ib.next.end()) {
    prefetch_parameter<AdamState>(next->second, state, key, store, ib);
  }
}

// After step(): every write of the parameters stepped one by one waited for, the reads queued
// for parameters step() stepped itself dropped, and the order learned for the next prefetches.
void finish_in_backward(detail::InBackward& ib, OffloadStore& store) {
  for (auto& b : ib.in_flight) {
    for (auto& f : b.io) {
      store.wait(f);
    }
  }
  ib.in_flight.clear();
  for (auto& kv : ib.prefetched) {
    for (auto& f : kv.second.io) {
      f.wait();
    }
  }
  ib.prefetched.clear();
  ib.next.clear();
  for (size_t i = 0; i + 1 < ib.order.size(); ++i) {
    ib.next[ib.order[i].unsafeGetTensorImpl()] = ib.order[i + 1];
  }
  ib.order.clear();
  ib.stepped.clear();
}

// One SGD pass over every parameter with a gradient.
template <typename Map>
void sgd_pass(std::vector<torch::optim::OptimizerParamGroup>& groups,
              Map& state,
              const std::function<torch::Tensor(const torch::Tensor&)>& copy_of) {
  std::vector<detail::SgdArgs> args;
  std::vector<int64_t> sizes;
  std::vector<torch::Tensor> written;
  for (auto& group : groups) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) {
        continue;
      }
      detail::SgdArgs a;
      a.param = p.data_ptr<float>();
      a.grad = p.grad().data_ptr<float>();
      if (o.momentum() != 0) {
        const auto key = detail::state_key(state, p);
        auto it = state.find(key);
        if (it == state.end()) {
          auto st = std::make_unique<torch::optim::SGDParamState>();
          st->momentum_buffer(torch::empty_like(p, at::MemoryFormat::Preserve));
          state[key] = std::move(st);
          it = state.find(key);
          a.first = true;  // the buffer takes the gradient as it is
        }
        auto& st = static_cast<torch::optim::SGDParamState&>(*it->second);
        if (!st.momentum_buffer().defined()) {  // a state without one: a first step
          st.momentum_buffer(torch::empty_like(p, at::MemoryFormat::Preserve));
          a.first = true;
        }
        a.momentum_buffer = st.momentum_buffer().data_ptr<float>();
        written.push_back(st.momentum_buffer());
      }
      const torch::Tensor copy = copy_of(p);
      a.copy = copy_bits(copy);
      a.copy_kind = copy_kind(copy);
      a.nesterov = o.nesterov();
      a.momentum = static_cast<float>(o.momentum());
      a.one_minus_dampening = static_cast<float>(1 - o.dampening());
      a.weight_decay = static_cast<float>(o.weight_decay());
      a.neg_lr = static_cast<float>(-o.lr());
      args.push_back(a);
      sizes.push_back(p.numel());
      written.insert(written.end(), {p, copy});
    }
  }
  run_chunks(args, sizes, detail::kernels().sgd);
  bump_versions(written);
}

// The closure's loss, computed with gradients on, as libtorch's steps do.
torch::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) {
    return {};
  }
  at::AutoGradMode enable_grad(true);
  return closure();
}

// The pass of FusedAdam's and FusedAdamW's step: in memory, or streamed through the store (the
// parameters step_parameter stepped since the last step() left out, then its round finished).
template <typename Options, typename AdamState, typename Map>
void adam_step_pass(std::vector<torch::optim::OptimizerParamGroup>& groups,
                    Map& state,
                    bool decoupled,
                    const std::function<torch::Tensor(const torch::Tensor&)>& copy,
                    const std::function<std::string(const torch::Tensor&, const char*)>& key,
                    OffloadStore* store,
                    detail::InBackward* ib) {
  if (store == nullptr) {
    adam_pass<Options, AdamState>(groups, state, decoupled, copy);
    return;
  }
  static const std::unordered_set<const c10::TensorImpl*> none;
  adam_offload_pass<Options, AdamState>(groups, state, decoupled, copy, key, *store,
                                        ib != nullptr ? ib->stepped : none);
  if (ib != nullptr) {
    finish_in_backward(*ib, *store);
  }
}

}  // namespace

std::string fused_isa() {
  return detail::kernels().isa;
}

void FusedOptimizer::write_copy(const torch::Tensor& param, torch::Tensor copy) {
  TORCH_CHECK(fusable(param, param),
              "fused optimizer: write_copy takes a contiguous fp32 CPU parameter (got ",
              param.defined() ? param.toString() : "an undefined tensor", ")");
  TORCH_CHECK(copy_fits(param, copy),
              "fused optimizer: a copy must be a contiguous bf16 or fp16 CPU tensor of its "
              "parameter's shape ",
              param.sizes(), " (got ", copy.defined() ? copy.toString() : "undefined", " ",
              copy.defined() ? copy.sizes() : c10::IntArrayRef{}, ")");
  // A parameter of another optimizer would never be stepped here, and its copy never written.
  TORCH_CHECK(steps(param), "fused optimizer: write_copy names a parameter ", param.sizes(),
              " this optimizer does not step");
  copies_[param.unsafeGetTensorImpl()] = {param, std::move(copy)};
}

bool FusedOptimizer::can_write_copy(const torch::Tensor& param, const torch::Tensor& copy) const {
  return fusable(param, param) && copy_fits(param, copy) && steps(param);
}

bool FusedOptimizer::writes_copy(const torch::Tensor& param) const {
  return copies_.count(param.unsafeGetTensorImpl()) > 0;
}

bool FusedOptimizer::steps(const torch::Tensor& param) const {
  const auto* self = dynamic_cast<const torch::optim::Optimizer*>(this);
  for (size_t g = 0; self != nullptr && g < self->param_groups().size(); ++g) {
    for (const auto& p : self->param_groups()[g].params()) {
      if (p.is_same(param)) {
        return true;
      }
    }
  }
  return false;
}

void FusedOptimizer::drop_stale_copies() {
  for (auto it = copies_.begin(); it != copies_.end();) {
    const torch::Tensor& param = it->second.first;
    const torch::Tensor& copy = it->second.second;
    const bool fits = fusable(param, param) && copy_fits(param, copy);
    if (fits) {
      ++it;
      continue;
    }
    std::cerr << "paratrain: warning: fused optimizer: the copy of a parameter of shape "
              << param.sizes() << " no longer fits it (now "
              << (copy.defined() ? copy.toString() : std::string("undefined"))
              << "); the step no longer writes it" << std::endl;
    it = copies_.erase(it);
  }
}

torch::Tensor FusedOptimizer::copy_of(const torch::Tensor& param) const {
  const auto it = copies_.find(param.unsafeGetTensorImpl());
  return it == copies_.end() ? torch::Tensor() : it->second.second;
}

torch::Tensor FusedOptimizer::run_step(const std::function<torch::Tensor()>& closure,
                                       const std::function<std::string()>& unfit,
                                       const std::function<void()>& fallback,
                                       const std::function<void()>& pass) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss = run_closure(closure);
  drop_stale_copies();
  const std::string why = unfit();
  TORCH_CHECK(why.empty() || store_ == nullptr, "fused optimizer: ", why,
              "; with its state offloaded every step must be the fused pass (libtorch's step "
              "needs the moments in memory)");
  last_fused_ = why.empty();
  if (last_fused_) {
    pass();
    return loss;
  }
  if (!warned_) {
    // Said once per optimizer: PyTorch's fused=True refuses such parameters; here the step is
    // libtorch's, which is correct but not one pass.
    std::cerr << "paratrain: warning: fused optimizer: " << why
              << "; its steps are libtorch's (several passes) until every parameter suits the pass"
              << std::endl;
    warned_ = true;
  }
  fallback();
  copy_after_fallback();
  return loss;
}

void FusedOptimizer::copy_after_fallback() {
  torch::NoGradGuard no_grad;
  for (auto& kv : copies_) {
    kv.second.second.copy_(kv.second.first);
  }
}

uint64_t FusedOptimizer::next_id() {
  static std::atomic<uint64_t> next{0};
  return next++;
}

std::string FusedOptimizer::offload_key(const torch::Tensor& param, const std::string& name) const {
  const auto* self = dynamic_cast<const torch::optim::Optimizer*>(this);
  for (size_t g = 0; self != nullptr && g < self->param_groups().size(); ++g) {
    const auto& params = self->param_groups()[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].is_same(param)) {
        return "optimizer" + std::to_string(id_) + "." + std::to_string(g) + "." +
               std::to_string(i) + "." + name;
      }
    }
  }
  TORCH_CHECK(false, "fused optimizer: a parameter of shape ", param.sizes(),
              " is not one this optimizer steps");
}

torch::Tensor FusedOptimizer::state_tensor(const torch::Tensor& param,
                                           const std::string& name,
                                           const torch::Tensor& held) {
  if (!offloaded(held, param)) {
    return held;
  }
  TORCH_CHECK(store_ != nullptr, "fused optimizer: state '", name, "' of a parameter of shape ",
              param.sizes(), " is empty and no store holds it");
  torch::Tensor values = OffloadStore::buffer(param.numel(), torch::kFloat);
  const std::string key = offload_key(param, name);
  if (store_->has(key)) {
    store_->wait(store_->read(key, values.data_ptr()));
  } else {
    values.zero_();
  }
  return values.view(param.sizes());
}

namespace {

// Every offloaded moment of `st` read back into the state object, on device `to`: the parameter's
// when the state stays in memory (libtorch's step may take over there), the host's when it moves
// to another store (a GPU need never hold it).
template <typename AdamState>
void bring_back(torch::optim::OptimizerParamState& s,
                const torch::Tensor& p,
                FusedOptimizer& fused,
                const torch::Device& to) {
  auto& st = static_cast<AdamState&>(s);
  auto back = [&](const char* name, const torch::Tensor& held) {
    return fused.state_tensor(p, name, held).to(to);
  };
  st.exp_avg(back("exp_avg", st.exp_avg()));
  st.exp_avg_sq(back("exp_avg_sq", st.exp_avg_sq()));
  if (st.max_exp_avg_sq().defined()) {
    st.max_exp_avg_sq(back("max_exp_avg_sq", st.max_exp_avg_sq()));
  }
}

}  // namespace

detail::InBackward& FusedOptimizer::begin_step_parameter() {
  TORCH_CHECK(store_ != nullptr,
              "fused optimizer: step_parameter streams offloaded moments: offload(store) first");
  drop_stale_copies();
  if (!in_backward_) {
    in_backward_ = std::make_shared<detail::InBackward>();
  }
  return *in_backward_;
}

void FusedOptimizer::step_parameter(const torch::Tensor& param) {
  TORCH_CHECK(false, "fused optimizer: step_parameter takes FusedAdam and FusedAdamW (a parameter ",
              param.sizes(), ")");
}

void FusedOptimizer::offload(std::shared_ptr<OffloadStore> store) {
  TORCH_CHECK(in_backward_ == nullptr || in_backward_->stepped.empty(),
              "fused optimizer: offload() between step_parameter and step(); call step() first");
  in_backward_.reset();  // the order it learned reads from the store it had
  TORCH_CHECK(store == nullptr || offloadable(),
              "fused optimizer: offload keeps the moments of Adam and AdamW; SGD's momentum "
              "stays in memory (use FusedAdam or FusedAdamW to offload)");
  auto* self = dynamic_cast<torch::optim::Optimizer*>(this);
  if (store_ != nullptr && store != store_ && self != nullptr) {
    auto& state = self->state();
    const bool decoupled = dynamic_cast<torch::optim::AdamW*>(self) != nullptr;
    for (auto& group : self->param_groups()) {
      for (auto& p : group.params()) {
        auto it = state.find(detail::state_key(state, p));
        if (it == state.end()) {
          continue;
        }
        const torch::Device to = store == nullptr ? p.device() : torch::Device(torch::kCPU);
        if (decoupled) {
          bring_back<torch::optim::AdamWParamState>(*it->second, p, *this, to);
        } else {
          bring_back<torch::optim::AdamParamState>(*it->second, p, *this, to);
        }
      }
    }
  }
  store_ = std::move(store);
  // The moments' disk space now, not at the first step: a disk too small fails before training.
  for (size_t g = 0; store_ != nullptr && self != nullptr && g < self->param_groups().size(); ++g) {
    for (const auto& p : self->param_groups()[g].params()) {
      for (const char* name : {"exp_avg", "exp_avg_sq"}) {
        store_->reserve(offload_key(p, name), p.numel() * 4);
      }
    }
  }
}

torch::Tensor FusedAdam::step(LossClosure closure) {
  return run_step(
      closure,
      [this] {
        return all_fusable(param_groups_, state_, adam_state_fusable<torch::optim::AdamParamState>,
                           store_ != nullptr);
      },
      [this] { torch::optim::Adam::step(nullptr); },
      [this] {
        adam_step_pass<torch::optim::AdamOptions, torch::optim::AdamParamState>(
            param_groups_, state_, false, [this](const torch::Tensor& p) { return copy_of(p); },
            [this](const torch::Tensor& p, const char* name) { return offload_key(p, name); },
            store_.get(), in_backward_.get());
      });
}

void FusedAdam::step_parameter(const torch::Tensor& param) {
  torch::NoGradGuard no_grad;
  detail::InBackward& round = begin_step_parameter();
  adam_step_parameter<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      param_groups_, state_, false, copy_of(param),
      [this](const torch::Tensor& p, const char* name) { return offload_key(p, name); }, *store_,
      round, param);
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  return run_step(
      closure,
      [this] {
        return all_fusable(param_groups_, state_, adam_state_fusable<torch::optim::AdamWParamState>,
                           store_ != nullptr);
      },
      [this] { torch::optim::AdamW::step(nullptr); },
      [this] {
        adam_step_pass<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
            param_groups_, state_, true, [this](const torch::Tensor& p) { return copy_of(p); },
            [this](const torch::Tensor& p, const char* name) { return offload_key(p, name); },
            store_.get(), in_backward_.get());
      });
}

void FusedAdamW::step_parameter(const torch::Tensor& param) {
  torch::NoGradGuard no_grad;
  detail::InBackward& round = begin_step_parameter();
  adam_step_parameter<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      param_groups_, state_, true, copy_of(param),
      [this](const torch::Tensor& p, const char* name) { return offload_key(p, name); }, *store_,
      round, param);
}

torch::Tensor FusedSGD::step(LossClosure closure) {
  return run_step(
      closure,
      [this] {
        return all_fusable(
            param_groups_, state_,
            [](const torch::optim::OptimizerParamState& s, const torch::Tensor& p, bool) {
              const auto& st = static_cast<const torch::optim::SGDParamState&>(s);
              return !st.momentum_buffer().defined() || fusable(st.momentum_buffer(), p);
            });
      },
      [this] { torch::optim::SGD::step(nullptr); },
      [this] {
        sgd_pass(param_groups_, state_, [this](const torch::Tensor& p) { return copy_of(p); });
      });
}

}  // namespace optim
}  // namespace paratrain

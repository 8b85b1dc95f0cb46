#pragma once

// Internal: a paratrain ProcessGroup over one of c10d's backends (ProcessGroupGloo, and
// ProcessGroupNCCL in CUDA builds). c10d does the transport; this adds what paratrain promises on
// top: avg and reduce_scatter where the engine lacks them, a deadline on every wait (Gloo would
// wait on a send or recv forever), errors that name the operation and the missing ranks (Note
// [Naming the ranks that did not arrive]), and a group that fails fast once broken.
//
// The engine is held by its concrete type: in libtorch 1.13 it derives from c10d::ProcessGroup, in
// 2.x from c10d::Backend, but the collective signatures used here are the same in both. What
// differs between engines is said by a traits struct (gloo.cpp, nccl.cpp):
//
//   struct XTraits {
//     using Engine = c10d::ProcessGroupX;
//     static constexpr const char* kName = "x";
//     static constexpr bool kWidenBFloat16 = ...;  // the engine reduces no bf16: send fp32/fp16
//     static constexpr bool kCudaOnly = ...;       // the engine moves CUDA tensors only
//     static constexpr bool kNativeReduceScatter = ...;  // the engine has reduce_scatter
//     static constexpr bool kExchangeAllgather = ...;  // CPU allgathers as sends and receives
//     static constexpr bool kBitwiseOps = ...;  // the engine has band, bor and bxor
//     static void shutdown(Engine&, bool broken);                // called once, before the engine
//     is released
//   };

#include "backends.h"
#include "composite_work.h"
#include "store_monitor.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace paratrain {
namespace dist {
namespace detail {

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // Gloo has no avg: sum, then divide when the work completes.
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case ReduceOp::kProduct:
      return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
    case ReduceOp::kBand:
      return c10d::ReduceOp(c10d::ReduceOp::BAND);
    case ReduceOp::kBor:
      return c10d::ReduceOp(c10d::ReduceOp::BOR);
    case ReduceOp::kBxor:
      return c10d::ReduceOp(c10d::ReduceOp::BXOR);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

// Point-to-point messages use the engine's tags below this; collectives built from sends and
// receives (exchange_allgather, exchange_reduce_scatter) use the ones from here on, numbered by
// the collective.
constexpr int kInternalTagBase = ProcessGroup::kMaxUserTag;

inline int internal_tag(int64_t seq) {
  return kInternalTagBase + static_cast<int>(seq % kInternalTagBase);
}

// output = the pieces combined by `op`, in rank order (avg: their sum over their count).
inline void combine_pieces(at::Tensor& output, const std::vector<at::Tensor>& pieces, ReduceOp op) {
  const bool narrow = output.scalar_type() == at::kHalf || output.scalar_type() == at::kBFloat16;
  bool aliased = false;
  for (const auto& piece : pieces) {
    aliased = aliased || output.is_alias_of(piece);
  }
  at::Tensor acc;
  if (narrow) {
    acc = pieces[0].to(at::kFloat);
  } else if (aliased || !output.is_contiguous()) {
    acc = pieces[0].clone(at::MemoryFormat::Contiguous);
  } else {
    acc = output;  // summed in place: no extra buffer
    acc.copy_(pieces[0]);
  }
  for (size_t r = 1; r < pieces.size(); ++r) {
    const at::Tensor& piece = pieces[r];
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc.add_(piece);
        break;
      case ReduceOp::kProduct:
        acc.mul_(piece);
        break;
      case ReduceOp::kMax:
        acc = at::maximum(acc, piece.to(acc.scalar_type()));
        break;
      case ReduceOp::kMin:
        acc = at::minimum(acc, piece.to(acc.scalar_type()));
        break;
      case ReduceOp::kBand:
        acc.bitwise_and_(piece);
        break;
      case ReduceOp::kBor:
        acc.bitwise_or_(piece);
        break;
      case ReduceOp::kBxor:
        acc.bitwise_xor_(piece);
        break;
    }
  }
  if (op == ReduceOp::kAvg) {
    acc.div_(static_cast<double>(pieces.size()));
  }
  if (!acc.is_same(output)) {
    output.copy_(acc.view(output.sizes()));
  }
}

template <typename Traits>
class C10dGroup;

template <typename Traits>
class C10dWork : public Work {
 public:
  C10dWork(std::shared_ptr<C10dGroup<Traits>> group,
           c10::intrusive_ptr<c10d::Work> work,
           std::string op,
           std::string detail,
           int64_t seq,
           bool collective,
           std::function<void()> on_success)
      : group_(std::move(group)),
        work_(std::move(work)),
        op_(std::move(op)),
        detail_(std::move(detail)),
        seq_(seq),
        collective_(collective),
        on_success_(std::move(on_success)) {}

  void wait() override;
  // Completion includes the finishing step (avg's division, copying a bf16 or reduce_scatter
  // result back), so a caller that polls and then reads sees final values.
  bool is_completed() override {
    if (done_ || !error_.empty()) {
      return true;
    }
    if (!work_->isCompleted()) {
      return false;
    }
    try {
      wait();  // does not block now; a failure is kept and rethrown by the caller's wait()
    } catch (const CollectiveError&) {
    }
    return true;
  }

 private:
  std::shared_ptr<C10dGroup<Traits>> group_;  // kept alive while work on it is pending
  c10::intrusive_ptr<c10d::Work> work_;
  std::string op_;
  std::string detail_;
  int64_t seq_;
  bool collective_;
  std::function<void()> on_success_;
  bool done_ = false;
  std::string error_;
};

template <typename Traits>
class C10dGroup : public ProcessGroup, public std::enable_shared_from_this<C10dGroup<Traits>> {
 public:
  using Engine = typename Traits::Engine;

  /// `engine` is the c10d backend already built on `store`.
  C10dGroup(c10::intrusive_ptr<Engine> engine,
            c10::intrusive_ptr<c10d::Store> store,
            StoreClientFactory monitor_client,
            int rank,
            int size,
            std::chrono::milliseconds timeout)
      : ProcessGroup(rank, size, timeout),
        store_(std::move(store)),
        monitor_client_(monitor_client),
        engine_(std::move(engine)) {
    if (size > 1 && monitor_client) {
      monitor_ = std::make_unique<StoreMonitor>(monitor_client, rank, size);
    }
  }

  ~C10dGroup() override {
    try {
      Traits::shutdown(*engine_, is_broken());
    } catch (const std::exception&) {
      // A broken group may fail to shut down; the process is going on without it.
    }
  }

  std::string backend_name() const override { return Traits::kName; }

  /// Builds this backend's group of `size` ranks over a store (new_group's subgroups).
  using Maker = std::function<ProcessGroupPtr(
      c10::intrusive_ptr<c10d::Store>, StoreClientFactory, int rank, int size)>;
  void set_maker(Maker maker) { maker_ = std::move(maker); }

  // Called by C10dWork::wait when c10d reports a failure.
  std::string fail(const std::string& op,
                   const std::string& detail,
                   int64_t seq,
                   bool collective,
                   const std::string& why) {
    std::string message = describe(op, seq, detail) + " failed: " + why;
    if (collective && monitor_) {
      message += monitor_->explain(seq);
    }
    mark_broken(message);
    return message;
  }

 protected:
  WorkPtr do_allreduce(at::Tensor& tensor, ReduceOp op, int64_t seq) override {
    check_device(tensor, "allreduce");
    issued(seq);
    c10d::AllreduceOptions opts;
    opts.reduceOp = engine_op(op);
    opts.timeout = timeout();
    at::Tensor wire = widened(tensor);
    std::vector<at::Tensor> tensors{wire};
    auto work = engine_->allreduce(tensors, opts);
    std::function<void()> finish;
    if (op == ReduceOp::kAvg || !wire.is_same(tensor)) {
      finish = [tensor, wire, op, n = size()]() mutable {
        if (op == ReduceOp::kAvg) {
          wire.div_(n);
        }
        if (!wire.is_same(tensor)) {
          tensor.copy_(wire);
        }
      };
    }
    return wrap(std::move(work), "allreduce", seq, true, std::move(finish),
                std::string(to_string(op)) + ", " + std::to_string(tensor.nbytes()) + " bytes");
  }

  WorkPtr do_broadcast(at::Tensor& tensor, int root, int64_t seq) override {
    check_device(tensor, "broadcast");
    issued(seq);
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeout();
    std::vector<at::Tensor> tensors{as_bits(tensor)};
    return wrap(engine_->broadcast(tensors, opts), "broadcast", seq, true, nullptr,
                "root " + std::to_string(root));
  }

  WorkPtr do_allgather(std::vector<at::Tensor>& outputs,
                       const at::Tensor& input,
                       int64_t seq) override {
    check_device(input, "allgather");
    issued(seq);
    if constexpr (Traits::kExchangeAllgather) {
      if (exchangeable(input, outputs)) {
        return exchange_allgather(outputs, input, seq);
      }
    }
    c10d::AllgatherOptions opts;
    opts.timeout = timeout();
    std::vector<std::vector<at::Tensor>> out(1);
    for (const auto& o : outputs) {
      out[0].push_back(as_bits(o));
    }
    std::vector<at::Tensor> in{as_bits(input)};
    return wrap(engine_->allgather(out, in, opts), "allgather", seq, true, nullptr, "");
  }

  // Gloo has no reduce_scatter (libtorch 1.13's c10d throws "does not support reduce_scatter"):
  // CPU tensors are exchanged over send and recv instead (exchange_reduce_scatter). CUDA tensors
  // on Gloo, which its send and recv do not take, are all-reduced whole and each rank keeps its
  // slice, which moves size() times the data. NCCL has its own.
  WorkPtr do_reduce_scatter(at::Tensor& output,
                            const std::vector<at::Tensor>& inputs,
                            ReduceOp op,
                            int64_t seq) override {
    check_device(output, "reduce_scatter");
    issued(seq);
    if constexpr (Traits::kNativeReduceScatter) {
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = engine_op(op);
      opts.timeout = timeout();
      std::vector<at::Tensor> outputs{output};
      std::vector<std::vector<at::Tensor>> lists{inputs};
      std::function<void()> finish;
      if (op == ReduceOp::kAvg) {
        finish = [output, n = size()]() mutable { output.div_(n); };
      }
      return wrap(engine_->reduce_scatter(outputs, lists, opts), "reduce_scatter", seq, true,
                  std::move(finish), to_string(op));
    } else {
      if (!output.is_cuda()) {
        return exchange_reduce_scatter(output, inputs, op, seq);
      }
      return allreduce_reduce_scatter(output, inputs, op, seq);
    }
  }
  WorkPtr do_reduce(at::Tensor& tensor, int dst, ReduceOp op, int64_t seq) override {
    check_device(tensor, "reduce");
    issued(seq);
    c10d::ReduceOptions opts;
    opts.reduceOp = engine_op(op);
    opts.rootRank = dst;
    opts.timeout = timeout();
    // The others' tensors stay as they were: Gloo and NCCL write partial results into them.
    at::Tensor wire = rank() == dst ? widened(tensor) : widened(tensor).clone();
    std::vector<at::Tensor> tensors{wire};
    auto work = engine_->reduce(tensors, opts);
    std::function<void()> finish;
    if (rank() == dst && (op == ReduceOp::kAvg || !wire.is_same(tensor))) {
      finish = [tensor, wire, op, n = size()]() mutable {
        if (op == ReduceOp::kAvg) {
          wire.div_(n);
        }
        if (!wire.is_same(tensor)) {
          tensor.copy_(wire);
        }
      };
    }
    return wrap(std::move(work), "reduce", seq, true, std::move(finish),
                std::string(to_string(op)) + ", dst " + std::to_string(dst));
  }

  WorkPtr do_gather(std::vector<at::Tensor>& outputs,
                    const at::Tensor& input,
                    int dst,
                    int64_t seq) override {
    check_device(input, "gather");
    issued(seq);
    c10d::GatherOptions opts;
    opts.rootRank = dst;
    opts.timeout = timeout();
    std::vector<std::vector<at::Tensor>> out;
    if (rank() == dst) {
      out.emplace_back();
      for (const auto& o : outputs) {
        out[0].push_back(as_bits(o));
      }
    }
    std::vector<at::Tensor> in{as_bits(input)};
    return wrap(engine_->gather(out, in, opts), "gather", seq, true, nullptr,
                "dst " + std::to_string(dst));
  }

  WorkPtr do_scatter(at::Tensor& output,
                     const std::vector<at::Tensor>& inputs,
                     int src,
                     int64_t seq) override {
    check_device(output, "scatter");
    issued(seq);
    c10d::ScatterOptions opts;
    opts.rootRank = src;
    opts.timeout = timeout();
    std::vector<std::vector<at::Tensor>> in;
    if (rank() == src) {
      in.emplace_back();
      for (const auto& i : inputs) {
        in[0].push_back(as_bits(i));
      }
    }
    std::vector<at::Tensor> out{as_bits(output)};
    return wrap(engine_->scatter(out, in, opts), "scatter", seq, true, nullptr,
                "src " + std::to_string(src));
  }

  WorkPtr do_all_to_all_single(at::Tensor& output,
                               const at::Tensor& input,
                               const std::vector<int64_t>& output_split_sizes,
                               const std::vector<int64_t>& input_split_sizes,
                               int64_t seq) override {
    check_device(input, "all_to_all_single");
    issued(seq);
    c10d::AllToAllOptions opts;
    opts.timeout = timeout();
    at::Tensor out = as_bits(output);
    at::Tensor in = as_bits(input);
    std::vector<int64_t> out_splits = output_split_sizes;
    std::vector<int64_t> in_splits = input_split_sizes;
    return wrap(engine_->alltoall_base(out, in, out_splits, in_splits, opts), "all_to_all_single",
                seq, true, nullptr, std::to_string(input.nbytes()) + " bytes out");
  }

  // Over the job's store, as torch.distributed's monitored_barrier over Gloo's messages: each
  // rank writes that it arrived, rank 0 waits for the keys and then writes its verdict, which the
  // others wait for. Nothing is left in flight when a rank is missing.
  void do_monitored_barrier(std::chrono::milliseconds timeout,
                            bool wait_all_ranks,
                            int64_t seq) override {
    issued(seq);
    const std::string prefix = "paratrain/monitored_barrier/" + std::to_string(seq) + "/";
    const std::string what = describe("monitored_barrier", seq);
    auto fail = [&](const std::string& why) {
      const std::string message = what + " failed: " + why;
      mark_broken(message);
      throw CollectiveError(message);
    };
    try {
      if (rank() != 0) {
        store_->set(prefix + std::to_string(rank()), std::vector<uint8_t>{1});
        store_->wait({prefix + "verdict"}, answer_time(timeout));
        const auto verdict = store_->get(prefix + "verdict");
        if (!verdict.empty() && verdict[0] != 'o') {
          fail(std::string(verdict.begin(), verdict.end()));
        }
        return;
      }
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      std::vector<int> missing;
      for (int r = 1; r < size(); ++r) {
        while (!store_->check({prefix + std::to_string(r)}) &&
               std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (!store_->check({prefix + std::to_string(r)})) {
          missing.push_back(r);
          if (!wait_all_ranks) {
            break;
          }
        }
      }
      if (missing.empty()) {
        store_->set(prefix + "verdict", std::vector<uint8_t>{'o', 'k'});
        return;
      }
      std::string ranks;
      for (int r : missing) {
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      }
      const std::string why = (missing.size() == 1 ? "rank " : "ranks ") + ranks +
                              " did not reach it within " + std::to_string(timeout.count()) + " ms";
      store_->set(prefix + "verdict", std::vector<uint8_t>(why.begin(), why.end()));
      fail(why);
    } catch (const CollectiveError&) {
      throw;
    } catch (const std::exception& e) {  // the store's timeout: rank 0 never gave its verdict
      fail("rank 0 did not let it pass within " + std::to_string(answer_time(timeout).count()) +
           " ms (" + error_message(e) + ")");
    }
  }

  WorkPtr do_barrier(int64_t seq) override {
    issued(seq);
    c10d::BarrierOptions opts;
    opts.timeout = timeout();
    return wrap(engine_->barrier(opts), "barrier", seq, true, nullptr, "");
  }

  // As PyTorch's new_group: the subgroup's engine meets over the job's store, under a prefix of
  // its own, so its rendezvous (and the heartbeat naming missing ranks) sees only its members.
  ProcessGroupPtr do_new_group(const std::vector<int>& ranks,
                               int index,
                               int64_t group_id) override {
    TORCH_CHECK(maker_ != nullptr, Traits::kName,
                " new_group: subgroups are not supported by this backend");
    if (index < 0) {
      return nullptr;
    }
    const std::string prefix = "paratrain/group/" + std::to_string(group_id);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
    StoreClientFactory client;
    if (monitor_client_) {
      client = [f = monitor_client_, prefix]() -> c10::intrusive_ptr<c10d::Store> {
        return c10::make_intrusive<c10d::PrefixStore>(prefix, f());
      };
    }
    auto group = maker_(store, client, index, static_cast<int>(ranks.size()));
    if (auto typed = std::dynamic_pointer_cast<C10dGroup<Traits>>(group)) {
      typed->set_maker(maker_);  // subgroups of subgroups
    }
    return group;
  }

  WorkPtr do_send(const at::Tensor& tensor, int dst, int tag, int64_t seq) override {
    check_device(tensor, "send");
    std::vector<at::Tensor> tensors{tensor};
    return wrap(engine_->send(tensors, dst, tag), "send", seq, false, nullptr,
                "to rank " + std::to_string(dst) + ", tag " + std::to_string(tag));
  }

  WorkPtr do_recv(at::Tensor& tensor, int src, int tag, int64_t seq) override {
    check_device(tensor, "recv");
    std::vector<at::Tensor> tensors{tensor};
    return wrap(engine_->recv(tensors, src, tag), "recv", seq, false, nullptr,
                "from rank " + std::to_string(src) + ", tag " + std::to_string(tag));
  }

 private:
  // NCCL would fail later with "Tensors must be CUDA and dense", naming neither the operation nor
  // the way out.
  void check_device(const at::Tensor& t, const char* op) const {
    TORCH_CHECK(!Traits::kCudaOnly || t.is_cuda(), Traits::kName, " ", op, ": the tensor is on ",
                t.device(), ", but ", Traits::kName,
                " moves CUDA tensors only; use backend 'cpu:gloo,cuda:", Traits::kName,
                "' (what 'auto' gives on a machine with GPUs) to send CPU tensors over gloo");
  }

  c10d::ReduceOp engine_op(ReduceOp op) const {
    const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
    TORCH_CHECK(!bitwise || Traits::kBitwiseOps, Traits::kName, " has no ", to_string(op),
                " reduction (PyTorch's neither); reduce integer tensors over gloo or mpi");
    return to_c10d(op);
  }

  // libtorch 1.13's Gloo reduces no bfloat16 ("Invalid scalar type"): such tensors travel as a
  // float copy, which is exact for the sum of a few bf16 values and rounds once on the way back.
  at::Tensor widened(const at::Tensor& t) const {
    if (Traits::kWidenBFloat16 && t.scalar_type() == at::kBFloat16) {
      return t.to(at::kFloat);
    }
    return t;
  }

  // Moving bf16 without arithmetic: the same bytes viewed as fp16, a 2-byte type Gloo knows.
  at::Tensor as_bits(const at::Tensor& t) const {
    if (Traits::kWidenBFloat16 && t.scalar_type() == at::kBFloat16) {
      return t.view(at::kHalf);
    }
    return t;
  }

  // Rank r sends inputs[p] to each rank p and receives each peer's piece of its own slice, then
  // sums the pieces in rank order. Each rank sends and receives (size()-1)/size() of the data, as
  // in a ring reduce-scatter, but without the ring's size()-1 dependent steps, and the sum's order
  // is the same on every rank. Half and bfloat16 pieces are summed in float and rounded once.
  WorkPtr exchange_reduce_scatter(at::Tensor& output,
                                  const std::vector<at::Tensor>& inputs,
                                  ReduceOp op,
                                  int64_t seq) {
    const int me = rank();
    const int n = size();
    const int tag = internal_tag(seq);
    std::vector<WorkPtr> parts;
    std::vector<at::Tensor> pieces(static_cast<size_t>(n));
    for (int step = 1; step < n; ++step) {
      const int to = (me + step) % n;
      const int from = (me + n - step) % n;
      std::vector<at::Tensor> sent{inputs[static_cast<size_t>(to)].contiguous()};
      parts.push_back(wrap(engine_->send(sent, to, tag), "reduce_scatter", seq, true, nullptr,
                           std::string(to_string(op)) + ", to rank " + std::to_string(to)));
      pieces[static_cast<size_t>(from)] = at::empty_like(output, at::MemoryFormat::Contiguous);
      std::vector<at::Tensor> received{pieces[static_cast<size_t>(from)]};
      parts.push_back(wrap(engine_->recv(received, from, tag), "reduce_scatter", seq, true, nullptr,
                           std::string(to_string(op)) + ", from rank " + std::to_string(from)));
    }
    pieces[static_cast<size_t>(me)] = inputs[static_cast<size_t>(me)];
    auto finish = [output, pieces, op]() mutable {
      combine_pieces(output, pieces, op);
      pieces.clear();
    };
    return std::make_shared<CompositeWork>(std::move(parts), std::move(finish));
  }

  // Gloo's allgather gathers into a flat buffer of its own and copies it out to the outputs: a
  // second copy of the gathered data and a pass over it. CPU tensors are sent straight to each
  // peer instead and received where they belong, with the same volume as the ring.
  // Also not when the input is another rank's output slot: a receive would overwrite it while
  // it is being sent (this rank's own slot is fine).
  bool exchangeable(const at::Tensor& input, const std::vector<at::Tensor>& outputs) const {
    if (input.is_cuda() || !input.is_contiguous()) {
      return false;
    }
    for (size_t r = 0; r < outputs.size(); ++r) {
      const at::Tensor& o = outputs[r];
      if (!o.is_contiguous() || o.is_cuda() ||
          (static_cast<int>(r) != rank() && o.is_alias_of(input))) {
        return false;
      }
    }
    return true;
  }

  WorkPtr exchange_allgather(std::vector<at::Tensor>& outputs,
                             const at::Tensor& input,
                             int64_t seq) {
    const int me = rank();
    const int n = size();
    const int tag = internal_tag(seq);
    std::vector<WorkPtr> parts;
    outputs[static_cast<size_t>(me)].copy_(input);
    for (int step = 1; step < n; ++step) {
      const int to = (me + step) % n;
      const int from = (me + n - step) % n;
      std::vector<at::Tensor> sent{input};
      parts.push_back(wrap(engine_->send(sent, to, tag), "allgather", seq, true, nullptr,
                           "to rank " + std::to_string(to)));
      std::vector<at::Tensor> received{outputs[static_cast<size_t>(from)]};
      parts.push_back(wrap(engine_->recv(received, from, tag), "allgather", seq, true, nullptr,
                           "from rank " + std::to_string(from)));
    }
    return std::make_shared<CompositeWork>(std::move(parts), nullptr);
  }

  WorkPtr allreduce_reduce_scatter(at::Tensor& output,
                                   const std::vector<at::Tensor>& inputs,
                                   ReduceOp op,
                                   int64_t seq) {
    at::Tensor flat = widened(at::cat(inputs).contiguous());
    c10d::AllreduceOptions opts;
    opts.reduceOp = engine_op(op);
    opts.timeout = timeout();
    std::vector<at::Tensor> tensors{flat};
    auto work = engine_->allreduce(tensors, opts);
    auto finish = [output, flat, op, r = rank(), n = size()]() mutable {
      at::Tensor mine = flat.chunk(n)[r].view(output.sizes());
      output.copy_(mine);
      if (op == ReduceOp::kAvg) {
        output.div_(n);
      }
    };
    return wrap(std::move(work), "reduce_scatter", seq, true, std::move(finish), to_string(op));
  }

  void issued(int64_t seq) {
    if (monitor_) {
      monitor_->set_issued(seq + 1);
    }
  }

  WorkPtr wrap(c10::intrusive_ptr<c10d::Work> work,
               const char* op,
               int64_t seq,
               bool collective,
               std::function<void()> finish,
               const std::string& detail) {
    return std::make_shared<C10dWork<Traits>>(this->shared_from_this(), std::move(work), op, detail,
                                              seq, collective, std::move(finish));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  StoreClientFactory monitor_client_;
  Maker maker_;
  std::unique_ptr<StoreMonitor> monitor_;  // before engine_: destroyed after it
  c10::intrusive_ptr<Engine> engine_;
};

template <typename Traits>
void C10dWork<Traits>::wait() {
  if (done_) {
    return;
  }
  if (!error_.empty()) {
    throw CollectiveError(error_);
  }
  std::string why;
  try {
    // c10d's own deadline (the group's timeout) applies inside Gloo; this one also covers
    // send/recv, which Gloo would otherwise wait on forever.
    if (!work_->wait(group_->timeout())) {
      why = "timed out after " + std::to_string(group_->timeout().count()) + " ms";
    }
  } catch (const std::exception& e) {
    why = error_message(e);
    if (why.find("Timed out") != std::string::npos || why.find("timed out") != std::string::npos) {
      why = "timed out after " + std::to_string(group_->timeout().count()) + " ms (" + why + ")";
    }
  }
  if (!why.empty()) {
    error_ = group_->fail(op_, detail_, seq_, collective_, why);
    throw CollectiveError(error_);
  }
  if (on_success_) {
    on_success_();
  }
  done_ = true;
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain

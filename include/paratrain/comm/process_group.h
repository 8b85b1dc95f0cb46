#pragma once

// paratrain's process-group interface: the collectives that DDP, the pipeline and the benchmarks
// need, behind one small contract, with one implementation per engine (gloo, mpi, nccl).
//
// Contract (read before adding a backend):
//  - Every operation is asynchronous: it returns a Work handle at once and the caller waits on it.
//    Operations run in the order they were issued on this group, and every rank must issue the
//    same collectives in the same order (as in c10d, MPI and NCCL).
//  - Tensors passed in must stay alive and untouched until wait() returns; results are written in
//    place (allreduce, broadcast, recv) or into the given outputs (allgather, reduce_scatter).
//  - wait() throws CollectiveError when the operation failed or did not finish within the group's
//    timeout. The message names the operation, its sequence number, this rank and, where the
//    backend can tell, the ranks that did not arrive. A group that threw is broken: later calls
//    fail fast rather than hang.
//  - Argument checks (shapes, roots, peers) happen here, in the non-virtual public methods, so
//    every backend rejects bad input the same way, before any rank starts communicating.
//  - Methods may be called from any thread, but not concurrently on one group.

#include <ATen/ATen.h>
#include <c10/core/DeviceType.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain {
namespace dist {

/// Default collective timeout: 5 minutes. torch.distributed's is 30 (10 on NCCL); paratrain's
/// timeouts name the ranks that did not arrive, so a dead or stuck rank is reported sooner.
constexpr std::chrono::milliseconds kDefaultTimeout{5 * 60 * 1000};

/// torch.distributed.ReduceOp. kAvg needs floating-point tensors; the bitwise ones (kBand, kBor,
/// kBxor) need integer or bool tensors, as in PyTorch, and NCCL has none of them.
enum class ReduceOp { kSum, kAvg, kMax, kMin, kProduct, kBand, kBor, kBxor };

/// "sum", "avg", "max", "min", "product", "band", "bor", "bxor".
const char* to_string(ReduceOp op);

/// One send or receive of batch_isend_irecv (torch.distributed.P2POp).
struct P2POp {
  enum class Kind { kIsend, kIrecv };
  Kind kind;
  at::Tensor tensor;
  int peer;
  int tag = 0;
};

/// A failed or timed-out collective. what() is one line suitable for users.
class CollectiveError : public std::runtime_error {
 public:
  explicit CollectiveError(const std::string& message) : std::runtime_error(message) {}
};

/// Handle to an operation in flight.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until the operation is done. Throws CollectiveError on failure or timeout.
  virtual void wait() = 0;
  /// True once the operation finished (successfully or not); never blocks.
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size, std::chrono::milliseconds timeout);
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// "gloo", "mpi" or "nccl", or the routes of a group over several engines, as PyTorch writes
  /// them: "cpu:gloo,cuda:nccl".
  virtual std::string backend_name() const = 0;

  /// The engine that moves tensors of `type`: backend_name() for a group of one engine, the
  /// route's engine for a routed group ("" when it has none for that device type).
  virtual std::string backend_for(c10::DeviceType type) const {
    (void)type;
    return backend_name();
  }

  /// Whether this group moves tensors of `type` where they are: by the engine backend_for(type)
  /// names, gloo CPU and CUDA tensors, mpi CPU tensors, nccl CUDA tensors. An engine of another
  /// name is taken to move CPU tensors only; a backend that moves others says so by overriding.
  virtual bool moves(c10::DeviceType type) const;

  /// Reduces `tensor` in place over all ranks. kAvg divides the sum by size() and needs a
  /// floating-point tensor.
  WorkPtr allreduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  /// Copies `root`'s tensor into `tensor` on every rank.
  WorkPtr broadcast(at::Tensor& tensor, int root = 0);
  /// outputs[r] receives rank r's `input`; outputs has size() tensors shaped like input.
  WorkPtr allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input);
  /// Reduces inputs[r] over all ranks into rank r's `output`; inputs has size() tensors shaped
  /// like output. Gloo, which has none, sends CPU tensors' pieces to the ranks they belong to and
  /// sums them in rank order (CUDA tensors on Gloo are all-reduced whole).
  WorkPtr reduce_scatter(at::Tensor& output,
                         const std::vector<at::Tensor>& inputs,
                         ReduceOp op = ReduceOp::kSum);
  /// Reduces `tensor` over all ranks into `dst`'s tensor; the others' tensors are left as they
  /// were (PyTorch leaves them unspecified).
  WorkPtr reduce(at::Tensor& tensor, int dst, ReduceOp op = ReduceOp::kSum);
  /// On `dst`, outputs[r] receives rank r's `input` (size() tensors shaped like it); every other
  /// rank passes an empty `outputs`, as torch.distributed.gather's gather_list is None there.
  WorkPtr gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, int dst);
  /// Each rank r receives `src`'s inputs[r] into `output`; `inputs` (size() tensors shaped like
  /// output) is given on `src` only and empty elsewhere.
  WorkPtr scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int src);
  /// outputs[r] receives rank r's inputs[this rank]: size() tensors each, of one dtype; the shapes
  /// may differ from pair to pair (outputs[r] must be shaped as rank r's piece for this rank).
  WorkPtr all_to_all(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs);
  /// `input` split along dim 0 by input_split_sizes goes to the ranks in order; `output`, split by
  /// output_split_sizes, receives each rank's piece. An empty split list means equal pieces
  /// (dim 0 divisible by size()).
  WorkPtr all_to_all_single(at::Tensor& output,
                            const at::Tensor& input,
                            std::vector<int64_t> output_split_sizes = {},
                            std::vector<int64_t> input_split_sizes = {});
  /// allgather into one tensor: `output` holds size() times `input`'s elements, rank r's at
  /// [r * input.numel(), ...) (shaped [size() * d0, ...] or [size(), d0, ...]).
  WorkPtr all_gather_into_tensor(at::Tensor& output, const at::Tensor& input);
  /// reduce_scatter from one tensor: `input` holds size() times `output`'s elements, and rank r
  /// receives the reduction of every rank's r-th slice.
  WorkPtr reduce_scatter_tensor(at::Tensor& output,
                                const at::Tensor& input,
                                ReduceOp op = ReduceOp::kSum);
  /// Completes once every rank has called it.
  WorkPtr barrier();
  /// A barrier that names the ranks that did not reach it within `timeout` (the group's when
  /// zero): rank 0 waits for every other rank, then lets them go. Throws CollectiveError on every
  /// rank that sees the failure; wait_all_ranks names all missing ranks rather than the first.
  /// The group is broken after a failure. Gloo and NCCL groups meet over the job's store, mpi
  /// groups by messages to rank 0. As in PyTorch, a rank 0 later than the others' wait for its
  /// word (twice the timeout) passes alone while they fail.
  void monitored_barrier(std::chrono::milliseconds timeout = std::chrono::milliseconds(0),
                         bool wait_all_ranks = false);
  /// Starts every send and receive of `ops` and returns their handles in order
  /// (torch.distributed.batch_isend_irecv). Every rank of a matching pair must list its side.
  /// Every operation is checked before any starts. On NCCL they are issued one by one, not as
  /// one NCCL group as PyTorch's: list each rank's receives before its sends to the same peer
  /// when the tensors are large.
  std::vector<WorkPtr> batch_isend_irecv(const std::vector<P2POp>& ops);
  /// torch.distributed.broadcast_object_list for one object given as bytes: every rank ends with
  /// `src`'s `bytes`. Blocks until done. Over the group's CPU engine, or through the current GPU
  /// on a group of NCCL alone.
  void broadcast_object(std::string& bytes, int src = 0);
  /// torch.distributed.all_gather_object over bytes: object_list[r] is rank r's `bytes`.
  /// Blocks until done. As broadcast_object, through the current GPU on NCCL alone (the group's
  /// bound device: make_nccl_group sets it).
  void all_gather_object(std::vector<std::string>& object_list, const std::string& bytes);
  /// Point to point; a send matches the recv on `dst` with the same tag, in [0, kMaxUserTag).
  static constexpr int kMaxUserTag = 1 << 30;
  WorkPtr send(const at::Tensor& tensor, int dst, int tag = 0);
  WorkPtr recv(at::Tensor& tensor, int src, int tag = 0);

  /// torch.distributed.new_group: a group of the given ranks of this group, the new group's rank
  /// i being ranks[i]. Every rank of this group calls it with the same list, in the same order
  /// as its other new_group calls (the k-th call of each rank makes the same group); members get
  /// the new group, the others nullptr. Call it while no operation of this group is in flight.
  /// The new group has this group's backend and timeout. Throws c10::Error for an empty list, a
  /// rank out of range or a repeated rank.
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks);

  /// Number of collectives issued on this group so far (the next one gets this number). Every
  /// rank counts the same collectives, which is how a failing rank tells who fell behind; send and
  /// recv are numbered apart, since only two ranks take part in each.
  int64_t sequence_number() const { return sequence_; }

  /// Bytes this rank has sent through this group (not its sub-groups): what a ring moves per
  /// rank, as nccl-tests' bus bandwidth counts them, whatever the engine's own algorithm.
  /// allreduce 2(n-1)/n of the tensor, allgather and all_gather_into_tensor (n-1) times the
  /// input, reduce_scatter and reduce_scatter_tensor (n-1) times the output, broadcast the
  /// tensor on the root, send its tensor; the other operations are not counted.
  int64_t bytes_sent() const { return bytes_sent_.load(); }

 protected:
  // Backends implement these; arguments are already checked and `seq` numbers the operation.
  virtual WorkPtr do_allreduce(at::Tensor& tensor, ReduceOp op, int64_t seq) = 0;
  virtual WorkPtr do_broadcast(at::Tensor& tensor, int root, int64_t seq) = 0;
  virtual WorkPtr do_allgather(std::vector<at::Tensor>& outputs,
                               const at::Tensor& input,
                               int64_t seq) = 0;
  virtual WorkPtr do_reduce_scatter(at::Tensor& output,
                                    const std::vector<at::Tensor>& inputs,
                                    ReduceOp op,
                                    int64_t seq) = 0;
  virtual WorkPtr do_barrier(int64_t seq) = 0;
  virtual WorkPtr do_reduce(at::Tensor& tensor, int dst, ReduceOp op, int64_t seq) = 0;
  /// `outputs` is empty on every rank but `dst`.
  virtual WorkPtr do_gather(std::vector<at::Tensor>& outputs,
                            const at::Tensor& input,
                            int dst,
                            int64_t seq) = 0;
  /// `inputs` is empty on every rank but `src`.
  virtual WorkPtr do_scatter(at::Tensor& output,
                             const std::vector<at::Tensor>& inputs,
                             int src,
                             int64_t seq) = 0;
  /// Split sizes are checked and complete (size() entries each, in rows of dim 0).
  virtual WorkPtr do_all_to_all_single(at::Tensor& output,
                                       const at::Tensor& input,
                                       const std::vector<int64_t>& output_split_sizes,
                                       const std::vector<int64_t>& input_split_sizes,
                                       int64_t seq) = 0;
  /// Rank 0 waits for the others for `timeout`, naming those that did not come (all of them when
  /// `wait_all_ranks`); the others wait for rank 0's word for answer_time(timeout).
  virtual void do_monitored_barrier(std::chrono::milliseconds timeout,
                                    bool wait_all_ranks,
                                    int64_t seq) = 0;
  virtual WorkPtr do_send(const at::Tensor& tensor, int dst, int tag, int64_t seq) = 0;
  virtual WorkPtr do_recv(at::Tensor& tensor, int src, int tag, int64_t seq) = 0;
  /// `ranks` is checked; `index` is this rank's place in it (-1: not a member); `group_id`
  /// counts this group's new_group calls, the same on every rank.
  virtual std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks,
                                                     int index,
                                                     int64_t group_id) = 0;

  /// How long a rank other than 0 waits for rank 0's verdict in a monitored_barrier: rank 0 may
  /// take the whole timeout to give it, so twice that, and a second for the message.
  static std::chrono::milliseconds answer_time(std::chrono::milliseconds timeout) {
    return 2 * timeout + std::chrono::milliseconds(1000);
  }

  /// The largest user tag + 1: kMaxUserTag, or less where the engine has fewer tags (mpi).
  virtual int user_tag_limit() const { return kMaxUserTag; }

  /// "allreduce #12 (sum, 4194304 bytes) on rank 1 of 2 (gloo)": the prefix of every error.
  std::string describe(const std::string& op, int64_t seq, const std::string& detail = "") const;

  /// Records the first failure (called by Work::wait on any thread); later operations on this
  /// group throw it at once instead of waiting for peers that are gone.
  void mark_broken(const std::string& message);
  /// Whether an operation of this group has failed.
  bool is_broken() const;

 private:
  // Where broadcast_object and all_gather_object put their bytes: the CPU, or the current GPU.
  at::TensorOptions object_options() const;
  int64_t next_sequence() { return sequence_++; }
  int64_t next_p2p_sequence() { return p2p_sequence_++; }
  void check_tensor(const at::Tensor& t, const char* op, const char* what) const;
  void check_op(ReduceOp op, const at::Tensor& t, const char* name) const;
  void check_root(int root, const char* op, const char* what) const;
  void check_peer(int peer, const char* op, const char* what) const;
  void check_not_broken(const char* op) const;

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  int64_t sequence_ = 0;
  int64_t p2p_sequence_ = 0;
  int64_t groups_made_ = 0;
  std::atomic<int64_t> bytes_sent_{0};
  void count_sent(double bytes);
  mutable std::mutex broken_mutex_;
  std::string broken_;  // guarded by broken_mutex_
};

using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

}  // namespace dist
}  // namespace paratrain

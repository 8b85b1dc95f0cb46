#include "paratrain/comm/process_group.h"

#include "launch/backend_routes.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace paratrain {
namespace dist {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

bool ProcessGroup::moves(c10::DeviceType type) const {
  const std::string engine = backend_for(type);
  const detail::EngineTraits traits = detail::engine_traits(engine);
  if (!traits.known) {
    return !engine.empty() && type == c10::DeviceType::CPU;
  }
  return traits.moves(type);
}

ProcessGroup::ProcessGroup(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {
  TORCH_CHECK(size >= 1, "process group size must be at least 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "rank ", rank, " is out of range for a group of size ",
              size);
  TORCH_CHECK(timeout.count() > 0, "collective timeout must be positive, got ", timeout.count(),
              " ms");
}

std::string ProcessGroup::describe(const std::string& op,
                                   int64_t seq,
                                   const std::string& detail) const {
  std::ostringstream out;
  out << op << " #" << seq;
  if (!detail.empty()) {
    out << " (" << detail << ")";
  }
  out << " on rank " << rank_ << " of " << size_ << " (" << backend_name() << ")";
  return out.str();
}

void ProcessGroup::mark_broken(const std::string& message) {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (broken_.empty()) {
    broken_ = message;
  }
}

bool ProcessGroup::is_broken() const {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  return !broken_.empty();
}

void ProcessGroup::check_not_broken(const char* op) const {
  std::lock_guard<std::mutex> lock(broken_mutex_);
  if (!broken_.empty()) {
    throw CollectiveError(std::string(op) + " on rank " + std::to_string(rank_) + " of " +
                          std::to_string(size_) + " (" + backend_name() +
                          ") refused: this group is broken by an earlier failure: " + broken_);
  }
}

void ProcessGroup::check_tensor(const at::Tensor& t, const char* op, const char* what) const {
  TORCH_CHECK(t.defined(), backend_name(), " ", op, ": ", what, " is an undefined tensor");
  TORCH_CHECK(t.is_contiguous(), backend_name(), " ", op, ": ", what,
              " must be contiguous (call .contiguous() first); got sizes ", t.sizes(), " strides ",
              t.strides());
  TORCH_CHECK(!t.is_sparse(), backend_name(), " ", op, ": ", what, " must be dense");
}

void ProcessGroup::check_peer(int peer, const char* op, const char* what) const {
  TORCH_CHECK(peer >= 0 && peer < size_, backend_name(), " ", op, ": ", what, " ", peer,
              " is out of range for a group of size ", size_);
  TORCH_CHECK(peer != rank_, backend_name(), " ", op, ": ", what, " ", peer,
              " is this rank itself");
}

WorkPtr ProcessGroup::allreduce(at::Tensor& tensor, ReduceOp op) {
  check_not_broken("allreduce");
  check_tensor(tensor, "allreduce", "tensor");
  TORCH_CHECK(op != ReduceOp::kAvg || at::isFloatingType(tensor.scalar_type()), backend_name(),
              " allreduce: avg needs a floating-point tensor, got ", tensor.scalar_type());
  return do_allreduce(tensor, op, next_sequence());
}

WorkPtr ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  check_not_broken("broadcast");
  check_tensor(tensor, "broadcast", "tensor");
  TORCH_CHECK(root >= 0 && root < size_, backend_name(), " broadcast: root ", root,
              " is out of range for a group of size ", size_);
  return do_broadcast(tensor, root, next_sequence());
}

WorkPtr ProcessGroup::allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  check_not_broken("allgather");
  check_tensor(input, "allgather", "input");
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_, backend_name(),
              " allgather: expected one output tensor per rank (", size_, "), got ",
              outputs.size());
  for (const auto& o : outputs) {
    check_tensor(o, "allgather", "output");
    TORCH_CHECK(o.sizes() == input.sizes() && o.scalar_type() == input.scalar_type(),
                backend_name(), " allgather: every output must match the input (", input.sizes(),
                ", ", input.scalar_type(), "), got ", o.sizes(), ", ", o.scalar_type());
  }
  return do_allgather(outputs, input, next_sequence());
}

WorkPtr ProcessGroup::reduce_scatter(at::Tensor& output,
                                     const std::vector<at::Tensor>& inputs,
                                     ReduceOp op) {
  check_not_broken("reduce_scatter");
  check_tensor(output, "reduce_scatter", "output");
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_, backend_name(),
              " reduce_scatter: expected one input tensor per rank (", size_, "), got ",
              inputs.size());
  for (const auto& i : inputs) {
    check_tensor(i, "reduce_scatter", "input");
    TORCH_CHECK(i.sizes() == output.sizes() && i.scalar_type() == output.scalar_type(),
                backend_name(), " reduce_scatter: every input must match the output (",
                output.sizes(), ", ", output.scalar_type(), "), got ", i.sizes(), ", ",
                i.scalar_type());
  }
  TORCH_CHECK(op != ReduceOp::kAvg || at::isFloatingType(output.scalar_type()), backend_name(),
              " reduce_scatter: avg needs a floating-point tensor, got ", output.scalar_type());
  return do_reduce_scatter(output, inputs, op, next_sequence());
}

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(const std::vector<int>& ranks) {
  check_not_broken("new_group");
  TORCH_CHECK(!ranks.empty(), backend_name(), " new_group: the rank list is empty");
  std::vector<bool> seen(static_cast<size_t>(size_), false);
  int index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    TORCH_CHECK(r >= 0 && r < size_, backend_name(), " new_group: rank ", r,
                " is out of range for a group of size ", size_);
    TORCH_CHECK(!seen[static_cast<size_t>(r)], backend_name(), " new_group: rank ", r,
                " appears twice in ",
                c10::IntArrayRef(std::vector<int64_t>(ranks.begin(), ranks.end())));
    seen[static_cast<size_t>(r)] = true;
    if (r == rank_) {
      index = static_cast<int>(i);
    }
  }
  return do_new_group(ranks, index, groups_made_++);
}

WorkPtr ProcessGroup::barrier() {
  check_not_broken("barrier");
  return do_barrier(next_sequence());
}

WorkPtr ProcessGroup::send(const at::Tensor& tensor, int dst, int tag) {
  check_not_broken("send");
  check_tensor(tensor, "send", "tensor");
  TORCH_CHECK(tag >= 0 && tag < kMaxUserTag, backend_name(), " send: tag must be in [0, ",
              kMaxUserTag, "), got ", tag, " (larger tags carry paratrain's own collectives)");
  check_peer(dst, "send", "destination rank");
  return do_send(tensor, dst, tag, next_p2p_sequence());
}

WorkPtr ProcessGroup::recv(at::Tensor& tensor, int src, int tag) {
  check_not_broken("recv");
  check_tensor(tensor, "recv", "tensor");
  TORCH_CHECK(tag >= 0 && tag < kMaxUserTag, backend_name(), " recv: tag must be in [0, ",
              kMaxUserTag, "), got ", tag, " (larger tags carry paratrain's own collectives)");
  check_peer(src, "recv", "source rank");
  return do_recv(tensor, src, tag, next_p2p_sequence());
}

}  // namespace dist
}  // namespace paratrain

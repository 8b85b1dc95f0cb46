#include "paratrain/comm/process_group.h"

#include "composite_work.h"
#include "launch/backend_routes.h"

#include <c10/util/Exception.h>

#include <cstring>
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
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
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

void ProcessGroup::check_op(ReduceOp op, const at::Tensor& t, const char* name) const {
  TORCH_CHECK(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), backend_name(), " ",
              name, ": avg needs a floating-point tensor, got ", t.scalar_type());
  const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  TORCH_CHECK(!bitwise || at::isIntegralType(t.scalar_type(), /*includeBool=*/true), backend_name(),
              " ", name, ": ", to_string(op), " needs an integer or bool tensor, got ",
              t.scalar_type());
}

void ProcessGroup::check_root(int root, const char* op, const char* what) const {
  TORCH_CHECK(root >= 0 && root < size_, backend_name(), " ", op, ": ", what, " ", root,
              " is out of range for a group of size ", size_);
}

WorkPtr ProcessGroup::allreduce(at::Tensor& tensor, ReduceOp op) {
  check_not_broken("allreduce");
  check_tensor(tensor, "allreduce", "tensor");
  check_op(op, tensor, "allreduce");
  count_sent(2.0 * (size_ - 1) / size_ * static_cast<double>(tensor.nbytes()));
  return do_allreduce(tensor, op, next_sequence());
}

WorkPtr ProcessGroup::reduce(at::Tensor& tensor, int dst, ReduceOp op) {
  check_not_broken("reduce");
  check_tensor(tensor, "reduce", "tensor");
  check_op(op, tensor, "reduce");
  check_root(dst, "reduce", "dst");
  return do_reduce(tensor, dst, op, next_sequence());
}

namespace {
// size() tensors shaped like `like` (what gather's outputs and scatter's inputs must be).
void check_list(const std::vector<at::Tensor>& list,
                const at::Tensor& like,
                int size,
                const std::string& where) {
  TORCH_CHECK(static_cast<int>(list.size()) == size, where, " expected one tensor per rank (", size,
              "), got ", list.size());
  for (const auto& t : list) {
    TORCH_CHECK(t.defined() && t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(),
                where, " every tensor must be shaped as ", like.sizes(), " of ", like.scalar_type(),
                ", got ", t.defined() ? t.sizes() : c10::IntArrayRef{}, " of ",
                t.defined() ? t.scalar_type() : at::ScalarType::Undefined);
    TORCH_CHECK(t.is_contiguous(), where, " every tensor must be contiguous");
  }
}
}  // namespace

WorkPtr ProcessGroup::gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, int dst) {
  check_not_broken("gather");
  check_tensor(input, "gather", "input");
  check_root(dst, "gather", "dst");
  if (rank_ == dst) {
    check_list(outputs, input, size_, backend_name() + " gather: outputs:");
  } else {
    TORCH_CHECK(outputs.empty(), backend_name(), " gather: outputs are given on rank ", rank_,
                ", which is not dst (", dst, "); pass an empty list there, as gather_list is None");
  }
  return do_gather(outputs, input, dst, next_sequence());
}

WorkPtr ProcessGroup::scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int src) {
  check_not_broken("scatter");
  check_tensor(output, "scatter", "output");
  check_root(src, "scatter", "src");
  if (rank_ == src) {
    check_list(inputs, output, size_, backend_name() + " scatter: inputs:");
  } else {
    TORCH_CHECK(inputs.empty(), backend_name(), " scatter: inputs are given on rank ", rank_,
                ", which is not src (", src,
                "); pass an empty list there, as scatter_list is None");
  }
  return do_scatter(output, inputs, src, next_sequence());
}

namespace {
// Split sizes along dim 0 of `t` for an all_to_all_single: `given`, or equal pieces when empty.
std::vector<int64_t> splits_of(const at::Tensor& t,
                               std::vector<int64_t> given,
                               int size,
                               const std::string& where) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (given.empty()) {
    TORCH_CHECK(rows % size == 0, where, " has ", rows, " rows in dim 0, which ", size,
                " ranks cannot share equally; give its split sizes");
    return std::vector<int64_t>(static_cast<size_t>(size), rows / size);
  }
  TORCH_CHECK(static_cast<int>(given.size()) == size, where, " split sizes have ", given.size(),
              " entries; give one per rank (", size, ")");
  int64_t sum = 0;
  for (int64_t s : given) {
    TORCH_CHECK(s >= 0, where, " split sizes must not be negative, got ", c10::IntArrayRef(given));
    sum += s;
  }
  TORCH_CHECK(sum == rows, where, " split sizes ", c10::IntArrayRef(given), " add up to ", sum,
              ", but the tensor has ", rows, " rows in dim 0");
  return given;
}
}  // namespace

WorkPtr ProcessGroup::all_to_all_single(at::Tensor& output,
                                        const at::Tensor& input,
                                        std::vector<int64_t> output_split_sizes,
                                        std::vector<int64_t> input_split_sizes) {
  check_not_broken("all_to_all_single");
  check_tensor(input, "all_to_all_single", "input");
  check_tensor(output, "all_to_all_single", "output");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), backend_name(),
              " all_to_all_single: input is ", input.scalar_type(), " and output ",
              output.scalar_type(), "; they must match");
  TORCH_CHECK(
      input.dim() >= 1 && output.dim() >= 1 && input.sizes().slice(1) == output.sizes().slice(1),
      backend_name(), " all_to_all_single: input ", input.sizes(), " and output ", output.sizes(),
      " must match in every dim but the first");
  const std::string name = backend_name() + " all_to_all_single:";
  auto out = splits_of(output, std::move(output_split_sizes), size_, name + " the output");
  auto in = splits_of(input, std::move(input_split_sizes), size_, name + " the input");
  return do_all_to_all_single(output, input, out, in, next_sequence());
}

// As PyTorch's gloo backend: the pieces travel as one flat all_to_all_single of their elements,
// so any engine with that collective has this one.
WorkPtr ProcessGroup::all_to_all(std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs) {
  check_not_broken("all_to_all");
  const std::string name = backend_name() + " all_to_all:";
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
              name, " expected one output and one input tensor per rank (", size_, "), got ",
              outputs.size(), " and ", inputs.size());
  std::vector<int64_t> out_counts, in_counts;
  for (int r = 0; r < size_; ++r) {
    check_tensor(inputs[r], "all_to_all", "input");
    check_tensor(outputs[r], "all_to_all", "output");
    TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                    outputs[r].scalar_type() == inputs[0].scalar_type(),
                name, " every tensor must be ", inputs[0].scalar_type(), ", got ",
                inputs[r].scalar_type(), " and ", outputs[r].scalar_type());
    TORCH_CHECK(
        inputs[r].device() == inputs[0].device() && outputs[r].device() == inputs[0].device(), name,
        " every tensor must be on ", inputs[0].device());
    in_counts.push_back(inputs[r].numel());
    out_counts.push_back(outputs[r].numel());
  }
  std::vector<at::Tensor> flat_in;
  for (const auto& t : inputs) {
    flat_in.push_back(t.reshape({-1}));
  }
  at::Tensor in = at::cat(flat_in);
  int64_t total = 0;
  for (int64_t c : out_counts) {
    total += c;
  }
  at::Tensor out = at::empty({total}, in.options());
  auto work = do_all_to_all_single(out, in, out_counts, in_counts, next_sequence());
  return std::make_shared<detail::CompositeWork>(
      std::vector<WorkPtr>{work}, [outputs, out, out_counts]() mutable {
        int64_t at = 0;
        for (size_t r = 0; r < outputs.size(); ++r) {
          outputs[r].copy_(out.narrow(0, at, out_counts[r]).view(outputs[r].sizes()));
          at += out_counts[r];
        }
      });
}

WorkPtr ProcessGroup::all_gather_into_tensor(at::Tensor& output, const at::Tensor& input) {
  check_not_broken("all_gather_into_tensor");
  check_tensor(input, "all_gather_into_tensor", "input");
  check_tensor(output, "all_gather_into_tensor", "output");
  TORCH_CHECK(
      output.numel() == size_ * input.numel() && output.scalar_type() == input.scalar_type(),
      backend_name(), " all_gather_into_tensor: the output must hold ", size_,
      " times the input's ", input.numel(), " ", input.scalar_type(), " elements, got ",
      output.numel(), " ", output.scalar_type(), " (", output.sizes(), ")");
  std::vector<at::Tensor> slots;
  at::Tensor rows = output.view({size_, input.numel()});
  for (int r = 0; r < size_; ++r) {
    slots.push_back(rows[r].view(input.sizes()));
  }
  count_sent(static_cast<double>(size_ - 1) * static_cast<double>(input.nbytes()));
  return do_allgather(slots, input, next_sequence());
}

WorkPtr ProcessGroup::reduce_scatter_tensor(at::Tensor& output,
                                            const at::Tensor& input,
                                            ReduceOp op) {
  check_not_broken("reduce_scatter_tensor");
  check_tensor(input, "reduce_scatter_tensor", "input");
  check_tensor(output, "reduce_scatter_tensor", "output");
  check_op(op, output, "reduce_scatter_tensor");
  TORCH_CHECK(
      input.numel() == size_ * output.numel() && output.scalar_type() == input.scalar_type(),
      backend_name(), " reduce_scatter_tensor: the input must hold ", size_, " times the output's ",
      output.numel(), " ", output.scalar_type(), " elements, got ", input.numel(), " ",
      input.scalar_type(), " (", input.sizes(), ")");
  std::vector<at::Tensor> pieces;
  at::Tensor rows = input.view({size_, output.numel()});
  for (int r = 0; r < size_; ++r) {
    pieces.push_back(rows[r].view(output.sizes()));
  }
  count_sent(static_cast<double>(size_ - 1) * static_cast<double>(output.nbytes()));
  return do_reduce_scatter(output, pieces, op, next_sequence());
}

void ProcessGroup::monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
  check_not_broken("monitored_barrier");
  TORCH_CHECK(timeout.count() >= 0, backend_name(),
              " monitored_barrier: the timeout must not be negative, got ", timeout.count(), " ms");
  do_monitored_barrier(timeout.count() == 0 ? timeout_ : timeout, wait_all_ranks, next_sequence());
}

std::vector<WorkPtr> ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops) {
  TORCH_CHECK(!ops.empty(), backend_name(), " batch_isend_irecv: the list of operations is empty");
  // Every operation is checked before any starts: a bad one must not leave others in flight.
  for (const auto& op : ops) {
    const char* name = op.kind == P2POp::Kind::kIsend ? "isend" : "irecv";
    check_tensor(op.tensor, name, "tensor");
    TORCH_CHECK(op.tag >= 0 && op.tag < user_tag_limit(), backend_name(), " ", name,
                ": tag must be in [0, ", user_tag_limit(), "), got ", op.tag);
    check_peer(op.peer, name, op.kind == P2POp::Kind::kIsend ? "destination rank" : "source rank");
    TORCH_CHECK(moves(op.tensor.device().type()), backend_name(), " ", name, ": the tensor is on ",
                op.tensor.device(), ", which this group's engines do not move");
  }
  std::vector<WorkPtr> works;
  for (const auto& op : ops) {
    at::Tensor t = op.tensor;
    works.push_back(op.kind == P2POp::Kind::kIsend ? send(t, op.peer, op.tag)
                                                   : recv(t, op.peer, op.tag));
  }
  return works;
}

// As PyTorch's: first the size, then the bytes, as uint8 tensors on the CPU over the group's CPU
// engine, or through the current GPU on a group of NCCL alone (as PyTorch's NCCL groups do).
at::TensorOptions ProcessGroup::object_options() const {
  return at::TensorOptions().device(moves(at::kCPU) ? at::kCPU : at::kCUDA);
}

void ProcessGroup::broadcast_object(std::string& bytes, int src) {
  check_root(src, "broadcast_object", "src");
  const at::TensorOptions on = object_options();
  at::Tensor length = at::full({1}, static_cast<int64_t>(bytes.size()), on.dtype(at::kLong));
  broadcast(length, src)->wait();
  at::Tensor data = at::zeros({length.cpu().item<int64_t>()}, at::kByte);
  if (rank_ == src && !bytes.empty()) {
    std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  }
  if (data.numel() > 0) {
    at::Tensor moved = data.to(on.device());
    broadcast(moved, src)->wait();
    data = moved.cpu();
  }
  bytes.assign(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
}

void ProcessGroup::all_gather_object(std::vector<std::string>& object_list,
                                     const std::string& bytes) {
  const at::TensorOptions on = object_options();
  at::Tensor length = at::full({1}, static_cast<int64_t>(bytes.size()), on.dtype(at::kLong));
  at::Tensor lengths = at::empty({size_}, on.dtype(at::kLong));
  all_gather_into_tensor(lengths, length)->wait();
  lengths = lengths.cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor mine = at::zeros({longest}, at::kByte);
  if (!bytes.empty()) {
    std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  }
  at::Tensor all = at::empty({size_ * longest}, on.dtype(at::kByte));
  if (longest > 0) {
    all_gather_into_tensor(all, mine.to(on.device()))->wait();
    all = all.cpu();
  }
  object_list.assign(static_cast<size_t>(size_), std::string());
  for (int r = 0; r < size_; ++r) {
    const auto* base = static_cast<const char*>(all.data_ptr()) + r * longest;
    object_list[static_cast<size_t>(r)].assign(base,
                                               static_cast<size_t>(lengths[r].item<int64_t>()));
  }
}

WorkPtr ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  check_not_broken("broadcast");
  check_tensor(tensor, "broadcast", "tensor");
  TORCH_CHECK(root >= 0 && root < size_, backend_name(), " broadcast: root ", root,
              " is out of range for a group of size ", size_);
  count_sent(rank_ == root ? static_cast<double>(tensor.nbytes()) : 0.0);
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
  count_sent(static_cast<double>(size_ - 1) * static_cast<double>(input.nbytes()));
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
  check_op(op, output, "reduce_scatter");
  count_sent(static_cast<double>(size_ - 1) * static_cast<double>(output.nbytes()));
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

void ProcessGroup::count_sent(double bytes) {
  bytes_sent_.fetch_add(static_cast<int64_t>(bytes));
}

WorkPtr ProcessGroup::barrier() {
  check_not_broken("barrier");
  return do_barrier(next_sequence());
}

WorkPtr ProcessGroup::send(const at::Tensor& tensor, int dst, int tag) {
  check_not_broken("send");
  check_tensor(tensor, "send", "tensor");
  TORCH_CHECK(tag >= 0 && tag < user_tag_limit(), backend_name(), " send: tag must be in [0, ",
              user_tag_limit(), "), got ", tag, " (larger tags carry paratrain's own collectives)");
  check_peer(dst, "send", "destination rank");
  count_sent(static_cast<double>(tensor.nbytes()));
  return do_send(tensor, dst, tag, next_p2p_sequence());
}

WorkPtr ProcessGroup::recv(at::Tensor& tensor, int src, int tag) {
  check_not_broken("recv");
  check_tensor(tensor, "recv", "tensor");
  TORCH_CHECK(tag >= 0 && tag < user_tag_limit(), backend_name(), " recv: tag must be in [0, ",
              user_tag_limit(), "), got ", tag, " (larger tags carry paratrain's own collectives)");
  check_peer(src, "recv", "source rank");
  return do_recv(tensor, src, tag, next_p2p_sequence());
}

}  // namespace dist
}  // namespace paratrain

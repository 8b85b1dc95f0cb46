// A process group that sends each collective to the engine of its tensors' device, as
// torch.distributed 2.x does for backend "cpu:gloo,cuda:nccl" (and for the default backend on a
// machine with GPUs): CPU tensors over gloo (or mpi), CUDA tensors over nccl, in one group.

#include "backends.h"

#include <c10/util/Exception.h>

namespace paratrain {
namespace dist {
namespace detail {
namespace {

class RoutedGroup : public ProcessGroup {
 public:
  RoutedGroup(std::vector<Route> routes, std::string name)
      : ProcessGroup(
            routes.at(0).group->rank(), routes.at(0).group->size(), routes.at(0).group->timeout()),
        routes_(std::move(routes)),
        name_(std::move(name)) {
    for (const auto& r : routes_) {
      TORCH_INTERNAL_ASSERT(r.group->rank() == rank() && r.group->size() == size(),
                            "routes disagree on rank or size");
    }
  }

  std::string backend_name() const override { return name_; }

  std::string backend_for(c10::DeviceType type) const override {
    for (const auto& r : routes_) {
      if (r.device == type) {
        return r.group->backend_name();
      }
    }
    return "";
  }

 protected:
  WorkPtr do_allreduce(at::Tensor& tensor, ReduceOp op, int64_t) override {
    return route(tensor, "allreduce").allreduce(tensor, op);
  }
  WorkPtr do_broadcast(at::Tensor& tensor, int root, int64_t) override {
    return route(tensor, "broadcast").broadcast(tensor, root);
  }
  WorkPtr do_allgather(std::vector<at::Tensor>& outputs,
                       const at::Tensor& input,
                       int64_t) override {
    return route(input, "allgather").allgather(outputs, input);
  }
  WorkPtr do_reduce_scatter(at::Tensor& output,
                            const std::vector<at::Tensor>& inputs,
                            ReduceOp op,
                            int64_t) override {
    return route(output, "reduce_scatter").reduce_scatter(output, inputs, op);
  }
  WorkPtr do_reduce(at::Tensor& tensor, int dst, ReduceOp op, int64_t) override {
    return route(tensor, "reduce").reduce(tensor, dst, op);
  }
  WorkPtr do_gather(std::vector<at::Tensor>& outputs,
                    const at::Tensor& input,
                    int dst,
                    int64_t) override {
    return route(input, "gather").gather(outputs, input, dst);
  }
  WorkPtr do_scatter(at::Tensor& output,
                     const std::vector<at::Tensor>& inputs,
                     int src,
                     int64_t) override {
    return route(output, "scatter").scatter(output, inputs, src);
  }
  WorkPtr do_all_to_all_single(at::Tensor& output,
                               const at::Tensor& input,
                               const std::vector<int64_t>& output_split_sizes,
                               const std::vector<int64_t>& input_split_sizes,
                               int64_t) override {
    return route(input, "all_to_all_single")
        .all_to_all_single(output, input, output_split_sizes, input_split_sizes);
  }
  // Moves no tensor: the first route's, as the barrier's.
  void do_monitored_barrier(std::chrono::milliseconds timeout,
                            bool wait_all_ranks,
                            int64_t) override {
    routes_.front().group->monitored_barrier(timeout, wait_all_ranks);
  }
  // Any one engine's barrier makes every rank wait for the others; the first route's is the CPU's
  // when there is one, which needs no device.
  WorkPtr do_barrier(int64_t) override { return routes_.front().group->barrier(); }
  WorkPtr do_send(const at::Tensor& tensor, int dst, int tag, int64_t) override {
    return route(tensor, "send").send(tensor, dst, tag);
  }
  WorkPtr do_recv(at::Tensor& tensor, int src, int tag, int64_t) override {
    return route(tensor, "recv").recv(tensor, src, tag);
  }

  // Every rank calls new_group on every engine, in route order, so each engine's k-th subgroup is
  // the same group on every rank.
  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks,
                                             int index,
                                             int64_t) override {
    std::vector<Route> sub;
    for (const auto& r : routes_) {
      sub.push_back({r.device, r.group->new_group(ranks)});
    }
    if (index < 0) {
      return nullptr;
    }
    return std::make_shared<RoutedGroup>(std::move(sub), name_);
  }

 private:
  ProcessGroup& route(const at::Tensor& t, const char* op) {
    const c10::DeviceType type = t.device().type();
    for (const auto& r : routes_) {
      if (r.device == type) {
        return *r.group;
      }
    }
    TORCH_CHECK(false, name_, " ", op, ": the tensor is on ", t.device(),
                ", and this group has no backend for ", c10::DeviceTypeName(type, true),
                " tensors; name one in the backend string (e.g. 'cpu:gloo,cuda:nccl')");
  }

  std::vector<Route> routes_;  // CPU first
  std::string name_;
};

}  // namespace

ProcessGroupPtr make_routed_group(std::vector<Route> routes, const std::string& name) {
  TORCH_INTERNAL_ASSERT(!routes.empty(), "a routed group needs a route");
  return std::make_shared<RoutedGroup>(std::move(routes), name);
}

}  // namespace detail
}  // namespace dist
}  // namespace paratrain

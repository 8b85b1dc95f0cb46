// One pipeline stage's work (StageRunner): its forwards and backwards of micro-batches, with
// their loss, recomputation (checkpoint) and messages to the neighbouring stages. Pipeline runs one
// per thread, DistributedPipeline one per rank.

#include "pipeline_internal.h"

#include <c10/core/DeviceGuard.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include "util/copies.h"

#include <algorithm>
#include <chrono>

namespace paratrain {
namespace pipeline {
namespace stage_work {

at::Tensor StageRunner::run_module(const at::Tensor& x) {
  if (fsdp != nullptr) {
    return fsdp->forward(x);
  }
  return ddp != nullptr ? ddp->forward(x) : module->forward(x);
}

at::Tensor StageRunner::receive(int64_t from, int64_t mb, bool grad) {
  auto t0 = Clock::now();
  at::Tensor t = transport->recv(from, index, mb, grad);
  waiting += std::chrono::duration<double>(Clock::now() - t0).count();
  return detail::to_device(t, device);
}

at::Tensor StageRunner::compute_loss(const at::Tensor& out, int64_t mb) {
  const at::Tensor& target = targets[static_cast<size_t>(mb)];
  at::Tensor l = loss(out, detail::to_device(target, device));
  TORCH_CHECK(l.numel() == 1, "the loss function returned a tensor of shape ", l.sizes(),
              "; it must return a scalar (reduce with mean or sum)");
  if (options.scale_loss()) {
    l = l * (static_cast<double>(target.size(0)) / static_cast<double>(batch));
  }
  return l;
}

void StageRunner::forward(int64_t mb, bool training) {
  at::Tensor x = index == 0 ? detail::to_device(inputs[static_cast<size_t>(mb)], device)
                            : receive(index - 1, mb, /*grad=*/false);
  Saved s;
  s.input = x.detach();
  if (index > 0 && training && s.input.is_floating_point()) {
    s.input.requires_grad_(true);
  }
  at::Tensor out;
  {
    // Without a graph: evaluation, or recomputation's first pass.
    torch::AutoGradMode mode(training && !options.checkpoint());
    out = run_module(s.input);
    if (is_last()) {
      if (training) {
        at::Tensor l = compute_loss(out, mb);
        loss_sum = loss_sum.defined() ? loss_sum + l.detach() : l.detach();
        s.loss = l;
      } else {
        outputs.push_back(out);
      }
    }
  }
  if (!is_last()) {
    transport->send(index, index + 1, mb, /*grad=*/false, out.detach());
    s.output = out;
  }
  if (training) {
    if (options.checkpoint()) {
      s.output = at::Tensor();
      s.loss = at::Tensor();
    }
    saved[mb] = std::move(s);
    stats.max_live_micro_batches =
        std::max<int64_t>(stats.max_live_micro_batches, static_cast<int64_t>(saved.size()));
  }
}

void StageRunner::backward(int64_t mb,
                           bool last_backward,
                           std::optional<DistributedDataParallel::NoSyncGuard>& no_sync) {
  auto it = saved.find(mb);
  TORCH_CHECK(it != saved.end(), "pipeline: stage ", index, " has no forward of micro-batch ", mb,
              " to run backward on");
  Saved s = std::move(it->second);
  saved.erase(it);
  if (options.checkpoint()) {  // re-materialise this stage's graph
    s.output = run_module(s.input);
    if (is_last()) {
      s.loss = compute_loss(s.output, mb);
    }
  }
  const at::Tensor& root = is_last() ? s.loss : s.output;
  if (last_backward && fsdp != nullptr) {
    fsdp->set_requires_gradient_sync(fsdp_sync);  // this backward reduce-scatters the step's sum
  }
  if (last_backward && ddp != nullptr) {
    // The other backwards accumulated locally; this one reduces everything (Note in the
    // header of DistributedPipeline).
    no_sync.reset();
    ddp->prepare_for_backward(root);
  }
  if (is_last()) {
    if (root.requires_grad()) {
      root.backward();
    }
  } else {
    at::Tensor g = receive(index + 1, mb, /*grad=*/true);
    if (root.requires_grad()) {
      torch::autograd::backward({root}, {g});
    }
  }
  if (index > 0) {
    at::Tensor gi = s.input.grad();
    transport->send(index, index - 1, mb, /*grad=*/true,
                    gi.defined() ? gi : torch::zeros_like(s.input));
  }
}

void StageRunner::run(const std::vector<Action>& acts, bool training) {
  c10::DeviceGuard guard(device);
  stats = StageStats();
  saved.clear();
  outputs.clear();
  loss_sum = at::Tensor();
  waiting = 0;
  std::optional<DistributedDataParallel::NoSyncGuard> no_sync;
  if (ddp != nullptr && training) {
    no_sync.emplace(*ddp);
  }
  if (fsdp != nullptr && training) {
    // The micro-batches' gradients add up unsharded until the last backward (pipeline.h).
    fsdp_sync = fsdp->requires_gradient_sync();
    fsdp->set_requires_gradient_sync(false);
  }
  torch::AutoGradMode mode(training);
  auto t0 = Clock::now();
  try {
    for (size_t i = 0; i < acts.size(); ++i) {
      if (acts[i].kind == Action::Kind::kForward) {
        forward(acts[i].micro_batch, training);
      } else {
        backward(acts[i].micro_batch, i + 1 == acts.size(), no_sync);
      }
    }
  } catch (...) {
    if (fsdp != nullptr && training) {
      fsdp->set_requires_gradient_sync(fsdp_sync);
    }
    throw;
  }
  if (fsdp != nullptr && training) {
    fsdp->set_requires_gradient_sync(fsdp_sync);  // whatever the schedule's last action was
  }
  stats.busy_seconds = std::chrono::duration<double>(Clock::now() - t0).count() - waiting;
}

}  // namespace stage_work
}  // namespace pipeline
}  // namespace paratrain

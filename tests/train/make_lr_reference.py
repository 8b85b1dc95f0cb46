"""Prints the learning rates PyTorch's schedulers give, for tests/train/trainer_test.cpp.

usage: make_lr_reference.py KIND STEP_SIZE GAMMA MILESTONES T_MAX ETA_MIN WARMUP START_FACTOR N
MILESTONES is comma-separated (or '-'). Prints N lrs, one per line: the lr in use at scheduler
step t = 0 .. N-1, from SGD(lr=0.1) stepped with scheduler.step() after each optimizer step.
"""
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
kind, step_size, gamma, milestones, t_max, eta_min, warmup, start, n = sys.argv[1:]
S = torch.optim.lr_scheduler
opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def main_schedule():
    if kind == "step":
        return S.StepLR(opt, step_size=int(step_size), gamma=float(gamma))
    if kind == "multistep":
        ms = [int(m) for m in milestones.split(",")] if milestones != "-" else []
        return S.MultiStepLR(opt, milestones=ms, gamma=float(gamma))
    if kind == "cosine":
        return S.CosineAnnealingLR(opt, T_max=int(t_max), eta_min=float(eta_min))
    return S.LambdaLR(opt, lambda t: 1.0)  # constant


if int(warmup) > 0:
    warm = S.LinearLR(opt, start_factor=float(start), total_iters=int(warmup))
    sched = S.SequentialLR(opt, [warm, main_schedule()], milestones=[int(warmup)])
else:
    sched = main_schedule()
for _ in range(int(n)):
    print(repr(opt.param_groups[0]["lr"]))
    opt.step()
    sched.step()

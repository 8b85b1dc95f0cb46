#!/usr/bin/env python3
# PyTorch's own DDP on the workloads of `paratrain bench ddp` (and, with --amp bf16, CPU autocast
# for `paratrain bench amp`), for the side-by-side comparison. Started by the paratrain launcher
# (torchrun's environment contract; through mpirun for --backend mpi), one thread per rank. Runs
# under any PyTorch from 1.13 on. Writes one JSON line (rank 0) to --out: the slowest rank's median
# step time, steps timed.
import argparse, contextlib, json, os, statistics, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, inp, out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, 0, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return F.relu(x + identity)


def resnet18_cifar(num_classes=10):
    # torchvision's ResNet-18 with a CIFAR stem (3x3 conv, no max-pool), as paratrain's.
    layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    inp = 64
    for i, w in enumerate([64, 128, 256, 512]):
        layers.append(nn.Sequential(BasicBlock(inp, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
        inp = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def mlp(num_classes=10):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.BatchNorm1d(512), nn.ReLU(),
                         nn.Dropout(), nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(),
                         nn.Dropout(), nn.Linear(256, num_classes))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    p.add_argument("--amp", default="none", choices=["none", "bf16"],
                   help="bf16: forward and loss under torch.autocast on the CPU (opt level O1)")
    p.add_argument("--system", default="pytorch", help="the row's system: pytorch-VERSION")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    # PyTorch 2.4+ serves its TCPStore through libuv by default; Debian's builds have no libuv and
    # refuse ("use_libuv was requested but PyTorch was build without libuv support"). The classic
    # store exists in every version, and USE_LIBUV is PyTorch's own switch for the default.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group(a.backend)
    torch.manual_seed(0)
    model = mlp() if a.workload == "mlp" else resnet18_cifar()
    shape = (a.batch, 1, 28, 28) if a.workload == "mlp" else (a.batch, 3, 32, 32)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(shape)
    y = torch.randint(0, 10, (a.batch,))
    # bf16 needs no GradScaler: its range is fp32's (as paratrain's O1 in bf16).
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.amp == "bf16" \
        else contextlib.nullcontext
    times = []
    for step in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        with autocast():
            loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    # Each process's median step, then the slowest process (as paratrain's bench does).
    t = torch.tensor([statistics.median(times)], dtype=torch.double)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps({"workload": a.workload, "system": a.system,
                                "backend": a.backend, "amp": a.amp,
                                "ranks": dist.get_world_size(),
                                "step_seconds": t.item(),
                                "steps": len(times)}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

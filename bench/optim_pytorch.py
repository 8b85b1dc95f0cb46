#!/usr/bin/env python3
"""The anchors of `paratrain bench optim`: one optimizer's step over a model's worth of fp32 CPU
parameters, timed. `--optimizer` names it as the benchmark's rows do:

  pytorch-fused     torch.optim.Adam(fused=True)   (PyTorch 2.4 and later)
  pytorch-foreach   torch.optim.Adam(foreach=True)
  DeepSpeedCPUAdam  deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=False)

The parameters are --params elements in tensors of at most --tensor-elements, with gradients of
the same size; each step is optimizer.step() alone. Writes one JSON row to --out: the median of
--steps timed steps after --warmup, the versions, and the peak resident memory."""
import argparse
import ctypes
import json
import os
import resource
import statistics
import sys
import tempfile
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--optimizer", required=True,
                   choices=["pytorch-fused", "pytorch-foreach", "DeepSpeedCPUAdam"])
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--tensor-elements", type=int, default=64 << 20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


def make_params(torch, n, per_tensor):
    params = []
    left = n
    while left > 0:
        size = min(left, per_tensor)
        p = torch.empty(size).uniform_(-0.05, 0.05).requires_grad_()
        p.grad = torch.empty(size).normal_(0, 1e-3)
        params.append(p)
        left -= size
    return params


def deepspeed_adam(params):
    """DeepSpeedCPUAdam, and the arithmetic its op was built with ("AVX512", "AVX2"), which its
    C++ side prints on stdout when it creates the optimizer (captured through the descriptor)."""
    import logging
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.utils import logger
    logger.setLevel(logging.INFO)  # it says which arithmetic it was built with at INFO
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as captured:
        os.dup2(captured.fileno(), 1)
        try:
            opt = DeepSpeedCPUAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.0, adamw_mode=False)
        finally:
            sys.stdout.flush()
            ctypes.CDLL(None).fflush(None)  # its C printf's buffer, before fd 1 goes back
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        text = captured.read()
    sys.stderr.write(text)
    simd = "unknown"
    for word in ["AVX512", "AVX2", "AVX256", "scalar"]:
        if word + " arithmetic" in text:
            simd = word
            break
    return opt, simd


def huge_page_bytes():
    """This process's memory in transparent huge pages, as the benchmark's own rows report it."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def main():
    args = parse()
    import torch
    torch.set_num_threads(args.threads)
    params = make_params(torch, args.params, args.tensor_elements)
    row = {"optimizer": args.optimizer, "params": args.params, "threads": args.threads,
           "anchor_version": "pytorch-" + torch.__version__.split("+")[0]}
    if args.optimizer == "DeepSpeedCPUAdam":
        import deepspeed
        opt, row["simd"] = deepspeed_adam(params)
        row["anchor_version"] = "deepspeed-" + deepspeed.__version__
    else:
        fused = args.optimizer == "pytorch-fused"
        opt = torch.optim.Adam(params, lr=1e-3, fused=fused, foreach=not fused)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    row["step_seconds"] = statistics.median(times)  # as the C++ rows' median
    row["step_seconds_min"] = min(times)
    row["step_seconds_max"] = max(times)
    row["steps"] = args.steps
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row["huge_page_bytes"] = huge_page_bytes()
    with open(args.out, "w") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch's side of `paratrain bench fsdp`: one GPT trained with Adam under PyTorch's DDP, DDP
with ZeroRedundancyOptimizer, FSDP2 (fully_shard on each block, then on the root) and FSDP2 with
activation checkpointing, on the CPU over gloo. Started by the paratrain launcher (torchrun's
environment contract), one thread per rank. Rank 0 appends one JSON row to --out: the slowest
rank's median step, the largest rank's peak RSS and its RSS before the model was built (the
interpreter and libraries: about 0.7 GiB for PyPI's CUDA wheel), the first and last losses; or,
where this PyTorch cannot run the system, the exact error (PyTorch 1.13 has no fully_shard; in
2.6 it failed on the CPU with "'Stream' object has no attribute 'record_event'")."""
import argparse
import datetime
import json
import math
import os
import resource
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

GPT2 = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
        "gpt2-xl": (48, 1600, 25)}


class Conv1D(nn.Module):
    """Hugging Face's Conv1D, as paratrain's gpt(): weight [in, out]."""

    def __init__(self, inp, out, std):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(inp, out).normal_(0, std))
        self.bias = nn.Parameter(torch.zeros(out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], -1)


class Block(nn.Module):
    """A pre-LayerNorm GPT-2 block with paratrain's attention: explicit scores, a causal mask
    built per forward, softmax (no fused kernel, so that both sides do the same work)."""

    def __init__(self, width, heads, layers):
        super().__init__()
        residual = 0.02 / math.sqrt(2 * layers)
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width, eps=1e-5), nn.LayerNorm(width, eps=1e-5)
        self.c_attn, self.attn_proj = Conv1D(width, 3 * width, 0.02), Conv1D(width, width, residual)
        self.c_fc = Conv1D(width, 4 * width, 0.02)
        self.mlp_proj = Conv1D(4 * width, width, residual)

    def attention(self, x):
        b, t, w = x.shape
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for z in self.c_attn(x).split(w, dim=2))
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(w // self.heads))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        y = torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, w))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, width, heads, vocab, context, checkpointing):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        nn.init.normal_(self.wte.weight, 0, 0.02)
        nn.init.normal_(self.wpe.weight, 0, 0.02)
        self.h = nn.ModuleList(Block(width, heads, layers) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)
        self.checkpointing = checkpointing

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1)))
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the head tied to the token embedding


def wrap(system, model):
    """The model to call and the optimizer, for `system`."""
    if system in ("ddp", "zero"):
        ddp = nn.parallel.DistributedDataParallel(model)
        if system == "ddp":
            return ddp, torch.optim.Adam(model.parameters(), lr=3e-4)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=3e-4)
    try:
        try:
            from torch.distributed.fsdp import fully_shard  # 2.6 on
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # 2.4 and 2.5
    except Exception as e:  # 1.13 under Python 3.11 fails importing torch.distributed.fsdp
        raise RuntimeError(f"no fully_shard in PyTorch {torch.__version__} (FSDP2 came in 2.4): "
                           f"{type(e).__name__}: {e}") from e
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=3e-4)


def current_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train(a, shape):
    """The parameters, the median step, the losses, and the RSS before the model was built."""
    layers, width, heads = shape
    before = current_rss()
    torch.manual_seed(0)
    model = GPT(layers, width, heads, a.vocab, a.context, a.system == "fsdp+ckpt")
    params = sum(p.numel() for p in model.parameters())
    forward, opt = wrap(a.system, model)
    torch.manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, a.vocab, (a.batch, a.context + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    times, losses = [], []
    for step in range(a.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step > 0:
            times.append(time.perf_counter() - t0)
    return params, statistics.median(times), losses, before


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=["ddp", "zero", "fsdp", "fsdp+ckpt"])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--layers", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--framework", default="pytorch", help="the rows' framework: pytorch-VERSION")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("USE_LIBUV", "0")  # as bench/ddp_pytorch.py: Debian's has no libuv
    # A short timeout: should a rank hang, the job ends within minutes, not gloo's default half
    # hour.
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    shape = GPT2[a.model] if a.model in GPT2 else (a.layers, a.width, a.heads)
    row = {"system": a.system, "framework": a.framework, "ranks": dist.get_world_size()}
    try:
        params, step, losses, before = train(a, shape)
    except Exception as e:
        traceback.print_exc()
        # What this PyTorch does with the system (1.13 has no fully_shard) fails every rank alike:
        # each says so in the store and waits a minute for the others. A rank that failed alone
        # does not hear from them, and fails the job: the launcher stops it at once on a non-zero
        # exit, where the others may wait in a collective that will not come. (Not a barrier:
        # gloo's monitored_barrier times out on rank 0 only, and a collective pairs by count.)
        store = dist.distributed_c10d._get_default_store()
        store.set(f"paratrain-failed/{dist.get_rank()}", "1")
        try:
            store.wait([f"paratrain-failed/{r}" for r in range(dist.get_world_size())],
                       datetime.timedelta(seconds=60))
        except Exception:
            os._exit(3)
        if dist.get_rank() == 0:
            row["error"] = f"{type(e).__name__}: {e}"
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            try:  # last out: rank 0 may hold the store the others still talk to
                store.wait([f"paratrain-done/{r}" for r in range(1, dist.get_world_size())],
                           datetime.timedelta(seconds=60))
            except Exception:
                pass  # the row is written: a rank gone without a word ends no worse
        else:
            store.set(f"paratrain-done/{dist.get_rank()}", "1")
        os._exit(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = torch.tensor([step, float(peak), float(before)], dtype=torch.double)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        row.update({"params": params, "peak_rss_bytes": int(t[1].item()),
                    "rss_before_model_bytes": int(t[2].item()),
                    "step_seconds": t[0].item(), "first_loss": losses[0], "loss": losses[-1],
                    "steps": a.steps})
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    dist.barrier()
    # Not destroy_process_group and the interpreter's exit: once in 2.15 a rank aborted in its
    # teardown after FSDP2 ("terminate called without an active exception"), which would fail
    # a job whose row is written.
    os._exit(0)


if __name__ == "__main__":
    main()

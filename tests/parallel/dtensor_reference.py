"""PyTorch's own tensor parallelism (DTensor) on the GPT that tests/programs/tp_worker dumped.

    python dtensor_reference.py DIR HEADS RANKS TOLERANCE

DIR holds what `tp_worker --dump DIR` wrote: the whole initial weights, the batch, and the
logits and whole gradients of paratrain's tensor-parallel forward and backward. This script
starts RANKS processes on gloo, builds the same GPT from torch.nn.Linear layers (q, k and v
apart, as DTensor's ColwiseParallel takes them; the head untied: its gradient is added to the
embedding's), applies torchtitan's plan with torch.distributed.tensor.parallel.parallelize_module,
runs the same forward and backward, and compares logits and gradients with paratrain's. Prints
one line per quantity and exits 1 when any differs by more than TOLERANCE.
"""

import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

EPS = 1e-5  # GPT-2's LayerNorm eps, as paratrain's GPT


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.head_dim = width // heads
        self.ln_1 = nn.LayerNorm(width, eps=EPS)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width, eps=EPS)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)

    def attend(self, x):
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        head_dim = self.head_dim
        heads = q.shape[-1] // head_dim  # this rank's heads: ColwiseParallel split them

        def split(z):
            return z.view(b, t, heads, head_dim).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        y = (probs @ v).transpose(1, 2).reshape(b, t, heads * head_dim)
        return self.proj(y)

    def forward(self, x):
        x = x + self.attend(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, w, heads):
        super().__init__()
        vocab, width = w["embed.wte.weight"].shape
        context = w["embed.wpe.weight"].shape[0]
        layers = len({k.split(".")[0] for k in w if k.split(".")[0][1:].isdigit()})
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=EPS)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def load(model, w):
    """paratrain's weights (Conv1D: [in, out]; c_attn fused q, k, v) into the Linear GPT."""
    width = w["embed.wte.weight"].shape[1]
    with torch.no_grad():
        model.wte.weight.copy_(w["embed.wte.weight"])
        model.head.weight.copy_(w["embed.wte.weight"])
        model.wpe.weight.copy_(w["embed.wpe.weight"])
        model.ln_f.weight.copy_(w["ln_f.weight"])
        model.ln_f.bias.copy_(w["ln_f.bias"])
        for i, b in enumerate(model.h):
            p = f"h{i}."
            for ln in ("ln_1", "ln_2"):
                getattr(b, ln).weight.copy_(w[p + ln + ".weight"])
                getattr(b, ln).bias.copy_(w[p + ln + ".bias"])
            for j, name in enumerate(("q", "k", "v")):
                part = slice(j * width, (j + 1) * width)
                getattr(b, name).weight.copy_(w[p + "attn.c_attn.weight"][:, part].t())
                getattr(b, name).bias.copy_(w[p + "attn.c_attn.bias"][part])
            for mine, theirs in (("proj", "attn.c_proj"), ("fc", "mlp.c_fc"),
                                 ("fc_proj", "mlp.c_proj")):
                getattr(b, mine).weight.copy_(w[p + theirs + ".weight"].t())
                getattr(b, mine).bias.copy_(w[p + theirs + ".bias"])


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gradients(model):
    """The Linear GPT's gradients under paratrain's names and layouts."""
    g = {k: whole(p.grad) for k, p in model.named_parameters()}
    out = {
        "embed.wte.weight": g["wte.weight"] + g["head.weight"],
        "embed.wpe.weight": g["wpe.weight"],
        "ln_f.weight": g["ln_f.weight"],
        "ln_f.bias": g["ln_f.bias"],
    }
    for i in range(len(model.h)):
        p, m = f"h{i}.", f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[p + ln + ".weight"] = g[m + ln + ".weight"]
            out[p + ln + ".bias"] = g[m + ln + ".bias"]
        out[p + "attn.c_attn.weight"] = torch.cat([g[m + n + ".weight"].t() for n in "qkv"], 1)
        out[p + "attn.c_attn.bias"] = torch.cat([g[m + n + ".bias"] for n in "qkv"])
        for mine, theirs in (("proj", "attn.c_proj"), ("fc", "mlp.c_fc"),
                             ("fc_proj", "mlp.c_proj")):
            out[p + theirs + ".weight"] = g[m + mine + ".weight"].t()
            out[p + theirs + ".bias"] = g[m + mine + ".bias"]
    return out


def plan(layers):
    """torchtitan's Llama plan on this GPT, without sequence or loss parallelism."""
    p = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(layers):
        for name in ("q", "k", "v", "fc"):
            p[f"h.{i}.{name}"] = ColwiseParallel()
        for name in ("proj", "fc_proj"):
            p[f"h.{i}.{name}"] = RowwiseParallel()
    return p


def worker(rank, ranks, directory, heads, tolerance, failed):
    # A file rendezvous in DIR: no port to race for, and it goes with the directory.
    dist.init_process_group("gloo", init_method="file://" + os.path.join(directory, "rendezvous"),
                            rank=rank, world_size=ranks, timeout=timedelta(seconds=90))
    torch.set_num_threads(1)
    w = load_file(os.path.join(directory, "weights.safetensors"))
    batch = load_file(os.path.join(directory, "batch.safetensors"))
    model = Gpt(w, heads)
    load(model, w)
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh["tp"], plan(len(model.h)))
    logits = model(batch["input"])
    F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten()).backward()
    logits = whole(logits).detach()
    grads = gradients(model)
    if rank == 0:
        theirs = load_file(os.path.join(directory, "grads.safetensors"))
        rows = [("logits", logits,
                 load_file(os.path.join(directory, "logits.safetensors"))["logits"])]
        rows += [("grad " + k, grads[k], theirs[k]) for k in sorted(theirs)]
        worst = 0.0
        for name, a, b in rows:
            if a.shape != b.shape:
                print(f"{name}: shape {tuple(a.shape)} here, {tuple(b.shape)} in paratrain's")
                failed.value = 1
                continue
            d = (a - b).abs().max().item()
            worst = max(worst, d)
            if not d <= tolerance:
                print(f"{name}: differs by {d:.3g} (tolerance {tolerance:g})")
                failed.value = 1
        print(f"torch {torch.__version__} DTensor on {ranks} gloo ranks: logits and "
              f"{len(rows) - 1} gradients, largest difference {worst:.3g}")
    dist.barrier()
    dist.destroy_process_group()


def main():
    directory, heads, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tolerance = float(sys.argv[4])
    failed = mp.get_context("spawn").Value("i", 0)
    mp.spawn(worker, args=(ranks, directory, heads, tolerance, failed), nprocs=ranks)
    sys.exit(failed.value)


if __name__ == "__main__":
    main()

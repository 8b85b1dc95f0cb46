#!/usr/bin/env python3
"""PyTorch's Adam(fused=True) on the CPU over a sequence of gradients, for
FusedOptimizerPyTorch.AdamMatchesPyTorchsFusedAdam: reads the initial parameters ("p.N") and the
gradients of every step ("g.STEP.N") from a safetensors file, steps Adam (or AdamW with
--decoupled) with the given settings, and writes the final parameters ("p.N") to --out."""
import argparse

import torch
from safetensors.torch import load_file, save_file


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--decoupled", action="store_true")
    p.add_argument("--amsgrad", action="store_true")
    args = p.parse_args()
    t = load_file(args.inputs)
    count = sum(1 for k in t if k.startswith("p."))
    params = [t[f"p.{i}"].clone().requires_grad_() for i in range(count)]
    kind = torch.optim.AdamW if args.decoupled else torch.optim.Adam
    opt = kind(params, lr=args.lr, weight_decay=args.weight_decay, amsgrad=args.amsgrad,
               fused=True)
    for step in range(args.steps):
        for i, param in enumerate(params):
            param.grad = t[f"g.{step}.{i}"].clone()
        opt.step()
    save_file({f"p.{i}": param.detach().contiguous() for i, param in enumerate(params)}, args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/python3
# A GPT-2 in plain PyTorch with Hugging Face's names and layout (GPT2LMHeadModel: transformer.wte,
# transformer.wpe, transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj},
# transformer.ln_f, lm_head tied to wte; Conv1D weights [in, out]), written here because Debian's
# python3-torch comes without transformers. Its forward follows Hugging Face's GPT2Attention:
# scores divided by sqrt(head_dim), masked with the dtype's lowest value, softmax, then the values.
# The reference for tests/models/gpt_test.cpp.
#
# Usage:
#   gpt_reference.py logits <out prefix>
#       a small GPT-2 (2 layers, width 64, 4 heads, vocab 97, context 32) with random weights
#       (seed 0), in eval mode, on a fixed batch of 3 x 32 tokens; writes
#         <prefix>_weights.safetensors  its state dict as Hugging Face saves it: lm_head.weight
#                                       (a copy of wte) and the attention masks (attn.bias)
#                                       included, which a loader must ignore
#         <prefix>_ref.safetensors      "tokens" (int64 [3, 32]) and "logits" (float32 [3, 32, 97])
#   gpt_reference.py counts
#       prints "count NAME N" for each preset and for "small" (the shape above): the parameters
#       of a model built on the meta device (no memory), the tied head counted once
import json
import math
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {  # Hugging Face's configs: n_layer, n_embd, n_head; vocab 50257, n_positions 1024
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
SMALL = dict(layers=2, width=64, heads=4, vocab=97, context=32)


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: a Linear with its weight stored [in, out]."""

    def __init__(self, n_in, n_out, device=None):
        super().__init__()
        self.n_out = n_out
        self.weight = nn.Parameter(torch.empty(n_in, n_out, device=device))
        self.bias = nn.Parameter(torch.zeros(n_out, device=device))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.n_out,))


class Attention(nn.Module):
    def __init__(self, width, heads, context, device=None):
        super().__init__()
        self.heads = heads
        self.c_attn = Conv1D(width, 3 * width, device)
        self.c_proj = Conv1D(width, width, device)
        # Hugging Face keeps the causal mask as a buffer "bias" (saved by older versions).
        mask = torch.tril(torch.ones(context, context, device=device))
        self.register_buffer("bias", mask.view(1, 1, context, context))

    def forward(self, x):
        batch, length, width = x.shape
        head_dim = width // self.heads
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(head_dim)
        causal = self.bias[:, :, :length, :length].bool()
        scores = torch.where(causal, scores, torch.tensor(torch.finfo(scores.dtype).min))
        y = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class Mlp(nn.Module):
    def __init__(self, width, device=None):
        super().__init__()
        self.c_fc = Conv1D(width, 4 * width, device)
        self.c_proj = Conv1D(4 * width, width, device)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's gelu_new


class Block(nn.Module):
    def __init__(self, width, heads, context, device=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=1e-5, device=device)
        self.attn = Attention(width, heads, context, device)
        self.ln_2 = nn.LayerNorm(width, eps=1e-5, device=device)
        self.mlp = Mlp(width, device)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, layers, width, heads, vocab, context, device=None):
        super().__init__()
        self.wte = nn.Embedding(vocab, width, device=device)
        self.wpe = nn.Embedding(context, width, device=device)
        self.h = nn.ModuleList(Block(width, heads, context, device) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5, device=device)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, layers, width, heads, vocab, context, device=None):
        super().__init__()
        self.transformer = Transformer(layers, width, heads, vocab, context, device)
        self.lm_head = nn.Linear(width, vocab, bias=False, device=device)
        self.lm_head.weight = self.transformer.wte.weight  # tied: parameters() lists it once

    def forward(self, tokens):
        t = self.transformer
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = t.wte(tokens) + t.wpe(positions)
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def save_safetensors(tensors, path):
    """The safetensors format by hand (the safetensors package may be missing): an 8-byte
    little-endian header length, the JSON header, then each tensor's little-endian bytes."""
    names = {torch.float32: "F32", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        blob = t.numpy().tobytes()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format allows trailing spaces; aligns the data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def write_logits(prefix):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(**SMALL)
    # Weights far from any initialisation (LayerNorms included), so that a tensor loaded into
    # the wrong place, or not at all, moves the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.normal_(1, 0.1)
            elif name.endswith("wte.weight") or name.endswith("wpe.weight"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.1)
    model.eval()
    tokens = torch.randint(0, SMALL["vocab"], (3, SMALL["context"]))
    with torch.no_grad():
        logits = model(tokens)
    save_safetensors(dict(model.state_dict()), prefix + "_weights.safetensors")
    save_safetensors({"tokens": tokens, "logits": logits}, prefix + "_ref.safetensors")


def print_counts():
    shapes = {name: dict(layers=l, width=w, heads=h, vocab=50257, context=1024)
              for name, (l, w, h) in PRESETS.items()}
    shapes["small"] = SMALL
    for name, shape in shapes.items():
        model = GPT2LMHeadModel(**shape, device="meta")
        print("count %s %d" % (name, sum(p.numel() for p in model.parameters())))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "logits":
        write_logits(sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "counts":
        print_counts()
    else:
        sys.exit("usage: gpt_reference.py logits <out prefix> | gpt_reference.py counts")

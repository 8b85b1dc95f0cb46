#!/usr/bin/env python3
# Hugging Face GPT-2 models made by transformers itself, for tests/models/hf_gpt2_test.cpp: each
# from a GPT2Config with random weights (a fixed seed; nothing is downloaded), saved with
# save_pretrained whole and in shards, with their logits and greedy generations; and the logits
# of models paratrain exported, loaded with from_pretrained. Run with HF_HUB_OFFLINE=1 and
# TRANSFORMERS_OFFLINE=1 by the Python of PARATRAIN_HF_PYTHON (scripts/venv.sh).
#
# Usage:
#   hf_gpt2_reference.py make OUT
#       writes, for each model NAME of MODELS below,
#         OUT/NAME          save_pretrained(OUT/NAME): config.json and model.safetensors
#         OUT/NAME-sharded  the same model with save_pretrained(max_shard_size=its shard size):
#                           shards and model.safetensors.index.json
#       and OUT/reference.safetensors ("NAME.tokens", int64 [2, T]; "NAME.logits", float32
#       [2, T, vocab], in eval mode) and OUT/generate.json ({NAME: {"prompt": [...],
#       "max_new_tokens": N, "greedy": [...]}}: generate(do_sample=False), prompt included)
#   hf_gpt2_reference.py logits TOKENS OUT DIR...
#       loads each DIR with GPT2LMHeadModel.from_pretrained and writes to OUT (safetensors) its
#       logits on TOKENS's "tokens" (int64 [B, T]) as "logits.I", I the DIR's position
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

# name: GPT2Config fields, save_pretrained's max_shard_size for the sharded copy, the prompt, and
# how many tokens to generate. "gpt2-2l" is gpt2's shape with 2 of its 12 layers; "small" has
# another head count (3) and context (48), and a vocabulary without GPT-2's <|endoftext|>.
MODELS = {
    "gpt2-2l": (dict(n_layer=2), "20MB", [464, 3290, 318, 257], 12),
    "small": (
        dict(n_layer=3, n_embd=96, n_head=3, n_positions=48, vocab_size=211,
             bos_token_id=None, eos_token_id=None),
        "100KB", [5, 17, 42], 20),
}


def make_model(name, fields, seed):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**fields))
    # transformers initialises the LayerNorms to ones and zeros and every bias to zero: spread
    # them, so that a tensor left unloaded (or loaded into the wrong place) moves the logits. At
    # its own scale a random GPT-2 repeats one token when generating; larger position embeddings
    # and attention and MLP inputs (std 1 / sqrt(n_embd): unit-scale queries, keys and MLP
    # activations) make each step's choice depend on the sequence so far.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".ln_" in pname or pname.startswith("transformer.ln_f"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if pname.endswith("weight") else 0.0))
            elif pname.endswith(".bias"):
                p.normal_(0, 0.02)
            elif pname.endswith("wpe.weight"):
                p.normal_(0, 0.3)
            elif pname.endswith("c_attn.weight") or pname.endswith("c_fc.weight"):
                p.normal_(0, model.config.n_embd ** -0.5)
    return model.eval()


def make(out):
    reference, generations = {}, {}
    for seed, (name, (fields, shard_size, prompt, new_tokens)) in enumerate(MODELS.items()):
        model = make_model(name, fields, seed)
        model.save_pretrained(f"{out}/{name}")
        model.save_pretrained(f"{out}/{name}-sharded", max_shard_size=shard_size)
        config = model.config
        tokens = torch.randint(0, config.vocab_size, (2, min(config.n_positions, 40)))
        with torch.no_grad():
            reference[f"{name}.logits"] = model(tokens).logits.contiguous()
            prompt_ids = torch.tensor([prompt])
            greedy = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                    do_sample=False, max_new_tokens=new_tokens,
                                    pad_token_id=config.eos_token_id or 0)
        reference[f"{name}.tokens"] = tokens
        generations[name] = dict(prompt=prompt, max_new_tokens=new_tokens,
                                 greedy=greedy[0].tolist())
    save_file(reference, f"{out}/reference.safetensors")
    with open(f"{out}/generate.json", "w") as f:
        json.dump(generations, f)


def logits(tokens_file, out, dirs):
    tokens = load_file(tokens_file)["tokens"]
    result = {}
    for i, d in enumerate(dirs):
        model = GPT2LMHeadModel.from_pretrained(d).eval()
        with torch.no_grad():
            result[f"logits.{i}"] = model(tokens).logits.float().contiguous()
    save_file(result, out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "logits":
        logits(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit("usage: hf_gpt2_reference.py make OUT | logits TOKENS OUT DIR...")

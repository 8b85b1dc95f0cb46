#!/usr/bin/env python3
"""The largest GPT each device mesh trains with Adam under a memory budget (half this machine's by
default): a binary search over the number of blocks of a GPT of gpt2-medium's width (1024, 16
heads, context 256, vocabulary 50304), one measured run per probe.

A probe fits when its largest rank's peak resident memory times the ranks is within the budget.
Meshes without pipeline stages run as `paratrain bench parallel` (2 steps, one sequence per
data-parallel rank), which reports the largest rank's peak; meshes with --pp run as `paratrain
train` (2 Adam steps on a small token file made here), whose largest rank's peak GNU time reports
(the launcher waits for its ranks, so its children's peak is theirs).

    python3 bench/largest_gpt.py [--paratrain build/bin/paratrain] [--budget-gib 12]
        [--mesh "tp4+sp+lp:4:24:48" --mesh "--pp 2 --tp 2:4:16:48" ...]

A mesh is NAME:RANKS:LOW:HIGH (the blocks searched); NAME is a `bench parallel` mesh, or the
`paratrain train` flags of one with --pp. Prints one JSON row per probe, then per mesh
{"mesh", "ranks", "layers", "params", "peak_rss_bytes", "budget_bytes"}.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

WIDTH, HEADS, VOCAB, CONTEXT = 1024, 16, 50304, 256
DEFAULT_MESHES = [
    "tp4+sp+lp:4:24:48",
    "tp2+sp+lp,fsdp2:4:16:48",
    "fsdp4:4:8:40",
    "fsdp2,replicate2:4:4:40",
    "fsdp2:2:8:56",
    "--pp 2 --tp 2:4:16:48",
    "--pp 2 --dp-shard 2:4:8:48",
]


def params(layers):
    """gpt_parameter_count for these shapes: blocks, token and position embeddings, ln_f."""
    block = 12 * WIDTH * WIDTH + 13 * WIDTH
    return block * layers + VOCAB * WIDTH + CONTEXT * WIDTH + 2 * WIDTH


def token_dir():
    """Token files of random ids (train and a 2-window validation set): enough for 2 steps."""
    d = tempfile.mkdtemp(prefix="largest-gpt-")
    rnd = os.urandom(2 * 4096)
    with open(os.path.join(d, "train.bin"), "wb") as f:
        f.write(bytes(b if i % 2 == 0 else 0 for i, b in enumerate(rnd)))
    with open(os.path.join(d, "val.bin"), "wb") as f:
        f.write(bytes(b if i % 2 == 0 else 0 for i, b in enumerate(rnd[: 2 * 600])))
    return d


def probe_bench(paratrain, mesh, layers, ranks):
    out = subprocess.run([paratrain, "bench", "parallel", "--json", "--meshes", mesh,
                          "--layers", str(layers), "--steps", "2", "--nproc-per-node", str(ranks)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, {"error": out.stderr.strip().splitlines()[-1:]}
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return row["peak_rss_bytes"], {"step_seconds": row["step_seconds"], "loss": row["loss"]}


def probe_train(paratrain, flags, layers, ranks, tokens):
    cmd = ["/usr/bin/time", "-f", "MAXRSS %M", paratrain, "train", "--model", "gpt",
           "--layers", str(layers), "--width", str(WIDTH), "--heads", str(HEADS),
           "--vocab", str(VOCAB), "--context", str(CONTEXT), "--dataset", "tokens",
           "--data-dir", tokens, "--device", "cpu", "--steps", "2", "--batch-size", "1",
           "--optimizer", "adam", "--lr", "1e-4", "--nproc-per-node", str(ranks),
           "--chunks", "1"] + flags.split()
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env=dict(os.environ, PARATRAIN_TIMEOUT="600"))
    text = out.stdout + out.stderr
    rss = [line for line in text.splitlines() if line.startswith("MAXRSS")]
    if out.returncode != 0 or not rss:
        return None, {"error": text.strip().splitlines()[-1:]}
    epoch = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    return int(rss[-1].split()[1]) * 1024, {"epoch": epoch}


def search(args, spec, tokens):
    name, ranks, low, high = spec.rsplit(":", 3)
    ranks, low, high = int(ranks), int(low), int(high)
    best = None
    while low <= high:
        mid = (low + high) // 2
        if name.startswith("--"):
            rss, info = probe_train(args.paratrain, name, mid, ranks, tokens)
        else:
            rss, info = probe_bench(args.paratrain, name, mid, ranks)
        fits = rss is not None and rss * ranks <= args.budget
        print(json.dumps({"mesh": name, "layers": mid, "params": params(mid),
                          "peak_rss_bytes": rss, "fits": fits, **info}), flush=True)
        if fits:
            best = (mid, rss)
            low = mid + 1
        else:
            high = mid - 1
    print(json.dumps({"mesh": name, "ranks": ranks, "layers": best and best[0],
                      "params": best and params(best[0]), "peak_rss_bytes": best and best[1],
                      "budget_bytes": args.budget}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paratrain", default="build/bin/paratrain")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="default: half of this machine's memory")
    parser.add_argument("--mesh", action="append", help="NAME:RANKS:LOW:HIGH (repeatable)")
    args = parser.parse_args()
    if args.budget_gib is None:
        args.budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    else:
        args.budget = int(args.budget_gib * 2**30)
    tokens = token_dir()
    for spec in args.mesh or DEFAULT_MESHES:
        search(args, spec, tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

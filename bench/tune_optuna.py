#!/usr/bin/env python3
"""Optuna's side of `paratrain bench tune`: the same search as paratrain's (the mlp on
Fashion-MNIST, lr loguniform(1e-3, 0.3), batch choice(32, 64, 128, 256), hidden choice(128, 256,
512), dropout uniform(0, 0.5); at most 2 epochs a trial, test accuracy reported every quarter
epoch; 1 thread) with Debian's python3-optuna and python3-torch. Prints one JSON row."""
import argparse
import gzip
import json
import math
import time

import numpy as np
import optuna
import torch
import torch.nn as nn

MEAN, STD = 0.2860, 0.3530


def read_idx(path, images):
    with gzip.open(path, "rb") as f:
        data = f.read()
    offset = 16 if images else 8
    arr = np.frombuffer(data, dtype=np.uint8, offset=offset)
    return torch.from_numpy(arr.reshape(-1, 28 * 28).copy() if images else arr.copy())


def load(root):
    def split(name):
        x = read_idx(f"{root}/{name}-images-idx3-ubyte.gz", True).float().div_(255).sub_(MEAN).div_(STD)
        y = read_idx(f"{root}/{name}-labels-idx1-ubyte.gz", False).long()
        return x, y

    return split("train") + split("t10k")


def mlp(hidden, dropout):
    # The zoo's mlp (paratrain models::make("mlp")) with hidden units and dropout as parameters.
    return nn.Sequential(
        nn.Linear(784, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, hidden // 2), nn.BatchNorm1d(hidden // 2), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden // 2, 10))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", choices=["tpe", "random"], default="tpe")
    p.add_argument("--pruner", choices=["hyperband", "none"], default="hyperband")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--quarters", type=int, default=8, help="quarter epochs a trial runs at most")
    # The first N images only (paratrain bench tune --smoke): an epoch is then a pass over them.
    p.add_argument("--train-images", type=int, default=60000)
    p.add_argument("--test-images", type=int, default=10000)
    a = p.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    xtr, ytr, xte, yte = load(a.data_dir)
    xtr, ytr = xtr[:a.train_images], ytr[:a.train_images]
    xte, yte = xte[:a.test_images], yte[:a.test_images]
    used = [0]

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-3, 0.3, log=True)
        batch = trial.suggest_categorical("batch", [32, 64, 128, 256])
        hidden = trial.suggest_categorical("hidden", [128, 256, 512])
        dropout = trial.suggest_float("dropout", 0.0, 0.5)
        g = torch.Generator().manual_seed(a.seed * 1000 + trial.number)
        torch.manual_seed(a.seed * 1000 + trial.number)
        model = mlp(hidden, dropout)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        per_quarter = math.ceil(len(xtr) / batch / 4)
        perm, pos, acc = torch.randperm(len(xtr), generator=g), 0, 0.0
        for q in range(1, a.quarters + 1):
            model.train()
            for _ in range(per_quarter):
                if pos + batch > len(perm):
                    perm, pos = torch.randperm(len(xtr), generator=g), 0
                idx = perm[pos:pos + batch]
                pos += batch
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                acc = (model(xte).argmax(1) == yte).float().mean().item()
            used[0] += 1
            trial.report(acc, q)
            if a.pruner == "hyperband" and trial.should_prune():
                raise optuna.TrialPruned()
        return acc

    sampler = (optuna.samplers.TPESampler(seed=a.seed) if a.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=a.seed))
    pruner = (optuna.pruners.HyperbandPruner(min_resource=1, max_resource=a.quarters, reduction_factor=3)
              if a.pruner == "hyperband" else optuna.pruners.NopPruner())
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
    start = time.perf_counter()
    study.optimize(objective, n_trials=a.trials, n_jobs=1)
    wall = time.perf_counter() - start
    print(json.dumps({"best_accuracy": study.best_value, "epochs_used": used[0] / 4,
                      "wall_seconds": wall}))


if __name__ == "__main__":
    main()

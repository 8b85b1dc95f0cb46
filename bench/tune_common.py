"""What the Python sides of `paratrain bench tune` share (bench/tune_optuna.py, bench/tune_ray.py):
Fashion-MNIST, the model, and a trial's training a quarter epoch at a time, as paratrain's trial
does it (bench/tune.cpp: run_trial), so that a trial resumed from its checkpoint continues the
same sequence. Runs under any PyTorch from 1.13 on."""
import gzip
import math

import numpy as np
import torch
import torch.nn as nn

MEAN, STD = 0.2860, 0.3530
DATA_DIR = "/usr/share/datasets/fashion-mnist"

# The search, as paratrain's: lr loguniform(1e-3, 0.3), batch choice(32, 64, 128, 256), hidden
# choice(128, 256, 512), dropout uniform(0, 0.5).
LR = (1e-3, 0.3)
BATCHES = [32, 64, 128, 256]
HIDDEN = [128, 256, 512]
DROPOUT = (0.0, 0.5)


def read_idx(path, images):
    with gzip.open(path, "rb") as f:
        data = f.read()
    arr = np.frombuffer(data, dtype=np.uint8, offset=16 if images else 8)
    return arr.reshape(-1, 28 * 28) if images else arr


def load(train_images, test_images, root=DATA_DIR):
    """(train_x, train_y, test_x, test_y) as numpy arrays: the first images of each split,
    normalized as paratrain's FashionMNIST (torchvision's Normalize((0.2860,), (0.3530,)))."""
    def split(name, n):
        x = read_idx(f"{root}/{name}-images-idx3-ubyte.gz", True)[:n]
        y = read_idx(f"{root}/{name}-labels-idx1-ubyte.gz", False)[:n]
        return ((x.astype(np.float32) / 255 - MEAN) / STD).astype(np.float32), y.astype(np.int64)

    return split("train", train_images) + split("t10k", test_images)


def mlp(hidden, dropout):
    # The zoo's mlp (paratrain models::make("mlp")) with hidden units and dropout as parameters.
    return nn.Sequential(
        nn.Linear(784, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden, hidden // 2), nn.BatchNorm1d(hidden // 2), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(hidden // 2, 10))


def train_quarter(model, opt, xtr, ytr, batch, trial_seed, quarter):
    """A quarter epoch of SGD: batches of `batch` drawn in order from a permutation seeded by the
    trial and the quarter, as paratrain's run_trial."""
    n = len(xtr)
    g = torch.Generator().manual_seed(trial_seed * 100 + quarter)
    perm = torch.randperm(n, generator=g)
    model.train()
    for s in range(math.ceil(n / (batch * 4))):
        start = (s * batch) % (n - batch)
        idx = perm[start:start + batch]
        opt.zero_grad()
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()


def accuracy(model, xte, yte):
    model.eval()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).double().mean().item()

#!/usr/bin/python3
# PyTorch's side of `paratrain bench amp-accuracy`: the zoo's CNN (paratrain::models::make("cnn"),
# written here with the same layers in the same order, so torch.manual_seed(seed) gives the same
# initial weights) trained on the first steps x 64 Fashion-MNIST training images with SGD (lr 0.05,
# momentum 0.9), then scored on the first --test-images test images. One JSON line per (level,
# seed):
#   O0  fp32
#   O1  torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's own CPU autocast
#   O2  apex's O2 by hand: the model in bf16 but BatchNorm, fp32 master weights for SGD
#   O3  the whole model in bf16
# Usage: amp_accuracy_pytorch.py [--levels O0,O1,O2,O3] [--seeds 0,1,2] [--steps 900]
#                                [--test-images 10000] [--data /usr/share/datasets/fashion-mnist]
import argparse
import gzip
import json
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530  # paratrain::data::kFashionMnistMean, kFashionMnistStd


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def load(root, split):
    images = read_idx(f"{root}/{split}-images-idx3-ubyte.gz").unsqueeze(1).float()
    images = images.div_(255.0).sub_(MEAN).div_(STD)
    return images, read_idx(f"{root}/{split}-labels-idx1-ubyte.gz").long()


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(128, 10))


def train(level, seed, steps, train_set, test_set, test_images):
    torch.manual_seed(seed)
    model = make_cnn()
    if level in ("O2", "O3"):
        for m in model.modules():
            if level == "O2" and isinstance(m, nn.BatchNorm2d):
                continue
            for p in m.parameters(recurse=False):
                p.data = p.data.bfloat16()
            for name, b in m.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(m, name, b.bfloat16())
    params = list(model.parameters())
    masters = params
    if level == "O2":
        masters = [p if p.dtype == torch.float32 else
                   p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.SGD(masters, lr=0.05, momentum=0.9)
    half = level in ("O2", "O3")
    images, targets = train_set
    model.train()
    for s in range(steps):
        x, y = images[s * 64:(s + 1) * 64], targets[s * 64:(s + 1) * 64]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=level == "O1"):
            out = model(x.bfloat16() if half else x)
            loss = F.cross_entropy(out.float(), y)
        loss.backward()
        if level == "O2":
            for p, m in zip(params, masters):
                if m is not p:
                    m.grad = p.grad.float()
                    p.grad = None
        opt.step()
        if level == "O2":
            with torch.no_grad():
                for p, m in zip(params, masters):
                    if m is not p:
                        p.copy_(m)
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=level == "O1"):
        x, y = test_set[0][:test_images], test_set[1][:test_images]
        predicted = model(x.bfloat16() if half else x).float().argmax(1)
    return predicted.eq(y).double().mean().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="O0,O1,O2,O3")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--test-images", type=int, default=10000)
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args()
    levels = args.levels.split(",")
    unknown = [level for level in levels if level not in ("O0", "O1", "O2", "O3")]
    if unknown:
        parser.error("unknown opt level %r: choose from O0, O1, O2, O3" % unknown[0])
    train_set, test_set = load(args.data, "train"), load(args.data, "t10k")
    for seed in [int(s) for s in args.seeds.split(",")]:
        for level in levels:
            start = time.time()
            acc = train(level, seed, args.steps, train_set, test_set, args.test_images)
            print(json.dumps({"system": "pytorch", "torch": torch.__version__, "level": level,
                              "seed": seed, "steps": args.steps, "test_images": args.test_images,
                              "accuracy": acc, "seconds": round(time.time() - start, 1)}),
                  flush=True)


if __name__ == "__main__":
    main()

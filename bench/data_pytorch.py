#!/usr/bin/env python3
# PyTorch's side of `paratrain bench data`: torchvision.datasets.ImageFolder (PIL decoding) through
# torch.utils.data.DataLoader with N worker processes, RandomResizedCrop + RandomHorizontalFlip +
# ToTensor + Normalize, as the ImageNet examples train. Appends one JSON row per timed epoch. Runs
# under any PyTorch from 1.13 on with its torchvision.
import argparse
import json
import time

import torch
import torchvision
from torchvision import transforms as T

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--workers", type=int, required=True)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--crop", type=int, default=224)
p.add_argument("--repeat", type=int, default=0)
p.add_argument("--system", default="pytorch", help="the row's system: pytorch-VERSION")
p.add_argument("--out", required=True)
a = p.parse_args()

torch.set_num_threads(1)
transform = T.Compose([
    T.RandomResizedCrop(a.crop),
    T.RandomHorizontalFlip(),
    T.ToTensor(),
    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
])
dataset = torchvision.datasets.ImageFolder(a.dir, transform)
loader = torch.utils.data.DataLoader(dataset, batch_size=a.batch, shuffle=True,
                                     num_workers=a.workers)
start = time.perf_counter()
images = 0
for x, y in loader:
    images += x.shape[0]
seconds = time.perf_counter() - start
with open(a.out, "a") as f:
    f.write(json.dumps({"system": a.system, "workers": a.workers, "repeat": a.repeat,
                        "images_per_second": images / seconds}) + "\n")

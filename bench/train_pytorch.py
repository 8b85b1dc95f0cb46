#!/usr/bin/env python3
# PyTorch's own training step on data already on the GPU: the ceiling that `paratrain train` is
# compared with (scripts/gpu-check.sh). ResNet-50 (torchvision's, or the same architecture written
# here when torchvision is absent), SGD with momentum, torch.autocast + GradScaler for fp16, a
# fixed random batch. Prints one JSON line: images per second over the timed steps.
import argparse
import json
import time

import torch
import torch.nn as nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def resnet50(num_classes):
    try:
        import torchvision

        return torchvision.models.resnet50(num_classes=num_classes)
    except ImportError:
        pass
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    inplanes = 64
    for planes, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(blocks):
            s = stride if i == 0 else 1
            down = None
            if s != 1 or inplanes != planes * 4:
                down = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, s, bias=False),
                                     nn.BatchNorm2d(planes * 4))
            layers.append(Bottleneck(inplanes, planes, s, down))
            inplanes = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, num_classes)]
    return nn.Sequential(*layers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50", choices=["resnet50"])
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--amp", default="fp16", choices=["none", "fp16", "bf16"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = resnet50(10).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=a.amp == "fp16")
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=dev)
    y = torch.randint(0, 10, (a.batch_size,), device=dev)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"system": "pytorch", "model": a.model, "batch": a.batch_size,
                      "amp": a.amp, "images_per_sec": a.batch_size * a.steps / seconds,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()

#!/usr/bin/python3
# Reference outputs of torchvision for paratrain's decoders and transforms. For each image file
# NAME in <dir> (written by the C++ test): PIL's Image.open(f).convert("RGB") as a uint8 tensor
# [3, H, W] ("decoded/NAME"); for the files listed in <transform files>, torchvision's functional
# transforms on that tensor, antialias on ("NAME/<op>"). Saved with torch.save to <out>.
# Usage: make_transforms_reference.py <dir> <out.pt> <name>...
import os
import sys

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
from PIL import Image

folder, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
ref = {}
for name in sorted(os.listdir(folder)):
    with Image.open(os.path.join(folder, name)) as img:
        ref["decoded/" + name] = F.pil_to_tensor(img.convert("RGB")).contiguous()
mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
for name in names:
    t = ref["decoded/" + name]
    ops = {
        "resize_up": F.resize(t, 256, antialias=True),
        "resize_down": F.resize(t, 64, antialias=True),
        "resize_exact": F.resize(t, [50, 80], antialias=True),
        "resize_float": F.resize(F.convert_image_dtype(t, torch.float), 57, antialias=True),
        "center_crop": F.center_crop(t, [61, 90]),
        "resized_crop": F.resized_crop(t, 10, 5, 120, 90, [224, 224], antialias=True),
        "hflip": F.hflip(t),
        "val_pipeline": T.Compose([T.Resize(73, antialias=True), T.CenterCrop(64),
                                   T.ConvertImageDtype(torch.float),
                                   T.Normalize(mean, std)])(t),
    }
    for op, value in ops.items():
        ref[name + "/" + op] = value.contiguous()
torch.save(ref, out)

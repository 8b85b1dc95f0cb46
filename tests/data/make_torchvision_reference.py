#!/usr/bin/python3
# Writes, for torchvision's resnet<depth> (random weights, seed 0, eval mode):
#   <out>_state.pt    dict(model.state_dict()) as torch.save writes it
#   <out>_ordered.pt  model.state_dict() itself (an OrderedDict with _metadata)
#   <out>_ref.pt      {"input": x, "logits": model(x)} for a fixed 2x3x64x64 input
# Usage: make_torchvision_reference.py <depth> <out prefix>
import sys

import torch
import torchvision

depth, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = getattr(torchvision.models, "resnet%d" % depth)()
# Non-trivial running statistics, so the test also checks that buffers load.
with torch.no_grad():
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
model.eval()
x = torch.randn(2, 3, 64, 64)
with torch.no_grad():
    logits = model(x)
torch.save(dict(model.state_dict()), out + "_state.pt")
torch.save(model.state_dict(), out + "_ordered.pt")
torch.save({"input": x, "logits": logits}, out + "_ref.pt")

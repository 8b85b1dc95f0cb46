# A script written for torch.distributed.launch: it takes its local rank from --local_rank, as
# PyTorch's documentation for that launcher shows, and checks that LOCAL_RANK agrees. Then the
# ranks meet through env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) and sum their local ranks.
import argparse
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--tag", default="")
args = parser.parse_args()

env_local = int(os.environ["LOCAL_RANK"])
if args.local_rank != env_local:
    print(f"--local_rank={args.local_rank} but LOCAL_RANK={env_local}", flush=True)
    sys.exit(3)
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([float(args.local_rank)])
dist.all_reduce(total)
world = dist.get_world_size()
want = world * (world - 1) / 2
if total.item() != want:
    print(f"sum of local ranks {total.item()}, expected {want}", flush=True)
    sys.exit(4)
print(f"rank {dist.get_rank()}: local_rank {args.local_rank} agrees with LOCAL_RANK "
      f"(tag {args.tag})", flush=True)
dist.destroy_process_group()

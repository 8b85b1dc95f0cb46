#!/usr/bin/env python3
"""Expected results of every torch.distributed collective, for comparison with paratrain's.

Usage: collectives_reference.py WORLD OUT_DIR

Starts WORLD processes on gloo, runs each collective on the inputs that
tests/programs/collective_worker.cpp (mode "reference") builds the same way, and saves each rank's
results to OUT_DIR/rank-R.pt (torch.save of a dict of tensors). Where this PyTorch's gloo lacks an
operation (all_to_all, all_gather_into_tensor and reduce_scatter_tensor in some versions), the
result comes from the torch.distributed operations it is defined by, which the dict records under
"composed/<name>".
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def values(seed, numel, dtype):
    """seed's inputs: small integers (-4..4), quarters as floats: every sum is exact."""
    i = torch.arange(numel, dtype=torch.int64)
    v = (seed * 7 + i * 3) % 9 - 4
    return (v.to(torch.float32) / 4) if dtype == torch.float32 else v.to(dtype)


def bits(seed, numel):
    i = torch.arange(numel, dtype=torch.int64)
    return (seed * 37 + i * 11) % 64


def as_bytes(b):
    return torch.tensor(list(b), dtype=torch.uint8)


def fallback(out, name, run, compose):
    try:
        run()
    except (RuntimeError, AttributeError, NotImplementedError):
        compose()
        out["composed/" + name] = torch.ones(1)


def worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)
    out = {}
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "product": dist.ReduceOp.PRODUCT}
    for name, op in ops.items():
        for dtype, tag in ((torch.float32, "f32"), (torch.int64, "i64")):
            t = values(rank, 7, dtype)
            dist.all_reduce(t, op)
            out["allreduce_%s_%s" % (name, tag)] = t
    t = values(rank, 7, torch.float32)
    dist.all_reduce(t)
    out["allreduce_avg_f32"] = t / world  # gloo has no AVG
    bitwise = {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
    for name, op in bitwise.items():
        t = bits(rank, 7)
        dist.all_reduce(t, op)
        out["allreduce_%s_i64" % name] = t

    t = values(rank, 6, torch.float32)
    dist.reduce(t, dst=world - 1)
    if rank == world - 1:
        out["reduce_sum_f32"] = t
    t = values(rank, 6, torch.int64)
    dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
    if rank == 0:
        out["reduce_product_i64"] = t

    dst = 1 % world
    gathered = [torch.zeros(5) for _ in range(world)] if rank == dst else None
    dist.gather(values(rank + 10, 5, torch.float32), gathered, dst=dst)
    if rank == dst:
        for k, g in enumerate(gathered):
            out["gather_%d" % k] = g

    src = world - 1
    received = torch.zeros(3, dtype=torch.int64)
    pieces = [values(100 + k, 3, torch.int64) for k in range(world)] if rank == src else None
    dist.scatter(received, pieces, src=src)
    out["scatter"] = received

    # all_to_all: rank r's piece for rank p has (r + p) % 3 + 1 rows of 2.
    inputs = [values(rank * 10 + p, ((rank + p) % 3 + 1) * 2, torch.float32).view(-1, 2)
              for p in range(world)]
    outputs = [torch.zeros((p + rank) % 3 + 1, 2) for p in range(world)]

    def all_to_all_composed():
        flat_out = torch.zeros(sum(o.numel() for o in outputs))
        dist.all_to_all_single(flat_out, torch.cat([i.reshape(-1) for i in inputs]),
                               [o.numel() for o in outputs], [i.numel() for i in inputs])
        at = 0
        for o in outputs:
            o.copy_(flat_out[at:at + o.numel()].view_as(o))
            at += o.numel()
    fallback(out, "all_to_all", lambda: dist.all_to_all(outputs, inputs), all_to_all_composed)
    for p, o in enumerate(outputs):
        out["all_to_all_%d" % p] = o

    # all_to_all_single, uneven: rank r sends (r + 2p) % 3 rows (some empty) to rank p.
    in_splits = [(rank + 2 * p) % 3 for p in range(world)]
    out_splits = [(p + 2 * rank) % 3 for p in range(world)]
    source = values(rank + 20, sum(in_splits) * 2, torch.int64).view(-1, 2)
    target = torch.zeros(sum(out_splits), 2, dtype=torch.int64)
    dist.all_to_all_single(target, source, out_splits, in_splits)
    out["all_to_all_single_uneven"] = target
    source = values(rank + 30, world * 2 * 3, torch.float32).view(world * 2, 3)
    target = torch.zeros(world * 2, 3)
    dist.all_to_all_single(target, source)
    out["all_to_all_single_equal"] = target

    piece = values(rank + 40, 5, torch.float32)
    whole = torch.zeros(world * 5)

    def gather_composed():
        parts = [torch.zeros(5) for _ in range(world)]
        dist.all_gather(parts, piece)
        whole.copy_(torch.cat(parts))
    fallback(out, "all_gather_into_tensor", lambda: dist.all_gather_into_tensor(whole, piece),
             gather_composed)
    out["all_gather_into_tensor"] = whole

    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        big = values(rank + 50, world * 4, torch.float32)
        mine = torch.zeros(4)

        def scatter_composed():
            reduced = big.clone()
            dist.all_reduce(reduced, op)
            mine.copy_(reduced.view(world, 4)[rank])
        fallback(out, "reduce_scatter_tensor_" + name,
                 lambda: dist.reduce_scatter_tensor(mine, big, op), scatter_composed)
        out["reduce_scatter_tensor_" + name] = mine

    send = values(rank + 60, 6, torch.float32)
    recv = torch.zeros(6)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world),
                                    dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
    for w in works:
        w.wait()
    out["batch_isend_irecv"] = recv

    objects = [("object of rank %d" % rank).encode() * (rank + 1)]
    dist.broadcast_object_list(objects, src=world - 1)
    out["broadcast_object"] = as_bytes(objects[0])
    everyone = [None] * world
    dist.all_gather_object(everyone, ("rank %d " % rank).encode() * (rank + 1))
    for k, b in enumerate(everyone):
        out["all_gather_object_%d" % k] = as_bytes(b)

    torch.save(out, os.path.join(out_dir, "rank-%d.pt" % rank))
    dist.barrier()
    dist.destroy_process_group()


def main():
    world, out_dir = int(sys.argv[1]), sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(worker, args=(world, port, out_dir), nprocs=world)


if __name__ == "__main__":
    main()

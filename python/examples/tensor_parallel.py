"""Tensor-parallel decode, checked: a two-layer MLP split over a
tensor-parallel (TP) group, its first weight by columns and its second by
rows, so each rank's output is a partial that one all-reduce per step sums:
the call a TP decode step waits on.

    mpirun -n 2 python3 python/examples/tensor_parallel.py              # NumPy, host side
    mpirun -n 4 python3 python/examples/tensor_parallel.py --tp 2       # two TP groups of 2
    mpirun -n 2 python3 python/examples/tensor_parallel.py --gpu        # torch CUDA, bf16, a GPU per rank
    mpirun -n 2 python3 python/examples/tensor_parallel.py --gpu --graph  # the step captured in a CUDA graph

Every step's result is compared bit for bit with the partials of the
group's ranks, gathered over MPI (a path arx does not touch) and added in
rank order in float32 on the host, rounded once to the dtype: arx's rule.
The TP group is a split of the world communicator (one arx instance per
group); the weights are the same on every rank (one seed), each rank
keeping its shard. Exit status 0 only if every step on every rank matched.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

import arx


def bf16_round(x32):
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    b = x32.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def rank_order_sum(parts):
    """((p0 + p1) + p2) + ... in float32: arx's order and accumulator."""
    acc = parts[0].astype(np.float32)
    for p in parts[1:]:
        acc = (acc + p).astype(np.float32)
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=0, help="TP group size (default: the world)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--gpu", action="store_true", help="torch CUDA tensors, bfloat16")
    ap.add_argument("--graph", action="store_true", help="with --gpu: replay the step as a CUDA graph")
    a = ap.parse_args()

    world = MPI.COMM_WORLD
    tp_size = a.tp or world.size
    if a.graph and not a.gpu:
        sys.exit("--graph needs --gpu (CUDA graphs)")
    if tp_size < 1 or world.size % tp_size or a.ffn % tp_size:
        sys.exit(f"--tp {tp_size} must divide the world ({world.size}) and --ffn ({a.ffn})")
    # One TP group per tp_size consecutive ranks.
    tp = world.Split(color=world.rank // tp_size, key=world.rank)
    shard = a.ffn // tp_size
    cols = slice(tp.rank * shard, (tp.rank + 1) * shard)

    rng = np.random.default_rng(1234)  # the same weights on every rank
    w1 = (rng.standard_normal((a.hidden, a.ffn)) / np.sqrt(a.hidden)).astype(np.float32)
    w2 = (rng.standard_normal((a.ffn, a.hidden)) / np.sqrt(a.ffn)).astype(np.float32)

    comm = arx.Comm(tp, device="gpu" if a.gpu else "host")
    bad = 0
    if a.gpu:
        import torch
        from arx import torch as arx_torch  # the custom op

        torch.cuda.set_device(comm.cuda_device)
        dt = torch.bfloat16
        w1_r = torch.from_numpy(w1[:, cols].copy()).to("cuda", dt)
        w2_r = torch.from_numpy(w2[cols, :].copy()).to("cuda", dt)
        x = torch.empty((1, a.hidden), device="cuda", dtype=dt)
        out = torch.empty((1, a.hidden), device="cuda", dtype=dt)

        def step():
            out.copy_(torch.relu(x @ w1_r) @ w2_r)  # this rank's partial
            partial.copy_(out)
            arx_torch.all_reduce_(out, comm)  # the sum over the TP group, in place

        partial = torch.empty_like(out)
        graph = None
        if a.graph:
            x.zero_()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up outside the capture
                step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        for i in range(a.steps):
            # The decode step's input: the same on every rank of the group.
            xi = np.random.default_rng([5678, world.rank // tp_size, i]).standard_normal((1, a.hidden))
            x.copy_(torch.from_numpy(xi.astype(np.float32)).to(dt))
            graph.replay() if graph else step()
            torch.cuda.synchronize()
            mine = partial.float().cpu().numpy().ravel()
            got = out.view(torch.int16).cpu().numpy().view(np.uint16).ravel()
            want = bf16_round(rank_order_sum(tp.allgather(mine)))
            bad += int(np.count_nonzero(got != want))
    else:
        w1_r = np.ascontiguousarray(w1[:, cols])
        w2_r = np.ascontiguousarray(w2[cols, :])
        for i in range(a.steps):
            x = np.random.default_rng([5678, world.rank // tp_size, i]).standard_normal((1, a.hidden))
            x = x.astype(np.float32)
            partial = (np.maximum(x @ w1_r, 0) @ w2_r).astype(np.float32)
            out = partial.copy()
            comm.allreduce(out)  # the sum over the TP group, in place
            want = rank_order_sum(tp.allgather(partial))
            bad += int(np.count_nonzero(out.view(np.uint32) != want.view(np.uint32)))
    comm.close()
    tp.Free()

    total = world.allreduce(bad)
    if world.rank == 0:
        what = f"{'GPU bf16' + (' graph' if a.graph else '') if a.gpu else 'host float32'}"
        print(f"tensor_parallel: {world.size} ranks, TP groups of {tp_size}, {a.steps} steps, {what}: "
              f"{'every step bit for bit' if total == 0 else f'{total} elements WRONG'}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

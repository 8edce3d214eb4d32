from mpi4py import MPI
import torch
import arx
import arx.torch  # registers the custom op torch.ops.arx.all_reduce

# A GPU on every rank; a generous call timeout, as each rank compiles
# (torch.compile below) at its own pace before its first call there.
comm = arx.Comm(MPI.COMM_WORLD, device="gpu", timeout=60)
torch.cuda.set_device(comm.cuda_device)
n = comm.size * (comm.size + 1) // 2

# Eager, on the current stream; returns at once.
x = torch.full((4096,), comm.rank + 1.0, dtype=torch.bfloat16, device="cuda")
comm.allreduce(x)
assert (x == n).all()

# Captured into a CUDA graph and replayed.
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    comm.allreduce(x)
for _ in range(3):
    x.fill_(comm.rank + 1.0)
    g.replay()
    assert (x == n).all()

# Inside torch.compile: one opaque in-place op.
@torch.compile(fullgraph=True)
def step(t):
    t = t * 2
    arx.torch.all_reduce_(t, comm)
    return t + 1

assert (step(torch.full((4096,), comm.rank + 1.0, device="cuda")) == 2 * n + 1).all()
comm.close()

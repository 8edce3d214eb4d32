"""GPU tests of the arx Python module: torch tensors (bfloat16, float16,
float32) eager, in place and out of place, on side streams, captured in
torch.cuda.graph and replayed; CuPy arrays; the __cuda_array_interface__
and DLPack paths; the torch custom op eagerly and under torch.compile; and
the failures (a mismatched call, a refused call, a CUDA tensor on a host
instance); reduce_scatter, all_gather and broadcast on CUDA tensors
(eager, in place, graph capture, streams, CAI/DLPack/CuPy, bad
arguments). Run by scripts/gpu-python on the GPU machine, several ranks on
one GPU under MPS:

    mpirun -n 2 python python/tests/test_gpu.py

Self-checking like test_host.py (harness.py): seeded inputs per rank, the
reference computed on every rank in NumPy, outputs poisoned (NaN) before
each call, bit comparison.
"""

import sys

import numpy as np
import torch

import arx
from harness import (FAIL_TIMEOUT, PROMPT, RANK, SIZE, WORLD, ag_input, case, check, expect_error,
                     expected, main, narrow, note, partial, rs_expected, same_bits, widen, wrong)

TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
COMM = None
DEV = None


def to_torch(a, dtype, device=None):
    """A NumPy partial (bfloat16 as uint16 bits) as a tensor on `device`."""
    device = device or DEV
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).to(device).view(torch.bfloat16)
    return torch.from_numpy(a.copy()).to(device)


def from_torch(t, dtype):
    """The tensor's bits in NumPy (after the current stream's work)."""
    t = t.detach().cpu()
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def nan_tensor(shape, dtype):
    return torch.full(shape if isinstance(shape, tuple) else (shape,), float("nan"), dtype=TD[dtype],
                      device=DEV)


@case
def a_gpu_instance_starts():
    global COMM, DEV
    COMM = arx.Comm(WORLD, device="gpu", timeout=60)
    check(COMM.device == "gpu" and COMM.cuda_device is not None,
          f"device {COMM.device}, cuda_device {COMM.cuda_device}")
    DEV = torch.device("cuda", COMM.cuda_device)
    torch.cuda.set_device(DEV)
    d = COMM.describe()
    note(f"{d['device']} over {d['fabric']}, CUDA device {d['cuda_device']} "
         f"({torch.cuda.get_device_name(DEV)}), torch {torch.__version__}")


@case
def torch_eager_every_dtype_size_and_mode():
    maxc = COMM.describe()["max_count"]
    cid = 100
    for dtype in ("bfloat16", "float16", "float32"):
        m = maxc[dtype]  # elements per chunk (one slot); longer calls run chunked
        for n in (1, 5, 4096, 65537, m, m + 1, 2 * m + 3):
            for in_place in (True, False):
                cid += 1
                name = f"torch {dtype} n={n} in_place={in_place}"
                parts = [partial(cid, n, dtype, r) for r in range(SIZE)]
                want = expected(parts, dtype)
                x = to_torch(parts[RANK], dtype)
                if in_place:
                    got = COMM.allreduce(x)
                    check(got is x, f"{name}: returned another object")
                    res = from_torch(x, dtype)
                else:
                    out = nan_tensor(n, dtype)
                    got = COMM.allreduce(x, out)
                    check(got is out, f"{name}: did not return out")
                    res = from_torch(out, dtype)
                    check(same_bits(from_torch(x, dtype), parts[RANK]), f"{name}: the input changed")
                check(same_bits(res, want), f"{name}: {wrong(res, want)}")
    COMM.check()


@case
def torch_calls_follow_the_current_stream():
    """On a side stream, a long kernel runs before the input is written:
    a call enqueued anywhere else than the current stream reads the old
    (zero) input and gives a wrong sum."""
    n = 65536
    for i, dtype in enumerate(("bfloat16", "float16", "float32")):
        parts = [partial(200 + i, n, dtype, r) for r in range(SIZE)]
        want = expected(parts, dtype)
        src = to_torch(parts[RANK], dtype)
        x = torch.zeros(n, dtype=TD[dtype], device=DEV)
        out = nan_tensor(n, dtype)
        torch.cuda.synchronize()
        s = torch.cuda.Stream(DEV)
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time
            x.copy_(src)
            COMM.allreduce(x, out)
        s.synchronize()
        res = from_torch(out, dtype)
        check(same_bits(res, want), f"side stream {dtype}: {wrong(res, want)}")
        # An explicit stream= argument wins over the current stream.
        y = torch.zeros(n, dtype=TD[dtype], device=DEV)
        torch.cuda.synchronize()
        s2 = torch.cuda.Stream(DEV)
        with torch.cuda.stream(s2):
            torch.cuda._sleep(100_000_000)
            y.copy_(src)
        COMM.allreduce(y, stream=s2)  # in place, on s2, from the default stream
        s2.synchronize()
        res = from_torch(y, dtype)
        check(same_bits(res, want), f"stream= {dtype}: {wrong(res, want)}")


@case
def torch_graph_capture_replays():
    replays, n = 200, 4096
    for k, dtype in enumerate(("bfloat16", "float16", "float32")):
        base = 1000 * (k + 1)
        bank_parts = [[partial(base + i, n, dtype, r) for r in range(SIZE)] for i in range(replays)]
        wants = [expected(p, dtype) for p in bank_parts]
        bank = torch.stack([to_torch(p[RANK], dtype) for p in bank_parts])
        x = torch.empty(n, dtype=TD[dtype], device=DEV)
        out = nan_tensor(n, dtype)
        # Eager first (warm-up), then capture one call.
        x.copy_(bank[0])
        COMM.allreduce(x, out)
        res = from_torch(out, dtype)
        check(same_bits(res, wants[0]), f"graph warm-up {dtype}: {wrong(res, wants[0])}")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            COMM.allreduce(x, out)
        results = torch.empty((replays, n), dtype=TD[dtype], device=DEV)
        for i in range(replays):
            x.copy_(bank[i])
            out.fill_(float("nan"))
            g.replay()
            results[i].copy_(out)
        torch.cuda.synchronize()
        got = from_torch(results, dtype)
        bad = [i for i in range(replays) if not same_bits(got[i], wants[i])]
        check(not bad, f"graph {dtype}: {len(bad)} of {replays} replays wrong, first {bad[:1]}: "
                       f"{wrong(got[bad[0]], wants[bad[0]]) if bad else ''}")
        COMM.check()

    # Two calls and a torch op in one graph, in place: the second call's
    # partial is twice the first's sum (the same on every rank).
    dtype, n, replays = "bfloat16", 8192, 20
    y = torch.empty(n, dtype=TD[dtype], device=DEV)
    z = torch.empty_like(y)
    out2 = nan_tensor(n, dtype)
    y.copy_(to_torch(partial(5000, n, dtype, RANK), dtype))
    COMM.allreduce(y)
    torch.cuda.synchronize()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        COMM.allreduce(y)
        torch.mul(y, 2, out=z)
        COMM.allreduce(z, out2)
    for i in range(replays):
        parts = [partial(5001 + i, n, dtype, r) for r in range(SIZE)]
        s1 = expected(parts, dtype)
        z_bits = narrow(widen(s1, dtype) * np.float32(2), dtype)
        want2 = expected([z_bits] * SIZE, dtype)
        y.copy_(to_torch(parts[RANK], dtype))
        out2.fill_(float("nan"))
        g2.replay()
        r1, r2 = from_torch(y, dtype), from_torch(out2, dtype)
        check(same_bits(r1, s1), f"graph of two calls, replay {i}, first: {wrong(r1, s1)}")
        check(same_bits(r2, want2), f"graph of two calls, replay {i}, second: {wrong(r2, want2)}")
    COMM.check()


class CaiOnly:
    """Only a __cuda_array_interface__ (the generic path)."""

    def __init__(self, t):
        self.t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


class DlpackOnly:
    """Only DLPack (the DLPack path)."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@case
def array_interface_and_dlpack_objects():
    n = 3000
    for i, dtype in enumerate(("float16", "float32")):
        parts = [partial(300 + i, n, dtype, r) for r in range(SIZE)]
        want = expected(parts, dtype)
        x = to_torch(parts[RANK], dtype)
        out = nan_tensor(n, dtype)
        got = COMM.allreduce(CaiOnly(x), CaiOnly(out))
        torch.cuda.synchronize()
        check(isinstance(got, CaiOnly), "CAI: returns out")
        res = from_torch(out, dtype)
        check(same_bits(res, want), f"CAI {dtype}: {wrong(res, want)}")
    for i, dtype in enumerate(("bfloat16", "float32")):
        parts = [partial(310 + i, n, dtype, r) for r in range(SIZE)]
        want = expected(parts, dtype)
        x = to_torch(parts[RANK], dtype)
        COMM.allreduce(DlpackOnly(x))
        res = from_torch(x, dtype)
        check(same_bits(res, want), f"DLPack {dtype}: {wrong(res, want)}")


@case
def cupy_arrays_if_present():
    try:
        import cupy
    except ImportError:
        note("CuPy not installed: CuPy arrays not tried")
        return
    n = 5000
    with cupy.cuda.Device(COMM.cuda_device):
        for i, dtype in enumerate(("float16", "float32")):
            parts = [partial(400 + i, n, dtype, r) for r in range(SIZE)]
            want = expected(parts, dtype)
            x = cupy.asarray(parts[RANK])
            out = cupy.full(n, np.nan, dtype=dtype)
            got = COMM.allreduce(x, out)
            check(got is out, "cupy: returns out")
            res = cupy.asnumpy(out)
            check(same_bits(res, want), f"cupy {dtype} out of place: {wrong(res, want)}")
            # In place on a non-blocking CuPy stream, behind a long kernel:
            # only a call on CuPy's current stream sees the written input.
            s = cupy.cuda.Stream(non_blocking=True)
            y = cupy.zeros(n, dtype=dtype)
            cupy.cuda.Device().synchronize()
            with s:
                with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr, device=DEV)):
                    torch.cuda._sleep(100_000_000)
                y.set(parts[RANK], stream=s)
                COMM.allreduce(y)
            s.synchronize()
            res = cupy.asnumpy(y)
            check(same_bits(res, want), f"cupy {dtype} on a side stream: {wrong(res, want)}")


@case
def the_torch_custom_op_eager_and_compiled():
    import arx.torch as at

    check(hasattr(torch.ops.arx, "all_reduce"), "torch.ops.arx.all_reduce is registered")
    n = 2048
    parts = [partial(600, n, "bfloat16", r) for r in range(SIZE)]
    x = to_torch(parts[RANK], "bfloat16")
    check(at.all_reduce_(x, COMM) is x, "all_reduce_ returns its tensor")
    res = from_torch(x, "bfloat16")
    want = expected(parts, "bfloat16")
    check(same_bits(res, want), f"op eager: {wrong(res, want)}")

    # Compiled: one opaque in-place op between two elementwise ops. A long
    # timeout: each rank compiles before its first call, at its own pace.
    with arx.Comm(WORLD, device="gpu", timeout=120) as cc:
        def f(t):
            y = t * 2
            at.all_reduce_(y, cc)
            return y + 1

        for backend in ("aot_eager", "inductor"):
            cf = torch.compile(f, backend=backend, fullgraph=True)
            for i in range(3):
                parts = [partial(610 + i, n, "float32", r) for r in range(SIZE)]
                want = expected([p * np.float32(2) for p in parts], "float32") + np.float32(1)
                try:
                    r = cf(to_torch(parts[RANK], "float32"))
                    res = from_torch(r, "float32")
                    check(same_bits(res, want), f"torch.compile {backend}, call {i}: {wrong(res, want)}")
                except arx.Error:
                    raise
                except Exception as e:  # noqa: BLE001 - a compiler problem is a failure
                    check(False, f"torch.compile {backend}: {type(e).__name__}: {str(e)[:300]}")
                    return
        # CUDA graphs through torch.compile.
        cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
        for i in range(5):
            parts = [partial(620 + i, n, "float32", r) for r in range(SIZE)]
            want = expected([p * np.float32(2) for p in parts], "float32") + np.float32(1)
            r = cf(to_torch(parts[RANK], "float32"))
            res = from_torch(r, "float32")
            check(same_bits(res, want), f"torch.compile reduce-overhead, call {i}: {wrong(res, want)}")
        cc.check()


@case
def a_cuda_tensor_on_a_host_instance_is_refused():
    with arx.Comm(WORLD, device="host", timeout=FAIL_TIMEOUT) as hc:
        x = torch.ones(16, device=DEV)
        e, dt = expect_error(lambda: hc.allreduce(x), arx.InvalidArgumentError,
                             contains=("host device side",), name="CUDA tensor, host instance")
        check(dt < PROMPT, f"CUDA tensor, host instance: took {dt:.1f} s")


@case
def a_mismatched_gpu_call_fails_every_rank_at_once():
    with arx.Comm(WORLD, device="gpu", timeout=FAIL_TIMEOUT) as c:
        n = 1000 + (1 if RANK == SIZE - 1 else 0)
        x = to_torch(partial(700, n, "float32", RANK), "float32")
        e, dt = expect_error(lambda: (c.allreduce(x), c.check()), arx.CallMismatchError,
                             name="GPU count mismatch")
        check(dt < PROMPT, f"GPU count mismatch: took {dt:.1f} s")
        check(bool(torch.isnan(x).all()), "GPU count mismatch: the output is not NaN")


@case
def a_refused_gpu_call_fails_the_others_at_once():
    with arx.Comm(WORLD, device="gpu", timeout=FAIL_TIMEOUT) as c:
        if RANK == SIZE - 1:
            x = to_torch(partial(710, 2000, "float32", RANK), "float32")[::2]
            e, dt = expect_error(lambda: c.allreduce(x), arx.InvalidArgumentError,
                                 contains=("contiguous",), name="GPU refused here")
        else:
            x = to_torch(partial(710, 1000, "float32", RANK), "float32")
            e, dt = expect_error(lambda: (c.allreduce(x), c.check()), arx.CallMismatchError,
                                 contains=(f"rank {SIZE - 1}",), name="GPU refused by a peer")
        check(dt < PROMPT, f"GPU refusal: took {dt:.1f} s")


# ---- set-up shared by the reduce_scatter/all_gather and broadcast cases -----

def side_stream():
    """A new stream (after the device's earlier work) whose work waits
    behind a ~50 ms kernel queued on it first: a call on it, or told
    `stream=` it, must wait for what is queued after the kernel."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream(DEV)
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
    return s


def cupy_or_note(what):
    """The cupy module, or None after noting that CuPy arrays were not
    tried in `what`."""
    try:
        import cupy
    except ImportError:
        note(f"CuPy not installed: CuPy arrays not tried in {what}")
        return None
    return cupy


def refused_on_a_new_comm(fn, cls, name, contains=()):
    """`fn(c)` then `c.check()` on a new GPU instance raise `cls` on this
    rank (its message naming every word of `contains`), promptly."""
    with arx.Comm(WORLD, device="gpu", timeout=FAIL_TIMEOUT) as c:
        _, dt = expect_error(lambda: (fn(c), c.check()), cls, contains=contains, name=name)
        check(dt < PROMPT, f"{name}: took {dt:.1f} s")


def each_refused(bad, what):
    """Each bad call of `bad` ((name, fn, words), the same on every rank)
    raises InvalidArgumentError on every rank naming `words`."""
    for name, fn, words in bad:
        refused_on_a_new_comm(fn, arx.InvalidArgumentError, f"cuda {what}{name}", words)


def refused_on_the_last_rank(there, here, words, what):
    """The last rank's call `there(c)` is refused (InvalidArgumentError
    naming `words`); the others' `here(c)` fails at once with
    CallMismatchError naming that rank."""
    if RANK == SIZE - 1:
        refused_on_a_new_comm(there, arx.InvalidArgumentError, f"GPU {what} refused here", words)
    else:
        refused_on_a_new_comm(here, arx.CallMismatchError, f"GPU {what} refused by a peer",
                              (f"rank {SIZE - 1}",))


# ---- reduce_scatter and all_gather on CUDA arrays ---------------------------

def blocks_except_mine(a, n):
    return np.concatenate([a[: RANK * n], a[(RANK + 1) * n:]])


def rs_ag_torch(comm, cid, dtype, n, mode, op):
    """One reduce_scatter and one all_gather of torch tensors in `mode`
    ("out": disjoint out, "none": out=None, "view": out is this rank's
    block), outputs poisoned (NaN), checked bit for bit against the NumPy
    reference; in place, the other blocks must be left as they were."""
    name = f"reduce_scatter {op} {dtype} n={n} {mode}"
    mine, want = rs_expected(cid, n, dtype, op)
    x = to_torch(mine, dtype)
    if mode == "out":
        out = nan_tensor(n, dtype)
        got = comm.reduce_scatter(x, out, op=op)
        check(got is out, f"{name}: did not return out")
        check(same_bits(from_torch(x, dtype), mine), f"{name}: the input changed")
    elif mode == "none":
        got = comm.reduce_scatter(x, op=op)
        check(got is x, f"{name}: did not return the input")
        out = x[RANK * n:(RANK + 1) * n]
    else:
        out = x[RANK * n:(RANK + 1) * n]
        got = comm.reduce_scatter(x, out, op=op)
        check(got is out, f"{name}: did not return out")
    res = from_torch(out, dtype)
    check(same_bits(res, want), f"{name}: {wrong(res, want)}")
    if mode != "out":
        rest = blocks_except_mine(from_torch(x, dtype), n)
        check(same_bits(rest, blocks_except_mine(mine, n)), f"{name}: another rank's block changed")

    name = f"all_gather {dtype} n={n} {mode}"
    parts = [ag_input(cid, n, dtype, r) for r in range(SIZE)]
    want = np.concatenate(parts)
    out = nan_tensor(SIZE * n, dtype)
    if mode == "out":
        x = to_torch(parts[RANK], dtype)
        got = comm.all_gather(x, out)
        check(got is out, f"{name}: did not return out")
        check(same_bits(from_torch(x, dtype), parts[RANK]), f"{name}: the input changed")
    else:
        out[RANK * n:(RANK + 1) * n].copy_(to_torch(parts[RANK], dtype))
        if mode == "none":
            got = comm.all_gather(out)
        else:
            got = comm.all_gather(out[RANK * n:(RANK + 1) * n], out)
        check(got is out, f"{name}: did not return the full tensor")
    res = from_torch(out, dtype)
    check(same_bits(res, want), f"{name}: {wrong(res, want)}")


@case
def reduce_scatter_and_all_gather_torch_eager():
    """bf16/f16/f32; n from 1 to beyond a slot per block (chunked); out
    of place, out=None and out as this rank's block; sum for every size,
    max/min/avg at one size."""
    m = COMM.describe()["max_count"]
    cid = 8000
    for dtype in ("bfloat16", "float16", "float32"):
        for n in (1, 1000, m[dtype] + 3):
            for mode in ("out", "none", "view"):
                for op in ("sum",) if n != 1000 else ("sum", "max", "min", "avg"):
                    cid += 1
                    rs_ag_torch(COMM, cid, dtype, n, mode, op)
    COMM.check()


@case
def reduce_scatter_and_all_gather_torch_graph_capture():
    """One reduce_scatter (out of place) and one all_gather (in place) per
    dtype captured in one torch.cuda.graph, replayed 20 times on new
    inputs with the outputs poisoned before each replay."""
    replays, n = 20, 3000
    for k, dtype in enumerate(("bfloat16", "float16", "float32")):
        base = 9000 + 100 * k
        x = torch.empty(SIZE * n, dtype=TD[dtype], device=DEV)
        out = nan_tensor(n, dtype)
        buf = nan_tensor(SIZE * n, dtype)
        mine, want = rs_expected(base, n, dtype, "sum")
        x.copy_(to_torch(mine, dtype))
        COMM.reduce_scatter(x, out)  # eager warm-up
        res = from_torch(out, dtype)
        check(same_bits(res, want), f"graph warm-up {dtype}: {wrong(res, want)}")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            COMM.reduce_scatter(x, out)
            COMM.all_gather(buf)
        for i in range(replays):
            cid = base + 1 + i
            mine, want = rs_expected(cid, n, dtype, "sum")
            parts = [ag_input(cid, n, dtype, r) for r in range(SIZE)]
            x.copy_(to_torch(mine, dtype))
            out.fill_(float("nan"))
            buf.fill_(float("nan"))
            buf[RANK * n:(RANK + 1) * n].copy_(to_torch(parts[RANK], dtype))
            g.replay()
            res, gathered = from_torch(out, dtype), from_torch(buf, dtype)
            check(same_bits(res, want), f"graph {dtype} replay {i}, reduce_scatter: {wrong(res, want)}")
            whole = np.concatenate(parts)
            check(same_bits(gathered, whole), f"graph {dtype} replay {i}, all_gather: {wrong(gathered, whole)}")
        COMM.check()


@case
def reduce_scatter_and_all_gather_on_other_streams_and_array_kinds():
    """The current stream (behind a 50 ms kernel on a side stream, as for
    allreduce), stream=, the __cuda_array_interface__ and DLPack paths,
    and CuPy arrays if installed."""
    n = 4096
    for i, dtype in enumerate(("bfloat16", "float32")):
        mine, want = rs_expected(9500 + i, n, dtype, "sum")
        src = to_torch(mine, dtype)
        x = torch.zeros(SIZE * n, dtype=TD[dtype], device=DEV)
        out = nan_tensor(n, dtype)
        s = side_stream()
        with torch.cuda.stream(s):
            x.copy_(src)
            COMM.reduce_scatter(x, out)
        s.synchronize()
        res = from_torch(out, dtype)
        check(same_bits(res, want), f"reduce_scatter on a side stream {dtype}: {wrong(res, want)}")
        parts = [ag_input(9510 + i, n, dtype, r) for r in range(SIZE)]
        y = torch.zeros(n, dtype=TD[dtype], device=DEV)
        gathered = nan_tensor(SIZE * n, dtype)
        s2 = side_stream()
        with torch.cuda.stream(s2):
            y.copy_(to_torch(parts[RANK], dtype))
        COMM.all_gather(y, gathered, stream=s2)
        s2.synchronize()
        res, whole = from_torch(gathered, dtype), np.concatenate(parts)
        check(same_bits(res, whole), f"all_gather stream= {dtype}: {wrong(res, whole)}")
    # __cuda_array_interface__ (float16) and DLPack (bfloat16) objects.
    mine, want = rs_expected(9520, n, "float16", "sum")
    x, out = to_torch(mine, "float16"), nan_tensor(n, "float16")
    got = COMM.reduce_scatter(CaiOnly(x), CaiOnly(out))
    torch.cuda.synchronize()
    res = from_torch(out, "float16")
    check(isinstance(got, CaiOnly) and same_bits(res, want), f"CAI reduce_scatter: {wrong(res, want)}")
    parts = [ag_input(9521, n, "bfloat16", r) for r in range(SIZE)]
    buf = nan_tensor(SIZE * n, "bfloat16")
    buf[RANK * n:(RANK + 1) * n].copy_(to_torch(parts[RANK], "bfloat16"))
    COMM.all_gather(DlpackOnly(buf))
    res, whole = from_torch(buf, "bfloat16"), np.concatenate(parts)
    check(same_bits(res, whole), f"DLPack all_gather in place: {wrong(res, whole)}")
    cupy = cupy_or_note("reduce_scatter/all_gather")
    if cupy is None:
        return
    with cupy.cuda.Device(COMM.cuda_device):
        mine, want = rs_expected(9530, n, "float32", "max")
        xc = cupy.asarray(mine)
        got = COMM.reduce_scatter(xc, op="max")
        check(got is xc, "cupy reduce_scatter in place returns the input")
        res = cupy.asnumpy(xc[RANK * n:(RANK + 1) * n])
        check(same_bits(res, want), f"cupy reduce_scatter max in place: {wrong(res, want)}")
        parts = [ag_input(9531, n, "float16", r) for r in range(SIZE)]
        oc = cupy.full(SIZE * n, np.nan, dtype="float16")
        COMM.all_gather(cupy.asarray(parts[RANK]), oc)
        res, whole = cupy.asnumpy(oc), np.concatenate(parts)
        check(same_bits(res, whole), f"cupy all_gather: {wrong(res, whole)}")
    COMM.check()


@case
def reduce_scatter_and_all_gather_refuse_bad_cuda_arguments():
    """Each bad call (the same on every rank) raises InvalidArgumentError
    on every rank naming what is wrong; one on the last rank only makes
    the others raise CallMismatchError at once."""
    n = 64
    big = torch.zeros(SIZE * n + 8, device=DEV)
    bad = [
        ("rs output length", lambda c: c.reduce_scatter(torch.zeros(SIZE * n, device=DEV),
                                                        torch.zeros(n + 1, device=DEV)),
         ("reduce_scatter", f"expected {SIZE} ranks x {n + 1}")),
        ("rs in place not a multiple", lambda c: c.reduce_scatter(torch.zeros(SIZE * n + 1, device=DEV)),
         ("not a multiple",)),
        ("ag output length", lambda c: c.all_gather(torch.zeros(n, device=DEV),
                                                    torch.zeros(SIZE * n - 1, device=DEV)),
         ("all_gather", f"expected {SIZE} ranks x {n}")),
        ("rs overlap elsewhere", lambda c: c.reduce_scatter(big[: SIZE * n], big[RANK * n + 1:RANK * n + 1 + n]),
         ("in place", "overlaps")),
        ("ag overlap elsewhere", lambda c: c.all_gather(big[RANK * n + 2:RANK * n + 2 + n], big[: SIZE * n]),
         ("in place", "overlaps")),
        ("rs out is the input", lambda c: c.reduce_scatter(big[:SIZE * n], big[:SIZE * n]),
         ("expected",)),
        ("rs dtype pair", lambda c: c.reduce_scatter(torch.zeros(SIZE * n, device=DEV),
                                                     torch.zeros(n, dtype=torch.float16, device=DEV)),
         ("float32", "float16")),
        ("rs float64", lambda c: c.reduce_scatter(torch.zeros(SIZE * n, dtype=torch.float64, device=DEV)),
         ("float64",)),
        ("rs strided", lambda c: c.reduce_scatter(torch.zeros(2 * SIZE * n, device=DEV)[::2]),
         ("contiguous",)),
        ("rs op", lambda c: c.reduce_scatter(torch.zeros(SIZE * n, device=DEV), op="prod"), ("op='prod'",)),
    ]
    each_refused(bad, "")
    x = to_torch(partial(9600, SIZE * n, "float32", RANK), "float32")
    refused_on_the_last_rank(lambda c: c.reduce_scatter(torch.zeros(SIZE * n + 1, device=DEV)),
                             lambda c: c.reduce_scatter(x), ("not a multiple",), "reduce_scatter")
    m = n + (1 if RANK == SIZE - 1 else 0)
    x = to_torch(partial(9601, m, "float32", RANK), "float32")
    out = nan_tensor(SIZE * m, "float32")
    refused_on_a_new_comm(lambda c: c.all_gather(x, out), arx.CallMismatchError,
                          "GPU all_gather length on the last rank")


# ---- broadcast on CUDA arrays -------------------------------------------------

def bcast_torch(comm, cid, dtype, n, root, mode):
    """One broadcast of torch tensors from `root` in `mode` ("out": a
    disjoint out, "none": out=None, "same": out is x); outputs poisoned
    (NaN: a non-root's in-place buffer too), checked bit for bit against
    the root's input as NumPy makes it (random bits, NaN payloads too)."""
    name = f"broadcast {dtype} n={n} root={root} {mode}"
    mine = ag_input(cid, n, dtype, RANK)
    want = ag_input(cid, n, dtype, root)
    if mode == "out":
        x = to_torch(mine, dtype)
        out = nan_tensor(n, dtype)
        got = comm.broadcast(x, out, root)
        check(got is out, f"{name}: did not return out")
        check(same_bits(from_torch(x, dtype), mine), f"{name}: the input changed")
    else:
        out = to_torch(mine, dtype) if RANK == root else nan_tensor(n, dtype)
        got = comm.broadcast(out, root=root) if mode == "none" else comm.broadcast(out, out, root)
        check(got is out, f"{name}: did not return the tensor")
    res = from_torch(out, dtype)
    check(same_bits(res, want), f"{name}: {wrong(res, want)}")


@case
def broadcast_torch_eager():
    """bf16/f16/f32; n from 1 to beyond a slot (chunked); every root; out
    of place (a non-root's own input must be ignored), out=None and
    out=x."""
    m = COMM.describe()["max_count"]
    cid = 10000
    for dtype in ("bfloat16", "float16", "float32"):
        for n in (1, 1000, m[dtype] + 3):
            for root in range(SIZE):
                for mode in ("out", "none", "same"):
                    cid += 1
                    bcast_torch(COMM, cid, dtype, n, root, mode)
    COMM.check()


@case
def broadcast_torch_graph_capture():
    """Per dtype, an out-of-place broadcast from one root and an in-place
    one from the next captured in one torch.cuda.graph, replayed 20 times
    on new inputs with the outputs (and the in-place buffer off the root)
    poisoned before each replay; the roots change with the dtype."""
    replays, n = 20, 3000
    for k, dtype in enumerate(("bfloat16", "float16", "float32")):
        base = 11000 + 100 * k
        ra, rb = k % SIZE, (k + 1) % SIZE
        x = torch.empty(n, dtype=TD[dtype], device=DEV)
        out = nan_tensor(n, dtype)
        buf = nan_tensor(n, dtype)
        x.copy_(to_torch(ag_input(base, n, dtype, RANK), dtype))
        COMM.broadcast(x, out, ra)  # eager warm-up
        res, want = from_torch(out, dtype), ag_input(base, n, dtype, ra)
        check(same_bits(res, want), f"graph warm-up {dtype}: {wrong(res, want)}")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            COMM.broadcast(x, out, ra)
            COMM.broadcast(buf, root=rb)
        for i in range(replays):
            ca, cb = base + 1 + 2 * i, base + 2 + 2 * i
            x.copy_(to_torch(ag_input(ca, n, dtype, RANK), dtype))
            out.fill_(float("nan"))
            if RANK == rb:
                buf.copy_(to_torch(ag_input(cb, n, dtype, RANK), dtype))
            else:
                buf.fill_(float("nan"))
            g.replay()
            res, want = from_torch(out, dtype), ag_input(ca, n, dtype, ra)
            check(same_bits(res, want), f"graph {dtype} replay {i}, root {ra} out of place: {wrong(res, want)}")
            res, want = from_torch(buf, dtype), ag_input(cb, n, dtype, rb)
            check(same_bits(res, want), f"graph {dtype} replay {i}, root {rb} in place: {wrong(res, want)}")
        COMM.check()


@case
def broadcast_on_other_streams_and_array_kinds():
    """The current stream (behind a 50 ms kernel on a side stream), stream=,
    the __cuda_array_interface__ and DLPack paths, CuPy arrays if
    installed, and a root passing a NumPy array to ranks passing CUDA
    tensors."""
    n = 4096
    root = SIZE - 1
    for i, dtype in enumerate(("bfloat16", "float32")):
        cid = 11500 + 10 * i
        src = to_torch(ag_input(cid, n, dtype, RANK), dtype)
        x = torch.zeros(n, dtype=TD[dtype], device=DEV)
        out = nan_tensor(n, dtype)
        s = side_stream()
        with torch.cuda.stream(s):
            x.copy_(src)
            COMM.broadcast(x, out, root)
        s.synchronize()
        res, want = from_torch(out, dtype), ag_input(cid, n, dtype, root)
        check(same_bits(res, want), f"broadcast on a side stream {dtype}: {wrong(res, want)}")
        y = torch.zeros(n, dtype=TD[dtype], device=DEV)
        s2 = side_stream()
        with torch.cuda.stream(s2):
            y.copy_(to_torch(ag_input(cid + 1, n, dtype, RANK), dtype))
        COMM.broadcast(y, root=0, stream=s2)  # in place, on s2, from the default stream
        s2.synchronize()
        res, want = from_torch(y, dtype), ag_input(cid + 1, n, dtype, 0)
        check(same_bits(res, want), f"broadcast stream= {dtype}: {wrong(res, want)}")
    # __cuda_array_interface__ (float16, out of place) and DLPack
    # (bfloat16, in place) objects.
    x, out = to_torch(ag_input(11520, n, "float16", RANK), "float16"), nan_tensor(n, "float16")
    got = COMM.broadcast(CaiOnly(x), CaiOnly(out), root)
    torch.cuda.synchronize()
    res, want = from_torch(out, "float16"), ag_input(11520, n, "float16", root)
    check(isinstance(got, CaiOnly) and same_bits(res, want), f"CAI broadcast: {wrong(res, want)}")
    buf = to_torch(ag_input(11521, n, "bfloat16", RANK), "bfloat16") if RANK == 0 else nan_tensor(n, "bfloat16")
    COMM.broadcast(DlpackOnly(buf), root=0)
    res, want = from_torch(buf, "bfloat16"), ag_input(11521, n, "bfloat16", 0)
    check(same_bits(res, want), f"DLPack broadcast in place: {wrong(res, want)}")
    # The root passes host memory, the others CUDA tensors (the same call
    # of the protocol).
    want = ag_input(11522, n, "float32", 0)
    if RANK == 0:
        h = want.copy()
        COMM.broadcast(h)
        check(same_bits(h, want), "mixed broadcast: the root's host input changed")
    else:
        t = nan_tensor(n, "float32")
        COMM.broadcast(t)
        res = from_torch(t, "float32")
        check(same_bits(res, want), f"mixed broadcast, CUDA side: {wrong(res, want)}")
    COMM.check()
    cupy = cupy_or_note("broadcast")
    if cupy is None:
        return
    with cupy.cuda.Device(COMM.cuda_device):
        want = ag_input(11530, n, "float32", root)
        xc = cupy.asarray(want) if RANK == root else cupy.full(n, np.nan, dtype="float32")
        got = COMM.broadcast(xc, root=root)
        check(got is xc, "cupy broadcast in place returns the input")
        res = cupy.asnumpy(xc)
        check(same_bits(res, want), f"cupy broadcast in place: {wrong(res, want)}")
        want = ag_input(11531, n, "float16", 0)
        oc = cupy.full(n, np.nan, dtype="float16")
        COMM.broadcast(cupy.asarray(ag_input(11531, n, "float16", RANK)), oc, 0)
        res = cupy.asnumpy(oc)
        check(same_bits(res, want), f"cupy broadcast out of place: {wrong(res, want)}")
    COMM.check()


@case
def broadcast_refuses_bad_cuda_arguments():
    """Each bad call (the same on every rank) raises InvalidArgumentError
    on every rank naming what is wrong; a root out of range on the last
    rank only makes the others raise CallMismatchError at once, and so
    does a length differing there."""
    n = 64
    big = torch.zeros(n + 8, device=DEV)
    bad = [
        ("lengths", lambda c: c.broadcast(torch.zeros(n, device=DEV), torch.zeros(n + 1, device=DEV)),
         ("broadcast", f"input has {n} elements, output {n + 1}")),
        ("overlap", lambda c: c.broadcast(big[:n], big[1:n + 1]), ("broadcast", "overlaps")),
        ("dtype pair", lambda c: c.broadcast(torch.zeros(n, device=DEV),
                                             torch.zeros(n, dtype=torch.float16, device=DEV)),
         ("float32", "float16")),
        ("float64", lambda c: c.broadcast(torch.zeros(n, dtype=torch.float64, device=DEV)), ("float64",)),
        ("strided", lambda c: c.broadcast(torch.zeros(2 * n, device=DEV)[::2]), ("contiguous",)),
        ("root = size", lambda c: c.broadcast(torch.zeros(n, device=DEV), root=SIZE), ("root", "not a rank")),
        ("root -1", lambda c: c.broadcast(torch.zeros(n, device=DEV), root=-1), ("root -1",)),
        ("root 1.0", lambda c: c.broadcast(torch.zeros(n, device=DEV), root=1.0), ("root",)),
    ]
    each_refused(bad, "broadcast ")
    x = to_torch(ag_input(11600, n, "float32", RANK), "float32")
    refused_on_the_last_rank(lambda c: c.broadcast(x, root=SIZE), lambda c: c.broadcast(x, root=0),
                             ("root", "not a rank"), "broadcast")
    m = n + (1 if RANK == SIZE - 1 else 0)
    x = to_torch(ag_input(11601, m, "float32", RANK), "float32")
    out = nan_tensor(m, "float32")
    refused_on_a_new_comm(lambda c: c.broadcast(x, out, 0), arx.CallMismatchError,
                          "GPU broadcast length on the last rank")


@case
def close():
    COMM.close()
    expect_error(lambda: COMM.allreduce(torch.ones(4, device=DEV)), arx.ClosedError, name="after close")


if __name__ == "__main__":
    sys.exit(main("test_gpu.py"))

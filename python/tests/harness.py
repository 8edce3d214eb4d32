"""Shared by test_host.py and test_gpu.py: seeded inputs, the independent
reference, bit comparisons, and the per-case driver.

The reference shares nothing with arx: it adds the ranks' partials in rank
order in NumPy float32 arithmetic (IEEE, round to nearest even) and rounds
once to the element type (NumPy's float32 -> float16 conversion, and integer
arithmetic for bfloat16), as arx's guarantee says every rank's result is.
"""

import os
import time

import numpy as np
from mpi4py import MPI

import arx

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
SEED = 20261201
# Errors must reach every rank long before the call timeout given to the
# Comms of the failure cases: "at once", not by timing out.
PROMPT = 15.0
FAIL_TIMEOUT = 30.0

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def expect_error(fn, cls, *, contains=(), name=""):
    """Runs fn; checks that it raised cls (an arx.Error) whose message
    contains every string of `contains`. Returns (exception or None,
    seconds)."""
    t0 = time.monotonic()
    try:
        fn()
    except arx.Error as e:
        dt = time.monotonic() - t0
        check(isinstance(e, cls), f"{name}: expected {cls.__name__}, got {type(e).__name__}: {e}")
        for s in contains:
            check(s in str(e), f"{name}: message lacks {s!r}: {e}")
        return e, dt
    except Exception as e:  # noqa: BLE001 - anything else is a failure
        check(False, f"{name}: expected {cls.__name__}, got non-arx {type(e).__name__}: {e}")
        return e, time.monotonic() - t0
    check(False, f"{name}: expected {cls.__name__}, nothing raised")
    return None, time.monotonic() - t0


# ---- inputs and the reference ----------------------------------------------

def bf16_bits(a32):
    """float32 -> bfloat16 bits, round to nearest even (no NaN here)."""
    u = np.ascontiguousarray(a32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def partial(case_id, n, dtype, r):
    """Rank r's input for a case: seeded random values of the element type
    (bfloat16 as uint16 bits), with signed zeros at the front: elements 0-3
    are -0.0 on every rank (the sum is -0.0), element 4 is -0.0 on rank 0
    only (the sum is +0.0)."""
    rng = np.random.default_rng([SEED, case_id, r])
    v = (rng.standard_normal(n) * 50).astype(np.float32)
    v[: min(n, 4)] = -0.0
    if n > 4:
        v[4] = -0.0 if r == 0 else 0.0
    if dtype == "bfloat16":
        return bf16_bits(v)
    return v.astype(dtype)


def widen(p, dtype):
    return bf16_to_f32(p) if dtype == "bfloat16" else p.astype(np.float32)


def narrow(a32, dtype):
    return bf16_bits(a32) if dtype == "bfloat16" else a32.astype(dtype)


def expected(parts, dtype):
    """((p0 + p1) + p2) + ... in float32, rounded once to the element type."""
    acc = widen(parts[0], dtype).copy()
    for p in parts[1:]:
        acc = acc + widen(p, dtype)
    return narrow(acc, dtype)


def bits(a):
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def same_bits(got, want):
    return got.shape == want.shape and np.array_equal(bits(got), bits(want))


def wrong(got, want):
    g, w = bits(got).ravel(), bits(want).ravel()
    if g.shape != w.shape:
        return f"shape {got.shape}, want {want.shape}"
    bad = np.flatnonzero(g != w)
    if bad.size == 0:
        return "same bits"
    i = bad[0]
    return f"{bad.size} elements differ, first at {i}: got bits {g[i]:#x}, want {w[i]:#x}"


def poison(n, dtype, shape=None):
    shape = shape or (n,)
    if dtype == "bfloat16":
        return np.full(shape, 0x7FC1, dtype=np.uint16)  # a bfloat16 NaN
    return np.full(shape, np.nan, dtype=dtype)


CANONICAL_NAN = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}


def op_expected(parts, dtype, op):
    """max/min (IEEE 754-2019 maximum/minimum: NaN gives NaN, -0 < +0) or avg
    (float32 sum, one float32 division by the rank count), written here with
    NumPy comparisons; any NaN result is the dtype's canonical NaN."""
    acc = widen(parts[0], dtype).copy()
    for p in parts[1:]:
        b = widen(p, dtype)
        if op == "avg":
            acc = acc + b
            continue
        a = acc
        both_neg, one_neg = np.signbit(a) & np.signbit(b), np.signbit(a) | np.signbit(b)
        with np.errstate(invalid="ignore"):
            if op == "max":
                tie = np.where(both_neg, a, np.abs(a))
                acc = np.where(a > b, a, np.where(a < b, b, tie))
            else:
                tie = np.where(one_neg, -np.abs(a), a)
                acc = np.where(a < b, a, np.where(a > b, b, tie))
        acc = np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), acc).astype(np.float32)
    if op == "avg":
        acc = (acc / np.float32(len(parts))).astype(np.float32)
    nan = np.isnan(acc)
    want = narrow(np.where(nan, np.float32(0), acc).astype(np.float32), dtype)
    bits(want)[nan] = CANONICAL_NAN[dtype]
    return want


def rs_expected(case_id, n, dtype, op):
    """Block RANK of the all-reduce of every rank's size*n input, computed
    here (harness.expected / op_expected), and this rank's input."""
    parts = [partial(case_id, SIZE * n, dtype, r) for r in range(SIZE)]
    full = expected(parts, dtype) if op == "sum" else op_expected(parts, dtype, op)
    return parts[RANK], full[RANK * n:(RANK + 1) * n]


def ag_input(case_id, n, dtype, r):
    """Rank r's all-gather input: random bits of the element size, any
    pattern (NaN payloads included: the call must move bits unchanged)."""
    rng = np.random.default_rng([SEED, case_id, r, 7])
    u = rng.integers(0, 2 ** 32, n, dtype=np.uint32)
    if dtype == "float32":
        return u.view(np.float32)
    a = u.astype(np.uint16)
    return a if dtype == "bfloat16" else a.view(np.float16)


# ---- driver ------------------------------------------------------------------

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


_printed = set()


def note(msg):
    if RANK == 0 and msg not in _printed:
        _printed.add(msg)
        print(f"  note: {msg}", flush=True)


def main(title):
    """Runs every case (or those named in ARX_PY_CASES, comma-separated)
    on every rank, gathers the verdicts between cases
    (outside them: a case may end early on one rank, a gather never
    does), prints them on rank 0; returns the exit status."""
    t_all = time.monotonic()
    total_bad = 0
    only = [c for c in os.environ.get("ARX_PY_CASES", "").split(",") if c]
    cases = [fn for fn in CASES if not only or fn.__name__ in only]
    for fn in cases:
        before = len(failures)
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a case that raises fails
            failures.append(f"{fn.__name__} raised {type(e).__name__}: {e}")
        all_bad = WORLD.allgather(failures[before:])
        bad = sum(len(b) for b in all_bad)
        total_bad += bad
        if RANK == 0:
            print(f"{'PASS' if bad == 0 else 'FAIL'} {fn.__name__} ({time.monotonic() - t0:.1f} s)", flush=True)
            for r, b in enumerate(all_bad):
                for m in b[:10]:
                    print(f"    rank {r}: {m}", flush=True)
    if RANK == 0:
        verdict = "passed" if total_bad == 0 else f"FAILED ({total_bad} failed checks)"
        print(f"{title}, {SIZE} ranks: {len(cases)} cases {verdict} in {time.monotonic() - t_all:.1f} s",
              flush=True)
    return 0 if total_bad == 0 else 1

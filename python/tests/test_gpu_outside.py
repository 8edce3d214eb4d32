#!/usr/bin/env python3
"""An outside tester's GPU checks of the arx Python binding.

    mpirun -n 2 python3 test_gpu_outside.py      # then -n 3 (one GPU, MPS)

Independent of the authors' tests: every rank derives every rank's input
from seeds, computes the expected bits in NumPy (float32 sums in rank order,
one rounding to the element type; bfloat16 rounding in integer arithmetic),
poisons outputs before each call and compares bit patterns.

Each case runs in its own function; a failure is recorded and the next case
runs. Cases create their own arx.Comm objects (call timeout 20 s, start-up
timeout 20 s), which are closed after the case on every rank. Between cases
every rank synchronizes its GPU and meets the others at an MPI barrier. At
the end rank 0 prints "PASS name" / "FAIL name: reasons" per case and
"stranger_gpu: N passed, M failed".

`python3 test_gpu_outside.py --selftest` (NumPy only) checks the reference
functions; `mpirun -n 3 python3 test_gpu_outside.py --hostcheck` compares them
with arx's host device side (a sanity check of the reference, no GPU).
"""

import hashlib
import os
import sys
import threading
import time
import traceback
import zlib

T0 = time.monotonic()

import numpy as np  # noqa: E402

BUDGET_S = 112.0  # no case starts after this (seconds since start)
WATCHDOG_S = 143.0  # a rank still running then prints what it has and exits

SEED = 20270117
DT = ("float32", "float16", "bfloat16")
ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
UT = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
ST = {"float32": np.int32, "float16": np.int16, "bfloat16": np.int16}
POISON = {"float32": 0x7FA5A5A5, "float16": 0x7D5A, "bfloat16": 0x7FA5}  # NaN patterns
CANON = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}
SIGN = {"float32": 0x80000000, "float16": 0x8000, "bfloat16": 0x8000}

# Special values (bit patterns) per dtype: zeros, infinities, NaNs with
# payloads (quiet and signalling, both signs), extremes, subnormals.
POOL = {
    "float32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC12345,
                0xFFC00001, 0x7F800011, 0x3F800000, 0xBF800000, 0x7F7FFFFF, 0xFF7FFFFF,
                0x00000001, 0x80000001, 0x00800000, 0x00000003, 0x007FFFFF, 0x807FFFFF],
    "float16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7E15, 0xFE01, 0x7C11, 0x3C00, 0xBC00,
                0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0400, 0x0003, 0x03FF, 0x83FF],
    "bfloat16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC5, 0xFFC1, 0x7F91, 0x3F80, 0xBF80,
                 0x7F7F, 0xFF7F, 0x0001, 0x8001, 0x0080, 0x0003, 0x007F, 0x807F],
}


# ---- reference (NumPy only) --------------------------------------------------

def to_f32(bits, dtype):
    """Bit patterns of `dtype` -> float32 values, exactly."""
    b = np.ascontiguousarray(bits).view(UT[dtype]).reshape(-1)
    if dtype == "float32":
        return b.view(np.float32).copy()
    if dtype == "float16":
        return b.view(np.float16).astype(np.float32)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def from_f32(a, dtype):
    """float32 values -> bit patterns of `dtype`, one round-to-nearest-even."""
    a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    if dtype == "float32":
        return a.view(np.uint32).copy()
    if dtype == "float16":
        with np.errstate(all="ignore"):
            return a.astype(np.float16).view(np.uint16).copy()
    u = a.view(np.uint32).astype(np.uint64)
    r = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    nan = np.isnan(a)
    r[nan] = (u[nan] >> np.uint64(16)) | np.uint64(0x40)
    return r.astype(np.uint16)


def isnan_bits(b, dtype):
    b = np.asarray(b).view(UT[dtype])
    if dtype == "float32":
        return (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    lim = 0x7C00 if dtype == "float16" else 0x7F80
    return (b & np.uint16(0x7FFF)) > np.uint16(lim)


def ieee_max(a, b):
    """IEEE 754-2019 maximum: NaN if either is NaN, -0 < +0."""
    with np.errstate(invalid="ignore"):
        r = np.where(a > b, a, b)
        eq = a == b
        r = np.where(eq, np.where(np.signbit(a), b, a), r)
        r = np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), r)
    return r.astype(np.float32)


def ieee_min(a, b):
    with np.errstate(invalid="ignore"):
        r = np.where(a < b, a, b)
        eq = a == b
        r = np.where(eq, np.where(np.signbit(a), a, b), r)
        r = np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), r)
    return r.astype(np.float32)


def ref_reduce(parts, dtype, op="sum", order=None):
    """The expected bits: `parts` (bit arrays, one per rank) reduced in
    `order` (default rank order) in float32, one rounding to `dtype`.
    max/min/avg NaN results are the canonical NaN; a sum's NaN is any NaN
    (compare with nan_any=True)."""
    order = list(range(len(parts))) if order is None else list(order)
    with np.errstate(all="ignore"):
        acc = to_f32(parts[order[0]], dtype).copy()
        for r in order[1:]:
            b = to_f32(parts[r], dtype)
            if op in ("sum", "avg"):
                acc = (acc + b).astype(np.float32)
            elif op == "max":
                acc = ieee_max(acc, b)
            elif op == "min":
                acc = ieee_min(acc, b)
            else:
                raise ValueError(op)
        if op == "avg":
            acc = (acc / np.float32(len(order))).astype(np.float32)
    out = from_f32(acc, dtype)
    if op != "sum":
        out[np.isnan(acc)] = CANON[dtype]
    return out


def f32_op(bits, dtype, fn):
    """An elementwise torch op on a `dtype` tensor, as torch computes it:
    in float32, rounded once to dtype."""
    with np.errstate(all="ignore"):
        return from_f32(fn(to_f32(bits, dtype)).astype(np.float32), dtype)


def special_rows(dtype, r):
    """Fixed leading elements of rank r's input in the specials cases."""
    def F(v):
        return int(from_f32(np.array([v], np.float32), dtype)[0])
    p = POOL[dtype]
    zero, nzero, pinf, ninf = p[0], p[1], p[2], p[3]
    qnan, snan, one, maxf, nmaxf, minsub = p[5], p[7], p[8], p[10], p[11], p[12]
    tiny = F({"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype])
    return [
        nzero,                                   # all -0: sum -0, max/min -0
        nzero if r == 0 else zero,               # -0 + +0 = +0, max +0, min -0
        maxf,                                    # overflow of the sum; f16 avg fits
        qnan if r == 0 else one,                 # NaN from one rank
        minsub,                                  # subnormals, no flush to zero
        pinf if r == 0 else (ninf if r == 1 else zero),  # inf - inf
        snan if r == 0 else ninf,                # signalling NaN
        one if r == 0 else tiny,                 # order and single rounding
        maxf if r == 0 else (nmaxf if r == 1 else one),  # cancellation of extremes
        zero if r == 0 else nzero,               # +0 then -0s
    ]


def rng_for(tag, r):
    return np.random.default_rng([SEED, zlib.crc32(tag.encode()), r])


def gen(tag, n, dtype, r, special=0.0):
    """Rank r's input (bit patterns of dtype) for `tag`: random values with
    exponents spread over 2^-6..2^6; with `special` > 0 that fraction drawn
    from POOL and the special rows in front."""
    rng = rng_for(f"{tag}/{dtype}", r)
    v = rng.standard_normal(n, dtype=np.float32) * np.exp2(rng.integers(-6, 7, n).astype(np.float32))
    b = from_f32(v, dtype)
    if special > 0 and n > 0:
        pool = np.array(POOL[dtype], dtype=UT[dtype])
        m = rng.random(n) < special
        b[m] = pool[rng.integers(0, len(pool), int(m.sum()))]
        rows = np.array(special_rows(dtype, r), dtype=UT[dtype])[:n]
        b[: len(rows)] = rows
    return b


def all_parts(tag, n, dtype, special=0.0, ranks=None):
    ranks = range(SIZE) if ranks is None else ranks
    return [gen(tag, n, dtype, r, special) for r in ranks]


def first_diff(got, want, dtype, nan_any):
    got = np.asarray(got).view(UT[dtype]).reshape(-1)
    want = np.asarray(want).view(UT[dtype]).reshape(-1)
    if got.shape != want.shape:
        return f"{got.size} elements, want {want.size}"
    bad = got != want
    if nan_any:
        bad &= ~(isnan_bits(got, dtype) & isnan_bits(want, dtype))
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return f"{int(bad.sum())} of {got.size} wrong, first [{i}] got {int(got[i]):#x} want {int(want[i]):#x}"


# ---- self-test of the reference (no MPI, no torch) ---------------------------

def selftest():
    fails = []

    def ok(c, m):
        if not c:
            fails.append(m)

    # bf16 rounding: ties to even, carries into the exponent, overflow, NaN.
    cases = [(0x3F808000, 0x3F80), (0x3F818000, 0x3F82), (0x3F808001, 0x3F81), (0x3F80FFFF, 0x3F81),
             (0x7F7FFFFF, 0x7F80), (0x7F7F7FFF, 0x7F7F), (0x7F800000, 0x7F80), (0xFF800000, 0xFF80),
             (0x80000000, 0x8000), (0x00008000, 0x0000), (0x00018000, 0x0002), (0x3FFFFFFF, 0x4000)]
    for u, want in cases:
        got = int(from_f32(np.array([u], np.uint32).view(np.float32), "bfloat16")[0])
        ok(got == want, f"bf16 round {u:#x}: {got:#x} want {want:#x}")
    for u in (0x7F800001, 0x7FC00000, 0xFFC12345, 0x7F80FFFF):
        got = from_f32(np.array([u], np.uint32).view(np.float32), "bfloat16")
        ok(bool(isnan_bits(got, "bfloat16")[0]), f"bf16 NaN {u:#x} -> {int(got[0]):#x}")
    # bf16 against round(float64) over random float32 values.
    rng = np.random.default_rng(1)
    u = rng.integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32)
    f = u.view(np.float32)
    f = f[np.isfinite(f)]
    got = to_f32(from_f32(f, "bfloat16"), "bfloat16").astype(np.float64)
    # brute-force nearest of the two candidates (truncate, next up), ties even
    t = (f.view(np.uint32) >> np.uint32(16)).astype(np.uint32)
    lo = (t << np.uint32(16)).view(np.float32).astype(np.float64)
    hi = ((t + np.uint32(1)) << np.uint32(16)).view(np.float32).astype(np.float64)
    x = f.astype(np.float64)
    with np.errstate(all="ignore"):
        dlo, dhi = np.abs(x - lo), np.abs(hi - x)
        pick_hi = (dhi < dlo) | ((dhi == dlo) & ((t & np.uint32(1)) == 1))
        want = np.where(pick_hi, hi, lo)
        # a value that rounds beyond max finite is inf
        bad = ~((got == want) | (np.isinf(got) & (np.abs(x) >= 3.3961775292304e38)))
    ok(not bad.any(), f"bf16 rounding differs from brute force on {int(bad.sum())} values")
    # f16 rounding by NumPy: ties to even, subnormals.
    for v, want in ((1 + 2 ** -11, 0x3C00), (1 + 3 * 2 ** -11, 0x3C02), (2 ** -24, 0x0001),
                    (2 ** -25, 0x0000), (3 * 2 ** -25, 0x0002), (65520.0, 0x7C00), (65519.0, 0x7BFF)):
        got = int(from_f32(np.array([v], np.float32), "float16")[0])
        ok(got == want, f"f16 round {v}: {got:#x} want {want:#x}")
    # float32 arithmetic here keeps subnormals (no FTZ/DAZ).
    s = (np.array([1], np.uint32).view(np.float32) + np.array([1], np.uint32).view(np.float32))
    ok(int(s.view(np.uint32)[0]) == 2, "NumPy float32 flushes subnormals here")
    # max/min on signed zeros and NaN; avg and sum.
    P = [np.array([0x8000, 0x0000, 0x7FC5, 0x3F80], np.uint16), np.array([0x0000, 0x8000, 0x3F80, 0x7F80], np.uint16)]
    ok(list(ref_reduce(P, "bfloat16", "max")) == [0x0000, 0x0000, 0x7FC0, 0x7F80], f"max {ref_reduce(P, 'bfloat16', 'max')}")
    ok(list(ref_reduce(P, "bfloat16", "min")) == [0x8000, 0x8000, 0x7FC0, 0x3F80], f"min {ref_reduce(P, 'bfloat16', 'min')}")
    ok(list(ref_reduce(P, "bfloat16", "sum"))[:2] == [0x0000, 0x0000], "sum of zeros")
    P3 = [np.array([0x8000, 0x8000], np.uint16)] * 3
    ok(list(ref_reduce(P3, "float16", "sum")) == [0x8000, 0x8000], "-0 sums")
    ok(list(ref_reduce(P3, "float16", "avg")) == [0x8000, 0x8000], "-0 avg")
    # f16 max finite: sum overflows, avg fits.
    M = [np.array([0x7BFF], np.uint16)] * 3
    ok(int(ref_reduce(M, "float16", "sum")[0]) == 0x7C00, "f16 sum overflow")
    ok(int(ref_reduce(M, "float16", "avg")[0]) == 0x7BFF, "f16 avg of max")
    M = [np.array([0x7F7FFFFF], np.uint32)] * 2
    ok(int(ref_reduce(M, "float32", "avg")[0]) == 0x7F800000, "f32 avg overflow is inf")
    # Order matters with three ranks (the special row 7): 1 + t + t.
    for dtype, want_fwd in (("float32", 0x3F800000), ("float16", 0x3C01), ("bfloat16", 0x3F81)):
        rows = [np.array([special_rows(dtype, r)[7]], UT[dtype]) for r in range(3)]
        fwd = int(ref_reduce(rows, dtype)[0])
        rev = int(ref_reduce(rows, dtype, order=[2, 1, 0])[0])
        ok(fwd == want_fwd, f"{dtype} row 7 forward {fwd:#x} want {want_fwd:#x}")
        if dtype == "float32":
            ok(rev == 0x3F800001, f"f32 row 7 reverse {rev:#x}")
    # gen is deterministic and special rows land.
    a = gen("t", 100, "float16", 1, special=0.3)
    b = gen("t", 100, "float16", 1, special=0.3)
    ok(np.array_equal(a, b), "gen not deterministic")
    ok(int(a[0]) == 0x8000, "special row 0")
    ok(not np.array_equal(gen("t", 100, "float32", 0), gen("t", 100, "float32", 1)), "ranks share inputs")
    ok(first_diff(a, b, "float16", False) is None, "first_diff same")
    c = b.copy()
    c[3] = 0x7E77
    ok(first_diff(c, b, "float16", True) is None or not isnan_bits(b[3:4], "float16")[0], "nan_any")
    for m in fails:
        print("SELFTEST FAIL", m)
    print(f"selftest: {len(fails)} failures")
    return 1 if fails else 0


# ---- per-case bookkeeping ----------------------------------------------------

class CaseState:
    def __init__(self, name):
        self.name = name
        self.fails = []
        self.notes = []
        self.digests = []
        self.comms = []
        self.secs = 0.0


CUR = CaseState("setup")
DONE = []
CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def chk(cond, msg):
    if not cond:
        CUR.fails.append(str(msg))
    return bool(cond)


def note(msg):
    CUR.notes.append(str(msg))


def short(e, n=260):
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[:n] + "..."


def cmp(label, got, want, dtype, nan_any=False, digest=True):
    """Bit comparison; the result's digest is kept for the cross-rank check
    (labels shared by ranks must hold identical bits on every rank)."""
    got = np.asarray(got).view(UT[dtype]).reshape(-1)
    want = np.asarray(want).view(UT[dtype]).reshape(-1)
    d = first_diff(got, want, dtype, nan_any)
    chk(d is None, f"{label}: {d}")
    if digest:
        g = got.copy()
        if nan_any:
            g[isnan_bits(g, dtype)] = CANON[dtype]
        CUR.digests.append((label, hashlib.sha1(g.tobytes()).hexdigest()[:16]))
    return d is None


def mk(mpi_comm=None, **kw):
    kw.setdefault("timeout", 20)
    kw.setdefault("init_timeout", 15)
    kw.setdefault("device", "gpu")
    c = arx.Comm(WORLD if mpi_comm is None else mpi_comm, **kw)
    CUR.comms.append(c)
    return c


def expect_err(fn, classes, label, within=10.0, contains=()):
    """fn() must raise one of `classes` (arx errors) within `within` s."""
    if not isinstance(classes, tuple):
        classes = (classes,)
    names = "/".join(c.__name__ for c in classes)
    t0 = time.monotonic()
    try:
        fn()
    except arx.Error as e:
        dt = time.monotonic() - t0
        chk(isinstance(e, classes), f"{label}: got {type(e).__name__} ({short(e)}), want {names}")
        chk(dt < within, f"{label}: raised after {dt:.1f} s (want < {within} s)")
        chk(len(str(e)) > 10, f"{label}: message too short: {e!r}")
        for w in contains:
            chk(w in str(e), f"{label}: message lacks {w!r}: {short(e)}")
        return e
    except Exception as e:  # noqa: BLE001
        chk(False, f"{label}: non-arx {type(e).__name__}: {short(e)}")
        return e
    chk(False, f"{label}: nothing raised (want {names})")
    return None


# ---- torch helpers (torch imported in __main__) ------------------------------

TD = {}
DEV = None
MAXC = {"float32": 262144, "float16": 524288, "bfloat16": 524288}
SLEEP = 30_000_000  # GPU cycles, ~15 ms on an H200


def dev(bits, dtype, device=None):
    """Bit patterns -> a CUDA tensor of dtype (on the current stream)."""
    a = np.ascontiguousarray(np.asarray(bits).view(UT[dtype])).view(ST[dtype]).copy()
    return torch.from_numpy(a).to(device or DEV).view(TD[dtype])


def cpu_t(bits, dtype):
    a = np.ascontiguousarray(np.asarray(bits).view(UT[dtype])).view(ST[dtype]).copy()
    return torch.from_numpy(a).view(TD[dtype])


def hbits(t):
    """A tensor's bits as a flat NumPy uint array (after the current stream)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    four = t.element_size() == 4
    a = t.reshape(-1).view(torch.int32 if four else torch.int16).cpu().numpy()
    return a.view(np.uint32 if four else np.uint16).copy()


def tdt(t):
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[t.dtype]


def poison_(t):
    four = t.element_size() == 4
    t.view(torch.int32 if four else torch.int16).fill_(POISON[tdt(t)])
    return t


def pempty(n, dtype):
    return poison_(torch.empty(n, dtype=TD[dtype], device=DEV))


def sync():
    torch.cuda.synchronize()


# ---- cases -------------------------------------------------------------------

@case
def default_device_is_gpu():
    """arx.Comm(WORLD) without device= picks the GPU side; describe() is
    complete; a first call sums."""
    global DEV
    c = arx.Comm(WORLD, timeout=20, init_timeout=20)
    CUR.comms.append(c)
    chk(c.device == "gpu", f"device {c.device!r}, want 'gpu'")
    chk(isinstance(c.cuda_device, int), f"cuda_device {c.cuda_device!r}")
    chk(c.rank == RANK and c.size == SIZE, f"rank/size {c.rank}/{c.size}")
    d = c.describe()
    for k in ("device", "fabric", "fabric_detail", "region_bytes", "slot_bytes", "world", "rank",
              "cuda_device", "timeout", "init_timeout", "max_count"):
        chk(k in d, f"describe() lacks {k!r}")
    chk(d.get("device") == "gpu", f"describe device {d.get('device')!r}")
    chk(d.get("rank") == RANK, f"describe rank {d.get('rank')!r}")
    t = d.get("timeout")
    chk(isinstance(t, (int, float)) and abs(t - 20) < 1e-6, f"describe timeout {t!r}, want 20")
    mc = d.get("max_count")
    if chk(isinstance(mc, dict), f"max_count {mc!r}"):
        for dt in DT:
            v = mc.get(dt)
            if chk(isinstance(v, int) and v > 0, f"max_count[{dt}] = {v!r}"):
                MAXC[dt] = v
        sb = d.get("slot_bytes")
        if isinstance(sb, int):
            for dt in DT:
                chk(MAXC[dt] * ESIZE[dt] <= sb, f"max_count[{dt}]={MAXC[dt]} exceeds slot_bytes {sb}")
    note(f"describe: fabric {d.get('fabric')}, slot_bytes {d.get('slot_bytes')}, max_count {mc}")
    if isinstance(c.cuda_device, int):
        DEV = torch.device("cuda", c.cuda_device)
    torch.cuda.set_device(DEV)
    x = torch.full((1000,), float(RANK + 1), device=DEV)
    r = c.allreduce(x)
    chk(r is x, "in place returns the input")
    c.check()
    chk(bool((x == SIZE * (SIZE + 1) / 2).all().item()), "first sum wrong")


@case
def sizes_around_slot_boundaries():
    """Every dtype from 1 element to beyond 1 MiB slots, 262143/4/5 f32
    elements and 16M+3 f32: bit-exact sums (chunked calls included), in
    and out of place, nothing written past `out`, inputs unchanged."""
    c = mk()
    for dtype in DT:
        m = MAXC[dtype]
        h = m // 2
        mib = (1 << 20) // ESIZE[dtype]
        sizes = sorted({1, 3, h - 1, h, h + 1, m - 1, m, m + 1, 2 * m - 1, 2 * m + 1, mib - 1, mib, mib + 1,
                        3 * m + 17} - {0})
        sizes.append(16 * 1024 * 1024 + 3 if dtype == "float32" else 4 * 1024 * 1024 + 1)
        N = max(sizes) + 64
        parts = all_parts("sizes", N, dtype)
        want = ref_reduce(parts, dtype)
        xin = dev(parts[RANK], dtype)
        out = torch.empty(N, dtype=TD[dtype], device=DEV)
        for i, n in enumerate(sizes):
            label = f"{dtype} n={n}"
            if i % 2 == 0:
                poison_(out[: n + 64])
                o = out[:n]
                r = c.allreduce(xin[:n], o)
                chk(r is o, f"{label}: out of place did not return out")
                sync()
                got = hbits(out[: n + 64])
                cmp(label + " out of place", got[:n], want[:n], dtype)
                chk((got[n:] == POISON[dtype]).all(), f"{label}: wrote past the end of out")
            else:
                x = xin[:n].clone()
                r = c.allreduce(x)
                chk(r is x, f"{label}: in place did not return x")
                sync()
                cmp(label + " in place", hbits(x), want[:n], dtype)
                del x
        sync()
        cmp(f"{dtype} input unchanged", hbits(xin), parts[RANK], dtype, digest=False)
        del xin, out
    c.check()


@case
def ops_on_special_values():
    """sum/max/min/avg on -0, NaN payloads, sNaN, +-inf, subnormals, max
    finite, every dtype, allreduce (one slot and chunked) and
    reduce_scatter: sum bit-exact (NaN any NaN); max/min/avg exact with
    the canonical NaN."""
    c = mk()
    for dtype in DT:
        for n in (4099, MAXC[dtype] + 5):
            parts = all_parts(f"spec{n}", n, dtype, special=0.3)
            x = dev(parts[RANK], dtype)
            for op in ("sum", "max", "min", "avg"):
                if n > 4099 and op == "min":
                    continue
                want = ref_reduce(parts, dtype, op)
                o = pempty(n, dtype)
                r = c.allreduce(x, o, op=op)
                chk(r is o, "returns out")
                sync()
                cmp(f"allreduce {op} {dtype} n={n}", hbits(o), want, dtype, nan_any=(op == "sum"))
            cmp(f"{dtype} n={n} input unchanged", hbits(x), parts[RANK], dtype, digest=False)
        k = 1031
        parts = all_parts("specrs", SIZE * k, dtype, special=0.3)
        x = dev(parts[RANK], dtype)
        for op in ("sum", "max", "min", "avg"):
            want = ref_reduce(parts, dtype, op)[RANK * k:(RANK + 1) * k]
            o = pempty(k, dtype)
            c.reduce_scatter(x, o, op=op)
            sync()
            cmp(f"reduce_scatter {op} {dtype}", hbits(o), want, dtype, nan_any=(op == "sum"), digest=False)
    c.check()


@case
def unaligned_offset_views():
    """Inputs and outputs at odd element offsets inside larger tensors
    (x = buf[1:], out at another offset, chunked sizes too), in and out of
    place: a correct result with the neighbouring elements untouched, or a
    clear InvalidArgumentError."""
    c = mk()
    refused = 0
    for dtype in DT:
        m = MAXC[dtype]
        for j, (n, xo, oo) in enumerate([(1, 1, 3), (7, 3, 1), (1000, 1, 2), (4099, 5, 0), (m + 3, 1, 7),
                                         (65536, 0, 1), (33, 7, 5)]):
            label = f"{dtype} n={n} x@{xo} out@{oo}"
            parts = all_parts(f"unal{j}", n, dtype)
            want = ref_reduce(parts, dtype)
            xb = pempty(n + 16, dtype)
            xb[xo:xo + n].copy_(dev(parts[RANK], dtype))
            ob = pempty(n + 16, dtype)
            yb = pempty(n + 16, dtype)
            yb[oo:oo + n].copy_(dev(parts[RANK], dtype))
            try:
                c.allreduce(xb[xo:xo + n], ob[oo:oo + n])
                c.allreduce(yb[oo:oo + n])
                sync()
            except arx.Error as e:
                refused += 1
                chk(isinstance(e, (arx.InvalidArgumentError, arx.CallMismatchError)),
                    f"{label}: raised {type(e).__name__}: {short(e)}")
                note(f"{label}: refused: {short(e, 120)}")
                c.close()
                c = mk()
                continue
            g = hbits(ob)
            cmp(label + " out of place", g[oo:oo + n], want, dtype)
            chk((g[:oo] == POISON[dtype]).all() and (g[oo + n:] == POISON[dtype]).all(),
                f"{label}: elements around out were written")
            gx = hbits(xb)
            cmp(label + " input unchanged", gx[xo:xo + n], parts[RANK], dtype, digest=False)
            chk((gx[:xo] == POISON[dtype]).all() and (gx[xo + n:] == POISON[dtype]).all(),
                f"{label}: elements around the input changed")
            gy = hbits(yb)
            cmp(label + " in place", gy[oo:oo + n], want, dtype)
            chk((gy[:oo] == POISON[dtype]).all() and (gy[oo + n:] == POISON[dtype]).all(),
                f"{label}: elements around the in-place tensor were written")
    if refused:
        note(f"{refused} offset views refused")
    c.check()


@case
def layouts_correct_or_refused():
    """2-D contiguous, a row, an (n,1) tensor with an odd stride on its size-1
    dim (contiguous for torch): correct. A column, a transpose, a stride-0
    expand, channels_last: InvalidArgumentError (or, if accepted, a correct
    elementwise result)."""
    dtype = "float32"

    def run(label, build, must_accept):
        c = mk()
        base_parts = all_parts("lay-" + label, 64 * 48, dtype)
        want_full = ref_reduce(base_parts, dtype)
        bases = [to_f32(p, dtype).reshape(64, 48) for p in base_parts]
        t = dev(base_parts[RANK], dtype).reshape(64, 48)
        view, sel = build(t)
        # expected elementwise: the same selection of every rank's base, summed
        sel_parts = [from_f32(sel(b), dtype) for b in bases]
        want = ref_reduce(sel_parts, dtype)
        before = hbits(t).copy()
        try:
            c.allreduce(view)
            c.check()
        except arx.InvalidArgumentError as e:
            chk(not must_accept, f"{label}: refused: {short(e)}")
            note(f"{label}: refused ({short(e, 100)})")
            c.close()
            return
        except arx.Error as e:
            chk(False, f"{label}: {type(e).__name__}: {short(e)}")
            c.close()
            return
        sync()
        cmp(f"layout {label}", hbits(view), want, dtype)
        if not must_accept:
            note(f"{label}: accepted")
        if label in ("row", "column"):  # the rest of the base is untouched
            mask = np.ones((64, 48), bool)
            if label == "row":
                mask[5, :] = False
            else:
                mask[:, 3] = False
            after = hbits(t).reshape(64, 48)
            chk(np.array_equal(after[mask], before.reshape(64, 48)[mask]), f"{label}: other elements changed")
        del want_full
        c.close()

    run("2-D contiguous", lambda t: (t, lambda b: b.reshape(-1)), True)
    run("row", lambda t: (t[5], lambda b: b[5]), True)
    run("(n,1) odd stride", lambda t: (t.reshape(-1).as_strided((64 * 48, 1), (1, 999)),
                                      lambda b: b.reshape(-1)), True)
    run("column", lambda t: (t[:, 3], lambda b: b[:, 3]), False)
    run("transpose", lambda t: (t.t(), lambda b: b.T.reshape(-1)), False)
    run("channels_last", lambda t: (t.reshape(2, 3, 16, 32).to(memory_format=torch.channels_last),
                                    lambda b: b.reshape(2, 3, 16, 32).reshape(-1)), False)

    # stride 0: never a wrong result
    c = mk()
    one = dev(gen("lay-exp", 1, dtype, RANK), dtype)
    e = one.expand(100)
    try:
        c.allreduce(e)
        c.check()
        sync()
        want = ref_reduce(all_parts("lay-exp", 1, dtype), dtype)
        note("stride-0 expand accepted")
        cmp("stride-0 expand", hbits(e)[:1], want, dtype, digest=False)
    except arx.InvalidArgumentError:
        pass
    except arx.Error as ex:
        chk(False, f"stride-0 expand: {type(ex).__name__}: {short(ex)}")
    c.close()


@case
def zero_and_one_element_tensors():
    """Empty tensors ((0,), (0,5)), 0-d and 1-element tensors, every dtype
    and op, allreduce/reduce_scatter/all_gather/broadcast with n=0; the
    Comm stays in step (a normal call after them is exact)."""
    c = mk()
    for dtype in DT:
        e = torch.empty(0, dtype=TD[dtype], device=DEV)
        chk(c.allreduce(e) is e, "n=0 in place returns x")
        e2 = torch.empty((0, 5), dtype=TD[dtype], device=DEV)
        o2 = torch.empty((0, 5), dtype=TD[dtype], device=DEV)
        chk(c.allreduce(e2, o2) is o2, "n=0 out of place returns out")
        c.reduce_scatter(torch.empty(0, dtype=TD[dtype], device=DEV), torch.empty(0, dtype=TD[dtype], device=DEV))
        c.all_gather(torch.empty(0, dtype=TD[dtype], device=DEV), torch.empty(0, dtype=TD[dtype], device=DEV))
        c.broadcast(torch.empty(0, dtype=TD[dtype], device=DEV), root=SIZE - 1)
        parts = all_parts("one", 1, dtype, special=0.0)
        for op in ("sum", "max", "min", "avg"):
            want = ref_reduce(parts, dtype, op)
            x = dev(parts[RANK], dtype).reshape(())  # 0-d
            r = c.allreduce(x, op=op)
            chk(r is x, "0-d returns x")
            o = pempty(1, dtype)
            c.allreduce(dev(parts[RANK], dtype), o, op=op)
            sync()
            cmp(f"0-d {op} {dtype}", hbits(x), want, dtype)
            cmp(f"1-element {op} {dtype}", hbits(o), want, dtype)
        # one element per rank through reduce_scatter / all_gather
        p1 = all_parts("one-rs", SIZE, dtype)
        o = pempty(1, dtype)
        c.reduce_scatter(dev(p1[RANK], dtype), o)
        og = pempty(SIZE, dtype)
        c.all_gather(dev(p1[RANK][:1], dtype), og)
        sync()
        cmp(f"reduce_scatter n=1 {dtype}", hbits(o), ref_reduce(p1, dtype)[RANK:RANK + 1], dtype, digest=False)
        cmp(f"all_gather n=1 {dtype}", hbits(og), np.concatenate([p[:1] for p in p1]), dtype)
    xh = np.zeros(0, np.float32)
    c.allreduce(xh)  # host call with no elements on a GPU Comm
    parts = all_parts("after-empty", 5000, "bfloat16")
    x = dev(parts[RANK], "bfloat16")
    c.allreduce(x)
    sync()
    cmp("after empty calls", hbits(x), ref_reduce(parts, "bfloat16"), "bfloat16")
    c.check()


@case
def side_stream_torch_work_before_and_after():
    """On a side stream, behind a rank-dependent sleep: a torch op makes the
    input, allreduce in place, a torch op on the result, allreduce out of
    place, a torch op on that; a call whose input the next kernel on the
    stream overwrites (max), and an in-place min followed by a doubling.
    Read after stream.synchronize() only."""
    c = mk()
    for k, dtype in enumerate(DT):
        n = 50000 + k
        P = all_parts("ss-p", n, dtype)
        Q = all_parts("ss-q", n, dtype)
        P2 = [f32_op(p, dtype, lambda a: a * np.float32(2)) for p in P]
        s1 = ref_reduce(P2, dtype)
        Y = [f32_op(s1, dtype, lambda a, q=q: a + to_f32(q, dtype)) for q in Q]
        s2 = ref_reduce(Y, dtype)
        s2neg = s2 ^ UT[dtype](SIGN[dtype])
        wmax = ref_reduce(P, dtype, "max")
        wmin2 = f32_op(ref_reduce(Q, dtype, "min"), dtype, lambda a: a * np.float32(2))
        src_p = dev(P[RANK], dtype)
        src_q = dev(Q[RANK], dtype)
        sync()
        s = torch.cuda.Stream(DEV)
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP * (1 + 2 * RANK))
            x = src_p * 2
            c.allreduce(x)
            y = x + src_q
            o = torch.empty_like(y)
            poison_(o)
            c.allreduce(y, o)
            o.neg_()
            z = src_p.clone()
            oz = torch.empty_like(z)
            poison_(oz)
            c.allreduce(z, oz, op="max")
            z.fill_(3.0)  # the next kernel on the stream overwrites the input
            w = src_q.clone()
            c.allreduce(w, op="min")
            w.mul_(2)
        s.synchronize()
        cmp(f"{dtype} in place after a torch op", hbits(x), s1, dtype)
        cmp(f"{dtype} out of place, negated after", hbits(o), s2neg, dtype)
        cmp(f"{dtype} max, input overwritten after the call", hbits(oz), wmax, dtype)
        cmp(f"{dtype} min in place, doubled after", hbits(w), wmin2, dtype)
    c.check()


@case
def streams_alternating_without_dependencies():
    """12 calls (sum/max/avg, allreduce/reduce_scatter/broadcast/all_gather,
    three dtypes) alternating between two side streams and the default
    stream (and stream= as a raw int), with rank- and call-dependent sleeps
    before some, no synchronization until the end: every result exact."""
    c = mk()
    s1, s2 = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
    streams = [s1, s2, torch.cuda.default_stream(DEV)]
    kinds = ["ar", "rs", "ar", "bc", "ag", "ar"]
    ops = ["sum", "max", "avg", "sum"]
    plan = []
    for i in range(12):
        dtype = DT[i % 3]
        kind = kinds[i % len(kinds)]
        op = ops[i % len(ops)]
        n = (4096, 70001, 1000, 262149)[i % 4]
        if kind in ("rs", "ag"):
            n = 3001
        if kind == "rs":
            parts = all_parts(f"alt{i}", SIZE * n, dtype)
            want = ref_reduce(parts, dtype, op)[RANK * n:(RANK + 1) * n]
            x, o = dev(parts[RANK], dtype), pempty(n, dtype)
        elif kind == "ag":
            parts = all_parts(f"alt{i}", n, dtype)
            want = np.concatenate(parts)
            x, o = dev(parts[RANK], dtype), pempty(SIZE * n, dtype)
        elif kind == "bc":
            root = i % SIZE
            parts = all_parts(f"alt{i}", n, dtype)
            want = parts[root]
            x, o = dev(parts[RANK], dtype), pempty(n, dtype)
        else:
            parts = all_parts(f"alt{i}", n, dtype)
            want = ref_reduce(parts, dtype, op)
            x, o = dev(parts[RANK], dtype), pempty(n, dtype)
        plan.append((i, dtype, kind, op, x, o, want))
    sync()
    for i, dtype, kind, op, x, o, want in plan:
        st = streams[i % 3]
        kw = {}
        ctx = torch.cuda.stream(st)
        if i % 4 == 3:  # stream= as a raw CUstream, from the default stream
            kw = {"stream": st.cuda_stream}
            ctx = torch.cuda.stream(torch.cuda.default_stream(DEV))
        with ctx:
            if i % 2 == 0:
                with torch.cuda.stream(st):
                    torch.cuda._sleep(SLEEP * (1 + (i + RANK) % 3))
            if kind == "ar":
                c.allreduce(x, o, op=op, **kw)
            elif kind == "rs":
                c.reduce_scatter(x, o, op=op, **kw)
            elif kind == "bc":
                c.broadcast(x, o, root=i % SIZE, **kw)
            else:
                c.all_gather(x, o, **kw)
    sync()
    for i, dtype, kind, op, x, o, want in plan:
        cmp(f"call {i} {kind} {op} {dtype} on stream {i % 3}", hbits(o), want, dtype, digest=(kind != "rs"))
    c.check()


@case
def caching_allocator_reuse():
    """Tensors freed right after their call and their blocks reused (also
    after empty_cache) for the next call, no synchronization; a tensor
    used on a side stream, record_stream'ed and freed while a new
    allocation on the default stream is overwritten at once."""
    c = mk()
    sizes = [3000, 70001, 3000, 262147, 1000, 70001, 5, 3000, 131072, 999, 3000, 70001]
    keep, ptrs = [], []
    for i, n in enumerate(sizes):
        dtype = ("bfloat16", "float32", "float16")[i % 3]
        parts = all_parts(f"alloc{i}", n, dtype)
        want = ref_reduce(parts, dtype, "sum")
        x = dev(parts[RANK], dtype)
        ptrs.append(x.data_ptr())
        if i % 2:
            o = torch.empty_like(x)
            poison_(o)
            c.allreduce(x, o)
            keep.append((i, dtype, o.clone(), want))
            del o
        else:
            c.allreduce(x)
            keep.append((i, dtype, x.clone(), want))
        del x
        if i % 4 == 3:
            torch.cuda.empty_cache()
    sync()
    for i, dtype, t, want in keep:
        cmp(f"alloc round {i} {dtype}", hbits(t), want, dtype)
    note(f"{len(ptrs) - len(set(ptrs))} of {len(ptrs)} input addresses were reused")
    # record_stream
    s = torch.cuda.Stream(DEV)
    keep = []
    n = 65536
    for i in range(6):
        parts = all_parts(f"rec{i}", n, "float32")
        want = ref_reduce(parts, "float32")
        a = dev(parts[RANK], "float32")
        s.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP)
            c.allreduce(a)
            res = a.clone()
        a.record_stream(s)
        res.record_stream(torch.cuda.current_stream(DEV))
        del a
        b = torch.empty(n, dtype=torch.float32, device=DEV)
        b.fill_(12345.0)
        keep.append((i, res, want, b))
    s.synchronize()
    sync()
    for i, res, want, b in keep:
        cmp(f"record_stream round {i}", hbits(res), want, "float32")
    c.check()


@case
def host_and_gpu_calls_on_one_comm():
    """A GPU call queued behind a sleep on a side stream, then at once host
    calls on the same Comm (NumPy f32 in place, NumPy bf16 bits with
    dtype=, a CPU f16 tensor reduce_scatter, a pinned CPU tensor, a NumPy
    broadcast), a GPU call on the default stream, a host all_gather: all
    exact, in the order made."""
    c = mk()
    n, k = 30000, 1500
    Pg = all_parts("hg-g", n, "float32")
    Ph = all_parts("hg-h", n, "float32")
    Pb = all_parts("hg-b", n, "bfloat16")
    Pr = all_parts("hg-r", SIZE * k, "float16")
    Pp = all_parts("hg-p", 777, "float16")
    Pc = all_parts("hg-c", n, "bfloat16")
    Pbc = all_parts("hg-bc", 999, "float32")
    Pag = all_parts("hg-ag", 513, "float16")
    xg = dev(Pg[RANK], "float32")
    og = pempty(n, "float32")
    sync()
    s = torch.cuda.Stream(DEV)
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP * 3)
        c.allreduce(xg, og)
    xh = Ph[RANK].view(np.float32).copy()
    chk(c.allreduce(xh) is xh, "NumPy in place returns x")
    cmp("numpy f32 in place after a queued GPU call", xh.view(np.uint32), ref_reduce(Ph, "float32"), "float32")
    xb = Pb[RANK].copy()
    ob = np.full(n, POISON["bfloat16"], np.uint16)
    c.allreduce(xb, ob, dtype="bfloat16")
    cmp("numpy bf16 bits out of place", ob, ref_reduce(Pb, "bfloat16"), "bfloat16")
    xt = cpu_t(Pr[RANK], "float16")
    ot = torch.full((k,), float("nan"), dtype=torch.float16)
    c.reduce_scatter(xt, ot)
    cmp("CPU f16 tensor reduce_scatter", hbits(ot), ref_reduce(Pr, "float16")[RANK * k:(RANK + 1) * k],
        "float16", digest=False)
    xp = cpu_t(Pp[RANK], "float16").pin_memory()
    c.allreduce(xp, op="max")
    cmp("pinned CPU f16 tensor max", hbits(xp), ref_reduce(Pp, "float16", "max"), "float16")
    xc = dev(Pc[RANK], "bfloat16")
    c.allreduce(xc, op="avg")
    xbc = Pbc[RANK].view(np.float32).copy()
    c.broadcast(xbc, root=SIZE - 1)
    cmp("numpy broadcast after a GPU call", xbc.view(np.uint32), Pbc[SIZE - 1], "float32")
    xag = Pag[RANK].view(np.float16).copy()
    oag = np.full(SIZE * 513, np.nan, np.float16)
    c.all_gather(xag, oag)
    cmp("numpy all_gather", oag.view(np.uint16), np.concatenate(Pag), "float16")
    sync()
    cmp("GPU call queued before the host calls", hbits(og), ref_reduce(Pg, "float32"), "float32")
    cmp("GPU avg between host calls", hbits(xc), ref_reduce(Pc, "bfloat16", "avg"), "bfloat16")
    c.check()


@case
def kinds_differ_across_ranks():
    """Documented for reduce_scatter/all_gather/broadcast: a rank may pass
    host arrays where others pass CUDA tensors. Each on its own Comm."""
    k = 2000
    # reduce_scatter: rank 0 NumPy
    c = mk()
    P = all_parts("mix-rs", SIZE * k, "float32")
    want = ref_reduce(P, "float32")[RANK * k:(RANK + 1) * k]
    if RANK == 0:
        o = np.full(k, np.nan, np.float32)
        c.reduce_scatter(P[RANK].view(np.float32).copy(), o)
        got = o.view(np.uint32)
    else:
        o = pempty(k, "float32")
        c.reduce_scatter(dev(P[RANK], "float32"), o)
        sync()
        got = hbits(o)
    cmp("reduce_scatter, rank 0 NumPy", got, want, "float32", digest=False)
    # all_gather: last rank NumPy bf16 bits
    P = all_parts("mix-ag", k, "bfloat16")
    if RANK == SIZE - 1:
        o = np.full(SIZE * k, POISON["bfloat16"], np.uint16)
        c.all_gather(P[RANK].copy(), o, dtype="bfloat16")
        got = o
    else:
        o = pempty(SIZE * k, "bfloat16")
        c.all_gather(dev(P[RANK], "bfloat16"), o)
        sync()
        got = hbits(o)
    cmp("all_gather, last rank NumPy", got, np.concatenate(P), "bfloat16")
    # broadcast: root 0 CUDA, last rank NumPy out of place
    P = all_parts("mix-bc", k, "float16")
    if RANK == SIZE - 1 and RANK != 0:
        o = np.full(k, np.nan, np.float16)
        c.broadcast(P[RANK].view(np.float16).copy(), o, root=0)
        got = o.view(np.uint16)
    else:
        o = pempty(k, "float16")
        c.broadcast(dev(P[RANK], "float16"), o, root=0)
        sync()
        got = hbits(o)
    cmp("broadcast, last rank NumPy", got, P[0], "float16")
    c.check()


@case
def allreduce_host_on_one_rank_gpu_on_others():
    """Not spelled out for allreduce (it is for the other collectives), but
    both device sides run one protocol with one answer: rank 0 passes NumPy,
    the others CUDA tensors; exact, or a clear error on every rank."""
    c = mk()
    n = 5000
    P = all_parts("mix-ar", n, "float32")
    want = ref_reduce(P, "float32")
    try:
        if RANK == 0:
            x = P[RANK].view(np.float32).copy()
            c.allreduce(x)
            got = x.view(np.uint32)
        else:
            x = dev(P[RANK], "float32")
            c.allreduce(x)
            c.check()
            sync()
            got = hbits(x)
        cmp("allreduce, rank 0 NumPy, others CUDA", got, want, "float32")
    except arx.Error as e:
        chk(False, f"refused: {type(e).__name__}: {short(e)}")


@case
def graph_of_many_calls_and_torch_ops():
    """One torch.cuda.graph: allreduce in place (bf16), a torch op, avg out
    of place, a chunked f32 sum, reduce_scatter max (f16), broadcast from
    the last rank in place, a torch op on its result, allreduce of that,
    all_gather; replayed 25 times on new inputs (outputs poisoned before
    each replay), eager calls on a side stream between some replays."""
    c = mk()
    R = 25
    NA, NC, KD, NE, NG = 4096, MAXC["float32"] + 5, 1000, 3000, 777
    inputs = {}
    specs = {"a": (NA, "bfloat16"), "q": (NA, "bfloat16"), "c": (NC, "float32"),
             "d": (SIZE * KD, "float16"), "e": (NE, "bfloat16"), "g": (NG, "float32")}
    for key, (n, dtype) in specs.items():
        inputs[key] = [all_parts(f"graph-{key}{i}", n, dtype) for i in range(R)]
    bank = {key: torch.stack([dev(inputs[key][i][RANK], specs[key][1]) for i in range(R)])
            for key in specs}
    st = {key: torch.empty(n, dtype=TD[dtype], device=DEV) for key, (n, dtype) in specs.items()}
    oc = pempty(NC, "float32")
    od = pempty(KD, "float16")
    og = pempty(SIZE * NG, "float32")

    def fill(i):
        for key in specs:
            st[key].copy_(bank[key][i])
        poison_(oc)
        poison_(od)
        poison_(og)

    fill(0)
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c.allreduce(st["a"])
        b = st["a"] + st["q"]
        ob = torch.empty_like(b)
        c.allreduce(b, ob, op="avg")
        c.allreduce(st["c"], oc)
        c.reduce_scatter(st["d"], od, op="max")
        c.broadcast(st["e"], root=SIZE - 1)
        h = st["e"].float() * 0.5
        c.allreduce(h)
        c.all_gather(st["g"], og)
    # eager calls between replays, on a side stream
    s2 = torch.cuda.Stream(DEV)
    EX = all_parts("graph-eager", 2048, "float16")
    ex_in = dev(EX[RANK], "float16")
    ex_out = [pempty(2048, "float16") for _ in range(R)]
    res = {key: [] for key in ("a", "ob", "oc", "od", "e", "h", "og")}
    sync()
    for i in range(R):
        fill(i)
        poison_(ob)
        g.replay()
        res["a"].append(st["a"].clone())
        res["ob"].append(ob.clone())
        res["oc"].append(oc.clone())
        res["od"].append(od.clone())
        res["e"].append(st["e"].clone())
        res["h"].append(h.clone())
        res["og"].append(og.clone())
        if i % 4 == 1:
            with torch.cuda.stream(s2):
                c.allreduce(ex_in, ex_out[i], op="max")
    sync()
    wex = ref_reduce(EX, "float16", "max")
    for i in range(R):
        asum = ref_reduce(inputs["a"][i], "bfloat16")
        cmp(f"replay {i} a", hbits(res["a"][i]), asum, "bfloat16")
        bs = [f32_op(asum, "bfloat16", lambda v, q=q: v + to_f32(q, "bfloat16")) for q in inputs["q"][i]]
        cmp(f"replay {i} avg", hbits(res["ob"][i]), ref_reduce(bs, "bfloat16", "avg"), "bfloat16")
        cmp(f"replay {i} chunked f32", hbits(res["oc"][i]), ref_reduce(inputs["c"][i], "float32"), "float32")
        cmp(f"replay {i} reduce_scatter max", hbits(res["od"][i]),
            ref_reduce(inputs["d"][i], "float16", "max")[RANK * KD:(RANK + 1) * KD], "float16", digest=False)
        eb = inputs["e"][i][SIZE - 1]
        cmp(f"replay {i} broadcast", hbits(res["e"][i]), eb, "bfloat16")
        hb = from_f32(to_f32(eb, "bfloat16") * np.float32(0.5), "float32")
        cmp(f"replay {i} sum of h", hbits(res["h"][i]), ref_reduce([hb] * SIZE, "float32"), "float32")
        cmp(f"replay {i} all_gather", hbits(res["og"][i]), np.concatenate(inputs["g"][i]), "float32")
        if i % 4 == 1:
            cmp(f"eager between replays {i}", hbits(ex_out[i]), wex, "float16")
    c.check()


@case
def graphs_sharing_a_memory_pool():
    """Two graphs captured into one pool (graph_pool_handle), the second
    reading the first's output; replayed alternately 12 times on new
    inputs, no warm-up before capture."""
    c = mk()
    R, n = 12, 5000
    P1 = [all_parts(f"pool1-{i}", n, "float32") for i in range(R)]
    P2 = [all_parts(f"pool2-{i}", n, "float32") for i in range(R)]
    b1 = torch.stack([dev(P1[i][RANK], "float32") for i in range(R)])
    b2 = torch.stack([dev(P2[i][RANK], "float32") for i in range(R)])
    in1 = torch.empty(n, device=DEV)
    in2 = torch.empty(n, device=DEV)
    in1.copy_(b1[0])
    in2.copy_(b2[0])
    sync()
    pool = torch.cuda.graph_pool_handle()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, pool=pool):
        hh = in1 * 2
        c.allreduce(hh)
    with torch.cuda.graph(g2, pool=pool):
        kk = hh + in2
        ok = torch.empty_like(kk)
        c.allreduce(kk, ok, op="avg")
        kb = ok.to(torch.bfloat16)
        c.allreduce(kb, op="max")
    got = []
    for i in range(R):
        in1.copy_(b1[i])
        in2.copy_(b2[i])
        poison_(ok)
        g1.replay()
        g2.replay()
        got.append((hh.clone(), ok.clone(), kb.clone()))
    sync()
    for i in range(R):
        h = ref_reduce([f32_op(p, "float32", lambda a: a * np.float32(2)) for p in P1[i]], "float32")
        ks = [f32_op(h, "float32", lambda a, q=q: a + to_f32(q, "float32")) for q in P2[i]]
        avg = ref_reduce(ks, "float32", "avg")
        kbw = from_f32(to_f32(avg, "float32"), "bfloat16")
        cmp(f"pool replay {i} g1", hbits(got[i][0]), h, "float32")
        cmp(f"pool replay {i} g2 avg", hbits(got[i][1]), avg, "float32")
        cmp(f"pool replay {i} g2 max", hbits(got[i][2]), ref_reduce([kbw] * SIZE, "bfloat16", "max"), "bfloat16")
    c.check()


@case
def subcommunicators_alive_together():
    """Five Comms at once: WORLD, WORLD again, a split with the rank order
    reversed, a split by parity, COMM_SELF; calls alternate between them on
    one stream without synchronizing. Sums follow each sub-communicator's
    rank order; reduce_scatter blocks and all_gather order follow it too."""
    rev = WORLD.Split(0, SIZE - 1 - RANK)
    par = WORLD.Split(RANK % 2, RANK)
    comms = [
        ("world", mk(WORLD), list(range(SIZE))),
        ("world2", mk(WORLD), list(range(SIZE))),
        ("reversed", mk(rev), [SIZE - 1 - j for j in range(SIZE)]),
        (f"parity{RANK % 2}", mk(par), [r for r in range(SIZE) if r % 2 == RANK % 2]),
        (f"self{RANK}", mk(MPI.COMM_SELF), [RANK]),
    ]
    for name, cm, mem in comms:
        chk(cm.size == len(mem) and cm.rank == mem.index(RANK),
            f"{name}: rank/size {cm.rank}/{cm.size}, want {mem.index(RANK)}/{len(mem)}")
    todo = []
    teeth = 0
    for rd in range(3):
        for idx, (name, cm, mem) in enumerate(comms):
            dtype = DT[(rd + idx) % 3]
            n = 3001 + rd
            tag = f"sub-{name.rstrip('0123456789')}-{rd}"
            parts = {r: gen(tag, n, dtype, r, special=0.05) for r in mem}
            order = [parts[r] for r in mem]
            want = ref_reduce(order, dtype)
            if len(mem) >= 3:
                fwd = ref_reduce([parts[r] for r in sorted(mem)], dtype)
                d = first_diff(fwd, want, dtype, True)
                teeth += d is not None
            x = dev(parts[RANK], dtype)
            o = pempty(n, dtype)
            cm.allreduce(x, o)
            todo.append((f"{name} round {rd} {dtype}", o, want, dtype, True, True))
            if name == "reversed":
                kk = 700
                rp = {r: gen(f"subrs-{rd}", len(mem) * kk, dtype, r) for r in mem}
                full = ref_reduce([rp[r] for r in mem], dtype)
                me = mem.index(RANK)
                orr = pempty(kk, dtype)
                cm.reduce_scatter(dev(rp[RANK], dtype), orr)
                todo.append((f"{name} round {rd} reduce_scatter", orr, full[me * kk:(me + 1) * kk], dtype, True, False))
                oag = pempty(len(mem) * 300, dtype)
                cm.all_gather(dev(rp[RANK][:300], dtype), oag)
                todo.append((f"{name} round {rd} all_gather", oag,
                             np.concatenate([rp[r][:300] for r in mem]), dtype, False, True))
            if name.startswith("parity"):
                bp = {r: gen(f"subbc-{rd}", 900, dtype, r) for r in mem}
                ob = pempty(900, dtype)
                cm.broadcast(dev(bp[RANK], dtype), ob, root=0)
                todo.append((f"{name} round {rd} broadcast", ob, bp[mem[0]], dtype, False, True))
    sync()
    for label, o, want, dtype, nan_any, digest in todo:
        cmp(label, hbits(o), want, dtype, nan_any=nan_any, digest=digest)
    if SIZE >= 3:
        chk(teeth > 0, "the reversed order never changed a result: the test lacks teeth")
        note(f"reversed-order sums that differ from rank-order sums: {teeth} calls")
    for name, cm, mem in comms:
        cm.check()


class Cai:
    """A bare __cuda_array_interface__ object."""

    def __init__(self, ptr, n, typestr="<f4", readonly=False):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, readonly),
                                         "version": 3, "strides": None}


@case
def bad_arguments_raise_clearly():
    """Each bad call (the same on every rank) on a new Comm raises
    InvalidArgumentError (also ValueError and TypeError) at once on every
    rank; the failed Comm then raises the same class on a valid call."""
    n = 1024
    x32 = dev(gen("bad", n, "float32", RANK), "float32")
    keep = [x32]
    try:
        import cupy
    except Exception:  # noqa: BLE001
        cupy = None

    def overlap(c):
        b = torch.zeros(n + 1, device=DEV)
        keep.append(b)
        c.allreduce(b[0:n], b[1:n + 1])

    bads = [
        ("out float16 for a float32 input", lambda c: c.allreduce(x32, torch.empty(n, dtype=torch.float16, device=DEV))),
        ("out bfloat16 for a float16 input", lambda c: c.allreduce(torch.zeros(n, dtype=torch.float16, device=DEV),
                                                                   torch.empty(n, dtype=torch.bfloat16, device=DEV))),
        ("out a CPU tensor for a CUDA input", lambda c: c.allreduce(x32, torch.empty(n))),
        ("a CPU input with a CUDA out", lambda c: c.allreduce(torch.zeros(n), torch.empty(n, device=DEV))),
        ("float64 CUDA input", lambda c: c.allreduce(torch.zeros(n, dtype=torch.float64, device=DEV))),
        ("int32 CUDA input", lambda c: c.allreduce(torch.zeros(n, dtype=torch.int32, device=DEV))),
        ("transposed input", lambda c: c.allreduce(torch.zeros(32, 48, device=DEV).t())),
        ("stride-0 input", lambda c: c.allreduce(torch.zeros(1, device=DEV).expand(n))),
        ("out overlapping the input by all but one element", overlap),
        ("out with one element more", lambda c: c.allreduce(x32, torch.empty(n + 1, device=DEV))),
        ("op='prod'", lambda c: c.allreduce(x32.clone(), op="prod")),
        ("misaligned __cuda_array_interface__", lambda c: c.allreduce(Cai(x32.data_ptr() + 2, 100))),
        ("reduce_scatter in place of size*n+1", lambda c: c.reduce_scatter(torch.zeros(SIZE * 10 + 1, device=DEV))),
        ("broadcast root=size", lambda c: c.broadcast(x32.clone(), root=SIZE)),
    ]
    if cupy is not None:
        bads.append(("a torch input with a CuPy out", lambda c: c.allreduce(x32, cupy.empty(n, dtype=cupy.float32))))
    for label, fn in bads:
        c = mk()
        e = expect_err(lambda: (fn(c), c.check()), arx.InvalidArgumentError, label)
        if isinstance(e, arx.InvalidArgumentError):
            chk(isinstance(e, ValueError) and isinstance(e, TypeError), f"{label}: not a ValueError+TypeError")
            chk(e.kind == type(e).__name__, f"{label}: kind {e.kind!r}")
            expect_err(lambda: c.allreduce(x32.clone()), type(e), f"{label}: next call on the failed Comm")
        c.close()
        chk(c.closed, f"{label}: closed is False after close()")
    sync()


@case
def one_rank_disagrees():
    """A Python-level refusal on the last rank only (out on the CPU): there
    InvalidArgumentError, elsewhere CallMismatchError naming it, at once;
    rank 0 with another op, rank 0 with another dtype, rank 0 calling
    allreduce where the others reduce_scatter: CallMismatchError on every
    rank at once, failed GPU outputs NaN."""
    n = 2048
    # refusal on the last rank
    c = mk()
    x = dev(gen("dis", n, "float32", RANK), "float32")
    if RANK == SIZE - 1:
        expect_err(lambda: c.allreduce(x, torch.empty(n)), arx.InvalidArgumentError, "refused here")
    else:
        expect_err(lambda: (c.allreduce(x, torch.empty(n, device=DEV)), c.check()), arx.CallMismatchError,
                   "refused by the last rank", contains=(f"rank {SIZE - 1}",))
    c.close()
    # op mismatch
    c = mk()
    x = dev(gen("dis-op", n, "bfloat16", RANK), "bfloat16")
    o = torch.zeros(n, dtype=torch.bfloat16, device=DEV)
    expect_err(lambda: (c.allreduce(x, o, op="max" if RANK == 0 else "sum"), c.check()), arx.CallMismatchError,
               "op differs on rank 0")
    sync()
    chk(bool(torch.isnan(o).all().item()), "op mismatch: the output is not all NaN")
    c.close()
    # dtype mismatch, same element count and size
    c = mk()
    x = torch.ones(n, dtype=torch.bfloat16 if RANK == 0 else torch.float16, device=DEV)
    expect_err(lambda: (c.allreduce(x), c.check()), arx.CallMismatchError, "dtype differs on rank 0")
    sync()
    chk(bool(torch.isnan(x).all().item()), "dtype mismatch: the in-place output is not all NaN")
    c.close()
    # collective mismatch
    c = mk()
    x = torch.ones(SIZE * n, device=DEV)
    if RANK == 0:
        f = lambda: (c.allreduce(x), c.check())  # noqa: E731
    else:
        f = lambda: (c.reduce_scatter(x, torch.zeros(n, device=DEV)), c.check())  # noqa: E731
    expect_err(f, arx.CallMismatchError, "allreduce on rank 0, reduce_scatter elsewhere")
    c.close()


@case
def errors_persist_then_close_and_timeout():
    """After a GPU count mismatch: check() raises CallMismatchError, again on
    a second check(), a later host call raises it too, the output is NaN;
    close(): closed, every call and check() raise ClosedError, close()
    twice is fine, `with` on it raises ClosedError. A rank that skips a call
    (timeout=3): the others raise a timeout within ~3 s plus slack. A new
    Comm then works."""
    c = mk()
    n = 1000 + (1 if RANK == SIZE - 1 else 0)
    x = dev(gen("err", n, "float32", RANK), "float32")
    e = expect_err(lambda: (c.allreduce(x), c.check()), arx.CallMismatchError, "count mismatch")
    if e is not None:
        expect_err(c.check, type(e), "second check()", within=5)
        expect_err(lambda: c.allreduce(np.ones(8, np.float32)), type(e), "host call on the failed Comm", within=5)
    sync()
    chk(bool(torch.isnan(x).all().item()), "count mismatch: the output is not all NaN")
    c.close()
    chk(c.closed, "closed is False")
    expect_err(lambda: c.allreduce(torch.ones(4, device=DEV)), arx.ClosedError, "allreduce after close", within=2)
    expect_err(lambda: c.reduce_scatter(np.ones(SIZE, np.float32)), arx.ClosedError, "reduce_scatter after close", within=2)
    expect_err(lambda: c.broadcast(np.ones(4, np.float32)), arx.ClosedError, "broadcast after close", within=2)
    try:
        c.check()
        chk(False, "check() after close raised nothing")
    except arx.ClosedError:
        pass
    except Exception as ex:  # noqa: BLE001
        chk(False, f"check() after close: {type(ex).__name__}: {short(ex)}")
    try:
        c.close()
    except Exception as ex:  # noqa: BLE001
        chk(False, f"second close(): {type(ex).__name__}: {short(ex)}")
    try:
        with c:
            chk(False, "`with` on a closed Comm entered")
    except arx.ClosedError:
        pass
    except Exception as ex:  # noqa: BLE001
        chk(False, f"`with` on a closed Comm: {type(ex).__name__}: {short(ex)}")
    # timeout: the last rank makes no call
    c2 = mk(timeout=3)
    if RANK == SIZE - 1:
        time.sleep(4.5)  # close only after the others' call has timed out
    else:
        y = dev(gen("tmo", 4096, "float32", RANK), "float32")
        t0 = time.monotonic()
        try:
            c2.allreduce(y)
            c2.check()
            chk(False, "a call without the last rank returned")
        except arx.Error as ex:
            dt = time.monotonic() - t0
            chk(isinstance(ex, (arx.TimeoutError, arx.KernelError, arx.PeerFailedError)),
                f"skipped call: {type(ex).__name__}: {short(ex)}")
            chk(dt < 13.0, f"skipped call: raised after {dt:.1f} s with timeout=3")
            if isinstance(ex, arx.TimeoutError):
                chk(isinstance(ex, TimeoutError), "arx.TimeoutError is not a builtins.TimeoutError")
            note(f"skipped call raised {type(ex).__name__} after {dt:.1f} s")
        sync()
        chk(bool(torch.isnan(y).all().item()), "timed-out call: output not all NaN")
    c2.close()
    # a new Comm works
    c3 = mk()
    P = all_parts("err-after", 3000, "float16")
    z = dev(P[RANK], "float16")
    c3.allreduce(z)
    sync()
    cmp("a new Comm after the failures", hbits(z), ref_reduce(P, "float16"), "float16")
    c3.check()


@case
def calls_from_another_thread():
    """A Comm called from a worker thread and the main thread in turn (one
    call at a time), GPU tensors on the thread's current stream."""
    c = mk()
    out = {}

    def work(i):
        try:
            torch.cuda.set_device(DEV)
            dtype = DT[i % 3]
            P = all_parts(f"thr{i}", 4000 + i, dtype)
            x = dev(P[RANK], dtype)
            c.allreduce(x)
            torch.cuda.current_stream(DEV).synchronize()
            out[i] = (hbits(x), ref_reduce(P, dtype), dtype)
        except Exception as e:  # noqa: BLE001
            out[i] = e

    for i in range(6):
        if i % 2:
            t = threading.Thread(target=work, args=(i,))
            t.start()
            t.join(60)
            chk(not t.is_alive(), f"thread {i} still running")
        else:
            work(i)
    sync()
    for i in range(6):
        r = out.get(i)
        if isinstance(r, tuple):
            cmp(f"call {i} ({'thread' if i % 2 else 'main'})", r[0], r[1], r[2])
        else:
            chk(False, f"call {i}: {type(r).__name__}: {short(r)}")
    c.check()


@case
def other_tensor_kinds():
    """An nn.Parameter (requires_grad) in place under no_grad; out= a view
    aliasing x (in place); out=x; a bf16 view of int16 storage; a CuPy
    slice at an odd offset in place between torch calls; CPU bf16 tensors
    on the GPU Comm."""
    c = mk()
    n = 3000
    P = all_parts("kinds-par", n, "float32")
    p = torch.nn.Parameter(dev(P[RANK], "float32"))
    with torch.no_grad():
        c.allreduce(p)
    Q = all_parts("kinds-alias", 2 * n, "float16")
    q = dev(Q[RANK], "float16")
    qv = q.view(2, n)
    r = c.allreduce(q, qv)
    chk(r is qv, "aliasing out: returns out")
    S = all_parts("kinds-self", n, "bfloat16")
    s = dev(S[RANK], "bfloat16")
    chk(c.allreduce(s, s) is s, "out=x returns x")
    B = all_parts("kinds-bfview", n, "bfloat16")
    raw = torch.from_numpy(B[RANK].view(np.int16).copy()).to(DEV)
    bv = raw.view(torch.bfloat16)
    c.allreduce(bv, op="min")
    cp_res = None
    try:
        import cupy
    except Exception:  # noqa: BLE001
        cupy = None
    C = all_parts("kinds-cupy", n, "float32")
    if cupy is not None:
        with cupy.cuda.Device(DEV.index):
            big = cupy.full(n + 8, np.nan, dtype=cupy.float32)
            big[3:3 + n] = cupy.asarray(C[RANK].view(np.float32))
            sl = big[3:3 + n]
            c.allreduce(sl)
            cupy.cuda.get_current_stream().synchronize()
            cp_res = cupy.asnumpy(big)
    CB = all_parts("kinds-cpu", 700, "bfloat16")
    xc = cpu_t(CB[RANK], "bfloat16")
    oc = torch.empty(700, dtype=torch.bfloat16)
    c.allreduce(xc, oc, op="avg")
    sync()
    cmp("nn.Parameter", hbits(p.detach()), ref_reduce(P, "float32"), "float32")
    chk(p.requires_grad, "Parameter lost requires_grad")
    cmp("out a 2-D view of x", hbits(q), ref_reduce(Q, "float16"), "float16")
    cmp("out=x", hbits(s), ref_reduce(S, "bfloat16"), "bfloat16")
    cmp("bf16 view of int16 storage", hbits(bv), ref_reduce(B, "bfloat16", "min"), "bfloat16")
    if cp_res is not None:
        cmp("CuPy slice at offset 3", cp_res[3:3 + n].view(np.uint32), ref_reduce(C, "float32"), "float32")
        chk(np.isnan(cp_res[:3]).all() and np.isnan(cp_res[3 + n:]).all(), "CuPy: neighbours written")
    else:
        note("CuPy not importable: CuPy slice not tried")
    cmp("CPU bf16 tensors avg", hbits(oc), ref_reduce(CB, "bfloat16", "avg"), "bfloat16")
    c.check()


@case
def torch_compile_custom_op():
    """arx.torch.all_reduce_ inside torch.compile: mode='reduce-overhead'
    with two ops and torch ops around (4 calls, new inputs); inductor on a
    function that all-reduces a slice (a view) of an intermediate; the op on
    a closed Comm raises ClosedError."""
    import arx.torch as at
    c = mk(timeout=60)
    n = 2048

    def f(t, q):
        a = t * 2
        at.all_reduce_(a, c)
        b = a + q
        at.all_reduce_(b, c)
        return b * 0.5

    cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    got = []
    for i in range(4):
        T = all_parts(f"cmp-t{i}", n, "float32")
        Q = all_parts(f"cmp-q{i}", n, "float32")
        r = cf(dev(T[RANK], "float32"), dev(Q[RANK], "float32"))
        got.append((r.clone(), T, Q))
    sync()
    for i, (r, T, Q) in enumerate(got):
        a = ref_reduce([f32_op(t, "float32", lambda v: v * np.float32(2)) for t in T], "float32")
        bs = [f32_op(a, "float32", lambda v, q=q: v + to_f32(q, "float32")) for q in Q]
        want = f32_op(ref_reduce(bs, "float32"), "float32", lambda v: v * np.float32(0.5))
        cmp(f"reduce-overhead call {i}", hbits(r), want, "float32")

    def g(t):
        a = t * 3
        at.all_reduce_(a[8:], c)
        return a

    cg = torch.compile(g, fullgraph=True)
    for i in range(2):
        T = all_parts(f"cmpv{i}", n, "float32")
        r = cg(dev(T[RANK], "float32"))
        sync()
        T3 = [f32_op(t, "float32", lambda v: v * np.float32(3)) for t in T]
        got_b = hbits(r)
        cmp(f"view mutation call {i}: head", got_b[:8], T3[RANK][:8], "float32", digest=False)
        cmp(f"view mutation call {i}: reduced tail", got_b[8:], ref_reduce([t[8:] for t in T3], "float32"), "float32")
    c.check()
    cz = mk()
    cz.close()
    try:
        at.all_reduce_(torch.ones(4, device=DEV), cz)
        chk(False, "the op on a closed Comm raised nothing")
    except arx.ClosedError:
        pass
    except Exception as e:  # noqa: BLE001
        chk(False, f"the op on a closed Comm: {type(e).__name__} (want arx.ClosedError): {short(e)}")


@case
def graph_replayed_after_close_writes_nan():
    """A captured call replayed after its Comm was closed on every rank: no
    exception, no CUDA error, output all NaN; a new Comm is then exact."""
    cc = mk()
    n = 4096
    P = all_parts("closed-graph", n, "float32")
    x = dev(P[RANK], "float32")
    o = pempty(n, "float32")
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cc.allreduce(x, o)
    g.replay()
    sync()
    cmp("replay while open", hbits(o), ref_reduce(P, "float32"), "float32")
    cc.check()
    timed_barrier("before close")
    cc.close()
    timed_barrier("after close")
    o.zero_()
    try:
        g.replay()
        sync()
        chk(bool(torch.isnan(o).all().item()), f"replay after close: output not all NaN "
            f"({int(torch.isnan(o).sum().item())} of {n} NaN)")
    except Exception as e:  # noqa: BLE001
        chk(False, f"replay after close: {type(e).__name__}: {short(e)}")
    c2 = mk()
    P = all_parts("closed-graph-after", n, "bfloat16")
    y = dev(P[RANK], "bfloat16")
    c2.allreduce(y)
    sync()
    cmp("a new Comm after the replay", hbits(y), ref_reduce(P, "bfloat16"), "bfloat16")
    c2.check()


# ---- driver --------------------------------------------------------------------

SYNC = None


def timed_barrier(what, limit=20.0):
    """A barrier on a private communicator that gives up after `limit` s."""
    req = SYNC.Ibarrier()
    t0 = time.monotonic()
    while not req.Test():
        if time.monotonic() - t0 > limit:
            chk(False, f"barrier '{what}' timed out")
            return False
        time.sleep(0.001)
    return True


def watchdog():
    time.sleep(max(1.0, WATCHDOG_S - (time.monotonic() - T0)))
    lines = [f"WATCHDOG rank {RANK}: {time.monotonic() - T0:.0f} s, still in case {CUR.name}"]
    for cs in DONE:
        lines.append(f"  rank {RANK} {'PASS' if not cs.fails else 'FAIL'} {cs.name}: {'; '.join(cs.fails)[:400]}")
    print("\n".join(lines), flush=True)
    os._exit(3)


def main():
    global WORLD, RANK, SIZE, SYNC, CUR, DEV, TD
    WORLD = MPI.COMM_WORLD
    RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
    SYNC = WORLD.Dup()
    TD = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    DEV = torch.device("cuda", 0)
    threading.Thread(target=watchdog, daemon=True).start()
    if RANK == 0:
        print(f"stranger_gpu: {SIZE} ranks, torch {torch.__version__}, arx {getattr(arx, '__version__', '?')}, "
              f"numpy {np.__version__}, import {time.monotonic() - T0:.1f} s", flush=True)
    skipped = []
    for fn in CASES:
        el = np.array([time.monotonic() - T0], np.float64)
        WORLD.Bcast(el, root=0)
        if el[0] > BUDGET_S:
            skipped.append(fn.__name__)
            continue
        CUR = CaseState(fn.__name__)
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            tb = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
            where = f" (line {' < '.join(str(f.lineno) for f in tb[::-1][:3])})" if tb else ""
            CUR.fails.append(f"raised {type(e).__name__}{where}: {short(e)}")
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            CUR.fails.append(f"torch.cuda.synchronize after the case: {type(e).__name__}: {short(e)}")
        WORLD.Barrier()
        for cm in CUR.comms:
            try:
                cm.close()
            except Exception as e:  # noqa: BLE001
                CUR.fails.append(f"close(): {type(e).__name__}: {short(e)}")
        CUR.comms = []
        CUR.secs = time.monotonic() - t0
        DONE.append(CUR)
        CUR = CaseState("between cases")
    mine = [(cs.name, cs.fails[:12], len(cs.fails), cs.notes[:6], cs.digests, cs.secs) for cs in DONE]
    everyone = WORLD.gather(mine, root=0)
    bad_total = 0
    if RANK == 0:
        passed = failed = 0
        names = [m[0] for m in everyone[0]]
        lines, notes = [], []
        for ci, name in enumerate(names):
            reasons = []
            digs = {}
            secs = 0.0
            case_notes = {}
            for r, lst in enumerate(everyone):
                if ci >= len(lst) or lst[ci][0] != name:
                    reasons.append(f"[r{r}] no verdict")
                    continue
                _, fails, nfail, nts, dg, sc = lst[ci]
                secs = max(secs, sc)
                reasons += [f"[r{r}] {m}" for m in fails]
                if nfail > len(fails):
                    reasons.append(f"[r{r}] ... {nfail - len(fails)} more")
                for nt in nts:
                    case_notes.setdefault(nt, []).append(r)
                for label, h in dg:
                    digs.setdefault(label, {})[r] = h
            for label, per in digs.items():
                if len(set(per.values())) > 1:
                    reasons.append(f"results differ across ranks at '{label}': {per}")
            notes.append(f"# {name}: {secs:.1f} s")
            for nt, rs in case_notes.items():
                notes.append(f"#   {name} (ranks {','.join(map(str, rs))}): {nt}")
            if reasons:
                failed += 1
                lines.append(f"FAIL {name}: " + " | ".join(reasons)[:1500])
            else:
                passed += 1
                lines.append(f"PASS {name}")
        for nt in notes:
            print(nt, flush=True)
        for s in skipped:
            lines.append(f"FAIL {s}: not run (time budget of {BUDGET_S:.0f} s reached)")
            failed += 1
        for ln in lines:
            print(ln, flush=True)
        print(f"# {SIZE} ranks, {time.monotonic() - T0:.1f} s in all", flush=True)
        print(f"stranger_gpu: {passed} passed, {failed} failed", flush=True)
        bad_total = failed
    code = np.array([bad_total], np.int64)
    WORLD.Bcast(code, root=0)
    return 1 if code[0] else 0


def hostcheck():
    """Sanity check of the reference against arx's host device side (no GPU):
    the special-value inputs, every dtype and op, rank order."""
    global WORLD, RANK, SIZE
    WORLD = MPI.COMM_WORLD
    RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
    bad = 0
    with arx.Comm(WORLD, device="host", timeout=20) as c:
        for dtype in DT:
            for n in (4099, 70000):
                parts = all_parts(f"spec{n}", n, dtype, special=0.3)
                for op in ("sum", "max", "min", "avg"):
                    want = ref_reduce(parts, dtype, op)
                    x = parts[RANK].copy()
                    if dtype == "float32":
                        x = x.view(np.float32)
                    elif dtype == "float16":
                        x = x.view(np.float16)
                    c.allreduce(x, op=op, dtype="bfloat16" if dtype == "bfloat16" else None)
                    d = first_diff(x.view(UT[dtype]), want, dtype, op == "sum")
                    if d:
                        bad += 1
                        print(f"rank {RANK} hostcheck {dtype} n={n} {op}: {d}", flush=True)
        # reversed split
        rev = WORLD.Split(0, SIZE - 1 - RANK)
        with arx.Comm(rev, device="host", timeout=20) as cr:
            mem = [SIZE - 1 - j for j in range(SIZE)]
            for dtype in DT:
                parts = {r: gen("hc-rev", 5000, dtype, r, special=0.05) for r in mem}
                want = ref_reduce([parts[r] for r in mem], dtype)
                x = parts[RANK].copy()
                x = x.view({"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype])
                cr.allreduce(x, dtype="bfloat16" if dtype == "bfloat16" else None)
                d = first_diff(x.view(UT[dtype]), want, dtype, True)
                if d:
                    bad += 1
                    print(f"rank {RANK} hostcheck reversed {dtype}: {d}", flush=True)
                fwd = ref_reduce([parts[r] for r in sorted(mem)], dtype)
                if RANK == 0:
                    print(f"hostcheck reversed {dtype}: forward order differs: {first_diff(fwd, want, dtype, True)}")
    print(f"rank {RANK} hostcheck: {bad} mismatches", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    if "--selftest" in sys.argv:
        sys.exit(selftest())
    from mpi4py import MPI
    import arx
    if "--hostcheck" in sys.argv:
        sys.exit(hostcheck())
    import torch
    sys.exit(main())

"""Host-side tests of the arx Python module: run under mpirun, every rank.

    mpirun -n 2 python python/tests/test_host.py
    mpirun -n 3 --oversubscribe python python/tests/test_host.py

Self-checking: every rank derives every rank's input from (seed, case,
rank), computes the expected sum on its own in NumPy (partials added in rank
order in float32, rounded once to the element type: arx's rule, see
harness.py), poisons outputs before each call and compares bit patterns. A
case never skips an MPI collective that other ranks make; the verdicts are
gathered between cases. Exit status 0 only if every case passed on every
rank. Needs no GPU and no torch (CPU tensors are tried if torch is there).
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import arx
from harness import (FAIL_TIMEOUT, PROMPT, RANK, SIZE, WORLD, ag_input, case, check, expect_error,
                     expected, main, narrow, note, op_expected, partial, poison, rs_expected,
                     same_bits, widen, wrong)


def call_and_check(comm, case_id, n, dtype, in_place, name, shape=None, sub=None):
    """One all-reduce on `comm` (ranks `sub` of the world, default all),
    checked against the reference."""
    ranks = sub if sub is not None else list(range(SIZE))
    parts = [partial(case_id, n, dtype, ranks[r]) for r in range(len(ranks))]
    want = expected(parts, dtype)
    mine = parts[comm.rank].copy()
    kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    if shape:
        mine = mine.reshape(shape)
        want = want.reshape(shape)
    if in_place:
        got = comm.allreduce(mine, **kw)
        check(got is mine, f"{name}: in-place call returned another object")
        check(same_bits(mine, want), f"{name}: wrong in-place result ({wrong(mine, want)})")
    else:
        orig = mine.copy()
        out = poison(n, dtype, shape)
        got = comm.allreduce(mine, out, **kw)
        check(got is out, f"{name}: out-of-place call did not return out")
        check(same_bits(out, want), f"{name}: wrong result ({wrong(out, want)})")
        check(same_bits(mine, orig), f"{name}: the input changed")
    return want


# ---- the cases -------------------------------------------------------------

@case
def sums_every_dtype_size_and_mode():
    with arx.Comm(WORLD) as comm:
        check(comm.rank == RANK and comm.size == SIZE, f"rank/size {comm.rank}/{comm.size}")
        maxc = comm.describe()["max_count"]
        cid = 0
        for dtype in ("float32", "float16", "bfloat16"):
            m = maxc[dtype]  # elements per chunk (one slot)
            for n in (1, 2, 3, 5, 17, 1000, 4096, 65537, m - 1, m, m + 1, 2 * m + 3):
                for in_place in (True, False):
                    cid += 1
                    call_and_check(comm, cid, n, dtype, in_place, f"{dtype} n={n} in_place={in_place}")
        # A 2-D C-contiguous array is a flat buffer to arx.
        cid += 1
        call_and_check(comm, cid, 64 * 33, "float32", False, "2-D", shape=(64, 33))
        # An empty array is a call too (every rank makes it).
        e = np.empty(0, np.float32)
        check(comm.allreduce(e) is e, "empty array")


@case
def signed_zeros_follow_ieee_addition():
    with arx.Comm(WORLD) as comm:
        for dtype in ("float32", "float16", "bfloat16"):
            want = call_and_check(comm, 500, 8, dtype, False, f"zeros {dtype}")
            w = widen(want, dtype)
            # The reference itself has -0.0 where every rank had -0.0 and
            # +0.0 where only rank 0 had it: a result with the wrong sign of
            # zero fails the bit comparison above.
            check(bool(np.all(np.signbit(w[:4]))) and not np.signbit(w[4]),
                  f"zeros {dtype}: the reference lost the signs of zero")


@case
def float16_rounds_once_from_a_float32_sum():
    """The reference must be able to tell arx's rule from its neighbours:
    with 3 or more ranks, rounding to float16 after every add (float16), and
    summing in another order (float32), give different bits for some
    elements of these inputs; arx's result must equal the rank-order float32
    sum rounded once."""
    n = 65536
    with arx.Comm(WORLD) as comm:
        for dtype in ("float16", "float32"):
            parts = [partial(900, n, dtype, r) for r in range(SIZE)]
            want = call_and_check(comm, 900, n, dtype, True, f"rule {dtype}")
            if SIZE >= 3:
                stepwise = parts[0].copy()
                for p in parts[1:]:
                    stepwise = (stepwise + p).astype(dtype)  # rounds every add
                reverse = widen(parts[-1], dtype).copy()
                for p in reversed(parts[:-1]):
                    reverse = reverse + widen(p, dtype)
                reverse = reverse.astype(dtype)
                # (float16 partials add exactly in float32, in any order;
                # float32 partials do not.)
                if dtype == "float16":
                    check(not same_bits(stepwise, want),
                          "rule: stepwise float16 rounding gives the same bits; the test cannot tell")
                else:
                    check(not same_bits(reverse, want),
                          "rule: float32 in reverse order gives the same bits; the test cannot tell")


@case
def ml_dtypes_bfloat16_if_present():
    try:
        import ml_dtypes
    except ImportError:
        note("ml_dtypes not installed: bfloat16 NumPy arrays not tried (uint16 bits were)")
        return
    with arx.Comm(WORLD) as comm:
        parts = [partial(600, 1000, "bfloat16", r) for r in range(SIZE)]
        want = expected(parts, "bfloat16")
        x = parts[RANK].view(ml_dtypes.bfloat16).copy()
        out = poison(1000, "bfloat16").view(ml_dtypes.bfloat16)
        comm.allreduce(x, out)
        check(same_bits(out.view(np.uint16), want), "ml_dtypes bfloat16")


@case
def torch_cpu_tensors_if_present():
    try:
        import torch
    except ImportError:
        note("torch not installed: CPU tensors not tried")
        return
    with arx.Comm(WORLD) as comm:
        for dt, name in ((torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
            parts = [partial(700, 999, name, r) for r in range(SIZE)]
            want = expected(parts, name)
            mine = parts[RANK]
            t = torch.from_numpy(mine.view(np.int16) if name == "bfloat16" else mine.copy())
            t = t.view(torch.bfloat16) if name == "bfloat16" else t
            t = t.clone()
            got = comm.allreduce(t)
            check(got is t, "torch cpu: in place returns the tensor")
            gb = t.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else t.numpy()
            check(same_bits(gb, want), f"torch cpu {name}: wrong result")
        # The custom op on a CPU tensor, eagerly.
        import arx.torch as at
        parts = [partial(701, 300, "float32", r) for r in range(SIZE)]
        t = torch.from_numpy(parts[RANK].copy())
        at.all_reduce_(t, comm)
        check(same_bits(t.numpy(), expected(parts, "float32")), "torch.ops.arx.all_reduce on CPU")


@case
def max_min_avg_bit_for_bit():
    """op="max", "min", "avg" on every dtype, in place and out of place,
    with signed-zero ties, NaN on the last rank only, +Inf on rank 0 and a
    subnormal; the result bits equal the reference's, NaN included."""
    with arx.Comm(WORLD) as comm:
        m = comm.describe()["max_count"]["float32"]
        cid = 600
        for op in ("max", "min", "avg"):
            for dtype in ("float32", "float16", "bfloat16"):
                for n in (1, 1001, m + 3):
                    for in_place in (True, False):
                        cid += 1
                        parts = []
                        for r in range(SIZE):
                            p = partial(cid, n, dtype, r)
                            v = widen(p, dtype).copy()
                            if n > 8:
                                v[5] = np.nan if r == SIZE - 1 else 1.0
                                v[6] = np.inf if r == 0 else -2.0
                                v[7] = np.float32(2.0 ** -133) * (1 + r)
                            parts.append(narrow(v, dtype) if n > 8 else p)
                        want = op_expected(parts, dtype, op)
                        mine = parts[RANK].copy()
                        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
                        name = f"{op} {dtype} n={n} in_place={in_place}"
                        if in_place:
                            got = comm.allreduce(mine, op=op, **kw)
                        else:
                            got = poison(n, dtype)
                            comm.allreduce(mine, got, op=op, **kw)
                        check(same_bits(got, want), f"{name}: {wrong(got, want)}")


@case
def a_mismatched_op_fails_every_rank_at_once():
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        x = partial(7, 256, "float32", RANK)
        op = "max" if RANK == 0 else "sum"
        e, dt = expect_error(lambda: comm.allreduce(x, op=op), arx.CallMismatchError,
                             contains=("max of 256",), name="op mismatch")
        check(dt < PROMPT, f"op mismatch: took {dt:.1f} s")


@case
def a_mismatched_count_fails_every_rank_at_once():
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        n = 1000 + (1 if RANK == SIZE - 1 else 0)
        x = partial(1, n, "float32", RANK)
        e, dt = expect_error(lambda: comm.allreduce(x), arx.CallMismatchError, name="count mismatch")
        check(isinstance(e, arx.MismatchError), "CallMismatchError is a MismatchError")
        check(dt < PROMPT, f"count mismatch: took {dt:.1f} s (timeout {FAIL_TIMEOUT} s)")
        check(str(SIZE - 1) in str(e) or RANK == SIZE - 1, f"count mismatch: the odd rank is not named: {e}")
        # The instance is failed: the next call raises again (on every rank).
        expect_error(lambda: comm.allreduce(partial(2, 1000, "float32", RANK)), arx.Error, name="after mismatch")


@case
def a_mismatched_dtype_fails_every_rank_at_once():
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        x = partial(3, 256, "float16" if RANK == 0 else "float32", RANK)
        e, dt = expect_error(lambda: comm.allreduce(x), arx.CallMismatchError, name="dtype mismatch")
        check(dt < PROMPT, f"dtype mismatch: took {dt:.1f} s")


@case
def bad_arguments_on_one_rank_fail_the_others_at_once():
    """A call this binding refuses (here a non-contiguous array on the last
    rank) is announced to the peers: they raise CallMismatchError naming
    that rank at once instead of timing out."""
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        if RANK == SIZE - 1:
            x = partial(4, 2000, "float32", RANK)[::2]
            e, dt = expect_error(lambda: comm.allreduce(x), arx.InvalidArgumentError,
                                 contains=("contiguous",), name="refused here")
        else:
            x = partial(4, 1000, "float32", RANK)
            e, dt = expect_error(lambda: comm.allreduce(x), arx.CallMismatchError,
                                 contains=(f"rank {SIZE - 1}", "refused"), name="refused by a peer")
            check(getattr(e, "peer", None) == SIZE - 1, f"refused by a peer: peer attribute {getattr(e, 'peer', None)}")
        check(dt < PROMPT, f"refusal: took {dt:.1f} s (timeout {FAIL_TIMEOUT} s)")


@case
def a_late_ranks_next_call_fails_at_once():
    """The last rank arrives after the others timed out: its late call may
    still be summed or fail, its next one raises PeerFailedError at once
    (the ranks that timed out tell it); every rank stays until it is done."""
    with arx.Comm(WORLD, timeout=1.5) as comm:
        x = partial(31, 512, "float32", RANK)
        out = poison(512, "float32")
        if RANK == SIZE - 1:
            time.sleep(2.5)
            try:
                comm.allreduce(x, out)
                want = expected([partial(31, 512, "float32", r) for r in range(SIZE)], "float32")
                check(same_bits(out, want), f"the late call returned a wrong sum ({wrong(out, want)})")
            except arx.PeerFailedError:
                pass
            e, dt = expect_error(lambda: comm.allreduce(partial(32, 512, "float32", RANK)), arx.PeerFailedError,
                                 contains=("timed out in a call",), name="the call after the late one")
            check(dt < 0.75, f"the call after the late one took {dt:.2f} s (timeout 1.5 s)")
            check(getattr(e, "peer", SIZE - 1) != SIZE - 1, f"peer attribute {getattr(e, 'peer', None)}")
        else:
            e, _ = expect_error(lambda: comm.allreduce(x, out), arx.Error, name="a call the last rank is late for")
            check(isinstance(e, (arx.TimeoutError, arx.PeerFailedError)),
                  f"a call the last rank is late for: {type(e).__name__}: {e}")
        WORLD.Barrier()


@case
def a_rank_that_closes_early_is_named_at_once():
    """The last rank closes its Comm after one checked call; every other
    rank's next call raises PeerFailedError at once naming it ("closed its
    instance"), not at the timeout."""
    comm = arx.Comm(WORLD, timeout=3.0)
    x = partial(33, 4096, "float32", RANK)
    out = poison(4096, "float32")
    comm.allreduce(x, out)
    want = expected([partial(33, 4096, "float32", r) for r in range(SIZE)], "float32")
    check(same_bits(out, want), f"the call before the close: {wrong(out, want)}")
    if RANK == SIZE - 1:
        comm.close()
    else:
        e, dt = expect_error(lambda: comm.allreduce(partial(34, 4096, "float32", RANK)), arx.PeerFailedError,
                             contains=("closed its instance",), name="the call after the last rank closed")
        check(dt < 1.5, f"the call after the last rank closed took {dt:.2f} s (timeout 3 s)")
        check(getattr(e, "peer", None) == SIZE - 1, f"peer attribute {getattr(e, 'peer', None)}")
        comm.close()
    WORLD.Barrier()


@case
def bad_arguments_raise_clear_errors():
    """Each bad call (the same on every rank) raises InvalidArgumentError
    on every rank, naming what is wrong. A refused call fails its Comm, so
    each gets a fresh one."""
    f32 = partial(5, 64, "float32", RANK)
    ro = f32.copy()
    ro.flags.writeable = False
    big = np.zeros(8, dtype=">f4")
    buf = np.zeros(100, np.float32)
    bad = [
        ("float64", lambda c: c.allreduce(f32.astype(np.float64)), ("float64",)),
        ("int32", lambda c: c.allreduce(np.arange(8, dtype=np.int32)), ("format 'i'",)),
        ("strided", lambda c: c.allreduce(np.zeros((8, 8), np.float32)[:, 1]), ("contiguous",)),
        ("read-only in place", lambda c: c.allreduce(ro), ("read-only",)),
        ("read-only out", lambda c: c.allreduce(f32, ro), ("read-only",)),
        ("partial overlap", lambda c: c.allreduce(buf[:60], buf[40:]), ("overlap",)),
        ("same start, other length", lambda c: c.allreduce(buf[:60], buf[:50]), ("overlap",)),
        ("length", lambda c: c.allreduce(f32, np.zeros(63, np.float32)), ("64", "63")),
        ("dtype pair", lambda c: c.allreduce(f32, np.zeros(64, np.float16)), ("float32", "float16")),
        ("op", lambda c: c.allreduce(f32, op="prod"), ("op='prod'",)),
        ("not a buffer", lambda c: c.allreduce([1.0, 2.0]), ("list",)),
        ("byte order", lambda c: c.allreduce(big), ("'>f'",)),
        ("dtype keyword", lambda c: c.allreduce(f32, dtype="int8"), ("dtype='int8'",)),
        ("bfloat16 on floats", lambda c: c.allreduce(f32, dtype="bfloat16"), ("bfloat16",)),
        ("kind pair", lambda c: c.allreduce(f32, object()), ()),
    ]
    for name, fn, words in bad:
        with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
            e, dt = expect_error(lambda: fn(comm), arx.InvalidArgumentError, contains=words, name=name)
            check(isinstance(e, ValueError) and isinstance(e, TypeError),
                  f"{name}: InvalidArgumentError should also be a ValueError and a TypeError")
            check(dt < PROMPT, f"{name}: took {dt:.1f} s")
            expect_error(lambda: comm.allreduce(f32.copy()), arx.Error, name=f"{name}: the Comm stays failed")


@case
def settings_take_effect():
    with arx.Comm(WORLD, slot_bytes="64K", timeout=2.5, device="host", fabric="shm", spin=None) as comm:
        d = comm.describe()
        check(d["slot_bytes"] == 65536, f"slot_bytes {d['slot_bytes']}")
        check(d["timeout"] == 2.5, f"timeout {d['timeout']}")
        check(d["device"] == "host" and d["fabric"] == "shm", f"device/fabric {d['device']}/{d['fabric']}")
        check(comm.device == "host" and comm.cuda_device is None, "device/cuda_device properties")
        check(d["max_count"]["float32"] == 16384, f"max_count {d['max_count']}")
        call_and_check(comm, 20, 16384, "float32", True, "a full 64K slot")
        # Beyond the slot: chunks of one slot, the same bits as one call.
        call_and_check(comm, 21, 16385, "float32", True, "one element past a 64K slot")
        call_and_check(comm, 22, 3 * 16384 + 8192 + 1, "float32", False, "3.5 slots of 64K")
    with arx.Comm(WORLD, slot_bytes=4096, devices=["a", "b"], proxy_cpu=0, gid_index=3) as comm:
        check(comm.describe()["slot_bytes"] == 4096, "slot_bytes as an int")


@case
def bad_settings_raise_on_every_rank():
    e, _ = expect_error(lambda: arx.Comm(WORLD, timout=5), arx.InvalidArgumentError,
                        contains=("timout", "timeout"), name="unknown setting")
    check(isinstance(e, TypeError), "an unknown setting is also a TypeError")
    for kw, words in (
        ({"device": "tpu"}, ("device", "tpu", "auto, host, gpu")),
        ({"fabric": 3}, ("fabric", "string")),
        ({"timeout": -1}, ("timeout", "-1")),
        ({"timeout": "abc"}, ("timeout", "'abc'")),
        ({"timeout": 0}, ("timeout=0ns", "between")),
        ({"slot_bytes": "12Q"}, ("slot_bytes", "12Q")),
        ({"slot_bytes": -5}, ("slot_bytes",)),
        ({"slot_bytes": 1.5}, ("slot_bytes",)),
        ({"devices": 7}, ("devices",)),
        ({"gid_index": True}, ("gid_index",)),
    ):
        e, _ = expect_error(lambda: arx.Comm(WORLD, **kw), arx.ConfigError, contains=words, name=f"setting {kw}")
        check(isinstance(e, arx.InvalidArgumentError), f"{kw}: ConfigError is an InvalidArgumentError")
    expect_error(lambda: arx.Comm(42), arx.InvalidArgumentError, contains=("mpi4py",), name="not a comm")
    expect_error(lambda: arx.Comm(MPI.COMM_NULL), arx.Error, contains=("MPI_COMM_NULL",), name="COMM_NULL")


@case
def a_bad_setting_on_one_rank_fails_the_others_at_once():
    kw = {"timout": 1} if RANK == SIZE - 1 else {}
    cls = arx.InvalidArgumentError if RANK == SIZE - 1 else arx.PeerFailedError
    e, dt = expect_error(lambda: arx.Comm(WORLD, init_timeout=FAIL_TIMEOUT, **kw), cls,
                         contains=("timout",), name="setting refused on one rank")
    if RANK != SIZE - 1:
        check(getattr(e, "peer", None) == SIZE - 1, f"PeerFailedError.peer {getattr(e, 'peer', None)}")
    check(dt < PROMPT, f"setting refused on one rank: took {dt:.1f} s (init_timeout {FAIL_TIMEOUT} s)")


@case
def settings_that_must_agree_are_checked():
    kw = {"slot_bytes": "64K"} if RANK == 0 else {"slot_bytes": "128K"}
    e, _ = expect_error(lambda: arx.Comm(WORLD, **kw), arx.MismatchError, contains=("ARX_SLOT_BYTES",),
                        name="slot size differs")
    check(getattr(e, "rank", None) == 1, f"MismatchError.rank {getattr(e, 'rank', None)}")


@case
def close_and_context_manager():
    comm = arx.Comm(WORLD)
    check(not comm.closed and repr(comm).startswith("<arx.Comm rank"), repr(comm))
    with comm as c:
        check(c is comm, "__enter__ returns the Comm")
        call_and_check(c, 30, 100, "float32", True, "inside with")
    check(comm.closed, "closed after with")
    for name, fn in (("allreduce", lambda: comm.allreduce(np.ones(4, np.float32))),
                     ("describe", comm.describe),
                     ("with", lambda: comm.__enter__()),
                     ("check", comm.check)):
        e, _ = expect_error(fn, arx.ClosedError, contains=("closed",), name=f"{name} after close")
        check(isinstance(e, arx.InvalidUsageError), "ClosedError is an InvalidUsageError")
    comm.close()  # twice: nothing
    # An error inside the with block still closes the Comm.
    try:
        with arx.Comm(WORLD) as c2:
            raise KeyError("boom")
    except KeyError:
        pass
    check(c2.closed, "closed after an exception in with")


@case
def sub_communicators():
    sub = WORLD.Split(color=RANK % 2, key=RANK)
    members = [r for r in range(SIZE) if r % 2 == RANK % 2]
    with arx.Comm(sub) as comm:
        check(comm.size == len(members) and comm.rank == members.index(RANK), "sub rank/size")
        call_and_check(comm, 40, 777, "float32", False, "split", sub=members)
    sub.Free()
    with arx.Comm(MPI.COMM_SELF) as one:
        call_and_check(one, 41, 99, "float16", True, "one rank", sub=[RANK])


@case
def calls_release_the_gil_and_work_from_threads():
    with arx.Comm(WORLD) as comm:
        # Rank 0 waits inside allreduce for the last rank, which arrives
        # 1 s late; a Python thread on rank 0 must run meanwhile.
        count = [0]
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                count[0] += 1

        # Meanwhile another thread's use of the same Comm is refused
        # (describe: harmless if it ran, unlike a second collective call).
        inside = threading.Event()
        busy = {}

        def other():
            inside.wait()
            time.sleep(0.3)
            try:
                comm.describe()
                busy["result"] = "describe() ran during another thread's call"
            except arx.InvalidUsageError as e:
                busy["result"] = e
            except Exception as e:  # noqa: BLE001
                busy["result"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=spin)
        t.start()
        b = threading.Thread(target=other)
        if RANK == 0:
            b.start()
        if RANK == SIZE - 1:
            time.sleep(2.0)
        x = partial(50, 64, "float32", RANK)
        c0 = count[0]
        inside.set()
        comm.allreduce(x)
        ran = count[0] - c0
        stop.set()
        t.join()
        if RANK == 0:
            b.join()
            check(ran > 100, f"GIL held during the call: another thread counted {ran} in it")
            check(isinstance(busy.get("result"), arx.InvalidUsageError)
                  and "another thread" in str(busy["result"]),
                  f"overlapping use from another thread: {busy.get('result')!r}")
        # A call from another thread (MPI_THREAD_MULTIPLE is mpi4py's default).
        res = {}

        def work():
            try:
                res["want"] = call_and_check(comm, 51, 500, "float32", False, "from a thread")
            except Exception as e:  # noqa: BLE001
                res["error"] = e

        w = threading.Thread(target=work)
        w.start()
        w.join()
        check("error" not in res, f"call from a thread raised {res.get('error')!r}")


def _child_uses(comm, held):
    """In a forked child: every use of the parent's Comm. Returns the
    failed checks as bits (the child's exit status); makes no MPI call."""
    bits = 0

    def raised(fn, cls, word):
        try:
            fn()
        except cls as e:
            return word in str(e)
        except BaseException:  # noqa: BLE001 - any other outcome is a failure
            return False
        return False

    x = np.arange(8, dtype=np.float32)
    if not raised(lambda: comm.allreduce(x), arx.ProxyError, "fork"):
        bits |= 1
    if not raised(comm.check, arx.ProxyError, "fork"):
        bits |= 2
    if held and not raised(comm.describe, arx.ProxyError, "fork"):
        bits |= 4
    # close() while a thread of the child is inside a (failing) call on
    # the copy: still closed for good once that thread is done.
    stop = threading.Event()

    def poke():
        while not stop.is_set():
            try:
                comm.check()
            except arx.Error:
                pass

    poker = threading.Thread(target=poke)
    poker.start()
    time.sleep(0.01)
    try:
        comm.close()
    except BaseException:  # noqa: BLE001
        bits |= 8
    stop.set()
    poker.join()
    if not comm.closed:
        bits |= 16
    if not raised(lambda: comm.allreduce(x), arx.ClosedError, "closed"):
        bits |= 32
    return bits


def _fork_and_check(comm, held):
    """Rank 0 only: forks; the child checks its copy of `comm`."""
    import os
    import warnings

    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # Python warns that forking a threaded process may deadlock the
        # child: the child here takes no lock a parent thread may hold.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 64
        try:
            code = _child_uses(comm, held)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    check(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0,
          f"forked child (held {held}): status {status:#x} (exit bits: 1 call, 2 check, "
          "4 describe, 8 close, 16 closed, 32 call after close)")


@case
def forked_children_get_the_fork_error():
    """A child forked from rank 0 while its Comm is idle, and one forked
    while another thread is inside a call on it: every use raises
    ProxyError naming the fork (not "another thread is inside a call",
    which the child cannot cure: that thread is not in the child), close()
    works and frees nothing of the parent's; the parent's calls before,
    during and after are checked."""
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        call_and_check(comm, 60, 333, "float32", False, "before the forks")
        if RANK == 0:
            _fork_and_check(comm, False)
        res = {}

        def work():
            try:
                while True:
                    try:
                        res["want"] = call_and_check(comm, 61, 4099, "float32", False, "during a fork")
                        return
                    except arx.InvalidUsageError as e:
                        # The main thread's describe() polls took the Comm
                        # for a moment: the call changed nothing; again.
                        if "another thread" not in str(e):
                            raise
            except Exception as e:  # noqa: BLE001
                res["error"] = e

        t = threading.Thread(target=work)
        if RANK == 0:
            t.start()
            inside = False
            for _ in range(10000):
                try:
                    comm.describe()
                except arx.InvalidUsageError:
                    inside = True
                    break
                time.sleep(0.001)
            check(inside, "the thread never entered its call")
            if inside:
                _fork_and_check(comm, True)
            for p in range(1, SIZE):
                WORLD.send(1, dest=p, tag=61)
            t.join()
        else:
            WORLD.recv(source=0, tag=61)
            t.start()
            t.join()
        check("error" not in res, f"call during the fork raised {res.get('error')!r}")
        for k in range(3):
            call_and_check(comm, 62 + k, 1000 + k, "bfloat16", k % 2 == 0, "after the forks")


class FakeCudaArray:
    """An object with a __cuda_array_interface__ (no GPU needed: the
    checks and the host instance's refusal come before any CUDA call)."""

    def __init__(self, typestr="<f4", shape=(8,), strides=None, ptr=0x10000, readonly=False):
        self.__cuda_array_interface__ = {"version": 3, "typestr": typestr, "shape": shape,
                                         "strides": strides, "data": (ptr, readonly), "stream": 1}


@case
def cuda_arrays_are_checked_and_refused_by_a_host_instance():
    for name, make, words in (
        ("host instance", lambda: FakeCudaArray(), ("host device side", "device='gpu'")),
        ("float64", lambda: FakeCudaArray(typestr="<f8"), ("'<f8'",)),
        ("strided", lambda: FakeCudaArray(shape=(4, 4), strides=(32, 4)), ("not C-contiguous",)),
        ("read-only", lambda: FakeCudaArray(readonly=True), ("read-only",)),
    ):
        with arx.Comm(WORLD, device="host", timeout=FAIL_TIMEOUT) as comm:
            e, dt = expect_error(lambda: comm.allreduce(make()), arx.InvalidArgumentError,
                                 contains=words, name=f"cuda array: {name}")
            check(dt < PROMPT, f"cuda array: {name}: took {dt:.1f} s")


# ---- reduce_scatter and all_gather -----------------------------------------

@case
def reduce_scatter_and_all_gather_on_host_buffers():
    """Every dtype; n from 0 to beyond a 4 KiB slot (chunked); out of
    place, in place (out=None) and in place as out = this rank's block;
    sum, max, min, avg; checked bit for bit against NumPy references."""
    with arx.Comm(WORLD, slot_bytes=4096) as comm:
        cid = 3000
        for dtype in ("float32", "float16", "bfloat16"):
            kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
            for n in (0, 1, 5, 1000, 2500):
                for mode in ("out", "none", "view"):
                    for op in ("sum",) if n != 1000 else ("sum", "max", "min", "avg"):
                        cid += 1
                        name = f"reduce_scatter {op} {dtype} n={n} {mode}"
                        mine, want = rs_expected(cid, n, dtype, op)
                        x = mine.copy()
                        if mode == "out":
                            out = poison(n, dtype)
                            got = comm.reduce_scatter(x, out, op=op, **kw)
                            check(got is out, f"{name}: did not return out")
                            check(same_bits(x, mine), f"{name}: the input changed")
                        elif mode == "none":
                            got = comm.reduce_scatter(x, op=op, **kw)
                            check(got is x, f"{name}: did not return the input")
                            out = x[RANK * n:(RANK + 1) * n]
                        else:
                            out = x[RANK * n:(RANK + 1) * n]
                            got = comm.reduce_scatter(x, out, op=op, **kw)
                            check(got is out, f"{name}: did not return out")
                        check(same_bits(out, want), f"{name}: {wrong(out, want)}")
                        if mode != "out":
                            rest = np.concatenate([x[: RANK * n], x[(RANK + 1) * n:]])
                            keep = np.concatenate([mine[: RANK * n], mine[(RANK + 1) * n:]])
                            check(same_bits(rest, keep), f"{name}: another rank's block changed")
                    cid += 1
                    name = f"all_gather {dtype} n={n} {mode}"
                    parts = [ag_input(cid, n, dtype, r) for r in range(SIZE)]
                    want = np.concatenate(parts)
                    if mode == "out":
                        x = parts[RANK].copy()
                        out = poison(SIZE * n, dtype)
                        got = comm.all_gather(x, out, **kw)
                        check(got is out and same_bits(x, parts[RANK]), f"{name}: return value or input")
                    else:
                        out = poison(SIZE * n, dtype)
                        out[RANK * n:(RANK + 1) * n] = parts[RANK]
                        if mode == "none":
                            got = comm.all_gather(out, **kw)
                        else:
                            got = comm.all_gather(out[RANK * n:(RANK + 1) * n], out, **kw)
                        check(got is out, f"{name}: did not return the full array")
                    check(same_bits(out, want), f"{name}: {wrong(out, want)}")
        # 2-D arrays are flat buffers, as for allreduce.
        mine, want = rs_expected(3500, 64, "float32", "sum")
        out = poison(64, "float32").reshape(8, 8)
        comm.reduce_scatter(mine.reshape(SIZE, 64), out)
        check(same_bits(out.ravel(), want), f"reduce_scatter 2-D: {wrong(out.ravel(), want)}")


@case
def reduce_scatter_and_all_gather_take_ml_dtypes_and_torch_cpu():
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
        note("ml_dtypes not installed: bfloat16 NumPy arrays not tried in reduce_scatter")
    try:
        import torch
    except ImportError:
        torch = None
        note("torch not installed: CPU tensors not tried in reduce_scatter/all_gather")
    with arx.Comm(WORLD) as comm:
        mine, want = rs_expected(3600, 300, "bfloat16", "sum")
        if ml_dtypes is not None:
            out = poison(300, "bfloat16").view(ml_dtypes.bfloat16)
            comm.reduce_scatter(mine.view(ml_dtypes.bfloat16), out)
            check(same_bits(out.view(np.uint16), want), "ml_dtypes reduce_scatter")
        if torch is not None:
            t = torch.from_numpy(mine.view(np.int16).copy()).view(torch.bfloat16)
            o = torch.empty(300, dtype=torch.bfloat16)
            comm.reduce_scatter(t, o)
            check(same_bits(o.view(torch.int16).numpy().view(np.uint16), want), "torch cpu reduce_scatter")
            parts = [ag_input(3601, 50, "float32", r) for r in range(SIZE)]
            o = torch.empty(SIZE * 50, dtype=torch.float32)
            comm.all_gather(torch.from_numpy(parts[RANK].copy()), o)
            check(same_bits(o.numpy(), np.concatenate(parts)), "torch cpu all_gather")


@case
def reduce_scatter_and_all_gather_refuse_bad_arguments():
    """Each bad call (the same on every rank) raises InvalidArgumentError
    on every rank, naming what is wrong; a fresh Comm for each (a refused
    call fails its Comm)."""
    n = 16
    big = np.zeros(SIZE * n + 8, np.float32)
    ro = np.zeros(SIZE * n, np.float32)
    ro.flags.writeable = False
    bad = [
        ("rs output length", lambda c: c.reduce_scatter(np.zeros(SIZE * n, np.float32), np.zeros(n + 1, np.float32)),
         ("reduce_scatter", f"expected {SIZE} ranks x {n + 1}")),
        ("rs in place not a multiple", lambda c: c.reduce_scatter(np.zeros(SIZE * n + 1, np.float32)),
         ("not a multiple",)),
        ("ag output length", lambda c: c.all_gather(np.zeros(n, np.float32), np.zeros(SIZE * n - 1, np.float32)),
         ("all_gather", f"expected {SIZE} ranks x {n}")),
        ("rs overlap elsewhere", lambda c: c.reduce_scatter(big[: SIZE * n], big[RANK * n + 1:RANK * n + 1 + n]),
         ("in place", "overlaps")),
        ("ag overlap elsewhere", lambda c: c.all_gather(big[RANK * n + 2:RANK * n + 2 + n], big[: SIZE * n]),
         ("in place", "overlaps")),
        ("rs read-only in place", lambda c: c.reduce_scatter(ro), ("read-only",)),
        ("rs read-only input, its own block as out",
         lambda c: c.reduce_scatter(ro, ro[RANK * n:(RANK + 1) * n]), ("read-only",)),
        ("rs dtype pair", lambda c: c.reduce_scatter(np.zeros(SIZE * n, np.float32), np.zeros(n, np.float16)),
         ("float32", "float16")),
        ("rs op", lambda c: c.reduce_scatter(np.zeros(SIZE * n, np.float32), op="prod"), ("op='prod'",)),
        ("ag float64", lambda c: c.all_gather(np.zeros(n), np.zeros(SIZE * n)), ("float64",)),
    ]
    for name, fn, words in bad:
        with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
            e, dt = expect_error(lambda: fn(comm), arx.InvalidArgumentError, contains=words, name=name)
            check(dt < PROMPT, f"{name}: took {dt:.1f} s")
            expect_error(lambda: comm.all_gather(np.zeros(n, np.float32), np.zeros(SIZE * n, np.float32)),
                         arx.Error, name=f"{name}: the Comm stays failed")


@case
def reduce_scatter_misuse_on_some_ranks_fails_every_rank_at_once():
    """out = the input's first block on every rank (an allreduce habit): in
    place on rank 0, refused elsewhere, and rank 0 raises at once too. A
    length differing on the last rank: every rank raises at once."""
    n = 32
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        x = partial(3700, SIZE * n, "float32", RANK)
        cls = arx.CallMismatchError if RANK == 0 else arx.InvalidArgumentError
        e, dt = expect_error(lambda: comm.reduce_scatter(x, x[:n]), cls, name="out = first block")
        check(dt < PROMPT, f"out = first block: took {dt:.1f} s")
    with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
        m = n + (1 if RANK == SIZE - 1 else 0)
        e, dt = expect_error(lambda: comm.all_gather(np.zeros(m, np.float32), np.zeros(SIZE * m, np.float32)),
                             arx.CallMismatchError, name="all_gather length on the last rank")
        check(dt < PROMPT, f"all_gather length on the last rank: took {dt:.1f} s")


@case
def reduce_scatter_and_all_gather_refuse_cuda_arrays_on_a_host_instance():
    """CUDA arrays go to the GPU entry points, which a host instance
    refuses (every rank at once), after the Python-side checks."""
    for name, fn, words in (
        ("reduce_scatter", lambda c: c.reduce_scatter(FakeCudaArray(shape=(8 * SIZE,))),
         ("host device side", "device='gpu'")),
        ("all_gather", lambda c: c.all_gather(FakeCudaArray(), FakeCudaArray(shape=(8 * SIZE,))),
         ("host device side",)),
        ("reduce_scatter float64", lambda c: c.reduce_scatter(FakeCudaArray(typestr="<f8", shape=(8 * SIZE,))),
         ("'<f8'",)),
        ("all_gather read-only out",
         lambda c: c.all_gather(FakeCudaArray(), FakeCudaArray(shape=(8 * SIZE,), readonly=True)),
         ("read-only",)),
    ):
        with arx.Comm(WORLD, device="host", timeout=FAIL_TIMEOUT) as comm:
            e, dt = expect_error(lambda: fn(comm), arx.InvalidArgumentError, contains=words,
                                 name=f"cuda {name}")
            check(dt < PROMPT, f"cuda {name}: took {dt:.1f} s")


# ---- broadcast ----------------------------------------------------------------

@case
def broadcast_on_host_buffers():
    """Every dtype; n from 0 to beyond a 4 KiB slot (chunked); every root;
    out of place (a non-root's own input must be ignored), in place
    (out=None; a non-root's buffer poisoned) and out = x; random bits
    (NaN payloads included) arriving unchanged."""
    with arx.Comm(WORLD, slot_bytes=4096) as comm:
        cid = 5000
        for dtype in ("float32", "float16", "bfloat16"):
            kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
            for n in (0, 1, 5, 1000, 2500):
                for root in range(SIZE):
                    for mode in ("out", "none", "same"):
                        cid += 1
                        name = f"broadcast {dtype} n={n} root={root} {mode}"
                        mine = ag_input(cid, n, dtype, RANK)
                        want = ag_input(cid, n, dtype, root)
                        if mode == "out":
                            x = mine.copy()
                            out = poison(n, dtype)
                            got = comm.broadcast(x, out, root, **kw)
                            check(got is out, f"{name}: did not return out")
                            check(same_bits(x, mine), f"{name}: the input changed")
                        else:
                            out = mine.copy() if RANK == root else poison(n, dtype)
                            if mode == "none":
                                got = comm.broadcast(out, root=root, **kw)
                            else:
                                got = comm.broadcast(out, out, root=root, **kw)
                            check(got is out, f"{name}: did not return the array")
                        check(same_bits(out, want), f"{name}: {wrong(out, want)}")
        # A NumPy integer root (through __index__) is a root like any other.
        for root in range(SIZE):
            cid += 1
            mine = ag_input(cid, 77, "float32", RANK)
            want = ag_input(cid, 77, "float32", root)
            out = poison(77, "float32")
            comm.broadcast(mine, out, np.int64(root))
            check(same_bits(out, want), f"broadcast root=np.int64({root}): {wrong(out, want)}")
        # Then an all-reduce on the same Comm.
        call_and_check(comm, 5999, 300, "float32", False, "an all-reduce after the broadcasts")


@case
def broadcast_takes_ml_dtypes_and_torch_cpu():
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
        note("ml_dtypes not installed: bfloat16 NumPy arrays not tried in broadcast")
    try:
        import torch
    except ImportError:
        torch = None
        note("torch not installed: CPU tensors not tried in broadcast")
    with arx.Comm(WORLD) as comm:
        root = SIZE - 1
        mine, want = ag_input(5100, 300, "bfloat16", RANK), ag_input(5100, 300, "bfloat16", root)
        if ml_dtypes is not None:
            out = poison(300, "bfloat16").view(ml_dtypes.bfloat16)
            comm.broadcast(mine.view(ml_dtypes.bfloat16), out, root)
            check(same_bits(out.view(np.uint16), want), "ml_dtypes broadcast")
        if torch is not None:
            t = torch.from_numpy(mine.view(np.int16).copy()).view(torch.bfloat16)
            o = torch.empty(300, dtype=torch.bfloat16)
            comm.broadcast(t, o, root)
            check(same_bits(o.view(torch.int16).numpy().view(np.uint16), want), "torch cpu broadcast")
            x = torch.from_numpy(ag_input(5101, 50, "float32", RANK).copy())
            comm.broadcast(x, root=0)
            check(same_bits(x.numpy(), ag_input(5101, 50, "float32", 0)), "torch cpu broadcast in place")


@case
def broadcast_refuses_bad_arguments():
    """Each bad call (the same on every rank) raises InvalidArgumentError
    on every rank, naming what is wrong; a fresh Comm for each."""
    n = 16
    big = np.zeros(2 * n, np.float32)
    ro = np.zeros(n, np.float32)
    ro.flags.writeable = False
    bad = [
        ("root = size", lambda c: c.broadcast(np.zeros(n, np.float32), root=SIZE), ("root", "not a rank")),
        ("root -1", lambda c: c.broadcast(np.zeros(n, np.float32), root=-1), ("root -1",)),
        ("root 2**70", lambda c: c.broadcast(np.zeros(n, np.float32), root=2**70), ("root",)),
        ("root 1.0", lambda c: c.broadcast(np.zeros(n, np.float32), root=1.0), ("root",)),
        ("lengths", lambda c: c.broadcast(np.zeros(n, np.float32), np.zeros(n + 1, np.float32)),
         ("broadcast", f"input has {n} elements, output {n + 1}")),
        ("overlap", lambda c: c.broadcast(big[:n], big[1:n + 1]), ("overlaps",)),
        ("read-only in place", lambda c: c.broadcast(ro), ("read-only",)),
        ("dtype pair", lambda c: c.broadcast(np.zeros(n, np.float32), np.zeros(n, np.float16)),
         ("float32", "float16")),
        ("float64", lambda c: c.broadcast(np.zeros(n)), ("float64",)),
    ]
    for name, fn, words in bad:
        with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
            e, dt = expect_error(lambda: fn(comm), arx.InvalidArgumentError, contains=words, name=name)
            check(dt < PROMPT, f"{name}: took {dt:.1f} s")
            expect_error(lambda: comm.broadcast(np.zeros(n, np.float32)),
                         arx.Error, name=f"{name}: the Comm stays failed")


@case
def broadcast_disagreements_fail_every_rank_at_once():
    """Rank 0 names root 1, the others root 0; every rank names itself; the
    last rank passes one element more; rank 0 passes a root that is no
    rank (InvalidArgumentError there): every rank raises at once."""
    n = 32
    shapes = [
        ("root", n, 1 if RANK == 0 else 0),
        ("every rank its own root", n, RANK),
        ("length on the last rank", n + (1 if RANK == SIZE - 1 else 0), 0),
        ("root out of range on rank 0", n, SIZE if RANK == 0 else 0),
    ]
    for name, m, root in shapes:
        with arx.Comm(WORLD, timeout=FAIL_TIMEOUT) as comm:
            cls = arx.CallMismatchError
            if name == "root out of range on rank 0" and RANK == 0:
                cls = arx.InvalidArgumentError
            x = ag_input(5200, m, "float32", RANK)
            e, dt = expect_error(lambda: comm.broadcast(x, poison(m, "float32"), root), cls, name=name)
            check(dt < PROMPT, f"broadcast {name}: took {dt:.1f} s")


@case
def broadcast_refuses_cuda_arrays_on_a_host_instance():
    """CUDA arrays go to the GPU entry point (Arx::broadcast_raw), which a
    host instance refuses (every rank at once, the message naming the
    call), after the Python-side checks."""
    for name, fn, words in (
        ("out of place", lambda c: c.broadcast(FakeCudaArray(), FakeCudaArray(ptr=0x20000)),
         ("broadcast", "host device side", "device='gpu'")),
        ("in place", lambda c: c.broadcast(FakeCudaArray(), root=SIZE - 1), ("broadcast", "host device side")),
        ("float64", lambda c: c.broadcast(FakeCudaArray(typestr="<f8")), ("'<f8'",)),
        ("read-only out", lambda c: c.broadcast(FakeCudaArray(), FakeCudaArray(ptr=0x20000, readonly=True)),
         ("read-only",)),
        ("read-only in place", lambda c: c.broadcast(FakeCudaArray(readonly=True)), ("read-only",)),
        ("root 1.0", lambda c: c.broadcast(FakeCudaArray(), root=1.0), ("root",)),
        ("root -1", lambda c: c.broadcast(FakeCudaArray(), root=-1), ("broadcast", "root -1")),
    ):
        with arx.Comm(WORLD, device="host", timeout=FAIL_TIMEOUT) as comm:
            e, dt = expect_error(lambda: fn(comm), arx.InvalidArgumentError, contains=words,
                                 name=f"cuda broadcast {name}")
            check(dt < PROMPT, f"cuda broadcast {name}: took {dt:.1f} s")


@case
def rust_log_is_read_as_env_logger_reads_it():
    """RUST_LOG as a Rust program's env_logger takes it: a plain level (the
    default for every target), `TARGET=LEVEL` or a bare `TARGET`, the
    longest target that is the record's own or a module above it winning;
    another crate's directive and anything unreadable leave the default
    (warn)."""
    from arx import _arx
    for value, target, want in (
        ("", "arx", "WARN"), ("info", "arx", "INFO"), (" debug ", "arx::proxy", "DEBUG"),
        ("off", "arx", "OFF"), ("arx=info", "arx", "INFO"), ("arx=info", "arx::proxy", "INFO"),
        ("arx", "arx::fabric::verbs", "TRACE"), ("warn,arx=debug", "arx::x", "DEBUG"),
        ("arx=debug,warn", "arx", "DEBUG"), ("arx::proxy=off", "arx::proxy", "OFF"),
        ("arx::proxy=off", "arx::fabric", "WARN"), ("arx::proxy=off", "arx", "WARN"),
        ("arx=info,arx::proxy=trace", "arx::proxy", "TRACE"),
        ("arx=info,arx::proxy=trace", "arx::proxy_x", "INFO"),
        ("arx::proxy=trace,arx=info", "arx::fabric", "INFO"), ("error,other=trace", "arx", "ERROR"),
        ("other=trace", "arx", "WARN"), ("arxx=debug", "arx", "WARN"), ("arx=debug", "arxx", "WARN"),
        ("bogus", "arx", "WARN"), ("arx=bogus", "arx", "WARN"), ("info,bogus", "arx", "INFO"),
        ("arx=info,arx=error", "arx", "ERROR"),
    ):
        got = _arx._log_level_of(value, target)
        check(got == want, f"RUST_LOG={value!r}, target {target}: level {got}, expected {want}")

if __name__ == "__main__":
    sys.exit(main("test_host.py"))

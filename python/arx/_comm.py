"""``arx.Comm``: an arx instance on an mpi4py communicator, and the dispatch
of ``allreduce`` (and of ``reduce_scatter``/``all_gather``/``broadcast``) by
argument kind
(host buffer, torch tensor, CUDA array interface, DLPack)."""

import itertools
import operator
import sys
import weakref

from . import _arx
from . import ClosedError, InvalidArgumentError

# Comms by id, for the torch custom op (which takes an int, not an object).
_ids = itertools.count(1)
_live = weakref.WeakValueDictionary()

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
_CAI_DTYPES = {"f4": "float32", "f2": "float16"}


def _torch():
    """The torch module if the program imported it (arx never imports it
    for a call: a tensor can only exist if torch was imported)."""
    return sys.modules.get("torch")


def _is_tensor(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _count(x):
    """Best-effort element count, shown to peers when a call is refused."""
    try:
        if _is_tensor(x):
            return int(x.numel())
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is not None:
            n = 1
            for d in cai["shape"]:
                n *= int(d)
            return n
        n = getattr(x, "size", None)
        return int(n) if isinstance(n, int) else 0
    except Exception:
        return 0


def _stream_handle(stream):
    """A CUstream as an int from a torch/CuPy stream object or an int."""
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h)
    return int(stream)


def _kind(x):
    """'torch-cuda', 'torch-cpu', 'cai', 'dlpack-cuda' or 'host'."""
    if _is_tensor(x):
        return "torch-cuda" if x.is_cuda else "torch-cpu"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None and not hasattr(x, "__array_interface__"):
        try:
            # kDLCUDA = 2, kDLCUDAManaged = 13
            if dev()[0] in (2, 13):
                return "dlpack-cuda"
        except Exception:
            pass
    return "host"


class Comm:
    """An arx instance over an mpi4py communicator.

    ``Comm(comm, **settings)`` is collective over ``comm`` (every rank must
    call it); ``settings`` are the Rust ``arx::Builder`` options: device,
    fabric, slot_bytes, timeout, init_timeout, stall_warn (seconds), spin,
    staging, devices, gid_index, proxy_cpu, cuda_device. A setting left out
    (or None) comes from its ``ARX_*`` variable, then the default. An
    unknown or bad setting raises on this rank and makes every other rank
    raise ``PeerFailedError`` at once.

    Calls are collective too: every rank makes the same calls in the same
    order. A failed call leaves the Comm failed (every later call raises the
    same error): close it and create a new one on every rank.
    """

    def __init__(self, comm, **settings):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise InvalidArgumentError(f"arx.Comm needs mpi4py: {e}") from None
        if not isinstance(comm, MPI.Comm):
            raise InvalidArgumentError(
                f"arx.Comm(comm): comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD), "
                f"got {type(comm).__name__}"
            )
        self._c = None
        self._c = _arx._Comm(comm.py2f(), settings, MPI.Get_library_version())
        self.id = next(_ids)
        _live[self.id] = self

    # -- what it is --------------------------------------------------------
    @property
    def rank(self):
        """This rank in the communicator."""
        return self._c.rank

    @property
    def size(self):
        """Ranks in the communicator."""
        return self._c.size

    @property
    def device(self):
        """'gpu' or 'host': the device side that runs the calls."""
        return self._c.device

    @property
    def cuda_device(self):
        """CUDA device ordinal of a GPU instance (tensors must live there), else None."""
        return self._c.cuda_device

    @property
    def closed(self):
        return self._c is None or self._c.closed

    def describe(self):
        """What the instance is made of (device side, fabric, slot size, ...)."""
        return self._c.describe()

    def __repr__(self):
        if self.closed:
            return "<arx.Comm closed>"
        return f"<arx.Comm rank {self.rank} of {self.size}, {self.device}>"

    # -- life --------------------------------------------------------------
    def close(self):
        """Frees the instance (collective with the Verbs fabric: a bounded
        barrier). Closing twice does nothing; any later call raises
        ``arx.ClosedError``."""
        if self._c is not None:
            self._c.close()
        _live.pop(getattr(self, "id", None), None)

    def __enter__(self):
        if self.closed:
            raise ClosedError("this arx.Comm is closed")
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def check(self):
        """Waits for this instance's GPU work; raises the first error it
        recorded (a GPU call's errors otherwise surface at the next call)."""
        self._c.check()

    # -- the call ----------------------------------------------------------
    def allreduce(self, x, out=None, op="sum", *, stream=None, dtype=None):
        """Sums ``x`` over all ranks into ``out`` (in place in ``x`` when
        ``out`` is None); returns the array that holds the result. Every rank
        gets the same bits: partials added in rank order in float32, rounded
        once.

        ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"`` (the same on
        every rank: ranks that differ all fail with a mismatch). max/min:
        IEEE 754-2019 maximum/minimum (any NaN gives the dtype's canonical
        NaN, -0.0 < +0.0), exact; avg: the float32 sum, divided once in
        float32 by the number of ranks, then rounded to the dtype.

        * NumPy arrays / host buffers: float32, float16 (bfloat16: uint16
          arrays of bfloat16 bits with ``dtype="bfloat16"``, or ml_dtypes
          bfloat16 arrays); C-contiguous; returns when done.
        * CPU torch tensors: float32, float16, bfloat16; as NumPy.
        * CUDA torch tensors, CuPy arrays, ``__cuda_array_interface__`` or
          DLPack CUDA objects (float32, float16, bfloat16 where the framework
          has it), on a GPU instance and its CUDA device: enqueued on
          ``stream`` (default: the framework's current stream) and returns at
          once; capturable in ``torch.cuda.graph``.

        ``out`` must have the input's kind, dtype and element count, and be
        the same memory (in place) or disjoint from it. Do not touch the
        arrays from other threads during a call.
        """
        c = self._c
        if c is None:
            raise ClosedError("this arx.Comm is closed")
        if op not in ("sum", "max", "min", "avg"):
            c.refuse(_count(x), f"op={op!r}: arx reduces with op='sum', 'max', 'min' or 'avg'")
        kind = _kind(x)
        if out is not None and out is not x and _kind(out) != kind:
            c.refuse(
                _count(x),
                f"input is a {type(x).__name__} ({kind}) but out is a {type(out).__name__} "
                f"({_kind(out)}): both must be the same kind of array",
            )
        if kind == "dlpack-cuda":
            torch = self._torch_for_dlpack(x)
            tx = torch.from_dlpack(x)
            tout = None if out is None or out is x else torch.from_dlpack(out)
            self.allreduce(tx, tout, op, stream=stream)
            return x if out is None else out
        if kind == "torch-cuda":
            self._torch_cuda(x, out, stream, op)
        elif kind == "cai":
            self._cai(x, out, stream, op)
        elif kind == "torch-cpu":
            self._torch_cpu(x, out, op)
        else:
            self._host(x, out, dtype, op)
        return x if out is None else out

    def _torch_for_dlpack(self, x):
        """torch, to view a DLPack CUDA object as a tensor (or a refusal)."""
        torch = _torch()
        if torch is None:
            try:
                import torch
            except ImportError:
                self._c.refuse(
                    _count(x),
                    f"{type(x).__name__} is a DLPack CUDA array: arx takes torch tensors, "
                    "CuPy arrays or __cuda_array_interface__ objects (torch is not installed "
                    "to convert it)",
                )
        return torch

    def _host(self, x, out, dtype, op):
        x, out, dtype = self._host_views(x, out, dtype)
        self._c.allreduce_host(x, out, dtype, op)

    @staticmethod
    def _host_views(x, out, dtype):
        """(x, out, dtype) for the host calls: ml_dtypes' bfloat16 arrays
        cannot be exported as buffers, so their bits go as uint16."""
        if dtype is None and getattr(getattr(x, "dtype", None), "name", None) == "bfloat16":
            x = x.view("uint16")
            if out is not None:
                if getattr(getattr(out, "dtype", None), "name", None) == "bfloat16":
                    out = out.view("uint16")
            dtype = "bfloat16"
        return x, out, dtype

    def _torch_cpu(self, x, out, op):
        xv, ov, dt = self._torch_cpu_views(x, None if out is x else out)
        self._c.allreduce_host(xv, ov, dt, op)

    def _torch_cpu_views(self, x, out):
        """NumPy views of CPU tensors (bfloat16 as int16 bits) and the
        dtype keyword for the host calls."""
        c = self._c
        torch = _torch()

        def host_view(t, what):
            name = str(t.dtype)
            if name not in _TORCH_DTYPES:
                c.refuse(_count(x), f"{what} has dtype {name}: arx reduces float32, float16 and bfloat16")
            t = t.detach()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy()
            return t.numpy()

        bf16 = x.dtype == torch.bfloat16
        xv = host_view(x, "the input")
        ov = None if out is None else host_view(out, "out")
        return xv, ov, "bfloat16" if bf16 else None

    def _torch_cuda(self, x, out, stream, red):
        args, stream = self._torch_cuda_args(x, out, stream)
        (ip, n, dt) = args[0]
        (op, on, odt) = args[-1]
        self._c.allreduce_device(ip, op, n, on, dt, odt, stream, red)

    def _torch_cuda_args(self, x, out, stream, skip_same=True):
        """[(address, count, dtype)] of the input (and of out unless it is
        None or the input), and the stream handle: the checks NumPy-style
        views cannot make (dtype, contiguity)."""
        c = self._c
        torch = _torch()
        tensors = [("the input", x)] + ([] if out is None or (skip_same and out is x) else [("out", out)])
        args = []
        for what, t in tensors:
            name = str(t.dtype)
            if name not in _TORCH_DTYPES:
                c.refuse(_count(x), f"{what} has dtype {name}: arx reduces float32, float16 and bfloat16")
            if not t.is_contiguous():
                c.refuse(
                    _count(x),
                    f"{what} is not contiguous (strides {tuple(t.stride())}): pass "
                    "t.contiguous() and copy the result back",
                )
            args.append((t.data_ptr(), t.numel(), _TORCH_DTYPES[name]))
        if stream is None:
            stream = torch.cuda.current_stream(x.device)
        return args, _stream_handle(stream)

    def _cai(self, x, out, stream, red):
        args, stream = self._cai_args(x, out, stream, in_place=out is None or out is x)
        (ip, n, dt) = args[0]
        (op, on, odt) = args[-1]
        self._c.allreduce_device(ip, op, n, on, dt, odt, stream, red)

    def _cai_args(self, x, out, stream, in_place, skip_same=True):
        """As ``_torch_cuda_args`` for ``__cuda_array_interface__`` objects;
        ``in_place``: the input is written too (so must not be read-only)."""
        c = self._c
        arrays = [("the input", x)] + ([] if out is None or (skip_same and out is x) else [("out", out)])
        args = []
        for what, a in arrays:
            ai = a.__cuda_array_interface__
            typestr = ai["typestr"]
            if typestr[0] not in "<|=" or typestr[1:] not in _CAI_DTYPES:
                c.refuse(
                    _count(x),
                    f"{what} has typestr {typestr!r}: arx reduces float32 ('<f4') and float16 "
                    "('<f2') CUDA arrays (bfloat16 through torch tensors)",
                )
            dt = _CAI_DTYPES[typestr[1:]]
            shape = tuple(int(d) for d in ai["shape"])
            n = 1
            for d in shape:
                n *= d
            strides = ai.get("strides")
            if strides is not None and n > 1:
                item = int(typestr[2:])
                want, acc = [], item
                for d in reversed(shape):
                    want.append(acc)
                    acc *= d
                want.reverse()
                if any(s != w for s, w, d in zip(strides, want, shape) if d > 1):
                    c.refuse(
                        _count(x),
                        f"{what} is not C-contiguous (shape {shape}, strides {tuple(strides)})",
                    )
            ptr, readonly = ai["data"]
            if readonly and (what == "out" or in_place):
                c.refuse(_count(x), f"{what} is read-only: the result is written there")
            args.append((int(ptr or 0), n, dt))
        if stream is None:
            stream = self._cai_stream(x, x.__cuda_array_interface__)
        return args, _stream_handle(stream)

    # -- reduce-scatter and all-gather ---------------------------------------
    def reduce_scatter(self, x, out=None, op="sum", *, stream=None, dtype=None):
        """Reduce-scatter (NCCL's definition): ``x`` holds ``size * n``
        elements; their reduction over all ranks is cut into ``size`` blocks
        of ``n`` and block ``r`` lands in rank ``r``'s ``out`` (``n``
        elements). Bit for bit block ``r`` of ``allreduce`` of the same
        inputs (same ``op`` rules). In place when ``out`` is None: this
        rank's block of ``x`` (``x.ravel()[rank*n:(rank+1)*n]``) receives
        the result, the other blocks are left as they were; ``out`` being
        that very block is in place too. Returns the array holding the
        result (``x`` in place).

        Every kind of array ``allreduce`` takes, with the same rules: host
        buffers and CPU torch tensors return when done; CUDA torch tensors,
        CuPy arrays, ``__cuda_array_interface__`` and DLPack CUDA objects
        (on a GPU instance and its CUDA device) are enqueued on ``stream``
        (default: the framework's current stream), return at once and are
        capturable in ``torch.cuda.graph``. ``out`` must have the input's
        kind and dtype, ``size * n`` and ``n`` elements, and be disjoint
        from ``x`` unless it is this rank's block of it.
        """
        self._blocks("reduce_scatter", x, out, op, dtype, stream)
        return x if out is None else out

    def all_gather(self, x, out=None, *, stream=None, dtype=None):
        """All-gather (NCCL's definition): every rank's ``x`` (``n``
        elements), concatenated in rank order, lands in every rank's ``out``
        (``size * n`` elements), bits unchanged. In place when ``out`` is
        None: ``x`` holds ``size * n`` elements and this rank's block of it
        is the input; ``x`` being that block of ``out`` is in place too.
        Returns the array holding the result (``x`` in place).

        Every kind of array ``allreduce`` takes (see ``reduce_scatter``:
        CUDA arrays are enqueued on ``stream``, capturable); ``x`` and
        ``out`` are disjoint unless ``x`` is this rank's block of ``out``.
        """
        self._blocks("all_gather", x, out, None, dtype, stream)
        return x if out is None else out

    # -- broadcast -------------------------------------------------------------
    def broadcast(self, x, out=None, root=0, *, stream=None, dtype=None):
        """Broadcast (NCCL's definition): the root's ``x`` lands in every
        rank's ``out`` (as many elements), bits unchanged. In place when
        ``out`` is None (or ``x`` itself): ``x`` is the root's input and
        every rank's result. ``x`` is read on the root only, but its length
        must equal ``out``'s on every rank. Every rank passes the same
        ``root`` and length; a ``root`` that is no rank raises
        ``arx.InvalidArgumentError`` there and ``arx.CallMismatchError`` on
        its peers, at once, as do ranks that disagree on the root or the
        length. Returns the array holding the result (``x`` in place).

        Every kind of array ``allreduce`` takes (see ``reduce_scatter``:
        CUDA arrays are enqueued on ``stream``, capturable); ``out`` must
        have the input's kind and dtype, and be ``x`` itself or disjoint
        from it.
        """
        c = self._c
        if c is None:
            raise ClosedError("this arx.Comm is closed")
        kind = _kind(x)
        if out is not None and _kind(out) != kind:
            c.refuse(
                _count(x),
                f"input is a {type(x).__name__} ({kind}) but out is a {type(out).__name__} "
                f"({_kind(out)}): both must be the same kind of array",
            )
        # Any integer (NumPy's too, through __index__); bool is refused.
        if isinstance(root, bool) or not hasattr(type(root), "__index__"):
            c.refuse(_count(x), f"broadcast: root={root!r} is not an integer")
        root = operator.index(root)
        if not -(2**63) <= root < 2**63:
            c.refuse(_count(x), f"broadcast: root={root!r} is not a rank of this {self.size}-rank comm")
        if kind == "dlpack-cuda":
            torch = self._torch_for_dlpack(x)
            tx = torch.from_dlpack(x)
            tout = None if out is None or out is x else torch.from_dlpack(out)
            self.broadcast(tx, tout, root, stream=stream)
            return x if out is None else out
        if kind in ("torch-cuda", "cai"):
            same = out is None or out is x
            if kind == "torch-cuda":
                args, s = self._torch_cuda_args(x, None if same else out, stream)
            else:
                args, s = self._cai_args(x, None if same else out, stream, same)
            (ip, n, dt) = args[0]
            o = None if same else args[-1]
            c.broadcast_device(ip, n, dt, None if o is None else o[0], 0 if o is None else o[1],
                               dt if o is None else o[2], s, root)
            return x if out is None else out
        if kind == "torch-cpu":
            xv, ov, dt = self._torch_cpu_views(x, None if out is x else out)
        else:
            xv, ov, dt = self._host_views(x, None if out is x else out, dtype)
        c.broadcast_host(xv, ov, dt, root)
        return x if out is None else out

    def _blocks(self, name, x, out, op, dtype, stream=None):
        c = self._c
        if c is None:
            raise ClosedError("this arx.Comm is closed")
        if op is not None and op not in ("sum", "max", "min", "avg"):
            c.refuse(_count(x), f"op={op!r}: arx reduces with op='sum', 'max', 'min' or 'avg'")
        kind = _kind(x)
        if out is not None and _kind(out) != kind:
            c.refuse(
                _count(x),
                f"input is a {type(x).__name__} ({kind}) but out is a {type(out).__name__} "
                f"({_kind(out)}): both must be the same kind of array",
            )
        if kind == "dlpack-cuda":
            torch = self._torch_for_dlpack(x)
            tx = torch.from_dlpack(x)
            tout = None if out is None else torch.from_dlpack(out)
            self._blocks(name, tx, tout, op, dtype, stream)
            return
        if kind in ("torch-cuda", "cai"):
            # out being the input itself is checked (refused) as an overlap.
            if kind == "torch-cuda":
                args, s = self._torch_cuda_args(x, out, stream, skip_same=False)
            else:
                args, s = self._cai_args(x, out, stream, out is None, skip_same=False)
            (ip, n, dt) = args[0]
            o = None if out is None else args[-1]
            c.blocks_device(name, ip, n, dt, None if o is None else o[0], 0 if o is None else o[1],
                            dt if o is None else o[2], s, op or "sum")
            return
        if kind == "torch-cpu":
            xv, ov, dt = self._torch_cpu_views(x, out)
        else:
            xv, ov, dt = self._host_views(x, out, dtype)
        if name == "reduce_scatter":
            c.reduce_scatter_host(xv, ov, dt, op)
        else:
            c.all_gather_host(xv, ov, dt)

    @staticmethod
    def _cai_stream(x, ai):
        cupy = sys.modules.get("cupy")
        if cupy is not None and isinstance(x, cupy.ndarray):
            return cupy.cuda.get_current_stream().ptr
        s = ai.get("stream")
        # No stream in the interface: the producer asks for no
        # synchronization; the legacy default stream orders the call after
        # all earlier work of blocking streams.
        return s if isinstance(s, int) else 0

    def __del__(self):
        _live.pop(getattr(self, "id", None), None)

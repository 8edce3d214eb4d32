"""arx: small all-reduce between GPUs (or CPUs) over RoCE RDMA or shared
memory, launched by MPI.

    from mpi4py import MPI
    import numpy as np
    import arx

    with arx.Comm(MPI.COMM_WORLD) as comm:
        x = np.full(4096, comm.rank + 1, dtype=np.float32)
        comm.allreduce(x)            # in place: every rank holds the sum

``arx.Comm(mpi4py_comm, **settings)`` is collective; ``comm.allreduce`` takes
NumPy arrays (float32, float16; bfloat16 as uint16 with dtype="bfloat16"),
CPU torch tensors, and CUDA torch tensors / CuPy arrays (float32, float16,
bfloat16) on a GPU instance, enqueued on the current stream (capturable in
``torch.cuda.graph``). ``arx.torch.all_reduce_(tensor, comm)`` is the same
call as a torch custom op for ``torch.compile``. ``comm.reduce_scatter`` and
``comm.all_gather`` (NCCL's definitions) take the same arrays. Every failure raises an
``arx.Error`` subclass carrying arx's message. See docs/PYTHON.md.
"""

import builtins as _builtins


class Error(Exception):
    """Base of every arx error. ``kind`` names the class; subclasses carry
    what a program may branch on (``peer``, ``rank``, ``seq``, ...)."""

    kind = "Error"


class MpiError(Error):
    """An MPI call failed, or MPI is not initialized / already finalized
    (``call`` names the MPI function)."""


class MismatchError(Error):
    """The ranks disagree on something they must share (a setting, the
    world size, ...). ``what`` names it, ``rank`` the first rank that differs
    from rank 0. Every rank raises it."""


class CallMismatchError(MismatchError):
    """Ranks made different calls (another collective, element count,
    dtype, op or broadcast root), or a peer refused its call (bad arguments
    on that rank). ``seq`` is the call
    number, ``peer`` the other rank. Every rank raises it at once."""


class TimeoutError(Error, _builtins.TimeoutError):
    """A bounded wait ran out (``during`` names it, ``waited`` in seconds):
    a peer stopped calling, or is slower than the timeout."""


class PeerFailedError(Error):
    """Another rank failed (``peer``), timed out in a call before this rank
    came, or closed its Comm after fewer calls; this rank stops too."""


class InvalidArgumentError(Error, ValueError, TypeError):
    """A call's or setting's argument is wrong (type, dtype, length, layout,
    device, overlap, unknown setting). Also a ``ValueError`` and a
    ``TypeError``, as Python's own argument errors are."""


class ConfigError(InvalidArgumentError):
    """A setting (keyword of ``arx.Comm`` or ``ARX_*`` variable) has a bad
    value; ``setting`` names it."""


class UnavailableError(Error):
    """Something arx needs is not here (no GPU, no RDMA device, no libcuda,
    mpi4py built against another MPI library)."""


class OsError(Error, _builtins.OSError):
    """A system call failed (shared memory, mmap, threads)."""


class VerbsError(Error):
    """A verbs (RDMA) call or completion failed."""


class TopologyError(Error):
    """RDMA device discovery or selection failed."""


class CudaError(Error):
    """A CUDA driver or NVRTC call failed."""


class KernelError(Error):
    """The arx GPU kernel recorded a failure that has no other class (a peer's
    other call, timeout or failure raise CallMismatchError, TimeoutError,
    PeerFailedError)."""


class ProxyError(Error):
    """arx's proxy thread failed."""


class InvalidUsageError(Error):
    """The module is used in a way it does not allow (a Comm used by two
    threads at once, close() on a thread MPI does not allow)."""


class ClosedError(InvalidUsageError):
    """The Comm was closed."""


class UnsupportedError(InvalidUsageError, NotImplementedError):
    """A call this build of arx cannot make (none in this build; kept so
    that code catching it keeps working). Also a ``NotImplementedError``.
    Such a call is refused as a bad argument is: the peers fail at once and
    the Comm is failed."""


from ._arx import MPI_LIBRARY, SETTINGS, __version__  # noqa: E402
from ._comm import Comm  # noqa: E402

__all__ = [
    "Comm",
    "Error",
    "MpiError",
    "MismatchError",
    "CallMismatchError",
    "TimeoutError",
    "PeerFailedError",
    "InvalidArgumentError",
    "ConfigError",
    "UnavailableError",
    "OsError",
    "VerbsError",
    "TopologyError",
    "CudaError",
    "KernelError",
    "ProxyError",
    "InvalidUsageError",
    "ClosedError",
    "UnsupportedError",
    "MPI_LIBRARY",
    "SETTINGS",
    "__version__",
]


def __getattr__(name):
    # arx.torch imports torch (slow, and absent on CPU-only machines): only
    # when asked for.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'arx' has no attribute {name!r}")

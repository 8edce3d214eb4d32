"""arx as a torch custom op, for ``torch.compile`` and CUDA graphs.

    import arx.torch  # registers torch.ops.arx.all_reduce (needs torch >= 2.4)
    arx.torch.all_reduce_(tensor, comm)  # in place; returns tensor

The op ``arx::all_reduce(Tensor(a!) tensor, int comm_id) -> ()`` mutates
its input; its fake (meta) implementation does nothing, so ``torch.compile``
traces it as one opaque in-place op without running it, and a captured
graph replays arx's kernel. Eager calls of ``arx.Comm.allreduce`` on a
tensor do the same work without the dispatcher; inside compiled code use
``all_reduce_`` (a call of ``comm.allreduce`` there would break the graph).
"""

import torch

from . import ClosedError
from . import _comm


@torch.library.custom_op("arx::all_reduce", mutates_args=("tensor",))
def _all_reduce(tensor: torch.Tensor, comm_id: int) -> None:
    comm = _comm._live.get(comm_id)
    if comm is None or comm.closed:
        raise ClosedError(f"arx::all_reduce: no open arx.Comm with id {comm_id}")
    comm.allreduce(tensor)


@_all_reduce.register_fake
def _(tensor, comm_id):
    return None


def all_reduce_(tensor, comm):
    """Sums ``tensor`` over the ranks of ``comm`` in place (the current
    stream for a CUDA tensor) through the ``arx::all_reduce`` op; returns
    ``tensor``."""
    torch.ops.arx.all_reduce(tensor, comm.id)
    return tensor


__all__ = ["all_reduce_"]

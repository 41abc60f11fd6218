"""Counting the ops of a decode step that would synchronise with the host, or size a tensor by its data.

A steady decode step must be a fixed-shape tensor program (docs/design.md, invariant 8): no
``.item()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing or other op whose result the host
waits for or whose output shape depends on data. :class:`OpLog` is a ``TorchDispatchMode`` that
records every aten op a compiled forward dispatches, including the ops inside kvpass's custom ops
(the runtime's Python), and marks those that sync. It declares ``ignore_compile_internals`` so that
dynamo keeps running the compiled code under it (a plain dispatch mode makes dynamo run the frame
eagerly). On CPU nothing actually waits; the same ops on CUDA would.

Not seen by a dispatch mode: ``Tensor.tolist()`` and ``.numpy()`` on CPU tensors (they read memory
without dispatching); the runtime has none in its decode paths.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpLog", "SYNC_OPS"]

aten = torch.ops.aten

#: ops whose result the host reads (a device sync on CUDA) or whose output size depends on data
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.allclose.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor,
}


def _bool_index(func, args) -> bool:
    """Boolean-mask indexing (``x[mask]``, ``x[mask] = y``) runs nonzero inside the kernel."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class OpLog(TorchDispatchMode):
    """Records ``(op name, syncs)`` for every op dispatched while active, in order.

    ``log.ops``: op names in call order; ``log.syncs``: the syncing ones. ``kvpass::`` ops are entered
    with a fresh log of the same lists, so the runtime's own ops are recorded too."""

    def __init__(self, ops: list | None = None, syncs: list | None = None):
        super().__init__()
        self.ops: list[str] = [] if ops is None else ops
        self.syncs: list[str] = [] if syncs is None else syncs

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket._qualified_op_name) if hasattr(func, "overloadpacket") else str(func)
        self.ops.append(name)
        if func in SYNC_OPS or _bool_index(func, args):
            self.syncs.append(name)
        if name.startswith("kvpass::"):
            # run the op's Python body under a fresh log (calling the op itself would dispatch to it)
            from kvpass.lowering.ops import IMPLS

            with OpLog(self.ops, self.syncs):
                return IMPLS[name](*args, **kwargs)
        return func(*args, **kwargs)

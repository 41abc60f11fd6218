"""Handles from compiled graphs to the runtime of the backend that compiled them.

Compiled code can only carry ints and tensors to an op, so each backend's :class:`Runtime` gets an
integer handle baked into its rewritten graphs. The table holds weak references only: the state
belongs to the backend, and is freed with it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpass.runtime.state import Runtime

_lock = threading.Lock()
_handles = itertools.count(1)
_table: weakref.WeakValueDictionary[int, Runtime] = weakref.WeakValueDictionary()


def register(runtime: Runtime) -> int:
    with _lock:
        handle = next(_handles)
        _table[handle] = runtime
    return handle


def lookup(handle: int) -> Runtime:
    rt = _table.get(handle)
    if rt is None:
        raise RuntimeError(
            f"kvpass: the backend (handle {handle}) that compiled this graph no longer exists; keep a "
            f"reference to the kvpass(...) backend for as long as the compiled model is used"
        )
    return rt

"""Handles from compiled graphs to the runtime of the backend that compiled them.

Compiled code can only carry ints and tensors to an op, so each backend's :class:`Runtime` gets an
integer handle baked into its rewritten graphs (and into the pass's cache key). A handle is derived
from the backend's key (policy and options) and the ordinal of this backend among those created with
that key in this process, so that it is the same in every process: the first ``Quest(1024)`` backend
of a new process finds the graphs that the first one of an earlier process left in Inductor's cache.
An ordinal is never reused within a process, so two backends never share a handle, even after one is
freed (a compiled graph of a freed backend must not reach a new backend's state). The table holds weak
references only: the state belongs to the backend, and is freed with it.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpass.runtime.runtime import Runtime

_lock = threading.Lock()
_ordinals: dict[str, int] = {}  # key -> next ordinal (never reused in this process)
_issued: set[int] = set()
_table: weakref.WeakValueDictionary[int, Runtime] = weakref.WeakValueDictionary()


def handle_for(key: str, ordinal: int) -> int:
    """The handle of the ``ordinal``-th backend with ``key``: in [1, 2**62), an int64 for the op schema."""
    digest = hashlib.sha256(f"{key}#{ordinal}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % ((1 << 62) - 1) + 1


def register(runtime: Runtime, key: str = "") -> int:
    with _lock:
        while True:  # a hash collision with a handle already issued takes the next ordinal
            ordinal = _ordinals.get(key, 0)
            _ordinals[key] = ordinal + 1
            handle = handle_for(key, ordinal)
            if handle not in _issued:
                break
        _issued.add(handle)
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

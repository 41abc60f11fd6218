"""Forwards that ran none of a backend's graphs: who compiled a module's call, and hooks that count.

``torch.compile`` reads the backend's ``__name__`` while it wraps a model or a function; the backend
then registers a :func:`watch` on the module (``torch.compile(model)``, ``model.compile()``, or the
module of ``model.forward``). The watch counts the backend's graph calls around each forward that this
backend was meant to run, and tells the backend when a whole forward ran none of them.

Which backend a forward belongs to is read from dynamo's own objects, never guessed from the hooks'
order (a module's forward may be compiled by several backends in turn, and hooks of old backends
stay on the module):

- inside a compiled call (``model.compile()``, calling what ``torch.compile(model)`` returned), the
  eval-frame callback dynamo has set is the backend's; a hook runs there only when dynamo fell back to
  eager (in a compiled graph the hooks are traced as nothing);
- outside one, ``model._compiled_call_impl`` (``model.compile()``) or ``model.__dict__["forward"]``
  (``model.forward = torch.compile(model.forward, backend=...)``) is a dynamo wrapper whose
  ``callback`` cell holds the backend (torch 2.13's ``_TorchDynamoContext.__call__``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

# a dynamo wrapper whose backend cannot be read: never blamed on this backend
OTHER = object()


def backend_of_callback(callback: Any) -> Any:
    """The backend behind a dynamo eval-frame callback (the object given to ``torch.compile``)."""
    from torch._dynamo.eval_frame import innermost_backend

    inner = innermost_backend(callback)
    return getattr(inner, "compiler_fn", inner)  # torch.compile wraps it in a _TorchCompileWrapper


def backend_of_wrapper(fn: Any) -> Any:
    """The backend a ``torch.compile(fn, backend=...)`` wrapper compiles with; None for anything that
    is not such a wrapper (a plain function or bound method)."""
    if getattr(fn, "_torchdynamo_wrapper_id", None) != id(fn):
        return None
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None or "callback" not in code.co_freevars:
        return OTHER  # a dynamo wrapper of another shape: not provably this backend's
    callback = cells[code.co_freevars.index("callback")].cell_contents
    return backend_of_callback(callback) if callable(callback) else OTHER


MINE, UNCOMPILED = object(), object()  # what whose() answers, with OTHER


class _Seen:
    """The last forward wrapper looked at and whose it is, so that a steady decode step costs an
    identity compare rather than a walk through dynamo's wrappers. The wrapper is held weakly and only
    the answer is kept: a watch keeps neither an old wrapper nor another backend alive."""

    __slots__ = ("ref", "whose")

    def __init__(self) -> None:
        self.ref: Callable[[], Any] = lambda: None
        self.whose: Any = UNCOMPILED


def _whose(found: Any, backend: Any) -> Any:
    return MINE if found is backend else UNCOMPILED if found is None else OTHER


def whose(mod: torch.nn.Module, backend: Any, seen: _Seen) -> Any:
    """MINE when ``backend`` compiles this call of ``mod``, OTHER when another backend (or a wrapper
    whose backend cannot be read) does, UNCOMPILED when no dynamo wrapper is involved."""
    callback = get_eval_frame_callback()
    if callback is not None and callback is not False:  # a hook inside a compiled call that fell back
        return _whose(backend_of_callback(callback), backend)
    fn = mod.__dict__.get("_compiled_call_impl") or mod.__dict__.get("forward")
    if fn is None:
        return UNCOMPILED
    if seen.ref() is not fn:
        seen.whose = _whose(backend_of_wrapper(fn), backend)
        try:
            seen.ref = weakref.ref(fn)
        except TypeError:  # not weakly referable: looked up again next time
            seen.ref = lambda: None
    return seen.whose


def watch(backend: Any, mod: torch.nn.Module, whole_module: bool) -> Callable[[], None]:
    """Hooks on ``mod`` that call ``backend._eager_forward(model_name, uncompiled)`` after a forward
    of ``mod`` owned by ``backend`` ran none of its graphs (``backend.graph_calls()`` did not move).
    ``uncompiled``: no dynamo wrapper was involved at all, which counts only for ``whole_module``
    watches (``torch.compile(model)``, whose wrapper's ``generate()`` calls the original module).
    Returns a function that widens the watch to the whole module. The hooks hold the backend weakly
    and remove themselves once it is gone."""
    be_ref = weakref.ref(backend)
    state = threading.local()  # the graph calls when this thread's forward began
    seen = _Seen()
    scope = {"module": whole_module}
    handles: list = []

    def before(m, args):
        if torch.compiler.is_compiling():  # inside a compiled graph: traced as nothing
            return
        be = be_ref()
        if be is None:
            for h in handles:
                h.remove()
            return
        who = whose(m, be, seen)
        if who is MINE or (who is UNCOMPILED and scope["module"]):
            state.n, state.uncompiled = be.graph_calls(), who is UNCOMPILED
        else:
            state.n = None

    def after(m, args, out):
        if torch.compiler.is_compiling():
            return
        n = getattr(state, "n", None)
        if n is None:
            return
        state.n = None
        be = be_ref()
        if be is not None and be.graph_calls() == n:
            be._eager_forward(type(m).__name__, state.uncompiled)

    handles += [mod.register_forward_pre_hook(before), mod.register_forward_hook(after)]

    def widen() -> None:
        scope["module"] = True

    return widen

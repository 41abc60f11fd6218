"""The wrapper around every graph a kvpass backend compiles: right or loud at the graph's edge.

Four checks, one pass over the graph's inputs and outputs per call (not per site), make four silent
failures loud (invariant 9; docs/design.md, "Right or loud at the graph's edge"):

- **Stubs go in plain and come out as :class:`~kvpass.runtime.store.CacheStub`.** A stub in the
  model's cache refuses every eager op that computes with it, so an eager fallback cannot attend it
  as if it held keys. Each stub the graph returns is tagged with its site's sequence (``epoch``).
- **A stub of a sequence the backend no longer holds is refused.** Two sequences interleaved on one
  backend (two ``generate`` calls stepping in turn, or two threads) would otherwise continue one
  sequence from the other's state.
- **Every stub handed to ``backend.adopt()`` is taken by its site** (kvpass/runtime/adopt.py): one
  that reached a layer the pass left exact was read as keys, so the step raises instead of returning.
- **One thread at a time.** A graph call while another thread is inside one of this backend's graphs
  raises at once: the per-site state belongs to one sequence (invariant 4).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvpass.runtime.adopt import ADOPTED
from kvpass.runtime.errors import KVPassError
from kvpass.runtime.store import CacheStub, as_cache_stub, plain

if TYPE_CHECKING:
    from kvpass.runtime.runtime import Runtime


class CallCount:
    """The calls of every graph of one backend: one counter, so that the backend's watch on a
    compiled forward (kvpass/watch.py) compares one int per forward."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class GuardedGraph:
    """``compiled(*args)`` with the checks above; ``calls`` counts this graph's calls, ``tally`` those
    of every graph of its backend."""

    def __init__(self, compiled: Callable, runtime: Runtime, busy: threading.RLock, tally: CallCount):
        self.compiled = compiled
        self.runtime = runtime
        self.busy = busy  # shared by every graph of one backend
        self.tally = tally  # likewise
        self.calls = 0
        self._owner: int | None = None

    def __call__(self, *args: Any) -> Any:
        if not self.busy.acquire(blocking=False):
            raise KVPassError(
                "kvpass: two threads ran this backend's compiled model at the same time. A kvpass "
                "backend holds one sequence (one batch) at a time, in its per-site state; concurrent "
                "generate() calls would decode from each other's caches. Fix: batch the prompts into one "
                "generate() call, or give each thread its own model compiled with its own kvpass(...) "
                "backend"
            )
        try:
            adopted: list[CacheStub] = []
            # isinstance: a device's subclass of the stub (kvpass.simcuda) is checked as the stub is
            args = [self._unwrap(a, adopted) if isinstance(a, CacheStub) else a for a in args]
            out = self.compiled(*args)
            if adopted:
                self._check_adopted(adopted)
            self.calls += 1
            self.tally.n += 1
            return self._tag(out)
        finally:
            self.busy.release()

    def _unwrap(self, stub: CacheStub, adopted: list) -> torch.Tensor:
        tag = stub._kvpass_tag
        if tag is not None and tag[0] == ADOPTED:
            if tag[1] is not self.runtime or not self.runtime.adoption.waiting(stub):
                raise KVPassError(
                    f"kvpass: layer {tag[2]} of the model's cache was handed to backend.adopt() of "
                    + ("another backend" if tag[1] is not self.runtime else
                       "this backend, and its keys were taken by an earlier step or dropped since "
                       "(backend.clear_state(), set_policy(), a later adopt())")
                    + ". Fix: adopt the prefilled cache with the backend that decodes it, right before "
                    "generate()")
            adopted.append(stub)
        elif tag is not None:
            site, state, epoch = tag
            if self.runtime.sites.get(site) is not state or state.epoch != epoch:
                info = state.info
                raise KVPassError(
                    f"kvpass: the model's cache for layer {info.layer} ({info.module_path}) belongs to a "
                    "sequence this backend no longer holds: another sequence was started on the same "
                    "backend since (two generate() calls stepping in turn, two threads, or "
                    "backend.clear_state()). A kvpass backend holds one sequence (one batch) at a time. "
                    "Fix: finish one sequence before starting the next, batch the prompts into one "
                    "generate() call, or compile one model per concurrent sequence, each with its own "
                    "kvpass(...) backend"
                )
        return plain(stub)

    def _check_adopted(self, adopted: list[CacheStub]) -> None:
        """Every adopted stub this graph was given must have been taken by its site: one that was not
        reached an op that is no kvpass site (a layer the pass left exact), which read it as keys."""
        left = sorted({s._kvpass_tag[2] for s in adopted if self.runtime.adoption.waiting(s)})
        if left:
            self.runtime.adoption.clear()
            raise KVPassError(
                f"kvpass: layer(s) {left} of the cache handed to backend.adopt() reached no kvpass site of "
                "this graph (the pass left them exact, or own_cache=False), so the step read their stubs as "
                "keys; its output is discarded. Fix: generate from the real cache, without adopt() (the "
                "first decode step then adopts what it can)")

    def _tag(self, out: Any) -> Any:
        if not isinstance(out, (list, tuple)):
            return out
        sites = self.runtime.stub_sites
        if not sites:
            return out
        res = list(out)
        held = set()  # one stub per site holds its sequence (the key and value stubs go into one cache)
        for i, t in enumerate(res):
            if (isinstance(t, torch.Tensor) and type(t) is not CacheStub and t.dim() == 4 and t.shape[2]
                    and t.stride(2) == 0):
                site = sites.get(t.untyped_storage().data_ptr())
                state = self.runtime.sites.get(site) if site is not None else None
                if state is not None:
                    res[i] = as_cache_stub(t, (site, state, state.epoch), hold=site not in held)
                    held.add(site)
        return res if isinstance(out, list) else type(out)(res)

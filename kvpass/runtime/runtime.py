"""The runtime of one backend: its sites' states, reached by the compiled graphs through ``handle``."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

import kvpass.runtime.registry as registry
from kvpass.runtime.adopt import Adoption
from kvpass.runtime.call import SiteInfo, make_call

if TYPE_CHECKING:
    from kvpass.policies.base import Policy
    from kvpass.runtime.state import SiteState


class Runtime:
    """All site states of one backend. Compiled graphs reach it through ``handle``."""

    def __init__(self, policy: Policy, key: str | None = None):
        self.policy = policy
        self.sites: dict[int, SiteState] = {}
        self.infos: dict[int, SiteInfo] = {}
        self.probe = None
        self.shared: dict = {}
        self._lock = threading.Lock()
        # the storage of every stub base a site has handed out -> the site (graph outputs that are
        # stubs are tagged with their site's sequence by the backend)
        self.stub_sites: dict[int, int] = {}
        self.adoption = Adoption()  # layers handed over by backend.adopt(), waiting for their first step
        # stubs dropped while the lock was held (a garbage collection inside a step): released at the
        # next stub() or report
        self._dead: list[tuple[SiteState, int]] = []
        # key: what the graphs depend on (the backend passes policy and options); see registry
        self.handle = registry.register(self, policy.key() if key is None else key)

    def info(self, site: int, layer: int | None = None) -> SiteInfo:
        if site not in self.infos:
            self.infos[site] = SiteInfo(site=site, layer=site if layer is None else layer)
        return self.infos[site]

    def state(self, site: int) -> SiteState:
        st = self.sites.get(site)
        if st is None:
            st = self.sites[site] = self.policy.new_state(self.info(site))
            st.probe = self.probe
            st.shared = self.shared
            st.owner = weakref.ref(self)
        return st

    def stub_died(self, st: SiteState, epoch: int) -> None:
        """The last stub of ``st``'s sequence ``epoch`` was garbage-collected (the weak references'
        callback, in whatever thread dropped it; see :meth:`SiteState.hold`)."""
        if not self._lock.acquire(blocking=False):  # this thread (or another) is inside a step
            self._dead.append((st, epoch))
            return
        try:
            self._reap(st, epoch)
            self._drain()
        finally:
            self._lock.release()

    def _reap(self, st: SiteState, epoch: int) -> None:
        if self.sites.get(st.info.site) is not st or st.epoch != epoch or st._live:
            return  # a sequence this site no longer holds (a new one started, set_policy), or held again
        st.release()
        if not any(s.length or s._live for s in self.sites.values()):
            self.shared.clear()  # scratch and per-sequence decisions of every site (the workspace)

    def _drain(self) -> None:
        """Release what :meth:`stub_died` could not while the lock was held; the caller holds it."""
        while self._dead:
            self._reap(*self._dead.pop())

    def collect(self) -> None:
        """Apply releases deferred by a garbage collection that ran inside a step."""
        if self._dead:
            with self._lock:
                self._drain()

    def held_bytes(self) -> int:
        """Bytes of every tensor this runtime's state references now (keys and values of both tiers,
        metadata, scratch, stub bases), each storage counted once: what the backend holds in memory."""
        self.collect()
        with self._lock:
            return tensor_bytes(self.sites, self.shared, self.adoption)

    def set_probe(self, probe) -> None:
        """``probe(state, call, idx)`` runs at every decode step before attention (None: off)."""
        with self._lock:
            self.probe = probe
            for st in self.sites.values():
                st.probe = probe

    def attend(
        self,
        site: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        scale: float,
        is_causal: bool,
    ) -> torch.Tensor:
        length = k.shape[2]
        if cache_position is not None:
            # A static cache is a preallocated buffer: the logical end is the last written slot.
            length = min(length, int(cache_position[-1].item()) + 1)
        call = make_call(q, k, v, attn_mask, scale, is_causal, length)
        with self._lock:
            return self.state(site).run(call, static=cache_position is not None)

    def attend_owned(
        self,
        site: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        scale: float,
        is_causal: bool,
        fetched: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like :meth:`attend`, for a site whose keys and values the runtime holds (the model's
        cache holds a stub): append ``k_new, v_new`` (B, H_kv, T, D) and attend."""
        with self._lock:
            if self.adoption.held and past_k is not None:  # the first step after backend.adopt()
                past_k, past_v = self.adoption.take(past_k, past_v)
            return self.state(site).run_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)

    def stub(self, site: int, new: torch.Tensor, length: int, past: torch.Tensor | None) -> torch.Tensor:
        """The ``kvpass::cache_stub`` op: the site's stub of ``length`` tokens shaped like ``new``."""
        with self._lock:
            if self._dead:
                self._drain()
            stubs = self.state(site).stubs
            stub = stubs.make(new, length, past)
            if stubs.new_bases:  # bases are made once per shape: a steady step registers nothing
                for base in stubs.new_bases:
                    self.stub_sites[base.untyped_storage().data_ptr()] = site
                stubs.new_bases.clear()
        if past is None or new.shape[2] > 1:
            # The next step decodes from this stub: its length is dynamic from that first decode on, so
            # dynamo compiles one decode graph for every length instead of one for the prompt's length
            # and another when it grows. Steady decode steps skip this (their graph is symbolic already).
            torch._dynamo.maybe_mark_dynamic(stub, 2)
        return stub

    def fetch(self, site: int, q: torch.Tensor, past_k: torch.Tensor | None) -> torch.Tensor:
        """The ``kvpass::fetch`` op: the site moves what this step needs into its device tier."""
        with self._lock:
            return self.state(site).run_fetch(q, past_k)

    def prefetch(self, site: int, q_hat: torch.Tensor, past_k: torch.Tensor | None, estimated: bool) -> torch.Tensor:
        """The ``kvpass::prefetch`` op: the site prepares its next fetch from an estimated query."""
        with self._lock:
            return self.state(site).run_prefetch(q_hat, past_k, estimated)

    def reset(self) -> None:
        """Forget every site's sequence and free what it held (``backend.clear_state()``)."""
        with self._lock:
            self._dead.clear()
            self.adoption.clear()
            self.shared.clear()
            for st in self.sites.values():
                st.release(keep_row=False)

    def set_policy(self, policy: Policy) -> None:
        """Every site starts afresh under ``policy`` (the graphs are unchanged)."""
        with self._lock:
            self.policy = policy
            self.adoption.clear()
            self.sites.clear()
            self.shared.clear()


def tensor_bytes(*roots: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``roots`` through containers and
    kvpass's own objects (their attributes); policies, site infos and callables are not entered."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("kvpass.") and not isinstance(obj, SiteInfo) \
                and not hasattr(obj, "new_state"):  # a policy: configuration only
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                stack.extend(v for k, v in attrs.items() if k not in ("owner", "policy", "info", "probe"))
            for name in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, name, None))
    return sum(storages.values())

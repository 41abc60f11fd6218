"""``backend.adopt(cache)``: a filled ``DynamicCache`` handed to the runtime before the first decode step.

A cache filled outside the backend (a prefix cache read back, a prefill run eagerly or in another
process) is otherwise adopted by the first decode step: each site reads the real keys, copies them into
its store and hands the model's cache a stub. That step's graph takes real tensors where every later
step takes stubs, so dynamo compiles it apart: two decode graphs per backend, each about a minute on this
CPU for SmolLM2. :func:`adopt_cache` moves the keys to the runtime first and leaves stubs in the cache,
so the first step already runs the steady graph.

Each stub left in the cache views a base of its own and is tagged ``(ADOPTED, runtime, layer)``; the
site whose attention gets one as its past takes the keys behind it (:meth:`Adoption.take`). Right or
loud: a graph given an adopted stub that no site took (a layer the pass left exact would read the stub
as keys) raises after the step (:class:`~kvpass.runtime.guard.GuardedGraph`), as does a stub used twice,
by another backend or after ``clear_state()``; an eager op on one raises like any stub's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpass.runtime.errors import KVPassError
from kvpass.runtime.store import CacheStub, _row_base, as_cache_stub

ADOPTED = "adopted"  # the first field of an adopted stub's tag


@dataclass
class _Held:
    """One layer's keys and values (B, H_kv, L, D), with the bases its two stubs view (kept alive, so
    that no other tensor takes their storage while the entry waits)."""

    keys: torch.Tensor
    values: torch.Tensor
    layer: int
    key_base: torch.Tensor
    value_base: torch.Tensor


class Adoption:
    """The adopted layers of one runtime waiting for their first step, by the storage of their key stub."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}
        self.value_ptrs: dict[int, int] = {}  # storage of a value stub -> that of its key stub

    def __bool__(self) -> bool:
        return bool(self.held)

    def clear(self) -> None:
        self.held.clear()
        self.value_ptrs.clear()

    def waiting(self, stub: torch.Tensor) -> bool:
        """Whether ``stub`` (an adopted stub given to a graph) still waits for its site."""
        ptr = stub.untyped_storage().data_ptr()
        return ptr in self.held or ptr in self.value_ptrs

    def take(self, past_k: torch.Tensor, past_v: torch.Tensor | None):
        """The real ``(past_k, past_v)`` behind an adopted stub pair, or the pair itself when it is not
        one. A crop of the stub (a shorter view of it) takes that many tokens."""
        held = self.held.pop(past_k.untyped_storage().data_ptr(), None)
        if held is None:
            return past_k, past_v
        self.value_ptrs.pop(held.value_base.untyped_storage().data_ptr(), None)
        length = past_k.shape[2]
        if (past_v is None or past_v.untyped_storage().data_ptr() != held.value_base.untyped_storage().data_ptr()
                or past_k.shape[0] != held.keys.shape[0] or length > held.keys.shape[2]):
            raise KVPassError(
                f"kvpass: the adopted cache of layer {held.layer} reached an attention site changed since "
                "backend.adopt(): its keys and values come from different layers, or its rows or length "
                "no longer match what was adopted. Fix: call backend.adopt(cache) right before generate(), "
                "after any change to the cache")
        return held.keys[:, :, :length], held.values[:, :, :length]


def _stub_view(base: torch.Tensor, length: int) -> torch.Tensor:
    """A stub of ``length`` tokens over ``base`` (B, H, D), laid out as the stubs a compiled step returns:
    a view whose ``_base`` is itself (B, H, L, D) with sequence stride 0. Dynamo guards on the base's
    strides, so a plain view of ``base`` would make the second step compile a graph of its own."""
    b, h, d = base.shape
    whole = base.new_empty(0).set_(base.untyped_storage(), 0, (b, h, length, d), (h * d, d, 0, 1))
    return whole.as_strided(whole.shape, whole.stride())


def adopt_cache(adoption: Adoption, runtime, cache) -> None:
    """Move every layer of ``cache`` (a filled ``DynamicCache``) into ``adoption`` and put tagged stubs
    in its place. Replaces what an earlier ``adopt`` left waiting."""
    from transformers import DynamicCache

    layers = getattr(cache, "layers", None)
    if layers is None or not isinstance(cache, DynamicCache):
        raise KVPassError(
            f"kvpass: backend.adopt() takes a transformers DynamicCache, got {type(cache).__name__}. A static "
            "or quantised cache is read in place by every step and needs no adoption. Fix: pass the "
            "DynamicCache that the prefill filled, or generate from the cache without adopt()")
    found = []
    for i, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if getattr(layer, "is_sliding", False):
            raise KVPassError(
                f"kvpass: layer {i} of the cache is a sliding-window layer, which kvpass leaves with the "
                "model. Fix: generate from the cache without backend.adopt()")
        if type(keys) is CacheStub or type(values) is CacheStub:
            raise KVPassError(
                f"kvpass: layer {i} of the cache passed to backend.adopt() is held by a kvpass backend "
                "already. Fix: adopt a cache of real keys (a prefill's), once")
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[2] == 0:
            raise KVPassError(
                f"kvpass: layer {i} of the cache passed to backend.adopt() holds no keys. Fix: prefill the "
                "cache first, or generate from the prompt without adopt()")
        found.append((keys, values))
    adoption.clear()
    for i, (keys, values) in enumerate(found):
        b, h, length, d = keys.shape
        kb = _row_base(b, h, d, keys.dtype, keys.device)
        vb = _row_base(b, values.shape[1], values.shape[3], values.dtype, values.device)
        held = _Held(keys, values, i, kb, vb)
        adoption.held[kb.untyped_storage().data_ptr()] = held
        adoption.value_ptrs[vb.untyped_storage().data_ptr()] = kb.untyped_storage().data_ptr()
        stubs = []
        for base in (kb, vb):
            stub = as_cache_stub(_stub_view(base, length), (ADOPTED, runtime, i))
            torch._dynamo.maybe_mark_dynamic(stub, 2)  # the steady graph: symbolic length, as its own stubs
            stubs.append(stub)
        layers[i].keys, layers[i].values = stubs

"""The ``kvpass::`` custom ops (torch.library): schema, fake implementation, device dispatch.

Registered when this module is first imported, which :func:`kvpass.kvpass` does lazily.

The ops are defined on a ``torch.library.Library`` with one CompositeExplicitAutograd kernel each (the
Python function, for every device), not with ``torch.library.custom_op``: a decode step calls 3-5 of
them at each of the 30 sites of a small model, and custom_op adds Python dispatch to every call (its
autograd wrapper and aliasing check) that costs about twice the Library op's whole call on this
project's CPUs (vLLM's ``direct_register_custom_op`` registers its ops this way for the same reason).
The ops are for inference: none has a derivative."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from kvpass.runtime import registry
from kvpass.runtime.store import make_stub

_LIB = torch.library.Library("kvpass", "DEF")  # the ops live as long as this module
IMPLS: dict[str, Callable] = {}  # "kvpass::name" -> the Python function (what bench.syncs runs under its log)


def _op(fn: Callable) -> Callable:
    """Define ``kvpass::<fn.__name__>`` from ``fn``'s annotations (it mutates none of its arguments).

    Every op is tagged ``cudagraph_unsafe``: it runs the runtime's Python (positions and counters in
    Python ints), which a CUDA graph's replay would skip, replaying the step it captured. Under
    ``mode="reduce-overhead"`` Inductor's graph partition therefore runs the ops between captured
    graphs (docs/design.md, "CUDA graphs: captured between the sites")."""
    name = fn.__name__
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.cudagraph_unsafe,))
    _LIB.impl(name, fn, "CompositeExplicitAutograd")
    IMPLS["kvpass::" + name] = fn
    return fn


def _fake(name: str) -> Callable:
    """Register the decorated function as ``kvpass::<name>``'s fake (meta) implementation."""

    def register(fn: Callable) -> Callable:
        _LIB._register_fake(name, fn)
        return fn

    return register


@_op
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    cache_position: Tensor | None,
    scale: float,
    is_causal: bool,
    handle: int,
    site: int,
) -> Tensor:
    """Attention of one site under the policy of the backend ``handle``.

    q: (B, H_q, T, D); k, v: (B, H_kv, S, D) the model's cache after this step's update (before
    repeat_kv); attn_mask: the SDPA mask, broadcastable to (B, H_q, T, S), or None; cache_position:
    the static-cache write positions (T,) or None for a cache that grows; scale <= 0 means 1/sqrt(D).
    Returns (B, H_q, T, D), contiguous. The site's state (metadata, selections) lives in the runtime,
    which is why the op mutates none of its tensor arguments.
    """
    out = registry.lookup(handle).attend(site, q, k, v, attn_mask, cache_position, scale, is_causal)
    return out.contiguous()


@_fake("attention")
def _attention_fake(q, k, v, attn_mask, cache_position, scale, is_causal, handle, site):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_op
def attention_owned(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    past_k: Tensor | None,
    past_v: Tensor | None,
    attn_mask: Tensor | None,
    scale: float,
    is_causal: bool,
    handle: int,
    site: int,
    fetched: Tensor | None = None,
) -> Tensor:
    """Attention of a site whose KV cache the runtime owns.

    q: (B, H_q, T, D); k_new, v_new: (B, H_kv, T, D) this step's keys and values; past_k, past_v:
    what the model's cache held before this step (the stub :func:`cache_stub` returned last step,
    or None at prefill). The runtime appends the new tokens to its own buffers in place.
    fetched: the ticket of this step's :func:`fetch` (policies with a host tier), which orders the
    fetch before this op. Returns (B, H_q, T, D), contiguous.
    """
    rt = registry.lookup(handle)
    out = rt.attend_owned(site, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal, fetched)
    return out.contiguous()


@_fake("attention_owned")
def _attention_owned_fake(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal, handle, site,
                          fetched=None):
    return q.new_empty((*q.shape[:-1], v_new.shape[-1]))


@_op
def fetch(q: Tensor, past_k: Tensor | None, handle: int, site: int, after: Tensor | None = None) -> Tensor:
    """Bring what this decode step will attend from the host tier to the device tier.

    q: (B, H_q, T, D) the step's queries (the selection depends on them); past_k: the model's cache
    before this step (its length is the sequence's). Returns a ticket, an int64 tensor of shape (1,)
    holding the step number, that :func:`attention_owned` takes as ``fetched``: the data dependency
    makes Inductor issue the fetch before the attention that needs it. On CUDA the copies would run
    on a side stream with an event the attention waits on; on CPU they are copies between the tiers.
    after: the ticket of this site's :func:`prefetch` (TailorKV), which orders the prefetch first.
    """
    return registry.lookup(handle).fetch(site, q, past_k)


@_fake("fetch")
def _fetch_fake(q, past_k, handle, site, after=None):
    return q.new_empty((1,), dtype=torch.int64)


@_op
def prefetch(q_hat: Tensor, past_k: Tensor | None, handle: int, site: int, estimated: bool) -> Tensor:
    """Prefetch what a site's next decode step will score with, from an estimate of its query.

    q_hat: (B, H_q, T, D) the site's query as estimated one layer early (TailorKV: the previous
    layer's residual stream through this layer's norm, q projection and RoPE, copied into the graph
    by the pass), or the site's true query when no estimate could be built (``estimated=False``);
    past_k: the site's cache before this step (its length). Returns a ticket (1,) int64 for this
    site's :func:`fetch`, so that Inductor issues the prefetch first.
    """
    return registry.lookup(handle).prefetch(site, q_hat, past_k, estimated)


@_fake("prefetch")
def _prefetch_fake(q_hat, past_k, handle, site, estimated):
    return q_hat.new_empty((1,), dtype=torch.int64)


@_op
def cache_stub(new: Tensor, past: Tensor | None, handle: int = 0, site: int = -1) -> Tensor:
    """What the model's cache keeps for a runtime-owned site: (B, H, L, D) with sequence stride 0,
    L = past length + new length, so the model sees the true length while holding no tokens.

    handle, site: the site whose stub this is; the site views every stub of one shape from one base,
    so that its next step knows its own stub by the storage alone (no read, no host sync). With the
    defaults the stub has a fresh base."""

    length = new.shape[2] + (past.shape[2] if past is not None else 0)
    if handle:
        return registry.lookup(handle).stub(site, new, length, past)
    return make_stub(new, length)


@_fake("cache_stub")
def _cache_stub_fake(new, past, handle=0, site=-1):
    b, h, t, d = new.shape
    length = t + (past.shape[2] if past is not None else 0)
    return new.new_empty((b, h, 1, d)).as_strided((b, h, length, d), (h * d, d, 0, 1))

"""The ``kvpass::`` custom ops (torch.library): schema, fake implementation, device dispatch.

Registered when this module is first imported, which :func:`kvpass.kvpass` does lazily."""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.runtime import registry


@torch.library.custom_op("kvpass::attention", mutates_args=())
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


@attention.register_fake
def _attention_fake(q, k, v, attn_mask, cache_position, scale, is_causal, handle, site):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4)
    return q.new_empty((*q.shape[:-1], v.shape[-1]))

"""Device dispatch for the kernels: Triton on CUDA (or under ``TRITON_INTERPRET=1`` in tests), the torch
reference elsewhere. The references are the CPU implementation, not a fallback of lesser quality."""

from __future__ import annotations

import torch

from kvpass.kernels import quest, sparse_attention as sa


def _use_triton(t: torch.Tensor) -> bool:
    # On CPU the interpreter is orders of magnitude slower than the reference, so the interpreted
    # kernels run only in the kernel tests, never in a model.
    return t.is_cuda


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """(B, H_q, D) attention over ``idx`` (B, H_kv, N) positions of ``k, v`` (B, H_kv, S, D)."""
    if _use_triton(q):
        return sa.sparse_decode_attention(q, k, v, idx=idx, bias=bias, scale=scale)
    return sa.sparse_decode_attention_ref(q, k, v, idx=idx, bias=bias, scale=scale)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: int) -> torch.Tensor:
    """(B, H_q, P) Quest page upper bounds; pages >= num_pages score -inf."""
    if _use_triton(q):
        return quest.quest_page_scores(q, kmin, kmax, num_pages=num_pages)
    return quest.quest_page_scores_ref(q, kmin, kmax, num_pages=num_pages)

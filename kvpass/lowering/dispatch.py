"""Device dispatch for the kernels: Triton on CUDA (or under ``TRITON_INTERPRET=1`` in tests), the torch
reference elsewhere. The references are the CPU implementation, not a fallback of lesser quality."""

from __future__ import annotations

import torch

from kvpass.kernels import centroid, clusterkv, quest, sparse_attention as sa, tailorkv


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
    workspace=None,
    dense: bool | None = None,
) -> torch.Tensor:
    """(B, H_q, D) attention over ``idx`` (B, H_kv, N) positions of ``k, v`` (B, H_kv, S, D); ``workspace``:
    the CPU path's scratch (see :func:`kvpass.kernels.sparse_attention.sparse_decode_attention_ref`)."""
    if _use_triton(q):
        return sa.sparse_decode_attention(q, k, v, idx=idx, bias=bias, scale=scale)
    return sa.sparse_decode_attention_ref(q, k, v, idx=idx, bias=bias, scale=scale, workspace=workspace,
                                          dense=dense)


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: int) -> torch.Tensor:
    """(B, H_q, P) Quest page upper bounds; pages >= num_pages score -inf."""
    if _use_triton(q):
        return quest.quest_page_scores(q, kmin, kmax, num_pages=num_pages)
    return quest.quest_page_scores_ref(q, kmin, kmax, num_pages=num_pages)


def cosine_kmeans(keys: torch.Tensor, num_clusters: int, max_iters: int, seed: int):
    """ClusterKV's cosine k-means of ``keys (B, H_kv, N, D)``: see :mod:`kvpass.kernels.clusterkv`."""

    return clusterkv.cosine_kmeans(keys, num_clusters, max_iters=max_iters, seed=seed,
                                   use_triton=_use_triton(keys))


def select_clusters(scores, sizes, offsets, order, budget: int) -> torch.Tensor:
    """(B, H_kv, budget) token positions of the best whole clusters (the last one trimmed)."""

    if _use_triton(scores):
        return clusterkv.select_clusters(scores, sizes, offsets, order, budget)
    if scores.device.type == "cpu" and clusterkv.select_clusters_cpu_available():
        return clusterkv.select_clusters_cpu(scores, sizes, offsets, order, budget)
    return clusterkv.select_clusters_ref(scores, sizes, offsets, order, budget)


def chunk_match(k: torch.Tensor, lo: int, hi: int, chunk: int):
    """CentroidKV's chunked soft matching: ``(a_pos, b_pos, sim)`` (see :mod:`kvpass.kernels.centroid`)."""

    if _use_triton(k):
        return centroid.chunk_match(k, lo, hi, chunk)
    return centroid.chunk_match_ref(k, lo, hi, chunk)


def centroid_attention(q, k, v, deg, scale: float, bias=None) -> torch.Tensor:
    """(B, H_q, Dv) decode attention with the log-degree bias (degree 0: the slot is ignored); ``bias``:
    that bias when the caller keeps it."""

    return centroid.centroid_decode_attention(q, k, v, deg, scale=scale, use_triton=_use_triton(q), bias=bias)


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str):
    """TailorKV's asymmetric quantise-and-pack of ``x (B, H, S, D)`` (a :class:`QuantizedKV`)."""

    if _use_triton(x):
        return tailorkv.quantize_pack(x, bits, group_size, axis)
    return tailorkv.quantize_pack_ref(x, bits, group_size, axis)


def quant_attention(q, kq, vq, k_res, v_res, scale: float) -> torch.Tensor:
    """(B, H_q, D) decode attention over a packed cache plus a full-precision residual."""

    if _use_triton(q):
        return tailorkv.quant_decode_attention(q, kq, vq, k_res, v_res, scale=scale)
    if tailorkv.quant_attention_cpu_supports(q, kq, vq, k_res, v_res):
        return tailorkv.quant_decode_attention_cpu(q, kq, vq, k_res, v_res, scale=scale)
    return tailorkv.quant_decode_attention_ref(q, kq, vq, k_res, v_res, scale=scale)


def partial_topk(q, k_ch, ch, k: int, length: int):
    """TailorKV's approximate top-k from the critical channels: ``(idx (B, H_kv, k), approx)``."""

    if _use_triton(q):
        return tailorkv.partial_topk(q, k_ch, ch, k, length)
    return tailorkv.partial_topk_ref(q, k_ch, ch, k, length)

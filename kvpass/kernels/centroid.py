"""CentroidKV: merge similar cached tokens into degree-weighted centroids (the KV cache physically
shrinks) and attend with a ``log(degree)`` bias.

Paper: "Efficient Long-Context LLM Inference via KV Cache Clustering", first published as Chelsea
(arXiv 2506.11418), later renamed CentroidKV. No public code exists; this file is the reference.

One merge round (Algorithm 1, "Chunked Soft Matching") on a cache of S live slots per head, with
degrees N (tokens each slot stands for, 1 after prefill):

1. Keep the ``sinks`` first and ``recent`` last slots; the candidates are ``[sinks, S - recent)``.
2. Cut the candidates into chunks of ``chunk`` slots. Inside a chunk, slots at even offsets form set
   A and slots at odd offsets set B (the alternating partition, optimal when key similarity decays
   convexly with distance, Theorem 6.1). Every A slot picks its most cosine-similar B slot of the same
   chunk (:func:`chunk_match`).
3. The ``floor(ratio * NA)`` most similar pairs merge (:func:`select_pairs`): each B slot receiving
   merges becomes the degree-weighted mean of itself and its A slots, its degree the sum
   (:func:`merge_scatter`); the merged A slots are removed. A round removes at most the A slots, about
   half of the candidates.

Decode attention over the merged cache (:func:`centroid_decode_attention`)::

    out = softmax(scale * q @ K^T + log N) @ V

which is exact when every merged group held identical (key, value) tokens, and equals plain attention
when all degrees are 1 (the same kernel serves ``Full``). Degree 0 marks an empty padding slot
(``log 0 = -inf``), so heads of different lengths can share one padded ``(B, H_kv, S, D)`` layout.

Shapes: keys and values ``(B, H, S, D)`` with any strides; degrees ``(B, H, S)`` fp32; match results
``(B, H, NA)`` where NA (the number of candidate A slots) depends only on the candidate range and
the chunk size, so every head has the same NA and, as a merge round removes the same number of slots
from every head, the same S after merging.

Contents: ``_chunk_match_kernel`` / :func:`chunk_match` / :func:`chunk_match_ref`;
``_merge_accumulate_kernel`` + ``_merge_compact_kernel`` / :func:`merge_scatter` /
:func:`merge_scatter_ref`; :func:`select_pairs` (plain torch on any device); :func:`merge_round`
(one round of Algorithm 1); :func:`centroid_decode_attention` (the ``log N`` bias over the existing
:mod:`kvpass.kernels.sparse_attention` kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._triton import require_triton, tl, triton, triton_available
from .sparse_attention import sparse_decode_attention, sparse_decode_attention_ref

__all__ = [
    "MergeResult",
    "centroid_decode_attention",
    "chunk_match",
    "chunk_match_ref",
    "merge_round",
    "merge_scatter",
    "merge_scatter_ref",
    "num_candidates",
    "select_pairs",
]

_EPS = 1e-6  # norm floor of the cosine similarity: zero keys have similarity 0 with everything
_MAX_CHUNK = 512
_MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_need_triton = require_triton


# --------------------------------------------------------------------------------------------------
# 1. Chunked soft matching
# --------------------------------------------------------------------------------------------------


def num_candidates(lo: int, hi: int, chunk: int) -> int:
    """NA, the number of candidate A slots of ``[lo, hi)`` cut into chunks of ``chunk``.

    Every chunk of length L contributes its ``ceil(L / 2)`` even offsets, except a last chunk of
    length 1 (an A slot with no B slot to merge into). At most ``ceil((hi - lo) / 2)``.
    """
    n = max(0, hi - lo)
    full, last = divmod(n, chunk)
    return full * ((chunk + 1) // 2) + ((last + 1) // 2 if last >= 2 else 0)


def _check_match_inputs(k, lo, hi, chunk, who: str) -> None:
    if k.dim() != 4:
        raise ValueError(f"kvpass: {who} needs k of shape (B, H, S, D), got {tuple(k.shape)}")
    if k.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kvpass: {who} needs float16/bfloat16/float32 keys, got {k.dtype}")
    S = k.shape[2]
    if not 0 <= lo <= hi <= S:
        raise ValueError(f"kvpass: {who} needs 0 <= lo <= hi <= S={S}, got lo={lo}, hi={hi}")
    if chunk < 2:
        raise ValueError(f"kvpass: {who} needs chunk >= 2 (one A and one B slot), got chunk={chunk}")


def _empty_match(k: torch.Tensor, na: int):
    shape = (k.shape[0], k.shape[1], na)
    pos = torch.empty(shape, dtype=torch.int64, device=k.device)
    return pos, pos.clone(), torch.empty(shape, dtype=torch.float32, device=k.device)


@triton.jit
def _chunk_match_kernel(
    K, A_POS, B_POS, SIM,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_ob, stride_oh, stride_on,
    H, LO, HI, D, CHUNK, HALF,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * H, chunks with at least one B slot). One program matches one chunk of one head: all
    # its A slots (even offsets) stay in one block, the B slots (odd offsets) stream in blocks of
    # BLOCK_B and D in steps of BLOCK_D, with a running (best similarity, first argmax) per A slot.
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    start = LO + pid_c * CHUNK
    end = tl.minimum(start + CHUNK, HI)
    n_b = (end - start) // 2  # B slots of this chunk (>= 1: the launcher skips a 1-slot last chunk)

    offs_a = tl.arange(0, BLOCK_A)
    pos_a = start + 2 * offs_a
    valid_a = pos_a < end
    k_base = K + b * stride_kb + h * stride_kh
    a_rows = k_base + pos_a.to(tl.int64)[:, None] * stride_ks

    best = tl.full([BLOCK_A], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_A], tl.int32)
    for b0 in range(0, n_b, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        valid_b = offs_b < n_b
        b_rows = k_base + (start + 2 * offs_b + 1).to(tl.int64)[:, None] * stride_ks
        dot = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
        sq_a = tl.zeros([BLOCK_A], tl.float32)
        sq_b = tl.zeros([BLOCK_B], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            ka = tl.load(
                a_rows + offs_d[None, :] * stride_kd, mask=valid_a[:, None] & mask_d[None, :], other=0.0
            ).to(tl.float32)
            kb = tl.load(
                b_rows + offs_d[None, :] * stride_kd, mask=valid_b[:, None] & mask_d[None, :], other=0.0
            ).to(tl.float32)
            dot += tl.dot(ka, tl.trans(kb), input_precision="ieee")  # exact fp32 products, no tf32
            sq_a += tl.sum(ka * ka, axis=1)
            sq_b += tl.sum(kb * kb, axis=1)
        norm_a = tl.maximum(tl.sqrt(sq_a), 1e-6)
        norm_b = tl.maximum(tl.sqrt(sq_b), 1e-6)
        sim = dot / (norm_a[:, None] * norm_b[None, :])
        sim = tl.where(valid_b[None, :], sim, float("-inf"))
        blk_best = tl.max(sim, axis=1)
        blk_arg = tl.argmax(sim, axis=1, tie_break_left=True).to(tl.int32)
        better = blk_best > best  # strict: a tie with an earlier block keeps the lower position
        best = tl.where(better, blk_best, best)
        arg = tl.where(better, blk_arg + b0, arg)

    out = b * stride_ob + h * stride_oh + (pid_c * HALF + offs_a).to(tl.int64) * stride_on
    tl.store(A_POS + out, pos_a.to(tl.int64), mask=valid_a)
    tl.store(B_POS + out, (start + 2 * arg + 1).to(tl.int64), mask=valid_a)
    tl.store(SIM + out, best, mask=valid_a)


def chunk_match(
    k: torch.Tensor, lo: int, hi: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton chunked soft matching: every candidate A slot's most cosine-similar B slot.

    Args:
        k: ``(B, H, S, D)`` keys, float16/bfloat16/float32, any strides. Only ``[lo, hi)`` is read.
        lo, hi: the candidate range ``0 <= lo <= hi <= S`` (sinks and recent slots excluded).
        chunk: chunk length, ``2 <= chunk <= 512``; chunks start at ``lo``, the last may be shorter.
            Slots at even offsets from their chunk's start form set A, odd offsets set B.

    Returns:
        ``(a_pos, b_pos, sim)``, each ``(B, H, NA)`` with ``NA = num_candidates(lo, hi, chunk)``:
        ``a_pos`` int64, the A slots in ascending position (the same for every head); ``b_pos`` int64,
        the absolute position of the most similar B slot of the same chunk (ties: the lowest
        position); ``sim`` fp32 cosine similarity, norms floored at 1e-6 (zero keys give 0, not NaN).
        A 1-slot last chunk has no B slot, so its A slot is not a candidate.
    """
    who = "chunk_match"
    _check_match_inputs(k, lo, hi, chunk, who)
    if chunk > _MAX_CHUNK or k.shape[3] > _MAX_HEAD_DIM:
        raise ValueError(
            f"kvpass: {who} needs chunk <= {_MAX_CHUNK} and head dim D <= {_MAX_HEAD_DIM} (a chunk's A "
            f"slots are one block), got chunk={chunk}, D={k.shape[3]}; use chunk_match_ref"
        )
    _need_triton(k, who, "chunk_match_ref")
    B, H, S, D = k.shape
    NA = num_candidates(lo, hi, chunk)
    if NA == 0 or B * H == 0:
        return _empty_match(k, NA)
    half = (chunk + 1) // 2
    n_chunks = -(-NA // half)  # chunks that own candidates (a 1-slot last chunk owns none)
    a_pos = torch.empty((B, H, NA), dtype=torch.int64, device=k.device)
    b_pos = torch.empty_like(a_pos)
    sim = torch.empty((B, H, NA), dtype=torch.float32, device=k.device)
    block_a = max(16, triton.next_power_of_2(half))  # tl.dot needs every dim >= 16
    _chunk_match_kernel[(B * H, n_chunks)](
        k, a_pos, b_pos, sim,
        *k.stride(),
        *a_pos.stride(),
        H, lo, hi, D, chunk, half,
        BLOCK_A=block_a,
        BLOCK_B=min(block_a, 128),
        BLOCK_D=max(16, min(64, triton.next_power_of_2(D))),
        num_warps=8 if block_a >= 128 else 4,  # GPU only: a 256 x 128 similarity tile
    )
    return a_pos, b_pos, sim


def chunk_match_ref(
    k: torch.Tensor, lo: int, hi: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`chunk_match` (fp32), the CPU path; same arguments and results, and no limit
    on chunk or D. All chunks at once: the candidates are zero-padded to whole chunks, viewed as
    ``(B, H, chunks, chunk, D)``, split into even/odd offsets and compared with one batched matmul."""
    who = "chunk_match_ref"
    _check_match_inputs(k, lo, hi, chunk, who)
    B, H, S, D = k.shape
    NA = num_candidates(lo, hi, chunk)
    if NA == 0 or B * H == 0:
        return _empty_match(k, NA)
    n = hi - lo
    C = -(-n // chunk)
    x = torch.zeros((B, H, C * chunk, D), dtype=torch.float32, device=k.device)
    x[:, :, :n] = k[:, :, lo:hi]
    x = x.view(B, H, C, chunk, D)
    xa, xb = x[:, :, :, 0::2], x[:, :, :, 1::2]  # (B, H, C, ceil(chunk/2), D), (B, H, C, chunk//2, D)
    norm_a = torch.linalg.vector_norm(xa, dim=-1).clamp_min(_EPS)
    norm_b = torch.linalg.vector_norm(xb, dim=-1).clamp_min(_EPS)
    sim = torch.matmul(xa, xb.transpose(-1, -2)) / (norm_a[..., :, None] * norm_b[..., None, :])

    dev = k.device
    chunk_start = lo + chunk * torch.arange(C, device=dev)[:, None]  # (C, 1)
    pos_a = chunk_start + 2 * torch.arange((chunk + 1) // 2, device=dev)  # (C, ceil(chunk/2))
    pos_b = chunk_start + 2 * torch.arange(chunk // 2, device=dev) + 1  # (C, chunk//2)
    sim = sim.masked_fill(~(pos_b < hi)[:, None, :], float("-inf"))  # padding B slots never win
    arg = torch.argmax(sim, dim=-1, keepdim=True)  # first maximum: ties go to the lowest position
    best = torch.gather(sim, -1, arg).squeeze(-1)  # (B, H, C, ceil(chunk/2))
    b_abs = chunk_start + 2 * arg.squeeze(-1) + 1  # (B, H, C, ceil(chunk/2))

    keep = (pos_a.reshape(-1) < hi).nonzero().squeeze(1)[:NA]  # drops padding and a 1-slot last chunk
    a_pos = pos_a.reshape(-1)[keep].expand(B, H, NA).contiguous()
    return a_pos, b_abs.reshape(B, H, -1)[:, :, keep], best.reshape(B, H, -1)[:, :, keep]


# --------------------------------------------------------------------------------------------------
# 2. Pair selection
# --------------------------------------------------------------------------------------------------


def select_pairs(sim: torch.Tensor, n_merge: int) -> torch.Tensor:
    """The ``n_merge`` most similar candidate pairs of every head.

    Args:
        sim: ``(B, H, NA)`` similarities from :func:`chunk_match` (NaN-free).
        n_merge: pairs to merge per head, ``0 <= n_merge <= NA``.

    Returns:
        ``take`` ``(B, H, NA)`` bool with exactly ``n_merge`` True per ``(b, h)``: the highest
        similarities, ties broken towards the lower index (= lower A position). Plain torch (a
        stable sort), so it runs on any device; it is a small part of a round.
    """
    if sim.dim() != 3:
        raise ValueError(f"kvpass: select_pairs needs sim of shape (B, H, NA), got {tuple(sim.shape)}")
    NA = sim.shape[2]
    if not 0 <= n_merge <= NA:
        raise ValueError(f"kvpass: select_pairs needs 0 <= n_merge <= NA={NA}, got n_merge={n_merge}")
    take = torch.zeros(sim.shape, dtype=torch.bool, device=sim.device)
    if n_merge == 0:
        return take
    order = torch.sort(sim, dim=-1, descending=True, stable=True).indices[..., :n_merge]
    return take.scatter_(-1, order, True)


# --------------------------------------------------------------------------------------------------
# 3. Weighted merge and compaction
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MergePlan:
    """Index bookkeeping shared by the merge kernels and the reference (all ``(B, H, S)``)."""

    m: int  # slots removed per head
    removed: torch.Tensor  # bool: a taken A slot
    target: torch.Tensor  # bool: a slot receiving at least one merge
    dest: torch.Tensor  # int64: index in the compacted output, -1 for removed slots
    row: torch.Tensor  # int64: rank among the head's targets (scratch row), -1 for other slots
    n_rows: int  # most targets of any head


def _merge_plan(k, v, deg, a_pos, b_pos, take, who: str) -> _MergePlan:
    if k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"kvpass: {who} needs k (B, H, S, D) and v (B, H, S, Dv) sharing (B, H, S), "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"kvpass: {who} needs floating-point k and v, got {k.dtype}, {v.dtype}")
    B, H, S, _ = k.shape
    if tuple(deg.shape) != (B, H, S) or not deg.is_floating_point():
        raise ValueError(
            f"kvpass: {who} needs deg of shape (B={B}, H={H}, S={S}) and a float dtype (float32), "
            f"got {tuple(deg.shape)} {deg.dtype}"
        )
    if a_pos.dim() != 3 or tuple(a_pos.shape[:2]) != (B, H) or a_pos.shape != b_pos.shape or (
        take.shape != a_pos.shape
    ):
        raise ValueError(
            f"kvpass: {who} needs a_pos, b_pos, take of one shape (B={B}, H={H}, NA), "
            f"got {tuple(a_pos.shape)}, {tuple(b_pos.shape)}, {tuple(take.shape)}"
        )
    if a_pos.dtype not in (torch.int32, torch.int64) or b_pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kvpass: {who} needs int32/int64 a_pos and b_pos, got {a_pos.dtype}, {b_pos.dtype}")
    if take.dtype != torch.bool:
        raise ValueError(f"kvpass: {who} needs a bool take mask, got {take.dtype}")
    for t in (v, deg, a_pos, b_pos, take):
        if t.device != k.device:
            raise ValueError(f"kvpass: {who} needs every input on {k.device}, got one on {t.device}")

    a = a_pos.long()
    t = b_pos.long()
    if bool((take & ((a < 0) | (a >= S) | (t < 0) | (t >= S))).any()):
        raise ValueError(f"kvpass: {who} needs taken a_pos and b_pos in [0, S={S})")
    counts = take.sum(-1)  # (B, H)
    m = int(counts[0, 0]) if counts.numel() else 0
    if bool((counts != m).any()):
        raise ValueError(
            f"kvpass: {who} needs the same number of taken pairs in every (b, h) (the output is "
            f"(B, H, S - m, D)), got counts from {int(counts.min())} to {int(counts.max())}"
        )
    hits = take.to(torch.int32)
    a_hits = torch.zeros((B, H, S), dtype=torch.int32, device=k.device)
    a_hits.scatter_add_(2, torch.where(take, a, 0), hits)
    t_hits = torch.zeros((B, H, S), dtype=torch.int32, device=k.device)
    t_hits.scatter_add_(2, torch.where(take, t, 0), hits)
    removed, target = a_hits > 0, t_hits > 0
    if bool((a_hits > 1).any()) or bool((removed & target).any()):
        raise ValueError(
            f"kvpass: {who} needs distinct taken a_pos per head, none of them also a taken b_pos "
            "(a removed slot cannot receive merges)"
        )
    dest = torch.where(removed, -1, torch.cumsum(~removed, dim=2) - 1)
    row = torch.where(target, torch.cumsum(target, dim=2) - 1, -1)
    n_rows = int(target.sum(-1).max()) if target.numel() else 0
    return _MergePlan(m=m, removed=removed, target=target, dest=dest, row=row, n_rows=n_rows)


@triton.jit
def _merge_accumulate_kernel(
    K, V, DEG, A_POS, B_POS, TAKE, ROW, ACC_K, ACC_V, ACC_DEG,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_db, stride_dh, stride_ds,
    stride_ab, stride_ah, stride_an,
    stride_tb, stride_th, stride_tn,
    stride_mb, stride_mh, stride_mn,
    H, S, NA, D, DV, R,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * H, cdiv(NA, BLOCK_N)). Every taken pair (a -> t) adds deg[a], deg[a] * k[a] and
    # deg[a] * v[a] to its target's fp32 scratch row (atomics: several A slots may share a target).
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < NA
    taken = tl.load(TAKE + b * stride_mb + h * stride_mh + offs_n * stride_mn, mask=in_n, other=0) != 0
    a = tl.load(A_POS + b * stride_ab + h * stride_ah + offs_n * stride_an, mask=taken, other=0).to(tl.int64)
    t = tl.load(B_POS + b * stride_tb + h * stride_th + offs_n * stride_tn, mask=taken, other=0).to(tl.int64)
    row = tl.load(ROW + pid_bh.to(tl.int64) * S + t, mask=taken, other=0)  # ROW: contiguous (B, H, S)
    acc_row = pid_bh.to(tl.int64) * R + row  # scratch: contiguous (B, H, R[, D])

    w = tl.load(DEG + b * stride_db + h * stride_dh + a * stride_ds, mask=taken, other=0.0).to(tl.float32)
    tl.atomic_add(ACC_DEG + acc_row, w, mask=taken)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = taken[:, None] & (offs_d < D)[None, :]
        x = tl.load(
            K + b * stride_kb + h * stride_kh + a[:, None] * stride_ks + offs_d[None, :] * stride_kd,
            mask=mask, other=0.0,
        ).to(tl.float32)
        tl.atomic_add(ACC_K + acc_row[:, None] * D + offs_d[None, :], w[:, None] * x, mask=mask)
    for d0 in range(0, DV, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = taken[:, None] & (offs_d < DV)[None, :]
        x = tl.load(
            V + b * stride_vb + h * stride_vh + a[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=mask, other=0.0,
        ).to(tl.float32)
        tl.atomic_add(ACC_V + acc_row[:, None] * DV + offs_d[None, :], w[:, None] * x, mask=mask)


@triton.jit
def _merge_compact_kernel(
    K, V, DEG, DEST, ROW, ACC_K, ACC_V, ACC_DEG, K2, V2, DEG2,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_db, stride_dh, stride_ds,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_eb, stride_eh, stride_es,
    H, S, D, DV, R,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * H, cdiv(S, BLOCK_S)). Every kept slot goes to its compacted index; a target becomes
    # (deg[t] * x[t] + acc) / (deg[t] + acc_deg), computed in fp32 and rounded once to x's dtype;
    # every other kept slot is copied unchanged (bit-identical).
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    in_s = offs_s < S
    plan = pid_bh.to(tl.int64) * S + offs_s  # DEST / ROW: contiguous (B, H, S)
    dest = tl.load(DEST + plan, mask=in_s, other=-1)
    row = tl.load(ROW + plan, mask=in_s, other=-1)
    live = dest >= 0
    is_t = live & (row >= 0)
    dest = tl.where(live, dest, 0)  # never form an out-of-bounds address, even masked
    acc_row = pid_bh.to(tl.int64) * R + tl.where(is_t, row, 0)
    s64 = offs_s.to(tl.int64)

    w = tl.load(DEG + b * stride_db + h * stride_dh + s64 * stride_ds, mask=live, other=0.0)
    w_add = tl.load(ACC_DEG + acc_row, mask=is_t, other=0.0)
    wf = w.to(tl.float32)
    den = wf + w_add
    den_safe = tl.where(den != 0.0, den, 1.0)  # only for non-targets, whose merged value is unused
    tl.store(
        DEG2 + b * stride_eb + h * stride_eh + dest * stride_es,
        tl.where(is_t, den, wf).to(DEG2.dtype.element_ty),
        mask=live,
    )
    k_rows = K + b * stride_kb + h * stride_kh + s64[:, None] * stride_ks
    v_rows = V + b * stride_vb + h * stride_vh + s64[:, None] * stride_vs
    k2_rows = K2 + b * stride_ob + h * stride_oh + dest[:, None] * stride_os
    v2_rows = V2 + b * stride_pb + h * stride_ph + dest[:, None] * stride_ps
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = live[:, None] & (offs_d < D)[None, :]
        x = tl.load(k_rows + offs_d[None, :] * stride_kd, mask=mask, other=0.0)
        acc = tl.load(ACC_K + acc_row[:, None] * D + offs_d[None, :], mask=mask & is_t[:, None], other=0.0)
        merged = (wf[:, None] * x.to(tl.float32) + acc) / den_safe[:, None]
        y = tl.where(is_t[:, None], merged.to(x.dtype), x)
        tl.store(k2_rows + offs_d[None, :] * stride_od, y, mask=mask)
    for d0 in range(0, DV, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = live[:, None] & (offs_d < DV)[None, :]
        x = tl.load(v_rows + offs_d[None, :] * stride_vd, mask=mask, other=0.0)
        acc = tl.load(ACC_V + acc_row[:, None] * DV + offs_d[None, :], mask=mask & is_t[:, None], other=0.0)
        merged = (wf[:, None] * x.to(tl.float32) + acc) / den_safe[:, None]
        y = tl.where(is_t[:, None], merged.to(x.dtype), x)
        tl.store(v2_rows + offs_d[None, :] * stride_pd, y, mask=mask)


def merge_scatter(
    k: torch.Tensor,
    v: torch.Tensor,
    deg: torch.Tensor,
    a_pos: torch.Tensor,
    b_pos: torch.Tensor,
    take: torch.Tensor,
    block_s: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton degree-weighted merge of the taken pairs, then removal of the merged A slots.

    Args:
        k: ``(B, H, S, D)``, v: ``(B, H, S, Dv)``, any float dtype and strides.
        deg: ``(B, H, S)`` float (fp32) degrees, >= 1 for live slots.
        a_pos, b_pos: ``(B, H, NA)`` int32/int64 positions: pair i merges slot ``a_pos[..., i]`` into
            slot ``b_pos[..., i]`` when ``take[..., i]``. Several A slots may share a target; taken
            A slots must be distinct and never a taken target.
        take: ``(B, H, NA)`` bool, the same number m of True in every ``(b, h)``.
        block_s: slots per program of the compaction (a power of two >= 16).

    Returns:
        ``(k2, v2, deg2)``: ``(B, H, S - m, D)``, ``(B, H, S - m, Dv)`` in k's/v's dtype and
        ``(B, H, S - m)`` fp32. A target t becomes ``(deg[t] k[t] + sum_a deg[a] k[a]) / (deg[t] +
        sum_a deg[a])`` (same for v, fp32 accumulation, one rounding), ``deg2[t] = deg[t] + sum_a
        deg[a]``; taken A slots are removed and the rest keep their order; untouched slots are
        bit-identical. The sums use fp32 atomics, so their order (and the last bit) may vary.
    """
    who = "merge_scatter"
    plan = _merge_plan(k, v, deg, a_pos, b_pos, take, who)
    _need_triton(k, who, "merge_scatter_ref")
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"kvpass: {who} needs block_s to be a power of two >= 16, got {block_s}")
    B, H, S, D = k.shape
    Dv = v.shape[3]
    NA = a_pos.shape[2]
    dev = k.device
    k2 = torch.empty((B, H, S - plan.m, D), dtype=k.dtype, device=dev)
    v2 = torch.empty((B, H, S - plan.m, Dv), dtype=v.dtype, device=dev)
    deg2 = torch.empty((B, H, S - plan.m), dtype=torch.float32, device=dev)
    if B * H == 0 or S == 0:
        return k2, v2, deg2
    R = max(plan.n_rows, 1)
    acc_k = torch.zeros((B, H, R, D), dtype=torch.float32, device=dev)
    acc_v = torch.zeros((B, H, R, Dv), dtype=torch.float32, device=dev)
    acc_deg = torch.zeros((B, H, R), dtype=torch.float32, device=dev)
    block_d = max(16, min(128, triton.next_power_of_2(max(D, Dv))))
    if plan.m > 0:
        block_n = max(16, min(128, triton.next_power_of_2(NA)))
        take_u8 = take.view(torch.uint8)  # same strides; bool pointers are avoided on purpose
        _merge_accumulate_kernel[(B * H, triton.cdiv(NA, block_n))](
            k, v, deg, a_pos, b_pos, take_u8, plan.row, acc_k, acc_v, acc_deg,
            *k.stride(), *v.stride(), *deg.stride(),
            *a_pos.stride(), *b_pos.stride(), *take_u8.stride(),
            H, S, NA, D, Dv, R,
            BLOCK_N=block_n, BLOCK_D=block_d,
        )
    _merge_compact_kernel[(B * H, triton.cdiv(S, block_s))](
        k, v, deg, plan.dest, plan.row, acc_k, acc_v, acc_deg, k2, v2, deg2,
        *k.stride(), *v.stride(), *deg.stride(), *k2.stride(), *v2.stride(), *deg2.stride(),
        H, S, D, Dv, R,
        BLOCK_S=block_s, BLOCK_D=block_d,
    )
    return k2, v2, deg2


def merge_scatter_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    deg: torch.Tensor,
    a_pos: torch.Tensor,
    b_pos: torch.Tensor,
    take: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`merge_scatter` (fp32 accumulation), the CPU path; same arguments (no
    ``block_s``) and results. ``scatter_add`` of the weighted A rows onto their targets, one division,
    then a boolean-mask compaction (valid because every head removes the same number of slots)."""
    plan = _merge_plan(k, v, deg, a_pos, b_pos, take, "merge_scatter_ref")
    B, H, S, D = k.shape
    w = deg.float()
    a = torch.where(take, a_pos.long(), 0)
    t = torch.where(take, b_pos.long(), 0)
    wa = torch.gather(w, 2, a) * take  # untaken pairs add 0 (to slot 0)
    den = w.scatter_add(2, t, wa)

    def merge(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xa = torch.gather(xf, 2, a[..., None].expand(-1, -1, -1, x.shape[3]))
        num = (w[..., None] * xf).scatter_add_(2, t[..., None].expand_as(xa), wa[..., None] * xa)
        merged = (num / torch.where(plan.target, den, 1.0)[..., None]).to(x.dtype)
        x_new = torch.where(plan.target[..., None], merged, x)  # untouched slots keep their bits
        return x_new[~plan.removed].view(B, H, S - plan.m, x.shape[3])

    deg2 = torch.where(plan.target, den, w)[~plan.removed].view(B, H, S - plan.m)
    return merge(k), merge(v), deg2


# --------------------------------------------------------------------------------------------------
# 4. One round of Algorithm 1
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeResult:
    """Outcome of :func:`merge_round`.

    k, v: ``(B, H, S - merged, D)`` / ``(B, H, S - merged, Dv)`` in the input dtypes; deg:
    ``(B, H, S - merged)`` fp32; merged: slots removed per head; mean_sim: mean cosine similarity of
    the merged pairs over all heads (0.0 when nothing merged); head_sim: ``(B, H)`` fp32 mean per head
    (0 when nothing merged), e.g. to spot outlier heads that merge poorly.
    """

    k: torch.Tensor
    v: torch.Tensor
    deg: torch.Tensor
    merged: int
    mean_sim: float
    head_sim: torch.Tensor


def merge_round(
    k: torch.Tensor,
    v: torch.Tensor,
    deg: torch.Tensor,
    sinks: int,
    recent: int,
    chunk: int,
    ratio: float,
    max_merge: int | None = None,
    use_triton: bool = False,
) -> MergeResult:
    """One round of CentroidKV's Algorithm 1 (chunked soft matching + degree-weighted merge).

    Args:
        k, v: ``(B, H, S, D)`` / ``(B, H, S, Dv)`` caches with S live slots in every head.
        deg: ``(B, H, S)`` degrees (fp32; >= 1), 1 for tokens never merged.
        sinks, recent: the first ``sinks`` and last ``recent`` slots are never merged (paper defaults
            16 and 64); candidates are ``[sinks, S - recent)``, and fewer than 2 merge nothing.
        chunk: chunk length (paper default 256).
        ratio: fraction of the NA candidate pairs to merge, in ``[0, 1]``:
            ``n_merge = floor(ratio * NA + 1e-9)`` (the 1e-9 absorbs float64 rounding, so that
            ``ratio = 1 / NA`` merges one pair), at most ``max_merge`` when given (so a caller stops
            at its budget). NA <= ceil(candidates / 2).
        use_triton: run :func:`chunk_match` / :func:`merge_scatter` (CUDA, or the interpreter)
            instead of the references.

    Returns:
        :class:`MergeResult`. Nothing to merge returns the input k and v objects (deg as fp32).
    """
    who = "merge_round"
    if k.dim() != 4:
        raise ValueError(f"kvpass: {who} needs k of shape (B, H, S, D), got {tuple(k.shape)}")
    if sinks < 0 or recent < 0:
        raise ValueError(
            f"kvpass: {who} needs sinks >= 0 and recent >= 0, got sinks={sinks}, recent={recent}"
        )
    if chunk < 2:
        raise ValueError(f"kvpass: {who} needs chunk >= 2, got chunk={chunk}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"kvpass: {who} needs 0 <= ratio <= 1, got ratio={ratio}")
    if max_merge is not None and max_merge < 0:
        raise ValueError(f"kvpass: {who} needs max_merge >= 0 (or None), got max_merge={max_merge}")
    B, H, S, _ = k.shape
    if v.dim() != 4 or v.shape[:3] != k.shape[:3] or tuple(deg.shape) != (B, H, S):
        raise ValueError(
            f"kvpass: {who} needs v (B, H, S, Dv) and deg (B, H, S) matching k {tuple(k.shape)}, "
            f"got v {tuple(v.shape)}, deg {tuple(deg.shape)}"
        )
    lo, hi = sinks, S - recent
    na = num_candidates(lo, hi, chunk) if hi - lo >= 2 else 0
    n_merge = math.floor(ratio * na + 1e-9)  # 1e-9: (1 / na) * na or 0.29 * 100 fall just below an integer
    if max_merge is not None:
        n_merge = min(n_merge, max_merge)
    if n_merge == 0:
        return MergeResult(
            k=k, v=v, deg=deg.float(), merged=0, mean_sim=0.0,
            head_sim=torch.zeros((B, H), dtype=torch.float32, device=k.device),
        )
    match = chunk_match if use_triton else chunk_match_ref
    scatter = merge_scatter if use_triton else merge_scatter_ref
    a_pos, b_pos, sim = match(k, lo, hi, chunk)
    take = select_pairs(sim, n_merge)
    head_sim = (sim * take).sum(-1) / n_merge
    k2, v2, deg2 = scatter(k, v, deg, a_pos, b_pos, take)
    return MergeResult(
        k=k2, v=v2, deg=deg2, merged=n_merge, mean_sim=float(head_sim.mean()), head_sim=head_sim
    )


# --------------------------------------------------------------------------------------------------
# 5. Decode attention with the log-degree bias
# --------------------------------------------------------------------------------------------------


def log_degree_bias(deg: torch.Tensor) -> torch.Tensor:
    """``log deg`` in fp32, ``-inf`` where ``deg <= 0`` (an ignored slot): the bias of
    :func:`centroid_decode_attention`, same shape as ``deg``."""
    d = deg.float()
    return torch.where(d > 0, d.clamp_min(1e-30).log(), float("-inf"))


def centroid_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    deg: torch.Tensor,
    scale: float | None = None,
    use_triton: bool | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a merged cache: ``softmax(scale * q k^T + log deg) v``.

    Args:
        q: ``(B, H_q, D)``, one decode query per head; ``H_q = G * H_kv``, query head h reads KV
            head ``h // G``.
        k, v: ``(B, H_kv, S, D)`` / ``(B, H_kv, S, Dv)`` centroids, any strides.
        deg: ``(B, H_kv, S)`` degrees, float or integer. ``deg <= 0`` gives bias ``-inf``: the slot
            is ignored (padding, so heads of different lengths share one layout; its k/v must be
            finite). All degrees 1 is plain softmax attention.
        scale: softmax scale, default ``1/sqrt(D)``.
        use_triton: ``None`` runs the Triton kernel on CUDA tensors and the torch reference
            elsewhere; ``True`` forces the kernel (CUDA or ``TRITON_INTERPRET=1``).
        bias: ``log_degree_bias(deg)`` when the caller keeps it (CentroidKV's state does, so that a
            decode step does not recompute it); ``None`` computes it from ``deg``.

    Returns:
        ``(B, H_q, Dv)`` in q's dtype; a head whose slots all have degree 0 gives zeros.
    """
    who = "centroid_decode_attention"
    if k.dim() != 4 or tuple(deg.shape) != tuple(k.shape[:3]):
        raise ValueError(
            f"kvpass: {who} needs deg of shape (B, H_kv, S) = {tuple(k.shape[:3])}, got {tuple(deg.shape)}"
        )
    if deg.device != k.device:
        raise ValueError(f"kvpass: {who} needs deg on {k.device}, got {deg.device}")
    if bias is None:
        bias = log_degree_bias(deg)
    elif tuple(bias.shape) != tuple(deg.shape):
        raise ValueError(f"kvpass: {who} needs bias shaped like deg {tuple(deg.shape)}, got {tuple(bias.shape)}")
    if use_triton is None:
        use_triton = q.is_cuda and triton_available(q)
    if use_triton:
        return sparse_decode_attention(q, k, v, bias=bias, scale=scale)
    return sparse_decode_attention_ref(q, k, v, bias=bias, scale=scale)

"""Decode attention over a per-KV-head index list (GQA without duplicating K/V).

One query token per head attends to a subset of cache positions chosen per KV head (the selection of
Quest, arXiv 2406.10774, ClusterKV, arXiv 2412.03213, TailorKV, arXiv 2505.19586), or to the whole cache
when no index list is given (the dense decode attention that serves the ``Full`` policy). The G query
heads that share a KV head (HF ``repeat_kv`` order: query head ``h`` uses KV head ``h // G``) are
processed together, so every selected K/V row is read once per KV head, not once per query head.

Semantics, for every batch ``b`` and query head ``h`` with ``hk = h // G``::

    s_j   = scale * q[b, h] . k[b, hk, idx_j] + bias[b, hk, idx_j]      over valid j
    out   = softmax_j(s) @ v[b, hk, idx_j]

An index entry is valid when ``0 <= idx_j < S``; anything else (``-1`` is the padding value) is
ignored. A row with no valid entry, or whose valid entries all have bias ``-inf``, returns zeros
(never NaN). Duplicate indices are *not* merged: a position listed twice counts twice in the
softmax (callers pass distinct positions).

Files in this module: ``_sparse_decode_attention_kernel`` (+ a combine kernel for split-N
"flash-decoding"), the launcher :func:`sparse_decode_attention`, and the plain-torch reference
:func:`sparse_decode_attention_ref`, which is also the CPU implementation used at decode time.
"""

from __future__ import annotations

import math

import torch

from . import cpu_decode
from ._triton import require_triton, tl, triton

__all__ = ["sinks_picked_recent", "sparse_decode_attention", "sparse_decode_attention_ref"]

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _sparse_decode_attention_kernel(
    Q, K, V, IDX, BIAS, OUT, M_PART, L_PART,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ib, stride_ih, stride_in,
    stride_bb, stride_bh, stride_bs,
    stride_ob, stride_oh, stride_osplit, stride_od,
    H_KV, S, N, D, DV, G, N_PER_SPLIT, NUM_SPLITS,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2 (exp2)
    HAS_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,  # split-N: write (acc, m, l) per split, a combine kernel finishes
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_split = tl.program_id(1)
    # int64 offsets: b * stride_kb overflows int32 on large caches
    b = (pid_bh // H_KV).to(tl.int64)
    hk = (pid_bh % H_KV).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_g = offs_g < G
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    heads = hk * G + offs_g  # the G query heads that read KV head hk

    # The group's queries are loaded once and stay in registers for the whole loop.
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    idx_base = IDX + b * stride_ib + hk * stride_ih
    bias_base = BIAS + b * stride_bb + hk * stride_bh

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)

    lo = pid_split * N_PER_SPLIT
    hi = tl.minimum(lo + N_PER_SPLIT, N)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        if HAS_IDX:
            pos = tl.load(idx_base + offs_n * stride_in, mask=in_range, other=-1).to(tl.int64)
            valid = in_range & (pos >= 0) & (pos < S)
            pos = tl.where(valid, pos, 0)  # never form an out-of-bounds address, even masked
        else:
            pos = offs_n.to(tl.int64)
            valid = in_range

        k = tl.load(
            k_base + pos[:, None] * stride_ks + offs_d[None, :] * stride_kd,
            mask=valid[:, None] & mask_d[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_base + pos * stride_bs, mask=valid, other=0.0).to(tl.float32)
            s += bias[None, :] * 1.4426950408889634
        s = tl.where(valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # While a row has seen only -inf, subtract 0 instead of -inf: exp2(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v = tl.load(
            v_base + pos[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
            mask=valid[:, None] & mask_dv[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = mask_g[:, None] & mask_dv[None, :]
    out_ptrs = OUT + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
    if WRITE_PARTIAL:
        tl.store(out_ptrs + pid_split * stride_osplit, acc, mask=out_mask)
        # M_PART / L_PART are contiguous (B, H_q, NUM_SPLITS) scratch owned by the launcher
        ml_offs = (b * H_KV * G + heads) * NUM_SPLITS + pid_split
        tl.store(M_PART + ml_offs, m_i, mask=mask_g)
        tl.store(L_PART + ml_offs, l_i, mask=mask_g)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # empty rows: acc is 0, so the output is 0
        tl.store(out_ptrs, (acc / l_safe[:, None]).to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _sparse_decode_attention_combine_kernel(
    ACC_PART, M_PART, L_PART, OUT,
    stride_ob, stride_oh, stride_od,
    H_Q, DV, NUM_SPLITS,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One program per (b, query head): merge the per-split online-softmax states.
    pid = tl.program_id(0)
    b = (pid // H_Q).to(tl.int64)
    h = (pid % H_Q).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < NUM_SPLITS
    mask_dv = offs_dv < DV
    row = pid.to(tl.int64) * NUM_SPLITS + offs_s  # scratch is contiguous (B, H_q, NUM_SPLITS[, DV])
    m = tl.load(M_PART + row, mask=mask_s, other=float("-inf"))
    l = tl.load(L_PART + row, mask=mask_s, other=0.0)
    acc = tl.load(
        ACC_PART + row[:, None] * DV + offs_dv[None, :], mask=mask_s[:, None] & mask_dv[None, :], other=0.0
    )
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # splits that saw nothing have m = -inf -> weight 0
    l_tot = tl.sum(w * l, axis=0)
    o = tl.sum(acc * w[:, None], axis=0)
    l_safe = tl.where(l_tot > 0.0, l_tot, 1.0)
    tl.store(
        OUT + b * stride_ob + h * stride_oh + offs_dv * stride_od,
        (o / l_safe).to(OUT.dtype.element_ty),
        mask=mask_dv,
    )


def _check_inputs(q, k, v, idx, bias, who: str):
    if q.dim() != 3:
        raise ValueError(f"kvpass: {who} needs q of shape (B, H_q, D), got {tuple(q.shape)}")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"kvpass: {who} needs k and v of shape (B, H_kv, S, D), "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H_q, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"kvpass: {who} needs k of shape (B={B}, H_kv, S, D={D}) to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"kvpass: {who} needs v to share (B, H_kv, S) with k {tuple(k.shape[:3])}, got {tuple(v.shape)}"
        )
    H_kv = k.shape[1]
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(
            f"kvpass: {who} needs H_q to be a multiple of H_kv (grouped-query attention), "
            f"got H_q={H_q}, H_kv={H_kv}"
        )
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"kvpass: {who} needs q, k, v of one dtype among float16/bfloat16/float32, "
            f"got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"kvpass: {who} needs q, k, v on one device, got {q.device}, {k.device}, {v.device}")
    if idx is not None:
        if idx.dim() != 3 or tuple(idx.shape[:2]) != (B, H_kv):
            raise ValueError(
                f"kvpass: {who} needs idx of shape (B={B}, H_kv={H_kv}, N), got {tuple(idx.shape)}"
            )
        if idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kvpass: {who} needs idx of dtype int32 or int64, got {idx.dtype}")
        if idx.device != q.device:
            raise ValueError(f"kvpass: {who} needs idx on {q.device}, got {idx.device}")
    if bias is not None:
        S = k.shape[2]
        if tuple(bias.shape) != (B, H_kv, S):
            raise ValueError(
                f"kvpass: {who} needs bias of shape (B={B}, H_kv={H_kv}, S={S}), got {tuple(bias.shape)}"
            )
        if not bias.is_floating_point():
            raise ValueError(f"kvpass: {who} needs a floating-point bias (float32), got {bias.dtype}")
        if bias.device != q.device:
            raise ValueError(f"kvpass: {who} needs bias on {q.device}, got {bias.device}")


def _default_num_splits(q: torch.Tensor, programs: int, n_blocks: int) -> int:
    # Split N only on a GPU whose SMs would otherwise idle (decode has few (b, kv head) pairs);
    # under the interpreter every extra program is pure cost.
    if not q.is_cuda or n_blocks <= 1:
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return max(1, min(n_blocks, triton.cdiv(2 * sms, max(programs, 1))))


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    block_n: int = 128,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton decode attention of one query per head over selected cache rows.

    Args:
        q: ``(B, H_q, D)``, one decode query per head; ``H_q = H_kv * G``.
        k: ``(B, H_kv, S, D)``, any strides. v: ``(B, H_kv, S, Dv)``, any strides (usually Dv = D).
        idx: ``(B, H_kv, N)`` int32/int64 positions into S; entries outside ``[0, S)`` (``-1``) are
            padding. ``None`` attends to all S positions (dense decode attention).
        bias: ``(B, H_kv, S)`` additive score bias (fp32), e.g. ``log(count)`` of merged tokens,
            ``-inf`` for empty slots. ``None`` for no bias.
        scale: softmax scale, default ``1/sqrt(D)``.
        block_n: cache rows per loop step (a power of two >= 16).
        num_splits: programs per (b, kv head) along N ("flash-decoding"); ``None`` picks one from the
            GPU's SM count (1 on CPU / interpreter).

    Returns:
        ``(B, H_q, Dv)`` in ``q.dtype``. Rows with no valid entry are zero. Duplicate indices count
        twice. bf16 is accepted, but the Triton interpreter computes bf16 wrongly (test on a GPU).
    """
    who = "sparse_decode_attention"
    _check_inputs(q, k, v, idx, bias, who)
    require_triton(q, who, "sparse_decode_attention_ref")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"kvpass: {who} needs block_n to be a power of two >= 16, got {block_n}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"kvpass: {who} needs num_splits >= 1 (or None), got {num_splits}")

    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    Dv = v.shape[3]
    G = H_q // H_kv
    N = S if idx is None else idx.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    out = torch.empty((B, H_q, Dv), dtype=q.dtype, device=q.device)
    if B == 0 or H_q == 0 or Dv == 0:
        return out

    n_blocks = max(1, triton.cdiv(N, block_n))  # N = 0 still launches: the programs write zeros
    splits = _default_num_splits(q, B * H_kv, n_blocks) if num_splits is None else num_splits
    splits = max(1, min(splits, n_blocks))  # never launch splits that own no rows
    n_per_split = triton.cdiv(n_blocks, splits) * block_n
    splits = max(1, triton.cdiv(N, n_per_split))

    # Dummy pointers for absent operands: never dereferenced (HAS_IDX / HAS_BIAS are constexpr).
    idx_t = idx if idx is not None else q
    idx_strides = idx.stride() if idx is not None else (0, 0, 0)
    bias_t = bias if bias is not None else q
    bias_strides = bias.stride() if bias is not None else (0, 0, 0)

    block_d = max(16, triton.next_power_of_2(D))
    common = dict(
        HAS_IDX=idx is not None,
        HAS_BIAS=bias is not None,
        BLOCK_G=max(16, triton.next_power_of_2(G)),  # tl.dot needs every dim >= 16
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=max(16, triton.next_power_of_2(Dv)),
        # fp32 inputs: exact products (tf32 would drift from the reference); ignored for fp16/bf16
        DOT_PRECISION="ieee",
        # GPU only (the interpreter ignores it): more warps for big K/V tiles, a guess not yet measured
        num_warps=8 if block_n * block_d >= 128 * 128 else 4,
    )
    scalars = (H_kv, S, N, D, Dv, G, n_per_split, splits, scale * _LOG2E)
    if splits == 1:
        _sparse_decode_attention_kernel[(B * H_kv, 1)](
            q, k, v, idx_t, bias_t, out, out, out,
            *q.stride(), *k.stride(), *v.stride(), *idx_strides, *bias_strides,
            out.stride(0), out.stride(1), 0, out.stride(2),
            *scalars, WRITE_PARTIAL=False, **common,
        )
        return out

    acc_part = torch.empty((B, H_q, splits, Dv), dtype=torch.float32, device=q.device)
    m_part = torch.empty((B, H_q, splits), dtype=torch.float32, device=q.device)
    l_part = torch.empty((B, H_q, splits), dtype=torch.float32, device=q.device)
    _sparse_decode_attention_kernel[(B * H_kv, splits)](
        q, k, v, idx_t, bias_t, acc_part, m_part, l_part,
        *q.stride(), *k.stride(), *v.stride(), *idx_strides, *bias_strides,
        *acc_part.stride(),
        *scalars, WRITE_PARTIAL=True, **common,
    )
    _sparse_decode_attention_combine_kernel[(B * H_q,)](
        acc_part, m_part, l_part, out,
        *out.stride(),
        H_q, Dv, splits,
        BLOCK_SPLITS=triton.next_power_of_2(splits),
        BLOCK_DV=triton.next_power_of_2(Dv),
    )
    return out


# The gathered path reads the selected rows twice (the gather's copy, then SDPA) and writes them once; the
# masked dense path reads every row once: it is the cheaper one from a third of the rows on
DENSE_FROM = 1 / 3


def sinks_picked_recent(batch: int, heads: int, n_sinks: int, picked: torch.Tensor | None, n_recent: int,
                        length: int, device, first: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H, n_sinks + N + n_recent)`` int64 positions of a selection made of three parts: each row's sinks
    ``f_b + [0, n_sinks)`` (``first (B,)`` or ``(1,)``; None: 0), ``picked (B, H, N)`` (None: no part), then
    the recent tokens ``[length - n_recent, length)``."""
    sinks = torch.arange(n_sinks, device=device)
    if first is not None:
        sinks = first.to(device=device, dtype=torch.int64).expand(batch)[:, None, None] + sinks
    parts = [sinks.expand(batch, heads, -1)]
    if picked is not None:
        parts.append(picked.to(device))
    parts.append(torch.arange(length - n_recent, length, device=device).expand(batch, heads, -1))
    return torch.cat(parts, dim=-1)


def use_dense(n: int, length: int) -> bool:
    """Whether attending ``n`` listed positions of a ``length``-token cache is cheaper with a mask over the
    whole cache than with a gather (see ``DENSE_FROM``)."""
    return n >= DENSE_FROM * length


def _decode_sdpa(q, k, v, idx, bias, scale, workspace=None, dense=None) -> torch.Tensor:
    """The fp32 CPU path of :func:`sparse_decode_attention_ref`: one SDPA call whose rows are the query
    heads of a KV head (``(B, H_kv, G, D)``), over the gathered positions, or over the whole cache with a
    mask when the index list holds at least ``DENSE_FROM`` of it. A position listed m times is given
    bias ``log m`` in the mask, which is what listing it m times does to the softmax. Rows with nothing
    valid give 0 (SDPA's CPU kernels return 0 for a row masked everywhere). The C kernel of
    :mod:`kvpass.kernels.cpu_decode` serves it where it is built, else :func:`decode_attention_torch`."""
    if cpu_decode.supports(q, k, v):
        # the fused C kernel reads the listed rows in place: no gather, no mask, no dense switch
        return cpu_decode.cpu_decode_attention(q, k, v, None if idx is None else idx.long(), scale,
                                               None if bias is None else bias.float())
    return decode_attention_torch(q, k, v, idx, bias, scale, workspace, dense)


def decode_attention_torch(q, k, v, idx, bias, scale, workspace=None, dense=None) -> torch.Tensor:
    """The torch code of the fp32 CPU path (see :func:`_decode_sdpa`), where the C kernel is not built
    (``KVPASS_NATIVE=0``, no compiler) or cannot serve the operands; ``kvpass bench --kernels``
    (:func:`kvpass.bench.kernels.benchmark_cpu_paths`) times the C kernel against it. Shapes as in
    :func:`sparse_decode_attention_ref`."""
    import torch.nn.functional as F

    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    qg = q.reshape(B, H_kv, H_q // H_kv, D)
    if idx is None:
        mask = None if bias is None else bias.float()[:, :, None, :]
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, H_q, v.shape[3])
    pos = idx.long()
    valid = (pos >= 0) & (pos < S)
    if use_dense(pos.shape[2], S) if dense is None else dense:
        counts = torch.zeros((B, H_kv, S + 1), dtype=torch.float32, device=q.device)
        counts.scatter_add_(2, torch.where(valid, pos, S), _ones(q, pos.shape))
        return _masked_dense(q, k, v, counts[:, :, :S], bias, scale)
    pos = torch.where(valid, pos, 0)
    ks, vs = _gather_pair(k, v, pos, workspace)
    if bias is None:
        mask = valid[:, :, None, :]
    else:
        mask = torch.gather(bias.float(), 2, pos).masked_fill_(~valid, float("-inf"))[:, :, None, :]
    out = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=mask, scale=scale)
    return out.reshape(B, H_q, v.shape[3])


def _masked_dense(q, k, v, counts, bias, scale) -> torch.Tensor:
    """Attention of q ``(B, H_q, D)`` over the whole of k, v ``(B, H_kv, S, D)``, position s weighted by
    ``counts (B, H_kv, S)``, the times it is listed (0: not attended): bias ``log(count)`` in SDPA's mask.
    ``counts`` is overwritten. Returns ``(B, H_q, Dv)``."""
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    mask = counts.log_()  # -inf where not listed
    if bias is not None:
        mask.add_(bias)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(B, H_kv, H_q // H_kv, D), k, v, attn_mask=mask[:, :, None, :], scale=scale)
    return out.reshape(B, H_q, v.shape[3])


def _ones(like: torch.Tensor, shape) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=like.device).expand(shape)


def _gather_pair(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, workspace=None):
    """:func:`_gather_rows` of k and v, with one row index when their layouts agree (a cache's k and v),
    into ``workspace`` buffers when one is given."""
    if k.shape[:3] == v.shape[:3] and k.stride()[:3] == v.stride()[:3]:
        rows = _row_index(k, pos)
        if rows is not None:
            n = pos.shape[2]
            return _take_rows(k, rows, n, workspace, "k"), _take_rows(v, rows, n, workspace, "v")
    return _gather_rows(k, pos), _gather_rows(v, pos)


def _row_index(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
    """Flat row numbers of ``x[b, h, pos]`` in x viewed as one table of rows, or None for a layout
    that is not one (see :func:`_gather_rows`)."""
    B, H, S, _ = x.shape
    sb, sh, ss, _ = x.stride()
    if not (S > 0 and ss > 0 and sb % ss == 0 and sh % ss == 0 and x.numel() > 0):
        return None
    if sb != H * sh:  # b and h not one run of rows (a slice of a bigger batch)
        base = torch.arange(B, device=x.device)[:, None] * (sb // ss) + torch.arange(H, device=x.device) * (sh // ss)
        return (base[:, :, None] + pos).reshape(-1)
    base = torch.arange(B * H, device=x.device).view(B, H)
    return (base[:, :, None] * (sh // ss) + pos).reshape(-1)


def _take_rows(x: torch.Tensor, rows: torch.Tensor, n: int, workspace=None, name: str = "") -> torch.Tensor:
    B, H, S, D = x.shape
    sb, sh, ss, sd = x.stride()
    n_rows = (B - 1) * (sb // ss) + (H - 1) * (sh // ss) + S  # last row ends at x's last element
    table = x.as_strided((n_rows, D), (ss, sd), x.storage_offset())
    return _select(table, rows, workspace, name).view(B, H, n, D)


def _select(table: torch.Tensor, rows: torch.Tensor, workspace, name: str) -> torch.Tensor:
    """``table.index_select(0, rows)``, written into the workspace buffer ``"gather_" + name`` when a
    workspace is given."""
    if workspace is None:
        return table.index_select(0, rows)
    out = workspace("gather_" + name, (rows.numel(), table.shape[1]), table.dtype, table.device)
    return torch.index_select(table, 0, rows, out=out)


def _gather_rows(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x[b, h, pos[b, h, n], :]`` for x ``(B, H, S, D)`` and pos ``(B, H, N)`` int64 in ``[0, S)``.

    When the (b, h) strides are multiples of the S stride (contiguous caches, slices of a bigger
    buffer along S), x is viewed as one table of rows and gathered with ``index_select``: about 6x
    faster on CPU than ``torch.gather`` with an index expanded over D. Other layouts use advanced
    indexing.
    """
    B, H = x.shape[:2]
    rows = _row_index(x, pos)
    if rows is not None:
        return _take_rows(x, rows, pos.shape[2])
    bi = torch.arange(B, device=x.device)[:, None, None]
    hi = torch.arange(H, device=x.device)[None, :, None]
    return x[bi, hi, pos]


def sparse_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    workspace=None,
    dense: bool | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`sparse_decode_attention` (fp32 accumulation); the CPU decode path.

    ``workspace(name, shape, dtype, device) -> Tensor``, optional: scratch buffers reused between calls
    for the gathered rows (the runtime's :class:`kvpass.runtime.state.Workspace`); None allocates.
    ``dense``: attend the whole cache with a mask instead of gathering (fp32 CPU path); None chooses by
    :func:`use_dense`.

    Shapes as in :func:`sparse_decode_attention`: q ``(B, H_q, D)``, k ``(B, H_kv, S, D)``,
    v ``(B, H_kv, S, Dv)``, idx ``(B, H_kv, N)`` or None, bias ``(B, H_kv, S)`` or None;
    returns ``(B, H_q, Dv)`` in ``q.dtype``. fp32 on CPU: one SDPA call over the gathered rows, or over
    the whole cache with a mask (see :func:`use_dense`); other dtypes and devices: a batched gather, two
    matmuls and an fp32 softmax. No Python loop over heads."""
    _check_inputs(q, k, v, idx, bias, "sparse_decode_attention_ref")
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    Dv = v.shape[3]
    G = H_q // H_kv
    N = S if idx is None else idx.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if N == 0 or B == 0 or H_q == 0:
        return q.new_zeros((B, H_q, Dv))

    if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and S > 0:
        return _decode_sdpa(q, k, v, idx, bias, scale, workspace, dense)
    qf = q.reshape(B, H_kv, G, D).float()  # query heads grouped by the KV head they read
    if idx is None:
        ks, vs, bs, valid = k, v, bias, None
    else:
        pos = idx.long()
        valid = (pos >= 0) & (pos < S)
        pos = torch.where(valid, pos, 0)
        ks, vs = _gather_rows(k, pos), _gather_rows(v, pos)  # (B, H_kv, N, D)
        bs = None if bias is None else torch.gather(bias, 2, pos)

    scores = torch.matmul(qf, ks.float().transpose(-1, -2))  # (B, H_kv, G, N) fp32
    scores.mul_(scale)
    if bs is not None:
        scores.add_(bs.float()[:, :, None, :])
    if valid is not None:
        scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m.masked_fill_(m == float("-inf"), 0.0)  # all-masked rows: exp(-inf - 0) = 0, not NaN
    p = scores.sub_(m).exp_()
    denom = p.sum(dim=-1, keepdim=True)
    denom.masked_fill_(denom == 0, 1.0)  # all-masked rows have p = 0, so the output is 0
    out = torch.matmul(p, vs.float()).div_(denom)  # (B, H_kv, G, Dv)
    return out.reshape(B, H_q, Dv).to(q.dtype)


def segments_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[tuple[int, int]],
    scale: float,
    idx: torch.Tensor | None = None,
    workspace=None,
) -> torch.Tensor:
    """:func:`sparse_decode_attention_ref` over a few ranges ``[lo, hi)`` of positions shared by every row
    and head (StreamingLLM's sinks and window, ClusterKV's sinks and recent tokens), plus the positions
    ``idx (B, H_kv, N)`` (-1: padding) gathered as usual: SDPA on each range's view, which copies
    nothing, and on the gathered rows, merged by their log-sum-exps. CPU, fp32. q ``(B, H_q, D)``; k, v
    ``(B, H_kv, S, D)``; returns ``(B, H_q, Dv)``. Ranges must be non-empty, and disjoint from each other
    and from ``idx``."""
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    if cpu_decode.supports(q, k, v):
        # the C kernel reads ranges and listed rows in place: one call over one index list
        dev = q.device
        parts = [torch.arange(lo, hi, device=dev).expand(B, H_kv, -1) for lo, hi in segments]
        if idx is not None and idx.shape[2]:
            parts.append(idx.long())
        return cpu_decode.cpu_decode_attention(q, k, v, torch.cat(parts, dim=2), scale)
    # this aten op reads q as if its last dim were contiguous (torch 2.13): a q the graph laid out
    # otherwise (batch > 1, e.g. beam search) gave garbage or NaN
    qg = (q if q.stride(-1) == 1 else q.contiguous()).reshape(B, H_kv, H_q // H_kv, D)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    parts = [flash(qg, k[:, :, lo:hi], v[:, :, lo:hi], 0.0, False, scale=scale) for lo, hi in segments]
    if idx is not None and idx.shape[2]:
        pos = idx.long()
        valid = (pos >= 0) & (pos < k.shape[2])
        ks, vs = _gather_pair(k, v, torch.where(valid, pos, 0), workspace)
        mask = torch.where(valid, 0.0, float("-inf"))[:, :, None, :]  # this op takes float masks only
        parts.append(flash(qg, ks, vs, 0.0, False, attn_mask=mask, scale=scale))
    if len(parts) == 1:
        return parts[0][0].reshape(B, H_q, v.shape[3])
    lse = torch.stack([p[1] for p in parts])  # (n, B, H_kv, G); -inf for a part with nothing valid
    w = torch.softmax(lse, dim=0)  # each part's share of the softmax mass
    out = torch.stack([p[0] for p in parts]).mul_(w[..., None]).sum(0)
    return out.reshape(B, H_q, v.shape[3])


def paged_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    length: int,
    scale: float | None = None,
    workspace=None,
    dense: bool | None = None,
    newest_last: bool = False,
) -> torch.Tensor:
    """:func:`sparse_decode_attention_ref` for selections made of whole pages (Quest): one gather
    row per page instead of per token, the CPU fast path.

    q ``(B, H_q, D)``; k, v ``(B, H_kv, C, D)`` contiguous buffers whose capacity C is a multiple of
    ``page_size`` (positions ``>= length`` must hold finite values: they are masked); pages
    ``(B, H_kv, n)`` distinct page indices with ``page * page_size < length``. Returns ``(B, H_q, D)``.
    Equals :func:`sparse_decode_attention_ref` with the pages' token positions as ``idx``.
    ``newest_last``: every row lists the newest page (the one holding ``length - 1``) last, so every
    other listed page is full: the gathered rows need no mask, only the newest page's empty tail cut.
    """
    B, H_q, D = q.shape
    _, H_kv, C, _ = k.shape
    Dv = v.shape[3]
    if not (k.is_contiguous() and v.is_contiguous() and C % page_size == 0):
        raise ValueError(
            f"kvpass: paged_decode_attention_ref needs contiguous k/v with capacity a multiple of "
            f"page_size={page_size}, got shape {tuple(k.shape)}"
        )
    G, n = H_q // H_kv, pages.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    fp32 = q.dtype == k.dtype == v.dtype == torch.float32
    if fp32 and (use_dense(n * page_size, length) if dense is None else dense):
        # most of the cache is selected: every token once, with a mask (see _decode_sdpa)
        counts = torch.zeros((B, H_kv, C // page_size), dtype=torch.float32, device=q.device)
        counts.scatter_add_(2, pages.long(), _ones(q, pages.shape))
        counts = counts.repeat_interleave(page_size, dim=2)[:, :, :length]
        return _masked_dense(q, k[:, :, :length], v[:, :, :length], counts, None, scale)
    if fp32 and cpu_decode.supports(q, k, v):
        # the C kernel reads the pages' rows in place; positions >= length are skipped
        pos = (pages.long()[..., None] * page_size + torch.arange(page_size, device=q.device)).flatten(-2)
        return cpu_decode.cpu_decode_attention(q, k[:, :, :length], v[:, :, :length], pos, scale)
    per_head = C // page_size
    rows = (torch.arange(B * H_kv, device=q.device).view(B, H_kv, 1) * per_head + pages).reshape(-1)
    ks = _select(k.view(-1, page_size * D), rows, workspace, "k").view(B, H_kv, n * page_size, D)
    vs = _select(v.view(-1, page_size * Dv), rows, workspace, "v").view(B, H_kv, n * page_size, Dv)
    if newest_last:
        live = None
        cut = n * page_size - (-length % page_size)  # the newest page holds length - (its first) tokens
        ks, vs = ks[:, :, :cut], vs[:, :, :cut]
    else:
        live = (pages[..., None] * page_size + torch.arange(page_size, device=q.device)).view(B, H_kv, 1, -1) < length
    if fp32:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(B, H_kv, G, D), ks, vs, attn_mask=live, scale=scale)
        return out.reshape(B, H_q, Dv)
    qf = q.reshape(B, H_kv, G, D).float()
    scores = torch.matmul(qf, ks.float().transpose(-1, -2)).mul_(scale)  # (B, H_kv, G, n * page_size)
    if live is not None:
        scores.masked_fill_(~live, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, vs.float()).reshape(B, H_q, Dv).to(q.dtype)

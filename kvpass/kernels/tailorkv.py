"""TailorKV kernels: 1/2-bit KV quantisation, fused decode attention over the packed cache, and
critical-channel top-k retrieval.

TailorKV (Yao et al., "TailorKV: A Hybrid Framework for Long-Context Inference via Tailored KV Cache
Optimization", ACL 2025 Findings, arXiv 2505.19586) serves "quantisation-friendly" layers (usually the
shallow, dense-attention ones) from a statically quantised cache: keys per channel, values per token (as
in KIVI, arXiv 2402.02750), down to 1 bit; and "sparsity-friendly" layers by fetching the top-k tokens
from a host tier, chosen with a few critical key channels.

Quantisation (asymmetric, ``bits`` in {1, 2}, ``L = 2**bits - 1`` levels above zero). The *grouped
axis* is S for ``axis="channel"`` (keys: every channel d, each run of ``group_size`` consecutive tokens
shares one (scale, zero)) and D for ``axis="token"`` (values: every token, each run of ``group_size``
consecutive channels shares one (scale, zero))::

    zero  = fp16(min over the group)          scale = fp16((max - min) / L)     (computed in fp32)
    code  = clamp(floor((x - zero) / scale + 1/2), 0, L)      (scale == 0 -> code 0; round half up)
    x_hat = zero + code * scale

``code`` is computed from the fp16-*rounded* scale and zero, in fp32 with correctly rounded division,
so the Triton kernel and the torch reference produce identical bytes.

Bit layout. ``8 // bits`` codes share a uint8 along the grouped axis, little-endian within the byte:
the code of grouped-axis position ``p`` sits in byte ``p // (8 // bits)`` at bits
``[(p % (8 // bits)) * bits, (p % (8 // bits) + 1) * bits)``. ``group_size`` must be a multiple of
``8 // bits``, so a byte never spans two groups. Shapes for x ``(B, H, S, D)``:

============  ========================  ===========================
axis          packed (uint8)            scale, zero (fp16)
============  ========================  ===========================
``channel``   ``(B, H, S*bits/8, D)``   ``(B, H, S/group_size, D)``
``token``     ``(B, H, S, D*bits/8)``   ``(B, H, S, D/group_size)``
============  ========================  ===========================

Contents:

- :class:`QuantizedKV`, :func:`quantize_pack` (Triton) / :func:`quantize_pack_ref`, :func:`dequantize`.
- :func:`quant_decode_attention` (Triton; dequantisation fused into the QK and PV products, the paper's
  FP16 x INT1 product) / :func:`quant_decode_attention_ref`: one decode query per head over the
  quantised tokens followed by a full-precision residual (the recent tokens not yet quantised).
- :func:`critical_channels` (torch): the paper's channel score ``s_i = |q_i| * max_t |K[t, i]|``.
- :func:`partial_topk` (Triton scoring) / :func:`partial_topk_ref`: approximate scores from the
  critical channels only, and the top-k positions to fetch.

- On CPU, in C (``kvpass/kernels/csrc/tailorkv.c``, built by :mod:`kvpass.kernels.native`):
  :func:`quant_decode_attention_cpu`, and a sparse layer's decode step (its channels, its list, its
  append and the attention over the list) through :class:`CpuStep`, whose operands are the argument
  structs of ``csrc/kvpass.h``, mirrored here by :class:`TailorSelectArgs`, :class:`TailorAppendArgs`
  and :class:`TailorStepArgs` (the same field names).

GQA everywhere follows HF ``repeat_kv``: query head ``h`` reads KV head ``h // G``, and one program
serves the G query heads of a KV head, so packed K/V are read once per KV head.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from . import cpu_decode, native
from ._triton import require_triton, tl, triton

__all__ = [
    "QuantizedKV",
    "quantize_pack",
    "quantize_pack_ref",
    "dequantize",
    "quant_decode_attention",
    "quant_decode_attention_ref",
    "critical_channels",
    "partial_topk",
    "partial_topk_ref",
]

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_AXES = ("channel", "token")


# --------------------------------------------------------------------------------------------------
# The container
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """A quantised ``(B, H, S, D)`` tensor (see the module docstring for the layout).

    Attributes:
        packed: uint8 codes, ``(B, H, S*bits/8, D)`` (axis="channel") or ``(B, H, S, D*bits/8)``
            (axis="token").
        scale, zero: fp16, ``(B, H, S/group_size, D)`` (channel) or ``(B, H, S, D/group_size)`` (token).
        bits: 1 or 2. group_size: elements per (scale, zero) along the grouped axis.
        axis: ``"channel"`` (groups of tokens, for keys) or ``"token"`` (groups of channels, for values).
        shape: ``(B, H, S, D)`` of the original tensor. dtype: its dtype (what :func:`dequantize` returns).
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    axis: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    def nbytes(self) -> int:
        """Bytes held: packed codes + scales + zeros."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def _check_quant_args(x: torch.Tensor, bits: int, group_size: int, axis: str, who: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"kvpass: {who} needs x of shape (B, H, S, D), got {shape}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kvpass: {who} needs x of dtype float16/bfloat16/float32, got {x.dtype}")
    if bits not in (1, 2):
        raise ValueError(f"kvpass: {who} needs bits in {{1, 2}}, got bits={bits}")
    if axis not in _AXES:
        raise ValueError(
            f"kvpass: {who} needs axis 'channel' (keys: groups of tokens) or 'token' "
            f"(values: groups of channels), got axis={axis!r}"
        )
    per = 8 // bits
    if not isinstance(group_size, int) or group_size < 1 or group_size % per:
        raise ValueError(
            f"kvpass: {who} needs group_size to be a positive multiple of 8 // bits = {per} "
            f"(a packed byte never spans two groups), got group_size={group_size}"
        )
    S, D = x.shape[2], x.shape[3]
    n, name = (S, "S") if axis == "channel" else (D, "D")
    if n % group_size:
        raise ValueError(
            f"kvpass: {who} needs {name} % group_size == 0 for axis={axis!r}, "
            f"got {name}={n}, group_size={group_size}"
        )


def _empty_qkv(x, bits, group_size, axis) -> QuantizedKV:
    B, H, S, D = x.shape
    per = 8 // bits
    if axis == "channel":
        packed_shape, meta_shape = (B, H, S // per, D), (B, H, S // group_size, D)
    else:
        packed_shape, meta_shape = (B, H, S, D // per), (B, H, S, D // group_size)
    return QuantizedKV(
        packed=torch.empty(packed_shape, dtype=torch.uint8, device=x.device),
        scale=torch.empty(meta_shape, dtype=torch.float16, device=x.device),
        zero=torch.empty(meta_shape, dtype=torch.float16, device=x.device),
        bits=bits,
        group_size=group_size,
        axis=axis,
        shape=(B, H, S, D),
        dtype=x.dtype,
    )


# --------------------------------------------------------------------------------------------------
# Quantise and pack
# --------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_pack_kernel(
    X, PACKED, SCALE, ZERO,
    stride_xb, stride_xh, stride_xl, stride_xm,
    stride_pb, stride_ph, stride_pl, stride_pm,
    stride_sb, stride_sh, stride_sl, stride_sm,  # SCALE and ZERO share one (contiguous) layout
    H, M, ROWS, GS,
    BITS: tl.constexpr,
    PER: tl.constexpr,  # codes per byte, 8 // BITS
    BLOCK_R: tl.constexpr,
    BLOCK_NB: tl.constexpr,  # >= bytes per group, GS // PER
):
    # "l" is the grouped axis (S for keys, D for values), "m" the other one; the launcher maps the
    # strides. A row is one (group, m) pair: row r -> group r // M, m = r % M, so consecutive rows
    # are consecutive m (contiguous channels for keys). One program quantises BLOCK_R rows of one
    # (b, h); a row's elements are held as (bytes of the group, codes per byte).
    pid_bh = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    LEVELS: tl.constexpr = (1 << BITS) - 1

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < ROWS
    grp = (offs_r // M).to(tl.int64)
    m = (offs_r % M).to(tl.int64)
    offs_nb = tl.arange(0, BLOCK_NB)
    offs_i = tl.arange(0, PER)
    nb_per_group = GS // PER
    mask_nb = offs_nb < nb_per_group
    mask = mask_r[:, None, None] & mask_nb[None, :, None] & (offs_i < PER)[None, None, :]
    pos = grp[:, None, None] * GS + offs_nb[None, :, None] * PER + offs_i[None, None, :]  # (R, NB, PER)
    x = tl.load(
        X + b * stride_xb + h * stride_xh + pos * stride_xl + m[:, None, None] * stride_xm,
        mask=mask,
        other=0.0,
    ).to(tl.float32)

    xmax = tl.max(tl.max(tl.where(mask, x, float("-inf")), axis=2), axis=1)
    xmin = tl.min(tl.min(tl.where(mask, x, float("inf")), axis=2), axis=1)
    xmax = tl.where(mask_r, xmax, 0.0)  # dead rows: keep the arithmetic finite
    xmin = tl.where(mask_r, xmin, 0.0)
    # div_rn: correctly rounded like torch (a plain "/" may compile to an approximate division on GPU)
    scale = tl.div_rn(xmax - xmin, tl.full([BLOCK_R], LEVELS, tl.float32)).to(tl.float16)
    zero = xmin.to(tl.float16)

    # codes from the fp16-rounded scale/zero, so the decoder sees exactly what was encoded
    s32 = scale.to(tl.float32)
    z32 = zero.to(tl.float32)
    has_range = s32 > 0.0
    t = tl.div_rn(x - z32[:, None, None], tl.where(has_range, s32, 1.0)[:, None, None])
    code = tl.minimum(tl.maximum(tl.floor(t + 0.5), 0.0), LEVELS)
    code = tl.where(has_range[:, None, None], code, 0.0).to(tl.int32)
    byte = tl.sum(code << (offs_i * BITS)[None, None, :], axis=2)  # (R, NB): bit fields do not overlap

    byte_pos = grp[:, None] * nb_per_group + offs_nb[None, :]
    tl.store(
        PACKED + b * stride_pb + h * stride_ph + byte_pos * stride_pl + m[:, None] * stride_pm,
        byte.to(tl.uint8),
        mask=mask_r[:, None] & mask_nb[None, :],
    )
    meta_offs = b * stride_sb + h * stride_sh + grp * stride_sl + m * stride_sm
    tl.store(SCALE + meta_offs, scale, mask=mask_r)
    tl.store(ZERO + meta_offs, zero, mask=mask_r)


def _grouped_strides(t: torch.Tensor, axis: str) -> tuple[int, int, int, int]:
    """Strides of a (B, H, S, D)-like tensor as (b, h, grouped axis, other axis)."""
    sb, sh, ss, sd = t.stride()
    return (sb, sh, ss, sd) if axis == "channel" else (sb, sh, sd, ss)


def quantize_pack(
    x: torch.Tensor, bits: int, group_size: int, axis: str, block_r: int | None = None
) -> QuantizedKV:
    """Triton asymmetric quantise-and-pack (KIVI-style grouping, TailorKV's 1/2-bit cache).

    Args:
        x: ``(B, H, S, D)`` float16/float32 (bfloat16 on GPU), any strides. Values must fit fp16.
        bits: 1 or 2.
        group_size: elements sharing one (scale, zero) along the grouped axis (tokens for
            ``axis="channel"``, channels for ``axis="token"``); a multiple of ``8 // bits`` dividing
            S (channel) or D (token).
        axis: ``"channel"`` (keys) or ``"token"`` (values).
        block_r: (group, other-axis) rows per program, a power of two (default: about 4096 elements
            per program).

    Returns:
        :class:`QuantizedKV`, bit-identical to :func:`quantize_pack_ref`.
    """
    who = "quantize_pack"
    _check_quant_args(x, bits, group_size, axis, who)
    require_triton(x, who, "quantize_pack_ref")
    if block_r is not None and (block_r < 1 or block_r & (block_r - 1)):
        raise ValueError(f"kvpass: {who} needs block_r to be a power of two (or None), got {block_r}")
    qkv = _empty_qkv(x, bits, group_size, axis)
    B, H, S, D = x.shape
    Lg, M = (S, D) if axis == "channel" else (D, S)
    rows = (Lg // group_size) * M
    if B * H * rows == 0:
        return qkv
    per = 8 // bits
    block_nb = triton.next_power_of_2(group_size // per)
    if block_r is None:
        block_r = min(triton.next_power_of_2(rows), max(1, 4096 // (block_nb * per)))
    grid = (B * H, triton.cdiv(rows, block_r))
    _quantize_pack_kernel[grid](
        x, qkv.packed, qkv.scale, qkv.zero,
        *_grouped_strides(x, axis), *_grouped_strides(qkv.packed, axis), *_grouped_strides(qkv.scale, axis),
        H, M, rows, group_size,
        BITS=bits, PER=per, BLOCK_R=block_r, BLOCK_NB=block_nb,
    )
    return qkv


def quantize_pack_ref(x: torch.Tensor, bits: int, group_size: int, axis: str) -> QuantizedKV:
    """Plain-torch :func:`quantize_pack` (same arguments, bit-identical result); the CPU path."""
    _check_quant_args(x, bits, group_size, axis, "quantize_pack_ref")
    qkv = _empty_qkv(x, bits, group_size, axis)
    B, H, S, D = x.shape
    per, levels = 8 // bits, (1 << bits) - 1
    # grouped axis at dim 2: (B, H, L, M)
    xt = x if axis == "channel" else x.transpose(2, 3)
    Lg, M = xt.shape[2], xt.shape[3]
    xg = xt.float().reshape(B, H, Lg // group_size, group_size, M)
    xmin, xmax = torch.aminmax(xg, dim=3) if xg.numel() else (xg.sum(3), xg.sum(3))
    scale = ((xmax - xmin) / levels).to(torch.float16)
    zero = xmin.to(torch.float16)
    s32, z32 = scale.float()[:, :, :, None], zero.float()[:, :, :, None]
    has_range = s32 > 0
    t = (xg - z32) / torch.where(has_range, s32, torch.ones_like(s32))
    code = torch.floor(t + 0.5).clamp_(0, levels)
    code = torch.where(has_range, code, torch.zeros_like(code)).to(torch.int32)
    shifts = (torch.arange(per, device=x.device, dtype=torch.int32) * bits).view(1, 1, 1, per, 1)
    packed = (code.reshape(B, H, Lg // per, per, M) << shifts).sum(3).to(torch.uint8)  # (B, H, L/per, M)
    if axis == "channel":
        qkv.packed.copy_(packed)
        qkv.scale.copy_(scale)
        qkv.zero.copy_(zero)
    else:
        qkv.packed.copy_(packed.transpose(2, 3))
        qkv.scale.copy_(scale.transpose(2, 3))
        qkv.zero.copy_(zero.transpose(2, 3))
    return qkv


def _check_qkv(qkv: QuantizedKV, who: str, name: str) -> None:
    if not isinstance(qkv, QuantizedKV):
        raise ValueError(f"kvpass: {who} needs {name} to be a QuantizedKV, got {type(qkv).__name__}")
    if qkv.bits not in (1, 2) or qkv.axis not in _AXES:
        raise ValueError(f"kvpass: {who} needs {name} with bits in {{1, 2}} and a known axis, "
                         f"got bits={qkv.bits}, axis={qkv.axis!r}")
    B, H, S, D = qkv.shape
    per, gs = 8 // qkv.bits, qkv.group_size
    n = S if qkv.axis == "channel" else D
    if gs < 1 or gs % per or n % gs:
        raise ValueError(
            f"kvpass: {who} needs {name}.group_size to be a multiple of {per} dividing "
            f"{'S' if qkv.axis == 'channel' else 'D'}={n}, got {gs}"
        )
    if qkv.axis == "channel":
        want_p, want_m = (B, H, S // per, D), (B, H, S // gs, D)
    else:
        want_p, want_m = (B, H, S, D // per), (B, H, S, D // gs)
    if (
        tuple(qkv.packed.shape) != want_p
        or qkv.packed.dtype != torch.uint8
        or tuple(qkv.scale.shape) != want_m
        or tuple(qkv.zero.shape) != want_m
        or qkv.scale.dtype != torch.float16
        or qkv.zero.dtype != torch.float16
    ):
        raise ValueError(
            f"kvpass: {who} needs {name} with packed uint8 {want_p} and fp16 scale/zero {want_m} "
            f"(shape={qkv.shape}, bits={qkv.bits}, axis={qkv.axis!r}), got packed {qkv.packed.dtype} "
            f"{tuple(qkv.packed.shape)}, scale {tuple(qkv.scale.shape)}, zero {tuple(qkv.zero.shape)}"
        )


def dequantize(qkv: QuantizedKV, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpack and dequantise: ``zero + code * scale`` computed in fp32, returned as ``(B, H, S, D)``
    contiguous in ``dtype`` (default ``qkv.dtype``). Plain torch (the reference for the fused kernel)."""
    _check_qkv(qkv, "dequantize", "qkv")
    dtype = qkv.dtype if dtype is None else dtype
    B, H, S, D = qkv.shape
    bits, per, gs = qkv.bits, 8 // qkv.bits, qkv.group_size
    shifts = torch.arange(per, device=qkv.packed.device, dtype=torch.uint8) * bits
    mask = (1 << bits) - 1
    if qkv.axis == "channel":
        codes = (qkv.packed[:, :, :, None, :] >> shifts.view(per, 1)) & mask  # (B, H, S/per, per, D)
        scale = qkv.scale.repeat_interleave(gs, dim=2)
        zero = qkv.zero.repeat_interleave(gs, dim=2)
    else:
        codes = (qkv.packed[..., None] >> shifts) & mask  # (B, H, S, D/per, per)
        scale = qkv.scale.repeat_interleave(gs, dim=3)
        zero = qkv.zero.repeat_interleave(gs, dim=3)
    codes = codes.reshape(B, H, S, D)
    return (zero.float() + codes.float() * scale.float()).to(dtype)


# --------------------------------------------------------------------------------------------------
# Fused decode attention over the quantised cache + a full-precision residual
# --------------------------------------------------------------------------------------------------


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    # One block of keys/values for the G queries of a KV head; base-2 online softmax.
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no exp2(-inf - -inf) = NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _quant_decode_attention_kernel(
    Q, KP, KS, KZ, VP, VS, VZ, KR, VR, OUT,
    stride_qb, stride_qh, stride_qd,
    stride_kpb, stride_kph, stride_kps, stride_kpd,  # key codes (B, H_kv, S_q*bits/8, D)
    stride_ksb, stride_ksh, stride_ksg, stride_ksd,  # key scale/zero (B, H_kv, S_q/gs, D)
    stride_vpb, stride_vph, stride_vps, stride_vpd,  # value codes (B, H_kv, S_q, D*bits/8)
    stride_vsb, stride_vsh, stride_vss, stride_vsg,  # value scale/zero (B, H_kv, S_q, D/gs)
    stride_krb, stride_krh, stride_krs, stride_krd,
    stride_vrb, stride_vrh, stride_vrs, stride_vrd,
    stride_ob, stride_oh, stride_od,
    H_KV, S_Q, R, D, G, GS_K, GS_V,
    qk_scale,  # softmax scale * log2(e)
    BITS_K: tl.constexpr,
    BITS_V: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (B * H_kv,); one program = the G query heads of one KV head, over S_q packed tokens
    # and then R residual tokens. Packed bytes are dequantised in registers (never written back).
    pid = tl.program_id(0)
    b = (pid // H_KV).to(tl.int64)
    hk = (pid % H_KV).to(tl.int64)
    PER_K: tl.constexpr = 8 // BITS_K
    PER_V: tl.constexpr = 8 // BITS_V
    MASK_K: tl.constexpr = (1 << BITS_K) - 1
    MASK_V: tl.constexpr = (1 << BITS_V) - 1

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = hk * G + offs_g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    cdt = Q.dtype.element_ty  # dequantised tiles are rounded to q's dtype, as the reference does

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    kp_base = KP + b * stride_kpb + hk * stride_kph
    ks_base = KS + b * stride_ksb + hk * stride_ksh
    kz_base = KZ + b * stride_ksb + hk * stride_ksh
    vp_base = VP + b * stride_vpb + hk * stride_vph
    vs_base = VS + b * stride_vsb + hk * stride_vsh
    vz_base = VZ + b * stride_vsb + hk * stride_vsh
    # value layout along D is the same for every token: byte column, bit shift and group per channel
    v_byte_col = (offs_d // PER_V).to(tl.int64) * stride_vpd
    v_shift = (offs_d % PER_V) * BITS_V
    v_grp_col = (offs_d // GS_V).to(tl.int64) * stride_vsg

    for start in range(0, S_Q, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < S_Q
        tile = valid[:, None] & mask_d[None, :]
        # keys: per-channel groups of tokens; token n sits in byte row n // PER_K at bit (n % PER_K)
        kb = tl.load(
            kp_base + (offs_n // PER_K).to(tl.int64)[:, None] * stride_kps + offs_d[None, :] * stride_kpd,
            mask=tile,
            other=0,
        ).to(tl.int32)
        kc = ((kb >> ((offs_n % PER_K) * BITS_K)[:, None]) & MASK_K).to(tl.float32)
        k_meta = (offs_n // GS_K).to(tl.int64)[:, None] * stride_ksg + offs_d[None, :] * stride_ksd
        k_scale = tl.load(ks_base + k_meta, mask=tile, other=0.0).to(tl.float32)
        k_zero = tl.load(kz_base + k_meta, mask=tile, other=0.0).to(tl.float32)
        k = (k_zero + kc * k_scale).to(cdt)
        # values: per-token groups of channels; channel d sits in byte d // PER_V at bit (d % PER_V)
        rows = offs_n.to(tl.int64)[:, None]
        vb = tl.load(vp_base + rows * stride_vps + v_byte_col[None, :], mask=tile, other=0).to(tl.int32)
        vc = ((vb >> v_shift[None, :]) & MASK_V).to(tl.float32)
        v_meta = rows * stride_vss + v_grp_col[None, :]
        v_scale = tl.load(vs_base + v_meta, mask=tile, other=0.0).to(tl.float32)
        v_zero = tl.load(vz_base + v_meta, mask=tile, other=0.0).to(tl.float32)
        v = (v_zero + vc * v_scale).to(cdt)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    kr_base = KR + b * stride_krb + hk * stride_krh
    vr_base = VR + b * stride_vrb + hk * stride_vrh
    for start in range(0, R, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < R
        tile = valid[:, None] & mask_d[None, :]
        rows = offs_n.to(tl.int64)[:, None]
        k = tl.load(kr_base + rows * stride_krs + offs_d[None, :] * stride_krd, mask=tile, other=0.0)
        v = tl.load(vr_base + rows * stride_vrs + offs_d[None, :] * stride_vrd, mask=tile, other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # S_q + R >= 1, so only padded query rows have l = 0
    tl.store(
        OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        (acc / l_safe[:, None]).to(OUT.dtype.element_ty),
        mask=mask_g[:, None] & mask_d[None, :],
    )


def _check_attention_inputs(q, kq, vq, k_res, v_res, who: str) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"kvpass: {who} needs q of shape (B, H_q, D), got {getattr(q, 'shape', q)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kvpass: {who} needs q of dtype float16/bfloat16/float32, got {q.dtype}")
    _check_qkv(kq, who, "kq")
    _check_qkv(vq, who, "vq")
    if kq.axis != "channel" or vq.axis != "token":
        raise ValueError(
            f"kvpass: {who} needs kq quantised per channel (axis='channel') and vq per token "
            f"(axis='token'), got kq.axis={kq.axis!r}, vq.axis={vq.axis!r}"
        )
    B, H_q, D = q.shape
    if tuple(kq.shape) != tuple(vq.shape) or kq.shape[0] != B or kq.shape[3] != D:
        raise ValueError(
            f"kvpass: {who} needs kq and vq of one shape (B={B}, H_kv, S_q, D={D}), "
            f"got kq {tuple(kq.shape)}, vq {tuple(vq.shape)}"
        )
    H_kv, S_q = kq.shape[1], kq.shape[2]
    for name, t in (("k_res", k_res), ("v_res", v_res)):
        ok = isinstance(t, torch.Tensor) and t.dim() == 4
        if not ok or (t.shape[0], t.shape[1], t.shape[3]) != (B, H_kv, D):
            raise ValueError(
                f"kvpass: {who} needs {name} of shape (B={B}, H_kv={H_kv}, R, D={D}), "
                f"got {getattr(t, 'shape', t)}"
            )
    if k_res.shape != v_res.shape:
        raise ValueError(
            f"kvpass: {who} needs k_res and v_res of one shape, "
            f"got {tuple(k_res.shape)}, {tuple(v_res.shape)}"
        )
    if k_res.dtype != q.dtype or v_res.dtype != q.dtype:
        raise ValueError(
            f"kvpass: {who} needs k_res, v_res in q's dtype {q.dtype}, got {k_res.dtype}, {v_res.dtype}"
        )
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(
            f"kvpass: {who} needs H_q to be a multiple of H_kv (grouped-query attention), "
            f"got H_q={H_q}, H_kv={H_kv}"
        )
    if S_q + k_res.shape[2] < 1:
        raise ValueError(f"kvpass: {who} needs S_q + R >= 1 tokens to attend to, got S_q={S_q}, R=0")
    tensors = (kq.packed, kq.scale, kq.zero, vq.packed, vq.scale, vq.zero, k_res, v_res)
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"kvpass: {who} needs every input on q's device {q.device}")


def quant_decode_attention(
    q: torch.Tensor,
    kq: QuantizedKV,
    vq: QuantizedKV,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    scale: float | None = None,
    block_n: int = 128,
) -> torch.Tensor:
    """Triton decode attention over a 1/2-bit cache plus a full-precision residual (TailorKV's
    quantisation-friendly layers), dequantising in registers.

    Args:
        q: ``(B, H_q, D)``, one decode query per head, ``H_q = G * H_kv``; any strides.
        kq: keys quantised with ``axis="channel"``, shape ``(B, H_kv, S_q, D)``; S_q may be 0.
        vq: values quantised with ``axis="token"``, the same S_q tokens; its bits may differ from kq's.
        k_res, v_res: ``(B, H_kv, R, D)`` in q's dtype, the tokens after the quantised ones (R may
            be 0, but ``S_q + R >= 1``); any strides.
        scale: softmax scale, default ``1/sqrt(D)``.
        block_n: tokens per loop step (a power of two >= 16).

    Returns:
        ``(B, H_q, D)`` in q's dtype: ``softmax(q K^T * scale) V`` with ``K = cat(dequant(kq), k_res)``,
        ``V = cat(dequant(vq), v_res)`` along tokens, dequantised values rounded to q's dtype.
    """
    who = "quant_decode_attention"
    _check_attention_inputs(q, kq, vq, k_res, v_res, who)
    require_triton(q, who, "quant_decode_attention_ref")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"kvpass: {who} needs block_n to be a power of two >= 16, got {block_n}")
    B, H_q, D = q.shape
    H_kv, S_q, R = kq.shape[1], kq.shape[2], k_res.shape[2]
    G = H_q // H_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    out = torch.empty((B, H_q, D), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    _quant_decode_attention_kernel[(B * H_kv,)](
        q, kq.packed, kq.scale, kq.zero, vq.packed, vq.scale, vq.zero, k_res, v_res, out,
        *q.stride(),
        *kq.packed.stride(), *kq.scale.stride(),
        *vq.packed.stride(), *vq.scale.stride(),
        *k_res.stride(), *v_res.stride(),
        *out.stride(),
        H_kv, S_q, R, D, G, kq.group_size, vq.group_size,
        scale * _LOG2E,
        BITS_K=kq.bits,
        BITS_V=vq.bits,
        BLOCK_G=max(16, triton.next_power_of_2(G)),  # tl.dot needs every dim >= 16
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        DOT_PRECISION="ieee",  # fp32: exact products, no tf32 drift; ignored for fp16
    )
    return out


def quant_decode_attention_ref(
    q: torch.Tensor,
    kq: QuantizedKV,
    vq: QuantizedKV,
    k_res: torch.Tensor,
    v_res: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`quant_decode_attention`: dequantise to q's dtype, concatenate with the
    residual, softmax and products in fp32. Shapes as there; returns ``(B, H_q, D)`` in q's dtype."""
    _check_attention_inputs(q, kq, vq, k_res, v_res, "quant_decode_attention_ref")
    B, H_q, D = q.shape
    H_kv = kq.shape[1]
    G = H_q // H_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    k = torch.cat([dequantize(kq, q.dtype), k_res], dim=2).float()  # (B, H_kv, S_q + R, D)
    v = torch.cat([dequantize(vq, q.dtype), v_res], dim=2).float()
    scores = torch.matmul(q.reshape(B, H_kv, G, D).float(), k.transpose(-1, -2)).mul_(scale)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, H_kv, G, D)
    return out.reshape(B, H_q, D).to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Critical channels and partial-channel top-k (TailorKV's sparsity-friendly layers)
# --------------------------------------------------------------------------------------------------


def critical_channels(q: torch.Tensor, kabs_max: torch.Tensor, n: int) -> torch.Tensor:
    """The n key channels that contribute most to the attention scores of a KV head's queries.

    Args:
        q: ``(B, H_q, D)`` (estimated) queries, ``H_q = G * H_kv``.
        kabs_max: ``(B, H_kv, D)``, ``max_t |K[t, i]|`` per channel.
        n: channels to keep, ``0 <= n <= D``.

    Returns:
        ``(B, H_kv, n)`` int64 channel indices, ascending (gather locality). The score is
        ``s_i = sum_{g in the group} |q_{g,i}| * kabs_max_i`` (fp32); ties go to the lower channel.
    """
    who = "critical_channels"
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        raise ValueError(
            f"kvpass: {who} needs floating-point q of shape (B, H_q, D), got {getattr(q, 'shape', q)}"
        )
    B, H_q, D = q.shape
    if (
        not isinstance(kabs_max, torch.Tensor)
        or kabs_max.dim() != 3
        or kabs_max.shape[0] != B
        or kabs_max.shape[2] != D
        or not kabs_max.is_floating_point()
    ):
        raise ValueError(
            f"kvpass: {who} needs floating-point kabs_max of shape (B={B}, H_kv, D={D}), "
            f"got {getattr(kabs_max, 'shape', kabs_max)}"
        )
    H_kv = kabs_max.shape[1]
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"kvpass: {who} needs H_q to be a multiple of H_kv, got H_q={H_q}, H_kv={H_kv}")
    if not 0 <= n <= D:
        raise ValueError(f"kvpass: {who} needs 0 <= n <= D={D}, got n={n}")
    G = H_q // H_kv
    s = (q.reshape(B, H_kv, G, D).float().abs() * kabs_max.float()[:, :, None, :]).sum(dim=2)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices  # stable: ties -> lower channel
    return order[..., :n].sort(dim=-1).values


@triton.jit
def _partial_scores_kernel(
    Q, KCH, CH, OUT,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kc,
    stride_cb, stride_ch, stride_cn,
    stride_ob, stride_oh, stride_os,
    H_KV, S, LENGTH, D, N_CH, G,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # grid: (B * H_kv, cdiv(S, BLOCK_S)). approx[t] = sum_j (sum_g q[g, ch_j]) * k_ch[t, j]: the
    # group's queries are summed first, so this is one GEMV per KV head (no tl.dot).
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    hk = (pid_bh % H_KV).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    heads = (hk * G + offs_g).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    live = offs_s < LENGTH  # positions >= length are not read (a capacity buffer's tail)
    rows = offs_s.to(tl.int64)

    s = tl.zeros([BLOCK_S], tl.float32)
    for c0 in range(0, N_CH, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask_c = offs_c < N_CH
        ch = tl.load(CH + b * stride_cb + hk * stride_ch + offs_c * stride_cn, mask=mask_c, other=0)
        ch = ch.to(tl.int64)
        ok = mask_c & (ch >= 0) & (ch < D)
        ch = tl.where(ok, ch, 0)  # never form an out-of-bounds address
        qg = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + ch[None, :] * stride_qd,
            mask=mask_g[:, None] & ok[None, :],
            other=0.0,
        ).to(tl.float32)
        q_sum = tl.sum(qg, axis=0)  # (BLOCK_C,)
        kt = tl.load(
            KCH + b * stride_kb + hk * stride_kh + rows[:, None] * stride_ks + offs_c[None, :] * stride_kc,
            mask=live[:, None] & mask_c[None, :],
            other=0.0,
        ).to(tl.float32)
        s += tl.sum(kt * q_sum[None, :], axis=1)
    s = tl.where(live, s, float("-inf"))
    tl.store(OUT + b * stride_ob + hk * stride_oh + rows * stride_os, s, mask=offs_s < S)


def _check_topk_inputs(q, k_ch, ch, k, length, who: str) -> int:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        raise ValueError(
            f"kvpass: {who} needs floating-point q of shape (B, H_q, D), got {getattr(q, 'shape', q)}"
        )
    B, H_q, D = q.shape
    if (
        not isinstance(k_ch, torch.Tensor)
        or k_ch.dim() != 4
        or k_ch.shape[0] != B
        or not k_ch.is_floating_point()
    ):
        raise ValueError(
            f"kvpass: {who} needs floating-point k_ch of shape (B={B}, H_kv, S, n), "
            f"got {getattr(k_ch, 'shape', k_ch)}"
        )
    _, H_kv, S, n = k_ch.shape
    if not isinstance(ch, torch.Tensor) or tuple(ch.shape) != (B, H_kv, n):
        raise ValueError(
            f"kvpass: {who} needs ch of shape (B={B}, H_kv={H_kv}, n={n}) matching k_ch, "
            f"got {getattr(ch, 'shape', ch)}"
        )
    if ch.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kvpass: {who} needs ch of dtype int32 or int64, got {ch.dtype}")
    if n > D:
        raise ValueError(f"kvpass: {who} needs n <= D={D} channels, got n={n}")
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(f"kvpass: {who} needs H_q to be a multiple of H_kv, got H_q={H_q}, H_kv={H_kv}")
    if k_ch.device != q.device or ch.device != q.device:
        raise ValueError(f"kvpass: {who} needs q, k_ch, ch on one device")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"kvpass: {who} needs k >= 0, got k={k}")
    length = S if length is None else int(length)
    if not 0 <= length <= S:
        raise ValueError(f"kvpass: {who} needs 0 <= length <= S={S}, got length={length}")
    return length


def _topk_positions(approx: torch.Tensor, k: int, length: int) -> torch.Tensor:
    """``(B, H_kv, min(k, S))`` int64: positions by descending score, ties -> lower position, NaN as
    -inf; slots beyond the ``length`` valid positions hold -1."""
    kk = min(k, approx.shape[2])
    if kk == 0:
        return approx.new_zeros((*approx.shape[:2], 0), dtype=torch.int64)
    # NaN scores (a non-finite key) rank last, like -inf
    approx = torch.where(approx.isnan(), float("-inf"), approx)
    # A stable sort of all S scores is slow on CPU (8 ms for 3 x 8k); topk finds the k-th score, the
    # tie rule picks among the equal ones by position, and only the k chosen are sorted.
    thr = approx.topk(kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = approx > thr
    eq = approx == thr
    need = kk - above.sum(-1, keepdim=True)
    chosen = above | (eq & (eq.cumsum(-1) <= need))
    # exactly kk positions per row are chosen: take them in position order with a fixed-shape topk
    # (boolean indexing would size its output from the data: a host sync)
    s = approx.shape[2]
    key = torch.where(chosen, s - torch.arange(s, device=approx.device), 0)
    pos = s - key.topk(kk, dim=-1, sorted=True).values
    order = torch.sort(approx.gather(-1, pos), dim=-1, descending=True, stable=True).indices
    idx = pos.gather(-1, order)
    return idx.masked_fill(idx >= length, -1)  # only happens once the valid positions ran out


def partial_topk(
    q: torch.Tensor,
    k_ch: torch.Tensor,
    ch: torch.Tensor,
    k: int,
    length: int | None = None,
    block_s: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TailorKV's approximate top-k: score every cached token with the critical channels only
    (Triton), then pick the k best (torch sort in the launcher).

    Args:
        q: ``(B, H_q, D)`` decode queries, ``H_q = G * H_kv``.
        k_ch: ``(B, H_kv, S, n)`` keys restricted to channels ``ch`` (the prefetched critical key
            cache), any float dtype and strides; S may be a capacity larger than ``length``.
        ch: ``(B, H_kv, n)`` int32/int64 channel indices in ``[0, D)`` (e.g. :func:`critical_channels`).
        k: positions to return (>= 0).
        length: valid positions (default S); positions ``>= length`` score ``-inf``, are not read
            and are never chosen.
        block_s: positions per program (a power of two >= 16).

    Returns:
        ``(idx, approx)``: idx ``(B, H_kv, min(k, S))`` int64 positions by descending approximate
        score (ties -> lower position), padded with -1 where ``k > length``; approx ``(B, H_kv, S)``
        fp32, ``approx[t] = sum_{g in group} sum_j q[g, ch_j] * k_ch[t, j]``.
    """
    who = "partial_topk"
    length = _check_topk_inputs(q, k_ch, ch, k, length, who)
    require_triton(q, who, "partial_topk_ref")
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"kvpass: {who} needs block_s to be a power of two >= 16, got {block_s}")
    B, H_q, D = q.shape
    _, H_kv, S, n = k_ch.shape
    G = H_q // H_kv
    approx = torch.empty((B, H_kv, S), dtype=torch.float32, device=q.device)
    if approx.numel():
        grid = (B * H_kv, triton.cdiv(S, block_s))
        _partial_scores_kernel[grid](
            q, k_ch, ch, approx,
            *q.stride(), *k_ch.stride(), *ch.stride(), *approx.stride(),
            H_kv, S, length, D, n, G,
            BLOCK_G=triton.next_power_of_2(G),
            BLOCK_S=block_s,
            BLOCK_C=min(32, triton.next_power_of_2(max(n, 1))),  # (BLOCK_S, BLOCK_C) tile in registers
        )
    return _topk_positions(approx, k, length), approx


def partial_topk_ref(
    q: torch.Tensor, k_ch: torch.Tensor, ch: torch.Tensor, k: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`partial_topk` (fp32; same shapes and conventions); the CPU path."""
    length = _check_topk_inputs(q, k_ch, ch, k, length, "partial_topk_ref")
    B, H_q, D = q.shape
    _, H_kv, S, n = k_ch.shape
    G = H_q // H_kv
    q_sum = q.reshape(B, H_kv, G, D).float().sum(dim=2).gather(2, ch.long())  # (B, H_kv, n)
    approx = torch.full((B, H_kv, S), float("-inf"), dtype=torch.float32, device=q.device)
    if length:
        live = torch.matmul(k_ch[:, :, :length].float(), q_sum[..., None])[..., 0]
        approx[:, :, :length] = live
    return _topk_positions(approx, k, length), approx


# --------------------------------------------------------------------------------------------------
# CPU: a sparse layer's channels and its whole step list in C
# --------------------------------------------------------------------------------------------------
# On a CPU the host tier is the device's own memory: the fetch scores the candidates from the host tier's
# channel-major keys in place (the rows a GPU's prefetch copies) and lists the positions the attention
# reads in place (kvpass.kernels.cpu_decode). Two C calls replace some twenty torch ops a site.

class QuantArgs(ctypes.Structure):
    """``kvpass_quant_args`` (csrc/kvpass.h): ``kvpass_quant_attention``'s operands, made per call."""

    c_name = "kvpass_quant_args"
    _fields_ = [*native.fields("q* qs_b qs_h kp* kp_b kp_h kp_s ks* kz* km_b km_h km_s vp* vp_b vp_h vp_s vs* vz* "
                               "vm_b vm_h vm_s kr* kr_b kr_h kr_s vr* vr_b vr_h vr_s out* os_b os_h B H G S R D bk bv "
                               "gk gv"),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int64)]


_QUANT_ARGTYPES = [ctypes.POINTER(QuantArgs)]


class TailorSelectArgs(ctypes.Structure):
    """``kvpass_tailor_select_args`` (csrc/kvpass.h): ``kvpass_tailor_select``'s operands."""

    c_name = "kvpass_tailor_select_args"
    _fields_ = native.fields("q* qs_b qs_h kT* kt_bf16 ts_b ts_h ts_d ch* cs_b cs_h first* out* os_b os_h B H G C D "
                             "n_s mid_end k n_r threads qc* qc_b qc_h kabs* a_b a_h ch_out* co_b co_h cos*")


class TailorAppendArgs(ctypes.Structure):
    """``kvpass_tailor_append_args``: ``kvpass_tailor_append``'s operands."""

    c_name = "kvpass_tailor_append_args"
    _fields_ = native.fields("kn* kn_b kn_h kn_t vn* vn_b vn_h vn_t k* k_b k_h k_s v* v_b v_h v_s kt* kt_bf16 t_b t_h "
                             "t_d kabs* a_b a_h B H T D at kn_d vn_d")


class TailorStepArgs(ctypes.Structure):
    """``kvpass_tailor_step_args``: the selection, the append and the attention of one decode step, and the
    attention's rows ``S`` and list length ``N``. :class:`CpuStep` holds one and passes its members to the
    separate entry points."""

    c_name = "kvpass_tailor_step_args"
    _fields_ = [("select", TailorSelectArgs), ("append", TailorAppendArgs), ("attend", cpu_decode.ListedArgs),
                ("S", ctypes.c_int64), ("N", ctypes.c_int64)]


def _cpu_fn(symbol: str, argtypes: list, restype=ctypes.c_int):
    return native.function("tailorkv", symbol, argtypes, restype)


_SELECT_FN = ("kvpass_tailor_select", [ctypes.POINTER(TailorSelectArgs)])
_APPEND_FN = ("kvpass_tailor_append", [ctypes.POINTER(TailorAppendArgs)])
_STEP_FN = ("kvpass_tailor_step", [ctypes.POINTER(TailorStepArgs)])


def cpu_select_available() -> bool:
    """Whether the C functions of a sparse layer's CPU step are built (see :mod:`kvpass.kernels.native`)."""
    return all(_cpu_fn(*f) is not None for f in (_SELECT_FN, _APPEND_FN, _STEP_FN))


def _plain_cpu(t: torch.Tensor, dtype: torch.dtype) -> bool:
    # an empty tensor is never read (and .contiguous() keeps its strides)
    return (type(t) is torch.Tensor and t.is_cpu and t.dtype == dtype
            and (t.stride(-1) == 1 or t.numel() == 0))


def _cpu_fp32(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.is_cpu and t.dtype == torch.float32


def _queries(q: torch.Tensor | None, b: int, d: int) -> bool:
    """Whether ``q`` is an fp32 CPU ``(b, H, D)`` or ``(b, H, 1, D)`` (a decode step's query as the op
    receives it) with a contiguous last dim."""
    return (q is not None and _plain_cpu(q, torch.float32) and q.shape[0] == b and q.shape[-1] == d
            and (q.dim() == 3 or (q.dim() == 4 and q.shape[2] == 1)))


class CpuStep:
    """A sparse layer's decode step on CPU, its fixed operands checked once (a state makes one where the
    buffers change, :meth:`holds`, and checks only the step's queries and tokens after that).

    Args:
        k, v: ``(B, H_kv, cap, D)`` fp32, the host tier (None: no :meth:`append`).
        kT: ``(B, H_kv, D, cap)`` fp32 or bf16, its keys channel-major.
        kabs: ``(B, H_kv, D)`` fp32, the channels' ``max_t |K|`` (None: channels are given to :meth:`select`).
        first: ``(B,)`` int64, each row's first real position in a left-padded batch (None: 0).

    Raises ValueError where these operands are not what the C kernels read (the message names them)."""

    def __init__(self, k: torch.Tensor | None, v: torch.Tensor | None, kT: torch.Tensor,
                 kabs: torch.Tensor | None = None, first: torch.Tensor | None = None):
        self._select_fn, self._append_fn, self._step_fn = (_cpu_fn(*f) for f in (_SELECT_FN, _APPEND_FN, _STEP_FN))
        ok = (self._select_fn is not None and self._append_fn is not None and kT.dim() == 4
              and (_plain_cpu(kT, torch.float32) or _plain_cpu(kT, torch.bfloat16)) and kT.shape[1] > 0)
        b, h, d = kT.shape[:3] if kT.dim() == 4 else (0, 0, 0)
        cap = kT.shape[3] if ok else 0
        if ok and k is not None:
            ok = (v is not None and all(_plain_cpu(x, torch.float32) and x.dim() == 4 for x in (k, v))
                  and tuple(k.shape[:2]) == (b, h) == tuple(v.shape[:2]) and k.shape[3] == d == v.shape[3])
            cap = min(cap, k.shape[2], v.shape[2]) if ok else 0
        ok = ok and (kabs is None or (_plain_cpu(kabs, torch.float32) and tuple(kabs.shape) == (b, h, d)))
        ok = ok and (first is None or (_plain_cpu(first, torch.int64) and tuple(first.shape) == (b,)
                                       and first.is_contiguous()))
        if not ok:
            raise ValueError(
                "kvpass: a TailorKV CPU step needs fp32 or bf16 kT (B, H_kv, D, S), fp32 k, v (B, H_kv, S, D) and "
                "kabs (B, H_kv, D), first None or a contiguous int64 (B,), all CPU with contiguous last dims, and "
                f"the C kernels built; got kT {tuple(kT.shape)} {kT.dtype}, k "
                f"{None if k is None else (tuple(k.shape), k.dtype)}, v {None if v is None else (tuple(v.shape), v.dtype)}, "
                f"kabs {None if kabs is None else (tuple(kabs.shape), kabs.dtype)}, first "
                f"{None if first is None else (tuple(first.shape), first.dtype)}")
        self.k, self.v, self.kT, self.kabs, self.first = k, v, kT, kabs, first
        self.b, self.h, self.d, self.cap = b, h, d, cap
        # the C functions' operands (TailorStepArgs), the fixed ones set here; _sa and _aa are views into _args
        self._args = TailorStepArgs()
        sa = self._sa = self._args.select
        self._listed = cpu_decode.ListedAttend(self._args.attend)  # where select_append_attend runs it
        self._sa_ref, self._step_ref = ctypes.byref(sa), ctypes.byref(self._args)
        kt = (kT.data_ptr(), int(kT.dtype == torch.bfloat16), *kT.stride()[:3])
        kab = (None, 0, 0) if kabs is None else (kabs.data_ptr(), kabs.stride(0), kabs.stride(1))
        sa.kT, sa.kt_bf16, sa.ts_b, sa.ts_h, sa.ts_d = kt
        sa.first = None if first is None else first.data_ptr()
        sa.B, sa.H, sa.D = b, h, d
        sa.kabs, sa.a_b, sa.a_h = kab
        self._aa = None
        if k is not None:
            aa = self._aa = self._args.append
            self._aa_ref = ctypes.byref(aa)
            aa.k, (aa.k_b, aa.k_h, aa.k_s) = k.data_ptr(), k.stride()[:3]
            aa.v, (aa.v_b, aa.v_h, aa.v_s) = v.data_ptr(), v.stride()[:3]
            aa.kt, aa.kt_bf16, aa.t_b, aa.t_h, aa.t_d = kt
            aa.kabs, aa.a_b, aa.a_h = kab
            aa.B, aa.H, aa.D = b, h, d
            self._listed.hold(k, v)  # the attention's cache: this step's own buffers

    def holds(self, k, v, kT, kabs, first) -> bool:
        """Whether this step was made for these very tensors (a replaced buffer needs a new one)."""
        return self.kT is kT and self.k is k and self.v is v and self.kabs is kabs and self.first is first

    def select(self, q: torch.Tensor, n_sinks: int, mid_end: int, k: int, n_recent: int,
               ch: torch.Tensor | None = None, q_c: torch.Tensor | None = None, n_channels: int = 0,
               cos: torch.Tensor | None = None, ch_out: torch.Tensor | None = None) -> torch.Tensor:
        """The positions this step attends (:func:`tailor_select_cpu`), in one C call.

        Args:
            q: ``(B, H_q, D)`` or ``(B, H_q, 1, D)`` fp32, the decode queries, ``H_q = G * H_kv``.
            ch: ``(B, H_kv, C)`` int64 channels to score with; None: picked here, ``n_channels`` per pair,
                from ``q_c`` (q's shape; the estimated query, or q) and ``kabs`` (:func:`critical_channels`),
                and written to ``ch_out (B, H_kv, n_channels)`` int64 when given.
            cos: ``(1,)`` float64; when given, the mean over rows and heads of ``cos(q_c, q)`` is added to it.
        """
        b, h, d = self.b, self.h, self.d
        n = mid_end - n_sinks
        ok = (_queries(q, b, d) and q.shape[1] % h == 0 and 0 <= n_sinks and n >= 0 and k >= 0
              and n_recent >= 0 and mid_end <= self.kT.shape[3])
        if ch is not None:
            ok = ok and _plain_cpu(ch, torch.int64) and ch.dim() == 3 and tuple(ch.shape[:2]) == (b, h)
            c = ch.shape[2] if ok else 0
            chs = (ch.data_ptr(), ch.stride(0), ch.stride(1)) if ok else None
            q_c, qc = None, (None, 0, 0)
        else:
            c = n_channels
            ok = ok and self.kabs is not None and _queries(q_c, b, d) and q_c.shape[1] == q.shape[1] and 0 <= c <= d
            chs = (None, 0, 0)
            qc = (q_c.data_ptr(), q_c.stride(0), q_c.stride(1)) if ok else None
        ok = ok and (cos is None or (q_c is not None and _plain_cpu(cos, torch.float64) and cos.numel() == 1))
        ok = ok and (ch_out is None or (ch is None and _plain_cpu(ch_out, torch.int64) and ch_out.dim() == 3
                                        and tuple(ch_out.shape) == (b, h, c)))
        if not ok:
            raise ValueError(
                "kvpass: tailor_select_cpu needs fp32 CPU q (B, H_q, D) or (B, H_q, 1, D) with a contiguous last "
                "dim, H_q a multiple of H_kv, 0 <= n_sinks <= mid_end <= S, k >= 0, n_recent >= 0, and either "
                "int64 channels ch (B, H_kv, C) or q_c shaped like q with kabs for 0 <= n_channels <= D (cos a "
                f"float64 scalar, ch_out int64 (B, H_kv, n_channels)); got q {tuple(q.shape)} {q.dtype}, kT "
                f"{tuple(self.kT.shape)} {self.kT.dtype}, ch {None if ch is None else (tuple(ch.shape), ch.dtype)}, "
                f"q_c {None if q_c is None else (tuple(q_c.shape), q_c.dtype)}, n_channels={n_channels}, "
                f"n_sinks={n_sinks}, mid_end={mid_end}, k={k}, n_recent={n_recent}")
        out = torch.empty((b, h, n_sinks + min(k, n) + n_recent), dtype=torch.int64)
        if not out.numel():
            return out
        self._fill_select(out, q, chs, c, n_sinks, mid_end, k, n_recent, qc, ch_out, cos)
        self._raise_for(self._select_fn(self._sa_ref))
        return out

    def select_append_attend(self, q: torch.Tensor, n_sinks: int, mid_end: int, k: int, n_recent: int,
                             q_c: torch.Tensor, n_channels: int, cos: torch.Tensor | None, k_new: torch.Tensor,
                             v_new: torch.Tensor, at: int, scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step in one C call: :meth:`select` (the channels picked from ``q_c``), :meth:`append` of
        the step's ``k_new, v_new (B, H_kv, 1, D)`` at ``at``, then the decode attention of ``q (B, H_q, 1,
        D)`` over the listed positions of ``k, v`` (:func:`kvpass.kernels.cpu_decode.decode_step`, read in
        place). Returns ``(idx (B, H_kv, N), out (B, H_q, 1, D))``; None, having done nothing, where one of
        the three would not serve these operands (the caller then makes them one by one)."""
        b, h, d = self.b, self.h, self.d
        n = mid_end - n_sinks
        kb, kh, kt, kd = k_new.shape if k_new.dim() == 4 else (0, 0, 0, 0)
        if not (self._step_fn is not None and self._aa is not None and self.kabs is not None and kt == 1
                and _queries(q, b, d) and q.dim() == 4 and q.shape[1] % h == 0 and _queries(q_c, b, d)
                and q_c.shape[1] == q.shape[1] and 0 <= n_channels <= d and 0 <= n_sinks and n >= 0 and k >= 0
                and n_recent >= 0 and mid_end <= self.kT.shape[3] and (cos is None or (
                    _plain_cpu(cos, torch.float64) and cos.numel() == 1))
                and _cpu_fp32(k_new) and _cpu_fp32(v_new) and (kb, kh, kd) == (b, h, d)
                and v_new.shape == k_new.shape and 0 <= at < self.cap):
            return None
        width = n_sinks + min(k, n) + n_recent
        out = None if width == 0 else self._listed.pack(q, self.k, self.v, self.cap, scale)
        if out is None:
            return None
        idx = torch.empty((b, h, width), dtype=torch.int64)
        self._fill_select(idx, q, (None, 0, 0), n_channels, n_sinks, mid_end, k, n_recent,
                          (q_c.data_ptr(), q_c.stride(0), q_c.stride(1)), None, cos)
        args = self._args
        args.S, args.N = self.cap, width
        self._fill_append(k_new, v_new, at)
        self._raise_for(self._step_fn(self._step_ref))
        return idx, out

    def _fill_select(self, out, q, chs, c, n_sinks, mid_end, k, n_recent, qc, ch_out, cos) -> None:
        a, h = self._sa, self.h
        a.q, a.qs_b, a.qs_h = q.data_ptr(), q.stride(0), q.stride(1)
        a.ch, a.cs_b, a.cs_h = chs
        a.out, a.os_b, a.os_h = out.data_ptr(), out.stride(0), out.stride(1)
        a.G, a.C = q.shape[1] // h, c
        a.n_s, a.mid_end, a.k, a.n_r, a.threads = n_sinks, mid_end, k, n_recent, torch.get_num_threads()
        a.qc, a.qc_b, a.qc_h = qc
        if ch_out is None:
            a.ch_out, a.co_b, a.co_h = None, 0, 0
        else:
            a.ch_out, a.co_b, a.co_h = ch_out.data_ptr(), ch_out.stride(0), ch_out.stride(1)
        a.cos = None if cos is None else cos.data_ptr()

    def _raise_for(self, rc: int) -> None:
        a, d = self._sa, self.d
        n, c = a.mid_end - a.n_s, a.C  # the candidates, the channels
        if rc == -2:
            raise ValueError(f"kvpass: tailor_select_cpu needs the channels ch in [0, D={d})")
        if rc == -3:
            raise ValueError(f"kvpass: tailor_select_cpu needs each row's first position in [0, mid_end - "
                             f"n_sinks = {n}]")
        if rc == -4:
            raise ValueError(f"kvpass: tailor_select_cpu scores at most 256 channels and picks them for head_dim "
                             f"<= 256, got {c} channels, head_dim {d}")
        if rc != 0:
            raise MemoryError("kvpass: tailor_select_cpu could not allocate its scratch")

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, at: int) -> bool:
        """The decode append (:func:`tailor_append_cpu`) into this step's ``k, v, kT, kabs``; False, having
        written nothing, where ``k_new, v_new`` are not fp32 CPU ``(B, H_kv, T, D)`` (any strides: a batched
        step's V comes transposed) or ``[at, at + T)`` leaves the capacity."""
        b, h, t, d = k_new.shape
        if (self._aa is None or self.kabs is None or t == 0 or not _cpu_fp32(k_new) or not _cpu_fp32(v_new)
                or (b, h, d) != (self.b, self.h, self.d) or v_new.shape != k_new.shape or at < 0
                or at + t > self.cap):
            return False
        self._fill_append(k_new, v_new, at)
        self._append_fn(self._aa_ref)
        return True

    def _fill_append(self, k_new: torch.Tensor, v_new: torch.Tensor, at: int) -> None:
        a = self._aa
        ks, vs = k_new.stride(), v_new.stride()
        a.kn, a.kn_b, a.kn_h, a.kn_t = k_new.data_ptr(), ks[0], ks[1], ks[2]
        a.vn, a.vn_b, a.vn_h, a.vn_t = v_new.data_ptr(), vs[0], vs[1], vs[2]
        a.T, a.at, a.kn_d, a.vn_d = k_new.shape[2], at, ks[3], vs[3]


def tailor_select_cpu(
    q: torch.Tensor, kT: torch.Tensor, ch: torch.Tensor, n_sinks: int, mid_end: int, k: int, n_recent: int,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """The positions a sparse layer's decode step attends, in one C call (fp32 CPU).

    Args:
        q: ``(B, H_q, D)`` the decode queries, ``H_q = G * H_kv``; contiguous last dim.
        kT: ``(B, H_kv, D, S)`` fp32 or bf16, the host tier's keys channel-major (S a capacity >=
            ``mid_end``); a bf16 copy is read as its fp32 values.
        ch: ``(B, H_kv, C)`` int64 critical channels (:func:`critical_channels`).
        n_sinks, mid_end, k, n_recent: the sinks ``[0, n_sinks)``, the candidates ``[n_sinks, mid_end)``,
            the top-k, the recent tokens ``[mid_end, mid_end + n_recent)``.
        first: ``(B,)`` int64, each row's first real position in a left-padded batch (None: 0): row ``b``'s
            sinks are ``[f_b, f_b + n_sinks)`` and its candidates ``[f_b + n_sinks, mid_end)``.

    Returns:
        ``(B, H_kv, n_sinks + min(k, mid_end - n_sinks) + n_recent)`` int64: the sinks, the top k
        candidates of :func:`partial_topk_ref`'s scores (``sum_j (sum_g q_g)[ch_j] * K[t, ch_j]``; NaN
        as -inf; ties to the lower position) in position order (every candidate when there are at most
        k), then the recent tokens; a padded row with fewer candidates than the list has room for ends
        with -1 (skipped by the attention). :meth:`CpuStep.select` also picks the channels.
    """
    return CpuStep(None, None, kT, None, first).select(q, n_sinks, mid_end, k, n_recent, ch=ch)


def quant_attention_cpu_supports(q, kq: QuantizedKV, vq: QuantizedKV, k_res, v_res) -> bool:
    """Whether :func:`quant_decode_attention_cpu` serves these operands: fp32 CPU q and residual, a query
    group of at most 16, head_dim at most 256, contiguous last dims, scales and zeros sharing strides."""
    ts = (kq.packed, kq.scale, kq.zero, vq.packed, vq.scale, vq.zero, k_res, v_res)
    return (
        _cpu_fn("kvpass_quant_attention", _QUANT_ARGTYPES) is not None
        and _plain_cpu(q, torch.float32) and _plain_cpu(k_res, torch.float32) and _plain_cpu(v_res, torch.float32)
        and all(type(t) is torch.Tensor and t.device.type == "cpu" and (t.stride(-1) == 1 or t.numel() == 0)
                for t in ts)
        and kq.scale.stride() == kq.zero.stride() and vq.scale.stride() == vq.zero.stride()
        and q.shape[2] <= 256 and q.shape[1] // max(1, kq.shape[1]) <= 16
    )


def quant_decode_attention_cpu(q, kq: QuantizedKV, vq: QuantizedKV, k_res, v_res, scale: float | None = None):
    """:func:`quant_decode_attention` on CPU, in one C call: the codes are unpacked in registers (a key
    is ``zero + code * scale``, so ``q . k = q . zero + (q * scale) . code`` per key group) and nothing is
    dequantised into memory; the ``(B, H_kv)`` pairs are split over torch's thread count (the output does
    not depend on it). Shapes and result as there, fp32 (:func:`quant_attention_cpu_supports`); equal
    to :func:`quant_decode_attention_ref` up to the order of fp32 sums."""
    who = "quant_decode_attention_cpu"
    _check_attention_inputs(q, kq, vq, k_res, v_res, who)
    if not quant_attention_cpu_supports(q, kq, vq, k_res, v_res):
        raise ValueError(f"kvpass: {who} needs fp32 CPU q and residual with contiguous last dims, a query group "
                         "<= 16, head_dim <= 256, and the C kernel built (kvpass.kernels.tailorkv."
                         "quant_attention_cpu_supports)")
    fn = _cpu_fn("kvpass_quant_attention", _QUANT_ARGTYPES)
    B, H_q, D = q.shape
    H, S, R = kq.shape[1], kq.shape[2], k_res.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty((B, H_q, D), dtype=torch.float32)
    if out.numel() == 0:
        return out
    rc = fn(QuantArgs(
        q.data_ptr(), q.stride(0), q.stride(1),
        kq.packed.data_ptr(), *kq.packed.stride()[:3], kq.scale.data_ptr(), kq.zero.data_ptr(), *kq.scale.stride()[:3],
        vq.packed.data_ptr(), *vq.packed.stride()[:3], vq.scale.data_ptr(), vq.zero.data_ptr(), *vq.scale.stride()[:3],
        k_res.data_ptr(), *k_res.stride()[:3], v_res.data_ptr(), *v_res.stride()[:3],
        out.data_ptr(), out.stride(0), out.stride(1),
        B, H, H_q // H, S, R, D, kq.bits, vq.bits, kq.group_size, vq.group_size, float(scale),
        torch.get_num_threads()))
    if rc != 0:
        raise MemoryError(f"kvpass: {who} could not allocate its scratch (rc={rc})")
    return out


def tailor_append_cpu(k_new: torch.Tensor, v_new: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kT: torch.Tensor, kabs: torch.Tensor, at: int) -> bool:
    """A sparse layer's decode append in one C call: ``k_new, v_new (B, H, T, D)`` into the host tier
    ``k, v (B, H, cap, D)`` at ``[at, at + T)``, the keys into the channel-major ``kT (B, H, D, cap)``
    (bfloat16, rounded as torch rounds, or fp32) and ``kabs (B, H, D) = max(kabs, |k_new|)`` over the new
    tokens, in place. fp32 CPU tensors (k, v, kabs with contiguous last dims; kT bf16 or fp32); returns
    False, having written nothing, where these operands do not qualify or the C library is not built (the
    caller then runs its torch ops)."""
    try:
        step = CpuStep(k, v, kT, kabs)
    except ValueError:
        return False
    return step.append(k_new, v_new, at)

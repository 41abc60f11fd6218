"""TailorKV (ACL 2025 Findings, arXiv 2505.19586) kernels: quantise-and-pack, fused decode attention over
the packed cache, critical channels and partial-channel top-k. Triton kernels (run by the interpreter on
CPU) against their torch references, and the references against independent routes (a hand-decoded bit
layout, per-group properties, SDPA over repeated K/V, exactly representable caches, naive loops)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvpass.kernels.sparse_attention import sparse_decode_attention_ref
from kvpass.kernels.tailorkv import (
    CpuStep,
    QuantizedKV,
    cpu_select_available,
    critical_channels,
    dequantize,
    partial_topk,
    partial_topk_ref,
    quant_attention_cpu_supports,
    quant_decode_attention,
    quant_decode_attention_cpu,
    quant_decode_attention_ref,
    quantize_pack,
    quantize_pack_ref,
    tailor_append_cpu,
    tailor_select_cpu,
)
from strategies import (
    DTYPES,
    GQA_GROUPS,
    HEAD_DIMS,
    SEEDS,
    TOL,
    TOL_SCORES,
    QuantAttentionProblem,
    QuantProblem,
    TopKProblem,
    make_quant_input,
    make_quant_values,
    make_strided,
    quant_attention_problems,
    quant_problems,
    topk_problems,
)


def assert_attention_close(actual, expected, q, kq, vq, k_res, v_res, scale=None):
    """TOL plus the conditioning of the logits: an fp32 logit carries a rounding error of about
    2**-24 * scale * sum_d |q_d k_d| (large with outlier key channels, whatever the sum is), and the
    output moves by that times max |v|; 8x margin over the worst ratio measured."""
    dtype = q.dtype
    B, H_q, D = q.shape
    G = H_q // kq.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = torch.cat([dequantize(kq, dtype), k_res], 2).float().repeat_interleave(G, dim=1)
    v = torch.cat([dequantize(vq, dtype), v_res], 2).float()
    cond = scale * (q.float().abs()[:, :, None, :] * k.abs()).sum(-1).amax().item()
    atol, rtol = TOL[dtype]
    atol += 8 * 2.0**-24 * cond * v.abs().amax().item()
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def assert_same_qkv(a: QuantizedKV, b: QuantizedKV):
    for field in ("bits", "group_size", "axis", "shape", "dtype"):
        assert getattr(a, field) == getattr(b, field), field
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)


# --------------------------------------------------------------------------------------------------
# Quantise and pack
# --------------------------------------------------------------------------------------------------


def grouped(t: torch.Tensor, group_size: int, axis: str) -> torch.Tensor:
    """``(B, H, S, D)`` -> ``(B, H, n_groups, M, group_size)``: one row per (scale, zero) group."""
    B, H, S, D = t.shape
    if axis == "channel":
        return t.reshape(B, H, S // group_size, group_size, D).transpose(3, 4)
    return t.reshape(B, H, S, D // group_size, group_size).transpose(2, 3)


def meta_grouped(m: torch.Tensor, axis: str) -> torch.Tensor:
    """scale/zero in the (B, H, n_groups, M, 1) order of :func:`grouped`."""
    return (m if axis == "channel" else m.transpose(2, 3))[..., None]


def naive_codes(qkv: QuantizedKV) -> torch.Tensor:
    """Decode every code with Python loops over the packed bytes (an independent reading of the layout:
    code of grouped position p = bits [(p % per) * bits, ...) of byte p // per)."""
    B, H, S, D = qkv.shape
    per, mask = 8 // qkv.bits, (1 << qkv.bits) - 1
    packed = qkv.packed.tolist()
    codes = torch.empty((B, H, S, D), dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            for s in range(S):
                for d in range(D):
                    if qkv.axis == "channel":
                        p, byte = s, packed[b][h][s // per][d]
                    else:
                        p, byte = d, packed[b][h][s][d // per]
                    codes[b, h, s, d] = (byte >> ((p % per) * qkv.bits)) & mask
    return codes


@given(p=quant_problems(), block_r=st.sampled_from([None, 128]))
def test_quantize_kernel_matches_ref_bit_exactly(p: QuantProblem, block_r):
    x = make_quant_input(p)
    got = quantize_pack(x, p.bits, p.group_size, p.axis, block_r=block_r)
    want = quantize_pack_ref(x, p.bits, p.group_size, p.axis)
    assert_same_qkv(got, want)
    # sizes are exactly what the bit width says
    n_groups = x.numel() // p.group_size
    assert got.packed.dtype == torch.uint8 and got.packed.numel() == x.numel() * p.bits // 8
    assert got.scale.dtype == got.zero.dtype == torch.float16
    if p.axis == "channel":
        assert got.packed.shape == (p.B, p.H, p.S * p.bits // 8, p.D)
        assert got.scale.shape == got.zero.shape == (p.B, p.H, p.S // p.group_size, p.D)
    else:
        assert got.packed.shape == (p.B, p.H, p.S, p.D * p.bits // 8)
        assert got.scale.shape == got.zero.shape == (p.B, p.H, p.S, p.D // p.group_size)
    assert got.scale.numel() == n_groups
    assert got.nbytes() == x.numel() * p.bits // 8 + 2 * 2 * n_groups
    assert got.shape == (p.B, p.H, p.S, p.D) and got.dtype == p.dtype


@given(p=quant_problems())
def test_dequantized_values_respect_their_groups(p: QuantProblem):
    """Per group: values within [min, max], on the 2**bits levels zero + c * scale, within scale/2 of the
    input, and constant groups exact.

    Tolerance (``slack``): the fp16 roundings of zero, of L * scale and (fp16 inputs) of the output each
    move a value by at most 2**-11 of the group's magnitude, so ``slack = 2**-8 * max(|min|, |max|) +
    2**-22`` (the absolute term covers fp16 subnormal scales)."""
    x = make_quant_input(p)
    qkv = quantize_pack_ref(x, p.bits, p.group_size, p.axis)
    xhat = dequantize(qkv)
    assert xhat.dtype == p.dtype and xhat.shape == x.shape
    L = (1 << p.bits) - 1

    xg = grouped(x.float(), p.group_size, p.axis)
    hg = grouped(xhat.float(), p.group_size, p.axis)
    gmin, gmax = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    scale = meta_grouped(qkv.scale, p.axis).float()
    zero = meta_grouped(qkv.zero, p.axis).float()
    slack = 2.0**-8 * torch.maximum(gmin.abs(), gmax.abs()) + 2.0**-22

    assert (hg >= gmin - slack).all() and (hg <= gmax + slack).all()
    assert ((hg - xg).abs() <= scale / 2 + slack).all()
    # only the 2**bits levels (1 bit: zero and zero + scale), computed as dequantize rounds them
    levels = torch.stack([(zero + c * scale).to(p.dtype).float() for c in range(L + 1)], dim=-1)
    assert (hg[..., None] == levels).any(-1).all()
    # constant groups (fp16-representable constants by construction) come back exactly
    const = gmax == gmin
    assert torch.equal(torch.where(const, hg, 0.0), torch.where(const, xg, 0.0))
    if p.values == "constant_groups":
        assert const.any()


@given(
    axis=st.sampled_from(["channel", "token"]),
    bits=st.sampled_from([1, 2]),
    dtype=DTYPES,
    seed=SEEDS,
)
def test_packed_layout_decodes_with_naive_loops(axis, bits, dtype, seed):
    """dequantize's vectorised unpacking equals a byte-by-byte decoding of the documented layout."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((2, 2, 16, 16), generator=gen).to(dtype)
    qkv = quantize_pack(x, bits, 8, axis)
    codes = naive_codes(qkv)
    assert codes.max() <= (1 << bits) - 1
    gs = qkv.group_size
    dim = 2 if axis == "channel" else 3
    scale = qkv.scale.float().repeat_interleave(gs, dim=dim)
    zero = qkv.zero.float().repeat_interleave(gs, dim=dim)
    assert torch.equal(dequantize(qkv), (zero + codes.float() * scale).to(dtype))


@pytest.mark.parametrize("fn", [quantize_pack, quantize_pack_ref])
def test_bit_layout_by_hand(fn):
    """Little-endian within the byte: code i of a byte at bits [i * bits, (i + 1) * bits)."""
    bits1 = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1], dtype=torch.float32)  # 2 + 16 + 32 + 128 = 178
    q = fn(bits1.view(1, 1, 8, 1), 1, 8, "channel")
    assert q.packed.flatten().tolist() == [178]
    assert q.zero.item() == 0.0 and q.scale.item() == 1.0
    q = fn(bits1.view(1, 1, 1, 8), 1, 8, "token")
    assert q.packed.flatten().tolist() == [178]
    two = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0]) * 0.5 - 1.0  # zero -1, scale 0.5
    q = fn(two.view(1, 1, 8, 1), 2, 4, "channel")  # 0|1<<2|2<<4|3<<6 = 228, 3|2<<2|1<<4 = 27
    assert q.packed.flatten().tolist() == [228, 27]
    assert q.zero.flatten().tolist() == [-1.0, -1.0] and q.scale.flatten().tolist() == [0.5, 0.5]
    assert torch.equal(dequantize(q).flatten(), two)


def test_round_half_up_and_clamp():
    """code = floor(t + 1/2): exact halves go up; 2 bits over [0, 3] with a midpoint 1.5 -> code 2."""
    x = torch.tensor([0.0, 1.5, 0.5, 3.0]).view(1, 1, 1, 4)
    for fn in (quantize_pack, quantize_pack_ref):
        q = fn(x, 2, 4, "token")
        assert q.packed.item() == 0 | (2 << 2) | (1 << 4) | (3 << 6)
        assert torch.equal(dequantize(q).flatten(), torch.tensor([0.0, 2.0, 1.0, 3.0]))


def test_quantize_empty_and_single_group():
    for fn in (quantize_pack, quantize_pack_ref):
        q = fn(torch.zeros((2, 3, 0, 16)), 1, 8, "channel")
        assert q.packed.shape == (2, 3, 0, 16) and q.scale.shape == (2, 3, 0, 16) and q.nbytes() == 0
        assert dequantize(q).shape == (2, 3, 0, 16)
        q = fn(torch.full((1, 1, 8, 1), 2.5, dtype=torch.float16), 1, 8, "channel")
        assert q.scale.item() == 0.0 and q.packed.item() == 0
        assert torch.equal(dequantize(q), torch.full((1, 1, 8, 1), 2.5, dtype=torch.float16))


@pytest.mark.parametrize("fn", [quantize_pack, quantize_pack_ref])
def test_quantize_errors(fn):
    x = torch.randn((1, 2, 16, 16))
    with pytest.raises(ValueError, match=r"kvpass: .*bits in \{1, 2\}, got bits=4"):
        fn(x, 4, 8, "channel")
    with pytest.raises(ValueError, match="kvpass: .*axis 'channel' .* got axis='head'"):
        fn(x, 1, 8, "head")
    with pytest.raises(ValueError, match=r"kvpass: .*multiple of 8 // bits = 8 .*got group_size=4"):
        fn(x, 1, 4, "channel")
    with pytest.raises(ValueError, match=r"kvpass: .*S % group_size == 0 for axis='channel', got S=12"):
        fn(x[:, :, :12], 2, 8, "channel")
    with pytest.raises(ValueError, match=r"kvpass: .*D % group_size == 0 for axis='token', got D=16"):
        fn(x, 2, 12, "token")
    with pytest.raises(ValueError, match="kvpass: .*x of shape"):
        fn(x[0], 1, 8, "channel")
    with pytest.raises(ValueError, match="kvpass: .*x of dtype"):
        fn(x.to(torch.int32), 1, 8, "channel")


# --------------------------------------------------------------------------------------------------
# Fused decode attention
# --------------------------------------------------------------------------------------------------


def make_quant_attention_inputs(p: QuantAttentionProblem):
    """``(q, kq, vq, k_res, v_res)``; keys have outlier channels, as real keys do."""
    gen = torch.Generator().manual_seed(p.seed)
    if p.q_strided:
        q = torch.randn((p.B, p.H_q, p.D + 8), generator=gen)[:, :, 4 : 4 + p.D].to(p.dtype)
    else:
        q = torch.randn((p.B, p.H_q, p.D), generator=gen).to(p.dtype)
    shape = (p.B, p.H_kv, p.S_q, p.D)
    k = make_strided(make_quant_values(shape, p.dtype, "outliers", p.k_group, "channel", gen), p.layout)
    v = make_strided(make_quant_values(shape, p.dtype, "randn", p.v_group, "token", gen), p.layout)
    kq = quantize_pack_ref(k, p.k_bits, p.k_group, "channel")
    vq = quantize_pack_ref(v, p.v_bits, p.v_group, "token")
    res = (p.B, p.H_kv, p.R, p.D)
    k_res = make_strided(torch.randn(res, generator=gen).to(p.dtype), p.layout)
    v_res = make_strided(torch.randn(res, generator=gen).to(p.dtype), p.layout)
    return q, kq, vq, k_res, v_res


@given(p=quant_attention_problems(), block_n=st.sampled_from([32, 128]))
def test_attention_kernel_matches_ref(p: QuantAttentionProblem, block_n: int):
    q, kq, vq, k_res, v_res = make_quant_attention_inputs(p)
    out = quant_decode_attention(q, kq, vq, k_res, v_res, block_n=block_n)
    assert out.dtype == q.dtype and out.shape == (p.B, p.H_q, p.D)
    assert not out.isnan().any()
    assert_attention_close(out, quant_decode_attention_ref(q, kq, vq, k_res, v_res), q, kq, vq, k_res, v_res)


@given(p=quant_attention_problems())
def test_attention_ref_equals_sdpa_over_dequantized_cache(p: QuantAttentionProblem):
    q, kq, vq, k_res, v_res = make_quant_attention_inputs(p)
    k = torch.cat([dequantize(kq), k_res], dim=2).float().repeat_interleave(p.G, dim=1)
    v = torch.cat([dequantize(vq), v_res], dim=2).float().repeat_interleave(p.G, dim=1)
    want = F.scaled_dot_product_attention(q.float()[:, :, None], k, v)[:, :, 0]
    assert_attention_close(quant_decode_attention_ref(q, kq, vq, k_res, v_res), want, q, kq, vq, k_res, v_res)


def exactly_quantisable(shape, bits, group_size, axis, gen):
    """Every group holds values in {a, a + L} (a a small integer per group): 1- and 2-bit quantisation
    is exact (scale L / L = 1, or 0 for a constant group)."""
    B, H, S, D = shape
    L = (1 << bits) - 1
    if axis == "channel":
        a = torch.randint(-4, 5, (B, H, S // group_size, 1, D), generator=gen)
        a = a.expand(-1, -1, -1, group_size, -1)
    else:
        a = torch.randint(-4, 5, (B, H, S, D // group_size, 1), generator=gen)
        a = a.expand(-1, -1, -1, -1, group_size)
    a = a.reshape(shape).float()
    return a + L * torch.randint(0, 2, shape, generator=gen).float()


@given(p=quant_attention_problems(max_s=128, max_r=16))
def test_attention_kernel_on_exact_cache_equals_plain_attention(p: QuantAttentionProblem):
    """Independent of dequantize(): when quantisation is lossless, the fused kernel equals decode
    attention over the original K/V."""
    gen = torch.Generator().manual_seed(p.seed)
    q = (torch.randn((p.B, p.H_q, p.D), generator=gen) * 0.3).to(p.dtype)
    shape = (p.B, p.H_kv, p.S_q, p.D)
    k = exactly_quantisable(shape, p.k_bits, p.k_group, "channel", gen).to(p.dtype)
    v = exactly_quantisable(shape, p.v_bits, p.v_group, "token", gen).to(p.dtype)
    k_res = torch.randn((p.B, p.H_kv, p.R, p.D), generator=gen).to(p.dtype)
    v_res = torch.randn((p.B, p.H_kv, p.R, p.D), generator=gen).to(p.dtype)
    kq = quantize_pack(make_strided(k, p.layout), p.k_bits, p.k_group, "channel")
    vq = quantize_pack(make_strided(v, p.layout), p.v_bits, p.v_group, "token")
    assert torch.equal(dequantize(kq), k) and torch.equal(dequantize(vq), v)
    out = quant_decode_attention(q, kq, vq, k_res, v_res, scale=0.2)
    want = sparse_decode_attention_ref(q, torch.cat([k, k_res], 2), torch.cat([v, v_res], 2), scale=0.2)
    assert_attention_close(out, want, q, kq, vq, k_res, v_res, scale=0.2)
    if p.dtype == torch.float32:  # the CPU's C kernel, against the same independent attention
        out = quant_decode_attention_cpu(q, kq, vq, k_res, v_res, scale=0.2)
        assert_attention_close(out, want, q, kq, vq, k_res, v_res, scale=0.2)


@given(p=quant_attention_problems())
def test_attention_cpu_kernel_matches_ref(p: QuantAttentionProblem):
    """The C kernel (fp32 CPU): the codes unpacked in registers, against dequantise-then-attend."""
    q, kq, vq, k_res, v_res = make_quant_attention_inputs(p)
    q, k_res, v_res = q.float(), k_res.float(), v_res.float()
    if not quant_attention_cpu_supports(q, kq, vq, k_res, v_res):
        assert p.layout == "d_strided" or p.q_strided  # a last dim that is not contiguous: the torch path
        q, k_res, v_res = q.contiguous(), k_res.contiguous(), v_res.contiguous()
    out = quant_decode_attention_cpu(q, kq, vq, k_res, v_res)
    assert out.dtype == torch.float32 and out.shape == (p.B, p.H_q, p.D) and not out.isnan().any()
    assert_attention_close(out, quant_decode_attention_ref(q, kq, vq, k_res, v_res), q, kq, vq, k_res, v_res)


def quant_case(seed, B, H_q, H_kv, S, D, R, bits, k_group, v_group):
    """``(q, kq, vq, k_res, v_res)`` of random fp32 values: the codes packed by the reference."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, D, generator=gen)
    k, v = torch.randn(B, H_kv, S, D, generator=gen), torch.randn(B, H_kv, S, D, generator=gen)
    kq, vq = quantize_pack_ref(k, bits[0], k_group, "channel"), quantize_pack_ref(v, bits[1], v_group, "token")
    kr, vr = torch.randn(B, H_kv, R, D, generator=gen), torch.randn(B, H_kv, R, D, generator=gen)
    return q, kq, vq, kr, vr


@pytest.mark.parametrize("bits", [(1, 1), (2, 1)])
def test_attention_cpu_kernel_splits_its_pairs_over_threads(bits):
    """Enough (row, head) pairs and tokens for the C kernel to split them over two threads: the same output
    as one thread, bit for bit (a pair is one thread's work), and the reference's."""
    q, kq, vq, kr, vr = quant_case(5, 2, 6, 2, 4096, 64, 7, bits, 64, 64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_decode_attention_cpu(q, kq, vq, kr, vr)
        torch.set_num_threads(2)
        two = quant_decode_attention_cpu(q, kq, vq, kr, vr)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)
    assert_attention_close(two, quant_decode_attention_ref(q, kq, vq, kr, vr), q, kq, vq, kr, vr)


@pytest.mark.parametrize("bits", [(1, 1), (2, 2)])
def test_attention_cpu_kernel_at_its_largest_group_and_head_dim(bits):
    """The vector path at the most it serves, a group of 16 queries and head_dim 256 (its accumulators
    and per-chunk scales sized for them), against the reference."""
    q, kq, vq, kr, vr = quant_case(3, 1, 32, 2, 128, 256, 3, bits, 32, 64)
    want = quant_decode_attention_ref(q, kq, vq, kr, vr)
    assert_attention_close(quant_decode_attention_cpu(q, kq, vq, kr, vr), want, q, kq, vq, kr, vr)


@pytest.mark.parametrize("bits", [(1, 1), (2, 2), (1, 2)])
def test_attention_cpu_kernel_off_the_vector_path(bits):
    """head_dim 24 (not a multiple of 16: the scalar loops) and a group of 16 queries, the most it serves."""
    q, kq, vq, kr, vr = quant_case(2, 1, 32, 2, 48, 24, 5, bits, 8, 8)
    want = quant_decode_attention_ref(q, kq, vq, kr, vr)
    assert_attention_close(quant_decode_attention_cpu(q, kq, vq, kr, vr), want, q, kq, vq, kr, vr)
    assert not quant_attention_cpu_supports(torch.randn(1, 34, 24), kq, vq, kr, vr)  # a group of 17
    with pytest.raises(ValueError, match="query group"):
        quant_decode_attention_cpu(q.half(), kq, vq, kr.half(), vr.half())


def _explicit(S_q, R, G, dtype=torch.float32, bits=(1, 2), seed=0):
    p = QuantAttentionProblem(
        dtype=dtype, B=2, H_kv=2, G=G, S_q=S_q, R=R, D=64, k_bits=bits[0], v_bits=bits[1], k_group=16,
        v_group=32, layout="bshd", q_strided=True, seed=seed,
    )
    return p, make_quant_attention_inputs(p)


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_residual_only(G, dtype):
    """S_q = 0: plain attention over the residual."""
    p, (q, kq, vq, k_res, v_res) = _explicit(0, 37, G, dtype)
    want = sparse_decode_attention_ref(q, k_res, v_res)
    for fn in (quant_decode_attention, quant_decode_attention_ref):
        assert_attention_close(fn(q, kq, vq, k_res, v_res), want, q, kq, vq, k_res, v_res)


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("bits", [(1, 1), (2, 2), (1, 2)])
def test_attention_quantised_only(G, bits):
    """R = 0: attention over the dequantised cache alone (several loop blocks, the last partial)."""
    p, (q, kq, vq, k_res, v_res) = _explicit(160, 0, G, bits=bits)
    want = sparse_decode_attention_ref(q, dequantize(kq), dequantize(vq))
    args = (q, kq, vq, k_res, v_res)
    assert_attention_close(quant_decode_attention(*args, block_n=64), want, *args)
    assert_attention_close(quant_decode_attention_ref(*args), want, *args)


def test_attention_single_token():
    p, (q, kq, vq, k_res, v_res) = _explicit(0, 1, 3)
    for fn in (quant_decode_attention, quant_decode_attention_ref):
        torch.testing.assert_close(fn(q, kq, vq, k_res, v_res), v_res[:, :, 0].repeat_interleave(3, dim=1))


@pytest.mark.parametrize("fn", [quant_decode_attention, quant_decode_attention_ref])
def test_attention_errors(fn):
    p, (q, kq, vq, k_res, v_res) = _explicit(32, 4, 3)
    with pytest.raises(ValueError, match="kvpass: .*kq quantised per channel .*vq per token"):
        fn(q, vq, kq, k_res, v_res)
    with pytest.raises(ValueError, match=r"kvpass: .*S_q \+ R >= 1"):
        _, (q0, kq0, vq0, _, _) = _explicit(0, 1, 3)
        fn(q0, kq0, vq0, k_res[:, :, :0], v_res[:, :, :0])
    with pytest.raises(ValueError, match="kvpass: .*k_res, v_res in q's dtype"):
        fn(q, kq, vq, k_res.half(), v_res.half())
    with pytest.raises(ValueError, match="kvpass: .*H_q to be a multiple of H_kv"):
        fn(q[:, :5], kq, vq, k_res, v_res)
    with pytest.raises(ValueError, match="kvpass: .*k_res and v_res of one shape"):
        fn(q, kq, vq, k_res, v_res[:, :, :2])
    with pytest.raises(ValueError, match="kvpass: .*kq and vq of one shape"):
        fn(q, kq, quantize_pack_ref(torch.randn(2, 2, 16, 64), 1, 8, "token"), k_res, v_res)
    with pytest.raises(ValueError, match="kvpass: .*kq to be a QuantizedKV"):
        fn(q, torch.zeros(1), vq, k_res, v_res)


def test_launcher_errors(monkeypatch):
    p, (q, kq, vq, k_res, v_res) = _explicit(32, 4, 1)
    with pytest.raises(ValueError, match="kvpass: quant_decode_attention needs block_n to be a power of two"):
        quant_decode_attention(q, kq, vq, k_res, v_res, block_n=48)
    with pytest.raises(ValueError, match="kvpass: quantize_pack needs block_r to be a power of two"):
        quantize_pack(torch.randn(1, 1, 8, 8), 1, 8, "channel", block_r=3)
    with pytest.raises(ValueError, match="kvpass: partial_topk needs block_s to be a power of two"):
        partial_topk(q, torch.randn(2, 2, 5, 3), torch.zeros((2, 2, 3), dtype=torch.int64), 2, block_s=8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: .*use quant_decode_attention_ref on CPU"):
        quant_decode_attention(q, kq, vq, k_res, v_res)
    with pytest.raises(RuntimeError, match="kvpass: .*use quantize_pack_ref on CPU"):
        quantize_pack(torch.randn(1, 1, 8, 8), 1, 8, "channel")
    with pytest.raises(RuntimeError, match="kvpass: .*use partial_topk_ref on CPU"):
        partial_topk(q, torch.randn(2, 2, 5, 3), torch.zeros((2, 2, 3), dtype=torch.int64), 2)


# --------------------------------------------------------------------------------------------------
# Critical channels
# --------------------------------------------------------------------------------------------------


def naive_critical_channels(q, kabs_max, n):
    B, H_q, D = q.shape
    H_kv = kabs_max.shape[1]
    G = H_q // H_kv
    out = torch.empty((B, H_kv, n), dtype=torch.int64)
    for b in range(B):
        for hk in range(H_kv):
            s = [
                sum(abs(float(q[b, hk * G + g, i])) * float(kabs_max[b, hk, i]) for g in range(G))
                for i in range(D)
            ]
            best = sorted(range(D), key=lambda i: (-s[i], i))[:n]
            out[b, hk] = torch.tensor(sorted(best), dtype=torch.int64)
    return out


@given(
    dtype=DTYPES, B=st.integers(1, 2), H_kv=st.integers(1, 3), G=GQA_GROUPS, D=HEAD_DIMS,
    n_frac=st.floats(0, 1), seed=SEEDS,
)
def test_critical_channels_match_naive_loop(dtype, B, H_kv, G, D, n_frac, seed):
    """Small integers: scores are exact and ties frequent (ties -> lower channel)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, H_kv * G, D), generator=gen).to(dtype)
    kabs_max = torch.randint(0, 4, (B, H_kv, D), generator=gen).to(dtype)
    n = round(n_frac * D)
    got = critical_channels(q, kabs_max, n)
    assert got.dtype == torch.int64 and got.shape == (B, H_kv, n)
    assert torch.equal(got, naive_critical_channels(q, kabs_max, n))


@given(dtype=DTYPES, G=GQA_GROUPS, D=HEAD_DIMS, n=st.integers(1, 16), seed=SEEDS)
def test_critical_channels_separate_kept_from_dropped(dtype, G, D, n, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((2, 2 * G, D), generator=gen).to(dtype)
    k = torch.randn((2, 2, 50, D), generator=gen).to(dtype)
    kabs_max = k.abs().amax(dim=2)
    ch = critical_channels(q, kabs_max, n)
    assert (ch[..., 1:] > ch[..., :-1]).all()  # ascending, distinct
    s = (q.double().abs().view(2, 2, G, D) * kabs_max.double()[:, :, None]).sum(2)
    kept = torch.zeros_like(s, dtype=torch.bool).scatter_(2, ch, True)
    low = torch.where(kept, s, math.inf).amin(-1)
    high = torch.where(kept, -math.inf, s).amax(-1)
    assert (low >= high - 1e-5 * s.abs().amax(-1)).all()


# --------------------------------------------------------------------------------------------------
# Partial-channel top-k
# --------------------------------------------------------------------------------------------------


def make_topk_inputs(p: TopKProblem):
    """``(q, K, ch, k_ch)``: full keys K ``(B, H_kv, S, D)``, channels ch (critical_channels of the
    valid prefix, or a random permutation of all D when n == D) and k_ch = K[..., ch] stored in
    p.layout, with NaN beyond ``length`` (a capacity buffer's unwritten tail)."""
    gen = torch.Generator().manual_seed(p.seed)
    if p.integer_valued:
        q = torch.randint(-3, 4, (p.B, p.H_q, p.D), generator=gen).to(p.dtype)
        K = torch.randint(-3, 4, (p.B, p.H_kv, p.S, p.D), generator=gen).to(p.dtype)
    else:
        q = torch.randn((p.B, p.H_q, p.D), generator=gen).to(p.dtype)
        K = torch.randn((p.B, p.H_kv, p.S, p.D), generator=gen).to(p.dtype)
    length = p.S if p.length is None else p.length
    if p.n == p.D:
        ch = torch.stack([torch.randperm(p.D, generator=gen) for _ in range(p.B * p.H_kv)])
        ch = ch.view(p.B, p.H_kv, p.D)
    else:
        kabs = K[:, :, :length].abs().amax(dim=2) if length else K.new_zeros((p.B, p.H_kv, p.D))
        ch = critical_channels(q, kabs, p.n)
    k_ch = torch.gather(K, 3, ch[:, :, None, :].expand(-1, -1, p.S, -1)).clone()
    k_ch[:, :, length:] = float("nan")
    return q, K, ch, make_strided(k_ch, p.layout), length


def check_topk_shape(idx, approx, p: TopKProblem, length: int):
    width = min(p.k, p.S)
    assert idx.dtype == torch.int64 and idx.shape == (p.B, p.H_kv, width)
    assert approx.dtype == torch.float32 and approx.shape == (p.B, p.H_kv, p.S)
    assert (approx[:, :, length:] == float("-inf")).all() and not approx.isnan().any()
    n_pad = max(0, width - length)
    assert (idx[..., width - n_pad :] == -1).all()
    chosen = idx[..., : width - n_pad]
    assert ((chosen >= 0) & (chosen < length)).all()  # never beyond length
    if chosen.numel():  # distinct positions
        assert (chosen.sort(-1).values.diff(dim=-1) > 0).all()


@given(p=topk_problems(), block_s=st.sampled_from([64, 256]))
def test_partial_topk_kernel_matches_ref(p: TopKProblem, block_s: int):
    q, _, ch, k_ch, length = make_topk_inputs(p)
    idx, approx = partial_topk(q, k_ch, ch, p.k, p.length, block_s=block_s)
    ridx, rapprox = partial_topk_ref(q, k_ch, ch, p.k, p.length)
    check_topk_shape(idx, approx, p, length)
    check_topk_shape(ridx, rapprox, p, length)
    if p.integer_valued:  # exact sums: identical scores, identical tie-breaking
        assert torch.equal(approx, rapprox) and torch.equal(idx, ridx)
    else:
        torch.testing.assert_close(approx, rapprox, atol=TOL_SCORES[0], rtol=TOL_SCORES[1])
        assert torch.equal(idx < 0, ridx < 0)
        # near-ties may order differently: the chosen scores must match
        got = torch.gather(rapprox, 2, idx.clamp(min=0)).masked_fill(idx < 0, 0.0)
        want = torch.gather(rapprox, 2, ridx.clamp(min=0)).masked_fill(ridx < 0, 0.0)
        torch.testing.assert_close(got, want, atol=TOL_SCORES[0], rtol=TOL_SCORES[1])


def naive_group_scores(q, K, length):
    """Exact group-summed q . k over all D channels, one (b, kv head, t) at a time, in float64."""
    B, H_q, D = q.shape
    H_kv, S = K.shape[1], K.shape[2]
    G = H_q // H_kv
    out = torch.full((B, H_kv, S), -math.inf, dtype=torch.float64)
    for b in range(B):
        for hk in range(H_kv):
            qs = q[b, hk * G : (hk + 1) * G].double().sum(0)
            for t in range(length):
                out[b, hk, t] = float(qs @ K[b, hk, t].double())
    return out


@given(p=topk_problems(max_s=120, all_channels=True))
def test_all_channels_give_the_exact_topk(p: TopKProblem):
    """n = D (in any channel order): the approximate top-k is the exact top-k of the group-summed
    scores (exactly for integer inputs; up to near-ties otherwise)."""
    q, K, ch, k_ch, length = make_topk_inputs(p)
    exact = naive_group_scores(q, K, length)
    width = min(p.k, p.S)
    for fn in (partial_topk, partial_topk_ref):
        idx, approx = fn(q, k_ch, ch, p.k, p.length)
        check_topk_shape(idx, approx, p, length)
        torch.testing.assert_close(approx.double(), exact, atol=1e-4, rtol=1e-5)
        if p.integer_valued:
            for b in range(p.B):
                for hk in range(p.H_kv):
                    s = exact[b, hk].tolist()
                    want = sorted(range(length), key=lambda t: (-s[t], t))[:width]
                    want += [-1] * (width - len(want))
                    assert idx[b, hk].tolist() == want
        else:
            chosen = torch.gather(exact, 2, idx.clamp(min=0)).masked_fill(idx < 0, 0.0)
            best = exact.sort(-1, descending=True).values[..., :width]
            best = best.masked_fill(idx < 0, 0.0)
            torch.testing.assert_close(chosen, best, atol=1e-4, rtol=1e-5)


def test_topk_length_and_padding():
    q = torch.randn((1, 4, 16))
    k_ch = torch.randn((1, 2, 40, 4))
    k_ch[:, :, 10:] = 1e4  # would win if positions >= length were read
    ch = torch.tensor([[[0, 3, 5, 9], [1, 2, 3, 4]]])
    for fn in (partial_topk, partial_topk_ref):
        idx, approx = fn(q, k_ch, ch, 15, length=10)
        assert idx.shape == (1, 2, 15)
        assert (idx[..., 10:] == -1).all()
        assert torch.equal(idx[..., :10].sort(-1).values, torch.arange(10).expand(1, 2, 10))
        assert (approx[..., 10:] == float("-inf")).all()
        idx, approx = fn(q, k_ch, ch, 3, length=0)
        assert (idx == -1).all() and (approx == float("-inf")).all()
        idx, _ = fn(q, k_ch, ch, 100)  # k > S: width min(k, S)
        assert idx.shape == (1, 2, 40) and (idx >= 0).all()
        idx, _ = fn(q, k_ch, ch, 0)
        assert idx.shape == (1, 2, 0)


def test_topk_ties_prefer_lower_positions():
    q = torch.ones((1, 2, 8))
    k_ch = torch.zeros((1, 1, 20, 2))
    k_ch[0, 0, [3, 7, 11, 15], 0] = 1.0  # four tied winners
    ch = torch.tensor([[[2, 6]]])
    for fn in (partial_topk, partial_topk_ref):
        idx, _ = fn(q, k_ch, ch, 6)
        assert idx.tolist() == [[[3, 7, 11, 15, 0, 1]]]


@pytest.mark.parametrize("fn", [partial_topk, partial_topk_ref])
def test_topk_errors(fn):
    q = torch.randn((1, 4, 16))
    k_ch = torch.randn((1, 2, 10, 3))
    ch = torch.zeros((1, 2, 3), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"kvpass: .*ch of shape \(B=1, H_kv=2, n=3\)"):
        fn(q, k_ch, ch[..., :2], 2)
    with pytest.raises(ValueError, match="kvpass: .*ch of dtype int32 or int64"):
        fn(q, k_ch, ch.float(), 2)
    with pytest.raises(ValueError, match=r"kvpass: .*0 <= length <= S=10"):
        fn(q, k_ch, ch, 2, length=11)
    with pytest.raises(ValueError, match="kvpass: .*k >= 0"):
        fn(q, k_ch, ch, -1)
    with pytest.raises(ValueError, match="kvpass: .*H_q to be a multiple of H_kv"):
        fn(q[:, :3], k_ch, ch, 2)
    with pytest.raises(ValueError, match="kvpass: critical_channels needs 0 <= n <= D=16"):
        critical_channels(q, torch.rand((1, 2, 16)), 17)


def test_int32_channels_and_critical_channels_pipeline():
    """critical_channels -> gather -> partial_topk, int32 channel indices accepted by both paths."""
    p = TopKProblem(
        dtype=torch.float16, B=2, H_kv=3, G=3, S=200, length=170, D=64, n=8, k=16, integer_valued=False,
        layout="d_strided", seed=5,
    )
    q, _, ch, k_ch, length = make_topk_inputs(p)
    a = partial_topk(q, k_ch, ch.to(torch.int32), p.k, length)
    b = partial_topk(q, k_ch, ch, p.k, length)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    r = partial_topk_ref(q, k_ch, ch.to(torch.int32), p.k, length)
    torch.testing.assert_close(a[1], r[1], atol=TOL_SCORES[0], rtol=TOL_SCORES[1])



# --------------------------------------------------------------------------------------------------
# CPU: the C channels, step list and cosine (kvpass.kernels.tailorkv, "CPU")
# --------------------------------------------------------------------------------------------------

def test_cpu_kernels_are_built():
    # the project's set-up has a C compiler (Inductor's): these kernels are what CPU users run
    assert cpu_select_available()


def critical_channels_cpu(q, kabs_max, n):
    """The channels :meth:`CpuStep.select` picks (written to ``ch_out``), from a step with no candidates."""
    B, H, D = kabs_max.shape
    out = torch.full((B, H, n), -7, dtype=torch.int64)
    step = CpuStep(None, None, torch.zeros(B, H, D, 1), kabs_max)
    step.select(q, 0, 0, 0, 1, q_c=q, n_channels=n, ch_out=out)  # one recent token: the C call runs
    return out


@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), G=GQA_GROUPS, D=HEAD_DIMS, n_frac=st.floats(0, 1),
       nan=st.booleans(), seed=SEEDS)
def test_critical_channels_cpu_match_naive_loop(B, H_kv, G, D, n_frac, nan, seed):
    """Small integers: exact scores and frequent ties (ties -> lower channel); a NaN query channel ranks
    first, as torch.sort(descending=True) ranks it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, H_kv * G, D), generator=gen).float()
    kabs_max = torch.randint(0, 4, (B, H_kv, D), generator=gen).float()
    if nan:
        q[0, 0, D // 2] = float("nan")
    n = round(n_frac * D)
    got = critical_channels_cpu(q, kabs_max, n)
    assert got.dtype == torch.int64 and got.shape == (B, H_kv, n)
    assert torch.equal(got, critical_channels(q, kabs_max, n))
    if not nan:
        assert torch.equal(got, naive_critical_channels(q, kabs_max, n))


def naive_step_list(q, kT, ch, n_s, mid_end, k, n_r, first=None):
    """Python loops: sinks, the k best candidates by (score desc, position asc) in position order, recent;
    row b of a padded batch starts at ``first[b]`` and ends with -1 where it has fewer candidates."""
    B, H_q, _ = q.shape
    H = kT.shape[1]
    G = H_q // H
    width = n_s + min(k, mid_end - n_s) + n_r
    rows = []
    for b in range(B):
        f = 0 if first is None else int(first[b])
        for h in range(H):
            qs = q[b, h * G : (h + 1) * G].double().sum(0)
            picked = list(range(f + n_s, mid_end))
            if mid_end - n_s - f > k:
                s = {}
                for t in picked:
                    x = sum(float(qs[c]) * float(kT[b, h, c, t]) for c in ch[b, h].tolist())
                    s[t] = -math.inf if math.isnan(x) else x
                picked = sorted(sorted(picked, key=lambda t: (-s[t], t))[:k])
            row = list(range(f, f + n_s)) + picked + list(range(mid_end, mid_end + n_r))
            rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int64).view(B, H, -1)


@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), G=GQA_GROUPS, D=st.sampled_from([4, 16]),
       S=st.integers(0, 90), n_s=st.integers(0, 6), n_r=st.integers(0, 6), k=st.integers(0, 40),
       c=st.integers(1, 4), nan=st.booleans(), padded=st.booleans(), bf16=st.booleans(), seed=SEEDS)
def test_tailor_select_cpu_matches_naive_loop(B, H_kv, G, D, S, n_s, n_r, k, c, nan, padded, bf16, seed):
    """Integer queries and keys: exact scores with many ties; every range may be empty, k may cover every
    candidate or be 0, the channels may repeat, and a NaN key scores -inf (ranked with the lowest). A
    padded batch: each row's own first position (0 up to all its candidates), -1 after a short row. The
    channel-major keys in fp32 or in bf16 (the runtime's copy of fp32 keys)."""
    gen = torch.Generator().manual_seed(seed)
    n_s, n_r = min(n_s, S), min(n_r, max(S - n_s, 0))
    mid_end = S - n_r
    q = torch.randint(-3, 4, (B, H_kv * G, D), generator=gen).float()
    kT = torch.randint(-3, 4, (B, H_kv, D, S + 5), generator=gen).float()  # a capacity past S
    kT[..., S:] = 1e6  # never read
    ch = torch.randint(0, D, (B, H_kv, min(c, D)), generator=gen)
    if nan and mid_end > n_s:
        kT[0, 0, ch[0, 0, 0], n_s] = float("nan")
    first = torch.randint(0, max(mid_end - n_s, 0) + 1, (B,), generator=gen) if padded else None
    if bf16:
        kT = kT.bfloat16()
    got = tailor_select_cpu(q, kT, ch, n_s, mid_end, k, n_r, first)
    assert torch.equal(got, naive_step_list(q, kT, ch, n_s, mid_end, k, n_r, first))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_tailor_select_cpu_matches_naive_loop_past_a_tile(padded, dtype):
    """Candidates over several of the C kernel's tiles (512) and 16-key blocks, integer scores (ties at the
    cut span blocks), pairs enough to split over threads: the naive loop's list."""
    gen = torch.Generator().manual_seed(7)
    B, H, G, D, S, n_s, n_r, k = 2, 3, 2, 8, 1500, 5, 7, 411
    q = torch.randint(-2, 3, (B, H * G, D), generator=gen).float()
    kT = torch.randint(-2, 3, (B, H, D, S), generator=gen).to(dtype)
    ch = torch.randint(0, D, (B, H, 2), generator=gen)
    first = torch.tensor([0, 333]) if padded else None
    want = naive_step_list(q, kT, ch, n_s, S - n_r, k, n_r, first)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):  # 6 pairs of about 1.5k candidates: two threads split them
            torch.set_num_threads(t)
            assert torch.equal(tailor_select_cpu(q, kT, ch, n_s, S - n_r, k, n_r, first), want)
    finally:
        torch.set_num_threads(threads)


def oracle_step_list(q, kT, ch, n_s, mid_end, k, n_r, first=None):
    """naive_step_list in torch ops, for many candidates: float64 scores (exact for integer values), a
    stable sort by descending score (ties to the lower position), NaN as -inf."""
    B, H_q, _ = q.shape
    H = kT.shape[1]
    G = H_q // H
    width = n_s + min(k, mid_end - n_s) + n_r
    out = torch.full((B, H, width), -1, dtype=torch.int64)
    for b in range(B):
        f = 0 if first is None else int(first[b])
        for h in range(H):
            qs = q[b, h * G : (h + 1) * G].double().sum(0)
            c = ch[b, h]
            pos = torch.arange(f + n_s, mid_end)
            if len(pos) > k:
                s = (qs[c, None] * kT[b, h][c][:, f + n_s : mid_end].double()).sum(0).nan_to_num(nan=-math.inf)
                pos = pos[torch.sort(-s, stable=True).indices[:k]].sort().values
            row = torch.cat([torch.arange(f, f + n_s), pos, torch.arange(mid_end, mid_end + n_r)])
            out[b, h, : len(row)] = row
    return out


@given(B=st.integers(1, 2), H_kv=st.integers(1, 2), G=st.sampled_from([1, 3]), S=st.integers(2100, 6000),
       k_frac=st.floats(0.0, 0.5), spread=st.sampled_from([1, 3, 1000]), c=st.integers(1, 8),
       nan=st.booleans(), padded=st.booleans(), bf16=st.booleans(), seed=SEEDS)
def test_tailor_select_cpu_few_of_many_matches_the_oracle(B, H_kv, G, S, k_frac, spread, c, nan, padded, bf16,
                                                          seed):
    """A few of many candidates (k at most half of 2k+ candidates): the kernel cuts them from a sampled
    threshold. Integer queries and keys from [-spread, spread] (many ties at the cut with a small spread,
    few with a large one), NaN keys, a padded batch with rows of every length: the oracle's list."""
    gen = torch.Generator().manual_seed(seed)
    D, n_s, n_r = 16, 4, 8
    mid_end = S - n_r
    q = torch.randint(-spread, spread + 1, (B, H_kv * G, D), generator=gen).float()
    kT = torch.randint(-spread, spread + 1, (B, H_kv, D, S), generator=gen).float()
    ch = torch.randint(0, D, (B, H_kv, c), generator=gen)
    if nan:
        kT[:, :, :, torch.randint(n_s, mid_end, (50,), generator=gen)] = float("nan")
    first = torch.randint(0, 2000, (B,), generator=gen) if padded else None
    k = int(k_frac * (mid_end - n_s - (0 if first is None else int(first.max()))))
    if bf16:
        kT = kT.bfloat16()  # integers up to 1000: bf16 rounds some, read back as the oracle reads them
    got = tailor_select_cpu(q, kT, ch, n_s, mid_end, k, n_r, first)
    assert torch.equal(got, oracle_step_list(q, kT, ch, n_s, mid_end, k, n_r, first))


@pytest.mark.parametrize("k", [600, 1000])
def test_tailor_select_cpu_few_of_many_when_the_sample_misleads(k):
    """The candidates the kernel samples for its threshold score high and all others low: fewer than k
    pass the threshold, so the kernel falls back to the full radix select; the list is still the
    oracle's."""
    D, S = 8, 2048 + 16
    n = S - 16
    q = torch.ones(1, 1, D)
    kT = torch.zeros(1, 1, D, S)
    low = torch.zeros(S, dtype=torch.bool)
    low[16:] = torch.arange(n) % 7 == 3
    kT[0, 0, 0, low] = 1.0  # ties among the low scores
    kT[0, 0, 0, 16 + torch.arange(512) * n // 512] = 5.0  # the positions a stride of n / 512 samples
    ch = torch.zeros(1, 1, 1, dtype=torch.int64)
    got = tailor_select_cpu(q, kT, ch, 16, S, k, 0)
    assert torch.equal(got, oracle_step_list(q, kT, ch, 16, S, k, 0))


def test_tailor_select_cpu_equals_partial_topk_on_random_keys():
    """Gaussian scores (no ties): the same top k as partial_topk_ref over the prefetched channels."""
    gen = torch.Generator().manual_seed(3)
    B, H, G, D, S, k = 2, 3, 3, 64, 3000, 700
    q = torch.randn(B, H * G, D, generator=gen)
    K = torch.randn(B, H, S, D, generator=gen)
    ch = critical_channels(q, K.abs().amax(2), 8)
    got = tailor_select_cpu(q, K.transpose(2, 3).contiguous(), ch, 16, S - 100, k, 100)
    k_ch = torch.gather(K[:, :, 16 : S - 100], 3, ch[:, :, None, :].expand(-1, -1, S - 116, -1))
    idx, _ = partial_topk_ref(q, k_ch, ch, k, S - 116)
    assert torch.equal(got[..., 16 : 16 + k], (idx + 16).sort(-1).values)
    assert torch.equal(got[..., :16], torch.arange(16).expand(B, H, 16))
    assert torch.equal(got[..., 16 + k :], torch.arange(S - 100, S).expand(B, H, 100))


def test_tailor_select_cpu_reads_bf16_keys_as_their_fp32_values():
    """Gaussian keys held in bf16: the C list equals the one from the same keys widened to fp32 (the
    kernel reads the bf16 bits as fp32 values, no other rounding), and the strides are in elements."""
    gen = torch.Generator().manual_seed(11)
    B, H, G, D, S, k = 2, 3, 3, 64, 2000, 300
    q = torch.randn(B, H * G, D, generator=gen)
    kT = torch.randn(B, H, D, S + 40, generator=gen).bfloat16()[..., :S]  # a capacity past S: strided rows
    ch = critical_channels(q, kT.float().abs().amax(3), 8)
    want = tailor_select_cpu(q, kT.float(), ch, 16, S - 50, k, 50)
    assert torch.equal(tailor_select_cpu(q, kT, ch, 16, S - 50, k, 50), want)


def test_tailor_cpu_refusals():
    q, kT = torch.randn(1, 6, 8), torch.randn(1, 2, 8, 30)
    ch = torch.tensor([[[0, 9], [1, 2]]])  # channel 9 of 8
    with pytest.raises(ValueError, match=r"in \[0, D=8\)"):
        tailor_select_cpu(q, kT, ch, 2, 20, 4, 5)
    with pytest.raises(ValueError, match="fp32 CPU"):
        tailor_select_cpu(q.half(), kT, ch, 2, 20, 4, 5)
    with pytest.raises(ValueError, match="mid_end"):
        tailor_select_cpu(q, kT, ch.clamp(max=7), 2, 31, 4, 5)  # candidates past the capacity
    # the recent tokens are listed, not read: the step's own token is appended after the selection, and may
    # outgrow the keys' capacity (the store's first reserve)
    got = tailor_select_cpu(q, kT, ch.clamp(max=7), 2, 28, 4, 5)
    assert torch.equal(got[..., -5:], torch.arange(28, 33).expand(1, 2, 5))
    with pytest.raises(ValueError, match="first position"):
        tailor_select_cpu(q, kT, ch.clamp(max=7), 2, 20, 4, 5, torch.tensor([19]))  # past the candidates
    with pytest.raises(ValueError, match="0 <= n_channels <= D"):
        critical_channels_cpu(q, kT[..., 0].contiguous(), 9)
    step = CpuStep(None, None, kT, kT[..., 0].abs())
    with pytest.raises(ValueError, match="q_c shaped like q"):
        step.select(q, 2, 20, 4, 5, q_c=q[:, :3], n_channels=2)
    with pytest.raises(ValueError, match="cos a float64"):
        step.select(q, 2, 20, 4, 5, q_c=q, n_channels=2, cos=torch.zeros(1))
    with pytest.raises(ValueError, match="C kernels"):
        CpuStep(torch.zeros(1, 2, 30, 8), None, kT, kT[..., 0].abs())  # k without v


@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), G=GQA_GROUPS, D=HEAD_DIMS, S=st.integers(1, 400),
       k=st.integers(0, 200), padded=st.booleans(), cosine=st.booleans(), seed=SEEDS)
def test_select_append_attend_equals_its_three_calls(B, H_kv, G, D, S, k, padded, cosine, seed):
    """The runtime's steady step in one C call (CpuStep.select_append_attend) lists what select lists, writes
    what append writes (host tier, channel-major keys, max |K|) and outputs decode_step's attention over
    that list, the step's token included; with the estimate's cosine added once."""
    from kvpass.kernels import cpu_decode

    gen = torch.Generator().manual_seed(seed)
    cap = S + 5
    n_s, n_r = min(4, S - 1), min(20, max(S - 5, 0)) + 1  # the recent tokens end with the step's own
    mid_end = S + 1 - n_r
    k_, v_ = torch.randn(B, H_kv, cap, D, generator=gen), torch.randn(B, H_kv, cap, D, generator=gen)
    kT = k_.transpose(2, 3).contiguous().bfloat16()
    kabs = k_[:, :, :S].abs().amax(2)
    first = torch.randint(0, max(mid_end - n_s, 0) + 1, (B,), generator=gen) if padded else None
    q = torch.randn(B, H_kv * G, 1, D, generator=gen)
    q_c = q + 0.5 * torch.randn(q.shape, generator=gen)
    kn, vn = torch.randn(B, H_kv, 1, D, generator=gen), torch.randn(B, H_kv, 1, D, generator=gen)
    c = min(4, D)
    bufs = [(k_.clone(), v_.clone(), kT.clone(), kabs.clone()) for _ in range(2)]
    coss = [torch.full((1,), 0.5, dtype=torch.float64) for _ in range(2)]
    one = CpuStep(*bufs[0][:3], bufs[0][3], first)
    three = CpuStep(*bufs[1][:3], bufs[1][3], first)
    got = one.select_append_attend(q, n_s, mid_end, k, n_r, q_c, c, coss[0] if cosine else None, kn, vn, S, 0.3)
    assert got is not None
    want_idx = three.select(q, n_s, mid_end, k, n_r, q_c=q_c, n_channels=c, cos=coss[1] if cosine else None)
    assert three.append(kn, vn, S)
    want_out = cpu_decode.decode_step(q, bufs[1][0], bufs[1][1], cap, want_idx, 0.3)
    assert torch.equal(got[0], want_idx) and torch.equal(got[1], want_out)
    assert (got[0] == S).any(-1).all()  # the step's own token, attended
    for a, b in zip(bufs[0], bufs[1]):
        assert torch.equal(a, b)
    assert torch.equal(coss[0], coss[1])


def test_select_append_attend_refuses_what_one_call_cannot_serve():
    """None, having written nothing, where the step's tokens, the queries or the capacity are not what the
    one call serves (the runtime then makes the three calls)."""
    k_, v_ = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    kT = k_.transpose(2, 3).contiguous()
    kabs = k_.abs().amax(2)
    step = CpuStep(k_, v_, kT, kabs)
    q, kn = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8)
    before = [t.clone() for t in (k_, v_, kT, kabs)]
    args = (2, 30, 8, 5, q, 2, None)
    assert step.select_append_attend(q, *args, torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8), 34, 0.3) is None
    assert step.select_append_attend(q, *args, kn.double(), kn.double(), 34, 0.3) is None
    assert step.select_append_attend(q, *args, kn, kn, 40, 0.3) is None  # past the capacity
    assert step.select_append_attend(q[:, :, 0], *args, kn, kn, 34, 0.3) is None  # a (B, H_q, D) query
    assert all(torch.equal(a, b) for a, b in zip(before, (k_, v_, kT, kabs)))
    assert step.select_append_attend(q, *args, kn, kn, 34, 0.3) is not None


@given(B=st.integers(1, 2), H_kv=st.integers(1, 3), G=GQA_GROUPS, D=HEAD_DIMS, S=st.integers(0, 700),
       c=st.integers(1, 8), k=st.integers(0, 300), four_d=st.booleans(), padded=st.booleans(), seed=SEEDS)
def test_select_picking_the_channels_equals_the_two_steps(B, H_kv, G, D, S, c, k, four_d, padded, seed):
    """The runtime's one C call (channels from the estimate q_c and max |K|, the top-k by them with the true
    q, the estimate's cosine) equals critical_channels on q_c, then tailor_select_cpu with those channels,
    and F.cosine_similarity; the query as the op gives it, (B, H_q, 1, D), or (B, H_q, D)."""
    gen = torch.Generator().manual_seed(seed)
    n_s, n_r = min(16, S), min(112, max(S - 16, 0))
    mid_end = S - n_r
    q = torch.randn(B, H_kv * G, D, generator=gen)
    q_c = q + 0.5 * torch.randn(B, H_kv * G, D, generator=gen)
    kT = torch.randn(B, H_kv, D, S + 3, generator=gen).bfloat16()
    kabs = kT.float().abs().amax(3)
    first = torch.randint(0, max(mid_end - n_s, 0) + 1, (B,), generator=gen) if padded else None
    ch = critical_channels(q_c, kabs, c if c <= D else D)
    want = tailor_select_cpu(q, kT, ch, n_s, mid_end, k, n_r, first)
    ch_out = torch.full(ch.shape, -1, dtype=torch.int64)
    cos = torch.full((1,), 0.25, dtype=torch.float64)
    got = CpuStep(None, None, kT, kabs, first).select(
        q.unsqueeze(2) if four_d else q, n_s, mid_end, k, n_r, q_c=q_c, n_channels=ch.shape[2], cos=cos,
        ch_out=ch_out)
    assert torch.equal(got, want)
    if want.numel():  # an empty list runs no C call
        assert torch.equal(ch_out, ch)
        assert abs(float(cos) - 0.25 - F.cosine_similarity(q_c.double(), q.double(), dim=-1).mean().item()) < 1e-6


@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    t=st.integers(1, 3),
    d=st.sampled_from([1, 8, 24]),
    cap=st.integers(4, 12),
    bf16=st.booleans(),
    special=st.booleans(),  # NaN, infinities, -0 and values halfway between two bfloat16s
    layout=st.sampled_from(["contiguous", "bthd", "transposed"]),
    seed=SEEDS,
)
def test_tailor_append_cpu_equals_torch_ops(b, h, t, d, cap, bf16, special, layout, seed):
    """The fused decode append writes what the torch ops it replaces write: the rows, the channel-major
    keys (bfloat16 rounded as torch rounds) and the running max of |k| (NaN spreading as torch.maximum)."""
    gen = torch.Generator().manual_seed(seed)
    at = int(torch.randint(0, cap - t + 1, (1,), generator=gen))
    k_new = torch.randn(b, h, t, d, generator=gen)
    if special:
        pool = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0,
                             1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8)])  # ties round to even
        pick = torch.rand(b, h, t, d, generator=gen) < 0.3
        k_new = torch.where(pick, pool[torch.randint(0, len(pool), (b, h, t, d), generator=gen)], k_new)
    if layout == "bthd":  # a view of (B, T, H, D), as the graph's projections give it
        k_new = k_new.transpose(1, 2).contiguous().transpose(1, 2)
    v_new = torch.randn(b, h, t, d, generator=gen)
    if layout == "transposed":  # D outermost, as a batched step's weight-major linear gives V (and K)
        k_new, v_new = (x.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0) for x in (k_new, v_new))
    k, v = torch.randn(b, h, cap, d, generator=gen), torch.randn(b, h, cap, d, generator=gen)
    kT = torch.randn(b, h, d, cap, generator=gen).to(torch.bfloat16 if bf16 else torch.float32)
    kabs = torch.rand(b, h, d, generator=gen)
    kabs[..., :1] = float("nan") if special else kabs[..., :1]
    want = [x.clone() for x in (k, v, kT, kabs)]
    want[0][:, :, at : at + t] = k_new
    want[1][:, :, at : at + t] = v_new
    want[2][:, :, :, at : at + t] = k_new.transpose(2, 3)
    torch.maximum(want[3], k_new.abs().amax(2), out=want[3])
    assert tailor_append_cpu(k_new, v_new, k, v, kT, kabs, at)
    for got, exp in zip((k, v, kT, kabs), want):
        assert torch.equal(got.isnan(), exp.isnan())
        assert torch.equal(torch.nan_to_num(got.float(), nan=7.0), torch.nan_to_num(exp.float(), nan=7.0))


def test_tailor_append_cpu_refuses_what_it_cannot_serve():
    k_new = torch.randn(1, 2, 1, 8)
    k, v = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    kT, kabs = torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 8)
    before = [x.clone() for x in (k, v, kT, kabs)]
    assert not tailor_append_cpu(k_new.double(), k_new.double(), k, v, kT, kabs, 0)  # not fp32
    assert not tailor_append_cpu(k_new, k_new, k, v, kT, kabs, 4)  # past the capacity
    assert not tailor_append_cpu(k_new, k_new, k, v, kT.half(), kabs, 0)  # a channel dtype it does not write
    assert all(torch.equal(x, y) for x, y in zip((k, v, kT, kabs), before))
    assert tailor_append_cpu(k_new, k_new, k, v, kT, kabs, 0)  # the same call, served (test_cpu_kernels_are_built)

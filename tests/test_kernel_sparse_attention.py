"""sparse_decode_attention (Triton, run by the interpreter on CPU) against its torch reference, and the
reference against independent dense formulas (SDPA over repeated K/V, an explicit masked softmax)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

from kvpass.kernels.sparse_attention import (
    paged_decode_attention_ref,
    sparse_decode_attention,
    sparse_decode_attention_ref,
)
from strategies import (
    TOL,
    AttentionProblem,
    attention_problems,
    make_attention_inputs,
    make_strided,
)


def naive_attention(q, k, v, idx=None, bias=None, scale=None):
    """Dense formula: repeat K/V per query head, mask the positions not in ``idx`` (which must be
    distinct), softmax over all S, all-masked rows -> 0. Deliberately a different route than the
    reference (no gather, torch.softmax)."""
    B, H_q, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    G = H_q // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kr = k.float().repeat_interleave(G, dim=1)  # (B, H_q, S, D)
    vr = v.float().repeat_interleave(G, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), kr) * scale
    if bias is not None:
        scores = scores + bias.float().repeat_interleave(G, dim=1)
    if idx is not None:
        keep = torch.zeros((B, H_kv, S), dtype=torch.bool)
        for b in range(B):
            for h in range(H_kv):
                row = idx[b, h].long()
                keep[b, h, row[(row >= 0) & (row < S)]] = True
        scores = scores.masked_fill(~keep.repeat_interleave(G, dim=1), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf rows give NaN -> 0
    return torch.einsum("bhs,bhsd->bhd", p, vr)


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------------
# The reference against independent formulas
# --------------------------------------------------------------------------------------------------


@given(p=attention_problems(idx_modes=("none",), bias_modes=("none",)))
def test_ref_dense_equals_sdpa_with_repeated_kv(p: AttentionProblem):
    q, k, v, _, _ = make_attention_inputs(p)
    out = sparse_decode_attention_ref(q, k, v)
    kr = k.repeat_interleave(p.G, dim=1)
    vr = v.repeat_interleave(p.G, dim=1)
    expected = F.scaled_dot_product_attention(q.float()[:, :, None], kr.float(), vr.float())[:, :, 0]
    assert out.dtype == q.dtype and out.shape == (p.B, p.H_q, p.D)
    assert_close(out, expected, p.dtype)


@given(p=attention_problems(idx_modes=("none", "subset")))
def test_ref_equals_naive_masked_softmax(p: AttentionProblem):
    q, k, v, idx, bias = make_attention_inputs(p)
    out = sparse_decode_attention_ref(q, k, v, idx, bias)
    assert_close(out, naive_attention(q, k, v, idx, bias), p.dtype)
    assert not out.isnan().any()


@given(p=attention_problems(dtypes=st.just(torch.float32), idx_modes=("duplicates",)))
def test_ref_duplicates_count_twice(p: AttentionProblem):
    """A position listed m times weighs like one listing with bias + log(m)."""
    assume(p.N > 0)
    q, k, v, idx, bias = make_attention_inputs(p)
    out = sparse_decode_attention_ref(q, k, v, idx, bias)
    counts = torch.zeros((p.B, p.H_kv, p.S))
    counts.scatter_add_(2, idx.long(), torch.ones(idx.shape))
    dedup_bias = counts.log() + (0.0 if bias is None else bias)  # log 0 = -inf: unlisted positions
    assert_close(out, naive_attention(q, k, v, None, dedup_bias), p.dtype)


# --------------------------------------------------------------------------------------------------
# The Triton kernel against the reference
# --------------------------------------------------------------------------------------------------


@given(
    p=attention_problems(),
    block_n=st.sampled_from([32, 128]),
    num_splits=st.sampled_from([None, 1, 3]),
)
def test_kernel_matches_ref(p: AttentionProblem, block_n: int, num_splits):
    q, k, v, idx, bias = make_attention_inputs(p)
    out = sparse_decode_attention(q, k, v, idx, bias, block_n=block_n, num_splits=num_splits)
    expected = sparse_decode_attention_ref(q, k, v, idx, bias)
    assert out.dtype == q.dtype and out.shape == (p.B, p.H_q, p.D)
    assert not out.isnan().any()
    assert_close(out, expected, p.dtype)


@given(p=attention_problems(idx_modes=("subset",), bias_modes=("none",), max_s=64), seed=st.integers(0, 99))
def test_kernel_custom_scale_and_value_dim(p: AttentionProblem, seed: int):
    """scale argument, and v with its own head dim (Dv = 80, not a power of two)."""
    q, k, _, idx, _ = make_attention_inputs(p)
    gen = torch.Generator().manual_seed(seed)
    v = make_strided(torch.randn((p.B, p.H_kv, p.S, 80), generator=gen).to(p.dtype), p.layout)
    out = sparse_decode_attention(q, k, v, idx, scale=0.3)
    assert out.shape == (p.B, p.H_q, 80)
    assert_close(out, sparse_decode_attention_ref(q, k, v, idx, scale=0.3), p.dtype)
    assert_close(out, naive_attention(q, k, v, idx, scale=0.3), p.dtype)


# --------------------------------------------------------------------------------------------------
# Explicit edge cases
# --------------------------------------------------------------------------------------------------


def _inputs(B=1, H_kv=2, G=3, S=50, D=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((B, H_kv * G, D), generator=gen).to(dtype)
    k = torch.randn((B, H_kv, S, D), generator=gen).to(dtype)
    v = torch.randn((B, H_kv, S, D), generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_idx", [False, True])
def test_head_dim_80(dtype, with_idx):
    q, k, v = _inputs(B=2, H_kv=2, G=4, S=150, D=80, dtype=dtype)
    idx = torch.randperm(150)[:100].repeat(2, 2, 1) if with_idx else None
    out = sparse_decode_attention(q, k, v, idx, block_n=64)
    assert_close(out, sparse_decode_attention_ref(q, k, v, idx), dtype)
    assert_close(out, naive_attention(q, k, v, idx), dtype)


@pytest.mark.parametrize("D", [16, 128, 256])
def test_other_power_of_two_head_dims(D):
    q, k, v = _inputs(H_kv=1, G=2, S=40, D=D)
    assert_close(sparse_decode_attention(q, k, v), naive_attention(q, k, v), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_all_neg_inf_bias_row_gives_zeros(num_splits):
    q, k, v = _inputs(B=2, H_kv=2, G=3, S=70)
    bias = torch.zeros((2, 2, 70))
    bias[1, 0] = float("-inf")  # (b=1, kv head 0) has no admissible key
    out = sparse_decode_attention(q, k, v, bias=bias, block_n=32, num_splits=num_splits)
    ref = sparse_decode_attention_ref(q, k, v, bias=bias)
    for o in (out, ref):
        assert not o.isnan().any()
        assert torch.equal(o[1, 0:3], torch.zeros_like(o[1, 0:3]))  # query heads 0..2 read kv head 0
        assert o[1, 3:].abs().sum() > 0 and o[0].abs().sum() > 0
    assert_close(out, ref, torch.float32)


def test_all_padding_and_empty_index_give_zeros():
    q, k, v = _inputs()
    for idx in (torch.full((1, 2, 7), -1), torch.empty((1, 2, 0), dtype=torch.int64)):
        for fn in (sparse_decode_attention, sparse_decode_attention_ref):
            out = fn(q, k, v, idx)
            assert torch.equal(out, torch.zeros_like(out))


def test_single_position_returns_its_value():
    q, k, v = _inputs(S=1)
    for fn in (sparse_decode_attention, sparse_decode_attention_ref):
        out = fn(q, k, v)
        torch.testing.assert_close(out, v[:, :, 0].repeat_interleave(3, dim=1))
        out = fn(q, k, v, torch.tensor([[[0, -1]] * 2]))
        torch.testing.assert_close(out, v[:, :, 0].repeat_interleave(3, dim=1))


def test_context_shorter_than_block_and_many_blocks():
    q, k, v = _inputs(S=5)
    assert_close(sparse_decode_attention(q, k, v, block_n=128), naive_attention(q, k, v), torch.float32)
    q, k, v = _inputs(S=300)
    idx = torch.randperm(300)[:257].repeat(1, 2, 1)  # 17 blocks of 16, the last one partial
    out = sparse_decode_attention(q, k, v, idx, block_n=16)
    assert_close(out, naive_attention(q, k, v, idx), torch.float32)


def test_out_of_range_index_is_padding():
    q, k, v = _inputs(S=20)
    idx = torch.tensor([[[3, 20, 7, 1000, -1], [19, 0, 25, -3, 4]]])
    clean = torch.tensor([[[3, 7, -1, -1, -1], [19, 0, 4, -1, -1]]])
    expected = sparse_decode_attention_ref(q, k, v, clean)
    assert_close(sparse_decode_attention(q, k, v, idx), expected, torch.float32)
    assert_close(sparse_decode_attention_ref(q, k, v, idx), expected, torch.float32)


def test_int32_and_int64_indices_agree():
    q, k, v = _inputs(S=100)
    idx = torch.randperm(100)[:60].repeat(1, 2, 1)
    a = sparse_decode_attention(q, k, v, idx.to(torch.int32))
    b = sparse_decode_attention(q, k, v, idx.to(torch.int64))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bf16_is_accepted_by_the_reference():
    q, k, v = _inputs(dtype=torch.bfloat16)
    out = sparse_decode_attention_ref(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive_attention(q, k, v), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fn", [sparse_decode_attention, sparse_decode_attention_ref])
def test_input_errors(fn):
    q, k, v = _inputs(H_kv=2, G=3, S=10, D=16)
    with pytest.raises(ValueError, match="kvpass: .*H_q to be a multiple of H_kv"):
        fn(q[:, :5], k, v)
    with pytest.raises(ValueError, match="kvpass: .*idx of shape"):
        fn(q, k, v, torch.zeros((1, 3, 4), dtype=torch.int64))
    with pytest.raises(ValueError, match="kvpass: .*idx of dtype int32 or int64"):
        fn(q, k, v, torch.zeros((1, 2, 4)))
    with pytest.raises(ValueError, match="kvpass: .*bias of shape"):
        fn(q, k, v, bias=torch.zeros((1, 2, 9)))
    with pytest.raises(ValueError, match="kvpass: .*one dtype"):
        fn(q.half(), k, v)
    with pytest.raises(ValueError, match="kvpass: .*k and v of shape"):
        fn(q, k[0], v[0])
    with pytest.raises(ValueError, match="kvpass: .*v to share"):
        fn(q, k, v[:, :, :9])


def test_launcher_errors(monkeypatch):
    q, k, v = _inputs(S=10, D=16)
    with pytest.raises(ValueError, match="kvpass: .*block_n to be a power of two"):
        sparse_decode_attention(q, k, v, block_n=48)
    with pytest.raises(ValueError, match="kvpass: .*num_splits"):
        sparse_decode_attention(q, k, v, num_splits=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: .*use sparse_decode_attention_ref on CPU"):
        sparse_decode_attention(q, k, v)


@given(
    b=st.integers(1, 2),
    h_kv=st.integers(1, 3),
    g=st.sampled_from([1, 3, 4]),
    page_size=st.sampled_from([1, 4, 16]),
    pages_cap=st.integers(1, 12),
    data=st.data(),
)
def test_paged_reference_equals_token_reference(b, h_kv, g, page_size, pages_cap, data):
    """Quest's CPU path (one gather row per page) equals the token-index reference."""
    d = 16
    cap = pages_cap * page_size
    length = data.draw(st.integers(1, cap))
    live = -(-length // page_size)
    n = data.draw(st.integers(1, live))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(b, h_kv * g, d, generator=gen)
    k = torch.randn(b, h_kv, cap, d, generator=gen)
    v = torch.randn(b, h_kv, cap, d, generator=gen)
    newest_last = data.draw(st.booleans())
    if newest_last:  # Quest's own order: full pages in any order, then the newest (maybe partial) page
        older = [torch.randperm(live - 1, generator=gen)[: n - 1] for _ in range(b * h_kv)]
        pages = torch.stack([torch.cat([o, torch.tensor([live - 1])]) for o in older]).view(b, h_kv, n)
    else:
        pages = torch.stack([torch.randperm(live, generator=gen)[:n] for _ in range(b * h_kv)]).view(b, h_kv, n)
    idx = (pages[..., None] * page_size + torch.arange(page_size)).flatten(-2)
    idx = torch.where(idx < length, idx, -1)
    want = sparse_decode_attention_ref(q, k[:, :, :length], v[:, :, :length], idx=idx)
    for dense in (False, True):
        got = paged_decode_attention_ref(q, k, v, pages, page_size, length, dense=dense, newest_last=newest_last)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        half = paged_decode_attention_ref(q.half(), k.half(), v.half(), pages, page_size, length, dense=dense,
                                          newest_last=newest_last)
        torch.testing.assert_close(half.float(), want, atol=2e-2, rtol=2e-2)


@given(
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    g=st.sampled_from([1, 3]),
    s=st.integers(2, 80),
    data=st.data(),
)
def test_segments_equal_the_token_reference(b, h_kv, g, s, data):
    """StreamingLLM's CPU path (SDPA per range, merged by log-sum-exp) equals the token-index reference
    given the ranges' positions, for one or two ranges anywhere in the cache."""
    from kvpass.kernels.sparse_attention import segments_decode_attention

    d = 16
    cut = sorted(data.draw(st.lists(st.integers(0, s), min_size=4, max_size=4)))
    ranges = [(lo, hi) for lo, hi in ((cut[0], cut[1]), (cut[2], cut[3])) if hi > lo]
    assume(ranges)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(b, h_kv * g, d, generator=gen)
    k = torch.randn(b, h_kv, s, d, generator=gen) * 3
    v = torch.randn(b, h_kv, s, d, generator=gen)
    idx = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).expand(b, h_kv, -1)
    want = naive_attention(q, k, v, idx, scale=0.3)
    got = segments_decode_attention(q, k, v, ranges, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_segments_take_a_query_whose_last_dim_is_not_contiguous():
    """A compiled graph can hand the site a query laid out (B, D, H_q) in memory (batch > 1, beam search):
    the segments path equals the reference on it (torch 2.13's CPU flash op read it as contiguous)."""
    from kvpass.kernels.sparse_attention import segments_decode_attention

    gen = torch.Generator().manual_seed(0)
    b, h_kv, g, s, d = 2, 2, 2, 40, 16
    q = torch.randn(b, d, h_kv * g, generator=gen).transpose(1, 2)  # strides (D*H, 1, H): last dim strided
    assert q.stride(-1) != 1
    k = torch.randn(b, h_kv, s, d, generator=gen)
    v = torch.randn(b, h_kv, s, d, generator=gen)
    ranges = [(0, 4), (20, 40)]
    idx = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).expand(b, h_kv, -1)
    got = segments_decode_attention(q, k, v, ranges, 0.25)
    torch.testing.assert_close(got, naive_attention(q.contiguous(), k, v, idx, scale=0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dense", [False, True])
def test_fp32_cpu_path_counts_duplicates_and_masks_everything(dense):
    """The fp32 CPU path, gathered (few positions) and masked dense (many): a duplicate counts twice,
    a row with no valid position gives zeros, and a bias of -inf masks."""
    from kvpass.kernels.sparse_attention import DENSE_FROM

    S, n = (12, 9) if dense else (30, 4)
    assert (n >= DENSE_FROM * S) == dense
    q, k, v = _inputs(S=S)
    idx = torch.full((1, 2, n), -1)
    idx[0, 0, :4] = torch.tensor([5, 5, 2, 7])  # KV head 1 has no valid position
    bias = torch.zeros(1, 2, S)
    bias[0, 0, 7] = float("-inf")
    out = sparse_decode_attention_ref(q, k, v, idx, bias)
    s5 = q[0, :3] @ k[0, 0, 5] / 8.0  # the default scale 1/sqrt(64)
    s2 = q[0, :3] @ k[0, 0, 2] / 8.0
    w5, w2 = 2 * s5.exp(), s2.exp()
    want = (w5[:, None] * v[0, 0, 5] + w2[:, None] * v[0, 0, 2]) / (w5 + w2)[:, None]
    torch.testing.assert_close(out[0, :3], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 3:], torch.zeros_like(out[0, 3:]))


def test_workspace_reuse_gives_the_same_output_and_never_aliases_it(monkeypatch):
    """The torch CPU path's gathered rows go into reused buffers: outputs equal those of fresh allocations
    through a shrinking and a growing selection, on every path (tokens, pages, ranges), and no output
    shares the workspace's memory. (The fused C kernel gathers nothing; this is the path where it is
    off or cannot serve the operands.)"""
    from kvpass.kernels import cpu_decode
    from kvpass.kernels.sparse_attention import segments_decode_attention

    monkeypatch.setattr(cpu_decode, "supports", lambda *a: False)
    from kvpass.runtime.workspace import Workspace

    ws = Workspace()
    gen = torch.Generator().manual_seed(3)
    q, k, v = _inputs(B=2, S=64)
    outs = []
    for n in (5, 3, 12):
        idx = torch.stack([torch.randperm(64, generator=gen)[:n] for _ in range(4)]).view(2, 2, n)
        pages = torch.stack([torch.randperm(16, generator=gen)[: (n + 3) // 4] for _ in range(4)]).view(2, 2, -1)
        for fn in (
            lambda w: sparse_decode_attention_ref(q, k, v, idx, None, 0.2, workspace=w),
            lambda w: paged_decode_attention_ref(q, k, v, pages, 4, 61, 0.2, workspace=w),
            lambda w: segments_decode_attention(q, k, v, [(0, 2), (60, 64)], 0.2, idx.clamp(2, 59), w),
        ):
            want, got = fn(None), fn(ws)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            outs.append(got)
    assert ws.nbytes() > 0
    held = [b.untyped_storage().data_ptr() for b in ws._bufs.values()]
    assert all(o.untyped_storage().data_ptr() not in held for o in outs)

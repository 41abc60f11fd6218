"""The fused CPU decode attention (a C kernel, kvpass/kernels/cpu_decode.py) against its float64 torch
reference, and the fp32 CPU paths that now run it against independent formulas."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvpass.kernels import cpu_decode
from kvpass.kernels.cpu_decode import cpu_decode_attention, cpu_decode_attention_ref
from kvpass.kernels.sparse_attention import paged_decode_attention_ref, segments_decode_attention
from strategies import SEEDS, TOL, make_strided


def test_kernel_is_built_here():
    # the machines this project runs on have the C compiler Inductor needs; a kernel that silently
    # failed to build would leave every test below on the torch path
    assert cpu_decode.available()


@given(
    b=st.integers(1, 3),
    h_kv=st.integers(1, 3),
    # groups 1-8 at head dims 64 and 128 run the unrolled copies of the vector path; other groups and dims
    # that are a multiple of the machine's lanes (4, 8 or 16) the generic copy; 12 on AVX2 and 264 (over
    # 256) the scalar loops
    g=st.sampled_from([1, 2, 3, 4, 7, 9, 16]),
    d=st.sampled_from([12, 16, 24, 64, 128, 264]),
    s=st.integers(1, 70),
    n=st.integers(0, 90),
    listed=st.booleans(),
    bias=st.sampled_from([None, "log_degree", "padding"]),
    layout=st.sampled_from(["contiguous", "s_slice", "bshd"]),
    big=st.booleans(),  # scores spread over hundreds: exp underflows to 0 for most positions
    threads=st.sampled_from([1, 2, 5]),
    seed=SEEDS,
)
def test_kernel_matches_reference(b, h_kv, g, d, s, n, listed, bias, layout, big, threads, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * g, d, generator=gen) * (30.0 if big else 1.0)
    k = make_strided(torch.randn(b, h_kv, s, d, generator=gen), layout)
    v = make_strided(torch.randn(b, h_kv, s, d, generator=gen), layout)
    # positions out of range (-1 padding, >= s) are skipped; duplicates count twice
    idx = torch.randint(-2, s + 2, (b, h_kv, n), generator=gen) if listed else None
    bs = None
    if bias == "log_degree":  # CentroidKV: log of a merged slot's degree, -inf for an empty slot
        bs = torch.randint(0, 5, (b, h_kv, s), generator=gen).float().log()
    elif bias == "padding":  # a left-padded row: -inf on its first positions, shared by the heads
        first = torch.randint(0, s + 1, (b, 1, 1), generator=gen)
        bs = torch.where(torch.arange(s) < first, float("-inf"), 0.0).expand(b, h_kv, s)
    # threads > 1 splits the pairs only past MIN_ROWS_PER_THREAD rows: large s and n reach it
    out = cpu_decode_attention(q, k, v, idx, 0.3, bs, threads=threads)
    ref = cpu_decode_attention_ref(q, k, v, idx, 0.3, bs)
    atol, rtol = TOL[torch.float32]
    if big:  # fp32 scores in the hundreds carry rounding of their own (an ulp of 100 is 8e-6): the tolerance
        # grows with the largest score, as a D-term sum in fp32 may round it
        smax = float((q.reshape(b, h_kv, g, d).double() @ k.double().transpose(-1, -2)).abs().max()) * 0.3
        atol = max(atol, 4 * 2.0 ** -24 * smax * d ** 0.5)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_rows_with_nothing_valid_are_zero():
    q, k, v = torch.randn(2, 6, 64), torch.randn(2, 3, 10, 64), torch.randn(2, 3, 10, 64)
    idx = torch.randint(0, 10, (2, 3, 5))
    idx[1, 2] = -1  # one (row, head) lists only padding
    out = cpu_decode_attention(q, k, v, idx, 0.125)
    assert torch.equal(out[1, 4:], torch.zeros(2, 64))
    torch.testing.assert_close(out, cpu_decode_attention_ref(q, k, v, idx, 0.125))
    assert torch.equal(cpu_decode_attention(q, k, v, idx[:, :, :0], 0.125), torch.zeros(2, 6, 64))


def test_dense_equals_sdpa_and_writes_out():
    q, k, v = torch.randn(2, 9, 64), torch.randn(2, 3, 300, 64), torch.randn(2, 3, 300, 64)
    out = torch.full((2, 9, 64), float("nan"))
    got = cpu_decode_attention(q, k, v, None, None, out=out)
    assert got is out
    ref = F.scaled_dot_product_attention(q.view(2, 3, 3, 64), k, v).reshape(2, 9, 64)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


@given(
    b=st.integers(1, 2),
    h_kv=st.integers(1, 3),
    n=st.integers(900, 2600),  # a pair's rows are split into parts of 512 or more from 1024 rows (PART_ROWS)
    listed=st.booleans(),
    skip=st.sampled_from(["none", "head", "tail", "all"]),  # whole parts with no valid row
    big=st.booleans(),  # parts whose softmax mass underflows against another part's
    seed=SEEDS,
)
def test_parts_of_a_pairs_rows_merge_to_the_reference(b, h_kv, n, listed, skip, big, seed):
    gen = torch.Generator().manual_seed(seed)
    g, d, s = 3, 64, n + 40
    q = torch.randn(b, h_kv * g, d, generator=gen) * (30.0 if big else 1.0)
    k, v = torch.randn(b, h_kv, s, d, generator=gen), torch.randn(b, h_kv, s, d, generator=gen)
    idx = torch.randint(0, s, (b, h_kv, n), generator=gen) if listed else None
    bs = None
    if listed:
        if skip == "head":
            idx[..., : n // 2] = -1
        elif skip == "tail":
            idx[..., 700:] = -1
        elif skip == "all":
            idx[1:] = -1  # the other rows list nothing
    else:
        s, k, v = n, k[:, :, :n], v[:, :, :n]
        lo = {"none": 0, "head": n - 300, "tail": 0, "all": n}[skip]
        bs = torch.zeros(b, h_kv, n)
        bs[..., :lo] = float("-inf")  # a padded row: its first parts hold no valid row
        if skip == "tail":
            bs[..., 600:] = float("-inf")
    out = cpu_decode_attention(q, k, v, idx, 0.3, bs, threads=1)
    ref = cpu_decode_attention_ref(q, k, v, idx, 0.3, bs)
    atol, rtol = TOL[torch.float32]
    if big:  # as in test_kernel_matches_reference: the tolerance grows with the largest score
        smax = float((q.reshape(b, h_kv, g, d).double() @ k.double().transpose(-1, -2)).abs().max()) * 0.3
        atol = max(atol, 4 * 2.0 ** -24 * smax * d ** 0.5)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # the parts depend on the rows alone: the same bits on more threads and for a row run alone
    assert torch.equal(cpu_decode_attention(q, k, v, idx, 0.3, bs, threads=2), out)
    one = cpu_decode_attention(q[-1:], k[-1:], v[-1:], None if idx is None else idx[-1:], 0.3,
                               None if bs is None else bs[-1:], threads=2)
    assert torch.equal(one, out[-1:])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_pairs_with_the_same_result(threads):
    # enough rows that the pairs and the parts of their rows are split over the threads
    # (MIN_ROWS_PER_THREAD): each thread writes its own pairs or parts only
    gen = torch.Generator().manual_seed(threads)
    q = torch.randn(3, 9, 64, generator=gen)
    k, v = torch.randn(3, 3, 9000, 64, generator=gen), torch.randn(3, 3, 9000, 64, generator=gen)
    idx = torch.randint(-1, 9000, (3, 3, 5000), generator=gen)
    for i in (None, idx):
        want = cpu_decode_attention(q, k, v, i, 0.1, threads=1)
        assert torch.equal(cpu_decode_attention(q, k, v, i, 0.1, threads=threads), want)
        torch.testing.assert_close(want, cpu_decode_attention_ref(q, k, v, i, 0.1), atol=2e-5, rtol=1e-5)


def test_unsupported_operands_are_refused():
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16)
    assert not cpu_decode.supports(q.half(), k.half(), v.half())
    assert not cpu_decode.supports(q, make_strided(k, "d_strided"), v)
    assert not cpu_decode.supports(torch.randn(1, 17, 16), k, v)  # a query group over 16
    with pytest.raises(ValueError, match="kvpass: cpu_decode_attention needs fp32"):
        cpu_decode_attention(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="needs idx int64"):
        cpu_decode_attention(q, k, v, torch.zeros(1, 1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="needs bias fp32"):
        cpu_decode_attention(q, k, v, None, None, torch.zeros(1, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs out fp32"):
        cpu_decode_attention(q, k, v, out=torch.empty(1, 2, 8))


@given(ranges=st.sampled_from([[(0, 3)], [(0, 2), (20, 31)], [(5, 31)]]), n=st.integers(0, 8), seed=SEEDS)
def test_segments_path_equals_listing_the_positions(ranges, n, seed):
    # StreamingLLM's and ClusterKV's ranges and recalled rows now go through the kernel as one list
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 64, generator=gen)
    k, v = torch.randn(2, 3, 31, 64, generator=gen), torch.randn(2, 3, 31, 64, generator=gen)
    free = torch.tensor([p for p in range(31) if not any(lo <= p < hi for lo, hi in ranges)])
    idx = free[torch.stack([torch.randperm(len(free), generator=gen)[:n] for _ in range(6)])].view(2, 3, -1)
    out = segments_decode_attention(q, k, v, ranges, 0.125, idx)
    listed = torch.cat([torch.arange(lo, hi).expand(2, 3, -1) for lo, hi in ranges] + [idx], dim=2)
    torch.testing.assert_close(out, cpu_decode_attention_ref(q, k, v, listed, 0.125), atol=2e-5, rtol=1e-5)


def test_paged_path_skips_the_newest_pages_empty_tail():
    gen = torch.Generator().manual_seed(0)
    B, H, C, D, ps, length = 2, 3, 64, 64, 16, 37
    q = torch.randn(B, 3 * H, D, generator=gen)
    k, v = torch.randn(B, H, C, D, generator=gen), torch.randn(B, H, C, D, generator=gen)
    pages = torch.tensor([0, 2]).expand(B, H, 2).contiguous()  # page 2 holds positions 32..36 only
    out = paged_decode_attention_ref(q, k, v, pages, ps, length, 0.125, dense=False, newest_last=True)
    pos = torch.cat([torch.arange(16), torch.arange(32, 37)]).expand(B, H, -1)
    torch.testing.assert_close(out, cpu_decode_attention_ref(q, k, v, pos, 0.125), atol=2e-5, rtol=1e-5)


def test_native_off_keeps_the_torch_path():
    # KVPASS_NATIVE=0 (or no compiler): the CPU paths run torch ops and give the same attention
    code = (
        "import torch; from kvpass.kernels import cpu_decode; "
        "from kvpass.kernels.sparse_attention import sparse_decode_attention_ref as f; "
        "assert not cpu_decode.available(); torch.manual_seed(0); "
        "q, k, v = torch.randn(1, 6, 64), torch.randn(1, 3, 50, 64), torch.randn(1, 3, 50, 64); "
        "i = torch.randint(0, 50, (1, 3, 8)); torch.save((q, k, v, i, f(q, k, v, i, scale=0.1)), 'o.pt')"
    )
    env = dict(os.environ, KVPASS_NATIVE="0")
    tmp = os.environ.get("TMPDIR", "/tmp")
    cwd = os.path.join(tmp, f"kvpass-native-off-{os.getpid()}")
    os.makedirs(cwd, exist_ok=True)
    subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, check=True, timeout=300)
    q, k, v, i, off = torch.load(os.path.join(cwd, "o.pt"))
    torch.testing.assert_close(off, cpu_decode_attention(q, k, v, i, 0.1), atol=2e-5, rtol=1e-5)


@given(b=st.integers(1, 2), h_kv=st.integers(1, 3), g=st.sampled_from([1, 3, 16]), d=st.sampled_from([12, 64]),
       cap=st.integers(1, 40), cut=st.integers(1, 40), n=st.integers(0, 30), listed=st.booleans(),
       bias=st.booleans(), seed=SEEDS)
def test_decode_step_attends_the_first_length_rows_in_place(b, h_kv, g, d, cap, cut, n, listed, bias, seed):
    # the runtime's steady entry reads a store's buffers in place: positions [length, cap) hold other data
    # (here NaN), never read; a listed position at or past length is skipped, as past S in the kernel
    torch.manual_seed(seed)
    length = min(max(cut, 1), cap)
    q = torch.randn(b, h_kv * g, 1, d)
    k, v = torch.randn(b, h_kv, cap, d), torch.randn(b, h_kv, cap, d)
    k[:, :, length:] = float("nan")
    v[:, :, length:] = float("nan")
    idx = torch.randint(-2, cap + 2, (b, h_kv, n)) if listed else None
    # a log-degree-like bias over the whole buffer (-inf: a slot to skip), NaN past length
    bb = torch.randn(b, h_kv, cap).masked_fill(torch.rand(b, h_kv, cap) < 0.2, float("-inf")) if bias else None
    if bias:
        bb[:, :, length:] = float("nan")
    out = cpu_decode.decode_step(q, k, v, length, idx, 0.3, bb)
    want = cpu_decode_attention_ref(q[:, :, 0], k[:, :, :length], v[:, :, :length], idx, 0.3,
                                    None if bb is None else bb[:, :, :length])
    assert out.shape == (b, h_kv * g, 1, d)
    torch.testing.assert_close(out[:, :, 0], want, atol=2e-5, rtol=1e-5)


def test_decode_step_returns_none_where_it_does_not_serve():
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16)
    assert cpu_decode.decode_step(q, k, v, 4, None, 0.1) is not None
    assert cpu_decode.decode_step(q.half(), k.half(), v.half(), 4, None, 0.1) is None
    assert cpu_decode.decode_step(torch.randn(1, 2, 2, 16), k, v, 4, None, 0.1) is None  # two queries
    assert cpu_decode.decode_step(q, k, v, 5, None, 0.1) is None  # past the buffers
    assert cpu_decode.decode_step(q, make_strided(k, "d_strided"), v, 4, None, 0.1) is None
    assert cpu_decode.decode_step(q, k, v, 4, torch.zeros(1, 1, 2, dtype=torch.int32), 0.1) is None
    assert cpu_decode.decode_step(q, k, v, 4, None, 0.1, torch.zeros(1, 1, 3)) is None  # bias shorter than length
    assert cpu_decode.decode_step(q, k, v, 4, None, 0.1, torch.zeros(1, 1, 4, dtype=torch.float64)) is None


def test_a_cache_stub_is_refused_not_read():
    # the kernel reads memory past __torch_function__: a stub must take the torch path, which raises
    from kvpass.kernels.sparse_attention import sparse_decode_attention_ref
    from kvpass.runtime.errors import KVPassError
    from kvpass.runtime.store import as_cache_stub, make_stub

    q, k_new = torch.randn(1, 6, 64), torch.randn(1, 3, 1, 64)
    stub = as_cache_stub(make_stub(k_new, 40), None)
    assert not cpu_decode.supports(q, stub, stub)
    with pytest.raises(KVPassError, match="outside the compiled graph"):
        sparse_decode_attention_ref(q, stub, stub, torch.zeros(1, 3, 4, dtype=torch.long))


@pytest.mark.parametrize("kind", ["none", "bool", "float", "shared"])
def test_fulls_grouped_decode_equals_sdpa_with_its_mask(kind):
    # Full's exact one-token step (padding masks as the kernel's bias) against SDPA with enable_gqa
    from kvpass.runtime.call import _grouped_decode

    gen = torch.Generator().manual_seed(5)
    B, S = 3, 50
    q = torch.randn(B, 9, 1, 64, generator=gen)
    k, v = torch.randn(B, 3, S, 64, generator=gen), torch.randn(B, 3, S, 64, generator=gen)
    keep = torch.arange(S) >= torch.tensor([0, 7, 49])[:, None]  # left padding of 0, 7 and 49 tokens
    mask = {"none": None, "bool": keep[:, None, None, :],
            "float": torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :],
            "shared": keep[:1, None, None, :]}[kind]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(_grouped_decode(q, k, v, mask, 0.125), want, atol=2e-5, rtol=1e-5)

"""CentroidKV (Chelsea, arXiv 2506.11418) as a policy: validation, the merged cache's invariants at every
step (degrees sum to the tokens seen, sinks and recent tokens untouched, the physical size within the
budget), exactness on duplicated tokens, outlier heads, and end-to-end behaviour on a tiny model."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpass import CentroidKV, KVPassError, kvpass
from kvpass.kernels.centroid import log_degree_bias
from kvpass.runtime import Runtime
from kvpass.runtime.store import make_stub
from tiny import generate, prompt, tiny_llama


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"cache_ratio": None}, "exactly one of cache_ratio and budget"),
        ({"budget": 512}, "exactly one of cache_ratio and budget"),
        ({"cache_ratio": 0.0}, "0 < cache_ratio <= 1"),
        ({"cache_ratio": 1.5}, "0 < cache_ratio <= 1"),
        ({"cache_ratio": "0.5"}, "a number cache_ratio"),
        ({"cache_ratio": None, "budget": 144}, "budget > sinks \\+ recent \\+ step \\(144\\)"),
        ({"chunk": 1}, "chunk >= 2"),
        ({"chunk": 1024}, "chunk <= 512"),
        ({"merge_ratio": 1.2}, "merge_ratio <= 1"),
        ({"merge_ratio_decay": -0.1}, "0 <= merge_ratio_decay"),
        ({"outlier_heads": 0.6}, "outlier_heads <= 0.5"),
        ({"sinks": -1}, "sinks >= 0"),
        ({"step": 0}, "step >= 1"),
        ({"expected_new_tokens": -5}, "expected_new_tokens >= 0"),
    ],
)
def test_bad_values_name_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        CentroidKV(**kw)


def test_with_budget_and_keys():
    assert CentroidKV.with_budget(512) == CentroidKV(budget=512, cache_ratio=None)
    keys = {CentroidKV().key(), CentroidKV(cache_ratio=0.5).key(), CentroidKV(outlier_heads=0.0).key(),
            CentroidKV.with_budget(512).key()}
    assert len(keys) == 4


# -- driving one site by hand -----------------------------------------------------------------------
def drive(policy, k, v, steps, rt=None, site=0, g=2, seed=0):
    """Prefill ``k, v (B, H, n, D)`` through the owned path, then ``steps`` decode steps with random
    tokens; yields (state, keys so far, values so far, q, out) after each decode step."""
    rt = rt or Runtime(policy)
    gen = torch.Generator().manual_seed(seed)
    b, h, n, d = k.shape
    q = torch.randn(b, h * g, n, d, generator=gen)
    rt.attend_owned(site, q, k, v, None, None, None, 0.0, True)
    for _ in range(steps):
        kn, vn = torch.randn(b, h, 1, d, generator=gen), torch.randn(b, h, 1, d, generator=gen)
        q1 = torch.randn(b, h * g, 1, d, generator=gen)
        stub = make_stub(kn, k.shape[2])
        out = rt.attend_owned(site, q1, kn, vn, stub, stub, None, 0.0, False)
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        yield rt.state(site), k, v, q1, out


def merged_oracle(q, k, v, deg, scale):
    """softmax(q·kᵀ·scale + log deg)·v in float64 with explicit loops over heads."""
    b_, hq, _, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty(b_, hq, 1, v.shape[-1], dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            s = k[b, h // g].double() @ q[b, h, 0].double() * scale + deg[b, h // g].double().log()
            out[b, h, 0] = torch.softmax(s, 0) @ v[b, h // g].double()
    return out


@pytest.mark.parametrize("budget, chunk", [(200, 32), (300, 256), (180, 7)])
def test_invariants_at_every_step(budget, chunk):
    policy = CentroidKV(budget=budget, cache_ratio=None, sinks=8, recent=16, chunk=chunk, step=24,
                        outlier_heads=0.0)
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 500, 16), torch.randn(2, 3, 500, 16)
    for st_, kk, vv, q, out in drive(policy, k, v, steps=40):
        s = st_.s
        assert s <= budget  # never more slots than the budget
        assert st_.k.shape[2] <= budget  # and the buffers themselves are that small
        torch.testing.assert_close(st_.degree_sum(), torch.full((2, 3), float(kk.shape[2])))  # degrees = tokens
        assert torch.equal(st_.k[:, :, :8], kk[:, :, :8]) and torch.equal(st_.deg[:, :, :8], torch.ones(2, 3, 8))
        assert torch.equal(st_.k[:, :, s - 16 : s], kk[:, :, -16:])  # recent tokens untouched
        assert torch.equal(st_.v[:, :, s - 16 : s], vv[:, :, -16:])
        # the bias the state keeps between merges is the one its degrees give
        assert torch.equal(st_.bias[:, :, :s], log_degree_bias(st_.deg[:, :, :s]))
        ref = merged_oracle(q, st_.k[:, :, :s], st_.v[:, :, :s], st_.deg[:, :, :s], 1 / math.sqrt(16))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert st_.rounds >= 2 and st_.merged == 540 - st_.s


def test_merged_keys_lie_in_the_hull_of_their_members():
    """With one chunk and one round, every merged slot is a degree-weighted mean of original tokens:
    each channel lies within the min/max of the prompt keys."""
    policy = CentroidKV(budget=100, cache_ratio=None, sinks=0, recent=2, chunk=256, step=8, outlier_heads=0.0)
    torch.manual_seed(1)
    k, v = torch.randn(1, 2, 160, 8), torch.randn(1, 2, 160, 8)
    st_, *_ = next(drive(policy, k, v, steps=1))
    lo, hi = k.min(2, keepdim=True).values, k.max(2, keepdim=True).values
    live = st_.k[:, :, : st_.s - 2]  # the last two slots are this step's recent tokens
    assert bool(((live >= lo - 1e-6) & (live <= hi + 1e-6)).all())


def test_duplicated_tokens_merge_exactly():
    """A prompt made of identical (key, value) pairs merges pair by pair; attention with log N then
    equals attention over the original tokens."""
    policy = CentroidKV(budget=200, cache_ratio=None, sinks=4, recent=8, chunk=64, step=16, outlier_heads=0.0,
                        merge_ratio=1.0, merge_ratio_decay=0.0)
    torch.manual_seed(2)
    k = torch.randn(1, 2, 160, 16).repeat_interleave(2, dim=2)  # tokens 2i and 2i+1 identical
    v = torch.randn(1, 2, 160, 16).repeat_interleave(2, dim=2)
    rt = Runtime(policy)
    q = torch.randn(1, 4, 320, 16)
    rt.attend_owned(0, q, k, v, None, None, None, 0.0, True)
    q1 = torch.randn(1, 4, 1, 16)
    kn, vn = k[:, :, :1], v[:, :, :1]  # the new token repeats the first one (merging it is exact too)
    stub = make_stub(kn, 320)
    out = rt.attend_owned(0, q1, kn, vn, stub, stub, None, 0.0, False)
    st_ = rt.state(0)
    assert st_.s < 200 and st_.merged > 0
    full = F.scaled_dot_product_attention(q1, torch.cat([k, kn], 2), torch.cat([v, vn], 2), enable_gqa=True)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


def test_merge_ratio_zero_and_covering_budget_keep_every_token():
    torch.manual_seed(3)
    k, v = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    for policy in (CentroidKV(merge_ratio=0.0, outlier_heads=0.0),
                   CentroidKV(budget=1000, cache_ratio=None, outlier_heads=0.0)):
        for st_, kk, vv, q, out in drive(policy, k, v, steps=3):
            assert st_.s == kk.shape[2] and st_.merged == 0
            full = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
            torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


def test_outlier_heads_are_the_least_redundant_and_stay_whole():
    """Three sites of 2 KV heads: 1/6 of the heads is an outlier; the one with random (non-redundant) keys
    is chosen, kept whole, and the other heads' budget shrinks to pay for it."""
    policy = CentroidKV(cache_ratio=0.5, sinks=4, recent=8, chunk=32, step=8, outlier_heads=1 / 6)
    rt = Runtime(policy)
    torch.manual_seed(4)
    base = torch.randn(1, 2, 100, 16)
    smooth = base.repeat_interleave(4, dim=2) + 0.01 * torch.randn(1, 2, 400, 16)  # highly redundant
    gens = []
    for site in range(3):
        k = smooth.clone()
        if site == 1:
            k[:, 1] = torch.randn(400, 16)  # site 1, head 1: nothing alike
        gens.append(drive(policy, k, torch.randn(1, 2, 400, 16), steps=5, rt=rt, site=site, seed=site))
    # prefill every site first (as a model does), then decode
    states = [next(g_) for g_ in gens]
    for _ in range(4):
        states = [next(g_) for g_ in gens]
    s1 = states[1][0]
    assert s1.outl.tolist() == [1] and s1.comp.tolist() == [0]
    assert torch.equal(s1.bias[:, :, : s1.s], log_degree_bias(s1.deg[:, :, : s1.s]))
    assert s1.ko.shape[2] >= s1.logical == 405
    assert all(st_.outl.numel() == 0 for st_, *_ in (states[0], states[2]))
    # the model as a whole holds at most half of Full's token slots
    held = sum(st_.s * len(st_.comp) + st_.logical * len(st_.outl) for st_, *_ in states)
    assert held <= 0.5 * 405 * 6
    q, kk, vv = states[1][3], states[1][1], states[1][2]
    torch.testing.assert_close(  # the outlier head's query heads attend exactly
        states[1][4][:, 2:], F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)[:, 2:], atol=1e-5, rtol=1e-5)


@settings(max_examples=15)
@given(n=st.integers(1, 300), steps=st.integers(1, 30), chunk=st.sampled_from([2, 5, 16, 64]),
       ratio=st.sampled_from([0.1, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_degrees_always_sum_to_tokens_seen(n, steps, chunk, ratio, seed):
    policy = CentroidKV(budget=60, cache_ratio=None, sinks=3, recent=5, chunk=chunk, step=7, merge_ratio=ratio,
                        outlier_heads=0.0)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    for st_, kk, vv, q, out in drive(policy, k, v, steps=steps, seed=seed):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(st_.degree_sum(), torch.full((1, 2), float(kk.shape[2])))
        assert st_.s <= max(60, 3 + 5 + 1 + 7)
        assert bool((st_.deg[:, :, : st_.s] >= 1).all())


# -- end to end --------------------------------------------------------------------------------------
def test_no_merge_equals_eager_merging_runs_and_a_second_generate_starts_afresh():
    # one compile: the merging policy runs on the graphs of the one that never merges (set_policy)
    model = tiny_llama(layers=2, heads=4, kv_heads=2)
    ids, other = prompt(200), prompt(200, seed=6)
    ref = generate(model, ids, new_tokens=6)
    be = kvpass(CentroidKV(merge_ratio=0.0), strict=True)
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=be)
    try:
        def run(x):
            return model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)

        assert torch.equal(run(ids), ref)
        be.set_policy(CentroidKV(cache_ratio=0.5, sinks=4, recent=16, chunk=32, step=16))
        fresh = run(other)  # the first sequence of the merging policy
        out = run(ids)
        rows = be.report_rows()
        second = run(other)
    finally:
        model.forward = fwd
    assert out.shape == ref.shape
    full_bytes = 2 * 2 * 205 * 16 * 4  # K and V, 2 KV heads, 205 tokens, head_dim 16, fp32
    for r in rows:
        assert r["merge_rounds"] > 0 and r["tokens_logical"] == 205
        assert r["tokens_held"] <= 0.5 * 205
        assert r["device_bytes"] <= 0.5 * full_bytes
    assert "CentroidKV" in be.report()
    assert torch.equal(second, fresh)  # nothing of the sequence before it leaked into the second one


def test_static_cache_is_refused_clearly():
    model = tiny_llama(layers=2, heads=4, kv_heads=2, pad_token_id=0)
    ids = prompt(40)
    with pytest.raises(KVPassError, match="own the cache"):
        generate(model, ids, new_tokens=2, backend=kvpass(CentroidKV()), cache_implementation="static")

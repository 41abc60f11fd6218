"""ClusterKV (arXiv 2412.03213) as a policy: validation, the clustering metadata checked against the keys,
selections checked against a plain-Python oracle, decode-time clustering, dense layers, and end-to-end
equality with Full when the budget covers the context."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpass import ClusterKV, Full, KVPassError, kvpass
from kvpass.runtime import Runtime
from sites import as_sets, attend_oracle, prefill_then_decode
from tiny import generate, prompt


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"budget": 16}, "budget > sinks \\(16\\), got budget=16"),
        ({"budget": 8, "sinks": 16}, "budget > sinks"),
        ({"tokens_per_cluster": 0}, "tokens_per_cluster >= 1"),
        ({"decode_clusters": 0}, "decode_clusters >= 1"),
        ({"decode_window": 3, "decode_clusters": 4}, "decode_window >= 4"),
        ({"cache_steps": 0}, "cache_steps >= 1"),
        ({"kmeans_iters": 0}, "kmeans_iters >= 1"),
        ({"dense_layers": (0, -1)}, "dense_layers entries >= 0"),
        ({"dense_layers": "0,1"}, "tuple of layer indices"),
        ({"gqa": "mean"}, "gqa in"),
        ({"budget": 1024.0}, "integer budget"),
        ({"offload": 1}, "offload True or False"),
    ],
)
def test_bad_values_name_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        ClusterKV(**kw)


def test_dense_layers_normalised_and_keyed():
    assert ClusterKV(dense_layers=[1, 0, 1]).dense_layers == (0, 1)
    assert ClusterKV(dense_layers=3).dense_layers == (3,)
    keys = {ClusterKV().key(), ClusterKV(budget=512).key(), ClusterKV(dense_layers=()).key(),
            ClusterKV(gqa="max").key(), ClusterKV(decode_window=64).key()}
    assert len(keys) == 5
    assert ClusterKV.with_budget(256) == ClusterKV(budget=256)


# -- the site state against oracles ---------------------------------------------------------------------
def clustered_keys(n_dirs=6, noise=0.05, seed=0):
    """Keys near a few random directions with random norms (so that clusters are real)."""
    g = torch.Generator().manual_seed(seed)

    def make(shape):
        dirs = torch.randn(n_dirs, shape[-1], generator=g)
        pick = torch.randint(0, n_dirs, shape[:-1], generator=g)
        norm = torch.rand(*shape[:-1], 1, generator=g) * 3 + 0.5
        return (dirs[pick] + noise * torch.randn(shape, generator=g)) * norm

    return make


def check_metadata(st_, k, policy):
    """The state's clusters partition [sinks, tail) and their centroids are the means of their keys."""
    b_, hkv = k.shape[:2]
    sizes, order, cent = st_.sizes, st_.order, st_.centroids
    assert int(sizes.sum(-1).unique().item()) == st_.tail - policy.sinks == order.shape[-1]
    offsets = [0] + sizes[0, 0].cumsum(0).tolist()
    for b in range(b_):
        for h in range(hkv):
            assert sorted(order[b, h].tolist()) == list(range(policy.sinks, st_.tail))
            offs = [0] + sizes[b, h].cumsum(0).tolist()
            for c in range(sizes.shape[-1]):
                members = order[b, h, offs[c] : offs[c + 1]]
                if len(members):
                    torch.testing.assert_close(cent[b, h, c], k[b, h, members].float().mean(0), atol=1e-5, rtol=1e-5)
    return offsets


def oracle_select(st_, q, length, policy, group):
    """Plain Python: sinks + the best clusters (group-summed q·μ, ties to the lower cluster) taken whole
    and the last trimmed + the newest tokens since the last clustering, exactly min(budget, L) tokens."""
    b_, hkv = st_.sizes.shape[:2]
    out = {}
    for b in range(b_):
        for h in range(hkv):
            sinks = list(range(min(policy.sinks, length)))
            n_recent = min(length - st_.tail, policy.budget - len(sinks))
            recent = list(range(length - n_recent, length))
            room = policy.budget - len(sinks) - n_recent
            qs = [q[b, h * group + j].double() for j in range(group)]
            cent = st_.centroids[b, h].double()
            if policy.gqa == "sum":
                scores = [float(sum(qs) @ cent[c]) for c in range(cent.shape[0])]
            else:
                scores = [max(float(qj @ cent[c]) for qj in qs) for c in range(cent.shape[0])]
            offs = [0] + st_.sizes[b, h].cumsum(0).tolist()
            chosen = []
            for c in sorted(range(len(scores)), key=lambda c: (-scores[c], c)):
                chosen += st_.order[b, h, offs[c] : offs[c + 1]].tolist()[: room - len(chosen)]
                if len(chosen) >= room:
                    break
            out[b, h] = sinks + chosen + recent
    return out


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("gqa", ["sum", "max"])
@pytest.mark.parametrize("budget, sinks, tpc", [(64, 4, 10), (40, 0, 7), (100, 16, 25)])
def test_selection_equals_oracle(budget, sinks, tpc, gqa, owned):
    policy = ClusterKV(budget=budget, sinks=sinks, tokens_per_cluster=tpc, dense_layers=(), gqa=gqa,
                       decode_window=64, decode_clusters=2)
    rt = Runtime(policy)
    g = 3
    steps = prefill_then_decode(policy, g=g, length=150, steps=4, owned=owned, rt=rt, keys=clustered_keys())
    st_ = rt.state(0)
    assert st_.sizes.shape[-1] == (150 - sinks) // tpc
    for q, k, v, out, idx in steps:
        check_metadata(st_, k, policy)
        want = oracle_select(st_, q, k.shape[2], policy, g)
        for key, sel in want.items():
            got = idx[key[0], key[1]].tolist()
            assert len(got) == len(sel) == min(budget, k.shape[2])
            assert got == sel  # the same tokens in the same order: sinks, clusters by score, recent
            assert len(set(got)) == len(got)
        ref = attend_oracle(q, k, v, as_sets(idx), 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_time_clustering_appends_clusters():
    policy = ClusterKV(budget=48, sinks=4, tokens_per_cluster=20, dense_layers=(), decode_window=8,
                       decode_clusters=2)
    rt = Runtime(policy)
    steps = prefill_then_decode(policy, length=100, steps=17, rt=rt, keys=clustered_keys())
    st_ = rt.state(0)
    # prefill: (100 - 4) // 20 = 4 clusters over [4, 100); the decode steps at lengths 109 and 117 each
    # cluster the 8 tokens before the current one into 2 more
    assert st_.sizes.shape[-1] == 4 + 2 * 2
    assert st_.tail == 116 and st_.clusterings == 3
    q, k, v, out, idx = steps[-1]
    check_metadata(st_, k, policy)
    assert idx[0, 0].tolist()[-1] == 116  # the current token is never clustered away
    for key, sel in oracle_select(st_, q, k.shape[2], policy, 3).items():
        assert idx[key[0], key[1]].tolist() == sel


def test_recent_tokens_beyond_the_budget_keep_the_newest():
    policy = ClusterKV(budget=24, sinks=4, tokens_per_cluster=10, dense_layers=(), decode_window=64,
                       decode_clusters=2)
    steps = prefill_then_decode(policy, length=60, steps=30, keys=clustered_keys())
    q, k, v, out, idx = steps[-1]
    length = k.shape[2]
    # 30 unclustered tokens > budget - sinks: sinks + the newest 20, no cluster
    assert idx[0, 0].tolist() == list(range(4)) + list(range(length - 20, length))


def test_dense_layers_and_covering_budget_attend_everything():
    policy = ClusterKV(budget=256, sinks=4, tokens_per_cluster=10, dense_layers=(0,))
    rt = Runtime(policy)
    rt.info(0, layer=0)
    for *_, idx in prefill_then_decode(policy, length=200, steps=2, rt=rt):
        assert idx is None
    assert rt.state(0).sizes is None  # a dense layer does not cluster
    rt2 = Runtime(ClusterKV(budget=256, dense_layers=()))
    for *_, idx in prefill_then_decode(rt2.policy, length=100, steps=2, rt=rt2):
        assert idx is None  # budget >= L: Full's tokens


@settings(max_examples=15)
@given(
    length=st.integers(1, 120),
    budget=st.integers(2, 80),
    sinks=st.integers(0, 8),
    tpc=st.integers(1, 30),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_selection_holds_exactly_min_budget_length(length, budget, sinks, tpc, steps, seed):
    if budget <= sinks:
        budget = sinks + 1
    policy = ClusterKV(budget=budget, sinks=sinks, tokens_per_cluster=tpc, dense_layers=(), decode_window=4,
                       decode_clusters=1)
    rt = Runtime(policy)
    keys = clustered_keys(seed=seed)
    for q, k, v, out, idx in prefill_then_decode(policy, b=1, hkv=2, length=length, steps=steps, rt=rt,
                                                  keys=keys, seed=seed):
        assert not torch.isnan(out).any()
        length_now = k.shape[2]
        if idx is None:
            assert length_now <= budget
            continue
        for row in idx.reshape(-1, idx.shape[-1]).tolist():
            assert len(row) == len(set(row)) == min(budget, length_now)
            assert all(0 <= t < length_now for t in row)
            assert set(range(min(sinks, length_now))) <= set(row)
            assert length_now - 1 in row  # the current token


def test_zero_keys_do_not_produce_nan():
    policy = ClusterKV(budget=32, sinks=2, tokens_per_cluster=8, dense_layers=())
    for q, k, v, out, idx in prefill_then_decode(policy, length=80, steps=2, keys=torch.zeros):
        assert torch.isfinite(out).all() and idx is not None


# -- offload: host tier, device tier, fetches ---------------------------------------------------------------
def offload_run(cache_steps):
    """Drive ClusterKV with and without offload on the same inputs; check they attend the same tokens
    to the same result; return the offloading site's hit rate."""
    kw = dict(budget=64, sinks=4, tokens_per_cluster=10, dense_layers=(), decode_window=8, decode_clusters=2)
    keys = clustered_keys(seed=5)
    plain = prefill_then_decode(ClusterKV(**kw), length=200, steps=20, owned=True, keys=keys, seed=3)
    policy = ClusterKV(**kw, offload=True, cache_steps=cache_steps)
    rt = Runtime(policy)
    keys = clustered_keys(seed=5)
    off = prefill_then_decode(policy, length=200, steps=20, owned=True, keys=keys, seed=3, rt=rt)
    for (q, k, v, out, idx), (q2, k2, v2, out2, idx2) in zip(plain, off):
        assert torch.equal(k, k2) and torch.equal(idx, idx2)  # the same selection, decode clustering included
        torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)
    st_ = rt.state(0)
    row = st_.row()
    assert st_.clusterings == 3  # the prompt, then two windows of 8 generated tokens (done in fetch)
    assert row["host_bytes"] == st_.store.nbytes() > 0
    slot = 2 * 16 * 4  # K and V of one token (head_dim 16, fp32)
    # every step recalls 64 - 4 sinks - recent tokens; only the misses crossed the tiers
    assert 0 < row["bytes_moved"] < 20 * 2 * 2 * 60 * slot
    assert 0.0 < row["hit_rate"] < 1.0
    return row["hit_rate"]


def test_offload_adopts_a_cache_filled_elsewhere_like_the_plain_path():
    """A decode step whose past is a real cache (an eager prefill, the bench's shared prefill) is
    adopted: metadata and device tier are built there, and the step is a compressed one in both modes."""
    from kvpass.runtime.store import make_stub

    kw = dict(budget=48, sinks=4, tokens_per_cluster=12, dense_layers=(), decode_window=8, decode_clusters=2)
    g = torch.Generator().manual_seed(0)
    k, v = clustered_keys(seed=7)((1, 2, 200, 16)), torch.randn(1, 2, 200, 16, generator=g)
    steps = [(torch.randn(1, 6, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g),
              torch.randn(1, 2, 1, 16, generator=g)) for _ in range(12)]
    runs = {}
    for offload in (False, True):
        rt = Runtime(ClusterKV(**kw, offload=offload))
        length, res = 200, []
        for i, (q1, kn, vn) in enumerate(steps):
            pk, pv = (k, v) if i == 0 else (make_stub(kn, length), make_stub(vn, length))
            ticket = rt.fetch(0, q1, pk) if offload else None
            res.append((rt.attend_owned(0, q1, kn, vn, pk, pv, None, 0.0, False, ticket), rt.state(0).last_idx))
            length += 1
        runs[offload] = res
    for (a, ia), (b, ib) in zip(runs[False], runs[True]):
        assert ia is not None and torch.equal(ia, ib)
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    assert runs[False][0][1][0, 0, -1].item() == 200  # the adopting step attends its own token


def test_offload_attends_the_same_tokens_from_the_device_tier():
    # keeping more steps' clusters on the device can only turn misses into hits
    assert offload_run(cache_steps=3) >= offload_run(cache_steps=1)


# -- end to end ------------------------------------------------------------------------------------------
# A covering budget equals eager on both cache types: tests/test_policies.py::
# test_full_and_covering_budgets_equal_eager (on Full's graphs, with the selection baselines).


# The two tests below share one compile of the model (conftest's compiled_tiny), one after the other.
def test_small_budget_report_and_swap_from_full(compiled_tiny):
    ct = compiled_tiny(layers=3, heads=4, kv_heads=2)
    ids = prompt(150)
    _, be = ct.generate(Full(), ids, new_tokens=4)  # prefill, first decode and dynamic-length decode
    policy = ClusterKV(budget=40, sinks=4, tokens_per_cluster=16, dense_layers=(0,))
    n_graphs = len(be.graphs)
    ct.generate(policy, ids, new_tokens=4)  # ClusterKV compiles to the same ops as the selection baselines
    rows = be.report_rows()
    assert len(be.graphs) == n_graphs
    dense = [r for r in rows if r["layer"] == 0]
    sparse = [r for r in rows if r["layer"] != 0]
    assert dense and sparse and all(r["dense"] for r in dense)
    assert all(r["tokens_attended"] == 153 for r in dense)
    assert all(r["tokens_attended"] == 40 and r["clusters"] == 9 for r in sparse)
    assert all(r["overhead_prefill_s"] > 0 for r in sparse)
    assert "ClusterKV" in be.report()


def test_offload_inserts_fetch_ops_and_generates_the_same_tokens(compiled_tiny):
    from torch._dynamo.utils import counters

    ct = compiled_tiny(layers=3, heads=4, kv_heads=2)
    model = ct.model
    ids = prompt(150)
    kw = dict(budget=40, sinks=4, tokens_per_cluster=16, dense_layers=(0,), decode_window=4, decode_clusters=1)
    ref, _ = ct.generate(ClusterKV(**kw), ids, new_tokens=8)  # the plain path, on the test above's graphs
    torch._dynamo.reset()
    counters.clear()
    be = kvpass(ClusterKV(**kw, offload=True), strict=True)
    out = generate(model, ids, new_tokens=8, backend=be)
    assert torch.equal(out, ref)
    assert counters["kvpass"]["fetches_inserted"] > 0
    rows = be.report_rows()
    sparse = [r for r in rows if r["layer"] != 0]
    assert all(r["host_bytes"] > 0 and r["bytes_moved"] > 0 and r["device_bytes"] < r["host_bytes"] for r in sparse)
    with pytest.raises(KVPassError, match="graph differently"):
        be.set_policy(ClusterKV(**kw))
    torch._dynamo.reset()
    with pytest.raises(KVPassError, match="own the cache"):
        generate(model, ids, new_tokens=2, backend=kvpass(ClusterKV(**kw, offload=True)),
                 cache_implementation="static")

"""Policies: validation, budget >= context equals Full, selections equal a plain-torch oracle."""

import math

import pytest
import torch

from kvpass import ClusterKV, Full, KVPassError, Quest, StreamingLLM, kvpass, policy_from_dict
from kvpass.runtime import Runtime
from sites import as_sets, attend_oracle, prefill_then_decode
from tiny import generate, prompt, tiny_llama


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Quest(budget=16, page_size=16), "budget >= 2 \\* page_size"),
        (lambda: Quest(budget=1024, page_size=0), "page_size >= 1"),
        (lambda: Quest(budget="1024"), "integer budget"),
        (lambda: Quest(budget=1024.0), "integer budget"),
        (lambda: Quest(gqa="mean"), "gqa in"),
        (lambda: StreamingLLM(sinks=-1), "sinks >= 0"),
        (lambda: StreamingLLM(window=0), "window >= 1"),
        (lambda: StreamingLLM.with_budget(4, sinks=4), "budget > sinks \\(4\\), got budget=4"),
        (lambda: policy_from_dict({"name": "Nope"}), "unknown policy 'Nope'"),
    ],
)
def test_bad_policy_values_name_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_backend_arguments():
    with pytest.raises(TypeError, match="needs a policy such as"):
        kvpass("Quest")
    with pytest.raises(TypeError, match="unknown option"):
        kvpass(Full(), budget=3)


def test_policies_are_frozen_and_keyed_by_every_parameter():
    p = Quest(budget=512)
    with pytest.raises(Exception):
        p.budget = 3
    keys = {Quest(budget=512).key(), Quest(budget=256).key(), Quest(budget=512, page_size=32).key(),
            Quest(budget=512, gqa="max").key(), StreamingLLM().key(), Full().key()}
    assert len(keys) == 6
    assert policy_from_dict({"name": "Quest", "budget": 512}) == Quest(budget=512)


# -- selections against an oracle --------------------------------------------------------------------
def _oracle_streaming(length, sinks, window):
    return set(range(min(sinks, length))) | set(range(max(0, length - window), length))


def _oracle_quest(q, k, budget, page_size, gqa):
    """Plain loops: per KV head, page upper bounds of the group's queries, top pages + the newest."""
    b_, hq, d = q.shape
    _, hkv, length, _ = k.shape
    g = hq // hkv
    pages = math.ceil(length / page_size)
    out = {}
    for b in range(b_):
        for h in range(hkv):
            scores = []
            for p in range(pages - 1):
                kp = k[b, h, p * page_size : (p + 1) * page_size].double()
                kmax, kmin = kp.max(0).values, kp.min(0).values
                per_q = [float(torch.maximum(q[b, h * g + j].double() * kmax, q[b, h * g + j].double() * kmin).sum())
                         for j in range(g)]
                scores.append(sum(per_q) if gqa == "sum" else max(per_q))
            n = min(budget // page_size - 1, pages - 1)
            top = sorted(range(pages - 1), key=lambda p: -scores[p])[:n] + [pages - 1]
            out[b, h] = {t for p in top for t in range(p * page_size, min((p + 1) * page_size, length))}
    return out


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("sinks, window", [(4, 20), (0, 33), (16, 64)])
def test_streaming_selects_sinks_and_window(sinks, window, owned):
    for q, k, v, out, idx in prefill_then_decode(StreamingLLM(sinks=sinks, window=window), owned=owned):
        length = k.shape[2]
        sel = as_sets(idx)
        want = _oracle_streaming(length, sinks, window)
        assert all(s == want for s in sel.values())
        assert all(len(s) == min(sinks + window, length) for s in sel.values())
        ref = attend_oracle(q, k, v, sel, 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("budget, page_size, gqa", [(32, 8, "sum"), (64, 16, "max"), (48, 16, "sum"), (40, 5, "sum")])
def test_quest_selects_top_pages_and_newest_page(budget, page_size, gqa, owned):
    policy = Quest(budget=budget, page_size=page_size, gqa=gqa)
    for q, k, v, out, idx in prefill_then_decode(policy, owned=owned):
        sel = as_sets(idx)
        assert sel == _oracle_quest(q, k, budget, page_size, gqa)
        assert all(len(s) <= budget and (k.shape[2] - 1) in s for s in sel.values())
        ref = attend_oracle(q, k, v, sel, 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", [Quest(budget=256, page_size=16), StreamingLLM(sinks=4, window=252)])
def test_budget_covering_context_is_exact(policy):
    for q, k, v, out, idx in prefill_then_decode(policy, length=100):
        assert idx is None  # exact attention, the same call Full makes


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("length, page_size", [(28, 8), (30, 5), (31, 16)])
def test_quest_folds_the_covered_steps_keys_when_the_context_outgrows_the_budget(length, page_size, owned):
    """Steps whose budget covers the context attend everything and leave their keys out of the pages
    (``QuestState.lag``); the step that outgrows the budget folds them in, one scheduled event, and from
    there every step selects what the oracle selects from every key."""
    budget = 32
    policy = Quest(budget=budget, page_size=page_size)
    rt = Runtime(policy)
    steps = prefill_then_decode(policy, length=length, steps=40 - length, owned=owned, rt=rt)
    covered = 0
    for q, k, v, out, idx in steps:
        if k.shape[2] <= budget:
            assert idx is None
            covered += 1
            continue
        sel = as_sets(idx)
        assert sel == _oracle_quest(q, k, budget, page_size, "sum"), k.shape[2]
        ref = attend_oracle(q, k, v, sel, 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert covered == budget - length and rt.state(0).events == 1
    # the pages hold what a state that folded every key holds: the bounds of every page of the cache
    from kvpass.kernels.quest import quest_bounds, quest_page_minmax_ref

    meta, d = rt.state(0).meta, k.shape[3]
    lo, hi = quest_page_minmax_ref(k, page_size)
    assert torch.equal(meta[:, :, : lo.shape[2], :d], quest_bounds(hi, meta.dtype, up=True))
    assert torch.equal(meta[:, :, : lo.shape[2], d:], quest_bounds(lo, meta.dtype, up=False))


# -- end to end on a tiny model ----------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_full_and_covering_budgets_equal_eager(cache):
    model = tiny_llama(layers=2, heads=6, kv_heads=2)
    ids = prompt(40)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    ref = generate(model, ids, new_tokens=6, **kw)
    # one compile: the covering budgets run on Full's graphs (set_policy; tests/test_backend.py checks
    # that a swapped-in policy equals a backend of its own)
    be = kvpass(Full(), strict=True)
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=be)
    try:
        for policy in (Full(), Quest(budget=64, page_size=8), StreamingLLM(sinks=4, window=60),
                       ClusterKV(budget=128, sinks=4, tokens_per_cluster=8, dense_layers=())):
            be.set_policy(policy)
            out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, **kw)
            assert be.graphs, "nothing was compiled"
            assert torch.equal(out, ref), policy
            rows = be.report_rows()
            assert all(r["policy"] == policy.name and r["prefill_calls"] == 1 for r in rows), policy
            if policy.name == "ClusterKV":
                assert all(r["clusters"] == (40 - 4) // 8 for r in rows)  # it clustered, attended everything
    finally:
        model.forward = fwd


def test_small_budget_attends_budget_tokens():
    model = tiny_llama(layers=2, heads=4, kv_heads=2)
    ids = prompt(120)
    be = kvpass(Quest(budget=32, page_size=8), strict=True)
    generate(model, ids, new_tokens=3, backend=be)
    for row in be.report_rows():
        assert row["tokens_logical"] == 122 and row["decode_calls"] == 2
        # three recalled pages of 8 plus the newest, partial page (positions 120, 121)
        assert row["tokens_attended"] == 3 * 8 + 2
        # Quest's metadata is counted on top of the cache it leaves with the model
        assert row["device_bytes"] > 2 * 122 * 2 * 16 * 4


# `make test-all`: in `make test`,
# tests/test_robustness.py::test_left_padded_batches_every_policy_equals_rows_alone runs StreamingLLM on a
# left-padded batch of prompts of the same lengths (30, 22) and compares tokens and logits
@pytest.mark.slow
def test_left_padded_batch_streaming_rows_equal_running_alone():
    model = tiny_llama(layers=2, heads=4, kv_heads=2, pad_token_id=0)
    rows = [prompt(30, seed=3)[0], prompt(22, seed=4)[0]]
    ids = torch.zeros(2, 30, dtype=torch.long)
    mask = torch.zeros(2, 30, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 30 - len(r):] = r
        mask[i, 30 - len(r):] = 1
    policy = StreamingLLM(sinks=2, window=10)
    out = generate(model, ids, new_tokens=5, backend=kvpass(policy, strict=True), attention_mask=mask)
    for i, r in enumerate(rows):
        torch._dynamo.reset()
        alone = generate(model, r[None], new_tokens=5, backend=kvpass(policy, strict=True))
        assert torch.equal(out[i, -5:], alone[0, -5:]), i


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("policy", [
    Quest(budget=64, page_size=16),
    ClusterKV(budget=64, sinks=4, tokens_per_cluster=10, dense_layers=(), decode_window=64, decode_clusters=2),
], ids=["Quest", "ClusterKV"])
def test_a_steady_cpu_step_attends_in_its_selections_c_call(policy, owned, monkeypatch):
    """Quest's and ClusterKV's steady fp32 CPU steps attend inside their selection's C call (no second
    crossing into C for the attention: docs/design.md, "Rows ahead in L2"), with the oracle's output over
    the positions they list."""
    from kvpass.kernels import cpu_decode

    assert cpu_decode.available()  # the README's set-up builds the C kernels (tests/test_native.py)
    steps = []
    real = cpu_decode.decode_step
    monkeypatch.setattr(cpu_decode, "decode_step", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    outs = prefill_then_decode(policy, length=150, steps=3, owned=owned)
    assert steps == []  # the listed attention ran in the selection's call, never on its own
    for q, k, v, out, idx in outs:
        assert idx is not None and idx.shape[-1] == 64
        ref = attend_oracle(q, k, v, as_sets(idx), 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("estimate", [None, lambda q: q * 0.5 + 0.1], ids=["true-query", "estimate"])
def test_a_steady_tailorkv_cpu_step_is_one_c_call(estimate, monkeypatch):
    """TailorKV's steady fp32 CPU step of a sparse layer selects, appends the step's token and attends in
    one C call (``CpuStep.select_append_attend``), never in the three it replaces, and lists and outputs
    exactly what those three do (the same channels and candidates: the append comes after the selection);
    its output is the oracle's over the positions it lists."""
    from kvpass.kernels import cpu_decode
    from kvpass.kernels.tailorkv import CpuStep
    from kvpass.policies.tailorkv import TailorKV

    policy = TailorKV(sparse_budget=48, static_tokens=16, sinks=4, critical_channels=4, residual=64, group_size=64)
    calls = []
    for cls, name in [(CpuStep, "select"), (CpuStep, "append"), (cpu_decode, "decode_step")]:
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    fused = prefill_then_decode(policy, length=150, steps=3, owned=True, ops=False, estimate=estimate)
    assert calls == []
    monkeypatch.setattr(CpuStep, "select_append_attend", lambda *a, **kw: None)  # the three calls instead
    apart = prefill_then_decode(policy, length=150, steps=3, owned=True, ops=False, estimate=estimate)
    assert calls.count("select") == calls.count("append") == calls.count("decode_step") == 3
    for (q, k, v, out, idx), (*_, out2, idx2) in zip(fused, apart):
        assert idx.shape[-1] == 48 and torch.equal(idx, idx2) and torch.equal(out, out2)
        ref = attend_oracle(q, k, v, as_sets(idx), 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

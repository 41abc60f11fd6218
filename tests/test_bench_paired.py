"""``kvpass bench --decode-cost --paired`` on the tiny random Llama (structure only: the times mean nothing).

One module-scoped run of :func:`run_paired` (StreamingLLM(budget=48), which shares Full's graph, at contexts
32 and 96 and at the batch context 64, batch 1, three rotations: four backends compiled, Full's at 32, 64 and
96), then a rerun into the same folder that must find every group done. The steps each call decodes are recorded, so that the rotations' order is checked
from what ran, and every ratio is recomputed here from the step times in the rows.
"""

from __future__ import annotations

import argparse
import statistics

import pytest
import torch

from kvpass.bench import decode_cost as dc
from kvpass.bench import paired
from kvpass.bench.common import tiny_model
from kvpass.bench.runner import load_results

CONTEXTS, BATCH_CONTEXT, STEPS, WARMUP, BUDGET = [32, 96], 64, 3, 2, 48


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory):
    tok = smollm2.tokenizer
    model = tiny_model(len(tok))
    out = tmp_path_factory.mktemp("paired")
    policies = dc.parse_policies(f"Full,StreamingLLM(budget={BUDGET})")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    calls, decode = [], paired._decode

    def recording(fwd, cache, ids, n):
        calls.append((id(cache), n))
        return decode(fwd, cache, ids, n)

    paired._decode = recording
    kw = dict(batch_context=BATCH_CONTEXT, threads=[1], steps=STEPS, warmup_steps=WARMUP, model_name="tiny",
              command="kvpass bench --decode-cost --paired --model tiny", progress=False)
    try:
        rows = paired.run_paired(model, tok, policies, CONTEXTS, [1], out, **kw)
        n_first = len(calls)
        again = paired.run_paired(model, tok, policies, CONTEXTS, [1], out, **kw)
    finally:
        paired._decode = decode
        torch.set_num_threads(threads)
    return out, rows, again, calls, n_first


def test_a_group_per_compressed_cell_and_a_rerun_resumes(run):
    out, rows, again, calls, n_first = run
    assert [(r["policy_name"], r["context"], r["batch"]) for r in rows] == [
        ("StreamingLLM", 32, 1), ("StreamingLLM", 64, 1), ("StreamingLLM", 96, 1)]
    assert len(load_results(out / paired.RESULTS)) == 3
    assert again == rows and len(calls) == n_first  # nothing measured again
    assert all(r["graphs_compiled_timed"] == 0 for r in rows)


def test_the_floor_brackets_the_tokens_attended(run):
    _, rows, *_ = run
    by_ctx = {r["context"]: r for r in rows}
    # StreamingLLM(budget=48) at 64 and 96 attends its budget; at 32 everything: after the dropped steps the
    # cache is 32 less the rotations still to come (its last rotation attends the context)
    assert by_ctx[96]["attended_per_site"] == by_ctx[64]["attended_per_site"] == BUDGET
    assert by_ctx[32]["attended_per_site"] == 32 - STEPS
    assert all(r["start_tokens"] == r["context"] - WARMUP - STEPS for r in rows)
    # 48 lies between 32 and the batch context 64 (Full runs there too), more than 2 % from both; 29 is below 32
    for c in (64, 96):
        assert by_ctx[c]["floor_contexts"] == [32, 64]
        assert by_ctx[c]["floor_weight"] == pytest.approx((BUDGET - 32) / (64 - 32))
        assert set(by_ctx[c]["full_step_ms"]) == {"32", "64", str(c)}
    assert by_ctx[32]["floor_contexts"] == [32] and by_ctx[32]["floor_weight"] == 0.0
    assert set(by_ctx[32]["full_step_ms"]) == {"32"}


def test_every_ratio_is_its_rotation_s_steps(run):
    _, rows, *_ = run
    for r in rows:
        lo, hi = (r["full_step_ms"][str(c)] for c in (32, 64 if r["context"] > 32 else 32))
        n, pol = r["attended_per_site"], r["policy_step_ms"]
        assert len(pol) == len(lo) == len(hi) == STEPS
        w = (n - 32) / 32 if r["context"] > 32 else 0.0  # the 32 cell's floor is Full at 32 alone
        want = [p / (a + w * (b - a)) for p, a, b in zip(pol, lo, hi)]
        assert r["vs_floor_steps"] == pytest.approx(want)
        assert r["vs_floor"] == pytest.approx(statistics.median(want))
        full = r["full_step_ms"][str(r["context"])]
        assert r["vs_full"] == pytest.approx(statistics.median([p / f for p, f in zip(pol, full)]))
        q1, q3 = r["vs_floor_quartiles"]
        assert min(want) <= q1 <= r["vs_floor"] <= q3 <= max(want)


def test_rotations_alternate_their_order(run):
    """Per group: the policy's dropped steps, then Full's at each floor context, then STEPS rotations of one
    step each, in the opposite order every other rotation."""
    _, _, _, calls, n_first = run
    warm = [c for c in calls[:n_first] if c[1] == WARMUP]
    singles = [c[0] for c in calls[:n_first] if c[1] == 1]
    sizes = [2, 3, 4]  # the policy and Full at 32; at 64 Full at 32 and 64; at 96 at the cell's context too
    assert len(warm) == sum(sizes) and len(singles) == STEPS * sum(sizes)
    w = s = 0
    for k in sizes:
        members = [c for c, _ in warm[w: w + k]]  # the order the members were made in
        steps = singles[s: s + k * STEPS]
        for i in range(STEPS):
            assert steps[k * i: k * i + k] == (members if i % 2 == 0 else members[::-1])
        w, s = w + k, s + k * STEPS


def test_page_has_the_command_and_every_group(run, tmp_path):
    out, rows, *_ = run
    page = paired.write_paired_md(out, tmp_path / "paired.md", "kvpass bench --decode-cost --paired --model tiny")
    text = page.read_text()
    assert "kvpass bench --decode-cost --paired --model tiny" in text and "do not edit by hand" in text
    assert "starts from C minus its dropped and timed steps tokens, so that its last timed step attends C" in text
    for r in rows:
        assert f"| StreamingLLM | {r['context']} | 1 | {r['vs_floor']:.2f}× |" in text


def test_targets_from_the_groups_medians():
    """The page's targets table from the groups' own medians, against figures worked by hand: the floor at 8k
    (batch 1 and 8), Full where the budget covers the context, the 32k speed-up as the median of Full's step
    over the policy's and its bound (Full over the floor); 0.9x a floor is no verdict, and a group without a
    budget (rows of older runs) gives no "covers" line."""
    def g(policy, name, ctx, batch, vs_floor_steps, vs_full_steps, budget=1024, old=False):
        # an old group started from its context: its last rotation held the context + 3 + 4 tokens
        when = {"warmup_steps": 3, "steps": 4} if old else {"start_tokens": ctx - 7}
        return {"policy": policy, "policy_name": name, "context": ctx, "batch": batch, "budget": budget, **when,
                "vs_floor_steps": vs_floor_steps, "vs_full_steps": vs_full_steps,
                "vs_floor": statistics.median(vs_floor_steps), "vs_full": statistics.median(vs_full_steps)}

    groups = [g("Q()", "Quest", 8192, 1, [1.12, 1.20, 1.14], [0.7] * 3),
              g("Q()", "Quest", 8192, 8, [1.0, 1.1, 1.3], [0.5] * 3),
              g("Q()", "Quest", 1024, 1, [1.04] * 3, [1.02, 1.04, 1.06]),
              g("C()", "ClusterKV", 8192, 1, [1.05] * 3, [0.7] * 3),
              g("C()", "ClusterKV", 8192, 8, [0.85] * 3, [0.5] * 3),
              g("C()", "ClusterKV", 1024, 1, [1.08] * 3, [1.08] * 3, budget=None),
              g("S()", "StreamingLLM", 1024, 1, [1.2] * 3, [1.2] * 3, old=True),
              # Full / policy per rotation 2.5, 2, 4, 5: median 3.25 (one over the median of policy / Full:
              # 3.08); Full / floor 1.32 / 0.4, 1.1 / 0.5, 1.21 / 0.25, 1.1 / 0.2 = 3.3, 2.2, 4.84, 5.5: 4.07
              g("C()", "ClusterKV", 32768, 1, [1.32, 1.1, 1.21, 1.1], [0.4, 0.5, 0.25, 0.2])]
    lines = paired.paired_targets(groups)
    got = {tuple(c.strip() for c in line.strip("|").split("|"))[:3]: line.rsplit("|", 2)[1].strip()
           for line in lines[2:]}
    assert got == {
        ("context 8192, batch 1: × floor", "Quest", "1.14×"): "missed by 4 %",  # 1.14 / 1.10
        ("context 8192, batch 1: × floor", "ClusterKV", "1.05×"): "met",
        ("context 8192, batch 8: × floor", "Quest", "1.10×"): "met",
        ("context 8192, batch 8: × floor", "ClusterKV", "0.85×"): "‡ not a measurement",
        ("context 1024, budget covers it: × Full", "Quest", "1.04×"): "met",
        ("context 1024, budget covers it: × Full", "StreamingLLM", "1.20×"):
            "not covering: the cache reached 1031 tokens",
        ("context 32768, batch 1: Full ÷ policy (Full ÷ its floor 4.07×)", "ClusterKV", "3.25×"): "met",
    }
    assert paired.paired_targets([x for x in groups if x["batch"] == 1 and x["context"] == 1024
                                  and x["budget"] is None]) == []


def test_paired_needs_decode_cost():
    from kvpass.bench.cli import add_arguments, run as bench_run

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="--paired .* --decode-cost"):
        bench_run(p.parse_args(["--paired"]))


@pytest.mark.parametrize("bench, kw, match", [
    (dc.run_decode_cost, dict(rounds=0), "decode cost needs steps, warmup_steps, rounds >= 1, got .*rounds=0"),
    (paired.run_paired, dict(steps=0, batch_context=64, threads=[1]),
     "paired decode cost needs steps, warmup_steps >= 1, got steps=0"),
    (paired.run_paired, dict(contexts=[], batch_context=64, threads=[1]), "needs positive contexts and batches"),
    (dc.run_decode_cost, dict(batches=[0]), "decode cost needs positive contexts and batches"),
    # a cell starts from its context less its dropped and timed steps: 2 + 8 leave nothing of 10
    (dc.run_decode_cost, dict(contexts=[10, 64], warmup_steps=2, steps=8),
     r"decode cost needs every context above the dropped and timed steps \(10\), got 10"),
    (paired.run_paired, dict(contexts=[10], warmup_steps=2, steps=8, batch_context=64, threads=[1]),
     r"paired decode cost needs every context above the dropped and timed steps \(10\), got 10"),
])
def test_both_benches_refuse_an_empty_grid_or_a_count_below_one(bench, kw, match, tmp_path):
    """Before loading or measuring anything (no model is needed to reach the check)."""
    args = {"contexts": [32], "batches": [1], **kw}
    contexts, batches = args.pop("contexts"), args.pop("batches")
    with pytest.raises(ValueError, match=match):
        bench(None, None, [], contexts, batches, tmp_path, **args)
    assert not any(tmp_path.iterdir())

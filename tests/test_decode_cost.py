"""``kvpass bench --decode-cost`` on the tiny random Llama (structure only: the times mean nothing).

One module-scoped run of :func:`run_decode_cost` (every default policy and eager, contexts 64 and 320 on
the tiny model limited to 256 positions, so that 320 is past its window, batch 1, two rounds interleaving
every graph key's cells), then a rerun into the same folder with batches 1 and 2 for Full alone, which must
skip every finished cell and run only the batch-2 cells (eager and Full: one compile, three rounds); then
checks on the rows, the bytes model (by hand from the config), the breakdown and the page. Three compiles dominate: 84 s of CPU in all (measured; 211 s of wall
time while two other test processes shared the 2 cores).
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from kvpass.bench import decode_cost as dc
from kvpass.bench.common import tiny_model
from kvpass.bench.runner import load_results

CONTEXTS, BATCH_CONTEXT = [64, 320], 64
KW = dict(batch_context=BATCH_CONTEXT, threads=[1], steps=2, warmup_steps=2, profile_steps=1, bandwidth_mb=8,
          model_name="tiny", command="kvpass bench --decode-cost --model tiny", progress=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer  # the session's conversion (the default cache may not exist, as on CI)


@pytest.fixture(scope="module")
def model(tokenizer):
    m = tiny_model(len(tokenizer))
    m.config.max_position_embeddings = 256  # 320 goes past the "trained" window
    return m


@pytest.fixture(scope="module")
def run(model, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("cost")
    policies = dc.parse_policies(dc.DEFAULT_POLICIES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    calls, run_cell = [], dc._run_cell

    def recording(model, fwd, backend, policy, context, batch, *a, **k):
        calls.append((policy if policy == dc.EAGER else policy.describe(), context, batch, backend))
        return run_cell(model, fwd, backend, policy, context, batch, *a, **k)

    dc._run_cell = recording
    try:
        first = dc.run_decode_cost(model, tokenizer, policies, CONTEXTS, [1], out, **KW, rounds=2)
        n_first = len(load_results(out / dc.RESULTS))
        first_calls = list(calls)
        # resume: the batch-1 cells are in the file; only eager and Full at batch 2 are new, in three rounds
        again = dc.run_decode_cost(model, tokenizer, [], CONTEXTS, [1, 2], out, **KW, rounds=3)
    finally:
        dc._run_cell = run_cell
        torch.set_num_threads(threads)
    rows = load_results(out / dc.RESULTS)
    return out, policies, rows, (first, n_first, again, first_calls)


def test_rows_for_every_policy_and_eager(run):
    out, policies, rows, _ = run
    names = {r["policy"] for r in rows}
    assert names == {"eager"} | {p.describe() for p in policies}
    for name in names:
        cells = {(r["context"], r["batch"]) for r in rows if r["policy"] == name}
        assert {(c, 1) for c in CONTEXTS} <= cells
        assert ((BATCH_CONTEXT, 2) in cells) == (name in ("eager", "Full()"))
    for r in rows:
        assert r["ms_per_token"] > 0 and len(r["step_ms"]) == 2 * r["rounds"] and r["threads"] == 1
        assert r["rounds"] == (3 if r["batch"] == 2 else 2) and len(r["round_ms"]) == r["rounds"]
        assert r["sites"] == 2 and r["tokens_attended"] > 0  # the cell's own backend ran its 2 layers
        assert r["graphs_compiled_timed"] == 0, r["policy"]
        assert r["graphs_compiled_warmup"] == 0, (r["policy"], r["context"], r["batch"])  # the backend warm-up did it
        assert r["bytes"]["total"] == r["bytes"]["weights"] + r["bytes"]["kv"] + r["bytes"]["metadata"]
        assert r["gbps"] == pytest.approx(r["bytes"]["total"] / (r["ms_per_token"] / 1e3) / 1e9)
        assert 0 < r["bandwidth"]["gbps"] and r["bandwidth_share"] > 0
    # the cache past the 256 positions is the prefill's K/V repeated
    long = [r for r in rows if r["context"] == 320]
    assert all(r["repeated"] and r["beyond_positions"] and r["prefill_tokens"] == 256 for r in long)
    # a cell starts from its context less its 2 dropped and 2 timed steps, and its profiled step where it has
    # one (between the dropped and the timed ones): its last timed step attends the context; eager and Full
    # attend every token at every layer
    profiled = [r for r in rows if "breakdown" in r]
    assert profiled and all(r["profiled_before_timed"] for r in profiled)
    assert all(r["start_tokens"] == r["context"] - 4 - ("breakdown" in r) for r in rows)
    for r in rows:
        if r["policy"] in ("eager", "Full()"):
            assert r["attended_per_site"] == r["context"]
            assert r["bytes"]["kv"] == r["tokens_attended"] * 2 * 2 * 16 * 4 * r["batch"]


def test_rounds_interleave_every_graph_key(run):
    _, policies, _, (_, _, _, calls) = run
    # round 1 runs every cell once, eager, Full, the shared-graph policies and TailorKV (a graph of its own)
    # alike, each with its own backend; round 2 runs them in the opposite order
    n = len(calls) // 2
    first, second = calls[:n], calls[n:]
    assert len(calls) == 2 * n == 2 * (len(policies) + 1) * len(CONTEXTS)
    assert second == first[::-1]
    keys = {c[0]: (None if c[3] is None else c[3].policy.graph_key()) for c in first}
    assert len(set(keys.values())) == 3  # eager, kvpass::attention, TailorKV's
    assert all(c[3] is None for c in first if c[0] == dc.EAGER)
    # one backend per graph key, every cell on the backend of its key
    by_key = {}
    for name, _, _, backend in first:
        if backend is not None:
            assert by_key.setdefault(keys[name], backend) is backend


def test_resume_skips_finished_cells(run):
    _, _, rows, (first, n_first, again, _) = run
    assert len(rows) == n_first + 2  # eager and Full at (64, 2)
    done = {(r["policy"], r["context"], r["batch"]): r["finished"] for r in first}
    for r in again:
        key = (r["policy"], r["context"], r["batch"])
        if key in done:
            assert r["finished"] == done[key]  # the row from the file, not a new measurement
    assert sorted((r["policy"], r["batch"]) for r in rows[n_first:]) == [("Full()", 2), ("eager", 2)]


def test_resume_refuses_rows_that_started_from_their_context(run, model, tokenizer, tmp_path):
    """Rows written before a cell ended at its context (no ``start_tokens``) measured other caches: a rerun into
    their folder is refused rather than put beside them on one page."""
    _, _, rows, _ = run
    old = {k: v for k, v in rows[0].items() if k != "start_tokens"}
    (tmp_path / dc.RESULTS).write_text(json.dumps(old) + "\n")
    with pytest.raises(ValueError, match="cells started from their context .* its own --out"):
        dc.run_decode_cost(model, tokenizer, [], CONTEXTS, [1], tmp_path, **KW)


def test_rounds_merge_to_the_median_of_round_medians(run):
    _, _, rows, _ = run
    for r in rows:
        # each round's median is its own 2 steps' median: the merged row keeps them in run order
        parts = [r["step_ms"][i: i + 2] for i in range(0, len(r["step_ms"]), 2)]
        assert r["round_ms"] == pytest.approx([sum(h) / 2 for h in parts]) and len(parts) == r["rounds"]
        assert r["ms_per_token"] == pytest.approx(statistics.median(r["round_ms"]))
        assert r["min_ms"] == min(r["step_ms"])
    parts = [{"ms_per_token": m, "min_ms": m - 1, "step_ms": [m], "warmup_ms": [9.0], "graphs_compiled_warmup": 1,
              "graphs_compiled_timed": g, "tokens_attended": i} for i, (m, g) in enumerate([(5.0, 0), (50.0, 1), (7.0, 0)])]
    merged = dc.merge_rounds(parts)
    assert merged["ms_per_token"] == 7.0 and merged["round_ms"] == [5.0, 50.0, 7.0]  # the slow round moves nothing
    assert merged["min_ms"] == 4.0 and merged["step_ms"] == [5.0, 50.0, 7.0] and merged["warmup_ms"] == [9.0] * 3
    assert merged["graphs_compiled_timed"] == 1 and merged["graphs_compiled_warmup"] == 3
    assert merged["tokens_attended"] == 2  # the report comes from the last round


def test_statistic_min_takes_the_fastest_step(run, tmp_path):
    out, _, rows, _ = run
    for r in rows:
        m = dc.restat(r, "min")
        assert m["ms_per_token"] == min(r["step_ms"]) == r["min_ms"] and m["median_ms"] == r["ms_per_token"]
        assert m["gbps"] == pytest.approx(r["bytes"]["total"] / (m["ms_per_token"] / 1e3) / 1e9)
        assert m["bandwidth_share"] == pytest.approx(m["gbps"] / r["bandwidth"]["gbps"])
        assert dc.restat(r)["ms_per_token"] == r["ms_per_token"]
    with pytest.raises(ValueError, match="statistic"):
        dc.restat(rows[0], "mean")
    page = dc.write_decode_cost_md(out, tmp_path / "cost.md", "kvpass bench --decode-cost --statistic min", "min")
    text = page.read_text()
    assert "**fastest** timed step" in text
    full = next(r for r in rows if r["policy"] == "Full()" and r["context"] == 320 and r["batch"] == 1)
    line = next(l for l in text.splitlines() if l.startswith("| Full (kvpass) | 320 | 1 |"))
    # ms/token, median ms, fastest ms
    assert line.split(" | ")[3:6] == [f"{full['min_ms']:.1f}", f"{full['ms_per_token']:.1f}", f"{full['min_ms']:.1f}"]


def test_a_cell_below_its_floor_is_marked(run):
    _, _, rows, _ = run
    target = next(r for r in rows if r["policy"].startswith("Quest") and r["context"] == 320)
    floor, _ = dc.floor_of(target, rows)
    for factor, marked in ((0.5, True), (1.0, False)):
        # every compressed cell at its floor (the tiny model's times are noise), the target at factor x its floor
        edited = [dict(r, ms_per_token=dc.floor_of(r, rows)[0] * (factor if r is target else 1.0))
                  if r["kind"] == "kvpass" and r["policy"] != "Full()" else r for r in rows]
        text = dc.markdown_tables(edited)
        cell = f"{factor * floor:.1f} ("
        line = next(l for l in text.splitlines() if l.startswith("| Quest") and cell in l)
        assert ("‡" in line) == marked and ("‡ faster than 0.9×" in text) == marked


def test_cell_cache_is_prefix_repeat_and_copies():
    k = torch.arange(2 * 5 * 3, dtype=torch.float32).view(1, 2, 5, 3)
    (k2, v2), = dc._cell_kv([(k, -k)], 12, 3)
    assert k2.shape == (3, 2, 12, 3) and k2.is_contiguous()
    assert torch.equal(k2[1, :, :5], k[0]) and torch.equal(k2[2, :, 5:10], k[0]) and torch.equal(k2[0, :, 10:], k[0, :, :2])
    (k3, _), = dc._cell_kv([(k, -k)], 4, 1)
    assert torch.equal(k3, k[:, :, :4])


def test_bytes_model_by_hand(model):
    # tiny Llama: hidden 64, 4 heads × 16, 2 KV heads, MLP 128, 2 layers, untied LM head, fp32
    h, d, hk, inter, layers, vocab = 64, 16, 2, 128, 2, model.config.vocab_size
    per_layer = h * 4 * d + 2 * h * hk * d + 4 * d * h + 3 * h * inter + 2 * h
    weights = 4 * (layers * per_layer + h + vocab * h)  # + final norm + LM head (the embedding is not read whole)
    for batch in (1, 3):
        wb = dc.weight_bytes(model, batch)
        assert wb["weights"] == weights
        assert wb["embedding_rows"] == 4 * h * batch
    per_token = dc.kv_bytes_per_token(hk, d, 4)
    assert per_token == 2 * 2 * 16 * 4
    by = dc.step_bytes(weights, tokens_attended=2 * 100, per_token=per_token, batch=3, metadata=7)
    assert by["kv"] == 2 * 100 * 256 * 3 and by["total"] == weights + by["kv"] + 7
    # tied: the matrix once, no extra rows
    model.lm_head.weight = model.model.embed_tokens.weight
    try:
        wb = dc.weight_bytes(model, 2)
        assert wb["weights"] == weights and wb["embedding_rows"] == 0
    finally:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())


def test_breakdown_buckets_sum_to_the_step(run):
    _, policies, rows, _ = run
    br = [r for r in rows if r.get("breakdown")]
    assert {r["policy"] for r in br if r["batch"] == 1} == {"eager"} | {p.describe() for p in policies}
    assert {(r["policy"], r["batch"]) for r in br if r["batch"] == 2} == {("eager", 2), ("Full()", 2)}
    assert {r["context"] for r in br} == {BATCH_CONTEXT}
    for r in br:
        b = r["breakdown"]
        assert set(b["ms"]) == set(dc.BUCKETS)
        assert sum(b["ms"].values()) == pytest.approx(b["step_ms"])
        assert all(b["ms"][k] >= 0 for k in dc.BUCKETS if k != "rest")
        if r["policy"] == "Full()":
            assert b["ms"]["gather+attention"] > 0  # SDPA under kvpass::attention


def test_classify_ranges_and_fallback():
    assert dc.classify(["aten::index_select", "kvpass.select", "kvpass::attention_owned"]) == "selection"
    assert dc.classify(["aten::bmm", "kvpass.attend", "kvpass::attention_owned"]) == "gather+attention"
    assert dc.classify(["aten::copy_", "kvpass.bookkeeping", "kvpass::attention"]) == "bookkeeping"
    assert dc.classify(["aten::bmm", "kvpass::attention_owned"]) == "gather+attention"
    assert dc.classify(["aten::topk", "kvpass::fetch"]) == "runtime"
    assert dc.classify(["aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention"]) \
        == "gather+attention"
    assert dc.classify(["aten::mm", "aten::matmul", "aten::linear"]) is None


def test_page_has_command_tables_plots_and_the_window_note(run, tmp_path):
    out, _, _, _ = run
    page = dc.write_decode_cost_md(out, tmp_path / "docs" / "decode-cost.md", "kvpass bench --decode-cost --model tiny")
    text = page.read_text()
    assert "```bash\nkvpass bench --decode-cost --model tiny\n" in text
    assert "Past the trained window" in text and "256 positions" in text and "320" in text
    assert "starts from C minus its dropped and timed steps tokens, so that its last timed step attends C" in text
    assert "By context, batch 1" in text and "By batch, context 64" in text and "Where a step goes" in text
    assert "CPU decode kernels: C (kvpass.kernels.native)" in text  # which CPU path the rows measured
    for name in ("tiny_ms_vs_context.png", "tiny_ms_vs_batch.png", "tiny_breakdown.png"):
        assert (tmp_path / "docs" / "decode-cost" / name).stat().st_size > 0
        assert f"decode-cost/{name}" in text


def test_floor_interpolates_between_measured_contexts():
    """F(N, B) for a policy attending N tokens per site: Full's ms/token between the two measured contexts
    that bracket N (linear in N), the nearest measured context outside them or within 2 % of one, always at
    the row's own batch and threads."""
    def full(ctx, ms, batch=1, threads=1):
        return {"policy": "Full()", "context": ctx, "batch": batch, "threads": threads, "model": "m",
                "ms_per_token": ms}

    rows = [full(1024, 100.0), full(4096, 160.0), full(8192, 400.0), full(1024, 7.0, batch=8),
            full(1024, 9.0, threads=2)]

    def row(n):
        return {"policy": "P", "context": 8192, "batch": 1, "threads": 1, "model": "m", "attended_per_site": n}

    assert dc.floor_of(row(1024), rows) == (100.0, "1024")
    assert dc.floor_of(row(1017), rows) == (100.0, "1024")  # below the smallest context
    ms, where = dc.floor_of(row(1792), rows)  # a quarter of the way from 1024 to 4096
    assert ms == pytest.approx(115.0) and where == "1792: 1024-4096"
    assert dc.floor_of(row(6144), rows)[0] == pytest.approx(280.0)
    assert dc.floor_of(row(20000), rows) == (400.0, "8192")
    assert dc.floor_of({**row(1024), "batch": 2}, rows) == (None, None)


def test_targets_say_met_or_by_how_much_they_are_missed():
    """The page's targets table against figures worked by hand: the floor (Full over the attended tokens), Full
    where the budget covers the context, the 32k speed-up and Full against eager HF; a cell below 0.9x its floor
    is no verdict, and a cell not measured gives no line."""
    def r(policy, name, ctx, batch, ms, attended=None, budget=None, kind="kvpass", old=False):
        # an old row started from its context: its last timed step held the context + 2 + 4 tokens
        when = {"warmup_steps": 2, "steps": 4} if old else {"start_tokens": ctx - 6}
        return {"policy": policy, "policy_name": name, "context": ctx, "batch": batch, "threads": 1, "model": "m",
                "ms_per_token": ms, "attended_per_site": attended if attended is not None else ctx,
                "budget": budget, "kind": kind, **when}

    rows = [r("Full()", "Full", 1024, 1, 30.0), r("Full()", "Full", 8192, 1, 50.0), r("Full()", "Full", 32768, 1, 105.0),
            r("Full()", "Full", 1024, 8, 100.0), r("Full()", "Full", 8192, 8, 250.0),
            r("eager", "eager HF", 8192, 8, 1000.0, kind="eager"),
            r("Q()", "Quest", 8192, 1, 34.5, 1024, 1024), r("Q()", "Quest", 8192, 8, 140.0, 1024, 1024),
            r("Q()", "Quest", 1024, 1, 31.2, 1024, 1024),
            r("C()", "ClusterKV", 8192, 1, 31.5, 1024, 1024), r("C()", "ClusterKV", 8192, 8, 80.0, 1024, 1024),
            r("C()", "ClusterKV", 1024, 1, 33.0, 1024, 1024), r("C()", "ClusterKV", 32768, 1, 34.0, 1024, 1024),
            r("C0()", "ClusterKV dense_layers=()", 32768, 1, 42.0, 1024, 1024),
            r("K()", "CentroidKV ratio=0.25", 1024, 1, 40.0, 256),  # no budget: no "covers" line
            r("S()", "StreamingLLM", 1024, 1, 36.0, 1024, 1024, old=True)]
    lines = dc.targets_table(rows, dc._index(rows), rows, 8192)
    got = {tuple(c.strip() for c in line.strip("|").split("|"))[:2]: line.rsplit("|", 2)[1].strip()
           for line in lines[2:]}
    assert got == {
        ("context 8192, batch 1: × floor", "Quest 1024"): "missed by 5 %",  # 34.5 / 30 = 1.15 over 1.10
        ("context 8192, batch 1: × floor", "ClusterKV 1024"): "met",  # 1.05
        ("context 8192, batch 8: × floor", "Quest 1024"): "missed by 12 %",  # 1.40 / 1.25
        ("context 8192, batch 8: × floor", "ClusterKV 1024"): "‡ not a measurement",  # 0.80 of its floor
        ("context 1024, budget covers it: × Full", "Quest 1024"): "met",  # 1.04
        ("context 1024, budget covers it: × Full", "ClusterKV 1024"): "missed by 5 %",  # 1.10 / 1.05
        # 1.20 over 1.05, but its timed steps ran past the budget: they selected
        ("context 1024, budget covers it: × Full", "StreamingLLM 1024"): "not covering: the cache reached 1030 tokens",
        # 105 / 34 = 3.09; the bound: Full's 32k step over its floor, Full's 1k step, 105 / 30
        ("context 32768, batch 1: Full ÷ policy (Full ÷ its floor 3.50×)", "ClusterKV 1024"): "met",
        ("context 32768, batch 1: Full ÷ policy (Full ÷ its floor 3.50×)", "ClusterKV dense_layers=() 1024"):
            "missed by 17 %",  # 105 / 42 = 2.5
        ("context 8192, batch 8: × eager HF", "Full (kvpass)"): "met",  # 0.25
    }
    assert dc.targets_table([x for x in rows if x["policy"] == "Full()"], dc._index(rows), rows, 8192) == []

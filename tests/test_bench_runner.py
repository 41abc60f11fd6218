"""``kvpass bench`` end to end on the tiny random Llama (structure only: accuracy means nothing).

One run through ``kvpass.cli.main`` (the tiny model with SmolLM2's tokenizer from the session
fixture's cache, context ~300 tokens, Full + StreamingLLM + Quest at one budget, two tasks), then a
rerun that must skip every cell, then the table, the plots and the generated page.
"""

from __future__ import annotations

import json
import math

import pytest

from kvpass import CentroidKV, ClusterKV
from kvpass.bench.common import build_policies, split_specs
from kvpass.bench.report import markdown_table
from kvpass.bench.runner import KERNELS, PERPLEXITY, RESULTS, load_results
from kvpass.cli import main

FIELDS = {
    "model", "policy", "policy_name", "budget", "context", "context_used", "prompt_tokens", "task",
    "sample", "seed", "haystack", "new_tokens", "accuracy", "output", "answers", "prefill_s", "decode_ms",
    "tokens_held", "tokens_attended", "device_bytes", "host_bytes", "sites", "left_exact", "recall",
    "recall_per_layer", "peak_rss_bytes", "graphs_compiled", "machine", "command", "finished",
    "bytes_moved", "bytes_moved_per_step", "overhead_prefill_s", "overhead_decode_s", "overhead_prefill_share",
    "overhead_decode_share", "decode_steps",
}


def test_split_specs_and_budget_sweep():
    assert split_specs("Full, Quest(budget=8, page_size=2),StreamingLLM") == [
        "Full", "Quest(budget=8, page_size=2)", "StreamingLLM"]
    pols = [p.describe() for p in build_policies("StreamingLLM,Quest(page_size=8)", [64, 128])]
    assert pols == [
        "Full()",
        "StreamingLLM(sinks=4, window=60)", "StreamingLLM(sinks=4, window=124)",
        "Quest(budget=64, page_size=8, gqa='sum')", "Quest(budget=128, page_size=8, gqa='sum')",
    ]


@pytest.mark.slow  # a sweep: six policies, two tasks, perplexity and the kernel benchmarks, then a rerun
def test_bench_tiny_end_to_end(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    out = tmp_path / "out"
    page = tmp_path / "docs" / "results.md"
    argv = ["bench", "--model", "tiny", "--out", str(out), "--contexts", "300", "--budgets", "160",
            "--policies", "Full,StreamingLLM,Quest,ClusterKV(dense_layers=(0,)),CentroidKV,"
                          "ClusterKV(offload=True, dense_layers=(0,), budget=160)",
            "--tasks", "single_needle,variable_tracking", "--samples", "1", "--threads", "2",
            "--results-md", str(page), "--perplexity", "200", "--ppl-eval-tokens", "12", "--quick"]
    assert main(argv) == 0
    rows = load_results(out / RESULTS)
    policies = ["Full()", "StreamingLLM(sinks=4, window=156)", "Quest(budget=160, page_size=16, gqa='sum')",
                ClusterKV(budget=160, dense_layers=(0,)).describe(), CentroidKV.with_budget(160).describe()]
    offload = ClusterKV(budget=160, dense_layers=(0,), offload=True).describe()
    assert len(rows) == 2 * (len(policies) + 1)  # one row per cell
    # the policy with its own graph (fetch ops) runs first, on its own backend; then Full first for each
    # (context, task, sample) and the policies that share its graph
    assert [r["policy"] for r in rows] == [offload] * 2 + policies * 2
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["model"] == "tiny" and r["context"] == 300 and r["sites"] == 2 and r["left_exact"] == 0
        assert r["graphs_compiled"] == 0  # set_policy swaps policies without recompiling
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["prefill_s"] > 0 and r["decode_ms"] > 0 and r["device_bytes"] > 0
        assert r["new_tokens"] == (32 if r["task"] == "single_needle" else 48)
        assert set(r["recall_per_layer"]) == (set() if r["policy_name"] == "CentroidKV" else {"0", "1"})
        assert r["machine"]["threads"] == 2 and r["machine"]["torch"]
        assert "--model tiny" in r["command"]
        assert r["decode_steps"] == r["new_tokens"] - 1
        assert 0 <= r["overhead_prefill_share"] < 1 and 0 <= r["overhead_decode_share"] < 1
        assert (r["bytes_moved"] > 0) == (r["policy"] == offload)  # only offload moves bytes between tiers
        if r["policy"] == "Full()":
            assert r["recall"]["mass"] == pytest.approx(1.0)
            assert r["tokens_attended"] == r["tokens_held"]
        elif r["policy_name"] == "CentroidKV":
            assert r["tokens_held"] <= 160 * r["sites"] and math.isnan(r["recall"]["mass"])  # merged: no recall
        else:
            assert r["recall"]["mass"] < 1.0  # 160 of ~330 tokens attended
            assert r["tokens_attended"] < r["tokens_held"]
        if r["policy"] == offload:
            assert r["host_bytes"] > 0 and r["bytes_moved_per_step"] > 0

    # Perplexity: every policy of the grid at the window, Full first as the reference.
    ppl = load_results(out / PERPLEXITY)
    assert [r["policy"] for r in ppl] == policies + [offload]
    assert all(r["window"] == 200 and r["eval_tokens"] == 12 and r["ppl"] > 1 for r in ppl)
    assert ppl[0]["delta"] == 0.0
    # Kernel micro-benchmarks: each op against its dense counterpart.
    kern = load_results(out / KERNELS)
    assert {r["kernel"] for r in kern} >= {"sparse_decode_attention", "quest_page_scores"}
    assert all(r["ms"] > 0 and r["baseline_ms"] > 0 for r in kern)

    # A rerun skips every finished cell: no new rows, no compile.
    from torch._dynamo.utils import counters

    compiled = counters["stats"]["unique_graphs"]
    assert main(argv) == 0
    assert counters["stats"]["unique_graphs"] == compiled
    assert len(load_results(out / RESULTS)) == len(rows)
    assert len(load_results(out / PERPLEXITY)) == len(ppl)
    assert "already in" in capsys.readouterr().out

    # The table: Full's accuracy next to every compressed figure, tiny marked structure-only.
    table = markdown_table(rows)
    assert "structure only" in table
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| Full")
             and not ln.startswith("| policy")]
    assert len(lines) == 5
    for ln in lines:
        assert ln.count("(Full ") == 2  # one per (context, task) column

    # Plots and the generated page.
    pngs = sorted((page.parent / "results").glob("*.png"))
    assert {p.name for p in pngs} == {
        "tiny_accuracy_vs_budget.png", "tiny_decode_vs_context.png", "tiny_bytes_vs_context.png",
        "tiny_recall_per_layer.png"}
    assert all(p.stat().st_size > 1000 for p in pngs)
    text = page.read_text()
    assert "generated" in text
    assert rows[0]["command"] in text
    assert "](results/tiny_recall_per_layer.png)" in text
    assert "torch " in text and "transformers " in text
    assert "## Perplexity" in text and "## Kernel micro-benchmarks" in text
    assert "policy overhead" in text


def test_decode_by_context_table():
    """Per context: the mean ms/token of a policy's cells and its ratio to Full's cells of that context."""
    from kvpass.bench.report import decode_by_context_table

    def row(name, budget, context, sample, ms):
        return {"model": "m", "policy_name": name, "budget": budget, "context": context, "task": "t",
                "sample": sample, "decode_ms": ms}

    rows = [row("Full", None, 1024, 0, 60.0), row("Full", None, 1024, 1, 62.0), row("Full", None, 8192, 0, 110.0),
            row("Quest", 1024, 1024, 0, 66.0), row("Quest", 1024, 1024, 1, 62.0), row("Quest", 1024, 8192, 0, 88.0)]
    lines = decode_by_context_table(rows).splitlines()
    assert lines[2] == "| policy | budget | 1024 tokens | 8192 tokens |"
    assert lines[4] == "| Full | – | 61.0 (1.00×) | 110.0 (1.00×) |"
    assert lines[5] == "| Quest | 1024 | 64.0 (1.05×) | 88.0 (0.80×) |"  # (66/60 + 62/62) / 2; 88/110
    assert decode_by_context_table([r for r in rows if r["context"] == 1024]) == ""  # one context: no table


def test_results_jsonl_ignores_a_torn_line(tmp_path):
    row = {"model": "m", "policy": "Full()", "context": 1, "task": "t", "sample": 0, "seed": 0, "haystack": "prose"}
    (tmp_path / RESULTS).write_text(json.dumps(row) + "\n" + '{"model": "m", "pol')
    assert load_results(tmp_path / RESULTS) == [row]


@pytest.mark.slow  # calibration, a TailorKV compile and a rerun, the bench end to end again
def test_bench_calibrates_tailorkv_once_and_reports_its_layers(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    out = tmp_path / "out"
    page = tmp_path / "results.md"
    argv = ["bench", "--model", "tiny", "--out", str(out), "--contexts", "300", "--budgets", "160",
            "--policies", "Full,TailorKV(profile=auto, static_tokens=32, group_size=16, residual=32)",
            "--tasks", "single_needle", "--samples", "1", "--perplexity", "0", "--no-kernels",
            "--results-md", str(page)]
    assert main(argv) == 0
    from kvpass.tailorkv import Profile

    prof = Profile.load(out / "tailorkv_profile.json")
    assert [i for i, _ in prof.scores] == [0, 1] and prof.prompt_tokens == (4096,)
    rows = load_results(out / RESULTS)
    tk = [r for r in rows if r["policy_name"] == "TailorKV group_size=16, residual=32"]
    assert len(tk) == 1 and tk[0]["budget"] == 160
    assert prof.summary() in tk[0]["policy"]  # the cells ran with the calibrated profile
    tiers = [d["tier"] for d in tk[0]["site_details"]]
    assert tiers == ["quantised" if p > 0.2 else "sparse" for _, p in prof.scores]
    assert not [r for r in rows if r["policy_name"] == "Full"][0]["site_details"]
    text = page.read_text()
    assert "## TailorKV profile" in text and "## Per layer: tiers, query estimates, bytes" in text
    assert prof.config_key in text
    # a rerun reuses the profile (same config) and so finds every cell done
    stamp = (out / "tailorkv_profile.json").stat().st_mtime_ns
    assert main(argv) == 0
    assert (out / "tailorkv_profile.json").stat().st_mtime_ns == stamp
    assert len(load_results(out / RESULTS)) == len(rows)


def test_policy_label_names_what_sets_a_policy_apart():
    """Rows of one table must not share a label: TailorKV's profile shows, the budget does not."""
    from kvpass import ClusterKV, TailorKV
    from kvpass.bench.runner import policy_label

    assert policy_label(TailorKV()) == "TailorKV"
    assert policy_label(TailorKV(profile="auto")) == "TailorKV profile=auto"
    assert policy_label(TailorKV(profile="auto", group_size=16)) == "TailorKV profile=auto group_size=16"
    assert policy_label(ClusterKV(budget=512, kmeans_iters=4)) == "ClusterKV kmeans_iters=4"
    from kvpass.tailorkv import Profile

    prof = Profile(config_key="k", model_type="llama", scores=((0, 0.5), (1, 0.1)))
    assert policy_label(TailorKV(profile=prof)) == "TailorKV profiled"


def test_machine_names_the_cpu_model_and_its_vector_set(tmp_path):
    """Rows from two machines of one architecture must not read alike: the CPU's model and widest vector
    set (what the C kernels' width follows) join the architecture; without /proc/cpuinfo, the architecture."""
    import platform

    from kvpass.bench.runner import _processor

    arch = platform.processor() or platform.machine()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 avx512f f16c\n")
    assert _processor(info) == f"{arch} (AMD EPYC, AVX-512)"
    info.write_text("model name\t: Some CPU\nflags\t\t: fpu sse2 avx avx2\n")
    assert _processor(info) == f"{arch} (Some CPU, AVX2)"
    info.write_text("flags\t\t: fpu sse2\n")
    assert _processor(info) == arch
    assert _processor(tmp_path / "absent") == arch

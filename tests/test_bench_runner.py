"""``kvpass bench`` end to end on the tiny random Llama (structure only: accuracy means nothing).

One run through ``kvpass.cli.main`` (the tiny model with SmolLM2's tokenizer from the session
fixture's cache, context ~300 tokens, Full + StreamingLLM + Quest at one budget, two tasks), then a
rerun that must skip every cell, then the table, the plots and the generated page.
"""

from __future__ import annotations

import json
import time

import pytest

from kvpass.bench.cli import build_policies, split_specs
from kvpass.bench.report import markdown_table
from kvpass.bench.runner import RESULTS, load_results
from kvpass.cli import main

FIELDS = {
    "model", "policy", "policy_name", "budget", "context", "context_used", "prompt_tokens", "task",
    "sample", "seed", "haystack", "new_tokens", "accuracy", "output", "answers", "prefill_s", "decode_ms",
    "tokens_held", "tokens_attended", "device_bytes", "host_bytes", "sites", "left_exact", "recall",
    "recall_per_layer", "peak_rss_bytes", "graphs_compiled", "machine", "command", "finished",
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


@pytest.mark.slow  # needs the bundled SmolLM2 (its tokenizer)
def test_bench_tiny_end_to_end(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    out = tmp_path / "out"
    page = tmp_path / "docs" / "results.md"
    argv = ["bench", "--model", "tiny", "--out", str(out), "--contexts", "300", "--budgets", "128",
            "--tasks", "single_needle,variable_tracking", "--samples", "1", "--threads", "2",
            "--results-md", str(page)]
    assert main(argv) == 0
    rows = load_results(out / RESULTS)
    policies = ["Full()", "StreamingLLM(sinks=4, window=124)", "Quest(budget=128, page_size=16, gqa='sum')"]
    assert len(rows) == 2 * len(policies)  # one row per cell
    assert [r["policy"] for r in rows[:3]] == policies  # Full first for each (context, task, sample)
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["model"] == "tiny" and r["context"] == 300 and r["sites"] == 2 and r["left_exact"] == 0
        assert r["graphs_compiled"] == 0  # set_policy swaps policies without recompiling
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["prefill_s"] > 0 and r["decode_ms"] > 0 and r["device_bytes"] > 0
        assert r["new_tokens"] == (32 if r["task"] == "single_needle" else 48)
        assert set(r["recall_per_layer"]) == {"0", "1"}
        assert r["machine"]["threads"] == 2 and r["machine"]["torch"]
        assert "--model tiny" in r["command"]
        if r["policy"] == "Full()":
            assert r["recall"]["mass"] == pytest.approx(1.0)
            assert r["tokens_attended"] == r["tokens_held"]
        else:
            assert r["recall"]["mass"] < 1.0  # 128 of ~330 tokens attended
            assert r["tokens_attended"] < r["tokens_held"]

    # A rerun skips every finished cell: no new rows, no compile.
    start = time.perf_counter()
    assert main(argv) == 0
    assert time.perf_counter() - start < 15
    assert len(load_results(out / RESULTS)) == len(rows)
    assert "already in" in capsys.readouterr().out

    # The table: Full's accuracy next to every compressed figure, tiny marked structure-only.
    table = markdown_table(rows)
    assert "structure only" in table
    lines = [ln for ln in table.splitlines() if ln.startswith("| Quest") or ln.startswith("| StreamingLLM")]
    assert len(lines) == 2
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


def test_results_jsonl_ignores_a_torn_line(tmp_path):
    row = {"model": "m", "policy": "Full()", "context": 1, "task": "t", "sample": 0, "seed": 0, "haystack": "prose"}
    (tmp_path / RESULTS).write_text(json.dumps(row) + "\n" + '{"model": "m", "pol')
    assert load_results(tmp_path / RESULTS) == [row]

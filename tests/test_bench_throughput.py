"""``kvpass bench --throughput`` on the tiny random Llama (structure only: the times mean nothing).

One run of Full, Quest and CentroidKV at batches 1 and 3 (prompts of 40 to 90 tokens, left-padded): the
rows, the agreement with Full (Full equals itself; a covering budget equals Full), the per-row bytes of a
padded batch (each row's own, summing to the site total) and the page.
"""

from __future__ import annotations

import pytest
import torch

from kvpass import CentroidKV, Quest
from kvpass.bench import throughput as tp
from kvpass.bench.common import tiny_model
from kvpass.bench.runner import load_results


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from kvpass.models import load_smollm2

    _, tok = load_smollm2(progress=False)
    model = tiny_model(len(tok))
    out = tmp_path_factory.mktemp("tput")
    policies = [Quest(budget=512, page_size=16), Quest(budget=32, page_size=8), CentroidKV(cache_ratio=0.5)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = tp.run_throughput(model, tok, policies, [1, 3], 40, 90, out, threads=[1], steps=3, warmup_steps=2,
                                 model_name="tiny", command="kvpass bench --throughput --model tiny",
                                 progress=False)
    finally:
        torch.set_num_threads(n)
    return out, rows


def test_rows_agreement_and_bytes(run):
    out, rows = run
    assert load_results(out / tp.RESULTS) == rows
    assert {(r["policy"], r["batch"]) for r in rows} == {
        (p, b) for p in ("Full()", Quest(budget=512, page_size=16).describe(), Quest(budget=32, page_size=8).describe(),
                         CentroidKV(cache_ratio=0.5).describe()) for b in (1, 3)}
    by = {(r["policy"], r["batch"]): r for r in rows}
    assert by["Full()", 3]["lengths"] == [40, 65, 90] and by["Full()", 1]["lengths"] == [65]
    for b in (1, 3):
        assert by["Full()", b]["agreement_with_full"] == [1.0] * b
        # a budget covering every row attends exactly: its tokens are Full's
        assert by[Quest(budget=512, page_size=16).describe(), b]["agreement_with_full"] == [1.0] * b
        assert all(r["graphs_compiled_timed"] == 0 for r in rows)
    small = by[Quest(budget=32, page_size=8).describe(), 3]
    per_row = small["device_bytes_per_row"]
    # Quest serves the padded batch in place: each row's share of buffers at the padded length
    assert len(set(per_row)) == 1 and 0 <= small["device_bytes"] - sum(per_row) < 3 * 64
    merged = by[CentroidKV(cache_ratio=0.5).describe(), 3]
    per_row = merged["device_bytes_per_row"]
    assert sum(per_row) == merged["device_bytes"]  # served row by row: each row reports its own bytes
    assert per_row[0] < per_row[2], "the shorter prompt holds fewer bytes"
    full = by["Full()", 3]
    assert full["device_bytes_per_row"] == [full["device_bytes"] // 3] * 3  # batched: the batch's share
    assert all(r["tokens_per_s"] > 0 and r["x_full"] for r in rows)


def test_cells_interleave_by_batch(run):
    # the graph key (Full, Quest and CentroidKV share kvpass::attention's) compiled before the first timed
    # cell, then each batch runs Full and every policy back to back: rows come out batch by batch, Full
    # first in each (keys of their own kept side by side: tests/test_decode_cost.py, with TailorKV)
    _, rows = run
    names = ["Full()", Quest(budget=512, page_size=16).describe(), Quest(budget=32, page_size=8).describe(),
             CentroidKV(cache_ratio=0.5).describe()]
    assert [(r["batch"], r["policy"]) for r in rows] == [(b, n) for b in (1, 3) for n in names]
    assert all(r["interleaved"] == "by batch" and r["graphs_compiled_timed"] == 0 for r in rows)


def test_page(run, tmp_path):
    _, rows = run
    page = tp.write_page(rows, tmp_path / "throughput.md", "kvpass bench --throughput --model tiny")
    text = page.read_text()
    assert "kvpass bench --throughput --model tiny" in text and "| Quest" in text
    assert "each batch size's cells (Full and every policy) run one after the other" in text
    assert (tmp_path / "throughput" / "throughput_1t.png").stat().st_size > 0


def test_task_rows_are_scored_and_full_rows_equal_each_sample_alone(tmp_path):
    """``--task``: each row of a padded batch is a sample of the task, prefilled on its own and decoded for
    the task's answer length. Full's rows give the eager model's greedy answer to each sample alone, and
    every row's accuracy is the task's score of its answer (samples rebuilt here from their seeds)."""
    from kvpass.bench.runner import default_new_tokens
    from kvpass.bench.tasks import make_sample, score
    from kvpass.bench.timing import answer_text
    from kvpass.models import chat_prompt, load_smollm2

    _, tok = load_smollm2(progress=False)
    model = tiny_model(len(tok))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = tp.run_throughput(model, tok, [Quest(budget=64, page_size=16)], [1, 2], 200, 300, tmp_path,
                                 threads=[1], steps=3, warmup_steps=2, model_name="tiny", progress=False,
                                 task="single_needle", seed=5)
    finally:
        torch.set_num_threads(n)
    overhead = len(tok(chat_prompt(tok, ""), add_special_tokens=False)["input_ids"])
    new = default_new_tokens("single_needle")
    for r in rows:
        assert r["task"] == "single_needle" and r["steps"] == new - 1 - 2
        wanted = tp.row_lengths(r["batch"], 200, 300)
        assert len(r["accuracy"]) == len(r["outputs"]) == r["batch"]
        for i, want in enumerate(wanted):
            sample = make_sample("single_needle", tok, want - overhead, 5 + want)
            ids = tok(chat_prompt(tok, sample.prompt), return_tensors="pt", add_special_tokens=False)["input_ids"]
            assert r["lengths"][i] == ids.shape[1] <= want
            assert r["accuracy"][i] == score(sample, r["outputs"][i])
            if r["policy"] == "Full()":
                with torch.no_grad():
                    alone = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                           min_new_tokens=new, do_sample=False)
                assert r["outputs"][i] == answer_text(tok, alone[0, ids.shape[1]:].tolist()), (r["batch"], i)
    page = tp.write_page(rows, tmp_path / "t.md", "kvpass bench --throughput --task single_needle")
    assert "single_needle accuracy" in page.read_text()

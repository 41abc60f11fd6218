"""RULER with one shared exact prefill per sample (kvpass.bench.ruler) against lm-eval's own model loop.

The model is a tiny random Llama with SmolLM2's tokenizer (structure only: its answers are noise, but
they must be the same noise as lm-eval's HFLM gives on the same requests).
"""

from __future__ import annotations

import pytest

from kvpass.bench.ruler import agreement, answer, requests, run_shared


@pytest.fixture
def tok_dir(smollm2, monkeypatch):
    from kvpass.models import smollm2_cache_path

    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    return str(smollm2_cache_path(smollm2.cache_dir))


def test_answer_is_cut_as_hflm_cuts_it(smollm2):
    tok = smollm2.tokenizer
    ids = tok(" 1234. The end.\nMore", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert answer(tok, ids, []) == " 1234. The end.\nMore"  # special tokens skipped
    assert answer(tok, ids, ["\n", ""]) == " 1234. The end."
    assert answer(tok, ids, [" The", "\n"]) == " 1234."


def test_agreement_counts_pairs_both_runs_hold():
    row = dict(policy="Full()", task="t", max_seq_length=1024)
    a = [row | dict(doc=0, score=1.0, response=" 7 "), row | dict(doc=1, score=0.0, response="x"),
         row | dict(doc=2, score=1.0, response="9")]
    b = [row | dict(doc=0, score=1.0, response="7"), row | dict(doc=1, score=1.0, response="y")]
    assert agreement(a, b) == {"n": 2, "same_score": 0.5, "same_text": 0.5}
    assert agreement(a, [])["n"] == 0


def test_shared_prefill_answers_equal_lm_eval_loop(smollm2, tok_dir, one_thread):
    """Two prose-niah requests: lm-eval's HFLM (its own loop, batch 1) on the uncompiled model, and the
    shared-prefill runner with ``eager`` and with kvpass's Full give the same answer text and score for
    each doc; ClusterKV at a small budget (the same compiled graph, swapped by ``set_policy``) attends
    fewer tokens than the rows hold and says so."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kvpass import ClusterKV, Full
    from kvpass.bench.ruler_tasks import TASKS_DIR
    from tiny import tiny_llama

    tok = smollm2.tokenizer
    model = tiny_llama(vocab=len(tok), positions=2048)
    meta = {"max_seq_lengths": [1024], "tokenizer": tok_dir, "num_samples": 2}
    res = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size=1),
                                  tasks=["niah_single_2_prose"], task_manager=TaskManager(include_path=str(TASKS_DIR),
                                                                                          metadata=meta),
                                  log_samples=True, gen_kwargs={"max_gen_toks": 3}, bootstrap_iters=0)
    loop = {s["doc_id"]: (s["filtered_resps"][0], s["1024"]) for s in res["samples"]["niah_single_2_prose"]}

    reqs = requests(["niah_single_2_prose"], [1024], 2, tok_dir, max_gen_toks=3)
    assert [r.doc_id for r in reqs] == [0, 1] and all(r.length == 1024 for r in reqs)
    small = ClusterKV(budget=64, sinks=4, tokens_per_cluster=16, decode_window=16, dense_layers=())
    rows = run_shared(model, tok, reqs, ["eager", Full(), small], progress=False)
    by = {(r["policy"], r["doc"]): r for r in rows}
    for doc, (text, score) in loop.items():
        for pol in ("eager", Full().describe()):
            assert (by[pol, doc]["response"], by[pol, doc]["score"]) == (text, score), (pol, doc)
    assert not by["eager", 0]["compressed"] and not by[Full().describe(), 0]["compressed"]
    assert all(by[small.describe(), d]["compressed"] for d in (0, 1))
    assert all(by[small.describe(), d]["attended"] < by[small.describe(), d]["prompt_tokens"] for d in (0, 1))

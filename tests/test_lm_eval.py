"""kvpass inside lm-evaluation-harness (kvpass.bench.lm_eval) and the prose RULER tasks
(kvpass.bench.ruler_tasks).

The model test runs lm-eval's own ``simple_evaluate`` on a tiny random Llama with SmolLM2's tokenizer
(structure only: its answers are noise, but they must be the same noise as plain HFLM's): one batch of
three left-padded rows of different lengths from the prose niah task. Importing lm-eval's RULER
generator costs about 30 s once per process (it builds RULER's 6.2M needle keys).
"""

from __future__ import annotations

import json
import math
import random

import pytest

# the eval extra, which the Makefile installs: lm_eval missing is a failure here, not a skip
from kvpass.bench.lm_eval import KVPassLM, cell_stats, parse_model_args, wilson, write_page

NEEDLE = "One of the special magic {kind} for {key} is: {value}."


@pytest.fixture
def tok_dir(smollm2, monkeypatch):
    """The SmolLM2 tokenizer's folder in the session's converted cache (``smollm2`` resolves to it)."""
    from kvpass.models import smollm2_cache_path

    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    return str(smollm2_cache_path(smollm2.cache_dir))


# -- the prose RULER tasks -------------------------------------------------------------------------
def test_prose_samples_have_the_length_and_the_needle(smollm2, tok_dir):
    import lm_eval.tasks.ruler.prepare_niah as pn

    from kvpass.bench.ruler_tasks import prose

    tok = smollm2.tokenizer
    split, state = pn.cached_sent_tokenize, random.getstate()
    rows = prose.generate(tok, "niah_single_2", 1024, num_samples=4)
    assert pn.cached_sent_tokenize is split and random.getstate() == state  # nothing of the caller's changed
    assert len(rows) == 4
    for r in rows:
        n = len(tok(r["input"]).input_ids)
        assert r["length"] == n + 128 <= 1024  # the prompt plus RULER's reserve for the answer
        assert n > 700  # filled with prose up to RULER's 500-word steps, not a stub
        (value,) = r["outputs"]
        assert value.isdigit() and len(value) == 7
        key = r["input"].rsplit("for ", 1)[1].split(" mentioned")[0]
        assert NEEDLE.format(kind="numbers", key=key, value=value) in r["input"]
        assert r["input"].count("special magic numbers for") == 1 and 0 <= r["needle_depth"] < 1
        assert "The special magic number for" in r["gen_prefix"]
    assert len({r["length"] for r in rows}) > 1  # different lengths: a batch of them is left-padded
    # seeded: the same samples after other draws; the first 2 of 4 are a 2-sample run's
    random.seed(123)
    random.random()
    assert prose.generate(tok, "niah_single_2", 1024, num_samples=4) == rows
    assert prose.generate(tok, "niah_single_2", 1024, num_samples=2) == rows[:2]
    assert prose.generate(tok, "niah_single_2", 1024, num_samples=2, seed=7) != rows[:2]

    (mk,) = prose.generate(tok, "niah_multikey_1", 1024, num_samples=1)
    assert mk["input"].count("special magic numbers for") == 4 and mk["outputs"][0] in mk["input"]
    with pytest.raises(ValueError, match="unknown RULER prose task"):
        prose.generate(tok, "niah_single_1", 1024)


def test_prose_tasks_register_in_lm_eval(tok_dir):
    from lm_eval.tasks import TaskManager

    from kvpass.bench.ruler_tasks import PROSE_TASKS, TASKS_DIR

    tm = TaskManager(include_path=str(TASKS_DIR), metadata={"max_seq_lengths": [1024], "tokenizer": "smollm2",
                                                            "num_samples": 2})
    assert set(PROSE_TASKS) <= set(tm.all_tasks)
    task = tm.load(["niah_single_2_prose"])["tasks"]["niah_single_2_prose"]
    docs = list(task.test_docs())
    assert len(docs) == 2 and docs[0]["max_length"] == 1024
    # scored by lm-eval's RULER code: the needle's value in the answer
    assert task.process_results(docs[0], [f" {docs[0]['outputs'][0]}."])["1024"] == 1.0
    assert task.process_results(docs[0], [" 1234567."])["1024"] == 0.0


# -- the lm-eval model -----------------------------------------------------------------------------
def test_model_args_split_outside_parentheses():
    args = parse_model_args("pretrained=smollm2,policy=Quest(budget=512, page_size=16),batch_size=4,strict=False")
    assert args == {"pretrained": "smollm2", "policy": "Quest(budget=512, page_size=16)", "batch_size": 4,
                    "strict": False}
    with pytest.raises(ValueError, match="key=value"):
        parse_model_args("pretrained=smollm2,Full")


def test_registered_and_bad_policy_fails_before_loading():
    from lm_eval.api.registry import get_model

    assert get_model("kvpass") is KVPassLM
    with pytest.raises(ValueError, match="budget"):
        KVPassLM(pretrained="no/such/model", policy="ClusterKV(budget=-1)")


@pytest.mark.slow  # a tiny model compiled inside lm-eval: 2-7 min on 2 cores
def test_kvpass_model_equals_hflm_for_full_and_compresses(smollm2, tok_dir, one_thread):
    """One left-padded batch of three prose-niah rows through ``simple_evaluate``: plain HFLM on the
    uncompiled model, then the ``kvpass`` model on the same weights with Full (the same
    continuations), then with ClusterKV (swapped in by ``set_policy``: no recompile), whose report
    rows show each row attending fewer tokens than it holds. Two new tokens: a prefill and one decode
    step, so two graphs compile (a third token would compile the symbolic-length decode graph too)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kvpass import ClusterKV
    from kvpass.bench.ruler_tasks import TASKS_DIR
    from tiny import tiny_llama

    tok = smollm2.tokenizer
    model = tiny_llama(vocab=len(tok), positions=2048)
    tm = TaskManager(include_path=str(TASKS_DIR), metadata={"max_seq_lengths": [1024], "tokenizer": tok_dir,
                                                            "num_samples": 3})

    def answers(lm):
        res = lm_eval.simple_evaluate(model=lm, tasks=["niah_single_2_prose"], task_manager=tm, log_samples=True,
                                      gen_kwargs={"max_gen_toks": 2}, bootstrap_iters=0)
        return {s["doc_id"]: s["resps"][0][0] for s in res["samples"]["niah_single_2_prose"]}

    eager = answers(HFLM(pretrained=model, tokenizer=tok, batch_size=3))
    lm = KVPassLM(pretrained=model, tokenizer=tok, policy="Full", batch_size=3)
    full = answers(lm)
    assert len(full) == 3 and full == eager
    (batch,) = lm.batches
    assert batch["rows"] == 3 and len(set(batch["prompt_tokens"])) > 1  # rows of different lengths: padded
    assert batch["sites"] == 2 and batch["attended"] == batch["tokens"]  # Full attends every token of its row
    assert batch["tokens"] == [t + 1 for t in batch["prompt_tokens"]]  # padding never counted

    lm.kvpass_backend.set_policy(ClusterKV(budget=64, sinks=4, tokens_per_cluster=16, decode_window=16,
                                           dense_layers=()))
    lm.batches.clear()
    answers(lm)
    (batch,) = lm.batches
    assert batch["compressed"] and all(a < t for a, t in zip(batch["attended"], batch["tokens"]))
    assert all(a <= 64 + 16 + 16 for a in batch["attended"])


def test_no_kvpass_graph_is_loud(smollm2, tok_dir):
    """A run in which the compiled forward never reaches kvpass's graphs (dynamo told to run eagerly)
    raises under strict (the default) instead of reporting uncompressed scores."""
    import torch
    from lm_eval.api.instance import Instance

    from kvpass import KVPassError
    from tiny import tiny_llama

    tok = smollm2.tokenizer
    lm = KVPassLM(pretrained=tiny_llama(vocab=len(tok), positions=256), tokenizer=tok, policy="Full", batch_size=1)
    req = Instance(request_type="generate_until", doc={}, arguments=("The grass is green.", {"max_gen_toks": 2}),
                   idx=0)
    with torch.compiler.set_stance("force_eager"), pytest.raises(KVPassError, match="compression"):
        lm.generate_until([req])


# -- the page --------------------------------------------------------------------------------------
def test_wilson_interval_by_hand():
    z = 1.959963984540054
    # 3 of 4 by the formula written out: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    p, n = 0.75, 4
    lo = (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    hi = (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)
    assert wilson(3, 4) == pytest.approx((lo, hi), abs=1e-12)
    assert wilson(3, 4) == pytest.approx((0.3006, 0.9544), abs=1e-4)  # the published table value
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)  # not the normal interval's (0, 0)
    assert wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)


def test_cell_stats_and_page(tmp_path):
    binary = cell_stats([1.0, 1.0, 0.0, 1.0])
    assert binary["ci"] == "wilson" and binary["n"] == 4 and binary["score"] == 0.75
    assert (binary["ci_low"], binary["ci_high"]) == pytest.approx((0.3006, 0.9544), abs=1e-4)
    frac = cell_stats([0.25, 0.5, 1.0])  # multi-value RULER: fractions of needles found
    sd = math.sqrt(((0.25 - 7 / 12) ** 2 + (0.5 - 7 / 12) ** 2 + (1 - 7 / 12) ** 2) / 2)
    assert frac["ci"] == "normal"
    assert frac["ci_low"] == pytest.approx(7 / 12 - 1.959964 * sd / math.sqrt(3), abs=1e-6)
    assert frac["ci_high"] == pytest.approx(min(1.0, 7 / 12 + 1.959964 * sd / math.sqrt(3)), abs=1e-6)

    rows = [{"policy": "Full()", "task": "niah_single_2_prose", "max_seq_length": 4096, "compressed": False,
             "attended_mean": 3900.0, "seconds": 80.0, **binary},
            {"policy": "ClusterKV(budget=1024)", "task": "niah_multivalue_prose", "max_seq_length": 4096,
             "compressed": True, "attended_mean": 1100.0, "seconds": 90.0, **frac}]
    page = write_page(rows, tmp_path / "p.md", "kvpass bench --lm-eval niah_single_2_prose", {"lm-eval": "0.4.13"})
    text = page.read_text()
    assert "    kvpass bench --lm-eval niah_single_2_prose" in text and "lm-eval 0.4.13" in text
    assert "| niah_single_2_prose | 4096 | `Full()` | lm-eval | 0.750 | [0.301, 0.954] | 4 | no | 3900.0 | 80 |" in text
    assert f"[{frac['ci_low']:.3f}, {frac['ci_high']:.3f}]* | 3 | yes" in text
    assert "loops on the" not in text  # no agreement line without a run of each loop
    json.dumps(rows)  # rows stay JSON (they go to lm_eval.jsonl)

    shared = dict(rows[0], mode="shared prefill")
    page = write_page(rows + [shared], tmp_path / "q.md", "cmd", agreement={"n": 8, "same_score": 1.0,
                                                                          "same_text": 0.875})
    text = page.read_text()
    assert "| `Full()` | shared prefill | 0.750 |" in text
    assert "on the 8 (policy, sample) pairs both ran: equal score on 1.000 of them, equal answer text on 0.875" in text

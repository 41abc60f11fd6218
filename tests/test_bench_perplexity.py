"""Token-by-token perplexity (kvpass.bench.perplexity) on a tiny random Llama."""

import math

import pytest
import torch

from kvpass import Full, Quest, StreamingLLM, kvpass
from kvpass.bench.perplexity import perplexity, perplexity_of_ids, split_policies
from tiny import prompt, tiny_llama

WINDOW, EVAL = 80, 12


@pytest.fixture(scope="module")
def run():
    torch._dynamo.reset()
    model = tiny_llama(layers=2)
    ids = prompt(WINDOW, seed=3)
    policies = [Full(), Quest(budget=WINDOW + 16, page_size=4), StreamingLLM(sinks=2, window=6)]
    be = kvpass(Full())
    res = perplexity_of_ids(model, ids, be, policies, EVAL, warmup=False)
    graphs = len(be.graphs)
    assert graphs <= 3, be.report()  # prefill, first decode, symbolic decode: compiled once for all
    return model, ids, policies, res


def test_full_equals_one_eager_forward(run):
    model, ids, policies, res = run
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    prefix = WINDOW - EVAL
    logp = torch.log_softmax(logits[prefix - 1 : WINDOW - 1], dim=-1)
    nll = -logp.gather(1, ids[0, prefix:, None]).mean().item()
    full = res[Full().describe()]
    assert full["tokens"] == EVAL and full["window"] == WINDOW
    assert full["nll"] == pytest.approx(nll, rel=1e-4)
    assert full["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert full["delta"] == 0.0


def test_covering_budget_is_exactly_full(run):
    _, _, policies, res = run
    assert res[policies[1].describe()]["nll"] == res[Full().describe()]["nll"]
    assert res[policies[1].describe()]["delta"] == 0.0


def test_small_budget_differs_and_reports_delta(run):
    _, _, policies, res = run
    small = res[policies[2].describe()]
    full = res[Full().describe()]
    assert small["nll"] != full["nll"]
    assert small["delta"] == pytest.approx(small["ppl"] - full["ppl"])
    assert list(res)[0] == Full().describe()  # Full first, the reference


def test_warmup_and_a_second_run_change_nothing(run):
    model, ids, policies, res = run
    again = perplexity_of_ids(model, ids, None, policies[::2], EVAL)  # warm-up on, a fresh backend
    for p in policies[::2]:
        assert again[p.describe()]["nll"] == pytest.approx(res[p.describe()]["nll"], rel=1e-6)


def test_text_entry_point_with_a_char_tokenizer():
    from types import SimpleNamespace

    def tok(text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 128 for c in text]]))

    model = tiny_llama(layers=1)
    res = perplexity(model, tok, None, [Full()], window=40, eval_tokens=4, start=1000, progress=False)
    assert res[Full().describe()]["tokens"] == 4 and res[Full().describe()]["ppl"] > 1


def test_split_policies():
    assert split_policies("Full, Quest(budget=256, page_size=16),StreamingLLM") == [
        "Full", "Quest(budget=256, page_size=16)", "StreamingLLM"]

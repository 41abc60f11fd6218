"""The attention-recall metric on cases computed by hand, and the probe through a compiled model."""

import math

import torch

from kvpass import Full, Quest, kvpass
from kvpass.bench.recall import RecallProbe, recall_of_selection
from tiny import generate, prompt, tiny_llama


def test_recall_by_hand():
    # one head, d=1, keys 0, ln2, ln3 (scale 1): weights exp(0), exp(ln2), exp(ln3) = 1, 2, 3 over 6
    q = torch.tensor([[[1.0]]])
    k = torch.tensor([[[[0.0], [math.log(2)], [math.log(3)]]]])
    idx = torch.tensor([[[2, -1]]])  # the heaviest token only
    mass, topk = recall_of_selection(q, k, idx, scale=1.0)
    torch.testing.assert_close(mass, torch.tensor([[0.5]]))
    torch.testing.assert_close(topk, torch.tensor([[1.0]]))  # the true top-1 is token 2
    idx = torch.tensor([[[0, 1]]])  # the two lightest: 3/6 of the mass, 1 of the true top-2 {2, 1}
    mass, topk = recall_of_selection(q, k, idx, scale=1.0)
    torch.testing.assert_close(mass, torch.tensor([[0.5]]))
    torch.testing.assert_close(topk, torch.tensor([[0.5]]))
    mass, topk = recall_of_selection(q, k, None, scale=1.0)
    assert mass.item() == topk.item() == 1.0


def test_recall_respects_padding_and_gqa():
    q = torch.tensor([[[1.0], [-1.0]]])  # two query heads share one KV head
    k = torch.tensor([[[[0.0], [math.log(2)], [5.0]]]])
    valid = torch.tensor([[True, True, False]])  # token 2 is padding
    mass, _ = recall_of_selection(q, k, torch.tensor([[[1, -1]]]), scale=1.0, valid=valid)
    # head 0: weights 1, 2 over 3 -> 2/3; head 1: keys scored 0, -ln2 -> 1, 1/2 over 3/2 -> 1/3
    torch.testing.assert_close(mass, torch.tensor([[2 / 3, 1 / 3]]))


def test_probe_through_a_compiled_model():
    model = tiny_llama(layers=2)
    ids = prompt(120)
    for policy, exact in ((Full(), True), (Quest(budget=32, page_size=8), False)):
        torch._dynamo.reset()
        be = kvpass(policy)
        probe = RecallProbe(every=1)
        be.runtime.set_probe(probe)
        generate(model, ids, new_tokens=4, backend=be)
        layers = probe.per_layer()
        assert sorted(layers) == [0, 1] and all(v["steps"] == 3 for v in layers.values())
        s = probe.summary()
        if exact:
            assert s["mass"] == s["topk"] == 1.0
        else:
            assert 0.0 < s["mass"] < 1.0 and 0.0 < s["topk"] <= 1.0

"""The backend: entry point, cache keys, isolation between backends and sequences."""

import gc
import weakref

import pytest
import torch

from kvpass import Full, KVPassError, Quest, StreamingLLM, kvpass
from kvpass.lowering.graph_pass import KVPassGraphPass
from tiny import generate, prompt, tiny_llama


def test_entry_point_backend_by_name():
    model = tiny_llama()
    ids = prompt(20)
    ref = generate(model, ids, new_tokens=4)
    options = {"policy": Quest(budget=32, page_size=8)}
    fwd = model.forward
    model.forward = torch.compile(fwd, backend="kvpass", options=options)
    try:
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        model.forward = fwd
    assert torch.equal(out, ref)  # budget >= context
    be = options["backend"]
    assert be.policy == Quest(budget=32, page_size=8)
    assert [r["prefill_calls"] for r in be.report_rows()] == [1, 1]


def test_entry_point_accepts_a_policy_dict_and_needs_a_policy():
    from kvpass.api import kvpass_backend

    opts = {"policy": {"name": "StreamingLLM", "window": 8}}
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    kvpass_backend(gm, [torch.randn(1, 2)], options=opts)
    assert opts["backend"].policy == StreamingLLM(window=8)
    with pytest.raises(KVPassError, match="needs options=\\{'policy'"):
        kvpass_backend(gm, [torch.randn(1, 2)], options={})


def test_uuid_covers_pass_policy_and_backend():
    a, b, c = kvpass(Quest(budget=64)), kvpass(Quest(budget=128)), kvpass(Quest(budget=64))
    ua, ub, uc = (KVPassGraphPass(x).uuid() for x in (a, b, c))
    assert len({ua, ub, uc}) == 3  # other policy; same policy in another backend (other state)
    assert KVPassGraphPass(a).uuid() == ua  # stable


def test_two_models_two_backends_do_not_interfere():
    m1, m2 = tiny_llama(seed=1), tiny_llama(seed=2, layers=3)
    ids = prompt(50)
    b1, b2 = kvpass(Quest(budget=16, page_size=4)), kvpass(StreamingLLM(sinks=2, window=6))
    f1, f2 = m1.forward, m2.forward
    m1.forward, m2.forward = torch.compile(f1, backend=b1), torch.compile(f2, backend=b2)
    try:
        # the references: each model's sequence on its own, one after the other (each generate starts
        # afresh: test_second_generate_does_not_leak_state)
        ref1 = m1.generate(ids, max_new_tokens=4, do_sample=False)
        ref2 = m2.generate(ids, max_new_tokens=4, do_sample=False)
        # then interleave the two sequences step by step
        out1 = m1.generate(ids, max_new_tokens=2, do_sample=False)
        out2 = m2.generate(ids, max_new_tokens=4, do_sample=False)
        out1 = m1.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        m1.forward, m2.forward = f1, f2
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)
    assert len(b1.runtime.sites) == 2 and len(b2.runtime.sites) == 3


def test_report_survives_dynamo_reset_and_the_backend_is_garbage_collected():
    # one compile for both: the report outlives the reset, and the reset frees everything but our name
    model = tiny_llama(layers=2)
    be = kvpass(Quest(budget=16, page_size=4))
    generate(model, prompt(40), new_tokens=3, backend=be)
    ref = weakref.ref(be.runtime)
    torch._dynamo.reset()  # calls reset() on the backends it knows, and drops them (held for recompiles)
    assert all(r["tokens_logical"] == 42 and r["tokens_attended"] > 0 for r in be.report_rows())
    del be
    gc.collect()
    assert ref() is None


def test_a_frame_of_the_inner_model_reaches_the_same_sites():
    """A graph break can compile the inner model on its own (its paths lack the outer prefix): a path
    that is a dotted suffix of a site's path, with the same layer, is that site; anything less certain
    (another layer, another prefix, two candidates) gets a site of its own."""
    be = kvpass(Full())
    sid = be._site_id
    assert sid("model.layers.0.self_attn", 0) == 0 and sid("model.layers.1.self_attn", 1) == 1
    assert sid("layers.0.self_attn", 0) == 0 and sid("layers.1.self_attn", 1) == 1
    assert sid("lm.model.layers.1.self_attn", 1) == 1  # an outer frame seen later: the same module
    assert sid("decoder.layers.0.self_attn", 0) not in (0, 1)  # no suffix of model.layers.0...
    assert sid("layers.0.self_attn", 0) == 0  # a path keeps its site
    assert sid("model.layers.0.cross_attn", 0) not in (0, 1)
    assert sid("self_attn", None) not in (0, 1)  # no layer index: never merged (and left exact)

    be = kvpass(Full())
    a, b = be._site_id("encoder.layers.0.attn", 0), be._site_id("decoder.layers.0.attn", 0)
    assert a != b and be._site_id("layers.0.attn", 0) not in (a, b)  # ambiguous: its own site


def test_own_cache_off_keeps_the_model_cache():
    model = tiny_llama(layers=2)
    ids = prompt(30)
    ref = generate(model, ids, new_tokens=4)
    be = kvpass(StreamingLLM(sinks=2, window=60), own_cache=False, strict=True)
    assert torch.equal(generate(model, ids, new_tokens=4, backend=be), ref)
    assert not any("(owned)" in r["pattern"] for g in be.graphs for r in g.sites)


# its own compile: the report's patterns are those of the graphs compiled in this test
def test_owned_cache_leaves_a_stub_in_the_model_cache_and_the_report_lists_every_site():
    model = tiny_llama(layers=2)
    ids = prompt(30)
    be = kvpass(Full(), strict=True)
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=be)
    try:
        res = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    finally:
        model.forward = fwd
    cache = res.past_key_values
    assert cache.get_seq_length() == 34  # logical positions never shrink
    for layer in cache.layers:
        assert layer.keys.shape[2] == 34 and layer.keys.stride(2) == 0
        assert layer.keys.untyped_storage().nbytes() < 34 * layer.keys[:, :, 0].numel() * 4
    for st in be.runtime.sites.values():
        assert st.store.length == 34
    assert all("(owned)" in r["pattern"] for g in be.graphs for r in g.sites)
    text = be.report()
    assert "Full()" in text and "P1 cat" in text
    assert len([ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "1 "))]) == 2


# The tests below on one tiny model and graph key share its compile (conftest's compiled_tiny),
# consecutively: the policies are swapped in with set_policy, every site afresh.
def test_second_generate_does_not_leak_state(compiled_tiny):
    # p2 on fresh sites (set_policy), then p1, then p2 again: the last equals the first (one compile)
    ct = compiled_tiny()
    model = ct.model
    p1, p2 = prompt(60, seed=1), prompt(45, seed=2)
    policy = StreamingLLM(sinks=2, window=12)
    be, compiled = ct.forward(policy)
    fwd = model.forward
    model.forward = compiled
    try:
        fresh = model.generate(p2, max_new_tokens=5, do_sample=False)
        model.generate(p1, max_new_tokens=5, do_sample=False)
        second = model.generate(p2, max_new_tokens=5, do_sample=False)
    finally:
        model.forward = fwd
    assert torch.equal(second, fresh)
    assert all(r["prefill_calls"] == 3 for r in be.report_rows())


def test_beam_search_reorders_the_owned_cache(compiled_tiny):
    # Full, then Quest with a budget that covers the context on the same graphs (set_policy)
    ct = compiled_tiny(layers=2)
    model = ct.model
    ids = prompt(24)
    kw = dict(num_beams=3, num_return_sequences=3)
    ref = generate(model, ids, new_tokens=5, **kw)
    fwd = model.forward
    try:
        for policy in (Full(), Quest(budget=64, page_size=8)):
            be, model.forward = ct.forward(policy)
            out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, **kw)
            assert torch.equal(out, ref), policy
    finally:
        model.forward = fwd
    assert [r["policy"] for r in be.report_rows()] == ["Quest", "Quest"]


def test_cache_filled_eagerly_is_adopted(compiled_tiny):
    """An eager prefill followed by compiled decoding: the runtime adopts the model's real cache."""
    from transformers import DynamicCache

    ct = compiled_tiny(layers=2)
    model = ct.model
    ids = prompt(20)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        first = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        ref_cache = DynamicCache(config=model.config)
        model(ids, past_key_values=ref_cache, use_cache=True)
        ref = model(first, past_key_values=ref_cache, use_cache=True).logits
        be, compiled = ct.forward(Full())
        out = compiled(first, past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(out, ref)
    assert all(st.store.length == 21 for st in be.runtime.sites.values())


def test_module_compile_works_too():
    model = tiny_llama(layers=2)
    ids = prompt(16)
    ref = generate(model, ids, new_tokens=4)
    be = kvpass(Full(), strict=True)
    model.compile(backend=be)
    try:
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    finally:
        model._compiled_call_impl = None
    assert torch.equal(out, ref)
    assert [r["decode_calls"] for r in be.report_rows()] == [3, 3]


def test_set_policy_swaps_without_recompiling():
    from torch._dynamo.utils import counters

    model = tiny_llama(layers=2)
    ids = prompt(60)
    policies = [Full(), Quest(budget=16, page_size=4), StreamingLLM(sinks=2, window=8)]
    # Full's reference is eager's tokens; the others come from a backend of their own
    refs = [generate(model, ids, new_tokens=4)]
    for p in policies[1:]:
        torch._dynamo.reset()
        refs.append(generate(model, ids, new_tokens=4, backend=kvpass(p)))
    torch._dynamo.reset()
    be = kvpass(Full())
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=be)
    try:
        outs = []
        for p in policies:
            be.set_policy(p)
            graphs = counters["stats"]["unique_graphs"]
            outs.append(model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False))
            if outs[1:]:
                assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    finally:
        model.forward = fwd
    assert all(torch.equal(a, b) for a, b in zip(outs, refs))
    assert [r["policy"] for r in be.report_rows()] == ["StreamingLLM", "StreamingLLM"]


def test_set_policy_refuses_a_different_graph():
    class Other(Quest):
        def graph_key(self):
            return "other"

    with pytest.raises(KVPassError, match="rewrites the graph differently"):
        kvpass(Full()).set_policy(Other())

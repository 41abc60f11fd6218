"""Right or loud (invariant 9): every way a step can leave the kvpass graph ends in the reference tokens
or a KVPassError naming the fix, never in different tokens without an error. The triggers live in
kvpass.bench.faults, which also writes docs/reliability.md from the same runs."""

from __future__ import annotations

import pytest
import torch

from kvpass import Full, KVPassError, Quest, kvpass
from kvpass.bench import faults
from kvpass.runtime.store import CacheStub

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs():
    return {}  # reference tokens by policy, compiled once for the module


def _case(trigger, policy):
    # A trigger run under Full and Quest ends the same way for both (the same refusal): `make test`
    # runs the compressing one, `make test-all` both.
    both = {"Full", "Quest"} <= set(trigger.policies)
    return pytest.param(trigger, policy, id=f"{trigger.name}-{policy.name}",
                        marks=pytest.mark.slow if both and policy.name == "Full" else ())


@pytest.mark.parametrize(("trigger", "policy"), [_case(t, p) for t, p in faults.cases()])
def test_trigger_is_right_or_loud(trigger, policy, refs):
    o = faults.run_trigger(trigger, policy, refs)
    assert o.result in ("right", "loud"), f"{o.trigger} / {o.policy}: {o.result}: {o.detail}"
    if o.result == "loud":
        assert o.detail.startswith("kvpass: ") and "Fix:" in o.detail, o.detail


def test_an_eager_step_on_a_runtime_owned_cache_is_refused_not_attended():
    # the structural part: whatever makes a step eager, the first op that computes with the stub refuses
    from transformers import DynamicCache

    model, ids = faults.tiny_model(layers=1), faults.prompt(12)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=kvpass(Full()))
    with torch.no_grad():  # as in generate (with autograd on, the site is left exact)
        out = compiled(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    keys = out.past_key_values.layers[0].keys
    assert type(keys) is CacheStub and keys.shape[2] == 12
    for op in (lambda k: k + 1, lambda k: k.sum(), lambda k: torch.cat([k, k], 2), lambda k: k @ k.mT,
               lambda k: torch.nn.functional.scaled_dot_product_attention(k, k, k), lambda k: k.tolist()):
        with pytest.raises(KVPassError, match="outside the compiled graph.*Fix:"):
            op(keys)
    # metadata and row moves between steps are served, and keep refusing
    assert keys.shape == (1, 2, 12, 16) and keys.dim() == 4 and keys.dtype == torch.float32
    moved = keys.index_select(0, torch.tensor([0]))[:, :, :10]
    assert type(moved) is CacheStub and moved.shape[2] == 10
    with pytest.raises(KVPassError):
        moved * 2
    assert "CacheStub" in repr(keys)


def test_own_cache_false_keeps_real_keys_so_eager_steps_stay_exact():
    model, ids = faults.tiny_model(layers=1), faults.prompt(12)
    ref = faults.generate(model, ids)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        out = faults.generate(model, ids, backend=kvpass(Full(), own_cache=False))
    assert torch.equal(out, ref)


def test_backend_compile_runs_generate_compressed_and_reports():
    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    torch._dynamo.reset()
    ref = faults.generate(model, ids, backend=kvpass(Quest(budget=32, page_size=8)))
    torch._dynamo.reset()
    backend = kvpass(Quest(budget=32, page_size=8))
    assert backend.compile(model) is model
    try:
        out = model.generate(ids, max_new_tokens=faults.NEW, min_new_tokens=faults.NEW, do_sample=False)
        assert torch.equal(out, ref)
        assert backend.graph_calls() == faults.NEW and backend.eager_forwards == 0
        assert "compression off" not in backend.report()
        with pytest.raises(KVPassError, match="already compiled"):
            backend.compile(model)
    finally:
        del model.forward
    with pytest.raises(KVPassError, match="not what torch.compile returned"):
        backend.compile(torch.compile(model, backend=backend))


def test_a_static_cache_other_than_the_sequence_own_is_rebuilt_from_not_continued():
    # two static caches stepping in turn on one site: the second must not decode from the first's metadata
    from kvpass.runtime.state import Runtime

    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 16)
    bufs = [torch.randn(1, 2, 64, 16) for _ in range(2)]
    rt = Runtime(Quest(budget=16, page_size=8))
    for buf in bufs:  # each prefill starts a sequence on its own buffer
        rt.attend(0, torch.randn(1, 4, 40, 16), buf, buf, None, torch.arange(40), 0.0, True)
    got = rt.attend(0, q, bufs[0], bufs[0], None, torch.tensor([40]), 0.0, False)  # the first one steps
    alone = Runtime(Quest(budget=16, page_size=8))
    alone.attend(0, torch.randn(1, 4, 40, 16), bufs[0], bufs[0], None, torch.arange(40), 0.0, True)
    want = alone.attend(0, q, bufs[0], bufs[0], None, torch.tensor([40]), 0.0, False)
    assert torch.equal(rt.state(0).last_idx, alone.state(0).last_idx)
    torch.testing.assert_close(got, want)


def test_steps_a_site_never_saw_rebuild_its_metadata_from_the_cache():
    # a cache the model keeps grew by a step that ran eagerly: the next step folds it in, as an adoption
    from kvpass.runtime.state import Runtime

    torch.manual_seed(0)
    k = torch.randn(1, 2, 64, 16)
    q = torch.randn(1, 4, 1, 16)
    seen, skipped = Runtime(Quest(budget=16, page_size=8)), Runtime(Quest(budget=16, page_size=8))
    for rt in (seen, skipped):
        rt.attend(0, torch.randn(1, 4, 40, 16), k, k, None, torch.arange(40), 0.0, True)
    seen.attend(0, q, k, k, None, torch.tensor([40]), 0.0, False)
    a = seen.attend(0, q, k, k, None, torch.tensor([41]), 0.0, False)
    b = skipped.attend(0, q, k, k, None, torch.tensor([41]), 0.0, False)  # position 40 ran eagerly
    assert torch.equal(seen.state(0).last_idx, skipped.state(0).last_idx)
    torch.testing.assert_close(a, b)

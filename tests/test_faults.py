"""Right or loud (invariant 9): every way a step can leave the kvpass graph ends in the reference tokens
or a KVPassError naming the fix, never in different tokens without an error. The triggers live in
kvpass.bench.faults, which also writes docs/results/reliability.md from the same runs."""

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


# Triggers whose outcome a cheaper default test of this file asserts the same way (`make test-all` runs
# them here too): the recompile limit spent by another model, warned and raised under strict
# (test_a_compiled_forward_run_eagerly_*[recompile limit spent], one other model instead of two); the
# force_eager stance on a compiled forward (test_a_compiled_forward_run_eagerly_warns_once_and_reports[
# force_eager stance], the same run); backend.compile with the forward run eagerly under strict
# (test_backend_compile_watches_through_the_same_hooks).
COVERED = {"models in one process", "models in one process, strict", "force_eager stance",
           "backend.compile, prefill eager, strict"}


def _case(trigger, policy):
    # A trigger run under Full and Quest ends the same way for both (the same refusal): `make test`
    # runs the compressing one, `make test-all` both.
    both = {"Full", "Quest"} <= set(trigger.policies)
    slow = (both and policy.name == "Full") or trigger.name in COVERED
    return pytest.param(trigger, policy, id=f"{trigger.name}-{policy.name}",
                        marks=pytest.mark.slow if slow else ())


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
    from kvpass.runtime import Runtime

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
    from kvpass.runtime import Runtime

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


def test_a_model_kept_cache_of_another_sequence_of_equal_length_is_refused():
    # own_cache=False (a DynamicCache: no cache_position): two sequences of equal length stepping in turn on one site. Their lengths agree;
    # the newest key the site saw does not, so the step raises instead of using the other's metadata.
    from kvpass.runtime import Runtime

    torch.manual_seed(0)
    ks = [torch.randn(1, 2, 64, 16) for _ in range(2)]
    q = torch.randn(1, 4, 1, 16)
    rt = Runtime(Quest(budget=16, page_size=8))
    for k in ks:  # each is prefilled; the second one last
        rt.attend(0, torch.randn(1, 4, 40, 16), k[:, :, :40], k[:, :, :40], None, None, 0.0, True)
    with pytest.raises(KVPassError, match="does not continue the sequence this site served.*Fix:"):
        rt.attend(0, q, ks[0][:, :, :41], ks[0][:, :, :41], None, None, 0.0, False)
    # the sequence that stepped last continues as if alone
    alone = Runtime(Quest(budget=16, page_size=8))
    alone.attend(0, torch.randn(1, 4, 40, 16), ks[1][:, :, :40], ks[1][:, :, :40], None, None, 0.0, True)
    want = alone.attend(0, q, ks[1][:, :, :41], ks[1][:, :, :41], None, None, 0.0, False)
    got = rt.attend(0, q, ks[1][:, :, :41], ks[1][:, :, :41], None, None, 0.0, False)
    torch.testing.assert_close(got, want)


def test_a_model_kept_cache_shorter_than_the_site_saw_rebuilds_its_metadata():
    # own_cache=False: a second sequence continues a copy of a shared prefix after the first decoded
    # past it. The site's metadata describes the first one's longer cache: it is rebuilt from this one.
    from kvpass.runtime import Runtime

    torch.manual_seed(0)
    k = torch.randn(1, 2, 64, 16)
    kb = torch.cat([k[:, :, :40], torch.randn(1, 2, 24, 16)], dim=2)  # the prefix, then its own tokens
    k[:, :, 40:] *= 50  # the first sequence's own keys dominate the bounds of the pages they fall in
    q = torch.randn(1, 4, 1, 16)
    prefill = torch.randn(1, 4, 40, 16)
    rt, alone = Runtime(Quest(budget=16, page_size=8)), Runtime(Quest(budget=16, page_size=8))
    for r in (rt, alone):
        r.attend(0, prefill, k[:, :, :40], k[:, :, :40], None, None, 0.0, True)
    for pos in range(40, 56):  # the first sequence decodes 16 tokens (two pages)
        rt.attend(0, q, k[:, :, : pos + 1], k[:, :, : pos + 1], None, None, 0.0, False)
    for pos in range(40, 58):  # the second continues the prefix, past the first one's pages
        got = rt.attend(0, q, kb[:, :, : pos + 1], kb[:, :, : pos + 1], None, None, 0.0, False)
        want = alone.attend(0, q, kb[:, :, : pos + 1], kb[:, :, : pos + 1], None, None, 0.0, False)
        assert torch.equal(rt.state(0).last_idx, alone.state(0).last_idx)
        torch.testing.assert_close(got, want)


# -- model.forward = torch.compile(model.forward, backend=b): a forward dynamo ran eagerly says so ----------

def _spent_limit():
    """The one graph allowed is used up by another model first (its cache is its own: its eager steps are
    exact), so this model's prefill, and so every step, runs eagerly."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(recompile_limit=1))
    faults.generate(faults.tiny_model(3), faults.prompt(8), backend=kvpass(Full(), own_cache=False))
    return stack


EAGER_WAYS = {"recompile limit spent": _spent_limit,
              "force_eager stance": lambda: torch.compiler.set_stance("force_eager")}


def _run_recording(model, ids, backend, way=None):
    import contextlib
    import warnings

    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        if way is not None:
            stack.enter_context(EAGER_WAYS[way]())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = faults.generate(model, ids, backend=backend)
    return out, [str(w.message) for w in caught if "compression is off" in str(w.message)]


@pytest.mark.parametrize("way", sorted(EAGER_WAYS))
def test_a_compiled_forward_run_eagerly_warns_once_and_reports(way):
    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    ref = faults.generate(model, ids)
    backend = kvpass(Quest(budget=32, page_size=8))
    out, said = _run_recording(model, ids, backend, way)
    assert torch.equal(out, ref)  # uncompressed: eager's tokens
    assert len(said) == 1, said  # once, though every forward ran eagerly
    assert "a forward of LlamaForCausalLM ran none of kvpass's graphs" in said[0]
    assert "dynamo ran it eagerly" in said[0] and "Fix:" in said[0]
    assert "generate() on what torch.compile(model) returns" not in said[0]  # not the wrapper's message
    assert backend.graph_calls() == 0 and backend.eager_forwards == faults.NEW
    assert f"compression off for {faults.NEW} forward(s)" in backend.report()


@pytest.mark.parametrize("way", sorted(EAGER_WAYS))
def test_a_compiled_forward_run_eagerly_raises_under_strict(way):
    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    backend = kvpass(Quest(budget=32, page_size=8), strict=True)
    match = r"compression is off: a forward of LlamaForCausalLM .*dynamo ran it eagerly.*Fix: raise the"
    with pytest.raises(KVPassError, match=match):
        _run_recording(model, ids, backend, way)
    assert backend.eager_forwards == 1  # the prefill: raised before any decode step


def test_a_normally_compiled_forward_does_not_warn_even_under_strict():
    import gc

    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    first = kvpass(Quest(budget=32, page_size=8))
    ref = faults.generate(model, ids, backend=first)
    backend = kvpass(Quest(budget=32, page_size=8), strict=True)
    out, said = _run_recording(model, ids, backend)
    assert torch.equal(out, ref) and said == []
    assert backend.graph_calls() == faults.NEW and backend.eager_forwards == 0 == first.eager_forwards
    assert "compression off" not in backend.report()
    assert len(model._forward_pre_hooks) == 2  # the two backends' watches, each quiet
    del first
    gc.collect()
    _run_recording(model, ids, backend)
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1  # a freed backend's watch goes


def test_backends_compiling_one_module_in_turn_do_not_blame_each_other():
    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    ref = faults.generate(model, ids)
    a, b = kvpass(Full(), strict=True), kvpass(Full())
    whole = kvpass(Full(), strict=True)
    torch.compile(model, backend=whole)  # watches the whole module, as generate() on its wrapper is eager
    out, said = _run_recording(model, ids, a)
    assert torch.equal(out, ref) and said == [] and a.graph_calls() == faults.NEW
    # b's compiled forward runs eagerly: b warns; a's and whole's watches see b's forward and keep quiet
    out, said = _run_recording(model, ids, b, "force_eager stance")
    assert torch.equal(out, ref) and len(said) == 1
    assert (a.eager_forwards, b.eager_forwards, whole.eager_forwards) == (0, faults.NEW, 0)
    # and a second time the other way round: a strict backend's forward compiled after b's
    out, said = _run_recording(model, ids, a)
    assert torch.equal(out, ref) and said == [] and a.graph_calls() == 2 * faults.NEW
    assert b.eager_forwards == faults.NEW
    # model.compile() by one backend, then another: only the one whose compiled call ran eagerly is named
    c, d = kvpass(Full(), strict=True), kvpass(Full())
    model.compile(backend=c)
    model.compile(backend=d)
    try:
        with torch.compiler.set_stance("force_eager"), pytest.warns(UserWarning, match="compression is off"):
            model.generate(ids, max_new_tokens=faults.NEW, min_new_tokens=faults.NEW, do_sample=False)
    finally:
        model._compiled_call_impl = None
    assert (c.eager_forwards, d.eager_forwards) == (0, faults.NEW)


def test_an_eager_model_run_is_not_blamed_on_a_forward_compiled_before():
    # the forward restored (faults.generate puts the bound method back): the watch stays, and is quiet
    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    backend = kvpass(Full(), strict=True)
    faults.generate(model, ids, backend=backend)
    _, said = _run_recording(model, ids, None)
    assert said == [] and backend.eager_forwards == 0


def test_backend_compile_watches_through_the_same_hooks():
    model, ids = faults.tiny_model(layers=1), faults.prompt(40)
    backend = kvpass(Full(), strict=True)
    backend.compile(model)
    try:
        with torch.no_grad():
            with torch.compiler.set_stance("force_eager"), pytest.raises(KVPassError, match="ran it eagerly"):
                model(ids)
            model(ids)
    finally:
        del model.forward
    assert backend.eager_forwards == 1 and backend.graph_calls() == 1
    assert len(model._forward_pre_hooks) == 1  # one watch, not one per way of compiling


def test_torch_compile_disable_says_compression_is_off():
    model = faults.tiny_model(layers=1)
    with pytest.warns(UserWarning, match=r"compression is off: torch.compile.*disable=True"):
        torch.compile(model.forward, backend=kvpass(Full()), disable=True)
    with pytest.raises(KVPassError, match=r"disable=True.*Fix"):
        torch.compile(model, backend=kvpass(Full(), strict=True), disable=True)

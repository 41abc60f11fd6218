"""Policy sweeps in one process (issue 53, item 6): many backends compiled in turn on copies of one model
all run compressed, and what a backend holds for a sequence is freed when the model's cache is dropped."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch

from kvpass import CentroidKV, ClusterKV, Full, KVPassError, Quest, StreamingLLM, TailorKV, kvpass
from tiny import prompt, tiny_llama

NEW = 3  # a prefill and two decode steps: the prefill graph and the (symbolic) decode graph

# small budgets that compress a 150-token prompt on the tiny Llama (2 layers, 2 KV heads of 16)
_CLUSTER = dict(sinks=4, tokens_per_cluster=16, decode_window=16, dense_layers=())
_CENTROID = dict(sinks=4, recent=16, chunk=64, step=16)
_TAILOR = dict(residual=16, static_tokens=16, sinks=4, group_size=16)
SWEEP = [
    Quest(budget=48, page_size=16), Full(), StreamingLLM(sinks=4, window=32),
    StreamingLLM(sinks=4, window=64), Quest(budget=64, page_size=8), ClusterKV(budget=48, **_CLUSTER),
    ClusterKV(budget=64, **_CLUSTER), CentroidKV(cache_ratio=0.25, **_CENTROID),
    CentroidKV(cache_ratio=0.5, **_CENTROID), TailorKV(sparse_budget=48, **_TAILOR),
    TailorKV(sparse_budget=64, **_TAILOR), StreamingLLM(sinks=4, window=32), ClusterKV(budget=48, **_CLUSTER),
    CentroidKV(cache_ratio=0.25, **_CENTROID), TailorKV(sparse_budget=48, **_TAILOR),
    Quest(budget=48, page_size=16),  # the first policy again, compiled last
]


def _generate(model, ids, **kw):
    return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kw)


def _compressed(be, length: int) -> bool:
    """Some site attended or held fewer than the sequence's tokens at its last step (the rows of a
    released sequence show it as it ended)."""
    rows = [r for r in be.report_rows() if "reason" not in r]
    assert rows and all(r["tokens_logical"] == length for r in rows), rows
    return any(r["tokens_attended"] < length or r["tokens_held"] < length for r in rows)


def _sweep(model, ids, policies, how=lambda be, m: be.compile(m)):
    """Compile each policy on a deep copy of ``model`` in turn and generate; a "compression is off"
    warning is an error. Returns each run's tokens."""
    outs = []
    for policy in policies:
        m = copy.deepcopy(model)
        be = kvpass(policy)
        how(be, m)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="kvpass: compression is off")
            out = _generate(m, ids)
        length = ids.shape[1] + NEW - 1  # the last step's context (its new token included)
        assert be.graph_calls() == NEW and be.eager_forwards == 0, (policy, be.report())
        assert len(be.graphs) == 2, (policy, be.report())  # this backend's own prefill and decode graphs
        if not policy.exact:
            assert _compressed(be, length), (policy, be.report())
        outs.append(out)
    return outs


def test_backends_compiled_in_turn_keep_each_its_own_recompile_limit():
    """The limit lowered to one backend's graphs (2) stands in for the default 8 that the 5th backend hit:
    without isolation the third backend (the second on the shared region) runs eagerly ("compression is
    off", an error here)."""
    model, ids = tiny_llama(), prompt(150)
    quest = Quest(budget=48, page_size=16)
    policies = [quest, StreamingLLM(sinks=4, window=32), quest]

    def how(be, m):  # the documented style, isolated by hand, for the middle one
        if be.policy.name == "StreamingLLM":
            m.forward = torch.compile(m.forward, backend=be, isolate_recompiles=True)
        else:
            be.compile(m)

    with torch._dynamo.config.patch(recompile_limit=2):
        outs = _sweep(model, ids, policies, how)
    assert torch.equal(outs[2], outs[0])  # the same policy, compiled first and compiled last


@pytest.mark.slow
def test_sixteen_policies_in_one_process_all_run_compressed():
    """16 policies at dynamo's default limits: each runs compressed, Full equals eager, and every policy
    compiled again later gives the tokens it gave when compiled first. About 3 minutes on 2 cores (32
    Inductor compiles)."""
    model, ids = tiny_llama(), prompt(150)
    ref = _generate(model, ids)
    outs = _sweep(model, ids, SWEEP)
    assert torch.equal(outs[SWEEP.index(Full())], ref)
    for i, policy in enumerate(SWEEP):
        first = SWEEP.index(policy)
        assert torch.equal(outs[i], outs[first]), (i, policy)


def test_a_dropped_cache_frees_what_the_backend_held_for_it():
    """Keys, values and metadata follow the sequence: freed when the model's cache that holds the stubs
    is garbage-collected (stubs moved by beam search hold it too), or by clear_state(); a stale cache
    stays refused."""
    from transformers import DynamicCache

    model, ids = tiny_llama(), prompt(200, batch=4)
    be = kvpass(ClusterKV(budget=48, **_CLUSTER))
    be.compile(model)
    empty = be.held_bytes()
    cache = DynamicCache(config=model.config)
    out = _generate(model, ids, past_key_values=cache)
    held = be.held_bytes()
    kv = 2 * 2 * 4 * 2 * 202 * 16 * 4  # layers x (k, v) x batch x KV heads x tokens x head dim x fp32
    assert held >= kv, held  # the keys and values of every site, at least
    cache.reorder_cache(torch.tensor([1, 0, 3, 2]))  # beam search: the moved stubs replace the graph's
    gc.collect()
    assert be.held_bytes() == held  # and hold the sequence as well
    del cache
    gc.collect()
    after = be.held_bytes()
    assert after <= max(empty, 4096), after  # the stub bases: (B, H_kv, D) per site, a few KiB
    report = be.report()
    assert "released" in report and "rows marked *" in report  # the ended sequence's figures stay readable
    assert all(r.get("released") and r["tokens_logical"] == 202 for r in be.report_rows())

    # generate() drops its own cache: nothing stays held after it returns
    assert torch.equal(_generate(model, ids), out)
    gc.collect()
    assert be.held_bytes() == after

    # clear_state() frees a sequence whose cache is still alive; continuing it then is refused
    cache = DynamicCache(config=model.config)
    _generate(model, ids, past_key_values=cache)
    assert be.held_bytes() >= kv
    be.clear_state()
    assert be.held_bytes() <= after
    longer = torch.cat([out, out[:, -1:]], dim=1)
    with pytest.raises(KVPassError, match="belongs to a sequence this backend no longer holds"):
        _generate(model, longer, past_key_values=cache)


def test_a_release_during_another_models_trace_computes_outside_the_fake_mode():
    """The garbage collection that drops a cache can run while dynamo traces another model under a
    fake-tensor mode: the released row's reductions run on the real tensors, and the memory is freed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvpass.runtime import Runtime

    rt = Runtime(Quest(budget=16, page_size=8), "test_sweep")
    st = rt.state(0)
    st.store.append(None, None, torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16))
    st.length, st.decode_calls, st.attended = 40, 1, -1
    st.last_idx = torch.tensor([[[0, 1, 2, -1], [3, 4, -1, -1]]])  # (B, H_kv, N): 3 and 2 attended
    assert rt.held_bytes() >= 2 * 2 * 40 * 16 * 4
    with FakeTensorMode():
        st.release()
    assert rt.held_bytes() == 0
    row = st.report_row()
    assert row["released"] and row["tokens_logical"] == 40 and row["tokens_attended"] == 2  # round(2.5)

"""A steady decode step is a fixed-shape tensor program (invariant 8): no op that syncs with the host or
sizes a tensor by its data, and the same ops step after step, except at the scheduled events a policy
declares (decode-time clustering, a merge round, a residual flush: ``SiteState.events``)."""

from __future__ import annotations

import collections

import pytest
import torch
from tiny import prompt, tiny_llama

from kvpass import (CentroidKV, ClusterKV, Full, Quest, StreamingLLM, TailorKV, kvpass)
from kvpass.bench.syncs import OpLog
from kvpass.runtime.call import SiteInfo

STEPS = 16
# ops that only make views (no kernel): `t[:, :n]` is a slice or, when n is the whole dim, an alias
VIEW_OPS = {"aten::alias", "aten::slice", "aten::select", "aten::view", "aten::_unsafe_view", "aten::as_strided",
            "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::permute", "aten::t",
            "aten::detach", "aten::reshape", "aten::lift_fresh"}

TINY_POLICIES = [
    Full(),
    StreamingLLM(sinks=4, window=8),
    Quest(budget=16, page_size=4),
    ClusterKV(budget=16, sinks=2, tokens_per_cluster=4, dense_layers=(), decode_window=8, decode_clusters=2),
    CentroidKV(cache_ratio=0.5, sinks=2, recent=4, chunk=8, step=4),
    TailorKV(sparse_budget=16, static_tokens=8, sinks=2, critical_channels=4),  # every layer sparse
    TailorKV(profile="auto", tau=0.0, group_size=8, residual=8),  # every layer quantised, a flush every 8 steps
]


def _events(backend) -> int:
    return sum(st.all_events() for st in backend.runtime.sites.values())


def decode_log(model, policy, ids, steps=STEPS, backend=None, mask=None):
    """Prefill ``ids`` (``mask``: its attention mask, for a padded batch), 3 warm-up decode steps
    (recompiles), then ``steps`` logged steps of the compiled forward: a list of (op names but views,
    syncing op names, scheduled event ran) per step."""
    from transformers import DynamicCache

    backend = backend or kvpass(policy)
    fwd = torch.compile(model.forward, backend=backend)
    cache = DynamicCache(config=model.config)
    out = []
    kw = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad():
        res = fwd(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
        tok = res.logits[:, -1:].argmax(-1)
        for i in range(3 + steps):
            log, before = OpLog(), _events(backend)
            if mask is not None:  # generate() extends the mask with ones
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
                kw = {"attention_mask": mask}
            with log:
                res = fwd(input_ids=tok, past_key_values=cache, use_cache=True, **kw)
            tok = res.logits[:, -1:].argmax(-1)
            if i >= 3:
                ops = tuple(op for op in log.ops if op not in VIEW_OPS)
                out.append((ops, collections.Counter(log.syncs), _events(backend) != before))
    return out


def check_steady(steps, policy):
    steady = [s for s in steps if not s[2]]
    assert len(steady) >= len(steps) // 2, f"{policy}: scheduled events in most steps"
    for ops, syncs, _ in steady:
        assert not syncs, f"{policy}: a steady decode step ran syncing ops {dict(syncs)}"
    # the ops may change only across a scheduled event (e.g. the CPU attention path switching from a
    # masked dense read to a gather as the context outgrows three times the selection)
    last = None
    for ops, _, event in steps:
        if event:
            last = None
            continue
        if last is not None:
            assert ops == last, f"{policy}: steady decode steps ran different op sequences with no event between"
        last = ops
    assert any("kvpass::attention_owned" in op for op in steady[0][0]), "the runtime's op was not logged"


class Syncing(StreamingLLM):
    """StreamingLLM whose selection reads a tensor on the host, as a data-dependent branch would."""

    def new_state(self, info):
        st = super().new_state(info)
        select = st.select

        def select_with_sync(call):
            idx = select(call)
            bool(call.q.sum() > 0)  # a host read
            return idx

        st.select = select_with_sync
        return st


def test_steady_decode_step_is_sync_free_and_fixed(one_thread):
    """Every policy of TINY_POLICIES, one compile per graph key (the others are swapped in with
    set_policy). Batch 3: the batch > 1 paths (a stub with several rows was read at every step before
    StubRows). ClusterKV's decode-time clustering runs every decode_window steps and is declared as an
    event. And the log can fail: a policy whose selection reads a tensor on the host is caught."""
    model = tiny_llama()
    ids = prompt(48, batch=3)
    # a left-padded batch for the first policy of each kind that keeps per-row metadata (served row by
    # row, kvpass/runtime/rows.py, or in place, Quest): the rows' first positions are read where the
    # sequence starts only
    from families import left_padded

    padded, mask = left_padded([prompt(48, seed=2)[0], prompt(37, seed=3)[0]])
    split = {type(p) for p in TINY_POLICIES
             if not (st := p.new_state(SiteInfo(0, 0))).rows_native or st.per_row_metadata}
    groups: dict[str, list] = {}
    for p in TINY_POLICIES:
        groups.setdefault(p.graph_key(), []).append(p)
    checked = []
    for group in groups.values():
        backend = kvpass(group[0])
        for policy in group:
            backend.set_policy(policy)
            steps = decode_log(model, policy, ids, backend=backend)
            check_steady(steps, policy.describe())
            if isinstance(policy, ClusterKV):
                assert 1 <= sum(s[2] for s in steps) <= 3, "ClusterKV's clustering is not an event"
            checked.append(policy)
            if type(policy) in split:
                split.discard(type(policy))
                backend.set_policy(policy)
                check_steady(decode_log(model, policy, padded, backend=backend, mask=mask),
                             policy.describe() + " (padded)")
                checked.append(f"{policy.name} padded")
        if group[0].graph_key() == Syncing().graph_key():
            backend.set_policy(Syncing(sinks=4, window=8))
            steps = decode_log(model, None, ids, steps=2, backend=backend)
            assert all(s[1] for s in steps)
            with pytest.raises(AssertionError, match="syncing ops"):
                check_steady(steps, "Syncing")
            checked.append("Syncing")
    assert not split, f"no padded batch checked for {split}"
    assert len(checked) == len(TINY_POLICIES) + 1 + 4 and "Syncing" in checked  # every policy, padded, canary


@pytest.mark.slow  # a sweep of five policies on its own SmolLM2 compile (a hand-written decode loop)
def test_steady_decode_on_smollm2(smollm2):
    """The same on SmolLM2 (30 sites, 3 KV heads), one compile for the policies that share a graph."""
    ids = smollm2.tokenizer("The history of the city. " * 40, return_tensors="pt")["input_ids"][:, :256]
    backend = kvpass(Full())
    policies = [Full(), StreamingLLM(sinks=4, window=60), Quest(budget=64, page_size=16),
                ClusterKV(budget=64, sinks=4, tokens_per_cluster=8, decode_window=8, decode_clusters=2),
                CentroidKV(cache_ratio=0.5)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in policies:
            backend.set_policy(p)
            steps = decode_log(smollm2.model, p, ids, steps=10, backend=backend)
            check_steady(steps, p.describe())
    finally:
        torch.set_num_threads(n)


def test_check_steady_refuses_ops_that_change_without_an_event():
    a, b = ("kvpass::attention_owned", "aten::mm"), ("kvpass::attention_owned", "aten::bmm")
    no_sync = collections.Counter()
    check_steady([(a, no_sync, False), (a, no_sync, False), (b, no_sync, True), (b, no_sync, False)], "ok")
    with pytest.raises(AssertionError, match="no event between"):
        check_steady([(a, no_sync, False), (a, no_sync, False), (b, no_sync, False)], "changed")

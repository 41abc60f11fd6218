"""Left-padded batches for every policy (invariant 10): each row is served as that prompt alone.

Rows are compared with the same prompt run alone through the same compiled forward: tokens, logits, and
the selection itself (the positions each site attends, or CentroidKV's merged slots) at every step. The
tests share one compile per graph key and backend options (conftest's ``padded_compiled``, also used by
tests/test_robustness.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteria, StoppingCriteriaList

from kvpass import CentroidKV, ClusterKV, KVPassError, Quest, TailorKV, kvpass
from families import SMALL, SPLIT, by_graph_key, left_padded
from tiny import prompt

pytestmark = pytest.mark.usefixtures("one_thread", "many_graphs")


@pytest.fixture
def many_graphs():
    """Batch sizes 1-4 and several policies on one model's forward compile more graphs than dynamo's
    default recompile limit allows (it counts them per code object; hitting it is loud, see test_faults)."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield

NEW = 6


def selection(st) -> tuple:
    """What a site state attends at its last step, in the row's own positions: the selected positions,
    or CentroidKV's merged slots (their count and degrees)."""
    if getattr(st, "deg", None) is not None:
        return ("merged", st.s, st.deg[:, :, : st.s].clone())
    idx = st.last_idx
    return ("all",) if idx is None else ("idx", idx.clone())


def row_selections(st, batch: int) -> list[tuple]:
    """:func:`selection` of each batch row: the row states of a batch served row by row, or the rows of
    a state that serves padding in place (Quest, ClusterKV), whose positions are shifted to the row's own (its
    first real token is position 0), as ``("idx", (1, H_kv, N))`` or ``("all", n_tokens)``."""
    if st.split is not None:
        return [selection(x) for x in st.split.subs]
    if not st.pad.padded:
        return [selection(st)] if batch == 1 else [("batched", selection(st))] * batch
    batch = st.batch  # beam search hands the criteria more candidates than the cache has rows
    first = st.pad.first.expand(batch)
    out = []
    for b in range(batch):
        n = st.length - int(first[b])
        if st.last_idx is None:
            out.append(("all", n))
            continue
        idx = st.last_idx[b : b + 1]
        out.append(("idx", torch.where(idx >= 0, idx - first[b], -1), n))
    return out


def _same_selection(batched: tuple, alone: tuple) -> bool:
    """A batch row's selection against the row alone's. A row served in place that fits its budget lists
    all its own positions where the row alone attends ``"all"``; the lists may carry extra -1 slots."""
    if batched[0] == "idx" and len(batched) == 3:
        _, idx, n = batched
        if alone[0] == "all":
            return all(torch.equal(r[r >= 0].sort().values, torch.arange(n)) for r in idx.flatten(0, 1))
        if alone[0] != "idx":
            return False
        got, want = idx.flatten(0, 1), alone[1].flatten(0, 1)
        return got.shape[0] == want.shape[0] and all(
            torch.equal(g[g >= 0], w[w >= 0]) for g, w in zip(got, want))
    if batched[0] == "all" and len(batched) == 2:
        return alone == ("all",)
    return _same(batched, alone)


class Record(StoppingCriteria):
    """After every forward of ``generate``: each site's selection per batch row (never stops)."""

    def __init__(self, backend, batch: int):
        self.backend, self.batch, self.steps = backend, batch, []

    def __call__(self, input_ids, scores, **kw):
        step = {}
        for site, s in sorted(self.backend.runtime.sites.items()):
            step[site] = row_selections(s, input_ids.shape[0])
        self.steps.append(step)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b))


def _generate(model, fwd, ids, backend, new=NEW, **kw):
    rec = Record(backend, ids.shape[0])
    f0 = model.forward
    model.forward = fwd
    try:
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, stopping_criteria=StoppingCriteriaList([rec]), **kw)
    finally:
        model.forward = f0
    return out, rec.steps


def test_rows_select_and_answer_what_each_prompt_alone_does(padded_compiled):
    """A batch of 3 prompts of 31, 19 and 26 tokens (compressing budgets: every row selects) equals each
    prompt alone, for every policy of SPLIT: the same positions selected (or slots merged) at every site
    and step, the same tokens, logits within rounding; the report has each row's own bytes, equal to the
    alone run's. One compile per graph key: the policies of a key are swapped in with ``set_policy``."""
    model = padded_compiled.model
    rows = [prompt(n, seed=40 + n)[0] for n in (31, 19, 26)]
    ids, mask = left_padded(rows)
    checked = []
    for group in by_graph_key({name: SMALL[name] for name in SPLIT}):
        for name in group:
            policy = SMALL[name]
            be, fwd = padded_compiled.forward(policy)
            out, steps = _generate(model, fwd, ids, be, attention_mask=mask)
            batch_rows = be.report_rows()
            in_place = {site: s.split is None for site, s in be.runtime.sites.items()}  # else row by row
            if name in ("Quest", "ClusterKV", "TailorKV"):
                # every row clusters (ClusterKV), or has more candidates than the top-k (TailorKV's sparse
                # layers on the CPU path, which a tiny fp32 model takes)
                assert all(in_place.values()), f"{name} serves a batch whose rows all fit in place"
            assert all(len(r["rows"]) == 3 for r in batch_rows), f"{name}: every site reports each batch row"
            assert all(r["device_bytes_per_row"] == max(x["device_bytes"] for x in r["rows"])
                       for r in batch_rows)
            compressing = 0
            for i, r in enumerate(rows):
                be.set_policy(policy)  # fresh site states, as the batch's rows had (buffer capacities too)
                alone, alone_steps = _generate(model, fwd, r[None], be)
                assert torch.equal(out.sequences[i, -NEW:], alone.sequences[0, -NEW:]), f"{name} row {i}"
                for x, y in zip(out.logits, alone.logits):
                    torch.testing.assert_close(x[i], y[0], atol=1e-4, rtol=1e-4)
                for step, (sb, sa) in enumerate(zip(steps, alone_steps)):
                    for site in sb:
                        assert _same_selection(sb[site][i], sa[site][0]), (
                            f"{name} row {i}, step {step}, site {site}: selection differs")
                        compressing += sa[site][0][0] != "all"
                for rb, ra in zip(batch_rows, be.report_rows()):
                    assert rb["rows"][i]["tokens"] == ra["tokens_logical"] == len(r) + NEW - 1
                    assert rb["rows"][i]["tokens_attended"] == ra["tokens_attended"], f"{name} row {i}"
                    if in_place[rb["site"]]:
                        # one buffer for the batch at the padded length: each row's share, padding included
                        assert rb["rows"][i]["tokens_held"] == rb["tokens_held"] >= ra["tokens_held"]
                        assert rb["rows"][i]["device_bytes"] == rb["device_bytes"] // 3
                        continue
                    for key in ("device_bytes", "host_bytes", "tokens_held"):
                        assert rb["rows"][i][key] == ra[key], f"{name} row {i}: {key} differ from alone"
            assert compressing, f"{name}: no step compressed (the budgets must select)"
            checked.append(name)
    assert sorted(checked) == sorted(SPLIT)


@pytest.mark.parametrize("offload,lengths,in_place", [
    (False, (30, 13), True),  # every row clusters at its prefill: in place
    (False, (30, 5), False),  # row 1 has 3 tokens past its sinks, fewer than tokens_per_cluster
    (True, (30, 13), False),  # the host tier and its fetches stay per row
])
def test_clusterkv_serves_in_place_where_every_row_clusters_else_row_by_row(padded_compiled, offload, lengths,
                                                                            in_place):
    """ClusterKV serves a padded batch in place when each row clusters at its prefill (its clustered range
    then ends where the others' does); a row too short to cluster yet, or offloading, sends the batch row by
    row. Either way each row selects the positions and gives the tokens of the prompt alone."""
    model = padded_compiled.model
    policy = ClusterKV(budget=12, sinks=2, tokens_per_cluster=4, decode_window=4, decode_clusters=2,
                       dense_layers=(), offload=offload)
    rows = [prompt(n, seed=120 + n)[0] for n in lengths]
    ids, mask = left_padded(rows)
    be, fwd = padded_compiled.forward(policy)
    out, steps = _generate(model, fwd, ids, be, new=8, attention_mask=mask)
    assert all((s.split is None) == in_place for s in be.runtime.sites.values())
    for i, r in enumerate(rows):
        be.set_policy(policy)
        alone, alone_steps = _generate(model, fwd, r[None], be, new=8)
        assert torch.equal(out.sequences[i, -8:], alone.sequences[0, -8:]), i
        for step, (sb, sa) in enumerate(zip(steps, alone_steps)):
            for site in sb:
                assert _same_selection(sb[site][i], sa[site][0]), f"row {i}, step {step}, site {site}"


def _tailor(**kw):
    return TailorKV(**{**dict(sparse_budget=16, static_tokens=6, sinks=2, critical_channels=4, group_size=8,
                              residual=8), **kw})


@pytest.mark.parametrize("how,lengths,in_place", [
    ("sparse", (30, 24), {0: True, 1: True}),  # every row has more candidates (24 - 6) than the top-k 10
    ("sparse", (30, 15), {0: False, 1: False}),  # row 1 has 9 candidates: its list would be shorter
    ("two tiers", (30, 24), {0: False, 1: True}),  # layer 0 quantised: its token groups stay per row
    ("auto", (30, 24), {0: False, 1: False}),  # tiers from each prompt's own queries
])
def test_tailorkv_serves_sparse_layers_in_place_else_row_by_row(padded_compiled, how, lengths, in_place):
    """TailorKV's sparse layers on the CPU path serve a padded batch in place when every row has more
    candidates than the top-k (each row's sinks, candidates and recent tokens at fixed offsets from its
    first real token, max |K| over its own keys); quantised layers, ``profile="auto"`` and a short row go
    row by row. Either way each row selects the positions and gives the tokens and logits of the prompt
    alone, and a batch served in place moves each row's own bytes between tiers."""
    from kvpass.tailorkv import Profile, config_key

    model = padded_compiled.model
    profile = {"sparse": None, "auto": "auto",
               "two tiers": Profile(config_key(model.config), "llama", ((0, 0.9), (1, 0.0)))}[how]
    policy = _tailor(profile=profile, tau=0.2 if how != "auto" else -0.0)
    rows = [prompt(n, seed=150 + n)[0] for n in lengths]
    ids, mask = left_padded(rows)
    be, fwd = padded_compiled.forward(policy)
    out, steps = _generate(model, fwd, ids, be, new=8, attention_mask=mask)
    sites = be.runtime.sites
    assert {s.info.layer: s.split is None for s in sites.values()} == in_place
    moved = {site: r["bytes_moved"] for site, r in zip(sorted(sites), be.report_rows())}
    alone_moved = dict.fromkeys(moved, 0)
    for i, r in enumerate(rows):
        be.set_policy(policy)
        alone, alone_steps = _generate(model, fwd, r[None], be, new=8)
        assert torch.equal(out.sequences[i, -8:], alone.sequences[0, -8:]), i
        for x, y in zip(out.logits, alone.logits):
            torch.testing.assert_close(x[i], y[0], atol=1e-4, rtol=1e-4)
        for step, (sb, sa) in enumerate(zip(steps, alone_steps)):
            for site in sb:
                assert _same_selection(sb[site][i], sa[site][0]), f"row {i}, step {step}, site {site}"
        for site, r in zip(sorted(sites), be.report_rows()):
            alone_moved[site] += r["bytes_moved"]
    assert moved == alone_moved, "the batch moves what its rows alone move"


def test_beam_search_on_a_padded_batch_follows_each_rows_beams(padded_compiled):
    """Beam search over a padded batch (the rows' states are reordered and copied per beam, or the batched
    metadata follows the reorder in place) gives each prompt's beams alone, for selecting policies served
    in place (TailorKV's sparse layers too) and a merging policy served row by row."""
    model = padded_compiled.model
    rows = [prompt(n, seed=60 + n)[0] for n in (28, 17)]
    ids, mask = left_padded(rows)
    for name in ("Quest", "ClusterKV", "CentroidKV", "TailorKV"):
        be, fwd = padded_compiled.forward(SMALL[name])
        out, _ = _generate(model, fwd, ids, be, attention_mask=mask, num_beams=2)
        for i, r in enumerate(rows):
            alone, _ = _generate(model, fwd, r[None], be, num_beams=2)
            assert torch.equal(out.sequences[i, -NEW:], alone.sequences[0, -NEW:]), (name, i)


def test_a_row_that_finishes_early_leaves_the_others_as_alone(padded_compiled):
    """Row 0 meets its EOS at the second new token; generate() then feeds it padding while row 1 goes on,
    which must still equal row 1 alone."""
    model = padded_compiled.model
    rows = [prompt(n, seed=80 + n)[0] for n in (24, 15)]
    be, fwd = padded_compiled.forward(SMALL["Quest"])
    first, _ = _generate(model, fwd, rows[0][None], be)
    eos = int(first.sequences[0, -NEW + 1])  # row 0's second new token
    second, _ = _generate(model, fwd, rows[1][None], be)
    assert eos not in second.sequences[0, -NEW:].tolist(), "pick prompts where only row 0 meets the EOS"
    ids, mask = left_padded(rows)
    f0 = model.forward
    model.forward = fwd
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    finally:
        model.forward = f0
    assert out[0, -NEW + 1] == eos and (out[0, -NEW + 2 :] == 0).all(), "row 0 stopped and was padded"
    assert torch.equal(out[1, -NEW:], second.sequences[0, -NEW:])


def test_a_padded_quest_batch_that_outgrows_its_budget_selects_as_each_row_alone(padded_compiled):
    """Prompts of 15 and 10 tokens under Quest(budget=16, page_size=4), 10 new tokens: the first steps cover
    the batch (its keys are left out of the page bounds, ``QuestState.lag``), then the longer row outgrows
    the budget and every key is folded in, row by row at its own pages, at that step; the shorter row
    selects from its pages later. Each row selects and answers what it does alone."""
    model = padded_compiled.model
    policy = SMALL["Quest"]
    assert policy.budget == 16
    rows = [prompt(n, seed=60 + n)[0] for n in (15, 10)]
    ids, mask = left_padded(rows)
    be, fwd = padded_compiled.forward(policy)
    out, steps = _generate(model, fwd, ids, be, new=10, attention_mask=mask)
    covered = [all(sel[0][0] == "all" for sel in step.values()) for step in steps]
    assert covered[0] and not covered[-1], covered  # covering steps, then selecting ones
    assert all(step[site][1][0] == "idx" for step in steps[-2:] for site in step)  # the shorter row selects too
    assert all(st.events == 1 for st in be.runtime.sites.values()), "the fold is not one event a site"
    for i, r in enumerate(rows):
        be.set_policy(policy)
        alone, alone_steps = _generate(model, fwd, r[None], be, new=10)
        assert torch.equal(out.sequences[i, -10:], alone.sequences[0, -10:]), f"row {i}"
        for step, (sb, sa) in enumerate(zip(steps, alone_steps)):
            for site in sb:
                assert _same_selection(sb[site][i], sa[site][0]), f"row {i}, step {step}, site {site}"


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(9, 40), min_size=2, max_size=3),
    name=st.sampled_from(["Quest", "ClusterKV", "TailorKV"]),
)
def test_any_padding_gives_each_row_alone(padded_compiled, lengths, name):
    """Batches of 2-3 prompts of any lengths (so any padding, none included): tokens equal each row alone."""
    model = padded_compiled.model
    be, fwd = padded_compiled.forward(SMALL[name])  # one compile: ClusterKV shares Quest's graphs
    rows = [prompt(n, seed=n * 7 + i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_padded(rows)
    out, _ = _generate(model, fwd, ids, be, new=4, attention_mask=mask)
    for i, r in enumerate(rows):
        alone, _ = _generate(model, fwd, r[None], be, new=4)
        assert torch.equal(out.sequences[i, -4:], alone.sequences[0, -4:]), (lengths, i)


def test_right_padding_and_holes_are_refused_with_the_fix(padded_compiled):
    model = padded_compiled.model
    ids = prompt(20, batch=2, seed=5)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # right padding
    f0 = model.forward
    model.forward = padded_compiled.forward(Quest(budget=8, page_size=4))[1]
    try:
        with torch.no_grad(), pytest.raises(KVPassError, match="padding_side='left'"):
            model(input_ids=ids, attention_mask=mask)
    finally:
        model.forward = f0


def test_padded_batch_on_a_model_kept_cache_equals_rows_alone(padded_compiled):
    """``own_cache=False`` (the model's DynamicCache holds real, left-padded keys): the rows' states read
    their own positions from it."""
    model = padded_compiled.model
    rows = [prompt(n, seed=90 + n)[0] for n in (27, 18)]
    ids, mask = left_padded(rows)
    policies = (ClusterKV(budget=16, sinks=2, tokens_per_cluster=4, decode_window=8, decode_clusters=2,
                          dense_layers=()), Quest(budget=16, page_size=4))
    for policy in policies:  # one compile: Quest shares ClusterKV's graphs
        be, fwd = padded_compiled.forward(policy, own_cache=False)
        out, _ = _generate(model, fwd, ids, be, attention_mask=mask)
        for i, r in enumerate(rows):
            alone, _ = _generate(model, fwd, r[None], be)
            assert torch.equal(out.sequences[i, -NEW:], alone.sequences[0, -NEW:]), (policy.name, i)


def test_beam_search_on_a_model_kept_cache_is_refused_with_the_fix(padded_compiled):
    """``own_cache=False``: generate() reorders the model's cache without the runtime seeing it, and
    Quest's page bounds would then score other beams' keys; the runtime notices on the device (the last
    step's newest key moved) and raises, naming the fix."""
    model = padded_compiled.model
    f0 = model.forward
    model.forward = padded_compiled.forward(Quest(budget=16, page_size=4), own_cache=False)[1]
    try:
        with pytest.raises(KVPassError, match="own_cache=True"):
            model.generate(prompt(40, seed=3), max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    finally:
        model.forward = f0


@pytest.mark.slow  # SmolLM2 at batch 3 compiles its own prefill and decode graphs (minutes)
def test_padded_batch_of_real_prompts_on_smollm2(smollm2):
    """Three real chat prompts of different lengths in one padded batch through generate(), every
    compressing policy: each row's tokens equal the row alone (99 % agreement at least; printed). One
    compile serves the policies that share a graph key (set_policy), TailorKV compiles its own."""
    tok, model = smollm2.tokenizer, smollm2.model
    texts = ["Write one sentence about the sea.",
             "List three colours of the rainbow, then say which one you like best and why. " * 3,
             "Explain in two sentences why the sky looks blue during the day. " * 6]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    enc = tok(chats, return_tensors="pt", padding=True, padding_side="left")
    assert len(set(enc["attention_mask"].sum(1).tolist())) == 3, "three different lengths"
    policies = [Quest(budget=64, page_size=16), ClusterKV(budget=64, sinks=4, tokens_per_cluster=8),
                CentroidKV(cache_ratio=0.5), TailorKV(sparse_budget=64, static_tokens=32, sinks=4, profile=None)]
    new, agree, total, backends = 12, 0, 0, {}
    with torch._dynamo.config.patch(recompile_limit=64):
        for p in policies:
            if p.graph_key() not in backends:
                be = kvpass(p, strict=True)
                backends[p.graph_key()] = be, torch.compile(model.forward, backend=be)
            be, fwd = backends[p.graph_key()]
            f0 = model.forward
            model.forward = fwd
            try:
                be.set_policy(p)
                out = model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False)
                assert all(len(r["rows"]) == 3 for r in be.report_rows()), "served row by row"
                for i, text in enumerate(chats):
                    be.set_policy(p)
                    alone = model.generate(**tok(text, return_tensors="pt"), max_new_tokens=new,
                                           min_new_tokens=new, do_sample=False)
                    agree += int((out[i, -new:] == alone[0, -new:]).sum())
                    total += new
            finally:
                model.forward = f0
    print(f"SmolLM2 padded batch: {agree}/{total} tokens equal the rows alone")
    assert agree >= 0.99 * total, f"{agree}/{total} tokens agree"

def _drive(policy, prefill_k, prefill_v, prefill_q, steps, reorder_at=None, rows=None):
    """One owned site driven by hand: a prefill, then decode steps ``[(q, k, v)]``; at step ``reorder_at``
    the model's stub comes back reordered by ``rows`` (what beam search's ``index_select`` does). Returns
    the outputs and selections of every step."""
    from kvpass.runtime import Runtime

    rt = Runtime(policy)
    rt.attend_owned(0, prefill_q, prefill_k, prefill_v, None, None, None, 0.0, True)
    length, outs = prefill_k.shape[2], []
    for i, (q, k, v) in enumerate(steps):
        stub = rt.stub(0, k, length, None)
        if i == reorder_at:
            stub = stub.index_select(0, rows)
        out = rt.attend_owned(0, q, k, v, stub, stub, None, 0.0, False)
        st = rt.state(0)
        outs.append((out, None if st.last_idx is None else st.last_idx.clone()))
        length += 1
    return outs


@pytest.mark.parametrize("name", ["Quest", "ClusterKV", "CentroidKV"])
def test_a_reordered_batch_continues_as_each_rows_own_history(name):
    """Beam search reorders the rows between steps: the site (its keys and every per-row metadata) then
    answers as the same site without the reorder whose rows were fed the reordered rows' inputs: row j
    after the reorder is old row ``rows[j]`` continued."""
    torch.manual_seed(0)
    policy = SMALL[name]
    b, hkv, g, d, n = 2, 2, 2, 16, 40
    k, v, q = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv * g, n, d)
    steps = [(torch.randn(b, hkv * g, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d))
             for _ in range(12)]
    at, rows = 5, torch.tensor([1, 0])  # a permutation that is its own inverse
    got = _drive(policy, k, v, q, steps, reorder_at=at, rows=rows)
    ref_steps = [s if i < at else tuple(x[rows] for x in s) for i, s in enumerate(steps)]
    ref = _drive(policy, k, v, q, ref_steps)
    for i in range(at, len(steps)):
        torch.testing.assert_close(got[i][0], ref[i][0][rows], atol=1e-6, rtol=1e-6)
        if got[i][1] is not None or ref[i][1] is not None:
            assert torch.equal(got[i][1], ref[i][1][rows]), f"{name}, step {i}: selection differs"

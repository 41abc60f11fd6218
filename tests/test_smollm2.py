"""The real bundled model through the README's path (``torch.compile(model.forward, backend=kvpass(...))``,
``model.generate``), on one compile per test process (conftest's ``smollm2_compiled``: a ~256-token prose
prompt, 10 new tokens). One test, so that xdist gives the whole of it to one worker: two tests could land
on two workers and compile SmolLM2 twice. The steady-decode sweep of five policies on SmolLM2 is in
tests/test_decode_syncs.py and ``kvpass demo --quick`` in tests/test_cli.py (both ``slow``: each compiles
SmolLM2 on its own)."""

import torch

from kvpass import Full, Quest


def test_full_equals_eager_and_quest_runs_on_fulls_graphs_on_smollm2(smollm2_compiled):
    """Full gives eager's tokens at every one of the 30 sites. Then a compressing policy swapped in with
    ``set_policy`` compiles nothing, attends at most its budget plus the newest page at every site,
    decodes from an exact prefill (the first new token is eager's), and with a budget that covers the
    context gives eager's tokens."""
    sm = smollm2_compiled
    ref = sm.eager()
    out, rows = sm.generate(Full())
    assert torch.equal(out, ref), (sm.tokenizer.decode(out[0, -10:]), sm.tokenizer.decode(ref[0, -10:]))
    assert [r["layer"] for r in rows] == list(range(30))
    assert all(r["prefill_calls"] == 1 and r["decode_calls"] == sm.new_tokens - 1 for r in rows)
    assert all(r["tokens_attended"] == r["tokens_logical"] for r in rows)

    n = sm.inputs["input_ids"].shape[1]
    assert n > 200  # the budget below is well under the context
    graphs = len(sm.backend.graphs)
    out, rows = sm.generate(Quest(budget=64, page_size=16))
    assert len(sm.backend.graphs) == graphs, "Quest compiled graphs of its own"
    assert [r["layer"] for r in rows] == list(range(30))
    for r in rows:
        assert r["policy"] == "Quest" and r["prefill_calls"] == 1 and r["decode_calls"] == sm.new_tokens - 1
        assert r["tokens_logical"] == n + sm.new_tokens - 1, r
        assert 0 < r["tokens_attended"] <= 64 + 16 < r["tokens_logical"], r
    assert torch.equal(out[:, : n + 1], ref[:, : n + 1])  # the prompt and the token of the exact prefill

    covering, _ = sm.generate(Quest(budget=512, page_size=16))
    assert len(sm.backend.graphs) == graphs
    assert torch.equal(covering, ref)

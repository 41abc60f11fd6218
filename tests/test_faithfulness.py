"""The faithfulness oracle (kvpass.bench.faithfulness): every decode step of every site attends exactly
what its policy says, for every policy; and the oracle fails on a step that leaves out the newest token
or reads one row short (mutations injected here)."""

import pytest
import torch

from kvpass import CentroidKV, ClusterKV, Full, Quest, StreamingLLM, TailorKV
from kvpass.bench.faithfulness import ATOL, Oracle, check_continuation, prefill
from tiny import prompt

LAYERS, PROMPT, STEPS = 2, 316, 8  # 316 = 9 x 32 + 28: TailorKV's residual of 32 flushes at the 4th step

# budgets far below the prompt: every policy compresses (ClusterKV's dense layers would be all of the
# tiny model's)
POLICIES = {
    "Full": (Full(), {"all"}),
    "StreamingLLM": (StreamingLLM(sinks=4, window=60), {"positions"}),
    "Quest": (Quest(budget=64, page_size=8), {"positions"}),
    "ClusterKV": (ClusterKV(budget=64, sinks=4, tokens_per_cluster=16, decode_window=32, dense_layers=()),
                  {"positions"}),
    "CentroidKV": (CentroidKV(cache_ratio=0.25), {"merged"}),
    "TailorKV-sparse": (TailorKV(sparse_budget=64, static_tokens=24, sinks=4), {"positions"}),
    # tau=0: every layer is quantisation-friendly; a small residual so that steps flush it
    "TailorKV-quantised": (TailorKV(sparse_budget=64, static_tokens=24, sinks=4, profile="auto", tau=0.0,
                                    residual=32, group_size=16), {"dequantised"}),
}


def _check(compiled_tiny, policy, seed=2):
    be, fwd = compiled_tiny(layers=LAYERS).forward(policy)
    return check_continuation(compiled_tiny(layers=LAYERS).model, policy, prompt(PROMPT, seed=seed), STEPS,
                              backend=be, fwd=fwd)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_step_attends_what_the_policy_says(compiled_tiny, one_thread, name):
    policy, what = POLICIES[name]
    oracle = _check(compiled_tiny, policy)
    s = oracle.summary()
    assert s["checks"] == LAYERS * STEPS, s
    assert oracle.failures == [], oracle.failures[:4]
    assert set(s["what"]) == what, s
    assert s["max_err"] < 1e-6, s
    if name not in ("Full", "TailorKV-quantised"):
        assert s["attended"] < PROMPT / 2, s  # it compresses: a faithful step of a method that drops tokens


def test_oracle_catches_a_step_without_the_newest_token(compiled_tiny, one_thread, monkeypatch):
    """Quest's selection loses the newest position: the step still matches attention over its (wrong)
    selection, so only the newest-token check can see it."""
    from kvpass.runtime.selection import QuestState

    select = QuestState.select

    def drop_newest(self, call):
        idx = select(self, call)
        self.select_out = None  # attend over the changed list, not the C call's own result
        return torch.where(idx == call.length - 1, -1, idx)

    monkeypatch.setattr(QuestState, "select", drop_newest)
    oracle = _check(compiled_tiny, POLICIES["Quest"][0])
    assert len(oracle.failures) == LAYERS * STEPS
    assert all(not c.newest and c.max_err < 1e-6 for c in oracle.failures)


def test_oracle_catches_a_step_that_reads_one_row_short(compiled_tiny, one_thread, monkeypatch):
    """Full's exact step reads the cache one row short (the newest token's): the output differs from
    attention over every position."""
    from kvpass.runtime.call import make_call
    from kvpass.runtime.state import SiteState

    def short(self, call):
        n = call.length - 1
        return make_call(call.q, call.k[:, :, :n], call.v[:, :, :n], None, call.scale, False, n).exact()

    monkeypatch.setattr(SiteState, "attend_all", short)
    oracle = _check(compiled_tiny, Full())
    assert len(oracle.failures) == LAYERS * STEPS
    assert min(c.max_err for c in oracle.failures) > 10 * ATOL[torch.float32]  # far outside the tolerance


def test_oracle_catches_centroidkv_reading_one_slot_short(compiled_tiny, one_thread, monkeypatch):
    """CentroidKV attends one merged slot fewer than it holds (the newest token's slot)."""
    from kvpass.runtime.centroidkv import CentroidState

    attend = CentroidState._attend_decode

    def short(self, q, scale):
        self.s -= 1
        try:
            return attend(self, q, scale)
        finally:
            self.s += 1

    monkeypatch.setattr(CentroidState, "_attend_decode", short)
    oracle = _check(compiled_tiny, POLICIES["CentroidKV"][0])
    assert len(oracle.failures) == LAYERS * STEPS
    assert min(c.max_err for c in oracle.failures) > 10 * ATOL[torch.float32]  # far outside the tolerance


def test_oracle_catches_a_lost_store_row(compiled_tiny, one_thread, monkeypatch):
    """The runtime's own copy of the cache loses the newest row (its key and value written as zeros): the
    policy's selection is right, what it reads is not; the oracle's copy of the cache tells them apart."""
    from kvpass.runtime.store import OwnedKV

    append = OwnedKV.append

    def lossy(self, past_k, past_v, k_new, v_new, stubs):
        out = append(self, past_k, past_v, k_new, v_new, stubs)
        if k_new.shape[2] == 1 and self.k is not None:
            self.k[:, :, self.length - 1] = 0
            self.v[:, :, self.length - 1] = 0
        return out

    monkeypatch.setattr(OwnedKV, "append", lossy)
    oracle = _check(compiled_tiny, Full())
    assert len(oracle.failures) == LAYERS * STEPS, [c.max_err for c in oracle.checks]


def test_oracle_refuses_to_watch_twice(compiled_tiny):
    be, _ = compiled_tiny(layers=LAYERS).forward(Full())
    with Oracle(be):
        with pytest.raises(RuntimeError, match="already watches"):
            Oracle(be).__enter__()
    assert "attend_owned" not in vars(be.runtime)  # the backend is left as it was


@pytest.mark.slow
def test_smollm2_8k_every_policy_is_faithful(smollm2):
    """The issue's setting: SmolLM2 at 8k, 32 decode steps, each policy at 1024 kept tokens."""
    from kvpass.bench.common import calibrate_policies
    from kvpass.bench.fidelity import prose_prompts

    ids = prose_prompts(smollm2.tokenizer, 8192, 1)[0]
    shared = prefill(smollm2.model, ids)
    policies = [Full(), StreamingLLM.with_budget(1024), Quest(budget=1024), ClusterKV(budget=1024),
                CentroidKV(cache_ratio=0.125), TailorKV.with_budget(1024, profile="auto")]
    for p in policies:
        torch._dynamo.reset()
        oracle = check_continuation(smollm2.model, p, ids, 32, prefilled=shared)
        assert oracle.summary()["checks"] == 30 * 32
        assert oracle.failures == [], (p, oracle.failures[:4])

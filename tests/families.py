"""Helpers for the coverage tests (tests/test_families.py, tests/test_robustness.py): small-budget
policies, left-padded batches, a hand-written decode loop, and the coverage rows of
:mod:`kvpass.coverage` computed once per test session."""

from __future__ import annotations

import torch

from kvpass import CentroidKV, ClusterKV, Full, Quest, StreamingLLM, TailorKV

# One small-budget instance of every registered policy, for prompts of 20-40 tokens: each budget is
# below the context, so the policies really select or merge. A new policy gets its entry here (the
# tests fail while a registered policy is missing, naming it).
SMALL = {
    "Full": Full(),
    "StreamingLLM": StreamingLLM(sinks=2, window=8),
    "Quest": Quest(budget=16, page_size=4),
    "ClusterKV": ClusterKV(budget=16, sinks=2, tokens_per_cluster=4, decode_window=8, decode_clusters=2,
                           dense_layers=()),
    "CentroidKV": CentroidKV.with_budget(24, sinks=2, recent=4, step=4, chunk=8, outlier_heads=0.0),
    "TailorKV": TailorKV(sparse_budget=16, static_tokens=6, sinks=2, critical_channels=4, group_size=8,
                         residual=8),
}


# The policies that keep per-row metadata: a left-padded batch is served row by row
# (kvpass/runtime/rows.py), or in place with each row's own pages or clusters (Quest, ClusterKV);
# tests/test_padded.py compares their rows' selections with each prompt alone. Full and StreamingLLM only
# mask the padding.
SPLIT = ["Quest", "ClusterKV", "CentroidKV", "TailorKV"]


def missing_from_small() -> list[str]:
    from kvpass.policies.base import registered_policies

    return sorted(set(registered_policies()) - set(SMALL))


def by_graph_key(policies: dict) -> list[list[str]]:
    """Policy names grouped by ``graph_key()``: one backend (one compilation) serves a group through
    ``set_policy``; a policy that rewrites the graph differently gets its own."""
    groups: dict[str, list[str]] = {}
    for name, p in policies.items():
        groups.setdefault(p.graph_key(), []).append(name)
    return list(groups.values())


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` of shape ``(len(rows), max_len)``, each row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def make_cache(model, kind: str, max_len: int):
    from transformers import DynamicCache, StaticCache

    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return DynamicCache(config=model.config)


@torch.no_grad()
def decode_loop(forward, model, ids: torch.Tensor, steps: int, cache: str = "dynamic", on_step=None):
    """Greedy decoding by hand: ``forward(input_ids, past_key_values=cache, use_cache=True)`` on the
    prompt, then one token at a time. Returns ``(tokens (B, steps), [logits (B, V)] per step)``.
    ``on_step(i)`` runs before decode step ``i`` (1-based)."""
    past = make_cache(model, cache, ids.shape[1] + steps + 1)
    out = forward(input_ids=ids, past_key_values=past, use_cache=True)
    logits = [out.logits[:, -1]]
    tokens = [logits[-1].argmax(-1)]
    for i in range(1, steps):
        if on_step is not None:
            on_step(i)
        out = forward(input_ids=tokens[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[:, -1])
        tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, 1), logits


_ROWS: dict = {}


def coverage_row(name: str):
    """The :class:`kvpass.coverage.CoverageRow` of a family, computed once per session (the family
    tests and the docs/models.md check share it)."""
    from kvpass import coverage

    if name not in _ROWS:
        _ROWS[name] = coverage.check_family(name)
    return _ROWS[name]

"""Attention recall: how much of the true attention a selection keeps (ClusterKV, arXiv 2412.03213,
Fig. 11 measures the same quantity).

At sampled decode steps the probe computes the exact softmax attention of every query head over the
whole cache and reports, per layer and query head,

- ``mass``: the share of the attention weight that falls on the tokens the policy attended;
- ``topk``: the share of the true top-N tokens (N = the number the head attended) that it attended.

Both are 1.0 for a step that attends everything.
"""

from __future__ import annotations

import collections
import math

import torch


def recall_of_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    idx: torch.Tensor | None,
    scale: float,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(B, H_q, D)``, k ``(B, H_kv, L, D)``, idx ``(B, H_kv, N)`` (-1 = none) or None for all,
    valid ``(B, L)`` bool or None. Returns (mass, topk), each ``(B, H_q)`` fp32."""
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    scores = torch.einsum("bhgd,bhld->bhgl", q.reshape(b, hkv, g, d).float(), k.float()) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    w = torch.softmax(scores, dim=-1)  # (B, H_kv, G, L)
    if idx is None:
        ones = torch.ones(b, hq)
        return ones, ones.clone()
    chosen = torch.zeros(b, hkv, length + 1, dtype=torch.bool)
    chosen.scatter_(2, torch.where(idx >= 0, idx, length).long(), True)
    chosen = chosen[..., :length]  # (B, H_kv, L)
    mass = (w * chosen[:, :, None, :]).sum(-1)
    n = chosen.sum(-1)  # (B, H_kv) tokens attended per KV head
    topk = torch.empty(b, hkv, g)
    for bi in range(b):
        for h in range(hkv):
            m = int(n[bi, h])
            top = w[bi, h].topk(max(m, 1), dim=-1).indices  # (G, m)
            topk[bi, h] = chosen[bi, h][top].float().mean(-1) if m else 0.0
    return mass.reshape(b, hq), topk.reshape(b, hq)


class RecallProbe:
    """A runtime probe (``backend.runtime.set_probe(RecallProbe(every=8))``) that samples every
    ``every``-th decode step of each site and accumulates recall per layer."""

    def __init__(self, every: int = 8):
        if every < 1:
            raise ValueError(f"kvpass: RecallProbe needs every >= 1, got every={every}")
        self.every = every
        self.samples: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = collections.defaultdict(list)

    def __call__(self, state, call, idx) -> None:
        if state.decode_calls % self.every:
            return
        mass, topk = recall_of_selection(call.q[:, :, 0], call.k_logical, idx, call.scale, call.valid)
        self.samples[state.info.layer].append((mass, topk))

    def per_layer(self) -> dict[int, dict[str, float]]:
        """{layer: {"mass": mean, "topk": mean, "steps": n}} over sampled steps, heads and rows."""
        out = {}
        for layer, rows in sorted(self.samples.items()):
            out[layer] = {
                "mass": float(torch.stack([m for m, _ in rows]).mean()),
                "topk": float(torch.stack([t for _, t in rows]).mean()),
                "steps": len(rows),
            }
        return out

    def summary(self) -> dict[str, float]:
        layers = self.per_layer()
        if not layers:
            return {"mass": float("nan"), "topk": float("nan"), "layers": 0}
        return {
            "mass": sum(v["mass"] for v in layers.values()) / len(layers),
            "topk": sum(v["topk"] for v in layers.values()) / len(layers),
            "layers": len(layers),
        }

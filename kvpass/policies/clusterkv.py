"""ClusterKV (Liu et al., "ClusterKV: Manipulating LLM KV Cache in Semantic Space for Recallable
Compression", DAC 2025, arXiv 2412.03213): recall whole semantic clusters of keys up to a token budget."""

from __future__ import annotations

import dataclasses

from kvpass.policies.base import Policy, bool_problem, check_int, register_policy
from kvpass.runtime.clusterkv import ClusterState


@register_policy
@dataclasses.dataclass(frozen=True)
class ClusterKV(Policy):
    """After prefill, the keys of each KV head (past the first ``sinks`` tokens) are clustered by
    k-means under cosine distance into ``(L - sinks) // tokens_per_cluster`` clusters. At each decode
    step clusters are ranked by ``q · μ`` (μ the mean of the cluster's keys) and taken whole, the last
    one trimmed, until ``budget`` tokens, together with the sinks and every token generated since the
    last clustering. Every ``decode_window`` generated tokens are clustered on their own into
    ``decode_clusters`` new clusters. Layers in ``dense_layers`` attend to everything (the paper keeps
    layers 0 and 1 dense).

    GQA: one selection per KV head; its query group's scores are combined by ``gqa``: ``"sum"`` (the
    group's summed query against μ: the clusters with the most attention mass over the group) or
    ``"max"`` (the best score of any query of the group).

    ``kmeans_iters`` caps the k-means iterations (they also stop when no label changes); ``seed``
    fixes the random initial centroids.

    ``offload=True``: the whole KV lives in the host tier; the device tier holds the centroids and
    metadata, the sinks, the recent tokens and the KV of the clusters recalled in the last
    ``cache_steps`` steps. The pass inserts a ``kvpass::fetch`` before each attention (its ticket feeds
    the attention, so Inductor orders them), which copies only the missing tokens from the host tier.
    Needs the runtime-owned cache (DynamicCache)."""

    budget: int = 1024
    sinks: int = 16
    tokens_per_cluster: int = 80
    decode_window: int = 320
    decode_clusters: int = 4
    cache_steps: int = 1
    dense_layers: tuple[int, ...] = (0, 1)
    offload: bool = False
    gqa: str = "sum"
    kmeans_iters: int = 8
    seed: int = 0
    name = "ClusterKV"

    def __post_init__(self):
        n = self.name
        check_int(n, "sinks", self.sinks, 0)
        check_int(n, "budget", self.budget, 1)
        if self.budget <= self.sinks:
            raise ValueError(f"kvpass: ClusterKV needs budget > sinks ({self.sinks}), got budget={self.budget}")
        check_int(n, "tokens_per_cluster", self.tokens_per_cluster, 1)
        check_int(n, "decode_clusters", self.decode_clusters, 1)
        check_int(n, "decode_window", self.decode_window, self.decode_clusters)
        check_int(n, "cache_steps", self.cache_steps, 1)
        check_int(n, "kmeans_iters", self.kmeans_iters, 1)
        check_int(n, "seed", self.seed, 0)
        layers = self.dense_layers
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        if not isinstance(layers, (tuple, list)):
            raise ValueError(
                f"kvpass: ClusterKV needs dense_layers as a tuple of layer indices, got {self.dense_layers!r}"
            )
        for layer in layers:
            check_int(n, "dense_layers entries", layer, 0)
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))
        if (msg := bool_problem(n, "offload", self.offload)) is not None:
            raise ValueError(msg)
        if self.gqa not in ("sum", "max"):
            raise ValueError(f"kvpass: ClusterKV needs gqa in ('sum', 'max'), got gqa={self.gqa!r}")

    @property
    def fetches(self) -> bool:
        return self.offload

    def graph_key(self) -> str:
        # offload inserts a kvpass::fetch before each owned attention site
        return "kvpass::attention+fetch" if self.offload else super().graph_key()

    @classmethod
    def with_budget(cls, budget: int, **kw) -> ClusterKV:
        return cls(budget=budget, **kw)

    def new_state(self, info):
        return ClusterState(self, info)

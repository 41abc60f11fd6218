"""CentroidKV (first published as Chelsea: Hu et al., "Efficient Long-Context LLM Inference via KV Cache
Clustering", arXiv 2506.11418): merge similar cached tokens into degree-weighted centroids, attend with
a +log(n) bias, so that the cache physically shrinks."""

from __future__ import annotations

import dataclasses

from kvpass.policies.base import Policy, check_int, register_policy
from kvpass.runtime.centroidkv import CentroidState


def _check_fraction(field: str, value, lo_open: bool, hi: float = 1.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"kvpass: CentroidKV needs a number {field}, got {field}={value!r}")
    ok = (0 < value if lo_open else 0 <= value) and value <= hi
    if not ok:
        lo = "0 <" if lo_open else "0 <="
        raise ValueError(f"kvpass: CentroidKV needs {lo} {field} <= {hi}, got {field}={value}")


@register_policy
@dataclasses.dataclass(frozen=True)
class CentroidKV(Policy):
    """Algorithm 1 of the paper, per attention site and KV head:

    - **Budget**: ``B = cache_ratio * (n + expected_new_tokens)`` slots for a prompt of ``n`` tokens, or
      ``budget`` slots when given (then ``cache_ratio`` must be None).
    - **Triggers**: prefill attends to the whole prompt exactly; at the first decode step, and again
      whenever the physical length ``s >= T + step``, merge rounds run until ``s <= T``, with
      ``T = B - step`` so that the slots held never exceed B (the paper lets s reach B + step; the
      fp32 degree of each slot is counted in B's bytes too).
    - **A round** (chunked soft matching, :func:`kvpass.kernels.centroid.merge_round`): the first
      ``sinks`` and last ``recent`` slots stay; the rest is cut into chunks of ``chunk`` slots,
      alternating positions form sets A and B, each A slot finds its most cosine-similar B slot of its
      chunk, and the ``r`` most similar fraction of pairs merge into degree-weighted centroids (a round
      removes at most half of the candidates).
    - **Progressive schedule**: round ``j`` of a sequence uses ``r = max(merge_ratio - j *
      merge_ratio_decay, min_merge_ratio)`` (at least one pair while over budget).
    - **Attention**: ``softmax(q·Kᵀ/√d + log N)·V`` over the merged slots, N their degrees.
    - **Outlier heads**: after prefill every KV head's redundancy is measured as the mean cosine
      similarity of its best A→B matches; the ``outlier_heads`` share of all KV heads of the model with
      the lowest redundancy stays uncompressed, and the other heads' budget shrinks so that the total
      held stays within ``cache_ratio`` (see docs/methods.md).

    ``merge_ratio=0`` never merges (Full's tokens). Needs the runtime to own the cache (DynamicCache,
    the default ``own_cache=True``): a StaticCache or a cache kept by the model would hold every token
    anyway, so that is refused."""

    cache_ratio: float | None = 0.25
    budget: int | None = None
    expected_new_tokens: int = 0
    sinks: int = 16
    recent: int = 64
    chunk: int = 256
    step: int = 64
    merge_ratio: float = 0.5
    merge_ratio_decay: float = 0.05
    min_merge_ratio: float = 0.1
    outlier_heads: float = 0.04
    name = "CentroidKV"

    def __post_init__(self):
        n = self.name
        if (self.cache_ratio is None) == (self.budget is None):
            raise ValueError(
                f"kvpass: CentroidKV needs exactly one of cache_ratio and budget, got "
                f"cache_ratio={self.cache_ratio!r}, budget={self.budget!r} (use budget=..., cache_ratio=None "
                f"for a fixed number of slots)"
            )
        if self.cache_ratio is not None:
            _check_fraction("cache_ratio", self.cache_ratio, lo_open=True)
        check_int(n, "expected_new_tokens", self.expected_new_tokens, 0)
        check_int(n, "sinks", self.sinks, 0)
        check_int(n, "recent", self.recent, 0)
        check_int(n, "chunk", self.chunk, 2)
        if self.chunk > 512:
            raise ValueError(f"kvpass: CentroidKV needs chunk <= 512 (one kernel block), got chunk={self.chunk}")
        check_int(n, "step", self.step, 1)
        if self.budget is not None:
            check_int(n, "budget", self.budget, 1)
            floor = self.sinks + self.recent + self.step
            if self.budget <= floor:
                raise ValueError(
                    f"kvpass: CentroidKV needs budget > sinks + recent + step ({floor}), got "
                    f"budget={self.budget}; lower sinks/recent/step or raise budget"
                )
        _check_fraction("merge_ratio", self.merge_ratio, lo_open=False)
        _check_fraction("merge_ratio_decay", self.merge_ratio_decay, lo_open=False)
        _check_fraction("min_merge_ratio", self.min_merge_ratio, lo_open=False)
        _check_fraction("outlier_heads", self.outlier_heads, lo_open=False, hi=0.5)
        # round j merges max(merge_ratio - j * decay, min_merge_ratio): a floor above the start would
        # replace merge_ratio from the first round on (merge_ratio=0 never merges, so any floor goes)
        if self.merge_ratio > 0 and self.min_merge_ratio > self.merge_ratio:
            raise ValueError(
                f"kvpass: CentroidKV needs min_merge_ratio <= merge_ratio ({self.merge_ratio}): the schedule "
                f"anneals from merge_ratio down to min_merge_ratio, got "
                f"min_merge_ratio={self.min_merge_ratio}; lower min_merge_ratio or raise merge_ratio"
            )

    @classmethod
    def with_budget(cls, budget: int, **kw) -> CentroidKV:
        return cls(budget=budget, cache_ratio=None, **kw)

    def new_state(self, info):
        return CentroidState(self, info)

"""TailorKV (Yao et al., "TailorKV: A Hybrid Framework for Long-Context Inference via Tailored KV Cache
Optimization", ACL 2025 Findings, arXiv 2505.19586): per layer, a 1/2-bit quantised cache or sparse
top-k retrieval from a host tier with the next layer's query estimated one layer early."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvpass.policies.base import Policy, check_int, register_policy


@register_policy
@dataclasses.dataclass(frozen=True)
class TailorKV(Policy):
    """Each layer is served one of two ways, by its dense-preference score ``P`` (the profile):

    - **Quantisation-friendly** (``P > tau``): keys quantised per channel, values per token, to
      ``quant_bits`` (1 or 2) in groups of ``group_size`` with fp16 scale and zero, bits packed; the
      newest tokens (fewer than ``residual``) stay in full precision and are quantised ``residual`` at
      a time. Decode attention runs on the packed cache (dequantisation fused into the kernel).
    - **Sparsity-friendly**: the layer's whole KV lives in the host tier. While layer l-1 runs, the
      graph pass has inserted ``kvpass::prefetch`` with layer l's query estimated from layer l-1's
      residual stream (layer l's own norm, q projection and RoPE, copied from the graph); it scores
      channels ``s_i = |q̂_i| · max_t |K_t,i|``, and copies the top ``critical_channels`` key channels
      from the host tier. At layer l, ``kvpass::fetch`` scores the tokens with those channels and the
      true query, and copies the ``sparse_budget - static_tokens`` best tokens' K and V; they are
      attended with the ``static_tokens`` kept on the device (the first ``sinks`` and the most recent).
      ``early_estimate``: None (the default) estimates where the attention runs on an accelerator,
      whose host tier is another memory; on CPU the attention op itself picks the channels from the
      true query and reads the host tier in place (no prefetch or fetch op, no second q projection).
      True estimates on CPU too (the paper's selection, for comparing it); False never.

    ``P`` per layer (the mean over heads and the last ``calib_queries`` prompt queries of the attention
    mass *outside* the top ``calib_topk`` fraction of keys; the paper's ``n_q - Σ top-k`` divided by
    ``n_q``) comes from ``profile``:

    - ``None``: no identification, every layer is sparsity-friendly (the retrieval half alone);
    - ``"auto"``: computed at the first prefill of a sequence from its own prompt;
    - a path or a :class:`kvpass.tailorkv.Profile`: from :func:`kvpass.tailorkv.calibrate`.

    Needs the runtime to own the cache (DynamicCache, the default ``own_cache=True``); refuses
    StaticCache and cache crops."""

    tau: float = 0.2
    quant_bits: int = 1
    group_size: int = 64
    residual: int = 128
    sparse_budget: int = 1024
    static_tokens: int = 128
    sinks: int = 16
    critical_channels: int = 8
    profile: Any = None
    calib_queries: int = 64
    calib_topk: float = 0.05
    early_estimate: bool | None = None
    name = "TailorKV"

    def __post_init__(self):
        n = self.name
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)) or not 0 <= self.tau:
            raise ValueError(f"kvpass: TailorKV needs a number tau >= 0, got tau={self.tau!r}")
        # type first: 1.0 == 1 would pass the membership test and reach the packing code as a float
        if type(self.quant_bits) is not int or self.quant_bits not in (1, 2):
            raise ValueError(
                f"kvpass: TailorKV needs quant_bits 1 or 2 (an int), got quant_bits={self.quant_bits!r} "
                f"({type(self.quant_bits).__name__})"
            )
        check_int(n, "group_size", self.group_size, 1)
        per = 8 // self.quant_bits
        if self.group_size % per:
            raise ValueError(
                f"kvpass: TailorKV needs group_size to be a multiple of 8 // quant_bits = {per} (a packed "
                f"byte never spans two groups), got group_size={self.group_size}"
            )
        check_int(n, "residual", self.residual, self.group_size)
        if self.residual % self.group_size:
            raise ValueError(
                f"kvpass: TailorKV needs residual to be a multiple of group_size ({self.group_size}: keys are "
                f"quantised in groups of tokens), got residual={self.residual}"
            )
        check_int(n, "sinks", self.sinks, 0)
        check_int(n, "static_tokens", self.static_tokens, 1)
        if self.static_tokens <= self.sinks:
            raise ValueError(
                f"kvpass: TailorKV needs static_tokens > sinks ({self.sinks}): the static tokens are the sinks "
                f"plus at least the current one, got static_tokens={self.static_tokens}"
            )
        check_int(n, "sparse_budget", self.sparse_budget, 1)
        if self.sparse_budget <= self.static_tokens:
            raise ValueError(
                f"kvpass: TailorKV needs sparse_budget > static_tokens ({self.static_tokens}): the budget counts "
                f"the static tokens and the top-k tokens fetched, got sparse_budget={self.sparse_budget}"
            )
        check_int(n, "critical_channels", self.critical_channels, 1)
        check_int(n, "calib_queries", self.calib_queries, 1)
        t = self.calib_topk
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise ValueError(f"kvpass: TailorKV needs 0 < calib_topk <= 1, got calib_topk={t!r}")
        e = self.early_estimate
        if not (e is None or type(e) is bool):  # 1 == True: the type, not membership
            raise ValueError(f"kvpass: TailorKV needs early_estimate None, True or False, got {e!r}")
        p = self.profile
        if isinstance(p, (str, Path)) and str(p) != "auto":
            from kvpass.tailorkv import Profile

            object.__setattr__(self, "profile", Profile.load(p))
        elif not (p is None or p == "auto" or type(p).__name__ == "Profile"):
            raise ValueError(
                f"kvpass: TailorKV needs profile None, 'auto', a path or a kvpass.tailorkv.Profile, got {p!r}"
            )

    @property
    def budget(self) -> int:
        """Tokens attended per sparse layer and step (reports and sweeps compare it with the others')."""
        return self.sparse_budget

    @property
    def topk(self) -> int:
        """Tokens fetched per sparse layer and step (the budget less the static tokens)."""
        return self.sparse_budget - self.static_tokens

    def params(self) -> dict[str, Any]:
        d = super().params()
        p = self.profile
        if type(p).__name__ == "Profile":
            d["profile"] = p.summary()
        return d

    @property
    def fetches(self) -> bool:
        return True

    @property
    def prefetches(self) -> bool:
        return True

    def fetches_on(self, device) -> bool:
        # on CPU the host tier is the memory the attention reads: no copy for a separate op to issue
        # early, so the attention selects and reads in place (one op a site instead of two)
        return device.type != "cpu"

    def prefetches_on(self, device) -> bool:
        # the estimate exists to start the host-to-device copy a layer early; on CPU it would only add a
        # second q projection a layer, and the true query at hand picks the channels at least as well
        return self.early_estimate if self.early_estimate is not None else device.type != "cpu"

    def graph_key(self) -> str:
        # a fetch before each owned attention and a prefetch with the query estimated one layer early,
        # where the device asks for them (fetches_on, prefetches_on): the graph depends on early_estimate
        estimate = {None: "", True: "+estimate", False: "-estimate"}[self.early_estimate]
        return "kvpass::attention+fetch+prefetch" + estimate

    @classmethod
    def with_budget(cls, budget: int, **kw) -> TailorKV:
        check_int(cls.name, "budget", budget, 1)
        static = kw.pop("static_tokens", min(128, budget // 8))
        return cls(sparse_budget=budget, static_tokens=max(static, kw.get("sinks", 16) + 1), **kw)

    def new_state(self, info):
        from kvpass.runtime.tailorkv import TailorState

        return TailorState(self, info)

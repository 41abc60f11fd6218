"""TailorKV (Yao et al., "TailorKV: A Hybrid Framework for Long-Context Inference via Tailored KV Cache
Optimization", ACL 2025 Findings, arXiv 2505.19586): per layer, a 1/2-bit quantised cache or sparse
top-k retrieval from a host tier with the next layer's query estimated one layer early."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from kvpass.policies.base import Policy, check_int, register_policy
from kvpass.runtime.errors import KVPassError
from kvpass.runtime.tailorkv import TailorState

FORMAT = 1
# Config entries that name or place a model rather than shape it (a profile follows the architecture).
_VOLATILE = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
             "_attn_implementation", "_attn_implementation_internal", "attn_implementation", "use_cache"}


def config_key(config) -> str:
    """A stable hash of a transformers config (never the model's name or path)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer dense-preference scores of one model architecture.

    ``scores``: ((layer, P), ...) ascending by layer. ``tau`` is the threshold the profile was listed
    with (the policy's own ``tau`` decides at run time)."""

    config_key: str
    model_type: str
    scores: tuple[tuple[int, float], ...]
    tau: float = 0.2
    calib_queries: int = 64
    calib_topk: float = 0.05
    prompts: int = 0
    prompt_tokens: tuple[int, ...] = ()

    def score(self, layer: int) -> float:
        for i, p in self.scores:
            if i == layer:
                return p
        raise KVPassError(
            f"kvpass: the TailorKV profile ({self.model_type}, config {self.config_key}) has no layer {layer}; "
            f"it covers layers {[i for i, _ in self.scores]}: calibrate this model with "
            f"kvpass.tailorkv.calibrate(model, prompts)"
        )

    def quantised(self, tau: float | None = None) -> tuple[int, ...]:
        tau = self.tau if tau is None else tau
        return tuple(i for i, p in self.scores if p > tau)

    def summary(self) -> str:
        return f"Profile({self.model_type}, config {self.config_key}, P={[round(p, 4) for _, p in self.scores]})"

    def describe(self, tau: float | None = None) -> str:
        """A readable table: layer, P, tier."""
        tau = self.tau if tau is None else tau
        lines = [f"TailorKV profile: {self.model_type}, config {self.config_key}, {self.prompts} prompt(s) "
                 f"{list(self.prompt_tokens)} tokens, last {self.calib_queries} queries, top "
                 f"{self.calib_topk:.0%} of keys, tau {tau}",
                 "  layer       P  tier"]
        for i, p in self.scores:
            lines.append(f"  {i:5d}  {p:6.4f}  {'quantised' if p > tau else 'sparse'}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kvpass_profile": FORMAT,
            "method": "TailorKV",
            "config_key": self.config_key,
            "model_type": self.model_type,
            "tau": self.tau,
            "calib_queries": self.calib_queries,
            "calib_topk": self.calib_topk,
            "prompts": self.prompts,
            "prompt_tokens": list(self.prompt_tokens),
            "layers": [{"layer": i, "P": p, "tier": "quantised" if p > self.tau else "sparse"}
                       for i, p in self.scores],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("kvpass_profile") != FORMAT or "layers" not in d:
            raise KVPassError(
                f"kvpass: not a TailorKV profile (format {FORMAT}); make one with kvpass.tailorkv.calibrate"
            )
        return cls(
            config_key=d["config_key"],
            model_type=d.get("model_type", "?"),
            scores=tuple((int(r["layer"]), float(r["P"])) for r in d["layers"]),
            tau=float(d.get("tau", 0.2)),
            calib_queries=int(d.get("calib_queries", 64)),
            calib_topk=float(d.get("calib_topk", 0.05)),
            prompts=int(d.get("prompts", 0)),
            prompt_tokens=tuple(d.get("prompt_tokens", ())),
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"kvpass: TailorKV profile {str(path)!r} does not exist; make one with "
                f"kvpass.tailorkv.calibrate(model, prompts, path={str(path)!r}) or use profile='auto'"
            )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"kvpass: TailorKV profile {str(path)!r} is not JSON ({e})") from None
        return cls.from_dict(d)

    def check(self, model) -> None:
        """Raise unless the profile was calibrated for ``model``'s config."""
        key = config_key(model.config)
        if key != self.config_key:
            raise KVPassError(
                f"kvpass: this TailorKV profile was calibrated for another config ({self.model_type}, "
                f"{self.config_key}; this model: {getattr(model.config, 'model_type', '?')}, {key}); "
                f"recalibrate with kvpass.tailorkv.calibrate(model, prompts)"
            )


def load_profile(path: str | Path, model=None) -> Profile:
    """Load a profile; with ``model``, check that it was calibrated for that model's config."""
    prof = Profile.load(path)
    if model is not None:
        prof.check(model)
    return prof


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
    # 2, not the paper's 1: on SmolLM2 the one quantised layer at 1 bit costs 8 points of top-1 agreement with
    # Full, at 2 bits 0.2 (docs/results/fidelity-4k-tailorkv-bits-2026-12-07.md); quant_bits=1 is the paper's
    quant_bits: int = 2
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
            # the calibration module builds backends (kvpass.api) for this policy: imported where used
            object.__setattr__(self, "profile", Profile.load(p))
        elif not (p is None or p == "auto" or isinstance(p, Profile)):
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
        if isinstance(p, Profile):
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
        return TailorState(self, info)

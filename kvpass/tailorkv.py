"""TailorKV's offline layer identification (arXiv 2505.19586, Sec. 4.1): the dense-preference score
``P`` of every layer, saved as a readable profile keyed by the model's config.

    from kvpass.tailorkv import calibrate
    profile = calibrate(model, [ids1, ids2], path="smollm2.tailorkv.json")
    backend = kvpass(TailorKV(profile=profile))        # or TailorKV(profile="smollm2.tailorkv.json")
    print(profile.describe())                         # which layers are quantised, with their P

A layer whose ``P`` exceeds the policy's ``tau`` is quantisation-friendly, the others
sparsity-friendly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from kvpass.runtime.state import KVPassError

FORMAT = 1
# Config entries that name or place a model rather than shape it (a profile follows the architecture).
_VOLATILE = {"_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
             "_attn_implementation", "_attn_implementation_internal", "attn_implementation", "use_cache"}


def config_key(config) -> str:
    """A stable hash of a transformers config (never the model's name or path)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def dense_preference(q: torch.Tensor, k: torch.Tensor, n_q: int, topk: float, scale: float) -> float:
    """TailorKV's dense-preference score of one layer at prefill, normalised per query.

    q: (B, H_q, T, D) the prompt's queries (the last T of the L positions); k: (B, H_kv, L, D).
    The last ``min(n_q, T)`` queries attend causally to the keys; ``k_top = ceil(topk * L)``.
    Returns the mean over batch rows, heads and queries of ``1 - Σ top-k attention weights``: the
    paper's ``P = n_q - Σ_{(i,j) ∈ top-k} Â_ij`` divided by n_q (and averaged over heads), so that
    one ``tau`` serves any n_q.
    """
    b, h_q, t, d = q.shape
    h_kv, length = k.shape[1], k.shape[2]
    n = min(n_q, t)
    g = h_q // h_kv
    qs = q[:, :, t - n :].float().reshape(b, h_kv, g, n, d)
    scores = torch.matmul(qs, k.float()[:, :, None].transpose(-1, -2)) * scale  # (B, H_kv, G, n, L)
    pos = torch.arange(length - n, length, device=q.device)[:, None]
    scores.masked_fill_(torch.arange(length, device=q.device)[None, :] > pos, -math.inf)
    attn = torch.softmax(scores, dim=-1)
    k_top = max(1, math.ceil(topk * length))
    top = attn.topk(min(k_top, length), dim=-1).values.sum(-1)
    return float((1.0 - top).mean())


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


def calibrate(
    model,
    prompts,
    path: str | Path | None = None,
    *,
    tokenizer=None,
    tau: float = 0.2,
    calib_queries: int = 64,
    calib_topk: float = 0.05,
    progress: bool = False,
) -> Profile:
    """Compute TailorKV's per-layer dense-preference scores offline (the paper's layer identification).

    Each prompt is prefilled once through the model compiled with ``kvpass(TailorKV(profile="auto"))``
    (so the scores come from the same graph pass that serves the model, on any HF decoder); ``P`` of a
    layer is the mean over prompts. ``prompts``: token-id tensors ``(1, T)`` or ``(T,)``, or strings
    with ``tokenizer``. Saves the profile to ``path`` when given."""
    from kvpass.api import constant_floats, kvpass
    from kvpass.policies.tailorkv import TailorKV

    if isinstance(prompts, (str, torch.Tensor)):
        prompts = [prompts]
    ids_list = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("kvpass: calibrate needs tokenizer= to encode text prompts")
            p = tokenizer(p, return_tensors="pt").input_ids
        if not isinstance(p, torch.Tensor) or p.dim() not in (1, 2) or (p.dim() == 2 and p.shape[0] != 1):
            raise ValueError(f"kvpass: calibrate needs prompts as (T,) or (1, T) token ids, got {getattr(p, 'shape', p)}")
        ids_list.append(p.view(1, -1))
    if not ids_list:
        raise ValueError("kvpass: calibrate needs at least one prompt")
    policy = TailorKV(profile="auto", tau=tau, calib_queries=calib_queries, calib_topk=calib_topk)
    backend = kvpass(policy)
    forward = torch.compile(type(model).forward.__get__(model), backend=backend, dynamic=True)
    totals: dict[int, list[float]] = {}
    device = next(model.parameters()).device
    for i, ids in enumerate(ids_list):
        if progress:
            print(f"kvpass: calibrating TailorKV on prompt {i + 1}/{len(ids_list)} ({ids.shape[1]} tokens)", flush=True)
        backend.clear_state()
        with torch.no_grad(), constant_floats():
            out = forward(input_ids=ids.to(device), use_cache=True)
        # read while the output's cache is alive: the runtime frees a sequence's state with its cache
        scores = dict(backend.runtime.shared.get("tailorkv.scores", {}))
        del out
        if not scores:
            raise KVPassError(
                "kvpass: calibrate found no attention site to score (see the backend's report: "
                + backend.report().splitlines()[-1] + ")"
            )
        for layer, p in scores.items():
            totals.setdefault(layer, []).append(p)
    prof = Profile(
        config_key=config_key(model.config),
        model_type=getattr(model.config, "model_type", "?"),
        scores=tuple((layer, sum(v) / len(v)) for layer, v in sorted(totals.items())),
        tau=tau,
        calib_queries=calib_queries,
        calib_topk=calib_topk,
        prompts=len(ids_list),
        prompt_tokens=tuple(int(ids.shape[1]) for ids in ids_list),
    )
    if path is not None:
        prof.save(path)
    return prof

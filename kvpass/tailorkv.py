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

from pathlib import Path

import torch

from kvpass.api import constant_floats, kvpass
from kvpass.policies.tailorkv import FORMAT, Profile, TailorKV, config_key, load_profile
from kvpass.runtime.errors import KVPassError
from kvpass.runtime.tailorkv import dense_preference

__all__ = ["FORMAT", "Profile", "calibrate", "config_key", "dense_preference", "load_profile"]


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

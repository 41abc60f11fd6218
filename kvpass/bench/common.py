"""What the bench modes share: policy specs and integer lists from the command line, the model of
``--model`` (SmolLM2, or a random tiny Llama for structure checks) and TailorKV's offline profile for
the sweep. Below every mode, so that the modes import it and :mod:`kvpass.bench.cli` only parses and
dispatches."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from kvpass.bench.prompts import topics_text
from kvpass.models import load_smollm2, smollm2_cache_path
from kvpass.policies.base import Policy
from kvpass.policies.full import Full
from kvpass.policies.parse import parse_policy
from kvpass.policies.tailorkv import TailorKV
from kvpass.tailorkv import Profile, calibrate, config_key

__all__ = ["CALIBRATION_TOKENS", "build_policies", "calibrate_policies", "load_for_bench", "load_model",
           "parse_ints", "parse_policies", "split_specs", "tiny_model"]


def split_specs(text: str) -> list[str]:
    """Split ``"Full,Quest(budget=1, page_size=2)"`` on the commas outside parentheses."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return [s for s in out if s]


def parse_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"kvpass: --{what} needs comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"kvpass: --{what} needs positive integers, got {text!r}")
    return vals


def build_policies(specs: str, budgets: list[int]):
    """Full plus every non-Full spec × every budget (``parse_policy(spec, budget=b)``); a spec that sets
    its own ``budget`` or ``cache_ratio`` is taken as it is."""
    out = [Full()]
    for spec in split_specs(specs):
        p = parse_policy(spec)
        if isinstance(p, Full):
            continue
        if re.search(r"\b(budget|sparse_budget|cache_ratio)\s*=", spec):
            if p not in out:
                out.append(p)  # the spec fixes its own budget: not swept
            continue
        for b in budgets:
            q = parse_policy(spec, budget=b)
            if q not in out:
                out.append(q)
    return out


CALIBRATION_TOKENS = 4096


def load_for_bench(args, policies: list) -> tuple:
    """What a measurement command starts with: the model of ``--model``, the ``--out`` folder made, and
    ``policies`` calibrated on the model where they need it. Returns ``(model, tokenizer, model name,
    policies, out)``."""
    out = Path(args.out)
    model, tok, model_name = load_model(args.model)
    out.mkdir(parents=True, exist_ok=True)
    return model, tok, model_name, calibrate_policies(policies, model, tok, out, progress=not args.no_progress), out


def calibrate_policies(policies: list, model, tokenizer, out: Path, progress: bool) -> list:
    """Give every ``TailorKV(profile="auto")`` of the sweep one profile, computed offline as the paper
    does (the bench's shared exact prefill would otherwise leave "auto" a single decode query to
    score with): :func:`kvpass.tailorkv.calibrate` on the last ``CALIBRATION_TOKENS`` tokens of the
    pydoc prose (no task and no perplexity window uses them), saved as ``OUT/tailorkv_profile.json``
    and reused by a rerun on the same model config."""
    need = [p for p in policies if isinstance(p, TailorKV) and p.profile == "auto"]
    if not need:
        return policies
    path = out / "tailorkv_profile.json"
    prof = Profile.load(path) if path.exists() else None
    if prof is None or prof.config_key != config_key(model.config):
        ids = tokenizer(topics_text(), return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = ids[:, -CALIBRATION_TOKENS:]
        p0 = need[0]
        prof = calibrate(model, [ids], path, tau=p0.tau, calib_queries=p0.calib_queries, calib_topk=p0.calib_topk,
                         progress=progress)
    if progress:
        print(prof.describe(tau=need[0].tau), flush=True)
    return [dataclasses.replace(p, profile=prof) if p in need else p for p in policies]


def tiny_model(vocab_size: int, seed: int = 0):
    """A random 2-layer Llama (hidden 64, 4 heads, 2 KV heads, 8192 positions) for structure checks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        attn_implementation="sdpa", eos_token_id=None,
    )
    cfg._name_or_path = "tiny"
    return LlamaForCausalLM(cfg).eval()


def load_model(name: str):
    """``(model, tokenizer, model_name)`` for ``--model``."""
    first = not (smollm2_cache_path() / "kvpass.json").exists()
    model, tok = load_smollm2(progress=first)
    if name == "tiny":
        del model
        return tiny_model(len(tok)), tok, "tiny"
    return model, tok, "SmolLM2-135M-Instruct"


def parse_policies(text: str) -> list[Policy]:
    """Policy specs as ``kvpass bench --decode-cost --policies`` takes them: each as given, except that
    ``budget=N`` also works for a policy without a ``budget`` field (``StreamingLLM(budget=1024)`` is
    ``StreamingLLM.with_budget(1024)``)."""
    out = []
    for spec in split_specs(text):
        try:
            out.append(parse_policy(spec))
        except ValueError:
            m = re.search(r"\bbudget\s*=\s*(\d+)\s*,?\s*", spec)
            if m is None:
                raise
            rest = (spec[: m.start()] + spec[m.end():]).replace(", )", ")").replace(",)", ")").replace("()", "")
            out.append(parse_policy(rest, budget=int(m.group(1))))
    return out

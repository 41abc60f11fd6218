"""Perplexity of long real text with a compressed KV cache, decoded token by token.

The setting of ClusterKV's PG19 figure (Liu et al., "ClusterKV: Manipulating LLM KV Cache in Semantic
Space for Recallable Compression", arXiv 2412.03213): prefill a long context, then decode the rest of
the text one token per forward with teacher forcing (the true next token is fed back), so that every
scored token is predicted by attention over the *compressed* cache. The paper reports perplexity
deltas over the full cache of about +0.5 for ClusterKV at budget 1024 and about +4 for Quest.

Text: the prose of CPython's ``pydoc_data.topics`` (real English, offline; it changes between Python
versions, so numbers are reproducible per Python minor version)::

    from kvpass import Full, Quest, kvpass
    from kvpass.bench.perplexity import perplexity
    from kvpass.models import load_smollm2

    model, tok = load_smollm2()
    res = perplexity(model, tok, kvpass(Full()), [Full(), Quest(budget=256)], window=2048, eval_tokens=128)
    res["Quest(budget=256, page_size=16, gqa='sum')"]["delta"]   # ppl(Quest) - ppl(Full)

or ``python -m kvpass.bench.perplexity --window 2048 --eval-tokens 128 --policies "Full,Quest(budget=256)"``.

What is scored: the window's last ``eval_tokens`` tokens. The first of them is predicted by the
prefill's last logits (exact attention, as in every policy); the others by the ``eval_tokens - 1``
decode steps. One compiled backend serves every policy through ``backend.set_policy`` (nothing
recompiles); Full runs first and is the reference for ``delta``.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from typing import Any, Iterable

import torch

from kvpass import Full, KVPassError, kvpass
from kvpass.bench.common import split_specs
from kvpass.bench.prompts import topics_text
from kvpass.models import load_smollm2
from kvpass.policies.base import Policy
from kvpass.policies.parse import parse_policy

__all__ = ["topics_text", "perplexity", "perplexity_of_ids", "split_policies", "main"]


def split_policies(text: str) -> list[str]:
    """Split ``"Full,Quest(budget=256, page_size=16)"`` on the commas outside parentheses."""
    return split_specs(text)


def _nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    """NLL of ``target`` (scalar id) under ``logits`` (V,), in fp32."""
    return -torch.log_softmax(logits.float(), dim=-1)[target].item()


def _prefill(fwd, ids: torch.Tensor, prefix: int):
    """``(NLL of ids[0, prefix], cache)`` after prefilling ``ids[:, :prefix]`` with ``fwd``."""
    from transformers import DynamicCache

    out = fwd(input_ids=ids[:, :prefix], past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    return _nll(out.logits[0, -1], ids[0, prefix]), out.past_key_values


def _run_one(fwd, ids: torch.Tensor, prefix: int, progress: bool, label: str, shared=None) -> list[float]:
    """Prefill ``ids[:, :prefix]`` (or continue from ``shared``, what :func:`_prefill` returned for an
    exact prefill: a copy of its cache is adopted by the policy at the first decode step), then decode
    ``ids[:, prefix:-1]`` one token at a time; returns the NLL of each of ``ids[0, prefix:]``."""
    if shared is None:
        first, cache = _prefill(fwd, ids, prefix)
    else:
        first, cache = shared[0], copy.deepcopy(shared[1])
    nlls = [first]
    steps = range(prefix, ids.shape[1] - 1)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=label, unit="tok", leave=False, file=sys.stderr)
    for t in steps:
        out = fwd(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nlls.append(_nll(out.logits[0, -1], ids[0, t + 1]))
    return nlls


def perplexity_of_ids(
    model,
    ids: torch.Tensor,
    backend=None,
    policies: Iterable[Policy] = (),
    eval_tokens: int = 128,
    *,
    progress: bool = False,
    compiled=None,
    warmup: bool = True,
    share_prefill: bool = True,
) -> dict[str, dict[str, Any]]:
    """Token-by-token perplexity of ``ids`` ``(1, W)`` for each policy (the text-free core).

    Args:
        model: a Hugging Face causal LM (eval mode).
        ids: ``(1, W)`` token ids, the whole window; ``W > eval_tokens >= 1``.
        backend: a :class:`kvpass.KVPassBackend`; ``None`` builds ``kvpass(Full())``. Its policy is
            swapped with ``set_policy`` (its site state is cleared each time) and left at the last one.
        policies: the policies to measure; ``Full()`` is run first (added if missing) as the reference.
            A policy whose graph differs from the backend's (``set_policy`` refuses it) gets a backend
            and a compilation of its own, with a warning.
        eval_tokens: how many of the window's last tokens are scored.
        compiled: an already compiled ``model.forward`` for ``backend`` (default: compiled here with
            ``dynamic=True``).
        warmup: first run Full on the window's first 8 tokens (prefill 5, decode 3), which compiles
            every graph (prefill, first decode, symbolic-length decode), so that ``seconds`` measures
            the runs and not the compilation.
        share_prefill: prefill the context once, exactly, with the model's own forward (every policy
            attends exactly at prefill) and start each policy from a copy of that cache; ``seconds``
            then counts the decode steps only. False: each policy prefills through the backend.

    Returns:
        ``{policy.describe(): {"ppl", "nll", "tokens", "window", "delta", "delta_nll", "seconds"}}``:
        ``nll`` is the mean NLL (nats) over ``tokens`` scored tokens, ``ppl = exp(nll)``, ``delta`` and
        ``delta_nll`` are the differences to Full, ``seconds`` the wall time of the policy's run.
    """

    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"kvpass: perplexity needs ids of shape (1, W), got {tuple(ids.shape)}")
    window = ids.shape[1]
    if not 1 <= eval_tokens < window:
        raise ValueError(
            f"kvpass: perplexity needs 1 <= eval_tokens < window ({window}), got eval_tokens={eval_tokens}"
        )
    policies = list(policies)
    for p in policies:
        if not isinstance(p, Policy):
            raise TypeError(f"kvpass: perplexity needs Policy objects, got {type(p).__name__}: {p!r}")
    full = next((p for p in policies if isinstance(p, Full)), Full())
    ordered = [full] + [p for p in policies if p is not full and p != full]
    # policies that need a backend of their own last (compiling one resets dynamo's cache)
    ordered.sort(key=lambda p: p.graph_key() != full.graph_key())
    if backend is None:
        backend = kvpass(full)
    if compiled is None:
        compiled = torch.compile(model.forward, backend=backend, dynamic=True)
    prefix = window - eval_tokens

    results: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        eager = type(model).forward.__get__(model)  # model.forward may be the compiled one
        if warmup and window >= 8:
            backend.set_policy(full)
            _run_one(compiled, ids[:, :8], 5, False, "warm-up")
            if share_prefill:
                _run_one(compiled, ids[:, :8], 5, False, "warm-up", shared=_prefill(eager, ids[:, :8], 5))
        shared = _prefill(eager, ids, prefix) if share_prefill else None
        for p in ordered:
            fwd = compiled
            try:
                backend.set_policy(p)
            except KVPassError as err:
                warnings.warn(f"{err}; compiling a separate backend for it", stacklevel=2)
                # A fresh dynamo cache: on top of the other backend's graphs, the new ones would reach
                # dynamo's recompile limit, and a frame dynamo then runs eagerly would read the stubs
                # an owned cache leaves in the model's cache. Warm-up compiles every graph first.
                torch._dynamo.reset()
                fwd = torch.compile(eager, backend=kvpass(p), dynamic=True)
                if warmup and window >= 8:
                    _run_one(fwd, ids[:, :8], 5, False, "warm-up")
                    if share_prefill:
                        _run_one(fwd, ids[:, :8], 5, False, "warm-up", shared=_prefill(eager, ids[:, :8], 5))
            start = time.perf_counter()
            nlls = _run_one(fwd, ids, prefix, progress, p.describe(), shared=shared)
            nll = sum(nlls) / len(nlls)
            results[p.describe()] = {
                "ppl": math.exp(nll),
                "nll": nll,
                "tokens": len(nlls),
                "window": window,
                "seconds": time.perf_counter() - start,
            }
    ref = results[full.describe()]
    for r in results.values():
        r["delta"] = r["ppl"] - ref["ppl"]
        r["delta_nll"] = r["nll"] - ref["nll"]
    return results


def perplexity(
    model,
    tokenizer,
    backend,
    policies: Iterable[Policy],
    window: int,
    eval_tokens: int,
    *,
    start: int = 0,
    progress: bool = True,
    compiled=None,
) -> dict[str, dict[str, Any]]:
    """Perplexity of ``pydoc_data.topics`` prose for each policy, ClusterKV's PG19 protocol
    (arXiv 2412.03213): tokens ``[start, start + window)`` of the text, the first
    ``window - eval_tokens`` prefilled, the last ``eval_tokens`` scored, decoded one at a time with
    teacher forcing through ``torch.compile(model.forward, backend=backend, dynamic=True)``.

    ``backend`` may be ``None`` (``kvpass(Full())`` is built). Returns what :func:`perplexity_of_ids`
    returns, keyed by ``policy.describe()``.
    """
    text = topics_text()
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if start < 0 or start + window > ids.shape[1]:
        raise ValueError(
            f"kvpass: perplexity needs start + window <= {ids.shape[1]} tokens of text, "
            f"got start={start}, window={window}"
        )
    ids = ids[:, start : start + window]
    return perplexity_of_ids(model, ids, backend, policies, eval_tokens, progress=progress, compiled=compiled)


def format_table(results: dict[str, dict[str, Any]]) -> str:
    rows = [["policy", "ppl", "delta", "nll", "tokens", "window", "s"]]
    for name, r in results.items():
        rows.append([name, f"{r['ppl']:.3f}", f"{r['delta']:+.3f}", f"{r['nll']:.4f}", str(r["tokens"]),
                     str(r["window"]), f"{r['seconds']:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join(line(row) for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvpass.bench.perplexity",
        description="Token-by-token perplexity of pydoc_data.topics prose with a compressed KV cache "
        "(SmolLM2-135M-Instruct; ClusterKV's PG19 protocol, arXiv 2412.03213).",
    )
    ap.add_argument("--window", type=int, default=2048, help="tokens of text (context + scored)")
    ap.add_argument("--eval-tokens", type=int, default=128, help="last tokens of the window scored")
    ap.add_argument("--start", type=int, default=0, help="first token of the window in the text")
    ap.add_argument("--policies", default="Full,Quest(budget=256)",
                    help='comma-separated specs, e.g. "Full,Quest(budget=256, page_size=16)"')
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = [parse_policy(s) for s in split_policies(args.policies)]
    model, tokenizer = load_smollm2(progress=not args.no_progress)
    full = next((p for p in policies if isinstance(p, Full)), Full())
    res = perplexity(model, tokenizer, kvpass(full), policies, args.window, args.eval_tokens,
                     start=args.start, progress=not args.no_progress)
    print(f"perplexity, pydoc_data.topics tokens [{args.start}, {args.start + args.window}), "
          f"last {args.eval_tokens} scored")
    print(format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

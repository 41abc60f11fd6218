"""Fidelity to Full on real prose: top-1 agreement and KL divergence of the next-token distribution.

A measure that needs no task (issue 53, item 3): on prompts of real English (CPython's
``pydoc_data.topics``, :func:`kvpass.bench.prompts.topics_text`), Full decodes ``steps`` tokens
greedily; every policy is then teacher-forced on that same continuation, one token per forward (a
decode step is where compression acts), and at each step its next-token distribution is compared with
Full's:

- ``agree``: whether the policy's top-1 token is Full's next token (Full's greedy choice);
- ``kl``: ``KL(Full || policy) = sum_v p_full(v) (log p_full(v) - log p_policy(v))`` in nats.

Both are averaged over the steps of a prompt, then over prompts; the 95 % confidence interval is a
t interval over the per-prompt means (prompts are the independent samples; the steps of one prompt
are not). Unlike a task's accuracy these are continuous and stay informative where the model fails
the task. The first token after the prompt comes from the prefill, exact for every policy, and is not
scored.

Cost: every kvpass policy prefills exactly, so each prompt is prefilled once with the model's own
forward and every policy continues from a copy of that cache, handed over with ``backend.adopt``
(its first decode step then runs the steady graph). Policies that share Full's graph
(``graph_key()``) share one compiled backend (``set_policy``); another graph (TailorKV's) gets its
own backend and prefills the prompts again::

    from kvpass import ClusterKV, Full
    from kvpass.bench.fidelity import fidelity_of_prompts, prose_prompts
    from kvpass.models import load_smollm2

    model, tok = load_smollm2()
    res = fidelity_of_prompts(model, prose_prompts(tok, 2048, 3), [Full(), ClusterKV(budget=512)], steps=16)
    res["ClusterKV(budget=512, ...)"]["agree"]      # mean top-1 agreement with Full

or ``kvpass bench --fidelity --contexts 4096 --prompts 20 --out bench_out/fidelity-4k-<date>``.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from kvpass import kvpass
from kvpass.bench.common import calibrate_policies, load_model, parse_ints, split_specs
from kvpass.bench.prompts import topics_text
from kvpass.bench.runner import machine_info
from kvpass.policies.base import Policy
from kvpass.policies.centroidkv import CentroidKV
from kvpass.policies.full import Full
from kvpass.policies.parse import parse_policy

__all__ = ["step_metrics", "mean_ci", "prose_prompts", "fidelity_of_prompts", "fidelity_policies",
           "fidelity_table", "summarise_log", "write_page", "run"]

#: the default sweep: every method at 512, 1024 and 2048 kept tokens (CentroidKV at the cache ratios
#: 0.125, 0.25, 0.5), TailorKV with its layers profiled (``profile="auto"``, calibrated offline)
DEFAULT_POLICIES = "Full,StreamingLLM,Quest,ClusterKV,CentroidKV,TailorKV(profile='auto')"
DEFAULT_BUDGETS = (512, 1024, 2048)
CENTROID_RATIOS = {512: 0.125, 1024: 0.25, 2048: 0.5}
RESULTS = "fidelity.jsonl"
PER_PROMPT = "fidelity_prompts.jsonl"  # one line per policy and prompt, written as the run goes

# two-sided 95 % quantiles of Student's t by degrees of freedom (scipy is not a dependency)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101,
        19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052,
        28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def _t95(df: int) -> float:
    if df in _T95:
        return _T95[df]
    return _T95[max(d for d in _T95 if d < df)]  # the tabled df below: a slightly wider interval


def step_metrics(ref_logp: torch.Tensor, logits: torch.Tensor, ref_tokens: torch.Tensor | None = None):
    """Per-step agreement and KL divergence.

    Args:
        ref_logp: ``(S, V)`` Full's log-probabilities (log-softmax) at each step.
        logits: ``(S, V)`` the policy's logits at the same steps (any float dtype; fp32 math).
        ref_tokens: ``(S,)`` Full's next tokens (default: the argmax of ``ref_logp``).

    Returns:
        ``(agree (S,) bool, kl (S,) fp32)``: whether the policy's top-1 token is Full's, and
        ``KL(Full || policy)`` in nats (0 for identical distributions, never negative).
    """
    if ref_logp.shape != logits.shape or ref_logp.dim() != 2:
        raise ValueError(f"kvpass: step_metrics needs ref_logp and logits of one shape (S, V), got "
                         f"{tuple(ref_logp.shape)} and {tuple(logits.shape)}")
    ref_logp = ref_logp.float()
    logp = torch.log_softmax(logits.float(), dim=-1)
    if ref_tokens is None:
        ref_tokens = ref_logp.argmax(-1)
    agree = logp.argmax(-1) == ref_tokens
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)  # rounding can give -1e-9
    return agree, kl


def mean_ci(values: Iterable[float]) -> tuple[float, float]:
    """``(mean, half width of the 95 % t interval)`` of independent samples (NaN width for one sample)."""
    xs = [float(x) for x in values]
    if not xs:
        return float("nan"), float("nan")
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, _t95(n - 1) * math.sqrt(var / n)


def prose_prompts(tokenizer, context: int, n: int, reserve: int = 4096) -> list[torch.Tensor]:
    """``n`` prompts ``(1, context)`` of pydoc prose, their starts spread evenly over the text; the last
    ``reserve`` tokens are left out (TailorKV's offline calibration reads them:
    :data:`kvpass.bench.common.CALIBRATION_TOKENS`). Prompts overlap where the text is too short for
    ``n`` disjoint ones (SmolLM2's tokens: about 100k, so 20 at 4k are disjoint, 20 at 8k overlap)."""

    ids = tokenizer(topics_text(), return_tensors="pt", add_special_tokens=False)["input_ids"]
    usable = ids.shape[1] - reserve
    if n < 1 or context < 2 or usable < context:
        raise ValueError(f"kvpass: prose_prompts needs n >= 1 and 2 <= context <= {usable} (the prose's tokens "
                         f"less {reserve} reserved), got n={n}, context={context}")
    span = usable - context
    starts = [round(i * span / max(1, n - 1)) if n > 1 else 0 for i in range(n)]
    return [ids[:, s : s + context].clone() for s in starts]


def fidelity_policies(specs: str = DEFAULT_POLICIES, budgets: Iterable[int] = DEFAULT_BUDGETS) -> list[Policy]:
    """Full plus every spec at every budget (through ``parse_policy(spec, budget=b)``; CentroidKV at the
    cache ratio of :data:`CENTROID_RATIOS`, else ``b / 4096``); a spec that fixes its own budget or
    ratio is taken as it is."""
    import dataclasses
    import re

    out: list[Policy] = [Full()]
    for spec in split_specs(specs):
        base = parse_policy(spec)
        if isinstance(base, Full):
            continue
        if re.search(r"\b(budget|sparse_budget|cache_ratio)\s*=", spec):
            found = [base]
        elif isinstance(base, CentroidKV):
            found = [dataclasses.replace(base, budget=None, cache_ratio=CENTROID_RATIOS.get(b, b / 4096))
                     for b in budgets]
        else:
            found = [parse_policy(spec, budget=b) for b in budgets]
        out += [p for p in found if p not in out]
    return out


def _describe(p: Policy) -> str:
    return p.describe()


def _eager(model):
    return type(model).forward.__get__(model)  # model.forward may be a compiled one


def _prefill(eager, ids: torch.Tensor):
    """``(first token (1, 1), cache)``: the exact prefill of ``ids (1, L)`` with the model's own forward."""
    from transformers import DynamicCache

    out = eager(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


def _decode(fwd, backend, cache, tokens: torch.Tensor, greedy_steps: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode from a copy of ``cache`` (adopted by ``backend``), one token per forward: teacher-forced on
    ``tokens (1, S)``, or with ``greedy_steps`` that many steps from ``tokens (1, 1)``, each feeding the
    last step's argmax. Returns ``(fed tokens (S,), logits (S, V) fp32)``."""
    cache = backend.adopt(copy.deepcopy(cache))
    greedy = greedy_steps > 0
    fed, rows = [], []
    tok = tokens[:, :1]
    for s in range(greedy_steps if greedy else tokens.shape[1]):
        if not greedy:
            tok = tokens[:, s : s + 1]
        out = fwd(input_ids=tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1].float()
        fed.append(int(tok[0, 0]))
        rows.append(logits)
        if greedy:
            tok = logits.argmax().view(1, 1)
    return torch.tensor(fed), torch.stack(rows)


def fidelity_of_prompts(
    model,
    prompts: list[torch.Tensor],
    policies: Iterable[Policy],
    steps: int = 64,
    *,
    progress: bool = False,
    options: dict | None = None,
    on_prompt=None,
    compiled=None,
) -> dict[str, dict[str, Any]]:
    """Top-1 agreement and KL(Full || policy) of each policy, teacher-forced on Full's greedy continuation.

    Args:
        model: a Hugging Face causal LM (eval mode); its ``forward`` is compiled here (a backend per
            ``graph_key()``, dynamo reset between them) and left as it was.
        prompts: token ids, each ``(1, L)``.
        policies: the policies; ``Full()`` is added if missing and is the reference.
        steps: decode steps scored per prompt (Full decodes them greedily; the others are fed Full's tokens).
        options: ``kvpass(policy, **options)`` for every backend.
        on_prompt: called as ``on_prompt(policy, prompt index, agreement, KL, max step KL, seconds)`` after
            each policy's run on a prompt (the per-prompt means; a long run's progress on disk).
        compiled: ``compiled(policy) -> (backend, compiled forward)`` serving ``policy`` (a compile shared
            with other work; dynamo is then neither reset nor warmed up); default: compiled here.

    Returns:
        ``{policy.describe(): {"policy", "agree", "agree_ci", "kl", "kl_ci", "prompts", "steps",
        "agree_per_prompt", "kl_per_prompt", "kl_max", "seconds"}}``; ``*_ci`` is the half width of the
        95 % t interval over the prompts' means, ``kl_max`` the largest single step's KL, ``seconds``
        the policy's decode wall time over all prompts (for the first policy of a graph, with its compile). Full's row is 1.0 and 0.0 by construction.
    """

    if steps < 1:
        raise ValueError(f"kvpass: fidelity needs steps >= 1, got steps={steps}")
    for ids in prompts:
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"kvpass: fidelity needs prompts of shape (1, L), got {tuple(ids.shape)}")
    policies = list(policies)
    full = Full()
    ordered = list({_describe(p): p for p in [full] + [p for p in policies if not isinstance(p, Full)]}.values())
    groups: dict[str, list[Policy]] = {}
    for p in ordered:
        groups.setdefault(p.graph_key(), []).append(p)
    eager = _eager(model)
    refs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per prompt: fed, next tokens, log-probs
    acc: dict[str, dict[str, Any]] = {_describe(p): {"policy": p, "agree": [], "kl": [], "kl_max": 0.0,
                                                      "seconds": 0.0} for p in ordered}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts) * len(ordered), desc="fidelity", unit="run", file=sys.stderr)
    fwd0 = model.forward
    try:
        with torch.no_grad():
            for key, members in groups.items():
                if compiled is not None:
                    backend, fwd = compiled(members[0])
                else:
                    torch._dynamo.reset()  # a fresh cache per graph: dynamo's recompile limit is per code object
                    backend = kvpass(members[0], **(options or {}))
                    fwd = torch.compile(eager, backend=backend, dynamic=True)
                for i, ids in enumerate(prompts):
                    first, cache = _prefill(eager, ids)
                    for p in members:
                        backend.set_policy(p)
                        t0 = time.perf_counter()
                        if isinstance(p, Full):
                            fed, logits = _decode(fwd, backend, cache, first, greedy_steps=steps)
                            logp = torch.log_softmax(logits, dim=-1)
                            refs.append((fed, logp.argmax(-1), logp))
                        else:
                            _, logits = _decode(fwd, backend, cache, refs[i][0][None])  # Full's tokens
                        agree, kl = step_metrics(refs[i][2], logits, refs[i][1])
                        a = acc[_describe(p)]
                        a["seconds"] += time.perf_counter() - t0
                        a["agree"].append(float(agree.float().mean()))
                        a["kl"].append(float(kl.mean()))
                        a["kl_max"] = max(a["kl_max"], float(kl.max()))
                        if on_prompt is not None:
                            on_prompt(p, i, a["agree"][-1], a["kl"][-1], float(kl.max()),
                                      time.perf_counter() - t0)
                        if bar is not None:
                            bar.set_postfix_str(f"{_describe(p)[:40]} #{i}")
                            bar.update(1)
                    del cache
                backend.clear_state()
    finally:
        if bar is not None:
            bar.close()
        model.forward = fwd0
        if compiled is None:
            torch._dynamo.reset()
    results = {}
    for name, a in acc.items():
        agree, agree_ci = mean_ci(a["agree"])
        kl, kl_ci = mean_ci(a["kl"])
        results[name] = {"policy": name, "agree": agree, "agree_ci": agree_ci, "kl": kl, "kl_ci": kl_ci,
                         "prompts": len(a["agree"]), "steps": steps, "agree_per_prompt": a["agree"],
                         "kl_per_prompt": a["kl"], "kl_max": a["kl_max"], "seconds": a["seconds"]}
    return results


def _budget(p: Policy) -> str:
    if getattr(p, "cache_ratio", None) is not None:
        return f"ratio {p.cache_ratio}"
    for f in ("budget", "sparse_budget"):
        if getattr(p, f, None) is not None:
            return str(getattr(p, f))
    return "all"


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's policy name, with the parameters that tell it from a row of the same name, context and
    kept tokens (two TailorKV rows at 1024: ``TailorKV (quant_bits=2)``)."""
    def fields(r):
        return re.split(r", (?=\w+=)", r["policy"].partition("(")[2].rstrip(")"))

    labels = []
    for r in rows:
        same = [o for o in rows if (o["context"], o["policy_name"], o["kept"]) == (r["context"], r["policy_name"],
                                                                                     r["kept"])]
        if len(same) < 2:
            labels.append(r["policy_name"])
            continue
        common = set.intersection(*(set(fields(o)) for o in same))
        own = [f for f in fields(r) if f not in common]
        labels.append(f"{r['policy_name']} ({', '.join(own)})" if own else r["policy_name"])
    return labels


def fidelity_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of result rows (one per context and policy)."""
    lines = ["| context | policy | kept | top-1 agreement (95 % CI) | KL(Full ‖ policy), nats (95 % CI) | max step KL "
             "| prompts × steps |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r, label in zip(rows, _labels(rows)):
        lines.append(
            f"| {r['context']} | {label} | {r['kept']} | {r['agree']:.4f} ± {r['agree_ci']:.4f} "
            f"| {r['kl']:.4f} ± {r['kl_ci']:.4f} | {r['kl_max']:.3f} | {r['prompts']} × {r['steps']} |")
    return "\n".join(lines)


def write_page(rows: list[dict[str, Any]], path: Path, command: str) -> Path:
    """The generated page: the command, what is measured, the table."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    model = rows[0]["model"] if rows else "?"
    text = f"""# Fidelity to Full on real prose

Generated by `{command}` ({when}; {model}, fp32, greedy, CPU). Do not edit: rerun the command.

Each prompt is a window of CPython's `pydoc_data.topics` prose. Full decodes the prompt's continuation
greedily; every policy is teacher-forced on that continuation, one token per decode step, from a copy
of the same exact prefill. Per step: whether the policy's top-1 token is Full's (agreement) and
KL(Full ‖ policy) of the next-token distribution in nats; averaged over the steps of a prompt, then
over prompts, with the half width of the 95 % t interval over the per-prompt means
(`kvpass/bench/fidelity.py`). "max step KL" is the largest KL of any single step.

{fidelity_table(rows)}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def summarise_log(path: Path, model: str = "SmolLM2-135M-Instruct") -> list[dict[str, Any]]:
    """Table rows from a run's per-prompt log (``OUT/fidelity_prompts.jsonl``), also of a run that has not
    finished: per context and policy, the prompts done so far (a policy's row counts its own prompts)."""
    import re

    runs: dict[tuple, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        runs.setdefault((r["context"], r["policy"]), []).append(r)
    rows = []
    for (c, name), rs in runs.items():
        agree, agree_ci = mean_ci(r["agree"] for r in rs)
        kl, kl_ci = mean_ci(r["kl"] for r in rs)
        m = re.search(r"\b(cache_ratio|sparse_budget|budget)=([0-9.]+)", name)
        kept = "all" if m is None else (f"ratio {m.group(2)}" if m.group(1) == "cache_ratio" else m.group(2))
        rows.append({"context": c, "policy": name, "policy_name": name.split("(")[0], "kept": kept,
                     "agree": agree, "agree_ci": agree_ci, "kl": kl, "kl_ci": kl_ci,
                     "kl_max": max(r["kl_max"] for r in rs), "prompts": len(rs), "steps": rs[0]["steps"],
                     "model": model})
    return rows


def run(args) -> int:
    """``kvpass bench --fidelity``: ``--contexts`` (default 4096), ``--prompts`` (default 20), ``--steps``
    (default 64), ``--policies`` (each non-Full one at ``--budgets``, default 512,1024,2048), ``--out``,
    ``--results-md`` (default ``OUT/fidelity.md``), ``--model``."""

    contexts = parse_ints(args.contexts or "4096", "contexts")
    budgets = parse_ints(args.budgets or ",".join(map(str, DEFAULT_BUDGETS)), "budgets")
    n_prompts = args.prompts if args.prompts is not None else 20
    steps = args.steps if args.steps is not None else 64
    if n_prompts < 2:
        raise ValueError(f"kvpass: --prompts needs at least 2 (a confidence interval), got {n_prompts}")
    policies = fidelity_policies(args.policies or DEFAULT_POLICIES, budgets)
    command = shlex.join(["kvpass"] + sys.argv[1:]) if Path(sys.argv[0]).name == "kvpass" else (
        f"kvpass bench --fidelity --contexts {','.join(map(str, contexts))} --prompts {n_prompts} --steps {steps} "
        f"--budgets {','.join(map(str, budgets))} --policies \"{args.policies or DEFAULT_POLICIES}\" --out {args.out}")
    out = Path(args.out)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(int(args.threads))
    try:
        model, tok, model_name = load_model(args.model)
        out.mkdir(parents=True, exist_ok=True)
        policies = calibrate_policies(policies, model, tok, out, progress=not args.no_progress)
        rows = []
        for c in contexts:
            def log(p, i, agree, kl, kl_max, seconds, c=c):
                with open(out / PER_PROMPT, "a") as f:
                    f.write(json.dumps({"context": c, "policy": p.describe(), "prompt": i, "agree": agree, "kl": kl,
                                        "kl_max": kl_max, "steps": steps, "seconds": seconds}) + "\n")

            res = fidelity_of_prompts(model, prose_prompts(tok, c, n_prompts), policies, steps,
                                      progress=not args.no_progress, on_prompt=log)
            by_name = {p.describe(): p for p in policies}
            for name, r in res.items():
                p = by_name.get(name)
                row = dict(r, model=model_name, context=c, policy_name=type(p).__name__ if p else name,
                           kept=_budget(p) if p else "all", command=command, machine=machine_info(),
                           finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
                rows.append(row)
                with open(out / RESULTS, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if not args.no_progress:
                    print(f"ctx {c} {name}: agree {r['agree']:.4f} ± {r['agree_ci']:.4f}, "
                          f"KL {r['kl']:.4f} ± {r['kl_ci']:.4f}", flush=True)
    finally:
        torch.set_num_threads(threads)
    print()
    print(fidelity_table(rows))
    page = write_page(rows, Path(args.results_md) if args.results_md else out / "fidelity.md", command)
    print(f"\nkvpass bench: wrote {page}", flush=True)
    return 0

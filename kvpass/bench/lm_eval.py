"""kvpass inside lm-evaluation-harness: the ``kvpass`` model, RULER pages, and lm-eval's CLI with both.

Needs the optional extra: ``pip install 'kvpass[eval]'`` (lm-eval 0.4.13, wonderwords, nltk). The
kvpass library never imports this module; importing it registers the lm-eval model ``kvpass``
(lm-eval's own convention for models outside its tree: ``@register_model`` runs when the module is
imported), so ``lm_eval.simple_evaluate(model="kvpass", ...)`` works after ``import
kvpass.bench.lm_eval``. lm-eval's own ``python -m lm_eval`` does not import it; run the same command
through this module instead, which registers the model and adds the prose RULER tasks
(:mod:`kvpass.bench.ruler_tasks`) to the task path::

    python -m kvpass.bench.lm_eval --model kvpass --model_args 'pretrained=smollm2,policy=ClusterKV(budget=1024)' \\
        --tasks niah_single_2_prose --metadata 'max_seq_lengths=[4096]' --limit 8 --batch_size 4 --device cpu

``pretrained`` is a Hugging Face path or ``smollm2`` (the bundled SmolLM2-135M-Instruct,
:func:`kvpass.models.load_smollm2`; for it the wrapper also hands the RULER tasks its tokenizer).
``policy`` is a spec read by :func:`kvpass.policies.parse.parse_policy`, commas inside the parentheses
allowed; ``policy=eager`` evaluates the same model uncompiled. ``strict`` (default True here),
``cache``, ``own_cache`` and ``skinny_linear`` go to :func:`kvpass.kvpass`; every other model arg goes
to lm-eval's ``HFLM`` (the batch size is lm-eval's own ``--batch_size``, not a model arg). After each
lm-eval request type the model checks that kvpass's graphs ran (compression never silently off) and
keeps what each generate batch attended in ``lm.batches``; the backend is ``lm.kvpass_backend``
(HFLM's own ``lm.backend`` is "causal").

``kvpass bench --lm-eval TASKS`` (:func:`run_bench`) runs ``simple_evaluate`` for each policy of
``--policies`` and writes a page: score, n and a 95 % confidence interval per task, length and policy.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvpass import KVPassError, kvpass
from kvpass.bench.common import build_policies, load_model, parse_ints, split_specs
from kvpass.bench.ruler_tasks import TASKS_DIR
from kvpass.models import load_smollm2, smollm2_cache_path
from kvpass.policies.base import Policy
from kvpass.policies.parse import parse_policy

__all__ = ["KVPassLM", "parse_model_args", "wilson", "cell_stats", "run_bench", "write_page", "main"]

#: z of a two-sided 95 % interval
Z95 = 1.959963984540054
RESULTS = "lm_eval.jsonl"
SAMPLES = "lm_eval_samples.jsonl"
EAGER = "eager"  # the pseudo-policy: the same model, uncompiled


class KVPassLM(HFLM):
    """lm-eval's ``HFLM`` on a model compiled with ``kvpass(policy).compile(model)``.

    Args:
        pretrained: a Hugging Face path (loaded by HFLM with ``attn_implementation="sdpa"``), ``"smollm2"``
            (the bundled model) or a model object.
        policy: a :class:`kvpass.Policy` or a spec such as ``"ClusterKV(budget=1024)"``; ``"eager"``: no
            compilation (the reference run of the same model).
        strict, cache, own_cache, skinny_linear: the backend options of :func:`kvpass.kvpass`; ``strict``
            defaults to True here: a site left exact or a forward that ran no kvpass graph raises.
        **kwargs: HFLM's arguments (``batch_size``, ``device``, ``tokenizer``, ``max_length``, ...).
    """

    def __init__(self, pretrained: Any = "smollm2", policy: Any = "Full", strict: bool = True, cache: bool = True,
                 own_cache: bool = True, skinny_linear: bool = True, **kwargs: Any) -> None:
        eager = isinstance(policy, str) and policy.strip().lower() == EAGER
        pol = None if eager else policy if isinstance(policy, Policy) else parse_policy(str(policy))
        backend = None if eager else kvpass(pol, strict=strict, cache=cache, own_cache=own_cache,
                                             skinny_linear=skinny_linear)  # bad options fail before the load
        if isinstance(pretrained, str) and pretrained.lower() == "smollm2":
            model, tok = load_smollm2(progress=True)
            kwargs.setdefault("tokenizer", tok)
            pretrained = model
        elif isinstance(pretrained, str):
            kwargs.setdefault("attn_implementation", "sdpa")  # kvpass finds SDPA attention sites
        if kwargs.get("device") is None:
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, **kwargs)
        self.policy, self.kvpass_backend = pol, backend  # HFLM's own self.backend is 'causal'
        #: per generate batch: rows, their own tokens and the tokens each attended (mean over sites)
        self.batches: list[dict] = []
        if backend is not None:
            backend.compile(self._model)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KVPassLM:
        """``"pretrained=smollm2,policy=Quest(budget=512, page_size=16)"``: split on the commas outside
        parentheses (lm-eval's own string parser splits on every comma, and policy specs have commas)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**parse_model_args(arg_string), **extra)

    # -- compression is checked after every request type ------------------------------------------
    def _checked(self, what: str, run, requests):
        be = self.kvpass_backend
        if be is None or not requests:
            return run()
        calls, eager = be.graph_calls(), be.eager_forwards
        out = run()
        why = None
        if be.graph_calls() == calls:
            why = "ran none of kvpass's graphs"
        elif be.eager_forwards > eager:
            why = f"ran {be.eager_forwards - eager} forward(s) without kvpass's graphs"
        if why:
            msg = (f"kvpass: lm-eval's {what} on {be!r} {why}: compression was off. Fix: compile a fresh model "
                   "per backend (dynamo's recompile limit counts every model compiled on the same forward), "
                   "or call torch._dynamo.reset() between models. See backend.report().")
            if be.strict:
                raise KVPassError(msg)
            warnings.warn(msg, stacklevel=3)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._checked("generate_until", lambda: super(KVPassLM, self).generate_until(requests, disable_tqdm),
                             requests)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._checked("loglikelihood", lambda: super(KVPassLM, self).loglikelihood(requests, disable_tqdm),
                             requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._checked("loglikelihood_rolling",
                             lambda: super(KVPassLM, self).loglikelihood_rolling(requests, disable_tqdm), requests)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        mask = generation_kwargs.get("attention_mask")
        own = mask.sum(-1).tolist() if mask is not None else [context.shape[1]] * context.shape[0]
        self.batches.append(batch_summary(self.kvpass_backend, own, out.shape[1] - context.shape[1]))
        return out

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info["kvpass_policy"] = EAGER if self.policy is None else self.policy.describe()
        return info


if __name__ != "__main__":
    # lm-eval's @register_model("kvpass"), applied when the module is imported under its own name; run as
    # ``python -m`` it imports itself (below), so lm-eval knows one class, not this one and __main__'s
    register_model("kvpass")(KVPassLM)


def parse_model_args(text: str | None) -> dict:
    """lm-eval's ``key=value,key=value`` model args, split on the commas outside parentheses and
    brackets, values typed as lm-eval types them (``4`` an int, ``False`` a bool)."""
    from lm_eval.utils import handle_arg_string

    args = {}
    for item in split_specs(text or ""):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"kvpass: model args are key=value pairs, got {item!r} in {text!r}")
        args[key.strip()] = handle_arg_string(value)
    return args


def batch_summary(backend, prompt_tokens: list[int], new_tokens: int) -> dict:
    """What one generate batch attended at its last decode step, from ``backend.report_rows()``:
    ``prompt_tokens`` (each row's own, padding excluded), ``tokens`` (each row's at the last step, from
    the report) and ``attended`` (each row's, averaged over the rewritten sites), ``compressed``
    (some row attended fewer tokens than it held), ``sites``."""
    out = {"rows": len(prompt_tokens), "prompt_tokens": [int(t) for t in prompt_tokens], "new_tokens": int(new_tokens)}
    if backend is None:
        return out | {"compressed": False, "sites": 0}
    sites = [r for r in backend.report_rows() if "reason" not in r]
    if not sites:
        return out | {"compressed": False, "sites": 0}
    per_site = [r["rows"] if "rows" in r else [{"tokens": r["tokens_logical"], "tokens_attended": r["tokens_attended"]}]
                for r in sites]
    tokens = [row["tokens"] for row in per_site[0]]
    attended = [sum(s[b]["tokens_attended"] for s in per_site) / len(per_site) for b in range(len(tokens))]
    return out | {"tokens": tokens, "attended": [round(a, 1) for a in attended],
                  "compressed": any(a < t for a, t in zip(attended, tokens)), "sites": len(sites)}


# -- statistics ------------------------------------------------------------------------------------
def wilson(k: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n`` (Wilson 1927): ``(low, high)``; good at small n
    and at 0 or n successes, where the normal interval collapses to a point."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def cell_stats(scores: list[float]) -> dict:
    """Mean score, n and a 95 % interval of per-sample scores in [0, 1]: Wilson's for 0/1 scores (every
    single-needle task), else the normal interval of the mean (mean +- z * s / sqrt(n), clipped; RULER's
    multi-value tasks score a sample by the fraction of its needles found)."""
    n = len(scores)
    if n == 0:
        return {"score": float("nan"), "n": 0, "ci_low": float("nan"), "ci_high": float("nan"), "ci": "none"}
    mean = sum(scores) / n
    if all(s in (0.0, 1.0) for s in scores):
        lo, hi = wilson(sum(scores), n)
        kind = "wilson"
    else:
        sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else float("nan")
        half = Z95 * sd / math.sqrt(n)
        lo, hi, kind = max(0.0, mean - half), min(1.0, mean + half), "normal"
    return {"score": mean, "n": n, "ci_low": lo, "ci_high": hi, "ci": kind}


# -- kvpass bench --lm-eval ------------------------------------------------------------------------
def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("kvpass", "transformers", "lm-eval"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "-"
    out["threads"] = torch.get_num_threads()
    return out


def _policy_specs(text: str, budgets: list[int]) -> list:
    """``--policies`` as the bench reads it (each non-Full spec without its own budget swept over
    ``budgets``), plus ``eager`` (the model uncompiled) where named."""

    specs = split_specs(text)
    rest = [s for s in specs if s.lower() != EAGER]
    pols: list = build_policies(",".join(rest), budgets) if rest else []
    if rest and not any(s.split("(")[0].strip().lower() == "full" for s in rest):
        pols = pols[1:]  # build_policies always adds Full: keep it only where asked for
    return ([EAGER] if len(rest) < len(specs) else []) + pols


def _name(policy) -> str:
    return policy if isinstance(policy, str) else policy.describe()


def run_bench(args: argparse.Namespace) -> int:
    """``kvpass bench --lm-eval TASKS``: for each policy, one lm-eval ``simple_evaluate`` of TASKS on the
    model of ``--model`` (a fresh copy per policy, dynamo reset in between), rows in
    ``OUT/lm_eval.jsonl`` (a rerun skips the policies whose cells are there), every sample's answer in
    ``OUT/lm_eval_samples.jsonl``, and the page ``--results-md`` (default ``OUT/lm-eval.md``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    lengths = parse_ints(args.max_seq_lengths or "4096", "max-seq-lengths")
    budgets = parse_ints(args.budgets or "1024", "budgets")
    policies = _policy_specs(args.policies or "Full", budgets)  # before the slow load: bad specs fail at once
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"kvpass: --limit needs a positive number of samples, got {args.limit}")
    command = _command(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    page = Path(args.results_md) if args.results_md else out / "lm-eval.md"
    progress = not args.no_progress
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(parse_ints(str(args.threads), "threads")[0])
    chat = bool(getattr(args, "chat_template", False))
    done = {(r["policy"], r["task"], r["max_seq_length"], r["limit"], r.get("chat_template", False))
            for r in _read(out / RESULTS)}
    t_all = time.perf_counter()
    try:
        for i, pol in enumerate(policies, 1):
            name = _name(pol)
            if all((name, t, L, args.limit, chat) in done for t in tasks for L in lengths):
                print(f"[{i}/{len(policies)}] {name}: in {out / RESULTS} already, skipped", flush=True)
                continue
            torch._dynamo.reset()  # each policy compiles a fresh model: earlier ones must not use up the limit
            model, tok, model_name = load_model(args.model)
            if progress:
                print(f"[{i}/{len(policies)}] {name}: {', '.join(tasks)} at {lengths} tokens, limit {args.limit}",
                      flush=True)
            lm = KVPassLM(pretrained=model, tokenizer=tok, policy=pol, batch_size=args.batch_size)
            tokdir = _tokenizer_dir(args.model)
            meta = {"max_seq_lengths": lengths, "tokenizer": tokdir, "pretrained": tokdir}
            if args.limit is not None:
                meta["num_samples"] = args.limit  # the first N of RULER's 500 samples: the same docs, made faster
            t0 = time.perf_counter()
            res = lm_eval.simple_evaluate(
                model=lm, tasks=tasks, limit=args.limit, log_samples=True,
                task_manager=TaskManager(include_path=str(TASKS_DIR), metadata=meta),
                gen_kwargs={"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None,
                apply_chat_template=chat, bootstrap_iters=0)
            secs = time.perf_counter() - t0
            rows, samples = _rows(res, name, model_name, lm, secs, args.limit, lengths)
            for r in rows + samples:
                r["chat_template"] = chat
            _append(out / SAMPLES, samples)
            _append(out / RESULTS, rows)
            for r in rows:
                print(f"    {r['task']} @ {r['max_seq_length']}: {r['score']:.3f} "
                      f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] n={r['n']} compressed={r['compressed']}"
                      f" ({secs:.0f} s for the policy)", flush=True)
            del lm, model
    finally:
        torch.set_num_threads(threads)

    samples = _read(out / SAMPLES)
    rows = _read(out / RESULTS) + shared_cells(samples, args.limit)
    write_page(rows, page, command, meta=versions() | {"model": args.model}, agreement=loop_agreement(samples))
    print(f"kvpass bench: wrote {page} ({len(rows)} cells); this run took {time.perf_counter() - t_all:.0f} s",
          flush=True)
    return 0


def _tokenizer_dir(model: str) -> str:
    return str(smollm2_cache_path())  # --model smollm2 and tiny both use SmolLM2's tokenizer


def _rows(res: dict, policy: str, model_name: str, lm: KVPassLM, secs: float, limit, lengths) -> tuple[list, list]:
    """One row per (task, length) and one per sample from ``simple_evaluate``'s result (``log_samples``)."""
    rows, samples = [], []
    compressed = any(b.get("compressed") for b in lm.batches)
    attended = [a for b in lm.batches for a in b.get("attended", [])]
    for task, logged in sorted(res["samples"].items()):
        ruler = all("max_length" in s["doc"] for s in logged)  # RULER: the metric is named by the length
        metric = next((k.split(",")[0] for k in res["results"].get(task, {})
                       if "," in k and "_stderr" not in k), None)
        for L in lengths if ruler else [0]:
            scores = []
            for s in logged:
                if ruler and int(s["doc"]["max_length"]) != L:
                    continue
                score = float(s[str(L)] if ruler else s[metric])
                scores.append(score)
                samples.append({"policy": policy, "task": task, "max_seq_length": L, "doc": s["doc_id"],
                                "length": s["doc"].get("length"), "needle_depth": s["doc"].get("needle_depth"),
                                "target": s["doc"].get("outputs", s.get("target")),
                                "response": s["filtered_resps"][0], "score": score})
            if not scores:
                continue
            rows.append({"policy": policy, "task": task, "max_seq_length": L, "limit": limit, "model": model_name,
                         **cell_stats(scores), "compressed": compressed,
                         "attended_mean": round(sum(attended) / len(attended), 1) if attended else None,
                         "seconds": round(secs, 1), "batch_size": lm.batch_size,
                         "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    return rows, samples


def _append(path: Path, rows: list[dict]) -> None:
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


#: The mode of a per-sample row of kvpass.bench.ruler's loop (lm-eval's own loop: "lm-eval").
SHARED = "shared prefill"


def agreement(a: list[dict], b: list[dict]) -> dict:
    """How two runs' per-sample rows agree on the samples and policies both hold: ``n``, ``same_score``
    (fraction with equal scores), ``same_text`` (equal answers after stripping whitespace)."""
    key = lambda r: (r["policy"], r["task"], r["max_seq_length"], int(r["doc"]))  # noqa: E731
    bi = {key(r): r for r in b}
    pairs = [(r, bi[key(r)]) for r in a if key(r) in bi]
    n = len(pairs)
    if not n:
        return {"n": 0, "same_score": float("nan"), "same_text": float("nan")}
    return {"n": n, "same_score": sum(x["score"] == y["score"] for x, y in pairs) / n,
            "same_text": sum(x["response"].strip() == y["response"].strip() for x, y in pairs) / n}


def shared_cells(samples: list[dict], limit) -> list[dict]:
    """Page rows (one per policy, task and length) from this runner's per-sample rows of run ``limit``."""
    groups: dict[tuple, list[dict]] = {}
    for r in samples:
        if r.get("mode") == SHARED and r.get("limit") == limit:
            groups.setdefault((r["policy"], r["task"], r["max_seq_length"]), []).append(r)
    rows = []
    for (pol, task, L), rs in groups.items():
        att = [r["attended"] for r in rs if r.get("attended") is not None]
        rows.append({"policy": pol, "task": task, "max_seq_length": L, "limit": limit, "mode": SHARED,
                     "model": rs[0].get("model"), **cell_stats([r["score"] for r in rs]),
                     "compressed": any(r["compressed"] for r in rs),
                     "attended_mean": round(sum(att) / len(att), 1) if att else None,
                     "seconds": round(sum(r["seconds"] for r in rs), 1),  # the shared prefills not counted
                     "batch_size": 1, "date": rs[-1].get("date")})
    return rows


def loop_agreement(samples: list[dict]) -> dict | None:
    """:func:`agreement` of lm-eval's loop and kvpass.bench.ruler's on the samples both hold, or None."""
    loop = [r for r in samples if r.get("mode", "lm-eval") != SHARED]
    shared = [r for r in samples if r.get("mode") == SHARED]
    a = agreement(loop, shared)
    return a if a["n"] else None


def write_page(rows: list[dict], path: Path, command: str, meta: dict | None = None,
               agreement: dict | None = None) -> Path:
    """The generated page: the command, the date, versions, then one table row per task, length, policy
    and loop (score, 95 % interval, n, whether the policy attended fewer tokens than the rows held);
    ``agreement``: :func:`agreement` of the two loops, where both ran."""
    meta = meta or {}
    lines = [
        "# lm-evaluation-harness with kvpass",
        "",
        "Generated by:",
        "",
        f"    {command}",
        "",
        f"Date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}. "
        + ", ".join(f"{k} {v}" for k, v in meta.items()) + ".",
        "",
        "Score: lm-eval's metric for the task (RULER: string_match_all, the fraction of a sample's needles in "
        "its answer), averaged over n samples. 95 % CI: the Wilson score interval where every sample scores 0 "
        "or 1 (preferred to lm-eval's stderr, which is a normal interval and collapses to a point at 0 or n "
        "of n); the normal interval of the mean otherwise (marked *). `compressed`: in the policy's run (all its "
        "tasks) some batch row attended fewer tokens than it held (no: the budget covered the context, or the "
        "policy is Full or eager); `attended`: tokens attended per row at a batch's last decode step, mean over "
        "sites and rows of the run. Batches are lm-eval's, left-padded. The prose "
        "tasks' haystack is pydoc_data.topics of the Python above. Loop `lm-eval`: lm-eval's own model loop "
        "(`simple_evaluate`, its batches); `shared prefill`: each sample prefilled once, exactly, and every "
        "policy continuing from that cache at batch 1, scored by lm-eval's task code (kvpass.bench.ruler; "
        "`s` there excludes the shared prefills).",
        "",
    ]
    if agreement:
        lines += [f"The two loops on the {agreement['n']} (policy, sample) pairs both ran: equal score on "
                  f"{agreement['same_score']:.3f} of them, equal answer text on {agreement['same_text']:.3f}.", ""]
    lines += [
        "| task | tokens | policy | loop | score | 95 % CI | n | compressed | attended | s (policy run) |",
        "|---|---:|---|---|---:|---|---:|---|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["task"], r["max_seq_length"], r["policy"] != EAGER,
                                         not r["policy"].startswith("Full"), r["policy"])):
        star = "*" if r.get("ci") == "normal" else ""
        chat = " (chat template)" if r.get("chat_template") else ""
        lines.append(f"| {r['task']}{chat} | {r['max_seq_length']} | `{r['policy']}` | {r.get('mode', 'lm-eval')} "
                     f"| {r['score']:.3f} | "
                     f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]{star} | {r['n']} | "
                     f"{'yes' if r['compressed'] else 'no'} | {r.get('attended_mean') or '-'} | {r['seconds']:.0f} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _command(args: argparse.Namespace) -> str:
    import shlex

    if Path(sys.argv[0]).name == "kvpass" and len(sys.argv) > 1 and sys.argv[1] == "bench":
        return shlex.join(["kvpass"] + sys.argv[1:])
    parts = ["kvpass", "bench", "--lm-eval", args.lm_eval, "--model", args.model,
             "--policies", args.policies or "Full"]
    for opt in ("budgets", "max_seq_lengths", "limit", "batch_size", "max_gen_toks", "threads", "results_md"):
        v = getattr(args, opt, None)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if getattr(args, "chat_template", False):
        parts.append("--chat-template")
    if getattr(args, "shared_prefill", False):
        parts.append("--shared-prefill")
    return shlex.join(parts + ["--out", str(args.out)])


# -- lm-eval's CLI with the kvpass model registered ------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (``lm-eval run ...``, or without ``run`` as lm-eval allows) with this
    module imported (the ``kvpass`` model registered), the prose RULER tasks on the task path, and, for
    ``pretrained=smollm2``, the bundled tokenizer's folder given to the RULER tasks as ``tokenizer``."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    cli = HarnessCLI()
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # HarnessCLI reads sys.argv (and inserts 'run' for the legacy form)
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "command", None) == "run":
        inc = getattr(args, "include_path", None)
        args.include_path = str(TASKS_DIR) if not inc else inc  # a user's own path wins
        margs = getattr(args, "model_args", None) or {}
        if getattr(args, "model", None) == "kvpass" and str(margs.get("pretrained", "smollm2")).lower() == "smollm2":
            args.metadata = {"tokenizer": _tokenizer_dir("smollm2")} | (getattr(args, "metadata", None) or {})
    setup_logging()
    cli.execute(args)


if __name__ == "__main__":
    from kvpass.bench.lm_eval import main as _main  # the module under its own name: its class is the registered one

    _main()

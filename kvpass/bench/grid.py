"""``kvpass bench`` without a mode option: the accuracy grid (:mod:`kvpass.bench.runner`), then perplexity
and kernel micro-benchmarks, the tables, and with ``--results-md`` the page (:mod:`kvpass.bench.report`).
Options in :func:`kvpass.bench.cli.add_arguments`."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from kvpass.bench.common import build_policies, calibrate_policies, load_model, parse_ints
from kvpass.bench.report import kernel_table, markdown_table, perplexity_table, write_results_md
from kvpass.bench.runner import (
    KERNELS, PERPLEXITY, RESULTS, load_results, run_grid, run_kernels, run_perplexity,
)
from kvpass.bench.tasks import all_tasks

__all__ = ["DEFAULTS", "GRID_POLICIES", "QUICK", "run"]

GRID_POLICIES = "Full,StreamingLLM,Quest,ClusterKV,CentroidKV"
QUICK = {
    "contexts": "2048,4096",
    "budgets": "256,1024",
    "tasks": "single_needle,multi_key_needle,variable_tracking",
    "samples": 1,
    "perplexity": "2048",
    "ppl_eval_tokens": 64,
}
DEFAULTS = {
    "contexts": "4096,8192",
    "budgets": "256,512,1024,2048",
    "tasks": None,  # every task
    "samples": 2,
    "perplexity": "2048,4096,8192",
    "ppl_eval_tokens": 128,
}


def _command(args: argparse.Namespace) -> str:
    """The command as typed when run as the ``kvpass`` script; otherwise (``main([...])`` in-process)
    the equivalent command rebuilt from the parsed options."""
    if Path(sys.argv[0]).name == "kvpass" and len(sys.argv) > 1 and sys.argv[1] == "bench":
        return shlex.join(["kvpass"] + sys.argv[1:])
    parts = ["kvpass", "bench", "--model", args.model, "--policies", args.policies or GRID_POLICIES]
    for opt in ("budgets", "contexts", "tasks", "samples", "new_tokens", "perplexity", "ppl_eval_tokens",
                "threads", "results_md"):
        v = getattr(args, opt)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    if args.haystack != "prose":
        parts += ["--haystack", args.haystack]
    if args.recall_every != 8:
        parts += ["--recall-every", str(args.recall_every)]
    if not args.kernels:
        parts.append("--no-kernels")
    if args.quick:
        parts.append("--quick")
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """``kvpass bench``: the accuracy grid."""
    preset = QUICK if args.quick else DEFAULTS
    contexts = parse_ints(args.contexts or preset["contexts"], "contexts")
    budgets = parse_ints(args.budgets or preset["budgets"], "budgets")
    tasks_arg = args.tasks or preset["tasks"]
    tasks = [t.strip() for t in tasks_arg.split(",") if t.strip()] if tasks_arg else all_tasks()
    bad = [t for t in tasks if t not in all_tasks()]
    if bad:
        raise ValueError(f"kvpass: unknown task(s) {bad}; expected some of {all_tasks()}")
    samples = args.samples if args.samples is not None else preset["samples"]
    if samples < 1:
        raise ValueError(f"kvpass: --samples needs a positive number, got {samples}")
    if args.threads is not None:
        n = parse_ints(str(args.threads), "threads")
        if len(n) != 1:
            raise ValueError(f"kvpass: the bench grid takes one --threads, got {args.threads!r} (lists are for "
                             "--decode-cost)")
        args.threads = n[0]
    if args.new_tokens is not None and args.new_tokens < 2:
        raise ValueError(f"kvpass: --new-tokens needs at least 2, got {args.new_tokens}")
    ppl_text = args.perplexity if args.perplexity is not None else preset["perplexity"]
    windows = [] if ppl_text.strip() == "0" else parse_ints(ppl_text, "perplexity")
    ppl_eval = args.ppl_eval_tokens if args.ppl_eval_tokens is not None else preset["ppl_eval_tokens"]
    if windows and not 1 <= ppl_eval < min(windows):
        raise ValueError(f"kvpass: --ppl-eval-tokens needs 1 <= N < the smallest window, got {ppl_eval}")
    policies = build_policies(args.policies or GRID_POLICIES, budgets)  # before the slow load: bad specs fail at once
    command = _command(args)
    out = Path(args.out)

    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        model, tok, model_name = load_model(args.model)
        out.mkdir(parents=True, exist_ok=True)
        policies = calibrate_policies(policies, model, tok, out, progress=not args.no_progress)

        def perplexities(backend, compiled):
            run_perplexity(model, tok, policies, windows, ppl_eval, out, model_name=model_name, command=command,
                           progress=not args.no_progress, backend=backend, compiled=compiled)

        run_grid(model, tok, policies, contexts, tasks, samples, out, seed=args.seed,
                 new_tokens=args.new_tokens, recall_every=args.recall_every, haystack=args.haystack,
                 progress=not args.no_progress, model_name=model_name, command=command,
                 on_done=perplexities if windows else None)
        if args.kernels:
            run_kernels(out, quick=args.quick, command=command)
    finally:
        torch.set_num_threads(threads)  # main() may run in-process (tests): leave torch as it was
    rows = load_results(out / RESULTS)
    print()
    print(markdown_table(rows))
    if windows:
        print()
        print(perplexity_table(load_results(out / PERPLEXITY)))
    if args.kernels:
        print()
        print(kernel_table(load_results(out / KERNELS)))
    if args.results_md:
        page = write_results_md(out, Path(args.results_md), command)
        print(f"\nkvpass bench: wrote {page}")
    print(f"kvpass bench: {len(rows)} cells in {out / RESULTS}; this run took {time.perf_counter() - t0:.0f} s",
          flush=True)
    return 0

"""kvpass bench: accuracy, attention recall, decode speed and memory of policies × budgets on long-context tasks.

Sweeps every non-Full policy of ``--policies`` over every budget of ``--budgets`` (through each class's
``with_budget``), against ``Full``, on generated RULER-style tasks (``kvpass.bench.tasks``) at each
context of ``--contexts``, with ONE compiled model (policies are swapped with ``set_policy``). Rows go
to ``OUT/results.jsonl`` as cells finish (a rerun skips finished cells); then the table is printed and,
with ``--results-md``, a page with the table and plots is written.

Then, unless switched off: perplexity of long prose (``--perplexity`` windows, every policy of the
grid, :mod:`kvpass.bench.perplexity`) into ``OUT/perplexity.jsonl`` and kernel micro-benchmarks
(:mod:`kvpass.bench.kernels`) into ``OUT/kernels.jsonl``; both appear on the page.

``--compile-time``: instead of the grid, seconds to the first tokens of a fresh process, compile
included, cold and warm, plain Inductor against kvpass: :mod:`kvpass.bench.compile_time`, rows in
``OUT/compile_time.jsonl``.

``--decode-cost``: instead of the grid, decode cost by context and by batch for eager HF, Full and each
policy (ms/token, ratios to Full and to the floor, bytes per step against the measured bandwidth, a
profiler breakdown): :mod:`kvpass.bench.decode_cost`, rows in ``OUT/decode_cost.jsonl``.

``--quick``: contexts 2048,4096, budgets 256,1024, tasks single_needle,multi_key_needle,
variable_tracking, 1 sample, the 9 default policies: 54 cells; perplexity at 2048 tokens (64 scored); quick
kernel shapes. Measured: 500 s on 2 idle cores (compile 116 s; ``kvpass bench --quick --out bench_out/quick3``),
728 s with ``--threads 1`` while another process held the other core. ``--model tiny``: a random 2-layer
Llama with SmolLM2's tokenizer, to check the suite end to end in seconds (structure only).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

import torch

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default=None, metavar="SPECS",
                   help="comma-separated policy specs, e.g. \"Full,StreamingLLM,Quest(page_size=32)\"; "
                        f"each non-Full one is swept over --budgets (default: {GRID_POLICIES}; with --decode-cost: "
                        "Full,StreamingLLM(budget=1024),Quest(budget=1024),ClusterKV(budget=1024),"
                        "CentroidKV(cache_ratio=0.25),TailorKV(), each as given)")
    p.add_argument("--budgets", default=None, metavar="N,N",
                   help=f"token budgets (default {DEFAULTS['budgets']}; --quick: {QUICK['budgets']})")
    p.add_argument("--contexts", default=None, metavar="N,N",
                   help=f"prompt sizes in tokens, capped to fit the model's positions with the new tokens "
                        f"(default {DEFAULTS['contexts']}; --quick: {QUICK['contexts']})")
    p.add_argument("--tasks", default=None, metavar="T,T",
                   help=f"tasks of kvpass.bench.tasks (default: all; --quick: {QUICK['tasks']})")
    p.add_argument("--samples", type=int, default=None, metavar="N",
                   help=f"samples (seeds) per task and context (default {DEFAULTS['samples']}; --quick: 1)")
    p.add_argument("--seed", type=int, default=0, help="first sample seed (default 0)")
    p.add_argument("--haystack", default="prose", choices=["prose", "filler"], help="default: prose")
    p.add_argument("--new-tokens", type=int, default=None, metavar="N",
                   help="tokens to generate per cell (default: per task, 16 for needles, up to 48 for lists)")
    p.add_argument("--recall-every", type=int, default=8, metavar="N",
                   help="measure attention recall every N-th decode step (default 8)")
    p.add_argument("--perplexity", default=None, metavar="W,W",
                   help=f"perplexity windows in tokens of pydoc_data.topics prose, every policy of the grid "
                        f"(default {DEFAULTS['perplexity']}; --quick: {QUICK['perplexity']}; 0: skip)")
    p.add_argument("--ppl-eval-tokens", type=int, default=None, metavar="N",
                   help=f"scored tokens at the end of each perplexity window (default "
                        f"{DEFAULTS['ppl_eval_tokens']}; --quick: {QUICK['ppl_eval_tokens']})")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="kernel micro-benchmarks (each kvpass op vs its dense torch equivalent; quick shapes "
                        "with --quick) into the results (default: on)")
    p.add_argument("--out", default="bench_out", metavar="DIR", help="results folder (default: %(default)s)")
    p.add_argument("--results-md", default=None, metavar="PATH",
                   help="also write a generated page (table, plots in PATH's stem folder next to it)")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                   help="smollm2 (the bundled SmolLM2-135M-Instruct) or tiny (random 2-layer Llama with "
                        "SmolLM2's tokenizer: structure only)")
    p.add_argument("--quick", action="store_true", help="a preset that finishes in under 10 minutes on 2 cores")
    p.add_argument("--threads", default=None, metavar="N",
                   help=f"torch CPU threads (default: torch's default, here {torch.get_num_threads()}); with "
                        "--decode-cost a list such as 1,2 (default there: 1 and torch's default; --quick: torch's "
                        "default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or per-cell lines")
    g = p.add_argument_group("decode cost", "kvpass bench --decode-cost: ms/token, bytes per step, bandwidth share "
                                            "and a profiler breakdown by context and by batch "
                                            "(kvpass.bench.decode_cost); --contexts, --policies, --threads, "
                                            "--out, --results-md, --model and --quick apply too")
    g.add_argument("--decode-cost", action="store_true",
                   help="measure decode cost instead of running the accuracy grid (rows in OUT/decode_cost.jsonl)")
    g.add_argument("--batches", default=None, metavar="N,N", help="batch sizes at --batch-context (default 1,4,8,16; "
                                                                 "--quick: 1,2)")
    g.add_argument("--batch-context", type=int, default=None, metavar="N",
                   help="context of the batch sweep (default 8192; --quick: 2048)")
    g.add_argument("--steps", type=int, default=None, metavar="N",
                   help="timed decode steps per cell, median reported (default 8; --quick: 4)")
    g.add_argument("--warmup-steps", type=int, default=3, metavar="N",
                   help="decode steps dropped per cell before timing (default %(default)s)")
    g.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="measure every cell N times, interleaved with the other cells of its graph, and report "
                        "the median of the rounds (default %(default)s; 3 makes the floors robust to a slow spell "
                        "of a shared machine)")
    g.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="ms/token on the tables and the page: the median of the timed steps (of the rounds' "
                        "medians), or the fastest timed step, the cost with the least interference from other "
                        "work (default %(default)s; re-summarises a finished --out without measuring)")
    g.add_argument("--paired", action="store_true",
                   help="time each compressed policy's steps alternating with its floor's (Full at the contexts "
                        "that bracket the tokens it attends) instead of cell after cell: ratios that a shared "
                        "machine's drift does not move (kvpass.bench.paired; rows in OUT/paired_cost.jsonl)")
    g.add_argument("--profile-steps", type=int, default=3, metavar="N",
                   help="extra profiled steps in the breakdown cells (default %(default)s; 0: no breakdown)")
    g.add_argument("--no-skinny-linear", dest="skinny_linear", action="store_false",
                   help="compile with kvpass(..., skinny_linear=False): decode linears as x @ W^T, to measure "
                        "what the weight-major and one-row forms buy (give it its own --out)")
    t = p.add_argument_group("throughput", "kvpass bench --throughput: tokens/s and bytes per row of left-padded "
                                           "batches of mixed lengths, each policy against Full in the same run "
                                           "(kvpass.bench.throughput); --batches (default 1,4,8,16), --policies, "
                                           "--steps, --threads, --out, --results-md, --model and --quick apply too")
    t.add_argument("--throughput", action="store_true",
                   help="measure padded-batch throughput instead of running the accuracy grid (rows in "
                        "OUT/throughput.jsonl)")
    t.add_argument("--task", default=None, metavar="TASK",
                   help="each row of a batch is a sample of TASK (e.g. single_needle) of about its length, "
                        "prefilled on its own, decoded for the task's answer length and scored: the accuracy of "
                        "each row on its task (default: prefixes of one prose prefill, no task)")
    t.add_argument("--lengths", default=None, metavar="LO-HI",
                   help="prompt lengths of a batch, spread evenly over LO-HI (default 2048-8192; --quick: 1024-2048)")
    c = p.add_argument_group("compile time", "kvpass bench --compile-time: seconds from torch.compile to the last "
                                             "of --new-tokens tokens (default 8) after a --contexts prompt "
                                             "(default 64) in fresh processes, cold and warm, plain Inductor and "
                                             "kvpass(policy) for each of --policies (default Full), at one "
                                             "--threads; --results-md writes the page (kvpass.bench.compile_time)")
    c.add_argument("--compile-time", action="store_true",
                   help="measure compile time instead of running the accuracy grid (rows in OUT/compile_time.jsonl)")
    e = p.add_argument_group("lm-eval", "kvpass bench --lm-eval TASKS: lm-evaluation-harness's simple_evaluate of "
                                        "TASKS for each of --policies (default Full; a spec without its own budget "
                                        "is swept over --budgets, default 1024 here; 'eager' runs the model "
                                        "uncompiled) through the lm-eval model 'kvpass' "
                                        "(kvpass.bench.lm_eval; needs pip install 'kvpass[eval]'); --model, --out, "
                                        "--results-md (default OUT/lm-eval.md) and --threads apply too")
    e.add_argument("--lm-eval", default=None, metavar="TASKS",
                   help="comma-separated lm-eval tasks, e.g. niah_single_2_prose,niah_single_1 (the prose RULER "
                        "tasks of kvpass.bench.ruler_tasks and lm-eval's own); rows in OUT/lm_eval.jsonl")
    e.add_argument("--limit", type=int, default=None, metavar="N", help="samples per task and length (default: all)")
    e.add_argument("--max-seq-lengths", default=None, metavar="N,N",
                   help="RULER's sample lengths in tokens, answer reserve included (default 4096)")
    e.add_argument("--batch-size", type=int, default=4, metavar="N",
                   help="lm-eval's batch size: its batches are left-padded (default %(default)s)")
    e.add_argument("--max-gen-toks", type=int, default=None, metavar="N",
                   help="override the task's max_gen_toks (RULER: 128; the answer is the first tokens)")
    e.add_argument("--chat-template", action="store_true",
                   help="lm-eval's apply_chat_template: each prompt as one user turn of the model's chat template")
    f = p.add_argument_group("fidelity", "kvpass bench --fidelity: top-1 agreement with Full and KL(Full || policy) "
                                         "of the next token, teacher-forced on Full's greedy continuation of pydoc "
                                         "prose (kvpass.bench.fidelity); --contexts (default 4096), --policies "
                                         "(each non-Full one at --budgets, default 512,1024,2048; CentroidKV at ratios "
                                         "0.125,0.25,0.5), --steps (default 64), --out, --results-md (default "
                                         "OUT/fidelity.md). kvpass bench --faithfulness: the faithfulness oracle "
                                         "(kvpass.bench.faithfulness) at --contexts (default 8192) for --steps "
                                         "(default 32) of each of --policies as given")
    f.add_argument("--fidelity", action="store_true",
                   help="measure fidelity to Full instead of running the accuracy grid (rows in OUT/fidelity.jsonl)")
    f.add_argument("--prompts", type=int, default=None, metavar="N", help="prose prompts per context (default 20)")
    f.add_argument("--faithfulness", action="store_true",
                   help="check every decode step against attention over what its policy says it attended (rows "
                        "in OUT/faithfulness.jsonl; exit status 1 when a step fails)")


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
    from kvpass.policies.parse import parse_policy
    from kvpass.policies.full import Full

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
    import dataclasses

    from kvpass.policies.tailorkv import TailorKV

    need = [p for p in policies if isinstance(p, TailorKV) and p.profile == "auto"]
    if not need:
        return policies
    from kvpass.bench.perplexity import topics_text
    from kvpass.tailorkv import Profile, calibrate, config_key

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
    from kvpass.models import load_smollm2, smollm2_cache_path

    first = not (smollm2_cache_path() / "kvpass.json").exists()
    model, tok = load_smollm2(progress=first)
    if name == "tiny":
        del model
        return tiny_model(len(tok)), tok, "tiny"
    return model, tok, "SmolLM2-135M-Instruct"


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
    if getattr(args, "lm_eval", None):
        try:
            from kvpass.bench.lm_eval import run_bench as run_lm_eval
        except ModuleNotFoundError as e:
            if e.name not in ("lm_eval", "wonderwords", "nltk"):
                raise
            raise ModuleNotFoundError(f"kvpass: --lm-eval needs the optional extra: pip install 'kvpass[eval]' "
                                      f"(missing: {e.name})") from e
        return run_lm_eval(args)
    if getattr(args, "fidelity", False):
        from kvpass.bench.fidelity import run as run_fidelity

        return run_fidelity(args)
    if getattr(args, "faithfulness", False):
        from kvpass.bench.faithfulness import run as run_faithfulness

        return run_faithfulness(args)
    if getattr(args, "compile_time", False):
        from kvpass.bench.compile_time import run as run_compile_time

        return run_compile_time(args)
    if getattr(args, "throughput", False):
        from kvpass.bench.throughput import run as run_throughput

        return run_throughput(args)
    if getattr(args, "paired", False) and not getattr(args, "decode_cost", False):
        raise ValueError("kvpass: --paired is a way of measuring decode cost: give it with --decode-cost")
    if getattr(args, "decode_cost", False):
        from kvpass.bench.decode_cost import run as run_decode_cost

        return run_decode_cost(args)
    from kvpass.bench.report import markdown_table, write_results_md
    from kvpass.bench.runner import RESULTS, load_results, run_grid
    from kvpass.bench.tasks import all_tasks

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
        from kvpass.bench.runner import run_perplexity

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
            from kvpass.bench.runner import run_kernels

            run_kernels(out, quick=args.quick, command=command)
    finally:
        torch.set_num_threads(threads)  # main() may run in-process (tests): leave torch as it was
    from kvpass.bench.report import kernel_table, perplexity_table
    from kvpass.bench.runner import KERNELS, PERPLEXITY

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

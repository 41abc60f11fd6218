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
kernel shapes. Measured: 500 s on 2 idle cores (compile 116 s; ``kvpass bench --quick --out bench_out/quick-<date>``),
728 s with ``--threads 1`` while another process held the other core. ``--model tiny``: a random 2-layer
Llama with SmolLM2's tokenizer, to check the suite end to end in seconds (structure only).
"""

from __future__ import annotations

import argparse

import torch

from kvpass.bench import compile_time, decode_cost, faithfulness, fidelity, grid, paired, throughput
from kvpass.bench.grid import DEFAULTS, GRID_POLICIES, QUICK

#: ``(option, the module whose run(args) measures it)``, in the order they are tried; none given: the
#: accuracy grid (:mod:`kvpass.bench.grid`). ``--lm-eval`` comes first, imported only then (an optional
#: extra). This module only parses and dispatches: what the modes share is in :mod:`kvpass.bench.common`.
MODES = (
    ("fidelity", fidelity),
    ("faithfulness", faithfulness),
    ("compile_time", compile_time),
    ("throughput", throughput),
    ("paired", paired),
    ("decode_cost", decode_cost),
)


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
    e.add_argument("--shared-prefill", action="store_true",
                   help="prefill each sample once, exactly, and continue every policy from that cache at batch 1, "
                        "scored by lm-eval's task code (kvpass.bench.ruler), instead of lm-eval's own loop")
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


def run(args: argparse.Namespace) -> int:
    """Run the mode ``args`` asks for: one of the groups above, else the accuracy grid."""
    if getattr(args, "lm_eval", None):
        try:  # lm-eval is the optional extra kvpass[eval]
            from kvpass.bench.lm_eval import run_bench as run_lm_eval
            from kvpass.bench.ruler import run_bench_shared
        except ModuleNotFoundError as e:
            if e.name not in ("lm_eval", "wonderwords", "nltk"):
                raise
            raise ModuleNotFoundError(f"kvpass: --lm-eval needs the optional extra: pip install 'kvpass[eval]' "
                                      f"(missing: {e.name})") from e
        return run_bench_shared(args) if getattr(args, "shared_prefill", False) else run_lm_eval(args)
    if getattr(args, "paired", False) and not getattr(args, "decode_cost", False):
        raise ValueError("kvpass: --paired is a way of measuring decode cost: give it with --decode-cost")
    for flag, mode in MODES:
        if getattr(args, flag, False):
            return mode.run(args)
    return grid.run(args)


"""``kvpass bench --decode-cost --paired``: each compressed policy's decode step against its floor, step by step.

::

    kvpass bench --decode-cost --paired --threads 1,2 --contexts 1024,4096,8192 --batches 1,8 \\
        --out bench_out/decode-cost-paired-<date> --results-md docs/results/decode-cost-paired.md

:mod:`kvpass.bench.decode_cost` times whole cells one after the other (a fresh cache, the dropped steps,
the timed steps) and compares a policy's median with Full's median of another cell, measured seconds or
minutes apart: on shared cores whose speed drifts by a third within a minute, a ratio of a few percent
is inside that drift. Here the two sides of each ratio are measured a few tens of milliseconds apart:

- **A group per policy cell** (policy, context C, batch B, threads): the policy decodes on its own cache
  (its dropped ``--warmup-steps`` first), which gives N, the tokens it attends per site (the report,
  averaged over the sites); the floor F(N, B) is Full's step at the measured ``--contexts`` that bracket
  N (interpolated linearly, as on the decode-cost page: :func:`kvpass.bench.decode_cost.bracket`), else at
  the nearest one. Full decodes at those contexts and at C (for × Full), each on a cache and a backend of
  its own (a backend holds one sequence), its dropped steps first. Every member's cache starts from its
  context minus the dropped steps and the rotations (:func:`kvpass.bench.decode_cost.start_tokens`): its
  last step attends its context.
- **Rotations**: ``--steps`` times, one decode step of each member of the group, the order reversed
  every other rotation. Each rotation gives a ratio policy step / F (F from that rotation's Full steps)
  and policy step / Full's step at C; a row reports the median of each over the rotations and the
  quartiles of the first, which say how much the machine moved within the group.
- **Graphs**: one backend per graph key for the policies and one Full backend per context, each compiled
  and warmed up on short contexts before any group (``kvpass.bench.decode_cost.warm_up``); a row counts the
  graphs compiled during its rotations (0 expected).
- **Resumable**: rows go to ``OUT/paired_cost.jsonl`` as groups finish; a rerun skips the cells there.
- **Targets**: the page ends each thread count with the decode-cost targets its groups measure
  (:func:`paired_targets`); Full against eager HF stays on the decode-cost page (eager is not paired).

The cells are the decode-cost page's compressed ones: every policy of ``--policies`` but Full at every
context (``--batch-context`` included: Full runs there too) at batch 1 and at every batch at
``--batch-context``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from kvpass import kvpass
from kvpass.bench.decode_cost import (
    DISTURBED, EAGER, NOT_A_MEASUREMENT, _cell_kv, _decode, _now, _plan, _site_sums, bracket, check_grid,
    context_sentence, floor_at, floor_label, last_tokens, machine_line, page_head, prefill, resume,
    settings, start_tokens, target_checks, target_lines, targets_title, warm_up,
)
from kvpass.bench.common import load_for_bench
from kvpass.bench.runner import _append, _model_name, load_results, machine_info, policy_budget, policy_label
from kvpass.bench.timing import cache_from, graph_keys_kept
from kvpass.policies.base import Policy
from kvpass.policies.full import Full

__all__ = ["RESULTS", "run", "run_paired", "paired_table", "paired_targets", "write_paired_md"]

RESULTS = "paired_cost.jsonl"


def _cells(policies: list[Policy], contexts: list[int], batches: list[int], batch_context: int):
    """``[(policy, context, batch)]``: the decode-cost plan's cells of the compressed policies (Full is the
    floor, eager not measured here)."""

    return [g for g in _plan(policies, contexts, batches, batch_context)
            if g[0] != EAGER and not isinstance(g[0], Full)]


def quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles (``statistics.quantiles``, exclusive method; the value itself for one)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def run_paired(
    model,
    tokenizer,
    policies: list[Policy],
    contexts: list[int],
    batches: list[int],
    out_dir: Path,
    *,
    batch_context: int,
    threads: list[int],
    steps: int = 8,
    warmup_steps: int = 3,
    model_name: str | None = None,
    command: str = "",
    progress: bool = True,
    skinny_linear: bool = True,
) -> list[dict[str, Any]]:
    """Measure every group not yet in ``out_dir/paired_cost.jsonl`` (see the module docstring); return the
    rows of this call's cells."""

    check_grid("paired decode cost", contexts, batches, steps=steps, warmup_steps=warmup_steps)
    contexts = sorted(set(contexts) | {int(batch_context)})  # Full runs at each: a floor or a cell's own context
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS
    model_name = model_name or _model_name(model)
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    cells = _cells(policies, contexts, batches, batch_context)

    def key_of(p, c, b, t) -> tuple:
        return (model_name, p.describe(), int(c), int(b), int(t))

    results, pending = resume(path, cells, threads, key_of, skinny_linear, "paired groups", progress)
    if not pending:
        return [results[key_of(p, c, b, t)] for t in threads for p, c, b in cells]
    old_threads = torch.get_num_threads()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")
            prefill_kv, first_ids, _ = prefill(model, tokenizer, min(max(contexts), max_pos), progress)
            for t in threads:
                todo = [g for g in pending if g[0] == t]
                if not todo:
                    continue
                torch.set_num_threads(t)
                gc.collect()
                machine = machine_info()
                batches_t = sorted({b for _, _, _, b in todo})
                keys: dict[str, list] = {}
                for g in todo:
                    keys.setdefault(g[1].graph_key(), []).append(g)
                with graph_keys_kept(len(keys) + len(contexts)):
                    runners: dict[Any, tuple] = {}  # graph key or ("Full", context) -> (backend, fwd)
                    t0 = time.perf_counter()
                    for gk, gs in keys.items():
                        backend = kvpass(gs[0][1], skinny_linear=skinny_linear)
                        fwd = torch.compile(model.forward, backend=backend, dynamic=True)
                        warm_up(model, backend, fwd, gs[0][1], [(g[2], g[3]) for g in gs], prefill_kv, first_ids,
                                warmup_steps)
                        runners[gk] = (backend, fwd)
                    for c in contexts:  # every context may be a floor: one Full backend each
                        backend = kvpass(Full(), skinny_linear=skinny_linear)
                        fwd = torch.compile(model.forward, backend=backend, dynamic=True)
                        warm_up(model, backend, fwd, Full(), [(c, b) for b in batches_t], prefill_kv, first_ids,
                                warmup_steps)
                        runners[("Full", c)] = (backend, fwd)
                    if progress:
                        print(f"kvpass bench --decode-cost --paired: {len(runners)} backend(s) compiled and warmed "
                              f"up in {time.perf_counter() - t0:.0f} s ({t} thread(s))", flush=True)
                    for _, p, c, b in todo:
                        row = _group(model, runners, p, c, b, contexts, prefill_kv, first_ids, steps, warmup_steps)
                        row.update({"model": model_name, "policy": p.describe(), "policy_name": policy_label(p),
                                    "budget": policy_budget(p), "context": int(c), "batch": int(b), "threads": int(t),
                                    "beyond_positions": c > max_pos,
                                    "skinny_linear": skinny_linear, "machine": machine, "command": command,
                                    "finished": _now()})
                        _append(path, row)
                        results[key_of(p, c, b, t)] = row
                        if progress:
                            q1, q3 = row["vs_floor_quartiles"]
                            print(f"  {row['policy_name']:<28} ctx={c:<6} batch={b:<3} x floor {row['vs_floor']:.3f} "
                                  f"(quartiles {q1:.3f}-{q3:.3f}; Full at {row['floor_at']}), x Full "
                                  f"{row['vs_full']:.3f}, {row['policy_ms']:.1f} ms/token", flush=True)
                    runners.clear()
    finally:
        torch.set_num_threads(old_threads)
        torch._dynamo.reset()
    return [results[key_of(p, c, b, t)] for t in threads for p, c, b in cells]


def _group(model, runners, policy, context, batch, contexts, prefill_kv, first_ids, steps, warmup_steps):
    """One policy cell and its floors, stepped in rotations (the module docstring); the row's measurements."""
    gc.collect()
    backend, fwd = runners[policy.graph_key()]
    backend.set_policy(policy)
    members = []  # [name, fwd, cache, next ids, backend]

    def join(name, fwd, backend, c):
        """A member on its own cache of context ``c`` (it ends there: ``start_tokens``), its dropped steps run."""
        start = start_tokens(c, warmup_steps, steps)
        cache = backend.adopt(cache_from(model, _cell_kv(prefill_kv, start, batch)))
        ids, _ = _decode(fwd, cache, first_ids(start, batch), warmup_steps)
        members.append([name, fwd, cache, ids, backend])
        return start

    start = join("policy", fwd, backend, context)
    s = _site_sums(backend)
    n = max(1.0, s["tokens_attended"] / max(1, s["sites"]))
    at, w = bracket(n, contexts)
    for c in dict.fromkeys(at + (context,)):
        fb, ffwd = runners[("Full", c)]
        join(c, ffwd, fb, c)
    graphs0 = sum(len(m[4].graphs) for m in members)
    ms: dict[Any, list[float]] = {m[0]: [] for m in members}
    for i in range(steps):
        for m in (members if i % 2 == 0 else members[::-1]):
            m[3], (dt,) = _decode(m[1], m[2], m[3], 1)
            ms[m[0]].append(1000 * dt)
    graphs = sum(len(m[4].graphs) for m in members) - graphs0
    floors = [floor_at(at, w, {c: ms[c][i] for c in at}) for i in range(steps)]
    vs_floor = [ms["policy"][i] / floors[i] for i in range(steps)]
    vs_full = [ms["policy"][i] / ms[context][i] for i in range(steps)]
    del members
    return {
        "steps": steps, "warmup_steps": warmup_steps, "start_tokens": start, "attended_per_site": n, "floor_contexts": list(at),
        "floor_weight": w, "floor_at": floor_label(n, at),
        "policy_step_ms": ms["policy"], "full_step_ms": {str(c): ms[c] for c in ms if c != "policy"},
        "vs_floor_steps": vs_floor, "vs_full_steps": vs_full,
        "vs_floor": statistics.median(vs_floor), "vs_floor_quartiles": list(quartiles(vs_floor)),
        "vs_full": statistics.median(vs_full), "policy_ms": statistics.median(ms["policy"]),
        "floor_ms": statistics.median(floors), "graphs_compiled_timed": graphs,
    }


def paired_targets(sel: list[dict[str, Any]]) -> list[str]:
    """The decode-cost targets (:func:`kvpass.bench.decode_cost.target_checks`) measured by one thread
    count's groups ``sel``, the batch sweep's context being the largest with a batch above 1. Each value is
    the group's median over its rotations (the 32k speed-up: of Full's step over the policy's); eager HF is
    not paired, so Full against eager is not here. Groups written without a budget give no "covers" line."""
    batch_ctx = max((r["context"] for r in sel if r["batch"] > 1), default=None)
    order = list(dict.fromkeys(r["policy"] for r in sel))
    cells = [{"policy": r["policy"], "name": r["policy_name"], "label": r["policy_name"], "context": r["context"],
              "batch": r["batch"], "budget": r.get("budget"), "last": last_tokens(r), "vs_floor": r["vs_floor"],
              "vs_full": r["vs_full"],
              "speedup": statistics.median(1 / x for x in r["vs_full_steps"]),
              "bound": statistics.median(f / p for f, p in zip(r["vs_floor_steps"], r["vs_full_steps"])),
              "disturbed": r["vs_floor"] < DISTURBED}
             for r in sorted(sel, key=lambda r: order.index(r["policy"]))]
    return target_lines(target_checks(cells, batch_ctx))


def paired_table(rows: list[dict[str, Any]]) -> str:
    """The page's tables: per model and thread count, one line per policy cell, then the targets those cells
    measure (:func:`paired_targets`)."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for t in sorted({r["threads"] for r in rows if r["model"] == model}):
            sel = sorted((r for r in rows if r["model"] == model and r["threads"] == t),
                         key=lambda r: (r["batch"], r["context"]))
            head = ["policy", "context", "batch", "× floor (median of steps)", "quartiles", "floor: Full at (N: contexts)",
                    "× Full at the context", "policy ms/token", "floor ms/token", "graphs in timed steps"]
            parts += [f"### {model}, {t} thread(s)", "", "| " + " | ".join(head) + " |",
                      "|" + "|".join(["---", "---:", "---:", "---:", "---", "---", "---:", "---:", "---:", "---:"]) + "|"]
            order = list(dict.fromkeys(r["policy"] for r in rows))
            for r in sorted(sel, key=lambda r: (order.index(r["policy"]), r["batch"], r["context"])):
                q1, q3 = r["vs_floor_quartiles"]
                parts.append("| " + " | ".join([
                    r["policy_name"], str(r["context"]), str(r["batch"]), f"{r['vs_floor']:.2f}×",
                    f"{q1:.2f}–{q3:.2f}", r["floor_at"], f"{r['vs_full']:.2f}×", f"{r['policy_ms']:.1f}",
                    f"{r['floor_ms']:.1f}", str(r["graphs_compiled_timed"])]) + " |")
            tt = paired_targets(sel)
            if tt:
                parts += ["", targets_title(tt, "each value the median over its group's rotations; kvpass Full "
                                                "against eager HF is on docs/results/decode-cost.md, eager is not paired; "
                                                "attention recall and accuracy at 8k are on "
                                                "docs/results/clusterkv-vs-quest-8k.md"), ""] + tt
                if any(line.endswith(f"| {NOT_A_MEASUREMENT} |") for line in tt):
                    parts += ["", f"‡ faster than {DISTURBED}× its floor: a compressed step cannot cost much less "
                                  "than Full's step over the tokens it attends; that ratio does not measure the "
                                  "policy."]
            parts.append("")
    return "\n".join(parts)


def write_paired_md(out_dir: Path, path: Path, command: str) -> Path:
    """The generated page from ``out_dir/paired_cost.jsonl``."""

    rows = load_results(Path(out_dir) / RESULTS)
    if not rows:
        raise ValueError(f"kvpass: no results in {Path(out_dir) / RESULTS}; run `kvpass bench --decode-cost "
                         "--paired` first")
    commands = list(dict.fromkeys([command] + [r.get("command", "") for r in rows]))
    machines = {r["threads"]: r["machine"] for r in rows}
    steps = sorted({r["steps"] for r in rows})
    warm = sorted({r["warmup_steps"] for r in rows})
    compiled = sum(r["graphs_compiled_timed"] for r in rows)
    lines = page_head("# Decode cost, each step paired with its floor",
                      "`kvpass bench --decode-cost --paired` (kvpass.bench.paired.write_paired_md)",
                      "kvpass/bench/paired.py", commands)
    lines += [machine_line(t, m) for t, m in sorted(machines.items())]
    lines += [
        "",
        f"{len(rows)} groups, finished between {min(r['finished'] for r in rows)} and "
        f"{max(r['finished'] for r in rows)} (UTC).",
        "",
        "## How it was measured",
        "",
        "- **Why paired**: docs/results/decode-cost.md times each cell's steps in a row and divides a policy's median by "
        "Full's median of another cell; on these shared cores the machine's speed moves by up to a third "
        "between the two, more than the few percent the targets are about. Here both sides of each ratio "
        "are measured tens of milliseconds apart.",
        "- **A group per policy cell**: the policy decodes on its own cache (the cache of docs/results/decode-cost.md: "
        f"one exact prefill of the prose, its prefix or repeats, a batch of copies). {context_sentence(rows)} After "
        f"its {', '.join(map(str, warm))} dropped step(s) the policy's report gives N, the tokens it attends per site "
        "(averaged over the sites). Its floor F(N, B) is Full's step at the measured contexts that bracket N, "
        "interpolated linearly, else at the nearest (`floor: Full at`). Full decodes at those contexts and at "
        "the cell's context, each on its own cache and backend, after its own dropped steps.",
        f"- **Rotations**: {', '.join(map(str, steps))} times one decode step of every member of the group, the "
        "order reversed every other time. Each rotation gives policy step / F (F from that rotation's Full "
        "steps) and policy step / Full's step at the cell's context; the tables give the median of each over "
        "the rotations, and the quartiles of the first (how much the machine moved within the group).",
        "- **Graphs**: one backend per policy graph key and one Full backend per context, compiled and warmed "
        f"up on short contexts first; graphs compiled during the rotations, summed over all groups: **{compiled}**.",
    ]
    if any(r["beyond_positions"] for r in rows):
        lines.append("- **Past the trained window**: contexts beyond the model's positions (repeated keys and "
                     "values) measure speed only, not a usable model.")
    lines += ["", "## Results", "", paired_table(rows)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def run(args: argparse.Namespace) -> int:
    """``kvpass bench --decode-cost --paired`` (options in :func:`kvpass.bench.cli.add_arguments`)."""
    contexts, batches, batch_context, steps, threads, policies, command = settings(args)
    t0 = time.perf_counter()
    model, tok, model_name, policies, out = load_for_bench(args, policies)
    run_paired(model, tok, policies, contexts, batches, out, batch_context=batch_context, threads=threads,
               steps=steps, warmup_steps=args.warmup_steps, model_name=model_name, command=command,
               progress=not args.no_progress, skinny_linear=args.skinny_linear)
    rows = [r for r in load_results(out / RESULTS) if r["model"] == model_name]
    print()
    print(paired_table(rows))
    if args.results_md:
        print(f"kvpass bench --decode-cost --paired: wrote {write_paired_md(out, Path(args.results_md), command)}")
    print(f"kvpass bench --decode-cost --paired: {len(rows)} groups in {out / RESULTS}; this run took "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0

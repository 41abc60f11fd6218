"""``kvpass bench --decode-cost``: what one decode step costs, per policy, by context and by batch.

::

    kvpass bench --decode-cost --quick                                   # smoke run: a few minutes
    kvpass bench --decode-cost --threads 1,2 --results-md docs/results/decode-cost.md --out bench_out/decode-cost-<date>
    kvpass bench --decode-cost --model tiny --contexts 64,128 --batches 1,2 --threads 1   # structure only

Every figure comes from ONE process, for eager Hugging Face (``model.forward`` uncompiled, DynamicCache),
``Full`` through kvpass, and every policy of ``--policies`` (default: Full, StreamingLLM(budget=1024),
Quest(budget=1024), ClusterKV(budget=1024), CentroidKV(cache_ratio=0.25), TailorKV()):

- **by context** (``--contexts``, default 1k..32k) at batch 1, and **by batch** (``--batches``, default
  1,4,8,16) at ``--batch-context`` (default 8192). Full is also run at every context up to the batch
  context at every batch, so that each compressed cell has its floor (below).
- **The cache**: ONE exact prefill of ``min(max context, model positions)`` tokens of ``pydoc_data.topics``
  prose with the model's own forward. A context up to that length takes the prefix of its keys and values
  (a causal prefill of the prefix gives the same); a longer one repeats them along the sequence (positions
  continue past the model's trained window, which RoPE accepts: those columns measure speed only); a batch
  of B is B copies of the row. A cell of context C starts from C minus its dropped and timed steps tokens
  (:func:`start_tokens`), so that its last timed step attends C tokens and a budget of C covers every
  step. Each cell puts the tensors into a fresh ``DynamicCache``
  (``cache.update(k, v, layer)``) and decodes greedily with a hand loop
  ``out = fwd(input_ids=ids, past_key_values=cache, use_cache=True)`` under ``torch.no_grad()``.
- **Time**: ``--warmup-steps`` steps are dropped (the policy adopts the real cache at its first step and
  builds its metadata there), then the median ms/token of ``--steps`` timed steps. Each graph key is
  compiled once per thread count (one backend each, ``dynamic=True``; ``torch._dynamo.reset()`` between
  thread counts, dynamo's recompile limit raised to hold every key's graphs at once) and warmed up on
  short contexts at batch 1 and 2 first; the row records how many graphs were compiled during its
  warm-up and its timed steps (``len(backend.graphs)``; 0 expected in the timed steps).
- **Rounds** (``--rounds R``, default 1): every cell of a thread count (eager, Full and every policy,
  whatever graph it runs) is measured R times, one cell after the other and in the opposite order every
  other round, each time with a fresh cache and its dropped steps; ms/token is the median of the R medians
  (``round_ms`` keeps them). The floors (Full) are thus measured interleaved with every policy: a slow
  spell of a shared machine moves the floor and the policy alike instead of one of them. A thread count's
  rows are written when its last round ends.
  A compressed cell below 0.9× its floor (:data:`DISTURBED`) is marked ‡ on the page: the two were measured
  on a machine running at different speeds.
- **Statistic** (``--statistic median|min``, default median): what ms/token is on the tables and the page
  (:func:`restat`): the median as above, or the fastest timed step of the cell. Every timed step is in the
  rows, so ``--statistic`` also re-summarises a finished ``--out`` folder without measuring again.
- **Bytes a step must read** (:func:`weight_bytes`, :func:`step_bytes`): every parameter once (linear
  weights, norms, the LM head; a tied embedding once, as the LM head; an untied embedding one row per
  sequence), the attended KV (``tokens_attended`` of ``backend.report_rows()`` summed over sites × 2 ×
  H_kv × head_dim × element size × batch) and, for compressed policies, the metadata bound
  ``device_bytes - tokens_held × 2 × H_kv × head_dim × element size × batch`` per site (everything the
  site holds on the device beyond its keys and values, buffer slack included: an upper bound) plus the
  site's ``selection_bytes`` (what its selection read from a host tier: TailorKV's key channels). Achieved
  GB/s = bytes / step time, and its share of this machine's bandwidth, measured by the command at the
  same thread count (:func:`measure_bandwidth`: the best of a few 512 MB tensor sums and copies).
- **Breakdown** (:func:`breakdown`): ``--profile-steps`` extra steps under ``torch.profiler`` in the cells
  ``(batch context, batch 1)`` and ``(batch context, batch 8 or the largest)``, between the dropped and the
  timed steps (the cell starts that many tokens earlier: they too attend at most the context); self CPU time (main
  thread) goes to ``selection`` (``kvpass.select`` ranges), ``gather+attention`` (``kvpass.attend``
  ranges, and SDPA anywhere else; without ranges, SDPA / bmm / matmul under a ``kvpass::`` op),
  ``bookkeeping`` (``kvpass.bookkeeping`` ranges), ``runtime`` (the rest of the time inside ``kvpass::``
  ops) and ``rest`` (linear layers and everything else: the profiled step time minus the other buckets,
  so the buckets sum to the step time). Quest's and ClusterKV's CPU steps attend inside their selection's
  C call, so their ``selection`` holds their attention.
- **Threads**: ``--threads 1,2`` runs each thread count in turn (Inductor's C++ kernels fix their OpenMP
  thread count when compiled, so each thread count compiles its own graphs). Default: 1 and torch's
  default; with ``--quick`` torch's default only.
- **Resumable**: rows go to ``OUT/decode_cost.jsonl`` as cells finish; a rerun skips the cells there
  (same model, policy, context, batch, threads). ``--results-md PATH`` writes a page with the tables and
  PNG plots (in the folder named after PATH's stem, next to it).

- **Paired** (``--paired``): instead of the cells above, each compressed policy's steps alternate with its
  floor's, one step each (:mod:`kvpass.bench.paired`, rows in ``OUT/paired_cost.jsonl``).

``--quick``: contexts 1024,2048, batches 1,2 at 2048, 4 timed steps, torch's default threads (22 cells; 2186 s
measured while two other processes shared the 2 cores, mostly the two compiles).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import shlex
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from kvpass import kvpass
from kvpass.bench.common import load_for_bench, parse_ints, parse_policies
from kvpass.bench.prompts import topics_text
from kvpass.bench.report import page_rows_and_plots
from kvpass.bench.runner import _append, _model_name, load_results, machine_info, policy_budget, policy_label
from kvpass.bench.timing import cache_from, cache_tensors, graph_keys_kept
from kvpass.policies.base import Policy
from kvpass.policies.full import Full

__all__ = ["DEFAULT_POLICIES", "RESULTS", "weight_bytes", "kv_bytes_per_token", "step_bytes", "measure_bandwidth",
           "breakdown", "parse_policies", "run_decode_cost", "markdown_tables", "write_decode_cost_md", "run"]

RESULTS = "decode_cost.jsonl"
DEFAULT_POLICIES = ("Full,StreamingLLM(budget=1024),Quest(budget=1024),ClusterKV(budget=1024),"
                    "CentroidKV(cache_ratio=0.25),TailorKV()")
DEFAULTS = {"contexts": "1024,2048,4096,8192,16384,32768", "batches": "1,4,8,16", "batch_context": 8192,
            "steps": 8}
QUICK = {"contexts": "1024,2048", "batches": "1,2", "batch_context": 2048, "steps": 4}
EAGER = "eager"
BUCKETS = ("selection", "gather+attention", "bookkeeping", "runtime", "rest")
RANGES = {"kvpass.select": "selection", "kvpass.attend": "gather+attention", "kvpass.bookkeeping": "bookkeeping"}
_WARM_CONTEXTS = (48, 80)


# --------------------------------------------------------------------------------------- bytes model


def weight_bytes(model, batch: int = 1) -> dict[str, int]:
    """Bytes of parameters one decode step reads: every parameter once (``model.parameters()`` yields a
    tied tensor once), except an input embedding that is not the LM head's matrix, of which the lookup
    reads one row per sequence. ``{"weights": ..., "embedding_rows": ..., "total": ...}``."""
    emb = model.get_input_embeddings().weight
    head_mod = model.get_output_embeddings()
    head = head_mod.weight if head_mod is not None else None
    tied = head is not None and head is emb
    total = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)
    rows = 0 if tied else batch * emb.shape[1] * emb.element_size()
    return {"weights": int(total), "embedding_rows": int(rows), "total": int(total + rows)}


def kv_bytes_per_token(kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of K and V of one token of one sequence at one site."""
    return 2 * kv_heads * head_dim * element_size


def step_bytes(weights: int, tokens_attended: int, per_token: int, batch: int, metadata: int = 0) -> dict[str, int]:
    """``tokens_attended``: summed over sites, per sequence; ``per_token``: :func:`kv_bytes_per_token`."""
    kv = int(tokens_attended) * per_token * batch
    return {"weights": int(weights), "kv": kv, "metadata": int(metadata), "total": int(weights) + kv + int(metadata)}


def measure_bandwidth(mb: int = 512, repeats: int = 5) -> dict[str, float]:
    """This machine's memory bandwidth at the current torch thread count: the best of ``repeats`` sums of an
    ``mb`` MB fp32 tensor (bytes read / time) and copies into another (bytes read + written / time)."""
    n = mb * (1 << 20) // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    best_sum, best_copy = 0.0, 0.0
    src.sum()
    dst.copy_(src)
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best_sum = max(best_sum, nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = max(best_copy, 2 * nbytes / (time.perf_counter() - t0) / 1e9)
    del src, dst
    return {"sum_gbps": best_sum, "copy_gbps": best_copy, "gbps": max(best_sum, best_copy), "mb": mb,
            "repeats": repeats, "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------- breakdown


def _is_sdpa(name: str) -> bool:
    return "scaled_dot_product" in name


def _is_attention_math(name: str) -> bool:
    return _is_sdpa(name) or name in ("aten::bmm", "aten::matmul", "aten::baddbmm", "aten::einsum")


def classify(chain: list[str]) -> str | None:
    """The bucket of an event from its name and its ancestors' (``chain[0]`` the event, then its parent, ...):
    the innermost ``kvpass.*`` range; else SDPA anywhere, or bmm / matmul under a ``kvpass::`` op:
    ``gather+attention``; else inside a ``kvpass::`` op: ``runtime``; else None (counted in ``rest``)."""
    for name in chain:
        if name in RANGES:
            return RANGES[name]
    in_op = any(n.startswith("kvpass::") for n in chain)
    for name in chain:
        if name.startswith("kvpass::"):
            break
        if _is_sdpa(name) or (in_op and _is_attention_math(name)):
            return "gather+attention"
    return "runtime" if in_op else None


def breakdown(events, steps: int, wall_s: float) -> dict[str, Any]:
    """Per-step ms by bucket (see the module docstring) from ``prof.events()`` of ``steps`` decode steps
    that took ``wall_s`` seconds under the profiler. ``rest`` = step time minus the other buckets."""
    events = list(events)
    by_thread: dict[int, int] = defaultdict(int)
    for e in events:
        by_thread[e.thread] += 1
    main = max(by_thread, key=by_thread.get) if by_thread else None
    sums = dict.fromkeys(BUCKETS, 0.0)
    ranges_seen = False
    for e in events:
        if e.thread != main:
            continue
        chain, p = [e.name], e.cpu_parent
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        if e.name in RANGES:
            ranges_seen = True
        b = classify(chain)
        if b is not None:
            sums[b] += e.self_cpu_time_total / 1e3  # us -> ms
    step_ms = 1000 * wall_s / steps
    out = {k: v / steps for k, v in sums.items()}
    out["rest"] = step_ms - sum(out[k] for k in BUCKETS if k != "rest")
    return {"steps": steps, "step_ms": step_ms, "ms": out, "source": "ranges" if ranges_seen else "ops"}


# ------------------------------------------------------------------------------------------ helpers


def _cell_kv(prefill_kv, context: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prefix of the prefill's K/V (``context`` <= its length) or the K/V repeated along the sequence,
    as ``batch`` copies: fresh contiguous tensors ``(batch, H_kv, context, D)``."""
    out = []
    for k, v in prefill_kv:
        p = k.shape[2]
        reps = -(-context // p)

        def make(t):
            t = t[:, :, :context] if reps == 1 else t.repeat(1, 1, reps, 1)[:, :, :context]
            return t.expand(batch, -1, -1, -1).contiguous()

        out.append((make(k), make(v)))
    return out


def start_tokens(context: int, warmup_steps: int, steps: int) -> int:
    """The tokens a cell of ``context`` starts from: each of its dropped (and profiled: ``warmup_steps`` counts
    them) and timed steps adds one, so that its last timed step attends ``context`` tokens (a budget of
    ``context`` covers every step of the cell)."""
    return context - warmup_steps - steps


def last_tokens(row: dict) -> int:
    """The tokens the cache held at a row's last timed step: its context; rows written before the cells ended at
    their context (no ``start_tokens``) started from it and went on for their dropped and timed steps."""
    return row["context"] if "start_tokens" in row else row["context"] + row["warmup_steps"] + row["steps"]


def context_sentence(rows: list[dict]) -> str:
    """What a page's context C means for the cache of its ``rows``' cells (:func:`last_tokens`)."""
    if all("start_tokens" in r for r in rows):
        return ("A cell of context C starts from C minus its dropped and timed steps tokens, so that its last timed "
                "step attends C tokens (a budget of C covers every step of the cell).")
    return ("A cell of context C starts from C tokens and each of its dropped and timed steps adds one (these rows "
            "were written before the cells ended at their context: a budget of C does not cover their steps).")


def _site_sums(backend) -> dict[str, Any]:
    rows = [r for r in backend.report_rows() if "reason" not in r]
    return {
        "sites": len(rows),
        "left_exact": len(backend.report_rows()) - len(rows),
        "tokens_attended": sum(int(r.get("tokens_attended", 0)) for r in rows),
        "tokens_held": sum(int(r.get("tokens_held", 0)) for r in rows),
        "device_bytes": sum(int(r.get("device_bytes", 0)) for r in rows),
        "host_bytes": sum(int(r.get("host_bytes", 0)) for r in rows),
        "bytes_moved": sum(int(r.get("bytes_moved", 0)) for r in rows),
        "_rows": rows,
    }


def _metadata_bytes(rows: list[dict], per_token: int, batch: int) -> int:
    """Per site: the device bytes besides the KV held, plus what the step's selection read from a host tier."""
    return sum(max(0, int(r.get("device_bytes", 0)) - int(r.get("tokens_held", 0)) * per_token * batch)
               + int(r.get("selection_bytes", 0)) for r in rows)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def cell_key(row: dict[str, Any]) -> tuple:
    return (row["model"], row["policy"], int(row["context"]), int(row["batch"]), int(row["threads"]))


def _decode(fwd, cache, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, list[float]]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fwd(input_ids=ids, past_key_values=cache, use_cache=True)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    return ids, times


# ---------------------------------------------------------------------------------------------- run


def prefill(model, tokenizer, length: int, progress: bool = False):
    """``(prefill_kv, first_ids, seconds)``: the keys and values of one exact prefill of ``length`` tokens of
    the prose with the model's own forward (call under ``torch.no_grad()``), and ``first_ids(context, batch)``,
    the ``(batch, 1)`` token a cell of that context decodes first (the prose's next token, or past the
    prefill the prefill's own next token)."""

    ids = tokenizer(topics_text(), return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] < length + 1:
        raise ValueError(f"kvpass: the prose has {ids.shape[1]} tokens, fewer than the prefill of {length}")
    ids = ids[:, : length + 1]
    t0 = time.perf_counter()
    out = model(input_ids=ids[:, :length], use_cache=True, logits_to_keep=1)
    seconds = time.perf_counter() - t0
    prefill_kv = [(k.detach(), v.detach()) for k, v in cache_tensors(out.past_key_values)]
    last_token = out.logits[:, -1].argmax(-1)
    if progress:
        print(f"kvpass bench --decode-cost: prefill of {length} tokens in {seconds:.1f} s", flush=True)

    def first_ids(c: int, b: int) -> torch.Tensor:
        tok = ids[0, c] if c < length else last_token[0]
        return tok.view(1, 1).expand(b, 1).contiguous()

    return prefill_kv, first_ids, seconds


def warm_up(model, backend, fwd, policy, cells, prefill_kv, first_ids, warmup_steps: int) -> None:
    """Compile and warm ``fwd`` (on ``backend`` with ``policy``) on short contexts for the ``(context, batch)``
    cells it will run: batch 1 specialises, 2 stands for every larger batch, and a context past the model's
    positions compiles a graph of its own (measured on the tiny model), warmed up too where a cell needs it."""
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    for b in sorted({min(b, 2) for _, b in cells}):
        beyond = any(c > max_pos and min(cb, 2) == b for c, cb in cells)
        for wc in _WARM_CONTEXTS + ((max_pos + _WARM_CONTEXTS[0],) if beyond else ()):
            backend.set_policy(policy)
            cache = backend.adopt(cache_from(model, _cell_kv(prefill_kv, wc, b)))
            _decode(fwd, cache, first_ids(wc, b), warmup_steps + 2)
            del cache


def resume(path: Path, plan: list, threads: list[int], key_of, skinny_linear: bool, what: str, progress: bool):
    """``(results, pending)``: the rows already in ``path`` for the ``plan``'s ``(policy, context, batch)`` at
    each of ``threads`` (by ``key_of(policy, context, batch, threads)``, as :func:`cell_key` makes it), and the
    ``(threads, policy, context, batch)`` still to measure. A file of the other ``skinny_linear`` is refused."""

    existing = {cell_key(r): r for r in load_results(path)}
    if any("start_tokens" not in r for r in existing.values()):
        raise ValueError(f"kvpass: {path} holds rows whose cells started from their context (written before a "
                         "cell's last timed step ended at it); give this run its own --out")
    if any(r.get("skinny_linear", True) != skinny_linear for r in existing.values()):
        raise ValueError(f"kvpass: {path} holds rows measured with skinny_linear={not skinny_linear}; give "
                         f"skinny_linear={skinny_linear} (--no-skinny-linear) its own --out")
    results = {k: existing[k] for k in (key_of(p, c, b, t) for t in threads for p, c, b in plan) if k in existing}
    pending = [(t, p, c, b) for t in threads for p, c, b in plan if key_of(p, c, b, t) not in existing]
    if progress:
        print(f"kvpass bench --decode-cost: {len(pending)} of {len(plan) * len(threads)} {what} to run "
              f"({len(results)} already in {path})", flush=True)
    return results, pending


def _plan(policies: list[Policy], contexts: list[int], batches: list[int], batch_context: int):
    """``[(policy or EAGER, context, batch)]``: by context at batch 1, by batch at ``batch_context``, and
    Full at every context up to ``batch_context`` at every batch (the floors)."""

    cells, seen = [], set()
    for p in [EAGER] + policies:
        mine = [(p, c, 1) for c in contexts] + [(p, batch_context, b) for b in batches]
        if isinstance(p, Full):
            mine += [(p, c, b) for c in contexts if c <= batch_context for b in batches]
        for cell in mine:
            key = (EAGER if p == EAGER else p.describe(), cell[1], cell[2])
            if key not in seen:
                seen.add(key)
                cells.append(cell)
    return cells


def run_decode_cost(
    model,
    tokenizer,
    policies: list[Policy],
    contexts: list[int],
    batches: list[int],
    out_dir: Path,
    *,
    batch_context: int | None = None,
    threads: list[int] | None = None,
    steps: int = 8,
    warmup_steps: int = 3,
    profile_steps: int = 3,
    profile_batches: tuple[int, ...] | None = None,
    bandwidth_mb: int = 512,
    model_name: str | None = None,
    command: str | None = None,
    progress: bool = True,
    skinny_linear: bool = True,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Measure every cell not yet in ``out_dir/decode_cost.jsonl`` (see the module docstring); return the
    rows of this call's cells. ``profile_batches``: the batches at ``batch_context`` whose cells get the
    profiler breakdown (default: 1 and 8, or the largest batch when 8 is not measured). ``skinny_linear``
    is passed to every ``kvpass()`` backend; an ``out_dir`` holds rows of one setting only."""

    check_grid("decode cost", contexts, batches, steps=steps, warmup_steps=warmup_steps, rounds=rounds)
    policies = [Full()] + [p for p in policies if not isinstance(p, Full)]
    batch_context = int(batch_context or max(contexts))
    threads = threads or [torch.get_num_threads()]
    if profile_batches is None:
        profile_batches = (1, 8 if 8 in batches else max(batches))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS
    model_name = model_name or _model_name(model)
    command = command if command is not None else shlex.join([Path(sys.argv[0]).name] + sys.argv[1:])
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    plan = _plan(policies, contexts, batches, batch_context)

    def key_of(p, c, b, t) -> tuple:
        return (model_name, EAGER if p == EAGER else p.describe(), int(c), int(b), int(t))

    results, pending = resume(path, plan, threads, key_of, skinny_linear, "cells", progress)
    if not pending:
        return [results[key_of(p, c, b, t)] for t in threads for p, c, b in plan]

    fwd_eager = model.forward
    prefill_len = min(max(c for _, _, c, _ in pending), max_pos)
    old_threads = torch.get_num_threads()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")  # counted in the row
            prefill_kv, first_ids, prefill_s = prefill(model, tokenizer, prefill_len, progress)
            kv_heads, head_dim, es = prefill_kv[0][0].shape[1], prefill_kv[0][0].shape[3], prefill_kv[0][0].element_size()
            per_token = kv_bytes_per_token(kv_heads, head_dim, es)
            n_layers = len(prefill_kv)

            for t in threads:
                todo = [g for g in pending if g[0] == t]
                if not todo:
                    continue
                torch.set_num_threads(t)
                gc.collect()
                bw = measure_bandwidth(bandwidth_mb)
                machine = machine_info()
                if progress:
                    print(f"kvpass bench --decode-cost: {t} thread(s): bandwidth {bw['gbps']:.1f} GB/s (sum "
                          f"{bw['sum_gbps']:.1f}, copy {bw['copy_gbps']:.1f}, best of {bw['repeats']} x "
                          f"{bw['mb']} MB)", flush=True)
                # eager first (nothing to compile), then one backend per graph key, the plain graph first;
                # every key's graphs stay compiled (dynamo keeps a cache entry per backend) so that the
                # rounds below interleave all cells, whatever graph they run
                key_cells: dict[str, list] = {EAGER: []}
                for g in todo:
                    key_cells.setdefault(EAGER if g[1] == EAGER else g[1].graph_key(), []).append(g)
                keys = list(key_cells)
                runners: dict[str, tuple] = {EAGER: (None, fwd_eager, 0.0)}
                with graph_keys_kept(len(keys)):
                    for gk in keys[1:]:
                        cells = key_cells[gk]
                        first = cells[0][1]
                        backend = kvpass(Full() if gk == Full().graph_key() else first, skinny_linear=skinny_linear)
                        fwd = torch.compile(fwd_eager, backend=backend, dynamic=True)
                        t0 = time.perf_counter()
                        warm_up(model, backend, fwd, first, [(g[2], g[3]) for g in cells], prefill_kv, first_ids,
                                warmup_steps)
                        runners[gk] = (backend, fwd, time.perf_counter() - t0)
                        if progress:
                            print(f"kvpass bench --decode-cost: compiled {len(backend.graphs)} graph(s) for {gk} "
                                  f"in {runners[gk][2]:.0f} s ({t} thread(s))", flush=True)
                    # rounds: every cell of every key once per round, the order reversed every other round, so
                    # that a slow spell of the machine lands on all cells (floors and policies alike) instead
                    # of a few consecutive ones
                    cells = [(gk, g) for gk in keys for g in key_cells[gk]]
                    parts: dict[tuple, list[dict]] = defaultdict(list)
                    for rnd in range(rounds):
                        for gk, cell in (cells if rnd % 2 == 0 else cells[::-1]):
                            _, p, c, b = cell
                            backend, fwd, _ = runners[gk]
                            profiled = rnd == rounds - 1 and c == batch_context and b in profile_batches
                            parts[cell].append(_run_cell(model, fwd, backend, p, c, b, prefill_kv, first_ids,
                                                         steps=steps, warmup_steps=warmup_steps,
                                                         profile_steps=profile_steps if profiled else 0,
                                                         per_token=per_token, n_layers=n_layers))
                        if progress and rounds > 1:
                            print(f"kvpass bench --decode-cost: round {rnd + 1} of {rounds} done ({t} thread(s))",
                                  flush=True)
                    for gk, cell in cells:
                        _, p, c, b = cell
                        compile_s = runners[gk][2]
                        row = merge_rounds(parts[cell])
                        row.update({
                            "model": model_name, "policy": EAGER if p == EAGER else p.describe(),
                            "policy_name": "eager HF" if p == EAGER else policy_label(p),
                            "kind": EAGER if p == EAGER else "kvpass",
                            "budget": None if p == EAGER else policy_budget(p),
                            "context": int(c), "batch": int(b), "threads": int(t),
                            "prefill_tokens": prefill_len,
                            "repeated": start_tokens(c, warmup_steps, steps) > prefill_len,
                            "max_positions": max_pos, "beyond_positions": c > max_pos,
                            "prefill_s": prefill_s, "compile_s": compile_s, "kv_heads": kv_heads,
                            "head_dim": head_dim, "element_size": es,
                            "bandwidth": bw, "machine": machine, "command": command, "finished": _now(),
                            "skinny_linear": skinny_linear, "rounds": rounds, "interleaved": "all keys",
                        })
                        wb = weight_bytes(model, b)
                        row["weight_bytes"] = wb
                        by = step_bytes(wb["total"], row["tokens_attended"], per_token, b, row["metadata_bytes"])
                        row["bytes"] = by
                        row["gbps"] = by["total"] / (row["ms_per_token"] / 1e3) / 1e9
                        row["bandwidth_share"] = row["gbps"] / bw["gbps"]
                        _append(path, row)
                        results[key_of(p, c, b, t)] = row
                        if progress:
                            print(f"  {row['policy_name']:<28} ctx={c:<6} batch={b:<3} {row['ms_per_token']:8.1f} "
                                  f"ms/token, {by['total'] / 1e9:.3f} GB/step, {row['gbps']:.1f} GB/s "
                                  f"({100 * row['bandwidth_share']:.0f} %), graphs compiled in warm-up / timed steps "
                                  f"{row['graphs_compiled_warmup']} / {row['graphs_compiled_timed']}"
                                  + (f", rounds {' '.join(f'{x:.1f}' for x in row['round_ms'])}" if rounds > 1 else ""),
                                  flush=True)
                    runners.clear()
    finally:
        torch.set_num_threads(old_threads)
        torch._dynamo.reset()
    return [results[key_of(p, c, b, t)] for t in threads for p, c, b in plan]


def merge_rounds(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a cell's rounds (each a :func:`_run_cell` row): ms/token is the median of the rounds'
    medians (one disturbed round of three moves nothing), ``round_ms`` keeps each round's median, the step
    lists are concatenated and the graph counts summed; everything else (the report, the breakdown) comes
    from the last round."""
    row = dict(parts[-1])
    row["round_ms"] = [p["ms_per_token"] for p in parts]
    row["ms_per_token"] = statistics.median(row["round_ms"])
    row["min_ms"] = min(p["min_ms"] for p in parts)
    row["step_ms"] = [x for p in parts for x in p["step_ms"]]
    row["warmup_ms"] = [x for p in parts for x in p["warmup_ms"]]
    for k in ("graphs_compiled_warmup", "graphs_compiled_timed"):
        row[k] = sum(p[k] for p in parts)
    return row


STATISTICS = ("median", "min")


def restat(row: dict[str, Any], statistic: str = "median") -> dict[str, Any]:
    """``row`` with ``ms_per_token`` (and GB/s, the bandwidth share) taken by ``statistic`` over its timed
    steps: ``median`` is the row as measured (the median of its rounds' medians); ``min`` is its fastest
    timed step, the step's cost with the least interference from other work on a shared machine
    (interference only adds time). ``median_ms`` keeps the measured median either way."""
    if statistic not in STATISTICS:
        raise ValueError(f"kvpass: decode cost statistic must be one of {STATISTICS}, got {statistic!r}")
    r = dict(row, median_ms=row.get("median_ms", row["ms_per_token"]), statistic=statistic)
    if statistic == "min":
        r["ms_per_token"] = row["min_ms"]
        r["gbps"] = row["bytes"]["total"] / (r["ms_per_token"] / 1e3) / 1e9
        r["bandwidth_share"] = r["gbps"] / row["bandwidth"]["gbps"]
    return r


def _run_cell(model, fwd, backend, policy, context, batch, prefill_kv, first_ids, *, steps, warmup_steps, profile_steps,
              per_token, n_layers) -> dict[str, Any]:
    gc.collect()
    if backend is not None:
        backend.set_policy(policy)
    # the profiled steps run between the dropped and the timed ones, so that they too attend at most the context
    start = start_tokens(context, warmup_steps + profile_steps, steps)
    cache = cache_from(model, _cell_kv(prefill_kv, start, batch))
    if backend is not None:
        backend.adopt(cache)  # the first step runs the steady graph (kvpass/runtime/adopt.py)

    def graphs() -> int:
        return len(backend.graphs) if backend is not None else 0

    g0 = graphs()
    ids, warm = _decode(fwd, cache, first_ids(start, batch), warmup_steps)
    g1 = graphs()
    profiled = {}
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            ids, _ = _decode(fwd, cache, ids, profile_steps)
            wall = time.perf_counter() - t0
        profiled = {"breakdown": breakdown(prof.events(), profile_steps, wall),
                    "graphs_compiled_profile": graphs() - g1, "profiled_before_timed": True}
    g2 = graphs()
    moved0 = _site_sums(backend)["bytes_moved"] if backend is not None else 0
    ids, timed = _decode(fwd, cache, ids, steps)
    g3 = graphs()
    row: dict[str, Any] = {
        "warmup_steps": warmup_steps, "steps": steps, "start_tokens": start,
        "warmup_ms": [1000 * x for x in warm], "step_ms": [1000 * x for x in timed],
        "ms_per_token": 1000 * statistics.median(timed), "min_ms": 1000 * min(timed),
        "graphs_compiled_warmup": g1 - g0, "graphs_compiled_timed": g3 - g2, **profiled,
    }
    if backend is not None:
        s = _site_sums(backend)
        rows = s.pop("_rows")
        row.update(s)
        row["bytes_moved_per_step"] = (s["bytes_moved"] - moved0) / steps

        row["metadata_bytes"] = 0 if isinstance(policy, Full) else _metadata_bytes(rows, per_token, batch)
    else:
        length = int(cache.get_seq_length())
        row.update({"sites": n_layers, "left_exact": 0, "tokens_attended": n_layers * length,
                    "tokens_held": n_layers * length, "device_bytes": n_layers * length * per_token * batch,
                    "host_bytes": 0, "bytes_moved": 0, "bytes_moved_per_step": 0.0, "metadata_bytes": 0})
    row["attended_per_site"] = row["tokens_attended"] / max(1, row["sites"])
    del cache
    return row


# ------------------------------------------------------------------------------------------- tables


def _f(x, digits: int = 1) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _order(rows: list[dict]) -> list[tuple[str, str]]:
    """``(policy, policy_name)`` in run order: eager, Full, then the others."""
    seen = list(dict.fromkeys((r["policy"], r["policy_name"]) for r in rows))
    return sorted(seen, key=lambda x: (x[0] != EAGER, x[0] != "Full()"))


def _label(r: dict) -> str:
    name = r["policy_name"]
    if r["policy"] == "Full()":
        return "Full (kvpass)"
    b = r.get("budget")
    if b is not None and "ratio=" not in name:
        name += f" {b}"
    if "profile=" in r["policy"] and "profile=None" not in r["policy"] and " profile" not in name:
        name += " profiled"  # rows written before policy_label named TailorKV's profile
    return name


def _index(rows):
    return {(r["policy"], r["context"], r["batch"], r["threads"]): r for r in rows}


def floor_of(row: dict, rows: list[dict]) -> tuple[float | None, str | None]:
    """F(N, B): Full's ms/token at N = the tokens the policy attends per site, at the same batch and threads,
    as ``(ms, where)``. Between two measured contexts Full's step is interpolated linearly in the context (it
    reads weights plus N tokens per site: linear in N); outside them the nearest measured context is taken
    (e.g. Full at 1024 for a budget of 1024). ``where`` names the context or the two that bracket N."""
    fulls = {r["context"]: r["ms_per_token"] for r in rows if r["policy"] == "Full()" and r["batch"] == row["batch"]
             and r["threads"] == row["threads"] and r["model"] == row["model"]}
    if not fulls:
        return None, None
    n = max(1.0, float(row.get("attended_per_site") or 0))
    at, w = bracket(n, list(fulls))
    return floor_at(at, w, fulls), floor_label(n, at)


def check_grid(what: str, contexts: list[int], batches: list[int], **counts: int) -> None:
    """Refuse a count below 1 (``counts``: name -> value) or empty or non-positive contexts or batches;
    ``what`` names the bench in the message."""
    if min(counts.values()) < 1:
        raise ValueError(f"kvpass: {what} needs {', '.join(counts)} >= 1, got "
                         + ", ".join(f"{k}={v}" for k, v in counts.items()))
    if not contexts or not batches or min(contexts) < 1 or min(batches) < 1:
        raise ValueError(f"kvpass: {what} needs positive contexts and batches, got {contexts}, {batches}")
    steps = counts.get("steps", 0) + counts.get("warmup_steps", 0)
    if min(contexts) <= steps:  # a cell starts from its context minus its steps (start_tokens)
        raise ValueError(f"kvpass: {what} needs every context above the dropped and timed steps ({steps}), got "
                         f"{min(contexts)}")


def bracket(n: float, contexts: list[int]) -> tuple[tuple[int, ...], float]:
    """Where F(n) is read among Full's measured ``contexts``: ``((lo, hi), w)`` for the two that bracket
    ``n`` (each more than 2 % away), F = F(lo) + w (F(hi) - F(lo)); else ``((c,), 0.0)`` for the nearest
    (in ratio; the smaller on a tie)."""
    cs = sorted(set(int(c) for c in contexts))
    for lo, hi in zip(cs, cs[1:]):
        if lo < n < hi and n - lo > 0.02 * n and hi - n > 0.02 * n:
            return (lo, hi), (n - lo) / (hi - lo)
    return (min(cs, key=lambda c: (abs(math.log(c / n)), c)),), 0.0


def floor_at(at: tuple[int, ...], w: float, ms: dict[int, float]) -> float:
    """F from Full's ms at the contexts of :func:`bracket` (``ms``: context -> ms)."""
    return ms[at[0]] if len(at) == 1 else ms[at[0]] + w * (ms[at[1]] - ms[at[0]])


def floor_label(n: float, at: tuple[int, ...]) -> str:
    return f"{n:.0f}: {at[0]}-{at[1]}" if len(at) == 2 else str(at[0])


DISTURBED = 0.9  # a compressed cell faster than this times its floor did less work than Full, or the floor was slow


def _disturbed(r: dict, vs_floor: float) -> bool:
    return r.get("kind") == "kvpass" and r["policy"] != "Full()" and vs_floor < DISTURBED


def _ratios(r: dict, rows: list[dict], idx) -> tuple[float, float, int | None]:
    full = idx.get(("Full()", r["context"], r["batch"], r["threads"]))
    vs_full = r["ms_per_token"] / full["ms_per_token"] if full else float("nan")
    fl, fc = floor_of(r, rows)
    vs_floor = r["ms_per_token"] / fl if fl else float("nan")
    return vs_full, vs_floor, fc


def _spread(r: dict) -> str:
    """The slowest round's median over the fastest's: how much the machine drifted during the cell."""
    ms = r.get("round_ms") or []
    return f"{max(ms) / min(ms):.2f}" if len(ms) > 1 else "–"


def _detail_table(rows: list[dict], sel, idx, all_rows) -> list[str]:
    head = ["policy", "context", "batch", "ms/token", "median ms", "fastest ms", "× Full", "× floor (Full at)",
            "rounds max / min", "tokens attended/site",
            "weights MB", "KV MB", "metadata ≤ MB", "bytes/step MB", "GB/s", "share of bandwidth", "graphs in timed steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for pol, _ in _order(rows):
        for r in sorted([r for r in rows if r["policy"] == pol and sel(r)], key=lambda r: (r["context"], r["batch"])):
            vs_full, vs_floor, fc = _ratios(r, all_rows, idx)
            by = r["bytes"]
            lines.append("| " + " | ".join([
                _label(r), str(r["context"]), str(r["batch"]), _f(r["ms_per_token"]),
                _f(r.get("median_ms", r["ms_per_token"])), _f(r["min_ms"]), _f(vs_full, 2) + "×",
                (f"{_f(vs_floor, 2)}× ({fc})" + (" ‡" if _disturbed(r, vs_floor) else "")) if fc else "–",
                _spread(r), _f(r["attended_per_site"], 0),
                _f(by["weights"] / 1e6), _f(by["kv"] / 1e6), _f(by["metadata"] / 1e6), _f(by["total"] / 1e6),
                _f(r["gbps"]), _f(100 * r["bandwidth_share"], 0) + " %", str(r["graphs_compiled_timed"]),
            ]) + " |")
    return lines


def _pivot(rows: list[dict], axis: str, fixed: dict, idx, all_rows) -> list[str]:
    sel = [r for r in rows if all(r[k] == v for k, v in fixed.items())]
    vals = sorted({r[axis] for r in sel})
    head = ["policy"] + [f"{axis} {v}" for v in vals]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(vals)) + "|"]
    for pol, _ in _order(sel):
        cells, name = [], None
        for v in vals:
            r = next((r for r in sel if r["policy"] == pol and r[axis] == v), None)
            if r is None:
                cells.append("–")
                continue
            name = _label(r)
            vs_full, vs_floor, _ = _ratios(r, all_rows, idx)
            mark = " ‡" if _disturbed(r, vs_floor) else ""
            cells.append(f"{_f(r['ms_per_token'])} ({_f(vs_full, 2)}× / {_f(vs_floor, 2)}×{mark})")
        lines.append("| " + " | ".join([name or pol] + cells) + " |")
    return lines


def _breakdown_table(rows: list[dict]) -> list[str]:
    br = [r for r in rows if r.get("breakdown")]
    if not br:
        return []
    head = ["policy", "context", "batch", "profiled step ms", "timed ms/token"] + [f"{b} ms" for b in BUCKETS] + ["source"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
    for pol, _ in _order(br):
        for r in sorted([r for r in br if r["policy"] == pol], key=lambda r: r["batch"]):
            b = r["breakdown"]
            lines.append("| " + " | ".join([_label(r), str(r["context"]), str(r["batch"]), _f(b["step_ms"]),
                                            _f(r["ms_per_token"])] + [_f(b["ms"][k]) for k in BUCKETS]
                                           + [b["source"]]) + " |")
    return lines


# The decode-cost targets each page checks (F: the floor, Full's own step over the tokens a policy attends)
FLOOR_AT_BATCH_1 = 1.10  # x F(N, 1) at the batch sweep's context
FLOOR_AT_BATCH = (8, 1.25)  # x F(N, 8) there
COVERED = 1.05  # x Full where the budget covers the context
LONG = (32768, "ClusterKV", 3.0)  # Full / ClusterKV at batch 1 from this context on
FULL_VS_EAGER = (8, 0.6)  # kvpass Full / eager HF at the batch sweep's context, batch 8


NOT_A_MEASUREMENT = "‡ not a measurement"


def _verdict(value: float, limit: float, at_most: bool, note: str | None = None) -> str:
    if note:
        return note
    if (value <= limit) if at_most else (value >= limit):
        return "met"
    pct = 100 * (value / limit - 1 if at_most else 1 - value / limit)
    return f"missed by {pct:.{0 if pct >= 1 else 1}f} %"  # 0.3 %, not 0 %, under a figure that rounds to its limit


def target_lines(checks: list[tuple]) -> list[str]:
    """The targets table, ``| target | policy | measured | limit | verdict |``, from ``checks``: tuples
    ``(target, policy label, value, limit, at_most, note)``, a note standing for the verdict where the value
    does not measure the target; a NaN value gives no line, no line no table."""
    lines = ["| target | policy | measured | limit | |", "|---|---|---:|---:|---|"]
    for what, label, value, limit, at_most, note in checks:
        if not math.isnan(value):
            lines.append(f"| {what} | {label} | {value:.2f}× | {'≤' if at_most else '≥'} {limit:.2f}× | "
                         f"{_verdict(value, limit, at_most, note)} |")
    return lines if len(lines) > 2 else []


def targets_title(lines: list[str], where: str) -> str:
    """The line above a targets table: how many of its targets are met, and where the others are."""
    met = sum(line.endswith("| met |") for line in lines)
    return f"**Targets** ({met} of {len(lines) - 2} met; {where})"


def long_bound(full_over_floor: float) -> str:
    """What the long-context target's line says of its floor: a policy at its floor (Full's step over the tokens
    it attends) is Full ÷ floor times faster than Full, and no faster."""
    return f"Full ÷ its floor {full_over_floor:.2f}×"


def target_checks(cells: list[dict], batch_ctx: int | None) -> list[tuple]:
    """The checks (:func:`target_lines`) of the compressed policies' targets, shared by the grid's page and
    the paired one: ``cells`` (in the policies' order) carry ``policy``, ``label``, ``context``, ``batch``,
    ``budget``, ``last`` (the tokens held at its last timed step: :func:`last_tokens`), ``vs_floor``,
    ``vs_full`` (policy over Full at its context), ``speedup`` (Full over policy), ``bound`` (Full over the
    floor) and ``disturbed``. At ``batch_ctx`` within :data:`FLOOR_AT_BATCH_1` of
    the floor at batch 1 and :data:`FLOOR_AT_BATCH` at batch 8, within :data:`COVERED` of Full where the
    budget covers the context, ClusterKV :data:`LONG` times faster than Full at 32k."""
    order = list(dict.fromkeys(c["policy"] for c in cells))
    key = lambda c: (c["context"], order.index(c["policy"]))  # noqa: E731
    checks = []
    for b, limit in ((1, FLOOR_AT_BATCH_1), FLOOR_AT_BATCH):
        for c in (c for c in cells if c["context"] == batch_ctx and c["batch"] == b):
            checks.append((f"context {batch_ctx}, batch {b}: × floor", c["label"], c["vs_floor"], limit, True,
                           NOT_A_MEASUREMENT if c["disturbed"] else None))
    for c in sorted((c for c in cells if c["batch"] == 1 and c["budget"] and c["budget"] >= c["context"]), key=key):
        # a cell run past its budget selected in its timed steps: not this target
        past = f"not covering: the cache reached {c['last']} tokens" if c["last"] > c["budget"] else None
        checks.append((f"context {c['context']}, budget covers it: × Full", c["label"], c["vs_full"], COVERED, True,
                       past))
    long_ctx, name, speedup = LONG
    for c in sorted((c for c in cells if c["name"].startswith(name) and c["batch"] == 1 and c["context"] >= long_ctx),
                    key=key):
        checks.append((f"context {c['context']}, batch 1: Full ÷ policy ({long_bound(c['bound'])})", c["label"],
                       c["speedup"], speedup, False, None))
    return checks


def targets_table(trows: list[dict], idx, all_rows: list[dict], batch_ctx: int | None) -> list[str]:
    """Each target of the decode cost as a line ``| target | policy | measured | limit | verdict |`` for one
    thread count's rows (``trows``; ``idx``/``all_rows`` as for :func:`_pivot`): the compressed policies'
    (:func:`target_checks`, from the ratios of cell medians) and Full :data:`FULL_VS_EAGER` of eager HF at
    ``batch_ctx``, batch 8. Cells not measured give no line."""
    policies = [p for p, _ in _order(trows) if p not in (EAGER, "Full()")]
    cells = []
    for r in sorted((r for r in trows if r["policy"] in policies), key=lambda r: policies.index(r["policy"])):
        vs_full, vs_floor, _ = _ratios(r, all_rows, idx)
        cells.append({"policy": r["policy"], "name": r["policy_name"], "label": _label(r), "context": r["context"],
                      "batch": r["batch"], "budget": r.get("budget"), "last": last_tokens(r), "vs_floor": vs_floor,
                      "vs_full": vs_full,
                      "speedup": 1 / vs_full, "bound": vs_floor / vs_full, "disturbed": _disturbed(r, vs_floor)})
    checks = target_checks(cells, batch_ctx)
    b, limit = FULL_VS_EAGER

    def cell(p):
        return next((r for r in trows if r["policy"] == p and r["context"] == batch_ctx and r["batch"] == b), None)

    full, eager = cell("Full()"), cell(EAGER)
    if full is not None and eager is not None:
        checks.append((f"context {batch_ctx}, batch {b}: × eager HF", _label(full),
                       full["ms_per_token"] / eager["ms_per_token"], limit, True, None))
    return target_lines(checks)


def markdown_tables(rows: list[dict[str, Any]]) -> str:
    """The tables of the page (per model and thread count): ms/token by context and by batch with the
    ratios to Full and to the floor, the bytes per step and bandwidth per cell, the breakdown."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        idx = _index(mrows)
        for t in sorted({r["threads"] for r in mrows}):
            trows = [r for r in mrows if r["threads"] == t]
            bw = trows[-1]["bandwidth"]["gbps"]
            tiny = " (structure only: random weights)" if model.startswith("tiny") else ""
            parts.append(f"### {model}{tiny}, {t} thread(s) (bandwidth {bw:.1f} GB/s)")
            batch_ctx = max((r["context"] for r in trows if r["batch"] > 1), default=None)
            sec = ["", "**By context, batch 1**: ms/token (× Full at the same context / × floor)", ""]
            sec += _pivot(trows, "context", {"batch": 1}, idx, mrows)
            if batch_ctx is not None:
                sec += ["", f"**By batch, context {batch_ctx}**: ms/token (× Full / × floor)", ""]
                sec += _pivot(trows, "batch", {"context": batch_ctx}, idx, mrows)
            sec += ["", "**Bytes per step and bandwidth**", ""]
            sec += _detail_table(trows, lambda r: r["batch"] == 1 or r["context"] == batch_ctx, idx, mrows)
            if any("‡" in line for line in sec):
                sec += ["", f"‡ faster than {DISTURBED}× its floor: a compressed step cannot cost much less than "
                            "Full's step over the tokens it attends, so the machine ran slower while the floor was "
                            "measured (or faster during this cell); that ratio does not measure the policy."]
            parts += sec
            tt, bt = targets_table(trows, idx, mrows, batch_ctx), _breakdown_table(trows)
            if tt:
                parts += ["", targets_title(tt, "F is the floor above; attention recall and accuracy at 8k are on "
                                                "docs/results/clusterkv-vs-quest-8k.md, not here"
                                                + ("; where a step's time goes: the next table" if bt else "")), ""] + tt
            if bt:
                parts += ["", "**Where a step goes** (ms per step, profiled steps)", ""] + bt
            parts.append("")
    return "\n".join(parts)


# -------------------------------------------------------------------------------------------- plots


def plot_all(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        slug = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
        threads = sorted({r["threads"] for r in mrows})
        max_pos = mrows[0].get("max_positions")
        for axis, fixed, fname in (("context", "batch", "ms_vs_context.png"), ("batch", "context", "ms_vs_batch.png")):
            fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.2), squeeze=False)
            for ax, t in zip(axes[0], threads):
                trows = [r for r in mrows if r["threads"] == t]
                fv = 1 if axis == "context" else max((r["context"] for r in trows if r["batch"] > 1), default=None)
                if fv is None:
                    continue
                for pol, _ in _order(trows):
                    pts = sorted([r for r in trows if r["policy"] == pol and r[fixed] == fv], key=lambda r: r[axis])
                    if not pts:
                        continue
                    ax.plot([r[axis] for r in pts], [r["ms_per_token"] for r in pts], marker="o", label=_label(pts[0]),
                            linestyle="--" if pol in ("Full()", EAGER) else "-")
                if axis == "context" and max_pos and any(r["context"] > max_pos for r in trows):
                    ax.axvline(max_pos, color="grey", linestyle=":", label=f"trained positions ({max_pos})")
                ax.set_xscale("log", base=2)
                ax.set_xlabel(axis + (" (tokens)" if axis == "context" else ""))
                ax.set_ylabel("ms/token")
                ax.set_title(f"{model}: ms/token vs {axis} ({fixed} {fv}, {t} thread(s))", fontsize=9)
                ax.legend(fontsize=7)
            save(fig, f"{slug}_{fname}")
        br = [r for r in mrows if r.get("breakdown")]
        if br:
            groups = sorted({(r["threads"], r["batch"]) for r in br})
            fig, axes = plt.subplots(1, len(groups), figsize=(max(5, 1.1 * len(_order(br))) * len(groups), 4.2),
                                     squeeze=False)
            for ax, (t, b) in zip(axes[0], groups):
                sel = [r for r in br if r["threads"] == t and r["batch"] == b]
                sel = [next(r for r in sel if r["policy"] == pol) for pol, _ in _order(sel)]
                bottom = [0.0] * len(sel)
                for bucket in BUCKETS:
                    vals = [max(0.0, r["breakdown"]["ms"][bucket]) for r in sel]
                    ax.bar(range(len(sel)), vals, bottom=bottom, label=bucket)
                    bottom = [x + y for x, y in zip(bottom, vals)]
                ax.set_xticks(range(len(sel)))
                ax.set_xticklabels([_label(r) for r in sel], rotation=30, ha="right", fontsize=7)
                ax.set_ylabel("ms per step (profiled)")
                ax.set_title(f"{model}: breakdown, context {sel[0]['context']}, batch {b}, {t} thread(s)", fontsize=9)
                ax.legend(fontsize=7)
            save(fig, f"{slug}_breakdown.png")
    return written


# --------------------------------------------------------------------------------------------- page


def write_decode_cost_md(out_dir: Path, path: Path, command: str, statistic: str = "median") -> Path:
    """The generated page from ``out_dir/decode_cost.jsonl``, ms/token taken by ``statistic``
    (:func:`restat`); plots in ``<path without suffix>/``."""

    out_dir, path = Path(out_dir), Path(path)
    rows, img_dir, pngs = page_rows_and_plots(out_dir / RESULTS, path,
                                              lambda rs, d: plot_all([restat(r, statistic) for r in rs], d),
                                              out_dir / "decode_cost_plots", "kvpass bench --decode-cost")
    rows = [restat(r, statistic) for r in rows]
    commands = list(dict.fromkeys([command] + [r.get("command", "") for r in rows]))
    machines = {}
    for r in rows:
        machines[r["threads"]] = (r["machine"], r["bandwidth"])
    r0 = rows[0]
    lines = page_head("# Decode cost" + (" (the fastest timed step of each cell)" if statistic == "min" else ""),
                      "`kvpass bench --decode-cost` (kvpass.bench.decode_cost.write_decode_cost_md)",
                      "kvpass/bench/decode_cost.py", commands)
    for t, (m, bw) in sorted(machines.items()):
        lines.append(
            f"{machine_line(t, m)}; measured bandwidth "
            f"{bw['gbps']:.1f} GB/s (best of {bw['repeats']} sums of {bw['mb']} MB: {bw['sum_gbps']:.1f} GB/s read; "
            f"copies: {bw['copy_gbps']:.1f} GB/s read + written)")
    first, last = min(r["finished"] for r in rows), max(r["finished"] for r in rows)
    per_tok = kv_bytes_per_token(r0["kv_heads"], r0["head_dim"], r0["element_size"])
    wb = r0["weight_bytes"]
    timed = sorted({r["steps"] for r in rows})
    warm = sorted({r["warmup_steps"] for r in rows})
    compiled = sum(r["graphs_compiled_timed"] for r in rows)
    rounds = sorted({r.get("rounds", 1) for r in rows})
    interleaved = all(r.get("interleaved") == "all keys" for r in rows)
    lines += [
        "",
        f"{len(rows)} cells, finished between {first} and {last} (UTC).",
        "",
        "## How it was measured",
        "",
        f"- **Cache**: one exact prefill of {r0['prefill_tokens']} tokens of `pydoc_data.topics` prose with the "
        f"model's own forward ({r0['prefill_s']:.1f} s). A cache up to {r0['prefill_tokens']} tokens takes the prefix "
        "of its keys and values; a longer one repeats them along the sequence; a batch of B is B copies of the "
        f"row. {context_sentence(rows)} Each cell puts them into a fresh `DynamicCache` and decodes greedily "
        "with a hand loop "
        "(`fwd(input_ids=ids, past_key_values=cache, use_cache=True)`, `torch.no_grad()`).",
        f"- **Time**: the first {', '.join(map(str, warm))} decode step(s) of a cell are dropped (the policy adopts "
        f"the cache and builds its metadata there), then {', '.join(map(str, timed))} steps are timed"
        + (" (per round)" if rounds != [1] else "") + "; "
        + ("ms/token is the **fastest** timed step of a cell (`--statistic min`): on these shared cores other "
           "work only adds time to a step, by up to a third in a slow spell, so the fastest step is the "
           "estimate of what the step itself costs; the median is in the detail table (`median ms`). "
           if statistic == "min" else "ms/token is the median of the timed steps (the detail table also has "
           "the fastest, `fastest ms`). ")
        + "Each graph key was compiled once per thread count and warmed up on short contexts first; graphs "
        f"compiled during timed steps, summed over all cells: **{compiled}**.",
        *([f"- **Rounds**: every cell was measured in {', '.join(map(str, rounds))} round(s): "
           + ("each round runs every cell of a thread count once (eager, Full and every policy, whatever graph it "
              "runs: each graph key keeps its own compiled graphs), in the opposite order every other round, so "
              "that the floors (Full) and every policy are measured interleaved in time; "
              if interleaved else
              "each round runs every cell of a graph key once (a fresh cache, the dropped steps, the timed steps), "
              "in the opposite order every other round, so that the floors (Full) and the policies sharing the "
              "`kvpass::attention` graph are measured interleaved in time (a policy with a graph of its own, "
              "TailorKV, interleaves with its own cells only); ")
           + "ms/token is the median of the rounds' medians, and `rounds max / min` in the detail table is the "
           "slowest round over the fastest."]
          if rounds != [1] else []),
        f"- **Bytes a step must read**: the weights, {wb['weights'] / 1e6:.1f} MB (every parameter once: linear "
        "layers, norms, the LM head; a tied embedding once, as the LM head; an untied embedding one row per "
        f"sequence: {wb['embedding_rows']} B at batch 1), plus the attended KV: `tokens_attended` of "
        f"`backend.report_rows()` summed over sites × {per_tok} B per token (2 × {r0['kv_heads']} KV heads × "
        f"{r0['head_dim']} × {r0['element_size']} B) × batch (eager HF: every token at every layer), plus, for "
        "compressed policies, the metadata bound: per site `device_bytes` minus the keys and values it holds "
        "(everything else it keeps on the device, buffer slack included, so an upper bound on what a step reads) "
        "plus `selection_bytes`, what the step's selection read from a host tier (TailorKV: the critical key "
        "channels of every candidate token). Tokens fetched from a host tier (TailorKV) are counted once, as "
        "attended. GB/s = bytes / ms per token; "
        "the share is of the bandwidth measured above at the same thread count.",
        "- **Ratios**: × Full is to kvpass Full at the same context, batch and threads; × floor is to F(N, B), "
        "Full's own ms/token at context N = the tokens the policy attends per site (from the report, averaged "
        "over the sites: ClusterKV's dense layers attend everything), at the same batch: interpolated "
        "linearly between the two measured contexts that bracket N (Full's step reads the weights plus N "
        "tokens per site), else Full at the nearest measured context (e.g. 1024 for a budget of 1024). The "
        "detail table gives N and the contexts used, or the one context, in parentheses. ‡ marks a compressed "
        f"cell faster than {DISTURBED}× its floor (the machine drifted between the two; not a measurement).",
        "- **Breakdown**: extra decode steps under `torch.profiler` "
        + ("between the dropped and the timed ones (the cell starts that many tokens earlier, so that they too "
           "attend at most its context)" if all(r.get("profiled_before_timed") for r in rows if "breakdown" in r)
           else "after the timed ones (their cache went past the context by as many tokens)")
        + "; self CPU time of the "
        "main thread goes to `selection` (ranges `kvpass.select`), `gather+attention` (ranges `kvpass.attend`, "
        "and SDPA elsewhere; where the runtime has no ranges, SDPA / bmm / matmul under a `kvpass::` op), "
        "`bookkeeping` (ranges `kvpass.bookkeeping`), `runtime` (the rest of the time inside `kvpass::` ops) and "
        "`rest` (linear layers and everything else: the profiled step time minus the others). `source` says "
        "whether the runtime's `kvpass.*` ranges were present (`ranges`) or only op names (`ops`). Quest, "
        "ClusterKV and TailorKV's sparse layers on CPU attend in their selection's C call (docs/design.md, "
        "\"Rows ahead in L2\"): their `selection` holds their attention. Profiled steps run slower than timed ones (profiler overhead).",
    ]
    beyond = sorted({r["context"] for r in rows if r["beyond_positions"]})
    if beyond:
        lines += [
            f"- **Past the trained window**: the model was trained on {r0['max_positions']} positions; the "
            f"context(s) {', '.join(map(str, beyond))} go beyond it (repeated keys and values, positions continue "
            "past it): those columns measure speed only, not a usable model.",
        ]
    lines += ["", "## Results", "", markdown_tables(rows), "## Plots", ""]
    for p in pngs:
        lines += [f"![{p.stem}]({img_dir.name}/{p.name})", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- CLI


def page_head(title: str, generator: str, source: str, commands: list[str]) -> list[str]:
    """A generated page's first lines: the title, the do-not-edit note naming ``generator``, where the method
    is (``source``), the command(s) and the machine heading."""
    return [title, "", f"<!-- Generated by {generator}; do not edit by hand: rerun the command(s) below. -->", "",
            f"Every number on this page comes from the run(s) below; see {source} for the method.", "",
            "## Command(s)", "", "```bash", *[c for c in commands if c], "```", "", "## Machine", ""]


def machine_line(threads: int, m: dict) -> str:
    """The machine of a row (``machine_info()``) at ``threads`` torch threads, as a page's list item."""
    return (f"- {threads} torch thread(s): {m.get('cpu_count')} cores, {m.get('processor')}, {m.get('platform')}; "
            f"Python {m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers')}; CPU decode "
            f"kernels: {_kernels_label(m)}")


def _kernels_label(machine: dict) -> str:
    native = machine.get("native_kernels")
    if native is None:
        return "not recorded (rows from before kvpass.kernels.native)"
    return "C (kvpass.kernels.native)" if native else "torch (KVPASS_NATIVE=0 or no C compiler)"


def _command(args: argparse.Namespace) -> str:
    if Path(sys.argv[0]).name == "kvpass" and len(sys.argv) > 1 and sys.argv[1] == "bench":
        return shlex.join(["kvpass"] + sys.argv[1:])
    parts = ["kvpass", "bench", "--decode-cost", "--model", args.model]
    for opt in ("policies", "contexts", "batches", "batch_context", "steps", "warmup_steps", "profile_steps",
                "rounds", "statistic", "threads", "results_md"):
        v = getattr(args, opt, None)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if args.quick:
        parts.append("--quick")
    if getattr(args, "paired", False):
        parts.append("--paired")
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def settings(args: argparse.Namespace) -> tuple:
    """``(contexts, batches, batch_context, steps, threads, policies, command)`` from the options of
    ``kvpass bench --decode-cost`` (and ``--paired``), presets filled in; bad specs fail here, before the
    slow load."""
    preset = QUICK if args.quick else DEFAULTS
    contexts = parse_ints(args.contexts or preset["contexts"], "contexts")
    batches = parse_ints(args.batches or preset["batches"], "batches")
    batch_context = args.batch_context or preset["batch_context"]
    steps = args.steps or preset["steps"]
    default_threads = torch.get_num_threads()
    if args.threads:
        threads = parse_ints(args.threads, "threads")
    else:
        threads = [default_threads] if args.quick else list(dict.fromkeys([1, default_threads]))
    policies = parse_policies(args.policies or DEFAULT_POLICIES)
    return contexts, batches, batch_context, steps, threads, policies, _command(args)


def run(args: argparse.Namespace) -> int:
    """``kvpass bench --decode-cost`` (options in :func:`kvpass.bench.cli.add_arguments`)."""
    contexts, batches, batch_context, steps, threads, policies, command = settings(args)
    t0 = time.perf_counter()
    model, tok, model_name, policies, out = load_for_bench(args, policies)
    run_decode_cost(model, tok, policies, contexts, batches, out, batch_context=batch_context, threads=threads,
                    steps=steps, warmup_steps=args.warmup_steps, profile_steps=args.profile_steps,
                    model_name=model_name, command=command, progress=not args.no_progress,
                    skinny_linear=args.skinny_linear, rounds=args.rounds)
    rows = [restat(r, args.statistic) for r in load_results(out / RESULTS) if r["model"] == model_name]
    print()
    print(markdown_tables(rows))
    if args.results_md:
        page = write_decode_cost_md(out, Path(args.results_md), command, args.statistic)
        print(f"kvpass bench --decode-cost: wrote {page}")
    print(f"kvpass bench --decode-cost: {len(rows)} cells in {out / RESULTS}; this run took "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0

"""``kvpass bench --throughput``: padded batches of prompts of mixed lengths, as servers decode them.

::

    kvpass bench --throughput --batches 1,4,8 --lengths 2048-8192 --out bench_out/throughput-<date> --results-md docs/results/throughput.md
    kvpass bench --throughput --model tiny --batches 1,2 --lengths 40-90 --threads 1      # structure only

Every figure comes from ONE process, for ``Full`` and every policy of ``--policies`` (default: Full,
StreamingLLM(budget=1024), Quest(budget=1024), ClusterKV(budget=1024), CentroidKV(cache_ratio=0.25),
TailorKV(sparse_budget=1024)):

- **The batch**: B prompts whose lengths are spread evenly over ``--lengths LO-HI`` (a batch of 1 takes the
  middle length), left-padded to the longest, as ``tokenizer(..., padding_side="left")`` gives them. Their
  keys and values are prefixes of ONE exact prefill of HI tokens of ``pydoc_data.topics`` prose (a causal
  prefill of a prefix gives the same), put into a fresh ``DynamicCache`` with zeros at the padding and
  the matching attention mask; the policy adopts that cache at its first decode step.
- **Decoding**: a hand loop ``fwd(input_ids, past_key_values, attention_mask, position_ids)`` under
  ``torch.no_grad()``, greedy, the mask extended by ones and each row's position counted from its own
  first token (what ``generate()`` passes).
- **Time**: ``--warmup-steps`` dropped steps (the adoption builds the metadata there), then the median of
  ``--steps`` timed steps; tokens/s = B / the median step. Each graph key is compiled once per thread count
  (one backend each, all kept compiled at once: :func:`kvpass.bench.timing.graph_keys_kept`) and warmed up
  on short padded batches first; then each batch size runs Full and every policy one after the other
  (``interleaved: "by batch"`` in the rows), so that a slow spell of the shared cores lands on a batch's
  cells together rather than on one policy's cells alone.
- **Bytes**: ``device_bytes`` summed over sites, and per row: a padded batch reports each row's bytes
  (``rows`` of the report row: a row served row by row holds its own; a state that serves the batch in
  place, Full, Quest or ClusterKV, gives each row its share of buffers at the padded length); a batch without
  padding divides by B.
- **Agreement with Full**: the share of each row's decoded tokens equal to Full's at the same step of the
  same cell (greedy, so one early difference can change the rest).
- **A task** (``--task single_needle``, any of :mod:`kvpass.bench.tasks`): each row is instead a sample of
  the task whose chat prompt has about the row's length (seed ``--seed`` + the length), prefilled exactly
  on its own; the cell decodes the task's answer length (``--steps`` is then that length less the prefill's
  token and the warm-up) and scores each row's greedy answer (``tasks.score``): ``accuracy`` and
  ``outputs`` per row, Full's from the same rows on its own line. Without a task the prose has no answer,
  and the agreement with Full is the bench's accuracy figure.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from kvpass import kvpass
from kvpass.bench.common import load_for_bench, parse_ints, parse_policies
from kvpass.bench.decode_cost import _now
from kvpass.bench.prompts import topics_text
from kvpass.bench.runner import _append, _model_name, default_new_tokens as _new, machine_info, policy_label
from kvpass.bench.tasks import make_sample, score
from kvpass.bench.timing import answer_text, cache_from, cache_tensors, graph_keys_kept
from kvpass.models import chat_prompt
from kvpass.policies.full import Full

RESULTS = "throughput.jsonl"
DEFAULT_POLICIES = ("Full,StreamingLLM(budget=1024),Quest(budget=1024),ClusterKV(budget=1024),"
                    "CentroidKV(cache_ratio=0.25),TailorKV(sparse_budget=1024)")
DEFAULTS = {"batches": "1,4,8,16", "lengths": "2048-8192", "steps": 8}
QUICK = {"batches": "1,4", "lengths": "1024-2048", "steps": 4}


def row_lengths(batch: int, lo: int, hi: int) -> list[int]:
    """``batch`` prompt lengths spread evenly over ``[lo, hi]`` (one prompt: the middle)."""
    if batch == 1:
        return [(lo + hi) // 2]
    return [lo + round((hi - lo) * i / (batch - 1)) for i in range(batch)]


def prose_rows(prefill_kv, ids: torch.Tensor, lengths: list[int]) -> list[tuple]:
    """Rows of a batch as prefixes of one prefill: ``(per-layer (k, v) of 1 row, first input id (1,), length)``,
    row i holding the first ``lengths[i]`` tokens and continuing with the next token of ``ids (1, S)``."""
    return [([(k[:, :, :n], v[:, :, :n]) for k, v in prefill_kv], ids[0, n : n + 1], n) for n in lengths]


def padded_cache(model, rows: list[tuple]):
    """A DynamicCache of ``len(rows)`` rows (see :func:`prose_rows`), row i's keys and values right-aligned
    (zeros before), and the ``(B, max)`` attention mask."""

    lengths = [n for _, _, n in rows]
    width, batch = max(lengths), len(rows)
    mask = torch.zeros((batch, width), dtype=torch.long)
    kv = []
    for layer, (k, v) in enumerate(rows[0][0]):
        kk = k.new_zeros((batch, k.shape[1], width, k.shape[3]))
        vv = v.new_zeros((batch, v.shape[1], width, v.shape[3]))
        for i, (row_kv, _, n) in enumerate(rows):
            kk[i, :, width - n :] = row_kv[layer][0][0, :, :n]
            vv[i, :, width - n :] = row_kv[layer][1][0, :, :n]
        kv.append((kk, vv))
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    return cache_from(model, kv), mask


def task_rows(model, tokenizer, task: str, lengths: list[int], seed: int, progress: bool) -> dict[int, tuple]:
    """For each length n: a sample of ``task`` whose chat prompt has about n tokens (seed ``seed + n``),
    prefilled exactly on its own: ``{n: (sample, per-layer (k, v), first new token (1,), prompt tokens)}``."""

    overhead = len(tokenizer(chat_prompt(tokenizer, ""), add_special_tokens=False)["input_ids"])
    out = {}
    for n in lengths:
        t0 = time.perf_counter()
        sample = make_sample(task, tokenizer, n - overhead, seed + n)
        ids = tokenizer(chat_prompt(tokenizer, sample.prompt), return_tensors="pt", add_special_tokens=False)["input_ids"]
        res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        kv = [(k.detach(), v.detach()) for k, v in cache_tensors(res.past_key_values)]
        out[n] = (sample, kv, res.logits[0, -1:].argmax(-1), ids.shape[1])
        del res
        if progress:
            print(f"kvpass bench --throughput: {task} sample of {ids.shape[1]} tokens prefilled in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _decode(fwd, cache, mask, ids, pos, n) -> tuple[list[torch.Tensor], list[float], torch.Tensor, torch.Tensor]:
    toks, times = [], []
    for _ in range(n):
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
        t0 = time.perf_counter()
        out = fwd(input_ids=ids, past_key_values=cache, attention_mask=mask, position_ids=pos, use_cache=True)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
        toks.append(ids[:, 0].clone())
        pos = pos + 1
    return toks, times, ids, mask


def _bytes(backend, batch: int) -> tuple[int, int, list[int]]:
    rows = [r for r in backend.report_rows() if "reason" not in r]
    device = sum(int(r.get("device_bytes", 0)) for r in rows)
    host = sum(int(r.get("host_bytes", 0)) for r in rows)
    if rows and all("rows" in r for r in rows):
        per_row = [sum(int(r["rows"][i]["device_bytes"]) for r in rows) for i in range(batch)]
    else:
        per_row = [device // batch] * batch
    return device, host, per_row


def run_throughput(model, tokenizer, policies, batches: list[int], lo: int, hi: int, out_dir: Path, *,
                   threads: list[int], steps: int = 8, warmup_steps: int = 3, model_name: str | None = None,
                   command: str = "", progress: bool = True, task: str | None = None,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Measure every (threads, policy, batch) cell (see the module docstring); rows are appended to
    ``out_dir/throughput.jsonl`` and returned. ``task``: each row is a sample of that task
    (:mod:`kvpass.bench.tasks`), decoded for the task's answer length and scored."""

    if not 1 <= lo <= hi:
        raise ValueError(f"kvpass: --lengths needs 1 <= LO <= HI, got {lo}-{hi}")
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    if task is not None:
        steps = max(1, _new(task) - 1 - warmup_steps)  # the first new token comes from the prefill
    if hi + warmup_steps + steps + 1 > max_pos:
        raise ValueError(f"kvpass: --lengths up to {hi} plus {warmup_steps + steps + 1} new tokens passes the "
                         f"model's {max_pos} positions; lower HI")
    policies = [Full()] + [p for p in policies if not isinstance(p, Full)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS
    model_name = model_name or _model_name(model)
    ids = tokenizer(topics_text(), return_tensors="pt", add_special_tokens=False)["input_ids"][:, : hi + 1]
    rows_out: list[dict[str, Any]] = []
    old_threads = torch.get_num_threads()
    fwd_eager = model.forward
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")
            t0 = time.perf_counter()
            prose = hi if task is None else 128  # a task's rows are its samples: prose only warms up
            out = fwd_eager(input_ids=ids[:, :prose], use_cache=True, logits_to_keep=1)
            prefill_kv = [(k.detach(), v.detach()) for k, v in cache_tensors(out.past_key_values)]
            del out
            if progress:
                print(f"kvpass bench --throughput: prefill of {prose} tokens in {time.perf_counter() - t0:.1f} s",
                      flush=True)
            samples = None
            if task is not None:
                wanted = sorted({n for b in batches for n in row_lengths(b, lo, hi)})
                # the answer is the prefill's token and the decoded ones (steps covers the task's length)
                samples = task_rows(model, tokenizer, task, wanted, seed, progress)

            def batch_rows(lengths):
                if samples is None:
                    return prose_rows(prefill_kv, ids, lengths)
                return [(samples[n][1], samples[n][2], samples[n][3]) for n in lengths]

            def start(rows):
                first = torch.stack([f.reshape(()) for _, f, _ in rows]).view(-1, 1)
                pos = torch.tensor([n for _, _, n in rows]).view(-1, 1)
                return first, pos

            for t in threads:
                torch.set_num_threads(t)
                full_tokens: dict[int, list[torch.Tensor]] = {}
                full_tps: dict[int, float] = {}
                # every graph key compiled first, on a backend of its own (dynamo keeps a cache entry per
                # backend); then each batch runs Full and every policy back to back, so that a slow spell of
                # the machine lands on a batch's cells together instead of on one policy's
                keys = list(dict.fromkeys(p.graph_key() for p in policies))
                runners: dict[str, tuple] = {}
                with graph_keys_kept(len(keys)):
                    for gk in keys:
                        backend = kvpass(next(p for p in policies if p.graph_key() == gk))
                        fwd = torch.compile(fwd_eager, backend=backend, dynamic=True)
                        t0 = time.perf_counter()
                        for warm in ([48], [40, 64], [33, 50, 70]):  # batch 1, a padded batch, another size
                            rows = prose_rows(prefill_kv, ids, warm)
                            cache, mask = padded_cache(model, rows)
                            backend.adopt(cache)  # one decode graph: the first step runs the steady one
                            _decode(fwd, cache, mask, *start(rows), warmup_steps + 2)
                        runners[gk] = (backend, fwd)
                        if progress:
                            print(f"kvpass bench --throughput: compiled {len(backend.graphs)} graph(s) in "
                                  f"{time.perf_counter() - t0:.0f} s ({t} thread(s))", flush=True)
                    for b in batches:
                        for p in policies:  # Full first: the others' agreement and x Full need its cell
                            backend, fwd = runners[p.graph_key()]
                            gc.collect()
                            backend.set_policy(p)
                            rows = batch_rows(row_lengths(b, lo, hi))
                            lengths = [n for _, _, n in rows]
                            cache, mask = padded_cache(model, rows)
                            backend.adopt(cache)
                            g0 = len(backend.graphs)
                            first, pos = start(rows)
                            warm_toks, _, nxt, mask = _decode(fwd, cache, mask, first, pos, warmup_steps)
                            toks, times, _, _ = _decode(fwd, cache, mask, nxt, pos + warmup_steps, steps)
                            accuracy = outputs = None
                            if samples is not None:
                                new_ids = torch.cat([first, torch.stack(warm_toks + toks, 1)], 1)
                                outputs = [answer_text(tokenizer, new_ids[i].tolist()) for i in range(b)]
                                accuracy = [score(samples[n][0], o)
                                            for n, o in zip(row_lengths(b, lo, hi), outputs)]
                            device, host, per_row = _bytes(backend, b)
                            tps = b / statistics.median(times)
                            seq = torch.stack(toks, 1)  # (B, steps)
                            if isinstance(p, Full):
                                full_tokens[b], full_tps[b] = seq, tps
                            agree = None
                            if b in full_tokens:
                                agree = [float((seq[i] == full_tokens[b][i]).float().mean()) for i in range(b)]
                            row = {
                                "model": model_name, "policy": p.describe(), "policy_name": policy_label(p),
                                "batch": b, "lengths": lengths, "threads": t, "steps": steps,
                                "warmup_steps": warmup_steps, "step_ms": [1000 * x for x in times],
                                "ms_per_step": 1000 * statistics.median(times), "tokens_per_s": tps,
                                "full_tokens_per_s": full_tps.get(b), "x_full": tps / full_tps[b] if b in full_tps
                                else None, "device_bytes": device, "host_bytes": host,
                                "device_bytes_per_row": per_row, "agreement_with_full": agree,
                                "task": task, "accuracy": accuracy, "outputs": outputs,
                                "graphs_compiled_timed": len(backend.graphs) - g0, "interleaved": "by batch",
                                "machine": machine_info(),
                                "command": command, "finished": _now(),
                            }
                            _append(path, row)
                            rows_out.append(row)
                            del cache
                            if progress:
                                xf = f"{row['x_full']:.2f}x Full" if row["x_full"] else "-"
                                ag = f"{100 * sum(agree) / len(agree):.0f} % = Full" if agree else ""
                                if accuracy is not None:
                                    ag += f", {task} accuracy {100 * sum(accuracy) / len(accuracy):.0f} %"
                                print(f"  {row['policy_name']:<28} batch={b:<3} {tps:7.2f} tokens/s ({xf}), "
                                      f"{device / 2**20:8.1f} MiB on device, max {max(per_row) / 2**20:.1f} MiB/row "
                                      f"{ag}", flush=True)
                del runners, backend, fwd
    finally:
        torch.set_num_threads(old_threads)
        torch._dynamo.reset()
    return rows_out


def markdown_tables(rows: list[dict[str, Any]]) -> str:
    lines = []
    for t in sorted({r["threads"] for r in rows}):
        sel = [r for r in rows if r["threads"] == t]
        batches = sorted({r["batch"] for r in sel})
        names = list(dict.fromkeys(r["policy_name"] for r in sel))
        task = next((r.get("task") for r in sel if r.get("task")), None)
        acc_head = f" / {task} accuracy over the rows" if task else ""
        lines += [f"### {t} thread(s): tokens/s (x Full, same batch) / MiB on the device, max per row / tokens "
                  f"equal to Full{acc_head}", "", "| policy | " + " | ".join(f"batch {b}" for b in batches) + " |",
                  "|---|" + "---:|" * len(batches)]
        for n in names:
            cells = []
            for b in batches:
                r = next((x for x in sel if x["policy_name"] == n and x["batch"] == b), None)
                if r is None:
                    cells.append("-")
                    continue
                xf = f"{r['x_full']:.2f}x" if r.get("x_full") else "-"
                ag = r.get("agreement_with_full")
                ag = f"{100 * sum(ag) / len(ag):.0f} %" if ag else "-"
                acc = r.get("accuracy")
                acc = f" / {100 * sum(acc) / len(acc):.0f} %" if acc else ""
                cells.append(f"{r['tokens_per_s']:.2f} ({xf}) / {r['device_bytes'] / 2**20:.0f}, "
                             f"{max(r['device_bytes_per_row']) / 2**20:.1f} / {ag}{acc}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for t in sorted({r["threads"] for r in rows}):
        sel = [r for r in rows if r["threads"] == t]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for n in dict.fromkeys(r["policy_name"] for r in sel):
            mine = sorted((r for r in sel if r["policy_name"] == n), key=lambda r: r["batch"])
            a.plot([r["batch"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=n)
            b.plot([r["batch"] for r in mine], [max(r["device_bytes_per_row"]) / 2**20 for r in mine], marker="o",
                   label=n)
        a.set(xlabel="batch (padded, mixed lengths)", ylabel="tokens/s", title=f"throughput, {t} thread(s)")
        b.set(xlabel="batch", ylabel="MiB on the device, largest row", title="bytes per row")
        a.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"throughput_{t}t.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _order_text(rows: list[dict[str, Any]]) -> str:
    if rows and all(r.get("interleaved") == "by batch" for r in rows):
        return ("The cells are one run on a shared machine, each batch size's cells (Full and every policy) run one "
                "after the other, every graph kept compiled: a slow spell of the cores lands on a batch's cells "
                "together. A cell still moves by several percent between runs.")
    return ("The cells are one run on a shared machine, each policy's cells after Full's (rows written before the "
            "bench interleaved them): a cell moves by up to a quarter between runs.")


def write_page(rows: list[dict[str, Any]], path: Path, command: str) -> Path:
    path = Path(path)
    pngs = plot(rows, path.parent / path.stem)
    lengths = sorted({n for r in rows for n in r["lengths"]})
    machine = rows[0]["machine"] if rows else {}
    task = next((r.get("task") for r in rows if r.get("task")), None)
    source = "the keys and values are prefixes of one exact prefill of prose."
    if task:
        source = (f"each row is a `{task}` sample of about its length (kvpass/bench/tasks.py), prefilled exactly "
                  "on its own, and decoded greedily for the task's answer length; its accuracy is the share of "
                  "the sample's answers found in that answer (`tasks.score`), averaged over the batch's rows "
                  "(Full's, from the same rows, is its own line).")
    text = [
        "# Throughput: padded batches of mixed lengths" + (f", each row a {task} sample" if task else ""), "",
        f"<!-- Generated by `kvpass bench --throughput` (kvpass.bench.throughput.write_page); do not edit by hand: "
        "rerun the command below. -->", "",
        "Every number on this page comes from the run below; kvpass/bench/throughput.py says how it is measured.",
        "", "## Command", "", "```bash", command, "```", "",
        f"Machine: {machine.get('cpu_count')} cores, {machine.get('processor')}, {machine.get('platform')}; Python "
        f"{machine.get('python')}, torch {machine.get('torch')}, transformers {machine.get('transformers')}.", "",
        f"Prompt lengths in this run: {lengths[0]} to {lengths[-1]} tokens, left-padded to the longest of each "
        f"batch; {source} Quest, ClusterKV and TailorKV's sparse layers serve a "
        "padded batch in place (each row's pages, sinks and clusters, or sinks and candidates, from its first real "
        "token); CentroidKV and TailorKV's quantised layers serve it row by row (docs/design.md, \"Padding\"). "
        "Tokens equal to Full: greedy, at the same step of the "
        "same cell. " + _order_text(rows), "",
        "## Results", "", markdown_tables(rows),
    ]
    for p in pngs:
        text += [f"![{p.stem}]({path.stem}/{p.name})", ""]
    path.write_text("\n".join(text))
    return path


def _command(args: argparse.Namespace) -> str:
    if Path(sys.argv[0]).name == "kvpass" and len(sys.argv) > 1 and sys.argv[1] == "bench":
        return shlex.join(["kvpass"] + sys.argv[1:])
    parts = ["kvpass", "bench", "--throughput", "--model", args.model]
    for opt in ("policies", "batches", "lengths", "task", "steps", "warmup_steps", "threads", "results_md"):
        v = getattr(args, opt, None)
        if v is not None:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if args.quick:
        parts.append("--quick")
    return shlex.join(parts + ["--out", str(args.out)])


def run(args: argparse.Namespace) -> int:
    """``kvpass bench --throughput`` (options in :func:`kvpass.bench.cli.add_arguments`)."""

    preset = QUICK if args.quick else DEFAULTS
    batches = parse_ints(args.batches or preset["batches"], "batches")
    spec = args.lengths or preset["lengths"]
    try:
        lo, hi = (int(x) for x in spec.split("-"))
    except ValueError:
        raise ValueError(f"kvpass: --lengths takes LO-HI (e.g. 2048-8192), got {spec!r}") from None
    threads = parse_ints(args.threads, "threads") if args.threads else [torch.get_num_threads()]
    policies = parse_policies(args.policies or DEFAULT_POLICIES)
    command = _command(args)
    t0 = time.perf_counter()
    model, tok, model_name, policies, out = load_for_bench(args, policies)
    rows = run_throughput(model, tok, policies, batches, lo, hi, out, threads=threads,
                          steps=args.steps or preset["steps"], warmup_steps=args.warmup_steps,
                          task=getattr(args, "task", None), seed=getattr(args, "seed", 0),
                          model_name=model_name, command=command, progress=not args.no_progress)
    print()
    print(markdown_tables(rows))
    if args.results_md:
        print(f"kvpass bench --throughput: wrote {write_page(rows, Path(args.results_md), command)}")
    print(f"kvpass bench --throughput: {len(rows)} cells in {out / RESULTS}; this run took "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0

"""Run a grid of (policy, context, task, sample) cells through ONE compiled model.

::

    from kvpass.bench.runner import run_grid
    rows = run_grid(model, tokenizer, [Full(), Quest(budget=512)], contexts=[4096],
                    tasks=["single_needle"], samples=2, out_dir=Path("bench_out"))

How it works: the model's ``forward`` is compiled once, ``torch.compile(model.forward,
backend=kvpass(Full()), dynamic=True)`` (prefill and decode graphs, each good for any length),
warmed up on a short input, and every policy of the grid is swapped in with
``backend.set_policy(policy)``: policies with the same ``graph_key()`` share the rewritten graph, so a
sweep over policies and budgets compiles nothing more (the row's ``graphs_compiled`` says if something
did). Policies whose graph differs (ClusterKV with offload inserts fetch ops) run after the others,
with a backend and a compile of their own.

Per cell the sample comes from :func:`kvpass.bench.tasks.make_sample` wrapped in the model's chat
template; generation is greedy with a fixed number of new tokens (no stop at ``<|im_end|>``, so every
policy decodes the same number of tokens; the answer is cut there before scoring), timed by a streamer
as in :mod:`kvpass.demo`. ``Full`` runs first for each (context, task, sample) so that the report can
put its accuracy and speed next to every compressed figure.

Rows are appended to ``out_dir/results.jsonl`` and flushed as each cell finishes; cells already in
the file (same model, policy, context, task, sample, seed and haystack) are skipped, so an
interrupted run resumes where it stopped.

Row fields: ``model``, ``policy`` (``describe()``), ``policy_name``, ``budget`` (None for Full),
``context`` (requested), ``context_used`` (passed to ``make_sample``: capped so that prompt, chat
template and new tokens fit the model's positions), ``prompt_tokens``, ``task``, ``sample``, ``seed``,
``haystack``, ``new_tokens``, ``accuracy``, ``output``, ``answers``, ``prefill_s``, ``decode_ms``
(per token), ``tokens_held`` / ``tokens_attended`` / ``device_bytes`` / ``host_bytes`` (summed over
sites, at the last decode step), ``bytes_moved`` (between tiers, over the sequence) and
``bytes_moved_per_step``, ``overhead_prefill_s`` / ``overhead_decode_s`` (the policy's own work:
metadata, clustering, selection, summed over sites) with ``overhead_prefill_share`` (of prefill_s)
and ``overhead_decode_share`` (of a decode step), ``decode_steps``, ``sites``, ``left_exact``, ``recall`` (``{"mass", "topk",
"layers"}``) and ``recall_per_layer`` (``{layer: {"mass", "topk", "steps"}}``, sampled every
``recall_every``-th decode step; those steps also pay for the probe, so decode_ms carries it for every
policy alike), ``peak_rss_bytes`` (the process's peak so far: monotone over a run), ``graphs_compiled``
(during the cell; 0 expected), ``wall_s``, ``machine``, ``command``, ``finished`` (UTC ISO time).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import resource
import shlex
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvpass import kvpass
from kvpass.bench.kernels import benchmark_kernels
from kvpass.bench.perplexity import perplexity
from kvpass.bench.recall import RecallProbe
from kvpass.bench.tasks import all_tasks, make_sample, score
from kvpass.bench.timing import Stamps, answer_text, generation_config
from kvpass.kernels import cpu_decode
from kvpass.models import chat_prompt
from kvpass.policies.base import Policy
from kvpass.policies.full import Full

__all__ = ["run_grid", "run_perplexity", "run_kernels", "default_new_tokens", "machine_info", "cell_key",
           "load_results", "RESULTS", "PERPLEXITY", "KERNELS"]

RESULTS = "results.jsonl"
PERPLEXITY = "perplexity.jsonl"
KERNELS = "kernels.jsonl"

#: New tokens per task: enough for the answers. SmolLM2 restates the question before the number ("The
#: special magic number for witty-badger mentioned in the text above is ..." is 16 tokens), so a
#: needle gets 32; lists of several items 48.
NEW_TOKENS = {
    "single_needle": 32,
    "multi_key_needle": 32,
    "multi_value": 48,
    "multi_query": 48,
    "variable_tracking": 48,
    "common_words": 48,
    "frequent_words": 24,
}

_WARMUP_TOKENS = 64


def default_new_tokens(task: str) -> int:
    return NEW_TOKENS.get(task, 48)


def machine_info() -> dict[str, Any]:
    """Cores, threads and versions, recorded in every row."""
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": _processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        # the CPU decode paths: the C kernels of kvpass.kernels.native, or the torch code (KVPASS_NATIVE=0,
        # no compiler)
        "native_kernels": _native_kernels(),
    }


def _processor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The architecture, with the CPU's model and widest vector set where Linux says them (``x86_64 (AMD
    EPYC, AVX-512)``): figures from two machines of one name are not comparable, and the C kernels' vector
    width follows the second."""
    arch = platform.processor() or platform.machine()
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return arch
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    extra = ", ".join(x for x in (model, isa) if x)
    return f"{arch} ({extra})" if extra else arch


def _native_kernels() -> bool:
    return cpu_decode.available()


# Fields that are the budget (its own column) or follow from it, or are shown elsewhere (a profile).
_BUDGET_FIELDS = {"budget", "sparse_budget", "static_tokens", "window", "cache_ratio", "offload", "profile"}


def policy_label(policy: Policy) -> str:
    """The policy's name, with what sets it apart in a table besides its budget: offload (ClusterKV),
    the cache ratio of ratio-budgeted policies (CentroidKV), TailorKV's profile (``profile=auto``, or
    ``profiled`` for a calibrated one), and every other parameter that differs from the
    class default (``ClusterKV kmeans_iters=4``)."""
    import dataclasses

    label = policy.name
    if getattr(policy, "offload", False):
        label += " offload"
    ratio = getattr(policy, "cache_ratio", None)
    if ratio is not None:
        label += f" ratio={ratio}"
    prof = getattr(policy, "profile", None)
    if prof is not None:  # 'auto', or a calibrated Profile (a path is loaded into one, the bench makes one)
        label += " profile=auto" if prof == "auto" else " profiled"
    changed = [f"{f.name}={getattr(policy, f.name)!r}" for f in dataclasses.fields(policy)
               if f.name not in _BUDGET_FIELDS and f.default is not dataclasses.MISSING
               and getattr(policy, f.name) != f.default]
    return label + (" " + ", ".join(changed) if changed else "")


def policy_budget(policy: Policy) -> int | None:
    """The token budget of a policy (``budget`` field or property), None for Full."""
    b = getattr(policy, "budget", None)
    return b if isinstance(b, int) else None


def cell_key(row: dict[str, Any]) -> tuple:
    return (row["model"], row["policy"], int(row["context"]), row["task"], int(row["sample"]),
            int(row["seed"]), row["haystack"])


def load_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a results.jsonl (a torn last line, from a killed run, is ignored)."""
    rows: list[dict[str, Any]] = []
    if not Path(path).exists():
        return rows
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _model_name(model) -> str:
    name = getattr(model.config, "_name_or_path", "") or ""
    return Path(name).name if name else type(model).__name__


def _with_full(policies: Iterable[Policy]) -> list[Policy]:
    out: list[Policy] = [Full()]
    for p in policies:
        if not isinstance(p, Policy):
            raise TypeError(f"kvpass: run_grid needs Policy objects, got {type(p).__name__}: {p!r}")
        if isinstance(p, Full) or p in out:
            continue
        out.append(p)
    return out


def _site_sums(backend) -> dict[str, Any]:
    rows = backend.report_rows()
    sites = [r for r in rows if "reason" not in r]
    return {
        "sites": len(sites),
        "left_exact": len(rows) - len(sites),
        "tokens_held": sum(int(r.get("tokens_held", 0)) for r in sites),
        "tokens_attended": sum(int(r.get("tokens_attended", 0)) for r in sites),
        "device_bytes": sum(int(r.get("device_bytes", 0)) for r in sites),
        "host_bytes": sum(int(r.get("host_bytes", 0)) for r in sites),
        "bytes_moved": sum(int(r.get("bytes_moved", 0)) for r in sites),
        "overhead_prefill_s": sum(float(r.get("overhead_prefill_s", 0.0)) for r in sites),
        "overhead_decode_s": sum(float(r.get("overhead_decode_s", 0.0)) for r in sites),
        "decode_steps": max([int(r.get("steps", 0)) for r in sites], default=0),
        # what a policy reports per layer beyond the common columns (TailorKV's tiers and estimates)
        "site_details": [
            {k: r[k] for k in ("layer",) + SITE_DETAILS + SITE_COMMON if k in r}
            for r in sites if any(k in r for k in SITE_DETAILS)
        ],
    }


SITE_DETAILS = ("tier", "P", "estimate", "estimate_cos", "quant_ratio")
SITE_COMMON = ("tokens_attended", "device_bytes", "host_bytes", "bytes_moved", "steps")


def _prefill(fwd, ids: torch.Tensor):
    """Exact prefill with the model's own (uncompiled) forward: ``(first token (1, 1), cache, seconds)``."""
    t0 = time.perf_counter()
    out = fwd(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    return first, out.past_key_values, time.perf_counter() - t0


def _warm_up(model, fwd, tokenizer, share_prefill: bool) -> float:
    """Compile every graph a cell will use (prefill, first decode, dynamic decode, and the continuation
    from an adopted cache) on a short input; returns the seconds it took."""

    t0 = time.perf_counter()
    warm = tokenizer(chat_prompt(tokenizer, "Say hello. " * 16), return_tensors="pt",
                     add_special_tokens=False)["input_ids"][:, :_WARMUP_TOKENS]
    model.generate(warm, attention_mask=torch.ones_like(warm), generation_config=generation_config(model, 2))
    if share_prefill:
        # the continuation from an adopted cache passes a real cache, not a stub: its own graph
        first, cache, _ = _prefill(fwd, warm)
        warm1 = torch.cat([warm, first], dim=1)
        model.generate(warm1, attention_mask=torch.ones_like(warm1), past_key_values=cache,
                       generation_config=generation_config(model, 3))
    return time.perf_counter() - t0


def _overheads(row: dict[str, Any]) -> None:
    """Derived per-step figures: the policy's own share of prefill and of a decode step, bytes moved
    between tiers per decode step."""
    steps = max(1, row["decode_steps"])
    row["overhead_prefill_share"] = row["overhead_prefill_s"] / row["prefill_s"] if row["prefill_s"] > 0 else float("nan")
    per_step_ms = 1000 * row["overhead_decode_s"] / steps
    row["overhead_decode_share"] = per_step_ms / row["decode_ms"] if row["decode_ms"] > 0 else float("nan")
    row["bytes_moved_per_step"] = row["bytes_moved"] / steps


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def run_grid(
    model,
    tokenizer,
    policies: list[Policy],
    contexts: list[int],
    tasks: list[str],
    samples: int,
    out_dir: Path,
    *,
    seed: int = 0,
    new_tokens: int | dict[str, int] | None = None,
    recall_every: int = 8,
    haystack: str = "prose",
    progress: bool = True,
    model_name: str | None = None,
    command: str | None = None,
    share_prefill: bool = True,
    on_done=None,
) -> list[dict[str, Any]]:
    """Run every cell not yet in ``out_dir/results.jsonl``; return the rows of this call's cells
    (those run now and those found in the file), in grid order.

    ``on_done(backend, compiled_forward)``: called at the end with the plain graph's backend and the
    compiled ``model.forward`` (the perplexity runs there without compiling again).

    ``share_prefill``: prefill each sample once, exactly (every policy here attends exactly at
    prefill), and start every policy's generation from a copy of that cache and the first token; the
    policy builds its metadata from the adopted cache at its first decode step (counted in its
    ``prefill_s``, which is the shared prefill's time plus that step). False: each cell prefills.

    ``policies``: selection policies (``Full`` is added first if missing). ``contexts``: prompt
    sizes in tokens of the tokenizer (capped to fit the model's positions). ``samples``: seeds
    ``seed .. seed + samples - 1``. ``new_tokens``: an int for every task, a dict per task, or None
    for :data:`NEW_TOKENS`. ``model`` is used as is (its ``forward`` is compiled for the call and
    restored afterwards).
    """

    if samples < 1:
        raise ValueError(f"kvpass: run_grid needs samples >= 1, got samples={samples}")
    if not contexts or any(int(c) < 1 for c in contexts):
        raise ValueError(f"kvpass: run_grid needs positive contexts, got {contexts!r}")
    unknown = [t for t in tasks if t not in all_tasks()]
    if unknown or not tasks:
        raise ValueError(f"kvpass: unknown task(s) {unknown or tasks!r}; expected some of {all_tasks()}")
    policies = _with_full(policies)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS
    model_name = model_name or _model_name(model)
    command = command if command is not None else shlex.join([Path(sys.argv[0]).name] + sys.argv[1:])
    machine = machine_info()

    def n_new(task: str) -> int:
        if isinstance(new_tokens, int):
            return new_tokens
        if isinstance(new_tokens, dict) and task in new_tokens:
            return int(new_tokens[task])
        return default_new_tokens(task)

    for t in tasks:
        if n_new(t) < 2:
            raise ValueError(f"kvpass: run_grid needs new_tokens >= 2 to time decoding, got {n_new(t)} for {t}")

    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    overhead = len(tokenizer(chat_prompt(tokenizer, ""), add_special_tokens=False)["input_ids"])

    def context_used(c: int, task: str) -> int:
        return max(1, min(int(c), max_pos - n_new(task) - overhead - 8))

    # The grid, Full first for each (context, task, sample).
    grid = [(c, t, s, p) for c in contexts for t in tasks for s in range(seed, seed + samples) for p in policies]
    existing = {cell_key(r): r for r in load_results(path)}

    def key_of(c, t, s, p) -> tuple:
        return (model_name, p.describe(), int(c), t, int(s), int(seed), haystack)

    pending = [g for g in grid if key_of(*g) not in existing]
    results: dict[tuple, dict[str, Any]] = {k: existing[k] for k in map(lambda g: key_of(*g), grid) if k in existing}
    if not pending:
        if progress:
            print(f"kvpass bench: all {len(grid)} cells already in {path}", flush=True)
        if on_done is not None:
            pending = []  # still compile the plain graph for on_done below
        else:
            return [results[key_of(*g)] for g in grid]

    # Policies that compile to the same graph share one backend (set_policy); each other graph (a
    # policy that inserts ops of its own, e.g. ClusterKV's fetch) gets its own, compiled when reached.
    # The plain graph runs last so that ``on_done`` gets its backend (Full and the selection policies).
    keys = list(dict.fromkeys([g[3].graph_key() for g in pending if g[3].graph_key() != Full().graph_key()]))
    order = {k: i for i, k in enumerate(keys + [Full().graph_key()])}
    pending.sort(key=lambda g: order[g[3].graph_key()])  # stable: grid order within a graph
    fwd = model.forward
    backend, current, compile_s = None, None, 0.0
    bar = None
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")  # counted in the row
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(pending), desc="kvpass bench", unit="cell", dynamic_ncols=True)
            sample_cache: dict[tuple, tuple] = {}
            for c, t, s, p in pending:
                if p.graph_key() != current:
                    if backend is not None:
                        backend.runtime.set_probe(None)
                    torch._dynamo.reset()
                    current = p.graph_key()
                    backend = kvpass(p if current != Full().graph_key() else Full())
                    model.forward = torch.compile(fwd, backend=backend, dynamic=True)
                    compile_s = _warm_up(model, fwd, tokenizer, share_prefill)
                    if progress:
                        bar.write(f"kvpass bench: compiled {len(backend.graphs)} graph(s) for {current} in "
                                  f"{compile_s:.0f} s; {len(pending)} of {len(grid)} cells to run")
                    sample_cache.clear()
                cell_t0 = time.perf_counter()
                skey = (c, t, s)
                if skey not in sample_cache:
                    sample_cache.clear()  # one sample at a time: Full and the others share it
                    used = context_used(c, t)
                    sample = make_sample(t, tokenizer, used, s, haystack)
                    text = chat_prompt(tokenizer, sample.prompt)
                    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
                    shared = _prefill(fwd, ids) if share_prefill else None
                    sample_cache[skey] = (used, sample, ids, shared)
                used, sample, ids, shared = sample_cache[skey]
                if bar is not None:
                    bar.set_postfix_str(f"{p.describe()} ctx={c} {t} #{s}")
                backend.set_policy(p)
                probe = RecallProbe(every=recall_every)
                backend.runtime.set_probe(probe)
                graphs_before = len(backend.graphs)
                nt = n_new(t)
                stamps = Stamps()
                if shared is None:
                    start = time.perf_counter()
                    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                         generation_config=generation_config(model, nt), streamer=stamps)
                    new_ids = out[0, ids.shape[1]:].tolist()
                else:
                    # Continue from the shared exact prefill: the first new token is already chosen; the
                    # policy adopts the prompt's cache (building its metadata) at the next step.
                    first, cache, prefill_s = shared
                    start = time.perf_counter() - prefill_s
                    ids1 = torch.cat([ids, first], dim=1)
                    out = model.generate(ids1, attention_mask=torch.ones_like(ids1), past_key_values=copy.deepcopy(cache),
                                         generation_config=generation_config(model, nt - 1), streamer=stamps)
                    new_ids = out[0, ids.shape[1]:].tolist()
                backend.runtime.set_probe(None)
                times = stamps.times
                answer = answer_text(tokenizer, new_ids)
                row: dict[str, Any] = {
                    "model": model_name,
                    "policy": p.describe(),
                    "policy_name": policy_label(p),
                    "budget": policy_budget(p),
                    "context": int(c),
                    "context_used": used,
                    "prompt_tokens": int(ids.shape[1]),
                    "task": t,
                    "sample": int(s),
                    "seed": int(seed),
                    "haystack": haystack,
                    "new_tokens": len(new_ids),
                    "accuracy": score(sample, answer),
                    "output": answer,
                    "answers": list(sample.answers),
                    "prefill_s": times[0] - start if times else float("nan"),
                    "decode_ms": 1000 * (times[-1] - times[0]) / max(1, len(times) - 1) if times else float("nan"),
                    **_site_sums(backend),
                    "recall": probe.summary(),
                    "recall_per_layer": {str(k): v for k, v in probe.per_layer().items()},
                    "recall_every": recall_every,
                    "peak_rss_bytes": _peak_rss_bytes(),
                    "graphs_compiled": len(backend.graphs) - graphs_before,
                    "compile_s": compile_s,
                    "wall_s": time.perf_counter() - cell_t0,
                    "machine": machine,
                    "command": command,
                    "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                }
                _overheads(row)
                _append(path, row)
                results[key_of(c, t, s, p)] = row
                if progress:
                    line = (f"{p.describe()} ctx={c} {t} #{s}: acc {row['accuracy']:.2f}, prefill "
                            f"{row['prefill_s']:.1f} s, decode {row['decode_ms']:.1f} ms/tok, recall "
                            f"{row['recall']['mass']:.3f}, output {answer[:40]!r}")
                    bar.write(line)
                    bar.update(1)
            if on_done is not None:
                if current != Full().graph_key():
                    torch._dynamo.reset()
                    backend = kvpass(Full())
                    model.forward = torch.compile(fwd, backend=backend, dynamic=True)
                if bar is not None:
                    bar.close()
                    bar = None
                on_done(backend, model.forward)
    finally:
        if bar is not None:
            bar.close()
        if backend is not None:
            backend.runtime.set_probe(None)
        model.forward = fwd
        torch._dynamo.reset()
    return [results[key_of(*g)] for g in grid]


def _append(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_perplexity(
    model,
    tokenizer,
    policies: list[Policy],
    windows: list[int],
    eval_tokens: int,
    out_dir: Path,
    *,
    model_name: str | None = None,
    command: str | None = None,
    progress: bool = True,
    backend=None,
    compiled=None,
) -> list[dict[str, Any]]:
    """Perplexity of ``pydoc_data.topics`` prose (:func:`kvpass.bench.perplexity.perplexity`) for every
    policy at every window, one compiled backend; rows (``model, policy, policy_name, budget, window,
    eval_tokens, ppl, nll, delta, delta_nll, seconds, machine, command, finished``) appended to
    ``out_dir/perplexity.jsonl``. Rows already there are not run again (Full, the reference of the deltas,
    is run whenever another policy of the window is)."""

    policies = _with_full(policies)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PERPLEXITY
    model_name = model_name or _model_name(model)
    done = {(r["model"], r["policy"], r["window"], r["eval_tokens"]) for r in load_results(path)}
    machine = machine_info()
    max_pos = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    if backend is None:
        backend = kvpass(Full())
    for w in windows:
        w = min(int(w), max_pos)
        todo = [p for p in policies if (model_name, p.describe(), w, eval_tokens) not in done]
        if not todo:
            continue
        if progress:
            print(f"kvpass bench: perplexity, window {w}, last {eval_tokens} tokens scored, "
                  f"{len(todo)} policies", flush=True)
        # Full is always run: the deltas are to Full of the same run
        res = perplexity(model, tokenizer, backend, todo, w, eval_tokens, progress=progress, compiled=compiled)
        for p in todo:
            r = res[p.describe()]
            _append(path, {
                "model": model_name, "policy": p.describe(), "policy_name": policy_label(p), "budget": policy_budget(p),
                "window": w, "eval_tokens": eval_tokens, **{k: r[k] for k in ("ppl", "nll", "delta", "delta_nll",
                                                                               "seconds")},
                "machine": machine, "command": command,
                "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            })
    return [r for r in load_results(path) if r["model"] == model_name]


def run_kernels(out_dir: Path, *, quick: bool = False, command: str | None = None) -> list[dict[str, Any]]:
    """Kernel micro-benchmarks (:func:`kvpass.bench.kernels.benchmark_kernels`, CUDA when present)
    written afresh to ``out_dir/kernels.jsonl`` (timings are of this machine now, never resumed)."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / KERNELS
    rows = benchmark_kernels("cuda" if torch.cuda.is_available() else "cpu", quick=quick)
    machine = machine_info()
    path.unlink(missing_ok=True)
    for r in rows:
        _append(path, {**r, "machine": machine, "command": command})
    return rows

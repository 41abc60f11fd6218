"""Run a grid of (policy, context, task, sample) cells through ONE compiled model.

::

    from kvpass.bench.runner import run_grid
    rows = run_grid(model, tokenizer, [Full(), Quest(budget=512)], contexts=[4096],
                    tasks=["single_needle"], samples=2, out_dir=Path("bench_out"))

How it works: the model's ``forward`` is compiled once, ``torch.compile(model.forward,
backend=kvpass(Full()), dynamic=True)`` (two graphs, prefill and decode, each good for any length),
warmed up on a short input, and every policy of the grid is swapped in with
``backend.set_policy(policy)``: selection policies share the rewritten graph, so a sweep over
policies and budgets compiles nothing more (the row's ``graphs_compiled`` says if something did).

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
sites, at the last decode step), ``sites``, ``left_exact``, ``recall`` (``{"mass", "topk",
"layers"}``) and ``recall_per_layer`` (``{layer: {"mass", "topk", "steps"}}``, sampled every
``recall_every``-th decode step; those steps also pay for the probe, so decode_ms carries it for every
policy alike), ``peak_rss_bytes`` (the process's peak so far: monotone over a run), ``graphs_compiled``
(during the cell; 0 expected), ``wall_s``, ``machine``, ``command``, ``finished`` (UTC ISO time).
"""

from __future__ import annotations

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

from kvpass.policies.base import Policy

__all__ = ["run_grid", "default_new_tokens", "machine_info", "cell_key", "load_results", "RESULTS"]

RESULTS = "results.jsonl"

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
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }


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
    from kvpass.policies.full import Full

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
    }


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
) -> list[dict[str, Any]]:
    """Run every cell not yet in ``out_dir/results.jsonl``; return the rows of this call's cells
    (those run now and those found in the file), in grid order.

    ``policies``: selection policies (``Full`` is added first if missing). ``contexts``: prompt
    sizes in tokens of the tokenizer (capped to fit the model's positions). ``samples``: seeds
    ``seed .. seed + samples - 1``. ``new_tokens``: an int for every task, a dict per task, or None
    for :data:`NEW_TOKENS`. ``model`` is used as is (its ``forward`` is compiled for the call and
    restored afterwards).
    """
    from kvpass import kvpass
    from kvpass.bench.recall import RecallProbe
    from kvpass.bench.tasks import all_tasks, make_sample, score
    from kvpass.demo import _answer, _generation_config, _Stamps
    from kvpass.models import chat_prompt
    from kvpass.policies.full import Full

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
        return [results[key_of(*g)] for g in grid]

    backend = kvpass(Full())
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=backend, dynamic=True)
    bar = None
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")  # counted in the row
            t0 = time.perf_counter()
            warm = tokenizer(chat_prompt(tokenizer, "Say hello. " * 16), return_tensors="pt",
                             add_special_tokens=False)["input_ids"][:, :_WARMUP_TOKENS]
            model.generate(warm, attention_mask=torch.ones_like(warm), generation_config=_generation_config(model, 2))
            compile_s = time.perf_counter() - t0
            if progress:
                print(f"kvpass bench: compiled {len(backend.graphs)} graph(s) in {compile_s:.0f} s; "
                      f"{len(pending)} of {len(grid)} cells to run", flush=True)
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(pending), desc="kvpass bench", unit="cell", dynamic_ncols=True)
            sample_cache: dict[tuple, tuple] = {}
            for c, t, s, p in pending:
                cell_t0 = time.perf_counter()
                skey = (c, t, s)
                if skey not in sample_cache:
                    sample_cache.clear()  # one sample at a time: Full and the others share it
                    used = context_used(c, t)
                    sample = make_sample(t, tokenizer, used, s, haystack)
                    text = chat_prompt(tokenizer, sample.prompt)
                    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
                    sample_cache[skey] = (used, sample, ids)
                used, sample, ids = sample_cache[skey]
                if bar is not None:
                    bar.set_postfix_str(f"{p.describe()} ctx={c} {t} #{s}")
                backend.set_policy(p)
                probe = RecallProbe(every=recall_every)
                backend.runtime.set_probe(probe)
                graphs_before = len(backend.graphs)
                nt = n_new(t)
                stamps = _Stamps()
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=_generation_config(model, nt), streamer=stamps)
                backend.runtime.set_probe(None)
                times = stamps.times
                new_ids = out[0, ids.shape[1]:].tolist()
                answer = _answer(tokenizer, new_ids)
                row: dict[str, Any] = {
                    "model": model_name,
                    "policy": p.describe(),
                    "policy_name": p.name,
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
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                results[key_of(c, t, s, p)] = row
                if progress:
                    line = (f"{p.describe()} ctx={c} {t} #{s}: acc {row['accuracy']:.2f}, prefill "
                            f"{row['prefill_s']:.1f} s, decode {row['decode_ms']:.1f} ms/tok, recall "
                            f"{row['recall']['mass']:.3f}, output {answer[:40]!r}")
                    bar.write(line)
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        backend.runtime.set_probe(None)
        model.forward = fwd
        torch._dynamo.reset()
    return [results[key_of(*g)] for g in grid]

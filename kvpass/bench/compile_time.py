"""``kvpass bench --compile-time``: how long a fresh process takes to its first tokens, compile included.

::

    kvpass bench --compile-time --threads 1 --out bench_out/compile-time-<date>     # SmolLM2: about 10 minutes idle

For plain Inductor (``torch.compile(model.forward)``) and for ``kvpass(policy)`` of each of
``--policies`` (default ``Full``), two fresh Python processes run one after the other on one new,
empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``): *cold* compiles everything, *warm* is the
second process, which finds the first one's graphs in the FX graph and AOTAutograd caches. Each process
loads the model (not timed), then times ``torch.compile`` plus one greedy ``generate()`` of
``--new-tokens`` tokens (default 8) after a prompt of ``--contexts`` tokens (default 64; fixed random
ids): the time to the first tokens as a user sees it. It also counts the dynamo graphs compiled in
that ``generate()`` (prefill, first decode, symbolic decode...) and the cache hits.

Rows go to ``OUT/compile_time.jsonl`` (rewritten by each run); then the table is printed, with each
time as a ratio to plain Inductor's in the same phase and whether the tokens equal Inductor's.
``--model tiny`` (a random 2-layer Llama) checks the plumbing in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvpass import kvpass
from kvpass.bench.common import parse_ints, split_specs, tiny_model
from kvpass.bench.runner import machine_info
from kvpass.bench.timing import generation_config
from kvpass.models import load_smollm2
from kvpass.policies.parse import parse_policy

RESULTS = "compile_time.jsonl"
DEFAULT_POLICIES = "Full"
PROMPT_TOKENS = 64
NEW_TOKENS = 8
INDUCTOR = "inductor"
_MARK = "KVPASS_COMPILE_TIME "
# Environment that would force Inductor's caches on or off: the children run with the defaults.
_CACHE_ENV = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
              "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT")


# ---------------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------------


def child(cell: dict[str, Any]) -> dict[str, Any]:
    """Run one cell in this (fresh) process: load, then time compile + generate. ``cell`` has
    ``model``, ``backend`` (``"inductor"`` or a policy spec), ``threads``, ``prompt_tokens``,
    ``new_tokens``."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(cell["threads"])
    model = _load(cell["model"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, cell["prompt_tokens"]), generator=g)
    gen = generation_config(model, cell["new_tokens"])
    backend = None
    counters.clear()
    t0 = time.perf_counter()
    if cell["backend"] == INDUCTOR:
        fwd = torch.compile(model.forward)
    else:
        backend = kvpass(parse_policy(cell["backend"]))
        fwd = torch.compile(model.forward, backend=backend)
    model.forward = fwd
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "graphs": counters["stats"]["unique_graphs"],
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "tokens": out[0, ids.shape[1]:].tolist(),
        "report_lines": len(backend.report().splitlines()) if backend is not None else 0,
    }


def _load(name: str):
    if name == "tiny":
        return tiny_model(256)

    model, _ = load_smollm2(progress=False)
    return model


def run_cell(cell: dict[str, Any], cache_dir: Path, timeout: float = 3600) -> dict[str, Any]:
    """Run :func:`child` in a fresh interpreter with ``cache_dir`` as Inductor's cache; its result."""
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV}
    root = str(Path(__file__).resolve().parent.parent.parent)  # the kvpass that runs this
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env["OMP_NUM_THREADS"] = str(cell["threads"])
    cmd = [sys.executable, "-m", "kvpass.bench.compile_time", json.dumps(cell)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"kvpass: the compile-time cell {cell} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len(_MARK):]), "process_s": wall}


# ---------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------


def measure(backends: list[str], *, model: str, threads: int, prompt_tokens: int = PROMPT_TOKENS,
            new_tokens: int = NEW_TOKENS, out: Path, command: str = "", progress: bool = True) -> list[dict]:
    """Cold then warm, per backend, each on a cache directory of its own; rows written to
    ``out/compile_time.jsonl``."""

    out.mkdir(parents=True, exist_ok=True)
    info = {**machine_info(), "threads": threads}
    rows = []
    for backend in backends:
        cache_dir = Path(tempfile.mkdtemp(prefix="kvpass-compile-time-"))
        try:
            for phase in ("cold", "warm"):
                cell = {"model": model, "backend": backend, "threads": threads, "prompt_tokens": prompt_tokens,
                        "new_tokens": new_tokens}
                if progress:
                    print(f"compile time: {backend}, {phase} ...", flush=True)
                res = run_cell(cell, cache_dir)
                row = {**cell, "phase": phase, **res, "command": command, "machine": info}
                rows.append(row)
                if progress:
                    print(f"  {res['seconds']:.1f} s to {new_tokens} tokens, {res['graphs']} graph(s), "
                          f"{res['fx_hits']} FX graph cache hit(s)", flush=True)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    with open(out / RESULTS, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per backend, cold and warm seconds with their ratio to plain Inductor's."""
    by = {(r["backend"], r["phase"]): r for r in rows}
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    head = ("| backend | cold s | cold / Inductor | warm s | warm / Inductor | graphs per generate() | "
            "warm FX cache hits / misses | tokens = Inductor's |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---|"]
    for b in backends:
        cells = [b if b == INDUCTOR else f"kvpass({b})"]
        for phase in ("cold", "warm"):
            r, ref = by.get((b, phase)), by.get((INDUCTOR, phase))
            cells.append(f"{r['seconds']:.1f}" if r else "-")
            cells.append(f"{r['seconds'] / ref['seconds']:.2f}x" if r and ref else "-")
        cold, warm = by.get((b, "cold")), by.get((b, "warm"))
        cells.append(str(cold["graphs"]) if cold else "-")
        cells.append(f"{warm['fx_hits']} / {warm['fx_misses']}" if warm else "-")
        same = [by[(b, p)]["tokens"] == by[(INDUCTOR, p)]["tokens"]
                for p in ("cold", "warm") if (b, p) in by and (INDUCTOR, p) in by]
        cells.append("-" if b == INDUCTOR or not same else ("yes" if all(same) else "NO"))
        lines.append("| " + " | ".join(cells) + " |")
    r0 = rows[0] if rows else {}
    if r0:
        lines.append("")
        lines.append(f"{r0['model']}, CPU, {r0['threads']} thread(s), prompt {r0['prompt_tokens']} tokens, "
                     f"{r0['new_tokens']} new tokens; seconds from torch.compile to the last token of one "
                     "generate() in a fresh process, compile included (cold: empty Inductor cache; warm: a "
                     "second process on the same cache)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``kvpass bench --compile-time`` (options in :func:`kvpass.bench.cli.add_arguments`)."""

    specs = split_specs(args.policies or DEFAULT_POLICIES)
    backends = [INDUCTOR] + [parse_policy(s).describe() for s in specs]  # bad specs fail at once
    threads = parse_ints(str(args.threads), "threads") if args.threads is not None else [torch.get_num_threads()]
    if len(threads) != 1:
        raise ValueError(f"kvpass: --compile-time takes one --threads, got {args.threads!r}")
    prompt = parse_ints(args.contexts, "contexts") if args.contexts else [PROMPT_TOKENS]
    if len(prompt) != 1:
        raise ValueError(f"kvpass: --compile-time takes one prompt length (--contexts), got {args.contexts!r}")
    new_tokens = args.new_tokens if args.new_tokens is not None else NEW_TOKENS
    if new_tokens < 2:
        raise ValueError(f"kvpass: --new-tokens needs at least 2, got {new_tokens}")
    command = shlex.join(["kvpass", "bench", "--compile-time", "--model", args.model, "--threads", str(threads[0]),
                          "--contexts", str(prompt[0]), "--new-tokens", str(new_tokens), "--policies",
                          ",".join(specs), "--out", str(args.out)])
    rows = measure(backends, model=args.model, threads=threads[0], prompt_tokens=prompt[0], new_tokens=new_tokens,
                   out=Path(args.out), command=command, progress=not args.no_progress)
    print()
    print(table(rows))
    print(f"\ncommand: {command}")
    if args.results_md:
        print(f"page: {write_md(rows, Path(args.results_md))}")
    return 0


def write_md(rows: list[dict], path: Path) -> Path:
    """A generated page: the command, the machine, the table of :func:`table`, and the cache behaviour."""
    import datetime

    r0 = rows[0]
    m = r0["machine"]
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    lines = [
        "# Compile time",
        "",
        "<!-- Generated by `kvpass bench --compile-time --results-md` (kvpass.bench.compile_time.write_md); "
        "do not edit by hand: rerun the command below. -->",
        "",
        "How long a fresh process takes from `torch.compile` to its first tokens, compile included, with plain "
        "Inductor and with kvpass (see kvpass/bench/compile_time.py for the method). Decode speed is on "
        "[decode-cost.md](decode-cost.md) (one sequence) and [throughput.md](throughput.md) (padded batches).",
        "",
        "## Command",
        "",
        "```bash",
        r0["command"] + f" --results-md {path}",
        "```",
        "",
        "## Machine",
        "",
        f"- {m['cpu_count']} cores, {r0['threads']} torch thread(s), {m['processor']}, {m['platform']}; Python "
        f"{m['python']}, torch {m['torch']}, transformers {m['transformers']}",
        f"- finished {now} (UTC)",
        "",
        "## Results",
        "",
        table(rows),
        "",
        "- **cold**: the first process on an empty Inductor cache directory compiles every graph.",
        "- **warm**: a second process on the same directory: Inductor's FX graph and AOTAutograd caches serve the "
        "graphs (kvpass's findings travel with them, so `report()` is the same); dynamo still traces the "
        "model, which is most of what remains.",
        "- **graphs per generate()**: dynamo graphs compiled during one `generate()` (prefill, first decode, "
        "symbolic decode).",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(_MARK + json.dumps(child(json.loads(sys.argv[1]))), flush=True)

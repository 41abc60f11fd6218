"""Decode speed of kvpass on the bundled SmolLM2-135M at long context (a benchmark, not a test).

    python demos/decode_speed.py                      # 8k prompt: eager, Inductor, kvpass Full, Quest
    python demos/decode_speed.py --context 4000 --static --json /tmp/speed.json

What it prints
--------------
One row per configuration, each run on the same ``--context``-token prompt (English text from
``pydoc_data.topics``, cut to exactly that many tokens), greedy, ``--new-tokens`` new tokens:

- ``eager``     Hugging Face eager (sdpa attention, DynamicCache), no torch.compile.  [reference]
- ``inductor``  ``torch.compile(model.forward)`` with the default backend, no kvpass.  [reference]
- ``Full``      ``torch.compile(model.forward, backend=kvpass(Full()))``: exact attention through
                ``kvpass::attention`` (the cost of the rewrite alone).
- ``Quest``     ``kvpass(Quest(budget=--budget, page_size=--page-size))``.
- with ``--static``, ``Full``/``Quest`` again with ``cache_implementation="static"`` (StaticCache).

Decode time per token
---------------------
``generate`` gets a ``BaseStreamer`` that records ``time.perf_counter()`` at every ``put()``:
once for the prompt (before prefill), then once per generated token. The first interval is the
prefill (plus the first token); every later interval is one whole decode step as the user sees it
(model forward + HF's logits processing / argmax / cache bookkeeping). The first ``--skip`` decode
steps (default 2) are dropped (with a cold dynamo cache they would include compilation), and the
median and the minimum over the remaining steps (>= 16 with the defaults) are reported. There is
one prefill per configuration: at 8k tokens a prefill takes ~30 s on a 2-core CPU.

Compile time
------------
Measured on short prompts so that it costs no extra long prefill, for the dynamic-cache rows:
after ``torch._dynamo.reset()``, a 3-token generate on a ``--warmup-context``-token prompt (W,
default 256) compiles the prefill graph and the two decode graphs (first decode: static length;
second decode: the cache length becomes symbolic); the same call is then repeated warm. A second
3-token generate on a prompt of W + 64 tokens compiles the dynamic-length prefill graph; it too is
repeated warm. ::

    compile_s = (cold(W) - warm(W)) + (cold(W + 64) - warm(W + 64))

i.e. the wall time the first calls spend beyond their steady-state cost: dynamo tracing, AOT
autograd, the kvpass graph pass (kvpass rows) and Inductor's C++ codegen and compilation. After
that no graph should be compiled during the long run; the ``graphs`` column says how many were
(dynamo's ``unique_graphs`` counter; expected 0). Inductor's on-disk caches (FX graph cache, C++
kernel cache) are left at their defaults: plain Inductor may hit its FX graph cache on a second
run of this script, kvpass never does (its backend disables that cache unless ``cache=True``), so
kvpass's compile time is a cold number and Inductor's may be a warm one; the C++ build cache is
shared by both. Set ``TORCHINDUCTOR_CACHE_DIR`` to a fresh folder for cold numbers on both.
StaticCache rows skip the warm-up (their graphs depend on the buffer size, hence on the prompt):
their long run compiles in the prefill and first decode steps, which the ``--skip`` drop hides.

The machine (cores, load, torch and transformers versions, threads) and the command line are
printed first; ``--json PATH`` writes every number, including the individual decode steps.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch
from transformers.generation.streamers import BaseStreamer


class StepTimer(BaseStreamer):
    """Records time.perf_counter() at every put(): the prompt, then each new token.

    With ``profile_after`` set, runs ``torch.profiler`` over the decode steps that follow the
    ``profile_after``-th new token (those steps are not among the timed ones)."""

    def __init__(self, profile_after: int | None = None, profile_steps: int = 0):
        self.times: list[float] = []
        self.profile_after, self.profile_steps = profile_after, profile_steps
        self.prof = None

    def put(self, value):
        self.times.append(time.perf_counter())
        if self.profile_after is None:
            return
        n = len(self.times) - 1  # new tokens so far
        if n == self.profile_after:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
            self.prof.start()
        elif n == self.profile_after + self.profile_steps and self.prof is not None:
            self.prof.stop()

    def end(self):
        pass


class _Tee:
    """stdout that also keeps what was printed (for --markdown)."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []

    def write(self, text):
        self.lines.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def build_prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"decode_speed: the filler text has only {ids.shape[1]} tokens < {n_tokens}")
    return ids[:, :n_tokens].contiguous()


def run_generate(model, input_ids: torch.Tensor, new_tokens: int, cache: str, profile_steps: int = 0) -> StepTimer:
    timer = StepTimer(new_tokens if profile_steps else None, profile_steps)
    kwargs = dict(
        max_new_tokens=new_tokens + profile_steps,
        min_new_tokens=new_tokens + profile_steps,  # never stop early on <|im_end|>
        do_sample=False,
        streamer=timer,
    )
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    timer.tokens = out[0, input_ids.shape[1] : input_ids.shape[1] + new_tokens].tolist()
    timer.times = timer.times[: new_tokens + 1]
    return timer


def profile_summary(prof, steps: int) -> tuple[dict, str]:
    """ms per decode step by op group, and the top ops by self time."""
    events = prof.key_averages()
    per = lambda us: us / 1e3 / steps  # noqa: E731
    total_self = sum(e.self_cpu_time_total for e in events)
    groups = collections.OrderedDict(
        [("kvpass::attention (incl. children)", 0.0), ("sdpa (all, incl. children)", 0.0),
         ("cat / KV-cache copy (self)", 0.0), ("mm/addmm/linear/bmm (self)", 0.0),
         ("index_put/index_copy/copy_ (self)", 0.0), ("all ops (self, sum)", per(total_self))]
    )
    for e in events:
        name = e.key
        if name.startswith("kvpass::attention"):
            groups["kvpass::attention (incl. children)"] += per(e.cpu_time_total)
        if name in ("aten::scaled_dot_product_attention",) and "kvpass" not in name:
            groups["sdpa (all, incl. children)"] += per(e.cpu_time_total)
        if "cat" in name.lower() and not name.startswith("kvpass"):
            groups["cat / KV-cache copy (self)"] += per(e.self_cpu_time_total)
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul") or name.startswith("mkl"):
            groups["mm/addmm/linear/bmm (self)"] += per(e.self_cpu_time_total)
        if name in ("aten::index_put_", "aten::index_copy_", "aten::copy_", "aten::index_put"):
            groups["index_put/index_copy/copy_ (self)"] += per(e.self_cpu_time_total)
    table = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=55)
    return dict(groups), table


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def make_policy(name: str, args):
    from kvpass import Full, Quest, StreamingLLM

    key = name.strip().lower()
    if key == "full":
        return Full()
    if key == "quest":
        return Quest(budget=args.budget, page_size=args.page_size)
    if key in ("streamingllm", "streaming"):
        return StreamingLLM(sinks=4, window=args.budget - 4)
    raise SystemExit(f"decode_speed: unknown policy {name!r} (expected Full, Quest, StreamingLLM)")


def measure(model, tokenizer, long_ids, label, kind, policy, cache, args) -> dict:
    """One configuration: compile warm-up on short prompts (dynamic cache), then one long run."""
    from kvpass import kvpass

    torch._dynamo.reset()
    gc.collect()
    backend = None
    row: dict = {"config": label, "kind": kind, "cache": cache, "policy": policy.describe() if policy else "-"}
    if kind != "eager":
        backend = kvpass(policy) if kind == "kvpass" else "inductor"
        model.forward = torch.compile(model.forward, backend=backend)
    try:
        if kind != "eager" and cache == "dynamic":
            compile_s = 0.0
            parts = []
            for w in (args.warmup_context, args.warmup_context + 64):
                ids = long_ids[:, :w]
                t = time.perf_counter()
                run_generate(model, ids, 3, cache)
                cold = time.perf_counter() - t
                t = time.perf_counter()
                run_generate(model, ids, 3, cache)
                warm = time.perf_counter() - t
                parts.append({"prompt": w, "cold_s": cold, "warm_s": warm})
                compile_s += cold - warm
            row["compile_s"] = compile_s
            row["compile_parts"] = parts
            print(
                f"  [{label}] compile {compile_s:.1f} s ("
                + ", ".join(f"{p['prompt']} tok: cold {p['cold_s']:.1f} s, warm {p['warm_s']:.2f} s" for p in parts)
                + ")",
                flush=True,
            )
        g0 = unique_graphs()
        gc.collect()
        timer = run_generate(model, long_ids, args.new_tokens, cache, args.profile_steps)
        row["graphs_in_long_run"] = unique_graphs() - g0 if kind != "eager" else 0
    finally:
        if "forward" in model.__dict__:
            del model.forward  # back to the class's forward
        torch._dynamo.reset()

    t = timer.times
    if len(t) != args.new_tokens + 1:
        print(f"  [{label}] warning: {len(t)} streamer puts for {args.new_tokens} new tokens", flush=True)
    steps_ms = [(b - a) * 1e3 for a, b in zip(t[1:], t[2:])]
    kept = steps_ms[args.skip:]
    row.update(
        prefill_s=t[1] - t[0],
        decode_ms_median=statistics.median(kept) if kept else float("nan"),
        decode_ms_min=min(kept) if kept else float("nan"),
        decode_steps_kept=len(kept),
        decode_ms_all=steps_ms,
        tokens=timer.tokens,
    )
    if timer.prof is not None:
        groups, table = profile_summary(timer.prof, args.profile_steps)
        row["profile_ms_per_step"] = groups
        print(f"  [{label}] profile of {args.profile_steps} decode steps after the timed ones (ms/step):")
        for k, v in groups.items():
            print(f"      {k:40s} {v:8.1f}")
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
            path = os.path.join(args.profile_dir, f"{label.replace('/', '_')}.txt")
            with open(path, "w") as f:
                f.write(table)
                f.write("\n\n")
                f.write(timer.prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=55,
                    max_shapes_column_width=80))
            print(f"      full table: {path}")
    if backend is not None and kind == "kvpass":
        rows = [r for r in backend.report_rows() if "reason" not in r]
        row["sites"] = len(rows)
        row["tokens_attended"] = max((r["tokens_attended"] for r in rows), default=None)
        row["decode_calls"] = max((r["decode_calls"] for r in rows), default=None)
        row["report_first_row"] = {k: v for k, v in rows[0].items()} if rows else None
        row["left_exact"] = sum(1 for r in backend.report_rows() if "reason" in r)
    print(
        f"  [{label}] prefill {row['prefill_s']:.1f} s, decode median {row['decode_ms_median']:.1f} ms, "
        f"min {row['decode_ms_min']:.1f} ms over {len(kept)} steps"
        + (f", {row['graphs_in_long_run']} graph(s) compiled in the long run" if kind != "eager" else "")
        + (f", {row['sites']} sites, {row['tokens_attended']} tokens attended (last step), "
           f"{row['decode_calls']} decode calls per site" if "sites" in row else ""),
        flush=True,
    )
    del backend
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8000, help="prompt tokens (model limit 8192 positions)")
    ap.add_argument("--new-tokens", type=int, default=32, help="generated tokens per configuration")
    ap.add_argument("--budget", type=int, default=1024, help="Quest token budget")
    ap.add_argument("--page-size", type=int, default=16, help="Quest page size")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--policies", default="Full,Quest", help="kvpass policies, comma-separated")
    ap.add_argument("--no-reference", action="store_true", help="skip the eager and plain-Inductor rows")
    ap.add_argument("--static", action="store_true", help="also run the policies with StaticCache")
    ap.add_argument("--skip", type=int, default=2, help="decode steps dropped at the start")
    ap.add_argument("--warmup-context", type=int, default=256, help="prompt tokens of the compile warm-up")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="run torch.profiler over this many extra decode steps after the timed ones")
    ap.add_argument("--profile-dir", default=None, help="write each configuration's profile table here")
    ap.add_argument("--json", default=None, metavar="PATH", help="write all numbers to PATH")
    ap.add_argument("--markdown", default=None, metavar="PATH",
                    help="also write what this run prints to PATH as a markdown page (docs/results/compile-time.md)")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout = _Tee(sys.stdout)

    if args.profile_steps:
        torch._inductor.config.cpp.enable_kernel_profile = True  # name each generated C++ kernel
    if args.context + args.new_tokens + args.profile_steps > 8192:
        raise SystemExit("decode_speed: --context + --new-tokens must stay within the model's 8192 positions")
    if args.new_tokens - 1 - args.skip < 1:
        raise SystemExit("decode_speed: --new-tokens leaves no decode step after --skip")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from kvpass.models import load_smollm2

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores_available": cores,
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    print(f"command: {cmd}")
    print(
        f"machine: {machine['cores_available']} cores available ({machine['cpu_count']} online), "
        f"load {tuple(round(x, 2) for x in load) if load else '?'}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, python {machine['python']}, torch threads {machine['threads']}"
    )

    model, tokenizer = load_smollm2(progress=False)
    long_ids = build_prompt(tokenizer, args.context)
    print(
        f"model: SmolLM2-135M fp32 sdpa; prompt {args.context} tokens, {args.new_tokens} new tokens, "
        f"first {args.skip} decode steps dropped; compile warm-up on {args.warmup_context} and "
        f"{args.warmup_context + 64} tokens",
        flush=True,
    )

    plan = []
    if not args.no_reference:
        plan += [("eager", "eager", None, "dynamic"), ("inductor", "inductor", None, "dynamic")]
    policies = [make_policy(p, args) for p in args.policies.split(",") if p.strip()]
    for p in policies:
        plan.append((p.name, "kvpass", p, "dynamic"))
    if args.static:
        for p in policies:
            plan.append((f"{p.name}/static", "kvpass", p, "static"))

    rows = []
    t_all = time.perf_counter()
    for label, kind, policy, cache in plan:
        print(f"running {label} ...", flush=True)
        rows.append(measure(model, tokenizer, long_ids, label, kind, policy, cache, args))
    total = time.perf_counter() - t_all

    by = {r["config"]: r for r in rows}
    ref_tokens = by.get("eager", by.get("Full", rows[0]))["tokens"]
    print()
    print(f"decode at {args.context} tokens (ms/token over {rows[0]['decode_steps_kept']} steps; "
          f"compile = first calls minus the same calls warm)")
    head = ["config", "cache", "median ms", "min ms", "vs Full", "prefill s", "compile s", "graphs*", "same tokens"]
    table = [head]
    full = by.get("Full")
    for r in rows:
        full_ref = by.get("Full/static") if r["cache"] == "static" and "Full/static" in by else full
        ratio = full_ref["decode_ms_median"] / r["decode_ms_median"] if full_ref else float("nan")
        same = sum(a == b for a, b in zip(r["tokens"], ref_tokens))
        table.append([
            r["config"], r["cache"], f"{r['decode_ms_median']:.1f}", f"{r['decode_ms_min']:.1f}",
            f"{ratio:.2f}x", f"{r['prefill_s']:.1f}",
            f"{r['compile_s']:.1f}" if "compile_s" in r else "-",
            str(r["graphs_in_long_run"]) if r["kind"] != "eager" else "-",
            f"{same}/{len(ref_tokens)}",
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  " + "  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print("  * graphs compiled during the long run (0 expected for dynamic-cache rows after the warm-up)")
    summary = {}
    if full and "Quest" in by:
        summary["quest_speedup_vs_full"] = full["decode_ms_median"] / by["Quest"]["decode_ms_median"]
        print(f"Quest vs Full decode speedup at {args.context}: {summary['quest_speedup_vs_full']:.2f}x "
              f"(median; min-based {full['decode_ms_min'] / by['Quest']['decode_ms_min']:.2f}x)")
    if full and "inductor" in by:
        summary["compile_s_kvpass_full"] = full.get("compile_s")
        summary["compile_s_inductor"] = by["inductor"].get("compile_s")
        print(f"compile time: kvpass(Full) {full['compile_s']:.1f} s vs plain Inductor "
              f"{by['inductor']['compile_s']:.1f} s")
    print(f"total {total:.0f} s")

    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                "# Decode speed (generated)\n\n"
                "Written by `demos/decode_speed.py --markdown`; do not edit by hand. Regenerate with the "
                "command on the first line below (on a quiet machine: other processes on the 2 cores "
                "distort every number).\n\n```\n" + "".join(sys.stdout.lines) + "```\n"
            )
        print(f"wrote {args.markdown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "machine": machine, "args": vars(args), "rows": rows,
                       "summary": summary, "total_s": total}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

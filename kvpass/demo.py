"""kvpass demo: find a fact hidden in a long prompt, with the full cache and with compressed ones.

Loads the bundled SmolLM2-135M-Instruct, hides "The secret passcode is 7391." at 40% depth of about
4,096 tokens of real English prose (CPython's ``pydoc_data.topics``, the Python reference manual), asks
for it, and generates greedily through ``torch.compile(model.forward, backend=kvpass(policy))`` with
``Full`` and each compressed policy (default :data:`DEMO_POLICIES`), as a batch of :data:`DEMO_BATCH`
copies of the prompt (``--batch``), the way a server decodes several sequences at once. Policies that rewrite the graph as
Full does (the same ``graph_key()``) run on Full's compiled graphs through ``backend.set_policy``; one
that inserts ops of its own (offload, TailorKV) gets its own compile.

For each policy it prints the answer, whether it holds the fact, decode milliseconds per token and the
ratio to Full, and the cache the sites hold and attend; then a table, and a PNG of decode ms/token and
bytes held per policy (``--png``).

How it runs: every policy here attends exactly at prefill, so the prompt (all but its last token) is
prefilled once with the model's own forward (kept in ``$KVPASS_CACHE/demo``, default
``~/.cache/kvpass/demo``, so a second run of the same prompt reads it back: :func:`stored_prefill`), and
each policy's ``generate`` starts from that cache, handed to the backend first
(``backend.adopt(cache)``: the runtime copies the keys and the cache holds stubs): its first step feeds the
last prompt token, builds the policy's metadata from the adopted keys and gives the first new token.
``torch.compile(..., dynamic=True)`` makes the length symbolic from the first compile (inside
:func:`kvpass.constant_floats`, as every ``kvpass`` command, so each graph is traced once), and with the
cache adopted every step runs on stubs, so each backend compiles one one-token graph good for any length;
a warm-up ``generate`` of 2 tokens on a 64-token prefix compiles it, so the timed ``generate`` compiles
nothing (the demo says so if it did). A streamer stamps ``time.perf_counter()`` as each token comes out:
decode ms/token is the median of the ``n - 1`` intervals between tokens, the steady steps after the
first (a median, because a 2-thread step on a shared machine now and then stalls for tens of ms).
Generation does not stop at ``<|im_end|>`` so that every policy decodes the same number of tokens; the
answer is cut there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from kvpass import Full, kvpass
from kvpass.bench.common import parse_policies
from kvpass.bench.prompts import ANSWER, FACT, QUESTION, build_prompt
from kvpass.bench.runner import machine_info
from kvpass.bench.timing import Stamps, answer_text, cache_from, cache_tensors, generation_config
from kvpass.models import load_smollm2, smollm2_cache_path
from kvpass.policies.parse import DEFAULT_POLICY, add_policy_arguments, parse_policy
from kvpass.tp import launch

#: What ``kvpass demo`` runs beside Full: policies of docs/results/decode-cost.md, each attending about 1,024 of
#: the 4,096 tokens (CentroidKV keeps a quarter of them). ClusterKV is left out of the default: at 4k on
#: this CPU its k-means and selection cost more than the keys it skips (it decoded slower than Full in
#: every batch-1 demo run on 2 cores; docs/results/decode-cost.md has its cells); ``--policies`` runs it.
DEMO_POLICIES = "StreamingLLM(budget=1024),Quest(budget=1024),CentroidKV(cache_ratio=0.25)"
#: ``--quick``: a 2,048-token prompt, half of it attended.
QUICK_POLICIES = "Quest(budget=1024),CentroidKV(cache_ratio=0.5)"
#: Sequences decoded together by default, as a server batches them: the weights are read once a step
#: for the batch and the cache once per sequence, so what a policy skips shows in the step's time (at
#: batch 1 on this CPU the weights are most of a step's bytes: docs/results/decode-cost.md).
DEMO_BATCH = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_policy_arguments(p, None)
    p.add_argument("--policies", default=None, metavar="LIST",
                   help=f"comma-separated policies to run beside Full (default {DEMO_POLICIES!r}; --quick: "
                        f"{QUICK_POLICIES!r}); --policy SPEC runs that one only; --tp runs one "
                        f"(default {DEFAULT_POLICY})")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="prompt length in tokens (default 4096; --quick: 2048)")
    p.add_argument("--new-tokens", type=int, default=None, metavar="N",
                   help="tokens to generate per policy (default 16; --quick: 12, the answer's length)")
    p.add_argument("--fresh-prefill", action="store_true",
                   help="recompute the prompt's prefill instead of reading the one an earlier run of the same "
                        "prompt, model and thread count kept in $KVPASS_CACHE/demo (default ~/.cache/kvpass/demo)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help=f"decode N copies of the prompt as one batch, as a server batches sequences (default "
                        f"{DEMO_BATCH}); "
                        "the answer is row 0's, ms/token is per batch step and the cache held is all N rows'")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help=f"torch CPU threads (default: torch's default, here {torch.get_num_threads()})")
    p.add_argument("--png", default="kvpass-demo.png", metavar="PATH",
                   help="where to write the chart of decode ms/token and bytes held per policy "
                        "(default kvpass-demo.png; '' writes none)")
    p.add_argument("--results-md", default=None, metavar="PATH",
                   help="also write a page with the command, the machine, the table and the chart (docs/results/demo.md)")
    p.add_argument("--quick", action="store_true",
                   help="a short run: context 2048, 12 new tokens, two policies")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="run under tensor parallelism instead: torchrun with N CPU ranks (gloo), the model loaded "
                        "with tp_plan='auto' on each, Full and the policy compiled with kvpass on every rank, "
                        "compared with the uncompiled TP model (SmolLM2 has 3 KV heads: N=3; see docs/scale-out.md)")


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    answer: str
    tokens: int
    first_s: float  # the first step: the last prompt token, adopting the prefilled cache
    decode_ms: float
    compile_s: float
    sites: int = 0
    held: int = 0
    attended: int = 0
    logical: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    recompiled: int = 0
    graphs: int = 0  # dynamo graphs the backend holds after the warm-up
    left_exact: list = field(default_factory=list)

    @property
    def found(self) -> bool:
        return ANSWER in self.answer

    @property
    def bytes_held(self) -> int:
        return self.device_bytes + self.host_bytes


WARMUP_TOKENS = 64


def prefill(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values of ``ids (1, n)`` but its last token, from the model's own forward."""

    with torch.inference_mode():
        out = model(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1)
    return cache_tensors(out.past_key_values)


#: Prefills :func:`stored_prefill` keeps (a 4k one of SmolLM2 is 191 MiB); older ones are deleted.
PREFILLS_KEPT = 2


def prefill_key(model, ids: torch.Tensor) -> str:
    """What a prefill depends on: the token ids, the model (config, every parameter's name, shape,
    dtype, sum and a strided sample), torch's and transformers' versions and the thread count (the
    reductions' order, hence the last bits, follow it)."""
    import hashlib

    import transformers

    h = hashlib.sha256(f"kvpass-demo-prefill-1|{torch.__version__}|{transformers.__version__}|"
                       f"{torch.get_num_threads()}|{model.config.to_json_string()}".encode())
    h.update(ids.to("cpu", torch.int64).contiguous().numpy().tobytes())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1).cpu()
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{flat.double().sum().item()!r}".encode())
            h.update(flat[:: max(1, flat.numel() // 64)].float().numpy().tobytes())
    return h.hexdigest()[:32]


def stored_prefill(model, ids: torch.Tensor, directory, fresh: bool = False):
    """:func:`prefill`, kept in ``directory`` under :func:`prefill_key` so that the next run of the
    same prompt on the same model and machine reads it back instead of recomputing it (a serving
    engine's prefix cache, in a file). ``fresh`` recomputes and overwrites. Returns ``(kv, read)``:
    ``read`` is True when the tensors came from the file. A file that cannot be read or written is
    recomputed, or left unwritten; the prefill is the same either way."""
    from pathlib import Path

    path = Path(directory) / f"prefill-{prefill_key(model, ids)}.pt"
    if not fresh and path.exists():
        try:
            kv = torch.load(path, weights_only=True)
            want = ids.shape[1] - 1
            if isinstance(kv, list) and kv and all(k.shape[2] == want and v.shape[2] == want for k, v in kv):
                return kv, True
        except (OSError, RuntimeError, ValueError, EOFError):
            pass
    kv = prefill(model, ids)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(kv, tmp)
        tmp.replace(path)  # atomic: a concurrent run reads the old file or the new one
        for old in sorted(path.parent.glob("prefill-*.pt"), key=lambda f: f.stat().st_mtime)[:-PREFILLS_KEPT]:
            old.unlink(missing_ok=True)
    except OSError:
        pass
    return kv, False


class _Bar:
    """A tqdm bar over the decoded tokens (nothing when tqdm is missing or the output is not a terminal)."""

    def __init__(self, total: int, desc: str):
        self.bar = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False, disable=None, file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _generate(model, ids, kv, new_tokens: int, backend, stamps=None, batch: int = 1):
    """Greedy ``generate`` of ``new_tokens`` after ``ids (1, n)`` from the cache ``kv`` of all but its
    last token, as a batch of ``batch`` copies, handed to ``backend`` first
    (:meth:`~kvpass.api.KVPassBackend.adopt` copies it into the runtime, so ``kv`` is left as it is)."""

    ids = ids.expand(batch, -1)
    kv = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in kv]
    cache = backend.adopt(cache_from(model, kv))
    return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                          generation_config=generation_config(model, new_tokens), streamer=stamps)


def run_policy(model, tokenizer, ids: torch.Tensor, kv, warm_kv, policy, new_tokens: int, step, compiled=None,
               batch: int = 1):
    """Warm up (compile), then time one greedy ``generate`` through ``kvpass(policy)`` from a copy of the
    prefilled cache ``kv`` (``warm_kv``: that of the 64-token warm-up prefix).

    ``compiled``: the ``(backend, compiled forward, policy compiled for)`` of an earlier policy. When ``policy`` rewrites the
    graph the same way (same ``graph_key()``: Full, StreamingLLM, Quest, ClusterKV without offload,
    CentroidKV), its graphs are reused through ``set_policy`` and nothing is compiled again; otherwise
    dynamo is reset and a new backend compiles. Returns ``(result, compiled)``."""
    import warnings

    name = short_name(policy)
    fwd = model.forward
    if compiled is not None and compiled[0].policy.graph_key() == policy.graph_key():
        backend, cfwd, compiled_for = compiled
        backend.set_policy(policy)  # every site starts afresh with the new policy
        what = f"{name}: warm-up on {WARMUP_TOKENS} tokens (the graphs compiled for {compiled_for} serve it)"
    else:
        torch._dynamo.reset()
        backend = kvpass(policy)
        cfwd = torch.compile(fwd, backend=backend, dynamic=True)
        compiled_for = name
        what = f"{name}: compiling the decode graphs (warm-up on {WARMUP_TOKENS} tokens)"
    model.forward = cfwd
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")  # listed in the result
            with step(what):
                t0 = time.perf_counter()
                _generate(model, ids[:, :WARMUP_TOKENS], warm_kv, 2, backend, batch=batch)
                compile_s = time.perf_counter() - t0
            n_graphs = len(backend.graphs)
            with step(f"{name}: decode {new_tokens} tokens after {ids.shape[1]}"):
                bar = _Bar(new_tokens, name)
                stamps = Stamps(on_token=bar.update)
                start = time.perf_counter()
                try:
                    out = _generate(model, ids, kv, new_tokens, backend, stamps, batch)
                finally:
                    bar.close()
    finally:
        model.forward = fwd
    t = stamps.times
    new_ids = out[0, ids.shape[1]:].tolist()
    res = Result(
        policy=name,
        answer=answer_text(tokenizer, new_ids),
        tokens=len(new_ids),
        first_s=t[0] - start,
        decode_ms=1000 * statistics.median([b - a for a, b in zip(t, t[1:])]) if len(t) > 1 else float("nan"),
        compile_s=compile_s,
        recompiled=len(backend.graphs) - n_graphs,
        graphs=n_graphs,
    )
    rows = backend.report_rows()
    sites = [r for r in rows if "reason" not in r]
    res.left_exact = [r for r in rows if "reason" in r]
    if sites:
        res.sites = len(sites)
        res.held = round(sum(r.get("tokens_held", 0) for r in sites) / len(sites))
        res.attended = round(sum(r.get("tokens_attended", 0) for r in sites) / len(sites))
        res.logical = max(r.get("tokens_logical", 0) for r in sites)
        res.device_bytes = sum(r.get("device_bytes", 0) for r in sites)
        res.host_bytes = sum(r.get("host_bytes", 0) for r in sites)
    return res, (backend, cfwd, compiled_for)


# ---------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------


_SIZES = ("budget", "window", "cache_ratio", "sparse_budget")


def short_name(policy) -> str:
    """The policy with its size (budget, window, cache ratio) and the parameters that differ from their
    defaults: ``Quest(budget=1024)``, ``StreamingLLM(window=1020)``."""
    import dataclasses

    def shown(f) -> bool:
        value = getattr(policy, f.name)
        if f.name in _SIZES:
            return value is not None
        return f.default is not dataclasses.MISSING and value != f.default

    changed = [f"{f.name}={getattr(policy, f.name)!r}" for f in dataclasses.fields(policy) if f.init and shown(f)]
    return f"{policy.name}({', '.join(changed)})"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class _Steps:
    """``[i/n] message ... 12.3 s`` progress lines, flushed as they start and end."""

    def __init__(self, total: int, out=None):
        self.total, self.i, self.out = total, 0, out or sys.stdout

    @contextlib.contextmanager
    def __call__(self, msg: str):
        self.i += 1
        print(f"[{self.i}/{self.total}] {msg} ...", file=self.out, flush=True)
        t0 = time.perf_counter()
        yield
        print(f"      done in {time.perf_counter() - t0:.1f} s", file=self.out, flush=True)


def _print_result(r: Result, full: Result | None) -> None:
    print(f"  answer:   {r.answer!r}")
    print(f"  fact {ANSWER!r} found: {'yes' if r.found else 'NO'}")
    vs = f", {full.decode_ms / r.decode_ms:.2f}x Full's speed" if full is not None and r.decode_ms > 0 else ""
    print(f"  decode:   {r.decode_ms:.1f} ms/token{vs} ({r.tokens} tokens; the first, which adopts the "
          f"cache, {r.first_s:.2f} s; compile + warm-up {r.compile_s:.0f} s, {r.graphs} graph(s))")
    if r.recompiled:
        print(f"  note:     {r.recompiled} graph(s) were compiled during the timed run: the times include that")
    if r.sites:
        host = f" + {_mib(r.host_bytes)} on the host" if r.host_bytes else ""
        print(f"  cache:    {r.sites} sites; per site {r.held} tokens held, {r.attended} of "
              f"{r.logical} attended at the last step; {_mib(r.device_bytes)} held in all{host}")
    for row in r.left_exact:
        print(f"  left exact: {row['module']}: {row['reason']}")
    print(flush=True)


def _cut(answer: str, n: int = 40) -> str:
    return answer if len(answer) <= n else answer[: n - 3] + "..."


def _table(results: list[Result]) -> str:
    full = results[0]
    lines = ["| policy | answer | fact | decode ms/token | speed vs Full | tokens attended/site | cache held |",
             "|---|---|:---:|---:|---:|---:|---:|"]
    for r in results:
        speed = full.decode_ms / r.decode_ms if r.decode_ms > 0 else float("nan")
        lines.append(f"| {r.policy} | {_cut(r.answer)!r} | {'yes' if r.found else 'no'} | {r.decode_ms:.1f} | "
                     f"{speed:.2f}x | {r.attended} of {r.logical} | {_mib(r.bytes_held)} |")
    return "\n".join(lines)


def write_png(results: list[Result], path: str, title: str) -> None:
    """Two bar charts, decode ms/token and MiB held per policy, into ``path`` (matplotlib's Agg canvas,
    no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [r.policy.replace("()", "").replace("(", "\n", 1).rstrip(")") for r in results]
    colors = ["#888888"] + ["#2a7ab0" if r.found else "#d08030" for r in results[1:]]
    fig = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    ms = [r.decode_ms for r in results]
    ax1.bar(range(len(results)), ms, color=colors)
    ax1.set_ylabel("decode ms/token (lower is faster)")
    for i, r in enumerate(results):
        ax1.annotate(f"{results[0].decode_ms / r.decode_ms:.2f}x" if r.decode_ms > 0 else "",
                     (i, ms[i]), ha="center", va="bottom", fontsize=9)
    mib = [r.bytes_held / (1 << 20) for r in results]
    ax2.bar(range(len(results)), mib, color=colors)
    ax2.set_ylabel("KV cache held, MiB (every layer)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(results)), names, fontsize=7.5)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title + "  (blue: found the fact, orange: missed it)", fontsize=10)
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    context = args.context if args.context is not None else (2048 if args.quick else 4096)
    new_tokens = args.new_tokens if args.new_tokens is not None else (12 if args.quick else 16)
    if new_tokens < 2:
        raise ValueError(f"kvpass: demo needs --new-tokens >= 2 to time decoding, got {new_tokens}")
    batch = args.batch if args.batch is not None else DEMO_BATCH
    if batch < 1:
        raise ValueError(f"kvpass: --batch needs a positive number, got {batch}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"kvpass: --threads needs a positive number, got {args.threads}")
    if args.policy is not None and args.policies is not None:
        raise ValueError("kvpass: demo takes --policy SPEC or --policies LIST, not both")
    # before the slow load: a bad policy fails at once
    if args.tp is not None:
        return _run_tp(args.tp, parse_policy(args.policy or DEFAULT_POLICY, budget=args.budget), context, new_tokens)
    if args.policy is not None:
        policies = [parse_policy(args.policy, budget=args.budget)]
    else:
        policies = parse_policies(args.policies or (QUICK_POLICIES if args.quick else DEMO_POLICIES))
        if args.budget is not None:
            policies = [parse_policy(p.describe(), budget=args.budget) for p in policies]

    policies = [Full()] + [p for p in policies if not isinstance(p, Full)]
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # the page shows the command as the user ran it: importing torch._dynamo sets the variable to
    # Inductor's default directory, which the user did not choose
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cache_dir = None if cache_dir == default_cache_dir() else cache_dir
    try:
        return _run(policies, context, new_tokens, args.png, args.results_md, args.fresh_prefill, cache_dir, batch)
    finally:
        torch.set_num_threads(threads)  # main() may run in-process (tests): leave torch as it was


def _run_tp(ranks: int, policy, context: int, new_tokens: int) -> int:
    """``kvpass demo --tp N``: the demo's prompt through :mod:`kvpass.tp` on N torchrun ranks."""

    if ranks < 1:
        raise ValueError(f"kvpass: demo --tp needs N >= 1 ranks, got {ranks}")
    args = ["--model", "smollm2", "--prompt-len", str(context), "--new-tokens", str(new_tokens),
            "--policy", "Full()", "--policy", policy.describe()]
    print(f"kvpass demo --tp {ranks}: torchrun --standalone --nproc-per-node {ranks} -m kvpass.tp "
          + " ".join(repr(a) if " " in a else a for a in args), flush=True)
    return launch(ranks, args, timeout=None, capture=False).returncode


def _busy_hint() -> str:
    """A hint when other processes compete for the cores: each parallel op then waits at OpenMP
    barriers for a thread that is not running, and a policy made of many small ops suffers most."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    if threads > 1 and load > cores - 0.5:
        return (f"  note: load average {load:.1f} on {cores} cores: other processes compete for them, so "
                f"times are noisy and {threads} threads may be slower than --threads 1\n")
    return ""


def _run(policies, context: int, new_tokens: int, png: str, results_md: str | None = None,
         fresh_prefill: bool = False, cache_dir: str | None = None, batch: int = 1) -> int:
    t_start = time.perf_counter()
    nt = torch.get_num_threads()
    print(f"kvpass demo: SmolLM2-135M-Instruct, CPU fp32, {nt} thread{'s' * (nt != 1)}, "
          f"{' vs '.join(short_name(p) for p in policies)}", flush=True)
    print(_busy_hint(), end="", flush=True)
    step = _Steps(3 + 2 * len(policies))
    first = not (smollm2_cache_path() / "kvpass.json").exists()
    with step("converting the bundled SmolLM2 GGUF (once, about 30 s)" if first else "loading SmolLM2-135M-Instruct"):
        model, tokenizer = load_smollm2(progress=first)
    with step(f"building a {context}-token prompt"):
        text, n, fact_at = build_prompt(tokenizer, context)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    print(f"  {n} tokens of Python reference prose; {FACT!r} at token {fact_at} "
          f"({100 * fact_at / n:.0f}% depth); question: {QUESTION!r}\n", flush=True)
    store = smollm2_cache_path().parent / "demo"
    with step(f"prefilling {n - 1} tokens once with the model's own forward (every policy starts from a copy)"):
        kv, read = stored_prefill(model, ids, store, fresh=fresh_prefill)
        warm_kv = prefill(model, ids[:, :WARMUP_TOKENS])
        if read:
            print(f"      read back from {store} (an earlier run's prefill of this prompt on this model and "
                  "thread count; --fresh-prefill recomputes it)", flush=True)

    from torch._dynamo.utils import counters

    hits0, misses0 = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    results, compiled = [], None
    try:
        for p in policies:
            r, compiled = run_policy(model, tokenizer, ids, kv, warm_kv, p, new_tokens, step, compiled, batch)
            print(f"{r.policy}:")
            _print_result(r, results[0] if results else None)
            results.append(r)
    finally:
        torch._dynamo.reset()  # drop the graphs and the backend dynamo holds for recompiles

    rows = f", batch of {batch} copies" if batch > 1 else ""
    print(f"At {n} tokens of context{rows}, {nt} thread{'s' * (nt != 1)}, {new_tokens} tokens decoded per policy:\n")
    print(_table(results) + "\n", flush=True)
    total_s = time.perf_counter() - t_start
    hits = counters["inductor"]["fxgraph_cache_hit"] - hits0
    misses = counters["inductor"]["fxgraph_cache_miss"] - misses0
    how = (f"prefill {'read back' if read else 'computed'}, compile + warm-up {results[0].compile_s:.0f} s, "
           f"Inductor's FX graph cache {hits} hit(s), {misses} miss(es)")
    print(f"whole demo: {total_s:.0f} s after the imports ({how})", flush=True)
    if png:
        title = f"kvpass demo: SmolLM2-135M, {n}-token prompt{rows}, CPU {nt} thread{'s' * (nt != 1)}"
        write_png(results, png, title)
        print(f"chart: {png}", flush=True)
    if results_md:
        write_md(results, results_md, png, n, new_tokens, fact_at, f"{total_s:.0f} s ({how})", cache_dir, batch)
        print(f"page: {results_md}", flush=True)
    return 0


def write_md(results: list[Result], path: str, png: str, n: int, new_tokens: int, fact_at: int,
             whole: str = "", cache_dir: str | None = None, batch: int = 1) -> None:
    """The demo's page: the command as run (``cache_dir``: the ``TORCHINDUCTOR_CACHE_DIR`` it was run
    with), the machine, the table, the chart (relative to the page)."""
    import datetime
    import shlex
    from pathlib import Path

    m = machine_info()
    page = Path(path)
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    full = results[0]
    # a run on its own Inductor cache directory (a cold one) says so on its page
    env = f"TORCHINDUCTOR_CACHE_DIR={shlex.quote(cache_dir)} " if cache_dir else ""
    lines = [
        "# kvpass demo", "",
        "<!-- Generated by `kvpass demo --results-md` (kvpass.demo.write_md); do not edit by hand: rerun the "
        "command below. -->", "",
        f"A fact hidden at token {fact_at} of a {n}-token prompt of Python reference prose, asked for at the "
        f"end; every policy continues from a copy of one exact prefill and decodes {new_tokens} tokens greedily "
        + (f"as a batch of {batch} copies of the prompt (as a server decodes several sequences at once; the "
           "answer is row 0's) " if batch > 1 else "")
        + "through `torch.compile(model.forward, backend=kvpass(policy))` (kvpass/demo.py says how it is timed).", "",
        "```bash", env + (shlex.join(["kvpass"] + sys.argv[1:]) if Path(sys.argv[0]).name == "kvpass"
                          else "kvpass demo"),
        "```", "",
        f"{m['cpu_count']} cores, {m['threads']} torch thread(s), {m['platform']}; torch {m['torch']}, "
        f"transformers {m['transformers']}; finished {now} (UTC). Compile + warm-up of the first policy: "
        f"{full.compile_s:.0f} s." + (f" Whole demo after the imports: {whole}." if whole else ""), "",
        _table(results), "",
        "Decode ms/token: the median interval between the tokens after the first"
        + (f" (a step of the batch, one token for each of its {batch} rows)" if batch > 1 else "") + ". "
        "Speed vs Full: Full's decode ms/token over the policy's, same run. Cache held: the keys, values and "
        "metadata the sites keep, every layer (device and host).", "",
    ]
    if png:
        rel = os.path.relpath(Path(png).resolve(), page.resolve().parent)
        lines += [f"![decode ms/token and cache held per policy]({rel})", ""]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines), encoding="utf-8")

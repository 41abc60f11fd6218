"""kvpass demo: find a fact hidden in a long prompt, with the full cache and with a compressed one.

Loads the bundled SmolLM2-135M-Instruct, hides "The secret passcode is 7391." at 40% depth of about
4,096 tokens of real English prose (CPython's ``pydoc_data.topics``, the Python reference manual), asks
for it, and generates greedily through ``torch.compile(model.forward, backend=kvpass(policy))`` twice:
with ``Full`` and with the compressed policy (default ``Quest(budget=1024, page_size=16)``). A policy
that rewrites the graph as Full does (the same ``graph_key()``) runs on Full's compiled graphs through
``backend.set_policy``; one that inserts ops of its own (offload, TailorKV) gets its own compile.

For each policy it prints the answer, whether it holds the fact, prefill seconds, decode milliseconds
per token, and the cache the sites hold and attend; then the decode speed ratio.

How the timing works: ``torch.compile(..., dynamic=True)`` makes the sequence length symbolic from
the first compile, so dynamo compiles two graphs per backend, one prefill and one decode, each good for
any length (with the default ``dynamic=None`` it compiles three: prefill, a first decode specialised
to the prompt length, then a symbolic decode at the second step). A warm-up ``generate`` of 2 tokens on
the first 64 prompt tokens compiles both, so the timed ``generate`` compiles nothing (checked: the demo
says so if it did). A streamer stamps ``time.perf_counter()`` as each token comes out: prefill is the
time to the first token, decode ms/token is ``(t_last - t_first) / (n - 1)``. Generation does not stop
at ``<|im_end|>`` so that both policies decode the same number of tokens; the answer is cut there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import torch

FACT = "The secret passcode is 7391."
ANSWER = "7391"
QUESTION = "What is the secret passcode? Answer with the number only."
DEPTH = 0.4


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvpass.policies.parse import DEFAULT_POLICY, add_policy_arguments

    add_policy_arguments(p, DEFAULT_POLICY)
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="prompt length in tokens (default 4096; --quick: 1024)")
    p.add_argument("--new-tokens", type=int, default=None, metavar="N",
                   help="tokens to generate per policy (default 24; --quick: 12, the answer's length)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help=f"torch CPU threads (default: torch's default, here {torch.get_num_threads()})")
    p.add_argument("--quick", action="store_true", help="a short run for tests: context 1024, 12 new tokens")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="run under tensor parallelism instead: torchrun with N CPU ranks (gloo), the model loaded "
                        "with tp_plan='auto' on each, Full and the policy compiled with kvpass on every rank, "
                        "compared with the uncompiled TP model (SmolLM2 has 3 KV heads: N=3; see docs/scale-out.md)")


# ---------------------------------------------------------------------------------------------------
# The prompt
# ---------------------------------------------------------------------------------------------------


def _prose() -> str:
    """About 465k characters of the Python reference manual, shipped with CPython (offline, real)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def build_prompt(tokenizer, context: int, depth: float = DEPTH) -> tuple[str, int, int]:
    """A chat prompt of at most ``context`` tokens (a few less at worst) with :data:`FACT` as its own
    paragraph at about ``depth`` of the prose.

    Returns ``(text, n_tokens, fact_token_position)``. The fact goes in at the paragraph break (or,
    failing that, the sentence end) just before the requested depth, so no sentence is cut in half.
    """
    from kvpass.models import chat_prompt

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def assemble(before: str, after: str) -> str:
        return chat_prompt(tokenizer, f"{before}\n\n{FACT}\n\n{after}\n\n{QUESTION}")

    overhead = n_tokens(assemble("", ""))
    prose = _prose()
    need = context - overhead
    if need < 64:
        raise ValueError(f"kvpass: demo needs --context >= {overhead + 64} tokens, got {context}")
    enc = tokenizer(prose[: need * 8], add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) < need:
        raise ValueError(
            f"kvpass: demo's filler prose holds about {len(offsets)} tokens; use --context <= "
            f"{len(offsets) + overhead}"
        )
    cut = offsets[int(need * depth)][0]
    for sep in ("\n\n", ". "):
        at = prose.rfind(sep, 0, cut)
        if at > 0 and cut - at < 2000:
            cut = at + len(sep)
            break
    # Joining changes the token count by a few; shrink the tail until the prompt fits.
    for _ in range(8):
        end = offsets[need - 1][1]
        text = assemble(prose[:cut].strip(), prose[cut:end].strip())
        total = n_tokens(text)
        if total <= context:
            break
        need -= total - context
    fact_at = n_tokens(text[: text.index(FACT)])
    return text, total, fact_at


# ---------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    answer: str
    tokens: int
    prefill_s: float
    decode_ms: float
    compile_s: float
    sites: int = 0
    held: int = 0
    attended: int = 0
    logical: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    recompiled: int = 0
    left_exact: list = field(default_factory=list)

    @property
    def found(self) -> bool:
        return ANSWER in self.answer


WARMUP_TOKENS = 64


def run_policy(model, tokenizer, ids: torch.Tensor, policy, new_tokens: int, step, compiled=None):
    """Warm up (compile), then time one greedy generate through ``kvpass(policy)``.

    ``compiled``: the ``(backend, compiled forward)`` of an earlier policy. When ``policy`` rewrites the
    graph the same way (same ``graph_key()``: Full, StreamingLLM, Quest, ClusterKV without offload,
    CentroidKV), its graphs are reused through ``set_policy`` and nothing is compiled again; otherwise
    dynamo is reset and a new backend compiles. Returns ``(result, (backend, compiled forward))``."""
    import warnings

    from kvpass import kvpass
    from kvpass.bench.timing import Stamps, answer_text, generation_config

    name = policy.describe()
    fwd = model.forward
    if compiled is not None and compiled[0].policy.graph_key() == policy.graph_key():
        backend, cfwd = compiled
        compiled_for = backend.policy.name  # read before set_policy replaces it
        backend.set_policy(policy)  # every site starts afresh with the new policy
        what = f"{name}: warm-up on {WARMUP_TOKENS} tokens (the graphs compiled for {compiled_for} serve it)"
    else:
        torch._dynamo.reset()
        backend = kvpass(policy)
        cfwd = torch.compile(fwd, backend=backend, dynamic=True)
        what = f"{name}: compiling the prefill and decode graphs (warm-up on {WARMUP_TOKENS} tokens)"
    model.forward = cfwd
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"kvpass: .* left exact")  # listed in the result
            with step(what):
                t0 = time.perf_counter()
                warm = ids[:, :WARMUP_TOKENS]
                model.generate(warm, attention_mask=torch.ones_like(warm),
                               generation_config=generation_config(model, 2))
                compile_s = time.perf_counter() - t0
            n_graphs = len(backend.graphs)
            with step(f"{name}: prefill {ids.shape[1]} tokens, then decode {new_tokens}"):
                stamps = Stamps()
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=generation_config(model, new_tokens), streamer=stamps)
    finally:
        model.forward = fwd
    t = stamps.times
    new_ids = out[0, ids.shape[1]:].tolist()
    res = Result(
        policy=name,
        answer=answer_text(tokenizer, new_ids),
        tokens=len(new_ids),
        prefill_s=t[0] - start,
        decode_ms=1000 * (t[-1] - t[0]) / max(1, len(t) - 1),
        compile_s=compile_s,
        recompiled=len(backend.graphs) - n_graphs,
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
    return res, (backend, cfwd)


# ---------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------


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


def _print_result(r: Result) -> None:
    print(f"  answer:   {r.answer!r}")
    print(f"  fact {ANSWER!r} found: {'yes' if r.found else 'NO'}")
    print(f"  prefill:  {r.prefill_s:.2f} s    decode: {r.decode_ms:.1f} ms/token "
          f"({r.tokens} tokens; compile + warm-up took {r.compile_s:.0f} s)")
    if r.recompiled:
        print(f"  note:     {r.recompiled} graph(s) were compiled during the timed run: the times include that")
    if r.sites:
        host = f" + {_mib(r.host_bytes)} on the host" if r.host_bytes else ""
        print(f"  cache:    {r.sites} sites; per site {r.held} tokens held, {r.attended} of "
              f"{r.logical} attended at the last step; {_mib(r.device_bytes)} held in all{host}")
    for row in r.left_exact:
        print(f"  left exact: {row['module']}: {row['reason']}")
    print(flush=True)


def run(args: argparse.Namespace) -> int:
    from kvpass.policies.parse import policy_from_args

    context = args.context if args.context is not None else (1024 if args.quick else 4096)
    new_tokens = args.new_tokens if args.new_tokens is not None else (12 if args.quick else 24)
    if new_tokens < 2:
        raise ValueError(f"kvpass: demo needs --new-tokens >= 2 to time decoding, got {new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"kvpass: --threads needs a positive number, got {args.threads}")
    policy = policy_from_args(args)  # before the slow load: a bad --policy fails at once
    if args.tp is not None:
        return _run_tp(args.tp, policy, context, new_tokens)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(policy, context, new_tokens)
    finally:
        torch.set_num_threads(threads)  # main() may run in-process (tests): leave torch as it was


def _run_tp(ranks: int, policy, context: int, new_tokens: int) -> int:
    """``kvpass demo --tp N``: the demo's prompt through :mod:`kvpass.tp` on N torchrun ranks."""
    from kvpass.tp import launch

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


def _run(policy, context: int, new_tokens: int) -> int:
    from kvpass import Full
    from kvpass.models import load_smollm2, smollm2_cache_path

    policies = [Full(), policy]

    nt = torch.get_num_threads()
    print(f"kvpass demo: SmolLM2-135M-Instruct, CPU fp32, {nt} thread{'s' * (nt != 1)}, "
          f"Full vs {policy.describe()}", flush=True)
    print(_busy_hint(), end="", flush=True)
    step = _Steps(2 + 2 * len(policies))
    first = not (smollm2_cache_path() / "kvpass.json").exists()
    with step("converting the bundled SmolLM2 GGUF (once, about 30 s)" if first else "loading SmolLM2-135M-Instruct"):
        model, tokenizer = load_smollm2(progress=first)
    with step(f"building a {context}-token prompt"):
        text, n, fact_at = build_prompt(tokenizer, context)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    print(f"  {n} tokens of Python reference prose; {FACT!r} at token {fact_at} "
          f"({100 * fact_at / n:.0f}% depth); question: {QUESTION!r}\n", flush=True)

    results, compiled = [], None
    try:
        for p in policies:
            r, compiled = run_policy(model, tokenizer, ids, p, new_tokens, step, compiled)
            print(f"{r.policy}:")
            _print_result(r)
            results.append(r)
    finally:
        torch._dynamo.reset()  # drop the graphs and the backend dynamo holds for recompiles

    full, comp = results
    ratio = full.decode_ms / comp.decode_ms if comp.decode_ms > 0 else float("nan")
    print(f"decode speed: Full {full.decode_ms:.1f} ms/token, {comp.policy} {comp.decode_ms:.1f} ms/token: "
          f"{ratio:.2f}x {'faster' if ratio >= 1 else 'slower'} at {n} tokens of context")
    print(f"answers: Full {'found' if full.found else 'missed'} the fact, {comp.policy} "
          f"{'found' if comp.found else 'missed'} it", flush=True)
    return 0

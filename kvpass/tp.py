"""kvpass under tensor parallelism (torch.distributed): the torchrun worker behind ``kvpass demo --tp N``
and ``tests/test_tp.py``.

Under transformers' ``from_pretrained(dir, tp_plan="auto")`` the key/value projections are sharded by
output rows (``colwise``: a DTensor placed ``Shard(0)`` on a 1-D mesh), so each rank's graph computes
``H_kv / N`` heads and its attention sites see local shapes. The pass needs nothing for that; the
library names the heads a rank holds (:mod:`kvpass.lowering.shards`, for ``report()``); this module
counts collectives and runs the check.

Run by hand (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 -m kvpass.tp --model tiny --dir /tmp/tiny-llama \\
        --policy 'Full()' --policy 'Quest(budget=16, page_size=4)'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import fx

from kvpass import constant_floats, kvpass
from kvpass.bench.prompts import build_prompt
from kvpass.models import load_smollm2, smollm2_cache_path
from kvpass.policies.parse import parse_policy

__all__ = ["collectives", "launch", "main"]

#: Namespaces of the collective ops that appear in dynamo and post-grad graphs.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d")


def collectives(graph: fx.Graph) -> dict[str, int]:
    """``{op name: count}`` of the collective ops (``_c10d_functional.*``, ``c10d.*``) in ``graph``."""
    found: collections.Counter = collections.Counter()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        # aten-level graphs hold OpOverloads (``all_reduce.default``), dynamo graphs OpOverloadPackets
        name = getattr(node.target, "_qualified_op_name", None) or getattr(node.target, "_name", "")
        if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
                and name.split("::")[0] in COLLECTIVE_NAMESPACES:
            found[str(node.target)] += 1
    return dict(sorted(found.items()))


# ---------------------------------------------------------------------------------------------------
# Launching (one subprocess: torchrun)
# ---------------------------------------------------------------------------------------------------


def launch(nproc: int, worker_args: list[str], timeout: float, capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m kvpass.tp worker_args`` on ``nproc`` CPU ranks through torchrun (``--standalone``:
    a free port on this host), importing this copy of kvpass. Raises ``subprocess.TimeoutExpired``
    past ``timeout`` seconds (the ranks are killed)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "kvpass.tp", *worker_args]
    return subprocess.run(cmd, check=False, env=env, timeout=timeout, capture_output=capture, text=True, cwd=root)


# ---------------------------------------------------------------------------------------------------
# The worker (one per rank)
# ---------------------------------------------------------------------------------------------------


def _tiny_llama(folder: str, kv_heads: int, seed: int = 0) -> None:
    """Save a random 2-layer Llama (8 query heads, ``kv_heads`` KV heads, head_dim 16) to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      eos_token_id=None)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)


def _prompt(model_name: str, folder: str, length: int) -> tuple[torch.Tensor, Any]:
    """``(ids (1, T), tokenizer or None)``: random ids for the tiny model; for SmolLM2 the demo's
    prompt (a fact hidden in Python reference prose, then the question)."""
    if model_name == "tiny":
        g = torch.Generator().manual_seed(1)
        return torch.randint(3, 128, (1, length), generator=g), None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text, _, _ = build_prompt(tok, length)
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"], tok


class _CountingPass:
    """A post-grad pass that records the collectives of each graph before and after ``inner``."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def __call__(self, graph: fx.Graph) -> None:
        before = collectives(graph)
        if self.inner is not None:
            self.inner(graph)
        self.log.append({"before": before, "after": collectives(graph)})

    def uuid(self):
        return None if self.inner is None else self.inner.uuid()


def _generate(model, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], torch.Tensor]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits, 1)[0]


def _run_compiled(model, ids, new_tokens: int, backend_fn) -> tuple[list[int], torch.Tensor, float]:
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=backend_fn, dynamic=True)
    try:
        t0 = time.perf_counter()
        toks, logits = _generate(model, ids, new_tokens)
        return toks, logits, time.perf_counter() - t0
    finally:
        model.forward = fwd


def _held_heads(backend) -> list[int]:
    """The head count of each site's own key buffer (the runtime-owned store), where it had one (read from
    the report: the buffers themselves were freed when generate() dropped the model's cache)."""
    return sorted({r["store_heads"] for r in backend.report_rows() if r.get("store_heads")})


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch._inductor.compile_fx import compile_fx
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()

    def say(what: str) -> None:  # progress on rank 0 (the summary comes at the end)
        if rank == 0:
            print(f"[{time.perf_counter() - start:6.1f} s] {what}", flush=True)

    if args.model == "tiny":
        folder = args.dir
        if rank == 0 and not (Path(folder) / "config.json").exists():
            _tiny_llama(folder, args.kv_heads)
    else:
        if rank == 0:
            load_smollm2(progress=False)  # converts the bundled GGUF once, if not yet cached
        folder = str(smollm2_cache_path())
    dist.barrier()
    say(f"{world} ranks: the single-process model and the TP model (tp_plan='auto'), eagerly")
    ids, tok = _prompt(args.model, folder, args.prompt_len)
    res: dict[str, Any] = {"rank": rank, "world": world, "prompt_len": ids.shape[1], "runs": []}
    load = {"dtype": torch.float32, "attn_implementation": "sdpa", "local_files_only": True}
    t0 = time.perf_counter()
    with torch.inference_mode():
        single = AutoModelForCausalLM.from_pretrained(folder, **load).eval()
        res["kv_heads"] = single.config.num_key_value_heads
        res["tokens_single"], logits_single = _generate(single, ids, args.new_tokens)
        del single
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", **load).eval()
        res["tokens_tp_eager"], logits_tp = _generate(model, ids, args.new_tokens)
    res["eager_s"] = time.perf_counter() - t0
    res["logits_diff_single_vs_tp"] = float((logits_single - logits_tp).abs().max())
    res["logits_scale"] = float(logits_single.abs().max())

    backend = fn = None
    for policy in args.policies:
        run: dict[str, Any] = {"policy": policy.describe()}
        if backend is not None and backend.policy.graph_key() == policy.graph_key():
            backend.set_policy(policy)  # the graphs compiled for the earlier policy serve this one
            run["compiled"] = False  # fn: the earlier policy's backend function
        else:
            torch._dynamo.reset()
            backend = kvpass(policy)
            backend._pass = _CountingPass(backend._pass, run.setdefault("post_grad", []))
            dyn: list = run.setdefault("dynamo", [])

            def fn(gm, example_inputs, _b=backend, _d=dyn):
                _d.append(collectives(gm.graph))
                return _b(gm, example_inputs)

            run["compiled"] = True
        say(f"{policy.describe()}: " + ("compiling with kvpass on every rank" if run["compiled"]
                                         else "on the graphs compiled for the previous policy (set_policy)"))
        with torch.inference_mode():
            run["tokens"], logits, run["time_s"] = _run_compiled(model, ids, args.new_tokens, fn)
        run["logits_diff_vs_tp_eager"] = float((logits - logits_tp).abs().max())
        run["graphs"] = [{"kind": g.kind, "sites": len(g.sites), "unmatched": len(g.unmatched)}
                         for g in backend.graphs]
        run["rows"] = backend.report_rows()
        run["report"] = backend.report()
        run["held_heads"] = _held_heads(backend)
        if tok is not None:
            run["answer"] = tok.decode(run["tokens"], skip_special_tokens=True).strip()
        res["runs"].append(run)

    if args.baseline_tokens:
        torch._dynamo.reset()
        log: list = []
        dyn_log: list = []
        counting = _CountingPass(None, log)

        def inductor(gm, example_inputs):
            dyn_log.append(collectives(gm.graph))
            return compile_fx(gm, example_inputs,
                              config_patches={"post_grad_custom_post_pass": counting, "fx_graph_cache": False})

        say(f"plain Inductor, {args.baseline_tokens} token(s), counting collectives")
        with torch.inference_mode():
            toks, _, secs = _run_compiled(model, ids, args.baseline_tokens, inductor)
        res["baseline"] = {"tokens": toks, "post_grad": log, "dynamo": dyn_log, "time_s": secs}
    res["total_s"] = time.perf_counter() - start
    return res


def _summary(all_ranks: list[dict]) -> str:
    r0 = all_ranks[0]
    lines = [(f"kvpass under tensor parallelism: {r0['world']} ranks (gloo, CPU), {r0['kv_heads']} KV heads, "
              f"prompt {r0['prompt_len']} tokens, {r0['total_s']:.0f} s on rank 0 after the process group started")]
    lines.append(f"  single process vs TP eager: tokens equal {r0['tokens_single'] == r0['tokens_tp_eager']}, "
                 f"max |logit diff| {r0['logits_diff_single_vs_tp']:.2e} (logits up to {r0['logits_scale']:.1f})")
    for i, run in enumerate(r0["runs"]):
        how = "compiled" if run["compiled"] else "graphs reused (set_policy)"
        lines.append(f"  {run['policy']}: {how}, {run['time_s']:.1f} s, tokens equal TP eager "
                     f"{run['tokens'] == r0['tokens_tp_eager']}"
                     + (f", answer {run['answer']!r}" if "answer" in run else ""))
        for res in all_ranks:
            run_r = res["runs"][i]
            if run_r.get("post_grad"):
                same = all(g["before"] == g["after"] for g in run_r["post_grad"])
                lines.append(f"    rank {res['rank']}: collectives per graph {[sum(g['after'].values()) for g in run_r['post_grad']]}"
                             f" (the same without the kvpass pass: {same})")
            lines.extend("    " + line for line in run_r["report"].splitlines())
    if "baseline" in r0:
        b = r0["baseline"]
        n = len(b["tokens"])
        lines.append(f"  plain Inductor ({n} token(s)): collectives per graph "
                     f"{[sum(g['after'].values()) for g in b['post_grad']]}, "
                     f"tokens equal TP eager {b['tokens'] == r0['tokens_tp_eager'][:n]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> NoReturn:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m kvpass.tp",
                                description="kvpass on a tensor-parallel model (run by torchrun, one process per rank)")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--dir", help="tiny: the folder rank 0 saves the random Llama in (then every rank loads it)")
    p.add_argument("--kv-heads", type=int, default=4, help="tiny: KV heads (default 4)")
    p.add_argument("--policy", action="append", help="a policy spec; repeat for more (default: Full())")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--baseline-tokens", type=int, default=0, metavar="N",
                   help="also generate N tokens through plain Inductor, counting its collectives (1: the prefill "
                        "graph only; default 0: none)")
    p.add_argument("--json", help="rank 0 writes every rank's results here")
    args = p.parse_args(argv)

    args.policies = [parse_policy(spec) for spec in args.policy or ["Full()"]]  # a bad spec fails at once
    if args.model == "tiny" and not args.dir:
        p.error("--model tiny needs --dir")
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts prints where (Python frames of every thread)
    dist.init_process_group("gloo")
    try:
        with constant_floats():
            res = _worker(args)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
        if dist.get_rank() == 0:
            if args.json:
                Path(args.json).write_text(json.dumps(gathered, indent=1, default=str))
            print(_summary(gathered), flush=True)
        dist.barrier()  # no rank tears its group down while rank 0 still writes
    finally:
        dist.destroy_process_group()
    # Done and written: leave without the interpreter's teardown, where torch's distributed and compile
    # state once aborted a rank in CI after all its work (SIGABRT, "terminate called without an active
    # exception"), failing a run whose results were complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

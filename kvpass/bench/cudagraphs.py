"""CUDA graphs with kvpass: ``torch.compile(..., backend=kvpass(policy), mode="reduce-overhead")``.

    python -m kvpass.bench.cudagraphs [--device cuda] [--policies Full,Quest,ClusterKV] [--steps 24]

For each policy a random 4-layer Llama (structure only: random weights, so no accuracy is claimed)
decodes a 256-token prompt greedily with ``generate()``, compiled twice by fresh strict backends
(``dynamic=True``): Inductor's default mode, then ``mode="reduce-overhead"``. The check fails unless
both give the same tokens (Full: also eager's) and, on CUDA, CUDA graphs were recorded and none in the
steady half of the decode (a graph recorded at every step would mean each step's new length reached a
captured graph; replays must serve the steady steps). It prints each mode's ms/token, timed on a second
``generate()`` once every shape has been seen. ``demos/gpu_check.sh`` runs it on a CUDA machine; on a
CPU Inductor skips CUDA graphs, and the check only shows that the mode reached Inductor
(``cudagraph_skips``) and changed no token.

The kvpass ops run the runtime's Python (positions and counters in Python ints), so they are tagged
``cudagraph_unsafe``: Inductor's graph partition captures the layers between two sites and runs the
ops between the replays (docs/design.md, "CUDA graphs: captured between the sites")."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvpass.api import kvpass
from kvpass.policies import ClusterKV, Full, Quest

PROMPT = 256
POLICIES = {
    "Full": lambda: Full(),
    "Quest": lambda: Quest(budget=64, page_size=16),
    "ClusterKV": lambda: ClusterKV(budget=64, sinks=4, tokens_per_cluster=8, dense_layers=(0,),
                                   decode_window=8, decode_clusters=2),
}


def tiny_llama(device: str, seed: int = 0):
    """A random Llama: 4 layers, hidden 128, 4 query heads on 2 KV heads, vocab 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval().to(device)


def graphs_recorded(device: torch.device) -> int:
    """CUDA graphs recorded so far by Inductor's cudagraph trees on ``device`` (0 on a CPU)."""
    if device.type != "cuda":
        return 0
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    if manager is None:
        return 0
    n, todo = 0, list(manager.get_roots())
    while todo:
        node = todo.pop()
        n += 1
        todo.extend(c for kids in node.children.values() for c in kids)
    return n


def _counts(device: torch.device):
    """A stopping criterion that never stops: it records the graphs recorded after each step."""
    from transformers import StoppingCriteria

    class Counts(StoppingCriteria):
        def __init__(self):
            self.device, self.after = device, []

        def __call__(self, input_ids, scores, **kwargs):
            self.after.append(graphs_recorded(self.device))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Counts()


def decode(model, ids, steps: int, policy, mode: str | None) -> dict:
    """Greedy tokens and timings of one fresh backend: a warm ``generate()`` (compile, CUDA graph
    recording), then a timed one over the same shapes."""
    from torch._dynamo.utils import counters
    from transformers import StoppingCriteriaList

    fwd = model.forward
    if policy is not None:
        model.forward = torch.compile(fwd, backend=kvpass(policy, strict=True), dynamic=True, mode=mode)
    skips, before = counters["inductor"]["cudagraph_skips"], graphs_recorded(ids.device)
    counts = _counts(ids.device)
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    try:
        with torch.no_grad():
            out = model.generate(ids, stopping_criteria=StoppingCriteriaList([counts]), **kw)
            sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            again = model.generate(ids, **kw)
            sync()
            ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        model.forward = fwd
        torch._dynamo.reset()
    return {"tokens": out[0, ids.shape[1]:].tolist(), "again": again[0, ids.shape[1]:].tolist(), "ms": ms,
            "graphs": [n - before for n in counts.after],
            "skips": counters["inductor"]["cudagraph_skips"] - skips}


def check(device: str, names: list[str], steps: int) -> list[str]:
    """Run the check; returns the failures (empty: passed) and prints what it measured."""
    dev = torch.device(device)
    model = tiny_llama(device)
    ids = torch.randint(3, 512, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(dev)
    failures = []
    eager = decode(model, ids, steps, None, None)["tokens"]
    for name in names:
        plain = decode(model, ids, steps, POLICIES[name](), None)
        graphs = decode(model, ids, steps, POLICIES[name](), "reduce-overhead")
        rec = graphs["graphs"]
        steady = rec[-1] - rec[len(rec) // 2] if rec else 0
        print(f"{name}: default {plain['ms']:.2f} ms/token, reduce-overhead {graphs['ms']:.2f} ms/token "
              f"({plain['ms'] / graphs['ms']:.2f}x); CUDA graphs recorded {rec[-1] if rec else 0} "
              f"({steady} in the steady half of {steps} steps); Inductor skipped CUDA graphs "
              f"{graphs['skips']} time(s)", flush=True)
        if graphs["tokens"] != plain["tokens"] or graphs["again"] != plain["again"]:
            failures.append(f"{name}: reduce-overhead decoded other tokens than the default mode "
                            f"({graphs['tokens']} vs {plain['tokens']})")
        if name == "Full" and plain["tokens"] != eager:
            failures.append(f"Full: the compiled decode differs from eager ({plain['tokens']} vs {eager})")
        if dev.type == "cuda":
            if not rec or rec[-1] == 0:
                failures.append(f"{name}: mode='reduce-overhead' recorded no CUDA graph (Inductor skipped "
                                f"them {graphs['skips']} time(s); TORCH_LOGS=perf_hints says why)")
            elif steady:
                failures.append(f"{name}: {steady} CUDA graph(s) recorded in the steady half of the decode: "
                                "a captured graph saw each step's new length")
        elif not graphs["skips"]:
            failures.append(f"{name}: mode='reduce-overhead' did not reach Inductor (no cudagraph skip on "
                            f"{device})")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpass.bench.cudagraphs",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.add_argument("--steps", type=int, default=24, help="tokens decoded per generate() (default 24)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names or any(n not in POLICIES for n in names):
        ap.error(f"--policies takes names of {', '.join(POLICIES)}, got {args.policies!r}")
    if args.steps < 4:
        ap.error("--steps must be at least 4 (the check looks at the steady half of the decode)")
    failures = check(args.device, names, args.steps)
    for f in failures:
        print("FAIL", f, flush=True)
    print("cudagraphs check:", "passed" if not failures else f"{len(failures)} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""``kvpass check --device simulated-cuda``: every policy end to end on the simulated CUDA device.

A tiny random Llama with grouped KV heads (built here: a tool does not import tests/) generates greedily
(prefill, then ``--steps`` decode steps) with each policy, once on the CPU and once on the simulated CUDA
device of :mod:`kvpass.simcuda` (the CUDA branches: Triton kernels under ``TRITON_INTERPRET=1``, host
tiers, fetch and prefetch ops, side streams). Both runs compile the backend's graphs with the same passes
and run the post-grad graph by FX. One row per policy and mode: tokens equal to the CPU run's, the largest
logit difference (Triton sums in another order: the tolerance is ``--atol``; the TailorKV row sets
``early_estimate=False``, as TailorKV's default estimates the query early on CUDA only), mixed-device ops
(an error: 0 or the row fails), host-to-device bytes per decode step (mean) next to the bytes the runtime
says it moved, and the first error. Exits 1 when a row fails.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
import traceback
from typing import Callable

import kvpass
from kvpass.simcuda import SimCuda, from_sim, sim_backend, sim_module, to_sim
from kvpass.tailorkv import Profile, config_key

__all__ = ["add_arguments", "run", "CASES", "check_case", "tiny_model"]

MODES = ("b1", "pad3", "beam2")


def add_arguments(parser) -> None:
    parser.add_argument("--device", default="simulated-cuda", choices=["simulated-cuda"],
                        help="the device to check on (only the simulated CUDA device so far)")
    parser.add_argument("--policies", default="all",
                        help=f"comma-separated case names ({', '.join(n for n, _ in CASES)}) or 'all'")
    parser.add_argument("--modes", default="b1", help="comma-separated: b1 (batch 1), pad3 (a left-padded "
                        "batch of 3), beam2 (beam search, 2 beams); or 'all'")
    parser.add_argument("--steps", type=int, default=40, help="decode steps (default 40)")
    parser.add_argument("--prompt", type=int, default=160, help="prompt tokens (default 160)")
    parser.add_argument("--atol", type=float, default=1e-3, help="largest logit difference allowed")


def tiny_model(seed: int = 0):
    """A 2-layer random Llama: 4 query heads, 2 KV heads, head_dim 16, vocabulary 128 (fp32, sdpa)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation="sdpa", eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _policies() -> list[tuple[str, Callable]]:
    def tailor(**kw):
        # layer 0 quantised (P above tau), layer 1 sparse: both tiers
        prof = Profile(_config_key(), "llama", ((0, 0.9), (1, 0.0)))
        return kvpass.TailorKV(profile=prof, sparse_budget=32, static_tokens=24, sinks=4, residual=16,
                               group_size=16, critical_channels=4, **kw)

    small = dict(budget=48, sinks=4, tokens_per_cluster=16, dense_layers=(), decode_window=16)
    return [
        ("Full", lambda: kvpass.Full()),
        ("StreamingLLM", lambda: kvpass.StreamingLLM(sinks=4, window=44)),
        ("Quest", lambda: kvpass.Quest(budget=48, page_size=16)),
        ("ClusterKV", lambda: kvpass.ClusterKV(**small)),
        ("ClusterKV(offload)", lambda: kvpass.ClusterKV(**small, offload=True)),
        ("CentroidKV", lambda: kvpass.CentroidKV(cache_ratio=None, budget=96, sinks=4, recent=16, chunk=32,
                                                 step=16)),
        # early_estimate=False: the default estimates the query early on CUDA only, so a run on the CPU
        # would select differently; both runs here take the channels from the true query
        ("TailorKV", lambda: tailor(early_estimate=False)),
        ("TailorKV(early_estimate)", lambda: tailor(early_estimate=True)),
    ]


def _config_key() -> str:
    return config_key(tiny_model().config)


CASES = [(n, None) for n in ("Full", "StreamingLLM", "Quest", "ClusterKV", "ClusterKV(offload)", "CentroidKV",
                             "TailorKV", "TailorKV(early_estimate)")]


@dataclasses.dataclass
class Row:
    policy: str
    mode: str
    tokens_equal: bool | None = None
    max_logit_diff: float | None = None
    mixed_ops: int = 0
    h2d_per_step: int | None = None
    moved_per_step: int | None = None
    launches: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.tokens_equal) and self.mixed_ops == 0


def _inputs(mode: str, length: int):
    import torch

    g = torch.Generator().manual_seed(1)
    if mode == "pad3":
        ids = torch.randint(3, 128, (3, length), generator=g)
        mask = torch.ones_like(ids)
        for row, pad in enumerate((0, 7, 20)):  # left padding
            ids[row, :pad] = 0
            mask[row, :pad] = 0
        return ids, mask
    ids = torch.randint(3, 128, (1, length), generator=g)
    return ids, torch.ones_like(ids)


class _StepMeter:
    """Wraps a compiled forward: host-to-device bytes of each call (the simulated device's copy log)."""

    def __init__(self, fwd, sim):
        self.fwd, self.sim, self.calls = fwd, sim, []

    def __call__(self, *args, **kwargs):
        mark = self.sim.mark() if self.sim is not None else None
        out = self.fwd(*args, **kwargs)
        if mark is not None:
            self.calls.append(self.sim.since(mark))
        return out


def _generate(model, policy, ids, mask, mode: str, steps: int, simulated: bool):
    import torch

    torch._dynamo.reset()
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    if mode == "beam2":
        kw.update(num_beams=2, early_stopping=False)
    be = kvpass.kvpass(policy, cache=False, strict=True)
    model = copy.deepcopy(model)
    if not simulated:
        model.forward = torch.compile(model.forward, backend=sim_backend(be, simulated=False))
        out = model.generate(ids, attention_mask=mask, **kw)
        return out.sequences, torch.stack(list(out.scores)), _moved(be), None, None
    with SimCuda() as sim:
        sim_module(model)
        meter = _StepMeter(torch.compile(model.forward, backend=sim_backend(be)), sim)
        model.forward = meter
        out = model.generate(to_sim(ids), attention_mask=to_sim(mask), **kw)
        seqs = from_sim(out.sequences).clone()
        scores = torch.stack([from_sim(s) for s in out.scores])
        moved = _moved(be)  # the runtime's statistics are device tensors: read inside the block
    return seqs, scores, moved, sim, meter


def _moved(be) -> int:
    return sum(int(r.get("bytes_moved") or 0) for r in be.report_rows() if "reason" not in r)


def check_case(name: str, mode: str, steps: int = 40, prompt: int = 160, atol: float = 1e-3) -> Row:
    """One row: ``name`` (a policy of :data:`CASES`) in ``mode`` on the CPU and on the simulated device."""
    import torch

    row = Row(name, mode)
    t0 = time.perf_counter()
    try:
        policy = dict(_policies())[name]()
        model = tiny_model()
        ids, mask = _inputs(mode, prompt)
        with torch.no_grad():
            ref, ref_scores, _, _, _ = _generate(model, policy, ids, mask, mode, steps, simulated=False)
            got, scores, moved, sim, meter = _generate(model, policy, ids, mask, mode, steps, simulated=True)
        row.tokens_equal = torch.equal(ref, got)
        row.max_logit_diff = float((ref_scores - scores).abs().nan_to_num(0.0).max())
        if row.max_logit_diff > atol and not row.error:
            row.error = f"logits differ by {row.max_logit_diff:.2e} > {atol}"
        row.mixed_ops = sim.mixed
        row.launches = sim.launches
        n_dec = max(1, len(meter.calls) - 1)
        # mean over the decode steps, as the runtime's own count (the prefill's call excluded)
        row.h2d_per_step = sum(c["h2d_bytes"] for c in meter.calls[1:]) // n_dec
        row.moved_per_step = moved // n_dec
        if sim.errors:
            row.error = sim.errors[0]
    except Exception as e:  # a row reports its failure; the others still run
        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        if os.environ.get("KVPASS_CHECK_TRACE"):
            traceback.print_exc()
    row.seconds = time.perf_counter() - t0
    return row


def _table(rows: list[Row]) -> str:
    cols = ["policy", "mode", "ok", "tokens", "max |dlogit|", "mixed ops", "H2D B/step", "moved B/step",
            "triton launches", "s", "error"]
    lines = [cols]
    for r in rows:
        lines.append([r.policy, r.mode, "ok" if r.ok else "FAIL",
                      "-" if r.tokens_equal is None else ("equal" if r.tokens_equal else "DIFFER"),
                      "-" if r.max_logit_diff is None else f"{r.max_logit_diff:.1e}", str(r.mixed_ops),
                      "-" if r.h2d_per_step is None else str(r.h2d_per_step),
                      "-" if r.moved_per_step is None else str(r.moved_per_step), str(r.launches),
                      f"{r.seconds:.0f}", r.error])
    widths = [max(len(x[i]) for x in lines) for i in range(len(cols) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths)) + "  " + x[-1] for x in lines)


def run(args) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads it when it is imported and when a kernel is decorated, both done by now: run this
        # command again in a process that has it from the start
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "kvpass.cli", *sys.argv[1:]], env)
    names = [n for n, _ in CASES] if args.policies == "all" else [p.strip() for p in args.policies.split(",")]
    unknown = [n for n in names if n not in dict(CASES)]
    if unknown:
        raise ValueError(f"kvpass: unknown check case(s) {unknown}; expected: "
                         f"{', '.join(n for n, _ in CASES)}")
    modes = list(MODES) if args.modes == "all" else [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"kvpass: unknown mode(s) {bad}; expected: {', '.join(MODES)}")
    rows = []
    for name in names:
        for mode in modes:
            rows.append(check_case(name, mode, steps=args.steps, prompt=args.prompt, atol=args.atol))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"kvpass check --device {args.device}: tiny Llama (2 layers, 4 query / 2 KV heads), prompt "
          f"{args.prompt}, {args.steps} decode steps; logits within {args.atol}")
    print(_table(rows))
    return 0 if all(r.ok for r in rows) else 1

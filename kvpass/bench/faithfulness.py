"""A faithfulness oracle: each decode step attends exactly what its policy says it attends.

At every decode step of every site (issue 53, item 4) the oracle recomputes the site's attention output
with plain softmax attention, in fp64, over exactly the positions the policy reports for that step,
read from the oracle's own copy of the full cache, and compares it with what the step returned:

- selection policies (Full, StreamingLLM, Quest, ClusterKV, TailorKV's sparse layers): the step's
  ``last_idx`` ``(B, H_kv, N)`` (-1 = none; ``None`` = every position) as a set of positions;
- CentroidKV: its merged keys and values with the ``+log(degree)`` bias on the merged heads (whose
  degrees must sum to the sequence length), the copy on the heads it keeps whole;
- TailorKV's quantised layers: the dequantised packed cache (:func:`kvpass.kernels.tailorkv.dequantize`)
  followed by the copy's full-precision tokens for the residual.

It also checks that the newest token is attended (for CentroidKV: a slot of degree 1 holds its key).
The copy starts from the exact prefill's cache (made outside the backend) and grows by the keys and
values each step hands the runtime, so a store that loses, shifts or corrupts a row shows as a
mismatch, as does a kernel that reads a row short; a method's own limit (what it chose to leave out)
does not. A difference between a policy and Full is then either a bug (this oracle fails) or the
method's choice (it passes).

The oracle watches one backend through a context manager that wraps that backend's runtime's
``attend_owned`` for its duration (an instance attribute: nothing global, other backends untouched)::

    from kvpass.bench.faithfulness import Oracle, check_continuation
    oracle = check_continuation(model, ClusterKV(budget=1024), ids, steps=32)
    oracle.failures          # [] when every step of every site matched
    oracle.summary()         # steps checked, largest error, tokens attended

or ``kvpass bench --faithfulness --contexts 8192 --out bench_out/faithfulness-8k-<date>``.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvpass import kvpass
from kvpass.bench.common import calibrate_policies, load_model, parse_ints, split_specs
from kvpass.bench.fidelity import prose_prompts
from kvpass.kernels.tailorkv import dequantize
from kvpass.policies.parse import parse_policy
from kvpass.runtime.centroidkv import CentroidState
from kvpass.runtime.tailorkv import QUANTISED, TailorState

__all__ = ["StepCheck", "Oracle", "prefill", "check_continuation", "run"]

#: |out - reference| allowed per element, against a reference in fp64, for fp32 and the others
ATOL = {torch.float32: 5e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}  # SmolLM2 fp32 at 1k: 3e-6 seen


@dataclasses.dataclass
class StepCheck:
    """One decode step of one site."""

    layer: int
    step: int  # decode steps of this oracle so far (0: the first)
    length: int  # logical length, the new token included
    attended: float  # positions (or slots) attended, mean over rows and KV heads
    max_err: float  # max |out - reference|
    newest: bool  # the newest token was attended
    what: str  # "positions", "all", "merged", "dequantised"
    ok: bool


class Oracle:
    """Checks every decode step of ``backend`` (batch rows unpadded) against plain attention over what
    the policy reports it attended, read from the oracle's copy of the full cache.

    Use: ``oracle.start(cache)`` with the exact prefill's DynamicCache (before ``backend.adopt``), then
    decode inside ``with oracle:``. ``failures`` lists the failed :class:`StepCheck` s; ``checks`` all."""

    def __init__(self, backend, atol: float | None = None):
        self.backend = backend
        self.atol = atol
        self.k: dict[int, torch.Tensor] = {}  # layer -> (B, H_kv, capacity, D), the first n[layer] live
        self.v: dict[int, torch.Tensor] = {}
        self.n: dict[int, int] = {}
        self.steps: dict[int, int] = {}
        self.checks: list[StepCheck] = []

    # -- the copy ----------------------------------------------------------------------------------
    def start(self, cache, room: int = 256) -> None:
        """Copy each layer's keys and values ``(B, H_kv, L, D)`` from an (exact, eager) DynamicCache."""
        self.k, self.v, self.n, self.steps = {}, {}, {}, {}
        layers = getattr(cache, "layers", None)
        count = len(layers) if layers is not None else len(cache.key_cache)
        for i in range(count):
            k = layers[i].keys if layers is not None else cache.key_cache[i]
            v = layers[i].values if layers is not None else cache.value_cache[i]
            b, h, n, d = k.shape
            self.k[i] = k.new_empty((b, h, n + room, d))
            self.v[i] = v.new_empty((b, h, n + room, v.shape[3]))
            self.k[i][:, :, :n], self.v[i][:, :, :n] = k, v
            self.n[i] = n

    def _append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        n, t = self.n[layer], k_new.shape[2]
        if n + t > self.k[layer].shape[2]:
            grow = max(256, t)
            self.k[layer] = torch.cat([self.k[layer], self.k[layer].new_empty((*self.k[layer].shape[:2], grow,
                                                                                 self.k[layer].shape[3]))], 2)
            self.v[layer] = torch.cat([self.v[layer], self.v[layer].new_empty((*self.v[layer].shape[:2], grow,
                                                                                 self.v[layer].shape[3]))], 2)
        self.k[layer][:, :, n : n + t] = k_new
        self.v[layer][:, :, n : n + t] = v_new
        self.n[layer] = n + t

    # -- watching the backend ----------------------------------------------------------------------
    def __enter__(self) -> Oracle:
        rt = self.backend.runtime
        if "attend_owned" in vars(rt):
            raise RuntimeError("kvpass: an Oracle already watches this backend")
        inner = rt.attend_owned

        def attend_owned(site, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal, fetched=None):
            out = inner(site, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal, fetched)
            st = rt.sites[site]
            layer = st.info.layer
            if layer in self.n and past_k is not None:
                self._append(layer, k_new, v_new)
                if q.shape[2] == 1:
                    self._check(st, layer, q, k_new, out, scale)
            return out

        rt.attend_owned = attend_owned
        return self

    def __exit__(self, *exc) -> None:
        del self.backend.runtime.attend_owned

    # -- one step ----------------------------------------------------------------------------------
    def _check(self, st, layer: int, q: torch.Tensor, k_new: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        n = self.n[layer]
        k, v = self.k[layer][:, :, :n], self.v[layer][:, :, :n]
        b, h_q, _, d = q.shape
        h_kv = k.shape[1]
        scale = scale if scale > 0 else 1.0 / math.sqrt(d)
        bias = torch.zeros((b, h_kv, n), dtype=torch.float64, device=q.device)
        if isinstance(st, CentroidState):
            ref, attended, newest = self._centroid(st, q, k, v, k_new, scale)
            what = "merged"
        else:
            if isinstance(st, TailorState) and st.tier == QUANTISED:
                k, v = self._dequantised(st, k, v)
                idx, what = None, "dequantised"
            else:
                idx = st.last_idx
                what = "all" if idx is None else "positions"
            if idx is not None:
                chosen = torch.zeros((b, h_kv, n + 1), dtype=torch.bool, device=q.device)
                chosen.scatter_(2, torch.where(idx >= 0, idx, n).long().clamp(0, n), True)
                chosen = chosen[..., :n]
                bias.masked_fill_(~chosen, -math.inf)
                newest = bool(chosen[..., n - 1].all())
                attended = float(chosen.sum(-1).double().mean())
            else:
                newest, attended = True, float(n)
            ref = _attention(q, k, v, bias, scale)
        err = float((out.double() - ref).abs().max()) if out.numel() else 0.0
        atol = self.atol if self.atol is not None else ATOL.get(out.dtype, 2e-2)
        step = self.steps.get(layer, 0)
        self.steps[layer] = step + 1
        ok = bool(err <= atol and newest and math.isfinite(err))
        self.checks.append(StepCheck(layer, step, n, attended, err, newest, what, ok))

    def _dequantised(self, st, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TailorKV's quantised layer as the step attended it: the packed tokens dequantised, then the
        residual in full precision (from the copy). A step that filled the residual flushed it into the
        packed cache after attending: then ``residual`` fewer tokens were packed at attention time."""

        kq, vq = st.packed.views()
        n_q = st.packed.n - (st.policy.residual if st.n_res == 0 else 0)
        kd = dequantize(kq, k.dtype)[:, :, :n_q]
        vd = dequantize(vq, v.dtype)[:, :, :n_q]
        return torch.cat([kd, k[:, :, n_q:]], 2), torch.cat([vd, v[:, :, n_q:]], 2)

    def _centroid(self, st, q, k, v, k_new, scale):
        """CentroidKV: merged slots with +log(degree) on the merged heads, the copy on the heads kept whole."""
        b, h_q, _, d = q.shape
        h_kv = k.shape[1]
        g = h_q // h_kv
        ref = torch.empty((b, h_q, 1, v.shape[3]), dtype=torch.float64, device=q.device)
        newest, attended = True, 0.0
        comp = st.comp.tolist() if st.comp is not None else []
        outl = st.outl.tolist() if st.outl is not None else []
        if comp:
            s = st.s
            mk, mv, deg = st.k[:, :, :s], st.v[:, :, :s], st.deg[:, :, :s].double()
            bias = torch.where(deg > 0, deg.clamp_min(1e-300).log(), -math.inf)
            qh = [h * g + j for h in comp for j in range(g)]
            ref[:, qh] = _attention(q[:, qh], mk, mv, bias, scale)
            # every token is represented once: the degrees sum to the length
            newest &= bool((deg.sum(-1) - k.shape[2]).abs().max() < 1e-6 * k.shape[2] + 1e-3)
            # the newest key sits whole in a slot of degree 1
            hit = (mk == k_new[:, comp]).all(-1) & (deg == 1)
            newest &= bool(hit.any(-1).all())
            attended += s * len(comp)
        if outl:
            qh = [h * g + j for h in outl for j in range(g)]
            kk, vv = k[:, outl], v[:, outl]
            ref[:, qh] = _attention(q[:, qh], kk, vv, torch.zeros(kk.shape[:3], dtype=torch.float64), scale)
            attended += k.shape[2] * len(outl)
        return ref, attended / max(1, len(comp) + len(outl)), newest

    # -- results -----------------------------------------------------------------------------------
    @property
    def failures(self) -> list[StepCheck]:
        return [c for c in self.checks if not c.ok]

    def summary(self) -> dict[str, Any]:
        """``{"checks", "failures", "max_err", "newest_missed", "attended", "length", "what"}`` over every
        site and step (``attended``: the mean over checks of the positions or slots attended)."""
        c = self.checks
        return {
            "checks": len(c),
            "failures": len(self.failures),
            "max_err": max((x.max_err for x in c), default=float("nan")),
            "newest_missed": sum(not x.newest for x in c),
            "attended": sum(x.attended for x in c) / max(1, len(c)),
            "length": max((x.length for x in c), default=0),
            "what": sorted({x.what for x in c}),
            "layers": len({x.layer for x in c}),
        }


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain softmax attention in fp64: q ``(B, H_q, 1, D)``, k, v ``(B, H_kv, S, D)``, bias ``(B, H_kv, S)``
    (0 or -inf, or log-degrees) -> ``(B, H_q, 1, Dv)``; the query heads of a KV head share its keys."""
    b, h_q, _, d = q.shape
    h_kv = k.shape[1]
    qg = q.double().reshape(b, h_kv, h_q // h_kv, d)
    s = torch.einsum("bhgd,bhsd->bhgs", qg, k.double()) * scale + bias.double()[:, :, None, :]
    w = torch.softmax(s, dim=-1)
    return torch.einsum("bhgs,bhsd->bhgd", w, v.double()).reshape(b, h_q, 1, v.shape[3])


def prefill(model, ids: torch.Tensor):
    """``(first token (B, 1), cache)``: the exact prefill of ``ids (B, L)`` with the model's own forward."""
    from transformers import DynamicCache

    eager = type(model).forward.__get__(model)
    with torch.no_grad():
        out = eager(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


def check_continuation(model, policy, ids: torch.Tensor, steps: int = 32, *, backend=None, fwd=None,
                       atol: float | None = None, prefilled=None, **options) -> Oracle:
    """Prefill ``ids (B, L)`` exactly with the model's own forward (or take ``prefilled``, what
    :func:`prefill` returned; it is copied, not changed), then decode ``steps`` tokens greedily through
    ``kvpass(policy, **options)`` (or ``backend`` with its compiled ``fwd``, the policy swapped in with
    ``set_policy``), every step checked. Returns the :class:`Oracle`."""

    if backend is None:
        backend = kvpass(policy, **options)
        fwd = torch.compile(type(model).forward.__get__(model), backend=backend, dynamic=True)
    else:
        backend.set_policy(policy)
    oracle = Oracle(backend, atol=atol)
    tok, cache = prefill(model, ids) if prefilled is None else prefilled
    with torch.no_grad():
        oracle.start(cache, room=steps + 16)
        cache = backend.adopt(copy.deepcopy(cache))
        with oracle:
            for _ in range(steps):
                out = fwd(input_ids=tok, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
    backend.clear_state()
    return oracle


DEFAULT_POLICIES = ("Full,StreamingLLM(sinks=4, window=1020),Quest(budget=1024),ClusterKV(budget=1024),"
                    "CentroidKV(cache_ratio=0.125),TailorKV(sparse_budget=1024, profile='auto')")


def run(args) -> int:
    """``kvpass bench --faithfulness``: the oracle on ``--model`` at each ``--contexts`` (default 8192) for
    ``--steps`` (default 32) decode steps of each policy of ``--policies`` (each as given), one prose
    prompt; rows in ``OUT/faithfulness.jsonl``, the page at ``--results-md`` (default
    ``OUT/faithfulness.md``)."""

    contexts = parse_ints(args.contexts or "8192", "contexts")
    steps = args.steps if args.steps is not None else 32
    specs = args.policies or DEFAULT_POLICIES
    policies = [parse_policy(s) for s in split_specs(specs)]
    command = shlex.join(["kvpass"] + sys.argv[1:]) if Path(sys.argv[0]).name == "kvpass" else (
        f"kvpass bench --faithfulness --contexts {','.join(map(str, contexts))} --steps {steps} "
        f"--policies \"{specs}\" --out {args.out}")
    out = Path(args.out)
    model, tok, model_name = load_model(args.model)
    out.mkdir(parents=True, exist_ok=True)
    policies = calibrate_policies(policies, model, tok, out, progress=not args.no_progress)
    rows = []
    eager = type(model).forward.__get__(model)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(int(args.threads))
    try:
        for c in contexts:
            ids = prose_prompts(tok, c, 1)[0]
            shared = prefill(model, ids)
            # one compile per graph (set_policy swaps the others in), as kvpass.bench.fidelity does
            groups: dict[str, list] = {}
            for p in policies:
                groups.setdefault(p.graph_key(), []).append(p)
            for members in groups.values():
                torch._dynamo.reset()
                backend = kvpass(members[0])
                fwd = torch.compile(eager, backend=backend, dynamic=True)
                for p in members:
                    t0 = time.perf_counter()
                    oracle = check_continuation(model, p, ids, steps, backend=backend, fwd=fwd, prefilled=shared)
                    row = dict(oracle.summary(), policy=p.describe(), policy_name=type(p).__name__, context=c,
                               steps=steps, model=model_name, seconds=time.perf_counter() - t0, command=command,
                               finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
                    rows.append(row)
                    with open(out / "faithfulness.jsonl", "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"ctx {c} {p.describe()[:60]}: {row['checks']} checks, {row['failures']} failed, max err "
                          f"{row['max_err']:.2e}, newest missed {row['newest_missed']}", flush=True)
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    page = Path(args.results_md) if args.results_md else out / "faithfulness.md"
    _write_page(rows, page, command)
    print(f"kvpass bench: wrote {page}", flush=True)
    return 0 if all(r["failures"] == 0 for r in rows) else 1


def _write_page(rows: list[dict[str, Any]], path: Path, command: str) -> None:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["| context | policy | site-steps checked | failed | max abs error | newest missed | attended (mean) | "
             "compared against |", "|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | `{r['policy']}` | {r['checks']} | {r['failures']} | {r['max_err']:.2e} | "
                     f"{r['newest_missed']} | {r['attended']:.0f} | {', '.join(r['what'])} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""# Faithfulness: each decode step attends exactly what its policy says

Generated by `{command}` ({when}; {rows[0]['model'] if rows else '?'}, fp32, greedy, CPU). Do not edit: rerun
the command.

At every decode step of every site, the step's output is compared with plain softmax attention in fp64
over exactly what the policy reports it attended, read from the oracle's own copy of the full cache
(the exact prefill's keys and values plus each step's new ones): the selected positions (selection
policies, TailorKV's sparse layers), the merged keys and values with the +log(degree) bias (CentroidKV;
its degrees must sum to the length), the dequantised packed cache plus the full-precision residual
(TailorKV's quantised layers). The newest token must be among them. A step fails when any element
differs by more than {ATOL[torch.float32]:g} (fp32) or the newest token is missing
(`kvpass/bench/faithfulness.py`; tests/test_faithfulness.py shows it failing on a step that leaves out the
newest token and on one that reads a row short).

{chr(10).join(lines)}
""")

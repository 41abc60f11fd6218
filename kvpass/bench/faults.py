"""Fault injection: each way a compiled model can leave the kvpass graph, and what kvpass does then.

Every trigger runs on a tiny random Llama (structure, not accuracy) and ends in one of:

- ``right``: the tokens equal the reference (eager for ``Full``; the same policy compiled normally
  otherwise);
- ``loud``: a :class:`~kvpass.KVPassError` whose message names the fix;
- ``wrong``: different tokens and no error, the outcome kvpass must never have;
- ``error``: another exception (a bug in kvpass or in the trigger).

``tests/test_faults.py`` asserts right-or-loud for each; ``python -m kvpass.bench.faults --out
docs/results/reliability.md`` runs the same triggers and writes the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
import warnings
from typing import Callable

import torch

from kvpass import KVPassError, kvpass
from kvpass.policies import Full, Policy, Quest

NEW = 6  # tokens generated per run


def tiny_model(seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation="sdpa", eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def prompt(length: int = 40, seed: int = 1, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=g)


def generate(model, ids, backend=None, **kw) -> torch.Tensor:
    fwd = model.forward
    if backend is not None:
        model.forward = torch.compile(fwd, backend=backend)
    try:
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kw)
    finally:
        model.forward = fwd


def reference(model, ids, policy: Policy) -> torch.Tensor:
    """What the run must give: eager for Full, the policy compiled in a fresh dynamo state otherwise."""
    if policy.exact:
        return generate(model, ids)
    torch._dynamo.reset()
    return generate(model, ids, backend=kvpass(policy))


# -- the triggers: each returns the generated tokens (or raises) ------------------------------------

def recompile_limit(limit: int):
    def run(model, ids, policy):
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=limit):
            return generate(model, ids, backend=kvpass(policy))
    return run


def models_in_one_process(strict: bool):
    def run(model, ids, policy):
        """Two other models compiled first use up the recompile limit (it counts the graphs of every model
        sharing forward's code): this model's prefill finds it spent and the whole generate runs eagerly,
        through ``model.forward = torch.compile(model.forward, backend=...)``. The watch kvpass put on the
        module reads that this backend compiles its forward, so it warns (raises under strict)."""
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=4):
            for seed in (1, 2):
                generate(tiny_model(seed), ids, backend=kvpass(Full(), own_cache=False))
            backend = kvpass(policy, strict=strict)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = generate(model, ids, backend=backend)
        said = [str(w.message) for w in caught if "compression is off" in str(w.message)]
        reported = "compression off" in backend.report()
        run.detail = ("warned, and report() says so: " + said[0]) if said and reported else ""
        return out if run.detail else torch.zeros_like(out)  # silent: counted wrong
    return run


def force_eager_stance(model, ids, policy):
    """``torch.compiler.set_stance("force_eager")`` around a generate through a compiled forward."""
    torch._dynamo.reset()
    backend = kvpass(policy)
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, ids, backend=backend)
    said = [str(w.message) for w in caught if "compression is off" in str(w.message)]
    force_eager_stance.detail = "warned: " + said[0] if said else ""
    return out if said else torch.zeros_like(out)  # silent: counted wrong


def uncompiled_decode(model, ids, policy):
    """Prefill through the compiled forward, then decode with the uncompiled model on the same cache
    (what ``torch._dynamo.disable`` on the decode frame, or a second, eager model, does)."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=kvpass(policy))
    cache = DynamicCache()
    out = compiled(input_ids=ids, past_key_values=cache, use_cache=True)
    toks = [out.logits[:, -1:].argmax(-1)]
    disabled = torch._dynamo.disable(model.forward)
    for _ in range(NEW - 1):
        out = disabled(input_ids=toks[-1], past_key_values=out.past_key_values, use_cache=True)
        toks.append(out.logits[:, -1:].argmax(-1))
    return torch.cat([ids, *toks], dim=1)


def reset_between_steps(model, ids, policy):
    from transformers import DynamicCache

    backend = kvpass(policy)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend)
    out = compiled(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    toks = [out.logits[:, -1:].argmax(-1)]
    for _ in range(NEW - 1):
        torch._dynamo.reset()
        out = compiled(input_ids=toks[-1], past_key_values=out.past_key_values, use_cache=True)
        toks.append(out.logits[:, -1:].argmax(-1))
    return torch.cat([ids, *toks], dim=1)


def graph_break_in_attention(model, ids, policy):
    """An attention function with a graph break: SDPA runs eagerly, outside any kvpass graph."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def broken(*args, **kwargs):
        torch._dynamo.graph_break()
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("kvpass_fault_break", broken)
    before = model.config._attn_implementation
    model.config._attn_implementation = "kvpass_fault_break"
    try:
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = generate(model, ids, backend=kvpass(policy))
    finally:
        model.config._attn_implementation = before
    said = [str(w.message) for w in caught if "left exact" in str(w.message) or "no attention" in str(w.message)]
    graph_break_in_attention.detail = "warned: " + said[0] if said else ""
    return out if said else torch.zeros_like(out)  # silent: counted wrong


def _interleaved(model, ids, backend, other: torch.Tensor) -> torch.Tensor:
    """``ids`` is prefilled, then ``other`` on a cache of its own, then ``ids``'s sequence decodes."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend)
    out = compiled(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    compiled(input_ids=other, past_key_values=DynamicCache(), use_cache=True)
    toks = [out.logits[:, -1:].argmax(-1)]
    for _ in range(NEW - 1):
        out = compiled(input_ids=toks[-1], past_key_values=out.past_key_values, use_cache=True)
        toks.append(out.logits[:, -1:].argmax(-1))
    return torch.cat([ids, *toks], dim=1)


def interleaved_sequences(model, ids, policy):
    """Two caches stepping in turn on one backend: the first continues after the second started."""
    return _interleaved(model, ids, kvpass(policy), prompt(33, seed=7))


def interleaved_model_kept(model, ids, policy):
    """The same with ``own_cache=False`` and two prompts of equal length: the lengths cannot tell the
    sequences apart, the newest key each site saw can."""
    return _interleaved(model, ids, kvpass(policy, own_cache=False), prompt(ids.shape[1], seed=7))


def clear_state_mid_sequence(model, ids, policy):
    from transformers import DynamicCache

    torch._dynamo.reset()
    backend = kvpass(policy)
    compiled = torch.compile(model.forward, backend=backend)
    out = compiled(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    toks = [out.logits[:, -1:].argmax(-1)]
    for i in range(NEW - 1):
        if i == 2:
            backend.clear_state()
        out = compiled(input_ids=toks[-1], past_key_values=out.past_key_values, use_cache=True)
        toks.append(out.logits[:, -1:].argmax(-1))
    return torch.cat([ids, *toks], dim=1)


def threads(rounds: int = 4):
    def run(model, ids, policy):
        """Two threads generate different prompts with one compiled model, ``rounds`` times. Returns the
        first thread's tokens when every run was right or loud; a wrong run returns the wrong tokens."""
        torch._dynamo.reset()
        prompts = [ids, prompt(ids.shape[1], seed=9)]
        refs = [reference(model, p, policy) for p in prompts]
        torch._dynamo.reset()
        model.forward, fwd = torch.compile(model.forward, backend=kvpass(policy)), model.forward
        results: list = []
        try:
            generate(model, prompts[0])  # warm up: compile outside the threads
            for _ in range(rounds):
                outs: list = [None, None]

                def work(i):
                    try:
                        outs[i] = generate(model, prompts[i])
                    except KVPassError as e:
                        outs[i] = e
                ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(timeout=300)
                results.append(outs)
        finally:
            model.forward = fwd
        for outs in results:
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor) and not torch.equal(o, refs[i]):
                    return o
        loud = [o for outs in results for o in outs if isinstance(o, KVPassError)]
        right = sum(isinstance(o, torch.Tensor) for outs in results for o in outs)
        run.detail = f"{right} of {2 * rounds} runs right, {len(loud)} refused with a KVPassError" + (
            f" ({str(loud[0]).split(': ', 1)[1]})" if loud else "")
        if len(loud) + right != 2 * rounds:
            raise RuntimeError(f"a thread did not finish: {results}")
        return refs[0]
    return run


def generate_on_torch_compile_module(strict: bool):
    def run(model, ids, policy):
        """``torch.compile(model, backend=...)`` then ``.generate()``: generate calls the original module,
        which kvpass watches (a forward pre-hook) since torch.compile wrapped it."""
        torch._dynamo.reset()
        backend = kvpass(policy, strict=strict)
        compiled = torch.compile(model, backend=backend)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = compiled.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        finally:
            model._forward_pre_hooks.clear()  # the watch stays on the model otherwise
        said = [str(w.message) for w in caught if "compression is off" in str(w.message)]
        reported = "compression off" in backend.report()
        run.detail = ("warned, and report() says so: " + said[0]) if said and reported else ""
        return out if run.detail else torch.zeros_like(out)  # silent: counted wrong
    return run


def watched_compile_prefill_eager(strict: bool, how: str = "backend.compile"):
    def run(model, ids, policy):
        """``backend.compile(model)`` (or ``model.compile(backend=...)``) when the recompile limit is spent
        before the prefill: the whole generate runs eagerly; the watch warns (or raises under strict)."""
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=1):
            # another model uses up the one graph allowed (its cache is its own: its eager steps are exact)
            other = tiny_model(3)
            if how == "model.compile":  # _call_impl's code, and so its limit, is every module's
                other.compile(backend=kvpass(Full(), own_cache=False))
                other.generate(ids[:, :8], max_new_tokens=NEW, do_sample=False)
            else:
                generate(other, ids[:, :8], backend=kvpass(Full(), own_cache=False))
            backend = kvpass(policy, strict=strict)
            fwd = model.forward
            if how == "model.compile":
                model.compile(backend=backend)
            else:  # the shared limit this trigger spends (backend.compile isolates it by default)
                backend.compile(model, isolate_recompiles=False)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            finally:
                model.forward = fwd
                model._compiled_call_impl = None
        said = [str(w.message) for w in caught if "compression is off" in str(w.message)]
        run.detail = "warned: " + said[0] if said else ""
        return out if said else torch.zeros_like(out)  # silent: counted wrong
    return run


@dataclasses.dataclass
class Trigger:
    name: str
    what: str
    run: Callable
    # "policy": the policy compiled normally; "eager": the step runs uncompressed, which is right only
    # when kvpass says so (the trigger returns zeros, counted wrong, when it did not)
    ref: str = "policy"
    # the policies it runs with (names in POLICIES): the costly triggers run one
    policies: tuple[str, ...] = ("Full", "Quest")


TRIGGERS = [
    Trigger("recompile_limit=1", "torch._dynamo.config.recompile_limit = 1: the first decode step runs eagerly",
            recompile_limit(1)),
    Trigger("recompile_limit=2", "recompile_limit = 2 (a generate needs 2 graphs: prefill, symbolic decode)",
            recompile_limit(2), policies=('Quest',)),
    Trigger("models in one process", "two other models compiled first, recompile_limit = 4: the limit "
            "counts every model's graphs of the shared forward code, so this one runs eagerly from its "
            "prefill on (model.forward = torch.compile(model.forward))", models_in_one_process(False),
            ref="eager", policies=("Quest",)),
    Trigger("models in one process, strict", "the same with kvpass(..., strict=True)",
            models_in_one_process(True), policies=("Quest",)),
    Trigger("force_eager stance", "torch.compiler.set_stance('force_eager') around generate through "
            "model.forward = torch.compile(model.forward)", force_eager_stance, ref="eager",
            policies=("Quest",)),
    Trigger("uncompiled decode", "prefill compiled, decode steps under torch._dynamo.disable on the same cache",
            uncompiled_decode),
    Trigger("dynamo reset between steps", "torch._dynamo.reset() before every decode step", reset_between_steps, policies=('Full',)),
    Trigger("graph break in attention", "an attention function with torch._dynamo.graph_break(): SDPA eager",
            graph_break_in_attention, ref="eager", policies=('Quest',)),
    Trigger("interleaved sequences", "two caches stepping in turn on one backend", interleaved_sequences),
    Trigger("interleaved sequences, own_cache=False", "the same with own_cache=False (the model keeps the "
            "cache) and two prompts of equal length", interleaved_model_kept),
    Trigger("clear_state mid-sequence", "backend.clear_state() between decode steps", clear_state_mid_sequence, policies=('Quest',)),
    Trigger("two threads", "two threads generating with one compiled model, 4 rounds", threads(4), policies=('Full',)),
    Trigger("generate on torch.compile(model)", "torch.compile(model, backend=...) then .generate()",
            generate_on_torch_compile_module(False), ref="eager", policies=("Quest",)),
    Trigger("generate on torch.compile(model), strict", "the same with kvpass(..., strict=True)",
            generate_on_torch_compile_module(True), policies=("Quest",)),
    Trigger("backend.compile, prefill eager", "backend.compile(model) with the recompile limit spent: "
            "the whole generate runs eagerly", watched_compile_prefill_eager(False), ref="eager", policies=('Quest',)),
    Trigger("backend.compile, prefill eager, strict", "the same with kvpass(..., strict=True)",
            watched_compile_prefill_eager(True), policies=('Quest',)),
    Trigger("model.compile, prefill eager", "model.compile(backend=...) with the recompile limit spent "
            "(_call_impl's code is shared by every module): the whole generate runs eagerly",
            watched_compile_prefill_eager(False, "model.compile"), ref="eager", policies=("Quest",)),
]

POLICIES: list[Policy] = [Full(), Quest(budget=32, page_size=8)]


@dataclasses.dataclass
class Outcome:
    trigger: str
    policy: str
    result: str  # right | loud | wrong | error
    detail: str
    seconds: float


def cases() -> list[tuple[Trigger, Policy]]:
    return [(t, p) for t in TRIGGERS for p in POLICIES if p.name in t.policies]


def run_trigger(trigger: Trigger, policy: Policy, refs: dict | None = None) -> Outcome:
    """Run one trigger; ``refs``: reference tokens by policy, filled as they are computed (one compile
    of each policy's reference for a whole run)."""
    model, ids = tiny_model(), prompt()
    want = Full() if trigger.ref == "eager" else policy
    refs = {} if refs is None else refs
    if want.key() not in refs:
        with torch.no_grad():
            refs[want.key()] = reference(model, ids, want)
    ref = refs[want.key()]
    trigger.run.detail = ""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), torch.no_grad():  # generate's own mode, for the hand-made steps
            warnings.simplefilter("ignore")
            out = trigger.run(model, ids, policy)
        result = "right" if torch.equal(out, ref) else "wrong"
        detail = trigger.run.detail or ("tokens equal the reference" if result == "right"
                                        else "tokens differ, no error")
    except KVPassError as e:
        result, detail = "loud", str(e)
    except Exception as e:  # noqa: BLE001  (reported as a failure of its own)
        result, detail = "error", f"{type(e).__name__}: {e}"
    finally:
        torch._dynamo.reset()
    return Outcome(trigger.name, policy.describe(), result, detail, time.perf_counter() - t0)


def write_page(outcomes: list[Outcome], path: str, command: str) -> None:
    lines = [
        "# Reliability: what kvpass does when a step leaves its graph",
        "",
        "Generated by `" + command + "` (tiny random Llama, greedy decoding; do not edit by hand).",
        "`right`: the tokens equal the reference (eager for Full, the policy compiled normally otherwise);",
        "`right (uncompressed, said so)`: the step ran without compression, the tokens equal eager's, and",
        "kvpass warned or its report says so; `loud`: a KVPassError naming the fix. `tests/test_faults.py`",
        "asserts one of these for every row.",
        "",
        "| trigger | what it does | policy | outcome | message (first sentence) |",
        "|---|---|---|---|---|",
    ]
    whats = {t.name: t.what for t in TRIGGERS}
    eager = {t.name for t in TRIGGERS if t.ref == "eager"}
    for o in outcomes:
        first = o.detail.split(". ")[0].replace("|", "\\|")
        result = f"**{o.result}**" + (" (uncompressed, said so)" if o.result == "right" and o.trigger in eager
                                      else "")
        lines.append(f"| {o.trigger} | {whats.get(o.trigger, '')} | `{o.policy}` | {result} | {first} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpass.bench.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/reliability.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    outcomes, refs = [], {}
    for trig, pol in cases():
        o = run_trigger(trig, pol, refs)
        print(f"{o.trigger:40s} {o.policy:40s} {o.result:6s} {o.seconds:5.1f}s  {o.detail[:90]}", flush=True)
        outcomes.append(o)
    write_page(outcomes, args.out, "python -m kvpass.bench.faults --out " + args.out)
    bad = [o for o in outcomes if o.result not in ("right", "loud")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

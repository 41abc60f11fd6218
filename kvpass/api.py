"""The public verb: ``kvpass(policy, **options)`` returns a dynamo backend."""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
import warnings
import weakref
from typing import Any

import torch

from kvpass.lowering.shards import key_shards
from kvpass.patterns.attention import layer_of
from kvpass.policies.base import Policy, bool_problem
from kvpass.policies.parse import policy_from_dict
from kvpass.runtime.adopt import adopt_cache
from kvpass.runtime.errors import KVPassError
from kvpass.runtime.guard import CallCount, GuardedGraph
from kvpass.runtime.runtime import Runtime
from kvpass.watch import backend_of_wrapper, watch

__all__ = ["kvpass", "KVPassBackend", "KVPassError", "kvpass_backend", "constant_floats"]


@contextlib.contextmanager
def constant_floats():
    """Trace the model's Python floats (RMSNorm's eps, ``nn.Embedding.norm_type``) as constants while
    ``torch.compile(..., dynamic=True)`` traces inside this block.

    Under ``dynamic=True`` dynamo passes such floats as symbolic inputs; AOTAutograd then specialises
    them back (``_tensorify_python_scalars``) and dynamo restarts the frame: every graph is traced and
    AOT-compiled twice, and on a warm start the first attempt misses the AOTAutograd cache
    (docs/design.md, "``dynamic=True`` traces each graph once"). The floats are guarded on, so a model
    with other values compiles again rather than running wrong. Wrap the calls that compile (the first
    ``generate()``), not ``torch.compile`` itself: dynamo traces at the first call. Every ``kvpass``
    command runs inside it."""
    with torch._dynamo.config.patch(specialize_float=True):
        yield


class KVPassBackend:
    """A torch.compile backend: Inductor with the kvpass graph pass installed.

    One backend serves one model's sequences at a time; its per-site state lives here and is freed
    with it. ``report()`` shows one row per attention site."""

    def __init__(self, policy: Policy, *, strict: bool = False, cache: bool = True, own_cache: bool = True,
                 skinny_linear: bool = True):
        if isinstance(policy, type) and issubclass(policy, Policy):
            raise TypeError(
                f"kvpass: kvpass() needs a policy instance, got the class {policy.__name__}; pass "
                f"{policy.__name__}(...), e.g. kvpass({policy.__name__}())"
            )
        if not isinstance(policy, Policy):
            raise TypeError(
                f"kvpass: kvpass() needs a policy such as kvpass.Quest(budget=1024), got "
                f"{type(policy).__name__}: {policy!r}"
            )
        for option, value in (("strict", strict), ("cache", cache), ("own_cache", own_cache),
                              ("skinny_linear", skinny_linear)):
            if (msg := bool_problem("kvpass()", option, value)) is not None:
                raise TypeError(msg)
        # The compiler is loaded by the first backend, not by `import kvpass`: the graph pass is an Inductor
        # CustomGraphPass (torch._dynamo and Inductor come with it, twice kvpass's own import time), and
        # importing the ops registers them.
        import kvpass.lowering.ops  # noqa: F401
        from kvpass.lowering.graph_pass import KVPassGraphPass

        self.policy = policy
        self.strict = strict
        self.cache = cache
        self.own_cache = own_cache
        self.skinny_linear = skinny_linear
        # What the rewritten graphs depend on; the runtime's handle is derived from it (see registry).
        self._key = policy.key() + f"|own_cache={own_cache}|skinny_linear={skinny_linear}"
        self.runtime = Runtime(policy, self._key)
        self.graphs: list = []
        self._site_ids: dict[str, int] = {}
        self._key_shards: dict = {}  # tensor parallelism: the key projection rows this rank holds (lowering/shards.py)
        self._heads: dict[int, str] = {}  # site -> the KV heads it holds under tensor parallelism
        self._lock = threading.Lock()
        self._busy = threading.RLock()  # held while one of this backend's graphs runs (GuardedGraph)
        self._guards: list = []
        self._compile_saw = False  # torch.compile(..., backend=self) was called (it reads __name__)
        # modules torch.compile wrapped with this backend -> widen their watch to the whole module
        self._watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._off_warned = False
        self._tally = CallCount()  # calls of every graph of this backend (GuardedGraph)
        self.eager_forwards = 0  # watched forwards that ran no kvpass graph (kvpass/watch.py)
        self._pass = KVPassGraphPass(self)

    @property
    def __name__(self) -> str:
        # torch.compile reads the backend's name when it wraps a model or function: the sign that
        # a compile was asked for, so that report() can say why nothing got compiled
        self._compile_saw = True
        self._watch_compiled_module()
        return "kvpass"

    def _watch_compiled_module(self) -> None:
        """Watch the module torch.compile is wrapping with this backend, for forwards that run none of
        its graphs (kvpass/watch.py).

        The module is a local of torch.compile's frame (the caller of ``__name__``'s caller):
        ``torch.compile(model)`` gives the module itself (its wrapper's ``generate()`` calls the
        original module, compiling nothing), ``model.compile()`` the module's ``_call_impl`` and
        ``torch.compile(model.forward)`` the bound forward. The hooks count a forward only when dynamo's
        objects say this backend compiles it, so a module compiled by several backends in turn does not
        blame the wrong one."""
        import sys

        frame, target = sys._getframe(1), None
        for _ in range(4):  # this property <- torch's compile wrapper <- torch.compile(model, ...)
            frame = frame.f_back
            if frame is None:
                return
            if frame.f_code.co_name == "compile" and frame.f_globals.get("__name__") == "torch":
                target = frame.f_locals.get("model")
                if frame.f_locals.get("disable") is True or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
                    self._compression_off(
                        "torch.compile(..., disable=True) (or TORCHDYNAMO_DISABLE=1) returns the model "
                        "uncompiled. Fix: drop disable=True (unset TORCHDYNAMO_DISABLE)")
                    return
                break
        whole = isinstance(target, torch.nn.Module)
        if not whole:
            target = getattr(target, "__self__", None)  # model.compile(), model.forward: a bound method
            if not isinstance(target, torch.nn.Module):
                return
        widen = self._watched.get(target)
        if widen is None:
            self._watched[target] = watch(self, target, whole)
        elif whole:
            widen()

    def _eager_forward(self, model: str, uncompiled: bool) -> None:
        """Called by the watch: a forward of ``model`` ran none of this backend's graphs."""
        self.eager_forwards += 1
        eager = (
            "dynamo ran it eagerly: its recompile limit (torch._dynamo.config.recompile_limit = "
            f"{torch._dynamo.config.recompile_limit}) counts the graphs of every model and backend compiled "
            "on the same forward code in this process, and torch.compiler.set_stance('force_eager'), "
            "torch._dynamo.disable or suppressed compile errors also run a forward eagerly")
        fix = ("raise the recompile limit, call torch._dynamo.reset() between unrelated models, or give each "
               "compiled model a limit of its own: backend.compile(model), or torch.compile(..., "
               "isolate_recompiles=True)")
        if uncompiled:
            eager = ("generate() on what torch.compile(model) returns calls the original module, uncompiled "
                     "(as does calling the model itself); or " + eager)
            fix = ("compile with backend.compile(model), model.compile(backend=backend) or model.forward = "
                   "torch.compile(model.forward, backend=backend); or " + fix)
        self._compression_off(f"a forward of {model} ran none of kvpass's graphs, so it attended the full "
                              f"cache: {eager}. Fix: {fix}")

    # -- dynamo backend protocol -----------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                 options: dict[str, Any] | None = None):
        """Compile ``gm`` with Inductor and the kvpass pass. ``mode`` and ``options`` are what
        ``torch.compile(..., backend=this, mode=..., options=...)`` passes on: Inductor's (``mode=
        "reduce-overhead"`` turns CUDA graphs on, captured between the sites, docs/design.md, "CUDA
        graphs: captured between the sites"); kvpass's own options go to ``kvpass(policy, ...)``."""
        from kvpass.lowering import graph_cache  # loaded with the graph pass (see __init__)

        inductor = inductor_patches(mode, options)
        self._key_shards = key_shards(gm)  # read by the pass (report() names each rank's KV heads)
        key = graph_cache.graph_key(self._pass.uuid(), gm) if self.cache else None
        seen = len(self.graphs)
        compiled = self._compile(gm, example_inputs, cached=self.cache, inductor=inductor)
        if self.cache:
            if len(self.graphs) > seen:
                graph_cache.save(key, self.graphs[seen:])
            elif not graph_cache.restore(key, self):
                # Inductor served the graph from its cache but kvpass has no record of what the pass
                # found there (a cache directory written without it, or site ids that clash with
                # this backend's): compile again with the caches off, so that the pass runs.
                compiled = self._compile(gm, example_inputs, cached=False, inductor=inductor)
                if len(self.graphs) > seen:
                    graph_cache.save(key, self.graphs[seen:])
        # Raised here rather than inside the pass, so that Inductor does not wrap the error.
        for rec in self.graphs[seen:]:
            self._check_unmatched(rec)
        if self.graphs[seen:] and not any(r.sites or r.unmatched for r in self.graphs):
            warnings.warn(
                "kvpass: no attention site found in the compiled graph(s) so far: the model runs exact "
                "(see backend.report())", stacklevel=2)
        guarded = GuardedGraph(compiled, self.runtime, self._busy, self._tally)
        self._guards.append(guarded)

        def kvpass_graph(*args):  # a function, as dynamo and its debug tools (depyf) expect
            return guarded(*args)

        kvpass_graph.guard = guarded
        return kvpass_graph

    def compile(self, model: torch.nn.Module, **compile_options: Any) -> torch.nn.Module:
        """Compile ``model.forward`` with this backend, in place, and return ``model``.

        ``model.forward = torch.compile(model.forward, backend=backend)`` with checks: the model itself
        (not what torch.compile returned) and a forward no kvpass backend has compiled already. As with
        that line, a forward that runs none of this backend's graphs (dynamo ran it eagerly: its
        recompile limit, ``set_stance('force_eager')``, suppressed errors) warns once, raises under
        ``strict=True`` and is counted in ``report()``. ``compile_options`` go to ``torch.compile``
        (``dynamic``, ``fullgraph``, ...); ``isolate_recompiles`` defaults to True here, so that each
        compiled model has its own recompile limit: a sweep compiling many backends on copies of one
        model in one process stays compiled."""
        import torch._dynamo

        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise KVPassError(
                "kvpass: backend.compile() needs the model itself, not what torch.compile returned "
                "(generate() on torch.compile's wrapper runs the uncompiled model); pass model._orig_mod"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"kvpass: backend.compile() needs a torch.nn.Module, got {type(model).__name__}")
        if "backend" in compile_options:
            raise TypeError("kvpass: backend.compile() compiles with this backend; drop the backend= option")
        if isinstance(other := backend_of_wrapper(model.__dict__.get("forward")), KVPassBackend):
            raise KVPassError(
                f"kvpass: this model's forward is already compiled by {other!r}; compile a fresh model (or "
                "restore this one with `del model.forward`) for another backend"
            )
        # Dynamo keeps compiled code per code object, and every model of a class (every HF model: their
        # forwards share transformers' decorator) runs one forward code: without isolation, each
        # backend's graphs count against one recompile limit, and the 5th backend on a model class runs
        # eagerly. Isolated, each compile has its own limit (docs/design.md, "Policy sweeps").
        compile_options.setdefault("isolate_recompiles", True)
        model.forward = torch.compile(model.forward, backend=self, **compile_options)
        return model

    def graph_calls(self) -> int:
        """How many times this backend's compiled graphs have run."""
        return self._tally.n

    def _compression_off(self, why: str) -> None:
        """A forward ran without any kvpass graph: warn once, or raise under ``strict``."""
        msg = f"kvpass: compression is off: {why}. See backend.report()."
        if self.strict:
            raise KVPassError(msg)
        if not self._off_warned:
            self._off_warned = True
            warnings.warn(msg, stacklevel=3)

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any], *, cached: bool,
                 inductor: dict[str, Any] | None = None):
        from torch._inductor.compile_fx import compile_fx

        patches: dict[str, Any] = {**(inductor or {}), "post_grad_custom_post_pass": self._pass}
        if not cached:
            # Off, the FX graph cache also turns the AOTAutograd cache off (it stores FX graph keys).
            patches["fx_graph_cache"] = False
        return compile_fx(gm, example_inputs, config_patches=patches)

    # -- called by the graph pass ----------------------------------------------------------------
    def _site_id(self, path: str, layer: int | None) -> int:
        with self._lock:
            if path not in self._site_ids:
                sid = self._same_module(path, layer)
                if sid is None:
                    used = set(self._site_ids.values())
                    sid = layer if layer is not None and layer not in used else max(used | {999}) + 1
                self._site_ids[path] = sid
            return self._site_ids[path]

    def _claim_sites(self, claims: dict[str, tuple[int | None, int]]) -> bool:
        """Adopt the site ids (``path -> (layer, site)``) baked into a graph served from the cache, if
        they agree with this backend's: a known path keeps its id, a new one takes an id no other
        module has. False (nothing changed) on a clash. The caller holds ``_lock``."""
        table = dict(self._site_ids)
        for path, (layer, sid) in claims.items():
            if path in table:
                if table[path] != sid:
                    return False
                continue
            same = self._same_module(path, layer, table)
            if (same is None and sid in table.values()) or (same is not None and same != sid):
                return False
            table[path] = sid
        self._site_ids = table
        return True

    def _same_module(self, path: str, layer: int | None, table: dict[str, int] | None = None) -> int | None:
        """The site of a path already seen that names the same module from another frame's root, or None.

        A graph break can make dynamo compile an inner module's forward as a frame of its own
        (transformers 4.57's StaticCache decode: ``LlamaModel.forward``), whose paths drop the outer
        prefix (``layers.0.self_attn`` for ``model.layers.0.self_attn``); a second site for that layer
        would decode from a state that never saw the prefill. Paths are merged only when every path of
        the candidate site is a dotted suffix of this one or has it as one, the layer index is in both,
        and exactly one site qualifies (``layers.0.self_attn`` next to ``encoder.layers.0...`` and
        ``decoder.layers.0...`` is ambiguous and gets a site of its own)."""

        if layer is None or layer_of(path) != layer:
            return None

        def related(other: str) -> bool:
            return layer_of(other) == layer and (other.endswith("." + path) or path.endswith("." + other))

        by_site: dict[int, list[str]] = {}
        for p, sid in (self._site_ids if table is None else table).items():
            by_site.setdefault(sid, []).append(p)
        hits = [sid for sid, paths in by_site.items() if all(related(p) for p in paths)]
        return hits[0] if len(hits) == 1 else None

    def _note_site(self, site: int, path: str, layer: int | None, pattern: str):
        """Record in the runtime what the pass found at ``site`` (also replayed on a cache hit)."""
        info = self.runtime.info(site, layer if layer is not None else site)
        if info.module_path == "?" or len(path) > len(info.module_path):
            info.module_path = path  # the longest of a site's paths (see _site_id)
        info.pattern = pattern
        info.graphs += 1
        return info

    def _record_graph(self, kind: str, rows: list[dict], unmatched: list, linears: int = 0) -> None:
        from kvpass.lowering.graph_pass import GraphRecord  # loaded with the graph pass (see __init__)

        self.graphs.append(GraphRecord(index=len(self.graphs), kind=kind, sites=rows, unmatched=unmatched,
                                       linears=linears))

    def _check_unmatched(self, rec) -> None:
        if not rec.unmatched:
            return
        why = "; ".join(f"{u.module_path}: {u.reason}" for u in rec.unmatched[:3])
        msg = (
            f"kvpass: {len(rec.unmatched)} attention site(s) in graph {rec.index} were left exact "
            f"({why}). See backend.report()."
        )
        if self.strict:
            raise KVPassError(msg)
        warnings.warn(msg, stacklevel=3)

    # -- user API --------------------------------------------------------------------------------
    def report_rows(self) -> list[dict]:
        """One dict per rewritten site (runtime statistics) plus one per site left exact."""
        self.runtime.collect()
        rows = [self.runtime.state(s).report_row() for s in sorted(self.runtime.infos)]
        for r in rows:
            if self._heads.get(r["site"]):
                r["heads"] = self._heads[r["site"]]
        for rec in self.graphs:
            for u in rec.unmatched:
                rows.append(
                    {"site": "-", "layer": u.layer, "module": u.module_path, "pattern": "left exact",
                     "policy": "-", "reason": f"{u.reason} (graph {rec.index}, shape {u.shape})"}
                )
        return rows

    def report(self) -> str:
        """A plain-text table: layer, pattern, policy, tokens and bytes per tier, calls."""
        rows = self.report_rows()
        head = f"kvpass report: policy {self.policy.describe()}, {len(self.graphs)} graph(s) compiled"
        if skinny := [r for r in self.graphs if r.linears]:
            head += (f"; {sum(r.linears for r in skinny)} linear(s) rewritten in {len(skinny)} decode graph(s) "
                     "(skinny_linear: weight-major for 2-16 rows, a reduction for one)")
        if any(r.get("released") for r in rows):
            head += ("\n  released: the model's cache of the last sequence was dropped and what the backend "
                     f"held for it was freed (held now: {self.held_bytes()} bytes); rows marked * show that "
                     "sequence as it ended")
        if self.eager_forwards:
            head += (f"\n  compression off for {self.eager_forwards} forward(s): they ran none of kvpass's "
                     "graphs (dynamo ran them eagerly, or generate() ran the module torch.compile(model) "
                     "wrapped; see the warning)")
        if not rows:
            if self.graphs:
                return head + (f"\n  no attention site found in {len(self.graphs)} compiled graph(s): the model "
                               "runs exact (kvpass found no KV-cache update feeding an SDPA node)")
            if self._compile_saw and not self.eager_forwards:
                return head + (
                    "\n  compression off: torch.compile was given this backend, but no graph has been "
                    "compiled. generate() on what torch.compile(model) returns runs the original, uncompiled "
                    "module: use backend.compile(model), model.compile(backend=backend) or model.forward = "
                    "torch.compile(model.forward, backend=backend). If the compiled model did run, dynamo "
                    "ran it eagerly (its recompile limit reached?); kvpass warns about that when the model is "
                    "called as a module (model(...), generate()), not when the compiled function is called "
                    "directly")
            if self._compile_saw:
                return head
            return head + "\n  no attention site found yet (has the compiled model run?)"
        heads = ["heads"] if any("heads" in r for r in rows) else []  # tensor parallelism only
        cols = ["layer", *heads, "pattern", "policy", "tokens_logical", "tokens_held", "tokens_attended",
                "device_bytes", "device_bytes_per_row", "host_bytes", "bytes_moved", "prefill_calls", "decode_calls"]
        table = [cols] + [[_fmt(r.get(c, "")) + ("*" if c == "layer" and r.get("released") else "")
                           for c in cols] for r in rows if "reason" not in r]
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        lines = [head] + ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
        for r in rows:
            if "reason" in r:
                lines.append(f"  left exact: {r['module']}: {r['reason']}")
        return "\n".join(lines)

    def set_policy(self, policy: Policy) -> None:
        """Swap the policy without recompiling, for sweeps over budgets or between selection
        policies. Only policies with the same ``graph_key()`` (the same rewritten graph) can be
        swapped; every site's state starts afresh."""
        if not isinstance(policy, Policy):
            raise TypeError(f"kvpass: set_policy needs a Policy, got {type(policy).__name__}")
        if policy.graph_key() != self.policy.graph_key():
            raise KVPassError(
                f"kvpass: {policy.describe()} rewrites the graph differently from {self.policy.describe()}; "
                f"compile with a new kvpass({policy.name}(...)) backend instead"
            )
        self.policy = policy
        self.runtime.set_policy(policy)

    def adopt(self, cache) -> Any:
        """Hand a filled ``DynamicCache`` (B, H_kv, L, D per layer: a prefill run outside this backend, a
        prefix cache read back) to the runtime before the first decode step; returns ``cache``, its layers
        now stubs.

        Without it the first step adopts the real keys itself, and its graph (real tensors in, stubs
        out) is compiled apart from the steady step's (stubs in and out): ``adopt`` saves that compile,
        about a minute for SmolLM2 on a 2-core CPU (kvpass/runtime/adopt.py). Results are the same.
        Every layer must reach a kvpass site: a layer the pass left exact raises after the step. With
        ``own_cache=False`` the model's cache keeps its keys, and ``adopt`` returns it unchanged."""
        if self.own_cache:
            with self.runtime._lock:
                adopt_cache(self.runtime.adoption, self.runtime, cache)
        return cache

    def held_bytes(self) -> int:
        """Bytes this backend's per-site state holds now (keys and values on the device and the host,
        metadata, scratch), each storage counted once. A sequence's share is freed when the model's
        cache holding its stubs is garbage-collected, or by :meth:`clear_state`."""
        return self.runtime.held_bytes()

    def clear_state(self) -> None:
        """Forget every site's sequence state and free what it held (a new prefill forgets by itself;
        a dropped model cache frees by itself).

        Not named ``reset``: ``torch._dynamo.reset()`` calls ``reset()`` on every backend it knows,
        and the statistics in ``report()`` should outlive a dynamo reset."""
        self.runtime.reset()

    def __repr__(self) -> str:
        return f"kvpass({self.policy.describe()})"


def _fmt(v: Any) -> str:
    if isinstance(v, int) and v >= 1 << 20:
        return f"{v / (1 << 20):.1f}MiB"
    return str(v)


def kvpass(policy: Policy, **options: Any) -> KVPassBackend:
    """Build the backend: ``torch.compile(model, backend=kvpass(Quest(budget=1024)))``.

    Options:
    - ``strict`` (bool, default False): raise instead of warning when an attention site is left exact,
      or when a watched forward ran none of the backend's graphs (compression off; kvpass/watch.py).
    - ``cache`` (bool, default True): let Inductor's FX graph and AOTAutograd caches serve compiled
      graphs across processes (keyed on the pass code, the policy, the options and the backend's
      handle, which is the same for the n-th backend of a policy in every process). What the pass
      found in a graph is kept beside Inductor's entry and restored on a hit, so ``report()`` is the
      same warm or cold. False compiles every graph afresh.
    - ``own_cache`` (bool, default True): for caches that grow by concatenation (DynamicCache), the
      runtime keeps the keys and values in its own buffers, appended in place, and the model's cache
      holds a zero-stride stub of the right length. False leaves the model's cache as it is.
    - ``skinny_linear`` (bool, default True): in decode graphs on CPU in fp32, compute each linear
      layer of a batch of 2-16 sequences (or a symbolic batch) weight-major, ``(W @ x^T)^T``, which MKL
      runs faster than ``x @ W^T`` there (SmolLM2's batch-4 step: 1.76x with 2 threads), and of a
      single sequence as ``sum(W * x, 1)``, which Inductor makes one reduction reading each weight row
      once (docs/design.md, "One-row decode linears"; kvpass/lowering/linear.py). Equal within fp32
      rounding; False keeps Inductor's ``x @ W^T``.

    Each option must be a real ``bool`` (``bool("no")`` is True, so nothing is coerced); a wrong type
    or an unknown option is a TypeError naming it and what to pass.
    """
    _check_option_names(options, OPTIONS, "kvpass()")
    return KVPassBackend(policy, **options)


#: The options of ``kvpass(policy, **options)``; ``torch.compile(backend="kvpass", options=...)`` also
#: takes ``policy`` and ``backend``.
OPTIONS = ("strict", "cache", "own_cache", "skinny_linear")


def _check_option_names(options: dict, valid: tuple[str, ...], where: str) -> None:
    unknown = sorted((k for k in options if k not in valid), key=str)
    if not unknown:
        return
    hints = [f"{near[0]!r} for {k!r}" for k in unknown
             if (near := difflib.get_close_matches(str(k), valid, n=1, cutoff=0.6))]
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    raise TypeError(f"kvpass: unknown option(s) {unknown} for {where}; expected: {', '.join(valid)}{hint}")


def inductor_patches(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """Inductor's config for ``torch.compile``'s ``mode`` and ``options`` (as its own backend reads them:
    ``torch._inductor.list_mode_options``, then the options, which win). The pass's own hook is not
    an option: kvpass installs it. Raises a KVPassError naming an unknown mode or option."""
    import torch._inductor
    import torch._inductor.config as config

    patches: dict[str, Any] = {}
    if mode is not None and mode != "default":
        modes = torch._inductor.list_mode_options()
        if mode not in modes:
            raise KVPassError(f"kvpass: unknown mode {mode!r} for torch.compile; Inductor's modes: "
                              f"{', '.join(modes)}")
        patches.update(torch._inductor.list_mode_options(mode))
    if options:
        if not isinstance(options, dict):
            raise KVPassError(f"kvpass: torch.compile's options must be a dict of Inductor options, got "
                              f"{type(options).__name__}")
        known = config.get_config_copy()
        unknown = sorted(str(k) for k in options if k not in known)
        ours = [k for k in unknown if k in OPTIONS or k == "policy"]
        if ours:
            raise KVPassError(f"kvpass: {', '.join(ours)} is an option of kvpass(policy, ...), not of "
                              f"torch.compile: pass kvpass({ours[0]}=...) (torch.compile's options go to "
                              "Inductor)")
        if unknown:
            hints = [f"{near[0]!r} for {k!r}" for k in unknown
                     if (near := difflib.get_close_matches(k, list(known), n=1, cutoff=0.8))]
            raise KVPassError(f"kvpass: unknown Inductor option(s) {unknown} in torch.compile's options"
                              + (f"; did you mean {', '.join(hints)}?" if hints else ""))
        if "post_grad_custom_post_pass" in options:
            raise KVPassError("kvpass: post_grad_custom_post_pass is where kvpass installs its graph pass; "
                              "compile with Inductor's own backend for a pass of your own")
        patches.update(options)
    return patches


def kvpass_backend(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    """The ``torch_dynamo_backends`` entry point: ``torch.compile(m, backend="kvpass",
    options={"policy": Quest(budget=1024)})``. The backend is built on the first graph and kept in
    ``options["backend"]`` so that every graph of that torch.compile call shares one runtime (read
    ``options["backend"].report()`` afterwards). ``mode`` goes to Inductor, as with a backend instance
    (``mode="reduce-overhead"``: CUDA graphs between the sites)."""
    # torch.compile (torch 2.13) only stores options; the backend first sees them here, at the first
    # graph, and dynamo wraps what it raises in BackendCompilerFailed, whose text carries our message.
    options = {} if options is None else options
    backend = options.get("backend")
    if backend is None:
        where = "torch.compile(backend='kvpass', options=...)"
        _check_option_names(options, ("policy", "backend", *OPTIONS), where)
        if options.get("policy") is None:
            raise KVPassError(
                "kvpass: torch.compile(model, backend='kvpass') needs options={'policy': kvpass.Quest(...)} "
                "(or {'policy': {'name': 'Quest', 'budget': 1024}} or {'policy': 'Quest(budget=1024)'})"
            )
        policy = options["policy"]
        if isinstance(policy, (str, dict)):
            policy = policy_from_dict(policy)
        flags = {k: v for k, v in options.items() if k not in ("policy", "backend")}
        backend = KVPassBackend(policy, **flags)
        options["backend"] = backend
    elif not isinstance(backend, KVPassBackend):
        raise KVPassError(
            f"kvpass: options['backend'] is where torch.compile(backend='kvpass') keeps the backend it "
            f"built, got {type(backend).__name__}: {backend!r}; pass options={{'policy': ...}} (or "
            f"torch.compile(model, backend=kvpass(policy)))"
        )
    return backend(gm, example_inputs, mode=mode)



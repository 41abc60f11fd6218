"""The post-grad graph pass: rewrite every attention site into ``kvpass::attention``."""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from kvpass.lowering.estimate import find_residuals, insert_estimate, layer_prefix, query_slice
from kvpass.lowering.linear import transpose_skinny_linears
from kvpass.lowering.nodes import fake_value, insert_node
from kvpass.lowering.shards import heads_label
from kvpass.patterns.attention import SiteMatch, Unmatched, _val, find_sites


_PKG = Path(__file__).resolve().parent.parent
# The code whose change must invalidate compiled graphs (FX graph cache keys include the uuid).
_PASS_FILES = tuple(
    str(_PKG / f)
    for f in ("patterns/attention.py", "lowering/graph_pass.py", "lowering/ops.py", "lowering/estimate.py",
              "lowering/linear.py", "lowering/nodes.py",
              "lowering/shards.py")
)


class PassHost(Protocol):
    """What the pass reads from, and records in, the backend that installs it (:class:`kvpass.KVPassBackend`
    is the one): named here, so that the compiler does not import the API above it."""

    policy: Any  # the Policy: fetches, prefetches, fetches_on, prefetches_on
    own_cache: bool
    skinny_linear: bool
    runtime: Any  # the Runtime: handle, info(site)
    _key: str
    _key_shards: dict  # module path -> KeyShard (lowering/shards.py)
    _heads: dict[int, str]
    _lock: Any  # held while a cache record is replayed (graph_cache.restore)

    def _site_id(self, path: str, layer: int | None) -> int: ...

    def _claim_sites(self, claims: dict[str, tuple[int | None, int]]) -> bool: ...

    def _note_site(self, site: int, path: str, layer: int | None, pattern: str) -> Any: ...

    def _record_graph(self, kind: str, rows: list[dict], unmatched: list, linears: int = 0) -> None: ...


@dataclasses.dataclass
class GraphRecord:
    """What the pass found in one compiled graph."""

    index: int
    kind: str  # "prefill", "decode" or "other", from the query lengths
    sites: list[dict]
    unmatched: list[Unmatched]
    linears: int = 0  # decode linears rewritten: weight-major, or a reduction for one row (lowering/linear.py)


def _device(m: SiteMatch) -> torch.device:
    """The device a site's attention runs on (its query's; CUDA where the trace carries no value)."""
    q = _val(m.q)
    return q.device if isinstance(q, torch.Tensor) else torch.device("cuda")


def _cache_updates_without_sdpa(graph: fx.Graph) -> int:
    """Cache updates (cat of a graph input along the sequence) in a graph with no SDPA node: the
    signature of attention written as matmul + softmax (attn_implementation="eager")."""
    n = 0
    for node in graph.nodes:
        if node.target is torch.ops.aten.cat.default and len(node.args) > 1 and node.args[1] in (2, -2):
            if node.args[0] and getattr(node.args[0][0], "op", None) == "placeholder":
                n += 1
    return n


class KVPassGraphPass(CustomGraphPass):
    """Installed as Inductor's ``post_grad_custom_post_pass`` by :class:`kvpass.KVPassBackend`."""

    def __init__(self, backend: PassHost):
        self._backend = weakref.ref(backend)
        self._key = backend._key
        self._handle = backend.runtime.handle

    def uuid(self) -> str:
        # Pass code + every policy parameter and option + the backend's handle: two policies (or two
        # backends, whose graphs carry different handles) never share compiled code, while the n-th
        # backend of a policy in a new process (same handle) reuses the n-th's of an earlier one.
        # (set_policy swaps within one backend only between policies that compile to the same graph.)
        h = hashlib.sha256(get_hash_for_files(_PASS_FILES))
        h.update(self._key.encode())
        h.update(str(self._handle).encode())
        return h.hexdigest()

    def __call__(self, graph: fx.Graph) -> None:
        backend = self._backend()
        if backend is None:
            return
        sites, unmatched = find_sites(graph)
        rows = [self._rewrite(graph, m, backend) for m in sites]
        if sites:
            graph.eliminate_dead_code()
        lengths = {r["query_len"] for r in rows}
        kind = "decode" if lengths == {1} else "prefill" if lengths and 1 not in lengths else "other"
        if kind == "decode" and backend.policy.prefetches and backend.own_cache:
            self._insert_prefetches(graph, sites, rows)
        linears = 0
        if kind == "decode" and backend.skinny_linear:
            linears = transpose_skinny_linears(graph)
            counters["kvpass"]["linears_transposed"] += linears
        if not sites and not unmatched and _cache_updates_without_sdpa(graph):
            unmatched.append(
                Unmatched(
                    "-",
                    "-",
                    None,
                    "-",
                    "KV-cache updates but no scaled_dot_product_attention: the model computes attention "
                    "as matmul + softmax; load it with attn_implementation='sdpa'",
                )
            )
        backend._record_graph(kind, rows, unmatched, linears)

    def _rewrite(self, graph: fx.Graph, m: SiteMatch, backend: PassHost) -> dict:
        site = backend._site_id(m.module_path, m.layer)
        backend._note_site(site, m.module_path, m.layer, m.pattern)
        self._note_heads(backend, site, m)
        if m.own is not None and backend.own_cache:
            new = self._rewrite_owned(graph, m, site)
        else:
            new = self._rewrite_plain(graph, m, site)
        new = self._match_layout(graph, m, new)
        m.new = new
        m.out.replace_all_uses_with(new)
        if m.out is not m.sdpa:
            graph.erase_node(m.out)
        if not m.sdpa.users:
            graph.erase_node(m.sdpa)
        counters["kvpass"]["sites_rewritten"] += 1
        counters["kvpass"][m.pattern.split()[0]] += 1
        if m.own is not None and backend.own_cache:
            counters["kvpass"]["caches_owned"] += 1
        q_len = _val(m.q).shape[2]
        row = {
            "site": site,
            "layer": m.layer,
            "module": m.module_path,
            "pattern": m.pattern + (" (owned)" if m.own is not None and backend.own_cache else ""),
            "query_len": int(q_len) if isinstance(q_len, int) else str(q_len),
        }
        if m.own is not None and backend.runtime.info(site).fetch_in_attention:
            row["fetch"] = "in attention"  # kept in the graph's record: a cache hit restores it
        if site in backend._heads:
            row["heads"] = backend._heads[site]  # kept in the graph's record: a cache hit restores it
        return row

    @staticmethod
    def _note_heads(backend: PassHost, site: int, m: SiteMatch) -> None:
        """Under tensor parallelism, which of the model's KV heads this rank's site holds (report())."""

        k = _val(m.own["k_new"] if m.own is not None else m.k)
        if k is None or k.ndim != 4 or not all(isinstance(n, int) for n in (k.shape[1], k.shape[3])):
            return
        label = heads_label(backend._key_shards.get(m.module_path), int(k.shape[1]), int(k.shape[3]))
        if label:
            backend._heads[site] = label

    def _insert(self, graph: fx.Graph, before: fx.Node, target, args, meta_from: fx.Node) -> fx.Node:
        return insert_node(graph, before, target, args, meta_from)

    @staticmethod
    def _match_layout(graph: fx.Graph, m: SiteMatch, new: fx.Node) -> fx.Node:
        """``new`` (the op's contiguous (B, H_q, T, D)) copied into the memory layout of the SDPA output it
        replaces, where they differ: CUDA's flash and efficient kernels return (B, T, H_q, D) memory, and
        the graph after them views it as such (``transpose(1, 2)`` then ``view``: no copy). Found by the
        simulated CUDA device (kvpass/simcuda.py). A CPU prefill's SDPA output is (B, T, H_q, D) memory
        too: Inductor's CPU lowering copied where the view could not be taken, but the graph was ill-typed
        (an FX run of it fails). Decode steps (T = 1) have one layout: nothing is inserted there."""
        ref, got = _val(m.out), _val(new)
        if not (isinstance(ref, torch.Tensor) and isinstance(got, torch.Tensor)) or ref.dim() != got.dim():
            return new

        def hint(x) -> int:
            return x.node.hint if isinstance(x, torch.SymInt) and x.node.hint is not None else int(x)

        wide = [i for i in range(ref.dim()) if hint(ref.shape[i]) != 1]
        if all(hint(ref.stride(i)) == hint(got.stride(i)) for i in wide):
            return new
        order = sorted(range(ref.dim()), key=lambda i: (-hint(ref.stride(i)), i))  # outermost first
        inverse = sorted(range(ref.dim()), key=lambda i: order[i])
        aten = torch.ops.aten
        p = insert_node(graph, m.sdpa, aten.permute.default, (new, order), m.sdpa)
        with graph.inserting_before(m.sdpa):
            c = graph.call_function(aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
        c.meta.update({k: v for k, v in p.meta.items() if k != "val"})
        c.meta["val"] = fake_value(lambda t: aten.clone.default(t, memory_format=torch.contiguous_format),
                                    (p,))
        return insert_node(graph, m.sdpa, aten.permute.default, (c, inverse), m.sdpa)

    def _insert_prefetches(self, graph: fx.Graph, sites: list[SiteMatch], rows: list[dict]) -> None:
        """TailorKV: before each owned site's fetch, a ``kvpass::prefetch`` fed with the site's query
        estimated from the previous site's residual stream (see :mod:`kvpass.lowering.estimate`),
        placed before the previous site's attention; the first site, and any whose query slice cannot
        be copied, prefetch with their true query."""

        policy = self._backend().policy
        owned = []
        for m, r in zip(sites, rows):
            if m.own is None or "fetch" not in m.own:
                continue
            dev = _device(m)
            if policy.prefetches_on(dev):
                owned.append((m, r))
            else:
                info = self._backend().runtime.info(r["site"])
                info.estimate = r["estimate"] = (f"none (on {dev.type} the true query picks the channels; "
                                                 "early_estimate=True estimates)")
        owned.sort(key=lambda mr: (mr[0].layer if mr[0].layer is not None else -1))
        slices = []
        for m, _ in owned:
            prefix = layer_prefix(m.module_path, m.layer)
            slices.append(query_slice(graph, m.q, m.layer, prefix) if prefix else None)
        find_residuals([s for s in slices if s is not None])
        prev = None  # (slice, site match) of the previous site with a residual
        for (m, row), sl in zip(owned, slices):
            info = self._backend().runtime.info(row["site"])
            q_hat, source = None, None
            if sl is None:
                why = "no decoder-layer module path"
            elif sl.residual is None:
                why = sl.why
            elif prev is None:
                why = "first site: no earlier layer"
            else:
                q_hat = insert_estimate(graph, sl, prev[0], prev[1].new)
                source = prev[0].layer
                why = "" if q_hat is not None else "the residual inputs differ in shape or dtype"
            fetch = m.own["fetch"]  # None: the attention fetches, and takes the prefetch's ticket itself
            if q_hat is None:
                anchor, q_in = fetch if fetch is not None else m.new, m.q
            else:
                anchor, q_in = q_hat.next, q_hat
            node = self._insert(graph, anchor, torch.ops.kvpass.prefetch.default,
                                (q_in, m.own["k_past"], self._handle, row["site"], q_hat is not None), m.sdpa)
            if fetch is not None:
                fetch.args = (*fetch.args[:4], node)
            else:
                m.new.args = (*m.new.args[:-1], node)
            info.estimate = f"layer {source}" if q_hat is not None else f"none ({why})"
            row["estimate"] = info.estimate
            counters["kvpass"]["prefetches_inserted"] += 1
            if q_hat is not None:
                counters["kvpass"]["queries_estimated"] += 1
            if sl is not None and sl.residual is not None:
                prev = (sl, m)

    def _rewrite_plain(self, graph: fx.Graph, m: SiteMatch, site: int) -> fx.Node:
        args = (
            m.q,
            m.k,
            m.v,
            m.attn_mask,
            m.cache_position,
            float(m.scale) if m.scale is not None else 0.0,
            m.is_causal,
            self._handle,
            site,
        )
        return self._insert(graph, m.sdpa, torch.ops.kvpass.attention.default, args, m.sdpa)

    def _rewrite_owned(self, graph: fx.Graph, m: SiteMatch, site: int) -> fx.Node:
        """The runtime keeps the keys and values; the graph returns stubs for the model's cache, so
        the whole-cache ``cat`` becomes dead code. A policy with a host tier also gets a
        ``kvpass::fetch`` before the attention, whose ticket the attention consumes."""
        o = m.own
        fetched = None
        backend = self._backend()
        policy = backend.policy if backend is not None else None
        if policy is not None and policy.fetches:
            if policy.fetches_on(_device(m)):
                fetched = self._insert(graph, m.sdpa, torch.ops.kvpass.fetch.default,
                                       (m.q, o["k_past"], self._handle, site), m.sdpa)
                counters["kvpass"]["fetches_inserted"] += 1
            o["fetch"] = fetched  # None: the attention fetches (the state must know: a missing op is loud)
            backend.runtime.info(site).fetch_in_attention = fetched is None
        args = (
            m.q,
            o["k_new"],
            o["v_new"],
            o["k_past"],
            o["v_past"],
            m.attn_mask,
            float(m.scale) if m.scale is not None else 0.0,
            m.is_causal,
            self._handle,
            site,
            fetched,
        )
        new = self._insert(graph, m.sdpa, torch.ops.kvpass.attention_owned.default, args, m.sdpa)
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        for store, fresh, past in ((o["k_store"], o["k_new"], o["k_past"]), (o["v_store"], o["v_new"], o["v_past"])):
            stub = self._insert(graph, output, torch.ops.kvpass.cache_stub.default,
                                (fresh, past, self._handle, site), m.sdpa)
            output.replace_input_with(store, stub)
            # Inductor restrides outputs to their original (dense) strides; a stub must stay a stub.
            flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
            strides = output.meta.get("original_output_strides")
            if strides is not None:
                for i, a in enumerate(flat):
                    if a is stub and i < len(strides):
                        strides[i] = None
        return new

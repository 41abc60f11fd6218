"""Attention-site matching on post-grad (aten) FX graphs, in the manner of Inductor's
``fx_passes/fuse_attention.py``: small numbered patterns, checks on ``node.meta["val"]``.

An attention site is a scaled-dot-product-attention node whose key and value come from the model's
KV cache. Walking back from SDPA's key/value we accept, in order:

1. an optional repeat_kv chain (transformers 4.x: ``unsqueeze(2) -> expand -> clone? -> view``);
2. an optional ``slice(dim=2, start=0)`` (transformers 5.x static cache at prefill);
3. the cache update, one of the numbered patterns:
   - ``P1 cat``:       ``cat([past, new], dim=-2)`` with ``past`` a graph input (DynamicCache decode);
   - ``P2 index_put``: ``index_put(buf, [None, None, pos], new)`` (StaticCache, ``index_copy_``);
   - ``P3 prefill``:   the new keys themselves, returned as a graph output for the cache to keep
                       (DynamicCache prefill: post-grad drops ``cat([empty, k])``).

Anything else is left exact and reported with the reason (invariant 5).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

# Every SDPA flavour Inductor leaves in a post-grad graph (CPU and CUDA), by overload packet.
SDPA_TARGETS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "sdpa_flash_cpu",
    aten._scaled_dot_product_flash_attention.default: "sdpa_flash",
    aten._scaled_dot_product_efficient_attention.default: "sdpa_efficient",
    aten._scaled_dot_product_cudnn_attention.default: "sdpa_cudnn",
    aten._scaled_dot_product_fused_attention_overrideable.default: "sdpa_overrideable",
    aten.scaled_dot_product_attention.default: "sdpa",
}

_REPEAT_KV_OPS = {
    aten.unsqueeze.default,
    aten.expand.default,
    aten.clone.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.alias.default,
}


@dataclasses.dataclass
class SiteMatch:
    sdpa: fx.Node
    out: fx.Node  # the node whose value is the attention output (getitem 0, or sdpa itself)
    q: fx.Node
    k: fx.Node  # the cache tensor, before repeat_kv (B, H_kv, S, D)
    v: fx.Node
    attn_mask: fx.Node | None
    cache_position: fx.Node | None
    scale: float | None
    is_causal: bool
    pattern: str
    module_path: str
    layer: int | None
    repeat_kv: bool
    # For a cache that grows by cat (P1) or is first stored at prefill (P3): the new keys/values, the
    # past cache (None at prefill) and the node the graph returns for the cache to keep. When set,
    # the runtime can own the cache (the model keeps a stub).
    own: dict | None = None


@dataclasses.dataclass
class Unmatched:
    node: str
    module_path: str
    layer: int | None
    shape: str
    reason: str


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _shape(n: Any) -> tuple:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "?"
    path = list(stack.values())[-1][0]
    # dynamo spells the root as L['self'] or L['fn']; keep the attribute path only
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path) or "?"


def layer_of(path: str) -> int | None:
    """The index of the decoder layer in a module path (``model.layers.3.self_attn`` -> 3)."""
    nums = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(nums[-1]) if nums else None


def _schema_args(node: fx.Node) -> dict[str, Any]:
    """Name -> value for every schema argument of an OpOverload call (defaults filled in)."""
    schema = node.target._schema
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def _strip_repeat_kv(node: fx.Node, outputs: set[fx.Node] = frozenset()) -> tuple[fx.Node, bool]:
    """Walk back through a repeat_kv chain; returns (base, whether a head repeat was seen).

    The walk stops at a graph output: that tensor is what the cache keeps (e.g. a ``clone`` that
    makes a slice of a fused QKV projection contiguous, as in Phi-3), so it is the base."""
    start = node
    while isinstance(node, fx.Node) and node.target in _REPEAT_KV_OPS and node not in outputs:
        node = node.args[0]
    if node is start:
        return node, False
    s0, s1 = _shape(start), _shape(node)
    repeated = len(s0) == 4 and len(s1) == 4 and s0[1] != s1[1]
    return node, repeated


def _is_seq_slice(node: fx.Node) -> bool:
    if node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * 5
    dim, start, step = args[1], args[2] or 0, args[4] or 1
    return dim in (2, -2) and start == 0 and step == 1


def _is_window_slice(node: fx.Node) -> bool:
    """``x[:, :, -W:]``: what a sliding-window cache keeps of its concatenated keys."""
    if node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * 5
    return args[1] in (2, -2) and isinstance(args[2], int) and args[2] < 0


_COPIES = (aten.copy.default, aten.copy_.default)


def _is_stored(node: fx.Node, outputs: set[fx.Node]) -> bool:
    """The graph keeps ``node`` for later calls: it is returned, or copied into a graph input (a static
    buffer written in place) or into a tensor that is returned (a buffer allocated in this graph)."""
    if node in outputs:
        return True
    return any(
        u.target in _COPIES and len(u.args) > 1 and u.args[1] is node
        and (u in outputs or getattr(u.args[0], "op", None) == "placeholder")
        for u in node.users
    )


def _keeps_window(node: fx.Node, outputs: set[fx.Node]) -> bool:
    """Only the last tokens of ``node`` are kept (``node[:, :, -W:]`` is stored): a sliding-window layer."""
    return any(_is_window_slice(u) and _is_stored(u, outputs) for u in node.users)


def _is_buffer(node: Any) -> bool:
    """A graph input, or a tensor made from no other tensor (``full``/``zeros``: a fresh buffer)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "placeholder":
        return True
    inputs: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), inputs.append)
    return node.op == "call_function" and not inputs


_SLIDING_REASON = (
    "a sliding-window cache layer (it keeps only the last tokens): left exact, as only global-attention "
    "layers are compressed"
)


def _is_seq_cat(node: fx.Node) -> bool:
    """``cat(tensors, dim=-2)`` on 4-D tensors: a concatenation along the sequence. A cat along another
    dimension (GPT-NeoX's partial rotary embedding, ``cat([rotated, passed], dim=-1)``) builds the new
    keys themselves and is no cache update."""
    if node.target is not aten.cat.default:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    ndim = len(_shape(node))
    return dim in (ndim - 2, -2)


def _cache_update(base: fx.Node, outputs: set[fx.Node]) -> tuple[str | None, fx.Node | None, str, tuple | None]:
    """Classify the node holding the cache. Returns (pattern, cache_position node, reason,
    (new, past, stored) when the runtime could own this cache, else None)."""
    sliced = _is_seq_slice(base)
    node = base.args[0] if sliced else base
    if _is_seq_cat(node):
        tensors = node.args[0]
        if len(tensors) == 2 and tensors[0].op == "placeholder":
            if node not in outputs and _keeps_window(node, outputs):
                return None, None, _SLIDING_REASON, None
            own = (tensors[1], tensors[0], node) if node in outputs and not sliced else None
            return "P1 cat", None, "", own
        return None, None, "a cat that is not a cache update (expected cat([past_cache, new], dim=-2))", None
    if node.target in (aten.index_put.default, aten.index_put_.default):
        indices = node.args[1]
        if not (
            len(indices) == 3
            and indices[0] is None
            and indices[1] is None
            and isinstance(indices[2], fx.Node)
            and len(_shape(indices[2])) == 1
        ):
            return None, None, "an index_put that is not a static-cache write (expected [None, None, pos])", None
        if not _is_buffer(node.args[0]):
            # A static cache writes into its buffer: a graph input, or a buffer allocated in this graph
            # (lazy initialisation at prefill). A write into a computed tensor is a rolled buffer
            # (transformers' StaticSlidingWindowLayer once full: roll, then write at -1), whose slots
            # are not positions.
            return None, None, _SLIDING_REASON + " (a rolled static buffer)", None
        return "P2 index_put", indices[2], "", None
    if node in outputs:
        return "P3 prefill", None, "", ((node, None, node) if not sliced else None)
    if _keeps_window(node, outputs):
        # a sliding-window layer's prefill: it attends to the whole prompt and keeps the last tokens
        return None, None, _SLIDING_REASON, None
    return None, None, "no KV-cache update feeds this attention (use_cache=False, or an unknown cache)", None


def find_sites(graph: fx.Graph) -> tuple[list[SiteMatch], list[Unmatched]]:
    """Every attention site of a post-grad graph, and every SDPA node that could not be matched."""
    output = next(n for n in graph.nodes if n.op == "output")
    outputs: set[fx.Node] = set()
    fx.node.map_arg(output.args, outputs.add)
    sites: list[SiteMatch] = []
    unmatched: list[Unmatched] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        path = module_path(node)
        layer = layer_of(path)

        def reject(reason: str, node=node, path=path, layer=layer) -> None:
            unmatched.append(Unmatched(node.name, path, layer, str(_shape(node.args[0])), reason))

        a = _schema_args(node)
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask", a.get("attn_bias"))
        if a.get("dropout_p") not in (None, 0.0, 0):
            reject("dropout_p != 0 (training-mode attention)")
            continue
        qv, kv, vv = _val(q), _val(k), _val(v)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
            reject("query/key/value are not 4-D (B, H, S, D) tensors")
            continue
        if not (qv.dtype.is_floating_point and qv.dtype == kv.dtype == vv.dtype):
            reject(f"unsupported dtypes q={qv.dtype} k={kv.dtype} v={vv.dtype}")
            continue
        # the output: the op itself (public SDPA) or getitem 0 of its tuple
        if SDPA_TARGETS[node.target] == "sdpa":
            out = node
        else:
            users = list(node.users)
            if not all(u.target is operator.getitem for u in users) or {u.args[1] for u in users} != {0}:
                reject("SDPA's auxiliary outputs (logsumexp) are used, e.g. for a backward pass")
                continue
            if len(users) != 1:
                reject("SDPA output used through several getitems")
                continue
            out = users[0]
        k_base, k_rep = _strip_repeat_kv(k, outputs)
        v_base, v_rep = _strip_repeat_kv(v, outputs)
        kb, vb = _val(k_base), _val(v_base)
        if not (isinstance(kb, torch.Tensor) and kb.dim() == 4 and isinstance(vb, torch.Tensor) and vb.dim() == 4):
            reject("the key/value before repeat_kv are not 4-D (B, H_kv, S, D)")
            continue
        if qv.shape[1] % kb.shape[1] != 0 or kb.shape[1] != vb.shape[1]:
            reject(f"query heads {qv.shape[1]} are not a multiple of KV heads {kb.shape[1]}")
            continue
        k_pat, k_pos, k_why, k_own = _cache_update(k_base, outputs)
        v_pat, v_pos, v_why, v_own = _cache_update(v_base, outputs)
        if k_pat is None or v_pat is None:
            reject(k_why or v_why)
            continue
        if k_pat != v_pat:
            reject(f"key and value caches differ in kind ({k_pat} vs {v_pat})")
            continue
        if k_pos is not None and v_pos is not None and k_pos is not v_pos:
            reject("key and value are written at different cache positions")
            continue
        if layer is None:
            # The graph was compiled for a submodule on its own (a graph break splits the model), so its
            # code may run for every layer while a site id is baked into it: the layers would share
            # one site's state. Only the model's own graph names each site's layer.
            reject(
                f"its module path {path!r} names no layer: this graph was compiled for a submodule on its "
                "own (a graph break splits the model, e.g. .item() in a mixture-of-experts router), so one "
                "compiled site would serve every layer; remove the graph break"
            )
            continue
        scale = a.get("scale")
        pattern = k_pat + (" +repeat_kv" if (k_rep or v_rep) else "") + (" +mask" if mask is not None else "")
        sites.append(
            SiteMatch(
                sdpa=node,
                out=out,
                q=q,
                k=k_base,
                v=v_base,
                attn_mask=mask,
                cache_position=k_pos,
                scale=scale,
                is_causal=bool(a.get("is_causal") or False),
                pattern=pattern,
                module_path=path,
                layer=layer,
                repeat_kv=k_rep or v_rep,
                own=(
                    {"k_new": k_own[0], "k_past": k_own[1], "k_store": k_own[2],
                     "v_new": v_own[0], "v_past": v_own[1], "v_store": v_own[2]}
                    if k_own is not None and v_own is not None
                    else None
                ),
            )
        )
    return sites, unmatched

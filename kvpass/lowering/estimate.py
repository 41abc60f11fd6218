"""Query estimation one layer early (TailorKV, arXiv 2505.19586, Sec. 4.3 and App. "inter-layer
similarity"): layer l's query is estimated from layer l-1's residual stream with layer l's own
weights, ``q̂_l = RoPE(W_q^l · norm_l(h_{l-1}))``, so that layer l's critical key channels can be
prefetched while layer l-1 runs.

The pass does not know the model. It finds, in the post-grad graph, the nodes that compute the query
of a site inside its decoder layer (walking back from the SDPA query while ``nn_module_stack`` stays
inside the layer's module, e.g. ``model.layers.5``): the input norm, the q projection, q/k norms,
RoPE. Their inputs from outside the layer are the weights (graph inputs), what every layer shares
(RoPE's cos/sin) and one tensor only this layer reads: its residual input ``h_l``. The slice is copied
with ``h_l`` replaced by the previous site's residual input ``h_{l-1}`` and placed before the previous
site's attention. Nothing model-specific is written here: a model whose query slice cannot be found
this way gets the true query instead (prefetch right before the fetch), and the report says why.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from kvpass.patterns.attention import _val, layer_of, module_path


@dataclasses.dataclass
class QuerySlice:
    layer: int
    prefix: str  # the decoder layer's module path
    nodes: list[fx.Node]  # in graph order, the last one is the query
    boundary: set[fx.Node]
    residual: fx.Node | None = None
    why: str = ""


def layer_prefix(path: str, layer: int | None) -> str | None:
    """``model.layers.3.self_attn`` -> ``model.layers.3`` (the module of the decoder layer)."""
    if layer is None:
        return None
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == str(layer):
            return ".".join(parts[: i + 1])
    return None


def _inside(node: fx.Node, prefix: str) -> bool:
    """In the layer's module, or a node Inductor's own rewrites left without a module (e.g. the
    ``x + eps`` of a norm after pattern replacement): copying those is harmless, and a walk that
    strays into another layer through one is caught by :func:`find_residuals`."""
    if node.op != "call_function":
        return False
    path = module_path(node)
    return path == prefix or path.startswith(prefix + ".") or path == "?"


def query_slice(graph: fx.Graph, q: fx.Node, layer: int, prefix: str) -> QuerySlice:
    inside: set[fx.Node] = set()
    boundary: set[fx.Node] = set()
    stack = [q]
    while stack:
        n = stack.pop()
        if n in inside or n in boundary:
            continue
        if _inside(n, prefix):
            inside.add(n)
            stack.extend(n.all_input_nodes)
        else:
            boundary.add(n)
    nodes = [n for n in graph.nodes if n in inside]
    return QuerySlice(layer, prefix, nodes, boundary)


def _is_hidden(n: fx.Node) -> bool:
    v = _val(n)
    return n.op != "placeholder" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 3


def find_residuals(slices: list[QuerySlice]) -> None:
    """Set each slice's ``residual``: its one floating (B, T, hidden) input that no other layer's
    query slice reads (RoPE's cos/sin are read by every layer; the weights are graph inputs)."""

    for s in slices:
        if not s.nodes:
            s.why = "the query is not computed inside its decoder layer's module"
            continue
        others = set().union(*(o.boundary for o in slices if o is not s)) if len(slices) > 1 else set()
        cands = [n for n in s.boundary if _is_hidden(n) and n not in others]
        if len(cands) != 1:
            s.why = f"{len(cands)} candidate residual inputs for layer {s.layer}'s query"
            continue
        res = cands[0]
        # The residual stream leaves a decoder layer at the layer's own module (its last add), or
        # comes from outside every layer (embeddings); anything else read from inside another layer
        # means the walk left this layer's query computation.
        path = module_path(res)
        inner = [n for n in s.boundary if n is not res and n.op != "placeholder"
                 and layer_of(module_path(n)) is not None]
        if layer_of(path) is not None and layer_prefix(path, layer_of(path)) != path or inner:
            s.why = f"layer {s.layer}'s query reads another layer's internals ({module_path((inner or [res])[0])})"
            continue
        s.residual = res


def insert_estimate(graph: fx.Graph, target: QuerySlice, source: QuerySlice, before: fx.Node) -> fx.Node | None:
    """Copy ``target``'s query slice fed with ``source``'s residual input; the copy is placed before
    ``before`` (the source site's attention) or, if an input comes later, right after that input.
    Returns the estimated query node, or None when the two residuals differ in shape or dtype."""
    a, b = _val(target.residual), _val(source.residual)
    if a is None or b is None or a.dtype != b.dtype or a.shape[-1] != b.shape[-1]:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    env = {target.residual: source.residual}
    inputs = [env.get(n, n) for n in target.boundary]
    point = before
    last = max(inputs, key=lambda n: order[n], default=None)
    if last is not None and order[last] >= order[before]:
        point = last.next
    with graph.inserting_before(point):
        for n in target.nodes:
            env[n] = graph.node_copy(n, lambda x: env.get(x, x))
    return env[target.nodes[-1]]

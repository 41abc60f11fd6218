"""Inserting nodes into a post-grad graph: each new node gets its anchor's source metadata and a fake
value, so that later passes and Inductor's lowering see its shape, dtype and device."""

from __future__ import annotations

import torch
import torch.fx as fx

from kvpass.patterns.attention import _val

__all__ = ["fake_value", "insert_node"]


def fake_value(target, args):
    """``target(*args)`` run on the fake values of ``args``' nodes (None where the graph carries none)."""
    vals = fx.node.map_arg(args, _val)
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    mode = torch._guards.detect_fake_mode(flat)
    if mode is None:
        return None
    with mode:
        return target(*vals)


def insert_node(graph: fx.Graph, before: fx.Node, target, args, meta_from: fx.Node) -> fx.Node:
    """A ``call_function`` node before ``before``, with ``meta_from``'s source metadata and a fake value."""
    with graph.inserting_before(before):
        new = graph.call_function(target, args=args)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr"):
        if key in meta_from.meta:
            new.meta[key] = meta_from.meta[key]
    new.meta["val"] = fake_value(target, args)
    return new

"""Decode linears: ``(W @ x^T)^T`` (weight-major) for 2-16 rows, ``sum(W * x, 1)`` for one row.

A decode step of a batch of ``M`` sequences multiplies an ``(M, K)`` activation by every ``(N, K)``
weight of the model: ``mm(x, permute(W, [1, 0]))`` in the post-grad graph. On this project's CPU
(torch 2.13, fp32, MKL) that product is much slower than the same product written weight-major,
``permute(mm(W, permute(x, [1, 0])), [1, 0])``, for ``2 <= M <= 16`` (a whole batch-4 decode step of
SmolLM2 at 4k tokens: 1.76x faster with 2 threads, 1.19x with 1; docs/design.md, "Batched decode
linears", measured with ``kvpass bench --decode-cost [--no-skinny-linear]``). At ``M = 1`` (dynamo
specialises a batch of one) MKL's product reads the weights at about a third of the machine's
bandwidth, and ``sum(W * x, 1)`` is faster: Inductor fuses it into one reduction that reads each row of
``W`` once, in order (docs/design.md, "One-row decode linears"). Either way the result is the same
product summed in another order: equal within fp32 rounding, not bit for bit.

Applied by the graph pass to decode graphs on CPU in fp32 when ``kvpass(..., skinny_linear=True)``
(the default).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kvpass.lowering.nodes import insert_node
from kvpass.patterns.attention import _val

aten = torch.ops.aten

#: Rows of the activation for which the weight-major form is used (a symbolic batch counts as in).
MIN_ROWS, MAX_ROWS = 2, 16


def _rows_in_range(m) -> bool:
    if isinstance(m, int):
        return MIN_ROWS <= m <= MAX_ROWS
    return isinstance(m, torch.SymInt)  # a symbolic batch: the decode batch of a dynamic=True compile


def _weight_of(node) -> fx.Node | None:
    """``W`` when ``node`` is ``permute(W, [1, 0])`` of a contiguous 2-d fp32 CPU tensor."""
    if not isinstance(node, fx.Node) or node.target is not aten.permute.default:
        return None
    if list(node.args[1]) != [1, 0]:
        return None
    w = node.args[0]
    v = _val(w)
    if not isinstance(v, torch.Tensor) or v.ndim != 2 or v.device.type != "cpu" or v.dtype != torch.float32:
        return None
    if not all(isinstance(s, int) for s in v.shape) or not v.is_contiguous():
        return None
    return w


def transpose_skinny_linears(graph: fx.Graph) -> int:
    """Rewrite each ``mm(x, permute(W, [1, 0]))`` (and ``addmm(b, x, permute(W, [1, 0]))`` with unit
    ``alpha``/``beta``) whose ``x`` is ``(M, K)`` fp32 and whose ``W`` is an ``(N, K)`` contiguous fp32
    CPU weight with ``N > MAX_ROWS``: with ``2 <= M <= 16`` rows (or a symbolic ``M``) into
    ``permute(mm(W, permute(x, [1, 0])), [1, 0])``, with one row into ``unsqueeze(sum(W * x, 1), 0)``
    (+ ``b``). Returns how many were rewritten."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.mm.default and not node.kwargs:
            bias, x, wt = None, node.args[0], node.args[1]
        elif node.target is aten.addmm.default and not node.kwargs and len(node.args) == 3:
            bias, x, wt = node.args
        else:
            continue
        w = _weight_of(wt)
        xv = _val(x)
        if w is None or not isinstance(xv, torch.Tensor) or xv.ndim != 2 or xv.dtype != torch.float32:
            continue
        if _val(w).shape[0] <= MAX_ROWS:
            continue
        if isinstance(xv.shape[0], int) and xv.shape[0] == 1:
            # one row: sum(W * x, 1), which Inductor makes one reduction reading each row of W once
            prod = insert_node(graph, node, aten.mul.Tensor, (w, x), node)
            y = insert_node(graph, node, aten.sum.dim_IntList, (prod, [1]), node)
            out = insert_node(graph, node, aten.unsqueeze.default, (y, 0), node)
        elif _rows_in_range(xv.shape[0]):
            xt = insert_node(graph, node, aten.permute.default, (x, [1, 0]), node)
            y = insert_node(graph, node, aten.mm.default, (w, xt), node)
            out = insert_node(graph, node, aten.permute.default, (y, [1, 0]), node)
        else:
            continue
        if bias is not None:
            out = insert_node(graph, node, aten.add.Tensor, (out, bias), node)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
        n += 1
    return n

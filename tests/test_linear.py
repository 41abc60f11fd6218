"""The weight-major rewrite of batched decode linears (kvpass/lowering/linear.py): where it applies, that
the rewritten graph computes the same product, and that a compiled decode with it matches one without."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import kvpass
from kvpass.lowering.linear import MAX_ROWS, MIN_ROWS, transpose_skinny_linears
from tiny import prompt

aten = torch.ops.aten


def _linear(x, w):
    return torch.mm(x, w.permute(1, 0))


def _linear_bias(x, w, b):
    return torch.addmm(b, x, w.permute(1, 0))


def _rewrite(fn, *args, mode="fake"):
    gm = make_fx(fn, tracing_mode=mode)(*args)
    n = transpose_skinny_linears(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, n


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 24), k=st.integers(1, 40), n=st.integers(1, 64), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_rewrites_exactly_the_skinny_fp32_products_and_keeps_their_value(m, k, n, bias, dtype):
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x = torch.randn(m, k, generator=g, dtype=dtype)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    fn, args = (_linear_bias, (x, w, b)) if bias else (_linear, (x, w))
    gm, count = _rewrite(fn, *args)
    expected = (m == 1 or MIN_ROWS <= m <= MAX_ROWS) and n > MAX_ROWS and dtype == torch.float32
    assert count == int(expected)
    targets = [nd.target for nd in gm.graph.nodes if nd.op == "call_function"]
    weight = [nd for nd in gm.graph.nodes if nd.op == "placeholder"][1]
    if expected:
        assert aten.addmm.default not in targets
        if m == 1:  # one row: sum(W * x, 1), no product left
            assert aten.mm.default not in targets
            mul = next(nd for nd in gm.graph.nodes if nd.target is aten.mul.Tensor)
            assert mul.args[0] is weight and aten.sum.dim_IntList in targets
        else:
            mm = next(nd for nd in gm.graph.nodes if nd.target is aten.mm.default)
            assert mm.args[0] is weight  # weight-major: W @ x^T
    out = gm(*args)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-5)


def test_a_non_contiguous_weight_is_left_alone():
    x, w = torch.randn(4, 8), torch.randn(8, 32).t()
    assert _rewrite(_linear, x, w)[1] == 0


def _decode_logits(fwd, ids):
    """The logits of the first decode step after a prefill, both through ``fwd``."""
    with torch.no_grad(), kvpass.constant_floats():
        out = fwd(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        return fwd(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True).logits


def test_a_compiled_batched_decode_is_rewritten_and_equals_eager(compiled_tiny):
    """Batches 3 then 5 (the second makes the batch symbolic): every linear of a batched decode graph
    (7 per layer and the LM head) is rewritten, the logits match eager's within fp32 rounding, and
    ``report()`` says so. Prompts of 24 tokens at batch 3 are the shapes of test_backend's beam search on
    the same shared model, whose graphs a worker that ran it reuses."""
    tiny = compiled_tiny()
    backend, fwd = tiny.forward(kvpass.Full())
    for batch in (3, 5):
        ids = prompt(24, batch=batch, seed=batch)
        torch.testing.assert_close(_decode_logits(fwd, ids), _decode_logits(tiny.model, ids), rtol=1e-4, atol=1e-4)
    batched = [r for r in backend.graphs if r.kind == "decode" and r.linears]
    assert batched and all(r.linears == 2 * 7 + 1 for r in batched)
    assert not any(r.linears for r in backend.graphs if r.kind != "decode")
    assert "linear(s) rewritten" in backend.report()


def test_a_compiled_one_row_decode_is_rewritten_and_equals_eager(compiled_tiny):
    """Batch 1 (dynamo specialises it): every linear of the decode graph becomes a reduction
    ``sum(W * x, 1)``, and the logits match eager's within fp32 rounding."""
    tiny = compiled_tiny()
    backend, fwd = tiny.forward(kvpass.Full())
    ids = prompt(24, batch=1, seed=11)
    torch.testing.assert_close(_decode_logits(fwd, ids), _decode_logits(tiny.model, ids), rtol=1e-4, atol=1e-4)
    decode = [r for r in backend.graphs if r.kind == "decode"]
    assert decode and all(r.linears == 2 * 7 + 1 for r in decode)


def test_the_option_is_a_checked_bool_and_part_of_the_graph_key():
    with pytest.raises(TypeError, match="skinny_linear"):
        kvpass.kvpass(kvpass.Full(), skinny_linear="no")
    a, b = kvpass.kvpass(kvpass.Full()), kvpass.kvpass(kvpass.Full(), skinny_linear=False)
    assert a._pass.uuid() != b._pass.uuid()
    assert a.skinny_linear and not b.skinny_linear


def test_the_count_travels_with_the_graph_record_of_a_warm_start(tmp_path, monkeypatch):
    """A cache hit skips the pass: the count is restored from the record kept beside Inductor's entry."""
    from kvpass.lowering import graph_cache
    from kvpass.lowering.graph_pass import GraphRecord

    monkeypatch.setattr(graph_cache, "_path", lambda key: tmp_path / f"{key}.json")
    graph_cache.save("k", [GraphRecord(index=0, kind="decode", sites=[], unmatched=[], linears=15)])
    backend = kvpass.kvpass(kvpass.Full())
    assert graph_cache.restore("k", backend)
    assert [r.linears for r in backend.graphs] == [15]
    assert "15 linear(s) rewritten in 1 decode graph(s)" in backend.report()

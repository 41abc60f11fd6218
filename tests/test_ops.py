"""The kvpass:: custom ops: schema, fake implementation and dispatch checked by torch.library.opcheck."""

import gc

import pytest
import torch

from kvpass import CentroidKV, ClusterKV, Full, Quest, StreamingLLM, kvpass


def _args(handle, b=1, hq=4, hkv=2, t=1, s=40, d=16, mask=False, static=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, t, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype)
    m = torch.ones(b, 1, t, s, dtype=torch.bool) if mask else None
    pos = torch.arange(s - t, s) if static else None
    return (q, k, v, m, pos, 0.0, t > 1, handle, 0)


@pytest.mark.parametrize("policy", [Full(), StreamingLLM(sinks=2, window=8), Quest(budget=16, page_size=4)])
@pytest.mark.parametrize("shape", [dict(t=1), dict(t=5), dict(t=1, mask=True), dict(t=1, static=True, hq=2, hkv=2),
                                   dict(t=1, b=2, hq=6, hkv=2, dtype=torch.float16)])
def test_opcheck_attention(policy, shape):
    be = kvpass(policy)
    args = _args(be.runtime.handle, **shape)
    if shape["t"] == 1:
        # decode needs a prefilled state: opcheck calls the op several times on the same inputs
        prefill = list(args)
        prefill[0] = torch.randn(args[0].shape[0], args[0].shape[1], 3, args[0].shape[3], dtype=args[0].dtype)
        prefill[1], prefill[2] = args[1][:, :, :-1], args[2][:, :, :-1]
        prefill[3], prefill[4], prefill[6] = None, None, True
        torch.ops.kvpass.attention(*prefill)
    torch.library.opcheck(torch.ops.kvpass.attention.default, args)


def test_op_output_matches_sdpa_for_full():
    be = kvpass(Full())
    q, k, v, *_ = _args(be.runtime.handle, t=6, s=6)
    out = torch.ops.kvpass.attention(q, k, v, None, None, 0.0, True, be.runtime.handle, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True)
    torch.testing.assert_close(out, ref)


def test_non_tensor_argument_is_a_clear_error():
    be = kvpass(Full())
    q, k, v, *_ = _args(be.runtime.handle)
    with pytest.raises((TypeError, RuntimeError), match="attention|Tensor|expected"):
        torch.ops.kvpass.attention([1.0], k, v, None, None, 0.0, False, be.runtime.handle, 0)


def test_dead_backend_is_a_clear_error_and_state_is_freed():
    be = kvpass(Full())
    handle = be.runtime.handle
    args = _args(handle, t=3, s=3)
    torch.ops.kvpass.attention(*args)
    del be
    gc.collect()
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.kvpass.attention(*args)


@pytest.mark.parametrize("policy", [Full(), CentroidKV(cache_ratio=0.5, sinks=2, recent=4, chunk=8, step=4),
                                    ClusterKV(budget=16, sinks=2, tokens_per_cluster=4, dense_layers=(), offload=True)])
def test_opcheck_owned_ops_and_fetch(policy):
    from kvpass.runtime.store import make_stub

    be = kvpass(policy)
    h = be.runtime.handle
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 30, 16, generator=g)
    k, v = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    # a prefill (no past): the op may be called repeatedly on the same inputs, each call restarts
    torch.library.opcheck(torch.ops.kvpass.attention_owned.default, (q, k, v, None, None, None, 0.0, True, h, 0))
    stub = torch.ops.kvpass.cache_stub(k, None)
    assert stub.shape == k.shape and stub.stride(2) == 0
    torch.library.opcheck(torch.ops.kvpass.cache_stub.default, (k, None))
    q1 = torch.randn(1, 4, 1, 16, generator=g)
    past = make_stub(k[:, :, :1], 30)
    torch.library.opcheck(torch.ops.kvpass.fetch.default, (q1, past, h, 0))
    ticket = torch.ops.kvpass.fetch(q1, past, h, 0)
    assert ticket.shape == (1,) and ticket.dtype == torch.int64
    out = torch.ops.kvpass.attention_owned(q1, k[:, :, :1], v[:, :, :1], past, past, None, 0.0, False, h, 0, ticket)
    assert out.shape == (1, 4, 1, 16) and torch.isfinite(out).all()

"""Driving one attention site by hand (no model): a prefill, then decode steps, and oracles for what
a selection policy attended."""

from __future__ import annotations

import torch

from kvpass.runtime import Runtime


def attend_oracle(q, k, v, sel, scale):
    """Softmax attention of each query head over its KV head's selected positions."""
    b_, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty(b_, hq, d, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            idx = sorted(sel[b, h // g])
            s = (k[b, h // g, idx].double() @ q[b, h].double()) * scale
            out[b, h] = torch.softmax(s, 0) @ v[b, h // g, idx].double()
    return out


def prefill_then_decode(policy, b=2, hkv=2, g=3, d=16, length=150, steps=3, seed=0, owned=False, rt=None,
                        keys=None, estimate=None, ops=True):
    """Drive one site: a prefill, then decode steps; the model's cache (owned=False) or the
    runtime's own store fed with stubs (owned=True), as the two rewrites do. ``rt``: a Runtime to
    use (to inspect its state afterwards); ``keys``: a callable ``(shape) -> keys`` for structured keys
    (default: standard normal); ``estimate``: ``q -> q_hat`` for a prefetching policy's
    ``kvpass::prefetch`` (default: the true query); ``ops``: a fetching policy's decode graph has its
    ``kvpass::fetch`` (and prefetch) ops, as on an accelerator, else (TailorKV on CPU) the attention fetches
    itself, after a prefetch only where an ``estimate`` is given. Returns ``[(q, k, v, out, idx)]`` per
    decode step."""
    from kvpass.runtime.store import make_stub

    torch.manual_seed(seed)
    rt = Runtime(policy) if rt is None else rt
    rt.info(0).fetch_in_attention = policy.fetches and not ops  # what the graph pass records
    make_keys = keys or torch.randn
    k = make_keys((b, hkv, length, d))
    v = torch.randn(b, hkv, length, d)
    q = torch.randn(b, hkv * g, length, d)
    if owned:
        rt.attend_owned(0, q, k, v, None, None, None, 0.0, True)
    else:
        rt.attend(0, q, k, v, None, None, 0.0, True)
    outs = []
    for _ in range(steps):
        kn, vn = make_keys((b, hkv, 1, d)), torch.randn(b, hkv, 1, d)
        q1 = torch.randn(b, hkv * g, 1, d)
        if owned:
            stub = make_stub(kn, k.shape[2])
            ticket = None
            if policy.prefetches and (ops or estimate is not None):  # what kvpass::prefetch does a layer early
                ticket = rt.prefetch(0, q1 if estimate is None else estimate(q1), stub, estimate is not None)
            if policy.fetches and ops:
                ticket = rt.fetch(0, q1, stub)  # what kvpass::fetch does first
            out = rt.attend_owned(0, q1, kn, vn, stub, stub, None, 0.0, False, ticket)
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        if not owned:
            out = rt.attend(0, q1, k, v, None, None, 0.0, False)
        outs.append((q1[:, :, 0], k, v, out[:, :, 0], rt.state(0).last_idx))
    return outs


def as_sets(idx):
    return {(b, h): {int(t) for t in idx[b, h] if t >= 0} for b in range(idx.shape[0]) for h in range(idx.shape[1])}

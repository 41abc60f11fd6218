"""TailorKV (arXiv 2505.19586) as a policy: validation, the profile and its calibration against the
definition computed from eager attention weights, sparse layers' selections against a plain oracle,
quantised layers against a hand-written 1-bit cache, the cross-layer query estimate against the
model's own modules, and end-to-end equality with Full when the budget covers the context."""

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpass import Full, KVPassError, TailorKV, kvpass
from kvpass.runtime import Runtime
from kvpass.tailorkv import Profile, calibrate, config_key, load_profile
from sites import as_sets, attend_oracle, prefill_then_decode
from tiny import generate, prompt, tiny_llama


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"quant_bits": 3}, "quant_bits 1 or 2"),
        ({"quant_bits": 1, "group_size": 12}, "multiple of 8 // quant_bits = 8"),
        ({"quant_bits": 2, "group_size": 6}, "multiple of 8 // quant_bits = 4"),
        ({"residual": 96}, "residual to be a multiple of group_size"),
        ({"residual": 32}, "residual >= 64"),
        ({"static_tokens": 16}, "static_tokens > sinks"),
        ({"sparse_budget": 128}, "sparse_budget > static_tokens"),
        ({"critical_channels": 0}, "critical_channels >= 1"),
        ({"tau": -0.1}, "tau >= 0"),
        ({"calib_topk": 0}, "0 < calib_topk <= 1"),
        ({"profile": 3}, "profile None, 'auto', a path"),
        ({"profile": "/nonexistent/p.json"}, "does not exist; make one with kvpass.tailorkv.calibrate"),
        ({"sparse_budget": 1024.0}, "integer sparse_budget"),
        ({"early_estimate": 1}, "early_estimate None, True or False"),
        ({"early_estimate": "yes"}, "early_estimate None, True or False"),
    ],
)
def test_bad_values_name_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        TailorKV(**kw)


def test_graph_key_and_budget():
    p = TailorKV()
    assert p.fetches and p.prefetches and p.topk == 1024 - 128
    assert p.graph_key() != Full().graph_key()
    # the estimate shapes the graph: policies that differ in it never share compiled graphs (set_policy)
    keys = {TailorKV(early_estimate=e).graph_key() for e in (None, True, False)}
    assert len(keys) == 3 and p.graph_key() == TailorKV(tau=0.3).graph_key()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    on = (p.fetches_on(cpu), p.prefetches_on(cpu), p.fetches_on(cuda), p.prefetches_on(cuda))
    assert on == (False, False, True, True)
    assert TailorKV(early_estimate=True).prefetches_on(cpu)
    assert not TailorKV(early_estimate=False).prefetches_on(cuda)
    assert TailorKV.with_budget(256).sparse_budget == 256
    assert len({TailorKV().key(), TailorKV(tau=0.3).key(), TailorKV(critical_channels=4).key()}) == 3


# -- the profile -------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    scores=st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=12),
    tau=st.floats(0, 1, allow_nan=False),
)
def test_profile_round_trips(tmp_path_factory, scores, tau):
    prof = Profile("abc123", "llama", tuple(enumerate(scores)), tau=tau, prompts=2, prompt_tokens=(10, 20))
    path = prof.save(tmp_path_factory.mktemp("p") / "p.json")
    back = Profile.load(path)
    assert back == prof
    assert back.quantised() == tuple(i for i, p in enumerate(scores) if p > tau)
    d = json.loads(path.read_text())
    assert [r["tier"] for r in d["layers"]] == ["quantised" if p > tau else "sparse" for p in scores]
    assert TailorKV(profile=str(path)).profile == prof


def test_profile_is_keyed_by_config_not_name(tmp_path):
    m = tiny_llama(layers=2)
    other = tiny_llama(layers=3)
    m.config._name_or_path = "somewhere/else"
    assert config_key(m.config) == config_key(tiny_llama(layers=2).config)
    assert config_key(m.config) != config_key(other.config)
    prof = Profile(config_key(other.config), "llama", ((0, 0.5), (1, 0.1), (2, 0.0)))
    prof.save(tmp_path / "p.json")
    with pytest.raises(KVPassError, match="calibrated for another config"):
        load_profile(tmp_path / "p.json", m)
    assert load_profile(tmp_path / "p.json", other) == prof
    with pytest.raises(KVPassError, match="has no layer 5"):
        prof.score(5)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(KVPassError, match="not a TailorKV profile"):
        Profile.load(tmp_path / "bad.json")


def _eager_dense_preference(model, ids, n_q, topk):
    """The definition, from the attention weights of the eager implementation: per layer, the mean
    over heads and the last n_q queries of 1 - (sum of the top ceil(topk * L) weights)."""
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            att = model(ids, output_attentions=True).attentions
    finally:
        model.config._attn_implementation = "sdpa"
    out = {}
    length = ids.shape[1]
    k = math.ceil(topk * length)
    for layer, a in enumerate(att):
        rows = a[0, :, length - n_q :].double()  # (H, n_q, L)
        out[layer] = float((1 - rows.topk(k, dim=-1).values.sum(-1)).mean())
    return out


def test_calibrate_matches_the_definition_from_eager_attention(tmp_path):
    m = tiny_llama(layers=3, seed=3)
    prompts = [prompt(96, seed=5), prompt(130, seed=6)]
    prof = calibrate(m, prompts, tmp_path / "prof.json", calib_queries=16, calib_topk=0.1)
    want = [_eager_dense_preference(m, p, 16, 0.1) for p in prompts]
    assert [i for i, _ in prof.scores] == [0, 1, 2]
    for layer, p in prof.scores:
        assert p == pytest.approx((want[0][layer] + want[1][layer]) / 2, abs=1e-4)
    assert prof.prompt_tokens == (96, 130) and prof.config_key == config_key(m.config)
    assert Profile.load(tmp_path / "prof.json") == prof
    text = prof.describe(tau=prof.scores[1][1])
    assert "quantised" in text or "sparse" in text


# -- sparse layers against an oracle ----------------------------------------------------------------
def _sparse_oracle(q_hat, q, k_past, policy):
    """Positions a sparse layer must attend for the query ``q (B, H_q, D)`` and estimate ``q_hat``,
    over the ``k_past (B, H_kv, L-1, D)`` cached before this step, computed with plain loops."""
    b_, hkv, past, d = k_past.shape
    length = past + 1
    g = q.shape[1] // hkv
    n_s = min(policy.sinks, past)
    n_r = min(policy.static_tokens - policy.sinks, length - n_s)
    mid = list(range(n_s, length - n_r))
    c = min(policy.critical_channels, d)
    sets = {}
    for b in range(b_):
        for h in range(hkv):
            chosen = set(range(n_s)) | set(range(length - n_r, length))
            if len(mid) <= policy.topk:
                chosen |= set(mid)
            else:
                kabs = [max(abs(float(k_past[b, h, t, i])) for t in range(past)) for i in range(d)]
                s = [sum(abs(float(q_hat[b, h * g + j, i])) for j in range(g)) * kabs[i] for i in range(d)]
                ch = sorted(sorted(range(d), key=lambda i: (-s[i], i))[:c])
                qs = [sum(float(q[b, h * g + j, i]) for j in range(g)) for i in range(d)]
                # the candidates are scored on the host tier's channel-major copy: bf16 for fp32 keys
                kc = k_past.bfloat16().float() if k_past.dtype == torch.float32 else k_past
                approx = {t: sum(qs[i] * float(kc[b, h, t, i]) for i in ch) for t in mid}
                chosen |= set(sorted(mid, key=lambda t: (-approx[t], t))[: policy.topk])
            sets[(b, h)] = chosen
    return sets


@pytest.mark.parametrize(
    "kw",
    [
        {"sparse_budget": 40, "static_tokens": 20, "sinks": 4, "critical_channels": 16},  # all channels
        {"sparse_budget": 40, "static_tokens": 20, "sinks": 4, "critical_channels": 3},
        {"sparse_budget": 64, "static_tokens": 9, "sinks": 8, "critical_channels": 5},
        {"sparse_budget": 400, "static_tokens": 20, "sinks": 4},  # covers the context: every token
    ],
)
@pytest.mark.parametrize("estimated", [False, True])
@pytest.mark.parametrize("path", ["c", "torch"])
@pytest.mark.parametrize("ops", [True, False], ids=["fetch-op", "fetch-in-attention"])
def test_sparse_layer_attends_the_oracles_tokens(kw, estimated, path, ops, monkeypatch):
    """Both CPU paths: the C kernels reading the host tier in place, and the torch ops that copy the
    device tier (what runs without a compiler, and the GPU path's logic); both decode graphs: with the
    prefetch and fetch ops (an accelerator's) and without them (CPU's: the attention fetches)."""
    from kvpass.kernels import tailorkv as kernels

    if path == "torch":
        monkeypatch.setattr(kernels, "cpu_select_available", lambda: False)
    policy = TailorKV(**kw)  # profile=None: every layer sparse
    noise = torch.Generator().manual_seed(9)
    hats = []

    def estimate(q):
        hats.append(q + 0.5 * torch.randn(q.shape, generator=noise))
        return hats[-1]

    rt = Runtime(policy)
    steps = prefill_then_decode(policy, length=120, steps=4, owned=True, rt=rt,
                                estimate=estimate if estimated else None, ops=ops)
    st_ = rt.state(0)
    for i, (q, k, v, out, idx) in enumerate(steps):
        q_hat = hats[i][:, :, 0] if estimated else q
        want = _sparse_oracle(q_hat, q, k[:, :, :-1], policy)
        assert as_sets(idx) == want
        n = len(next(iter(want.values())))
        assert all(len(s) == n for s in want.values()) and n == min(policy.sparse_budget, k.shape[2])
        ref = attend_oracle(q, k, v, {key: sorted(s) for key, s in want.items()}, 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    assert st_.tier == "sparse" and st_.host_bytes() > 0 and st_.bytes_moved > 0
    assert st_.in_c == (path == "c")
    if estimated:
        want_cos = sum(float(torch.nn.functional.cosine_similarity(h[:, :, 0], q_, dim=-1).mean())
                       for h, (q_, *_) in zip(hats, steps)) / len(steps)
        assert st_.estimate_cosine() == pytest.approx(want_cos, abs=1e-5)
    else:
        assert math.isnan(st_.estimate_cosine())


def test_sparse_layers_report_the_same_bytes_on_both_cpu_paths(monkeypatch):
    """The C path reads the host tier in place, yet reports the device tier and the bytes moved between
    tiers as the copying path does: what the method holds and moves on a GPU."""
    from kvpass.kernels import tailorkv as kernels

    policy = TailorKV(sparse_budget=40, static_tokens=20, sinks=4, critical_channels=3)
    got = []
    for path in ("c", "torch"):
        if path == "torch":
            monkeypatch.setattr(kernels, "cpu_select_available", lambda: False)
        rt = Runtime(policy)
        prefill_then_decode(policy, length=120, steps=3, owned=True, rt=rt)
        st_ = rt.state(0)
        assert st_.in_c == (path == "c")
        got.append((st_.kv_bytes, st_.bytes_moved, st_.prefetched, st_.host_bytes(), st_.selection_bytes()))
        # the last step scored every candidate (all but the static tokens) on 3 key channels, held in bf16
        b, h = st_.kT.shape[:2]
        assert st_.kT.dtype == torch.bfloat16
        assert st_.selection_bytes() == b * h * 3 * (st_.logical - policy.static_tokens) * 2
        assert rt.state(0).row()["selection_bytes"] == st_.selection_bytes()
    assert got[0] == got[1]


# -- quantised layers against a hand-written 1-bit cache -----------------------------------------------
def _quant_dequant(x, bits, group, axis):
    """Asymmetric quantise-dequantise by groups (fp16 scale and zero), written out in plain torch."""
    levels = (1 << bits) - 1
    xt = x if axis == "channel" else x.transpose(2, 3)  # groups along dim 2
    b, h, n, m = xt.shape
    xg = xt.float().reshape(b, h, n // group, group, m)
    lo, hi = xg.min(3, keepdim=True).values, xg.max(3, keepdim=True).values
    zero = lo.half().float()
    scale = ((hi - lo) / levels).half().float()
    code = torch.where(scale > 0, torch.floor((xg - zero) / torch.where(scale > 0, scale, 1) + 0.5), 0)
    out = (zero + code.clamp(0, levels) * scale).reshape(b, h, n, m)
    return (out if axis == "channel" else out.transpose(2, 3)).to(x.dtype)


@pytest.mark.parametrize("bits", [1, 2])
def test_quantised_layer_equals_attention_over_the_hand_quantised_cache(bits):
    policy = TailorKV(profile="auto", tau=-0.0, quant_bits=bits, group_size=16, residual=32)
    rt = Runtime(policy)
    # 150 prompt tokens: 128 quantised, 22 in the residual; 12 steps cross a flush at 160
    steps = prefill_then_decode(policy, length=150, steps=12, owned=True, rt=rt, d=16)
    st_ = rt.state(0)
    assert st_.tier == "quantised" and st_.packed.n == 160 and st_.n_res == 2
    for i, (q, k, v, out, _) in enumerate(steps):
        length = k.shape[2]
        n_q = 128 if length <= 160 else 160  # the flush happens after the step that fills the residual
        kk = torch.cat([_quant_dequant(k[:, :, :n_q], bits, 16, "channel"), k[:, :, n_q:]], 2)
        vv = torch.cat([_quant_dequant(v[:, :, :n_q], bits, 16, "token"), v[:, :, n_q:]], 2)
        every = {(b, h): list(range(length)) for b in range(k.shape[0]) for h in range(k.shape[1])}
        ref = attend_oracle(q, kk, vv, every, 1 / math.sqrt(q.shape[-1]))
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    if bits == 1:
        # 1-bit codes take only the two levels of their group
        kq, _ = st_.packed.views()
        from kvpass.kernels.tailorkv import dequantize

        deq = dequantize(kq).float().reshape(2, 2, 10, 16, 16)
        assert all(len(torch.unique(deq[b, h, gi, :, c])) <= 2 for b in range(2) for h in range(2)
                   for gi in range(10) for c in range(16))


def test_one_bit_layer_holds_a_tenth_of_fp16_with_scales():
    policy = TailorKV(profile="auto", tau=-0.0, quant_bits=1)
    rt = Runtime(policy)
    prefill_then_decode(policy, b=1, hkv=3, g=3, d=64, length=1024, steps=1, owned=True, rt=rt)
    st_ = rt.state(0)
    row = st_.row()
    assert row["tier"] == "quantised" and row["quant_ratio"] <= 0.1
    # 1024 tokens packed: 1 bit per element plus an fp16 scale and zero per 64 elements, K and V
    assert st_.packed.live_bytes() == 2 * 3 * 1024 * 64 * (1 / 8 + 4 / 64)
    # everything held is counted: the packed buffers (with room for decoding) and the fp32 residual
    res = 2 * 3 * 128 * 64 * 4
    assert row["device_bytes"] == st_.packed.nbytes() + res and row["host_bytes"] == 0
    assert row["device_bytes"] < 0.2 * 2 * 3 * 1025 * 64 * 4


# -- the model end to end --------------------------------------------------------------------------
# Tests on the same tiny model share its compile (conftest's compiled_tiny: TailorKV policies share a
# graph key and are swapped in with set_policy, every site afresh).
@pytest.mark.parametrize("dynamic", [None, True])
def test_estimated_query_equals_the_models_own_modules(dynamic):
    """q̂_l = RoPE(q_proj_l(norm_l(h_{l-1}))), computed from the eager model's hidden states (also in
    graphs compiled dynamic from the start, where Inductor's rewrites leave norm nodes without a
    module)."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m = tiny_llama(layers=3, seed=4)
    ids = prompt(150, seed=2)
    # a covering budget: attention is exact, so the eager model's hidden states are the compiled ones
    be = kvpass(TailorKV(sparse_budget=1024, static_tokens=32, sinks=4, early_estimate=True))
    f = torch.compile(m.forward, backend=be, dynamic=dynamic)
    cache = DynamicCache(config=m.config)
    seq = ids
    with torch.no_grad():
        logits = f(ids, past_key_values=cache, use_cache=True).logits
        for _ in range(3):
            tok = logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, tok], 1)
            logits = f(tok, past_key_values=cache, use_cache=True).logits
        hs = m(seq, output_hidden_states=True).hidden_states  # hs[i]: the input of layer i
    pos = torch.tensor([[seq.shape[1] - 1]])
    layers = m.model.layers
    for layer in (1, 2):
        h = hs[layer - 1][:, -1:]
        attn = layers[layer].self_attn
        q = attn.q_proj(layers[layer].input_layernorm(h)).view(1, 1, -1, attn.head_dim).transpose(1, 2)
        cos, sin = m.model.rotary_emb(h, pos)
        q_hat, _ = apply_rotary_pos_emb(q, q, cos, sin)
        got = be.runtime.state(layer).q_hat[:, :, 0]  # kept as the op received it, (B, H_q, 1, D)
        torch.testing.assert_close(got, q_hat[:, :, 0].detach(), atol=1e-5, rtol=1e-5)
    assert [r["estimate"] for r in be.report_rows()] == ["none (first site: no earlier layer)", "layer 0", "layer 1"]


def test_adopted_cache_continues_like_the_compiled_prefill(compiled_tiny):
    from transformers import DynamicCache

    ct = compiled_tiny(layers=2, seed=1)
    m = ct.model
    ids = prompt(160, seed=3)
    pol = TailorKV(sparse_budget=64, static_tokens=24, sinks=4)
    outs = []
    for adopt in (False, True):
        _, f = ct.forward(pol, strict=False)  # every site afresh: the adopting run has seen no prefill
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            logits = (m if adopt else f)(ids, past_key_values=cache, use_cache=True).logits
            toks = []
            for _ in range(4):
                tok = logits[:, -1:].argmax(-1)
                toks.append(tok)
                logits = f(tok, past_key_values=cache, use_cache=True).logits
        outs.append((torch.cat(toks, 1), logits))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


def test_second_turn_chunk_continues_the_cache(compiled_tiny):
    from transformers import DynamicCache

    ct = compiled_tiny(layers=2, seed=1)
    m = ct.model
    ids, more = prompt(100, seed=3), prompt(7, seed=4)
    be, f = ct.forward(TailorKV(sparse_budget=1024, static_tokens=64), strict=False)
    cache, ref_cache = DynamicCache(config=m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        f(ids, past_key_values=cache, use_cache=True)
        got = f(more, past_key_values=cache, use_cache=True).logits
        m(ids, past_key_values=ref_cache, use_cache=True)
        want = m(more, past_key_values=ref_cache, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert be.runtime.state(0).logical == 107


def test_refusals_name_the_fix():
    m = tiny_llama(layers=2)
    ids = prompt(40)
    with pytest.raises(Exception, match="needs the runtime to own the cache|StaticCache"):
        generate(m, ids, new_tokens=2, backend=kvpass(TailorKV()), cache_implementation="static")


# -- beam search: the state follows the batch reordering ---------------------------------------------
def _row_tensors(st) -> dict:
    """Every per-row tensor a site holds (the live part), by name: the host tier, the device tier (none on
    the CPU's in-place path) and the channel maxima of a sparse layer; the packed codes, scales, zeros and
    residual of a quantised one."""
    if st.tier == "quantised":
        kq, vq = st.packed.views()
        out = {f"k{n}": getattr(kq, n) for n in ("packed", "scale", "zero")}
        out.update({f"v{n}": getattr(vq, n) for n in ("packed", "scale", "zero")})
        out.update(res_k=st.res_k[:, :, : st.n_res], res_v=st.res_v[:, :, : st.n_res])
    else:
        hk, hv = st.store.views()
        out = {"host_k": hk, "host_v": hv, "kT": st.kT[..., : st.store.length], "sink_k": st.sink_k,
               "sink_v": st.sink_v, "rec_k": st.rec_k, "rec_v": st.rec_v, "kabs": st.kabs}
    return {name: t.clone() for name, t in out.items() if t is not None}


def _assert_rows_equal(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{where}: {name}"


def _site_step(rt, q, kn, vn, q_hat, stub):
    """One decode step of site 0 as a decode graph runs it: prefetch, fetch, attention."""
    ticket = rt.fetch(0, q, stub) if rt.prefetch(0, q_hat, stub, True) is not None else None
    return rt.attend_owned(0, q, kn, vn, stub, stub, None, 0.0, False, ticket)[:, :, 0]


@pytest.mark.parametrize("rows", [[1, 0], [1, 1, 0], [0, 0, 0, 1, 1, 1]])
@pytest.mark.parametrize("tier", ["sparse", "quantised"])
def test_reordered_site_equals_a_site_fed_each_rows_history(tier, rows):
    """One site, batch 2: a prefill, a decode step, then the stub comes back reordered or expanded
    (``rows``, as beam search's index_select gives it), later permuted again; each step prefetches with
    an estimated query. Every output, selection and per-row tensor equals that of a site which never
    saw a reorder, fed each final row's own history (its prompt, its tokens and queries)."""
    from kvpass.runtime.store import make_stub

    if tier == "sparse":
        pol = TailorKV(sparse_budget=40, static_tokens=12, sinks=4, critical_channels=3)
    else:  # every layer quantised (2 bits); 22 tokens in the residual, flushed at the 10th step (after both reorders)
        pol = TailorKV(profile="auto", tau=-0.0, group_size=16, residual=32)
    b, hkv, g, d, length, n, steps, again = 2, 2, 3, 16, 150, len(rows), 11, 5
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    def inputs(bb):  # q, k, v, q_hat of one decode step
        q = rnd(bb, hkv * g, 1, d)
        return q, rnd(bb, hkv, 1, d), rnd(bb, hkv, 1, d), q + 0.5 * rnd(bb, hkv * g, 1, d)

    prefill = (rnd(b, hkv * g, length, d), rnd(b, hkv, length, d), rnd(b, hkv, length, d))
    first = inputs(b)
    later = [inputs(n) for _ in range(steps)]
    r = torch.tensor(rows)
    p2 = torch.roll(torch.arange(n), 1)  # the second reorder, before later step `again`

    a = Runtime(pol)
    a.attend_owned(0, *prefill, None, None, None, 0.0, True)
    _site_step(a, *first, make_stub(first[1], length))
    outs_a = []
    for j, x in enumerate(later):
        stub = make_stub(torch.empty(b if j == 0 else n, hkv, 1, d), length + 1 + j)
        if j == 0:
            stub = stub.index_select(0, r)
        elif j == again:
            stub = stub.index_select(0, p2)
        outs_a.append((_site_step(a, *x, stub), a.state(0).last_idx))

    # site b holds, from the start, the rows in their final order: row i is a's row p2[i] before the
    # second reorder, which was row r[p2[i]] of the prefill
    src = r[p2]
    bb = Runtime(pol)
    bb.attend_owned(0, *(t[src] for t in prefill), None, None, None, 0.0, True)
    _site_step(bb, *(t[src] for t in first), make_stub(first[1][src], length))
    for j, x in enumerate(later):
        x = tuple(t[p2] for t in x) if j < again else x
        out = _site_step(bb, *x, make_stub(x[1], length + 1 + j))
        got, idx = outs_a[j]
        if j < again:
            got, idx = got[p2], None if idx is None else idx[p2]
        torch.testing.assert_close(got, out, atol=1e-6, rtol=1e-6, msg=lambda m, j=j: f"step {j}: {m}")
        if tier == "sparse":
            assert as_sets(idx) == as_sets(bb.state(0).last_idx), f"step {j}"
    sa, sb = a.state(0), bb.state(0)
    assert sa.tier == sb.tier == tier and sa.events >= 2
    if tier == "quantised":
        assert sa.packed.n == 160 and sa.packed.b == n
    else:
        assert sa.tokens_attended() == 40
    _assert_rows_equal(_row_tensors(sa), _row_tensors(sb), tier)


# (next to the beam-search tests of the same two models: consecutive, they reuse the graphs)
@pytest.mark.parametrize("early", [True, None])
def test_covering_budget_all_sparse_equals_eager(compiled_tiny, early):
    """Both CPU decode graphs: the estimate's (prefetch ops) and the default's (the attention fetches)."""
    ct = compiled_tiny(layers=3)
    ids = prompt(200)
    ref = generate(ct.model, ids, new_tokens=8)
    out, be = ct.generate(TailorKV(sparse_budget=1024, static_tokens=64, early_estimate=early), ids,
                          new_tokens=8, strict=False)
    assert torch.equal(out, ref)
    rows = be.report_rows()
    assert [r["tier"] for r in rows] == ["sparse"] * 3
    if early:
        assert rows[0]["estimate"].startswith("none (first site")
        assert [r["estimate"] for r in rows[1:]] == ["layer 0", "layer 1"]
    else:
        assert all(r["estimate"].startswith("none (on cpu the true query") for r in rows)
    assert all(r["host_bytes"] > 0 for r in rows)


def test_default_cpu_decode_graph_has_no_fetch_or_prefetch_op_and_selects_by_the_true_query():
    """On CPU TailorKV's attention op fetches (no kvpass::fetch or kvpass::prefetch, no second q
    projection in the graph); each step's selection is the oracle's from the site's true query, which a
    probe sees."""
    from torch._dynamo.utils import counters

    m = tiny_llama(layers=3, seed=4)
    ids = prompt(150, seed=2)
    policy = TailorKV(sparse_budget=48, static_tokens=16, sinks=4, critical_channels=3)
    be = kvpass(policy)
    seen = []

    def probe(state, call, idx):
        if call.q.shape[2] == 1:
            seen.append((state.info.site, call.q[:, :, 0].clone(), call.k[:, :, : call.length - 1].clone(),
                         idx.clone()))

    be.runtime.set_probe(probe)
    counters.clear()
    torch._dynamo.reset()
    generate(m, ids, new_tokens=4, backend=be)
    assert counters["kvpass"]["sites_rewritten"] > 0 and counters["kvpass"]["caches_owned"] > 0
    assert counters["kvpass"]["fetches_inserted"] == 0 and counters["kvpass"]["prefetches_inserted"] == 0
    assert counters["kvpass"]["queries_estimated"] == 0
    assert len(be.runtime.infos) == 3 and all(i.fetch_in_attention for i in be.runtime.infos.values())
    assert all(st.in_c for st in be.runtime.sites.values())  # the C path (fp32 queries)
    assert len(seen) == 3 * 3  # three decode steps (the fourth token comes from the prefill), three sites
    for site, q, k_past, idx in seen:
        assert as_sets(idx) == _sparse_oracle(q, q, k_past, policy), f"site {site}"
    assert all(math.isnan(r["estimate_cos"]) for r in be.report_rows())


def test_compressing_run_reports_tiers_traffic_and_estimate(compiled_tiny):
    ct = compiled_tiny(layers=3, seed=2)
    ids = prompt(300)
    prof = Profile(config_key(ct.model.config), "llama", ((0, 0.9), (1, 0.1), (2, 0.05)))
    pol = TailorKV(profile=prof, sparse_budget=96, static_tokens=32, group_size=16, residual=32, early_estimate=True)
    out, be = ct.generate(pol, ids, new_tokens=6, strict=False)
    assert out.shape == (1, 306)
    rows = be.report_rows()
    assert [r["tier"] for r in rows] == ["quantised", "sparse", "sparse"]
    # codes of quant_bits per element plus an fp16 scale and zero per group of 16, over fp16's 2 bytes
    assert rows[0]["host_bytes"] == 0 and rows[0]["quant_ratio"] == pytest.approx((pol.quant_bits / 8 + 4 / 16) / 2)
    for r in rows[1:]:
        assert r["tokens_attended"] == 96 and r["bytes_moved"] > 0
        assert 0.5 < r["estimate_cos"] <= 1.0  # adjacent layers' residual streams are similar
    assert "estimate" in be.report() or rows


def test_decoding_past_the_stores_first_capacity(compiled_tiny):
    # a prefill reserves its length + 256 slots (whole pages of 64); the step that outgrows them runs its
    # fetch before the attention appends the new token (and grows the store and the channel-major keys):
    # the selection then lists a recent position that the keys do not hold yet, as every step does
    ct = compiled_tiny(layers=3, seed=2)
    ids = prompt(100)
    prof = Profile(config_key(ct.model.config), "llama", ((0, 0.9), (1, 0.1), (2, 0.05)))
    pol = TailorKV(profile=prof, sparse_budget=96, static_tokens=32, group_size=16, residual=32)
    out, be = ct.generate(pol, ids, new_tokens=300, strict=False)  # 400 tokens: past 100 + 256 -> 384
    assert out.shape == (1, 400)
    rows = be.report_rows()
    assert [r["tier"] for r in rows] == ["quantised", "sparse", "sparse"]
    assert all(r["tokens_attended"] == 96 for r in rows[1:])


# one prompt x 3 beams, and 2 prompts x 2 beams; each test runs one of them in `make test`, both in
# `make test-all`
SLOW = pytest.mark.slow
BEAMS_COVERING = [(1, 3), pytest.param(2, 2, marks=SLOW)]
BEAMS_COMPRESSING = [pytest.param(1, 3, marks=SLOW), (2, 2)]


@pytest.mark.parametrize("prompts, beams", BEAMS_COVERING)
def test_beam_search_with_a_covering_budget_equals_eager(compiled_tiny, prompts, beams):
    """Every layer sparse (no quantisation) and a budget covering the context: each beam attends
    every token it holds, from the host tier the beam reordering moved, so generate() equals eager
    beam search token for token."""
    ct = compiled_tiny(layers=3)
    ids = prompt(120, batch=prompts, seed=3)
    kw = {"num_beams": beams, "num_return_sequences": beams}
    ref = generate(ct.model, ids, new_tokens=6, **kw)
    out, be = ct.generate(TailorKV(sparse_budget=1024, static_tokens=64, sinks=4), ids, new_tokens=6,
                          strict=False, **kw)
    assert torch.equal(out, ref)
    assert [r["tier"] for r in be.report_rows()] == ["sparse"] * 3
    assert all(st.events >= 1 for st in be.runtime.sites.values())  # the reorders were followed


class _Recorder:
    """A logits processor that keeps, at each beam-search step, the running sequences (each row's
    whole token history, in the batch order of the forward that just ran) and their log-probs."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append((input_ids.clone(), scores.clone()))
        return scores


class _Forced:
    """A logits processor that makes greedy generate() feed row b the tokens ``histories[b]`` (no
    reordering) and keeps the log-probs of the forward that saw the whole history."""

    def __init__(self, histories):
        self.histories, self.scores = histories, None

    def __call__(self, input_ids, scores):
        n = input_ids.shape[1]
        if n == self.histories.shape[1]:
            self.scores = torch.log_softmax(scores.float(), -1)
            return scores
        forced = torch.full_like(scores, -math.inf)
        forced[torch.arange(len(forced)), self.histories[:, n]] = 0
        return forced


def _teacher_forced(ct, pol, histories, prompt_len):
    """The log-probs (B, V) of ``histories`` run under ``pol`` through the compile ``ct`` as a batch
    that is never reordered: a prefill of the first ``prompt_len`` tokens, then each row's own tokens
    one step at a time (greedy generate, which calls the model as beam search does: the same compiled
    graphs)."""
    from transformers import LogitsProcessorList

    forced = _Forced(histories)
    out, _ = ct.generate(pol, histories[:, :prompt_len], new_tokens=histories.shape[1] - prompt_len + 1,
                         strict=False, logits_processor=LogitsProcessorList([forced]))
    assert torch.equal(out[:, :-1], histories)
    return forced.scores


@pytest.mark.parametrize("prompts, beams", BEAMS_COMPRESSING)
def test_beam_search_compressing_equals_runs_without_reordering(compiled_tiny, prompts, beams):
    """A compressing TailorKV (a 2-bit layer whose residual flushes after the reorders, two sparse
    layers scoring 3 of 16 channels with the estimated query, 48 of ~160 tokens attended, 2 recent
    ones, so that the beams' own tokens, the only ones that tell them apart, soon become candidates
    for the top-k): at every
    beam-search step, the log-probs of each running beam equal those of a run of the same policy that
    is fed that beam's token history with no reordering at all, and after the last step every per-row
    tensor of every layer (host tier, device tier, channel maxima, packed cache, residual) equals that
    run's. So each row's state is the state of its own history, whatever the beams did."""
    ct = compiled_tiny(layers=3, seed=2)
    prompt_len = 156  # 128 tokens packed, 28 in the residual: the flush comes at the 4th decode step
    ids = prompt(prompt_len, batch=prompts, seed=4)
    prof = Profile(config_key(ct.model.config), "llama", ((0, 0.9), (1, 0.1), (2, 0.05)))
    pol = TailorKV(profile=prof, quant_bits=2, sparse_budget=48, static_tokens=6, sinks=4,
                   critical_channels=3, group_size=16, residual=32)
    from transformers import LogitsProcessorList

    rec = _Recorder()
    _, be = ct.generate(pol, ids, new_tokens=8, strict=False, num_beams=beams, num_return_sequences=beams,
                        logits_processor=LogitsProcessorList([rec]))
    states = [be.runtime.state(i) for i in range(3)]
    assert [st.tier for st in states] == ["quantised", "sparse", "sparse"]
    assert states[0].packed.n == 160 and all(st.events >= 1 for st in states[1:])
    assert all(st.tokens_attended() == 48 for st in states[1:])
    beam_rows = [_row_tensors(st) for st in states]
    histories = [h for h, _ in rec.steps]
    # the beams did reorder: some step's histories are not the previous step's extended row by row
    assert any(not torch.equal(a, b[:, : a.shape[1]]) for a, b in itertools.pairwise(histories))

    for i, (hist, scores) in enumerate(rec.steps):  # each prefill starts the sites afresh
        want = _teacher_forced(ct, pol, hist, prompt_len)
        torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5, msg=lambda s, i=i: f"step {i}: {s}")
    for layer in range(3):
        _assert_rows_equal(beam_rows[layer], _row_tensors(be.runtime.state(layer)), f"layer {layer}")

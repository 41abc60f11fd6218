"""The pass finds every attention site in real HF graphs (tiny random Llama, transformers as installed)."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kvpass import Full, KVPassError, kvpass
from kvpass.patterns.attention import layer_of, module_path
from tiny import generate, prompt, tiny_llama


@pytest.fixture(autouse=True)
def _clear_counters():
    counters.clear()
    yield


# static: `make test-all`; in `make test` tests/test_families.py checks every layer of the Llama family's
# static-cache graphs (P2 in prefill and decode, one call per step at every site)
@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
def test_every_layer_matched_in_prefill_and_decode(cache):
    model = tiny_llama(layers=3)
    be = kvpass(Full(), strict=True)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    generate(model, prompt(12), new_tokens=4, backend=be, **kw)
    kinds = [g.kind for g in be.graphs]
    assert "prefill" in kinds and "decode" in kinds, kinds
    for g in be.graphs:
        assert not g.unmatched
        assert sorted(r["layer"] for r in g.sites) == [0, 1, 2], g
        assert all(r["module"] == f"model.layers.{r['layer']}.self_attn" for r in g.sites)
    # one rewrite per layer per compiled graph
    assert counters["kvpass"]["sites_rewritten"] == 3 * len(be.graphs)
    decode_patterns = {r["pattern"].split()[0] for g in be.graphs if g.kind == "decode" for r in g.sites}
    assert decode_patterns == ({"P1"} if cache == "dynamic" else {"P2"})
    # every site ran prefill once and then decoded
    rows = be.report_rows()
    assert [r["layer"] for r in rows] == [0, 1, 2]
    assert all(r["prefill_calls"] == 1 and r["decode_calls"] == 3 for r in rows)


def test_layer_from_module_path():
    assert layer_of("model.layers.12.self_attn") == 12
    assert layer_of("transformer.h.3.attn") == 3
    assert layer_of("gpt_neox.layers.0.attention") == 0
    assert layer_of("attn") is None


def test_module_path_normalised():
    class N:
        meta = {"nn_module_stack": {"a": ("L['self'].model.layers[4].self_attn", object)}}

    assert module_path(N()) == "model.layers.4.self_attn"


class NoCacheAttention(torch.nn.Module):
    """SDPA with no KV cache: the pass must leave it alone and say why."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 96)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.proj(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_without_cache_is_left_exact_and_reported():
    mod = NoCacheAttention().eval()
    x = torch.randn(1, 5, 32)
    be = kvpass(Full())
    with pytest.warns(UserWarning, match="left exact"), torch.no_grad():
        out = torch.compile(mod, backend=be)(x)
    torch.testing.assert_close(out, mod(x))
    assert counters["kvpass"]["sites_rewritten"] == 0
    (row,) = be.report_rows()
    assert row["pattern"] == "left exact" and "no KV-cache update" in row["reason"]
    assert "left exact" in be.report()


def _inner(exc: BaseException) -> BaseException:
    """dynamo wraps a backend's exception in BackendCompilerFailed."""
    return getattr(exc, "inner_exception", exc)


def test_strict_raises_on_unmatched_site():
    with pytest.raises(Exception, match="left exact") as info, torch.no_grad():
        torch.compile(NoCacheAttention(), backend=kvpass(Full(), strict=True))(torch.randn(1, 5, 32))
    assert isinstance(_inner(info.value), KVPassError)


def test_eager_attention_implementation_is_reported():
    model = tiny_llama(layers=2, attn_implementation="eager")
    ids = prompt(8)
    ref = generate(model, ids, new_tokens=3)
    be = kvpass(Full())
    with pytest.warns(UserWarning, match="attn_implementation='sdpa'"):
        out = generate(model, ids, new_tokens=3, backend=be)
    assert torch.equal(out, ref)  # left exact
    assert counters["kvpass"]["sites_rewritten"] == 0
    torch._dynamo.reset()
    with pytest.raises(Exception, match="attn_implementation='sdpa'") as info:
        generate(model, ids, new_tokens=3, backend=kvpass(Full(), strict=True))
    assert isinstance(_inner(info.value), KVPassError)


def _synthetic_graph(target, with_getitem=True):
    """cat-updated cache feeding one SDPA flavour, built by hand with meta-tensor values: the CUDA
    variants cannot be traced on this CPU-only machine, but the matcher only reads node metadata."""
    import operator

    aten = torch.ops.aten
    g = torch.fx.Graph()

    def ph(name, *shape):
        n = g.placeholder(name)
        n.meta["val"] = torch.empty(*shape, device="meta")
        return n

    q = ph("q", 1, 4, 1, 16)
    pk, nk, pv, nv = ph("pk", 1, 2, 7, 16), ph("nk", 1, 2, 1, 16), ph("pv", 1, 2, 7, 16), ph("nv", 1, 2, 1, 16)
    ck = g.call_function(aten.cat.default, ([pk, nk], -2))
    cv = g.call_function(aten.cat.default, ([pv, nv], -2))
    ck.meta["val"] = cv.meta["val"] = torch.empty(1, 2, 8, 16, device="meta")
    names = [a.name for a in target._schema.arguments]
    args = [q, ck, cv] + [None] * (len(names) - 3)
    kwargs = {}
    for i, name in enumerate(names):
        if name in ("attn_bias", "attn_mask"):
            args[i] = None
        elif name == "dropout_p":
            args[i] = 0.0
        elif name in ("is_causal", "compute_log_sumexp", "return_debug_mask"):
            args[i] = False
        elif name == "scale":
            args[i] = None
        elif name == "enable_gqa":
            args[i] = True
    while args and args[-1] is None and names[len(args) - 1] not in ("attn_bias",):
        args.pop()
    sdpa = g.call_function(target, tuple(args), kwargs)
    sdpa.meta["nn_module_stack"] = {"x": ("L['self'].model.layers[5].self_attn", object)}
    out = g.call_function(operator.getitem, (sdpa, 0)) if with_getitem else sdpa
    out.meta["val"] = torch.empty(1, 4, 1, 16, device="meta")
    g.output((ck, cv, out))
    return g


@pytest.mark.parametrize("name", ["sdpa_flash_cpu", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa"])
def test_every_sdpa_flavour_is_matched(name):
    from kvpass.patterns.attention import SDPA_TARGETS, find_sites

    target = next(t for t, n in SDPA_TARGETS.items() if n == name)
    sites, unmatched = find_sites(_synthetic_graph(target, with_getitem=name != "sdpa"))
    assert not unmatched
    (site,) = sites
    assert site.layer == 5 and site.pattern.startswith("P1 cat") and site.own is not None


def test_sliding_window_layer_is_left_exact_with_reason():
    from kvpass.patterns.attention import SDPA_TARGETS, find_sites

    target = next(t for t, n in SDPA_TARGETS.items() if n == "sdpa_flash_cpu")
    g = _synthetic_graph(target)
    aten = torch.ops.aten
    out = next(n for n in g.nodes if n.op == "output")
    ck, cv, res = out.args[0]
    with g.inserting_before(out):
        kept = [g.call_function(aten.slice.Tensor, (c, 2, -4, 9223372036854775807)) for c in (ck, cv)]
    out.args = ((kept[0], kept[1], res),)
    sites, unmatched = find_sites(g)
    assert not sites
    assert "sliding-window" in unmatched[0].reason and unmatched[0].layer == 5


# -- graph shapes found in other decoder families (kvpass.coverage runs them end to end) --------------
def _graph_with(build):
    """A post-grad-like graph: ``build(g, ph, call)`` returns (q, k, v, extra outputs); SDPA sits in
    ``model.layers.3.self_attn``."""
    g = torch.fx.Graph()

    def ph(name, *shape, dtype=torch.float32):
        n = g.placeholder(name)
        n.meta["val"] = torch.empty(*shape, device="meta", dtype=dtype)
        return n

    def call(target, *args, like=None):
        n = g.call_function(target, args)
        vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        n.meta["val"] = like if like is not None else target(*vals)
        return n

    q, k, v, outs = build(g, ph, call)
    sdpa = call(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, False,
                like=None)
    sdpa.meta["nn_module_stack"] = {"x": ("L['self'].model.layers[3].self_attn", object)}
    import operator

    out = g.call_function(operator.getitem, (sdpa, 0))
    out.meta["val"] = torch.empty(q.meta["val"].shape, device="meta")
    g.output((*outs, out))
    return g


def test_partial_rotary_cat_and_contiguous_copy_are_new_keys():
    """GPT-NeoX builds its keys with cat([rotated, passed], dim=-1) and Phi-3 returns a contiguous
    copy of its values: both are the new keys/values kept by the cache (P3), not cache updates."""
    from kvpass.patterns.attention import find_sites

    aten = torch.ops.aten

    def build(g, ph, call):
        q, pv = ph("q", 1, 4, 5, 16), ph("v", 1, 4, 5, 16)
        rot, rest = ph("rot", 1, 4, 5, 4), ph("rest", 1, 4, 5, 12)
        k = call(aten.cat.default, [rot, rest], -1)
        v = call(aten.clone.default, pv)
        return q, k, v, (k, v)

    sites, unmatched = find_sites(_graph_with(build))
    assert not unmatched
    (site,) = sites
    assert site.pattern.startswith("P3") and site.layer == 3 and site.own is not None
    assert site.k.target is aten.cat.default and site.v.target is aten.clone.default


@pytest.mark.parametrize("buffer", ["graph input", "allocated in the graph"])
def test_static_cache_write_into_its_buffer_is_p2(buffer):
    from kvpass.patterns.attention import find_sites

    aten = torch.ops.aten

    def build(g, ph, call):
        q, kn, vn = ph("q", 1, 4, 1, 16), ph("kn", 1, 4, 1, 16), ph("vn", 1, 4, 1, 16)
        pos = ph("pos", 1, dtype=torch.int64)
        if buffer == "graph input":
            kb, vb = ph("kb", 1, 4, 8, 16), ph("vb", 1, 4, 8, 16)
        else:  # lazy initialisation at prefill: zeros made inside the graph
            kb, vb = (call(aten.full.default, [1, 4, 8, 16], 0.0) for _ in range(2))
        k = call(aten.index_put.default, kb, [None, None, pos], kn)
        v = call(aten.index_put.default, vb, [None, None, pos], vn)
        return q, k, v, (k, v)

    sites, unmatched = find_sites(_graph_with(build))
    assert not unmatched and [s.pattern.split()[0] for s in sites] == ["P2"]


def test_rolled_static_sliding_buffer_is_left_exact():
    """transformers' StaticSlidingWindowLayer, once full, rolls its buffer and writes at slot -1: its
    slots are no longer positions, so the site is left exact with the reason."""
    from kvpass.patterns.attention import find_sites

    aten = torch.ops.aten

    def build(g, ph, call):
        q, kn, vn = ph("q", 1, 4, 1, 16), ph("kn", 1, 4, 1, 16), ph("vn", 1, 4, 1, 16)
        kb, vb = ph("kb", 1, 4, 8, 16), ph("vb", 1, 4, 8, 16)
        order = ph("order", 8, dtype=torch.int64)  # (arange(8) + 1) % 8
        last = call(aten.full.default, [1], -1, like=torch.empty(1, device="meta", dtype=torch.int64))
        rolled = [call(aten.index.Tensor, b, [None, None, order]) for b in (kb, vb)]
        k = call(aten.index_put.default, rolled[0], [None, None, last], kn)
        v = call(aten.index_put.default, rolled[1], [None, None, last], vn)
        return q, k, v, (k, v)

    sites, unmatched = find_sites(_graph_with(build))
    assert not sites
    assert "sliding-window" in unmatched[0].reason and "rolled" in unmatched[0].reason


def test_sliding_window_prefill_is_left_exact_with_reason():
    """A sliding-window layer's prefill attends to the whole prompt and keeps only x[:, :, -W:]."""
    from kvpass.patterns.attention import find_sites

    aten = torch.ops.aten

    def build(g, ph, call):
        q, k, v = ph("q", 1, 4, 12, 16), ph("k", 1, 4, 12, 16), ph("v", 1, 4, 12, 16)
        kept = [call(aten.slice.Tensor, t, 2, -7, 9223372036854775807) for t in (k, v)]
        return q, k, v, kept

    sites, unmatched = find_sites(_graph_with(build))
    assert not sites and "sliding-window" in unmatched[0].reason


def test_site_without_a_layer_in_its_path_is_left_exact():
    """A graph compiled for one decoder layer on its own (a graph break) may run for every layer: a site
    id baked into it would be shared, so the pass leaves it exact and says why."""
    from kvpass.patterns.attention import SDPA_TARGETS, find_sites

    target = next(t for t, n in SDPA_TARGETS.items() if n == "sdpa_flash_cpu")
    g = _synthetic_graph(target)
    sdpa = next(n for n in g.nodes if n.target is target)
    sdpa.meta["nn_module_stack"] = {"x": ("L['self'].self_attn", object)}
    sites, unmatched = find_sites(g)
    assert not sites and "names no layer" in unmatched[0].reason and "graph break" in unmatched[0].reason

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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
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

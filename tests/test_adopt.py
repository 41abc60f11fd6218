"""backend.adopt(cache): a prefilled cache handed over before the first step decodes as without it, from
one decode graph instead of two, and every misuse of its stubs is loud."""

from __future__ import annotations

import pytest
import torch

from kvpass import Full, KVPassError, Quest, constant_floats, kvpass
from kvpass.bench.timing import cache_from
from tiny import prompt, tiny_llama

NEW = 6


def _mask(ids):
    """Row 0 whole, the others left-padded with token 0."""
    mask = (ids != 0).long()
    mask[0] = 1
    return mask


def _prefill(model, ids):
    """The eager prefill of all but the last token: [(k, v)] per layer."""
    with torch.no_grad():
        past = model(ids[:, :-1], attention_mask=_mask(ids)[:, :-1], use_cache=True).past_key_values
    return [(layer.keys.clone(), layer.values.clone()) for layer in past.layers]


def _decode(model, fwd, ids, kv, adopt=None, keep=None):
    """Greedy tokens after ``ids`` from a copy of ``kv`` through ``fwd`` (``adopt``: the backend that
    adopts the cache first). ``keep``: a list the cache is appended to, so that the backend's state of the
    sequence outlives the call (kvpass frees it with the model's cache)."""
    cache = cache_from(model, [(k.clone(), v.clone()) for k, v in kv])
    if keep is not None:
        keep.append(cache)
    f0 = model.forward
    model.forward = fwd
    try:
        with torch.inference_mode(), constant_floats():  # as kvpass demo runs
            if adopt is not None:
                assert adopt.adopt(cache) is cache
            return model.generate(ids, attention_mask=_mask(ids), past_key_values=cache,
                                  max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    finally:
        model.forward = f0


@pytest.fixture(scope="module")
def adopted():
    """A tiny Llama, the prefill of a left-padded batch (row 1 has 30 pad tokens: Quest serves it row by
    row), and for Quest (budget under the context) a backend that decodes the prefilled cache as the
    first step finds it and one that adopts it first (each compiled on its own)."""
    torch._dynamo.reset()
    model, ids = tiny_llama(pad_token_id=0), prompt(100, batch=2)
    ids[1, :30] = 0
    kv = _prefill(model, ids)
    policy = Quest(budget=32, page_size=8)
    plain, adopting = kvpass(policy, strict=True), kvpass(policy, strict=True)
    fwd_plain = torch.compile(model.forward, backend=plain, dynamic=True)
    fwd_adopt = torch.compile(model.forward, backend=adopting, dynamic=True)
    caches = []  # the tests read each backend's state of its sequence
    out_plain = _decode(model, fwd_plain, ids, kv, keep=caches)
    out_adopt = _decode(model, fwd_adopt, ids, kv, adopt=adopting, keep=caches)
    yield dict(caches=caches, model=model, ids=ids, kv=kv, plain=plain, adopting=adopting, fwd_plain=fwd_plain,
               fwd_adopt=fwd_adopt, out_plain=out_plain, out_adopt=out_adopt)
    torch._dynamo.reset()


KEEP = pytest.mark.usefixtures("adopted")


def test_adopted_cache_decodes_the_same_from_one_graph(adopted):
    assert torch.equal(adopted["out_adopt"], adopted["out_plain"])
    # the plain backend compiled the adopting step and the steady step; the adopting one only the latter
    assert len(adopted["plain"].graphs) == 2
    assert len(adopted["adopting"].graphs) == 1
    rows = adopted["adopting"].report_rows()
    assert rows and all(r["tokens_attended"] < r["tokens_logical"] for r in rows)  # compression is on


def test_adopted_cache_selects_what_the_adopting_step_selects(adopted):
    # the same Quest selection of each row at the last step, site by site (not only the same text)
    plain, adopting = adopted["plain"].runtime.sites, adopted["adopting"].runtime.sites
    assert plain.keys() == adopting.keys()
    for site in plain:
        p, a = plain[site], adopting[site]
        assert p.split is None and a.split is None and p.pad.padded  # Quest serves the padded batch in place
        assert p.last_idx is not None and p.last_idx.shape[0] == 2 and torch.equal(p.last_idx, a.last_idx)


def test_adopt_twice_and_eager_reads_are_loud(adopted):
    model, kv, be = adopted["model"], adopted["kv"], adopted["adopting"]
    cache = be.adopt(cache_from(model, [(k.clone(), v.clone()) for k, v in kv]))
    with pytest.raises(KVPassError, match="held by a kvpass backend already"):
        be.adopt(cache)
    with pytest.raises(KVPassError, match=r"layer 0 \(handed to backend.adopt\(\)\).*outside the compiled"):
        with torch.no_grad():
            model(adopted["ids"][:, -1:], past_key_values=cache, use_cache=True)  # the uncompiled model


def test_adopted_stubs_of_another_backend_or_dropped_are_loud(adopted):
    model, ids, kv = adopted["model"], adopted["ids"], adopted["kv"]
    with pytest.raises(KVPassError, match="another backend"):
        _decode(model, adopted["fwd_plain"], ids, kv, adopt=adopted["adopting"])
    be = adopted["adopting"]
    cache = be.adopt(cache_from(model, [(k.clone(), v.clone()) for k, v in kv]))
    be.clear_state()
    f0 = model.forward
    model.forward = adopted["fwd_adopt"]
    try:
        with pytest.raises(KVPassError, match="dropped since"), torch.no_grad(), constant_floats():
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2,
                           do_sample=False)
    finally:
        model.forward = f0
    # the backend still decodes what it adopts afresh
    assert torch.equal(_decode(model, adopted["fwd_adopt"], ids, kv, adopt=be), adopted["out_plain"])


def test_adopt_refuses_what_it_cannot_hold(adopted):
    model, be = adopted["model"], adopted["adopting"]
    from transformers import DynamicCache

    with pytest.raises(KVPassError, match="holds no keys"):
        be.adopt(DynamicCache(config=model.config))
    with pytest.raises(KVPassError, match="takes a transformers DynamicCache"):
        be.adopt([(k, v) for k, v in adopted["kv"]])


def test_model_kept_cache_is_left_as_it_is():
    model, ids = tiny_llama(), prompt(20)
    kv = _prefill(model, ids)
    be = kvpass(Full(), own_cache=False)
    cache = cache_from(model, kv)
    keys = cache.layers[0].keys
    assert be.adopt(cache) is cache and cache.layers[0].keys is keys


def test_adopted_layer_no_site_takes_is_loud():
    """An eager-attention model: the pass matches no site, so the decode graph concatenates the stub as
    keys; the step raises instead of returning what it computed."""
    model, ids = tiny_llama(attn_implementation="eager"), prompt(20)
    kv = _prefill(model, ids)
    be = kvpass(Full())
    fwd = torch.compile(model.forward, backend=be, dynamic=True)
    with pytest.warns(UserWarning), pytest.raises(KVPassError, match=r"layer\(s\) \[0, 1\].*reached no kvpass site"):
        _decode(model, fwd, ids, kv, adopt=be)
    assert not be.runtime.adoption  # nothing left waiting


@pytest.mark.slow
def test_padded_batch_of_a_prefetching_policy_adopts_the_same():
    """TailorKV estimating its query (a prefetch op before the attention, a host tier) on a left-padded
    batch served row by row: adopting gives the tokens and selections of the adopting step, from one graph."""
    from kvpass import TailorKV

    model = tiny_llama(pad_token_id=0)
    ids = prompt(100, batch=2)
    ids[1, :30] = 0
    policy = TailorKV(sparse_budget=48, static_tokens=24, sinks=4, early_estimate=True)
    got = []
    for adopt in (False, True):
        torch._dynamo.reset()
        be = kvpass(policy, strict=True)
        fwd = torch.compile(model.forward, backend=be, dynamic=True)
        f0 = model.forward
        try:
            with torch.inference_mode(), constant_floats():
                mask = _mask(ids)
                past = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True).past_key_values
                cache = cache_from(model, [(layer.keys, layer.values) for layer in past.layers])
                if adopt:
                    be.adopt(cache)
                model.forward = fwd
                out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False)
        finally:
            model.forward = f0
        got.append((out, len(be.graphs)))
    (plain, n_plain), (adopted, n_adopted) = got
    assert torch.equal(adopted, plain)
    assert (n_plain, n_adopted) == (2, 1)

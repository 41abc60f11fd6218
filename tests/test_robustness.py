"""Any way it is called: every policy with left-padded batches, no recompilation after warm-up, bounded
device bytes over 1,000 decode steps, and clear errors for bad input."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import StoppingCriteria, StoppingCriteriaList

from kvpass import CentroidKV, ClusterKV, Full, KVPassError, Quest, StreamingLLM, TailorKV, kvpass
from families import SMALL, SPLIT, by_graph_key, left_padded, missing_from_small
from sites import prefill_then_decode
from tiny import prompt, tiny_llama


# tiny models on one thread (tests/conftest.py says why)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_small_has_every_registered_policy():
    missing = missing_from_small()
    assert not missing, (
        f"registered policies without a small-budget instance in tests/families.py SMALL: {missing}; add "
        f"one so the padding, recompilation and bad-input tests cover them"
    )


class OnStep(StoppingCriteria):
    """Runs ``fn(step)`` after every forward of ``generate`` (step 1: the prefill); never stops."""

    def __init__(self, fn):
        self.fn, self.step = fn, 0

    def __call__(self, input_ids, scores, **kw):
        self.step += 1
        self.fn(self.step)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _greedy(forward, model, ids, new_tokens, **kw):
    fwd = model.forward
    model.forward = forward
    try:
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kw)
    finally:
        model.forward = fwd


# -- left padding ------------------------------------------------------------------------------------
# `make test` runs the policies that serve padding themselves: tests/test_padded.py compares every policy
# that splits a padded batch into rows (families.SPLIT) with its rows alone at batch 3, tokens, logits and
# selections. `make test-all` runs every registered policy here, at batches 2 and 4.
@pytest.mark.parametrize("policies, batches", [
    pytest.param("not split", (2,), id="not-split-2"),
    pytest.param("all", (2, 4), marks=pytest.mark.slow, id="all-2-4"),
])
@torch._dynamo.config.patch(recompile_limit=64)  # batch sizes 1, 2 and 4 for every graph key on one forward
def test_left_padded_batches_every_policy_equals_rows_alone(padded_compiled, policies, batches):
    """Batches of 2 (and 4) prompts of different lengths, left-padded: each row equals that row run alone
    with the same policy (tokens and logits), for every registered policy (`make test`: those not in
    families.SPLIT, which tests/test_padded.py runs at batch 3, selections too). One compilation per graph
    key (conftest's ``padded_compiled``): the policies are swapped with ``set_policy``."""
    model = padded_compiled.model
    rows = [prompt(n, seed=10 + n)[0] for n in (30, 22, 26, 17)]
    new = 5
    names = [n for n in SMALL if policies == "all" or n not in SPLIT]
    assert names, "every registered policy is in families.SPLIT"
    problems = []
    for group in by_graph_key({name: SMALL[name] for name in names}):
        for name in group:
            alone = {}
            for batch in batches:
                ids, mask = left_padded(rows[:batch])
                be, fwd = padded_compiled.forward(SMALL[name])
                out = _greedy(fwd, model, ids, new, attention_mask=mask)
                for i, r in enumerate(rows[:batch]):
                    if i not in alone:
                        # fresh states (TailorKV's profile="auto" calibrates on the first prompt it sees)
                        be.set_policy(SMALL[name])
                        alone[i] = _greedy(fwd, model, r[None], new)
                    a = alone[i]
                    if not torch.equal(out.sequences[i, -new:], a.sequences[0, -new:]):
                        problems.append(f"{name} batch {batch} row {i}: tokens differ from the row alone")
                    elif not all(torch.allclose(x[i], y[0], atol=1e-4, rtol=1e-4)
                                 for x, y in zip(out.logits, a.logits)):
                        problems.append(f"{name} batch {batch} row {i}: logits differ from the row alone")
    assert not problems, "\n".join(problems)


# -- no recompilation after warm-up ---------------------------------------------------------------------
# static: `make test-all`; in `make test` the static cache runs in tests/test_policies.py and the
# hand-written loops of tests/test_families.py, and each policy's static-cache refusal in its own file
@pytest.mark.parametrize("cache", ["dynamic", pytest.param("static", marks=pytest.mark.slow)])
def test_decoding_compiles_nothing_after_warm_up(cache):
    """After the prefill and two decode steps (the last graph a decode with a symbolic length), later
    decode steps compile nothing, for every policy (a policy that cannot serve the cache type refuses
    with a KVPassError naming the fix)."""
    model = tiny_llama(layers=2)
    ids = prompt(30)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    compiled_after, refused = {}, {}
    for group in by_graph_key(SMALL):
        be = kvpass(SMALL[group[0]], strict=True)
        fwd = torch.compile(model.forward, backend=be)
        for name in group:
            be.set_policy(SMALL[name])
            seen = {}

            def hook(step, seen=seen):
                if step == 3:  # prefill + 2 decode steps done
                    seen["warm-up graphs"] = counters["stats"]["unique_graphs"]
                    counters.clear()
                elif step > 3:
                    seen["after"] = counters["stats"]["unique_graphs"] + sum(counters["frames"].values())

            counters.clear()
            try:
                _greedy(fwd, model, ids, 7, stopping_criteria=StoppingCriteriaList([OnStep(hook)]), **kw)
            except KVPassError as e:
                refused[name] = str(e)
                continue
            compiled_after[name] = seen["after"]
            if name == group[0]:
                assert seen["warm-up graphs"] >= 2, seen  # the counters do see compilation
    assert compiled_after == {name: 0 for name in compiled_after}, compiled_after
    assert "Full" in compiled_after and "StreamingLLM" in compiled_after
    for name, msg in refused.items():
        assert cache == "static" and "DynamicCache" in msg, (name, msg)


# -- memory over a long decode ----------------------------------------------------------------------------
def _sample_rows(be, every):
    samples = []

    def hook(step):
        if step % every == 0:
            samples.append(be.report_rows())

    return samples, StoppingCriteriaList([OnStep(hook)])


def test_centroidkv_device_bytes_stay_within_budget_over_1000_steps():
    """CentroidKV(budget=B) holds at most B slots per KV head; with its fp32 degree a slot costs
    2*D*itemsize + 4 bytes, so a site's device bytes never exceed batch * H_kv * B * that (read from the
    report, which counts the buffers' real sizes), however long the decode."""
    budget, steps = 64, 1000  # the 10x margin on Full below holds from about 560 steps
    policy = CentroidKV.with_budget(budget, sinks=4, recent=16, step=16, chunk=32, outlier_heads=0.0)
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, positions=4096)
    ids = prompt(100)
    be = kvpass(policy, strict=True)
    samples, stop = _sample_rows(be, 100)
    _greedy(torch.compile(model.forward, backend=be), model, ids, steps, stopping_criteria=stop)
    bound = 1 * 2 * budget * (2 * 16 * 4 + 4)
    full_kv = 1 * 2 * (100 + steps) * 2 * 16 * 4  # what Full holds at the end
    assert len(samples) == steps // 100
    for rows in samples:
        for r in rows:
            assert r["tokens_held"] <= budget, r
            assert 0 < r["device_bytes"] <= bound, (r["tokens_logical"], r["device_bytes"], bound)
    last = samples[-1]
    assert all(r["tokens_logical"] == 100 + steps - 1 and r["merge_rounds"] > 0 for r in last)
    assert all(r["device_bytes"] * 10 < full_kv for r in last)


def test_device_bytes_per_sequence_barely_grow_with_the_context():
    """What a server can count on (issue 14): with a fixed budget, the device bytes of one sequence do not
    grow with its context for CentroidKV, and grow by a small fixed share of Full's per-token bytes for the
    offloading policies: ClusterKV(offload=True) keeps 8 bytes a token and KV head for its recall (the step
    that last recalled a position and its slot); TailorKV's sparse layers the prefetched critical channels
    (``critical_channels / head_dim`` of the keys) and its quantised layers ``quant_bits`` per element plus
    fp16 scales. Measured from the report at two prompt lengths, against Full's growth: docs/design.md
    ("What a sequence holds on the device") has the same shares for SmolLM2."""
    from kvpass.tailorkv import Profile, config_key

    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, positions=2048)
    tailor = dict(sparse_budget=16, static_tokens=6, sinks=2, critical_channels=4, group_size=8, residual=8,
                  quant_bits=2)
    two_tiers = Profile(config_key(model.config), "llama", ((0, 0.9), (1, 0.0)))  # layer 0 quantised, 1 sparse
    policies = {  # name: (policy, the most its growth may be of Full's)
        "CentroidKV": (CentroidKV.with_budget(48, sinks=4, recent=8, step=8, chunk=16, outlier_heads=0.0), 0.0),
        # per token and KV head: its recall step and slot (int32 each), its place in the cluster order (int64),
        # and a cluster's centroid, size and offset (fp32 x 16, int64 x 2) per 8 tokens; Full: K and V, 128 B
        "ClusterKV(offload)": (ClusterKV(budget=32, sinks=4, tokens_per_cluster=8, decode_window=32,
                                         decode_clusters=4, dense_layers=(), offload=True),
                               (4 + 4 + 8 + (4 * 16 + 16) / 8) / 128),
        # sparse: 4 of 16 channels (16 of 128 B); quantised: 2-bit codes (8 B) and fp16 scales (16 B)
        "TailorKV": (TailorKV(**tailor, profile=two_tiers), (16 + 24) / (2 * 128)),
    }

    def growth(policy):
        """Device bytes after a prompt of 1400 tokens less those after one of 200 (3 decode steps each)."""
        torch._dynamo.reset()  # each policy compiles its own graphs: stay within the recompile limit
        be = kvpass(policy, strict=True)
        fwd = torch.compile(model.forward, backend=be)
        held = []
        for n in (200, 1400):
            be.set_policy(policy)  # fresh states, buffer capacities too
            _greedy(fwd, model, prompt(n, seed=n), 3)
            held.append(sum(r["device_bytes"] for r in be.report_rows()))
        return held[1] - held[0]

    full = growth(Full())
    assert full > 0
    for name, (policy, share) in policies.items():
        grown = growth(policy)
        # capacities grow by doubling (and by whole chunks): a slack of 2x the share, never Full's growth
        assert grown <= 2 * share * full + 4096, (name, grown, full)
        print(f"{name}: {grown / full:.3f} of Full's device bytes per added token")


def test_clusterkv_offload_keeps_every_token_in_the_host_tier():
    """ClusterKV recalls from the whole cache, so the report counts all of it in the host tier with
    offload=True, and less on the device. (Quest keeps every token on the device: test_policies.py.)"""
    steps, n = 200, 40
    model = tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, positions=1024)
    kv_bytes = 1 * 2 * (n + steps - 1) * 2 * 16 * 4  # keys and values of every token, one site
    policy = ClusterKV(budget=32, sinks=4, tokens_per_cluster=8, decode_window=32, decode_clusters=4,
                       dense_layers=(), offload=True)
    be = kvpass(policy, strict=True)
    _greedy(torch.compile(model.forward, backend=be), model, prompt(n), steps)
    for r in be.report_rows():
        assert r["tokens_logical"] == n + steps - 1
        assert r["host_bytes"] >= kv_bytes and r["device_bytes"] < r["host_bytes"], r


# -- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ClusterKV(budget=8, sinks=16), r"ClusterKV needs budget > sinks \(16\), got budget=8"),
        (lambda: StreamingLLM.with_budget(4, sinks=4),
         r"StreamingLLM needs budget > sinks \(4\), got budget=4"),
        (lambda: CentroidKV.with_budget(20, sinks=16),
         r"budget > sinks \+ recent \+ step \(144\), got budget=20; lower sinks/recent/step or raise budget"),
        (lambda: Quest(budget=8, page_size=16), r"budget >= 2 \* page_size \(32\).*got budget=8"),
    ],
    ids=["ClusterKV", "StreamingLLM", "CentroidKV", "Quest"],
)
def test_budget_below_sinks_names_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# what was found, where, and the fix (the message also names the module path when the pass gave one)
NON_FINITE = (r"kvpass: {name} found {found} in the keys of layer 0 \(site 0\) {when}.*"
              r"fp32 or bf16.*use Full\(\)")
COMPRESSING = sorted(n for n in SMALL if n != "Full")


def _bad_key(bad, at=30):
    """Keys drawn as ``torch.randn`` with one channel of position ``at`` set to ``bad`` (prefill keys)."""
    def keys(shape):
        k = torch.randn(shape)
        if shape[2] > at:
            k[:, :, at, 3] = bad
        return k

    return keys


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", COMPRESSING)
def test_non_finite_keys_at_prefill_name_the_site_and_the_fix(name, bad):
    """A compressing policy cannot select, cluster, merge or quantise NaN/Inf keys (its metadata would be
    garbage that looks valid): it raises a KVPassError at prefill naming the site, what it found and
    where, and the fix."""
    found = "NaN" if bad != bad else "Inf"
    with pytest.raises(KVPassError, match=NON_FINITE.format(name=name, found=found, when="at prefill")) as e:
        prefill_then_decode(SMALL[name], length=60, steps=2, owned=True, keys=_bad_key(bad))
    assert "position 30" in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_full_keeps_eager_semantics_for_non_finite_keys(bad):
    """Full attends exactly like eager: no error, and NaN exactly where exact attention gives NaN."""
    for owned in (False, True):
        outs = prefill_then_decode(Full(), length=60, steps=2, owned=owned, keys=_bad_key(bad))
        for q, k, v, out, idx in outs:
            exact = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], k, v, enable_gqa=True
            )[:, :, 0]
            assert idx is None and exact.isnan().any()
            assert torch.equal(out.isnan(), exact.isnan())


@pytest.mark.parametrize("name", [*COMPRESSING, "ClusterKV(offload)"])
def test_non_finite_keys_in_an_adopted_cache(name):
    """A cache filled outside kvpass (an eager prefill) is checked when the first decode step adopts it."""
    from kvpass.runtime import Runtime

    policy = SMALL.get(name) or ClusterKV(budget=16, sinks=2, tokens_per_cluster=4, decode_window=8,
                                          decode_clusters=2, dense_layers=(), offload=True)
    torch.manual_seed(0)
    k, v = _bad_key(float("nan"))((1, 2, 40, 16)), torch.randn(1, 2, 40, 16)
    rt = Runtime(policy)
    when = r"of a cache filled outside kvpass \(adopted at this decode step\)"
    with pytest.raises(KVPassError, match=NON_FINITE.format(name=policy.name, found="NaN", when=when)):
        rt.attend_owned(0, torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), k, v,
                        None, 0.0, False)


@pytest.mark.parametrize(
    "name, when, step",
    # CentroidKV merges the prompt down at the first decode step; TailorKV's residual holds 60 % 8 = 4
    # prompt tokens and is quantised when 4 more have been decoded; ClusterKV clusters the whole prompt,
    # then the window of 8 decoded tokens (positions 60..67) at the step of position 68
    [("CentroidKV", "when merging", 1), ("TailorKV", "when quantising", 4), ("ClusterKV", "when clustering", 9)],
)
def test_non_finite_decoded_keys_are_caught_where_they_are_merged_or_quantised(name, when, step):
    """Decode steps do not check their one new key (a host sync per layer per step); the policies that
    fold decoded keys into compressed storage check them there, a few steps later at most."""
    from kvpass.runtime import Runtime

    # TailorKV: tau=-0.0 makes the layer a quantised one (the sparse tier quantises nothing)
    policy = SMALL[name] if name != "TailorKV" else TailorKV(profile="auto", tau=-0.0, group_size=8, residual=8)
    rt = Runtime(policy)
    calls = []

    def keys(shape):  # the prompt (60 tokens) is finite; the first decoded key is NaN
        calls.append(shape)
        k = torch.randn(shape)
        if len(calls) == 2:
            k[:, :, 0, 3] = float("nan")
        return k

    with pytest.raises(KVPassError, match=NON_FINITE.format(name=name, found="NaN", when=when)):
        prefill_then_decode(policy, length=60, steps=10, owned=True, keys=keys, rt=rt)
    assert len(calls) == 1 + step  # the prefill, then decode steps up to the one that raised
    assert name != "TailorKV" or rt.state(0).tier == "quantised"


def test_non_finite_keys_through_compiled_generate():
    """Through torch.compile and generate(): the user sees the KVPassError's text (the layer's module
    path, NaN, the fix), and Full still runs like eager."""
    model = tiny_llama(layers=2)
    # a NaN weight in layer 1's key projection: every key of that layer is NaN from the prefill on
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    ids = prompt(30)
    # raised by the op at run time, outside dynamo's and Inductor's compile steps: nothing wraps it
    with pytest.raises(KVPassError, match=r"kvpass: Quest found NaN in the keys of layer 1 "
                       r"\(model\.layers\.1\.self_attn\) at prefill.*fp32 or bf16.*use Full\(\)"):
        _greedy(torch.compile(model.forward, backend=kvpass(SMALL["Quest"], strict=True)), model, ids, 3)
    torch._dynamo.reset()
    be = kvpass(Full(), strict=True)
    out = _greedy(torch.compile(model.forward, backend=be), model, ids, 3)
    ref = _greedy(model.forward, model, ids, 3)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(out.logits, ref.logits))


def test_head_dims_the_kernels_cannot_take():
    """On CPU the torch references serve any head_dim (here 320); the Triton launchers, which hold a key
    row in one block, refuse D > 256 with the limit and the way out in the message."""
    from kvpass.kernels import centroid, clusterkv

    for name in ("Full", "Quest", "ClusterKV", "CentroidKV"):
        outs = prefill_then_decode(SMALL[name], length=40, steps=1, d=320, owned=True)
        assert torch.isfinite(outs[-1][3]).all()
    keys = torch.randn(1, 2, 64, 320)
    with pytest.raises(ValueError, match=r"head dim D <= 256.*got D=320; use \w+_ref"):
        clusterkv.cosine_kmeans(keys, 4, use_triton=True)
    with pytest.raises(ValueError, match=r"head dim D <= 256"):
        centroid.chunk_match(keys, 0, 64, 16)


def test_model_without_attention_runs_exact_and_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(3, 16)
    be = kvpass(Full())
    counters.clear()
    with torch.no_grad(), pytest.warns(UserWarning, match="no attention site found .* the model runs exact"):
        out = torch.compile(model, backend=be)(x)
    torch.testing.assert_close(out, model(x))
    assert be.graphs and not any(g.sites or g.unmatched for g in be.graphs)
    assert counters["kvpass"]["sites_rewritten"] == 0
    assert "no attention site found in 1 compiled graph(s): the model runs exact" in be.report()

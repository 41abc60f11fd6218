"""Warm starts: a second process reuses Inductor's caches and reports what the first one found."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpass import Full, Quest, kvpass
from kvpass.runtime import registry
from tiny import prompt, tiny_llama

ROOT = Path(__file__).resolve().parent.parent

# One process of a warm-start pair: three backends of one policy (so the n-th of each process must
# find the n-th's graphs), a generate() through the first, a prefill through the second (same model),
# and a decode step of an eager-attention model through the third (sites left exact, with the reason).
_SCRIPT = r"""
import json, sys, time, warnings
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import torch
from torch._dynamo.utils import counters
from tiny import generate, prompt, tiny_llama
from kvpass import Full, kvpass

torch.set_num_threads(1)
warnings.simplefilter("ignore")
out = {}
model, ids = tiny_llama(), prompt(12)
backends = [kvpass(Full()) for _ in range(3)]
with torch.no_grad():
    eager = generate(model, ids, new_tokens=3)
    out["tokens"] = generate(model, ids, new_tokens=3, backend=backends[0]).tolist()
    out["eager"] = eager.tolist()
    out["first"] = dict(counters["inductor"])
    torch.compile(model.forward, backend=backends[1])(ids)
    out["second"] = dict(counters["inductor"])
    exact = tiny_llama(attn_implementation="eager")
    past = exact(ids, use_cache=True).past_key_values  # eager prefill; the decode graph has the cache cat
    torch.compile(exact.forward, backend=backends[2])(ids[:, -1:], past_key_values=past, use_cache=True)
out["handles"] = [b.runtime.handle for b in backends]
out["reports"] = [b.report() for b in backends]
out["inductor"] = dict(counters["inductor"])
out["aot"] = dict(counters["aot_autograd"])
out["kvpass"] = dict(counters["kvpass"])
out["seconds"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""


def _run(cache_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")}  # the defaults
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT / "tests")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow  # two fresh processes, four tiny graphs each
def test_second_process_reuses_the_cache_and_reports_the_same(tmp_path):
    cold = _run(tmp_path)
    # The first process compiles everything; its second backend of the same policy shares nothing
    # with the first, although it compiles the same model (another handle, so another cache key).
    assert cold["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert cold["second"].get("fxgraph_cache_miss", 0) > cold["first"].get("fxgraph_cache_miss", 0)
    assert cold["kvpass"]["sites_rewritten"] > 0 and "graphs_from_cache" not in cold["kvpass"]
    assert len(set(cold["handles"])) == 3
    assert "left exact:" in cold["reports"][2], cold["reports"][2]

    warm = _run(tmp_path)
    # Every graph of the second process comes from the caches, the pass never runs, and yet the
    # reports (sites, layers, patterns, sites left exact and why, runtime statistics) are the same.
    assert warm["inductor"].get("fxgraph_cache_hit", 0) == 4, warm["inductor"]
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm["inductor"]
    assert warm["aot"].get("autograd_cache_hit", 0) == 4, warm["aot"]
    assert "sites_rewritten" not in warm["kvpass"], warm["kvpass"]
    assert warm["kvpass"]["graphs_from_cache"] == warm["inductor"]["fxgraph_cache_hit"]
    assert warm["handles"] == cold["handles"]
    assert warm["reports"] == cold["reports"]
    assert "P1" in warm["reports"][0] and "left exact:" in warm["reports"][2]
    assert warm["tokens"] == cold["tokens"] == warm["eager"]
    print(f"cold process {cold['seconds']:.1f} s, warm process {warm['seconds']:.1f} s")


def test_stale_cache_without_records_compiles_again(tmp_path, monkeypatch):
    """A hit without kvpass's record (a cache directory written by another tool) recompiles with the
    caches off, so that the pass runs and report() is complete; the record is written then."""
    from kvpass.lowering import graph_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, ids = tiny_llama(layers=1), prompt(8)
    be = kvpass(Full())
    monkeypatch.setattr(graph_cache, "restore", lambda key, backend: False)
    calls = []
    real = be._compile
    monkeypatch.setattr(be, "_compile", lambda gm, ex, cached, **kw: calls.append(cached)
                        or real(gm, ex, cached=cached, **kw))
    record, swallowed = be._record_graph, []
    # the pass appears not to run the first time, as on a cache hit
    monkeypatch.setattr(be, "_record_graph", lambda *a: record(*a) if swallowed else swallowed.append(a))
    with torch.no_grad():
        got = torch.compile(model.forward, backend=be)(ids).logits
        want = model(ids).logits
    assert calls == [True, False]
    torch.testing.assert_close(got, want)
    assert any(r.sites for r in be.graphs)
    assert list((tmp_path / "kvpass").glob("*.json"))


def test_backends_of_one_policy_never_share_a_handle():
    a, b = kvpass(Quest(budget=64)), kvpass(Quest(budget=64))
    assert a.runtime.handle != b.runtime.handle
    assert a._pass.uuid() != b._pass.uuid()
    assert registry.lookup(a.runtime.handle) is a.runtime
    old = a.runtime.handle
    del a
    gc.collect()
    c = kvpass(Quest(budget=64))
    # a freed backend's handle is never given again in this process: a graph it compiled that is
    # still alive must fail loudly rather than reach the new backend's state
    assert c.runtime.handle not in (old, b.runtime.handle)
    with pytest.raises(RuntimeError, match="no longer exists"):
        registry.lookup(old)
    # another policy, or the same one with other options, compiles other graphs
    assert kvpass(Quest(budget=65))._pass.uuid() != b._pass.uuid()
    assert kvpass(Quest(budget=64), own_cache=False)._pass.uuid() != b._pass.uuid()


def test_handles_fit_the_op_schema():
    for ordinal in range(200):
        h = registry.handle_for("Full()|own_cache=True", ordinal)
        assert 0 < h < 1 << 63
    assert registry.handle_for("k", 0) == registry.handle_for("k", 0) != registry.handle_for("k", 1)


def test_cache_false_compiles_without_the_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._dynamo.utils import counters

    counters.clear()
    model, ids = tiny_llama(layers=1), prompt(8)
    be = kvpass(Full(), cache=False)
    with torch.no_grad():
        torch.compile(model.forward, backend=be)(ids)
    assert counters["inductor"]["fxgraph_cache_miss"] == 0 and counters["kvpass"]["sites_rewritten"] == 1
    assert not (tmp_path / "kvpass").exists()


def test_constant_floats_compiles_each_dynamic_graph_once(tmp_path, monkeypatch):
    """Under dynamic=True dynamo restarts a frame whose float attributes (RMSNorm eps) AOTAutograd
    specialises, tracing and compiling it twice; inside ``constant_floats()`` it traces each frame once,
    with the same logits. Both compiles are counted, so the test fails if torch stops restarting (then
    the helper is moot) or the helper stops preventing it."""
    from torch._dynamo.utils import counters

    from kvpass import constant_floats

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, ids = tiny_llama(layers=1), prompt(8)
    aot_calls = []
    for ctx in (contextlib.nullcontext, constant_floats):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad(), ctx():
            got = torch.compile(model.forward, backend=kvpass(Full()), dynamic=True)(ids).logits
        assert counters["stats"]["unique_graphs"] == 1
        aot_calls.append(counters["aot_autograd"]["total"])
        torch.testing.assert_close(got, model(ids).logits)
    assert aot_calls == [2, 1]

"""The command line: policy specs, ``kvpass explain`` on the tiny model, ``kvpass demo --quick``.

Everything runs in-process through ``kvpass.cli.main``. The explain tests compile the 2-layer random
Llama (a few seconds each); the demo test compiles SmolLM2 on its own and is marked slow
(tests/test_smollm2.py runs the real model in the default run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import pytest

from kvpass import Full, Quest, StreamingLLM, TailorKV
from kvpass.cli import main
from kvpass.policies.parse import parse_policy
from kvpass.policies import Policy, base

# kvpass::attention or a variant of it (kvpass::attention_owned when the runtime owns the cache)
ATTENTION_CALL = re.compile(r"torch\.ops\.kvpass\.attention\w*\.default\(")


# -- parse_policy ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        Full(),
        Quest(),
        Quest(budget=512, page_size=8, gqa="max"),
        StreamingLLM(),
        StreamingLLM(sinks=0, window=64),
        TailorKV(),
        TailorKV(profile="auto", critical_channels=4, quant_bits=2),
    ],
    ids=lambda p: p.describe(),
)
def test_parse_policy_round_trips_describe(policy):
    assert parse_policy(policy.describe()) == policy


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Quest", Quest()),
        ("Quest()", Quest()),
        ("quest(budget=2048)", Quest(budget=2048)),
        ("Quest(budget=1024,page_size=16)", Quest(budget=1024, page_size=16)),
        ("  Quest ( budget = 256 , page_size = 8 , ) ", Quest(budget=256, page_size=8)),
        ("Quest(gqa=max)", Quest(gqa="max")),
        ('Quest(gqa="max")', Quest(gqa="max")),
        ("StreamingLLM(sinks=+2, window=30)", StreamingLLM(sinks=2, window=30)),
    ],
)
def test_parse_policy_syntax(text, expected):
    assert parse_policy(text) == expected


def test_parse_policy_budget_option():
    assert parse_policy("Quest", budget=256) == Quest(budget=256)
    assert parse_policy("Quest(budget=4096, page_size=8)", budget=256) == Quest(budget=256, page_size=8)
    # No budget field: through with_budget (StreamingLLM: window = budget - sinks).
    assert parse_policy("StreamingLLM(sinks=2)", budget=64) == StreamingLLM(sinks=2, window=62)
    assert parse_policy("Full", budget=64) == Full()


def test_parse_policy_values(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Probe(Policy):
        name = "Probe"
        sizes: tuple = ()
        ratio: float = 0.0
        flag: bool = False
        label: str | None = "x"

    monkeypatch.setitem(base._REGISTRY, "Probe", Probe)
    p = parse_policy("Probe(sizes=(4, 8, 16), ratio=1.5e-1, flag=True, label=None)")
    assert p == Probe(sizes=(4, 8, 16), ratio=0.15, flag=True, label=None)
    assert parse_policy("Probe(sizes=[1,2,], ratio=-2, label='a b')") == Probe(sizes=(1, 2), ratio=-2, label="a b")
    assert parse_policy("Probe(sizes=())").sizes == ()
    assert parse_policy(p.describe()) == p


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty policy"),
        ("   ", "empty policy"),
        ("Nope", r"unknown policy 'Nope'; expected one of \[.*'Quest'"),
        ("Quest(", "expected a parameter name"),
        ("Quest(budget)", "expected '=' after 'budget'"),
        ("Quest(budget=)", "expected a value"),
        ("Quest(1024)", "expected a parameter name"),
        ("Quest(budget=1, budget=2)", "'budget' is given twice"),
        ("Quest(budget=1024 page_size=16)", "expected ',' or '\\)'"),
        ("Quest(budget=1024) extra", "expected the end of the policy"),
        ("Quest(bogus=1)", r"Quest has no parameter\(s\) \['bogus'\]; its parameters are \['budget'"),
        ("Quest(budget=8)", "Quest needs budget >= 2 \\* page_size"),
        ("Quest(budget=1e3)", "Quest needs an integer budget"),
        ("Quest(budget=__import__('os'))", "expected ',' or '\\)'"),
        ("Quest(budget=1; import os)", "unexpected ';' at column 15"),
        ("Quest(sizes=((1, 2)))", "tuples do not nest"),
        ("Quest(gqa='max)", "unexpected \"'\""),
    ],
)
def test_parse_policy_rejects(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_policy(text)
    assert str(info.value).startswith("kvpass: ")


# -- main: version, errors ---------------------------------------------------------------------------


def test_version(capsys):
    import kvpass

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvpass {kvpass.__version__}"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["explain", "--policy", "Quest(budget=8)"], "Quest needs budget >= 2 * page_size (32)"),
        (["demo", "--policy", "Bogus"], "unknown policy 'Bogus'"),
        (["demo", "--policy", "StreamingLLM", "--budget", "2"], "StreamingLLM needs budget > sinks (4)"),
        (["demo", "--policies", "Quest,Bogus"], "unknown policy 'Bogus'"),
        (["demo", "--policy", "Quest", "--policies", "Quest"], "demo takes --policy SPEC or --policies LIST, not both"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, match, capsys):
    assert main(argv) == 2  # raised before any model is loaded
    err = capsys.readouterr().err
    assert err.startswith("kvpass: ") and match in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


# -- explain -----------------------------------------------------------------------------------------


def _graphs(out: str) -> list[tuple[str, str]]:
    """(kind, block text) per ``graph N: kind ...`` block of the explain output."""
    blocks = re.split(r"^(?=graph \d+: )", out, flags=re.M)
    found = []
    for b in blocks:
        m = re.match(r"graph \d+: (\w+)", b)
        if m:
            found.append((m.group(1), b.split("\n\n")[0]))
    return found


def _assert_every_layer_rewritten(out: str, layers: int = 2) -> None:
    graphs = _graphs(out)
    kinds = [k for k, _ in graphs]
    assert "prefill" in kinds and "decode" in kinds, out
    for kind, block in graphs:
        for layer in range(layers):
            assert re.search(rf"rewritten\s+layer\s+{layer}\s+model\.layers\.{layer}\.self_attn", block), block
        assert "left exact  layer" not in block
    assert f"{len(graphs)} of {len(graphs)} graph(s) have every one of the {layers} layers rewritten" in out
    assert "kvpass report: policy" in out


def test_explain_tiny(capsys):
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "tiny random Llama" in out and "DynamicCache" in out
    # dynamo: 2 compiles (the stubs are marked dynamic after the prefill, so the first decode is symbolic)
    assert [k for k, _ in _graphs(out)] == ["prefill", "decode"]
    assert "[P3 prefill" in out and "[P1 cat" in out  # pattern names may carry suffixes
    _assert_every_layer_rewritten(out)


def test_explain_dump_dir_static_cache(tmp_path, capsys):
    assert main(["explain", "--cache", "static", "--policy", "StreamingLLM(sinks=4, window=16)",
                 "--dump-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    _assert_every_layer_rewritten(out)
    assert "[P2 index_put" in out
    assert f"graphs dumped to {tmp_path} with depyf" in out
    rewritten = sorted(tmp_path.glob("*AFTER_POST_GRAD*.py"))
    assert len(rewritten) == len(_graphs(out)) == 2
    for f in rewritten:
        assert len(ATTENTION_CALL.findall(f.read_text())) == 2, f
    # Inductor's generated code calls the op as an extern kernel.
    assert any("kvpass.attention" in f.read_text() for f in tmp_path.glob("*kernel*.py"))
    assert "MISMATCH" not in out


def test_explain_dump_dir_falls_back_to_inductor_trace(tmp_path, capsys, monkeypatch):
    import kvpass.explain as explain

    @contextlib.contextmanager
    def broken(dump_dir):
        raise RuntimeError("depyf does not support this torch")
        yield

    monkeypatch.setattr(explain, "_depyf_graphs", broken)
    assert main(["explain", "--new-tokens", "1", "--dump-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "depyf failed (RuntimeError: depyf does not support this torch)" in captured.err
    assert "with Inductor debug trace" in captured.out
    files = list(tmp_path.rglob("fx_graph_transformed.py"))
    assert len(files) == 1  # one new token: the prefill graph only
    assert len(ATTENTION_CALL.findall(files[0].read_text())) == 2


# -- demo --------------------------------------------------------------------------------------------


@pytest.mark.slow  # its own SmolLM2 load and compile (dynamic=True) and a 2k-token prompt
def test_demo_quick(smollm2, monkeypatch, capsys, tmp_path):
    # The demo loads SmolLM2 from the default cache ($KVPASS_CACHE). Point it at the session's
    # temporary cache (conftest's ``smollm2`` fixture converts into it once per run and the other slow
    # tests share it), so the test neither depends on nor writes to the user's ~/.cache/kvpass.
    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    png = tmp_path / "demo.png"
    assert main(["demo", "--quick", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Full() vs Quest(budget=1024) vs CentroidKV(cache_ratio=0.5)" in out
    # Quest and CentroidKV rewrite the graph as Full does: they run on Full's graphs and compile nothing
    assert re.search(r"Quest\(budget=1024\): warm-up on 64 tokens \(the graphs compiled for Full\(\) serve it\)", out), out
    assert "compiled during the timed run" not in out, out
    answers = re.findall(r"^  answer:   '(.*)'$", out, flags=re.M)
    assert len(answers) == 3, out
    assert "7391" in answers[0], out  # Full finds the fact at 2k tokens (greedy, fp32: deterministic)
    assert re.search(r"^  decode:   [\d.]+ ms/token, [\d.]+x Full's speed \(12 tokens", out, flags=re.M), out
    rows = re.findall(r"^\| (Full\(\)|Quest\(budget=1024\)|CentroidKV\(cache_ratio=0.5\)) \|", out, flags=re.M)
    assert rows == ["Full()", "Quest(budget=1024)", "CentroidKV(cache_ratio=0.5)"], out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_continues_a_copied_prefill_as_generate_does_from_the_prompt():
    """The demo prefills a prompt once and hands each policy's backend that cache (``backend.adopt``):
    generating from it through the compiled model gives the tokens a plain generate() from the prompt
    gives, from one decode graph, in every row of a ``--batch`` of copies, and leaves the prefill unchanged."""
    import torch
    from tiny import prompt, tiny_llama

    from kvpass import Full, constant_floats, kvpass
    from kvpass.bench.timing import generation_config
    from kvpass.demo import _generate, prefill

    model = tiny_llama()
    ids = prompt(24)
    backend = kvpass(Full(), strict=True)
    fwd = model.forward
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids),
                                  generation_config=generation_config(model, 5))
        kv = prefill(model, ids)
        before = [(k.clone(), v.clone()) for k, v in kv]
        assert kv[0][0].shape[2] == 23  # every token but the last
        model.forward = torch.compile(fwd, backend=backend, dynamic=True)
        try:
            with constant_floats():
                for _ in range(2):
                    assert torch.equal(_generate(model, ids, kv, 5, backend), expected)
                assert len(backend.graphs) == 1  # the adopted cache: the steady decode graph only
                assert torch.equal(_generate(model, ids, kv, 5, backend, batch=2), expected.expand(2, -1))
        finally:
            model.forward = fwd
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(kv, before))


def test_demo_stored_prefill_reads_back_the_same_tensors_and_only_for_the_same_prompt_and_model(tmp_path):
    """A second run of one prompt reads the prefill the first one kept, equal to a fresh prefill, without
    running the model; another prompt, other weights or ``fresh`` compute it again; at most
    PREFILLS_KEPT files stay."""
    import torch
    from tiny import prompt, tiny_llama

    from kvpass import demo

    model, ids = tiny_llama(), prompt(24)
    with torch.inference_mode():
        want = demo.prefill(model, ids)
        kv, read = demo.stored_prefill(model, ids, tmp_path)
        assert not read
        fwd = model.forward
        model.forward = lambda *a, **k: pytest.fail("the stored prefill ran the model")
        kv2, read2 = demo.stored_prefill(model, ids, tmp_path)
        model.forward = fwd
        assert read2
        for got in (kv, kv2):
            assert len(got) == len(want)
            assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(got, want))
        assert not demo.stored_prefill(model, prompt(24, seed=2), tmp_path)[1]
        assert not demo.stored_prefill(model, ids, tmp_path, fresh=True)[1]
        other = tiny_llama(seed=3)
        got, read3 = demo.stored_prefill(other, ids, tmp_path)
        assert not read3 and not torch.equal(got[0][0], want[0][0])
    assert len(list(tmp_path.glob("prefill-*.pt"))) == demo.PREFILLS_KEPT


def test_demo_table_and_chart(tmp_path):
    from kvpass import CentroidKV, Full, Quest, StreamingLLM
    from kvpass.demo import Result, _table, short_name, write_png

    assert [short_name(p) for p in (Full(), StreamingLLM.with_budget(512), Quest(budget=256, page_size=32),
                                    CentroidKV(cache_ratio=0.25))] == [
        "Full()", "StreamingLLM(window=508)", "Quest(budget=256, page_size=32)", "CentroidKV(cache_ratio=0.25)"]
    results = [Result("Full()", "7391", 12, 0.5, 100.0, 30.0, sites=30, held=4096, attended=4096, logical=4096,
                      device_bytes=96 << 20),
               Result("Quest(budget=1024)", "It is 7391.", 12, 0.5, 80.0, 1.0, sites=30, held=4096,
                      attended=1024, logical=4096, device_bytes=100 << 20),
               Result("StreamingLLM(window=1020)", "I don't know", 12, 0.5, 50.0, 1.0, sites=30, held=1024,
                      attended=1024, logical=4096, device_bytes=24 << 20, host_bytes=1 << 20)]
    table = _table(results).splitlines()
    assert table[2] == "| Full() | '7391' | yes | 100.0 | 1.00x | 4096 of 4096 | 96.0 MiB |"
    assert table[3] == "| Quest(budget=1024) | 'It is 7391.' | yes | 80.0 | 1.25x | 1024 of 4096 | 100.0 MiB |"
    assert table[4] == "| StreamingLLM(window=1020) | \"I don't know\" | no | 50.0 | 2.00x | 1024 of 4096 | 25.0 MiB |"
    png = tmp_path / "img" / "chart.png"
    png.parent.mkdir()
    write_png(results, str(png), "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    from kvpass.demo import write_md

    page = tmp_path / "docs" / "demo.md"
    write_md(results, str(page), str(png), 4096, 12, 1552)
    text = page.read_text()
    assert _table(results) in text and "![decode ms/token and cache held per policy](../img/chart.png)" in text
    assert "hidden at token 1552 of a 4096-token prompt" in text and "Compile + warm-up of the first policy: 30 s" in text
    assert "TORCHINDUCTOR_CACHE_DIR" not in text  # a run on the default directory shows none
    write_md(results, str(page), str(png), 4096, 12, 1552, cache_dir="/tmp/cold dir")
    assert "TORCHINDUCTOR_CACHE_DIR='/tmp/cold dir' " in page.read_text()


def test_demo_generation_config_decodes_past_eos_without_masking_the_prompt():
    """The demo decodes a fixed number of tokens (EOS does not stop it), and prompt tokens equal to the
    pad token stay visible (generate() must not infer a padding mask from them: SmolLM2 pads with
    <|im_end|>, which every chat prompt holds)."""
    import functools

    import torch
    from tiny import prompt, tiny_llama

    from kvpass.bench.timing import generation_config

    model = tiny_llama()
    ids = prompt(16)
    expected = ids
    with torch.no_grad():
        for _ in range(6):  # greedy, no cache, nothing masked
            nxt = model(expected).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    gen = model.generation_config
    gen.eos_token_id = int(expected[0, 16])  # the first new token: a default generate stops at once
    gen.pad_token_id = int(ids[0, 3])  # a prompt token
    assert gen.pad_token_id != gen.eos_token_id
    masks = []
    fwd = model.forward

    @functools.wraps(fwd)  # generate() reads forward's signature to decide what to pass
    def recording_forward(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return fwd(*args, **kwargs)

    model.forward = recording_forward
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation_config(model, 6))
    assert torch.equal(out, expected)
    assert masks and all(m is None or bool(m.all()) for m in masks)


def test_nothing_imports_the_command_line():
    """cli.py only dispatches: what the subcommands share lives below it (kvpass.policies.parse,
    kvpass.bench.timing), and no module imports another subcommand's private names."""
    import ast
    from pathlib import Path

    from kvpass.cli import COMMANDS

    commands = {module for _, module, _ in COMMANDS}
    pkg = Path(__file__).resolve().parent.parent / "kvpass"
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module + "." + a.name for a in node.names]
                if node.module == "kvpass" and any(a.name == "cli" for a in node.names):
                    offenders.append(f"{path.name}: from kvpass import cli")
                if node.module == "kvpass.cli":
                    offenders.append(f"{path.name}: {names}")
                if node.module in commands and any(a.name.startswith("_") for a in node.names):
                    offenders.append(f"{path.name}: private {names}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.name}: import {a.name}" for a in node.names if a.name == "kvpass.cli"]
    assert offenders == []


@pytest.mark.slow  # compiles SmolLM2 in a fresh process
def test_readme_first_example_runs(smollm2, tmp_path):
    """The first Python block of the README runs as written, on the bundled model, and generates."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "KVPASS_CACHE": str(smollm2.cache_dir), "PYTHONPATH": str(root),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "assistant" in proc.stdout, proc.stdout

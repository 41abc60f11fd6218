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


@pytest.mark.slow  # its own SmolLM2 load and compile (dynamic=True) and a 1k-token prompt
def test_demo_quick(smollm2, monkeypatch, capsys):
    # The demo loads SmolLM2 from the default cache ($KVPASS_CACHE). Point it at the session's
    # temporary cache (conftest's ``smollm2`` fixture converts into it once per run and the other slow
    # tests share it), so the test neither depends on nor writes to the user's ~/.cache/kvpass.
    monkeypatch.setenv("KVPASS_CACHE", str(smollm2.cache_dir))
    assert main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "Full vs Quest(budget=1024, page_size=16" in out
    # Quest rewrites the graph as Full does: it runs on Full's graphs and compiles nothing
    assert re.search(r"Quest\(.*\): warm-up on 64 tokens \(the graphs compiled for Full serve it\)", out), out
    assert "compiled during the timed run" not in out, out
    answers = re.findall(r"^  answer:   '(.*)'$", out, flags=re.M)
    assert len(answers) == 2, out
    assert "7391" in answers[0], out  # Full finds the fact at 1k tokens (greedy, fp32: deterministic)
    assert re.search(r"^decode speed: Full [\d.]+ ms/token, Quest\(.*\) [\d.]+ ms/token: [\d.]+x (faster|slower)",
                     out, flags=re.M), out
    assert re.search(r"prefill:\s+[\d.]+ s\s+decode: [\d.]+ ms/token \(12 tokens", out), out


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

"""kvpass bench --compile-time: the table and, on the tiny model, the fresh-process plumbing."""

from __future__ import annotations

import json

import pytest

from kvpass.bench import compile_time as ct


def _row(backend, phase, seconds, graphs=3, hits=0, misses=3, tokens=(1, 2)):
    return {"backend": backend, "phase": phase, "seconds": seconds, "graphs": graphs, "fx_hits": hits,
            "fx_misses": misses, "tokens": list(tokens), "model": "tiny", "threads": 1, "prompt_tokens": 64,
            "new_tokens": 8}


def test_table_gives_ratios_to_plain_inductor_in_the_same_phase():
    rows = [_row("inductor", "cold", 80.0), _row("inductor", "warm", 16.0, hits=3, misses=0),
            _row("Full()", "cold", 100.0, graphs=2), _row("Full()", "warm", 20.0, graphs=2, hits=2, misses=0),
            _row("Quest(budget=8)", "cold", 40.0), _row("Quest(budget=8)", "warm", 8.0, tokens=(1, 3))]
    lines = ct.table(rows).splitlines()
    full = next(ln for ln in lines if ln.startswith("| kvpass(Full())"))
    assert [c.strip() for c in full.strip("|").split("|")] == ["kvpass(Full())", "100.0", "1.25x", "20.0", "1.25x",
                                                            "2", "2 / 0", "yes"]
    quest = next(ln for ln in lines if ln.startswith("| kvpass(Quest"))
    assert "0.50x" in quest and quest.rstrip(" |").endswith("NO")  # other tokens in the warm run
    inductor = next(ln for ln in lines if ln.startswith("| inductor"))
    assert [c.strip() for c in inductor.strip("|").split("|")][1:5] == ["80.0", "1.00x", "16.0", "1.00x"]


def test_bad_options_fail_before_any_process(tmp_path):
    from kvpass.cli import main

    assert main(["bench", "--compile-time", "--threads", "1,2", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--compile-time", "--policies", "Nope", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / ct.RESULTS).exists()


@pytest.mark.slow  # four fresh processes, each compiling a tiny Llama
def test_tiny_cold_and_warm_processes(tmp_path, capsys):
    from kvpass.cli import main

    out = tmp_path / "out"
    assert main(["bench", "--compile-time", "--model", "tiny", "--threads", "1", "--contexts", "12",
                 "--new-tokens", "3", "--out", str(out), "--no-progress"]) == 0
    rows = [json.loads(ln) for ln in (out / ct.RESULTS).read_text().splitlines()]
    by = {(r["backend"], r["phase"]): r for r in rows}
    assert set(by) == {(b, p) for b in ("inductor", "Full()") for p in ("cold", "warm")}
    for b in ("inductor", "Full()"):
        assert by[(b, "cold")]["fx_hits"] == 0 and by[(b, "cold")]["fx_misses"] > 0
        assert by[(b, "warm")]["fx_misses"] == 0 and by[(b, "warm")]["fx_hits"] == by[(b, "cold")]["graphs"]
    # greedy Full through kvpass gives plain Inductor's tokens, cold and warm
    assert by[("Full()", "cold")]["tokens"] == by[("inductor", "cold")]["tokens"] == by[("Full()", "warm")]["tokens"]
    # the owned cache's stubs are dynamic from the first decode on: one graph fewer per generate()
    assert by[("Full()", "cold")]["graphs"] == by[("inductor", "cold")]["graphs"] - 1
    assert by[("Full()", "warm")]["report_lines"] == by[("Full()", "cold")]["report_lines"] > 2
    printed = capsys.readouterr().out
    assert "| kvpass(Full()) |" in printed and "command: kvpass bench --compile-time --model tiny" in printed


def test_page_has_the_command_the_machine_and_the_table(tmp_path):
    machine = {"cpu_count": 2, "processor": "x86_64", "platform": "Linux", "python": "3.11", "torch": "2.13.0",
               "transformers": "5.18.0"}
    rows = [{**_row(b, p, s), "command": "kvpass bench --compile-time --model tiny", "machine": machine}
            for b, p, s in (("inductor", "cold", 80.0), ("inductor", "warm", 16.0), ("Full()", "cold", 90.0),
                            ("Full()", "warm", 20.0))]
    page = ct.write_md(rows, tmp_path / "docs" / "performance.md").read_text()
    assert "kvpass bench --compile-time --model tiny --results-md " in page
    assert "2 cores, 1 torch thread(s)" in page and "torch 2.13.0" in page
    assert ct.table(rows) in page
    assert "| kvpass(Full()) | 90.0 | 1.12x | 20.0 | 1.25x |" in page

"""kvpass.kernels.native: C kernels built once per machine, loaded again without compiling, rebuilt when
the cached file is damaged, and absent (the torch paths run) when turned off or without a compiler."""

from __future__ import annotations

import ast
import subprocess
import sys
import uuid

from kvpass.kernels import native


def _source(value: int) -> str:
    # a unique source per test: library() caches per process by source
    return f"/* {uuid.uuid4()} */\nint kvpass_probe(void) {{ return {value}; }}\n"


def test_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    src = _source(7)
    lib = native.library("probe", src)
    assert lib is not None and lib.kvpass_probe() == 7
    files = list((tmp_path / "native").glob("probe-*.so"))
    assert len(files) == 1
    assert native.library("probe", src) is lib  # one load per process
    stamp = files[0].stat().st_mtime_ns
    native._loaded.clear()  # a new process: loads the file, compiles nothing
    assert native.library("probe", src).kvpass_probe() == 7
    assert files[0].stat().st_mtime_ns == stamp


def test_a_damaged_file_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    src = _source(11)
    assert native.library("probe", src).kvpass_probe() == 11
    (path,) = (tmp_path / "native").glob("probe-*.so")
    native._loaded.clear()
    path.unlink()  # a new file, not the loaded one rewritten (which this process still maps)
    path.write_bytes(b"not a shared object")
    assert native.library("probe", src).kvpass_probe() == 11


def test_off_or_without_a_compiler_there_is_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    monkeypatch.setenv("KVPASS_NATIVE", "0")
    assert not native.enabled()
    assert native.library("probe", _source(1)) is None
    monkeypatch.delenv("KVPASS_NATIVE")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native.library("probe", _source(2)) is None
    assert not list((tmp_path / "native").glob("probe-*.so"))


def test_kernels_run_on_torchs_own_openmp_pool():
    """torch 2.13's CPU build runs its threads on GNU OpenMP: the kernels' parallel loops are built with
    it and take torch's pool (one libgomp in the process, torch's), not a second set of threads."""
    assert native.openmp_flags() == ["-fopenmp"]
    # a fresh interpreter: a test process may hold another package's libgomp too (lm-eval's scikit-learn)
    code = ("from kvpass.kernels import cpu_decode; assert cpu_decode.available(); "
            "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    gomp = ast.literal_eval(out.strip().splitlines()[-1])
    assert len(gomp) == 1 and "torch" in gomp[0], gomp

"""kvpass.kernels.native: C kernels built once per machine from kvpass/kernels/csrc, loaded again without
compiling, rebuilt when the cached file is damaged or a source changes, and absent (the torch paths run)
when turned off or without a compiler; the C is warning-free under the project's flags, and every argument
struct's ctypes mirror has the C layout."""

from __future__ import annotations

import ast
import ctypes
import os
import re
import subprocess
import sys
import uuid

import pytest

from kvpass.kernels import clusterkv, cpu_decode, native, quest, tailorkv


def _probe(root, value: int) -> None:
    # a csrc folder of its own: one probe.c and one header (a unique text: library() caches per process)
    root.mkdir(exist_ok=True)
    (root / "probe.h").write_text(f"/* {uuid.uuid4()} */\n#ifndef VALUE\n#define VALUE {value}\n#endif\n")
    (root / "probe.c").write_text('#include "probe.h"\nint kvpass_probe(void) { return VALUE; }\n')


def test_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    root = tmp_path / "csrc"
    _probe(root, 7)
    lib = native.library("probe", root=root)
    assert lib is not None and lib.kvpass_probe() == 7
    files = list((tmp_path / "native").glob("probe-*.so"))
    assert len(files) == 1
    assert native.library("probe", root=root) is lib  # one load per process
    stamp = files[0].stat().st_mtime_ns
    native._loaded.clear()  # a new process: loads the file, compiles nothing
    assert native.library("probe", root=root).kvpass_probe() == 7
    assert files[0].stat().st_mtime_ns == stamp


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    # the hash covers the headers, not only the .c file
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    root = tmp_path / "csrc"
    _probe(root, 3)
    assert native.library("probe", root=root).kvpass_probe() == 3
    (root / "probe.h").write_text((root / "probe.h").read_text().replace("VALUE 3", "VALUE 4"))
    native._loaded.clear()
    assert native.library("probe", root=root).kvpass_probe() == 4
    assert len(list((tmp_path / "native").glob("probe-*.so"))) == 2
    assert native.library("probe", {"VALUE": 5}, root=root).kvpass_probe() == 5  # a test's variant build
    assert len(list((tmp_path / "native").glob("probe-*.so"))) == 3


def test_a_damaged_file_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    root = tmp_path / "csrc"
    _probe(root, 11)
    assert native.library("probe", root=root).kvpass_probe() == 11
    (path,) = (tmp_path / "native").glob("probe-*.so")
    native._loaded.clear()
    path.unlink()  # a new file, not the loaded one rewritten (which this process still maps)
    path.write_bytes(b"not a shared object")
    assert native.library("probe", root=root).kvpass_probe() == 11


def test_off_or_without_a_compiler_there_is_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    root = tmp_path / "csrc"
    _probe(root, 1)
    monkeypatch.setenv("KVPASS_NATIVE", "0")
    assert not native.enabled()
    assert native.library("probe", root=root) is None
    monkeypatch.delenv("KVPASS_NATIVE")
    native._loaded.clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native.library("probe", root=root) is None
    assert native.library("no_such_file", root=root) is None
    assert not list((tmp_path / "native").glob("probe-*.so"))


def _cc() -> str:
    return os.environ.get("CC") or "cc"


@pytest.mark.parametrize("openmp", [True, False], ids=["openmp", "pthreads"])
@pytest.mark.parametrize("name", sorted(p.stem for p in native.CSRC.glob("*.c")))
def test_every_c_file_builds_without_a_warning(name, openmp, tmp_path):
    """Each csrc/*.c with the project's flags (both builds native makes: on torch's OpenMP, and the
    pthread fallback): any compiler output fails the test."""
    flags = [*native.FLAGS, *(["-fopenmp"] if openmp else [])]
    res = subprocess.run([_cc(), *flags, f"-I{native.CSRC}", str(native.CSRC / f"{name}.c"), "-o",
                          str(tmp_path / f"{name}.so"), "-lm"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert {"-Wall", "-Wextra"} <= set(native.FLAGS)


def _structs() -> list[type[ctypes.Structure]]:
    mods = (cpu_decode, clusterkv, quest, tailorkv)
    found = {v for m in mods for v in vars(m).values()
             if isinstance(v, type) and issubclass(v, ctypes.Structure) and hasattr(v, "c_name")}
    return sorted(found, key=lambda c: c.c_name)


def test_every_ctypes_struct_has_its_c_layout(tmp_path):
    """sizeof, and every field's offset and size, by name, from a C program built on kvpass.h, equal the
    ctypes mirror's (a field renamed, added, dropped or resized on one side fails here, or fails to compile)."""
    structs = _structs()
    header = (native.CSRC / "kvpass.h").read_text()
    declared = set(re.findall(r"^} (kvpass_\w+);", header, flags=re.M))
    assert {c.c_name for c in structs} == declared  # every struct of the header has its mirror
    assert len(declared) >= 11
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvpass.h"', "int main(void) {"]
    for c in structs:
        lines.append(f'    printf("{c.c_name} sizeof %zu\\n", sizeof({c.c_name}));')
        for f in c._fields_:
            lines.append(f'    printf("{c.c_name} {f[0]} %zu %zu\\n", offsetof({c.c_name}, {f[0]}), '
                         f'sizeof((({c.c_name} *)0)->{f[0]}));')
    lines.append("    return 0;\n}")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    flags = [f for f in native.FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([_cc(), *flags, f"-I{native.CSRC}", str(src), "-o", str(tmp_path / "layout"), "-lm"],
                   check=True, capture_output=True, timeout=120)
    got = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout.split("\n")
    c_layout = {tuple(ln.split()[:2]): tuple(map(int, ln.split()[2:])) for ln in got if ln}
    py_layout = {}
    for c in structs:
        py_layout[(c.c_name, "sizeof")] = (ctypes.sizeof(c),)
        for f in c._fields_:
            py_layout[(c.c_name, f[0])] = (getattr(c, f[0]).offset, getattr(c, f[0]).size)
    assert py_layout == c_layout


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

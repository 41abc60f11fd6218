"""The CPU kernels in C, built once per machine and loaded with ctypes.

The C lives in ``kvpass/kernels/csrc/``: one file per kernel module (``cpu_decode.c``, ``clusterkv.c``,
``quest.c``, ``tailorkv.c``) and one header, ``kvpass.h``, for what they share (the vector helpers, the
softmax pieces, the listed-rows attention) and for every argument struct an entry point takes; each struct
is mirrored by a ``ctypes.Structure`` in the kernel's Python file. The files ship as package data and are
read when a library is first asked for, not at import. :func:`library` compiles ``csrc/<name>.c`` with the
C compiler Inductor's CPU backend uses (``$CC``, else ``cc``; :data:`FLAGS`: ``-O3 -march=native``, IEEE
arithmetic, ``-Wall -Wextra``, torch's OpenMP where torch runs on it, else pthreads: :func:`openmp_flags`)
into ``$KVPASS_CACHE/native`` (default ``~/.cache/kvpass/native``), named by a hash of the sources (the
file and the header), the compiler, the flags and the CPU's feature flags, so that a changed source or
another CPU gets its own file; a second process loads the file without compiling. ``KVPASS_NATIVE=0``
turns every C kernel off, and a machine without a working compiler has none: the callers then run their
torch code (the same results; docs/design.md, "Fused decode attention on CPU").

The loaded libraries are a per-process cache of build artifacts (like Triton's kernel cache), not state
of any backend: they hold no data between calls.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["CSRC", "FLAGS", "enabled", "fields", "function", "library", "openmp_flags", "sources"]

# no -ffast-math: the kernels keep IEEE arithmetic (their exp is their own, vectorised); the C is -Wall
# -Wextra clean (tests/test_native.py fails on any warning)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread", "-Wall",
         "-Wextra"]

CSRC = Path(__file__).with_name("csrc")  # the C files and their header, shipped as package data

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_functions: dict[tuple, object] = {}


def fields(spec: str) -> list[tuple[str, type]]:
    """A ``ctypes.Structure``'s ``_fields_`` from the C struct's field names in order, a pointer marked by a
    trailing ``*`` (``void *``), the others ``int64_t``: ``fields("q* qs_b qs_h")``."""
    return [(n[:-1], ctypes.c_void_p) if n.endswith("*") else (n, ctypes.c_int64) for n in spec.split()]


def enabled() -> bool:
    """False when ``KVPASS_NATIVE=0`` turns the C kernels off."""
    return os.environ.get("KVPASS_NATIVE", "1") != "0"


def _cache_dir() -> Path:
    root = os.environ.get("KVPASS_CACHE") or Path.home() / ".cache" / "kvpass"
    return Path(root) / "native"


def _cpu_key() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((ln for ln in lines if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def openmp_flags() -> list[str]:
    """``["-fopenmp"]`` where torch runs its threads on GNU OpenMP (its ``libgomp`` is loaded in this
    process, Linux), else ``[]``. A kernel's parallel loop then runs on torch's own, warm pool: the library
    needs ``libgomp.so.1``, which the loader resolves to the copy torch loaded. With pthreads instead, a
    kernel's threads met torch's pool spinning on the same cores after each of its ops (TailorKV's
    batch-8 attention ran 1.8x slower inside the model than alone; docs/design.md, "TailorKV on CPU")."""
    import torch

    if platform.system() != "Linux" or not torch.backends.openmp.is_available():
        return []
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return ["-fopenmp"] if "libgomp" in maps else []


def sources(name: str, root: Path | None = None) -> str:
    """The text a build of ``<root>/<name>.c`` reads: the file, then every header beside it (sorted by
    name), each after its name. ``root``: default :data:`CSRC`."""
    root = CSRC if root is None else Path(root)
    files = [root / f"{name}.c", *sorted(root.glob("*.h"))]
    return "".join(f"// {f.name}\n{f.read_text()}" for f in files)


def _build(name: str, root: Path, defines: tuple[str, ...]) -> Path | None:
    try:
        text = sources(name, root)
    except OSError:  # a file missing from the installed package: no C kernels
        return None
    omp = openmp_flags()
    path = _compile(name, root, text, [*FLAGS, *omp, *defines])
    if path is None and omp:  # a compiler without OpenMP: the pthread loops
        path = _compile(name, root, text, [*FLAGS, *defines])
    return path


def _compile(name: str, root: Path, text: str, flags: list[str]) -> Path | None:
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256("\0".join([text, cc, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{name}-{key}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            so = Path(tmp) / path.name
            subprocess.run([cc, *flags, f"-I{root}", str(root / f"{name}.c"), "-o", str(so), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(so, path)  # atomic: a process building the same key at once gets a whole file
    except (OSError, subprocess.SubprocessError):  # no compiler, a failed build, a cache not writable
        return None
    return path


def _defines(defines: dict[str, object] | None) -> tuple[str, ...]:
    return tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))


def library(name: str, defines: dict[str, object] | None = None, root: Path | None = None) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c`` (built on first use), or None where C kernels are off or cannot be
    built. ``defines``: macros passed as ``-D`` (a test's variant build); ``root``: another folder of C
    files (default :data:`CSRC`). One load per process and (name, defines, root)."""
    root = CSRC if root is None else Path(root)
    flags = _defines(defines)
    key = f"{name}:{root}:{flags}"
    if key in _loaded:
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            path = _build(name, root, flags) if enabled() else None
            lib = None
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError:  # a damaged file in the cache: build it again, once
                    path.unlink(missing_ok=True)
                    path = _build(name, root, flags)
                    lib = ctypes.CDLL(str(path)) if path is not None else None
            _loaded[key] = lib
        return _loaded[key]


def function(name: str, symbol: str, argtypes: list, restype=ctypes.c_int,
             defines: dict[str, object] | None = None):
    """The C function ``symbol`` of :func:`library` ``(name, defines)`` with its ctypes signature, or None
    where C kernels are off or cannot be built. Made once per process."""
    key = (name, symbol) if defines is None else (name, symbol, _defines(defines))  # no work per call
    if key not in _functions:
        lib = library(name, defines)
        fn = None
        if lib is not None:
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = argtypes, restype
        _functions[key] = fn
    return _functions[key]

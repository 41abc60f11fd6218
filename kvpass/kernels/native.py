"""Small C kernels for the CPU paths, built once per machine and loaded with ctypes.

A kernel file that has a C counterpart of its Triton kernel (``cpu_decode.py``, ``clusterkv.py``) keeps
its C source beside the Triton one and gets the library from :func:`library`. The library is compiled
with the C compiler Inductor's CPU backend uses (``$CC``, else ``cc``; ``-O3 -march=native``, IEEE
arithmetic, torch's OpenMP where torch runs on it, else pthreads: :func:`openmp_flags`) into ``$KVPASS_CACHE/native`` (default ``~/.cache/kvpass/native``), named by a
hash of the source, the compiler, the flags and the CPU's feature flags, so that a changed source or
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

__all__ = ["FLAGS", "VECTOR", "enabled", "function", "library", "openmp_flags"]

# no -ffast-math: the kernels keep IEEE arithmetic (their exp is their own, vectorised)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-pthread"]

# fp32 vectors of the machine's width (GCC/Clang vector extensions) for the kernels' sums: C does not
# reorder a float sum by itself, so a dot product vectorises only when written in lanes. Needs <string.h>
# and <stdint.h>.
VECTOR = r"""
/* VW float lanes, the machine's own vector width: a vector wider than the hardware's is emulated
   through the stack (a 16-lane vector on an AVX2 core ran the decode attention at 100 ns a row) */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef float v4 __attribute__((vector_size(16)));
static inline vf loadv(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void storev(float *p, vf x) { memcpy(p, &x, sizeof x); }
/* the VW lanes of x summed down to 4 (lane i + lane i + 4 + ...), then to one */
static inline v4 fold4(vf x) {
#if VW == 16
    typedef float v8 __attribute__((vector_size(32)));
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif VW == 8
    return __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
#else
    return x;
#endif
}
static inline float hsumv(vf x) {
    v4 b = fold4(x);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
/* sum of r[d] * m[d] over n values: VW lanes at a time (n % VW == 0), else one at a time (a scalar sum
   is one chain of n dependent adds: the compiler may not reorder float additions) */
static inline float dot(const float *r, const float *m, int64_t n) {
    if (n % VW == 0) {
        vf acc = loadv(r) * loadv(m);
        for (int64_t d = VW; d < n; d += VW) acc += loadv(r + d) * loadv(m + d);
        return hsumv(acc);
    }
    float acc = 0.f;
    for (int64_t d = 0; d < n; d++) acc += r[d] * m[d];
    return acc;
}
/* dot with four chains of adds where n % (4 VW) == 0 (another order of the sum): one chain waits on each
   add's latency, four keep the vector unit busy; the rows still read in order, which the hardware
   prefetcher follows (four rows side by side, read cold, it did not) */
static inline float dot_wide(const float *r, const float *m, int64_t n) {
    if (n % (4 * VW) != 0) return dot(r, m, n);
    vf a0 = loadv(r) * loadv(m), a1 = loadv(r + VW) * loadv(m + VW), a2 = loadv(r + 2 * VW) * loadv(m + 2 * VW),
       a3 = loadv(r + 3 * VW) * loadv(m + 3 * VW);
    for (int64_t d = 4 * VW; d < n; d += 4 * VW) {
        a0 += loadv(r + d) * loadv(m + d);
        a1 += loadv(r + d + VW) * loadv(m + d + VW);
        a2 += loadv(r + d + 2 * VW) * loadv(m + d + 2 * VW);
        a3 += loadv(r + d + 3 * VW) * loadv(m + d + 3 * VW);
    }
    return hsumv((a0 + a1) + (a2 + a3));
}
"""

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_functions: dict[tuple, object] = {}


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


def _build(name: str, source: str) -> Path | None:
    omp = openmp_flags()
    path = _compile(name, source, FLAGS + omp)
    if path is None and omp:  # a compiler without OpenMP: the pthread loops
        path = _compile(name, source, FLAGS)
    return path


def _compile(name: str, source: str, flags: list[str]) -> Path | None:
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256("\0".join([source, cc, *flags, _cpu_key()]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{name}-{key}.so"
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            so = Path(tmp) / path.name
            subprocess.run([cc, *flags, str(src), "-o", str(so), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(so, path)  # atomic: a process building the same key at once gets a whole file
    except (OSError, subprocess.SubprocessError):  # no compiler, a failed build, a cache not writable
        return None
    return path


def library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled ``source`` (built on first use), or None where C kernels are off or cannot be built."""
    key = f"{name}:{hashlib.sha256(source.encode()).hexdigest()}"
    if key in _loaded:
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            path = _build(name, source) if enabled() else None
            lib = None
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError:  # a damaged file in the cache: build it again, once
                    path.unlink(missing_ok=True)
                    path = _build(name, source)
                    lib = ctypes.CDLL(str(path)) if path is not None else None
            _loaded[key] = lib
        return _loaded[key]


def function(name: str, source: str, symbol: str, argtypes: list, restype=ctypes.c_int):
    """The C function ``symbol`` of :func:`library` ``(name, source)`` with its ctypes signature, or None
    where C kernels are off or cannot be built. Made once per process."""
    key = (name, symbol, hash(source), len(source))  # a str caches its hash: no work per call
    if key not in _functions:
        lib = library(name, source)
        fn = None
        if lib is not None:
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = argtypes, restype
        _functions[key] = fn
    return _functions[key]

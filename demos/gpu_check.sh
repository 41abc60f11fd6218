#!/usr/bin/env bash
# GPU check for the kvpass kernels and CUDA graphs; each step has a timeout (330, 90, 120, 240 s on CUDA).
#
# On a CUDA machine:
#   1. every kernel test file (TESTS below) with the real Triton kernels (TRITON_INTERPRET=0;
#      tests/conftest.py only *defaults* it to 1, and kvpass/kernels/_triton.py decides at import
#      time), hypothesis profile ci, one pytest process per file in parallel (Triton compiles each
#      kernel specialisation on the host; five processes compile on five cores).
#      The kernel tests build their inputs on the CPU, so a pytest plugin written by this script wraps
#      every Triton launcher (LAUNCHERS in the plugin) to copy CPU inputs to the GPU (whole storage, so
#      strides, offsets and the NaN-filled gaps of strided inputs survive; QuantizedKV fields too),
#      launch there and copy the results back: the real kernels are checked against the CPU
#      references the tests use. The drivers that call launchers (cosine_kmeans, merge_round,
#      centroid_decode_attention with use_triton=True) look them up as module globals at call time,
#      so they reach the wrappers; the plugin also rebinds every other kvpass module attribute that
#      holds a launcher (centroid.py's own `sparse_decode_attention`). Each process reports its
#      launcher call counts, and the check fails if a launcher was never called through a wrapper.
#      The *errors tests (argument checks on CPU tensors, and that a CPU tensor is refused without
#      the interpreter) run without the plugin, under the interpreter.
#   2. python -m kvpass.bench.kernels --device cuda (timings, bandwidth against the device's peak).
#   3. python -m kvpass.bench.cudagraphs --device cuda: torch.compile(..., mode="reduce-overhead") (CUDA
#      graphs, captured between the kvpass ops) for Full, Quest and ClusterKV on a random 4-layer Llama:
#      the same greedy tokens as the default mode, CUDA graphs recorded, none in the steady half of the
#      decode, and each mode's ms/token.
# Without CUDA: the kernel tests under the Triton interpreter, the quick CPU benchmark (one thread:
# with two threads on a busy 2-core machine, OpenMP waits turn timings into multiples of ~8 ms) and the
# CUDA graphs check on the CPU (Inductor skips the graphs there: it shows the mode reaches Inductor).
#
# Usage: demos/gpu_check.sh from any directory. It runs .venv/bin/python where `make` built it, else the
# machine's python3 with its own torch and Triton (kvpass from this checkout on PYTHONPATH); PYTHON=...
# overrides. It prints the versions first.
#   demos/gpu_check.sh --write-plugin DIR   only writes DIR/kvpass_cuda_launch.py and exits. With
#   KVPASS_LAUNCH_DEVICE=cpu the plugin copies to (new) CPU tensors instead and simulates the GPU
#   run on a CPU machine: the kernels are decorated under TRITON_INTERPRET=1, the plugin then sets
#   TRITON_INTERPRET=0 and lets only the wrapped calls see 1, so a launcher call that bypasses the
#   wrappers fails exactly as a CPU tensor would on the GPU run:
#     TRITON_INTERPRET=1 KVPASS_LAUNCH_DEVICE=cpu PYTHONPATH=DIR .venv/bin/python -m pytest \
#         -p kvpass_cuda_launch -k "not errors" tests/test_kernel_quest.py
set -euo pipefail
cd "$(dirname "$0")/.."
# the project's venv where `make` built one; otherwise the machine's own python3 with whatever torch and
# Triton it has, kvpass imported from this checkout
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import sys, torch; import importlib.util as u; t = u.find_spec('triton'); \
import importlib; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', \
importlib.import_module('triton').__version__ if t else 'absent', '| CUDA', torch.version.cuda, \
'| device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
export HYPOTHESIS_PROFILE=ci
TESTS=(tests/test_kernel_sparse_attention.py tests/test_kernel_quest.py tests/test_kernel_clusterkv.py
       tests/test_kernel_centroid.py tests/test_kernel_tailorkv.py)

write_plugin() {
    cat > "$1/kvpass_cuda_launch.py" <<'PYEOF'
"""pytest plugin (demos/gpu_check.sh): run the Triton launchers on device copies of CPU test inputs.

KVPASS_LAUNCH_DEVICE (default cuda): where the copies go; "cpu" simulates the GPU run on a CPU
machine under the interpreter (see demos/gpu_check.sh). KVPASS_LAUNCH_COUNTS: a file to which the
launcher call counts are written as JSON at the end of the session.
"""
import collections
import dataclasses
import functools
import importlib
import json
import os
import sys

import torch

DEVICE = os.environ.get("KVPASS_LAUNCH_DEVICE", "cuda")
SIMULATE = DEVICE == "cpu"
LAUNCHERS = {
    "kvpass.kernels.sparse_attention": ("sparse_decode_attention",),
    "kvpass.kernels.quest": ("quest_page_scores",),
    "kvpass.kernels.clusterkv": ("kmeans_assign", "centroid_update", "select_clusters"),
    "kvpass.kernels.centroid": ("chunk_match", "merge_scatter"),
    "kvpass.kernels.tailorkv": ("quantize_pack", "quant_decode_attention", "partial_topk"),
}
calls = collections.Counter()
rebound = []


def _map(x, fn):
    """fn applied to every tensor in x (tensors, tuples, lists, dicts, dataclass instances)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(
            x, **{f.name: _map(getattr(x, f.name), fn) for f in dataclasses.fields(x) if f.init}
        )
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_map(v, fn) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def to_device(t, device=None):
    """A copy of CPU tensor t on device: the whole storage is copied, so strides, offset and the
    (NaN-filled) gaps of a strided view survive. Non-CPU tensors pass through."""
    if t.device.type != "cpu":
        return t
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
    return flat.to(device or DEVICE, copy=True).as_strided(t.shape, t.stride(), t.storage_offset())


def on_device(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        args, kwargs = _map(args, to_device), _map(kwargs, to_device)
        prev = os.environ.get("TRITON_INTERPRET")
        if SIMULATE:
            os.environ["TRITON_INTERPRET"] = "1"  # only the wrapped launch may use the interpreter
        try:
            out = fn(*args, **kwargs)
            if DEVICE.startswith("cuda"):
                torch.cuda.synchronize()
        finally:
            if SIMULATE:
                os.environ["TRITON_INTERPRET"] = prev if prev is not None else "0"
        return _map(out, lambda t: t.cpu())

    wrapper.__wrapped_launcher__ = fn
    return wrapper


def wrap_launchers():
    """Replace every launcher in LAUNCHERS by its wrapper, in its module and in every loaded kvpass
    module that bound it under any name (``from .sparse_attention import sparse_decode_attention``)."""
    by_id = {}
    for mod_name, names in LAUNCHERS.items():
        mod = importlib.import_module(mod_name)
        for name in names:
            fn = getattr(mod, name)
            if hasattr(fn, "__wrapped_launcher__"):
                continue  # already wrapped
            by_id[id(fn)] = (fn, on_device(fn, f"{mod_name.rsplit('.', 1)[1]}.{name}"))
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "kvpass" or mod_name.startswith("kvpass.")):
            continue
        for attr, val in list(vars(mod).items()):
            hit = by_id.get(id(val))
            if hit is not None and hit[0] is val:
                setattr(mod, attr, hit[1])
                rebound.append(f"{mod_name}.{attr}")
    return [w for _, w in by_id.values()]


def pytest_configure(config):
    wrap_launchers()
    if SIMULATE:
        os.environ["TRITON_INTERPRET"] = "0"  # kernels are already decorated (interpreted)


def pytest_terminal_summary(terminalreporter):
    counts = ", ".join(f"{k}={v}" for k, v in sorted(calls.items())) or "none"
    terminalreporter.write_line(f"kvpass_cuda_launch: launcher calls on {DEVICE}: {counts}")


def pytest_sessionfinish(session):
    path = os.environ.get("KVPASS_LAUNCH_COUNTS")
    if path:
        with open(path, "w") as f:
            json.dump(dict(calls), f)
PYEOF
}

if [[ "${1:-}" == "--write-plugin" ]]; then
    write_plugin "${2:?usage: demos/gpu_check.sh --write-plugin DIR}"
    exit 0
fi

start=$SECONDS
status=0

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=0
    "$PY" -c "import torch; print('CUDA:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
    plugdir="$(mktemp -d)"
    trap 'rm -rf "$plugdir"' EXIT
    write_plugin "$plugdir"
    echo "== 1/3 kernel tests, compiled Triton on CUDA (TRITON_INTERPRET=0, hypothesis profile ci)"
    pids=()
    for i in "${!TESTS[@]}"; do
        PYTHONPATH="$plugdir${PYTHONPATH:+:$PYTHONPATH}" KVPASS_LAUNCH_COUNTS="$plugdir/counts$i.json" \
            timeout 330 "$PY" -m pytest -q -p no:cacheprovider -p kvpass_cuda_launch -k "not errors" \
            "${TESTS[$i]}" > "$plugdir/log$i.txt" 2>&1 &
        pids+=($!)
    done
    for i in "${!TESTS[@]}"; do
        rc=0
        wait "${pids[$i]}" || rc=$?
        echo "-- ${TESTS[$i]} (exit $rc)"
        tail -n 40 "$plugdir/log$i.txt"
        [[ $rc -eq 0 ]] || status=$rc
    done
    # every wrapped launcher must have been called (through its wrapper) by some test file
    "$PY" - "$plugdir" <<'PYEOF' || status=1
import glob, json, os, sys
sys.path.insert(0, sys.argv[1])
from kvpass_cuda_launch import LAUNCHERS
total = {}
for p in glob.glob(os.path.join(sys.argv[1], "counts*.json")):
    for k, v in json.load(open(p)).items():
        total[k] = total.get(k, 0) + v
want = [f"{m.rsplit('.', 1)[1]}.{n}" for m, names in LAUNCHERS.items() for n in names]
missing = [w for w in want if not total.get(w)]
print("launcher calls on cuda:", ", ".join(f"{w}={total.get(w, 0)}" for w in want))
if missing:
    print("gpu_check: launchers never called through the CUDA wrappers:", ", ".join(missing))
    sys.exit(1)
PYEOF
    # argument checks only (nothing launches); their CPU inputs pass the availability check only under
    # the interpreter, and some then set TRITON_INTERPRET=0 themselves to see a CPU tensor refused
    echo "== argument-check tests (-k errors), Triton interpreter, no plugin"
    TRITON_INTERPRET=1 timeout 90 "$PY" -m pytest -q -p no:cacheprovider -k errors "${TESTS[@]}" || status=$?
    echo "== 2/3 kernel benchmark (CUDA)"
    timeout 120 "$PY" -m kvpass.bench.kernels --device cuda || status=$?
    echo "== 3/3 CUDA graphs: mode='reduce-overhead' with Full, Quest, ClusterKV"
    timeout 240 "$PY" -m kvpass.bench.cudagraphs --device cuda || status=$?
else
    export TRITON_INTERPRET=1
    echo "no CUDA device: kernel tests under the Triton interpreter, quick CPU benchmark, CUDA graphs check on the CPU"
    echo "== 1/3 kernel tests, Triton interpreter (TRITON_INTERPRET=1, hypothesis profile ci)"
    timeout 600 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" || status=$?
    echo "== 2/3 kernel benchmark (CPU, quick)"
    timeout 60 "$PY" -m kvpass.bench.kernels --device cpu --quick --threads 1 || status=$?
    echo "== 3/3 CUDA graphs check on the CPU (the mode reaches Inductor, which skips the graphs)"
    timeout 300 "$PY" -m kvpass.bench.cudagraphs --device cpu || status=$?
fi
echo "gpu_check: exit status $status, $((SECONDS - start)) s"
exit "$status"

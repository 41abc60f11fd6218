#!/usr/bin/env bash
# GPU check for the kvpass kernels, in well under 8 minutes.
#
# On a CUDA machine:
#   1. the kernel tests with the real Triton kernels (TRITON_INTERPRET=0; tests/conftest.py only
#      *defaults* it to 1, and kvpass/kernels/_triton.py decides at import time), hypothesis profile ci.
#      The kernel tests build their inputs on the CPU, so a pytest plugin written by this script wraps
#      the two launchers to copy CPU inputs to the GPU (storage, strides and offset kept), launch there
#      and copy the result back: the real kernels are checked against the CPU references the tests
#      use. test_launcher_errors (argument checks on CPU tensors, and that a CPU tensor is refused
#      without the interpreter) runs without the plugin, under the interpreter.
#   2. python -m kvpass.bench.kernels --device cuda (timings, bandwidth against the device's peak).
# Without CUDA: the kernel tests under the Triton interpreter and the quick CPU benchmark (one thread:
# with two threads on a busy 2-core machine, OpenMP waits turn timings into multiples of ~8 ms).
#
# Usage, from the repository root of a checkout whose venv is .venv:  demos/gpu_check.sh
# (PYTHON=/path/to/python overrides the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HYPOTHESIS_PROFILE=ci
TESTS=(tests/test_kernel_sparse_attention.py tests/test_kernel_quest.py)
start=$SECONDS
status=0

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=0
    "$PY" -c "import torch; print('CUDA:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
    plugdir="$(mktemp -d)"
    trap 'rm -rf "$plugdir"' EXIT
    cat > "$plugdir/kvpass_cuda_launch.py" <<'PYEOF'
"""pytest plugin (demos/gpu_check.sh): run the Triton launchers on CUDA copies of CPU test inputs."""
import functools

import torch


def _to_cuda(t):
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return t
    # copy the whole storage so that strides, offsets and the NaN-filled gaps of strided inputs survive
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
    return flat.cuda().as_strided(t.shape, t.stride(), t.storage_offset())


def _on_cuda(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*[_to_cuda(a) for a in args], **{k: _to_cuda(v) for k, v in kwargs.items()})
        torch.cuda.synchronize()
        return out.cpu()

    return wrapper


def pytest_configure(config):
    from kvpass.kernels import quest, sparse_attention

    sparse_attention.sparse_decode_attention = _on_cuda(sparse_attention.sparse_decode_attention)
    quest.quest_page_scores = _on_cuda(quest.quest_page_scores)
PYEOF
    echo "== 1/2 kernel tests, compiled Triton on CUDA (TRITON_INTERPRET=0, hypothesis profile ci)"
    PYTHONPATH="$plugdir${PYTHONPATH:+:$PYTHONPATH}" timeout 300 "$PY" -m pytest -q -p kvpass_cuda_launch \
        -k "not test_launcher_errors" "${TESTS[@]}" || status=$?
    # argument checks only (nothing launches); its CPU inputs pass the availability check only under
    # the interpreter, and it then sets TRITON_INTERPRET=0 itself to see a CPU tensor refused
    TRITON_INTERPRET=1 timeout 60 "$PY" -m pytest -q -k test_launcher_errors "${TESTS[@]}" || status=$?
    echo "== 2/2 kernel benchmark (CUDA)"
    timeout 150 "$PY" -m kvpass.bench.kernels --device cuda || status=$?
else
    export TRITON_INTERPRET=1
    echo "no CUDA device: kernel tests under the Triton interpreter, quick CPU benchmark"
    echo "== 1/2 kernel tests, Triton interpreter (TRITON_INTERPRET=1, hypothesis profile ci)"
    timeout 360 "$PY" -m pytest -q "${TESTS[@]}" || status=$?
    echo "== 2/2 kernel benchmark (CPU, quick)"
    timeout 60 "$PY" -m kvpass.bench.kernels --device cpu --quick --threads 1 || status=$?
fi
echo "gpu_check: exit status $status, $((SECONDS - start)) s"
exit "$status"

import atexit
import os
import shutil
import tempfile
import time
from types import SimpleNamespace

# Each test session (each xdist worker) compiles into an Inductor cache directory of its own, which its
# subprocesses inherit: kvpass caches compiled graphs by default, and a hit in a cache left by an
# earlier session would skip the pass whose counters and rewrites the tests assert.
_inductor_cache = tempfile.mkdtemp(prefix="kvpass-test-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

# The Triton kernels run under the interpreter on this CPU-only machine; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("dev", max_examples=20, deadline=None)
settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# Under pytest-xdist (`make test` runs one worker per core) each worker gets one thread: most of a
# test's time is single-threaded compilation, and two workers of two threads would oversubscribe.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean dynamo cache (recompile limits are per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once per test run into a fresh temporary cache.

    Returns a namespace with ``cache_dir`` (the cache root to pass as ``load_smollm2(cache_dir=...)``;
    reloading from it takes well under a second), ``model`` and ``tokenizer`` (fp32, sdpa, eval; shared
    by every test of the session, so a test that changes the model must load its own copy from
    ``cache_dir``) and ``first_load_s`` (seconds taken by the converting load).
    """
    from kvpass.models import load_smollm2

    cache_dir = tmp_path_factory.mktemp("kvpass_cache")
    start = time.perf_counter()
    model, tokenizer = load_smollm2(cache_dir=cache_dir, progress=False)
    first_load_s = time.perf_counter() - start
    return SimpleNamespace(cache_dir=cache_dir, model=model, tokenizer=tokenizer, first_load_s=first_load_s)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine OpenMP's spinning
    threads made small ops up to 20x slower (measured on decode steps)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

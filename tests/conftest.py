import atexit
import os
import shutil
import tempfile
from types import SimpleNamespace

# Each test session (each xdist worker) compiles into an Inductor cache directory of its own, which its
# subprocesses inherit: kvpass caches compiled graphs by default, and a hit in a cache left by an
# earlier session would skip the pass whose counters and rewrites the tests assert.
_inductor_cache = tempfile.mkdtemp(prefix="kvpass-test-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

# The Triton kernels run under the interpreter on this CPU-only machine; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor compiles its C++ kernels in this process: its default pool of compile workers imports torch
# once per core in every test process (and every subprocess), about 9 s of CPU each time on a busy
# 2-core machine, while pytest-xdist already keeps both cores busy. The generated code is the same.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

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


#: The fixtures of models compiled once per test process: their tests keep dynamo's cache.
KEEP_DYNAMO = frozenset({"smollm2_compiled", "compiled_tiny", "padded_compiled"})


#: Files whose tests are the longest single ones (a SmolLM2 compile, a torchrun launch, a 16-step logged
#: decode of every policy): they run first, so that the run does not end on one of them while the other
#: xdist worker has nothing left.
FIRST = ("test_smollm2.py", "test_tp.py", "test_decode_syncs.py")


def pytest_collection_modifyitems(items):
    """Reorders the run: the files of ``FIRST`` first; then the tests on ``padded_compiled``
    (tests/test_padded.py, tests/test_robustness.py) one after another, from the first one's place: a
    test between two of them resets dynamo (``_fresh_dynamo``), and the next would trace its graphs
    again. Every xdist worker reorders the same way."""
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the collection order otherwise

    def shares(item):
        return "padded_compiled" in getattr(item, "fixturenames", ())

    first = next((i for i, item in enumerate(items) if shares(item)), None)
    if first is not None:
        group = [item for item in items if shares(item)]
        rest = [item for item in items if not shares(item)]
        items[:] = rest[:first] + group + rest[first:]


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    """Each test compiles from a clean dynamo cache (recompile limits are per code object), except the
    tests on a model compiled once per process (a fixture of ``KEEP_DYNAMO``): a reset would drop its
    graphs. A test between two of them resets as usual; the next one then compiles again (slower, still
    correct: the same backend, whose graphs Inductor's cache then serves)."""
    keep = not KEEP_DYNAMO.isdisjoint(request.fixturenames)
    if not keep:
        torch._dynamo.reset()
    yield
    if not keep:
        torch._dynamo.reset()


@pytest.fixture(scope="session")
def run_tmp(tmp_path_factory):
    """A temporary directory shared by every xdist worker of the run (alone: the session's base), for
    work done once per run under a file lock (the SmolLM2 conversion, the torchrun launch of test_tp)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # a worker's base is <run>/popen-gwN; <run> is shared by the run's workers
    return root


@pytest.fixture(scope="session")
def smollm2(run_tmp):
    """SmolLM2-135M-Instruct converted once per test run into a fresh temporary cache.

    The xdist workers of a run share the cache (a file lock makes the others wait for the first one's
    conversion, which takes minutes on a busy machine; then each reloads it in about a second).
    Returns a namespace with ``cache_dir`` (the cache root to pass as ``load_smollm2(cache_dir=...)``),
    ``model`` and ``tokenizer`` (fp32, sdpa, eval; shared by every test of the process, so a test that
    changes the model must load its own copy from ``cache_dir``).
    """
    from filelock import FileLock

    from kvpass.models import load_smollm2

    root = run_tmp
    cache_dir = root / "kvpass_cache"
    with FileLock(str(root / "kvpass_cache.lock")):  # beside the cache: test_models lists its folder
        cache_dir.mkdir(exist_ok=True)
        model, tokenizer = load_smollm2(cache_dir=cache_dir, progress=False)
    return SimpleNamespace(cache_dir=cache_dir, model=model, tokenizer=tokenizer)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine OpenMP's spinning
    threads made small ops up to 20x slower (measured on decode steps)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class CompiledSmolLM2:
    """The session's SmolLM2 through the README's path: ``torch.compile(model.forward,
    backend=kvpass(Full(), strict=True))`` and ``model.generate``. The compiled forward is installed
    only for the length of :meth:`generate`, so the other users of ``smollm2.model`` stay eager."""

    def __init__(self, smollm2):
        from kvpass import Full, kvpass
        from kvpass.bench.prompts import build_prompt

        self.model, self.tokenizer = smollm2.model, smollm2.tokenizer
        self.backend = kvpass(Full(), strict=True)
        self.forward = torch.compile(self.model.forward, backend=self.backend)
        # one prompt for every test: another length would compile the prefill again (dynamic shapes)
        text, _, _ = build_prompt(self.tokenizer, 256)
        self.inputs = self.tokenizer(text, return_tensors="pt")
        self.new_tokens = 10
        self._eager = None

    def _generate(self, **kw):
        return self.model.generate(**self.inputs, max_new_tokens=self.new_tokens,
                                   min_new_tokens=self.new_tokens, do_sample=False, **kw)

    def eager(self) -> torch.Tensor:
        """Greedy tokens of plain eager ``generate`` (prompt then new tokens), computed once."""
        if self._eager is None:
            self._eager = self._generate()
        return self._eager

    def generate(self, policy) -> tuple[torch.Tensor, list[dict]]:
        """Greedy tokens through the compiled forward under ``policy`` (swapped in with ``set_policy``,
        so it must share Full's ``graph_key()``; every site starts afresh), and the report rows."""
        self.backend.set_policy(policy)
        fwd = self.model.forward
        self.model.forward = self.forward
        try:
            out = self._generate()
        finally:
            self.model.forward = fwd
        return out, self.backend.report_rows()


@pytest.fixture(scope="session")
def smollm2_compiled(smollm2):
    """SmolLM2 compiled with kvpass once per test process (each xdist worker), for the tests that run
    the real model in the default run (tests/test_smollm2.py): see :class:`CompiledSmolLM2`. Tests
    that use it keep dynamo's cache (``_fresh_dynamo``)."""
    return CompiledSmolLM2(smollm2)


class CompiledTiny:
    """One tiny Llama compiled once per test process, one ``kvpass(policy, strict=..., **options)``
    backend per ``graph_key()`` and option set; :meth:`forward` swaps the policy in with ``set_policy``
    (every site starts afresh), so the tests of a graph key share its graphs (prefill, decode, and the
    batch sizes and lengths that earlier tests made dynamic). Several batch sizes and backends on one
    forward compile more graphs than dynamo's default recompile limit allows: these compiles have
    their own."""

    def __init__(self, model):
        self.model = model
        self._compiled: dict = {}

    def forward(self, policy, strict=True, **options):
        """``(backend, compiled forward)`` for ``policy``: install the forward as ``model.forward`` for a
        run (tests/tiny.py's ``generate`` takes the backend and compiles anew), or call it directly."""
        from kvpass import kvpass

        key = (policy.graph_key(), strict, tuple(sorted(options.items())))
        if key not in self._compiled:
            be = kvpass(policy, strict=strict, **options)
            self._compiled[key] = be, torch.compile(self.model.forward, backend=be, recompile_limit=64)
        be, fwd = self._compiled[key]
        be.set_policy(policy)
        return be, fwd

    def generate(self, policy, ids, new_tokens=6, strict=True, options=None, **kw):
        """Greedy ``generate`` through the shared compile under ``policy``; returns ``(output, backend)``."""
        from transformers import DynamicCache

        be, fwd = self.forward(policy, strict=strict, **(options or {}))
        # kvpass frees a sequence's state with the model's cache: keep the last one, for tests that read
        # the backend's state of it after generate() returned
        self.cache = kw.setdefault("past_key_values", DynamicCache(config=self.model.config))
        f0 = self.model.forward
        self.model.forward = fwd
        try:
            out = self.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, **kw)
        finally:
            self.model.forward = f0
        return out, be


@pytest.fixture(scope="session")
def compiled_tiny():
    """``get(**tiny_llama_kwargs)``: the :class:`CompiledTiny` of that tiny Llama (tests/tiny.py), built
    once per test process. Tests that use it keep dynamo's cache (``_fresh_dynamo``) and must not change
    the model."""
    import inspect

    from tiny import tiny_llama

    defaults = {k: p.default for k, p in inspect.signature(tiny_llama).parameters.items() if k != "kw"}
    made: dict = {}

    def get(**kw) -> CompiledTiny:
        key = tuple(sorted({**defaults, **kw}.items()))  # tiny_llama() and tiny_llama(layers=2) are one model
        if key not in made:
            made[key] = CompiledTiny(tiny_llama(**kw))
        return made[key]

    return get


@pytest.fixture(scope="session")
def padded_compiled(compiled_tiny):
    """The 2-layer tiny Llama with ``pad_token_id=0`` of the left-padded batch tests (tests/test_padded.py,
    tests/test_robustness.py): see :class:`CompiledTiny`."""
    return compiled_tiny(layers=2, heads=4, kv_heads=2, pad_token_id=0)

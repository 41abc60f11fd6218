import os

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

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean dynamo cache (recompile limits are per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

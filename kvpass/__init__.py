"""kvpass: a torch.compile backend that compresses the KV cache of unmodified Hugging Face causal LMs.

    from kvpass import kvpass, Quest
    backend = kvpass(Quest(budget=1024))
    model.forward = torch.compile(model.forward, backend=backend)

Importing kvpass registers nothing and patches nothing: the ``kvpass::`` ops are registered the first
time a backend is built.
"""

from kvpass.api import KVPassBackend, KVPassError, constant_floats, kvpass
from kvpass.policies import (
    CentroidKV,
    ClusterKV,
    Full,
    Policy,
    Quest,
    StreamingLLM,
    TailorKV,
    policy_from_dict,
)

__all__ = [
    "kvpass",
    "KVPassBackend",
    "KVPassError",
    "Policy",
    "Full",
    "StreamingLLM",
    "Quest",
    "ClusterKV",
    "CentroidKV",
    "TailorKV",
    "policy_from_dict",
    "constant_floats",
]
__version__ = "0.1.0"

"""Policies: one frozen dataclass per method, validated in ``__post_init__``.

A policy is configuration only. It creates one :class:`kvpass.runtime.SiteState` per attention site
(``new_state``); all mutable state lives there, owned by the backend that compiled the model.
"""

from kvpass.policies.base import Policy, register_policy, registered_policies
from kvpass.policies.centroidkv import CentroidKV
from kvpass.policies.clusterkv import ClusterKV
from kvpass.policies.full import Full
from kvpass.policies.parse import policy_from_dict
from kvpass.policies.quest import Quest
from kvpass.policies.streaming import StreamingLLM
from kvpass.policies.tailorkv import TailorKV

__all__ = [
    "Policy",
    "Full",
    "StreamingLLM",
    "Quest",
    "ClusterKV",
    "CentroidKV",
    "TailorKV",
    "policy_from_dict",
    "register_policy",
    "registered_policies",
]

"""The policy base class and the name -> class registry."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvpass.runtime.state import SiteInfo, SiteState

_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` reachable by name (``policy_from_dict``, the CLI, the bench)."""
    _REGISTRY[cls.name] = cls
    return cls


def registered_policies() -> dict[str, type[Policy]]:
    return dict(_REGISTRY)


def policy_from_dict(spec: dict[str, Any] | str) -> Policy:
    """Build a policy from ``{"name": "Quest", "budget": 512}`` or from the string ``"Quest"``."""
    if isinstance(spec, str):
        spec = {"name": spec}
    spec = dict(spec)
    name = spec.pop("name", None)
    if name not in _REGISTRY:
        raise ValueError(
            f"kvpass: unknown policy {name!r}; expected one of {sorted(_REGISTRY)}"
        )
    return _REGISTRY[name](**spec)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base class. Subclasses are frozen dataclasses with a class-level ``name``."""

    name: ClassVar[str] = "Policy"
    # True for a policy that attends every token as eager does at every step (Full): non-finite keys then
    # give eager's NaNs; every other policy refuses them with a KVPassError (SiteState.check_keys)
    exact: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """A stable string naming the policy and every parameter (part of the graph pass's uuid)."""
        return json.dumps({"name": self.name, **self.params()}, sort_keys=True, default=str)

    def graph_key(self) -> str:
        """What of this policy shapes the rewritten graph. Selection policies all compile to the same
        ops (their parameters only matter at run time), so a backend may swap between them without
        recompiling (``KVPassBackend.set_policy``). A policy that inserts graph structure of its
        own overrides this with its class and the parameters that structure depends on."""
        return "kvpass::attention"

    @property
    def fetches(self) -> bool:
        """True when the policy keeps a host tier and the pass must insert a ``kvpass::fetch`` before
        each owned attention site (then ``graph_key`` must differ from the plain policies')."""
        return False

    @property
    def prefetches(self) -> bool:
        """True when the pass must also insert ``kvpass::prefetch`` for each site, fed with the site's
        query estimated one layer early (implies ``fetches``)."""
        return False

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"

    def new_state(self, info: SiteInfo) -> SiteState:
        raise NotImplementedError

    # helpers for validation messages in the FlexAttention style
    @staticmethod
    def _need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"kvpass: {msg}")


def check_int(policy: str, field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"kvpass: {policy} needs an integer {field}, got {field}={value!r} ({type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"kvpass: {policy} needs {field} >= {minimum}, got {field}={value}")

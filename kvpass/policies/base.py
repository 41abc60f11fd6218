"""The policy base class and the name -> class registry."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from kvpass.runtime.call import SiteInfo
    from kvpass.runtime.state import SiteState

_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` reachable by name (``policy_from_dict``, the CLI, the bench)."""
    _REGISTRY[cls.name] = cls
    return cls


def registered_policies() -> dict[str, type[Policy]]:
    return dict(_REGISTRY)


def _closest(word: Any, names: list[str]) -> str | None:
    """The registered spelling nearest to ``word`` (case-insensitive), for did-you-mean hints."""
    lower = {n.lower(): n for n in names}
    hit = difflib.get_close_matches(str(word).lower(), list(lower), n=1, cutoff=0.6)
    return lower[hit[0]] if hit else None


def unknown_policy_error(name: Any) -> ValueError:
    names = sorted(_REGISTRY)
    near = _closest(name, names) if isinstance(name, str) else None
    hint = f"; did you mean {near!r}?" if near else ""
    return ValueError(f"kvpass: unknown policy {name!r}; expected one of {names}{hint}")


def check_fields(cls: type[Policy], keys: Any) -> None:
    """Refuse keys that are not init fields of ``cls``, naming them, the valid ones and the closest."""
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted((k for k in keys if k not in fields), key=str)
    if not unknown:
        return
    hints = [f"{near!r} for {k!r}" for k in unknown if (near := _closest(k, fields))]
    hint = f"; did you mean {', '.join(hints)}?" if hints else ""
    raise ValueError(
        f"kvpass: {cls.name} has no parameter(s) {unknown}; its parameters are {fields or 'none'}{hint}"
    )


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

    def fetches_on(self, device: torch.device) -> bool:
        """Whether the pass inserts the ``kvpass::fetch`` op (policies that ``fetches``) in a decode graph
        whose attention runs on ``device``; where it does not, the policy's attention fetches itself."""
        return self.fetches

    def prefetches_on(self, device: torch.device) -> bool:
        """Whether the pass inserts ``kvpass::prefetch`` with the query estimated one layer early (policies
        that ``prefetches``) in a decode graph whose attention runs on ``device``."""
        return self.prefetches

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


_FALSY = {"0", "false", "no", "off", "n", "f", ""}
_TRUTHY = {"1", "true", "yes", "on", "y", "t"}


def bool_problem(owner: str, field: str, value: Any) -> str | None:
    """The message for a flag that is not a real bool, or None. Only ``bool`` is accepted: ``'no'``
    and ``'false'`` are truthy strings, so coercing with ``bool()`` would turn them into True."""
    if isinstance(value, bool):
        return None
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _FALSY or (type(value) is int and value == 0):
        fix = f"pass {field}=False"
    elif word in _TRUTHY or (type(value) is int and value == 1):
        fix = f"pass {field}=True"
    else:
        fix = f"pass {field}=True or {field}=False"
    got = f"{field}={value!r} ({type(value).__name__})"
    return f"kvpass: {owner} needs {field} True or False (a bool), got {got}; {fix}"

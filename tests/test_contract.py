"""The runtime's contract with the methods (kvpass/runtime/state.py): the driver is one class that no
method overrides, and a method implements the hooks the driver calls for the kind of cache it keeps."""

from __future__ import annotations

import pytest

from kvpass.policies import registered_policies
from kvpass.runtime import SiteInfo, SiteState

# the driver: every step of every method runs through these, unchanged
DRIVER = ("run", "run_owned", "run_fetch", "run_prefetch", "forward", "forward_owned")
# the hooks a method with a cache of its own (owns_cache) must implement
OWN_CACHE_HOOKS = ("start", "extend", "decode", "held_rows", "reorder_cache")


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _all_subclasses(sub)
    return found


def _method_states() -> dict[str, SiteState]:
    """A site state of each registered policy at its defaults (ClusterKV also with its host tier)."""
    states = {}
    for name, cls in registered_policies().items():
        states[name] = cls().new_state(SiteInfo(site=0, layer=0))
    states["ClusterKV(offload=True)"] = registered_policies()["ClusterKV"](offload=True).new_state(
        SiteInfo(site=0, layer=0))
    return states


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(SiteState, name)


def test_every_registered_method_has_a_state_of_the_driver():
    states = _method_states()
    assert {"Full", "StreamingLLM", "Quest", "ClusterKV", "CentroidKV", "TailorKV"} <= set(states)
    for name, st in states.items():
        assert isinstance(st, SiteState), name


@pytest.mark.parametrize("name", DRIVER)
def test_no_method_overrides_the_driver(name):
    classes = _all_subclasses(SiteState) | {type(st) for st in _method_states().values()}
    assert classes, "no SiteState subclass found"
    bad = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if _overrides(c, name))
    assert not bad, f"{bad} override SiteState.{name}: implement the driver's hooks instead (SiteState's docstring)"


def test_a_method_that_keeps_its_own_cache_implements_its_hooks():
    states = _method_states()
    owners = {name: type(st) for name, st in states.items() if st.owns_cache}
    assert {"CentroidKV", "TailorKV"} <= set(owners)
    for name, cls in owners.items():
        missing = [h for h in OWN_CACHE_HOOKS if not _overrides(cls, h)]
        assert not missing, f"{name} keeps its own cache and lacks {missing}"
        assert cls.model_cache_refusal, f"{name} keeps its own cache: a model-kept cache must be refused"
    for name, st in states.items():
        if st.store.host and not st.owns_cache:  # a host tier behind the driver's owned store
            assert _overrides(type(st), "to_device"), f"{name} keeps a host tier and lacks to_device"
            assert st.model_cache_refusal, f"{name} keeps a host tier: a model-kept cache must be refused"

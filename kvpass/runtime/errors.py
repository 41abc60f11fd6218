"""kvpass's error type and the texts of its refusals that the runtime's modules share (a leaf: it imports
no other kvpass module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvpass.runtime.call import SiteInfo


class KVPassError(RuntimeError):
    """A request kvpass cannot serve correctly; the message names the fix."""


# how check_keys names the keys of a cache that a decode step adopts
ADOPTED_KEYS = "of a cache filled outside kvpass (adopted at this decode step)"


def non_finite_keys_message(policy_name: str, info: SiteInfo, keys: torch.Tensor, when: str, first: int = 0,
                            unit: str | None = "position") -> str | None:
    """None when ``keys (B, H_kv, n, D)`` are all finite; otherwise the KVPassError message: the site,
    what was found (NaN or Inf) and where, and the fix. ``first`` is the position of ``keys[:, :, 0]``."""
    if keys.numel() == 0 or bool(torch.isfinite(keys).all()):
        return None
    nan = keys.isnan()
    found = "NaN" if bool(nan.any()) else "Inf"
    bad = (nan if found == "NaN" else keys.isinf()).any(-1).nonzero()[0].tolist()  # (b, h, i): the first
    path = info.module_path if info.module_path != "?" else f"site {info.site}"
    at = f" (batch row {bad[0]}, KV head {bad[1]}, {unit} {first + bad[2]})" if unit else ""
    return (
        f"kvpass: {policy_name} found {found} in the keys of layer {info.layer} ({path}) {when}{at}; it "
        "cannot select or compress non-finite keys. The model's activations overflowed or its inputs are "
        "bad: run the model in fp32 or bf16 rather than fp16 and check the inputs, or use Full(), which "
        "attends exactly like eager (NaN in, NaN out)"
    )


REORDERED = (
    "kvpass: the rows of a cache the model keeps were reordered between steps (beam search), or another "
    "batch stepped on this backend in between, and this policy's per-row metadata cannot follow a cache it "
    "does not own. Fix: use own_cache=True (the default, with a DynamicCache) or num_beams=1"
)

INTERLEAVED = (
    "kvpass: the cache the model keeps (own_cache=False, a StaticCache) does not continue the sequence "
    "this site served at its last step: another sequence stepped on this backend in between (two "
    "generate() calls in turn, two threads), and this policy's metadata belongs to that one. Fix: finish "
    "one sequence before starting the next, use one backend per sequence, or own_cache=True (the default, "
    "with a DynamicCache), which tells the sequences apart"
)

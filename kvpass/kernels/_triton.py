"""Guarded Triton import shared by the kernel files.

Importing kvpass must work where Triton is missing or broken (some CPU-only installs), so the import is
wrapped and, when it fails, ``triton``/``tl`` become small stand-ins: ``triton.jit`` returns the function
unchanged and ``tl.constexpr`` is a plain annotation, so kernel definitions still execute at import time.
Launchers check :data:`HAS_TRITON` (through :func:`triton_available`) before launching.

Note: Triton decides at *decoration* time whether ``@triton.jit`` builds an interpreted kernel, so
``TRITON_INTERPRET=1`` must be set before the kernel modules are imported (tests/conftest.py does this).
"""

from __future__ import annotations

import os
import types

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install raising something else at import
    HAS_TRITON = False

    def _jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

    triton = types.SimpleNamespace(
        jit=_jit, cdiv=lambda a, b: -(-a // b), next_power_of_2=_next_power_of_2
    )
    tl = types.SimpleNamespace(constexpr=object)

__all__ = ["HAS_TRITON", "triton", "tl", "triton_available", "require_triton", "interpreting"]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(t: torch.Tensor) -> bool:
    """True when a Triton kernel can run on ``t``: Triton imports and ``t`` is on CUDA, or the
    interpreter is on (then CPU tensors work too)."""
    return HAS_TRITON and (t.is_cuda or interpreting())


def require_triton(t: torch.Tensor, who: str, ref: str) -> None:
    """Raise the launchers' common error when a Triton kernel cannot run on ``t``; ``ref`` names the
    torch reference to use instead."""
    if not triton_available(t):
        raise RuntimeError(
            f"kvpass: {who} needs Triton and a CUDA tensor (or TRITON_INTERPRET=1), got a tensor on "
            f"{t.device} (HAS_TRITON={HAS_TRITON}); use {ref} on CPU"
        )

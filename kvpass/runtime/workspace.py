"""The scratch tensors of a decode step."""

from __future__ import annotations

import math

import torch


class Workspace:
    """Scratch tensors a decode step reuses instead of allocating (the gathered keys and values of a
    selection): on CPU a fresh tensor of a few MB pays its page faults at every step, which at batch 8
    cost more than the gather itself (docs/design.md, "Decode attention on CPU"). One workspace serves
    every site of a Runtime, which run one after another; what it holds is a step's scratch, never
    state: nothing a step returns aliases it."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

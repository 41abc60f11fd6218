"""The call of ``kvpass::attention`` as the runtime sees it, and the mask helpers it needs.

Shapes: ``q (B, H_q, T, D)``; ``k, v (B, H_kv, S, D)`` as the model's cache holds them (before any
repeat_kv); ``T`` new tokens; ``L`` the logical sequence length (``S`` can be larger for a static
cache, and a compressing state may hold fewer physical tokens than ``L``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F

from kvpass.kernels import cpu_decode


def profile_range(name: str):
    """A profiler range (``kvpass bench --decode-cost`` sorts a step's time by them); nothing at all
    unless a profiler runs (a range is an op call: 180 of them a step at 30 sites)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()



@dataclasses.dataclass
class SiteInfo:
    """What the graph pass learned about one attention site."""

    site: int
    layer: int
    module_path: str = "?"
    pattern: str = "?"
    graphs: int = 0
    estimate: str = "-"  # where a prefetching policy's query estimate comes from (the pass decides)
    fetch_in_attention: bool = False  # a fetching policy's graph has no kvpass::fetch here (the pass decides)


@dataclasses.dataclass
class AttentionCall:
    """One call of ``kvpass::attention`` as the runtime sees it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    scale: float
    is_causal: bool
    length: int  # logical length L, new tokens included
    valid: torch.Tensor | None = None  # (B, L) bool, False on padding; None: nothing masked (set by the state)
    start: int = -1  # first position not yet folded into the site's metadata (0: rebuild); -1: past

    def __post_init__(self):
        if self.start < 0:
            self.start = self.past

    @property
    def new_tokens(self) -> int:
        return self.q.shape[2]

    @property
    def past(self) -> int:
        return self.length - self.new_tokens

    @property
    def k_logical(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    @property
    def v_logical(self) -> torch.Tensor:
        return self.v[:, :, : self.length]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def exact(self) -> torch.Tensor:
        """Exactly the attention the model asked for (same inputs, same mask)."""
        if self.q.shape[2] == 1 and self.group > 1 and not self.is_causal and _mask_folds(self.attn_mask):
            return _grouped_decode(self.q, self.k, self.v, self.attn_mask, self.scale)
        return F.scaled_dot_product_attention(
            self.q,
            self.k,
            self.v,
            attn_mask=self.attn_mask,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.group != 1,
        )

    def padding_bias(self) -> torch.Tensor | None:
        """(B, H_kv, L) fp32: 0 on real tokens, -inf on padding; None without padding."""
        if self.valid is None:
            return None
        bias = torch.zeros(self.valid.shape, dtype=torch.float32, device=self.valid.device)
        bias.masked_fill_(~self.valid, -math.inf)
        return bias[:, None, :].expand(-1, self.k.shape[1], -1)


def _mask_folds(attn_mask: torch.Tensor | None) -> bool:
    """Whether an SDPA mask is shared by the query heads and the one query (see :func:`_grouped_decode`)."""
    return attn_mask is None or (attn_mask.dim() == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1)


def _grouped_decode(q, k, v, attn_mask, scale) -> torch.Tensor:
    """One decode query per head, ``q (B, H_q, 1, D)``, over ``k, v (B, H_kv, S, D)``: the query heads of a
    KV head become that head's rows, ``(B, H_kv, G, D)``, so SDPA reads each KV head once for its whole
    group. The same attention as ``enable_gqa``, each row computed alone (no causal mask with one query),
    and faster on CPU (docs/design.md, "Decode attention on CPU"). fp32 on CPU: the C kernel of
    :mod:`kvpass.kernels.cpu_decode`, the mask (padding) as its bias."""
    b, h_q, _, d = q.shape
    h_kv = k.shape[1]
    if q.is_cpu and (attn_mask is None or attn_mask.shape[-1] == k.shape[2]):
        bias = None
        if attn_mask is not None:
            row = attn_mask[:, 0, 0]  # (B or 1, S): shared by the heads and the one query
            bias = (torch.zeros(row.shape, dtype=torch.float32, device=row.device).masked_fill_(~row, -math.inf)
                    if row.dtype == torch.bool else row.float())
            bias = bias[:, None, :].expand(b, h_kv, -1)
        out = cpu_decode.decode_step(q, k, v, k.shape[2], None, scale, bias)
        if out is not None:
            return out
    qg = q.reshape(b, h_kv, h_q // h_kv, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=attn_mask, scale=scale)
    return out.view(b, h_q, 1, v.shape[3])


def mask_row(attn_mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B', L) bool: the keys the newest query may see, from an SDPA mask broadcastable to
    (B, H, T, S) (B' is 1 for a mask shared by the batch). No host sync."""
    row = attn_mask[..., -1, :length]
    while row.dim() > 2:
        row = row[:, 0]  # masks are shared across heads
    if row.dim() == 1:
        row = row[None]
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2


def valid_from_mask(attn_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """:func:`mask_row`, or None when every key is visible (no padding). One host sync: called where a
    sequence starts or grows by several tokens, never in a steady decode step (:class:`Padding`)."""
    if attn_mask is None:
        return None
    valid = mask_row(attn_mask, length)
    if bool(valid.all()):
        return None
    return valid


def make_call(q, k, v, attn_mask, scale, is_causal, length, start=-1) -> AttentionCall:
    """The call of ``kvpass::attention``; ``scale <= 0`` is the op's encoding of SDPA's default scale."""
    if scale <= 0:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return AttentionCall(
        q=q, k=k, v=v, attn_mask=attn_mask, scale=scale, is_causal=is_causal, length=length, start=start,
    )

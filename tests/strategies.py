"""Shared hypothesis strategies and tolerances for the kernel tests.

Hypothesis draws the *structure* of a problem (shapes, dtype, layout, modes, a seed); the tensor
values come from a seeded ``torch.Generator``, so a failing example shrinks on structure and replays
exactly. Layouts produce non-contiguous tensors the way the runtime does (slices of a capacity buffer,
(B, S, H, D) storage seen as (B, H, S, D), strided head dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

# (atol, rtol) for outputs computed in the given dtype against an fp32-accumulating reference.
# fp16: the kernel rounds the softmax weights to fp16 before P @ V (as flash attention does), and the
# output itself is rounded to fp16 (unit roundoff 2**-11 ~ 4.9e-4 on values up to ~4).
TOL = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
}
# Quest scores are fp32 sums of D products whatever the input dtype (fp16 values are exact in fp32).
TOL_SCORES = (1e-4, 1e-5)

DTYPES = st.sampled_from([torch.float32, torch.float16])
GQA_GROUPS = st.sampled_from([1, 3, 4])
HEAD_DIMS = st.sampled_from([16, 64])
LAYOUTS = st.sampled_from(["contiguous", "s_slice", "bshd", "d_strided"])
SEEDS = st.integers(min_value=0, max_value=2**31 - 1)


def make_strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Re-store a ``(B, H, S, D)`` tensor in ``layout`` (values unchanged; padding holds NaN, which
    a kernel reading outside the view would turn into a visible failure):

    - ``contiguous``: plain.
    - ``s_slice``: positions ``[3, 3 + S)`` of a larger capacity buffer along S.
    - ``bshd``: (B, S, H, D) storage seen as (B, H, S, D) (strides (S*H*D, D, H*D, 1)).
    - ``d_strided``: every other element of a (B, H, S, 2D) buffer (stride 2 along D).
    """
    B, H, S, D = x.shape
    if layout == "contiguous":
        return x.contiguous()
    if layout == "s_slice":
        buf = torch.full((B, H, S + 8, D), float("nan"), dtype=x.dtype)
        buf[:, :, 3 : 3 + S] = x
        return buf[:, :, 3 : 3 + S]
    if layout == "bshd":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "d_strided":
        buf = torch.full((B, H, S, 2 * D), float("nan"), dtype=x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]
    raise ValueError(f"unknown layout {layout!r}")


@dataclass(frozen=True)
class AttentionProblem:
    dtype: torch.dtype
    B: int
    H_kv: int
    G: int
    S: int
    D: int
    N: int
    idx_mode: str  # "none" | "subset" (distinct positions + padding) | "duplicates"
    idx_dtype: torch.dtype
    bias_mode: str  # "none" | "random" | "neg_inf" (some -inf) | "row_neg_inf" (one all -inf row)
    layout: str
    q_strided: bool
    seed: int

    @property
    def H_q(self) -> int:
        return self.H_kv * self.G


@st.composite
def attention_problems(
    draw,
    dtypes=DTYPES,
    head_dims=HEAD_DIMS,
    max_s: int = 300,
    idx_modes=("none", "subset", "duplicates"),
    bias_modes=("none", "random", "neg_inf", "row_neg_inf"),
    layouts=LAYOUTS,
) -> AttentionProblem:
    S = draw(st.integers(1, max_s))
    idx_mode = draw(st.sampled_from(idx_modes))
    N = S if idx_mode == "none" else draw(st.integers(0, S))
    return AttentionProblem(
        dtype=draw(dtypes),
        B=draw(st.integers(1, 2)),
        H_kv=draw(st.integers(1, 3)),
        G=draw(GQA_GROUPS),
        S=S,
        D=draw(head_dims),
        N=N,
        idx_mode=idx_mode,
        idx_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        bias_mode=draw(st.sampled_from(bias_modes)),
        layout=draw(layouts),
        q_strided=draw(st.booleans()),
        seed=draw(SEEDS),
    )


def make_index(
    B: int, H: int, S: int, N: int, mode: str, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor | None:
    """``(B, H, N)`` positions into S.

    ``subset``: per (b, h) row, a random number of distinct positions (a prefix of a random
    permutation) scattered among padding entries (mostly -1, sometimes other negatives), so rows
    range from all-padding to fully valid. ``duplicates``: positions drawn with replacement.
    """
    if mode == "none":
        return None
    if mode == "duplicates":
        return torch.randint(0, S, (B, H, N), generator=gen).to(dtype)
    assert mode == "subset"
    idx = torch.empty((B, H, N), dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            n_valid = int(torch.randint(0, N + 1, (1,), generator=gen))
            if N > 0 and torch.rand((), generator=gen) < 0.5:
                n_valid = N  # half the rows without padding
            row = torch.full((N,), -1, dtype=torch.int64)
            row[:n_valid] = torch.randperm(S, generator=gen)[:n_valid]
            pad = row[n_valid:]
            pad[torch.rand(pad.shape, generator=gen) < 0.2] = -7  # any negative value is padding
            idx[b, h] = row[torch.randperm(N, generator=gen)]
    return idx.to(dtype)


def make_bias(B: int, H: int, S: int, mode: str, gen: torch.Generator) -> torch.Tensor | None:
    """``(B, H, S)`` fp32 bias: log-degree-like values, some ``-inf``, or one row all ``-inf``."""
    if mode == "none":
        return None
    bias = torch.rand((B, H, S), generator=gen) * 2.0  # log of merged-token counts up to e**2
    if mode in ("neg_inf", "row_neg_inf"):
        bias[torch.rand((B, H, S), generator=gen) < 0.3] = float("-inf")
    if mode == "row_neg_inf":
        bias[B - 1, H - 1] = float("-inf")
    return bias


def make_attention_inputs(p: AttentionProblem):
    """``(q, k, v, idx, bias)`` for an :class:`AttentionProblem`."""
    gen = torch.Generator().manual_seed(p.seed)
    if p.q_strided:  # heads further apart than D elements, as in a slice of a fused QKV buffer
        q = torch.randn((p.B, p.H_q, p.D + 8), generator=gen)[:, :, 4 : 4 + p.D].to(p.dtype)
    else:
        q = torch.randn((p.B, p.H_q, p.D), generator=gen).to(p.dtype)
    k = make_strided(torch.randn((p.B, p.H_kv, p.S, p.D), generator=gen).to(p.dtype), p.layout)
    v = make_strided(torch.randn((p.B, p.H_kv, p.S, p.D), generator=gen).to(p.dtype), p.layout)
    idx = make_index(p.B, p.H_kv, p.S, p.N, p.idx_mode, p.idx_dtype, gen)
    bias = make_bias(p.B, p.H_kv, p.S, p.bias_mode, gen)
    return q, k, v, idx, bias


# ---------------------------------------------------------------------------------------------------
# Quest
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuestProblem:
    q_dtype: torch.dtype
    meta_dtype: torch.dtype
    B: int
    H_kv: int
    G: int
    P: int  # capacity (pages in the buffer)
    num_pages: int | None
    D: int
    layout: str
    ordered: bool  # kmin <= kmax (real metadata) or two unrelated tensors
    seed: int

    @property
    def H_q(self) -> int:
        return self.H_kv * self.G


@st.composite
def quest_problems(draw, head_dims=HEAD_DIMS, max_pages: int = 40) -> QuestProblem:
    P = draw(st.integers(1, max_pages))
    return QuestProblem(
        q_dtype=draw(DTYPES),
        meta_dtype=draw(DTYPES),
        B=draw(st.integers(1, 2)),
        H_kv=draw(st.integers(1, 3)),
        G=draw(GQA_GROUPS),
        P=P,
        num_pages=draw(st.one_of(st.none(), st.integers(0, P))),
        D=draw(head_dims),
        layout=draw(LAYOUTS),
        ordered=draw(st.booleans()),
        seed=draw(SEEDS),
    )


def make_quest_inputs(p: QuestProblem):
    """``(q, kmin, kmax)`` for a :class:`QuestProblem`; pages beyond ``num_pages`` hold NaN/inf
    garbage (a capacity buffer's unopened pages), which the scorers must never read."""
    gen = torch.Generator().manual_seed(p.seed)
    q = torch.randn((p.B, p.H_q, p.D), generator=gen).to(p.q_dtype)
    a = torch.randn((p.B, p.H_kv, p.P, p.D), generator=gen)
    c = torch.randn((p.B, p.H_kv, p.P, p.D), generator=gen)
    if p.ordered:
        a, c = torch.minimum(a, c), torch.maximum(a, c)
    if p.num_pages is not None and p.num_pages < p.P:
        a[:, :, p.num_pages :] = float("nan")
        c[:, :, p.num_pages :] = float("inf")
    kmin = make_strided(a.to(p.meta_dtype), p.layout)
    kmax = make_strided(c.to(p.meta_dtype), p.layout)
    return q, kmin, kmax


@dataclass(frozen=True)
class PageUpdateProblem:
    dtype: torch.dtype  # of the metadata buffers
    key_dtype: torch.dtype
    B: int
    H_kv: int
    D: int
    page_size: int
    prefix: int  # tokens summarised before the first update
    chunks: tuple[int, ...]  # sizes of successive updates (0 allowed)
    spare_pages: int
    seed: int


@st.composite
def page_update_problems(draw) -> PageUpdateProblem:
    return PageUpdateProblem(
        dtype=draw(DTYPES),
        key_dtype=draw(DTYPES),
        B=draw(st.integers(1, 2)),
        H_kv=draw(st.integers(1, 3)),
        D=draw(st.sampled_from([4, 16])),
        page_size=draw(st.sampled_from([1, 2, 3, 8, 16])),
        prefix=draw(st.integers(0, 70)),
        chunks=tuple(draw(st.lists(st.one_of(st.just(1), st.integers(0, 40)), min_size=1, max_size=5))),
        spare_pages=draw(st.integers(0, 3)),
        seed=draw(SEEDS),
    )

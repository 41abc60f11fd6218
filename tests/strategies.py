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


# ---------------------------------------------------------------------------------------------------
# TailorKV
# ---------------------------------------------------------------------------------------------------

QUANT_GROUP_SIZES = (4, 8, 16, 32, 64)


@dataclass(frozen=True)
class QuantProblem:
    dtype: torch.dtype
    B: int
    H: int
    S: int
    D: int
    bits: int
    group_size: int
    axis: str  # "channel" (groups of tokens) | "token" (groups of channels)
    values: str  # "randn" | "outliers" (a few channels x20, as in keys) | "constant_groups"
    layout: str
    seed: int


@st.composite
def quant_problems(draw, max_s: int = 256, axes=("channel", "token"), bit_widths=(1, 2)) -> QuantProblem:
    axis = draw(st.sampled_from(axes))
    bits = draw(st.sampled_from(bit_widths))
    D = draw(HEAD_DIMS)
    per = 8 // bits  # a group must hold whole bytes
    if axis == "channel":
        gs = draw(st.sampled_from([g for g in QUANT_GROUP_SIZES if g % per == 0]))
        S = gs * draw(st.integers(1, max(1, max_s // gs)))
    else:
        gs = draw(st.sampled_from([g for g in QUANT_GROUP_SIZES if g % per == 0 and D % g == 0]))
        S = draw(st.integers(1, max_s))
    return QuantProblem(
        dtype=draw(DTYPES),
        B=draw(st.integers(1, 2)),
        H=draw(st.integers(1, 3)),
        S=S,
        D=D,
        bits=bits,
        group_size=gs,
        axis=axis,
        values=draw(st.sampled_from(["randn", "outliers", "constant_groups"])),
        layout=draw(LAYOUTS),
        seed=draw(SEEDS),
    )


def make_quant_values(
    shape: tuple[int, int, int, int], dtype: torch.dtype, values: str, group_size: int, axis: str,
    gen: torch.Generator,
) -> torch.Tensor:
    """A contiguous ``(B, H, S, D)`` tensor in ``dtype`` whose values are fp16-representable (drawn in
    fp16 first). ``constant_groups``: the first and about a third of the other quantisation groups
    hold one repeated value (their first element)."""
    B, H, S, D = shape
    x = torch.randn(shape, generator=gen)
    if values == "outliers" and D > 0:
        x[..., torch.randperm(D, generator=gen)[: max(1, D // 8)]] *= 20.0
    x = x.half().float()
    if values == "constant_groups" and x.numel() > 0:
        if axis == "channel":
            xg = x.view(B, H, S // group_size, group_size, D)
            keep = torch.rand((B, H, S // group_size, 1, D), generator=gen) < 0.35
            keep.view(-1)[0] = True  # at least one
            x = torch.where(keep, xg[:, :, :, :1, :], xg).reshape(shape)
        else:
            xg = x.view(B, H, S, D // group_size, group_size)
            keep = torch.rand((B, H, S, D // group_size, 1), generator=gen) < 0.35
            keep.view(-1)[0] = True  # at least one
            x = torch.where(keep, xg[..., :1], xg).reshape(shape)
    return x.to(dtype)


def make_quant_input(p: QuantProblem) -> torch.Tensor:
    """The ``(B, H, S, D)`` input of a :class:`QuantProblem`, stored in ``p.layout``."""
    gen = torch.Generator().manual_seed(p.seed)
    x = make_quant_values((p.B, p.H, p.S, p.D), p.dtype, p.values, p.group_size, p.axis, gen)
    return make_strided(x, p.layout)


@dataclass(frozen=True)
class QuantAttentionProblem:
    dtype: torch.dtype
    B: int
    H_kv: int
    G: int
    S_q: int  # quantised tokens (a multiple of k_group, may be 0)
    R: int  # full-precision residual tokens (may be 0; S_q + R >= 1)
    D: int
    k_bits: int
    v_bits: int
    k_group: int
    v_group: int
    layout: str
    q_strided: bool
    seed: int

    @property
    def H_q(self) -> int:
        return self.H_kv * self.G


@st.composite
def quant_attention_problems(draw, max_s: int = 256, max_r: int = 40) -> QuantAttentionProblem:
    D = draw(HEAD_DIMS)
    k_group = draw(st.sampled_from([8, 16, 32]))  # multiples of 8 suit both bit widths
    S_q = k_group * draw(st.integers(0, max_s // k_group))
    R = draw(st.integers(1 if S_q == 0 else 0, max_r))
    return QuantAttentionProblem(
        dtype=draw(DTYPES),
        B=draw(st.integers(1, 2)),
        H_kv=draw(st.integers(1, 3)),
        G=draw(GQA_GROUPS),
        S_q=S_q,
        R=R,
        D=D,
        k_bits=draw(st.sampled_from([1, 2])),
        v_bits=draw(st.sampled_from([1, 2])),
        k_group=k_group,
        v_group=draw(st.sampled_from([g for g in (8, 16, 32) if D % g == 0])),
        layout=draw(LAYOUTS),
        q_strided=draw(st.booleans()),
        seed=draw(SEEDS),
    )


@dataclass(frozen=True)
class TopKProblem:
    dtype: torch.dtype  # of q and k_ch
    B: int
    H_kv: int
    G: int
    S: int  # capacity of k_ch along tokens
    length: int | None  # valid positions (None: all S)
    D: int
    n: int  # critical channels
    k: int
    integer_valued: bool  # small integers: every sum is exact in fp32, ties are frequent
    layout: str
    seed: int

    @property
    def H_q(self) -> int:
        return self.H_kv * self.G


@st.composite
def topk_problems(draw, max_s: int = 300, all_channels: bool = False) -> TopKProblem:
    S = draw(st.integers(1, max_s))
    D = draw(HEAD_DIMS)
    return TopKProblem(
        dtype=draw(DTYPES),
        B=draw(st.integers(1, 2)),
        H_kv=draw(st.integers(1, 3)),
        G=draw(GQA_GROUPS),
        S=S,
        length=draw(st.one_of(st.none(), st.integers(0, S))),
        D=D,
        n=D if all_channels else draw(st.integers(1, D)),
        k=draw(st.one_of(st.integers(0, 8), st.integers(0, S + 5))),
        integer_valued=draw(st.booleans()),
        layout=draw(LAYOUTS),
        seed=draw(SEEDS),
    )


# ---------------------------------------------------------------------------------------------------
# CentroidKV (chunked soft matching, weighted merge)
# ---------------------------------------------------------------------------------------------------

# Chunk sizes for the matcher: odd ones (the A/B parity restarts at every chunk), tiny ones and the
# paper's 256. The interpreter pays per program (chunk), so problems keep to a few chunks per head.
CENTROID_CHUNKS = st.sampled_from([2, 3, 5, 8, 16, 33, 64, 128, 256])
CENTROID_KEY_MODES = st.sampled_from(["random", "smooth", "integer", "zeros"])


@dataclass(frozen=True)
class MatchProblem:
    dtype: torch.dtype
    B: int
    H: int
    S: int
    D: int
    lo: int
    hi: int
    chunk: int
    key_mode: str  # "random" | "smooth" (random walk: high local similarity, as real keys) |
    #                "integer" (small integers: exact ties) | "zeros" (random with some zero keys)
    layout: str
    seed: int


@st.composite
def match_problems(
    draw, dtypes=DTYPES, head_dims=HEAD_DIMS, chunks=CENTROID_CHUNKS, max_chunks: int = 6, layouts=LAYOUTS
) -> MatchProblem:
    """A candidate range ``[lo, hi)`` of 1 to ``max_chunks`` whole chunks (at most 300 slots) plus a
    remainder (a partial or 1-slot last chunk) inside a cache of S slots, often with ``lo > 0``.
    Empty and 1-slot ranges are explicit tests."""
    chunk = draw(chunks)
    n = draw(st.integers(1, max(1, min(max_chunks, 300 // chunk)))) * chunk + draw(st.integers(0, chunk - 1))
    lo = draw(st.integers(0, 20))
    S = lo + n + draw(st.integers(0, 20))
    return MatchProblem(
        dtype=draw(dtypes),
        B=draw(st.integers(1, 2)),
        H=draw(st.integers(1, 3)),
        S=max(S, 1),
        D=draw(head_dims),
        lo=lo,
        hi=lo + n,
        chunk=chunk,
        key_mode=draw(CENTROID_KEY_MODES),
        layout=draw(layouts),
        seed=draw(SEEDS),
    )


def make_centroid_keys(
    B: int, H: int, S: int, D: int, mode: str, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """``(B, H, S, D)`` contiguous keys for a :class:`MatchProblem` ``key_mode``."""
    if mode == "smooth":
        steps = 0.3 * torch.randn((B, H, S, D), generator=gen)
        x = torch.randn((B, H, 1, D), generator=gen) + steps.cumsum(2)
    elif mode == "integer":
        # slots copy vectors from a small pool: many identical keys, so exact similarity ties
        pool = torch.randint(-2, 3, (B, H, max(2, S // 4), D), generator=gen).float()
        pick = torch.randint(0, pool.shape[2], (B, H, S, 1), generator=gen)
        x = torch.gather(pool, 2, pick.expand(-1, -1, -1, D))
    else:
        x = torch.randn((B, H, S, D), generator=gen)
        if mode == "zeros":
            x[torch.rand((B, H, S), generator=gen) < 0.3] = 0.0
    return x.to(dtype)


def make_match_inputs(p: MatchProblem) -> torch.Tensor:
    gen = torch.Generator().manual_seed(p.seed)
    return make_strided(make_centroid_keys(p.B, p.H, p.S, p.D, p.key_mode, p.dtype, gen), p.layout)


@dataclass(frozen=True)
class MergeProblem:
    dtype: torch.dtype
    B: int
    H: int
    S: int
    D: int
    Dv: int
    m: int  # taken pairs per (b, h)
    extra: int  # untaken pairs per (b, h)
    n_targets: int  # size of the pool the targets are drawn from (small: many A slots per target)
    deg_mode: str  # "ones" | "integer" | "float"
    layout: str
    pos_dtype: torch.dtype
    seed: int


@st.composite
def merge_problems(
    draw, dtypes=DTYPES, head_dims=HEAD_DIMS, max_s: int = 200, layouts=LAYOUTS
) -> MergeProblem:
    """Arbitrary merge plans (not only what chunk matching produces): m distinct removed slots per
    head, targets drawn with replacement from a pool of other slots, untaken pairs mixed in."""
    S = draw(st.integers(2, max_s))
    m = draw(st.integers(1, S - 1))  # m = 0 (nothing taken) is an explicit test
    return MergeProblem(
        dtype=draw(dtypes),
        B=draw(st.integers(1, 2)),
        H=draw(st.integers(1, 3)),
        S=S,
        D=draw(head_dims),
        Dv=draw(st.sampled_from([16, 64, 80])),
        m=m,
        extra=draw(st.integers(0, 8)),
        n_targets=draw(st.integers(1, S - m)),
        deg_mode=draw(st.sampled_from(["ones", "integer", "float"])),
        layout=draw(layouts),
        pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(SEEDS),
    )


def make_merge_inputs(p: MergeProblem):
    """``(k, v, deg, a_pos, b_pos, take)`` for a :class:`MergeProblem`; pairs in random order."""
    gen = torch.Generator().manual_seed(p.seed)
    k = make_strided(torch.randn((p.B, p.H, p.S, p.D), generator=gen).to(p.dtype), p.layout)
    v = make_strided(torch.randn((p.B, p.H, p.S, p.Dv), generator=gen).to(p.dtype), p.layout)
    if p.deg_mode == "ones":
        deg = torch.ones((p.B, p.H, p.S))
    elif p.deg_mode == "integer":
        deg = torch.randint(1, 9, (p.B, p.H, p.S), generator=gen).float()
    else:
        deg = 1.0 + 5.0 * torch.rand((p.B, p.H, p.S), generator=gen)
    NA = p.m + p.extra
    a_pos = torch.empty((p.B, p.H, NA), dtype=torch.int64)
    b_pos = torch.empty_like(a_pos)
    take = torch.zeros((p.B, p.H, NA), dtype=torch.bool)
    for b in range(p.B):
        for h in range(p.H):
            perm = torch.randperm(p.S, generator=gen)
            removed, pool = perm[: p.m], perm[p.m : p.m + p.n_targets]
            targets = pool[torch.randint(0, len(pool), (p.m,), generator=gen)]
            a = torch.cat([removed, torch.randint(0, p.S, (p.extra,), generator=gen)])
            t = torch.cat([targets, torch.randint(0, p.S, (p.extra,), generator=gen)])
            order = torch.randperm(NA, generator=gen)
            a_pos[b, h], b_pos[b, h] = a[order], t[order]
            take[b, h] = (torch.arange(NA) < p.m)[order]
    return k, v, deg, a_pos.to(p.pos_dtype), b_pos.to(p.pos_dtype), take


@dataclass(frozen=True)
class MergeRoundProblem:
    dtype: torch.dtype
    B: int
    H: int
    S: int
    D: int
    sinks: int
    recent: int
    chunk: int
    ratio: float
    max_merge: int | None
    key_mode: str
    layout: str
    seed: int


@st.composite
def merge_round_problems(
    draw, dtypes=DTYPES, head_dims=HEAD_DIMS, max_s: int = 200, chunks=CENTROID_CHUNKS, layouts=LAYOUTS
) -> MergeRoundProblem:
    """A cache of S slots per head with at least 2 candidates between the sinks and the recent
    slots, exact and arbitrary positive ratios, and budget caps (``max_merge``) above and below
    ``floor(ratio * NA)``. Rounds that merge nothing (ratio 0, < 2 candidates) are explicit tests."""
    sinks = draw(st.integers(0, 20))
    recent = draw(st.integers(0, 40))
    return MergeRoundProblem(
        dtype=draw(dtypes),
        B=draw(st.integers(1, 2)),
        H=draw(st.integers(1, 3)),
        S=sinks + recent + draw(st.integers(2, max(2, max_s - 60))),
        D=draw(head_dims),
        sinks=sinks,
        recent=recent,
        chunk=draw(chunks),
        ratio=draw(st.one_of(st.sampled_from([0.25, 0.5, 1.0]), st.floats(0.05, 1.0))),
        max_merge=draw(st.one_of(st.none(), st.integers(1, 30))),
        key_mode=draw(CENTROID_KEY_MODES),
        layout=draw(layouts),
        seed=draw(SEEDS),
    )

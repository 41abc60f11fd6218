"""Quest page metadata and page scoring (Quest, arXiv 2406.10774).

The cache is cut into pages of ``page_size`` consecutive tokens. Each page keeps the elementwise
minimum and maximum of its keys; at decode the query scores every page with the upper bound

    score[b, h, p] = sum_d max(q[b, h, d] * kmax[b, hk, p, d], q[b, h, d] * kmin[b, hk, p, d])

(``hk = h // G``, HF ``repeat_kv`` order), and the top pages are attended exactly.

Scoring uses ``max(q*a, q*b) = relu(q) * max(a, b) + min(q, 0) * min(a, b)``, which holds for any
``a, b`` (kmin <= kmax is not assumed), so the score is two matrix products instead of a
``(G, P, D)`` elementwise tensor. Pages at or beyond ``num_pages`` are never read and score ``-inf``.

The runtime keeps the bounds in fp16 (:data:`BOUNDS_DTYPE`), each maximum rounded up and each minimum
down (:func:`quest_bounds`), so they still bound every key of their page and the score still bounds
every ``q·k`` of it, with half the bytes a decode step reads to score the pages (Quest, Tang et al.
2024, serves fp16 models, whose keys fp16 bounds hold exactly). A key beyond fp16's range gives
an infinite bound; where ``0 * inf`` makes a score NaN, every scorer here counts it ``+inf`` (the
page is taken: its bound is unknown, not small).

Contents: :func:`quest_page_minmax_ref` and :func:`quest_update_minmax_` (plain torch: metadata is
built once at prefill and patched per decode step, neither is worth a kernel), the Triton scorer
``_quest_page_scores_kernel`` / :func:`quest_page_scores` and its reference
:func:`quest_page_scores_ref`, and :func:`quest_top_pages_cpu`, the CPU decode step's scoring and
top-page choice in C (:mod:`kvpass.kernels.native`; one call instead of a dozen torch ops per site),
with :class:`QuestStep` for the runtime's steps. The C is ``kvpass/kernels/csrc/quest.c``; its argument
structs are declared in ``csrc/kvpass.h`` and mirrored here by ``ctypes.Structure`` classes
(:class:`QuestArgs`, :class:`QuestStepArgs`) with the same field names.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_decode, native
from ._triton import require_triton, tl, triton

__all__ = [
    "BOUNDS_DTYPE",
    "quest_bounds",
    "quest_page_minmax_ref",
    "quest_update_minmax_",
    "quest_page_scores",
    "quest_page_scores_ref",
    "quest_select_cpu",
    "quest_select_ref",
    "quest_select_torch",
    "quest_top_pages_cpu",
    "quest_top_pages_ref",
    "quest_top_pages_torch",
]


# --------------------------------------------------------------------------------------------------
# Page metadata (plain torch)
# --------------------------------------------------------------------------------------------------

# the dtype of the runtime's page bounds: half the bytes of fp32 for the step that reads them all
BOUNDS_DTYPE = torch.float16


def quest_bounds(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` in ``dtype``, rounded toward ``+inf`` (``up``: a page's maximum) or ``-inf`` (its minimum),
    so that the stored value still bounds every key the exact one bounds. Any shape; a ``dtype`` that
    holds ``x`` exactly returns it converted. Past fp16's range a maximum becomes ``+inf`` (a minimum
    ``-inf``), and the other side's ``-65504`` or ``65504``."""
    return _outward(x, dtype)[int(up)]


def _outward(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(down, up)``: :func:`quest_bounds` both ways from one conversion (a steady step's key needs both)."""
    y = x.to(dtype)
    if dtype == x.dtype or torch.finfo(dtype).bits > torch.finfo(x.dtype).bits:
        return y, y
    w = torch.promote_types(x.dtype, torch.float32)  # holds both exactly
    yw, xw = y.to(w), x.to(w)
    inf = torch.full((), float("inf"), dtype=dtype, device=y.device)
    return (torch.where(yw > xw, torch.nextafter(y, -inf), y), torch.where(yw < xw, torch.nextafter(y, inf), y))


def _pages_minmax(x: torch.Tensor, lead: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page min/max of x ``(B, H, T, D)``, T >= 1, whose first token sits at slot ``lead`` of its
    page. Returns two fp32 ``(B, H, ceil((lead + T) / page_size), D)`` tensors.

    Slots outside x are filled with copies of a real token of the same page (the first token before
    x, the last one after it): a duplicate changes neither min nor max, so one ``aminmax`` pass
    serves both (no +inf padding for the min and -inf padding for the max).
    """
    B, H, T, D = x.shape
    P = -(-(lead + T) // page_size)
    buf = torch.empty((B, H, P * page_size, D), dtype=torch.float32, device=x.device)
    buf[:, :, lead : lead + T] = x
    if lead > 0:
        buf[:, :, :lead] = x[:, :, :1]
    if lead + T < P * page_size:
        buf[:, :, lead + T :] = x[:, :, T - 1 : T]
    kmin, kmax = torch.aminmax(buf.view(B, H, P, page_size, D), dim=3)
    return kmin, kmax


def quest_page_minmax_ref(
    k: torch.Tensor, page_size: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page key minimum and maximum over positions ``[0, length)``.

    Args:
        k: ``(B, H_kv, S, D)`` keys, any float dtype and strides.
        page_size: tokens per page (>= 1).
        length: number of valid positions (default S); the last page may be partial, and only its
            real tokens count.

    Returns:
        ``(kmin, kmax)``, each ``(B, H_kv, P, D)`` fp32 with ``P = ceil(length / page_size)``.
    """
    if k.dim() != 4:
        raise ValueError(
            f"kvpass: quest_page_minmax_ref needs k of shape (B, H_kv, S, D), got {tuple(k.shape)}"
        )
    if not k.is_floating_point():
        raise ValueError(f"kvpass: quest_page_minmax_ref needs floating-point keys, got {k.dtype}")
    if page_size < 1:
        raise ValueError(f"kvpass: quest_page_minmax_ref needs page_size >= 1, got {page_size}")
    B, H, S, D = k.shape
    length = S if length is None else length
    if not 0 <= length <= S:
        raise ValueError(f"kvpass: quest_page_minmax_ref needs 0 <= length <= S={S}, got length={length}")
    if length == 0:
        empty = torch.empty((B, H, 0, D), dtype=torch.float32, device=k.device)
        return empty, empty.clone()
    return _pages_minmax(k[:, :, :length], 0, page_size)


def quest_update_minmax_(
    kmin: torch.Tensor, kmax: torch.Tensor, k_new: torch.Tensor, start: int, page_size: int
) -> None:
    """Update page metadata in place for new keys at positions ``[start, start + T)``.

    Args:
        kmin, kmax: ``(B, H_kv, P_cap, D)`` metadata buffers (any float dtype; a narrower one than the
            keys' holds them rounded outward, :func:`quest_bounds`), valid for positions ``[0, start)``;
            slots of pages not yet opened may hold anything.
        k_new: ``(B, H_kv, T, D)`` new keys (T may be 0, may cross page boundaries and open pages).
        start: position of ``k_new[:, :, 0]`` (the number of tokens already summarised).
        page_size: tokens per page.

    The page holding ``start`` is merged with its stored min/max when it already has tokens
    (``start % page_size != 0``); every page opened by ``k_new`` is overwritten from ``k_new`` alone,
    so stale buffer content never leaks in. Raises ``ValueError`` when P_cap is too small.
    """
    who = "quest_update_minmax_"
    if kmin.dim() != 4 or kmin.shape != kmax.shape:
        raise ValueError(
            f"kvpass: {who} needs kmin and kmax of one shape (B, H_kv, P_cap, D), "
            f"got {tuple(kmin.shape)} and {tuple(kmax.shape)}"
        )
    if k_new.dim() != 4 or k_new.shape[:2] != kmin.shape[:2] or k_new.shape[3] != kmin.shape[3]:
        raise ValueError(
            f"kvpass: {who} needs k_new of shape (B, H_kv, T, D) = ({kmin.shape[0]}, {kmin.shape[1]}, T, "
            f"{kmin.shape[3]}), got {tuple(k_new.shape)}"
        )
    if page_size < 1:
        raise ValueError(f"kvpass: {who} needs page_size >= 1, got {page_size}")
    if start < 0:
        raise ValueError(f"kvpass: {who} needs start >= 0, got {start}")
    T = k_new.shape[2]
    if T == 0:
        return
    p0, lead = divmod(start, page_size)
    P_cap = kmin.shape[2]
    n_pages = -(-(lead + T) // page_size)
    if p0 + n_pages > P_cap:
        raise ValueError(
            f"kvpass: {who} needs capacity for {p0 + n_pages} pages (positions up to {start + T}, "
            f"page_size={page_size}), got P_cap={P_cap}; allocate larger kmin/kmax"
        )
    if n_pages == 1:
        # Decode fast path (all new tokens in one page): no page buffer, ~4 small ops.
        new_min, new_max = torch.aminmax(k_new.float(), dim=2, keepdim=True)
    else:
        new_min, new_max = _pages_minmax(k_new, lead, page_size)
    if lead > 0:  # page p0 already summarises tokens [p0 * page_size, start)
        new_min[:, :, 0] = torch.minimum(new_min[:, :, 0], kmin[:, :, p0].float())
        new_max[:, :, 0] = torch.maximum(new_max[:, :, 0], kmax[:, :, p0].float())
    kmin[:, :, p0 : p0 + n_pages] = quest_bounds(new_min, kmin.dtype, up=False)
    kmax[:, :, p0 : p0 + n_pages] = quest_bounds(new_max, kmax.dtype, up=True)


# --------------------------------------------------------------------------------------------------
# Page scores
# --------------------------------------------------------------------------------------------------


@triton.jit
def _quest_page_scores_kernel(
    Q, KMIN, KMAX, OUT,
    stride_qb, stride_qh, stride_qd,
    stride_nb, stride_nh, stride_np, stride_nd,
    stride_xb, stride_xh, stride_xp, stride_xd,
    stride_ob, stride_oh, stride_op,
    H_KV, P, NUM_PAGES, D, G,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * H_kv, cdiv(P, BLOCK_P)); one program scores BLOCK_P pages for the G query heads of
    # one KV head, so each page's metadata is read once per KV head.
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = (pid_bh // H_KV).to(tl.int64)
    hk = (pid_bh % H_KV).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_g = offs_g < G
    live = offs_p < NUM_PAGES  # dead pages are not even loaded (their slots may hold anything)
    heads = hk * G + offs_g

    q_base = Q + b * stride_qb + heads[:, None] * stride_qh
    n_base = KMIN + b * stride_nb + hk * stride_nh + offs_p[:, None] * stride_np
    x_base = KMAX + b * stride_xb + hk * stride_xh + offs_p[:, None] * stride_xp
    s = tl.zeros([BLOCK_G, BLOCK_P], tl.float32)
    # D in chunks keeps the two (BLOCK_P, BLOCK_D) tiles in registers for D up to 256
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        q = tl.load(q_base + offs_d[None, :] * stride_qd, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        q = q.to(tl.float32)
        tile_mask = live[:, None] & mask_d[None, :]
        a = tl.load(n_base + offs_d[None, :] * stride_nd, mask=tile_mask, other=0.0).to(tl.float32)
        c = tl.load(x_base + offs_d[None, :] * stride_xd, mask=tile_mask, other=0.0).to(tl.float32)
        hi = tl.maximum(a, c)
        lo = tl.minimum(a, c)
        # max(q*a, q*c) = relu(q) * max(a, c) + min(q, 0) * min(a, c); fp32 "ieee": exact products
        s += tl.dot(tl.maximum(q, 0.0), tl.trans(hi), input_precision="ieee")
        s += tl.dot(tl.minimum(q, 0.0), tl.trans(lo), input_precision="ieee")
    s = tl.where(s != s, float("inf"), s)  # 0 * inf: a bound past fp16's range, unknown (module docstring)
    s = tl.where(live[None, :], s, float("-inf"))
    tl.store(
        OUT + b * stride_ob + heads[:, None] * stride_oh + offs_p[None, :] * stride_op,
        s,
        mask=mask_g[:, None] & (offs_p < P)[None, :],
    )


def _nan_up(s: torch.Tensor) -> torch.Tensor:
    """Bounds ``s`` with each NaN (``0 * inf``: a bound past fp16's range) counted ``+inf``, in place."""
    return s.nan_to_num_(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))


def _check_scores_inputs(q, kmin, kmax, num_pages, who: str) -> int:
    if q.dim() != 3:
        raise ValueError(f"kvpass: {who} needs q of shape (B, H_q, D), got {tuple(q.shape)}")
    if kmin.dim() != 4 or kmin.shape != kmax.shape:
        raise ValueError(
            f"kvpass: {who} needs kmin and kmax of one shape (B, H_kv, P, D), "
            f"got {tuple(kmin.shape)} and {tuple(kmax.shape)}"
        )
    B, H_q, D = q.shape
    H_kv = kmin.shape[1]
    if kmin.shape[0] != B or kmin.shape[3] != D:
        raise ValueError(
            f"kvpass: {who} needs kmin/kmax of shape (B={B}, H_kv, P, D={D}) to match q, "
            f"got {tuple(kmin.shape)}"
        )
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(
            f"kvpass: {who} needs H_q to be a multiple of H_kv, got H_q={H_q}, H_kv={H_kv}"
        )
    if not (q.is_floating_point() and kmin.is_floating_point() and kmax.is_floating_point()):
        raise ValueError(
            f"kvpass: {who} needs floating-point q, kmin, kmax, got {q.dtype}, {kmin.dtype}, {kmax.dtype}"
        )
    if kmin.device != q.device or kmax.device != q.device:
        raise ValueError(f"kvpass: {who} needs q, kmin, kmax on one device")
    P = kmin.shape[2]
    num_pages = P if num_pages is None else int(num_pages)
    if not 0 <= num_pages <= P:
        raise ValueError(f"kvpass: {who} needs 0 <= num_pages <= P={P}, got num_pages={num_pages}")
    return num_pages


def quest_page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    num_pages: int | None = None,
    block_p: int = 128,
) -> torch.Tensor:
    """Triton Quest page scores.

    Args:
        q: ``(B, H_q, D)`` decode queries, ``H_q = H_kv * G``.
        kmin, kmax: ``(B, H_kv, P, D)`` page metadata, any float dtype and strides (P may be a
            capacity larger than the live page count).
        num_pages: live pages (default P); pages ``>= num_pages`` get ``-inf`` and are not read.
        block_p: pages per program (a power of two >= 16).

    Returns:
        ``(B, H_q, P)`` fp32 scores.
    """
    who = "quest_page_scores"
    num_pages = _check_scores_inputs(q, kmin, kmax, num_pages, who)
    require_triton(q, who, "quest_page_scores_ref")
    if block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"kvpass: {who} needs block_p to be a power of two >= 16, got {block_p}")
    B, H_q, D = q.shape
    H_kv, P = kmin.shape[1], kmin.shape[2]
    G = H_q // H_kv
    out = torch.empty((B, H_q, P), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    grid = (B * H_kv, triton.cdiv(P, block_p))
    _quest_page_scores_kernel[grid](
        q, kmin, kmax, out,
        *q.stride(), *kmin.stride(), *kmax.stride(), *out.stride(),
        H_kv, P, num_pages, D, G,
        BLOCK_G=max(16, triton.next_power_of_2(G)),  # tl.dot needs every dim >= 16
        BLOCK_P=block_p,
        BLOCK_D=max(16, min(64, triton.next_power_of_2(D))),
    )
    return out


def quest_page_scores_ref(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_pages: int | None = None
) -> torch.Tensor:
    """Plain-torch :func:`quest_page_scores` (fp32); the CPU decode path.

    q ``(B, H_q, D)``, kmin/kmax ``(B, H_kv, P, D)`` -> ``(B, H_q, P)`` fp32, pages ``>= num_pages``
    set to ``-inf``. Two batched matmuls over the live pages, no loop over heads.
    """
    num_pages = _check_scores_inputs(q, kmin, kmax, num_pages, "quest_page_scores_ref")
    B, H_q, D = q.shape
    H_kv, P = kmin.shape[1], kmin.shape[2]
    G = H_q // H_kv
    out = torch.full((B, H_q, P), float("-inf"), dtype=torch.float32, device=q.device)
    if num_pages == 0 or out.numel() == 0:
        return out
    qf = q.reshape(B, H_kv, G, D).float()
    a = kmin[:, :, :num_pages].float()
    c = kmax[:, :, :num_pages].float()
    hi, lo = torch.maximum(a, c), torch.minimum(a, c)
    s = torch.matmul(qf.clamp(min=0), hi.transpose(-1, -2))  # (B, H_kv, G, num_pages)
    s.add_(torch.matmul(qf.clamp(max=0), lo.transpose(-1, -2)))
    out[:, :, :num_pages] = _nan_up(s).reshape(B, H_q, num_pages)
    return out


# --------------------------------------------------------------------------------------------------
# The CPU decode step's page choice, in C
# --------------------------------------------------------------------------------------------------

class QuestArgs(ctypes.Structure):
    """``kvpass_quest_args`` (csrc/kvpass.h): ``kvpass_quest_select``'s operands (:class:`QuestStep` fills
    it once and sets only what a step changes)."""

    c_name = "kvpass_quest_args"
    _fields_ = native.fields("q* qs_b qs_h knew* ks_b ks_h meta* ms_b ms_h ms_p first* fs_b pages* ps_b ps_h ps_n "
                             "idx* is_b is_h B H G D L page budget n W gqa_max threads")


class QuestStepArgs(ctypes.Structure):
    """``kvpass_quest_step_args``: the selection's operands, then the attention's over the positions it lists."""

    c_name = "kvpass_quest_step_args"
    _fields_ = [("select", QuestArgs), ("attend", cpu_decode.ListedArgs)]


def _top_lib():
    return native.function("quest", "kvpass_quest_select", [ctypes.POINTER(QuestArgs)])


def quest_top_pages_cpu_available() -> bool:
    """Whether :func:`quest_top_pages_cpu` is built (see :mod:`kvpass.kernels.native`)."""
    return _top_lib() is not None


def _check_select_args(name, fn, q, meta, scored, n, gqa) -> None:
    # at every site of every decode step: is_cpu and one read of each shape (a .device costs a microsecond)
    qs, ms = q.shape, meta.shape
    ok = (fn is not None and type(q) is torch.Tensor and type(meta) is torch.Tensor and q.is_cpu and meta.is_cpu
          and q.dtype == torch.float32 and meta.dtype == BOUNDS_DTYPE and meta.dim() == 4
          and (q.dim() == 3 or (q.dim() == 4 and qs[2] == 1)) and ms[0] == qs[0] and ms[3] == 2 * qs[-1]
          and ms[1] > 0 and qs[1] % ms[1] == 0 and ms[2] > scored >= 0 and n >= 0
          and q.stride(-1) == 1 and meta.stride(3) == 1 and gqa in ("sum", "max"))
    if not ok:
        raise ValueError(
            f"kvpass: {name} needs fp32 CPU q (B, H_q, D) and fp16 meta (B, H_kv, P_cap > scored, 2D) "
            "with contiguous last dims, gqa 'sum' or 'max' and the C kernel built; got q "
            f"{tuple(q.shape)} {q.dtype}, "
            f"meta {tuple(meta.shape)} {meta.dtype}, scored={scored}, n={n}, gqa={gqa!r}"
        )


def quest_top_pages_cpu(
    q: torch.Tensor, meta: torch.Tensor, scored: int, n: int, gqa: str = "sum"
) -> torch.Tensor:
    """The pages a Quest decode step attends, in C: the top ``n`` of pages ``[0, scored)`` by the query
    group's bound (``gqa`` "sum" or "max" of the G queries' bounds), ties to the lower page, in
    ascending page order, then page ``scored`` (the newest, always taken). q ``(B, H_q, D)`` fp32;
    meta ``(B, H_kv, P_cap, 2D)`` fp16 rows ``[max | min]`` (:func:`quest_bounds`), last dim contiguous,
    ``P_cap > scored``.
    Returns ``(B, H_kv, min(n, scored) + 1)`` int64. Equals :func:`quest_top_pages_ref` up to the
    rounding of the bounds (a near-tie may rank the other way). Every row starts at position 0; see
    :func:`quest_select_cpu` for rows that start later (a left-padded batch)."""
    fn = _top_lib()
    _check_select_args("quest_top_pages_cpu", fn, q, meta, scored, n, gqa)
    B, H_q, D = q.shape
    H = meta.shape[1]
    k = min(n, scored)
    out = torch.empty((B, H, k + 1), dtype=torch.int64)
    # one page_size-1 "cache" of scored + 1 pages, no budget: every row scores `scored` pages
    a = QuestArgs(q=q.data_ptr(), qs_b=q.stride(0), qs_h=q.stride(1), meta=meta.data_ptr(),
                  pages=out.data_ptr(), B=B, H=H, G=H_q // H, D=D, L=scored + 1, page=1, budget=-1, n=k, W=k,
                  gqa_max=int(gqa == "max"), threads=torch.get_num_threads())
    a.ms_b, a.ms_h, a.ms_p = meta.stride()[:3]
    a.ps_b, a.ps_h, a.ps_n = out.stride()
    rc = fn(ctypes.byref(a))
    if rc != 0:
        raise MemoryError("kvpass: quest_top_pages_cpu could not allocate its scratch")
    return out


def quest_select_cpu(
    q: torch.Tensor, meta: torch.Tensor, first: torch.Tensor | None, length: int, page_size: int,
    budget: int, n: int, width: int, gqa: str = "sum", k_new: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Quest decode step's choice for a batch whose rows may start late (left padding), in C.

    Row ``b`` holds the cache positions ``[f_b, length)`` (``first (B,)`` or ``(1,)`` int64 CPU, or None:
    every ``f_b`` is 0), cut into its own pages of ``page_size`` from ``f_b``, so its pages are the ones
    the prompt alone has. The newest page is always taken; of the others the row takes all where its
    ``length - f_b`` tokens fit in ``budget`` (alone it attends them all), else the top ``n`` by the
    query group's bound (ties to the lower page). ``q (B, H_q, D)``, or ``(B, H_q, 1, D)`` as a decode
    step's attention receives it; ``meta (B, H_kv, P_cap, 2D)`` fp16 holds each row's pages from its page 0;
    ``P_cap >= ceil(length / page_size)``. ``width``: the most top pages a row takes.

    Returns ``pages (B, H_kv, width + 1)``, each row's top pages ascending, then its newest, then -1,
    and ``idx (B, H_kv, (width + 1) * page_size)``, their token positions in the cache (-1 past
    ``length`` and for -1 pages): what the attention reads. Equals :func:`quest_select_ref` up to
    the rounding of the bounds.

    ``k_new (B, H_kv, D)``: the step's key (cache position ``length - 1``), merged into each row's newest
    page first, as :func:`quest_fold_key_` does (a steady decode step's metadata update, in the same
    call); fp32 with a contiguous last dim, else it is merged in torch before the call. A decode step
    of the runtime makes a :class:`QuestStep` once and calls its ``select``."""
    fn = _top_lib()
    _check_select_args("quest_select_cpu", fn, q, meta, max(-(-length // page_size) - 1, 0), n, gqa)
    if first is not None and not (first.dtype == torch.int64 and first.is_cpu and first.dim() == 1
                                  and first.shape[0] in (1, q.shape[0])):
        raise ValueError(f"kvpass: quest_select_cpu needs first (B,) or (1,) int64 on CPU, got "
                         f"{tuple(first.shape)} {first.dtype}")
    return QuestStep(meta, first, page_size, budget, gqa).select(q, length, n, width, k_new)


class QuestStep:
    """A Quest layer's decode-step selection on CPU (:func:`quest_select_cpu`), its fixed operands checked
    once and its C operands kept in a :class:`QuestStepArgs` (a state makes one where ``meta`` or
    ``first`` is replaced, :meth:`holds`; a step sets only the query, the key, the length, the outputs
    and, where it attends too (:meth:`select_attend`), the cache).

    Args:
        meta: ``(B, H_kv, P_cap, 2D)`` fp16 CPU ``[max | min]`` page bounds (:func:`quest_bounds`), last
            dim contiguous.
        first: ``(B,)`` or ``(1,)`` int64 CPU, each row's first real position (None: 0).
        page_size, budget, gqa: the policy's (Quest, Tang et al. 2024).

    Raises ValueError where these operands are not what the C kernel reads (the message names them)."""

    def __init__(self, meta: torch.Tensor, first: torch.Tensor | None, page_size: int, budget: int,
                 gqa: str = "sum"):
        self._fn = _top_lib()
        self._step_fn = native.function("quest", "kvpass_quest_step", [ctypes.POINTER(QuestStepArgs)])
        ok = (self._fn is not None and type(meta) is torch.Tensor and meta.is_cpu and meta.dtype == BOUNDS_DTYPE
              and meta.dim() == 4 and meta.shape[1] > 0 and meta.shape[3] % 2 == 0 and meta.stride(3) == 1
              and page_size > 0 and gqa in ("sum", "max"))
        b = meta.shape[0] if meta.dim() == 4 else 0
        ok = ok and (first is None or (type(first) is torch.Tensor and first.is_cpu and first.dtype == torch.int64
                                       and first.dim() == 1 and first.shape[0] in (1, b)))
        if not ok:
            raise ValueError(
                "kvpass: a Quest CPU step needs fp16 CPU meta (B, H_kv, P_cap, 2D) with a contiguous last dim, "
                "first None or int64 CPU (B,) or (1,), page_size > 0, gqa 'sum' or 'max' and the C kernel built; "
                f"got meta {tuple(meta.shape)} {meta.dtype}, first "
                f"{None if first is None else (tuple(first.shape), first.dtype)}, page_size={page_size}, gqa={gqa!r}")
        self.meta, self.first = meta, first
        self.b, self.h, self.d, self.cap, self.page = b, meta.shape[1], meta.shape[3] // 2, meta.shape[2], page_size
        self._args = QuestStepArgs()
        a = self._a = self._args.select  # a view into _args (it keeps _args alive)
        self._ref, self._step_ref = ctypes.byref(a), ctypes.byref(self._args)
        self._listed = cpu_decode.ListedAttend(self._args.attend)  # where select_attend runs it
        a.meta, (a.ms_b, a.ms_h, a.ms_p) = meta.data_ptr(), meta.stride()[:3]
        if first is not None:
            a.first, a.fs_b = first.data_ptr(), first.stride(0) if first.shape[0] > 1 else 0
        a.B, a.H, a.D = b, self.h, self.d
        a.page, a.budget = page_size, budget
        a.gqa_max = int(gqa == "max")

    def holds(self, meta: torch.Tensor, first: torch.Tensor | None) -> bool:
        """Whether this step was made for these very tensors (a replaced buffer needs a new one)."""
        return self.meta is meta and self.first is first

    def select(self, q: torch.Tensor, length: int, n: int, width: int,
               k_new: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pages, idx)`` of this step (:func:`quest_select_cpu`), in one C call.

        Args:
            q: ``(B, H_q, D)`` or ``(B, H_q, 1, D)`` fp32, the decode queries, ``H_q = G * H_kv``.
            k_new: the step's key, merged into its page first: ``(B, H_kv, D)``, or the cache ``(B, H_kv,
                S >= length, D)`` whose position ``length - 1`` it is (read in place: no view of it).
        """
        return self._run(self._fn, self._ref, q, length, n, width, k_new)

    def select_attend(self, q: torch.Tensor, length: int, n: int, width: int, k: torch.Tensor,
                      v: torch.Tensor, scale: float, k_new: torch.Tensor | None = None):
        """``(pages, idx, out)``: :meth:`select`, then the decode attention of ``q (B, H_q, 1, D)`` over
        ``idx`` in ``k, v (B, H_kv, S >= length, D)`` (:func:`kvpass.kernels.cpu_decode.decode_step`, read
        in place), ``out (B, H_q, 1, D)``, in one C call; None, having done nothing, where that attention
        does not serve these operands (the caller then selects and attends in two calls)."""
        out = None if self._step_fn is None else self._listed.pack(q, k, v, length, scale)
        if out is None:
            return None
        pages, idx = self._run(self._step_fn, self._step_ref, q, length, n, width, k_new)
        return pages, idx, out

    def _run(self, fn, ref, q, length, n, width, k_new) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d, page = self.b, self.h, self.d, self.page
        qs = q.shape
        if not (type(q) is torch.Tensor and q.is_cpu and q.dtype == torch.float32 and qs[0] == b and qs[-1] == d
                and (len(qs) == 3 or (len(qs) == 4 and qs[2] == 1)) and qs[1] % h == 0 and q.stride(-1) == 1
                and n >= 0 and width >= 0 and 0 <= length <= self.cap * page and self.cap > 0):
            raise ValueError(
                f"kvpass: quest_select_cpu needs fp32 CPU q (B={b}, H_q, D={d}) or (B, H_q, 1, D), H_q a multiple "
                f"of {h}, with a contiguous last dim, n >= 0, width >= 0 and 0 <= length <= P_cap * page_size = "
                f"{self.cap * page}; got q {tuple(qs)} {q.dtype}, n={n}, width={width}, length={length}")
        a = self._a
        a.knew = None
        if k_new is not None:
            ks = k_new.shape
            if (type(k_new) is torch.Tensor and k_new.is_cpu and k_new.dtype == torch.float32 and ks[0] == b
                    and ks[1] == h and ks[-1] == d and k_new.stride(-1) == 1
                    and (len(ks) == 3 or (len(ks) == 4 and ks[2] >= length))):
                at = 0 if len(ks) == 3 else (length - 1) * k_new.stride(2) * 4
                a.knew, a.ks_b, a.ks_h = k_new.data_ptr() + at, k_new.stride(0), k_new.stride(1)
            else:  # another dtype or layout: merged in torch
                quest_fold_key_(self.meta, k_new if len(ks) == 3 else k_new[:, :, length - 1], self.first,
                                length, page)
        pages = torch.empty((b, h, width + 1), dtype=torch.int64)
        idx = torch.empty((b, h, (width + 1) * page), dtype=torch.int64)
        ps, xs = pages.stride(), idx.stride()
        a.q, a.qs_b, a.qs_h = q.data_ptr(), q.stride(0), q.stride(1)
        a.pages, a.ps_b, a.ps_h, a.ps_n = pages.data_ptr(), ps[0], ps[1], ps[2]
        a.idx, a.is_b, a.is_h = idx.data_ptr(), xs[0], xs[1]
        a.G, a.L, a.n, a.W = qs[1] // h, length, n, width
        a.threads = torch.get_num_threads()
        if fn(ref) != 0:
            raise MemoryError("kvpass: quest_select_cpu could not allocate its scratch")
        return pages, idx


def quest_fold_key_(meta: torch.Tensor, k_new: torch.Tensor, first: torch.Tensor | None, length: int,
                    page_size: int) -> None:
    """Merge a decode step's key ``k_new (B, H_kv, D)`` (cache position ``length - 1``) into its row's
    newest page of ``meta (B, H_kv, P_cap, 2D)`` = [max | min], in place: page ``(length - 1 - f_b) //
    page_size`` of a row starting at ``f_b`` (``first (B,)`` or ``(1,)``, None: 0), the key rounded up
    for the max and down for the min where ``meta`` is narrower (:func:`quest_bounds`). Pages not yet
    opened hold -inf | +inf, so every step runs the same ops wherever the page boundary falls."""
    d = k_new.shape[-1]
    k_lo, k_hi = _outward(k_new, meta.dtype)
    if first is None:
        page = meta[:, :, (length - 1) // page_size]
        torch.maximum(page[..., :d], k_hi, out=page[..., :d])
        torch.minimum(page[..., d:], k_lo, out=page[..., d:])
        return
    batch = k_new.shape[0]
    rows = torch.arange(batch, device=meta.device)
    p = (length - 1 - first.to(meta.device).expand(batch)) // page_size
    page = meta[rows, :, p]  # (B, H_kv, 2D)
    meta[rows, :, p] = torch.cat([torch.maximum(page[..., :d], k_hi), torch.minimum(page[..., d:], k_lo)], dim=-1)


def _pages_to_idx(pages: torch.Tensor, first: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Token positions ``(B, H, N * page_size)`` of ``pages (B, H, N)`` of rows starting at ``first (B,)``."""
    pos = (first[:, None, None, None] + pages[..., None] * page_size
           + torch.arange(page_size, device=pages.device)).flatten(-2)
    ok = (pages >= 0).repeat_interleave(page_size, dim=-1) & (pos < length)
    return torch.where(ok, pos, -1)


def _row_budget(first: torch.Tensor | None, batch: int, length: int, page_size: int, budget: int, n: int,
                device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: first position, scored pages (all but the newest) and pages taken (B,) int64."""
    f = (torch.zeros(batch, dtype=torch.int64, device=device) if first is None
         else first.to(device=device, dtype=torch.int64).expand(batch))
    nb = length - f
    scored = torch.where(nb > 0, (nb + page_size - 1) // page_size - 1, -1)
    k = torch.where(nb <= budget, scored, scored.clamp(max=n)).clamp(min=0)
    return f, scored, k


def quest_select_ref(
    q: torch.Tensor, meta: torch.Tensor, first: torch.Tensor | None, length: int, page_size: int,
    budget: int, n: int, width: int, gqa: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch :func:`quest_select_cpu`, row by row through :func:`quest_top_pages_ref` (each row as
    alone: its own pages scored, its own count taken)."""
    B, H = q.shape[0], meta.shape[1]
    f, scored, k = _row_budget(first, B, length, page_size, budget, n, q.device)
    pages = torch.full((B, H, width + 1), -1, dtype=torch.int64)
    for b in range(B):
        if int(scored[b]) < 0:
            continue
        row = quest_top_pages_ref(q[b : b + 1], meta[b : b + 1], int(scored[b]), min(int(k[b]), width), gqa)
        pages[b, :, : row.shape[-1]] = row[0]
    return pages, _pages_to_idx(pages, f.cpu(), length, page_size)


def quest_select_torch(
    q: torch.Tensor, meta: torch.Tensor, first: torch.Tensor | None, length: int, page_size: int,
    budget: int, n: int, width: int, gqa: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quest_select_cpu` in torch ops (any device, no host sync): pages past a row's own are
    scored ``-inf``, the ``width`` best taken in descending order and those past the row's count
    dropped (-1). The same pages as there; the top pages come unordered (ties as torch breaks them)."""
    B, H = q.shape[0], meta.shape[1]
    f, scored, k = _row_budget(first, B, length, page_size, budget, n, q.device)
    pmax = max(-(-length // page_size) - 1, 0)
    scores = _group_bounds(q, meta, pmax, gqa)
    pos = torch.arange(pmax, device=q.device)
    scores = scores.masked_fill(pos >= scored[:, None, None], float("-inf"))
    w = min(width, pmax)
    top = scores.topk(w, dim=-1, sorted=True).indices
    top = torch.where(torch.arange(w, device=q.device) < k[:, None, None], top, -1)
    fill = top.new_full((B, H, width - w), -1)
    pages = torch.cat([top, scored[:, None, None].expand(B, H, 1), fill], dim=-1)
    return pages, _pages_to_idx(pages, f, length, page_size)


def quest_top_pages_ref(
    q: torch.Tensor, meta: torch.Tensor, scored: int, n: int, gqa: str = "sum"
) -> torch.Tensor:
    """Plain torch :func:`quest_top_pages_cpu` (float64 bounds, a stable sort for the ties)."""
    B, H_q, D = q.shape
    H = meta.shape[1]
    qg = q.reshape(B, H, H_q // H, D).double()
    qq = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)  # (B, H, G, 2D)
    per_q = _nan_up(qq @ meta[:, :, :scored].double().transpose(-1, -2))  # (B, H, G, scored)
    bound = per_q.sum(2) if gqa == "sum" else per_q.amax(2)
    k = min(n, scored)
    top = torch.sort(bound, dim=-1, descending=True, stable=True).indices[..., :k].sort(-1).values
    return torch.cat([top, torch.full((B, H, 1), scored, dtype=torch.int64)], dim=-1)


def quest_top_pages_torch(
    q: torch.Tensor, meta: torch.Tensor, scored: int, n: int, gqa: str = "sum"
) -> torch.Tensor:
    """:func:`quest_top_pages_cpu` in torch ops, the CPU path where the C kernel is not built: the
    group's bounds as one product (for ``gqa="sum"`` the summed ``[relu(q) | min(q, 0)]`` as a row
    times ``meta^T``, about 3.6x faster on CPU than ``meta @ q``), ``topk`` (unordered; ties as torch
    breaks them), then the newest page. Shapes as there."""
    B, H = q.shape[0], meta.shape[1]
    top = _group_bounds(q, meta, scored, gqa).topk(min(n, scored), dim=-1, sorted=False).indices
    return torch.cat([top, top.new_full((B, H, 1), scored)], dim=-1)


def _group_bounds(q: torch.Tensor, meta: torch.Tensor, pages: int, gqa: str) -> torch.Tensor:
    """(B, H_kv, pages) fp32 bounds of pages ``[0, pages)`` for the query group of each KV head: one
    product (for ``gqa="sum"`` the summed ``[relu(q) | min(q, 0)]`` as a row times ``meta^T``)."""
    B, H_q, D = q.shape
    H = meta.shape[1]
    qg = q.reshape(B, H, H_q // H, D).float()
    qq = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)  # (B, H, G, 2D)
    m = meta[:, :, :pages].float()
    if gqa == "sum":
        return _nan_up(torch.matmul(qq.sum(2, keepdim=True), m.transpose(-1, -2))[:, :, 0])
    return _nan_up(torch.matmul(qq, m.transpose(-1, -2))).amax(2)

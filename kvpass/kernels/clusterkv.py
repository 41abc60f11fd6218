"""ClusterKV: cosine k-means of the keys and budgeted recall of whole clusters.

ClusterKV (Liu et al., "ClusterKV: Manipulating LLM KV Cache in Semantic Space for Recallable
Compression", arXiv 2412.03213, DAC 2025) clusters the keys of every KV head with k-means under the
cosine distance ``1 - <a, b> / (|a| |b|)``. At decode the query scores every cluster by ``q . mu``
(``mu`` the mean of the cluster's raw keys) and whole clusters are recalled in descending score
order until the token budget is filled.

Shapes (``B`` batch, ``H`` KV heads, ``N`` clustered tokens, ``C`` clusters, ``D`` head dim)::

    keys       (B, H, N, D)    fp16 / bf16 / fp32, any strides
    centroids  (B, H, C, D)    fp32 (unit directions for the assignment, raw means mu for scoring)
    labels     (B, H, N)       int64 cluster of each token; values outside [0, C) are padding
    sizes      (B, H, C)       int64 tokens per cluster
    offsets    (B, H, C + 1)   int64 exclusive prefix sums of sizes
    order      (B, H, N)       int64 token positions grouped by cluster: cluster c is
                               order[..., offsets[c]:offsets[c + 1]]
    scores     (B, H, C)       fp32 q . mu per cluster (-inf: never select)
    idx        (B, H, budget)  int64 selected positions, -1 padding at the end

Normalisation everywhere is ``x / max(|x|, 1e-6)`` in fp32, so a zero key is a zero vector with
similarity 0 to every centroid (never NaN). Keys are assumed finite.

Contents (Triton kernel ``_name_kernel``, launcher ``name``, plain-torch ``name_ref``; the references
are the CPU implementation used in production):

- :func:`kmeans_assign` / :func:`kmeans_assign_ref`: nearest centroid by cosine similarity, ties to the
  lowest cluster index.
- :func:`centroid_update` / :func:`centroid_update_ref`: per-cluster sums of (unit) keys and counts;
  the kernel spreads ``tl.atomic_add`` over the sequence, as in the paper's implementation.
- :func:`cosine_kmeans`: the spherical k-means driver, returning a :class:`KMeans`.
- :func:`select_clusters` / :func:`select_clusters_ref`: the budgeted cluster recall;
  :func:`select_clusters_cpu`, the same recall in C (one call instead of a dozen small torch ops per
  site and step; :mod:`kvpass.kernels.native`), the CPU path where it is built.
- :func:`cluster_select_torch` / :func:`cluster_select_cpu`: a decode step's whole list (each row's
  sinks, recalled clusters and recent tokens, or all of a row that fits the budget), the C one in one
  call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_decode, native
from .sparse_attention import sinks_picked_recent
from ._triton import interpreting, require_triton, tl, triton

__all__ = [
    "KMeans",
    "centroid_update",
    "centroid_update_ref",
    "cosine_kmeans",
    "kmeans_assign",
    "kmeans_assign_ref",
    "select_clusters",
    "select_clusters_cpu",
    "select_clusters_ref",
    "cluster_scores",
    "cluster_select_cpu",
    "cluster_select_torch",
]

_EPS = 1e-6  # norm floor of the normalisation x / max(|x|, eps)
_MAX_D = 256  # the kernels hold a whole key row in one block
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x / max(|x|, eps)`` along the last dim."""
    x = x.float()
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(_EPS)


def _need_triton(t: torch.Tensor, who: str) -> None:
    require_triton(t, who, f"{who}_ref")


def _check_block(value: int, name: str, who: str) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"kvpass: {who} needs {name} to be a power of two >= 16, got {value}")


def _check_head_dim(D: int, who: str) -> int:
    if D > _MAX_D:
        raise ValueError(
            f"kvpass: {who} needs head dim D <= {_MAX_D} (one block per key row), got D={D}; "
            f"use {who}_ref"
        )
    return max(16, triton.next_power_of_2(D))  # tl.dot needs every dim >= 16


def _default_block_n(block_d: int) -> int:
    # The interpreter pays per block operation: few large blocks. On a GPU a (BLOCK_N, BLOCK_D) fp32
    # tile must stay in registers (a guess, not measured).
    if interpreting():
        return 128
    return 64 if block_d <= 128 else 32


def _check_keys(keys: torch.Tensor, who: str) -> None:
    if keys.dim() != 4:
        raise ValueError(f"kvpass: {who} needs keys of shape (B, H, N, D), got {tuple(keys.shape)}")
    if keys.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kvpass: {who} needs keys of dtype float16/bfloat16/float32, got {keys.dtype}")


# --------------------------------------------------------------------------------------------------
# Assignment
# --------------------------------------------------------------------------------------------------


@triton.jit
def _kmeans_assign_kernel(
    X, CEN, LABELS, SIM,
    stride_xb, stride_xh, stride_xn, stride_xd,
    stride_cb, stride_ch, stride_cc, stride_cd,
    stride_lb, stride_lh, stride_ln,
    stride_sb, stride_sh, stride_sn,
    H, N, C, D,
    EPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * H, cdiv(N, BLOCK_N)); one program assigns BLOCK_N keys of one (b, h), looping over
    # the centroids in BLOCK_C chunks with a running max / argmax.
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D

    x_rows = X + b * stride_xb + h * stride_xh + offs_n[:, None].to(tl.int64) * stride_xn
    x = tl.load(
        x_rows + offs_d[None, :] * stride_xd,
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # bf16 is converted at once (the interpreter cannot do bf16 arithmetic)
    x = x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), EPS)[:, None]

    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    best_c = tl.zeros([BLOCK_N], tl.int32)
    c_base = CEN + b * stride_cb + h * stride_ch
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        cen = tl.load(
            c_base + offs_c[:, None].to(tl.int64) * stride_cc + offs_d[None, :] * stride_cd,
            mask=mask_c[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)
        cen = cen / tl.maximum(tl.sqrt(tl.sum(cen * cen, axis=1)), EPS)[:, None]
        # fp32 "ieee": exact products, so near-ties resolve as in the reference
        s = tl.dot(x, tl.trans(cen), input_precision="ieee")  # (BLOCK_N, BLOCK_C)
        s = tl.where(mask_c[None, :], s, float("-inf"))
        c_max = tl.max(s, axis=1)
        # the lowest cluster index attaining the chunk maximum
        c_arg = tl.min(tl.where(s == c_max[:, None], offs_c[None, :], C), axis=1)
        better = c_max > best  # strict: an earlier (lower) cluster keeps a tie
        best = tl.where(better, c_max, best)
        best_c = tl.where(better, c_arg, best_c)

    offs_n64 = offs_n.to(tl.int64)
    tl.store(LABELS + b * stride_lb + h * stride_lh + offs_n64 * stride_ln, best_c.to(tl.int64), mask=mask_n)
    tl.store(SIM + b * stride_sb + h * stride_sh + offs_n64 * stride_sn, best, mask=mask_n)


def _check_assign_inputs(keys: torch.Tensor, centroids: torch.Tensor, who: str) -> None:
    _check_keys(keys, who)
    B, H, _, D = keys.shape
    if centroids.dim() != 4 or centroids.shape[:2] != (B, H) or centroids.shape[3] != D:
        raise ValueError(
            f"kvpass: {who} needs centroids of shape (B={B}, H={H}, C, D={D}), got {tuple(centroids.shape)}"
        )
    if centroids.shape[2] < 1:
        raise ValueError(f"kvpass: {who} needs at least one centroid (C >= 1), got C=0")
    if centroids.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"kvpass: {who} needs floating-point centroids (float32), got {centroids.dtype}")
    if centroids.device != keys.device:
        raise ValueError(
            f"kvpass: {who} needs keys and centroids on one device, got {keys.device}, {centroids.device}"
        )


def kmeans_assign(
    keys: torch.Tensor,
    centroids: torch.Tensor,
    *,
    block_n: int | None = None,
    block_c: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton nearest-centroid assignment under cosine similarity.

    Args:
        keys: ``(B, H, N, D)`` fp16/bf16/fp32, any strides, ``D <= 256``.
        centroids: ``(B, H, C, D)`` fp32 (any float dtype is read as fp32), any strides, ``C >= 1``;
            need not be unit vectors.
        block_n: keys per program (power of two >= 16; default 128 interpreted, 64/32 on a GPU).
        block_c: centroids per loop step (power of two >= 16; default 64, 32 on a GPU for D > 128).

    Returns:
        ``labels (B, H, N)`` int64, the argmax over c of ``sim[n, c] = x_hat . c_hat`` with ties to the
        lowest c, and ``sim (B, H, N)`` fp32, that maximum. A zero key scores 0 against every
        centroid, so it gets label 0 and sim 0. Raises ``ValueError`` for ``D > 256``.
    """
    who = "kmeans_assign"
    _check_assign_inputs(keys, centroids, who)
    _need_triton(keys, who)
    B, H, N, D = keys.shape
    C = centroids.shape[2]
    block_d = _check_head_dim(D, who)
    block_n = _default_block_n(block_d) if block_n is None else block_n
    if block_c is None:
        block_c = 64 if interpreting() or block_d <= 128 else 32
    _check_block(block_n, "block_n", who)
    _check_block(block_c, "block_c", who)
    labels = torch.empty((B, H, N), dtype=torch.int64, device=keys.device)
    sim = torch.empty((B, H, N), dtype=torch.float32, device=keys.device)
    if labels.numel() == 0:
        return labels, sim
    grid = (B * H, triton.cdiv(N, block_n))
    _kmeans_assign_kernel[grid](
        keys, centroids, labels, sim,
        *keys.stride(), *centroids.stride(), *labels.stride(), *sim.stride(),
        H, N, C, D,
        EPS=_EPS,
        BLOCK_N=block_n,
        BLOCK_C=block_c,
        BLOCK_D=block_d,
    )
    return labels, sim


def kmeans_assign_ref(keys: torch.Tensor, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`kmeans_assign` (fp32); the CPU implementation.

    keys ``(B, H, N, D)``, centroids ``(B, H, C, D)`` -> ``labels (B, H, N)`` int64 (ties to the lowest
    c), ``sim (B, H, N)`` fp32. One batched matmul of the unit vectors; memory ``B*H*N*C`` fp32.
    """
    _check_assign_inputs(keys, centroids, "kmeans_assign_ref")
    sim = torch.matmul(_unit(keys), _unit(centroids).transpose(-1, -2))  # (B, H, N, C)
    best, labels = sim.max(dim=-1)  # torch returns the first maximal index
    return labels, best


# --------------------------------------------------------------------------------------------------
# Centroid update
# --------------------------------------------------------------------------------------------------


@triton.jit
def _centroid_update_kernel(
    X, LABELS, SUMS, COUNTS,
    stride_xb, stride_xh, stride_xn, stride_xd,
    stride_lb, stride_lh, stride_ln,
    stride_sb, stride_sh, stride_sc, stride_sd,
    stride_cb, stride_ch, stride_cc,
    H, N, C, D,
    EPS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (B * H, cdiv(N, BLOCK_N)); each program adds its block of tokens into the per-cluster
    # sums of its (b, h) with atomics (the reduction is spread over the sequence).
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D

    lab_ptrs = LABELS + b * stride_lb + h * stride_lh + offs_n * stride_ln
    lab = tl.load(lab_ptrs, mask=mask_n, other=-1).to(tl.int64)
    valid = mask_n & (lab >= 0) & (lab < C)  # out-of-range labels are padding
    lab = tl.where(valid, lab, 0)  # never form an out-of-bounds address, even masked
    tile_mask = valid[:, None] & mask_d[None, :]
    x = tl.load(
        X + b * stride_xb + h * stride_xh + offs_n[:, None] * stride_xn + offs_d[None, :] * stride_xd,
        mask=tile_mask,
        other=0.0,
    ).to(tl.float32)
    if NORMALIZE:
        x = x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), EPS)[:, None]
    tl.atomic_add(
        SUMS + b * stride_sb + h * stride_sh + lab[:, None] * stride_sc + offs_d[None, :] * stride_sd,
        x,
        mask=tile_mask,
    )
    tl.atomic_add(
        COUNTS + b * stride_cb + h * stride_ch + lab * stride_cc,
        tl.where(valid, 1.0, 0.0),
        mask=valid,
    )


def _check_update_inputs(keys, labels, num_clusters, who: str) -> None:
    _check_keys(keys, who)
    B, H, N, _ = keys.shape
    if labels.dim() != 3 or tuple(labels.shape) != (B, H, N):
        raise ValueError(
            f"kvpass: {who} needs labels of shape (B={B}, H={H}, N={N}), got {tuple(labels.shape)}"
        )
    if labels.dtype not in _INT_DTYPES:
        raise ValueError(f"kvpass: {who} needs labels of dtype int32 or int64, got {labels.dtype}")
    if labels.device != keys.device:
        raise ValueError(
            f"kvpass: {who} needs keys and labels on one device, got {keys.device}, {labels.device}"
        )
    if num_clusters < 0:
        raise ValueError(f"kvpass: {who} needs num_clusters >= 0, got {num_clusters}")


def centroid_update(
    keys: torch.Tensor,
    labels: torch.Tensor,
    num_clusters: int,
    normalize: bool,
    *,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-cluster sums and counts (atomics).

    Args:
        keys: ``(B, H, N, D)`` fp16/bf16/fp32, any strides, ``D <= 256``.
        labels: ``(B, H, N)`` int32/int64, any strides; labels ``< 0`` or ``>= num_clusters`` are
            padding (ignored, their keys are not read).
        num_clusters: C.
        normalize: sum unit keys ``x / max(|x|, 1e-6)`` (spherical k-means) instead of raw keys.
        block_n: tokens per program (power of two >= 16).

    Returns:
        ``sums (B, H, C, D)`` fp32 and ``counts (B, H, C)`` fp32. The order of the fp32 atomic adds
        varies, so sums match the reference only up to rounding.
    """
    who = "centroid_update"
    _check_update_inputs(keys, labels, num_clusters, who)
    _need_triton(keys, who)
    B, H, N, D = keys.shape
    C = int(num_clusters)
    block_d = _check_head_dim(D, who)
    block_n = _default_block_n(block_d) if block_n is None else block_n
    _check_block(block_n, "block_n", who)
    sums = torch.zeros((B, H, C, D), dtype=torch.float32, device=keys.device)
    counts = torch.zeros((B, H, C), dtype=torch.float32, device=keys.device)
    if sums.numel() == 0 or N == 0:
        return sums, counts
    grid = (B * H, triton.cdiv(N, block_n))
    _centroid_update_kernel[grid](
        keys, labels, sums, counts,
        *keys.stride(), *labels.stride(), *sums.stride(), *counts.stride(),
        H, N, C, D,
        EPS=_EPS,
        NORMALIZE=bool(normalize),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return sums, counts


def centroid_update_ref(
    keys: torch.Tensor, labels: torch.Tensor, num_clusters: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`centroid_update` (fp32, one ``index_add_`` and one ``bincount``); the CPU
    implementation. Padding labels go to a spare row that is dropped."""
    _check_update_inputs(keys, labels, num_clusters, "centroid_update_ref")
    B, H, N, D = keys.shape
    C = int(num_clusters)
    x = _unit(keys) if normalize else keys.float()
    lab = labels.long()
    valid = (lab >= 0) & (lab < C)
    rows = torch.arange(B * H, device=keys.device).view(B, H, 1) * C + lab
    rows = torch.where(valid, rows, B * H * C).reshape(-1)
    sums = torch.zeros((B * H * C + 1, D), dtype=torch.float32, device=keys.device)
    sums.index_add_(0, rows, x.reshape(B * H * N, D))
    counts = torch.bincount(rows, minlength=B * H * C + 1).float()
    return sums[:-1].view(B, H, C, D), counts[:-1].view(B, H, C)


# --------------------------------------------------------------------------------------------------
# k-means driver
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KMeans:
    """Result of :func:`cosine_kmeans` (shapes as in the module docstring)."""

    labels: torch.Tensor  # (B, H, N) int64 in [0, C)
    directions: torch.Tensor  # (B, H, C, D) fp32 unit: the spherical k-means centres
    centroids: torch.Tensor  # (B, H, C, D) fp32 mean of the raw member keys (mu; 0 when empty)
    sizes: torch.Tensor  # (B, H, C) int64
    order: torch.Tensor  # (B, H, N) int64 positions sorted by label, ascending inside a cluster
    offsets: torch.Tensor  # (B, H, C + 1) int64 exclusive prefix sums of sizes
    objective: list[float]  # sum of (1 - x_hat . c_hat[label]) after each assignment
    iters: int  # assignment steps run


def cosine_kmeans(
    keys: torch.Tensor,
    num_clusters: int,
    max_iters: int = 16,
    seed: int = 0,
    use_triton: bool = False,
) -> KMeans:
    """Spherical (cosine) k-means of each KV head's keys, ClusterKV (arXiv 2412.03213).

    Args:
        keys: ``(B, H, N, D)`` fp16/bf16/fp32, any strides, ``N >= 1``.
        num_clusters: C, ``1 <= C <= N``.
        max_iters: at most this many assignment steps (>= 1).
        seed: seeds the ``torch.Generator`` (on the keys' device) that draws, per KV head, C distinct
            token positions (the same for every batch row) whose unit keys are the initial directions.
        use_triton: run :func:`kmeans_assign` / :func:`centroid_update` (else their references).

    Each iteration assigns every token to its most similar direction, stops when the labels did not
    change, and otherwise moves every direction to the normalised sum of its members' unit keys; a
    cluster whose member sum is zero (empty, or only zero keys) keeps its direction. The returned
    directions are those of the returned labels (the update of the last assignment).
    """
    who = "cosine_kmeans"
    _check_keys(keys, who)
    B, H, N, D = keys.shape
    C = int(num_clusters)
    if N < 1:
        raise ValueError(f"kvpass: {who} needs at least one token (N >= 1), got N=0")
    if not 1 <= C <= N:
        raise ValueError(f"kvpass: {who} needs 1 <= num_clusters <= N={N}, got num_clusters={num_clusters}")
    if max_iters < 1:
        raise ValueError(f"kvpass: {who} needs max_iters >= 1, got {max_iters}")
    if use_triton:
        assign, update = kmeans_assign, centroid_update
    else:
        # The CPU path normalises the keys once, not in every iteration (the directions are unit
        # vectors already): the same assignments as kmeans_assign_ref, about a third less work.
        unit = _unit(keys)

        def assign(_keys, dirs):
            best, labels = torch.matmul(unit, dirs.transpose(-1, -2)).max(dim=-1)
            return labels, best

        def update(_keys, labels, num, normalize):
            return centroid_update_ref(unit if normalize else _keys, labels, num, False)
    dev = keys.device

    gen = torch.Generator(device=dev)
    gen.manual_seed(int(seed))
    # C distinct positions per head: the top C of N uniform draws (a random C-subset), the same for
    # every batch row, so that a row's clusters do not depend on its place in the batch (a beam
    # reorder, a row served alone); a batch of one draws exactly what it drew before
    init = torch.rand((1, H, N), generator=gen, device=dev).topk(C, dim=-1).indices.expand(B, -1, -1)
    directions = _unit(torch.gather(keys, 2, init[..., None].expand(B, H, C, D)))

    objective: list[float] = []
    prev = None
    iters = 0
    for _ in range(max_iters):
        labels, sim = assign(keys, directions)
        iters += 1
        objective.append(float((1.0 - sim.double()).sum()))
        if prev is not None and torch.equal(labels, prev):
            break  # directions are already the update of these labels
        sums, _ = update(keys, labels, C, True)
        norm = torch.linalg.vector_norm(sums, dim=-1, keepdim=True)
        directions = torch.where(norm > 0, sums / norm.clamp_min(1e-30), directions)
        prev = labels

    raw_sums, _ = update(keys, labels, C, False)
    sizes = torch.zeros((B, H, C), dtype=torch.int64, device=dev)
    sizes.scatter_add_(2, labels, torch.ones_like(labels))
    centroids = raw_sums / sizes.clamp_min(1).to(torch.float32)[..., None]
    order = torch.sort(labels, dim=-1, stable=True).indices
    offsets = torch.zeros((B, H, C + 1), dtype=torch.int64, device=dev)
    torch.cumsum(sizes, dim=-1, out=offsets[..., 1:])
    return KMeans(
        labels=labels,
        directions=directions,
        centroids=centroids,
        sizes=sizes,
        order=order,
        offsets=offsets,
        objective=objective,
        iters=iters,
    )


# --------------------------------------------------------------------------------------------------
# Cluster selection
# --------------------------------------------------------------------------------------------------


@triton.jit
def _select_clusters_kernel(
    SCORES, IDS, SIZES, OFFSETS, ORDER, OUT,
    stride_tb, stride_th, stride_tc,
    stride_ib, stride_ih, stride_ic,
    stride_zb, stride_zh, stride_zc,
    stride_fb, stride_fh, stride_fc,
    stride_ob, stride_oh, stride_on,
    stride_xb, stride_xh, stride_xj,
    H, C, N, BUDGET,
    BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # grid: (B * H, cdiv(BUDGET, BLOCK_J)). SCORES / IDS are the scores sorted in descending order and
    # the cluster ids in that order. Each program walks the ranked clusters in BLOCK_C chunks with a
    # running prefix sum of their sizes, finds for each of its output slots j the cluster whose
    # [start, end) range holds j (a masked sum instead of a search), and emits order[offset + j - start].
    pid_bh = tl.program_id(0)
    pid_j = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_j = (pid_j * BLOCK_J + tl.arange(0, BLOCK_J)).to(tl.int64)
    mask_j = offs_j < BUDGET

    src = tl.zeros([BLOCK_J], tl.int64)  # offset + j - start of the cluster holding slot j
    hits = tl.zeros([BLOCK_J], tl.int32)
    carry = tl.sum(tl.zeros([BLOCK_C], tl.int64), axis=0)  # tokens of the clusters ranked before
    score_base = SCORES + b * stride_tb + h * stride_th
    ids_base = IDS + b * stride_ib + h * stride_ih
    sizes_base = SIZES + b * stride_zb + h * stride_zh
    offsets_base = OFFSETS + b * stride_fb + h * stride_fh
    for c0 in range(0, C, BLOCK_C):
        offs_r = c0 + tl.arange(0, BLOCK_C)
        mask_r = offs_r < C
        score = tl.load(score_base + offs_r * stride_tc, mask=mask_r, other=float("-inf"))
        cid = tl.load(ids_base + offs_r * stride_ic, mask=mask_r, other=0).to(tl.int64)
        cid = tl.where(mask_r & (cid >= 0) & (cid < C), cid, 0)
        size = tl.load(sizes_base + cid * stride_zc, mask=mask_r, other=0).to(tl.int64)
        off = tl.load(offsets_base + cid * stride_fc, mask=mask_r, other=0).to(tl.int64)
        # -inf and NaN scores (score > -inf is false) and empty clusters take no slot
        eff = tl.where(mask_r & (score > float("-inf")), tl.maximum(size, 0), 0)
        end = carry + tl.cumsum(eff, axis=0)
        start = end - eff
        hit = (offs_j[:, None] >= start[None, :]) & (offs_j[:, None] < end[None, :])
        src += tl.sum(tl.where(hit, off[None, :] - start[None, :], 0), axis=1)
        hits += tl.sum(hit.to(tl.int32), axis=1)
        carry += tl.sum(eff, axis=0)

    src = src + offs_j
    ok = mask_j & (hits > 0) & (src >= 0) & (src < N)
    src = tl.where(ok, src, 0)
    tok = tl.load(ORDER + b * stride_ob + h * stride_oh + src * stride_on, mask=ok, other=-1).to(tl.int64)
    tl.store(
        OUT + b * stride_xb + h * stride_xh + offs_j * stride_xj,
        tl.where(ok, tok, -1),
        mask=mask_j,
    )


def _check_select_inputs(scores, sizes, offsets, order, budget, who: str) -> None:
    if scores.dim() != 3:
        raise ValueError(f"kvpass: {who} needs scores of shape (B, H, C), got {tuple(scores.shape)}")
    B, H, C = scores.shape
    if not scores.is_floating_point():
        raise ValueError(f"kvpass: {who} needs floating-point scores (float32), got {scores.dtype}")
    if tuple(sizes.shape) != (B, H, C):
        raise ValueError(
            f"kvpass: {who} needs sizes of shape (B={B}, H={H}, C={C}), got {tuple(sizes.shape)}"
        )
    if tuple(offsets.shape) != (B, H, C + 1):
        raise ValueError(
            f"kvpass: {who} needs offsets of shape (B={B}, H={H}, C+1={C + 1}), got {tuple(offsets.shape)}"
        )
    if order.dim() != 3 or tuple(order.shape[:2]) != (B, H):
        raise ValueError(f"kvpass: {who} needs order of shape (B={B}, H={H}, N), got {tuple(order.shape)}")
    for name, t in (("sizes", sizes), ("offsets", offsets), ("order", order)):
        if t.dtype not in _INT_DTYPES:
            raise ValueError(f"kvpass: {who} needs {name} of dtype int32 or int64, got {t.dtype}")
        if t.device != scores.device:
            raise ValueError(f"kvpass: {who} needs {name} on {scores.device}, got {t.device}")
    if int(budget) < 0:
        raise ValueError(f"kvpass: {who} needs budget >= 0, got budget={budget}")


def select_clusters(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    budget: int,
    *,
    block_j: int = 128,
    block_c: int = 128,
) -> torch.Tensor:
    """Budgeted recall of whole clusters (Triton prefix sums and index emission).

    Args:
        scores: ``(B, H, C)`` fp32 cluster scores (q . mu); ``-inf`` (and NaN) clusters are never chosen.
        sizes: ``(B, H, C)`` int tokens per cluster (size-0 clusters are skipped).
        offsets: ``(B, H, C + 1)`` int; cluster c's tokens are
            ``order[..., offsets[c]:offsets[c] + sizes[c]]``.
        order: ``(B, H, N)`` int token positions grouped by cluster (values copied as they are).
        budget: output slots, >= 0.
        block_j, block_c: output slots / clusters per block (powers of two >= 16).

    Returns:
        ``(B, H, budget)`` int64: clusters in descending score order (ties to the lower cluster
        index), whole while they fit, the last one trimmed to its first members so the budget is
        filled exactly; ``-1`` padding at the end when the eligible clusters hold fewer tokens.
        The descending sort itself is ``torch.sort(stable=True)`` in the launcher.
    """
    who = "select_clusters"
    _check_select_inputs(scores, sizes, offsets, order, budget, who)
    _need_triton(scores, who)
    _check_block(block_j, "block_j", who)
    _check_block(block_c, "block_c", who)
    B, H, C = scores.shape
    N = order.shape[2]
    budget = int(budget)
    out = torch.empty((B, H, budget), dtype=torch.int64, device=scores.device)
    if out.numel() == 0:
        return out
    if C == 0:
        return out.fill_(-1)
    sorted_scores, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    grid = (B * H, triton.cdiv(budget, block_j))
    _select_clusters_kernel[grid](
        sorted_scores, ids, sizes, offsets, order, out,
        *sorted_scores.stride(), *ids.stride(), *sizes.stride(), *offsets.stride(),
        *order.stride(), *out.stride(),
        H, C, N, budget,
        BLOCK_J=block_j,
        BLOCK_C=min(block_c, max(16, triton.next_power_of_2(C))),
    )
    return out


def select_clusters_ref(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    budget: int,
) -> torch.Tensor:
    """Plain-torch :func:`select_clusters`; the CPU implementation. Vectorised: stable descending
    sort, cumulative sizes in rank order, ``searchsorted`` of every output slot to its cluster rank,
    one gather from ``order``. Shapes and conventions as in :func:`select_clusters`."""
    _check_select_inputs(scores, sizes, offsets, order, budget, "select_clusters_ref")
    B, H, C = scores.shape
    N = order.shape[2]
    budget = int(budget)
    dev = scores.device
    if B * H * budget == 0 or C == 0 or N == 0:
        return torch.full((B, H, budget), -1, dtype=torch.int64, device=dev)
    sorted_scores, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    eff = torch.gather(sizes.long(), 2, ids).clamp_min(0)
    eff = torch.where(sorted_scores > float("-inf"), eff, 0)  # NaN compares false: skipped too
    end = eff.cumsum(dim=-1)  # (B, H, C), nondecreasing
    slots = torch.arange(budget, device=dev).expand(B, H, budget).contiguous()
    rank = torch.searchsorted(end, slots, right=True)  # first rank whose end > j
    hit = rank < C
    rank = rank.clamp_max(C - 1)
    start = torch.gather(end - eff, 2, rank)
    cid = torch.gather(ids, 2, rank)
    src = torch.gather(offsets.long(), 2, cid) + slots - start
    ok = hit & (src >= 0) & (src < N)
    tok = torch.gather(order.long(), 2, torch.where(ok, src, 0))
    return torch.where(ok, tok, -1)


class SelectClustersArgs(ctypes.Structure):
    """``kvpass_select_clusters_args`` (csrc/kvpass.h): ``kvpass_select_clusters``' operands."""

    c_name = "kvpass_select_clusters_args"
    _fields_ = native.fields("scores* ss_b ss_h ss_c sizes* zs_b zs_h zs_c offsets* fs_b fs_h fs_c order* rs_b rs_h "
                             "rs_n out* xs_b xs_h xs_j B H C N budget")


def _select_lib():
    return native.function("clusterkv", "kvpass_select_clusters", [ctypes.POINTER(SelectClustersArgs)])


class ClusterArgs(ctypes.Structure):
    """``kvpass_cluster_args`` (csrc/kvpass.h): ``kvpass_cluster_select``'s operands (:class:`ClusterStep`
    fills it once and sets only what a step changes)."""

    c_name = "kvpass_cluster_args"
    _fields_ = native.fields("q* qs_b qs_h cent* cs_b cs_h cs_c sizes* zs_b zs_h zs_c offsets* fs_b fs_h fs_c "
                             "order* rs_b rs_h rs_n first* ft_b out* xs_b xs_h B H G D C N L n_sinks cluster_budget "
                             "n_recent cover W gqa_max")


class ClusterStepArgs(ctypes.Structure):
    """``kvpass_cluster_step_args``: the selection's operands, then the attention's over its list."""

    c_name = "kvpass_cluster_step_args"
    _fields_ = [("select", ClusterArgs), ("attend", cpu_decode.ListedArgs)]


def _cluster_select_lib():
    # the runtime's entry: the step's operands in one struct (ClusterStep)
    return native.function("clusterkv", "kvpass_cluster_select", [ctypes.POINTER(ClusterArgs)])


def select_clusters_cpu_available() -> bool:
    """Whether :func:`select_clusters_cpu` is built (see :mod:`kvpass.kernels.native`)."""
    return _select_lib() is not None


def select_clusters_cpu(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor,
    budget: int,
) -> torch.Tensor:
    """:func:`select_clusters_ref` in C, on CPU tensors: the same ``(B, H, budget)`` int64 positions
    (exactly: the ranking is a stable sort of the same fp32 scores), from one call instead of a dozen
    torch ops. Shapes and conventions as in :func:`select_clusters`."""
    who = "select_clusters_cpu"
    _check_select_inputs(scores, sizes, offsets, order, budget, who)
    fn = _select_lib()
    if fn is None or scores.device.type != "cpu":
        raise ValueError(f"kvpass: {who} needs CPU tensors and the C kernel built "
                         "(kvpass.kernels.clusterkv.select_clusters_cpu_available())")
    B, H, C = scores.shape
    N, budget = order.shape[2], int(budget)
    out = torch.empty((B, H, budget), dtype=torch.int64)
    if out.numel() == 0:
        return out
    scores, sizes, offsets, order = scores.float(), sizes.long(), offsets.long(), order.long()
    rc = fn(SelectClustersArgs(scores.data_ptr(), *scores.stride(), sizes.data_ptr(), *sizes.stride(),
                                offsets.data_ptr(), *offsets.stride(), order.data_ptr(), *order.stride(),
                                out.data_ptr(), *out.stride(), B, H, C, N, budget))
    if rc != 0:
        raise MemoryError(f"kvpass: {who} could not allocate its scratch")
    return out


# --------------------------------------------------------------------------------------------------
# A decode step's whole selection: sinks, recalled clusters, recent tokens
# --------------------------------------------------------------------------------------------------


def _first_rows(first: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    if first is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    return first.to(device=device, dtype=torch.int64).expand(batch)


def cluster_scores(q: torch.Tensor, centroids: torch.Tensor, gqa: str = "sum") -> torch.Tensor:
    """``(B, H, C)`` fp32 q·μ of each cluster for the decode queries ``q (B, H_q, D)`` (``H_q = G H``),
    the query group combined by ``gqa``: "sum" scores the group's summed query, "max" takes the
    largest of its members' scores."""
    b, h, _, d = centroids.shape
    qg = q.reshape(b, h, -1, d).float()
    if gqa == "sum":
        return torch.matmul(centroids, qg.sum(2)[..., None])[..., 0]
    return torch.matmul(qg, centroids.transpose(-1, -2)).amax(2)


def cluster_select_torch(
    q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
    first: torch.Tensor | None, length: int, n_sinks: int, cluster_budget: int, n_recent: int, cover: int,
    width: int, gqa: str = "sum", select=select_clusters_ref,
) -> torch.Tensor:
    """The positions a ClusterKV decode step attends, ``(B, H, width)`` int64, -1 padding.

    Row b starts at cache position ``f_b`` (``first (B,)`` or ``(1,)``, None: 0). Where ``cover >= 0``
    and the row's own length ``length - f_b`` is at most ``cover``, the row lists all of ``[f_b,
    length)`` (it fits the budget: alone it attends everything). Otherwise it lists its sinks ``f_b +
    [0, n_sinks)``, then ``cluster_budget`` slots of the best whole clusters by :func:`cluster_scores`
    (``select``: :func:`select_clusters_ref` or a launcher with its signature), then the recent tokens
    ``[length - n_recent, length)``. Metadata shapes as in the module docstring; q ``(B, H_q, D)``."""
    b, h = centroids.shape[:2]
    dev = q.device
    f = _first_rows(first, b, dev)
    picked = None
    if cluster_budget > 0:
        picked = select(cluster_scores(q, centroids, gqa), sizes, offsets, order, cluster_budget)
    idx = sinks_picked_recent(b, h, n_sinks, picked, n_recent, length, dev, f)
    idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]), value=-1)[..., :width]
    if cover < 0:
        return idx
    f = f[:, None, None]
    own = f + torch.arange(width, device=dev)
    return torch.where(length - f <= cover, torch.where(own < length, own, -1), idx)


def cluster_select_cpu(
    q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
    first: torch.Tensor | None, length: int, n_sinks: int, cluster_budget: int, n_recent: int, cover: int,
    width: int, gqa: str = "sum",
) -> torch.Tensor:
    """:func:`cluster_select_torch` in one C call (CPU, fp32 q and centroids with contiguous last dims,
    int64 metadata): the scores, the ranking and the list of a site's step without a dozen small torch
    ops. The same list up to the rounding of the scores (the C dot products add in another order than
    BLAS: a near-tie between two clusters may rank the other way). ``q (B, H_q, D)``, or ``(B, H_q, 1,
    D)`` as a decode step's attention receives it. A decode step of the runtime makes a
    :class:`ClusterStep` once for its clusters and calls its ``select``."""
    return ClusterStep(centroids, sizes, offsets, order, first, gqa).select(
        q, length, n_sinks, cluster_budget, n_recent, cover, width)


class ClusterStep:
    """A ClusterKV layer's decode-step list on CPU (:func:`cluster_select_cpu`), its clusters checked once
    and its C operands kept in a :class:`ClusterStepArgs` (a state makes one where a cluster tensor or
    ``first`` is replaced, :meth:`holds`; a step sets only the query, the length, the budgets and the
    output).

    Args:
        centroids: ``(B, H_kv, C, D)`` fp32 CPU, last dim contiguous (ClusterKV, Liu et al. 2024).
        sizes, offsets, order: ``(B, H_kv, C)``, ``(B, H_kv, C + 1)``, ``(B, H_kv, N)`` int64 CPU: each
            cluster's tokens are ``order[offsets[c] : offsets[c] + sizes[c]]``.
        first: ``(B,)`` or ``(1,)`` int64 CPU, each row's first real position (None: 0).

    Raises ValueError where these operands are not what the C kernel reads (the message names them)."""

    def __init__(self, centroids: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, order: torch.Tensor,
                 first: torch.Tensor | None, gqa: str = "sum"):
        self._fn = _cluster_select_lib()
        self._step_fn = native.function("clusterkv", "kvpass_cluster_step", [ctypes.POINTER(ClusterStepArgs)])
        cs = centroids.shape
        ok = (self._fn is not None and type(centroids) is torch.Tensor and centroids.is_cpu and len(cs) == 4
              and centroids.dtype == torch.float32 and cs[1] > 0 and centroids.stride(3) == 1
              and gqa in ("sum", "max")
              and all(type(t) is torch.Tensor and t.dtype == torch.int64 and t.is_cpu for t in (sizes, offsets, order)))
        if ok:
            b, h, c = cs[:3]
            ok = (sizes.shape == (b, h, c) and offsets.shape == (b, h, c + 1) and order.dim() == 3
                  and order.shape[:2] == (b, h))
            ok = ok and (first is None or (type(first) is torch.Tensor and first.dtype == torch.int64
                                           and first.is_cpu and first.dim() == 1 and first.shape[0] in (1, b)))
        if not ok:
            raise ValueError(
                "kvpass: cluster_select_cpu needs fp32 CPU q (B, H_q, D) and centroids (B, H, C, D) with contiguous "
                "last dims, int64 sizes (B, H, C), offsets (B, H, C + 1), order (B, H, N), first (B,) or (1,), gqa "
                f"'sum' or 'max' and the C kernel built; got centroids {tuple(cs)} {centroids.dtype}, sizes "
                f"{tuple(sizes.shape)} {sizes.dtype}, offsets {tuple(offsets.shape)}, order {tuple(order.shape)}, "
                f"first {None if first is None else (tuple(first.shape), first.dtype)}, gqa={gqa!r}")
        self.centroids, self.sizes, self.offsets, self.order, self.first = centroids, sizes, offsets, order, first
        self.b, self.h, self.d = b, h, cs[3]
        self._args = ClusterStepArgs()
        a = self._a = self._args.select  # a view into _args (it keeps _args alive)
        self._ref, self._step_ref = ctypes.byref(a), ctypes.byref(self._args)
        self._listed = cpu_decode.ListedAttend(self._args.attend)  # where select_attend runs it
        a.cent, (a.cs_b, a.cs_h, a.cs_c) = centroids.data_ptr(), centroids.stride()[:3]
        a.sizes, (a.zs_b, a.zs_h, a.zs_c) = sizes.data_ptr(), sizes.stride()
        a.offsets, (a.fs_b, a.fs_h, a.fs_c) = offsets.data_ptr(), offsets.stride()
        a.order, (a.rs_b, a.rs_h, a.rs_n) = order.data_ptr(), order.stride()
        if first is not None:
            a.first, a.ft_b = first.data_ptr(), first.stride(0) if first.shape[0] > 1 else 0
        a.B, a.H, a.D, a.C, a.N = b, h, self.d, c, order.shape[2]
        a.gqa_max = int(gqa == "max")

    def holds(self, centroids, sizes, offsets, order, first) -> bool:
        """Whether this step was made for these very tensors (a replaced one needs a new step)."""
        return (self.centroids is centroids and self.sizes is sizes and self.offsets is offsets
                and self.order is order and self.first is first)

    def select(self, q: torch.Tensor, length: int, n_sinks: int, cluster_budget: int, n_recent: int, cover: int,
               width: int) -> torch.Tensor:
        """``(B, H_kv, width)`` int64, this step's list (:func:`cluster_select_torch`), in one C call;
        ``q (B, H_q, D)`` or ``(B, H_q, 1, D)`` fp32, ``H_q = G * H_kv``."""
        return self._run(self._fn, self._ref, q, length, n_sinks, cluster_budget, n_recent, cover, width)

    def select_attend(self, q: torch.Tensor, length: int, n_sinks: int, cluster_budget: int, n_recent: int,
                      cover: int, width: int, k: torch.Tensor, v: torch.Tensor, scale: float):
        """``(idx, out)``: :meth:`select`, then the decode attention of ``q (B, H_q, 1, D)`` over ``idx``
        in ``k, v (B, H_kv, S >= length, D)`` (:func:`kvpass.kernels.cpu_decode.decode_step`, read in place),
        ``out (B, H_q, 1, D)``, in one C call; None where that attention does not serve these operands."""
        out = None if self._step_fn is None else self._listed.pack(q, k, v, length, scale)
        if out is None:
            return None
        idx = self._run(self._step_fn, self._step_ref, q, length, n_sinks, cluster_budget, n_recent, cover, width)
        if idx.numel() == 0:
            out.zero_()  # nothing listed: the attention's empty rows, which it did not run
        return idx, out

    def _run(self, fn, ref, q, length, n_sinks, cluster_budget, n_recent, cover, width) -> torch.Tensor:
        b, h, d = self.b, self.h, self.d
        qs = q.shape
        if not (type(q) is torch.Tensor and q.is_cpu and q.dtype == torch.float32 and qs[0] == b and qs[-1] == d
                and (len(qs) == 3 or (len(qs) == 4 and qs[2] == 1)) and qs[1] % h == 0 and q.stride(-1) == 1
                and width >= 0):
            raise ValueError(
                f"kvpass: cluster_select_cpu needs fp32 CPU q (B={b}, H_q, D={d}) or (B, H_q, 1, D), H_q a multiple "
                f"of {h}, with a contiguous last dim, and width >= 0; got q {tuple(qs)} {q.dtype}, width={width}")
        out = torch.empty((b, h, width), dtype=torch.int64)
        if out.numel() == 0:
            return out
        a = self._a
        a.q, a.qs_b, a.qs_h = q.data_ptr(), q.stride(0), q.stride(1)
        a.out, a.xs_b, a.xs_h = out.data_ptr(), out.stride(0), out.stride(1)
        a.G = qs[1] // h
        a.L, a.n_sinks, a.cluster_budget, a.n_recent, a.cover, a.W = (length, n_sinks, cluster_budget, n_recent,
                                                                        cover, width)
        if fn(ref) != 0:
            raise MemoryError("kvpass: cluster_select_cpu could not allocate its scratch")
        return out


def cluster_select_cpu_available() -> bool:
    """Whether :func:`cluster_select_cpu` is built (see :mod:`kvpass.kernels.native`)."""
    return _cluster_select_lib() is not None

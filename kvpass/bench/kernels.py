"""Micro-benchmarks of the kvpass kernels, each against the dense torch equivalent it replaces.

One row per (kernel, shape); ``N`` is what the kernel reads or returns (see each entry). Baselines:

- ``sparse_decode_attention``: one decode query per head over ``N`` gathered positions of an
  ``S``-token cache, against dense SDPA over all ``S`` keys
  (``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``, q ``(B, H_q, 1, D)``).
- ``quest_page_scores``: Quest page upper bounds over ``N = S / page_size`` pages; on CUDA the Triton
  launcher against :func:`quest_page_scores_ref`, on CPU the reference against the plain broadcast
  formula ``sum_d max(q_d kmax_d, q_d kmin_d)`` (what a direct port would do).
- ``centroid_decode_attention`` (CentroidKV): attention with the ``log deg`` bias over a merged cache
  of ``N = S / 4`` slots with random degrees in ``[1, 7]`` (mean 4, so about S tokens), against
  dense SDPA over all ``S`` keys (the Full cache it replaces).
- ``quant_decode_attention`` (TailorKV): a 1-bit cache of ``N = S_q`` tokens (S rounded down to a
  multiple of the group 64; keys ``axis="channel"``, values ``axis="token"``, packed once outside the
  timing with :func:`quantize_pack_ref`) plus a full-precision residual of ``R = 128`` tokens, against
  dense SDPA over ``S`` fp keys.
- ``partial_topk`` (TailorKV): scores from ``n = 8`` critical channels of the ``S`` keys (``k_ch``
  ``(B, H_kv, S, 8)``, gathered outside the timing) and the top ``k = N`` positions, against the dense
  route: full ``q K^T`` scores summed over the query group, then ``torch.topk(N)``.
- ``kmeans_assign`` (ClusterKV): one assignment of the ``S`` keys to ``N = C = S // 80`` centroids,
  against one dense ``q K^T`` over ``S`` (what a decode step's full scoring costs). A *cost reference*,
  not an equivalent: the assignment runs once per (re)clustering, not per decode step.
- ``select_clusters`` (ClusterKV): budgeted recall of whole clusters (``C = S // 80`` clusters of
  random sizes, budget ``N``), against ``torch.topk(N)`` over ``S`` fp32 token scores (the
  token-level selection it replaces).
- ``merge_round`` (CentroidKV): one merge round, :func:`chunk_match` over the ``S`` keys (chunk 256,
  no sinks or recent slots) + :func:`merge_scatter` of half the pairs (``N = S / 4`` merges), against
  dense SDPA over ``S`` (a cost reference: a round runs once per merge, not per decode step).

On CPU the CPU decode paths are timed (``impl``: "C" for the C kernels of :mod:`kvpass.kernels.native`
where they are built, "torch ref" for the torch references) with ``torch.utils.benchmark.Timer``
(``blocked_autorange``, median); on CUDA the Triton launchers (``use_triton=True`` where the op has
a switch) with ``triton.testing.do_bench`` (median). Each row also gives the bytes the kernel must
move at least and the achieved bandwidth; on CUDA against the device's peak (see
:func:`peak_bandwidth`). ``el`` is the element size of ``dtype``, ``BH = B*H_kv``, ``io = 2*B*H_q*D*el``
(q and out):

- sparse: the gathered K and V rows ``BH*N*2*D*el`` + io + idx (int32);
- dense SDPA: all K and V rows ``BH*S*2*D*el`` + io;
- quest: kmin and kmax of the live pages ``2*BH*P*D*el`` + q + the fp32 scores ``B*H_q*P``;
- centroid: ``BH*N*(2*D*el + 4)`` (K, V and fp32 degrees of the merged slots) + io;
- quant: the packed codes, fp16 scales and zeros of K and V (``QuantizedKV.nbytes``, about
  ``BH*S_q*2*D/8`` + ``BH*S_q*2*D/64*2*2``) + the residual ``BH*R*2*D*el`` + io;
- partial_topk: ``BH*S*(8*el + 4)`` (k_ch and the fp32 scores) + q + ch (int64) + idx ``BH*N*8``;
  its dense route: K ``BH*S*D*el`` + q + idx;
- kmeans_assign: keys + fp32 centroids + int64 labels + fp32 sim, ``BH*(S*(D*el + 12) + C*D*4)``;
  the dense ``q K^T``: K + q + scores ``B*H_q*S*el``;
- select_clusters: fp32 scores, int64 sizes and offsets ``BH*(20*C + 8)`` + the recalled order
  entries and the int64 output ``BH*N*16``; ``torch.topk``: scores ``BH*S*4`` + values and indices
  ``BH*N*12``;
- merge_round: chunk_match reads K and writes (a_pos, b_pos, sim) ``BH*(S*D*el + NA*20)``;
  merge_scatter reads K, V, degrees and the pairs and writes the compacted cache,
  ``BH*((2*S - N)*(2*D*el + 4) + NA*17)`` (NA = S / 2 candidate pairs).

``python -m kvpass.bench.kernels [--quick] [--device cpu|cuda] [--threads T]`` prints the table.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvpass.bench.common import parse_policies
from kvpass.kernels import centroid, clusterkv, cpu_decode, quest, sparse_attention as sa, tailorkv
from kvpass.kernels.sparse_attention import sinks_picked_recent
from kvpass.runtime.runtime import Runtime
from kvpass.runtime.store import cpu_empty
from kvpass.runtime.tailorkv import take_rows
from kvpass.runtime.workspace import Workspace

__all__ = ["Shape", "SHAPES", "QUICK_SHAPES", "benchmark_kernels", "peak_bandwidth", "format_table", "main"]


@dataclass(frozen=True)
class Shape:
    """One decode problem: q ``(B, H_q, D)``, cache ``(B, H_kv, S, D)``, ``N`` selected positions."""

    name: str
    B: int
    H_q: int
    H_kv: int
    D: int
    S: int
    N: int
    page_size: int = 16


SHAPES = (
    Shape("smollm2", 1, 9, 3, 64, 8192, 1024),
    Shape("smollm2", 1, 9, 3, 64, 32768, 1024),
    Shape("gqa-32/8", 1, 32, 8, 128, 8192, 1024),
    Shape("gqa-32/8", 1, 32, 8, 128, 32768, 1024),
)
QUICK_SHAPES = (
    Shape("smollm2", 1, 9, 3, 64, 2048, 256),
    Shape("gqa-32/8", 1, 32, 8, 128, 2048, 256),
)

# Memory bus width in bits, for when torch does not report it (name substring -> bits). Public specs:
# H100 SXM5 / H200: 5120 / 6144-bit HBM3(e); A100: 5120-bit HBM2e; H100 PCIe: 5120-bit HBM2e.
_BUS_WIDTH_BITS = {"H200": 6144, "H100": 5120, "A100": 5120, "L40": 384, "A10": 384, "L4": 192}
# Last resort, the datasheet peak in bytes/s (name substring -> bytes/s), checked in this order.
_PEAK_BYTES = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40", 0.864e12), ("A10", 0.6e12), ("L4", 0.3e12),
)


def peak_bandwidth(device: int | torch.device = 0) -> tuple[float | None, str]:
    """Peak DRAM bandwidth of a CUDA device in bytes/s and how it was found.

    Peak = 2 (double data rate) x memory clock x bus width / 8. Sources, in order: the clock and bus
    width of ``torch.cuda.get_device_properties`` (``memory_clock_rate`` in kHz, ``memory_bus_width``
    in bits; CUDA 13 may report 0), then ``nvidia-smi --query-gpu=clocks.max.memory`` (MHz) with the
    bus width from :data:`_BUS_WIDTH_BITS` (an assumption by device name: H100 SXM 5120 bits, H200 6144
    bits), then the datasheet figure from :data:`_PEAK_BYTES`. ``(None, reason)`` when none applies.
    """
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz > 0 and bus_bits > 0:
        peak = 2 * clock_khz * 1e3 * bus_bits / 8
        return peak, f"torch props: {clock_khz / 1e3:.0f} MHz x {bus_bits} bit x 2"
    guess_bits = next((b for k, b in _BUS_WIDTH_BITS.items() if k in props.name), None)
    if bus_bits <= 0:
        bus_bits = guess_bits or 0
    if shutil.which("nvidia-smi") and bus_bits > 0:
        index = device.index if isinstance(device, torch.device) else int(device)
        try:
            out = subprocess.run(
                ["nvidia-smi", f"--id={index or 0}", "--query-gpu=clocks.max.memory",
                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout
            mhz = float(re.findall(r"[\d.]+", out)[0])
            return 2 * mhz * 1e6 * bus_bits / 8, (
                f"nvidia-smi: {mhz:.0f} MHz x {bus_bits} bit (assumed for {props.name}) x 2"
            )
        except Exception:  # no usable nvidia-smi answer: fall through to the datasheet table
            pass
    for key, peak in _PEAK_BYTES:
        if key in props.name:
            return peak, f"datasheet figure for {key} (assumed)"
    return None, f"unknown for {props.name}"


def _time_cpu(fn: Callable[[], Any], quick: bool) -> float:
    from torch.utils.benchmark import Timer

    fn()  # warm up
    m = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=0.05 if quick else 0.5
    )
    return m.median * 1e3


def _time_cpu_cold(fn: Callable[[], Any], quick: bool, flush: torch.Tensor) -> float:
    """Median ms of single calls of ``fn``, each after writing ``flush`` (a buffer larger than the
    last-level cache), so that each call reads its operands from memory, as a layer of a model does."""
    fn()
    times = []
    for _ in range(5 if quick else 25):
        flush.add_(1)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _time_cuda(fn: Callable[[], Any], quick: bool) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100,
                                         return_mode="median"))


def _sparse_inputs(s: Shape, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(s.B, s.H_q, s.D, generator=g).to(device, dtype)
    k = torch.randn(s.B, s.H_kv, s.S, s.D, generator=g).to(device, dtype)
    v = torch.randn(s.B, s.H_kv, s.S, s.D, generator=g).to(device, dtype)
    # N distinct positions per (b, kv head), sorted, as a selection policy produces them
    idx = torch.rand(s.B, s.H_kv, s.S, generator=g).argsort(dim=-1)[..., : s.N].sort(dim=-1).values
    return q, k, v, idx.to(device=device, dtype=torch.int32)


def sparse_and_dense(s: Shape, device: str, dtype: torch.dtype, idx_all: bool = False):
    """The two callables the sparse row compares: ``(sparse, dense)``, each returning ``(B, H_q, D)``.
    ``idx_all`` selects every position (then both compute the same attention)."""

    q, k, v, idx = _sparse_inputs(s, device, dtype)
    if idx_all:
        idx = torch.arange(s.S, device=device, dtype=torch.int32).expand(s.B, s.H_kv, s.S).contiguous()
    scale = 1.0 / math.sqrt(s.D)
    kernel = sa.sparse_decode_attention if device.startswith("cuda") else sa.sparse_decode_attention_ref
    q4 = q[:, :, None]

    def sparse():
        return kernel(q, k, v, idx=idx, scale=scale)

    def dense():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)[:, :, 0]

    return sparse, dense, (q, k, v, idx)


def _quest_inputs(s: Shape, device: str, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    P = s.S // s.page_size
    q = torch.randn(s.B, s.H_q, s.D, generator=g).to(device, dtype)
    a = torch.randn(s.B, s.H_kv, P, s.D, generator=g)
    b = a + torch.rand(s.B, s.H_kv, P, s.D, generator=g)
    return q, a.to(device, dtype), b.to(device, dtype)


def _quest_broadcast(q, kmin, kmax):
    B, H_q, D = q.shape
    G = H_q // kmin.shape[1]
    qf = q.float().view(B, kmin.shape[1], G, 1, D)
    s = torch.maximum(qf * kmax.float()[:, :, None], qf * kmin.float()[:, :, None]).sum(-1)
    return s.view(B, H_q, -1)


def _dense_scores_topk(q, k, n):
    """The dense route of :func:`partial_topk`: full ``q K^T`` summed over each KV head's query group,
    then ``torch.topk``. q ``(B, H_q, D)``, k ``(B, H_kv, S, D)`` -> indices ``(B, H_kv, n)``."""
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    s = torch.matmul(q.view(B, H_kv, H_q // H_kv, D), k.transpose(-1, -2)).float().sum(2)
    return torch.topk(s, n, dim=-1).indices


def _cluster_inputs(s: Shape, device: str, seed: int = 2):
    """A clustering of the S tokens of every KV head into ``C = S // 80`` clusters of random sizes:
    ``(scores (B, H_kv, C) fp32, sizes, offsets, order)`` as :func:`select_clusters` takes them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    C = max(1, s.S // 80)
    labels = torch.randint(0, C, (s.B, s.H_kv, s.S), generator=g)
    sizes = torch.zeros((s.B, s.H_kv, C), dtype=torch.int64).scatter_add_(2, labels, torch.ones_like(labels))
    offsets = torch.zeros((s.B, s.H_kv, C + 1), dtype=torch.int64)
    torch.cumsum(sizes, dim=-1, out=offsets[..., 1:])
    order = torch.sort(labels, dim=-1, stable=True).indices
    scores = torch.randn((s.B, s.H_kv, C), generator=g)
    return tuple(t.to(device) for t in (scores, sizes, offsets, order))


def benchmark_kernels(
    device: str = "cpu", shapes=None, quick: bool = False, dtype: torch.dtype | None = None
) -> list[dict]:
    """Time each kernel against its dense/reference counterpart on ``device`` ("cpu" or "cuda").

    Args:
        shapes: :class:`Shape` s (default :data:`SHAPES`, or :data:`QUICK_SHAPES` when ``quick``).
        quick: small shapes and short timing runs (a smoke test: seconds on CPU).
        dtype: default float16 on CUDA, float32 on CPU (the dtype each path serves).

    Returns:
        One dict per (kernel, shape): ``kernel, shape, B, H_q, H_kv, D, S, N, dtype, device, impl,
        ms, baseline, baseline_ms, speedup`` (baseline_ms / ms), ``bytes, gbps`` (achieved by the
        kernel), ``baseline_bytes, baseline_gbps``, and on CUDA ``peak_gbps, pct_peak``.
    """
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("kvpass: benchmark_kernels(device='cuda') needs a CUDA device")
    if shapes is None:
        shapes = QUICK_SHAPES if quick else SHAPES
    dtype = dtype or (torch.float16 if cuda else torch.float32)
    timer = _time_cuda if cuda else _time_cpu
    el = torch.empty((), dtype=dtype).element_size()
    peak, _ = peak_bandwidth(torch.device(device)) if cuda else (None, "")

    rows: list[dict] = []

    def add(kernel, s, impl, ms, baseline, base_ms, nbytes, base_bytes, extra=None):
        row = dict(kernel=kernel, shape=s.name, **{k: v for k, v in asdict(s).items() if k != "name"},
                   dtype=str(dtype).replace("torch.", ""), device=device, impl=impl, ms=ms,
                   baseline=baseline, baseline_ms=base_ms, speedup=base_ms / ms,
                   bytes=nbytes, gbps=nbytes / ms / 1e6, baseline_bytes=base_bytes,
                   baseline_gbps=base_bytes / base_ms / 1e6)
        if peak:
            row["peak_gbps"] = peak / 1e9
            row["pct_peak"] = 100 * row["gbps"] / row["peak_gbps"]
        row.update(extra or {})
        rows.append(row)

    with torch.no_grad():
        for s in shapes:
            sparse, dense, (q, k, v, idx) = sparse_and_dense(s, device, dtype)
            io = (s.B * s.H_q * s.D * 2) * el  # q and out
            nbytes = s.B * s.H_kv * s.N * 2 * s.D * el + io + idx.numel() * idx.element_size()
            dense_bytes = s.B * s.H_kv * s.S * 2 * s.D * el + io
            impl = "triton" if cuda else "C" if cpu_decode.available() else "torch ref"  # the attention rows
            ref_impl = "triton" if cuda else "torch ref"  # the rows whose CPU path is torch code
            dense_ms = timer(dense, quick)  # the baseline of every attention-shaped row of this shape
            add("sparse_decode_attention", s, impl, timer(sparse, quick),
                "dense SDPA over S", dense_ms, nbytes, dense_bytes)
            g = torch.Generator(device="cpu").manual_seed(3)
            BH, G = s.B * s.H_kv, s.H_q // s.H_kv

            # CentroidKV decode: S / 4 merged slots with degrees in [1, 7] (about S tokens in all)
            Sm = max(1, s.S // 4)
            km, vm = k[:, :, :Sm].contiguous(), v[:, :, :Sm].contiguous()
            deg = torch.randint(1, 8, (s.B, s.H_kv, Sm), generator=g).float().to(device)
            scale = 1.0 / math.sqrt(s.D)
            cda = centroid.centroid_decode_attention
            fn = lambda: cda(q, km, vm, deg, scale=scale, use_triton=cuda)  # noqa: E731
            add("centroid_decode_attention", s, impl, timer(fn, quick), "dense SDPA over S", dense_ms,
                BH * Sm * (2 * s.D * el + 4) + io, dense_bytes, {"N": Sm})
            del km, vm, deg

            # TailorKV 1-bit cache (group 64) + a 128-token fp residual
            Sq, R = s.S // 64 * 64, 128
            vgroup = 64 if s.D % 64 == 0 else s.D
            kq = tailorkv.quantize_pack_ref(k[:, :, :Sq], 1, 64, "channel")
            vq = tailorkv.quantize_pack_ref(v[:, :, :Sq], 1, vgroup, "token")
            k_res = torch.randn(s.B, s.H_kv, R, s.D, generator=g).to(device, dtype)
            v_res = torch.randn(s.B, s.H_kv, R, s.D, generator=g).to(device, dtype)
            quant = tailorkv.quant_decode_attention if cuda else tailorkv.quant_decode_attention_ref
            fn = lambda: quant(q, kq, vq, k_res, v_res, scale=scale)  # noqa: E731
            add("quant_decode_attention", s, ref_impl, timer(fn, quick), "dense SDPA over S", dense_ms,
                kq.nbytes() + vq.nbytes() + 2 * BH * R * s.D * el + io, dense_bytes, {"N": Sq})
            del kq, vq, k_res, v_res

            # TailorKV partial-channel top-k: 8 critical channels, k = N
            n_ch = min(8, s.D)
            ch = tailorkv.critical_channels(q, k.abs().amax(dim=2), n_ch)
            k_ch = torch.gather(k, 3, ch[:, :, None, :].expand(s.B, s.H_kv, s.S, n_ch)).contiguous()
            topk = tailorkv.partial_topk if cuda else tailorkv.partial_topk_ref
            fn = lambda: topk(q, k_ch, ch, s.N)  # noqa: E731
            base = lambda: _dense_scores_topk(q, k, s.N)  # noqa: E731
            qb, idx_b = s.B * s.H_q * s.D * el, BH * s.N * 8
            add("partial_topk", s, ref_impl, timer(fn, quick), "q.K^T + topk", timer(base, quick),
                BH * s.S * (n_ch * el + 4) + qb + BH * n_ch * 8 + idx_b,
                BH * s.S * s.D * el + qb + idx_b)
            del ch, k_ch

            # ClusterKV assignment of the S keys to C = S // 80 centroids (cost reference: one q.K^T)
            C = max(1, s.S // 80)
            cents = torch.randn(s.B, s.H_kv, C, s.D, generator=g).to(device)
            assign = clusterkv.kmeans_assign if cuda else clusterkv.kmeans_assign_ref
            fn = lambda: assign(k, cents)  # noqa: E731
            q4g = q.view(s.B, s.H_kv, G, s.D)
            base = lambda: torch.matmul(q4g, k.transpose(-1, -2))  # noqa: E731
            add("kmeans_assign", s, ref_impl, timer(fn, quick), "q.K^T (cost ref)", timer(base, quick),
                BH * (s.S * (s.D * el + 12) + C * s.D * 4), BH * s.S * s.D * el + qb + s.B * s.H_q * s.S * el,
                {"N": C})
            del cents

            # ClusterKV budgeted cluster recall vs token-level topk
            scores, sizes, offsets, order = _cluster_inputs(s, device)
            tok = torch.randn(s.B, s.H_kv, s.S, generator=g).to(device)
            c_select = not cuda and clusterkv.select_clusters_cpu_available()  # the CPU path in C
            select = (clusterkv.select_clusters if cuda else clusterkv.select_clusters_cpu if c_select
                      else clusterkv.select_clusters_ref)
            fn = lambda: select(scores, sizes, offsets, order, s.N)  # noqa: E731
            base = lambda: torch.topk(tok, s.N, dim=-1)  # noqa: E731
            sel_impl = "triton" if cuda else "C" if c_select else "torch ref"
            add("select_clusters", s, sel_impl, timer(fn, quick), "topk over S", timer(base, quick),
                BH * (20 * scores.shape[2] + 8 + 16 * s.N), BH * (4 * s.S + 12 * s.N))
            del scores, sizes, offsets, order, tok

            # CentroidKV merge round: chunk_match (chunk 256) + merge_scatter of half the pairs
            ones = torch.ones(s.B, s.H_kv, s.S, device=device)
            NA = centroid.num_candidates(0, s.S, 256)
            fn = lambda: centroid.merge_round(k, v, ones, 0, 0, 256, 0.5, use_triton=cuda)  # noqa: E731
            m = fn().merged
            add("merge_round", s, ref_impl, timer(fn, quick), "dense SDPA (cost ref)", dense_ms,
                BH * (s.S * s.D * el + NA * 20) + BH * ((2 * s.S - m) * (2 * s.D * el + 4) + NA * 17),
                dense_bytes, {"N": m})
            del ones
            del q, k, v, idx, sparse, dense

            qq, kmin, kmax = _quest_inputs(s, device, dtype)
            P = kmin.shape[2]
            qbytes = 2 * s.B * s.H_kv * P * s.D * el + s.B * s.H_q * s.D * el + s.B * s.H_q * P * 4
            if cuda:
                fn = lambda: quest.quest_page_scores(qq, kmin, kmax)  # noqa: E731
                base = lambda: quest.quest_page_scores_ref(qq, kmin, kmax)  # noqa: E731
                impl, base_name = "triton", "torch ref"
            else:
                fn = lambda: quest.quest_page_scores_ref(qq, kmin, kmax)  # noqa: E731
                base = lambda: _quest_broadcast(qq, kmin, kmax)  # noqa: E731
                impl, base_name = "torch ref", "broadcast max"
            add("quest_page_scores", s, impl, timer(fn, quick), base_name, timer(base, quick),
                qbytes, qbytes, {"N": P})
            del qq, kmin, kmax
    return rows


#: Decode problems of the CPU-path comparison: SmolLM2's shapes at 8k tokens, batch 1 and 8.
CPU_PATH_SHAPES = (
    Shape("smollm2", 1, 9, 3, 64, 8192, 1024),
    Shape("smollm2", 8, 9, 3, 64, 8192, 1024),
    Shape("smollm2", 1, 9, 3, 64, 32768, 1024),  # decode-cost's 32k target: selection over 4x the candidates
)
QUICK_CPU_PATH_SHAPES = (
    Shape("smollm2", 1, 9, 3, 64, 2048, 256),
    Shape("smollm2", 2, 9, 3, 64, 2048, 256),
)


def benchmark_cpu_paths(quick: bool = False, shapes=None) -> list[dict]:
    """Each C kernel of :mod:`kvpass.kernels.native` against the torch code it replaces on CPU (what runs
    with ``KVPASS_NATIVE=0``), in one run, fp32. Rows as :func:`benchmark_kernels` gives them, with
    ``impl`` "C" and ``baseline`` "torch path":

    - ``attend_all``: a decode step over all ``S`` tokens (``Full``): the C kernel against the grouped
      SDPA of :func:`kvpass.kernels.sparse_attention.decode_attention_torch`; bytes: K and V once + io.
    - ``attend_listed``: over ``N`` listed positions of ``S`` (distinct, sorted, random: a selection):
      the C kernel reading them in place against the torch path's gather into a reused workspace + SDPA;
      bytes: the listed K and V rows + io + idx.
    - ``attend_listed_huge``: the same C call over K and V in the runtime's huge-page buffers
      (:func:`kvpass.runtime.store.cpu_empty`) against 4 KiB pages (``baseline`` "4 KiB pages").
    - ``attend_listed_cold``: that call with the caches flushed before each call (operands from
      memory, as in a model's step) against the same call over ``N`` contiguous rows, also cold (the
      floor F(N) reads those); the price of scattered rows.
    - ``quest_top_pages``: bounds of ``S / page_size`` pages and the top ``N / page_size``:
      :func:`~kvpass.kernels.quest.quest_top_pages_cpu` against
      :func:`~kvpass.kernels.quest.quest_top_pages_torch`; bytes: the page metadata (2 x D fp16 a page).
    - ``quest_select``: the runtime's Quest step, :meth:`~kvpass.kernels.quest.QuestStep.select` (the
      step's key merged into its page, the top pages and their ``N`` token positions, one C call)
      against :func:`~kvpass.kernels.quest.quest_select_torch`; bytes: the page metadata and the list.
    - ``cluster_recall``: ``C = S // 80`` clusters, budget ``N``:
      :func:`~kvpass.kernels.clusterkv.select_clusters_cpu` against
      :func:`~kvpass.kernels.clusterkv.select_clusters_ref`; bytes as for ``select_clusters``.
    - ``cluster_select``: ClusterKV's whole decode-step list (``C = S // 80`` clusters, 16 sinks, 64 recent
      tokens, ``N - 80`` recalled slots, gqa "sum"): :meth:`~kvpass.kernels.clusterkv.ClusterStep.select`
      (the runtime's call, its step made once) against
      :func:`~kvpass.kernels.clusterkv.cluster_select_torch`; bytes: the centroids, sizes and offsets, the
      recalled order slots read and the list written.
    - ``tailor_select``: TailorKV's sparse layer, 8 critical channels, 16 sinks, 112 recent tokens and
      ``N - 128`` fetched: :meth:`~kvpass.kernels.tailorkv.CpuStep.select` (the runtime's one C call: the
      channels picked from the query and the channel maxima, the list) against the torch path (the channels, their rows
      copied from the channel-major keys, :func:`~kvpass.kernels.tailorkv.partial_topk_ref`, the list),
      the keys channel-major in bf16 as the runtime holds them; bytes: the channel rows read and the list
      written.
    - ``tailor_select_cold``: :func:`~kvpass.kernels.tailorkv.tailor_select_cpu` alone with the caches
      flushed before each call, over the bf16 channel copy against an fp32 one (``baseline`` "fp32
      channel copy"); bytes: the channel rows read and the list written.

    Raises RuntimeError where the C kernels are not built."""

    if not (cpu_decode.available() and quest.quest_top_pages_cpu_available()
            and clusterkv.select_clusters_cpu_available() and tailorkv.cpu_select_available()):
        raise RuntimeError("kvpass: benchmark_cpu_paths needs the C kernels (KVPASS_NATIVE=0 or no C compiler)")
    shapes = shapes or (QUICK_CPU_PATH_SHAPES if quick else CPU_PATH_SHAPES)
    rows: list[dict] = []

    def add(kernel, s, ms, base_ms, nbytes, extra=None):
        row = dict(kernel=kernel, shape=f"{s.name} b{s.B}", **{k: v for k, v in asdict(s).items() if k != "name"},
                   dtype="float32", device="cpu", impl="C", ms=ms, baseline="torch path", baseline_ms=base_ms,
                   speedup=base_ms / ms, bytes=nbytes, gbps=nbytes / ms / 1e6, baseline_bytes=nbytes,
                   baseline_gbps=nbytes / base_ms / 1e6)
        row.update(extra or {})
        rows.append(row)

    with torch.no_grad():
        for s in shapes:
            q, k, v, idx = _sparse_inputs(s, "cpu", torch.float32)
            idx = idx.long()
            scale = 1.0 / math.sqrt(s.D)
            io = 2 * s.B * s.H_q * s.D * 4
            c = lambda: cpu_decode.cpu_decode_attention(q, k, v, None, scale)  # noqa: E731
            t = lambda: sa.decode_attention_torch(q, k, v, None, None, scale)  # noqa: E731
            torch.testing.assert_close(c(), t(), atol=1e-4, rtol=1e-4)
            add("attend_all", s, _time_cpu(c, quick), _time_cpu(t, quick), s.B * s.H_kv * s.S * 2 * s.D * 4 + io,
                {"N": s.S})
            ws = Workspace()
            c = lambda: cpu_decode.cpu_decode_attention(q, k, v, idx, scale)  # noqa: E731
            t = lambda: sa.decode_attention_torch(q, k, v, idx, None, scale, ws, False)  # noqa: E731
            torch.testing.assert_close(c(), t(), atol=1e-4, rtol=1e-4)
            add("attend_listed", s, _time_cpu(c, quick), _time_cpu(t, quick),
                s.B * s.H_kv * s.N * (2 * s.D * 4 + 8) + io)
            # the same C call over a cache in huge pages (the runtime's buffers) against 4 KiB pages
            kh, vh = cpu_empty(tuple(k.shape), k.dtype), cpu_empty(tuple(v.shape), v.dtype)
            kh.copy_(k)
            vh.copy_(v)
            h = lambda: cpu_decode.cpu_decode_attention(q, kh, vh, idx, scale)  # noqa: E731
            torch.testing.assert_close(h(), c(), atol=0, rtol=0)
            add("attend_listed_huge", s, _time_cpu(h, quick), _time_cpu(c, quick),
                s.B * s.H_kv * s.N * (2 * s.D * 4 + 8) + io, {"baseline": "4 KiB pages"})
            # from memory, as inside a model (the caches flushed before each call): N listed rows of the
            # huge-page cache against N contiguous rows of it, the floor's read
            flush = torch.zeros(32 << 20, dtype=torch.int32)  # 128 MB, past a last-level cache
            kn, vn = kh[:, :, : s.N], vh[:, :, : s.N]
            contiguous = lambda: cpu_decode.cpu_decode_attention(q, kn, vn, None, scale)  # noqa: E731
            add("attend_listed_cold", s, _time_cpu_cold(h, quick, flush),
                _time_cpu_cold(contiguous, quick, flush), s.B * s.H_kv * s.N * (2 * s.D * 4 + 8) + io,
                {"baseline": f"{s.N} contiguous rows"})
            del flush
            del q, k, v, idx, ws, kh, vh

            qq, kmin, kmax = _quest_inputs(s, "cpu", torch.float32)
            meta = torch.cat([quest.quest_bounds(kmax, quest.BOUNDS_DTYPE, up=True),
                              quest.quest_bounds(kmin, quest.BOUNDS_DTYPE, up=False)], dim=-1).contiguous()
            P, n = meta.shape[2] - 1, s.N // s.page_size - 1
            c = lambda: quest.quest_top_pages_cpu(qq, meta, P, n)  # noqa: E731
            t = lambda: quest.quest_top_pages_torch(qq, meta, P, n)  # noqa: E731
            mb = meta.element_size()
            add("quest_top_pages", s, _time_cpu(c, quick), _time_cpu(t, quick),
                s.B * s.H_kv * P * 2 * s.D * mb + s.B * s.H_q * s.D * 4, {"N": n + 1})
            # the runtime's step: the key merged into its page, the top pages and their positions, one call
            q4, kc = qq[:, :, None], torch.randn(s.B, s.H_kv, s.S, s.D)
            step = quest.QuestStep(meta, None, s.page_size, s.N)
            c = lambda: step.select(q4, s.S, n, n, k_new=kc)  # noqa: E731
            t = lambda: quest.quest_select_torch(qq, meta, None, s.S, s.page_size, s.N, n, n)  # noqa: E731
            add("quest_select", s, _time_cpu(c, quick), _time_cpu(t, quick),
                s.B * s.H_kv * P * 2 * s.D * mb + s.B * s.H_q * s.D * 4 + s.B * s.H_kv * s.N * 8, {"N": s.N})
            del q4, kc
            del qq, kmin, kmax, meta

            scores, sizes, offsets, order = _cluster_inputs(s, "cpu")
            c = lambda: clusterkv.select_clusters_cpu(scores, sizes, offsets, order, s.N)  # noqa: E731
            t = lambda: clusterkv.select_clusters_ref(scores, sizes, offsets, order, s.N)  # noqa: E731
            assert torch.equal(c(), t())
            BH = s.B * s.H_kv
            add("cluster_recall", s, _time_cpu(c, quick), _time_cpu(t, quick),
                BH * (20 * scores.shape[2] + 8 + 16 * s.N))
            del scores
            # ClusterKV's whole step list: q . mu of every cluster, the recall, the sinks and recent tokens
            g = torch.Generator(device="cpu").manual_seed(5)
            C = sizes.shape[2]
            # small integers: every score is exact in fp32 whatever order the C and BLAS sums add in, so
            # both paths rank the same ties the same way and the lists can be compared
            qc = torch.randint(-8, 9, (s.B, s.H_q, s.D), generator=g).float()
            cent = torch.randint(-8, 9, (s.B, s.H_kv, C, s.D), generator=g).float()
            n_s, n_r = 16, 64
            args = (qc, cent, sizes, offsets, order, None, s.S, n_s, s.N - n_s - n_r, n_r, -1, s.N, "sum")
            step = clusterkv.ClusterStep(cent, sizes, offsets, order, None)  # the runtime's, made once
            c = lambda: step.select(qc, *args[6:12])  # noqa: E731
            t = lambda: clusterkv.cluster_select_torch(*args, select=clusterkv.select_clusters_ref)  # noqa: E731
            assert torch.equal(c(), t()) and torch.equal(clusterkv.cluster_select_cpu(*args), t())
            add("cluster_select", s, _time_cpu(c, quick), _time_cpu(t, quick),
                BH * (C * (4 * s.D + 16) + 16 * s.N) + 4 * s.B * s.H_q * s.D, {"clusters": C})
            del sizes, offsets, order, qc, cent

            # TailorKV's sparse layer: channels from the estimate, the top-k from the true query, the list
            q, k, _, _ = _sparse_inputs(s, "cpu", torch.float32, seed=3)
            # the channel-major copy as the runtime holds it for fp32 keys: bf16
            kT, kabs, n_ch, sinks, recent = k.transpose(2, 3).bfloat16().contiguous(), k.abs().amax(2), 8, 16, 112
            mid_end, top = s.S - recent, s.N - 128
            step = tailorkv.CpuStep(None, None, kT, kabs)
            c = lambda: step.select(q, sinks, mid_end, top, recent, q_c=q, n_channels=n_ch)  # noqa: E731

            def t():
                ch = tailorkv.critical_channels(q, kabs, n_ch)
                k_ch = take_rows(kT, ch)[..., sinks:mid_end].contiguous().transpose(2, 3)
                idx, _ = tailorkv.partial_topk_ref(q, k_ch, ch, top, mid_end - sinks)
                return sinks_picked_recent(s.B, s.H_kv, sinks, idx + sinks, recent, s.S, q.device)

            assert torch.equal(c()[..., sinks : sinks + top], t()[..., sinks : sinks + top].sort(-1).values)
            add("tailor_select", s, _time_cpu(c, quick), _time_cpu(t, quick),
                BH * (n_ch * (mid_end - sinks) * kT.element_size() + 8 * s.N), {"N": s.N - 128 + sinks + recent})
            # the C call with the caches flushed (channel rows from memory, as in a model's step), over the
            # bf16 copy against an fp32 one (what the runtime held before): the price of the copy's bytes
            kT32, ch = kT.float(), tailorkv.critical_channels(q, kabs, n_ch)
            flush = torch.zeros(32 << 20, dtype=torch.int32)
            cold = lambda t: _time_cpu_cold(  # noqa: E731
                lambda: tailorkv.tailor_select_cpu(q, t, ch, sinks, mid_end, top, recent), quick, flush)
            assert torch.equal(tailorkv.tailor_select_cpu(q, kT, ch, sinks, mid_end, top, recent),
                               tailorkv.tailor_select_cpu(q, kT32, ch, sinks, mid_end, top, recent))  # same values
            nb16, nb32 = (BH * (n_ch * (mid_end - sinks) * es + 8 * s.N) for es in (2, 4))
            ms16, ms32 = cold(kT), cold(kT32)
            add("tailor_select_cold", s, ms16, ms32, nb16, {"N": s.N - 128 + sinks + recent,
                "baseline": "fp32 channel copy", "baseline_bytes": nb32, "baseline_gbps": nb32 / ms32 / 1e6})
            del q, k, kT, kT32, kabs, flush
    return rows


SITE_OPS_POLICIES = ("Full,StreamingLLM(budget=1024),Quest(budget=1024),ClusterKV(budget=1024),"
                     "CentroidKV(cache_ratio=0.25),TailorKV")


def benchmark_site_ops(policies: str = SITE_OPS_POLICIES, contexts: tuple[int, ...] = (1024, 8192), sites: int = 30,
                       steps: int = 40, quick: bool = False, seed: int = 0) -> list[dict]:
    """What a steady decode step costs in the runtime's ops, outside any model: ``sites`` attention sites of
    SmolLM2's shape (9 query heads, 3 KV heads, head dim 64, batch 1), each prefilled with ``context``
    fp32 keys and values through ``kvpass::attention_owned``, then ``steps`` decode steps timed that call
    each site's ops as a compiled graph does (``kvpass::prefetch`` and ``kvpass::fetch`` where the policy
    has them, with the true query for the estimate; ``kvpass::attention_owned``; two ``kvpass::cache_stub``),
    one site after the other.

    The keys are not a model's: each is a moving average of 64 random vectors along the sequence plus
    noise, so that nearby tokens resemble each other and clusters are runs of positions, as a model's
    keys make them (independent random keys would scatter every cluster over the cache). A selection's
    quality is not measured here, only its cost.

    Rows: ``kernel`` "site_ops", ``us_per_site`` the median step over ``sites``; ``baseline_us`` is Full's
    at the smallest context (F of the floor: what attending about that many tokens costs), ``extra_us``
    the difference: a policy's own work at a site (selection, Python, attention over what it selected)
    where its budget is that context. ``events``: scheduled events (clustering, merges, flushes) during
    the timed steps; 0 for a steady step. ``attended``: the tokens the last step attended, the mean over
    the sites (``SiteState.tokens_attended``). ``mean_us``: the mean over the timed steps, events included:
    with ``steps`` past a policy's schedule (CentroidKV merges every 64 steps, TailorKV flushes its quantised
    residual every 128, ClusterKV clusters every 320 generated tokens) what a step costs amortised, where
    ``us_per_site`` is the steady step."""
    import kvpass.lowering.ops  # noqa: F401  (registers the kvpass:: ops)

    ops = torch.ops.kvpass
    if quick:
        contexts, steps = tuple(c for c in contexts if c <= 1024) or contexts[:1], 8
    contexts = tuple(sorted(contexts))
    rows: list[dict] = []
    g = torch.Generator().manual_seed(seed)

    def keys(n):
        walk = torch.randn(1, 3, n + 64, 64, generator=g).cumsum(2)
        return (walk[:, :, 64:] - walk[:, :, :-64]) / 8 + 0.5 * torch.randn(1, 3, n, 64, generator=g)

    full_us = None
    with torch.no_grad():
        for ctx in contexts:
            kv = [(keys(ctx), torch.randn(1, 3, ctx, 64, generator=g)) for _ in range(sites)]
            q_pre = torch.randn(1, 9, ctx, 64, generator=g)
            qs = [torch.randn(1, 9, 1, 64, generator=g) for _ in range(sites)]
            new = [(kv[s][0][:, :, -1:].clone(), torch.randn(1, 3, 1, 64, generator=g)) for s in range(sites)]
            for policy in parse_policies(policies):
                rt = Runtime(policy)
                h = rt.handle
                stubs = []
                for s, (k, v) in enumerate(kv):
                    ops.attention_owned(q_pre, k, v, None, None, None, 0.125, True, h, s)
                    stubs.append((ops.cache_stub(k, None, h, s), ops.cache_stub(v, None, h, s)))

                def step():
                    for s in range(sites):
                        sk, sv = stubs[s]
                        q, (k1, v1) = qs[s], new[s]
                        ticket = None
                        if policy.fetches:
                            after = ops.prefetch(q, sk, h, s, False) if policy.prefetches else None
                            ticket = ops.fetch(q, sk, h, s, after)
                        ops.attention_owned(q, k1, v1, sk, sv, None, 0.125, False, h, s, ticket)
                        stubs[s] = (ops.cache_stub(k1, sk, h, s), ops.cache_stub(v1, sv, h, s))

                for _ in range(3):
                    step()
                events = sum(st.all_events() for st in rt.sites.values())
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                events = sum(st.all_events() for st in rt.sites.values()) - events
                us = 1e6 * statistics.median(times) / sites
                mean_us = 1e6 * statistics.mean(times) / sites
                if full_us is None and policy.name == "Full":
                    full_us = us
                base = full_us if full_us is not None else float("nan")
                attended = statistics.mean(st.tokens_attended() for st in rt.sites.values())
                rows.append(dict(kernel="site_ops", policy=policy.describe(), context=ctx, sites=sites, steps=steps,
                                 us_per_site=us, baseline=f"Full at {contexts[0]}", baseline_us=base,
                                 extra_us=us - base, events=events, attended=attended, mean_us=mean_us))
                del rt
    return rows


def format_table(rows: list[dict]) -> str:
    cols = ["kernel", "shape", "S", "N", "dtype", "impl", "ms", "baseline", "baseline_ms", "speedup",
            "gbps", "baseline_gbps"]
    if any("pct_peak" in r for r in rows):
        cols.append("pct_peak")

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if v < 100 else f"{v:.0f}"
        return str(v)

    table = [cols] + [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpass.bench.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, short runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads (default: torch's); 1 is steadier on a machine shared with other jobs")
    ap.add_argument("--cpu-paths", action="store_true",
                    help="instead: each C kernel against the torch code it replaces on CPU (benchmark_cpu_paths)")
    ap.add_argument("--site-ops", action="store_true",
                    help="instead: a steady decode step's runtime ops per attention site, each policy against "
                         "Full, outside any model (benchmark_site_ops)")
    ap.add_argument("--policies", default=SITE_OPS_POLICIES, help="with --site-ops: the policies (Full first)")
    ap.add_argument("--contexts", default="1024,8192", help="with --site-ops: comma-separated contexts")
    ap.add_argument("--steps", type=int, default=40,
                    help="with --site-ops: timed steps (past 64, 128 or 320 they include the scheduled events)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.site_ops:
        ctxs = tuple(int(c) for c in args.contexts.split(","))
        rows = benchmark_site_ops(args.policies, ctxs, steps=args.steps, quick=args.quick)
        print(f"kvpass runtime ops of a steady decode step, us per site ({torch.get_num_threads()} threads, 30 sites of "
              f"SmolLM2's shape, batch 1, keys that drift along the sequence; {rows[0]['steps'] if rows else 0} timed "
              "steps, their median; extra: over Full at the smallest context; mean_us: the mean step, scheduled "
              "events included, and events: how many the timed steps ran)")
        cols = ["policy", "context", "attended", "us_per_site", "baseline_us", "extra_us", "mean_us", "events"]
        table = [cols] + [[r["policy"][:48], str(r["context"]), f"{r['attended']:.0f}", f"{r['us_per_site']:.0f}",
                           f"{r['baseline_us']:.0f}", f"{r['extra_us']:+.0f}", f"{r['mean_us']:.0f}",
                           str(r["events"])] for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        print("\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table))
        return 0
    if args.cpu_paths:
        rows = benchmark_cpu_paths(quick=args.quick)
        print(f"kvpass C kernels against the torch paths they replace ({torch.get_num_threads()} threads, fp32, "
              "one run; N: positions listed, pages chosen, or tokens recalled)")
        print(format_table(rows))
        return 0
    rows = benchmark_kernels(args.device, quick=args.quick)
    head = f"kvpass kernels on {args.device}"
    if args.device == "cuda":
        peak, how = peak_bandwidth(0)
        name = torch.cuda.get_device_name(0)
        head += f" ({name}; peak {peak / 1e9:.0f} GB/s, {how})" if peak else f" ({name}; peak {how})"
    else:
        head += f" ({torch.get_num_threads()} threads; CPU decode paths, impl column)"
    print(head)
    print("N: positions read or returned (quest: pages S/page_size; centroid: merged slots; quant: 1-bit "
          "tokens, + 128 fp; kmeans_assign: centroids; merge_round: pairs merged)")
    print("gbps = bytes moved / time; (cost ref) baselines are a scale, not the same result")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

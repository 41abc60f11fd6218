"""Micro-benchmarks of the kvpass kernels against the dense torch equivalent.

- ``sparse_decode_attention``: one decode query per head over ``N`` gathered positions of an
  ``S``-token cache, against dense SDPA over all ``S`` keys
  (``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``, q ``(B, H_q, 1, D)``).
- ``quest_page_scores``: Quest page upper bounds over ``S / page_size`` pages; on CUDA the Triton
  launcher against :func:`quest_page_scores_ref`, on CPU the reference against the plain broadcast
  formula ``sum_d max(q_d kmax_d, q_d kmin_d)`` (what a direct port would do).

On CPU the references (the CPU decode path) are timed with ``torch.utils.benchmark.Timer``
(``blocked_autorange``, median); on CUDA the Triton launchers with ``triton.testing.do_bench``
(median). Each row also gives the bytes the kernel must move at least and the achieved bandwidth;
on CUDA against the device's peak (see :func:`peak_bandwidth`).

Bytes moved (lower bounds, each tensor read or written once):
- sparse: the gathered K and V rows ``B*H_kv*N*(D+Dv)`` + q + out + idx (int32 or int64);
- dense SDPA: all K and V rows ``B*H_kv*S*(D+Dv)`` + q + out;
- quest: kmin and kmax of the live pages ``2*B*H_kv*P*D`` + q + the fp32 scores ``B*H_q*P``.

``python -m kvpass.bench.kernels [--quick] [--device cpu|cuda]`` prints the table.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

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
    from kvpass.kernels import sparse_attention as sa

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
    from kvpass.kernels import quest

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
            add("sparse_decode_attention", s, "triton" if cuda else "torch ref", timer(sparse, quick),
                "dense SDPA over S", timer(dense, quick), nbytes, dense_bytes)
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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = benchmark_kernels(args.device, quick=args.quick)
    head = f"kvpass kernels on {args.device}"
    if args.device == "cuda":
        peak, how = peak_bandwidth(0)
        name = torch.cuda.get_device_name(0)
        head += f" ({name}; peak {peak / 1e9:.0f} GB/s, {how})" if peak else f" ({name}; peak {how})"
    else:
        head += f" ({torch.get_num_threads()} threads; torch reference path)"
    print(head)
    print("quest_page_scores: N is the page count P = S / page_size; gbps = bytes moved / time")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode attention on the CPU, fused with the gather: a small C kernel built once per machine.

One query token per head attends to the rows of a cache listed per KV head, read in place (no gathered
copy), or to every row. The G query heads of a KV head (HF ``repeat_kv`` order: head ``h`` reads KV
head ``h // G``) share each K and V row, so a row is read once per KV head. Per (batch row, KV head)
the kernel makes two passes: the G scores of every listed row and their maximum, then
``exp(s - max)`` and the weighted sum of the V rows, fp32 throughout. It is the CPU counterpart of
:mod:`kvpass.kernels.sparse_attention`'s Triton kernel (same semantics: a position outside ``[0, S)``,
such as the padding ``-1``, is skipped; duplicates count twice; a row with nothing valid returns 0).

Why C and not torch on CPU: SDPA's flash kernel and matmul-softmax-matmul run one decode query group
at 7-11 GB/s on this project's machines (compute-bound: the products have 1-3 rows), while the
memory reads 25-29 GB/s; a gather first copies every selected row. docs/design.md, "Fused decode
attention on CPU", has the figures.

The C is ``kvpass/kernels/csrc/cpu_decode.c`` (shared pieces and argument structs in ``csrc/kvpass.h``),
built once per machine by :mod:`kvpass.kernels.native` (the C compiler Inductor uses, ``-O3
-march=native``); :func:`available` is False where no compiler works or ``KVPASS_NATIVE=0``, and the
callers then keep their torch code.

In this module: :func:`cpu_decode_attention` (checks, launch), :func:`cpu_decode_attention_ref` (plain
torch, the reference the tests compare with), and :class:`ListedArgs` / :class:`ListedAttend`, the
attention's operands as a selection kernel (clusterkv.c, quest.c, tailorkv.c) runs it after its list.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native

__all__ = ["DecodeArgs", "ListedArgs", "ListedAttend", "available", "cpu_decode_attention",
           "cpu_decode_attention_ref"]

_MAX_GROUP = 16

class ListedArgs(ctypes.Structure):
    """``kvpass_listed_args`` (csrc/kvpass.h): the cache, output and scale of the decode attention a
    selection kernel runs over the list it has just written (in the same call from Python: a call costs
    tens of microseconds at 30 sites a step), and the address of ``kvpass_decode_attention`` in this
    module's library. Filled by :class:`ListedAttend`."""

    c_name = "kvpass_listed_args"
    _fields_ = [("attend", ctypes.c_void_p),
                ("k", ctypes.c_void_p), ("ks_b", ctypes.c_int64), ("ks_h", ctypes.c_int64), ("ks_s", ctypes.c_int64),
                ("v", ctypes.c_void_p), ("vs_b", ctypes.c_int64), ("vs_h", ctypes.c_int64), ("vs_s", ctypes.c_int64),
                ("out", ctypes.c_void_p), ("os_b", ctypes.c_int64), ("os_h", ctypes.c_int64),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int64)]


class ListedAttend:
    """Fills a selection kernel's :class:`ListedArgs` (``args``, a member of the step's struct) with
    :func:`decode_step`'s operands; one per selection step object, so that the attention's address is
    looked up and set once, not at every step."""

    def __init__(self, args: ListedArgs) -> None:
        fn = _load()
        self.args = args
        self.address = None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value
        args.attend = self.address
        self._k = self._v = None  # a cache that stays for the step object's life (hold)

    def hold(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set ``k, v`` once: :meth:`pack` with these very tensors (the caller's own buffers, replaced only
        with the step object) does not set them again."""
        self._k = self._v = None
        self._set_kv(k, v)
        self._k, self._v = k, v

    def _set_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        args, ks, vs = self.args, k.stride(), v.stride()
        args.k, args.ks_b, args.ks_h, args.ks_s = k.data_ptr(), ks[0], ks[1], ks[2]
        args.v, args.vs_b, args.vs_h, args.vs_s = v.data_ptr(), vs[0], vs[1], vs[2]

    def pack(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
             scale: float) -> torch.Tensor | None:
        """Fill :attr:`args` and return the ``(B, H_q, 1, D)`` output ``attend_listed`` will write; None,
        writing nothing, where :func:`decode_step` would not serve ``q (B, H_q, 1, D)``, ``k, v (B, H_kv,
        S >= length, D)``."""
        if not (self.address is not None and q.dim() == 4 and q.shape[2] == 1 and _serves(q, k, v)
                and 0 <= length <= k.shape[2]):
            return None
        out = q.new_empty(q.shape)
        if k is not self._k or v is not self._v:
            self._set_kv(k, v)
        args, os_ = self.args, out.stride()
        args.out, args.os_b, args.os_h = out.data_ptr(), os_[0], os_[1]
        args.scale, args.threads = float(scale), torch.get_num_threads()
        return out


class DecodeArgs(ctypes.Structure):
    """``kvpass_decode_args`` (csrc/kvpass.h): ``kvpass_decode_attention``'s operands, made per call (one
    struct converts faster than thirty ctypes arguments)."""

    c_name = "kvpass_decode_args"
    _fields_ = [*native.fields("q* qs_b qs_h k* ks_b ks_h ks_s v* vs_b vs_h vs_s idx* is_b is_h is_n bias* bs_b "
                               "bs_h bs_s out* os_b os_h B Hk G S N D"),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int64)]


_ARGTYPES = [ctypes.POINTER(DecodeArgs)]


def _load():
    """The kernel's ctypes function (:func:`kvpass.kernels.native.function`), or None."""
    return native.function("cpu_decode", "kvpass_decode_attention", _ARGTYPES)


def available() -> bool:
    """Whether the C kernel is built and loaded (a compiler was found, ``KVPASS_NATIVE`` is not 0)."""
    return _load() is not None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`cpu_decode_attention` serves these operands (plain fp32 CPU tensors whose last dim
    is contiguous, a query group of at most 16, v's head dim equal to k's). A tensor subclass is never
    served: the kernel reads memory directly, past any ``__torch_function__`` (a kvpass cache stub must
    reach torch code, which refuses it loudly)."""
    return q.dim() == 3 and _serves(q, k, v)


def _serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """:func:`supports` but for q's dimensions: B and H_q are its first two, D its last. Runs at every site
    of every decode step, hence ``is_cpu`` and one read of each shape (a ``.device`` costs a microsecond)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and q.is_cpu and k.is_cpu and v.is_cpu
            and q.dtype == torch.float32 and k.dtype == torch.float32 and v.dtype == torch.float32
            and k.dim() == 4 and v.dim() == 4 and q.stride(-1) == 1 and k.stride(3) == 1 and v.stride(3) == 1):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    h = ks[1]
    return (h > 0 and qs[1] % h == 0 and qs[1] // h <= _MAX_GROUP and vs[0] == ks[0] and vs[1] == h
            and vs[2] == ks[2] and vs[3] == ks[3] == qs[-1] and _load() is not None)


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, idx: torch.Tensor | None,
                scale: float, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A runtime decode step's attention, ``(B, H_q, 1, D)``, or None where the kernel does not serve the
    operands (the caller takes its torch path). ``q (B, H_q, 1, D)`` as the attention op receives it;
    ``k, v (B, H_kv, S', D)`` with ``S' >= length``, of which positions ``[0, length)`` are attended (a
    store's buffers, read in place: no sliced view per step); ``idx (B, H_kv, N)`` int64 lists the
    positions (None: all); ``bias (B, H_kv, S'')`` fp32 with ``S'' >= length`` is added to the scores
    (CentroidKV's log degree, kept beside its buffers). :func:`cpu_decode_attention` without the views it
    would need (each costs microseconds, at 30 sites a step)."""
    if not (q.dim() == 4 and q.shape[2] == 1 and _serves(q, k, v) and 0 <= length <= k.shape[2]):
        return None
    if bias is not None:
        bs = bias.shape
        if not (type(bias) is torch.Tensor and bias.is_cpu and bias.dtype == torch.float32 and bias.dim() == 3
                and bs[0] == k.shape[0] and bs[1] == k.shape[1] and bs[2] >= length):
            return None
        bstr, bptr = bias.stride(), bias.data_ptr()
    else:
        bstr, bptr = (0, 0, 0), None
    qs = q.shape
    b, h_q, d = qs[0], qs[1], qs[3]
    h_kv = k.shape[1]
    out = q.new_empty(qs)
    if idx is not None:
        if not (idx.dtype == torch.int64 and idx.dim() == 3 and idx.shape[0] == b and idx.shape[1] == h_kv):
            return None
        n, istr, iptr = idx.shape[2], idx.stride(), idx.data_ptr()
    else:
        n, istr, iptr = length, (0, 0, 0), None
    if b * h_q == 0:
        return out
    return _launch(q, k, v, length, n, iptr, istr, bptr, bstr, out, scale, torch.get_num_threads())


def _launch(q, k, v, S, N, iptr, istr, bptr, bstr, out, scale, threads) -> torch.Tensor:
    """The C call on checked operands: q's and out's first two dims are (B, H_q), their last D."""
    ks, vs, qs, os_ = k.stride(), v.stride(), q.stride(), out.stride()
    rc = _load()(DecodeArgs(q.data_ptr(), qs[0], qs[1], k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1],
                            vs[2], iptr, *istr, bptr, *bstr, out.data_ptr(), os_[0], os_[1], q.shape[0], k.shape[1],
                            q.shape[1] // k.shape[1], S, N, q.shape[-1], float(scale), threads))
    if rc != 0:
        raise MemoryError(f"kvpass: cpu_decode_attention could not allocate its scratch (rc={rc})")
    return out


def cpu_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q (B, H_q, D)`` over ``k, v (B, H_kv, S, D)`` (any strides but a
    contiguous last dim), at the positions ``idx (B, H_kv, N)`` (int64; outside ``[0, S)`` skipped;
    duplicates count twice) or at every position (``idx`` None), with an additive fp32 ``bias
    (B, H_kv, S)`` on the scores (``-inf`` skips a position; CentroidKV's ``log degree``, padding).
    fp32 CPU only (:func:`supports`). The (batch row, KV head) pairs are split over ``threads``
    (default ``torch.get_num_threads()``) when there is enough work. Returns ``(B, H_q, D)``, into
    ``out`` when given (its last dim contiguous); a row with nothing valid is 0."""
    if not supports(q, k, v):  # supports() also asks for the built kernel
        raise ValueError(
            "kvpass: cpu_decode_attention needs fp32 CPU q (B, H_q, D), k, v (B, H_kv, S, D) with a "
            "contiguous last dim and the C kernel built (kvpass.kernels.cpu_decode.available()); got "
            f"q {tuple(q.shape)} {q.dtype} {q.device}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if out is None:
        out = q.new_empty((B, H_q, D))
    elif tuple(out.shape) != (B, H_q, D) or out.dtype != torch.float32 or out.stride(2) != 1:
        raise ValueError(f"kvpass: cpu_decode_attention needs out fp32 ({B}, {H_q}, {D}) with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if idx is not None:
        if idx.dtype != torch.int64 or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, H_kv):
            raise ValueError(f"kvpass: cpu_decode_attention needs idx int64 (B={B}, H_kv={H_kv}, N), got "
                             f"{tuple(idx.shape)} {idx.dtype}")
        N, istr, iptr = idx.shape[2], idx.stride(), idx.data_ptr()
    else:
        N, istr, iptr = S, (0, 0, 0), None
    if bias is not None:
        if bias.dtype != torch.float32 or tuple(bias.shape) != (B, H_kv, S) or bias.device.type != "cpu":
            raise ValueError(f"kvpass: cpu_decode_attention needs bias fp32 CPU (B={B}, H_kv={H_kv}, S={S}), "
                             f"got {tuple(bias.shape)} {bias.dtype} {bias.device}")
        bstr, bptr = bias.stride(), bias.data_ptr()
    else:
        bstr, bptr = (0, 0, 0), None
    if B * H_q == 0:
        return out
    return _launch(q, k, v, S, N, iptr, istr, bptr, bstr, out, scale,
                   torch.get_num_threads() if threads is None else int(threads))


def cpu_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch :func:`cpu_decode_attention` in float64 (gather, masked softmax, weighted sum); shapes
    as there."""
    B, H_q, D = q.shape
    _, H_kv, S, _ = k.shape
    G = H_q // H_kv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    qg = q.reshape(B, H_kv, G, D).double()
    if idx is None:
        idx = torch.arange(S).expand(B, H_kv, S)
    if idx.shape[2] == 0:
        return q.new_zeros((B, H_q, D))
    valid = (idx >= 0) & (idx < S)
    pos = torch.where(valid, idx, 0)
    ks = torch.gather(k.double(), 2, pos[..., None].expand(-1, -1, -1, D))
    vs = torch.gather(v.double(), 2, pos[..., None].expand(-1, -1, -1, D))
    s = (qg @ ks.transpose(-1, -2)) * scale  # (B, H_kv, G, N)
    if bias is not None:
        b = torch.gather(bias.double(), 2, pos)
        valid = valid & (b > float("-inf"))
        s = s + torch.where(valid, b, 0.0)[:, :, None, :]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    p = (s - m).exp()
    den = p.sum(-1, keepdim=True)
    out = (p @ vs) / torch.where(den > 0, den, 1.0)
    return out.reshape(B, H_q, D).to(q.dtype)

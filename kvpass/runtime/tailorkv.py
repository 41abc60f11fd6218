"""Site state of TailorKV (arXiv 2505.19586): a quantised layer or a sparse layer with a host tier.

**Quantised layer** (device only): keys quantised per channel (groups of ``group_size`` tokens),
values per token (groups of channels), ``quant_bits`` wide, in capacity buffers that grow by whole
residual chunks; ``res_k/res_v (B, H_kv, residual, D)`` hold the newest tokens in full precision.
A decode step appends to the residual, attends over packed + residual with the fused kernel, and
quantises the residual once it holds ``residual`` tokens.

**Sparse layer**: the site's store (``OwnedKV(host=True)``) is the host tier with every token. The
device tier holds the first ``sinks`` tokens, the ``static_tokens - sinks`` most recent ones, the
per-channel ``max_t |K|`` ``(B, H_kv, D)`` fp32, the top-k tokens fetched this step, and (shared by
the layers of a backend, by layer parity: the paper's double buffer) the critical key channels
prefetched for the next layer. Positions ``[sinks, L - recent)`` are the candidates for top-k.

On a CPU (fp32, the C kernels built) the host tier is the device's own memory, so a sparse layer copies
nothing (``in_c``): the prefetch picks the channels, the fetch scores the candidates from the host tier's
channel-major keys in place and lists sinks, top-k and recent positions
(:func:`kvpass.kernels.tailorkv.tailor_select_cpu`), and the attention reads those rows in place
(:mod:`kvpass.kernels.cpu_decode`). The report counts what the method holds on its device tier and moves
between tiers as a GPU would (docs/design.md, "TailorKV on CPU").

The graph pass orders the ops of one decode step as ``prefetch(q̂_l)`` (during layer l-1) ->
``fetch(q_l)`` -> ``attention_owned`` of layer l. Only the attention reads the stub, so a batch that
beam search reordered or expanded is followed there (``reorder_cache``), and the step's selection, made for
the old rows, is made again.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from kvpass.kernels import cpu_decode
from kvpass.kernels import tailorkv as kernels  # cpu_select_available read at each call (tests switch it off)
from kvpass.kernels.sparse_attention import sinks_picked_recent
from kvpass.kernels.tailorkv import CpuStep, QuantizedKV, critical_channels, dequantize
from kvpass.lowering.dispatch import partial_topk, quant_attention, quantize, sparse_attention
from kvpass.runtime.call import make_call, profile_range
from kvpass.runtime.errors import KVPassError
from kvpass.runtime.state import SiteState
from kvpass.runtime.store import OwnedKV, grow_seq, host_empty

QUANTISED, SPARSE = "quantised", "sparse"


def value_group(head_dim: int, group_size: int, bits: int) -> int:
    """The channel group of the per-token value quantisation: ``group_size`` when it divides the head
    dimension, else the largest multiple of ``8 // bits`` below it that does (head_dim 96 with groups
    of 64 -> 48)."""
    per = 8 // bits
    for g in range(min(group_size, head_dim), 0, -1):
        if head_dim % g == 0 and g % per == 0:
            return g
    raise KVPassError(
        f"kvpass: TailorKV cannot quantise head_dim={head_dim} at {bits} bit(s): it needs a multiple of "
        f"{per} (8 // quant_bits); use {'quant_bits=2 or ' if bits == 1 else ''}another policy for this model"
    )


def take_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, h, idx[b, h, n]]`` for a contiguous ``t (B, H, S, X)`` and ``idx (B, H, N)``: one
    ``index_select`` of whole rows, (B, H, N, X) (a CPU copies rows several times faster this way than
    with ``gather`` or advanced indexing)."""
    b, h, s, x = t.shape
    off = (torch.arange(b * h, device=t.device) * s).view(b, h, 1)
    return t.view(b * h * s, x).index_select(0, (idx.to(t.device) + off).view(-1)).view(b, h, -1, x)


def batch_rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """``t.index_select(0, rows)`` on ``t``'s own device (rows moved there); a pinned host buffer stays
    pinned, so the side stream's copies from it stay asynchronous."""
    if t is None:
        return None
    idx = rows.to(t.device)
    if t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned():
        out = torch.empty((idx.shape[0], *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, idx, out=out)
    return t.index_select(0, idx)


def dense_preference(q: torch.Tensor, k: torch.Tensor, n_q: int, topk: float, scale: float) -> float:
    """TailorKV's dense-preference score of one layer at prefill, normalised per query.

    q: (B, H_q, T, D) the prompt's queries (the last T of the L positions); k: (B, H_kv, L, D).
    The last ``min(n_q, T)`` queries attend causally to the keys; ``k_top = ceil(topk * L)``.
    Returns the mean over batch rows, heads and queries of ``1 - Σ top-k attention weights``: the
    paper's ``P = n_q - Σ_{(i,j) ∈ top-k} Â_ij`` divided by n_q (and averaged over heads), so that
    one ``tau`` serves any n_q.
    """
    b, h_q, t, d = q.shape
    h_kv, length = k.shape[1], k.shape[2]
    n = min(n_q, t)
    g = h_q // h_kv
    qs = q[:, :, t - n :].float().reshape(b, h_kv, g, n, d)
    scores = torch.matmul(qs, k.float()[:, :, None].transpose(-1, -2)) * scale  # (B, H_kv, G, n, L)
    pos = torch.arange(length - n, length, device=q.device)[:, None]
    scores.masked_fill_(torch.arange(length, device=q.device)[None, :] > pos, -math.inf)
    attn = torch.softmax(scores, dim=-1)
    k_top = max(1, math.ceil(topk * length))
    top = attn.topk(min(k_top, length), dim=-1).values.sum(-1)
    return float((1.0 - top).mean())


class PackedCache:
    """The packed 1/2-bit cache of a quantised layer (see :mod:`kvpass.kernels.tailorkv`)."""

    def __init__(self, like_k: torch.Tensor, like_v: torch.Tensor, bits: int, group: int, capacity: int):
        b, h, _, d = like_k.shape
        dv = like_v.shape[3]
        self.bits, self.group, self.vgroup = bits, group, value_group(dv, group, bits)
        self.dtype = like_k.dtype
        self.b, self.h, self.d, self.dv = b, h, d, dv
        self.n = 0
        per = 8 // bits
        dev = like_k.device
        cap = capacity
        self.kp = torch.zeros((b, h, cap // per, d), dtype=torch.uint8, device=dev)
        self.ks = torch.zeros((b, h, cap // group, d), dtype=torch.float16, device=dev)
        self.kz = torch.zeros_like(self.ks)
        self.vp = torch.zeros((b, h, cap, dv // per), dtype=torch.uint8, device=dev)
        self.vs = torch.zeros((b, h, cap, dv // self.vgroup), dtype=torch.float16, device=dev)
        self.vz = torch.zeros_like(self.vs)

    @property
    def capacity(self) -> int:
        return self.vp.shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kp, self.ks, self.kz, self.vp, self.vs, self.vz))

    def live_bytes(self) -> int:
        """Bytes of the ``n`` quantised tokens: packed codes + fp16 scales and zeros."""
        per = 8 // self.bits
        k = self.n // per * self.d + 2 * 2 * (self.n // self.group) * self.d
        v = self.n * (self.dv // per) + 2 * 2 * self.n * (self.dv // self.vgroup)
        return self.b * self.h * (k + v)

    def append(self, k: torch.Tensor, v: torch.Tensor, chunk: int) -> None:
        """Quantise ``k, v (B, H, n, D)``, n a multiple of the group, after the tokens held."""
        n = k.shape[2]
        if n == 0:
            return
        end = self.n + n
        if end > self.capacity:
            cap = end + 8 * chunk  # whole residual chunks: a regrowth every 8 flushes at most
            per = 8 // self.bits
            self.kp = grow_seq(self.kp, cap // per)
            self.ks, self.kz = grow_seq(self.ks, cap // self.group), grow_seq(self.kz, cap // self.group)
            self.vp, self.vs, self.vz = grow_seq(self.vp, cap), grow_seq(self.vs, cap), grow_seq(self.vz, cap)
        kq = quantize(k, self.bits, self.group, "channel")
        vq = quantize(v, self.bits, self.vgroup, "token")
        per = 8 // self.bits
        self.kp[:, :, self.n // per : end // per] = kq.packed
        self.ks[:, :, self.n // self.group : end // self.group] = kq.scale
        self.kz[:, :, self.n // self.group : end // self.group] = kq.zero
        self.vp[:, :, self.n : end] = vq.packed
        self.vs[:, :, self.n : end] = vq.scale
        self.vz[:, :, self.n : end] = vq.zero
        self.n = end

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search reordered (or expanded) the batch: rows ``rows (B',)`` of every buffer."""
        for name in ("kp", "ks", "kz", "vp", "vs", "vz"):
            setattr(self, name, batch_rows(getattr(self, name), rows))
        self.b = rows.shape[0]

    def views(self):
        """(kq, vq) :class:`QuantizedKV` views of the ``n`` tokens held (no copy)."""
        per, n = 8 // self.bits, self.n
        kq = QuantizedKV(self.kp[:, :, : n // per], self.ks[:, :, : n // self.group], self.kz[:, :, : n // self.group],
                         self.bits, self.group, "channel", (self.b, self.h, n, self.d), self.dtype)
        vq = QuantizedKV(self.vp[:, :, :n], self.vs[:, :, :n], self.vz[:, :, :n],
                         self.bits, self.vgroup, "token", (self.b, self.h, n, self.dv), self.dtype)
        return kq, vq


class TailorState(SiteState):
    # a padded batch is served in place by a sparse layer on the CPU path (serves_padded), else row by row
    # (kvpass.runtime.rows)
    rows_native = False
    owns_cache = True  # a packed cache or a host tier per layer (start / extend / decode)
    model_cache_refusal = (
        "kvpass: TailorKV needs the runtime to own the cache (a DynamicCache with kvpass(..., "
        "own_cache=True), the default): its layers hold a packed cache or a host tier, which a "
        "StaticCache's device buffers cannot; drop cache_implementation='static'"
    )

    def __init__(self, policy, info, shared=None):
        super().__init__(policy, info, shared)
        self.store = OwnedKV(host=True)  # the host tier of a sparse layer (unused by a quantised one)
        self.cos_sum = None  # sum over steps of the estimate's cosine similarity to the true query
        self.cos_c = torch.zeros(1, dtype=torch.float64)  # the same sum, added by the C selection (in_c)
        self.cos_n = 0

    def reset(self) -> None:
        super().reset()
        self.tier: str | None = None
        self.score: float | None = None
        self.logical = 0
        # quantised layer
        self.packed: PackedCache | None = None
        self.res_k = self.res_v = None
        self.n_res = 0
        # sparse layer (device tier)
        self.sink_k = self.sink_v = self.rec_k = self.rec_v = None
        self.kabs: torch.Tensor | None = None
        self.kT: torch.Tensor | None = None  # (B, H_kv, D, capacity): host-tier keys, channel-major (bf16 for fp32)
        self.ch: torch.Tensor | None = None  # (B, H_kv, c) channels prefetched for this step
        self.k_ch: torch.Tensor | None = None  # (B, H_kv, candidates, c) their keys
        self.q_hat: torch.Tensor | None = None  # this step's estimate (B, H_q, 1, D), as the op receives it
        self.sel_k = self.sel_v = None
        self.plan = None  # (n_sinks, picked positions (B, H_kv, k) or None, n_recent) of this step
        self.in_c = False  # CPU: the C kernels read the host tier in place (module docstring)
        self.cpu_step = None  # in_c: the C step over this layer's buffers (kvpass.kernels.tailorkv.CpuStep)
        self.n_s = 0  # sinks held (fixed when the sequence is loaded)
        self.listed: torch.Tensor | None = None  # in_c: (B, H_kv, N) positions this step attends
        # in_c, fetch in the attention: this step's selection (CpuStep.select's arguments), which the
        # attention runs in its own C call (select, append, attend: _decode_in_c)
        self.pending: tuple | None = None
        self.channel_bytes = 0  # the critical channels of the candidates read (or copied) this step
        # a left-padded batch served in place: (B,) int64 each row's first real position, and their sum
        self.first: torch.Tensor | None = None
        self.first_sum = 0
        self.prefetched = 0
        self.event = None  # CUDA: the prefetch's copy on the side stream

    # -- tiers -----------------------------------------------------------------------------------
    def _decide(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        """This layer's tier, from the profile (or this prompt's queries with ``profile="auto"``)."""
        p, layer = self.policy, self.info.layer
        tier = self._profile_tier()
        if tier is not None:
            self.tier = tier
            self.score = None if p.profile is None else p.profile.score(layer)
        else:
            if self.first is not None:  # serves_padded refuses "auto"
                raise KVPassError("kvpass: TailorKV(profile='auto') cannot serve a padded batch in place")
            scores = self.shared.setdefault("tailorkv.scores", {})
            if layer not in scores:
                scores[layer] = dense_preference(q, k, p.calib_queries, p.calib_topk, scale)
            self.score = scores[layer]
            self.tier = QUANTISED if self.score > p.tau else SPARSE
        if self.tier == SPARSE:
            self.shared.setdefault("tailorkv.sparse_layers", set()).add(layer)

    def _profile_tier(self) -> str | None:
        """This layer's tier where the profile fixes it without the prompt's queries (None: ``"auto"``)."""
        p = self.policy
        if p.profile is None:
            return SPARSE
        if p.profile == "auto":
            return None
        return QUANTISED if p.profile.score(self.info.layer) > p.tau else SPARSE

    @staticmethod
    def _c_path(like: torch.Tensor) -> bool:
        """Whether a sparse layer of keys like ``like`` runs on the CPU path (``in_c``)."""
        return (like.device.type == "cpu" and like.dtype == torch.float32 and cpu_decode.available()
                and kernels.cpu_select_available())

    def serves_padded(self, first: list[int], length: int, new_tokens: int, like: torch.Tensor) -> bool:
        """In place for a sparse layer on the CPU path whose every row has more candidates than the top-k
        at the start (``static_tokens + topk`` own tokens, and one more): each row's sinks, candidates and
        recent tokens then sit at fixed offsets from its first real token, as alone (the C step list takes
        the rows' first positions), and ``max |K|`` is taken over the row's own keys. A quantised layer
        (its groups of tokens would start at the padded position), the torch path, a ``profile="auto"``
        (tiers from each prompt's own queries) and shorter rows are served row by row."""
        if self._profile_tier() != SPARSE or not self._c_path(like):
            return False
        p = self.policy
        loaded = length if new_tokens > 1 else length - 1  # an adopting decode step loads what precedes it
        return all(loaded - f - p.static_tokens > p.topk for f in first)

    @property
    def n_sinks(self) -> int:
        return min(self.policy.sinks, self.logical)

    @property
    def n_recent(self) -> int:
        return min(self.policy.static_tokens - self.policy.sinks, self.logical - self.n_sinks)

    def _load(self, k: torch.Tensor, v: torch.Tensor, dev: torch.device) -> None:
        """A new sequence of ``L`` tokens ``k, v (B, H_kv, L, D)`` (the host views for a sparse layer)."""
        p, length = self.policy, k.shape[2]
        self.logical = length
        if self.tier == QUANTISED:
            r = p.residual
            n_q = length // r * r  # whole residual chunks are quantised, the rest stays full precision
            self.packed = PackedCache(k, v, p.quant_bits, p.group_size, n_q + 2 * r)
            self.packed.append(k[:, :, :n_q].to(dev), v[:, :, :n_q].to(dev), r)
            self.res_k = k.new_zeros((*k.shape[:2], r, k.shape[3]), device=dev)
            self.res_v = v.new_zeros((*v.shape[:2], r, v.shape[3]), device=dev)
            self.n_res = length - n_q
            self.res_k[:, :, : self.n_res] = k[:, :, n_q:]
            self.res_v[:, :, : self.n_res] = v[:, :, n_q:]
            return
        n_s, n_r = self.n_sinks, self.n_recent
        self.n_s = n_s
        self.in_c = dev.type == "cpu" and self._c_path(k)
        if self.first is not None and not self.in_c:
            raise KVPassError("kvpass: TailorKV serves a padded batch in place on the CPU path only (fp32, the C "
                              "kernels built); this sequence must be served row by row")
        # a channel-major copy of the keys in the host tier: the prefetch of c critical channels then
        # reads c contiguous rows, c/D of the keys, instead of touching every key. Fp32 keys are copied as
        # bf16: the copy only ranks candidates on c of D channels (an estimate already), and the
        # selection reads half the bytes (docs/design.md, "A steady step's selection in fewer ops")
        b, h, _, d = k.shape
        cap = max(self.store.k.shape[2] if self.store.k is not None else 0, length)
        self.kT = host_empty((b, h, d, cap), torch.bfloat16 if k.dtype == torch.float32 else k.dtype)
        self.kT[:, :, :, :length] = k.transpose(2, 3)
        self.kT[:, :, :, length:].zero_()
        if not self.in_c:
            self.sink_k, self.sink_v = k[:, :, :n_s].to(dev, copy=True), v[:, :, :n_s].to(dev, copy=True)
            self.rec_k = k[:, :, length - n_r :].to(dev, copy=True)
            self.rec_v = v[:, :, length - n_r :].to(dev, copy=True)
        if not length:
            self.kabs = None
        elif self.first is None:
            self.kabs = k.abs().amax(dim=2).float().to(dev)
        else:  # each row's own keys: padding is never a maximum
            own = torch.arange(length, device=k.device) >= self.first.to(k.device)[:, None]  # (B, L)
            self.kabs = k.abs().mul_(own[:, None, :, None]).amax(dim=2).float().to(dev)

    def _in_c(self, q: torch.Tensor) -> bool:
        """Whether this step's C path serves the query ``q`` (fp32, a contiguous last dim) on an ``in_c`` layer."""
        return self.in_c and q.dtype == torch.float32 and q.stride(-1) == 1

    # -- the ops ---------------------------------------------------------------------------------
    def _channel_buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A view ``shape`` of the prefetch buffer of this layer's parity (two per backend)."""
        bufs = self.shared.setdefault("tailorkv.channel_buffers", [None, None])
        i = self.info.layer % 2
        buf = bufs[i]
        if (buf is None or buf.shape[:3] != shape[:3] or buf.shape[3] < shape[3]
                or buf.dtype != like.dtype or buf.device != like.device):
            cap = max(shape[3] + 256, int(buf.shape[3] * 1.5) if buf is not None else 0)
            buf = bufs[i] = like.new_empty((*shape[:3], cap))
        return buf[..., : shape[3]]

    def prefetch(self, q_hat: torch.Tensor, past: int, estimated: bool) -> torch.Tensor:
        """``kvpass::prefetch``: pick the critical channels of this layer from ``q_hat (B, H_q, 1, D)``
        and copy those key channels of the top-k candidates from the host tier (on the CPU path, keep
        ``q_hat`` for the fetch, which picks the channels in its C call)."""
        ticket = torch.full((1,), self.steps, dtype=torch.int64, device=q_hat.device)
        self.ch = self.k_ch = self.q_hat = None
        if self.tier != SPARSE or q_hat.shape[2] != 1 or past == 0 or past != self.logical:
            return ticket  # prefill, a quantised layer, or a sequence this state has not loaded
        t0 = time.perf_counter()
        # on the CPU path the fetch's C call picks the channels from the estimate (no copy to overlap)
        if not self.in_c and q_hat.shape[0] == self.kabs.shape[0]:
            with profile_range("kvpass.select"):
                self._prefetch(q_hat[:, :, 0], past + 1)
        # else the batch size changed since the last step (beam search expanded it): the attention, which
        # sees the new rows, reorders this state and prefetches for them (see reorder_cache)
        if estimated:  # Inductor may reuse the input buffer after the op: a copy
            self.q_hat = q_hat.clone(memory_format=torch.contiguous_format)
        self.overhead_decode_s += time.perf_counter() - t0
        return ticket

    def _ranges(self, length: int) -> tuple[int, int, int]:
        """(n_sinks, end of the top-k candidates, n_recent) for a sequence of ``length`` tokens: the
        device tier holds positions [0, n_sinks) and [length - n_recent, length)."""
        p = self.policy
        n_s = self.n_s
        n_r = min(p.static_tokens - p.sinks, length - n_s)
        return n_s, length - n_r, n_r

    def _prefetch(self, q_hat: torch.Tensor, length: int) -> None:
        p = self.policy
        n_s, mid_end, _ = self._ranges(length)
        if mid_end - n_s <= p.topk:
            return  # every candidate is fetched: nothing to score
        c = min(p.critical_channels, q_hat.shape[-1])
        n = mid_end - n_s
        self._c_only()
        self.ch = critical_channels(q_hat, self.kabs, c)  # (B, H_kv, c)
        b, h = self.ch.shape[:2]
        channels = take_rows(self.kT, self.ch)[..., n_s:mid_end]  # (B, H_kv, c, n)
        buf = self._channel_buffer((b, h, c, n), self.kabs.new_empty(0, dtype=channels.dtype))
        if buf.is_cuda and not channels.is_cuda:
            # the copy to the device runs on a side stream; the fetch waits on its event (written for
            # GPUs, not exercised on the CPU machines this project is tested on)
            stream = self.shared.setdefault("tailorkv.stream", torch.cuda.Stream(buf.device))
            stream.wait_stream(torch.cuda.current_stream(buf.device))
            with torch.cuda.stream(stream):
                buf.copy_(channels.pin_memory(), non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(stream)
        else:
            buf.copy_(channels)
        self.k_ch = buf.transpose(2, 3)  # (B, H_kv, n, c), as partial_topk takes it
        moved = self.channel_bytes = buf.numel() * buf.element_size()
        self.bytes_moved += moved
        self.prefetched += moved

    def fetch(self, q: torch.Tensor, past: int) -> torch.Tensor:
        """``kvpass::fetch``: score the candidates with the prefetched channels and the true query,
        copy the top-k tokens' K and V to the device tier."""
        ticket = super().fetch(q, past)
        self.plan = None
        self._fetch_step(q, past)
        return ticket

    def _fetch_step(self, q: torch.Tensor, past: int, attend: bool = False) -> None:
        """The fetch of a decode step with ``past`` cached tokens, by the op or (CPU) by the attention
        (``attend``: on the C path the attention makes the selection, in its own call)."""
        if self.tier != SPARSE or q.shape[2] != 1 or past == 0 or past != self.logical:
            return
        t0 = time.perf_counter()
        if self._in_c(q) and q.shape[0] == self.kabs.shape[0]:
            with profile_range("kvpass.select"):
                self._fetch_in_c(q, past + 1, cosine=True, defer=attend)
            self.overhead_decode_s += time.perf_counter() - t0
            return
        if self.q_hat is not None:
            self._estimate_cosine(q[:, :, 0])
        self._wait(q.device)
        if q.shape[0] == self.kabs.shape[0]:
            with profile_range("kvpass.select"):
                self._fetch(q[:, :, 0], past + 1)  # else the batch size changed: see prefetch
        self.overhead_decode_s += time.perf_counter() - t0

    def _estimate_cosine(self, q: torch.Tensor) -> None:
        """Add this step's mean cosine similarity of the estimate ``q̂`` to the true ``q (B, H_q, D)``
        (kept on the device: no host sync; the CPU path's C selection adds it to ``cos_c`` itself)."""
        cos = F.cosine_similarity(self.q_hat.reshape(q.shape).float(), q.float(), dim=-1).mean()
        self.cos_sum = cos if self.cos_sum is None else self.cos_sum + cos
        self.cos_n += 1

    def _wait(self, device: torch.device) -> None:
        """CUDA: make the current stream wait for the prefetch's copy."""
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)
            self.event = None

    def _fetch(self, q: torch.Tensor, length: int) -> None:
        p = self.policy
        n_s, mid_end, n_r = self._ranges(length)
        n_mid = mid_end - n_s
        host_k, host_v = self.store.k, self.store.v
        dev = q.device
        if self._in_c(q):
            self._fetch_in_c(q, length, cosine=False)
            return
        self._c_only()
        if n_mid <= 0:
            picked = None
        elif n_mid <= p.topk:
            picked = torch.arange(n_s, mid_end, device=dev).expand(*q.shape[:1], host_k.shape[1], -1)
        else:
            if self.k_ch is None:  # no prefetch ran for this step (no prefetch op, an adopted cache)
                self._prefetch(q, length)
                self._wait(dev)
            idx, _ = partial_topk(q, self.k_ch, self.ch, p.topk, n_mid)
            self.ch = self.k_ch = None  # this step's: the next one prefetches (or, with no prefetch op, here)
            picked = idx + n_s  # k < n_mid: never -1
        if picked is not None:
            # the gathered rows are fresh pageable memory: the copy is synchronous on a GPU, so say so
            # (non_blocking=True from unpinned memory promised an overlap it did not have; the simulated
            # device flags it). A pinned staging ring would make it asynchronous.
            self.sel_k = take_rows(host_k, picked).to(dev)  # (B, H_kv, k, D)
            self.sel_v = take_rows(host_v, picked).to(dev)
            self.bytes_moved += self.sel_k.numel() * self.sel_k.element_size() + self.sel_v.numel() * self.sel_v.element_size()
        self.plan = (n_s, picked, n_r)

    def _fetch_in_c(self, q: torch.Tensor, length: int, cosine: bool, defer: bool = False) -> None:
        """The CPU path's fetch, one C call: the critical channels from the estimate ``q̂`` (the true query
        where no estimate came: the first layer, an adopted cache), the top-k by them, the list of positions
        this step attends; with ``cosine``, ``cos(q̂, q)`` added to ``cos_c``. ``q (B, H_q, [1,] D)``.
        ``defer``: the call is left to the attention (``pending``), which makes it with its own."""
        p = self.policy
        n_s, mid_end, n_r = self._ranges(length)
        n, c = mid_end - n_s, min(p.critical_channels, self.kT.shape[2])
        q_c = self.q_hat if self.q_hat is not None else q
        cos = self.cos_c if cosine and self.q_hat is not None else None
        if defer:
            self.listed, self.pending = None, (q, n_s, mid_end, p.topk, n_r, q_c, c, cos)
        else:
            self.listed = self._cpu_step().select(q, n_s, mid_end, p.topk, n_r, q_c=q_c, cos=cos, n_channels=c)
        b, h, d = self.kT.shape[:3]
        if cos is not None:
            self.cos_n += 1
        if n > p.topk:  # what a GPU's prefetch copies: the critical channels of every row's own candidates
            self.channel_bytes = h * c * (b * n - self.first_sum) * self.kT.element_size()
            self.bytes_moved += self.channel_bytes
            self.prefetched += self.channel_bytes
        kk = min(p.topk, max(n, 0))
        self.bytes_moved += 2 * b * h * kk * d * self.store.k.element_size()  # the fetched rows
        self.plan = (n_s, kk, n_r)

    def _cpu_step(self):
        """The C step over this layer's current buffers (a new one where a buffer was replaced)."""
        st, c = self.store, self.cpu_step
        if c is None or not c.holds(st.k, st.v, self.kT, self.kabs, self.first):
            c = self.cpu_step = CpuStep(st.k, st.v, self.kT, self.kabs, self.first)
        return c

    def _c_only(self) -> None:
        """The torch path has no per-row offsets: a padded batch served in place must stay on the C path."""
        if self.first is not None:
            raise KVPassError("kvpass: TailorKV serves this padded batch in place on the CPU path, and this step's "
                              "queries left it (not fp32 with a contiguous last dim); decode in fp32, or start "
                              "the batch again to serve it row by row")

    def _set_first(self, first: torch.Tensor | None, batch: int) -> None:
        """The rows' first real positions ``(B,)`` of a padded batch served in place (None: no padding)."""
        self.first = None if first is None else first.expand(batch).to(torch.int64).contiguous()
        self.first_sum = 0 if first is None else int(self.first.sum())

    # -- attention -------------------------------------------------------------------------------
    def start(self, call, k_new, v_new, t0: float) -> torch.Tensor:
        q, k_all, v_all, length, t = call.q, call.k, call.v, call.length, call.new_tokens
        past, dev = call.past, q.device
        # padding is served here only where serves_padded said so (in_place); row states see none
        self.pad.valid(call.attn_mask if self.in_place else None, length, True)
        self._set_first(self.pad.first if self.pad.padded else None, q.shape[0])
        self._decide(q, k_all, call.scale)
        # the prefill attends the keys where the query is (a sparse layer's store is on the host)
        if self.tier == SPARSE:
            self.store.append(None, None, k_all, v_all)
            k_all, v_all = self.store.views()
        if t > 1:
            out = call.exact()  # prefill attends exactly
            self._load(k_all, v_all, dev)
            self.overhead_prefill_s += time.perf_counter() - t0
            self.prefill_calls += 1
            self.attended = length
            self._account()
            return out
        # an adopted decode step: load everything before this token, then decode as usual
        self._load(k_all[:, :, :past], v_all[:, :, :past], dev)
        if self.tier == SPARSE:
            self.store.length = past  # the decode path appends this step's token itself
            self._fetch(q[:, :, 0], length)  # no fetch op ran for this step: fetch here
        self.overhead_prefill_s += time.perf_counter() - t0
        return self._decode(q, k_new, v_new, call.attn_mask, call.scale, call.is_causal)

    def decode(self, q, k_new, v_new, attn_mask, scale, is_causal) -> torch.Tensor:
        if self.info.fetch_in_attention and self.plan is None:
            self._fetch_step(q, self.logical, attend=True)  # this graph has no kvpass::fetch (CPU): the fetch runs here
        return self._decode(q, k_new, v_new, attn_mask, scale, is_causal)

    def held_rows(self) -> int:
        return self.store.k.shape[0] if self.tier == SPARSE else self.packed.b

    def fork_refusal(self, past: int) -> str:
        return (f"kvpass: TailorKV cannot roll back or fork its cache (the model's cache says {past} tokens, "
                f"this site holds {self.logical}); assisted decoding and cache crops need a policy that keeps "
                f"every token in full precision")

    def reorder_cache(self, rows: torch.Tensor, q: torch.Tensor, length: int) -> None:
        """Beam search reordered (or expanded) the batch between steps: row i of every per-row tensor
        becomes row ``rows[i]`` (the host tier's on the host). The prefetch and fetch of this step ran
        before the attention saw the new order, for the old rows: their selection is made again (the
        channels from the same estimate ``q̂``, the top-k from the true query)."""
        t0 = time.perf_counter()
        self.events += 1
        if self.tier == QUANTISED:
            self.packed.reorder(rows)
            self.res_k, self.res_v = batch_rows(self.res_k, rows), batch_rows(self.res_v, rows)
        else:
            b, st = self.store.k.shape[0], self.store
            st.k, st.v = batch_rows(st.k, rows), batch_rows(st.v, rows)
            self.kT = batch_rows(self.kT, rows)
            for name in ("sink_k", "sink_v", "rec_k", "rec_v", "kabs"):
                setattr(self, name, batch_rows(getattr(self, name), rows))
            if self.first is not None:
                self.reorder_rows(rows)  # the padding's rows (pad.first) follow
                self._set_first(self.first.index_select(0, rows), rows.shape[0])
            # the fetch ran (or skipped a resized batch): select again; without it _decode says it is missing
            redo = q.shape[2] == 1 and (self.plan is not None or q.shape[0] != b)
            self._wait(q.device)
            self.ch = self.k_ch = self.plan = self.sel_k = self.sel_v = self.listed = self.pending = None
            if redo and self._in_c(q):
                self._fetch_in_c(q, length, cosine=False)
            elif redo:
                self._prefetch((self.q_hat if self.q_hat is not None else q)[:, :, 0], length)
                self._wait(q.device)
                self._fetch(q[:, :, 0], length)
        self.overhead_decode_s += time.perf_counter() - t0

    def _account(self) -> None:
        if self.tier == QUANTISED:
            self.physical = self.logical
            self.kv_bytes = self.packed.nbytes() + 2 * self.res_k.numel() * self.res_k.element_size()
        elif self.in_c:
            # the device tier a GPU holds: sinks, recent and fetched tokens, max |K| (read in place here)
            self.physical = self.store.length
            st, (n_s, mid_end, n_r) = self.store, self._ranges(self.logical)
            kk = min(self.policy.topk, max(mid_end - n_s, 0)) if self.steps else 0
            row = 2 * st.k.shape[0] * st.k.shape[1] * st.k.shape[3] * st.k.element_size()
            self.kv_bytes = row * (n_s + n_r + kk) + self.kabs.numel() * self.kabs.element_size()
        else:
            self.physical = self.store.length
            ts = (self.sink_k, self.sink_v, self.rec_k, self.rec_v, self.kabs, self.sel_k, self.sel_v)
            self.kv_bytes = sum(x.numel() * x.element_size() for x in ts if x is not None)
        self.length = self.logical

    def _decode(self, q, k_new, v_new, attn_mask, scale, is_causal) -> torch.Tensor:
        self.decode_calls += 1
        self.steps += 1
        self.logical += 1
        if self.tier == QUANTISED:
            out = self._decode_quantised(q, k_new, v_new, scale)
        elif self.in_c:
            out = self._decode_in_c(q, k_new, v_new, attn_mask, scale, is_causal)
        else:
            self._host_append(k_new, v_new)
            self.kabs = torch.maximum(self.kabs, k_new[:, :, 0].abs().float())
            n_r = self.policy.static_tokens - self.policy.sinks
            keep = n_r - 1 if self.rec_k.shape[2] >= n_r else self.rec_k.shape[2]
            self.rec_k = torch.cat([self.rec_k[:, :, self.rec_k.shape[2] - keep :], k_new], 2)
            self.rec_v = torch.cat([self.rec_v[:, :, self.rec_v.shape[2] - keep :], v_new], 2)
            if self.plan is None:
                raise KVPassError("kvpass: TailorKV decoded a sparse layer without its kvpass::fetch (the graph "
                                  "was not rewritten for TailorKV: compile with a kvpass(TailorKV(...)) backend)")
            hk, hv = self.store.views()
            call = make_call(q, hk, hv, attn_mask, scale, is_causal, self.logical, self.logical - 1)
            idx = self._selection(call)
            self.last_idx = idx
            if self.probe is not None:
                self.probe(self, call, idx)
            with profile_range("kvpass.attend"):
                out = self._attend_sparse(q, scale)
            self.attended = -1
        self._account()
        return out

    def _decode_in_c(self, q, k_new, v_new, attn_mask, scale, is_causal) -> torch.Tensor:
        """A sparse layer's step on CPU: the listed rows of the host tier, read in place. A selection the
        fetch left to it (``pending``) runs here, with the append and the attention in the same C call
        where that call serves the operands (in that order, as in three calls)."""
        pend, self.pending = self.pending, None
        if self.plan is None or (self.listed is None and pend is None):
            raise KVPassError("kvpass: TailorKV decoded a sparse layer without its kvpass::fetch (the graph "
                              "was not rewritten for TailorKV: compile with a kvpass(TailorKV(...)) backend)")
        st = self.store
        if pend is not None:
            with profile_range("kvpass.bookkeeping"):
                end = self._host_room(k_new, v_new)
            t0 = time.perf_counter()
            with profile_range("kvpass.select"):  # the attention too, in the same call
                sq, n_s, mid_end, topk, n_r, q_c, c, cos = pend
                step = self._cpu_step()
                done = None if sq is not q else step.select_append_attend(
                    q, n_s, mid_end, topk, n_r, q_c, c, cos, k_new, v_new, st.length, scale)
                if done is None:  # the selection first, as the fused call makes it
                    self.listed = step.select(sq, n_s, mid_end, topk, n_r, q_c=q_c, cos=cos, n_channels=c)
            self.overhead_decode_s += time.perf_counter() - t0
            if done is not None:
                st.length = end
                idx, out = done
                self.plan, self.last_idx, self.attended = None, idx, -1
                if self.probe is not None:
                    hk, hv = st.views()
                    self.probe(self, make_call(q, hk, hv, attn_mask, scale, is_causal, self.logical,
                                                self.logical - 1), idx)
                return out
        with profile_range("kvpass.bookkeeping"):
            self._host_append(k_new, v_new, kabs=True)
        idx, self.plan = self.listed, None
        self.last_idx = idx
        if self.probe is not None:
            hk, hv = self.store.views()
            self.probe(self, make_call(q, hk, hv, attn_mask, scale, is_causal, self.logical, self.logical - 1), idx)
        self.attended = -1
        st = self.store
        with profile_range("kvpass.attend"):
            out = cpu_decode.decode_step(q, st.k, st.v, st.k.shape[2], idx, scale)
            if out is None:  # in_c was decided at the prefill: the queries are fp32 CPU, as the keys are
                raise KVPassError("kvpass: TailorKV's CPU path met operands its decode attention does not serve "
                                  f"(q {tuple(q.shape)} {q.dtype}, keys {tuple(st.k.shape)} {st.k.dtype})")
            return out

    def _host_append(self, k_new, v_new, kabs: bool = False) -> None:
        """The new tokens into the host tier and the channel-major keys; with ``kabs``, also the running
        max of |k| (fp32 here: the in-C path). One C call where the operands allow (a decode step's five
        ops otherwise)."""
        st = self.store
        end = self._host_room(k_new, v_new)
        if not (kabs and self._cpu_step().append(k_new, v_new, st.length)):
            st.k[:, :, st.length : end] = k_new
            st.v[:, :, st.length : end] = v_new
            self.kT[:, :, :, st.length : end] = k_new.transpose(2, 3)
            if kabs:
                torch.maximum(self.kabs, k_new.abs().amax(2), out=self.kabs)
        st.length = end

    def _host_room(self, k_new, v_new) -> int:
        """Room in the host tier and the channel-major keys for the new tokens (a capacity growth, an
        event); returns the length after them."""
        st = self.store
        end = st.length + k_new.shape[2]
        st._reserve(k_new, v_new, end)
        if self.kT.shape[3] < end:
            kT = host_empty((*self.kT.shape[:3], st.k.shape[2]), self.kT.dtype)
            kT[..., : st.length] = self.kT[..., : st.length]
            kT[..., st.length :].zero_()
            self.kT = kT
        return end

    def _selection(self, call) -> torch.Tensor:
        """(B, H_kv, N) positions attended at this step (for reports and the recall probe)."""
        n_s, picked, n_r = self.plan
        return sinks_picked_recent(*call.k.shape[:2], n_s, picked, n_r, call.length, call.k.device)

    def _attend_sparse(self, q, scale) -> torch.Tensor:
        ks, vs = [self.sink_k], [self.sink_v]
        if self.plan[1] is not None:
            ks.append(self.sel_k)
            vs.append(self.sel_v)
        k = torch.cat(ks + [self.rec_k], 2)
        v = torch.cat(vs + [self.rec_v], 2)
        self.plan = None
        return sparse_attention(q[:, :, 0], k, v, None, None, scale).unsqueeze(2)

    def _decode_quantised(self, q, k_new, v_new, scale) -> torch.Tensor:
        r = self.policy.residual
        self.res_k[:, :, self.n_res : self.n_res + 1] = k_new
        self.res_v[:, :, self.n_res : self.n_res + 1] = v_new
        self.n_res += 1
        kq, vq = self.packed.views()
        with profile_range("kvpass.attend"):
            out = quant_attention(q[:, :, 0], kq, vq, self.res_k[:, :, : self.n_res], self.res_v[:, :, : self.n_res],
                                  scale)
        self.attended = self.logical
        self.last_idx = None
        if self.n_res == r:
            self.events += 1
            t0 = time.perf_counter()
            # decoded keys are checked here, once per residual chunk, not at each step (a host sync per
            # layer per step); a NaN would become the scale of its whole channel group
            self.check_keys(self.res_k, "when quantising", first=self.logical - r)
            self.packed.append(self.res_k, self.res_v, r)
            self.n_res = 0
            self.overhead_decode_s += time.perf_counter() - t0
        return out.unsqueeze(2)

    def extend(self, q, k_new, v_new, attn_mask, scale, is_causal) -> torch.Tensor:
        """Several new tokens on a running sequence (a second chat turn): exact attention over what the
        layer holds (dequantised for a quantised layer), then the tokens join the cache."""
        t = k_new.shape[2]
        self.prefill_calls += 1
        if self.tier == SPARSE:
            self._host_append(k_new, v_new)
            hk, hv = self.store.views()
            out = make_call(q, hk, hv, attn_mask, scale, is_causal, hk.shape[2]).exact()
            self.logical = hk.shape[2]
            self._load(hk, hv, q.device)
            self._account()
            return out
        kq, vq = self.packed.views()
        k = torch.cat([dequantize(kq, q.dtype), self.res_k[:, :, : self.n_res], k_new], 2)
        v = torch.cat([dequantize(vq, q.dtype), self.res_v[:, :, : self.n_res], v_new], 2)
        out = make_call(q, k, v, attn_mask, scale, is_causal, k.shape[2]).exact()
        # the residual and the new tokens: whole chunks are quantised, the rest stays full precision
        r = self.policy.residual
        fk = torch.cat([self.res_k[:, :, : self.n_res], k_new], 2)
        fv = torch.cat([self.res_v[:, :, : self.n_res], v_new], 2)
        n_q = fk.shape[2] // r * r
        self.packed.append(fk[:, :, :n_q], fv[:, :, :n_q], r)
        self.n_res = fk.shape[2] - n_q
        self.res_k[:, :, : self.n_res] = fk[:, :, n_q:]
        self.res_v[:, :, : self.n_res] = fv[:, :, n_q:]
        self.logical += t
        self._account()
        return out

    # -- reports ---------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        if self.tier != SPARSE:
            return 0
        return self.store.nbytes() + (self.kT.numel() * self.kT.element_size() if self.kT is not None else 0)

    def selection_bytes(self) -> int:
        return self.channel_bytes if self.tier == SPARSE else 0

    def metadata_bytes(self) -> int:
        if self.tier != SPARSE:
            return 0
        if self.in_c:
            # the channels a GPU's double buffer holds for this layer (read in place here)
            layers = self.shared.get("tailorkv.sparse_layers", {self.info.layer})
            return self.channel_bytes // max(1, sum(1 for i in layers if i % 2 == self.info.layer % 2))
        bufs = self.shared.get("tailorkv.channel_buffers") or [None, None]
        buf = bufs[self.info.layer % 2]
        if buf is None:
            return 0
        # the double buffer is shared by the sparse layers of one parity: each carries its share
        layers = self.shared.get("tailorkv.sparse_layers", {self.info.layer})
        n = max(1, sum(1 for i in layers if i % 2 == self.info.layer % 2))
        return buf.numel() * buf.element_size() // n

    def estimate_cosine(self) -> float:
        """Mean cosine similarity of the estimated query to the true one (NaN: no estimate)."""
        total = float(self.cos_c) + (float(self.cos_sum) if self.cos_sum is not None else 0.0)
        return total / self.cos_n if self.cos_n else float("nan")

    def row(self):
        r = super().row()
        r["tier"] = self.tier or "-"
        r["P"] = self.score if self.score is not None else float("nan")
        r["estimate"] = self.info.estimate
        r["estimate_cos"] = self.estimate_cosine()
        if self.tier == QUANTISED and self.packed is not None:
            fp16 = 2 * self.packed.n * (self.packed.d + self.packed.dv) * self.packed.b * self.packed.h
            r["quant_ratio"] = self.packed.live_bytes() / fp16 if fp16 else float("nan")
        return r

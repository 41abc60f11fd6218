"""The runtime-owned KV store of a site whose cache grows by ``cat`` (DynamicCache).

The graph pass hands the model's cache a *stub* instead of the concatenated keys: a tensor of the
right logical shape ``(B, H_kv, L, D)`` whose sequence stride is 0, so it holds one row per batch
entry and head, not L. Positions, masks and ``get_seq_length`` see the true length (invariant 3)
while the real keys and values live here, appended in place (no per-step copy of the whole cache).

Each stub row carries its batch row's index, so that a reordering done by the caller between steps
(beam search's ``reorder_cache``) is seen and applied to the store, and a crop (assisted decoding)
shows up as a shorter stub.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys

import torch

from kvpass.runtime.errors import KVPassError


_HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 Linux
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's ``madvise`` (Linux), else None; a handle on the C library, no state."""
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def cpu_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, 2 MiB-aligned and advised for transparent huge pages
    when it holds at least 2 MiB (Linux with THP in ``madvise`` or ``always`` mode; elsewhere a plain
    ``torch.empty``). A decode step that reads 1024 rows scattered over an 8k-token cache touches a 4 KiB
    page for nearly every row, and the TLB misses halve the rows' read rate; huge pages give it back
    (docs/design.md, "Huge pages for the caches"). The pages are faulted in when first written, so the
    advice holds before any is."""
    n = math.prod(shape) * dtype.itemsize
    madvise = _madvise() if n >= _HUGE else None
    if madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(n + _HUGE, dtype=torch.uint8)
    off = -raw.data_ptr() % _HUGE
    madvise(raw.data_ptr() + off, n // _HUGE * _HUGE, _MADV_HUGEPAGE)  # advice: a refusal changes nothing
    return raw[off : off + n].view(dtype).view(shape)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host-tier buffer: pinned where a GPU copies from it (the side stream's copies stay asynchronous),
    else on the CPU in huge pages (``cpu_empty``)."""
    if torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return cpu_empty(shape, dtype)


def make_stub(k: torch.Tensor, length: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, length, D) with sequence stride 0; row b holds the value b (the batch row's index).

    ``base``: a ``(B, H, D)`` tensor of row indices to view (a site's persistent base, so that the site
    knows its own stub by its storage); None makes a fresh one."""
    b, h, _, d = k.shape
    if base is None:
        base = _row_base(b, h, d, k.dtype, k.device)
    return base.as_strided((b, h, length, d), (h * d, d, 0, 1))


def _row_base(b: int, h: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.arange(b, device=device, dtype=dtype).view(b, 1, 1).expand(b, h, d).contiguous()


# what StubRows.rows returns for the site's own stub, unchanged: rows 0..B-1 in order
SAME = "same"

# Tensor methods that read no data: a stub answers them as the tensor it stands for.
_STUB_META = frozenset({
    torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.storage_offset,
    torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.__len__,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.nelement, torch.Tensor.get_device,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__hash__, torch.Tensor._is_view,
})
# Ops that move or select rows without computing with keys: what a caller does to a cache between
# steps (beam search's index_select, a crop, a batch expansion, a device move). The result is still
# a stub, so the next op that computes with it is refused.
_STUB_MOVES = frozenset({
    torch.Tensor.index_select, torch.Tensor.__getitem__, torch.Tensor.repeat_interleave,
    torch.Tensor.narrow, torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.to, torch.Tensor.cpu,
    torch.Tensor.cuda, torch.Tensor.detach, torch.Tensor.__deepcopy__, torch.index_select,
    torch.repeat_interleave, torch.narrow,
})


class CacheStub(torch.Tensor):
    """What the model's cache holds for a runtime-owned site, outside the compiled graph.

    The keys and values live in the runtime; the stub (zero sequence stride) only carries the shape.
    Inside a kvpass graph that is all the graph needs. An eager frame (dynamo fell back after a
    recompile limit, ``torch._dynamo.disable``, a graph break inside attention) would compute with
    it as if it were the keys: every such op raises a :class:`KVPassError` instead (invariant 9).
    Metadata reads and row moves between steps (beam search, crops) are served; ``kvpass::`` ops get
    the plain tensor. ``_kvpass_tag``: ``(site, state, epoch)`` of the sequence the stub belongs to,
    set by the backend when a compiled graph returns it."""

    _kvpass_tag: tuple | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling() or func in _STUB_META or _is_getter(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "kvpass":
            args, kwargs = torch.utils._pytree.tree_map_only(CacheStub, plain, (args, kwargs))
            return func(*args, **kwargs)
        if func in _STUB_MOVES:
            # isinstance: a device's subclass of the stub (kvpass.simcuda) carries the tag too; a moved
            # stub without it would hold nothing, and the sequence is released when the old stubs die
            tag = next((a._kvpass_tag for a in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(a, CacheStub)), None)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: as_cache_stub(t, tag), out)
        raise KVPassError(eager_read_message(func, args, kwargs))

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"CacheStub(shape={tuple(self.shape)}, dtype={self.dtype}: keys held by kvpass)"


def _is_getter(func) -> bool:
    # property reads (t.shape, t.dtype, t.device, ...) reach __torch_function__ as their __get__
    return getattr(func, "__name__", None) == "__get__"


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (the same storage and strides; a stub loses its refusals)."""
    if type(t) is CacheStub:
        with torch._C.DisableTorchFunctionSubclass():
            return t.as_subclass(torch.Tensor)
    return t


def as_cache_stub(t: torch.Tensor, tag: tuple | None, hold: bool = True) -> CacheStub:
    """``t`` as a stub of the sequence ``tag`` names. A site's sequence lives while one of its stubs does
    (:meth:`kvpass.runtime.state.SiteState.hold`): ``hold=False`` only for a stub that lives and dies
    with another one that is counted (a step's value stub beside its key stub)."""
    with torch._C.DisableTorchFunctionSubclass():
        out = t.as_subclass(CacheStub)
    out.__dict__.update(t.__dict__)  # what was set on the tensor (dynamo's dynamic-dimension marks)
    out._kvpass_tag = tag
    if hold and tag is not None and type(tag[0]) is int:  # (site, state, epoch); adopted: no site
        tag[1].hold(out, tag[2])
    return out


def eager_read_message(func, args, kwargs) -> str:
    import torch._dynamo

    tag = next((a._kvpass_tag for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, CacheStub) and a._kvpass_tag is not None), None)
    where = ""
    if tag is not None and tag[0] == "adopted":  # kvpass.runtime.adopt
        where = f" of layer {tag[2]} (handed to backend.adopt())"
    elif tag is not None:
        info = tag[1].info
        where = f" of layer {info.layer} ({info.module_path})"
    name = getattr(func, "__name__", str(func))
    limit = torch._dynamo.config.recompile_limit
    return (
        f"kvpass: {name}() read the KV cache{where} outside the compiled graph. kvpass keeps this "
        "cache's keys and values in its runtime and the model's cache holds a stub, so an eager step "
        "would attend garbage. Dynamo ran this step without the kvpass graph: its recompile limit was "
        f"hit (torch._dynamo.config.recompile_limit = {limit}; it counts the graphs of every model and "
        "backend compiled in this process; a generate needs 2 or 3 graphs), torch._dynamo.disable or "
        "a graph break covers attention, or a compiled model's cache was passed to an uncompiled one. Fix: "
        "raise torch._dynamo.config.recompile_limit, compile each model with backend.compile(model) (or "
        "torch.compile(..., isolate_recompiles=True)), call torch._dynamo.reset() between unrelated models, "
        "keep the cache with the model that made it, or pass own_cache=False to kvpass() (the model's cache then keeps real keys)"
    )


class StubRows:
    """The stubs one site hands the model's cache, viewed from two persistent bases per shape.

    A steady decode step must tell its own stub, unchanged, from a reordered one (beam search), a
    crop or a real cache without reading it: every tensor op on it would be a host sync per layer per
    step. A stub is ours and in order when its storage is one of the bases and its strides are the
    stub's; anything else goes through :func:`stub_rows`, which reads the tensor (a scheduled event:
    a reorder, an adoption). Two bases, because a custom op's output may not alias its input: each
    step's stub views the base that the previous step's stub (the op's ``past``) does not."""

    def __init__(self) -> None:
        self.bases: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.new_bases: list[torch.Tensor] = []  # made since the owner last read them (Runtime.stub)

    def make(self, new: torch.Tensor, length: int, past: torch.Tensor | None = None) -> torch.Tensor:
        b, h, _, d = new.shape
        key = (b, h, d, new.dtype, new.device)
        pair = self.bases.get(key)
        if pair is None:
            pair = self.bases[key] = (_row_base(b, h, d, new.dtype, new.device),
                                      _row_base(b, h, d, new.dtype, new.device))
            self.new_bases.extend(pair)
            if len(self.bases) > 4:  # a few shapes (k, v; a batch size change): drop the oldest
                self.bases.pop(next(iter(self.bases)))
        taken = past is not None and past.untyped_storage().data_ptr() == pair[0].untyped_storage().data_ptr()
        return make_stub(new, length, pair[1] if taken else pair[0])

    def is_own(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this site's stub, in order (metadata only: no read)."""
        if t.dim() == 4 and t.shape[2] > 0 and t.stride(2) == 0 and t.storage_offset() == 0:
            b, h, _, d = t.shape
            pair = self.bases.get((b, h, d, t.dtype, t.device))
            if pair is not None and t.stride() == (h * d, d, 0, 1):
                ptr = t.untyped_storage().data_ptr()
                return ptr in (pair[0].untyped_storage().data_ptr(), pair[1].untyped_storage().data_ptr())
        return False

    def rows(self, t: torch.Tensor) -> torch.Tensor | str | None:
        """:data:`SAME` for this site's stub in order, else :func:`stub_rows` of ``t``."""
        return SAME if self.is_own(t) else stub_rows(t)


def stub_rows(t: torch.Tensor) -> torch.Tensor | None:
    """The batch-row indices a stub carries, or None when ``t`` holds real keys.

    A stub that the caller reordered (``index_select`` over the batch, as beam search does) comes
    back materialised, so a dense tensor that is constant per batch row and integral is a stub too;
    real keys are never exactly constant over all positions and channels. Reads ``t`` (host syncs):
    the steady decode step recognises its own stub by :class:`StubRows` instead."""
    if t.dim() != 4 or t.shape[2] == 0:
        return None
    rows = t[:, 0, 0, 0]
    if t.stride(2) != 0:
        if not bool((t == rows.view(-1, 1, 1, 1)).all()):
            return None
    if not bool((rows == rows.round()).all()) or bool((rows < 0).any()):
        return None
    return rows.round().long()


def grow_seq(
    buf: torch.Tensor | None,
    need: int,
    *,
    live: int | None = None,
    slack: int = 0,
    factor: float = 1.0,
    fill: float = 0,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """A buffer with room for ``need`` slots along dim 2 (the sequence axis of every runtime buffer).

    ``buf`` itself when it has room; otherwise a new tensor of ``max(need + slack, factor · capacity)``
    slots, its first ``live`` slots (default: all of ``buf``) copied and the rest ``fill``. With ``buf``
    None, a new buffer shaped like ``like`` along the other dims."""
    if buf is not None and buf.shape[2] >= need:
        return buf
    ref = buf if buf is not None else like
    cap = max(need + slack, int(factor * buf.shape[2]) if buf is not None else 0)
    out = ref.new_full((*ref.shape[:2], cap, *ref.shape[3:]), fill)
    if buf is not None:
        n = buf.shape[2] if live is None else live
        if n:
            out[:, :, :n] = buf[:, :, :n]
    return out


def reorder_needed(rows: torch.Tensor, batch: int) -> bool:
    """True when stub ``rows`` are not 0..``batch``-1 in order; raises when they name no row of ours."""
    if rows.shape[0] == batch and (batch == 1 and int(rows[0]) == 0 or torch.equal(
            rows, torch.arange(batch, device=rows.device))):
        return False
    if int(rows.min()) < 0 or int(rows.max()) >= batch:
        raise KVPassError("kvpass: the cache rows were changed in a way kvpass cannot follow")
    return True


class OwnedKV:
    """Keys and values of one site, (B, H_kv, capacity, D) each, the first ``length`` slots valid."""

    GROWTH = 1.5
    SLACK = 256  # slots beyond the prefill, so that decoding does not regrow at once

    def __init__(self, host: bool = False) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.reordered: torch.Tensor | None = None  # rows of the last append's reorder (the owner's metadata follows)
        # host=True: the buffers live in CPU memory (pinned when CUDA is present) whatever device the
        # model runs on: the host tier of an offloading policy
        self.host = host

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def clear(self) -> None:
        self.k = self.v = None
        self.length = 0

    def _reserve(self, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        if self.k is not None and self.k.shape[2] >= need and self.k.shape[:2] == like_k.shape[:2]:
            return
        if self.k is None or self.length == 0:
            cap = need + self.SLACK  # a new sequence: room for decoding, no growth factor
        else:
            cap = max(need, int(self.k.shape[2] * self.GROWTH))
        b, h, _, dk = like_k.shape
        cap = -(-cap // 64) * 64  # whole pages for page-granular policies (page sizes dividing 64)
        if self.host:
            k = host_empty((b, h, cap, dk), like_k.dtype)
            v = host_empty((b, h, cap, like_v.shape[3]), like_v.dtype)
        elif like_k.device.type == "cpu":
            k = cpu_empty((b, h, cap, dk), like_k.dtype)
            v = cpu_empty((b, h, cap, like_v.shape[3]), like_v.dtype)
        else:
            k = like_k.new_empty((b, h, cap, dk))
            v = like_v.new_empty((b, h, cap, like_v.shape[3]))
        # the caller writes slots [0, need) next (the old ones are copied here); the rest is zeroed, not
        # left empty: page-granular gathers read the unwritten tail of the last page (masked, but 0 * NaN
        # would still be NaN). Zeroing only the tail touches each page of a large adopted cache once.
        k[:, :, need:].zero_()
        v[:, :, need:].zero_()
        if self.k is not None and self.length and self.k.shape[:2] == like_k.shape[:2]:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        elif self.length:  # old slots not carried over (other rows or heads): zeros, as before, not garbage
            k[:, :, : self.length].zero_()
            v[:, :, : self.length].zero_()
        self.k, self.v = k, v

    def append(
        self,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        stubs: StubRows | None = None,
    ) -> bool:
        """Bring the store in line with the model's cache ``past`` and append the new tokens.

        ``stubs``: the site's :class:`StubRows`, which knows its own stub without reading it (no host
        sync in a steady decode step). Returns True when the sequence was (re)started here, so that
        metadata must be rebuilt from position 0: a prefill, a crop, or a cache that was filled outside
        kvpass."""
        rebuilt = False
        if past_k is None or past_k.shape[2] == 0:
            self.length = 0
            rebuilt = True
        elif (rows := stubs.rows(past_k) if stubs is not None else stub_rows(past_k)) is None:
            # a real cache filled elsewhere (eager prefill, a cache passed in by hand): adopt it
            self.length = 0
            self._reserve(past_k, past_v, past_k.shape[2] + k_new.shape[2])
            self.k[:, :, : past_k.shape[2]] = past_k
            self.v[:, :, : past_v.shape[2]] = past_v
            self.length = past_k.shape[2]
            rebuilt = True
        else:
            past = past_k.shape[2]
            if self.k is None or past > self.length:
                raise KVPassError(
                    f"kvpass: the model's cache says {past} tokens but this backend holds {self.length}; "
                    "a cache produced by another backend or model cannot be continued here"
                )
            if rows is not SAME and self.reorder_needed(rows):
                self.k = self.k.index_select(0, rows)
                self.v = self.v.index_select(0, rows)
                self.reordered = rows
            if past < self.length:  # cropped (assisted decoding rolled back)
                self.length = past
                rebuilt = True
        end = self.length + k_new.shape[2]
        self._reserve(k_new, v_new, end)
        self.k[:, :, self.length : end] = k_new
        self.v[:, :, self.length : end] = v_new
        self.length = end
        return rebuilt

    def reorder_needed(self, rows: torch.Tensor) -> bool:
        """Whether stub ``rows`` (read from a stub the caller changed) differ from 0..B-1: beam search
        reordered or expanded the batch between steps (host syncs: not a steady step)."""
        return reorder_needed(rows, self.k.shape[0])

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

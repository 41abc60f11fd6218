"""Per-site runtime state and the generic attention driver.

Shapes: ``q (B, H_q, T, D)``; ``k, v (B, H_kv, S, D)`` as the model's cache holds them (before any
repeat_kv); ``T`` new tokens; ``L`` the logical sequence length (``S`` can be larger for a static
cache, and a compressing state may hold fewer physical tokens than ``L``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from kvpass.runtime import registry

if TYPE_CHECKING:
    from kvpass.policies.base import Policy

# how check_keys names the keys of a cache that a decode step adopts
ADOPTED = "of a cache filled outside kvpass (adopted at this decode step)"


def _range(name: str):
    """A profiler range (``kvpass bench --decode-cost`` sorts a step's time by them); nothing at all
    unless a profiler runs (a range is an op call: 180 of them a step at 30 sites)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class Workspace:
    """Scratch tensors a decode step reuses instead of allocating (the gathered keys and values of a
    selection): on CPU a fresh tensor of a few MB pays its page faults at every step, which at batch 8
    cost more than the gather itself (docs/design.md, "Decode attention on CPU"). One workspace serves
    every site of a Runtime, which run one after another; what it holds is a step's scratch, never
    state: nothing a step returns aliases it."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class KVPassError(RuntimeError):
    """A request kvpass cannot serve correctly; the message names the fix."""


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
    from kvpass.kernels import cpu_decode

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


class Padding:
    """Whether a site's sequence is a left-padded batch, decided where the sequence starts or grows by
    several tokens (prefill, chunked prefill, an adopted cache), where a host sync is paid anyway.

    A decode step appends one real token per row (``generate()`` extends the attention mask with ones,
    also for rows that finished), so its padding is the prefill's: a steady step reads the mask only
    when the batch is padded, and never syncs. ``first (B,)`` is each row's first real position and
    ``first_min`` / ``first_max`` their extremes as Python ints (0 without padding)."""

    def __init__(self) -> None:
        self.padded: bool | None = None  # None: no sequence seen yet
        self.first: torch.Tensor | None = None
        self.first_min = self.first_max = 0

    def valid(self, attn_mask: torch.Tensor | None, length: int, event: bool) -> torch.Tensor | None:
        """(B, L) bool validity (None: no padding). ``event``: a prefill, a multi-token step or an
        adoption, where the mask is read in full."""
        if attn_mask is None:
            if event:
                self._set(None)
            return None
        if event or self.padded is None:
            valid = valid_from_mask(attn_mask, length)
            self._set(valid)
            return valid
        return mask_row(attn_mask, length) if self.padded else None

    def _set(self, valid: torch.Tensor | None) -> None:
        self.padded = valid is not None
        if valid is None:
            self.first, self.first_min, self.first_max = None, 0, 0
        else:
            self.first = valid.to(torch.int8).argmax(dim=1)  # first real token of each row
            self.first_min, self.first_max = int(self.first.min()), int(self.first.max())


def non_finite_keys_message(policy_name: str, info: SiteInfo, keys: torch.Tensor, when: str, first: int = 0,
                            unit: str | None = "position") -> str | None:
    """None when ``keys (B, H_kv, n, D)`` are all finite; otherwise the KVPassError message: the site,
    what was found (NaN or Inf) and where, and the fix. ``first`` is the position of ``keys[:, :, 0]``."""
    if keys.numel() == 0 or bool(torch.isfinite(keys).all()):
        return None
    nan = keys.isnan()
    found = "NaN" if bool(nan.any()) else "Inf"
    bad = (nan if found == "NaN" else keys.isinf()).any(-1).nonzero()[0].tolist()  # (b, h, i): the first
    path = info.module_path if info.module_path != "?" else f"site {info.site}"
    at = f" (batch row {bad[0]}, KV head {bad[1]}, {unit} {first + bad[2]})" if unit else ""
    return (
        f"kvpass: {policy_name} found {found} in the keys of layer {info.layer} ({path}) {when}{at}; it "
        "cannot select or compress non-finite keys. The model's activations overflowed or its inputs are "
        "bad: run the model in fp32 or bf16 rather than fp16 and check the inputs, or use Full(), which "
        "attends exactly like eager (NaN in, NaN out)"
    )


def check_rows_kept(st: SiteState, call: AttentionCall) -> None:
    """A cache the model keeps (``own_cache=False``, StaticCache) can change between steps without the
    runtime seeing it: the caller reorders its rows (beam search), or another sequence of the same
    length stepped on this backend in between (two ``generate`` calls in turn), and the policy's
    metadata would then score other rows', or another sequence's, keys. The last step's newest key must
    still be in each row: checked on the device (``_assert_async``, no host sync on CUDA; on CPU a
    failed check raises at once). Equal keys there are the same sequence (a deeper layer's key depends
    on the whole prefix), or one whose metadata is the same."""
    k = call.k
    prev = st.tail_key
    # only a step that continues the last one (the same decode step run again, as opcheck does, is not)
    if (prev is not None and prev.shape[0] == k.shape[0] and call.past == st.length
            and 0 < call.past <= k.shape[2]):
        what = REORDERED if k.shape[0] > 1 else INTERLEAVED
        try:
            torch._assert_async((k[:, :, call.past - 1] == prev).all(), what)
        except RuntimeError as e:
            raise KVPassError(f"{what} ({st.policy.name}, layer {st.info.layer})") from e
    st.tail_key = k[:, :, call.length - 1].clone()  # (B, H_kv, D): a few hundred numbers per site


REORDERED = (
    "kvpass: the rows of a cache the model keeps were reordered between steps (beam search), or another "
    "batch stepped on this backend in between, and this policy's per-row metadata cannot follow a cache it "
    "does not own. Fix: use own_cache=True (the default, with a DynamicCache) or num_beams=1"
)

INTERLEAVED = (
    "kvpass: the cache the model keeps (own_cache=False, a StaticCache) does not continue the sequence "
    "this site served at its last step: another sequence stepped on this backend in between (two "
    "generate() calls in turn, two threads), and this policy's metadata belongs to that one. Fix: finish "
    "one sequence before starting the next, use one backend per sequence, or own_cache=True (the default, "
    "with a DynamicCache), which tells the sequences apart"
)


def _make_call(q, k, v, attn_mask, scale, is_causal, length, start=-1) -> AttentionCall:
    if scale <= 0:
        scale = 1.0 / math.sqrt(q.shape[-1])  # the op's encoding of "SDPA's default scale"
    return AttentionCall(
        q=q, k=k, v=v, attn_mask=attn_mask, scale=scale, is_causal=is_causal, length=length, start=start,
    )


class SiteState:
    """State of one attention site. The base class is the Full policy: exact attention, no metadata.

    Subclasses override :meth:`observe` (fold the new tokens into metadata) and :meth:`select` (the
    token indices to attend at a decode step, ``(B, H_kv, N)`` with -1 padding, or None for all).

    A state whose metadata cannot hold left padding per row sets ``rows_native = False``: the runtime
    then serves a padded batch with one state per row (:mod:`kvpass.runtime.rows`)."""

    rows_native = True  # serves a left-padded batch itself (exact attention and StreamingLLM mask padding)
    # keeps metadata per batch row (Quest's pages): a reorder of a cache the model keeps must be caught
    per_row_metadata = False
    checks_kept = True  # check_rows_kept on a model-kept cache; False for a row state (its split checks the batch)

    def __init__(self, policy: Policy, info: SiteInfo, shared: dict | None = None):
        from kvpass.runtime.store import OwnedKV, StubRows

        self.policy = policy
        self.info = info
        self.store = OwnedKV()  # used when the pass gave this site's cache to the runtime
        self.stubs = StubRows()  # the stubs this site hands the model's cache (known without a read)
        self.pad = Padding()
        self.probe = None  # measurement hook (kvpass.bench): called at decode steps with the selection
        # Scratch shared by the sites of one Runtime (decisions that need every layer, e.g. CentroidKV's
        # outlier heads); owned by the backend like the states themselves.
        self.shared: dict = {} if shared is None else shared
        self.prefill_calls = 0
        self.decode_calls = 0
        # scheduled events run since the state was made (decode-time clustering, a merge round, a
        # residual flush): the steps that may sync and run other ops than a steady step (tests count them)
        self.events = 0
        # bumped at every sequence (re)start: a stub tagged with an older epoch belongs to a sequence
        # this site no longer holds (see KVPassBackend's graph guard)
        self.epoch = 0
        self.static_ptr = 0  # the storage of the static cache this sequence runs on (0: none)
        self.batch = 1  # rows of the last step
        # a state that is not rows_native serves this left-padded sequence itself (serves_padded said so
        # where it started); set by kvpass.runtime.rows at every start, kept by reset()
        self.in_place = False
        # the Runtime that holds this state (set by Runtime.state(); None for a padded batch's row states,
        # which hold no stubs): told when the last stub of this site's sequence is dropped (hold())
        self.owner: Callable[[], Runtime | None] | None = None
        self.reset()

    # -- the runtime's entry points: the policy's own step, or one state per row of a padded batch --
    def run_owned(self, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal) -> torch.Tensor:
        self.batch = q.shape[0]
        if self.rows_native:
            return self.forward_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)
        from kvpass.runtime import rows

        return rows.run_owned(self, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)

    def run(self, call: AttentionCall, static: bool) -> torch.Tensor:
        self.batch = call.q.shape[0]
        if self.rows_native:
            return self.forward(call, static=static)
        from kvpass.runtime import rows

        return rows.run(self, call, static)

    def run_fetch(self, q: torch.Tensor, past_k: torch.Tensor | None) -> torch.Tensor:
        past = 0 if past_k is None else past_k.shape[2]
        if not self._split_continues(past_k, past):
            return self.fetch(q, past)
        self.split.fetch(q, past)
        return torch.full((1,), self.steps, dtype=torch.int64, device=q.device)

    def run_prefetch(self, q_hat: torch.Tensor, past_k: torch.Tensor | None, estimated: bool) -> torch.Tensor:
        past = 0 if past_k is None else past_k.shape[2]
        if not self._split_continues(past_k, past):
            return self.prefetch(q_hat, past, estimated)
        self.split.prefetch(q_hat, past, estimated)
        return torch.full((1,), self.steps, dtype=torch.int64, device=q_hat.device)

    def _split_continues(self, past_k: torch.Tensor | None, past: int) -> bool:
        """Whether this step (seen by a fetch or prefetch, before the attention) continues the padded
        batch served row by row; a reorder of its stub (beam search) is applied here, before the fetch. A
        new sequence or an adopted cache goes to this state's own hook (the attention starts the rows)."""
        split = self.split
        if split is None or not past or past != split.length:
            return False
        if not self.stubs.is_own(past_k):
            rows = self.stubs.rows(past_k)
            if rows is None:
                return False
            split.reorder(rows, past)
        return True

    def serves_padded(self, first: list[int], length: int, new_tokens: int, like: torch.Tensor) -> bool:
        """Whether a state that is not ``rows_native`` serves a left-padded sequence itself: rows whose
        first real positions are ``first``, starting with a forward of ``new_tokens`` tokens that ends at
        ``length``, with keys like ``like``. Asked once, where the sequence starts; False sends it row by row (:mod:`kvpass.runtime.rows`)."""
        return False

    def all_events(self) -> int:
        """Scheduled events of this site, its per-row states included."""
        return self.events + (self.split.events() if self.split is not None else 0)

    # -- lifecycle -------------------------------------------------------------------------------
    def reset(self) -> None:
        """A new sequence starts (a forward on an empty cache)."""
        self.epoch += 1
        self.split = None  # the per-row states of a left-padded batch (kvpass.runtime.rows), if any
        self.length = 0
        self.physical = 0
        self.kv_bytes = 0
        self.attended = 0
        self.last_idx: torch.Tensor | None = None
        # the step's attention where select() ran it in the same call (Quest's and ClusterKV's C steps):
        # forward() returns it in place of attend_selected()
        self.select_out: torch.Tensor | None = None
        # The policy's own work (metadata, clustering, selection, quantisation), wall seconds since the
        # sequence started, split by phase; on CUDA these are launch times unless a probe synchronises.
        self.overhead_prefill_s = 0.0
        self.overhead_decode_s = 0.0
        self.bytes_moved = 0  # between tiers (host -> device), since the sequence started
        self.steps = 0  # decode steps since the sequence started
        self.keys_seen = 0  # keys [0, keys_seen) were checked for NaN/Inf or passed on purpose (check_keys)
        self.tail_key: torch.Tensor | None = None  # (B, H_kv, D) the newest key of a model-kept cache
        self.dense_path: bool | None = None  # the CPU attention path of the last step (choose_dense)
        # weak references to the model-cache stubs of this sequence (hold()); dropping the set here
        # drops their callbacks with it: an older sequence's stubs can no longer release this one
        self._live: set[weakref.ref] = set()
        self._reaper: Callable[[weakref.ref], None] | None = None
        self.released_row: dict[str, Any] | None = None  # report() row of a sequence released (release())

    def hold(self, stub: torch.Tensor, epoch: int) -> None:
        """Count ``stub`` (a :class:`~kvpass.runtime.store.CacheStub` of this site's sequence ``epoch``,
        handed to the model's cache or derived from one by a row move) as a holder of the sequence: when
        the last one is garbage-collected (the model's cache was dropped: ``generate()`` returned, a
        request ended), the runtime releases the site's keys, values and metadata (:meth:`release`). A
        dropped cache cannot come back, so nothing it could still ask for is lost. One weak reference
        per stub, no host sync."""
        if epoch != self.epoch or self.owner is None:
            return
        if self._reaper is None:
            self._reaper = _reaper(self.owner, weakref.ref(self), epoch)
        self._live.add(weakref.ref(stub, self._reaper))

    def release(self, keep_row: bool = True) -> None:
        """Drop this site's sequence: its keys, values (both tiers) and metadata are freed, and a stub
        of it given to a graph later is refused (the epoch moves on). ``keep_row``: ``report()`` keeps
        the sequence's row as it ended (marked ``released``; :meth:`report_row`)."""
        row = None
        if keep_row and (self.length or self.prefill_calls or self.decode_calls):
            from torch.utils._mode_utils import no_dispatch

            # A garbage collection runs this wherever it happens, also while dynamo traces another model
            # under a fake-tensor mode: the row's few reductions run on the real tensors, outside any mode.
            try:
                with no_dispatch(), torch._C.DisableTorchFunction():
                    row = self.row()
            except Exception:  # noqa: BLE001  (a weakref callback: the report loses the row, memory is freed)
                row = None
        self.reset()
        self.store.clear()
        self.released_row = row

    def report_row(self) -> dict[str, Any]:
        """:meth:`row`, or the row of the released sequence as it ended (nothing of it is held now)."""
        if self.released_row is not None and not self.length:
            return {**self.released_row, "released": True}
        return self.row()

    def forward_owned(self, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal) -> torch.Tensor:
        """A step of a site whose cache the runtime owns (see :meth:`Runtime.attend_owned`): append to
        :attr:`store`, then :meth:`forward`. Policies that keep a different physical cache override it."""
        with _range("kvpass.bookkeeping"):
            rebuilt = self.store.append(past_k, past_v, k_new, v_new, self.stubs)
            self._follow_reorder()
        k, v = self.store.views()
        length = k.shape[2]
        start = 0 if rebuilt else length - k_new.shape[2]
        return self.forward(_make_call(q, k, v, attn_mask, scale, is_causal, length, start), owned=True)

    def forward(self, call: AttentionCall, owned: bool = False, static: bool = False) -> torch.Tensor:
        if not owned and self.length and (call.past > self.length or call.past < self.length - call.new_tokens):
            # the model's cache grew by steps this site never saw (they ran eagerly, outside the graph),
            # or is shorter than what it saw (a crop; another sequence continuing a copy of a shared
            # prefix): its metadata does not describe this cache, so rebuild it from the cache, as for an
            # adopted one. (past == length - new_tokens is the same step run again, as opcheck does.)
            call.start = 0
        if static:
            # a static cache is one buffer per sequence: another buffer mid-sequence is another sequence
            # stepping on this backend (two static caches in turn); its keys are all in the buffer, so
            # the metadata is rebuilt from it rather than continued from the other sequence's
            ptr = call.k.untyped_storage().data_ptr()
            if call.past and ptr != self.static_ptr:
                call.start = 0
            self.static_ptr = ptr
        if call.start == 0:
            self.reset()
        if not owned and (self.per_row_metadata or not self.rows_native) and self.checks_kept:
            check_rows_kept(self, call)
        event = call.start == 0 or call.new_tokens > 1 or self.keys_seen < call.past
        call.valid = self.pad.valid(call.attn_mask, call.length, event)
        self.length = call.length
        if owned:
            self.physical = self.store.length
            self.kv_bytes = self.store.nbytes()
        else:
            k = call.k
            self.physical = k.shape[2]
            self.kv_bytes = 2 * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size() * self.physical
        if call.new_tokens > 1 or self.keys_seen < call.past:
            # A step that reads every key it has not seen (prefill, chunked prefill, a cache filled
            # elsewhere) checks them; a plain decode step's one new key is not checked: that would be a
            # host sync per layer per step.
            lo = min(self.keys_seen, call.past)
            when = ("at prefill" if call.past == 0 else "in a multi-token step" if call.new_tokens > 1
                    else ADOPTED)
            self.check_keys(call.k[:, :, lo : call.length], when, first=lo)
        self.keys_seen = call.length
        t0 = time.perf_counter()
        if call.new_tokens > 1:
            # Prefill and chunked prefill attend exactly, as every method here does.
            self.observe(call)
            self.overhead_prefill_s += time.perf_counter() - t0
            self.prefill_calls += 1
            self.attended = call.length
            self.last_idx = None
            return call.exact()
        self.decode_calls += 1
        self.steps += 1
        with _range("kvpass.select"):
            self.observe(call)
            self.select_out = None
            idx = self.select(call)
        if call.start == 0:
            # metadata built from an adopted cache (a prefill done elsewhere) is prefill work
            self.overhead_prefill_s += time.perf_counter() - t0
        else:
            self.overhead_decode_s += time.perf_counter() - t0
        self.last_idx = idx
        if self.probe is not None:
            self.probe(self, call, idx)
        with _range("kvpass.attend"):
            if idx is None:
                self.attended = call.length
                return self.attend_all(call)
            self.attended = -1  # counted from last_idx when a report asks (no device sync per step)
            out, self.select_out = self.select_out, None
            return self.attend_selected(call, idx) if out is None else out

    def attend_all(self, call: AttentionCall) -> torch.Tensor:
        """A decode step that attends every token (Full, or a budget that covers the context)."""
        return call.exact()

    def attend_selected(self, call: AttentionCall, idx: torch.Tensor) -> torch.Tensor:
        """(B, H_q, 1, D) attention over the selected positions ``idx`` (B, H_kv, N)."""
        from kvpass.lowering.dispatch import sparse_attention

        out = sparse_attention(
            call.q[:, :, 0], call.k_logical, call.v_logical, idx, call.padding_bias(), call.scale, self.workspace,
            self.choose_dense(idx.shape[2], call.length),
        )
        return out.unsqueeze(2)

    def attend_listed_in_c(self, call: AttentionCall, idx: torch.Tensor, lists_padding: bool = True) -> torch.Tensor | None:
        """(B, H_q, 1, D) attention over ``idx`` (B, H_kv, N) int64 read in place by the C kernel
        (:mod:`kvpass.kernels.cpu_decode`), or None where it cannot serve the step (padding that ``idx``
        may list, another device or dtype, the kernel not built): the caller then takes its torch path.
        ``lists_padding=False``: the selection never lists a padding position, so padding needs no mask."""
        from kvpass.kernels import cpu_decode

        if lists_padding and call.valid is not None:
            return None
        return cpu_decode.decode_step(call.q, call.k, call.v, call.length, idx, call.scale)

    def choose_dense(self, n: int, length: int) -> bool:
        """Whether the CPU path attends ``n`` selected positions of ``length`` with a mask over the whole
        cache rather than a gather (:func:`kvpass.kernels.sparse_attention.use_dense`). The choice flips
        once as a sequence grows past three times its selection: that step runs other ops, so it counts
        as a scheduled event."""
        from kvpass.kernels.sparse_attention import use_dense

        dense = use_dense(n, length)
        if self.dense_path is not None and dense != self.dense_path:
            self.events += 1
        self.dense_path = dense
        return dense

    @property
    def workspace(self) -> Workspace:
        """The scratch of the Runtime's sites (or of this state's batch row)."""
        ws = self.shared.get("workspace")
        if ws is None:
            ws = self.shared["workspace"] = Workspace()
        return ws

    def _follow_reorder(self) -> None:
        rows = self.store.reordered
        if rows is not None:
            self.store.reordered = None
            self.reorder_rows(rows)

    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Beam search reordered or expanded the batch (``rows (B',)``: new row i is old row ``rows[i]``),
        and the store followed: the per-row metadata follows too (policies with metadata extend this)."""
        if self.pad.first is not None and self.pad.first.shape[0] > 1:
            self.pad.first = self.pad.first.index_select(0, rows.to(self.pad.first.device))

    def fetch(self, q: torch.Tensor, past: int) -> torch.Tensor:
        """Before the attention of a step with ``past`` cached tokens: fetch from the host tier
        (policies that offload). Returns the ticket ``(1,)`` int64 (the decode step number)."""
        return torch.full((1,), self.steps, dtype=torch.int64, device=q.device)

    def prefetch(self, q_hat: torch.Tensor, past: int, estimated: bool) -> torch.Tensor:
        """Before this site's fetch, from an estimate of its query (policies that prefetch)."""
        return torch.full((1,), self.steps, dtype=torch.int64, device=q_hat.device)

    def check_keys(self, keys: torch.Tensor, when: str, first: int = 0,
                   unit: str | None = "position") -> None:
        """Raise a KVPassError naming the site and the fix when ``keys (B, H_kv, n, D)`` hold NaN or Inf.

        Compressing policies only: a NaN key poisons page bounds, centroids, merged slots and quantisation
        scales, so their selection would be garbage while looking valid. ``Full`` (``policy.exact``) keeps
        eager's semantics instead: a NaN key gives NaN wherever eager attention gives NaN. One host sync,
        so callers check where they read every key anyway (prefill, adoption, a merge or quantisation)."""
        if self.policy.exact:
            return
        msg = non_finite_keys_message(self.policy.name, self.info, keys, when, first, unit)
        if msg is not None:
            raise KVPassError(msg)

    # -- policy hooks ----------------------------------------------------------------------------
    def observe(self, call: AttentionCall) -> None:
        """Fold the tokens at positions ``[call.start, call.length)`` into the metadata."""

    def select(self, call: AttentionCall) -> torch.Tensor | None:
        return None

    def metadata_bytes(self) -> int:
        return 0

    def selection_bytes(self) -> int:
        """Bytes the last decode step's selection read besides the device metadata and the attended KV
        (the whole batch): a host tier's keys scored in place (TailorKV's key channels)."""
        return 0

    def host_bytes(self) -> int:
        """Bytes this site keeps in the host tier (policies that offload)."""
        return 0

    def tokens_attended(self) -> int:
        """Tokens attended at the last step (mean over batch rows and KV heads)."""
        if self.attended < 0 and self.last_idx is not None:
            self.attended = round(float((self.last_idx >= 0).sum(-1).float().mean()))
        return max(self.attended, 0)

    def row(self) -> dict[str, Any]:
        """The site's report row; ``device_bytes_per_row``: what the largest batch row holds on the device
        (a batched state: its share, the total over the batch)."""
        base = self._row()
        if self.split is not None:
            return self.split.row(base)
        base["device_bytes_per_row"] = base["device_bytes"] // max(1, self.batch)
        if self.pad.padded and self.pad.first is not None:
            base["rows"] = self._padded_rows(base)
        return base

    def _padded_rows(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        """Each row of a left-padded batch served in place: its own tokens and the tokens it attended
        (its selection, or all of its own), and its share of the bytes: the batch's buffers hold every
        row at the padded length, padding included."""
        first = [int(f) for f in self.pad.first.expand(self.batch).tolist()]
        attended = None
        if self.last_idx is not None and self.last_idx.shape[0] == self.batch:
            attended = (self.last_idx >= 0).sum(-1).float().mean(-1).round().long().tolist()
        return [{"first": f, "tokens": self.length - f, "tokens_held": self.physical,
                 "tokens_attended": self.length - f if attended is None else attended[b],
                 "device_bytes": base["device_bytes"] // self.batch, "host_bytes": base["host_bytes"] // self.batch}
                for b, f in enumerate(first)]

    def _row(self) -> dict[str, Any]:
        return {
            "site": self.info.site,
            "layer": self.info.layer,
            "module": self.info.module_path,
            "pattern": self.info.pattern,
            "policy": self.policy.name,
            "tokens_logical": self.length,
            "tokens_held": self.physical,
            "tokens_attended": self.tokens_attended(),
            "device_bytes": self.kv_bytes + self.metadata_bytes(),
            "host_bytes": self.host_bytes(),
            # KV heads of the runtime-owned buffers (0: none), kept in the row of a released sequence
            "store_heads": self.store.k.shape[1] if self.store.k is not None else 0,
            "selection_bytes": self.selection_bytes(),
            "bytes_moved": self.bytes_moved,
            "steps": self.steps,
            "overhead_prefill_s": self.overhead_prefill_s,
            "overhead_decode_s": self.overhead_decode_s,
            "prefill_calls": self.prefill_calls,
            "decode_calls": self.decode_calls,
        }


class Runtime:
    """All site states of one backend. Compiled graphs reach it through ``handle``."""

    def __init__(self, policy: Policy, key: str | None = None):
        self.policy = policy
        self.sites: dict[int, SiteState] = {}
        self.infos: dict[int, SiteInfo] = {}
        self.probe = None
        self.shared: dict = {}
        self._lock = threading.Lock()
        # the storage of every stub base a site has handed out -> the site (graph outputs that are
        # stubs are tagged with their site's sequence by the backend)
        self.stub_sites: dict[int, int] = {}
        from kvpass.runtime.adopt import Adoption

        self.adoption = Adoption()  # layers handed over by backend.adopt(), waiting for their first step
        # stubs dropped while the lock was held (a garbage collection inside a step): released at the
        # next stub() or report
        self._dead: list[tuple[SiteState, int]] = []
        # key: what the graphs depend on (the backend passes policy and options); see registry
        self.handle = registry.register(self, policy.key() if key is None else key)

    def info(self, site: int, layer: int | None = None) -> SiteInfo:
        if site not in self.infos:
            self.infos[site] = SiteInfo(site=site, layer=site if layer is None else layer)
        return self.infos[site]

    def state(self, site: int) -> SiteState:
        st = self.sites.get(site)
        if st is None:
            st = self.sites[site] = self.policy.new_state(self.info(site))
            st.probe = self.probe
            st.shared = self.shared
            st.owner = weakref.ref(self)
        return st

    def stub_died(self, st: SiteState, epoch: int) -> None:
        """The last stub of ``st``'s sequence ``epoch`` was garbage-collected (the weak references'
        callback, in whatever thread dropped it; see :meth:`SiteState.hold`)."""
        if not self._lock.acquire(blocking=False):  # this thread (or another) is inside a step
            self._dead.append((st, epoch))
            return
        try:
            self._reap(st, epoch)
            self._drain()
        finally:
            self._lock.release()

    def _reap(self, st: SiteState, epoch: int) -> None:
        if self.sites.get(st.info.site) is not st or st.epoch != epoch or st._live:
            return  # a sequence this site no longer holds (a new one started, set_policy), or held again
        st.release()
        if not any(s.length or s._live for s in self.sites.values()):
            self.shared.clear()  # scratch and per-sequence decisions of every site (the workspace)

    def _drain(self) -> None:
        """Release what :meth:`stub_died` could not while the lock was held; the caller holds it."""
        while self._dead:
            self._reap(*self._dead.pop())

    def collect(self) -> None:
        """Apply releases deferred by a garbage collection that ran inside a step."""
        if self._dead:
            with self._lock:
                self._drain()

    def held_bytes(self) -> int:
        """Bytes of every tensor this runtime's state references now (keys and values of both tiers,
        metadata, scratch, stub bases), each storage counted once: what the backend holds in memory."""
        self.collect()
        with self._lock:
            return tensor_bytes(self.sites, self.shared, self.adoption)

    def set_probe(self, probe) -> None:
        """``probe(state, call, idx)`` runs at every decode step before attention (None: off)."""
        with self._lock:
            self.probe = probe
            for st in self.sites.values():
                st.probe = probe

    def attend(
        self,
        site: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        cache_position: torch.Tensor | None,
        scale: float,
        is_causal: bool,
    ) -> torch.Tensor:
        length = k.shape[2]
        if cache_position is not None:
            # A static cache is a preallocated buffer: the logical end is the last written slot.
            length = min(length, int(cache_position[-1].item()) + 1)
        call = _make_call(q, k, v, attn_mask, scale, is_causal, length)
        with self._lock:
            return self.state(site).run(call, static=cache_position is not None)

    def attend_owned(
        self,
        site: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        scale: float,
        is_causal: bool,
        fetched: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Like :meth:`attend`, for a site whose keys and values the runtime holds (the model's
        cache holds a stub): append ``k_new, v_new`` (B, H_kv, T, D) and attend."""
        with self._lock:
            if self.adoption.held and past_k is not None:  # the first step after backend.adopt()
                past_k, past_v = self.adoption.take(past_k, past_v)
            return self.state(site).run_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)

    def stub(self, site: int, new: torch.Tensor, length: int, past: torch.Tensor | None) -> torch.Tensor:
        """The ``kvpass::cache_stub`` op: the site's stub of ``length`` tokens shaped like ``new``."""
        with self._lock:
            if self._dead:
                self._drain()
            stubs = self.state(site).stubs
            stub = stubs.make(new, length, past)
            if stubs.new_bases:  # bases are made once per shape: a steady step registers nothing
                for base in stubs.new_bases:
                    self.stub_sites[base.untyped_storage().data_ptr()] = site
                stubs.new_bases.clear()
        if past is None or new.shape[2] > 1:
            # The next step decodes from this stub: its length is dynamic from that first decode on, so
            # dynamo compiles one decode graph for every length instead of one for the prompt's length
            # and another when it grows. Steady decode steps skip this (their graph is symbolic already).
            torch._dynamo.maybe_mark_dynamic(stub, 2)
        return stub

    def fetch(self, site: int, q: torch.Tensor, past_k: torch.Tensor | None) -> torch.Tensor:
        """The ``kvpass::fetch`` op: the site moves what this step needs into its device tier."""
        with self._lock:
            return self.state(site).run_fetch(q, past_k)

    def prefetch(self, site: int, q_hat: torch.Tensor, past_k: torch.Tensor | None, estimated: bool) -> torch.Tensor:
        """The ``kvpass::prefetch`` op: the site prepares its next fetch from an estimated query."""
        with self._lock:
            return self.state(site).run_prefetch(q_hat, past_k, estimated)

    def reset(self) -> None:
        """Forget every site's sequence and free what it held (``backend.clear_state()``)."""
        with self._lock:
            self._dead.clear()
            self.adoption.clear()
            self.shared.clear()
            for st in self.sites.values():
                st.release(keep_row=False)

    def set_policy(self, policy: Policy) -> None:
        """Every site starts afresh under ``policy`` (the graphs are unchanged)."""
        with self._lock:
            self.policy = policy
            self.adoption.clear()
            self.sites.clear()
            self.shared.clear()


def _reaper(owner: Callable[[], Runtime | None], state: Callable[[], SiteState | None], epoch: int):
    """The weak-reference callback of a site's stubs of sequence ``epoch``: holds the runtime and the
    state weakly, so that a stub outliving its backend keeps nothing alive."""

    def died(ref: weakref.ref) -> None:
        st = state()
        if st is None or st.epoch != epoch:
            return
        live = st._live
        live.discard(ref)
        if not live and (rt := owner()) is not None:  # the last one: release under the runtime's lock
            rt.stub_died(st, epoch)

    return died


def tensor_bytes(*roots: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``roots`` through containers and
    kvpass's own objects (their attributes); policies, site infos and callables are not entered."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("kvpass.") and not isinstance(obj, SiteInfo) \
                and not hasattr(obj, "new_state"):  # a policy: configuration only
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                stack.extend(v for k, v in attrs.items() if k not in ("owner", "policy", "info", "probe"))
            for name in getattr(type(obj), "__slots__", ()):
                stack.append(getattr(obj, name, None))
    return sum(storages.values())

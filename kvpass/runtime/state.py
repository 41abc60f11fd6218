"""The driver of one attention site: :class:`SiteState` runs every step the same way (padding, NaN checks,
the owned store, stubs, events, accounting) and calls the method's hooks, which a policy's state
overrides (see "The runtime" in docs/architecture.md).

Shapes: ``q (B, H_q, T, D)``; ``k, v (B, H_kv, S, D)`` as the model's cache holds them (before any
repeat_kv); ``T`` new tokens; ``L`` the logical sequence length (``S`` can be larger for a static
cache, and a compressing state may hold fewer physical tokens than ``L``).
"""

from __future__ import annotations

import math
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._mode_utils import no_dispatch

import kvpass.runtime.rows as rows
from kvpass.kernels import cpu_decode
from kvpass.kernels.sparse_attention import use_dense
from kvpass.lowering.dispatch import sparse_attention
from kvpass.runtime.call import AttentionCall, SiteInfo, make_call, profile_range
from kvpass.runtime.errors import ADOPTED_KEYS, INTERLEAVED, REORDERED, KVPassError, non_finite_keys_message
from kvpass.runtime.padding import Padding
from kvpass.runtime.store import SAME, OwnedKV, StubRows, reorder_needed
from kvpass.runtime.workspace import Workspace

if TYPE_CHECKING:
    from kvpass.policies.base import Policy
    from kvpass.runtime.runtime import Runtime


class SiteState:
    """State of one attention site, and the driver of its steps. The base class is the Full policy:
    exact attention, no metadata.

    The driver (``run``, ``run_owned``, ``forward``, ``forward_owned``, ``run_fetch``, ``run_prefetch``)
    is the same for every method: sequence starts and resets, padding, NaN checks, the owned store and
    its stubs, reorders, events and accounting. Methods do not override it (tests/test_contract.py
    checks); they implement hooks, each called once where a step needs it:

    - a method that selects from the cache (Quest, StreamingLLM, ClusterKV): :meth:`observe` (fold the
      new tokens into metadata), :meth:`select` (the positions a decode step attends, ``(B, H_kv, N)``
      with -1 padding, or None for all), and how it attends them (:meth:`attend_selected`,
      :meth:`attend_all`); with a host tier (``store.host``: ClusterKV's offload) also
      :meth:`to_device` and :meth:`settle`, around the step;
    - a method with a physical cache of its own (``owns_cache``: CentroidKV's merged slots, TailorKV's
      tiers): :meth:`start`, :meth:`extend`, :meth:`decode`, :meth:`reorder_cache`, :meth:`held_rows`
      and :meth:`fork_refusal`; the driver decides which one a step calls;
    - optional: :meth:`fetch` / :meth:`prefetch` (a host tier), :meth:`reorder_rows`,
      :meth:`serves_padded`, and the report's :meth:`metadata_bytes`, :meth:`host_bytes`,
      :meth:`selection_bytes`.

    A state whose metadata cannot hold left padding per row sets ``rows_native = False``: the runtime
    then serves a padded batch with one state per row (:mod:`kvpass.runtime.rows`)."""

    rows_native = True  # serves a left-padded batch itself (exact attention and StreamingLLM mask padding)
    # keeps metadata per batch row (Quest's pages): a reorder of a cache the model keeps must be caught
    per_row_metadata = False
    checks_kept = True  # check_rows_kept on a model-kept cache; False for a row state (its split checks the batch)
    # keeps a physical cache of its own (forward_owned calls start / extend / decode, not the owned store);
    # such a state keeps ``logical``, the length of the sequence it holds, which the model's cache must match
    owns_cache = False
    # why a cache the model keeps (StaticCache, own_cache=False) cannot be served: the KVPassError text
    # (None: served)
    model_cache_refusal: str | None = None

    def __init__(self, policy: Policy, info: SiteInfo, shared: dict | None = None):
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
        return rows.run_owned(self, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)

    def run(self, call: AttentionCall, static: bool) -> torch.Tensor:
        self.batch = call.q.shape[0]
        if self.rows_native:
            return self.forward(call, static=static)
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
        :attr:`store`, then :meth:`forward`; a method with a cache of its own (``owns_cache``) gets the
        step in its hooks instead (:meth:`start`, :meth:`extend`, :meth:`decode`)."""
        if self.owns_cache:
            t = k_new.shape[2]
            past = 0 if past_k is None else past_k.shape[2]
            if scale <= 0:
                scale = 1.0 / math.sqrt(q.shape[-1])
            rows = self.stubs.rows(past_k) if past else None
            if not past or rows is None:
                # a new sequence: a prefill, or a cache filled outside kvpass (adopted at this step)
                t0 = time.perf_counter()
                self.reset()
                k_all = k_new if not past else torch.cat([past_k, k_new], 2)
                v_all = v_new if not past else torch.cat([past_v, v_new], 2)
                self.check_keys(k_all, "at prefill" if not past else ADOPTED_KEYS)
                call = make_call(q, k_all, v_all, attn_mask, scale, is_causal, past + t)
                return self.start(call, k_new, v_new, t0)
            if past != self.logical:
                raise KVPassError(self.fork_refusal(past))
            if rows is not SAME and reorder_needed(rows, self.held_rows()):
                self.reorder_cache(rows, q, past + t)
            if t > 1:
                self.check_keys(k_new, "in a multi-token step", first=past)
                return self.extend(q, k_new, v_new, attn_mask, scale, is_causal)
            return self.decode(q, k_new, v_new, attn_mask, scale, is_causal)
        with profile_range("kvpass.bookkeeping"):
            rebuilt = self.store.append(past_k, past_v, k_new, v_new, self.stubs)
            self._follow_reorder()
        k, v = self.store.views()
        length = k.shape[2]
        start = 0 if rebuilt else length - k_new.shape[2]
        call = make_call(q, k, v, attn_mask, scale, is_causal, length, start)
        if not self.store.host:
            return self.forward(call, owned=True)
        # a host tier (ClusterKV's offload): the method brings what the step attends to the device
        call = self.to_device(call, rebuilt, k_new, v_new)
        out = self.forward(call, owned=True)
        if call.new_tokens > 1:
            self.settle(rebuilt, k_new, v_new)
        return out

    def forward(self, call: AttentionCall, owned: bool = False, static: bool = False) -> torch.Tensor:
        """A step over ``call``'s keys (the model's cache, or with ``owned`` the runtime's store): exact
        attention for a prefill or chunk, :meth:`observe` and :meth:`select` and the attention of the
        selection for a decode step."""
        if not owned and self.model_cache_refusal is not None:
            raise KVPassError(self.model_cache_refusal)
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
            self.check_rows_kept(call)
        event = call.start == 0 or call.new_tokens > 1 or self.keys_seen < call.past
        call.valid = self.pad.valid(call.attn_mask, call.length, event)
        self.length = call.length
        if owned:
            self.physical = self.store.length
            # a host tier's bytes are not the device's (host_bytes counts them)
            self.kv_bytes = 0 if self.store.host else self.store.nbytes()
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
                    else ADOPTED_KEYS)
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
        with profile_range("kvpass.select"):
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
        with profile_range("kvpass.attend"):
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
        if lists_padding and call.valid is not None:
            return None
        return cpu_decode.decode_step(call.q, call.k, call.v, call.length, idx, call.scale)

    def choose_dense(self, n: int, length: int) -> bool:
        """Whether the CPU path attends ``n`` selected positions of ``length`` with a mask over the whole
        cache rather than a gather (:func:`kvpass.kernels.sparse_attention.use_dense`). The choice flips
        once as a sequence grows past three times its selection: that step runs other ops, so it counts
        as a scheduled event."""
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

    def check_rows_kept(self, call: AttentionCall) -> None:
        """A cache the model keeps (``own_cache=False``, StaticCache) can change between steps without the
        runtime seeing it: the caller reorders its rows (beam search), or another sequence of the same
        length stepped on this backend in between (two ``generate`` calls in turn), and the policy's
        metadata would then score other rows', or another sequence's, keys. The last step's newest key must
        still be in each row: checked on the device (``_assert_async``, no host sync on CUDA; on CPU a
        failed check raises at once). Equal keys there are the same sequence (a deeper layer's key depends
        on the whole prefix), or one whose metadata is the same."""
        k = call.k
        prev = self.tail_key
        # only a step that continues the last one (the same decode step run again, as opcheck does, is not)
        if (prev is not None and prev.shape[0] == k.shape[0] and call.past == self.length
                and 0 < call.past <= k.shape[2]):
            what = REORDERED if k.shape[0] > 1 else INTERLEAVED
            try:
                torch._assert_async((k[:, :, call.past - 1] == prev).all(), what)
            except RuntimeError as e:
                raise KVPassError(f"{what} ({self.policy.name}, layer {self.info.layer})") from e
        self.tail_key = k[:, :, call.length - 1].clone()  # (B, H_kv, D): a few hundred numbers per site

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
        """The positions a decode step attends, ``(B, H_kv, N)`` int64 with -1 padding, or None for all.
        A method whose kernel attends in the same call sets :attr:`select_out` to that attention."""
        return None

    # a host tier (store.host): the whole KV on the host, what a step attends brought to the device
    def to_device(self, call: AttentionCall, rebuilt: bool, k_new: torch.Tensor,
                  v_new: torch.Tensor) -> AttentionCall:
        """Before :meth:`forward` of a step on a host-tier store (``call`` over the host views; ``rebuilt``:
        a new sequence, ``k_new, v_new (B, H_kv, T, D)`` this step's tokens): fill the device tier and
        return the call the step runs."""
        raise NotImplementedError(f"{type(self).__name__} keeps a host tier and implements no to_device")

    def settle(self, rebuilt: bool, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """After a multi-token step on a host-tier store: the device tier takes what :meth:`observe` left."""

    # a cache of the method's own (owns_cache): the driver calls one of these per step
    def start(self, call: AttentionCall, k_new: torch.Tensor, v_new: torch.Tensor, t0: float) -> torch.Tensor:
        """A new sequence (the state was reset and its keys checked): ``call`` holds every token, a
        prefill's or an adopted cache's, with this step's ``k_new, v_new (B, H_kv, T, D)`` last. Build the
        cache and return the step's attention ``(B, H_q, T, D)``; ``t0``: when the step began (overhead)."""
        raise NotImplementedError(f"{type(self).__name__} owns its cache and implements no start")

    def extend(self, q, k_new, v_new, attn_mask, scale: float, is_causal: bool) -> torch.Tensor:
        """Several new tokens ``k_new, v_new (B, H_kv, T, D)`` on the sequence held (a second chat turn,
        chunked prefill; their keys were checked): attend and append them."""
        raise NotImplementedError(f"{type(self).__name__} owns its cache and implements no extend")

    def decode(self, q, k_new, v_new, attn_mask, scale: float, is_causal: bool) -> torch.Tensor:
        """A decode step ``q (B, H_q, 1, D)`` on the sequence held: append the token and attend."""
        raise NotImplementedError(f"{type(self).__name__} owns its cache and implements no decode")

    def held_rows(self) -> int:
        """Batch rows of the cache held (a reorder is applied when the stub's rows differ)."""
        raise NotImplementedError(f"{type(self).__name__} owns its cache and implements no held_rows")

    def reorder_cache(self, rows: torch.Tensor, q: torch.Tensor, length: int) -> None:
        """Beam search reordered or expanded the batch (``rows (B',)``) before a step ending at ``length``."""
        raise NotImplementedError(f"{type(self).__name__} owns its cache and implements no reorder_cache")

    def fork_refusal(self, past: int) -> str:
        """The KVPassError text for a model cache of ``past`` tokens that is not the sequence held (a crop,
        assisted decoding, a fork): a cache of its own cannot be rolled back."""
        return (f"kvpass: {self.policy.name} cannot roll back or fork its cache (the model's cache says {past} "
                f"tokens, this site holds {self.logical})")

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

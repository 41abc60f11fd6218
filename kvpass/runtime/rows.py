"""Left-padded batches served row by row (invariant 10: each row as that prompt alone).

A policy whose metadata is laid out per batch (ClusterKV's clusters, CentroidKV's merged slots,
TailorKV's quantisation groups and host tier) would mix padding into a row's clusters, merges or groups,
or shift a row's group boundaries by its padding. Such a state (``rows_native`` False) is asked once,
where a padded sequence starts, whether it serves it itself (``SiteState.serves_padded``: ClusterKV
when every row clusters at its prefill, TailorKV's sparse layers on the CPU path when every row has more
candidates than the top-k; ``in_place`` then holds for the sequence). Otherwise it serves
a left-padded batch through a :class:`RowSplit`: one state of the same policy per batch row, fed
that row's real tokens only, in the row's own positions (position 0 is the row's first real token). Each
row's state is exactly the state the prompt would have alone, so its selection, its merges and its
quantisation are the alone run's; padding is never selected, merged, quantised or counted in a budget.

Shapes: the site sees ``q (B, H_q, T, D)``, ``k_new, v_new (B, H_kv, T, D)`` and the padded length ``L``;
row ``b`` (first real position ``f_b``) sees ``(1, H, T_b, D)`` of length ``L - f_b``. A decode step
has ``T = T_b = 1``; only a prefill (or a chunk) has rows with fewer real tokens than ``T``.

Cost: the per-row states run one after another, so a padded batch pays the policy's per-step Python once
per row (a batch without padding keeps the batched state). A steady step stays sync-free and
fixed-op: the rows' first positions are Python ints, read where the sequence starts.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from kvpass.runtime.call import AttentionCall, make_call, valid_from_mask
from kvpass.runtime.errors import KVPassError
from kvpass.runtime.store import SAME

if TYPE_CHECKING:
    from kvpass.runtime.state import SiteState


def first_positions(valid: torch.Tensor, batch: int, where: str) -> list[int]:
    """Each row's first real position from ``valid (B', L)`` (B' is 1 for a mask shared by the batch).
    Raises a KVPassError unless every row is left-padded: padding, then only real tokens."""
    valid = valid.expand(batch, -1)
    length = valid.shape[1]
    first = valid.to(torch.int8).argmax(dim=1)
    real = valid.sum(dim=1)
    if bool((real == 0).any()):
        raise KVPassError(
            f"kvpass: a batch row has no real token {where} (its attention mask is all zeros there); kvpass "
            "serves left-padded batches row by row and needs each row's first real token in the first "
            "multi-token forward: prefill a padded batch in one forward, or in chunks longer than its padding"
        )
    if not bool((first + real == length).all()):
        raise KVPassError(
            "kvpass: the attention mask has zeros after a row's first real token (right padding, or holes "
            "in the mask); compressing policies serve left-padded batches only: tokenize with "
            "padding_side='left' (what generate() expects), or use Full()/StreamingLLM()"
        )
    return [int(x) for x in first.tolist()]


def _row_mask(attn_mask: torch.Tensor | None, b: int, q_from: int, k_from: int) -> torch.Tensor | None:
    """Row ``b`` of an SDPA mask ``(B or 1, H or 1, T, S)``: queries from ``q_from``, keys from ``k_from``."""
    if attn_mask is None:
        return None
    r = min(b, attn_mask.shape[0] - 1)
    return attn_mask[r : r + 1, ..., q_from:, k_from:]


class RowSplit:
    """The per-row states of one site while its sequence is a left-padded batch."""

    def __init__(self, parent: SiteState, first: list[int], length: int = 0):
        self.parent = parent
        self.first = first  # per row: the first real position in the padded cache (Python ints)
        self.length = length  # padded positions the site has seen (what the model's cache says)
        self.fresh = True  # no step served yet (a first step on a filled cache adopts it)
        self.reordered_at = -1  # the past length at which a reorder was applied (fetch, then attend)
        self.subs = [self._new_row(b) for b in range(len(first))]

    def _new_row(self, b: int) -> SiteState:
        p = self.parent
        sub = p.policy.new_state(p.info)
        sub.checks_kept = False  # run() checks the whole batch's newest keys once per step
        sub.probe = p.probe
        # decisions that need every layer (CentroidKV's outlier heads) are made per row, as alone
        sub.shared = p.shared.setdefault("rows", {}).setdefault(b, {})
        return sub

    # -- bookkeeping -----------------------------------------------------------------------------
    def events(self) -> int:
        return sum(s.events for s in self.subs)

    def reorder(self, rows: torch.Tensor, past: int) -> None:
        """Beam search reordered or expanded the batch (``rows (B',)``, a host read: an event). A row
        taken twice gets a copy of the state (each beam then continues alone)."""
        if past == self.reordered_at:
            return  # this step's fetch applied it already
        self.reordered_at = past
        idx = [int(r) for r in rows.tolist()]
        if idx == list(range(len(self.subs))):
            return
        if min(idx) < 0 or max(idx) >= len(self.subs):
            raise KVPassError("kvpass: the cache rows were changed in a way kvpass cannot follow")
        p, taken, subs = self.parent, set(), []
        for r in idx:
            sub = self.subs[r]
            if r in taken:
                # policy, site info, probe and the per-row shared scratch are shared, never copied
                memo = {id(x): x for x in (p.policy, p.info, sub.shared, sub.probe) if x is not None}
                sub = copy.deepcopy(sub, memo)
            taken.add(r)
            subs.append(sub)
        self.subs = subs
        self.first = [self.first[r] for r in idx]

    def _stub(self, sub: SiteState, like: torch.Tensor, length: int) -> torch.Tensor | None:
        """The stub the row's state would have handed its cache (its own, in order)."""
        return None if length == 0 else sub.stubs.make(like, length)

    def _account(self, t: int) -> None:
        p = self.parent
        first_step, self.fresh = self.fresh, False
        self.length += t
        p.length = self.length
        if t > 1 or first_step:
            p.prefill_calls += 1
        else:
            p.decode_calls += 1
            p.steps += 1

    # -- steps -----------------------------------------------------------------------------------
    def _each_row(self, q: torch.Tensor, t: int, dv: int, step) -> torch.Tensor:
        """Run ``step(b, sub, f, s)`` for every row (``f``: its first real position, ``s``: this step's
        padding tokens of the row, a prefill's) and assemble the ``(B, H_q, t, dv)`` output; the padding
        queries of a prefill get zeros (finite: later layers mask their keys)."""
        batch, past = q.shape[0], self.length
        if batch != len(self.subs):
            raise KVPassError(f"kvpass: the batch changed from {len(self.subs)} to {batch} rows mid-sequence "
                              "in a way kvpass cannot follow (only beam search's reorder is followed)")
        out = q.new_zeros((batch, q.shape[1], t, dv)) if t > 1 else None
        outs = []
        for b, sub in enumerate(self.subs):
            f = self.first[b]
            s = max(0, f - past)
            if s >= t:
                raise KVPassError(
                    "kvpass: a chunk holds only padding for a batch row that has not started; prefill a "
                    "padded batch in one forward, or in chunks longer than its padding"
                )
            o = step(b, sub, f, s)
            if out is None:
                outs.append(o)
            else:
                out[b : b + 1, :, s:] = o
        self._account(t)
        return torch.cat(outs, 0) if out is None else out

    def forward_owned(self, q, k_new, v_new, attn_mask, scale, is_causal, adopt=None) -> torch.Tensor:
        """A step of an owned site: each row's state appends its real tokens and attends. ``adopt``:
        ``(past_k, past_v)`` of a real cache filled outside kvpass, adopted row by row."""
        past = self.length

        def step(b, sub, f, s):
            row_past = max(0, past - f)
            if adopt is not None and row_past:
                pk, pv = adopt[0][b : b + 1, :, f:], adopt[1][b : b + 1, :, f:]
            else:
                pk = self._stub(sub, k_new[b : b + 1], row_past)
                pv = self._stub(sub, v_new[b : b + 1], row_past)
            return sub.forward_owned(q[b : b + 1, :, s:], k_new[b : b + 1, :, s:], v_new[b : b + 1, :, s:], pk, pv,
                                     _row_mask(attn_mask, b, s, f), scale, is_causal)

        return self._each_row(q, k_new.shape[2], v_new.shape[3], step)

    def forward(self, call: AttentionCall, static: bool) -> torch.Tensor:
        """A step of a site whose cache the model keeps (``call.k (B, H_kv, S, D)``, left-padded)."""
        q, past = call.q, call.past

        def step(b, sub, f, s):
            row = make_call(q[b : b + 1, :, s:], call.k[b : b + 1, :, f:], call.v[b : b + 1, :, f:],
                             _row_mask(call.attn_mask, b, s, f), call.scale, call.is_causal, call.length - f,
                             0 if self.fresh and past else -1)
            return sub.forward(row, static=static)

        return self._each_row(q, call.new_tokens, call.v.shape[3], step)

    def fetch(self, q: torch.Tensor, past: int) -> None:
        for b, sub in enumerate(self.subs):
            sub.fetch(q[b : b + 1], past - self.first[b])

    def prefetch(self, q_hat: torch.Tensor, past: int, estimated: bool) -> None:
        for b, sub in enumerate(self.subs):
            sub.prefetch(q_hat[b : b + 1], past - self.first[b], estimated)

    # -- report ----------------------------------------------------------------------------------
    def row(self, base: dict[str, Any]) -> dict[str, Any]:
        """The site's report row over its row states: bytes and moves summed, tokens averaged, and
        ``rows``: each batch row's own figures."""
        rows = [s.row() for s in self.subs]
        n = len(rows)
        out = dict(base)
        for key in ("tokens_held", "tokens_attended"):
            out[key] = round(sum(r[key] for r in rows) / n)
        for key in ("device_bytes", "host_bytes", "selection_bytes", "bytes_moved", "overhead_prefill_s",
                    "overhead_decode_s"):
            out[key] = sum(r[key] for r in rows)
        out["device_bytes_per_row"] = max(r["device_bytes"] for r in rows)
        out["rows"] = [{"first": f, "tokens": r["tokens_logical"], "tokens_held": r["tokens_held"],
                        "tokens_attended": r["tokens_attended"], "device_bytes": r["device_bytes"],
                        "host_bytes": r["host_bytes"]} for f, r in zip(self.first, rows)]
        return out


# -- the runtime's entry points for a state that is not rows_native ----------------------------------
def run_owned(st: SiteState, q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal) -> torch.Tensor:
    """:meth:`Runtime.attend_owned` for a state that does not serve padding itself."""
    t = k_new.shape[2]
    past = 0 if past_k is None else past_k.shape[2]
    split = st.split
    if past and t == 1 and st.stubs.is_own(past_k):
        # a steady decode step: the sequence keeps its mode, nothing is read
        if split is not None:
            return split.forward_owned(q, k_new, v_new, attn_mask, scale, is_causal)
        return st.forward_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)
    # an event (prefill, chunk, reorder, crop, adopted cache): the mask and the stub are read
    rows = st.stubs.rows(past_k) if past else None
    if rows is not None and (split is not None or st.in_place):
        held = split.length if split is not None else st.length
        if past != held:
            raise KVPassError(
                f"kvpass: {st.policy.name} cannot roll back a left-padded batch (the model's cache says {past} "
                f"tokens, this site holds {held}); assisted decoding and cache crops need unpadded batches"
            )
        if split is None:  # served in place: the store and the state follow a reorder themselves
            return st.forward_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)
        if rows is not SAME:
            split.reorder(rows, past)
        return split.forward_owned(q, k_new, v_new, attn_mask, scale, is_causal)
    valid = valid_from_mask(attn_mask, past + t)
    if valid is None:
        st.split, st.in_place = None, False
        return st.forward_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)
    if rows is not None:
        raise KVPassError(
            f"kvpass: padding appeared in the attention mask of a sequence that started without it "
            f"({st.policy.name}, {past} cached tokens); pass the whole padded prompt in the first forward"
        )
    first = first_positions(valid, q.shape[0], "in its prefill")
    if st.serves_padded(first, past + t, t, k_new):
        st.split, st.in_place = None, True
        return st.forward_owned(q, k_new, v_new, past_k, past_v, attn_mask, scale, is_causal)
    _start(st, first, past)
    return st.split.forward_owned(q, k_new, v_new, attn_mask, scale, is_causal,
                                  adopt=(past_k, past_v) if past else None)


def run(st: SiteState, call: AttentionCall, static: bool) -> torch.Tensor:
    """:meth:`Runtime.attend` (the model keeps the cache) for a state that does not serve padding itself."""
    split = st.split
    if split is not None and call.past == split.length and call.past:
        st.check_rows_kept(call)  # the row states cannot see a reorder of the model's cache
        return split.forward(call, static)
    if st.in_place and call.past == st.length and call.past:
        return st.forward(call, static=static)  # it checks the rows were kept itself
    valid = valid_from_mask(call.attn_mask, call.length)
    if valid is None:
        st.split, st.in_place = None, False
        return st.forward(call, static=static)
    first = first_positions(valid, call.q.shape[0], "in its first forward")
    if st.serves_padded(first, call.length, call.new_tokens, call.k):
        st.split, st.in_place = None, True
        call.start = 0  # a new sequence for this state: its metadata is built from the cache
        return st.forward(call, static=static)
    _start(st, first, call.past)
    st.tail_key = call.k[:, :, call.length - 1].clone()
    return st.split.forward(call, static)


def _start(st: SiteState, first: list[int], past: int) -> None:
    st.in_place = False
    st.reset()  # a new sequence: the epoch moves on (stubs of the last one are refused)
    st.store.clear()  # the rows hold their own keys; the batched store would only hold memory
    st.split = RowSplit(st, first, past)

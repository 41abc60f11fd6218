"""Site state of ClusterKV (arXiv 2412.03213): clusters of keys per KV head, budgeted cluster recall.

Metadata per site, for every batch row and KV head:

- ``centroids (B, H_kv, C, D)`` fp32: the mean of each cluster's keys (the paper's μ, scored by q·μ),
- ``sizes (B, H_kv, C)`` int64 and ``offsets (B, H_kv, C + 1)`` int64: cluster ``c`` is
  ``order[..., offsets[c] : offsets[c] + sizes[c]]``,
- ``order (B, H_kv, N)`` int64: the clustered cache positions grouped by cluster.

Positions ``[0, sinks)`` are never clustered, ``[sinks, tail)`` are, and ``[tail, L)`` (tokens
since the last clustering) are attended at every step until ``decode_window`` of them are clustered.

A left-padded batch is served in place when every row clusters at its prefill (:meth:`ClusterState.serves_padded`):
row ``b`` (first real position ``f_b``) has its sinks at ``f_b + [0, sinks)`` and its prefill clusters from
its own keys ``[f_b + sinks, L0)``, seeded as alone. The rows' cluster counts differ: a row's clusters are
padded to the batch's largest count with size-0 clusters (never selected) and its order segment with -1
(never read). Every row's clustered range ends at the same cache position ``L0``, so from there the
recent range, the decode-time windows and the cluster budget are the batch's, as each row alone has them.

With ``offload=True`` the whole KV lives in the host tier (the site's store, in CPU memory) and the
device tier (:class:`DeviceTier`) holds the sinks, the recent tokens and the tokens of the clusters
selected in the last ``cache_steps`` steps; each step's ``kvpass::fetch`` copies only the missing ones.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvpass.kernels.clusterkv import (
    cluster_scores, cluster_select_cpu_available, cluster_select_torch, ClusterStep
)
from kvpass.kernels.sparse_attention import segments_decode_attention, sinks_picked_recent
from kvpass.lowering.dispatch import cosine_kmeans, select_clusters, sparse_attention
from kvpass.runtime.call import AttentionCall
from kvpass.runtime.errors import ADOPTED_KEYS, KVPassError
from kvpass.runtime.state import SiteState
from kvpass.runtime.store import OwnedKV, grow_seq


class DeviceTier:
    """The device side of ClusterKV's cluster-granular cache (arXiv 2412.03213, Sec. 4).

    - ``sink_k/v (B, H, n_sinks, D)``: the first tokens, kept for the whole sequence;
    - ``rec_k/v (B, H, cap, D)``: tokens ``[rec_start, rec_start + rec_len)`` since the last clustering;
    - ``ring_k/v (cache_steps + 1, B, H, budget, D)``: the recalled cluster tokens of the last
      ``cache_steps`` steps, one buffer per step plus the one being filled;
    - ``seen, slot (B, H, cap_L)`` int32: per position, the step that last recalled it (-1: never)
      and its slot in that step's buffer.

    A recalled position that some buffer of the last ``cache_steps`` steps holds is a hit (a copy
    inside the device tier); the others are misses, copied from the host tier (counted in bytes).
    """

    def __init__(self, sinks_k, sinks_v, cache_steps: int, budget: int):
        self.sink_k, self.sink_v = sinks_k, sinks_v
        b, h, _, d = sinks_k.shape
        self.rec_k = sinks_k.new_zeros((b, h, 64, d))
        self.rec_v = sinks_v.new_zeros((b, h, 64, sinks_v.shape[-1]))
        self.rec_start = self.rec_len = 0
        self.ring_k = sinks_k.new_zeros((cache_steps + 1, b, h, budget, d))
        self.ring_v = sinks_v.new_zeros((cache_steps + 1, b, h, budget, sinks_v.shape[-1]))
        # int32: positions and steps stay far below 2**31, and these grow with the context
        self.seen = torch.full((b, h, 0), -1, dtype=torch.int32, device=sinks_k.device)
        self.slot = torch.zeros((b, h, 0), dtype=torch.int32, device=sinks_k.device)
        self.cache_steps = cache_steps
        self.step = 0
        self.hits = self.recalled = 0
        self.cur = 0  # ring buffer of the last fetch
        self.n_cur = 0  # tokens in it
        # CUDA: the copies run on a side stream; the attention waits on the event (written for GPUs,
        # not exercised on the CPU machines this project is tested on)
        self.stream = torch.cuda.Stream(sinks_k.device) if sinks_k.is_cuda else None
        self.event = None

    def nbytes(self) -> int:
        ts = (self.sink_k, self.sink_v, self.rec_k, self.rec_v, self.ring_k, self.ring_v, self.seen, self.slot)
        return sum(t.numel() * t.element_size() for t in ts)

    def sync_recent(self, tail: int, end: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Hold exactly the tokens ``[tail, end)``: drop those clustered since, append ``k_new``
        (the last ``k_new.shape[2]`` positions before ``end``; produced on the device)."""
        if tail > self.rec_start:
            drop = min(tail - self.rec_start, self.rec_len)
            keep = self.rec_len - drop
            self.rec_k[:, :, :keep] = self.rec_k[:, :, drop : self.rec_len].clone()
            self.rec_v[:, :, :keep] = self.rec_v[:, :, drop : self.rec_len].clone()
            self.rec_start, self.rec_len = tail, keep
        t = k_new.shape[2]
        skip = max(0, tail - (end - t))  # new tokens already clustered (a prefill clusters them at once)
        n = t - skip
        self.rec_k = grow_seq(self.rec_k, self.rec_len + n, live=self.rec_len, factor=2)
        self.rec_v = grow_seq(self.rec_v, self.rec_len + n, live=self.rec_len, factor=2)
        self.rec_k[:, :, self.rec_len : self.rec_len + n] = k_new[:, :, skip:]
        self.rec_v[:, :, self.rec_len : self.rec_len + n] = v_new[:, :, skip:]
        self.rec_len += n
        self.rec_start = end - self.rec_len

    def recent(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest ``n`` recent tokens."""
        return self.rec_k[:, :, self.rec_len - n : self.rec_len], self.rec_v[:, :, self.rec_len - n : self.rec_len]

    def fetch(self, host_k: torch.Tensor, host_v: torch.Tensor, idx: torch.Tensor, length: int) -> int:
        """Put the tokens at positions ``idx (B, H, N)`` into a fresh ring buffer: hits from the buffers
        of the last ``cache_steps`` steps, misses from ``host_k/v``. Returns the bytes moved."""
        if self.stream is None:
            return self._fetch(host_k, host_v, idx, length)
        self.stream.wait_stream(torch.cuda.current_stream(idx.device))  # idx and the ring are ready
        with torch.cuda.stream(self.stream):
            moved = self._fetch(host_k, host_v, idx, length)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
        return moved

    def wait(self) -> None:
        """Make the current stream wait for the last fetch (before attending the device tier)."""
        if self.event is not None:
            torch.cuda.current_stream(self.ring_k.device).wait_event(self.event)
            self.event = None

    def _fetch(self, host_k, host_v, idx, length) -> int:
        b, h, n = idx.shape
        dev = self.ring_k.device
        self.seen = grow_seq(self.seen, length, factor=2, fill=-1)
        self.slot = grow_seq(self.slot, length, factor=2)
        self.step += 1
        bufs, cap, d, dv = self.cache_steps + 1, self.ring_k.shape[3], self.ring_k.shape[-1], self.ring_v.shape[-1]
        r = self.step % bufs
        seen = self.seen.gather(2, idx).long()
        hit = ((seen >= 0) & (self.step - seen <= self.cache_steps)).view(-1)
        # flat row numbers: one index_select/index_copy per tier instead of a mask per coordinate
        # (boolean indexing runs nonzero for each of them: most of a step's cost at 30 layers)
        row = torch.arange(b * h, device=dev).view(b, h, 1)
        j = torch.arange(n, device=dev)
        dst = ((r * b * h + row) * cap + j).view(-1)
        hit_i, miss_i = hit.nonzero().squeeze(1), (~hit).nonzero().squeeze(1)
        ring_k, ring_v = self.ring_k.view(-1, d), self.ring_v.view(-1, dv)
        if hit_i.numel():  # hits: within the device tier (another step's buffer, never buffer r)
            src = (((seen.clamp(min=0) % bufs) * b * h + row) * cap + self.slot.gather(2, idx)).view(-1)[hit_i]
            ring_k.index_copy_(0, dst[hit_i], ring_k.index_select(0, src))
            ring_v.index_copy_(0, dst[hit_i], ring_v.index_select(0, src))
        # misses: host -> device; (B, H, L, D) views over a longer buffer flatten to (B*H, L, D) as views
        hk, hv = host_k.flatten(0, 1), host_v.flatten(0, 1)
        m_row = (miss_i // n).to(hk.device)
        m_pos = idx.reshape(-1)[miss_i].to(hk.device)
        # the gathered rows are fresh pageable memory: the copy is synchronous on a GPU (non_blocking=True
        # promised an overlap it did not have; the simulated device flags it). A pinned staging ring would
        # make it asynchronous on the side stream.
        rows_k = hk[m_row, m_pos].to(dev)
        rows_v = hv[m_row, m_pos].to(dev)
        ring_k.index_copy_(0, dst[miss_i], rows_k)
        ring_v.index_copy_(0, dst[miss_i], rows_v)
        self.seen.scatter_(2, idx, self.step)
        self.slot.scatter_(2, idx, j.to(self.slot.dtype).expand(b, h, n))
        self.hits = self.hits + hit.sum()  # a device counter: read when a report asks, no sync per step
        self.recalled += idx.numel()
        self.cur, self.n_cur = r, n
        return rows_k.numel() * rows_k.element_size() + rows_v.numel() * rows_v.element_size()


class ClusterState(SiteState):
    # a padded batch is served in place where serves_padded says so, else row by row (kvpass.runtime.rows)
    rows_native = False

    def __init__(self, policy, info, shared=None):
        super().__init__(policy, info, shared)
        if policy.offload and not self.dense:
            self.store = OwnedKV(host=True)  # the host tier: the whole KV
            self.model_cache_refusal = (
                "kvpass: ClusterKV(offload=True) needs the runtime to own the cache (a DynamicCache with "
                "kvpass(..., own_cache=True), the default); a StaticCache keeps every token on the device "
                "anyway: use offload=False with it"
            )

    def reset(self) -> None:
        super().reset()
        self.tier: DeviceTier | None = None
        self.plan = None  # (n_sinks, cluster positions or None, n_recent) made by the last fetch
        self.centroids: torch.Tensor | None = None
        self.sizes: torch.Tensor | None = None
        self.offsets: torch.Tensor | None = None
        self.order: torch.Tensor | None = None
        self._step = None  # the CPU selection's ClusterStep, made for the tensors above (select)
        self.tail = 0  # first position not clustered (sinks excluded)
        self.clusterings = 0
        self.kmeans_iters = 0

    @property
    def dense(self) -> bool:
        return self.info.layer in self.policy.dense_layers

    @property
    def offloading(self) -> bool:
        return self.policy.offload and not self.dense

    def metadata_bytes(self) -> int:
        meta = sum(t.numel() * t.element_size() for t in (self.centroids, self.sizes, self.offsets, self.order)
                   if t is not None)
        return meta + (self.tier.nbytes() if self.tier is not None else 0)

    def host_bytes(self) -> int:
        return self.store.nbytes() if self.offloading else 0

    def attend_all(self, call: AttentionCall) -> torch.Tensor:
        if call.k.device != call.q.device:
            # offload, a context the budget covers: every token comes from the host tier (at most a
            # budget's worth, the bytes a selection would move)
            dev = call.q.device
            call = dataclasses.replace(call, k=call.k_logical.to(dev), v=call.v_logical.to(dev))
        return super().attend_all(call)

    def reorder_rows(self, rows: torch.Tensor) -> None:
        if self.offloading:
            # this step's fetch planned and copied for the old row order, before the attention saw the
            # reordered stub: the device tier cannot follow without a second fetch
            raise KVPassError(
                "kvpass: ClusterKV(offload=True) does not follow a batch reordered between steps (beam "
                "search): use ClusterKV(offload=False), which follows it, or num_beams=1"
            )
        super().reorder_rows(rows)
        for name in ("centroids", "sizes", "offsets", "order"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))

    # -- clustering ------------------------------------------------------------------------------
    def _cluster(self, keys: torch.Tensor, start: int, clusters: int) -> None:
        """Cluster ``keys (B, H_kv, n, D)`` (positions ``start ..``) and append the clusters."""
        p = self.policy
        self.check_keys(keys, "when clustering", first=start)  # decoded keys meet their first batched read here
        self.events += 1
        km = cosine_kmeans(keys, clusters, max_iters=p.kmeans_iters, seed=p.seed + self.clusterings)
        self.clusterings += 1
        self.kmeans_iters += km.iters
        self._append(km.centroids, km.sizes, km.offsets, km.order + start)

    def _append(self, centroids, sizes, offsets, order) -> None:
        """Append clusters (``offsets (B, H_kv, C + 1)`` into their own ``order``) to the metadata."""
        if self.centroids is None:
            self.centroids, self.sizes, self.offsets, self.order = centroids, sizes, offsets, order
            return
        self.centroids = torch.cat([self.centroids, centroids], dim=2)
        self.sizes = torch.cat([self.sizes, sizes], dim=2)
        self.offsets = torch.cat([self.offsets[..., :-1], offsets + self.order.shape[2]], dim=2)
        self.order = torch.cat([self.order, order], dim=2)

    def serves_padded(self, first: list[int], length: int, new_tokens: int, like: torch.Tensor) -> bool:
        """In place when every row clusters at this first forward, as it would alone (its clustered
        range then ends where every other row's does). Offloading, and a batch with a row too short to
        cluster yet (its own tail would differ), are served row by row."""
        if self.dense:
            return True  # exact attention with the model's mask
        if self.offloading:
            return False
        p = self.policy
        for f in first:
            own = length - f
            end = own if new_tokens > 1 else own - 1  # an adopting decode step keeps its token recent
            if end - min(p.sinks, own) < p.tokens_per_cluster:
                return False
        return True

    def _cluster_rows(self, call: AttentionCall) -> None:
        """The start of a left-padded sequence served in place: each row's own keys after its sinks are
        clustered as the prompt alone would cluster them (the same count and seed), and the rows' clusters
        are stacked, padded with size-0 clusters and -1 order slots."""
        p, length = self.policy, call.length
        end = length if call.new_tokens > 1 else length - 1
        kms = []
        # the rows' first positions were checked (left padding only) where the sequence started
        for b, f in enumerate(self.pad.first.expand(call.k.shape[0]).tolist()):
            lo = f + min(p.sinks, length - f)
            if end - lo < p.tokens_per_cluster:  # serves_padded sent such a batch row by row
                raise KVPassError(f"kvpass: ClusterKV cannot serve batch row {b} in place: it has "
                                  f"{end - lo} tokens to cluster, fewer than tokens_per_cluster")
            km = cosine_kmeans(call.k[b : b + 1, :, lo:end], (end - lo) // p.tokens_per_cluster,
                               max_iters=p.kmeans_iters, seed=p.seed + self.clusterings)
            self.kmeans_iters += km.iters
            kms.append((km, lo))
        self.events += 1
        self.clusterings += 1
        b, h, _, d = call.k.shape
        c = max(km.sizes.shape[2] for km, _ in kms)
        n = max(km.order.shape[2] for km, _ in kms)
        centroids = call.k.new_zeros((b, h, c, d), dtype=torch.float32)
        sizes = torch.zeros((b, h, c), dtype=torch.int64, device=call.k.device)
        offsets = torch.empty((b, h, c + 1), dtype=torch.int64, device=call.k.device)
        order = torch.full((b, h, n), -1, dtype=torch.int64, device=call.k.device)
        for r, (km, lo) in enumerate(kms):
            cr, nr = km.sizes.shape[2], km.order.shape[2]
            centroids[r, :, :cr] = km.centroids[0]
            sizes[r, :, :cr] = km.sizes[0]
            offsets[r, :, : cr + 1] = km.offsets[0]
            offsets[r, :, cr + 1 :] = nr
            order[r, :, :nr] = km.order[0] + lo
        self._append(centroids, sizes, offsets, order)
        self.tail = end

    def observe(self, call: AttentionCall) -> None:
        if self.dense:
            return
        p, length = self.policy, call.length
        if call.start == 0:
            self.tail = 0
            self.centroids = self.sizes = self.offsets = self.order = None
            if self.pad.padded:
                self._cluster_rows(call)
                return
        self.tail = max(self.tail, min(p.sinks, length))
        if call.new_tokens > 1 or call.start == 0:
            # (chunked) prefill, or a cache filled elsewhere being adopted: the new tail is clustered at
            # the prompt's granularity (an adopting decode step keeps its own token recent)
            end = length if call.new_tokens > 1 else length - 1
            if end - self.tail < p.tokens_per_cluster:
                return
            clusters = (end - self.tail) // p.tokens_per_cluster
        else:
            if self.offloading:
                return  # decode-time clustering runs in fetch, on the device tier
            # decode: the window of generated tokens before the current one (which stays recent, so a
            # step always attends to its own token)
            end = length - 1
            if end - self.tail < p.decode_window:
                return
            clusters = p.decode_clusters
        self._cluster(call.k[:, :, self.tail : end], self.tail, clusters)
        self.tail = end

    # -- selection -------------------------------------------------------------------------------
    def cluster_scores(self, q: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, C) fp32: q·μ of each cluster for the decode query ``q (B, H_q, 1, D)``, the
        query group combined by ``policy.gqa``."""
        return cluster_scores(q[:, :, 0], self.centroids, self.policy.gqa)

    def _budgets(self, length: int) -> tuple[int, int, int] | None:
        """``(n_sinks, cluster slots, n_recent)`` of a step at ``length`` (they add up to the budget), or
        None when every row fits in the budget (exact attention, as each alone)."""
        p = self.policy
        if self.dense or length - self.pad.first_min <= p.budget:
            return None
        n_sinks = min(p.sinks, length)  # a row served in place is longer than its sinks
        tail = max(self.tail, n_sinks)
        # The recent tokens are always attended; more of them than the budget leaves keeps the newest.
        n_recent = min(length - tail, p.budget - n_sinks)
        return n_sinks, p.budget - n_sinks - n_recent, n_recent

    def _plan(self, q: torch.Tensor, length: int):
        """The offloading step's selection: ``(n_sinks, cluster positions (B, H_kv, N) or None, n_recent)``,
        or None when everything is attended."""
        budgets = self._budgets(length)
        if budgets is None:
            return None
        n_sinks, cluster_budget, n_recent = budgets
        picked = None
        if self.centroids is not None and cluster_budget > 0:
            picked = select_clusters(self.cluster_scores(q), self.sizes, self.offsets, self.order, cluster_budget)
        return n_sinks, picked, n_recent

    def _select_in_c(self, q: torch.Tensor) -> bool:
        return (type(q) is torch.Tensor and q.is_cpu and q.dtype == torch.float32 and q.stride(-1) == 1
                and cluster_select_cpu_available())

    def select(self, call: AttentionCall) -> torch.Tensor | None:
        if self.offloading:
            return self._offload_idx(call)
        budgets = self._budgets(call.length)
        if budgets is None:
            return None
        n_sinks, cluster_budget, n_recent = budgets
        p = self.policy
        meta = (self.centroids, self.sizes, self.offsets, self.order)
        if self.centroids is None:  # nothing clustered yet: the cluster slots stay empty
            b, h, _, d = call.k.shape
            meta = (call.q.new_zeros((b, h, 0, d), dtype=torch.float32),
                    *(torch.zeros((b, h, n), dtype=torch.int64, device=call.q.device) for n in (0, 1, 0)))
        self._plan_of_step = budgets
        padded = self.pad.padded
        # sinks, recalled clusters and recent tokens in one list; in a padded batch each row's own, and
        # all of a row that fits the budget
        rest = (self.pad.first if padded else None, call.length, n_sinks, cluster_budget, n_recent,
                p.budget if padded else -1, p.budget, p.gqa)
        if self._select_in_c(call.q) and meta[0].dtype == torch.float32 and meta[0].stride(3) == 1:
            # the (B, H_q, 1, D) query as it came (no view of it per step), the clusters' arguments packed
            # once (a ClusterStep, made again where clustering replaces them); a fresh list each step, as a
            # probe or a test may keep last_idx
            step = self._step
            if step is None or not step.holds(*meta, rest[0]):
                step = self._step = ClusterStep(*meta, rest[0], p.gqa)
            # the attention in the same C call where it serves the cache (the list holds no padding):
            # forward() returns it (select_out)
            done = step.select_attend(call.q, *rest[1:7], call.k, call.v, call.scale)
            if done is not None:
                idx, self.select_out = done
                return idx
            return step.select(call.q, *rest[1:7])
        return cluster_select_torch(call.q[:, :, 0], *meta, *rest, select=select_clusters)

    def _offload_idx(self, call: AttentionCall) -> torch.Tensor | None:
        """The positions the offloading step attends (the plan its fetch made), for reports and probes."""
        if self.plan is None:
            return None
        n_sinks, picked, n_recent = self.plan
        dev = picked.device if picked is not None else call.k.device
        return sinks_picked_recent(*call.k.shape[:2], n_sinks, picked, n_recent, call.length, dev)

    # -- offload ---------------------------------------------------------------------------------
    def fetch(self, q: torch.Tensor, past: int) -> torch.Tensor:
        ticket = super().fetch(q, past)
        self.plan = None
        if not self.offloading or q.shape[2] != 1 or past == 0 or self.tier is None:
            return ticket  # prefill (exact, from the new tokens) or nothing to fetch
        p, length = self.policy, past + 1
        end = length - 1  # decode-time clustering of the window before this token, on the device tier
        if end - self.tail >= p.decode_window and self.tier.rec_start == self.tail:
            n = end - self.tail
            self._cluster(self.tier.rec_k[:, :, :n], self.tail, p.decode_clusters)
            self.tail = end
        self.plan = self._plan(q, length)
        if self.plan is not None and self.plan[1] is not None:
            host_k, host_v = self.store.views()
            self.bytes_moved += self.tier.fetch(host_k, host_v, self.plan[1], length)
        return ticket

    def to_device(self, call: AttentionCall, rebuilt: bool, k_new: torch.Tensor,
                  v_new: torch.Tensor) -> AttentionCall:
        q, hk, hv, length, t = call.q, call.k, call.v, call.length, k_new.shape[2]
        dev = q.device
        if rebuilt and t == 1:
            # a decode step on a cache filled elsewhere (adopted): build the metadata and the device
            # tier from the host tier, then plan and fetch as the fetch op would have, and attend as any
            # decode step does
            t0 = time.perf_counter()
            self.reset()
            self.check_keys(hk[:, :, : length - t], ADOPTED_KEYS)
            self.keys_seen = length - t
            self.observe(call)
            self._new_tier(hk, hv, length, dev)
            self.plan = self._plan(q, length)
            if self.plan is not None and self.plan[1] is not None:
                self.bytes_moved += self.tier.fetch(hk, hv, self.plan[1], length)
            self.overhead_prefill_s += time.perf_counter() - t0
            return dataclasses.replace(call, start=length - t)
        if rebuilt or t > 1:
            # prefill attends exactly over every token (the host views; no copy on CPU); observe
            # clusters the prompt (a new sequence resets the state), and settle() makes the tokens left
            # unclustered the device's recent tokens
            self.plan = None
            return dataclasses.replace(call, k=hk.to(dev), v=hv.to(dev))
        # a decode step: fetch has planned and filled the device tier; the host views give shapes only
        self.tier.wait()  # sync_recent may move tokens the fetch's clustering read
        self.tier.sync_recent(self.tail, length, k_new, v_new)
        return call

    def settle(self, rebuilt: bool, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        if rebuilt:
            hk, hv = self.store.views()
            self._new_tier(hk, hv, hk.shape[2], k_new.device)
        else:
            self.tier.sync_recent(self.tail, self.store.length, k_new, v_new)

    def _new_tier(self, hk: torch.Tensor, hv: torch.Tensor, length: int, dev: torch.device) -> None:
        """A new sequence: the sinks go to the device tier once, and the tokens not clustered (from the
        host tier's copy) become its recent tokens."""
        n_s = min(self.policy.sinks, length)
        self.tier = DeviceTier(hk[:, :, :n_s].to(dev), hv[:, :, :n_s].to(dev), self.policy.cache_steps,
                               self.policy.budget)
        self.tier.rec_start = n_s
        self.tier.sync_recent(self.tail, length, hk[:, :, n_s:].to(dev), hv[:, :, n_s:].to(dev))

    def attend_selected(self, call: AttentionCall, idx: torch.Tensor) -> torch.Tensor:
        if not self.offloading:
            q = call.q
            if q.device.type != "cpu" or q.dtype != torch.float32 or call.k.dtype != q.dtype:
                return super().attend_selected(call, idx)
            # sinks, recalled clusters, recent tokens as listed; a padded row's list is its own tokens
            out = self.attend_listed_in_c(call, idx, lists_padding=False)
            if out is not None:
                return out
            if call.valid is not None:
                return super().attend_selected(call, idx)
            # the sinks and the recent tokens are two ranges of the cache, attended in place; only the
            # recalled clusters' tokens are gathered
            n_sinks, cluster_budget, n_recent = self._plan_of_step
            picked = idx[..., n_sinks : n_sinks + cluster_budget] if cluster_budget else None
            ranges = [r for r in ((0, n_sinks), (call.length - n_recent, call.length)) if r[1] > r[0]]
            return segments_decode_attention(q[:, :, 0], call.k_logical, call.v_logical, ranges, call.scale,
                                             picked, self.workspace).unsqueeze(2)
        n_sinks, picked, n_recent = self.plan
        tier = self.tier
        tier.wait()
        rk, rv = tier.recent(n_recent)
        ks, vs = [tier.sink_k[:, :, :n_sinks]], [tier.sink_v[:, :, :n_sinks]]
        if picked is not None:
            ks.append(tier.ring_k[tier.cur, :, :, : tier.n_cur])
            vs.append(tier.ring_v[tier.cur, :, :, : tier.n_cur])
        k = torch.cat(ks + [rk], dim=2)
        v = torch.cat(vs + [rv], dim=2)
        out = sparse_attention(call.q[:, :, 0], k, v, None, None, call.scale)
        return out.unsqueeze(2)

    def row(self):
        r = super().row()
        r["clusters"] = 0 if self.sizes is None else int(self.sizes.shape[-1])
        r["dense"] = self.dense
        if self.tier is not None:
            r["hit_rate"] = float(self.tier.hits) / self.tier.recalled if self.tier.recalled else float("nan")
        return r

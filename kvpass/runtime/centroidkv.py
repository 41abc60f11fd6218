"""Site state of CentroidKV (Chelsea, arXiv 2506.11418): a physically smaller cache of degree-weighted
centroids, merged by chunked soft matching, attended with a +log(degree) bias.

Physical layout of one site (the model's cache holds a zero-stride stub, see :mod:`kvpass.runtime.store`):

- compressed heads: ``k, v (B, H_c, cap, D)`` and ``deg (B, H_c, cap)`` fp32, the first ``s`` slots
  live (every compressed head has the same ``s``: a merge round removes as many slots from each);
- outlier heads (kept whole): ``ko, vo (B, H_o, cap_o, D)``, the first ``logical`` slots live.

``logical`` is the true sequence length (what positions and masks see); the degrees of the compressed
heads always sum to it.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from kvpass.kernels import cpu_decode
from kvpass.kernels.centroid import log_degree_bias, merge_round, num_candidates
from kvpass.lowering.dispatch import centroid_attention, chunk_match, sparse_attention
from kvpass.runtime.call import make_call
from kvpass.runtime.state import SiteState
from kvpass.runtime.store import grow_seq


def _grow(buf: torch.Tensor | None, like: torch.Tensor, live: int, need: int, slack: int) -> torch.Tensor:
    """``buf`` with room for ``need`` slots along dim 2 (its first ``live`` slots kept)."""
    return grow_seq(buf, need, live=live, slack=slack, factor=1.5, like=like)


class CentroidState(SiteState):
    SLACK = 64
    rows_native = False  # a padded batch is served row by row (kvpass.runtime.rows)
    owns_cache = True  # the merged slots (start / extend / decode)
    model_cache_refusal = (
        "kvpass: CentroidKV needs the runtime to own the cache (a DynamicCache with kvpass(..., "
        "own_cache=True), the default): this site's cache is kept by the model (a StaticCache, or "
        "own_cache=False), which would hold every token anyway; use generate() without "
        "cache_implementation='static'"
    )

    def reset(self) -> None:
        super().reset()
        self.k = self.v = self.deg = None
        # log-degree bias of the slots (B, H_c, capacity), kept beside deg so that a decode step does not
        # recompute it: new slots append 0 (log 1); a merge, a reorder or a new head split drops it
        self.bias: torch.Tensor | None = None
        self.all_comp = True
        self.s = 0
        self.ko = self.vo = None
        self.logical = 0
        self.comp: torch.Tensor | None = None  # (H_c,) KV heads that are merged
        self.outl: torch.Tensor | None = None  # (H_o,) KV heads kept whole
        self.prompt_len = 0
        self.target: int | None = None  # slots per compressed head (set at the first decode step)
        self.rounds = 0
        self.merged = 0

    # -- accounting ------------------------------------------------------------------------------
    def _account(self) -> None:
        bufs = [t for t in (self.k, self.v, self.deg, self.ko, self.vo) if t is not None]
        self.kv_bytes = sum(t.numel() * t.element_size() for t in bufs)
        h_c = 0 if self.comp is None else len(self.comp)
        h_o = 0 if self.outl is None else len(self.outl)
        self.physical = round((self.s * h_c + self.logical * h_o) / max(1, h_c + h_o))
        self.attended = self.physical
        self.length = self.logical

    def degree_sum(self) -> torch.Tensor:
        """(B, H_c): tokens represented by each compressed head's slots (== ``logical``)."""
        return self.deg[:, :, : self.s].sum(-1)

    def row(self):
        r = super().row()
        r.update(merge_rounds=self.rounds, merged=self.merged, target=self.target,
                 outlier_heads=[] if self.outl is None else self.outl.tolist())
        return r

    # -- the cache -------------------------------------------------------------------------------
    def _load(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A new sequence whose first tokens are ``k, v (B, H_kv, L, D)``: every head starts whole
        (compressed heads are chosen at the first decode step)."""
        self.comp = torch.arange(k.shape[1], device=k.device)
        self.outl = self.comp[:0]
        self.all_comp = True  # every head compressed: a step's new rows need no head gather
        self.bias = None
        n = k.shape[2]
        self.k = _grow(None, k, 0, n, self.SLACK)
        self.v = _grow(None, v, 0, n, self.SLACK)
        self.deg = _grow(None, k.new_zeros(k.shape[:3], dtype=torch.float32), 0, n, self.SLACK)
        self.k[:, :, :n], self.v[:, :, :n] = k, v
        self.deg[:, :, :n] = 1.0
        self.s = self.logical = self.prompt_len = n
        self.ko = self.vo = None

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[2]
        if self.all_comp or len(self.comp):
            need = self.s + t
            self.k = _grow(self.k, k, self.s, need, self.SLACK)
            self.v = _grow(self.v, v, self.s, need, self.SLACK)
            self.deg = _grow(self.deg, self.deg, self.s, need, self.SLACK)
            self.k[:, :, self.s : need] = k if self.all_comp else k[:, self.comp]
            self.v[:, :, self.s : need] = v if self.all_comp else v[:, self.comp]
            self.deg[:, :, self.s : need] = 1.0
            if self.bias is not None:
                self.bias = _grow(self.bias, self.bias, self.s, need, self.SLACK)
                self.bias[:, :, self.s : need] = 0.0
            self.s = need
        if len(self.outl):
            need = self.logical + t
            self.ko = _grow(self.ko, k[:, self.outl], self.logical, need, self.SLACK)
            self.vo = _grow(self.vo, v[:, self.outl], self.logical, need, self.SLACK)
            self.ko[:, :, self.logical : need] = k[:, self.outl]
            self.vo[:, :, self.logical : need] = v[:, self.outl]
        self.logical += t

    def reorder_cache(self, rows: torch.Tensor, q: torch.Tensor, length: int) -> None:
        """Beam search reordered (or expanded) the batch between steps."""
        for name in ("k", "v", "deg", "ko", "vo"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows))
        self.bias = None

    # -- outlier heads and the budget ------------------------------------------------------------
    def _redundancy(self) -> torch.Tensor:
        """(H_kv,) how mergeable each head's prompt keys are: the mean cosine similarity of each A slot's
        best B match (chunked soft matching over the candidate range), averaged over the batch."""
        p = self.policy
        lo, hi = p.sinks, self.s - p.recent
        if hi - lo < 2:
            return torch.ones(self.k.shape[1])
        _, _, sim = chunk_match(self.k[:, :, : self.s], lo, hi, p.chunk)
        return sim.mean(-1).mean(0).float().cpu()

    def _decide(self) -> None:
        """Choose this sequence's outlier heads over every site of the model (the lowest redundancy
        ``outlier_heads`` share) and the slots each compressed head keeps, so that the whole model
        holds at most ``cache_ratio`` of Full's tokens (or ``budget`` slots per head on average)."""
        p, shared = self.policy, self.shared
        if "outliers" not in shared:
            red = shared.get("redundancy", {})
            ranked = sorted(((float(r), site, h) for site, heads in red.items() for h, r in enumerate(heads)))
            n_out = round(p.outlier_heads * len(ranked))
            shared["outliers"] = {(site, h) for _, site, h in ranked[:n_out]}
            shared["heads"] = len(ranked)
        n_heads, n_out = shared["heads"], len(shared["outliers"])
        h_kv = self.k.shape[1]
        out = [h for h in range(h_kv) if (self.info.site, h) in shared["outliers"]]
        horizon = self.prompt_len + p.expected_new_tokens
        if p.budget is not None:
            held = p.budget
        else:
            # R * (n + Γ) tokens' worth of bytes, the degree (fp32) of each slot included
            slot = 2 * self.k.shape[-1] * self.k.element_size()
            held = math.floor(p.cache_ratio * horizon * slot / (slot + 4))
        if n_out and n_heads > n_out:
            # outlier heads hold the whole horizon; the others give up the difference
            held = math.floor((held * n_heads - n_out * horizon) / (n_heads - n_out))
        # s stays within [target, target + step]: the slots held never exceed ``held``
        self.target = max(held - p.step, p.sinks + p.recent + 1)
        if out:
            dev = self.k.device
            self.all_comp, self.bias = False, None
            self.outl = torch.tensor(out, device=dev)
            self.comp = torch.tensor([h for h in range(h_kv) if h not in out], device=dev)
            n = self.s
            self.ko, self.vo = self.k[:, self.outl, :n].clone(), self.v[:, self.outl, :n].clone()
            if len(self.comp):
                self.k, self.v = self.k[:, self.comp].clone(), self.v[:, self.comp].clone()
                self.deg = self.deg[:, self.comp].clone()
            else:
                self.k = self.v = self.deg = None
                self.s = 0

    def _merge(self) -> None:
        """Merge rounds until ``s <= target`` (Algorithm 1), the ratio annealed per round."""
        self.events += 1
        p = self.policy
        self.bias = None  # the degrees change here (a step merges rarely: recomputed at its attention)
        if self.comp is None or not len(self.comp) or p.merge_ratio == 0:
            return
        use_triton = self.k.is_cuda
        # the decoded tokens are checked here, where a round reads every slot anyway, not at each step (a
        # host sync per layer per step); a NaN slot would spread into the centroid it is merged with
        self.check_keys(self.k[:, :, : self.s], "when merging", unit=None)
        shrunk = False
        while self.s > self.target:
            lo, hi = p.sinks, self.s - p.recent
            na = num_candidates(lo, hi, p.chunk) if hi - lo >= 2 else 0
            if na == 0:
                break  # only sinks and recent slots left
            r = max(p.merge_ratio - self.rounds * p.merge_ratio_decay, p.min_merge_ratio)
            if math.floor(r * na) == 0:
                r = 1.0 / na  # over budget: at least one pair
            res = merge_round(self.k[:, :, : self.s], self.v[:, :, : self.s], self.deg[:, :, : self.s],
                              p.sinks, p.recent, p.chunk, r, max_merge=self.s - self.target,
                              use_triton=use_triton)
            if res.merged == 0:
                break
            self.rounds += 1
            self.merged += res.merged
            self.s -= res.merged
            self.k[:, :, : self.s] = res.k
            self.v[:, :, : self.s] = res.v
            self.deg[:, :, : self.s] = res.deg
            self.deg[:, :, self.s :] = 0.0
            shrunk = True
        cap = self.target + p.step
        if shrunk and self.k.shape[2] > cap:
            # give the memory back: the buffers only ever need target + step slots from now on
            self.k = self.k[:, :, :cap].clone()
            self.v = self.v[:, :, :cap].clone()
            self.deg = self.deg[:, :, :cap].clone()

    # -- attention -------------------------------------------------------------------------------
    def _heads(self, kv_heads: torch.Tensor, group: int) -> torch.Tensor:
        return (kv_heads[:, None] * group + torch.arange(group, device=kv_heads.device)).flatten()

    def _attend_decode(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, H_q, 1, D) -> (B, H_q, 1, Dv): log-degree attention on compressed heads, plain on
        outlier heads."""
        b, h_q = q.shape[:2]
        h_kv = len(self.comp) + len(self.outl)
        g = h_q // h_kv
        dv = (self.v if self.v is not None else self.vo).shape[-1]
        if self.k is not None and self.bias is None:
            self.bias = log_degree_bias(self.deg)
        if self.all_comp:
            # the buffers and their bias read in place, one C call (CPU, fp32); else the dispatched kernel
            out = cpu_decode.decode_step(q, self.k, self.v, self.s, None, scale, self.bias)
            if out is not None:
                return out
            out = centroid_attention(q[:, :, 0], self.k[:, :, : self.s], self.v[:, :, : self.s],
                                     self.deg[:, :, : self.s], scale, self.bias[:, :, : self.s])
            return out.unsqueeze(2)
        out = q.new_empty((b, h_q, dv))
        if len(self.comp):
            qh = self._heads(self.comp, g)
            out[:, qh] = centroid_attention(q[:, qh, 0], self.k[:, :, : self.s], self.v[:, :, : self.s],
                                            self.deg[:, :, : self.s], scale, self.bias[:, :, : self.s])
        qh = self._heads(self.outl, g)
        n = self.logical  # outlier heads keep every token: plain dense attention
        out[:, qh] = sparse_attention(q[:, qh, 0], self.ko[:, :, :n], self.vo[:, :, :n], None, None, scale)
        return out.unsqueeze(2)

    def _attend_chunk(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Several new tokens on a merged cache (a second chat turn, chunked prefill): each attends to
        the merged slots with the log-degree bias and causally to the new tokens."""
        b, h_q, t, _ = q.shape
        h_kv = len(self.comp) + len(self.outl)
        g = h_q // h_kv
        outs = q.new_empty((b, h_q, t, (self.v if self.v is not None else self.vo).shape[-1]))
        parts = []
        if len(self.comp):
            parts.append((self.comp, self.k[:, :, : self.s], self.v[:, :, : self.s], self.deg[:, :, : self.s]))
        if len(self.outl):
            n = self.logical
            parts.append((self.outl, self.ko[:, :, :n], self.vo[:, :, :n],
                          self.ko.new_ones((b, len(self.outl), n), dtype=torch.float32)))
        for heads, k, v, deg in parts:
            s = k.shape[2]
            bias = torch.where(deg > 0, deg.clamp_min(1e-30).log(), -math.inf)  # (B, h, S)
            bias = bias[:, :, None, :].expand(-1, -1, t, -1).clone()
            causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
            bias[..., s - t :] = bias[..., s - t :].masked_fill(causal, -math.inf)
            qh = self._heads(heads, g)
            if g > 1:
                k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            mask = bias.repeat_interleave(g, dim=1).to(q.dtype)
            outs[:, qh] = F.scaled_dot_product_attention(q[:, qh], k, v, attn_mask=mask, scale=scale)
        return outs

    # -- one step (the driver's hooks) ---------------------------------------------------------------
    def start(self, call, k_new, v_new, t0: float) -> torch.Tensor:
        self._load(call.k, call.v)
        # measure how mergeable each head is, for the outlier-head choice at the first decode step
        self.shared.setdefault("redundancy", {})[self.info.site] = self._redundancy()
        self.shared.pop("outliers", None)
        if call.new_tokens > 1 or not call.past:
            # prefill: exact attention over the whole prompt, as the paper does
            self.overhead_prefill_s += time.perf_counter() - t0
            self.prefill_calls += 1
            self._account()
            n = self.logical
            return make_call(call.q, self.k[:, :, :n], self.v[:, :, :n], call.attn_mask, call.scale,
                             call.is_causal, n).exact()
        # an adopted cache, this step's token loaded with it: the step decodes
        self.overhead_prefill_s += time.perf_counter() - t0
        return self.decode(call.q, None, None, call.attn_mask, call.scale, call.is_causal)

    def extend(self, q, k_new, v_new, attn_mask, scale, is_causal) -> torch.Tensor:
        self._append(k_new, v_new)
        self.prefill_calls += 1
        self._account()
        return self._attend_chunk(q, scale)

    def decode(self, q, k_new, v_new, attn_mask, scale, is_causal) -> torch.Tensor:
        """(``k_new`` None: the token is in the cache already, loaded by :meth:`start`.)"""
        t0 = time.perf_counter()
        if k_new is not None:
            self._append(k_new, v_new)
        if self.target is None:
            self._decide()  # the first decode step: merge the prompt down to the budget
            self._merge()
            self.overhead_prefill_s += time.perf_counter() - t0  # the paper merges right after prefill
        else:
            if self.s >= self.target + self.policy.step:
                self._merge()
            self.overhead_decode_s += time.perf_counter() - t0
        self.decode_calls += 1
        self.steps += 1
        self._account()
        return self._attend_decode(q, scale)

    def held_rows(self) -> int:
        return (self.k if self.k is not None else self.ko).shape[0]

    def fork_refusal(self, past: int) -> str:
        if self.k is None and self.ko is None:
            return "kvpass: the model's cache continues a sequence this backend never saw"
        return (f"kvpass: CentroidKV cannot roll back or fork a merged cache (the model's cache says {past} "
                f"tokens, the merged cache represents {self.logical}); assisted decoding and cache crops "
                f"need a policy that keeps every token")

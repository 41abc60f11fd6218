"""CentroidKV (Chelsea, arXiv 2506.11418): chunked soft matching, the degree-weighted merge, merge rounds
and log-degree decode attention. The Triton kernels (run by the interpreter on CPU) against the torch
references, the references against naive loops, and the method's properties: degrees are conserved,
merged slots are convex combinations of their members, no merge crosses a chunk, sinks and recent slots
never change, merging identical tokens is exact, and all-ones degrees are plain attention (Full)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvpass.kernels.centroid import (
    MergeResult,
    centroid_decode_attention,
    chunk_match,
    chunk_match_ref,
    merge_round,
    merge_scatter,
    merge_scatter_ref,
    num_candidates,
    select_pairs,
)
from strategies import (
    DTYPES,
    GQA_GROUPS,
    HEAD_DIMS,
    LAYOUTS,
    SEEDS,
    TOL,
    MatchProblem,
    MergeProblem,
    MergeRoundProblem,
    make_centroid_keys,
    make_match_inputs,
    make_merge_inputs,
    make_strided,
    match_problems,
    merge_problems,
    merge_round_problems,
)

MARGIN = 1e-3  # below this gap between the best and the runner-up, either B slot is a correct match


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------------
# Oracles
# --------------------------------------------------------------------------------------------------


def candidate_table(k, lo, hi, chunk):
    """Loop oracle of the matching: for every candidate A slot in ascending order, ``(a, bs, sims)``
    with ``bs`` the B slots of its chunk and ``sims`` ``(B, H, len(bs))`` fp64 cosine similarities
    (norms floored at 1e-6), computed slot by slot."""
    kf = k.double()
    rows = []
    for start in range(lo, hi, chunk):
        end = min(start + chunk, hi)
        bs = list(range(start + 1, end, 2))
        if not bs:
            continue  # a 1-slot last chunk: its A slot has no partner
        kb = kf[:, :, bs]
        nb = kb.norm(dim=-1).clamp_min(1e-6)
        for a in range(start, end, 2):
            ka = kf[:, :, a]
            sims = (kb * ka[:, :, None]).sum(-1) / (nb * ka.norm(dim=-1).clamp_min(1e-6)[..., None])
            rows.append((a, bs, sims))
    return rows


def check_match(a_pos, b_pos, sim, k, lo, hi, chunk, sim_atol=1e-5):
    """(a_pos, b_pos, sim) against the loop oracle: a_pos exactly the even offsets, b_pos in the same
    chunk at an odd offset, exactly the oracle's best where it beats the runner-up by > MARGIN and
    otherwise within MARGIN of it, sim the best similarity."""
    B, H = k.shape[:2]
    rows = candidate_table(k, lo, hi, chunk)
    NA = len(rows)
    assert NA == num_candidates(lo, hi, chunk)
    assert a_pos.shape == b_pos.shape == sim.shape == (B, H, NA)
    assert a_pos.dtype == b_pos.dtype == torch.int64 and sim.dtype == torch.float32
    assert not sim.isnan().any()
    if NA == 0:
        return
    assert torch.equal(a_pos, torch.tensor([r[0] for r in rows]).expand(B, H, NA))
    for i, (a, bs, sims) in enumerate(rows):
        got = b_pos[:, :, i]
        assert ((got - lo) // chunk == (a - lo) // chunk).all(), "a match crossed a chunk"
        assert ((got - lo) % chunk % 2 == 1).all() and (got < hi).all()
        top = sims.topk(min(2, len(bs)), dim=-1).values
        best = top[..., 0]
        margin = top[..., 0] - top[..., 1] if len(bs) > 1 else torch.full_like(best, math.inf)
        expected = torch.tensor(bs)[sims.argmax(-1)]
        clear = margin > MARGIN
        assert torch.equal(got[clear], expected[clear])
        chosen = torch.gather(sims, -1, ((got - bs[0]) // 2)[..., None]).squeeze(-1)
        assert (chosen >= best - MARGIN).all()
        torch.testing.assert_close(sim[:, :, i].double(), best, atol=sim_atol, rtol=0)


def naive_merge(k, v, deg, a_pos, b_pos, take):
    """The merge, one head and one target at a time, in fp64: ``(k2, v2, deg2)`` fp64."""
    B, H, S, _ = k.shape
    ks, vs, ds = [], [], []
    for b in range(B):
        for h in range(H):
            groups: dict[int, list[int]] = {}
            for i in range(a_pos.shape[2]):
                if take[b, h, i]:
                    groups.setdefault(int(b_pos[b, h, i]), []).append(int(a_pos[b, h, i]))
            removed = {a for members in groups.values() for a in members}
            rk, rv, rd = [], [], []
            for s in range(S):
                if s in removed:
                    continue
                members = [s] + groups.get(s, [])
                w = deg[b, h, members].double()
                rk.append((w[:, None] * k[b, h, members].double()).sum(0) / w.sum())
                rv.append((w[:, None] * v[b, h, members].double()).sum(0) / w.sum())
                rd.append(w.sum())
            ks.append(torch.stack(rk))
            vs.append(torch.stack(rv))
            ds.append(torch.stack(rd))
    n = len(ks[0])
    return (
        torch.stack(ks).view(B, H, n, -1),
        torch.stack(vs).view(B, H, n, -1),
        torch.stack(ds).view(B, H, n),
    )


def kept_slots(a_pos, b_pos, take, S, b, h):
    """(kept slots in order, targets) of head (b, h)."""
    removed = set(a_pos[b, h][take[b, h]].tolist())
    return [s for s in range(S) if s not in removed], set(b_pos[b, h][take[b, h]].tolist())


def check_merge_output(out, k, v, deg, a_pos, b_pos, take):
    """Properties of a merge result (kernel or reference) and agreement with the loop oracle."""
    k2, v2, deg2 = out
    B, H, S, _ = k.shape
    m = int(take[0, 0].sum()) if take.numel() else 0
    assert k2.shape == (B, H, S - m, k.shape[3]) and v2.shape == (B, H, S - m, v.shape[3])
    assert deg2.shape == (B, H, S - m) and deg2.dtype == torch.float32
    assert k2.dtype == k.dtype and v2.dtype == v.dtype
    # degrees are conserved: every token is counted once, before and after
    torch.testing.assert_close(deg2.double().sum(-1), deg.double().sum(-1), atol=1e-4, rtol=1e-6)
    ek, ev, ed = naive_merge(k, v, deg, a_pos, b_pos, take)
    assert_close(k2, ek, k.dtype)
    assert_close(v2, ev, v.dtype)
    torch.testing.assert_close(deg2.double(), ed, atol=1e-5, rtol=1e-6)
    for b in range(B):
        for h in range(H):
            kept, targets = kept_slots(a_pos, b_pos, take, S, b, h)
            untouched = [j for j, s in enumerate(kept) if s not in targets]
            src = [kept[j] for j in untouched]
            # slots not involved in a merge keep their bits
            assert torch.equal(k2[b, h, untouched], k[b, h, src])
            assert torch.equal(v2[b, h, untouched], v[b, h, src])
            assert torch.equal(deg2[b, h, untouched], deg[b, h, src].float())
            # a merged slot lies in the box spanned by its members (hence in their convex hull)
            for j, s in enumerate(kept):
                if s not in targets:
                    continue
                members = [s] + a_pos[b, h][take[b, h] & (b_pos[b, h] == s)].tolist()
                for x, x2 in ((k, k2), (v, v2)):
                    rows = x[b, h, members].float()
                    slack = 1e-6 * (1 + rows.abs().amax(0))
                    assert (x2[b, h, j].float() >= rows.amin(0) - slack).all()
                    assert (x2[b, h, j].float() <= rows.amax(0) + slack).all()


def weighted_attention(q, k, v, deg, scale=None):
    """The paper's first form, per query head: sum_i n_i e^{s_i} v_i / sum_i n_i e^{s_i} (fp64),
    zero when every degree is 0."""
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros((B, H_q, v.shape[3]), dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            n = deg[b, h // G].double()
            live = n > 0
            if not live.any():
                continue
            s = (k[b, h // G][live].double() @ q[b, h].double()) * scale
            w = n[live] * torch.exp(s - s.max())
            out[b, h] = (w[:, None] * v[b, h // G][live].double()).sum(0) / w.sum()
    return out


# --------------------------------------------------------------------------------------------------
# chunk_match
# --------------------------------------------------------------------------------------------------


@given(p=match_problems())
def test_chunk_match_ref_matches_loop_oracle(p: MatchProblem):
    k = make_match_inputs(p)
    check_match(*chunk_match_ref(k, p.lo, p.hi, p.chunk), k, p.lo, p.hi, p.chunk)


@given(p=match_problems())
def test_chunk_match_kernel_matches_ref(p: MatchProblem):
    k = make_match_inputs(p)
    a, b, s = chunk_match(k, p.lo, p.hi, p.chunk)
    check_match(a, b, s, k, p.lo, p.hi, p.chunk)
    ra, rb, rs = chunk_match_ref(k, p.lo, p.hi, p.chunk)
    assert torch.equal(a, ra)
    torch.testing.assert_close(s, rs, atol=1e-5, rtol=0)
    if p.key_mode == "integer":  # exact arithmetic on both sides: ties are ties, same lowest slot
        assert torch.equal(b, rb)


@pytest.mark.parametrize("fn", [chunk_match, chunk_match_ref])
@pytest.mark.parametrize("chunk", [4, 7, 512])
def test_chunk_match_ties_pick_the_lowest_position(fn, chunk):
    """Every B slot of a chunk is a copy of one vector: all similarities tie, the lowest B wins.
    chunk=512 puts 256 B slots in the chunk, more than one kernel block of B slots. Integer-valued
    keys: every dot product is exact in fp32 whatever the summation order, so the copies tie exactly
    (with random floats, the interpreter's BLAS matmul gave equal rows values one ulp apart)."""
    S = 600 if chunk == 512 else 40
    gen = torch.Generator().manual_seed(0)
    k = torch.randint(-4, 5, (1, 2, S, 16), generator=gen).float()
    lo, hi = 5, S - 3
    for start in range(lo, hi, chunk):
        k[:, :, start + 1 : min(start + chunk, hi) : 2] = k[:, :, start + 1 : start + 2]
    a, b, s = fn(k, lo, hi, chunk)
    chunk_start = lo + (a - lo) // chunk * chunk
    assert torch.equal(b, chunk_start + 1)
    # a later tie block: make the best B slot appear twice, at the end of the chunk and before it
    k2 = torch.randint(-4, 5, (1, 1, 512, 16), generator=gen).float()
    k2[:, :, 301] = k2[:, :, 0]
    k2[:, :, 511] = k2[:, :, 0]
    a, b, s = fn(k2, 0, 512, 512)
    assert int(b[0, 0, 0]) == 301


@pytest.mark.parametrize("fn", [chunk_match, chunk_match_ref])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_match_zero_keys(fn, dtype):
    k = torch.zeros((2, 1, 40, 64), dtype=dtype)
    k[0, 0, 7] = 1.0  # one nonzero B slot in chunk 0 of batch 0
    a, b, s = fn(k, 0, 40, 16)
    assert not s.isnan().any() and (s == 0).all()
    assert torch.equal(b, (a // 16) * 16 + 1)  # all ties at 0: the lowest B slot


@pytest.mark.parametrize("fn", [chunk_match, chunk_match_ref])
def test_chunk_match_candidate_counts(fn):
    k = torch.randn((1, 1, 50, 16))
    cases = {
        (0, 0, 4): [],
        (3, 4, 4): [],  # one candidate: no B slot
        (3, 5, 4): [3],
        (0, 9, 4): [0, 2, 4, 6],  # chunks [0,4) [4,8) [8]: the 1-slot last chunk has no candidate
        (0, 10, 4): [0, 2, 4, 6, 8],
        (2, 13, 5): [2, 4, 6, 7, 9, 11],  # odd chunk: parity restarts at 7 and 12 (12 alone)
    }
    for (lo, hi, chunk), expected in cases.items():
        a, b, s = fn(k, lo, hi, chunk)
        assert a[0, 0].tolist() == expected, (lo, hi, chunk)
        assert num_candidates(lo, hi, chunk) == len(expected)


def test_chunk_match_errors(monkeypatch):
    k = torch.randn((1, 1, 20, 16))
    for fn in (chunk_match, chunk_match_ref):
        with pytest.raises(ValueError, match="kvpass: .* needs 0 <= lo <= hi <= S=20"):
            fn(k, 5, 21, 4)
        with pytest.raises(ValueError, match="kvpass: .* needs chunk >= 2"):
            fn(k, 0, 20, 1)
        with pytest.raises(ValueError, match=r"kvpass: .* needs k of shape \(B, H, S, D\)"):
            fn(k[0], 0, 20, 4)
    with pytest.raises(ValueError, match="kvpass: chunk_match needs chunk <= 512 and head dim D <= 256"):
        chunk_match(k, 0, 20, 1024)
    with pytest.raises(ValueError, match="kvpass: chunk_match needs chunk <= 512 and head dim D <= 256"):
        chunk_match(torch.randn((1, 1, 20, 320)), 0, 20, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: chunk_match needs Triton .* use chunk_match_ref"):
        chunk_match(k, 0, 20, 4)


# --------------------------------------------------------------------------------------------------
# select_pairs
# --------------------------------------------------------------------------------------------------


@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    NA=st.integers(0, 60),
    ties=st.booleans(),
    data=st.data(),
)
def test_select_pairs_matches_sorted_order(B, H, NA, ties, data):
    n_merge = data.draw(st.integers(0, NA))
    gen = torch.Generator().manual_seed(data.draw(SEEDS))
    if ties:  # few distinct values: the order among equals decides
        sim = torch.randint(-2, 3, (B, H, NA), generator=gen) / 2.0
    else:
        sim = torch.randn((B, H, NA), generator=gen)
    take = select_pairs(sim, n_merge)
    assert take.dtype == torch.bool and take.shape == (B, H, NA)
    for b in range(B):
        for h in range(H):
            row = sim[b, h].tolist()
            best = sorted(range(NA), key=lambda i: (-row[i], i))[:n_merge]
            assert sorted(take[b, h].nonzero().squeeze(1).tolist()) == sorted(best)
    with pytest.raises(ValueError, match=f"kvpass: select_pairs needs 0 <= n_merge <= NA={NA}"):
        select_pairs(sim, NA + 1)


# --------------------------------------------------------------------------------------------------
# merge_scatter
# --------------------------------------------------------------------------------------------------


@given(p=merge_problems(max_s=60))
def test_merge_scatter_ref_matches_loop(p: MergeProblem):
    args = make_merge_inputs(p)
    check_merge_output(merge_scatter_ref(*args), *args)


@given(p=merge_problems(), block_s=st.sampled_from([16, 128]))
def test_merge_scatter_kernel_matches_ref(p: MergeProblem, block_s: int):
    args = make_merge_inputs(p)
    out = merge_scatter(*args, block_s=block_s)
    ref = merge_scatter_ref(*args)
    for x, r in zip(out, ref):
        assert x.shape == r.shape and x.dtype == r.dtype
        assert_close(x, r, p.dtype)
    torch.testing.assert_close(out[2], ref[2], atol=1e-5, rtol=1e-6)  # degrees: fp32 sums
    if p.S <= 60:
        check_merge_output(out, *args)


def test_merge_scatter_merges_many_into_one():
    """Weighted mean by hand: slot 1 (deg 2, value 1) absorbs slot 0 (deg 1, value 4) and slot 3
    (deg 3, value -2): (2*1 + 1*4 + 3*(-2)) / 6 = 0."""
    k = torch.tensor([4.0, 1.0, 7.0, -2.0, 5.0]).view(1, 1, 5, 1).expand(1, 1, 5, 16).contiguous()
    deg = torch.tensor([[[1.0, 2.0, 1.0, 3.0, 1.0]]])
    a = torch.tensor([[[0, 2, 3]]])
    b = torch.tensor([[[1, 1, 1]]])
    take = torch.tensor([[[True, False, True]]])
    for fn in (merge_scatter, merge_scatter_ref):
        k2, v2, deg2 = fn(k, k.half(), deg, a, b, take)
        assert k2[0, 0, :, 0].tolist() == [0.0, 7.0, 5.0]
        assert v2.dtype == torch.float16 and v2[0, 0, :, 0].tolist() == [0.0, 7.0, 5.0]
        assert deg2[0, 0].tolist() == [6.0, 1.0, 1.0]


@pytest.mark.parametrize("fn", [merge_scatter, merge_scatter_ref])
@pytest.mark.parametrize("NA", [0, 5])
def test_merge_scatter_nothing_taken_is_a_copy(fn, NA):
    gen = torch.Generator().manual_seed(NA)
    k = make_strided(torch.randn((2, 3, 30, 64), generator=gen).half(), "bshd")
    deg = torch.randint(1, 5, (2, 3, 30), generator=gen).float()
    pos = torch.randint(0, 30, (2, 3, NA), generator=gen)
    k2, v2, deg2 = fn(k, k, deg, pos, pos, torch.zeros((2, 3, NA), dtype=torch.bool))
    assert torch.equal(k2, k) and torch.equal(v2, k) and torch.equal(deg2, deg)


def test_merge_scatter_errors(monkeypatch):
    k = torch.randn((1, 2, 10, 16))
    deg = torch.ones((1, 2, 10))
    a = torch.tensor([[[0, 2], [4, 6]]])
    b = torch.tensor([[[1, 3], [5, 7]]])
    for fn in (merge_scatter, merge_scatter_ref):
        with pytest.raises(ValueError, match="kvpass: .* needs the same number of taken pairs"):
            fn(k, k, deg, a, b, torch.tensor([[[True, True], [True, False]]]))
        with pytest.raises(ValueError, match="kvpass: .* needs distinct taken a_pos"):
            fn(k, k, deg, a, torch.tensor([[[1, 0], [5, 7]]]), torch.ones((1, 2, 2), dtype=torch.bool))
        with pytest.raises(ValueError, match="kvpass: .* needs distinct taken a_pos"):
            fn(k, k, deg, torch.tensor([[[0, 0], [4, 6]]]), b, torch.ones((1, 2, 2), dtype=torch.bool))
        with pytest.raises(ValueError, match=r"kvpass: .* needs taken a_pos and b_pos in \[0, S=10\)"):
            fn(k, k, deg, a, b + 9, torch.ones((1, 2, 2), dtype=torch.bool))
        with pytest.raises(ValueError, match="kvpass: .* needs a bool take mask"):
            fn(k, k, deg, a, b, torch.ones((1, 2, 2)))
        with pytest.raises(ValueError, match=r"kvpass: .* needs deg of shape \(B=1, H=2, S=10\)"):
            fn(k, k, deg[:, :1], a, b, torch.ones((1, 2, 2), dtype=torch.bool))
    # untaken pairs are never read, whatever they hold
    take = torch.tensor([[[True, False], [False, True]]])
    k2, _, _ = merge_scatter(k, k, deg, a, torch.where(take, b, 99), take)
    assert k2.shape == (1, 2, 9, 16)
    with pytest.raises(ValueError, match="kvpass: merge_scatter needs block_s to be a power of two"):
        merge_scatter(k, k, deg, a, b, take, block_s=48)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: merge_scatter needs Triton .* use merge_scatter_ref"):
        merge_scatter(k, k, deg, a, b, take)


# --------------------------------------------------------------------------------------------------
# merge_round
# --------------------------------------------------------------------------------------------------


def expected_merges(S, sinks, recent, chunk, ratio, max_merge):
    lo, hi = sinks, S - recent
    na = 0
    for start in range(lo, hi, chunk):  # counted slot by slot, independently of num_candidates
        end = min(start + chunk, hi)
        if end - start >= 2:
            na += len(range(start, end, 2))
    n = math.floor(ratio * na + 1e-9)  # floor(ratio * NA), robust to float64 rounding
    return n if max_merge is None else min(n, max_merge)


@given(p=merge_round_problems(max_s=140), rounds=st.integers(1, 3))
def test_merge_round_properties(p: MergeRoundProblem, rounds: int):
    """Provenance: v holds a one-hot of each original token, so after any number of rounds
    ``deg * v`` is the 0/1 membership matrix of every slot. Checks per round: the length shrinks by
    floor(ratio * NA) (capped by max_merge); sinks and recent slots are bit-identical and in place;
    every new slot is made of old slots of one chunk (one B slot plus A slots); slot order is kept;
    merged keys are the degree-weighted mean of their tokens; degrees sum to the token count."""
    gen = torch.Generator().manual_seed(p.seed)
    k = make_strided(make_centroid_keys(p.B, p.H, p.S, p.D, p.key_mode, p.dtype, gen), p.layout)
    v = torch.eye(p.S).expand(p.B, p.H, p.S, p.S)
    deg = torch.ones((p.B, p.H, p.S))
    k_orig = k.float()
    member = torch.eye(p.S).expand(p.B, p.H, p.S, p.S).bool()  # (slot, original token)
    for i in range(rounds):
        S = k.shape[2]
        r = merge_round(k, v, deg, p.sinks, p.recent, p.chunk, p.ratio, p.max_merge)
        assert isinstance(r, MergeResult)
        n = expected_merges(S, p.sinks, p.recent, p.chunk, p.ratio, p.max_merge)
        assert r.merged == n and r.k.shape == (p.B, p.H, S - n, p.D) and r.deg.shape == (p.B, p.H, S - n)
        assert math.isfinite(r.mean_sim) and not r.head_sim.isnan().any()
        if n == 0:
            assert r.k is k and r.v is v and torch.equal(r.deg, deg) and r.mean_sim == 0.0
            continue
        assert -1.0 - 1e-5 <= r.mean_sim <= 1.0 + 1e-5
        s, t = p.sinks, p.recent
        for new, old in ((r.k, k), (r.v, v), (r.deg, deg)):
            assert torch.equal(new[:, :, :s], old[:, :, :s])
            assert torch.equal(new[:, :, new.shape[2] - t :], old[:, :, S - t :])
        torch.testing.assert_close(r.deg.sum(-1), torch.full((p.B, p.H), float(p.S)))

        new_member = (r.v * r.deg[..., None]).round()
        torch.testing.assert_close(r.v * r.deg[..., None], new_member, atol=1e-4, rtol=0)
        new_member = new_member.bool()
        assert (new_member.sum(2) == 1).all(), "every token in exactly one slot"
        torch.testing.assert_close(new_member.sum(-1).float(), r.deg)
        # old slots composing each new slot: (B, H, S_new, S_old), a partition of the old slots
        parts = (new_member.float() @ member.float().transpose(-1, -2)) > 0
        assert (parts.sum(2) == 1).all()
        old = torch.arange(S)
        cand = (old >= p.sinks) & (old < S - p.recent)
        chunk_id = torch.where(cand, (old - p.sinks) // p.chunk, -1 - old)  # sinks/recent: own ids
        odd = cand & ((old - p.sinks) % p.chunk % 2 == 1)  # B slots of this round
        group = parts.sum(-1)  # (B, H, S_new) old slots per new slot
        grouped = group > 1
        assert (parts & ~cand)[grouped].sum() == 0, "sinks and recent slots never merge"
        ids = torch.where(parts, chunk_id, 0)
        lo_id = torch.where(parts, chunk_id, S).amin(-1)
        assert (torch.where(parts, ids == lo_id[..., None], True)).all(), "a merge crossed a chunk"
        anchor = parts & (odd | ~grouped[..., None])  # the B slot of a group, or the lone slot
        assert (anchor.sum(-1) == 1).all(), "one B slot per merged group"
        pos = anchor.float().argmax(-1)  # (B, H, S_new)
        assert (pos[..., 1:] > pos[..., :-1]).all(), "slots keep their order"
        if i == 0:  # merged keys: degree-weighted mean of the original tokens they hold
            w = new_member.float()
            mean = (w @ k_orig) / w.sum(-1, keepdim=True)
            assert_close(r.k[grouped], mean[grouped], p.dtype)
        k, v, deg, member = r.k, r.v, r.deg, new_member


@given(p=merge_round_problems(max_s=160, chunks=st.sampled_from([3, 8, 33, 64, 256])))
def test_merge_round_triton_matches_ref(p: MergeRoundProblem):
    gen = torch.Generator().manual_seed(p.seed)
    k = make_strided(make_centroid_keys(p.B, p.H, p.S, p.D, p.key_mode, p.dtype, gen), p.layout)
    v = make_strided(torch.randn((p.B, p.H, p.S, p.D), generator=gen).to(p.dtype), p.layout)
    deg = torch.randint(1, 4, (p.B, p.H, p.S), generator=gen).float()
    a = merge_round(k, v, deg, p.sinks, p.recent, p.chunk, p.ratio, p.max_merge, use_triton=True)
    b = merge_round(k, v, deg, p.sinks, p.recent, p.chunk, p.ratio, p.max_merge, use_triton=False)
    assert a.merged == b.merged
    assert math.isclose(a.mean_sim, b.mean_sim, abs_tol=1e-5)
    torch.testing.assert_close(a.head_sim, b.head_sim, atol=1e-5, rtol=0)
    # near-ties (< 1e-3 apart) may legitimately pair differently; random keys have none in practice
    assert torch.equal(a.deg, b.deg)
    assert_close(a.k, b.k, p.dtype)
    assert_close(a.v, b.v, p.dtype)


def test_merge_round_nothing_to_do():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((2, 2, 50, 16), generator=gen)
    deg = torch.ones((2, 2, 50))
    for kwargs in (
        dict(sinks=4, recent=8, chunk=16, ratio=0.0),  # ratio 0: Full's tokens
        dict(sinks=4, recent=8, chunk=16, ratio=1.0, max_merge=0),
        dict(sinks=30, recent=19, chunk=16, ratio=1.0),  # one candidate
        dict(sinks=30, recent=30, chunk=16, ratio=1.0),  # sinks and recent overlap
        dict(sinks=0, recent=0, chunk=16, ratio=0.03),  # floor(0.03 * 25) = 0
    ):
        for use_triton in (False, True):
            r = merge_round(k, k, deg, use_triton=use_triton, **kwargs)
            assert r.k is k and r.v is k and torch.equal(r.deg, deg) and r.merged == 0 and r.mean_sim == 0.0
    r = merge_round(k, k, deg, 0, 0, 50, 1.0, max_merge=3)
    assert r.merged == 3 and r.k.shape == (2, 2, 47, 16)
    k98 = torch.randn((1, 1, 98, 16), generator=gen)
    assert (1.0 / 49) * 49 < 1.0  # float64: a plain floor would merge nothing
    r = merge_round(k98, k98, torch.ones((1, 1, 98)), 0, 0, 98, 1.0 / 49)
    assert r.merged == 1
    with pytest.raises(ValueError, match="kvpass: merge_round needs 0 <= ratio <= 1"):
        merge_round(k, k, deg, 0, 0, 16, 1.5)
    with pytest.raises(ValueError, match="kvpass: merge_round needs chunk >= 2"):
        merge_round(k, k, deg, 0, 0, 1, 0.5)
    with pytest.raises(ValueError, match="kvpass: merge_round needs sinks >= 0"):
        merge_round(k, k, deg, -1, 0, 16, 0.5)
    with pytest.raises(ValueError, match="kvpass: merge_round needs max_merge >= 0"):
        merge_round(k, k, deg, 0, 0, 16, 0.5, max_merge=-1)


# --------------------------------------------------------------------------------------------------
# centroid_decode_attention
# --------------------------------------------------------------------------------------------------


@given(
    dtype=DTYPES,
    B=st.integers(1, 2),
    H_kv=st.integers(1, 3),
    G=GQA_GROUPS,
    D=HEAD_DIMS,
    n=st.integers(1, 60),
    int_deg=st.booleans(),
    layout=LAYOUTS,
    seed=SEEDS,
)
def test_attention_on_merged_duplicates_equals_originals(dtype, B, H_kv, G, D, n, int_deg, layout, seed):
    """n distinct tokens per head, token i repeated c_i times (1..4) in the original cache: one slot
    per token with degree c_i and the log N bias gives the originals' attention exactly."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((B, H_kv * G, D), generator=gen).to(dtype)
    k = make_strided(torch.randn((B, H_kv, n, D), generator=gen).to(dtype), layout)
    v = make_strided(torch.randn((B, H_kv, n, D), generator=gen).to(dtype), layout)
    counts = torch.randint(1, 5, (B, H_kv, n), generator=gen)
    deg = counts if int_deg else counts.float()
    expected = torch.empty((B, H_kv * G, D))
    for b in range(B):
        for h in range(H_kv):
            kk = k[b, h].float().repeat_interleave(counts[b, h], dim=0)
            vv = v[b, h].float().repeat_interleave(counts[b, h], dim=0)
            qq = q[b, h * G : (h + 1) * G].float()
            expected[b, h * G : (h + 1) * G] = F.scaled_dot_product_attention(qq[:, None], kk, vv)[:, 0]
    for use_triton in (False, True):
        out = centroid_decode_attention(q, k, v, deg, use_triton=use_triton)
        assert out.dtype == dtype and out.shape == (B, H_kv * G, D)
        assert_close(out, expected, dtype)


@given(
    dtype=DTYPES,
    H_kv=st.integers(1, 3),
    G=GQA_GROUPS,
    D=HEAD_DIMS,
    pairs=st.integers(1, 40),
    sinks=st.integers(0, 8),
    recent=st.integers(0, 8),
    chunk=st.sampled_from([2, 6, 16, 64, 256]),
    ratio=st.floats(0.0, 1.0),
    use_triton=st.booleans(),
    seed=SEEDS,
)
def test_merge_round_on_duplicated_cache_keeps_attention(
    dtype, H_kv, G, D, pairs, sinks, recent, chunk, ratio, use_triton, seed
):
    """Candidates come as identical (key, value) pairs at offsets (2j, 2j+1): every A slot's best match
    is its twin (similarity 1), so any merge is exact and attention after the round equals attention
    over the original cache (all degrees 1)."""
    gen = torch.Generator().manual_seed(seed)
    S = sinks + 2 * pairs + recent
    q = torch.randn((1, H_kv * G, D), generator=gen).to(dtype)
    k = torch.randn((1, H_kv, S, D), generator=gen).to(dtype)
    v = torch.randn((1, H_kv, S, D), generator=gen).to(dtype)
    twin = torch.arange(sinks + 1, sinks + 2 * pairs, 2)
    k[:, :, twin] = k[:, :, twin - 1]
    v[:, :, twin] = v[:, :, twin - 1]
    deg = torch.ones((1, H_kv, S))
    r = merge_round(k, v, deg, sinks, recent, chunk, ratio, use_triton=use_triton)
    assert r.merged == expected_merges(S, sinks, recent, chunk, ratio, None)
    if r.merged:
        assert r.mean_sim > 1 - 1e-5 and int(r.deg.max()) == 2
    before = centroid_decode_attention(q, k, v, deg, use_triton=use_triton)
    after = centroid_decode_attention(q, r.k, r.v, r.deg, use_triton=use_triton)
    assert_close(after, before, dtype)
    assert_close(after, weighted_attention(q, k, v, deg), dtype)


@given(
    dtype=DTYPES,
    B=st.integers(1, 2),
    H_kv=st.integers(1, 3),
    G=GQA_GROUPS,
    D=HEAD_DIMS,
    S=st.integers(1, 200),
    layout=LAYOUTS,
    seed=SEEDS,
)
def test_degree_zero_padding_changes_nothing(dtype, B, H_kv, G, D, S, layout, seed):
    """Heads of different lengths in one padded layout: slots of degree 0 hold large garbage and are
    ignored; a head with no live slot returns zeros. Kernel and reference against the loop formula."""
    gen = torch.Generator().manual_seed(seed)
    big = 1e4 if dtype == torch.float32 else 3e3
    q = torch.randn((B, H_kv * G, D), generator=gen).to(dtype)
    k = torch.randn((B, H_kv, S, D), generator=gen)
    v = torch.randn((B, H_kv, S, D), generator=gen)
    deg = 1.0 + 3.0 * torch.rand((B, H_kv, S), generator=gen)
    pad = torch.rand((B, H_kv, S), generator=gen) < 0.4
    pad[B - 1, H_kv - 1] = torch.rand(S, generator=gen) < 2.0  # an empty head
    deg[pad] = 0.0
    k[pad] = big * torch.randn((int(pad.sum()), D), generator=gen)
    v[pad] = big * torch.randn((int(pad.sum()), D), generator=gen)
    k, v = make_strided(k.to(dtype), layout), make_strided(v.to(dtype), layout)
    expected = weighted_attention(q, k, v, deg)
    for use_triton in (False, True):
        out = centroid_decode_attention(q, k, v, deg, use_triton=use_triton)
        assert not out.isnan().any()
        assert_close(out, expected, dtype)
        assert (out[B - 1, (H_kv - 1) * G :] == 0).all()
    # the same heads without their padding slots (the kernel equals the formula above)
    out = centroid_decode_attention(q, k, v, deg)
    for b in range(B):
        for h in range(H_kv - 1 if b == B - 1 else H_kv):
            live = ~pad[b, h]
            sub = centroid_decode_attention(
                q[b : b + 1, h * G : (h + 1) * G], k[b : b + 1, h : h + 1, live],
                v[b : b + 1, h : h + 1, live], deg[b : b + 1, h : h + 1, live]
            )
            assert_close(out[b : b + 1, h * G : (h + 1) * G], sub, dtype)


@given(
    dtype=DTYPES,
    B=st.integers(1, 2),
    H_kv=st.integers(1, 3),
    G=GQA_GROUPS,
    D=HEAD_DIMS,
    S=st.integers(1, 300),
    int_deg=st.booleans(),
    layout=LAYOUTS,
    scale=st.sampled_from([None, 0.3]),
    seed=SEEDS,
)
def test_all_degrees_one_is_plain_attention(dtype, B, H_kv, G, D, S, int_deg, layout, scale, seed):
    """The same kernel serves Full: degree 1 everywhere is SDPA (enable_gqa)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((B, H_kv * G, D), generator=gen).to(dtype)
    k = make_strided(torch.randn((B, H_kv, S, D), generator=gen).to(dtype), layout)
    v = make_strided(torch.randn((B, H_kv, S, D), generator=gen).to(dtype), layout)
    deg = torch.ones((B, H_kv, S), dtype=torch.int64 if int_deg else torch.float32)
    expected = F.scaled_dot_product_attention(
        q.float()[:, :, None], k.float(), v.float(), scale=scale, enable_gqa=True
    )[:, :, 0]
    for use_triton in (False, True):
        out = centroid_decode_attention(q, k, v, deg, scale=scale, use_triton=use_triton)
        assert_close(out, expected, dtype)


@given(
    dtype=DTYPES,
    B=st.integers(1, 2),
    H_kv=st.integers(1, 3),
    G=GQA_GROUPS,
    D=HEAD_DIMS,
    S=st.integers(1, 300),
    layout=LAYOUTS,
    seed=SEEDS,
)
def test_attention_kernel_matches_ref(dtype, B, H_kv, G, D, S, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((B, H_kv * G, D), generator=gen).to(dtype)
    k = make_strided(torch.randn((B, H_kv, S, D), generator=gen).to(dtype), layout)
    v = make_strided(torch.randn((B, H_kv, S, D), generator=gen).to(dtype), layout)
    deg = torch.randint(0, 30, (B, H_kv, S), generator=gen).float()
    out = centroid_decode_attention(q, k, v, deg, use_triton=True)
    assert_close(out, centroid_decode_attention(q, k, v, deg, use_triton=False), dtype)
    assert_close(out, weighted_attention(q, k, v, deg), dtype)


def test_attention_dispatch_and_errors(monkeypatch):
    q = torch.randn((1, 4, 16))
    k = torch.randn((1, 2, 10, 16))
    deg = torch.ones((1, 2, 10))
    with pytest.raises(ValueError, match=r"kvpass: centroid_decode_attention needs deg of shape"):
        centroid_decode_attention(q, k, k, deg[:, :, :9])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = centroid_decode_attention(q, k, k, deg)  # None on CPU: the torch reference, no Triton needed
    assert out.shape == (1, 4, 16)
    with pytest.raises(RuntimeError, match="kvpass: sparse_decode_attention needs Triton"):
        centroid_decode_attention(q, k, k, deg, use_triton=True)

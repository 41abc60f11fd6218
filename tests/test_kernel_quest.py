"""Quest (arXiv 2406.10774) page metadata and page scores: the Triton scorer (run by the interpreter on
CPU) against its torch reference, and the references against naive per-page loops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpass.kernels.quest import (
    BOUNDS_DTYPE,
    quest_bounds,
    quest_page_minmax_ref,
    quest_page_scores,
    quest_page_scores_ref,
    quest_update_minmax_,
)
from strategies import (
    DTYPES,
    LAYOUTS,
    SEEDS,
    TOL_SCORES,
    PageUpdateProblem,
    QuestProblem,
    make_quest_inputs,
    make_strided,
    page_update_problems,
    quest_problems,
)


def naive_scores(q, kmin, kmax, num_pages=None):
    """The paper's formula, one (b, h, p) at a time."""
    B, H_q, D = q.shape
    H_kv, P = kmin.shape[1], kmin.shape[2]
    G = H_q // H_kv
    num_pages = P if num_pages is None else num_pages
    out = torch.full((B, H_q, P), float("-inf"))
    for b in range(B):
        for h in range(H_q):
            qh = q[b, h].float()
            for p in range(num_pages):
                lo, hi = kmin[b, h // G, p].float(), kmax[b, h // G, p].float()
                out[b, h, p] = torch.maximum(qh * hi, qh * lo).sum()
    return out


def naive_minmax(k, page_size, length):
    P = -(-length // page_size)
    pages = [k[:, :, p * page_size : min((p + 1) * page_size, length)].float() for p in range(P)]
    return torch.stack([x.amin(2) for x in pages], 2), torch.stack([x.amax(2) for x in pages], 2)


def assert_scores_close(actual, expected):
    atol, rtol = TOL_SCORES
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)  # -inf must match -inf


# --------------------------------------------------------------------------------------------------
# Page min/max
# --------------------------------------------------------------------------------------------------


@given(
    dtype=DTYPES,
    S=st.integers(1, 120),
    page_size=st.sampled_from([1, 2, 5, 16, 64]),
    cut=st.integers(0, 120),
    layout=LAYOUTS,
    seed=SEEDS,
)
def test_minmax_ref_matches_per_page_loop(dtype, S, page_size, cut, layout, seed):
    length = min(cut, S)  # includes length 0, length 1 and partial last pages
    gen = torch.Generator().manual_seed(seed)
    k = make_strided(torch.randn((2, 3, S, 8), generator=gen).to(dtype), layout)
    kmin, kmax = quest_page_minmax_ref(k, page_size, length)
    P = -(-length // page_size)
    assert kmin.shape == kmax.shape == (2, 3, P, 8)
    assert kmin.dtype == kmax.dtype == torch.float32
    if P:
        emin, emax = naive_minmax(k, page_size, length)
        assert torch.equal(kmin, emin) and torch.equal(kmax, emax)


def test_minmax_partial_last_page_ignores_tokens_past_length():
    k = torch.zeros((1, 1, 10, 2))
    k[0, 0, :, 0] = torch.arange(10.0)
    k[0, 0, 7:, 1] = 100.0  # beyond length: must not leak into page 1
    kmin, kmax = quest_page_minmax_ref(k, page_size=4, length=7)
    assert kmin[0, 0].tolist() == [[0.0, 0.0], [4.0, 0.0]]
    assert kmax[0, 0].tolist() == [[3.0, 0.0], [6.0, 0.0]]


def _run_updates(p: PageUpdateProblem):
    gen = torch.Generator().manual_seed(p.seed)
    total = p.prefix + sum(p.chunks)
    keys = torch.randn((p.B, p.H_kv, total, p.D), generator=gen).to(p.key_dtype)
    P_cap = -(-total // p.page_size) + p.spare_pages
    # stale garbage everywhere: pages opened by an update must not read it
    kmin = (torch.randn((p.B, p.H_kv, P_cap, p.D), generator=gen) - 50).to(p.dtype)
    kmax = (torch.randn((p.B, p.H_kv, P_cap, p.D), generator=gen) + 50).to(p.dtype)
    if p.prefix:
        mn, mx = quest_page_minmax_ref(keys, p.page_size, p.prefix)
        kmin[:, :, : mn.shape[2]] = quest_bounds(mn, p.dtype, up=False)
        kmax[:, :, : mx.shape[2]] = quest_bounds(mx, p.dtype, up=True)
    pos = p.prefix
    for t in p.chunks:
        quest_update_minmax_(kmin, kmax, keys[:, :, pos : pos + t], pos, p.page_size)
        pos += t
        n = -(-pos // p.page_size)
        if n:
            emin, emax = quest_page_minmax_ref(keys, p.page_size, pos)
            # rounding outward to the buffer dtype is monotone, so min/max commute with it: exact equality
            assert torch.equal(kmin[:, :, :n], quest_bounds(emin, p.dtype, up=False)), (pos, t)
            assert torch.equal(kmax[:, :, :n], quest_bounds(emax, p.dtype, up=True)), (pos, t)
            assert (kmin[:, :, :n].float() <= emin).all() and (kmax[:, :, :n].float() >= emax).all()


@given(p=page_update_problems())
def test_update_minmax_matches_recomputation(p: PageUpdateProblem):
    _run_updates(p)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_update_minmax_token_by_token_decode(page_size):
    _run_updates(
        PageUpdateProblem(
            dtype=torch.float32, key_dtype=torch.float16, B=1, H_kv=2, D=8, page_size=page_size,
            prefix=5, chunks=(1,) * 40, spare_pages=0, seed=3,
        )
    )


def test_update_minmax_errors():
    kmin = torch.zeros((1, 2, 3, 4))
    kmax = torch.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"kvpass: quest_update_minmax_ needs capacity for 4 pages"):
        quest_update_minmax_(kmin, kmax, torch.zeros((1, 2, 5, 4)), 10, 4)  # positions up to 15 -> 4 pages
    with pytest.raises(ValueError, match="kvpass: quest_update_minmax_ needs k_new of shape"):
        quest_update_minmax_(kmin, kmax, torch.zeros((1, 3, 1, 4)), 0, 4)
    with pytest.raises(ValueError, match="kvpass: quest_update_minmax_ needs kmin and kmax of one shape"):
        quest_update_minmax_(kmin, kmax[:, :1], torch.zeros((1, 2, 1, 4)), 0, 4)
    with pytest.raises(ValueError, match="kvpass: quest_page_minmax_ref needs 0 <= length <= S"):
        quest_page_minmax_ref(torch.zeros((1, 1, 5, 4)), 2, length=6)
    with pytest.raises(ValueError, match="kvpass: quest_page_minmax_ref needs page_size >= 1"):
        quest_page_minmax_ref(torch.zeros((1, 1, 5, 4)), 0)


# --------------------------------------------------------------------------------------------------
# Page scores
# --------------------------------------------------------------------------------------------------


@given(p=quest_problems(max_pages=12))
def test_scores_ref_matches_naive_formula(p: QuestProblem):
    q, kmin, kmax = make_quest_inputs(p)
    out = quest_page_scores_ref(q, kmin, kmax, p.num_pages)
    assert out.shape == (p.B, p.H_q, p.P)
    assert_scores_close(out, naive_scores(q, kmin, kmax, p.num_pages))


@given(p=quest_problems(), block_p=st.sampled_from([16, 128]))
def test_kernel_matches_ref(p: QuestProblem, block_p: int):
    q, kmin, kmax = make_quest_inputs(p)
    out = quest_page_scores(q, kmin, kmax, p.num_pages, block_p=block_p)
    assert out.shape == (p.B, p.H_q, p.P)
    assert not out.isnan().any()  # garbage (NaN/inf) in dead pages is never read
    assert_scores_close(out, quest_page_scores_ref(q, kmin, kmax, p.num_pages))


@given(
    S=st.integers(1, 200),
    page_size=st.sampled_from([1, 8, 16]),
    G=st.sampled_from([1, 4]),
    seed=SEEDS,
)
def test_kernel_on_real_metadata_bounds_every_key(S, page_size, G, seed):
    """End to end: the score of a page bounds q . k of every key in it (Quest's upper bound)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn((1, 2, S, 16), generator=gen)
    q = torch.randn((1, 2 * G, 16), generator=gen)
    kmin, kmax = quest_page_minmax_ref(k, page_size)
    scores = quest_page_scores(q, kmin, kmax)
    dots = torch.einsum("bhd,bhsd->bhs", q, k.repeat_interleave(G, dim=1))
    page_of = torch.arange(S) // page_size
    assert (dots <= scores[:, :, page_of] + 1e-4).all()
    if page_size == 1:  # a one-token page scores exactly q . k
        torch.testing.assert_close(scores, dots, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("D", [80, 256])
def test_kernel_head_dims_beyond_one_chunk(D):
    p = QuestProblem(
        q_dtype=torch.float16, meta_dtype=torch.float32, B=2, H_kv=2, G=3, P=37, num_pages=30, D=D,
        layout="s_slice", ordered=False, seed=1,
    )
    q, kmin, kmax = make_quest_inputs(p)
    out = quest_page_scores(q, kmin, kmax, 30)
    assert_scores_close(out, quest_page_scores_ref(q, kmin, kmax, 30))
    assert_scores_close(out, naive_scores(q, kmin, kmax, 30))


def test_zero_live_pages():
    q = torch.randn((1, 4, 16))
    kmin = torch.full((1, 2, 5, 16), float("nan"))
    for fn in (quest_page_scores, quest_page_scores_ref):
        out = fn(q, kmin, kmin, num_pages=0)
        assert out.shape == (1, 4, 5) and (out == float("-inf")).all()


@pytest.mark.parametrize("fn", [quest_page_scores, quest_page_scores_ref])
def test_scores_input_errors(fn):
    q = torch.randn((1, 6, 16))
    kmin = torch.randn((1, 4, 5, 16))
    with pytest.raises(ValueError, match="kvpass: .*H_q to be a multiple of H_kv"):
        fn(q, kmin, kmin)
    kmin = kmin[:, :3]
    with pytest.raises(ValueError, match=r"kvpass: .*0 <= num_pages <= P=5"):
        fn(q, kmin, kmin, num_pages=6)
    with pytest.raises(ValueError, match="kvpass: .*kmin and kmax of one shape"):
        fn(q, kmin, kmin[:, :, :4])
    with pytest.raises(ValueError, match=r"kvpass: .*D=16\) to match q"):
        fn(q, kmin[..., :8], kmin[..., :8])


def test_launcher_errors(monkeypatch):
    q = torch.randn((1, 2, 16))
    kmin = torch.randn((1, 1, 5, 16))
    with pytest.raises(ValueError, match="kvpass: quest_page_scores needs block_p to be a power of two"):
        quest_page_scores(q, kmin, kmin, block_p=24)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: .*use quest_page_scores_ref on CPU"):
        quest_page_scores(q, kmin, kmin)



# -- the bounds' storage: fp16, rounded outward -------------------------------------------------------
_EDGES = [0.0, -0.0, 1e-30, -1e-30, 6e-8, 65504.0, 65519.0, 65520.0, 7e4, 1e30, -65504.0, -65519.0, -7e4,
          float("inf"), float("-inf"), 1.0, 1.0 + 2.0 ** -12, -(1.0 + 2.0 ** -12), 3.14159, -2.71828]


@given(x=st.lists(st.one_of(st.floats(width=32, allow_nan=False), st.sampled_from(_EDGES)), min_size=1,
                  max_size=40),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_bounds_round_outward_to_the_nearest_value_past(x, dtype):
    """A stored max is the least ``dtype`` value >= the fp32 one (a min: the greatest <=): still a bound,
    and no looser than one step of the narrow type (past its range: +-inf for the max, +-65504 within)."""
    v = torch.tensor(x, dtype=torch.float32)
    up, down = quest_bounds(v, dtype, up=True), quest_bounds(v, dtype, up=False)
    assert up.dtype == down.dtype == dtype
    assert (up.float() >= v).all() and (down.float() <= v).all()
    inf = torch.tensor(float("inf"), dtype=dtype)
    below, above = torch.nextafter(up, -inf), torch.nextafter(down, inf)  # one step back toward v
    assert ((below.float() < v) | (up == -inf)).all() and ((above.float() > v) | (down == inf)).all()
    exact = v.to(dtype).float() == v
    assert torch.equal(up[exact], v.to(dtype)[exact]) and torch.equal(down[exact], v.to(dtype)[exact])
    assert torch.equal(quest_bounds(v, torch.float32, up=True), v)  # a dtype that holds it: unchanged


# -- the CPU decode step's page choice in C ------------------------------------------------------------
def _half_meta(kmax, kmin):
    """Rows ``[max | min]`` as the runtime stores them: fp16, rounded outward."""
    return torch.cat([quest_bounds(kmax, BOUNDS_DTYPE, up=True), quest_bounds(kmin, BOUNDS_DTYPE, up=False)], -1)


def _top_inputs(b, h_kv, g, d, cap, integral, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * g, d, generator=gen)
    keys = torch.randn(b, h_kv, cap, 2, d, generator=gen)
    if integral:  # small integers: every bound is exact in fp16, so ties are real and broken by page
        q, keys = q.mul(2).round(), keys.mul(2).round()
    return q, _half_meta(keys.amax(3), keys.amin(3))


@given(
    b=st.integers(1, 2), h_kv=st.integers(1, 3), g=st.sampled_from([1, 3]), d=st.sampled_from([4, 64]),
    scored=st.integers(0, 40), n=st.integers(0, 45), gqa=st.sampled_from(["sum", "max"]),
    integral=st.booleans(), seed=SEEDS,
)
def test_top_pages_cpu_matches_ref(b, h_kv, g, d, scored, n, gqa, integral, seed):
    from kvpass.kernels.quest import quest_top_pages_cpu, quest_top_pages_ref

    q, meta = _top_inputs(b, h_kv, g, d, scored + 3, integral, seed)
    got = quest_top_pages_cpu(q, meta, scored, n, gqa)
    want = quest_top_pages_ref(q, meta, scored, n, gqa)
    assert got.shape == want.shape == (b, h_kv, min(n, scored) + 1)
    assert (got[..., -1] == scored).all()  # the newest page, always last
    if integral:
        assert torch.equal(got, want)  # exact bounds: the same pages, ties to the lower page
        return
    # fp32 sums of the bounds against float64 ones: a near-tie may rank either way, never a clearly worse page
    qg = q.reshape(b, h_kv, g, d).double()
    qq = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)
    per_q = qq @ meta[:, :, :scored].double().transpose(-1, -2)
    bound = per_q.sum(2) if gqa == "sum" else per_q.amax(2)
    for bi in range(b):
        for hi in range(h_kv):
            chosen = set(got[bi, hi, :-1].tolist())
            assert len(chosen) == min(n, scored) and got[bi, hi, :-1].tolist() == sorted(chosen)
            rest = [p for p in range(scored) if p not in chosen]
            if chosen and rest:
                worst = min(float(bound[bi, hi, p]) for p in chosen)
                best_left = max(float(bound[bi, hi, p]) for p in rest)
                assert worst >= best_left - 1e-4 * (1 + abs(best_left))


def _few_values_inputs(b, h_kv, g, d, scored, levels, seed):
    """Bounds and queries in ``{-1, 0, 1}`` (``levels`` 3) or all zero queries (``levels`` 1): exact sums
    of a few distinct values, so most pages tie with others."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (b, h_kv * g, d), generator=gen).float() * (levels > 1)
    keys = torch.randint(-1, 2, (b, h_kv, scored + 3, 2, d), generator=gen).float()
    return q, _half_meta(keys.amax(3), keys.amin(3))


@given(
    b=st.integers(1, 2), h_kv=st.integers(1, 2), g=st.sampled_from([1, 3]), d=st.sampled_from([4, 64]),
    scored=st.integers(41, 1500), frac=st.floats(0.0, 1.2), levels=st.sampled_from([1, 3]),
    gqa=st.sampled_from(["sum", "max"]), seed=SEEDS,
)
def test_top_pages_cpu_many_pages_and_ties_match_ref(b, h_kv, g, d, scored, frac, levels, gqa, seed):
    """The C choice scores every page, finds the n-th best bound and takes the pages above it, then the
    first ones equal to it: with hundreds of pages and few distinct bounds (all equal for a zero query)
    it takes exactly the reference's pages, ties to the lower page."""
    from kvpass.kernels.quest import quest_top_pages_cpu, quest_top_pages_ref

    n = int(frac * scored)
    q, meta = _few_values_inputs(b, h_kv, g, d, scored, levels, seed)
    got = quest_top_pages_cpu(q, meta, scored, n, gqa)
    assert torch.equal(got, quest_top_pages_ref(q, meta, scored, n, gqa))
    if levels == 1 and 0 < n < scored:  # every bound 0: the first n pages
        assert torch.equal(got[..., :-1], torch.arange(n).expand(b, h_kv, n))


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_top_pages_cpu_sorts_where_the_partition_rounds_run_out(rounds):
    """Past ``SELECT_ROUNDS`` partition rounds (inputs made to defeat the pivot) the C choice sorts what is
    left: the same pages. A build with 0, 1 or 2 rounds reaches that fallback on ordinary inputs."""
    import ctypes

    from kvpass.kernels import native
    from kvpass.kernels.quest import QuestArgs, QuestStep, _top_lib

    assert "#define SELECT_ROUNDS 64" in (native.CSRC / "quest.c").read_text()  # the default a build overrides
    few = native.function("quest", "kvpass_quest_select", [ctypes.POINTER(QuestArgs)],
                          defines={"SELECT_ROUNDS": rounds})
    assert few is not None and few is not _top_lib()  # a library of its own
    for seed, (scored, n, levels) in enumerate([(700, 63, 3), (300, 150, 1), (513, 1, 3), (90, 89, 3)]):
        q, meta = _few_values_inputs(2, 3, 3, 64, scored, levels, seed)
        q = q + torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)) * (seed % 2)  # some distinct
        length = (scored + 1) * 16
        want = QuestStep(meta, None, 16, 0).select(q, length, n, n)
        step = QuestStep(meta, None, 16, 0)
        step._fn = few
        got = step.select(q, length, n, n)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@given(scored=st.integers(1, 40), n=st.integers(1, 45), gqa=st.sampled_from(["sum", "max"]), seed=SEEDS)
def test_top_pages_torch_path_chooses_the_same_pages(scored, n, gqa, seed):
    # the torch path (where C is not built) picks the same set; only the order differs (topk's)
    from kvpass.kernels.quest import quest_top_pages_cpu, quest_top_pages_torch

    q, meta = _top_inputs(2, 3, 3, 64, scored + 1, False, seed)
    got = quest_top_pages_torch(q, meta, scored, n, gqa)
    want = quest_top_pages_cpu(q, meta, scored, n, gqa)
    assert torch.equal(got[..., -1], want[..., -1])
    same = (got[..., :-1].sort(-1).values == want[..., :-1]).all(-1)
    if not bool(same.all()):  # only a near-tie (fp32 bounds summed in another order) may differ
        qg = q.reshape(2, 3, 3, 64).double()
        qq = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)
        per_q = qq @ meta[:, :, :scored].double().transpose(-1, -2)
        bound = per_q.sum(2) if gqa == "sum" else per_q.amax(2)
        a, b = bound.gather(2, got[..., :-1]).sum(-1), bound.gather(2, want[..., :-1]).sum(-1)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("big", [1e5, -1e5, 65520.0])
@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_a_key_past_fp16s_range_makes_its_page_taken(big, gqa):
    """A key past fp16's range stores an infinite bound; ``0 * inf`` (a query channel of the other sign, or
    zero) would make the score NaN: every path counts it +inf, so the page is taken, never lost."""
    from kvpass.kernels.quest import quest_select_torch, quest_top_pages_cpu, quest_top_pages_ref, quest_top_pages_torch

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 12, 4, 8, generator=gen)
    keys[0, 1, 5, 2, 3] = big
    meta = _half_meta(keys.amax(3), keys.amin(3))
    assert meta[0, 1, 5].isinf().any()
    q = torch.randn(1, 6, 8, generator=gen)
    q[0, :, 3] = 0.0  # the channel's products are 0 * inf for every query
    got = quest_top_pages_cpu(q, meta, 11, 2, gqa)
    assert torch.equal(got, quest_top_pages_ref(q, meta, 11, 2, gqa))
    assert 5 in got[0, 1].tolist()
    assert 5 in quest_top_pages_torch(q, meta, 11, 2, gqa)[0, 1].tolist()
    assert 5 in quest_select_torch(q, meta, None, 12 * 4, 4, 12, 2, 2, gqa)[0][0, 1].tolist()
    for scores in (quest_page_scores_ref(q, meta[..., 8:], meta[..., :8], 11),
                   quest_page_scores(q, meta[..., 8:], meta[..., :8], 11, block_p=16)):  # Triton, interpreted
        assert torch.equal(scores[0, 3:, 5], torch.full((3,), float("inf")))
        assert not scores.isnan().any()


def test_top_pages_cpu_errors():
    from kvpass.kernels.quest import quest_top_pages_cpu

    q, meta = _top_inputs(1, 1, 3, 8, 5, False, 0)
    with pytest.raises(ValueError, match="kvpass: quest_top_pages_cpu needs"):
        quest_top_pages_cpu(q, meta, 5, 2)  # P_cap must exceed the scored pages (the newest is one more)
    with pytest.raises(ValueError, match="gqa 'sum' or 'max'"):
        quest_top_pages_cpu(q, meta, 3, 2, gqa="mean")
    with pytest.raises(ValueError, match="kvpass: quest_top_pages_cpu needs"):
        quest_top_pages_cpu(q.half(), meta, 3, 2)


# -- the choice for a left-padded batch (rows that start late), in C -----------------------------------
@given(
    b=st.integers(1, 3), h_kv=st.integers(1, 2), g=st.sampled_from([1, 3]), d=st.sampled_from([4, 16]),
    page=st.sampled_from([1, 2, 4]), length=st.integers(1, 48), budget=st.integers(2, 24),
    shared=st.booleans(), gqa=st.sampled_from(["sum", "max"]), integral=st.booleans(), seed=SEEDS,
)
def test_select_rows_cpu_matches_each_row_alone(b, h_kv, g, d, page, length, budget, shared, gqa, integral,
                                                seed):
    """Rows starting at any position (left padding; a mask shared by the batch gives one ``first``): the
    C choice equals the reference row by row, lists only the row's own positions, always its newest
    page, every position of a row that fits the budget, and at most the budget's pages otherwise."""
    from kvpass.kernels.quest import quest_select_cpu, quest_select_ref, quest_select_torch

    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, length, (1 if shared else b,), generator=gen)
    pmax = -(-length // page)
    q, meta = _top_inputs(b, h_kv, g, d, pmax + 1, integral, seed)
    n = max(budget // page - 1, 0)
    width = max(n, -(-budget // page) - 1)
    pages, idx = quest_select_cpu(q, meta, first, length, page, budget, n, width, gqa)
    rp, ri = quest_select_ref(q, meta, first, length, page, budget, n, width, gqa)
    assert pages.shape == rp.shape == (b, h_kv, width + 1) and idx.shape == (b, h_kv, (width + 1) * page)
    if integral:
        assert torch.equal(pages, rp) and torch.equal(idx, ri)
    tp, ti = quest_select_torch(q, meta, first, length, page, budget, n, width, gqa)
    assert torch.equal(tp.sort(-1).values.ne(-1).sum(-1), pages.ne(-1).sum(-1))  # as many pages
    for bi in range(b):
        f = int(first.expand(b)[bi])
        own = length - f
        for hi in range(h_kv):
            row = idx[bi, hi][idx[bi, hi] >= 0]
            assert ((row >= f) & (row < length)).all() and row.unique().numel() == row.numel()
            assert (length - 1) in row.tolist()  # the newest token's page
            if own <= budget:
                assert torch.equal(row.sort().values, torch.arange(f, length))
            else:
                assert row.numel() <= (n + 1) * page
                assert pages[bi, hi].ne(-1).sum() == min(n, -(-own // page) - 1) + 1
            if integral:
                # exact bounds: the torch path takes pages of the same bounds (topk breaks ties its own way)
                qg = q[bi].reshape(h_kv, g, d)[hi].double()
                qq = torch.cat([qg.clamp(min=0), qg.clamp(max=0)], dim=-1)
                per_q = qq @ meta[bi, hi].double().T
                bound = per_q.sum(0) if gqa == "sum" else per_q.amax(0)
                got_p, want_p = tp[bi, hi][tp[bi, hi] >= 0], pages[bi, hi][pages[bi, hi] >= 0]
                assert torch.equal(bound[got_p].sort().values, bound[want_p].sort().values)


@given(
    b=st.integers(1, 3), h_kv=st.integers(1, 2), d=st.sampled_from([4, 16]), page=st.sampled_from([1, 2, 4]),
    length=st.integers(1, 48), budget=st.integers(2, 24), padded=st.booleans(), strided=st.booleans(),
    seed=SEEDS,
)
def test_select_cpu_merges_the_steps_key_as_torch_does(b, h_kv, d, page, length, budget, padded, strided, seed):
    """``k_new``: the step's key merged into each row's newest page inside the C call leaves the same
    metadata as :func:`quest_fold_key_` in torch, bit for bit, and the same choice as merging first;
    a key the C call cannot read (strided last dim) is merged in torch first."""
    from kvpass.kernels.quest import quest_fold_key_, quest_select_cpu

    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, length, (b,), generator=gen) if padded else None
    pmax = -(-length // page)
    q, meta = _top_inputs(b, h_kv, 3, d, pmax + 1, False, seed)
    meta[:, :, pmax - 1 :, :d] = float("-inf")  # the newest page may be unopened (a page boundary)
    meta[:, :, pmax - 1 :, d:] = float("inf")
    keys = torch.randn(b, h_kv, d, 2, generator=gen)
    k_new = keys[..., 0] if strided else keys[..., 0].contiguous()
    n = max(budget // page - 1, 0)
    width = max(n, -(-budget // page) - 1)
    meta_before, want_meta = meta.clone(), meta.clone()
    quest_fold_key_(want_meta, k_new, first, length, page)
    want = quest_select_cpu(q, want_meta.clone(), first, length, page, budget, n, width)
    got = quest_select_cpu(q, meta, first, length, page, budget, n, width, k_new=k_new)
    assert torch.equal(meta, want_meta)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the merge is the page's max and min with the key rounded outward: the newest page bounds the key
    for bi in range(b):
        f = 0 if first is None else int(first[bi])
        p = (length - 1 - f) // page
        was = meta_before[bi, :, p].float()
        assert torch.equal(meta[bi, :, p, :d], quest_bounds(torch.maximum(was[:, :d], k_new[bi]), meta.dtype, True))
        assert (meta[bi, :, p, :d].float() >= k_new[bi]).all() and (meta[bi, :, p, d:].float() <= k_new[bi]).all()


@given(b=st.integers(1, 3), h_kv=st.integers(1, 2), page=st.sampled_from([1, 4, 16]), length=st.integers(1, 60),
       steps=st.integers(1, 4), padded=st.booleans(), gqa=st.sampled_from(["sum", "max"]), seed=SEEDS)
def test_quest_step_reads_the_key_in_the_cache_and_serves_step_after_step(b, h_kv, page, length, steps, padded,
                                                                         gqa, seed):
    """One QuestStep over several decode steps (the runtime's use): the key read in place from the cache
    ``(B, H_kv, S, D)`` at position ``length - 1`` gives the same metadata, pages and positions as
    :func:`quest_select_cpu` given that key as ``(B, H_kv, D)``, step after step, and the reference's
    choice on the merged metadata."""
    from kvpass.kernels.quest import QuestStep, quest_select_cpu, quest_select_ref

    gen = torch.Generator().manual_seed(seed)
    d, budget = 8, 12
    end = length + steps
    first = torch.randint(0, length, (b,), generator=gen) if padded else None
    _, meta = _top_inputs(b, h_kv, 3, d, -(-end // page) + 1, True, seed)  # integral: exact sums and ties
    meta[:, :, -(-length // page) - 1 :, :d] = float("-inf")
    meta[:, :, -(-length // page) - 1 :, d:] = float("inf")
    cache = torch.randint(-3, 4, (b, h_kv, end + 3, d), generator=gen).float()  # a capacity past the length
    want_meta = meta.clone()
    step = QuestStep(meta, first, page, budget, gqa)
    for t in range(length, end):
        q = torch.randint(-2, 3, (b, h_kv * 3, 1, d), generator=gen).float()
        n = max(budget // page - 1, 0)
        width = max(n, -(-budget // page) - 1)
        want = quest_select_cpu(q, want_meta, first, t, page, budget, n, width, gqa,
                                k_new=cache[:, :, t - 1].contiguous())
        got = step.select(q, t, n, width, k_new=cache)
        assert step.holds(meta, first)
        assert torch.equal(meta, want_meta)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ref = quest_select_ref(q[:, :, 0], meta, first, t, page, budget, n, width, gqa)
        assert torch.equal(got[1], ref[1])


@given(b=st.integers(1, 3), h_kv=st.integers(1, 2), g=st.integers(1, 4), page=st.sampled_from([1, 4, 16]),
       length=st.integers(1, 60), padded=st.booleans(), strided=st.booleans(),
       gqa=st.sampled_from(["sum", "max"]), seed=SEEDS)
def test_quest_step_attends_what_it_selects_in_the_same_call(b, h_kv, g, page, length, padded, strided, gqa,
                                                             seed):
    """``select_attend`` (the runtime's steady step: selection and attention in one C call) gives the
    metadata, pages and positions of ``select`` on a copy, and the attention of the float64 reference over
    those positions; operands the C attention does not serve are left to the caller, untouched."""
    from kvpass.kernels.cpu_decode import available, cpu_decode_attention_ref
    from kvpass.kernels.quest import QuestStep

    assert available()  # the README's set-up builds the C kernels (tests/test_native.py)
    gen = torch.Generator().manual_seed(seed)
    d, budget = 8, 12
    first = torch.randint(0, length, (b,), generator=gen) if padded else None
    _, meta = _top_inputs(b, h_kv, 3, d, -(-length // page) + 1, False, seed)
    cap = length + 5
    k = torch.randn(b, h_kv, cap, 2 * d if strided else d, generator=gen)[..., :d]  # a row stride past D
    v = torch.randn(b, h_kv, cap, d, generator=gen)
    q = torch.randn(b, h_kv * g, 1, d, generator=gen)
    n = max(budget // page - 1, 0)
    width = max(n, -(-budget // page) - 1)
    want_meta = meta.clone()
    want = QuestStep(want_meta, first, page, budget, gqa).select(q, length, n, width, k_new=k)
    step = QuestStep(meta, first, page, budget, gqa)
    pages, idx, out = step.select_attend(q, length, n, width, k, v, 0.3, k_new=k)
    assert torch.equal(meta, want_meta)
    assert torch.equal(pages, want[0]) and torch.equal(idx, want[1])
    ref = cpu_decode_attention_ref(q[:, :, 0], k[:, :, :length], v[:, :, :length], idx, 0.3)
    assert out.shape == q.shape
    torch.testing.assert_close(out[:, :, 0], ref, rtol=1e-5, atol=1e-5)
    before = meta.clone()
    assert step.select_attend(q, length, n, width, k.double(), v.double(), 0.3, k_new=k) is None
    assert torch.equal(meta, before)  # refused before the key's merge


def test_quest_step_refusals():
    from kvpass.kernels.quest import QuestStep

    q, meta = _top_inputs(2, 1, 3, 8, 5, False, 0)
    with pytest.raises(ValueError, match="kvpass: a Quest CPU step needs fp16"):
        QuestStep(meta.float(), None, 4, 8)
    with pytest.raises(ValueError, match="kvpass: a Quest CPU step needs"):
        QuestStep(meta, torch.zeros(3, dtype=torch.int64), 4, 8)
    with pytest.raises(ValueError, match="kvpass: a Quest CPU step needs"):
        QuestStep(meta, None, 4, 8, gqa="mean")
    step = QuestStep(meta, None, 4, 8)
    assert not step.holds(meta.clone(), None)
    with pytest.raises(ValueError, match="kvpass: quest_select_cpu needs fp32"):
        step.select(q, 21, 1, 1)  # 6 pages do not fit meta's 5
    with pytest.raises(ValueError, match="kvpass: quest_select_cpu needs fp32"):
        step.select(q.double(), 12, 1, 1)
    with pytest.raises(ValueError, match="kvpass: quest_select_cpu needs fp32"):
        step.select(q[:1], 12, 1, 1)  # another batch


def test_select_rows_cpu_errors():
    from kvpass.kernels.quest import quest_select_cpu

    q, meta = _top_inputs(2, 1, 3, 8, 5, False, 0)
    with pytest.raises(ValueError, match="kvpass: quest_select_cpu needs first"):
        quest_select_cpu(q, meta, torch.zeros(3, dtype=torch.int64), 12, 4, 8, 1, 1)
    with pytest.raises(ValueError, match="kvpass: quest_select_cpu needs fp32"):
        quest_select_cpu(q, meta, None, 40, 4, 8, 1, 1)  # 10 pages do not fit meta's 5


@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_select_rows_cpu_split_over_threads_equals_one_thread(gqa):
    """Enough pairs and pages that the C choice splits the (row, KV head) pairs over two threads: the
    same pages and positions as on one thread, and the reference's on exact (integral) bounds."""
    from kvpass.kernels.quest import quest_select_cpu, quest_select_ref

    b, h_kv, g, d, page, length, budget = 4, 3, 3, 64, 16, 4000, 512
    q, meta = _top_inputs(b, h_kv, g, d, -(-length // page) + 1, True, 5)
    first = torch.tensor([0, 17, 900, 3999])
    n = budget // page - 1
    args = (q, meta, first, length, page, budget, n, n, gqa)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = quest_select_cpu(*args)
        torch.set_num_threads(1)
        one = quest_select_cpu(*args)
    finally:
        torch.set_num_threads(threads)
    ref = quest_select_ref(*args)
    for a, o, r in zip(two, one, ref):
        assert torch.equal(a, o) and torch.equal(a, r)

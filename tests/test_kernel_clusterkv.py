"""ClusterKV (arXiv 2412.03213): cosine k-means assignment, centroid update, the k-means driver and the
budgeted cluster selection. Triton kernels (run by the interpreter on CPU) against their torch
references, the references against naive formulas (float64 einsum, Python loops), and k-means
properties."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpass.kernels.clusterkv import (
    KMeans,
    centroid_update,
    centroid_update_ref,
    cosine_kmeans,
    kmeans_assign,
    kmeans_assign_ref,
    select_clusters,
    select_clusters_cpu,
    select_clusters_cpu_available,
    select_clusters_ref,
    cluster_scores,
    cluster_select_cpu,
    cluster_select_cpu_available,
    cluster_select_torch,
)
from strategies import DTYPES, HEAD_DIMS, LAYOUTS, SEEDS, make_strided

SIM_TOL = (1e-5, 1e-5)  # fp32 cosine similarities of unit vectors, whatever the key dtype
SUM_TOL = (5e-4, 1e-4)  # fp32 sums of up to a few hundred keys, added in any order (atomics)


def _keys(gen, B, H, N, D, dtype, layout, zero_frac=0.0):
    x = torch.randn((B, H, N, D), generator=gen) * (0.5 + 2 * torch.rand((B, H, N, 1), generator=gen))
    if zero_frac:
        x[torch.rand((B, H, N), generator=gen) < zero_frac] = 0.0
    return make_strided(x.to(dtype), layout)


def _small_strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Re-store a 3-D ``(B, H, X)`` tensor: contiguous, every other element, or (H, B, X) storage."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "strided":
        buf = torch.full((*x.shape[:2], 2 * x.shape[2]), -99, dtype=x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]
    assert layout == "hbx"
    return x.transpose(0, 1).contiguous().transpose(0, 1)


SMALL_LAYOUTS = st.sampled_from(["contiguous", "strided", "hbx"])


# --------------------------------------------------------------------------------------------------
# Assignment
# --------------------------------------------------------------------------------------------------


def naive_sims(keys, centroids):
    """(B, H, N, C) float64 cosine similarities with the 1e-6 norm floor (no F.cosine_similarity)."""
    x = keys.double()
    c = centroids.double()
    x = x / x.pow(2).sum(-1, keepdim=True).sqrt().clamp(min=1e-6)
    c = c / c.pow(2).sum(-1, keepdim=True).sqrt().clamp(min=1e-6)
    return torch.einsum("bhnd,bhcd->bhnc", x, c)


def naive_assign(keys, centroids):
    sim = naive_sims(keys, centroids)
    best = sim.amax(-1)
    C = sim.shape[-1]
    labels = torch.where(sim == best[..., None], torch.arange(C), C).amin(-1)  # lowest maximal c
    return labels, best, sim


def top2_gap(sim):
    if sim.shape[-1] < 2:
        return torch.full(sim.shape[:-1], float("inf"), dtype=sim.dtype)
    t = sim.topk(2, dim=-1).values
    return t[..., 0] - t[..., 1]


@st.composite
def assign_problems(draw, max_n=300, max_c=40):
    return {
        "dtype": draw(DTYPES),
        "B": draw(st.integers(1, 2)),
        "H": draw(st.integers(1, 3)),
        "N": draw(st.integers(1, max_n)),
        "C": draw(st.one_of(st.just(1), st.integers(1, max_c))),
        "D": draw(HEAD_DIMS),
        "layout": draw(LAYOUTS),
        "c_layout": draw(LAYOUTS),
        "zero_frac": draw(st.sampled_from([0.0, 0.1])),
        "seed": draw(SEEDS),
    }


def make_assign_inputs(p):
    gen = torch.Generator().manual_seed(p["seed"])
    keys = _keys(gen, p["B"], p["H"], p["N"], p["D"], p["dtype"], p["layout"], p["zero_frac"])
    cen = make_strided(torch.randn((p["B"], p["H"], p["C"], p["D"]), generator=gen) * 3, p["c_layout"])
    return keys, cen


@given(p=assign_problems(max_n=120))
def test_assign_ref_matches_naive(p):
    keys, cen = make_assign_inputs(p)
    labels, sim = kmeans_assign_ref(keys, cen)
    assert labels.shape == sim.shape == (p["B"], p["H"], p["N"])
    assert labels.dtype == torch.int64 and sim.dtype == torch.float32
    e_labels, e_best, e_sim = naive_assign(keys, cen)
    torch.testing.assert_close(sim.double(), e_best, atol=SIM_TOL[0], rtol=SIM_TOL[1])
    clear = top2_gap(e_sim) > 1e-5
    assert torch.equal(labels[clear], e_labels[clear])
    zero = keys.float().abs().sum(-1) == 0
    assert (labels[zero] == 0).all() and (sim[zero] == 0).all()
    assert not sim.isnan().any()


@given(p=assign_problems(), block_c=st.sampled_from([16, 64]), block_n=st.sampled_from([None, 64]))
def test_assign_kernel_matches_ref(p, block_c, block_n):
    keys, cen = make_assign_inputs(p)
    labels, sim = kmeans_assign(keys, cen, block_n=block_n, block_c=block_c)
    r_labels, r_sim = kmeans_assign_ref(keys, cen)
    assert labels.dtype == torch.int64 and sim.dtype == torch.float32
    torch.testing.assert_close(sim, r_sim, atol=SIM_TOL[0], rtol=SIM_TOL[1])
    clear = top2_gap(naive_sims(keys, cen)) > 1e-3
    assert torch.equal(labels[clear], r_labels[clear])
    zero = keys.float().abs().sum(-1) == 0
    assert (labels[zero] == 0).all() and (sim[zero] == 0).all()
    assert not sim.isnan().any()


@pytest.mark.parametrize("fn", [kmeans_assign, kmeans_assign_ref])
def test_assign_ties_go_to_the_lowest_cluster(fn):
    """Exact ties: duplicated centroids (in one chunk and across chunks of 16) and zero keys."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn((2, 2, 150, 16), generator=gen)
    keys[:, :, ::7] = 0.0
    cen = torch.randn((2, 2, 40, 16), generator=gen)
    cen[:, :, 5] = cen[:, :, 2]  # same chunk
    cen[:, :, 33] = cen[:, :, 1] * 4.0  # other chunk, same direction (exact power-of-two scale)
    cen[:, :, 20] = 0.0  # a zero centroid: similarity 0 to every key
    kw = {"block_c": 16} if fn is kmeans_assign else {}
    labels, sim = fn(keys, cen, **kw)
    assert not (labels == 5).any() and not (labels == 33).any()
    assert (labels[:, :, ::7] == 0).all() and (sim[:, :, ::7] == 0).all()
    assert ((labels == 2) | (labels == 1)).any()  # the duplicated directions do win tokens


def test_assign_single_centroid_and_bf16_ref():
    keys = torch.randn((1, 2, 33, 16)).bfloat16()
    cen = torch.randn((1, 2, 1, 16))
    labels, sim = kmeans_assign_ref(keys, cen)
    assert (labels == 0).all()
    torch.testing.assert_close(sim.double(), naive_sims(keys, cen)[..., 0], atol=1e-5, rtol=1e-5)
    labels, _sim2 = kmeans_assign(keys.float(), cen)
    assert (labels == 0).all()


@pytest.mark.parametrize("D", [80, 256])
def test_kernels_odd_and_largest_head_dims(D):
    gen = torch.Generator().manual_seed(D)
    keys = _keys(gen, 1, 2, 70, D, torch.float16, "d_strided")
    cen = torch.randn((1, 2, 20, D), generator=gen)
    labels, sim = kmeans_assign(keys, cen, block_c=16)
    r_labels, r_sim = kmeans_assign_ref(keys, cen)
    torch.testing.assert_close(sim, r_sim, atol=SIM_TOL[0], rtol=SIM_TOL[1])
    clear = top2_gap(naive_sims(keys, cen)) > 1e-3
    assert torch.equal(labels[clear], r_labels[clear])
    for normalize in (False, True):
        sums, counts = centroid_update(keys, r_labels, 20, normalize)
        r_sums, r_counts = centroid_update_ref(keys, r_labels, 20, normalize)
        torch.testing.assert_close(sums, r_sums, atol=SUM_TOL[0], rtol=SUM_TOL[1])
        assert torch.equal(counts, r_counts)


def test_assign_errors(monkeypatch):
    keys = torch.randn((1, 2, 8, 16))
    with pytest.raises(ValueError, match=r"kvpass: kmeans_assign needs head dim D <= 256"):
        kmeans_assign(torch.randn((1, 1, 4, 320)), torch.randn((1, 1, 2, 320)))
    for fn in (kmeans_assign, kmeans_assign_ref):
        with pytest.raises(ValueError, match=r"kvpass: .* needs at least one centroid \(C >= 1\)"):
            fn(keys, torch.randn((1, 2, 0, 16)))
        with pytest.raises(ValueError, match=r"kvpass: .* needs centroids of shape \(B=1, H=2, C, D=16\)"):
            fn(keys, torch.randn((1, 1, 3, 16)))
        with pytest.raises(ValueError, match=r"kvpass: .* needs keys of dtype"):
            fn(keys.long(), torch.randn((1, 2, 3, 16)))
    with pytest.raises(ValueError, match="kvpass: kmeans_assign needs block_c to be a power of two"):
        kmeans_assign(keys, torch.randn((1, 2, 3, 16)), block_c=24)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"kvpass: kmeans_assign needs Triton.*use kmeans_assign_ref"):
        kmeans_assign(keys, torch.randn((1, 2, 3, 16)))


# --------------------------------------------------------------------------------------------------
# Centroid update
# --------------------------------------------------------------------------------------------------


@st.composite
def update_problems(draw, max_n=300):
    return {
        "dtype": draw(DTYPES),
        "B": draw(st.integers(1, 2)),
        "H": draw(st.integers(1, 3)),
        "N": draw(st.integers(1, max_n)),
        "C": draw(st.integers(1, 20)),
        "D": draw(HEAD_DIMS),
        "layout": draw(LAYOUTS),
        "label_layout": draw(SMALL_LAYOUTS),
        "label_dtype": draw(st.sampled_from([torch.int32, torch.int64])),
        "pad_frac": draw(st.sampled_from([0.0, 0.3])),
        "normalize": draw(st.booleans()),
        "seed": draw(SEEDS),
    }


def make_update_inputs(p):
    gen = torch.Generator().manual_seed(p["seed"])
    keys = _keys(gen, p["B"], p["H"], p["N"], p["D"], p["dtype"], p["layout"], zero_frac=0.05)
    labels = torch.randint(0, p["C"], (p["B"], p["H"], p["N"]), generator=gen)
    pad = torch.rand(labels.shape, generator=gen) < p["pad_frac"]
    pad_values = torch.tensor([-1, -7, p["C"], p["C"] + 5])  # negative or >= C: padding
    labels[pad] = pad_values[torch.randint(0, 4, (int(pad.sum()),), generator=gen)]
    return keys, _small_strided(labels.to(p["label_dtype"]), p["label_layout"])


def naive_update(keys, labels, C, normalize):
    B, H, N, D = keys.shape
    sums = torch.zeros((B, H, C, D), dtype=torch.float64)
    counts = torch.zeros((B, H, C), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for n in range(N):
                c = int(labels[b, h, n])
                if 0 <= c < C:
                    x = keys[b, h, n].double()
                    if normalize:
                        x = x / max(float(x.norm()), 1e-6)
                    sums[b, h, c] += x
                    counts[b, h, c] += 1
    return sums, counts


@given(p=update_problems(max_n=60))
def test_update_ref_matches_naive_loop(p):
    keys, labels = make_update_inputs(p)
    sums, counts = centroid_update_ref(keys, labels, p["C"], p["normalize"])
    assert sums.shape == (p["B"], p["H"], p["C"], p["D"]) and counts.shape == (p["B"], p["H"], p["C"])
    assert sums.dtype == counts.dtype == torch.float32
    e_sums, e_counts = naive_update(keys, labels, p["C"], p["normalize"])
    torch.testing.assert_close(sums.double(), e_sums, atol=SUM_TOL[0], rtol=SUM_TOL[1])
    assert torch.equal(counts.double(), e_counts)
    valid = (labels >= 0) & (labels < p["C"])
    assert counts.sum(-1).long().tolist() == valid.sum(-1).tolist()


@given(p=update_problems(), block_n=st.sampled_from([None, 32]))
def test_update_kernel_matches_ref(p, block_n):
    keys, labels = make_update_inputs(p)
    sums, counts = centroid_update(keys, labels, p["C"], p["normalize"], block_n=block_n)
    r_sums, r_counts = centroid_update_ref(keys, labels, p["C"], p["normalize"])
    assert sums.dtype == counts.dtype == torch.float32
    torch.testing.assert_close(sums, r_sums, atol=SUM_TOL[0], rtol=SUM_TOL[1])  # atomics: any order
    assert torch.equal(counts, r_counts)
    valid = (labels >= 0) & (labels < p["C"])
    assert counts.sum(-1).long().tolist() == valid.sum(-1).tolist()
    assert not sums.isnan().any()  # NaN padding of strided layouts is never read


@pytest.mark.parametrize("fn", [centroid_update, centroid_update_ref])
def test_update_padding_only(fn):
    keys = torch.full((1, 2, 20, 16), float("nan"))  # padding tokens' keys are never read
    labels = torch.full((1, 2, 20), -1)
    labels[0, 1, ::2] = 3
    sums, counts = fn(keys, labels, 3, True)
    assert (sums == 0).all() and (counts == 0).all()


def test_update_errors(monkeypatch):
    keys = torch.randn((1, 2, 8, 16))
    for fn in (centroid_update, centroid_update_ref):
        with pytest.raises(ValueError, match=r"kvpass: .* needs labels of shape \(B=1, H=2, N=8\)"):
            fn(keys, torch.zeros((1, 2, 7), dtype=torch.int64), 3, True)
        with pytest.raises(ValueError, match=r"kvpass: .* needs labels of dtype int32 or int64"):
            fn(keys, torch.zeros((1, 2, 8)), 3, True)
    with pytest.raises(ValueError, match=r"kvpass: centroid_update needs head dim D <= 256"):
        centroid_update(torch.randn((1, 1, 4, 300)), torch.zeros((1, 1, 4), dtype=torch.int64), 2, False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: centroid_update needs Triton"):
        centroid_update(keys, torch.zeros((1, 2, 8), dtype=torch.int64), 3, True)


# --------------------------------------------------------------------------------------------------
# k-means driver
# --------------------------------------------------------------------------------------------------


def check_kmeans(km: KMeans, keys: torch.Tensor, C: int):
    """Every invariant of a KMeans result, checked against independent computations."""
    B, H, N, D = keys.shape
    assert km.labels.shape == (B, H, N) and km.labels.dtype == torch.int64
    assert km.directions.shape == km.centroids.shape == (B, H, C, D)
    assert km.directions.dtype == km.centroids.dtype == torch.float32
    assert km.sizes.shape == (B, H, C) and km.sizes.dtype == torch.int64
    assert km.order.shape == (B, H, N) and km.offsets.shape == (B, H, C + 1)
    assert 1 <= km.iters == len(km.objective)
    for t in (km.directions, km.centroids):
        assert not t.isnan().any()
    assert ((km.labels >= 0) & (km.labels < C)).all()
    assert int(km.sizes.sum()) == B * H * N
    assert (km.offsets[..., 0] == 0).all() and torch.equal(km.offsets[..., -1], torch.full((B, H), N))
    assert torch.equal(km.offsets.diff(dim=-1), km.sizes)
    norms = km.directions.norm(dim=-1)
    assert ((norms - 1).abs() < 1e-5).logical_or(norms == 0).all()  # 0 only from a zero key seed
    for b in range(B):
        for h in range(H):
            lab = km.labels[b, h]
            assert torch.equal(km.sizes[b, h], torch.bincount(lab, minlength=C))
            assert torch.equal(km.order[b, h].sort().values, torch.arange(N))  # a permutation
            # segment c of order (offsets are the cumsum of sizes, checked above) holds label c only
            seg_lab = lab[km.order[b, h]]
            assert torch.equal(seg_lab, torch.repeat_interleave(torch.arange(C), km.sizes[b, h]))
            same = seg_lab[1:] == seg_lab[:-1]
            assert (km.order[b, h].diff()[same] > 0).all()  # ascending positions inside a cluster
            # centroids = mean of the raw member keys (one-hot matmul in float64), 0 when empty
            onehot = torch.nn.functional.one_hot(lab, C).double()  # (N, C)
            mean = onehot.T @ keys[b, h].double() / km.sizes[b, h].clamp(min=1)[:, None]
            torch.testing.assert_close(km.centroids[b, h].double(), mean, atol=1e-5, rtol=1e-5)
    obj = km.objective
    for a, nxt in itertools.pairwise(obj):
        assert nxt <= a + 1e-4 * max(abs(a), 1.0), obj
    assert all(-1e-3 <= o <= 2 * B * H * N + 1e-3 for o in obj)  # 1 - cos lies in [0, 2]


def check_converged_objective(km: KMeans, keys: torch.Tensor):
    """After convergence the returned directions are those of the last assignment: its objective is
    the sum of 1 - cos(x, direction[label]), and no token has a more similar direction."""
    sim = naive_sims(keys, km.directions)  # (B, H, N, C) float64
    own = torch.gather(sim, 3, km.labels[..., None])[..., 0]
    assert abs(float((1 - own).sum()) - km.objective[-1]) <= 1e-4 * max(km.objective[-1], 1.0)
    assert (own >= sim.amax(-1) - 1e-5).all()


@st.composite
def kmeans_problems(draw, max_n=200):
    N = draw(st.integers(1, max_n))
    return {
        "dtype": draw(DTYPES),
        "B": draw(st.integers(1, 2)),
        "H": draw(st.integers(1, 3)),
        "N": N,
        "C": draw(st.integers(1, min(N, 24))),
        "D": draw(HEAD_DIMS),
        "layout": draw(LAYOUTS),
        "zero_frac": draw(st.sampled_from([0.0, 0.1])),
        "repeats": draw(st.integers(0, 5)),
        "max_iters": draw(st.sampled_from([1, 3, 16])),
        "seed": draw(SEEDS),
    }


@given(p=kmeans_problems())
def test_kmeans_properties(p):
    gen = torch.Generator().manual_seed(p["seed"])
    x = torch.randn((p["B"], p["H"], p["N"], p["D"]), generator=gen)
    x[torch.rand(x.shape[:3], generator=gen) < p["zero_frac"]] = 0.0
    pos = torch.randperm(p["N"], generator=gen)[: p["repeats"]]
    x[:, :, pos] = torch.randn((p["B"], p["H"], 1, p["D"]), generator=gen)  # one key repeated
    keys = make_strided(x.to(p["dtype"]), p["layout"])
    km = cosine_kmeans(keys, p["C"], max_iters=p["max_iters"], seed=p["seed"])
    check_kmeans(km, keys, p["C"])
    assert km.iters <= p["max_iters"]
    if km.iters < p["max_iters"]:
        check_converged_objective(km, keys)
    if len(pos) > 1:  # identical keys land in one cluster
        assert (km.labels[:, :, pos] == km.labels[:, :, pos[:1]]).all()
    zero = keys.float().abs().sum(-1) == 0
    if p["C"] > 1 and not zero.any():
        # the returned directions are the normalised means of the members' unit keys
        sums, _ = centroid_update_ref(keys, km.labels, p["C"], True)
        filled = km.sizes > 0
        unit = sums / sums.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(km.directions[filled], unit[filled], atol=1e-5, rtol=1e-5)
    # deterministic per seed
    again = cosine_kmeans(keys, p["C"], max_iters=p["max_iters"], seed=p["seed"])
    assert torch.equal(again.labels, km.labels) and again.objective == km.objective
    assert torch.equal(again.directions, km.directions)


def test_kmeans_converges_and_stops_early():
    gen = torch.Generator().manual_seed(5)
    centers = torch.randn((1, 1, 4, 16), generator=gen)
    keys = (centers.repeat_interleave(30, dim=2) + 0.05 * torch.randn((1, 1, 120, 16), generator=gen))
    km = cosine_kmeans(keys, 4, max_iters=50, seed=1)
    check_kmeans(km, keys, 4)
    assert km.iters < 50
    check_converged_objective(km, keys)
    assert km.objective[-1] < km.objective[0]


def test_kmeans_one_cluster_per_token_and_single_cluster():
    keys = torch.randn((2, 2, 17, 16))
    km = cosine_kmeans(keys, 17)  # every token is a seed and its own best direction
    check_kmeans(km, keys, 17)
    assert (km.sizes == 1).all()
    km = cosine_kmeans(keys, 1)
    check_kmeans(km, keys, 1)
    assert (km.labels == 0).all() and km.iters <= 2
    torch.testing.assert_close(km.centroids[:, :, 0], keys.mean(2))


def test_kmeans_all_zero_keys_no_nan():
    keys = torch.zeros((1, 2, 10, 16), dtype=torch.float16)
    km = cosine_kmeans(keys, 3)
    check_kmeans(km, keys, 3)
    assert (km.labels == 0).all() and km.objective == [20.0, 20.0]


def test_kmeans_bf16_keys_ref():
    keys = torch.randn((1, 2, 50, 16)).bfloat16()
    check_kmeans(cosine_kmeans(keys, 5), keys, 5)


def test_kmeans_different_seeds_give_different_inits():
    keys = torch.randn((1, 1, 100, 16))
    a = cosine_kmeans(keys, 10, max_iters=1, seed=0)
    b = cosine_kmeans(keys, 10, max_iters=1, seed=1)
    assert not torch.equal(a.labels, b.labels)


@settings(max_examples=8)
@given(
    dtype=DTYPES,
    B=st.integers(1, 2),
    H=st.integers(1, 2),
    C=st.integers(1, 6),
    per=st.integers(1, 20),
    D=HEAD_DIMS,
    layout=LAYOUTS,
    seed=SEEDS,
)
def test_kmeans_triton_matches_ref_on_separated_data(dtype, B, H, C, per, D, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    N = C * per
    centers = torch.randn((B, H, C, D), generator=gen)
    centers = centers / centers.norm(dim=-1, keepdim=True)
    members = torch.stack([torch.randperm(N, generator=gen) % C for _ in range(B * H)]).view(B, H, N)
    x = torch.gather(centers, 2, members[..., None].expand(B, H, N, D))
    x = x + 0.3 / D**0.5 * torch.randn((B, H, N, D), generator=gen)
    x = x * (0.5 + 2 * torch.rand((B, H, N, 1), generator=gen))
    keys = make_strided(x.to(dtype), layout)
    ref = cosine_kmeans(keys, C, seed=seed)
    tri = cosine_kmeans(keys, C, seed=seed, use_triton=True)
    check_kmeans(tri, keys, C)
    assert torch.equal(tri.labels, ref.labels)
    assert tri.iters == ref.iters
    assert torch.equal(tri.sizes, ref.sizes) and torch.equal(tri.order, ref.order)
    torch.testing.assert_close(tri.centroids, ref.centroids, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri.directions, ref.directions, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(tri.objective), torch.tensor(ref.objective), atol=1e-3, rtol=1e-5)


def test_kmeans_errors():
    keys = torch.randn((1, 1, 5, 16))
    for bad in (0, 6):
        msg = rf"kvpass: cosine_kmeans needs 1 <= num_clusters <= N=5, got num_clusters={bad}"
        with pytest.raises(ValueError, match=msg):
            cosine_kmeans(keys, bad)
    with pytest.raises(ValueError, match=r"kvpass: cosine_kmeans needs at least one token"):
        cosine_kmeans(keys[:, :, :0], 1)
    with pytest.raises(ValueError, match=r"kvpass: cosine_kmeans needs max_iters >= 1"):
        cosine_kmeans(keys, 2, max_iters=0)
    with pytest.raises(ValueError, match=r"kvpass: cosine_kmeans needs keys of shape \(B, H, N, D\)"):
        cosine_kmeans(keys[0], 2)


# --------------------------------------------------------------------------------------------------
# Cluster selection
# --------------------------------------------------------------------------------------------------


@st.composite
def select_problems(draw, max_n=300, max_c=40):
    N = draw(st.integers(0, max_n))
    return {
        "B": draw(st.integers(1, 2)),
        "H": draw(st.integers(1, 3)),
        "N": N,
        "C": draw(st.integers(1, max_c)),
        "budget": draw(st.one_of(st.just(0), st.integers(0, N + 10), st.just(N))),
        "score_mode": draw(st.sampled_from(["random", "ties", "neg_inf", "all_neg_inf", "nan"])),
        "layout": draw(SMALL_LAYOUTS),
        "start": draw(st.sampled_from([0, 16])),  # positions offset by the sinks, as in the runtime
        "seed": draw(SEEDS),
    }


def make_select_inputs(p):
    B, H, N, C = p["B"], p["H"], p["N"], p["C"]
    gen = torch.Generator().manual_seed(p["seed"])
    # skewed labels: many empty and some large clusters
    labels = (torch.rand((B, H, N), generator=gen) ** 2 * C).long().clamp_max(C - 1)
    sizes = torch.zeros((B, H, C), dtype=torch.int64).scatter_add_(2, labels, torch.ones_like(labels))
    offsets = torch.nn.functional.pad(sizes.cumsum(-1), (1, 0))
    order = torch.sort(labels, dim=-1, stable=True).indices + p["start"]
    mode = p["score_mode"]
    if mode == "ties":
        scores = torch.randint(0, 3, (B, H, C), generator=gen).float()
    else:
        scores = torch.randn((B, H, C), generator=gen)
    if mode in ("neg_inf", "nan"):
        scores[torch.rand((B, H, C), generator=gen) < 0.3] = float("-inf")
    if mode == "nan":
        scores[torch.rand((B, H, C), generator=gen) < 0.2] = float("nan")
    if mode == "all_neg_inf":
        scores[B - 1, H - 1] = float("-inf")
    lay = p["layout"]
    return (
        _small_strided(scores, lay),
        _small_strided(sizes, lay),
        _small_strided(offsets, lay),
        _small_strided(order, lay),
    )


def naive_select(scores, sizes, offsets, order, budget):
    """The rule written as a loop: rank clusters by (-score, c), skip -inf / NaN / empty, take members."""
    B, H, C = scores.shape
    out = torch.full((B, H, budget), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            eligible = [c for c in range(C) if scores[b, h, c] > float("-inf") and sizes[b, h, c] > 0]
            taken = []
            for c in sorted(eligible, key=lambda c: (-float(scores[b, h, c]), c)):
                o = int(offsets[b, h, c])
                taken += order[b, h, o : o + int(sizes[b, h, c])].tolist()
                if len(taken) >= budget:
                    break
            taken = taken[:budget]
            out[b, h, : len(taken)] = torch.tensor(taken, dtype=torch.int64)
    return out


def eligible_tokens(scores, sizes):
    return torch.where(scores > float("-inf"), sizes, 0).sum(-1)


@given(p=select_problems(max_n=150))
def test_select_ref_matches_naive_loop(p):
    scores, sizes, offsets, order = make_select_inputs(p)
    idx = select_clusters_ref(scores, sizes, offsets, order, p["budget"])
    assert idx.shape == (p["B"], p["H"], p["budget"]) and idx.dtype == torch.int64
    assert torch.equal(idx, naive_select(scores, sizes, offsets, order, p["budget"]))


@given(p=select_problems(), block_j=st.sampled_from([32, 128]), block_c=st.sampled_from([16, 128]))
def test_select_kernel_matches_ref(p, block_j, block_c):
    scores, sizes, offsets, order = make_select_inputs(p)
    idx = select_clusters(scores, sizes, offsets, order, p["budget"], block_j=block_j, block_c=block_c)
    ref = select_clusters_ref(scores, sizes, offsets, order, p["budget"])
    assert idx.shape == (p["B"], p["H"], p["budget"]) and idx.dtype == torch.int64
    assert torch.equal(idx, ref)


@given(p=select_problems())
def test_select_cpu_kernel_matches_ref(p):
    # the C recall (the CPU path where it is built) gives exactly the reference's positions
    assert select_clusters_cpu_available()
    scores, sizes, offsets, order = make_select_inputs(p)
    idx = select_clusters_cpu(scores, sizes, offsets, order, p["budget"])
    assert idx.shape == (p["B"], p["H"], p["budget"]) and idx.dtype == torch.int64
    assert torch.equal(idx, select_clusters_ref(scores, sizes, offsets, order, p["budget"]))


@given(p=select_problems(max_n=200))
def test_select_properties(p):
    scores, sizes, offsets, order = make_select_inputs(p)
    budget = p["budget"]
    idx = select_clusters_ref(scores, sizes, offsets, order, budget)
    B, H, C = scores.shape
    eligible = eligible_tokens(scores, sizes)
    for b in range(B):
        for h in range(H):
            row = idx[b, h]
            n_valid = min(budget, int(eligible[b, h]))
            assert (row[:n_valid] >= 0).all() and (row[n_valid:] == -1).all()  # -1 only at the end
            got = row[:n_valid]
            assert len(got.unique()) == n_valid  # no duplicates
            # cluster of every selected token, from the position inside order
            where = {int(t): i for i, t in enumerate(order[b, h].tolist())}
            slot = torch.tensor([where[int(t)] for t in got], dtype=torch.int64)
            cl = torch.searchsorted(offsets[b, h].contiguous(), slot, right=True) - 1
            assert all(scores[b, h, c] > float("-inf") for c in cl.tolist())  # -inf never chosen
            runs = torch.unique_consecutive(cl).tolist()
            assert len(runs) == len(set(runs))  # cluster by cluster
            sc = [float(scores[b, h, c]) for c in runs]
            assert all(x >= y for x, y in itertools.pairwise(sc))  # in descending score order
            for k, c in enumerate(runs):
                members = order[b, h, offsets[b, h, c] : offsets[b, h, c + 1]]
                taken = got[cl == c]
                if k < len(runs) - 1:
                    assert torch.equal(taken, members)  # whole clusters ...
                else:
                    assert torch.equal(taken, members[: len(taken)])  # ... but the last: its first members
            if budget >= p["N"]:  # every token of every eligible cluster
                keep = torch.zeros(C, dtype=torch.bool)
                keep[[c for c in range(C) if scores[b, h, c] > float("-inf")]] = True
                members = torch.cat(
                    [order[b, h, offsets[b, h, c] : offsets[b, h, c + 1]] for c in range(C) if keep[c]]
                    + [torch.empty(0, dtype=torch.int64)]
                )
                assert torch.equal(got.sort().values, members.sort().values)


@pytest.mark.parametrize("fn", [select_clusters, select_clusters_ref, select_clusters_cpu])
def test_select_hand_example(fn):
    # clusters: 0 -> [5, 9], 1 -> [1], 2 -> [] (empty), 3 -> [0, 2, 7], 4 -> [3] (-inf)
    order = torch.tensor([[[5, 9, 1, 0, 2, 7, 3]]])
    sizes = torch.tensor([[[2, 1, 0, 3, 1]]])
    offsets = torch.tensor([[[0, 2, 3, 3, 6, 7]]])
    scores = torch.tensor([[[0.5, 0.5, 9.0, 2.0, float("-inf")]]])
    assert fn(scores, sizes, offsets, order, 4).tolist() == [[[0, 2, 7, 5]]]  # 3 whole, 0 trimmed
    assert fn(scores, sizes, offsets, order, 6).tolist() == [[[0, 2, 7, 5, 9, 1]]]  # tie: 0 before 1
    assert fn(scores, sizes, offsets, order, 8).tolist() == [[[0, 2, 7, 5, 9, 1, -1, -1]]]
    assert fn(scores, sizes, offsets, order, 0).shape == (1, 1, 0)
    assert fn(scores, sizes, offsets, order, 2).tolist() == [[[0, 2]]]


def test_select_errors(monkeypatch):
    scores = torch.randn((1, 2, 3))
    sizes = torch.ones((1, 2, 3), dtype=torch.int64)
    offsets = torch.arange(4).expand(1, 2, 4)
    order = torch.arange(3).expand(1, 2, 3)
    for fn in (select_clusters, select_clusters_ref, select_clusters_cpu):
        with pytest.raises(ValueError, match=r"kvpass: .* needs budget >= 0, got budget=-1"):
            fn(scores, sizes, offsets, order, -1)
        with pytest.raises(ValueError, match=r"kvpass: .* needs offsets of shape \(B=1, H=2, C\+1=4\)"):
            fn(scores, sizes, offsets[..., :3], order, 2)
        with pytest.raises(ValueError, match=r"kvpass: .* needs sizes of dtype int32 or int64"):
            fn(scores, sizes.float(), offsets, order, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="kvpass: select_clusters needs Triton"):
        select_clusters(scores, sizes, offsets, order, 2)


# --------------------------------------------------------------------------------------------------
# A decode step's whole list (sinks, recalled clusters, recent tokens; rows of a padded batch)
# --------------------------------------------------------------------------------------------------


@st.composite
def step_problems(draw):
    B, H, G = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    C = draw(st.integers(0, 40))  # past a dozen clusters the C kernel's heap has levels to sift through
    n_sinks, n_recent, cluster_budget = draw(st.integers(0, 4)), draw(st.integers(0, 6)), draw(st.integers(0, 24))
    first = draw(st.sampled_from(["none", "shared", "rows"]))
    return {
        "B": B, "H": H, "G": G, "D": draw(st.sampled_from([4, 16])), "C": C,
        "sizes": draw(st.lists(st.integers(0, 5), min_size=B * H * C, max_size=B * H * C)),
        "gap": draw(st.integers(0, 3)),  # order slots no cluster covers (a padded row's tail of -1)
        "first": first,
        "firsts": draw(st.lists(st.integers(0, 12), min_size=B, max_size=B)),
        "extra": draw(st.integers(0, 40)),
        "n_sinks": n_sinks, "n_recent": n_recent, "cluster_budget": cluster_budget,
        "cover": draw(st.sampled_from([-1, n_sinks + cluster_budget + n_recent])),
        "gqa": draw(st.sampled_from(["sum", "max"])),
        "nan": draw(st.booleans()),
        "seed": draw(SEEDS),
    }


def make_step_inputs(p):
    """Integer-valued q and centroids: every score is exact in fp32 whatever order the products are
    added in, so the C path, the torch path and the oracle rank the same ties the same way."""
    B, H, G, D, C = p["B"], p["H"], p["G"], p["D"], p["C"]
    gen = torch.Generator().manual_seed(p["seed"])
    q = torch.randint(-2, 3, (B, H * G, D), generator=gen).float()
    centroids = torch.randint(-2, 3, (B, H, C, D), generator=gen).float()
    sizes = torch.tensor(p["sizes"], dtype=torch.int64).view(B, H, C)
    offsets = torch.nn.functional.pad(sizes.cumsum(-1), (1, 0))
    n = int(sizes.sum(-1).max()) if C else 0
    order = torch.full((B, H, n + p["gap"]), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            m = int(sizes[b, h].sum())
            order[b, h, :m] = torch.randperm(max(m, 1), generator=gen)[:m] + 100
    if p["first"] == "none":
        first = None
    elif p["first"] == "shared":
        first = torch.tensor(p["firsts"][:1], dtype=torch.int64)
    else:
        first = torch.tensor(p["firsts"], dtype=torch.int64)
    length = 100 + n + p["extra"]
    return q, centroids, sizes, offsets, order, first, length


def naive_step(q, centroids, sizes, offsets, order, first, length, n_sinks, cluster_budget, n_recent, cover, width,
               gqa, scores=None):
    """Python loops: each (row, head)'s list as the method states it."""
    B, H, C, D = centroids.shape
    G = q.shape[1] // H
    out = torch.full((B, H, width), -1, dtype=torch.int64)
    for b in range(B):
        f = 0 if first is None else int(first[min(b, first.shape[0] - 1)])
        for h in range(H):
            if cover >= 0 and length - f <= cover:
                row = list(range(f, min(length, f + width)))
            else:
                ranked = []
                for c in range(C):
                    if scores is not None:
                        s = float(scores[b, h, c])
                    else:
                        per = [sum(float(q[b, h * G + g, d]) * float(centroids[b, h, c, d]) for d in range(D))
                               for g in range(G)]
                        s = sum(per) if gqa == "sum" else max(per)
                    if sizes[b, h, c] > 0 and s > float("-inf"):
                        ranked.append((-s, c))
                picked = []
                for _, c in sorted(ranked):
                    lo = int(offsets[b, h, c])
                    picked += order[b, h, lo : lo + int(sizes[b, h, c])].tolist()
                picked = (picked + [-1] * cluster_budget)[:cluster_budget]
                row = [f + t for t in range(n_sinks)] + picked + list(range(length - n_recent, length))
            out[b, h, : len(row)] = torch.tensor(row[:width], dtype=torch.int64)
    return out


@settings(max_examples=60, deadline=None)
@given(p=step_problems())
def test_step_selection_c_and_torch_match_the_oracle(p):
    """cluster_select_cpu and cluster_select_torch against Python loops: any first positions (None, one for
    the batch, one per row), covered rows, empty clusters, order slots no cluster covers, ties (integer
    scores), NaN scores, both gqa modes, a cluster budget larger than the clusters hold."""
    q, centroids, sizes, offsets, order, first, length = make_step_inputs(p)
    scores = None
    if p["nan"] and p["C"]:  # a NaN score is never chosen (as select_clusters)
        centroids[..., 0, 0] = float("nan")
        scores = cluster_scores(q, centroids, p["gqa"])
    width = p["n_sinks"] + p["cluster_budget"] + p["n_recent"] + (p["cover"] > 0) * 3
    args = (q, centroids, sizes, offsets, order, first, length, p["n_sinks"], p["cluster_budget"], p["n_recent"],
            p["cover"], width, p["gqa"])
    want = naive_step(*args, scores=scores)
    assert torch.equal(cluster_select_torch(*args), want)
    assert cluster_select_cpu_available()
    assert torch.equal(cluster_select_cpu(*args), want)


@settings(max_examples=40, deadline=None)
@given(p=step_problems(), strided=st.booleans())
def test_step_attends_its_list_in_the_same_call(p, strided):
    """ClusterStep.select_attend (the runtime's steady step: list and attention in one C call) gives
    select's list and the float64 reference attention over it; a cache the C attention does not read is
    left to the caller."""
    from kvpass.kernels.clusterkv import ClusterStep
    from kvpass.kernels.cpu_decode import available, cpu_decode_attention_ref

    assert available()  # the README's set-up builds the C kernels (tests/test_native.py)
    q, centroids, sizes, offsets, order, first, length = make_step_inputs(p)
    width = p["n_sinks"] + p["cluster_budget"] + p["n_recent"] + (p["cover"] > 0) * 3
    rest = (length, p["n_sinks"], p["cluster_budget"], p["n_recent"], p["cover"], width)
    gen = torch.Generator().manual_seed(p["seed"])
    B, H, _, D = centroids.shape
    k = torch.randn(B, H, length + 2, 2 * D if strided else D, generator=gen)[..., :D]
    v = torch.randn(B, H, length + 2, D, generator=gen)
    q4 = q[:, :, None]
    step = ClusterStep(centroids, sizes, offsets, order, first, p["gqa"])
    want = step.select(q4, *rest)
    idx, out = step.select_attend(q4, *rest, k, v, 0.25)
    assert torch.equal(idx, want)
    ref = cpu_decode_attention_ref(q, k[:, :, :length], v[:, :, :length], idx, 0.25)
    torch.testing.assert_close(out[:, :, 0], ref, rtol=1e-5, atol=1e-5)
    assert step.select_attend(q4, *rest, k.double(), v.double(), 0.25) is None


def test_step_selection_cpu_refuses_what_it_cannot_read():
    q, c = torch.zeros(1, 4, 8), torch.zeros(1, 2, 3, 8)
    sizes, offsets, order = torch.ones(1, 2, 3, dtype=torch.int64), torch.zeros(1, 2, 4, dtype=torch.int64), \
        torch.zeros(1, 2, 3, dtype=torch.int64)
    for bad in ({"q": q.double()}, {"sizes": sizes.int()}, {"offsets": offsets[..., :3]},
                {"gqa": "mean"}, {"first": torch.zeros(2, dtype=torch.int64)}):
        a = {"q": q, "centroids": c, "sizes": sizes, "offsets": offsets, "order": order, "first": None, "gqa": "sum"}
        a.update(bad)
        with pytest.raises(ValueError, match="cluster_select_cpu needs"):
            cluster_select_cpu(a["q"], a["centroids"], a["sizes"], a["offsets"], a["order"], a["first"], 10, 1, 2, 1,
                               -1, 4, a["gqa"])

"""Kernel micro-benchmarks (kvpass.bench.kernels): fields, positive times, like-for-like comparison."""


import torch

from kvpass.bench.kernels import QUICK_SHAPES, Shape, benchmark_kernels, format_table, sparse_and_dense

FIELDS = {"kernel", "shape", "B", "H_q", "H_kv", "D", "S", "N", "dtype", "device", "impl", "ms", "baseline",
          "baseline_ms", "speedup", "bytes", "gbps", "baseline_bytes", "baseline_gbps"}


KERNELS = {"sparse_decode_attention", "quest_page_scores", "centroid_decode_attention",
           "quant_decode_attention", "partial_topk", "kmeans_assign", "select_clusters", "merge_round"}


def test_quick_cpu_benchmark_rows():
    rows = benchmark_kernels("cpu", quick=True)
    assert len(rows) == len(KERNELS) * len(QUICK_SHAPES)
    assert {r["kernel"] for r in rows} == KERNELS
    # one row per (kernel, shape)
    assert {(r["kernel"], r["S"], r["H_q"]) for r in rows} == {
        (k, s.S, s.H_q) for k in KERNELS for s in QUICK_SHAPES
    }
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["ms"] > 0 and r["baseline_ms"] > 0 and r["bytes"] > 0 and r["gbps"] > 0, r
        assert r["baseline_bytes"] > 0 and r["baseline_gbps"] > 0 and r["N"] > 0, r
        # the CPU paths: the C kernels where this machine has them built (it does), torch code elsewhere
        c_rows = {"sparse_decode_attention", "centroid_decode_attention", "select_clusters"}
        assert r["device"] == "cpu" and r["impl"] == ("C" if r["kernel"] in c_rows else "torch ref"), r
    table = format_table(rows)
    assert all(k in table for k in KERNELS)


def test_sparse_and_dense_agree_when_idx_covers_everything():
    for s in (Shape("gqa", 1, 8, 2, 32, 300, 300), Shape("smollm2", 2, 9, 3, 64, 64, 64)):
        sparse, dense, (q, k, v, idx) = sparse_and_dense(s, "cpu", torch.float32, idx_all=True)
        assert idx.shape == (s.B, s.H_kv, s.S)
        out_s, out_d = sparse(), dense()
        assert out_s.shape == out_d.shape == (s.B, s.H_q, s.D)
        torch.testing.assert_close(out_s, out_d, rtol=1e-4, atol=1e-5)


def test_quest_rows_compare_the_same_scores():
    from kvpass.bench.kernels import _quest_broadcast, _quest_inputs
    from kvpass.kernels.quest import quest_page_scores_ref

    q, kmin, kmax = _quest_inputs(QUICK_SHAPES[0], "cpu", torch.float32)
    torch.testing.assert_close(quest_page_scores_ref(q, kmin, kmax), _quest_broadcast(q, kmin, kmax),
                               rtol=1e-4, atol=1e-4)


def test_peak_bandwidth_sources(monkeypatch):
    from types import SimpleNamespace

    import kvpass.bench.kernels as kb

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000, memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=0: props)
    peak, how = kb.peak_bandwidth(0)
    assert abs(peak - 3.352e12) < 1e10 and "torch props" in how  # H100 SXM: 3.35 TB/s
    props = SimpleNamespace(name="NVIDIA H200", memory_clock_rate=0, memory_bus_width=0)
    monkeypatch.setattr(kb.shutil, "which", lambda name: None)  # no nvidia-smi: the datasheet table
    peak, how = kb.peak_bandwidth(0)
    assert peak == 4.8e12 and "assumed" in how
    props = SimpleNamespace(name="Some GPU", memory_clock_rate=0, memory_bus_width=0)
    assert kb.peak_bandwidth(0)[0] is None


def test_cpu_paths_compare_each_c_kernel_with_the_torch_path_it_replaces():
    from kvpass.bench.kernels import QUICK_CPU_PATH_SHAPES, benchmark_cpu_paths

    rows = benchmark_cpu_paths(quick=True)  # each row also checks that both give the same result
    names = {"attend_all", "attend_listed", "attend_listed_huge", "attend_listed_cold", "quest_top_pages",
             "quest_select", "cluster_recall", "cluster_select", "tailor_select", "tailor_select_cold"}
    assert {(r["kernel"], r["B"]) for r in rows} == {(k, s.B) for k in names for s in QUICK_CPU_PATH_SHAPES}
    for r in rows:
        assert FIELDS <= set(r), FIELDS - set(r)
        base = {"attend_listed_huge": "4 KiB pages", "attend_listed_cold": f"{r['N']} contiguous rows",
                "tailor_select_cold": "fp32 channel copy"}.get(r["kernel"], "torch path")
        assert r["impl"] == "C" and r["baseline"] == base and r["ms"] > 0 and r["baseline_ms"] > 0
        assert r["bytes"] > 0 and r["speedup"] == r["baseline_ms"] / r["ms"]
    assert "attend_listed" in format_table(rows)


def test_site_ops_time_steady_compressed_steps_of_every_policy():
    # a bench row is only worth its figure if the steps it timed were steady (no event) and compressed
    # (each policy attended what its budget allows, not the whole cache)
    from kvpass.bench.kernels import benchmark_site_ops

    pols = "Full,StreamingLLM(budget=256),Quest(budget=256),ClusterKV(budget=256),CentroidKV(cache_ratio=0.25),TailorKV"
    rows = benchmark_site_ops(pols, contexts=(1024,), sites=3, steps=4)
    assert [r["policy"].split("(")[0] for r in rows] == ["Full", "StreamingLLM", "Quest", "ClusterKV", "CentroidKV",
                                                         "TailorKV"]
    full = rows[0]
    assert full["extra_us"] == 0 and full["baseline_us"] == full["us_per_site"] > 0
    assert full["attended"] == 1024 + 3 + 4  # the prefill, the 3 untimed steps and the timed ones
    for r in rows:
        assert r["events"] == 0 and r["us_per_site"] > 0 and r["extra_us"] == r["us_per_site"] - full["us_per_site"]
    # 3 sites: ClusterKV's dense layers 0 and 1 attend everything, site 2 its budget
    budgets = {"StreamingLLM": 256, "Quest": 256, "ClusterKV": (2 * 1031 + 256) / 3, "CentroidKV": 1031 * 0.3,
               "TailorKV": 1024}
    for r in rows[1:]:
        assert 0 < r["attended"] <= budgets[r["policy"].split("(")[0]], r


def test_site_ops_mean_counts_the_scheduled_events():
    # past CentroidKV's merge step (64 decode steps) the timed steps include merges: counted as events, and
    # in the mean (amortised) but not the median (steady) figure; without one, the row says 0 events
    from kvpass.bench.kernels import benchmark_site_ops

    rows = benchmark_site_ops("Full,CentroidKV(cache_ratio=0.25)", contexts=(256,), sites=2, steps=70)
    full, cent = rows
    assert full["events"] == 0 and cent["events"] >= 2  # one merge a site at least
    for r in rows:
        assert r["steps"] == 70 and r["mean_us"] > 0 and r["us_per_site"] > 0
    steady = benchmark_site_ops("Full,CentroidKV(cache_ratio=0.25)", contexts=(256,), sites=2, steps=8)
    assert steady[1]["events"] == 0

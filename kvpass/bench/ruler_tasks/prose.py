"""The data of RULER's needle tasks with CPython's ``pydoc_data.topics`` as the haystack.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?", COLM
2024) hides key/value needles ("One of the special magic numbers for <key> is: <value>.") in a
haystack. Its niah_single_2/3, niah_multikey_1, niah_multivalue and niah_multiquery take Paul Graham's
essays as the haystack, which lm-eval downloads; these machines have no network. Here the haystack is
the prose of ``pydoc_data.topics`` (about 65k words of English documentation, code included; it
changes between Python minor versions, so a page names the Python it ran on), and the samples come
from lm-eval's own generator, ``lm_eval.tasks.ruler.prepare_niah.generate_samples``, with RULER's
parameters for each task (copied from ``lm_eval/tasks/ruler/niah_utils.py``, 0.4.13). Scoring is
lm-eval's (``common_utils.process_results``: string_match_all). Samples are sized in tokens of the
model's tokenizer: ``max_seq_length`` is the prompt plus RULER's 128 tokens reserved for the answer.

Two things differ from lm-eval's essay tasks, both so that the data is offline and reproducible:

- Sentences (where needles may go) are split by nltk's Punkt trained on the haystack itself
  (``PunktSentenceTokenizer(text)``, unsupervised, as Punkt is meant to be) instead of nltk's
  ``punkt_tab`` model, which is a download. lm-eval's generator calls its module-level
  ``cached_sent_tokenize``; :func:`generate` points that name at the local splitter for the length of
  the call and restores it (so it is not thread-safe: generate from one thread).
- lm-eval's generator draws keys, values and depths from the global ``random`` stream, so its data
  depends on what ran before. :func:`generate` seeds it from ``(seed, task, length)`` and restores
  the caller's random state afterwards: the same arguments give the same samples in any order, and
  the first N of M samples equal the N samples of a run with ``num_samples=N``.

Task metadata (lm-eval ``--metadata`` or ``TaskManager(metadata=...)``, merged with the model args):
``max_seq_lengths`` (default ``[4096]``), ``tokenizer``/``pretrained`` (a tokenizer path, or
``smollm2`` for the bundled model's), ``num_samples`` (default 500, RULER's), ``seed`` (default 42).

Importing lm-eval's ``prepare_niah`` costs about 30-40 s and 1 GB once per process (it builds RULER's
6.2M adjective-noun keys) and prints a failed ``punkt_tab`` download, which nothing here needs.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
from typing import Any

from kvpass.bench.prompts import topics_text
from kvpass.models import load_smollm2, smollm2_cache_path

__all__ = ["VARIANTS", "haystack_words", "generate", "tokenizer_for", "sent_split"]

# RULER's template, as in lm_eval/tasks/ruler/niah_utils.py (the generator edits it for one answer).
TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
    "{type_needle_v} for {query} mentioned in the provided text?"
)

#: RULER's parameters of each essay-haystack needle task (lm_eval/tasks/ruler/niah_utils.py, 0.4.13).
VARIANTS: dict[str, dict[str, Any]] = {
    "niah_single_2": dict(type_needle_k="words", type_needle_v="numbers"),
    "niah_single_3": dict(type_needle_k="words", type_needle_v="uuids"),
    "niah_multikey_1": dict(type_needle_k="words", type_needle_v="numbers", num_needle_k=4),
    "niah_multivalue": dict(type_needle_k="words", type_needle_v="numbers", num_needle_v=4),
    "niah_multiquery": dict(type_needle_k="words", type_needle_v="numbers", num_needle_q=4),
}
DEFAULT_SEQ_LENGTHS = (4096,)
NUM_SAMPLES = 500  # RULER's
SEED = 42


@functools.lru_cache(maxsize=1)
def haystack_words() -> tuple[str, ...]:
    """The haystack as lm-eval builds its essay one: the text's words, whitespace collapsed."""

    return tuple(re.sub(r"\s+", " ", topics_text()).strip().split(" "))


@functools.lru_cache(maxsize=1)
def _punkt():
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer(" ".join(haystack_words()))  # about 4 s


@functools.lru_cache(maxsize=64)
def sent_split(text: str) -> list[str]:
    """Sentences of ``text`` by Punkt trained on the haystack (stands in for ``nltk.sent_tokenize``)."""
    return _punkt().tokenize(text)


@contextlib.contextmanager
def _seeded_offline(seed: str):
    import lm_eval.tasks.ruler.prepare_niah as pn

    state, split = random.getstate(), pn.cached_sent_tokenize
    pn.cached_sent_tokenize = sent_split
    random.seed(seed)
    try:
        yield pn
    finally:
        pn.cached_sent_tokenize = split
        random.setstate(state)


def generate(tokenizer, task: str, max_seq_length: int, num_samples: int = NUM_SAMPLES, seed: int = SEED,
             tokens_to_generate: int = 128) -> list[dict]:
    """``num_samples`` samples of RULER's ``task`` (a key of :data:`VARIANTS`) over the prose haystack.

    Each sample is lm-eval's dict (``input``, ``outputs``: the needle values to find, ``length``: prompt
    tokens + ``tokens_to_generate``, ``max_length``, ``gen_prefix``, ``index``) plus ``needle_depth``:
    where the (first) needle holding an answer starts, as a fraction of the input's characters."""
    if task not in VARIANTS:
        raise ValueError(f"kvpass: unknown RULER prose task {task!r}; expected one of {sorted(VARIANTS)}")
    if not isinstance(max_seq_length, int) or max_seq_length <= tokens_to_generate:
        raise ValueError(f"kvpass: max_seq_length must be an int above tokens_to_generate ({tokens_to_generate}), "
                         f"got {max_seq_length!r}")
    with _seeded_offline(f"{seed}|{task}|{max_seq_length}") as pn:
        rows = pn.generate_samples(list(haystack_words()), TOKENIZER=tokenizer, max_seq_length=max_seq_length,
                                   template=TEMPLATE, type_haystack="essay", num_samples=num_samples,
                                   tokens_to_generate=tokens_to_generate, **VARIANTS[task])
    for r in rows:
        first = min(r["input"].find(f"is: {v}.") for v in r["outputs"])
        r["needle_depth"] = round(first / len(r["input"]), 4)
    return rows


def tokenizer_for(kwargs: dict) -> Any:
    """The tokenizer named by task metadata, as lm-eval's RULER tasks resolve it (``tokenizer``, then
    ``pretrained``, then ``model``), where ``smollm2`` names the bundled model's."""
    from lm_eval.tasks.ruler.common_utils import get_tokenizer, resolve_tokenizer_name

    name = resolve_tokenizer_name(kwargs)
    if isinstance(name, str) and name.lower() == "smollm2":
        path = smollm2_cache_path()
        if not (path / "kvpass.json").exists():
            load_smollm2()  # converts once into the cache
        name = str(path)
    return get_tokenizer(name)


def _dataset(task: str, kwargs: dict) -> dict:
    """lm-eval's ``custom_dataset`` result: ``{"test": Dataset}`` over every requested length."""
    import datasets

    lengths = kwargs.get("max_seq_lengths", DEFAULT_SEQ_LENGTHS)
    if isinstance(lengths, int):
        lengths = [lengths]
    tok = tokenizer_for(kwargs)
    n, seed = int(kwargs.get("num_samples", NUM_SAMPLES)), int(kwargs.get("seed", SEED))
    rows = [r for L in lengths for r in generate(tok, task, int(L), num_samples=n, seed=seed)]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


# lm-eval calls these with the task metadata (``custom_dataset: !function ...`` in the YAMLs).
def niah_single_2_prose(**kwargs) -> dict:
    return _dataset("niah_single_2", kwargs)


def niah_single_3_prose(**kwargs) -> dict:
    return _dataset("niah_single_3", kwargs)


def niah_multikey_1_prose(**kwargs) -> dict:
    return _dataset("niah_multikey_1", kwargs)


def niah_multivalue_prose(**kwargs) -> dict:
    return _dataset("niah_multivalue", kwargs)


def niah_multiquery_prose(**kwargs) -> dict:
    return _dataset("niah_multiquery", kwargs)

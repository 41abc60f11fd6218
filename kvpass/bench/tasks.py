"""Long-context tasks generated offline from a seed, in the style of RULER.

RULER: Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654. The tasks here are written from the paper's descriptions (no RULER code), sized
in tokens of the model's own tokenizer, and need no download::

    from kvpass.bench.tasks import make_sample, score
    from kvpass.models import chat_prompt

    sample = make_sample("multi_key_needle", tokenizer, context_tokens=4096, seed=0)
    text = chat_prompt(tokenizer, sample.prompt)      # the caller applies the chat template
    ...                                               # generate `output` from `text`
    score(sample, output)                             # 1.0 when every answer is in the output

Tasks (``TASKS``, RULER's name in brackets):

- ``single_needle`` [niah_single]: one needle "One of the special magic numbers for {key} is:
  {value}." in the haystack; asks for the value.
- ``multi_key_needle`` [niah_multikey]: four needles with different keys; asks for one key, the
  other three values are the distractors.
- ``multi_value`` [niah_multivalue]: four needles with the same key; all four values are answers.
- ``multi_query`` [niah_multiquery]: four needles with different keys; asks for all four at once.
- ``variable_tracking`` [vt]: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (five variables, in
  order at seeded depths) plus a distractor chain with another value; asks for every variable that
  holds the value. The distractors are the other chain's variables.
- ``common_words`` [cwe]: a numbered list in which ten words appear ``freq_cw`` times and all others
  ``freq_ucw`` times (both set from the context size, ``freq_cw`` at most 30 as in RULER); asks for
  the ten most common words. The distractors are the uncommon words.
- ``frequent_words`` [fwe]: a text whose word of rank ``k`` appears ``floor(M / k**2)`` times
  (Zipf-like, alpha = 2 as in RULER); asks for the three most frequent words. The distractors are the
  other words, most frequent first.

Every answer leads every non-answer by a margin of at least two occurrences, also counting the words
of the instructions, so the top-N is never a tie.

Haystacks (``HAYSTACKS``):

- ``filler``: RULER's "noise" sentences, :data:`FILLER`, repeated.
- ``prose``: English paragraphs of the Python reference documentation from CPython's
  ``pydoc_data.topics`` (the paragraphs that are neither code nor grammar), cycled from a seeded
  offset. Its text changes between Python versions, so prose samples are reproducible per Python
  minor version.

The word tasks have no haystack to hide things in (in RULER, too, their whole context is the list),
so for them ``haystack`` picks the vocabulary: ``prose`` draws real English words from the same
documentation, ``filler`` made-up words (``common_words``: pronounceable ``CVCVCV`` words,
``frequent_words``: RULER's "coded" six random letters).

Length: the prompt (instructions, haystack and question; ``len(tokenizer(prompt).input_ids)``)
lands in ``[context_tokens - max(1, floor(0.015 * context_tokens)), context_tokens]``, found by a
secant search over the amount of haystack that tokenizes the whole prompt a handful of times; the
haystack may end in the middle of a sentence (as in RULER). The caller's chat template comes on top.

Determinism: everything is drawn from ``random.Random`` instances seeded by strings (never the global
random state). Keys, values and variable names depend on ``(task, seed)`` only, so one seed asks the
same question at every context size and in both haystacks; the depths, the prose offset and the
word lists also depend on ``context_tokens`` and ``haystack``.
"""

from __future__ import annotations

import bisect
import functools
import math
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "FILLER",
    "HAYSTACKS",
    "NEEDLE",
    "Sample",
    "TASKS",
    "Tokenizer",
    "all_tasks",
    "make_sample",
    "score",
]

HAYSTACKS = ("filler", "prose")

#: RULER's "noise" haystack, repeated.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NEEDLE = "One of the special magic numbers for {key} is: {value}."

#: The prompt is accepted once it is within this fraction of ``context_tokens`` (and never above).
_SLACK = 0.015

_NEEDLE_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
_VT_INTRO = "Memorize and track the chains of variable assignments hidden in the following text."
_CWE_INTRO = (
    "Below is a numbered list of words. Some of the words appear many times in the list, "
    "the others only a few times."
)
_FWE_INTRO = "Read the following text and keep track of how often each word appears in it."

# Keys are "adjective-noun" (RULER draws them the same way from a word list).
_ADJECTIVES = (
    "amber ancient brave bright calm clever crimson curious dusty eager early fancy fierce gentle "
    "giant golden graceful hidden hollow humble icy jolly keen lazy little lively lucky mellow misty "
    "modest noble odd pale patient polite proud quiet rapid rare rusty silent silver sleepy smooth "
    "sour steady stormy sunny swift tame tender tidy tiny velvet vivid wandering warm wild wise witty "
    "young zealous"
).split()
_NOUNS = (
    "anchor apple badger banjo barrel beacon bison blossom bridge button candle canyon castle cedar "
    "comet copper cricket dolphin dragon falcon feather garden glacier harbor hammer helmet island "
    "jacket kettle ladder lantern lemon lizard magnet maple meadow mirror monkey orchard otter panther "
    "parrot pebble pepper pillow pocket puzzle rabbit raven ribbon river rocket saddle salmon spider "
    "squirrel teapot thunder tiger tulip turtle violin walnut whistle willow window wizard zebra"
).split()


class Tokenizer(Protocol):
    """Anything called as ``tokenizer(text)`` that returns an object with ``.input_ids`` (a Hugging
    Face tokenizer, or a fake one in tests)."""

    def __call__(self, text: str) -> Any: ...


@dataclass(frozen=True)
class Sample:
    """One generated prompt with its expected answers.

    ``prompt`` is the user message (instructions, haystack and question); the caller applies the
    chat template. ``answers`` are every expected item (:func:`score` looks for each in the output);
    ``distractors`` are values present in the prompt that are not answers (may be empty).
    """

    task: str
    context_tokens: int
    seed: int
    prompt: str
    answers: tuple[str, ...]
    distractors: tuple[str, ...]
    haystack: str


# ---------------------------------------------------------------------------------------- helpers


def _rng(*parts: object) -> random.Random:
    """A private generator seeded by a string (str seeds hash with SHA-512: stable across runs)."""
    return random.Random("kvpass.bench.tasks/" + "/".join(str(p) for p in parts))


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _words(text: str) -> list[str]:
    """The alphabetic words of ``text``, as the tests and the margins count them (case-sensitive)."""
    return re.findall(r"[A-Za-z]+", text)


@functools.lru_cache(maxsize=1)
def _prose_sentences() -> tuple[str, ...]:
    """Sentences of the prose paragraphs of ``pydoc_data.topics``, in a fixed order."""
    import pydoc_data.topics

    sentences: list[str] = []
    topics = pydoc_data.topics.topics
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            lines = para.split("\n")
            if any(line[:1] in (" ", "\t") for line in lines):  # code, grammar, indented lists
                continue
            text = " ".join(line.strip() for line in lines)
            if any(mark in text for mark in ("::=", ">>>", "***", "===", "---")):  # headings, tables
                continue
            if len(text.split()) < 8 or not text.endswith((".", ":")):
                continue
            if sum(c.isalpha() or c.isspace() for c in text) < 0.85 * len(text):
                continue
            text = re.sub(r"(\w)- (\w)", r"\1-\2", text)  # words hyphenated across a line break
            text = re.sub(r"\s+", " ", text)
            # A sentence that ends in ":" introduced a code block that was dropped: drop it too.
            pieces = re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", text)
            sentences.extend(s for s in pieces if len(s.split()) >= 3 and not s.endswith(":"))
    return tuple(sentences)


@functools.lru_cache(maxsize=1)
def _forbidden_text() -> str:
    """Lower-cased text of both haystacks: drawn keys, values and names must not occur in it."""
    return ("\n".join(_prose_sentences()) + "\n" + FILLER).lower()


@functools.lru_cache(maxsize=1)
def _prose_vocabulary() -> tuple[str, ...]:
    """Distinct lower-case words of 4-12 letters in the prose, sorted."""
    words = set()
    for sentence in _prose_sentences():
        for token in sentence.split():
            token = token.strip(",.;:!?()")
            if re.fullmatch(r"[a-z]{4,12}", token):
                words.add(token)
    return tuple(sorted(words))


def _sentences(haystack: str) -> tuple[str, ...]:
    if haystack == "filler":
        return tuple(re.split(r"(?<=\.) ", FILLER))
    return _prose_sentences()


class _Haystack:
    """The sentences of a haystack cycled from ``start``, cut to a number of words, with sentences
    inserted at relative depths (between sentences)."""

    def __init__(self, sentences: Sequence[str], start: int, min_words: int):
        self.sents: list[str] = []
        self.cum = [0]  # cum[i] = words in sents[:i]
        i = start
        while self.cum[-1] < min_words:
            s = sentences[i % len(sentences)]
            self.sents.append(s)
            self.cum.append(self.cum[-1] + len(s.split()))
            i += 1

    @property
    def max_words(self) -> int:
        return self.cum[-1]

    def text(self, n_words: int, inserts: Sequence[tuple[float, str]]) -> str:
        """The first ``n_words`` words, with each ``(depth, sentence)`` of ``inserts`` (depth in
        [0, 1]) placed before the full sentence nearest to that depth; inserts keep their order for
        equal depths."""
        k = bisect.bisect_right(self.cum, n_words) - 1  # full sentences
        before: list[list[str]] = [[] for _ in range(k + 1)]
        for depth, sentence in sorted(inserts, key=lambda item: item[0]):
            before[round(depth * k)].append(sentence)
        pieces: list[str] = []
        for i in range(k):
            pieces.extend(before[i])
            pieces.append(self.sents[i])
        pieces.extend(before[k])
        rest = n_words - self.cum[k]
        if rest:
            pieces.append(" ".join(self.sents[k].split()[:rest]))
        return " ".join(pieces)


def _fit(
    build: Callable[[int], str],
    tokenizer: Tokenizer,
    context_tokens: int,
    n_max: int,
    guess: Callable[[int], int],
    what: str,
) -> tuple[int, str]:
    """An ``(n, build(n))`` with ``n`` in ``[0, n_max]`` whose prompt has at most ``context_tokens``
    tokens and at least ``context_tokens - max(1, floor(_SLACK * context_tokens))`` (or the largest ``n``
    that fits, where ``build(n + 1)`` adds more tokens than that slack: a long word under a character
    tokenizer), found by a secant
    search (bisection after a few steps) that tokenizes the whole prompt each step. ``build``'s
    token count must grow with ``n``; ``guess(t0)`` proposes the first ``n`` given the token count of
    ``build(0)``."""
    floor_t = context_tokens - max(1, int(context_tokens * _SLACK))
    target = (floor_t + context_tokens) / 2
    p0 = build(0)
    t0 = _count(tokenizer, p0)
    if t0 > context_tokens:
        raise ValueError(
            f"kvpass: {what} needs a prompt of at least {t0} tokens, got context_tokens={context_tokens}; "
            f"pass a larger context_tokens"
        )
    lo, t_lo, p_lo = 0, t0, p0
    hi: int | None = None
    t_hi = 0
    n = guess(t0)
    for step in range(64):
        if t_lo >= floor_t or lo >= n_max or (hi is not None and hi - lo <= 1):
            break
        n = min(max(n, lo + 1), n_max if hi is None else hi - 1)
        p = build(n)
        t = _count(tokenizer, p)
        if t <= context_tokens:
            lo, t_lo, p_lo = n, t, p
        else:
            hi, t_hi = n, t
        if hi is None:  # lo > 0 here: the last probe fitted
            rate = (t_lo - t0) / lo
            n = lo + (int((target - t_lo) / rate) if rate > 0 else n_max)
        elif step >= 6:
            n = (lo + hi) // 2
        else:
            n = lo + int((target - t_lo) * (hi - lo) / max(t_hi - t_lo, 1))
    if t_lo < floor_t and lo >= n_max:
        raise ValueError(
            f"kvpass: {what} ran out of material at {t_lo} tokens, got context_tokens={context_tokens}; "
            f"pass a smaller context_tokens"
        )
    return lo, p_lo


def _unique_numbers(rng: random.Random, count: int, digits: int) -> list[str]:
    """``count`` distinct numbers of ``digits`` digits, none of them in the haystacks."""
    forbidden = _forbidden_text()
    out: list[str] = []
    while len(out) < count:
        value = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if value not in out and value not in forbidden:
            out.append(value)
    return out


def _keys(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct "adjective-noun" keys, none inside another and none in the haystacks."""
    forbidden = _forbidden_text()
    out: list[str] = []
    while len(out) < count:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key in forbidden or any(key in other or other in key for other in out):
            continue
        out.append(key)
    return out


def _free_words(candidates: Sequence[str], count: int, avoid_text: str) -> list[str]:
    """Up to ``count`` words of ``candidates`` (in order) that occur in no other candidate nor in
    ``avoid_text``, case-insensitively: an answer found in the output is then not part of a
    distractor or of the instructions."""
    lowered = [w.lower() for w in candidates]
    out: list[str] = []
    for i, w in enumerate(lowered):
        if w in avoid_text or any(w in other for j, other in enumerate(lowered) if j != i):
            continue
        out.append(candidates[i])
        if len(out) == count:
            break
    return out


# ---------------------------------------------------------------------------------------- needles


def _needle_task(
    task: str,
    tokenizer: Tokenizer,
    context_tokens: int,
    seed: int,
    haystack: str,
    *,
    n_keys: int,
    n_values: int,
    n_queries: int,
) -> Sample:
    content = _rng(task, seed)
    layout = _rng(task, seed, context_tokens, haystack)
    keys = _keys(content, n_keys)
    values = _unique_numbers(content, n_keys * n_values, 7)
    needles = [
        (key, values[i * n_values + j], NEEDLE.format(key=key, value=values[i * n_values + j]))
        for i, key in enumerate(keys)
        for j in range(n_values)
    ]
    asked = keys[:n_queries]
    answers = tuple(value for key, value, _ in needles if key in asked)
    distractors = tuple(value for key, value, _ in needles if key not in asked)
    inserts = [(layout.random(), sentence) for _, _, sentence in needles]

    if n_values > 1:
        question = (
            f"What are all the special magic numbers for {asked[0]} mentioned in the text above? "
            f"There are {n_values} of them. Answer with the numbers only, separated by commas."
        )
    elif n_queries > 1:
        listed = ", ".join(asked[:-1]) + f" and {asked[-1]}"
        question = (
            f"What are the special magic numbers for {listed} mentioned in the text above? "
            f"Answer with the {n_queries} numbers only, in this order, separated by commas."
        )
    else:
        question = (
            f"What is the special magic number for {asked[0]} mentioned in the text above? "
            f"Answer with the number only."
        )
    return _haystack_sample(
        task, tokenizer, context_tokens, seed, haystack, layout, _NEEDLE_INTRO, question, inserts,
        answers, distractors,
    )


def _haystack_sample(
    task: str,
    tokenizer: Tokenizer,
    context_tokens: int,
    seed: int,
    haystack: str,
    layout: random.Random,
    intro: str,
    question: str,
    inserts: Sequence[tuple[float, str]],
    answers: tuple[str, ...],
    distractors: tuple[str, ...],
) -> Sample:
    sentences = _sentences(haystack)
    start = layout.randrange(len(sentences)) if haystack == "prose" else 0
    # Enough words for any tokenizer that spends at least a quarter of a token on a word.
    hay = _Haystack(sentences, start, 4 * context_tokens + 64)

    def build(n: int) -> str:
        return f"{intro}\n\n{hay.text(n, inserts)}\n\n{question}"

    _, prompt = _fit(
        build, tokenizer, context_tokens, hay.max_words,
        guess=lambda t0: int((context_tokens - t0) * 0.7), what=task,
    )
    return Sample(task, context_tokens, seed, prompt, answers, distractors, haystack)


def single_needle(tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose") -> Sample:
    """One needle; the answer is its value."""
    return _needle_task(
        "single_needle", tokenizer, context_tokens, seed, haystack, n_keys=1, n_values=1, n_queries=1
    )


def multi_key_needle(
    tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose"
) -> Sample:
    """Four needles with different keys; asks for one, the other values are distractors."""
    return _needle_task(
        "multi_key_needle", tokenizer, context_tokens, seed, haystack, n_keys=4, n_values=1, n_queries=1
    )


def multi_value(tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose") -> Sample:
    """Four needles with one key; all four values are answers."""
    return _needle_task(
        "multi_value", tokenizer, context_tokens, seed, haystack, n_keys=1, n_values=4, n_queries=1
    )


def multi_query(tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose") -> Sample:
    """Four needles with different keys, all asked at once."""
    return _needle_task(
        "multi_query", tokenizer, context_tokens, seed, haystack, n_keys=4, n_values=1, n_queries=4
    )


# ------------------------------------------------------------------------------ variable tracking

_VT_VARIABLES = 5  # per chain: the value and four hops, as RULER's default


def variable_tracking(
    tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose"
) -> Sample:
    """Two chains ``VAR A = value``, ``VAR B = VAR A``, ...; asks for the first chain's variables."""
    task = "variable_tracking"
    content = _rng(task, seed)
    layout = _rng(task, seed, context_tokens, haystack)
    value, other_value = _unique_numbers(content, 2, 5)
    forbidden = _forbidden_text()
    names: list[str] = []
    while len(names) < 2 * _VT_VARIABLES:
        name = "".join(content.choices(string.ascii_uppercase, k=5))
        # Not in the haystacks even lower-cased (RULER-style scoring ignores case), not "VAR".
        if name not in names and name.lower() not in forbidden and "VAR" not in name:
            names.append(name)
    chains = [(names[:_VT_VARIABLES], value), (names[_VT_VARIABLES:], other_value)]
    inserts: list[tuple[float, str]] = []
    for chain, start_value in chains:
        depths = sorted(layout.random() for _ in chain)
        statements = [f"VAR {chain[0]} = {start_value}."]
        statements += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        inserts += list(zip(depths, statements))
    question = (
        f"Which variables are assigned the value {value}, either directly or through other variables? "
        f"There are {_VT_VARIABLES} of them. Answer with the variable names only, separated by spaces."
    )
    return _haystack_sample(
        task, tokenizer, context_tokens, seed, haystack, layout, _VT_INTRO, question, inserts,
        tuple(chains[0][0]), tuple(chains[1][0]),
    )


# ------------------------------------------------------------------------------------ word tasks


def _made_up_words(rng: random.Random, count: int, avoid: set[str]) -> list[str]:
    """``count`` distinct pronounceable six-letter words (consonant-vowel syllables)."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    out: list[str] = []
    seen = set(avoid)
    while len(out) < count:
        word = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(3))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def _coded_words(rng: random.Random, count: int, avoid: set[str]) -> list[str]:
    """``count`` distinct words of six random lower-case letters (RULER's "coded" words)."""
    out: list[str] = []
    seen = set(avoid)
    while len(out) < count:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def _vocabulary(
    haystack: str, rng: random.Random, count: int, template: str, made_up: Callable[..., list[str]]
) -> list[str]:
    """``count`` distinct words (fewer if the prose runs out), none of them a word of ``template``."""
    avoid = {w.lower() for w in _words(template)}
    if haystack == "prose":
        candidates = [w for w in _prose_vocabulary() if w not in avoid]
        return rng.sample(candidates, min(count, len(candidates)))
    return made_up(rng, count, avoid)


def _answers_first(vocab: list[str], n: int, template: str, what: str) -> list[str]:
    """``vocab`` reordered so that its first ``n`` words are safe answers (see :func:`_free_words`)."""
    answers = _free_words(vocab, n, template.lower())
    if len(answers) < n:
        raise ValueError(f"kvpass: {what} found only {len(answers)} usable answer words, expected {n}")
    return answers + [w for w in vocab if w not in answers]


_CWE_ANSWERS = 10


def common_words(tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose") -> Sample:
    """A numbered list where ten words appear ``freq_cw`` times and the others ``freq_ucw`` times."""
    task = "common_words"
    n = _CWE_ANSWERS
    question = (
        f"What are the {n} most common words in the list above? "
        f"Answer with the {n} words only, separated by commas."
    )
    template = f"{_CWE_INTRO}\n\n\n\n{question}"
    rng = _rng(task, seed, context_tokens, haystack)

    def listing(items: Sequence[str]) -> str:
        return "\n".join(f"{i}. {w}" for i, w in enumerate(items, 1))

    # Tokens per item, measured on a probe list, give the list's capacity, which sets the frequencies
    # (RULER, too, lowers them for short contexts): the common words fill about a quarter of it.
    probe = _vocabulary(haystack, _rng(task, seed, "probe", haystack), 64, template, _made_up_words)
    t_template = _count(tokenizer, template)
    per_item = max((_count(tokenizer, f"{_CWE_INTRO}\n\n{listing(probe)}\n\n{question}") - t_template), 1)
    per_item /= len(probe)
    capacity = max(int((context_tokens - t_template) / per_item), 0)  # items that fit
    freq_ucw = 3 if capacity >= 500 else 1
    template_max = max(Counter(_words(template)).values())
    freq_cw = max(min(30, capacity // (4 * n)), freq_ucw + 2, template_max + 2)

    vocab = _vocabulary(haystack, rng, n + capacity // freq_ucw + 16, template, _made_up_words)
    vocab = _answers_first(vocab, n, template, task)
    answers, pool = vocab[:n], vocab[n:]

    def build(k: int) -> str:
        items = answers * freq_cw + pool[:k] * freq_ucw
        _rng(task, seed, context_tokens, haystack, "shuffle", k).shuffle(items)
        return f"{_CWE_INTRO}\n\n{listing(items)}\n\n{question}"

    k, prompt = _fit(
        build, tokenizer, context_tokens, len(pool),
        guess=lambda t0: int((context_tokens - t0) / per_item / freq_ucw * 0.9), what=task,
    )
    return Sample(task, context_tokens, seed, prompt, tuple(answers), tuple(pool[:k]), haystack)


_FWE_ANSWERS = 3
_FWE_ALPHA = 2.0


def _zipf_counts(m: int, size: int) -> list[int]:
    """Occurrences of the words of rank 1.. : ``floor(m / rank**alpha)``, while at least one."""
    counts = []
    for rank in range(1, size + 1):
        c = int(m / rank**_FWE_ALPHA)
        if c < 1:
            break
        counts.append(c)
    return counts


def frequent_words(
    tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose"
) -> Sample:
    """A shuffled text whose rank-``k`` word appears ``floor(M / k**2)`` times; asks for the top three."""
    task = "frequent_words"
    n = _FWE_ANSWERS
    question = (
        f"What are the {n} most frequent words in the text above? "
        f"Answer with the {n} words only, separated by commas."
    )
    template = f"{_FWE_INTRO}\n\n\n\n{question}"
    rng = _rng(task, seed, context_tokens, haystack)
    # Any tokenizer spends at least a quarter of a token on a word and its space: at most 4 tokens per
    # word, so M stays below 4 * context_tokens and the vocabulary below sqrt(4 * context_tokens).
    size = math.isqrt(4 * context_tokens) + 2
    vocab = _vocabulary(haystack, rng, size, template, _coded_words)
    vocab = _answers_first(vocab, n, template, task)
    size = len(vocab)

    # The smallest M from which on the top n lead every other word, the instructions' words included,
    # by two. floor() loses less than one, so it suffices that M / n**a - 1 >= M / (n + 1)**a + 2 and
    # M / n**a - 1 >= template_max + 2.
    template_max = max(Counter(_words(template)).values())
    lead = n**-_FWE_ALPHA - (n + 1) ** -_FWE_ALPHA
    m_min = math.ceil(max(3 / lead, (template_max + 3) * n**_FWE_ALPHA))

    def words_for(k: int) -> list[str]:
        counts = _zipf_counts(m_min + k, size)
        items = [w for w, c in zip(vocab, counts) for _ in range(c)]
        _rng(task, seed, context_tokens, haystack, "shuffle", k).shuffle(items)
        return items

    def build(k: int) -> str:
        return f"{_FWE_INTRO}\n\n{' '.join(words_for(k))}\n\n{question}"

    k, prompt = _fit(
        build, tokenizer, context_tokens, 4 * context_tokens,
        guess=lambda t0: int((context_tokens - t0) / 4), what=task,
    )
    counts = _zipf_counts(m_min + k, size)
    distractors = tuple(vocab[n : len(counts)])
    return Sample(task, context_tokens, seed, prompt, tuple(vocab[:n]), distractors, haystack)


# ---------------------------------------------------------------------------------------- public

TASKS: dict[str, Callable[..., Sample]] = {
    "single_needle": single_needle,
    "multi_key_needle": multi_key_needle,
    "multi_value": multi_value,
    "multi_query": multi_query,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "frequent_words": frequent_words,
}


def all_tasks() -> list[str]:
    """The task names, in RULER's order."""
    return list(TASKS)


def make_sample(
    task: str, tokenizer: Tokenizer, context_tokens: int, seed: int, haystack: str = "prose"
) -> Sample:
    """Generate the sample ``seed`` of ``task`` whose prompt has at most ``context_tokens`` tokens of
    ``tokenizer`` (and at least ``context_tokens - max(1, floor(0.015 * context_tokens))``).

    Deterministic per ``(task, context_tokens, seed, haystack)`` (and Python minor version, for the
    prose). Raises ``ValueError`` for an unknown task or haystack, or a context too small for the task.
    """
    if task not in TASKS:
        raise ValueError(f"kvpass: unknown task {task!r}; expected one of {all_tasks()}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"kvpass: unknown haystack {haystack!r}; expected one of {list(HAYSTACKS)}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < 1:
        raise ValueError(f"kvpass: context_tokens must be a positive int, got {context_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"kvpass: seed must be an int, got {seed!r}")
    return TASKS[task](tokenizer, context_tokens, seed, haystack)


def score(sample: Sample, output: str, *, case_sensitive: bool = False) -> float:
    """Fraction of ``sample.answers`` found in ``output`` (1.0 = all), each as a substring of the
    stripped output, as RULER's ``string_match_all`` does. RULER compares lower-cased strings; pass
    ``case_sensitive=True`` for an exact-case match."""
    text = output.strip()
    answers = [a.strip() for a in sample.answers]
    if not case_sensitive:
        text = text.lower()
        answers = [a.lower() for a in answers]
    return sum(a in text for a in answers) / len(answers)

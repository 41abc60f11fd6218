"""kvpass.bench.tasks: RULER-style long-context tasks (determinism, length, answers, scoring).

Everything but the last test uses fake tokenizers (fast, offline); the last one uses the real
SmolLM2 tokenizer of the session fixture.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpass.bench.tasks import FILLER, HAYSTACKS, NEEDLE, TASKS, Sample, all_tasks, make_sample, score


class WordTokenizer:
    """One token per whitespace-separated word."""

    def __call__(self, text):
        return SimpleNamespace(input_ids=text.split())


class CharTokenizer:
    """One token per four characters (rounded up), whitespace included."""

    def __call__(self, text):
        return SimpleNamespace(input_ids=[0] * math.ceil(len(text) / 4))


TOKENIZERS = {"words": WordTokenizer(), "chars": CharTokenizer()}
NEEDLE_TASKS = ("single_needle", "multi_key_needle", "multi_value", "multi_query")
EXPECTED_TASKS = [*NEEDLE_TASKS, "variable_tracking", "common_words", "frequent_words"]

CONTEXTS = st.integers(min_value=500, max_value=3000)
SEEDS = st.integers(min_value=0, max_value=2**31 - 1)

NEEDLE_RE = re.compile(NEEDLE.format(key=r"([a-z]+-[a-z]+)", value=r"(\d{7})").replace(".", r"\."))
VAR_RE = re.compile(r"VAR ([A-Z]{5}) = (?:VAR ([A-Z]{5})|(\d+))\.")


def all_cases(fn):
    """Parametrize over every task and haystack."""
    return pytest.mark.parametrize("task", EXPECTED_TASKS)(pytest.mark.parametrize("haystack", HAYSTACKS)(fn))


def question(sample: Sample) -> str:
    return sample.prompt.rsplit("\n\n", 1)[1]


def body(sample: Sample) -> str:
    """The prompt without its first paragraph (the instructions) and its last (the question)."""
    return sample.prompt.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]


def lower_bound(context: int) -> int:
    return context - max(1, int(context * 0.015))


# ----------------------------------------------------------------------------------- the registry


def test_task_names():
    assert all_tasks() == EXPECTED_TASKS
    assert list(TASKS) == EXPECTED_TASKS
    assert HAYSTACKS == ("filler", "prose")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(task="needle"), "unknown task 'needle'"),
        (dict(haystack="essay"), "unknown haystack 'essay'"),
        (dict(context_tokens=0), "context_tokens must be a positive int"),
        (dict(context_tokens=2048.0), "context_tokens must be a positive int"),
        (dict(seed="0"), "seed must be an int"),
        (dict(context_tokens=20), "needs a prompt of at least"),
        (dict(task="common_words", context_tokens=40), "needs a prompt of at least"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = dict(task="single_needle", tokenizer=WordTokenizer(), context_tokens=1000, seed=0)
    args["haystack"] = "filler"
    args.update(kwargs)
    with pytest.raises(ValueError, match="kvpass: .*" + re.escape(message)):
        make_sample(**args)


# ------------------------------------------------------------------------------------ determinism


@all_cases
@given(context=CONTEXTS, seed=SEEDS)
def test_deterministic_and_private_random_state(task, haystack, context, seed):
    state = random.getstate()
    a = make_sample(task, WordTokenizer(), context, seed, haystack)
    b = make_sample(task, WordTokenizer(), context, seed, haystack)
    assert a == b
    assert random.getstate() == state  # the global random state is never used
    assert (a.task, a.context_tokens, a.seed, a.haystack) == (task, context, seed, haystack)


@all_cases
@given(context=CONTEXTS, seeds=st.lists(SEEDS, min_size=2, max_size=2, unique=True))
def test_differs_across_seeds(task, haystack, context, seeds):
    a, b = (make_sample(task, WordTokenizer(), context, s, haystack) for s in seeds)
    assert a.prompt != b.prompt
    assert a.answers != b.answers


@pytest.mark.parametrize("task", [*NEEDLE_TASKS, "variable_tracking"])
def test_same_question_at_every_size_and_haystack(task):
    """Keys, values and names depend on (task, seed) only: paired comparisons across sizes."""
    samples = [make_sample(task, WordTokenizer(), c, 7, h) for c in (600, 1500) for h in HAYSTACKS]
    assert len({s.answers for s in samples}) == 1
    assert len({question(s) for s in samples}) == 1
    assert len({s.prompt for s in samples}) == 4


def test_needle_depths_are_spread():
    """Seeded depths put the needle anywhere, not always at one end."""
    positions = []
    for seed in range(30):
        s = make_sample("single_needle", WordTokenizer(), 800, seed, "filler")
        positions.append(body(s).index("One of the special") / len(body(s)))
    assert min(positions) < 0.2 and max(positions) > 0.8


# ----------------------------------------------------------------------------------------- length


@all_cases
@given(context=CONTEXTS, seed=SEEDS, tokenizer=st.sampled_from(sorted(TOKENIZERS)))
def test_prompt_length(task, haystack, context, seed, tokenizer):
    tok = TOKENIZERS[tokenizer]
    s = make_sample(task, tok, context, seed, haystack)
    n = len(tok(s.prompt).input_ids)
    low = lower_bound(context)
    if task == "frequent_words":
        # its text grows by whole Zipf increments: M -> M + 1 can add two words of up to 11 characters
        # at once, more than 1.5 % of the smallest contexts under the character tokenizer
        # (found by hypothesis: context 500, seed 140, 487 characters)
        low = min(low, context - 24)
    if tokenizer == "chars" and haystack == "prose":
        # the prompt grows by whole words, and a prose word (an identifier, a path) can be longer than
        # the 1.5 % slack in characters: the longest is 50 (found by hypothesis: multi_key_needle,
        # context 500, seed 43493, 490 characters, the next word overshooting 500)
        low = min(low, context - 51)
    assert low <= n <= context
    assert 0.95 * context <= n


@pytest.mark.parametrize("task", EXPECTED_TASKS)
def test_prompt_length_8k(task):
    tok = CharTokenizer()
    s = make_sample(task, tok, 8192, 1, "prose")
    assert lower_bound(8192) <= len(tok(s.prompt).input_ids) <= 8192


# ---------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("haystack", HAYSTACKS)
@given(context=CONTEXTS, seed=SEEDS)
def test_needles(task, haystack, context, seed):
    s = make_sample(task, WordTokenizer(), context, seed, haystack)
    needles = NEEDLE_RE.findall(s.prompt)
    values: dict[str, list[str]] = {}
    for key, value in needles:
        values.setdefault(key, []).append(value)
    shape = {"multi_key_needle": (4, 1), "multi_value": (1, 4), "multi_query": (4, 1)}
    n_keys, n_values = shape.get(task, (1, 1))
    assert len(values) == n_keys and all(len(v) == n_values for v in values.values())
    asked = [key for key in values if key in question(s)]
    assert len(asked) == (4 if task == "multi_query" else 1)
    # Each answer is the value of a needle of an asked key; each distractor that of another key.
    assert sorted(s.answers) == sorted(v for k in asked for v in values[k])
    assert sorted(s.distractors) == sorted(v for k in values if k not in asked for v in values[k])
    assert set(s.answers).isdisjoint(s.distractors)
    for value in s.answers + s.distractors:
        assert s.prompt.count(value) == 1  # nowhere else in the haystack
    if task == "multi_query":  # asked in the order of the answers
        assert s.answers == tuple(values[k][0] for k in sorted(asked, key=question(s).index))


@pytest.mark.parametrize("haystack", HAYSTACKS)
@given(context=CONTEXTS, seed=SEEDS)
def test_variable_tracking(haystack, context, seed):
    s = make_sample("variable_tracking", WordTokenizer(), context, seed, haystack)
    asked = re.search(r"assigned the value (\d+)", question(s)).group(1)
    value_of: dict[str, str] = {}
    for name, source, number in VAR_RE.findall(s.prompt):
        assert name not in value_of  # assigned once
        # Defined in order: a variable's source is assigned earlier in the text.
        value_of[name] = number or value_of[source]
    assert len(value_of) == 10
    assert sorted(s.answers) == sorted(name for name, v in value_of.items() if v == asked)
    assert len(s.distractors) == 5 and set(s.answers).isdisjoint(s.distractors)
    others = {value_of[name] for name in s.distractors}
    assert len(others) == 1 and others != {asked}
    for name in s.answers + s.distractors:  # appears only in its statements, in any case
        assert s.prompt.lower().count(name.lower()) == s.prompt.count(f"VAR {name}")


def check_top_words(s: Sample, n: int):
    counts = Counter(re.findall(r"[A-Za-z]+", s.prompt))  # the whole prompt, instructions included
    assert len(s.answers) == n == len(set(s.answers))
    least_answer = min(counts[a] for a in s.answers)
    most_other = max(c for w, c in counts.items() if w not in s.answers)
    assert least_answer >= most_other + 2  # no tie, a margin of two
    assert s.distractors and set(s.answers).isdisjoint(s.distractors)
    assert all(0 < counts[d] < least_answer for d in s.distractors)
    for a in s.answers:  # an answer is not inside another listed word, in any case
        assert not any(a.lower() in w.lower() for w in counts if w != a and w.lower() != a.lower())


@pytest.mark.parametrize("haystack", HAYSTACKS)
@given(context=CONTEXTS, seed=SEEDS, tokenizer=st.sampled_from(sorted(TOKENIZERS)))
def test_common_words(haystack, context, seed, tokenizer):
    s = make_sample("common_words", TOKENIZERS[tokenizer], context, seed, haystack)
    check_top_words(s, 10)
    items = body(s).split("\n")
    assert [int(line.split(". ")[0]) for line in items] == list(range(1, len(items) + 1))
    listed = Counter(line.split(". ")[1] for line in items)
    assert set(listed) == set(s.answers) | set(s.distractors)
    assert len({listed[a] for a in s.answers}) == 1 and len({listed[d] for d in s.distractors}) == 1


@pytest.mark.parametrize("haystack", HAYSTACKS)
@given(context=CONTEXTS, seed=SEEDS, tokenizer=st.sampled_from(sorted(TOKENIZERS)))
def test_frequent_words(haystack, context, seed, tokenizer):
    s = make_sample("frequent_words", TOKENIZERS[tokenizer], context, seed, haystack)
    check_top_words(s, 3)
    counts = Counter(body(s).split())
    assert set(counts) == set(s.answers) | set(s.distractors)
    ranked = list(s.answers + s.distractors)
    assert [counts[w] for w in ranked] == sorted(counts.values(), reverse=True)  # Zipf ranks
    assert counts[ranked[0]] > 3 * counts[ranked[1]]  # alpha = 2: rank 2 has a quarter


# -------------------------------------------------------------------------------------- haystacks


@all_cases
def test_haystacks(task, haystack):
    import pydoc_data.topics

    s = make_sample(task, WordTokenizer(), 1200, 3, haystack)
    assert s.haystack == haystack
    prose = " ".join(" ".join(t.split()) for t in pydoc_data.topics.topics.values())
    prose_words = set(re.findall(r"[a-z]+", prose))
    if task in ("common_words", "frequent_words"):  # the haystack picks the vocabulary
        vocab = s.answers + s.distractors
        if haystack == "prose":
            assert all(w in prose_words for w in vocab)
        elif task == "common_words":
            assert all(re.fullmatch(r"([bdfgklmnprstvz][aeiou]){3}", w) for w in vocab)
        else:
            assert all(re.fullmatch(r"[a-z]{6}", w) for w in vocab)
        return
    text = body(s)
    for sentence in re.split(r"(?<=\.) ", FILLER):
        assert (sentence in text) == (haystack == "filler")
    if haystack == "prose":
        full = [x for x in re.split(r"(?<=[.!?]) ", text) if len(x.split()) >= 8]
        assert full and sum(x in prose for x in full) >= len(full) // 2


# ---------------------------------------------------------------------------------------- scoring


def hand_sample(answers, distractors=()):
    return Sample("multi_value", 100, 0, "prompt", tuple(answers), tuple(distractors), "filler")


def test_score_hand_made():
    s = hand_sample(["1234567", "7654321", "1111111", "2222222"], ["3333333"])
    assert score(s, "1234567, 7654321, 1111111, 2222222") == 1.0
    assert score(s, "2222222\n1111111\n7654321\n1234567\n") == 1.0  # any order, any separator
    assert score(s, "1234567 and 1111111") == 0.5
    assert score(s, "") == 0.0
    assert score(s, "I don't know.") == 0.0
    assert score(s, "3333333") == 0.0  # a distractor only
    assert score(s, "The special magic numbers are 1234567, 7654321, 1111111 and 2222222.") == 1.0
    assert score(s, "  The first one is 1234567.  ") == 0.25


def test_score_case():
    s = hand_sample(["QWERT", "ASDFG"])
    assert score(s, "qwert asdfg") == 1.0  # as RULER's string_match_all (lower-cased)
    assert score(s, "qwert asdfg", case_sensitive=True) == 0.0
    assert score(s, "QWERT asdfg", case_sensitive=True) == 0.5


@all_cases
def test_score_generated(task, haystack):
    s = make_sample(task, WordTokenizer(), 900, 11, haystack)
    assert score(s, ", ".join(s.answers)) == 1.0
    assert score(s, f"The answer is: {' '.join(s.answers)}.") == 1.0
    assert score(s, ", ".join(s.distractors)) == 0.0
    assert score(s, s.answers[0]) == pytest.approx(1 / len(s.answers))
    half = len(s.answers) // 2
    if half:
        assert score(s, " ".join(s.answers[:half])) == pytest.approx(half / len(s.answers))


# ------------------------------------------------------------------------------ real tokenizer


def test_real_tokenizer(smollm2):
    tok = smollm2.tokenizer
    for task in all_tasks():
        for haystack in HAYSTACKS:
            for context in (2048, 8192):
                s = make_sample(task, tok, context, 0, haystack)
                n = len(tok(s.prompt).input_ids)
                assert lower_bound(context) <= n <= context, (task, haystack, context, n)
                assert score(s, ", ".join(s.answers)) == 1.0
                assert score(s, ", ".join(s.distractors)) == 0.0

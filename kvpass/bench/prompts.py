"""Real English prose that the tools share, offline: CPython's ``pydoc_data.topics`` (the Python reference
manual). :func:`topics_text` is the benches' haystack and perplexity text; :func:`build_prompt` is the
demo's prompt, shared by ``kvpass demo`` and the tensor-parallel check (:mod:`kvpass.tp`): a fact hidden
at a given depth of the prose, then the question."""

from __future__ import annotations

from pydoc_data.topics import topics

from kvpass.models import chat_prompt

__all__ = ["ANSWER", "DEPTH", "FACT", "QUESTION", "build_prompt", "pydoc_prose", "topics_text"]

FACT = "The secret passcode is 7391."
ANSWER = "7391"
QUESTION = "What is the secret passcode? Answer with the number only."
DEPTH = 0.4


def topics_text() -> str:
    """The values of ``pydoc_data.topics.topics`` joined in key order (about 65k words of English)."""
    return "\n\n".join(topics[k] for k in sorted(topics))


def pydoc_prose() -> str:
    """About 465k characters of the Python reference manual, shipped with CPython (offline, real)."""
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def build_prompt(tokenizer, context: int, depth: float = DEPTH) -> tuple[str, int, int]:
    """A chat prompt of at most ``context`` tokens (a few less at worst) with :data:`FACT` as its own
    paragraph at about ``depth`` of the prose.

    Returns ``(text, n_tokens, fact_token_position)``. The fact goes in at the paragraph break (or,
    failing that, the sentence end) just before the requested depth, so no sentence is cut in half.
    """

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def assemble(before: str, after: str) -> str:
        return chat_prompt(tokenizer, f"{before}\n\n{FACT}\n\n{after}\n\n{QUESTION}")

    overhead = n_tokens(assemble("", ""))
    prose = pydoc_prose()
    need = context - overhead
    if need < 64:
        raise ValueError(f"kvpass: demo needs --context >= {overhead + 64} tokens, got {context}")
    enc = tokenizer(prose[: need * 8], add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) < need:
        raise ValueError(
            f"kvpass: demo's filler prose holds about {len(offsets)} tokens; use --context <= "
            f"{len(offsets) + overhead}"
        )
    cut = offsets[int(need * depth)][0]
    for sep in ("\n\n", ". "):
        at = prose.rfind(sep, 0, cut)
        if at > 0 and cut - at < 2000:
            cut = at + len(sep)
            break
    # Joining changes the token count by a few; shrink the tail until the prompt fits.
    for _ in range(8):
        end = offsets[need - 1][1]
        text = assemble(prose[:cut].strip(), prose[cut:end].strip())
        total = n_tokens(text)
        if total <= context:
            break
        need -= total - context
    fact_at = n_tokens(text[: text.index(FACT)])
    return text, total, fact_at

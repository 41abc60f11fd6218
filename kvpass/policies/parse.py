"""Policies on the command line: ``--policy "Quest(budget=1024, page_size=16)"`` or ``--policy Quest
--budget 1024``. :func:`parse_policy` reads that syntax without ``eval``; the subcommands share
:func:`add_policy_arguments` and :func:`policy_from_args`."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from kvpass.policies.base import Policy, check_fields, registered_policies, unknown_policy_error

__all__ = ["DEFAULT_POLICY", "parse_policy", "policy_from_dict", "add_policy_arguments", "policy_from_args"]

#: The compressed policy the demo uses unless told otherwise.
DEFAULT_POLICY = "Quest(budget=1024, page_size=16)"


# ---------------------------------------------------------------------------------------------------
# Policy specs: Name(key=value, ...)
# ---------------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<num>[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<str>'[^'\\]*'|"[^"\\]*")
      | (?P<punct>[(),=\[\]])
    )""",
    re.VERBOSE,
)
_WORDS = {"True": True, "False": False, "None": None}


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            start = len(text[pos:]) - len(text[pos:].lstrip()) + pos
            raise ValueError(
                f"kvpass: cannot read the policy {text!r}: unexpected {text[start]!r} at column "
                f"{start + 1}; expected Name(key=value, ...) with numbers, quoted strings or tuples"
            )
        kind = m.lastgroup
        tokens.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return tokens


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def fail(self, expected: str) -> ValueError:
        tok = self.peek()
        where = f"{tok[1]!r} at column {tok[2] + 1}" if tok else "the end"
        return ValueError(
            f"kvpass: cannot read the policy {self.text!r}: expected {expected}, found {where} "
            f"(syntax: Name or Name(key=value, ...), e.g. \"Quest(budget=1024, page_size=16)\")"
        )

    def take(self, kind: str, value: str | None = None, expected: str = "") -> str:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            raise self.fail(expected or (repr(value) if value else kind))
        self.i += 1
        return tok[1]

    def at(self, value: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == "punct" and tok[1] == value

    def scalar(self) -> Any:
        tok = self.peek()
        if tok is None:
            raise self.fail("a value")
        kind, text, _ = tok
        if kind == "num":
            self.i += 1
            if re.fullmatch(r"[+-]?\d+", text):
                return int(text)
            return float(text)
        if kind == "str":
            self.i += 1
            return text[1:-1]
        if kind == "name":
            self.i += 1
            return _WORDS.get(text, text)  # a bare word is a string: gqa=max
        raise self.fail("a value (number, string, True/False/None or a tuple)")

    def value(self) -> Any:
        for open_, close in (("(", ")"), ("[", "]")):
            if self.at(open_):
                self.i += 1
                items = []
                while not self.at(close):
                    if self.at("(") or self.at("["):
                        raise self.fail("a number or string (tuples do not nest)")
                    items.append(self.scalar())
                    if not self.at(close):
                        self.take("punct", ",", f"',' or {close!r}")
                self.i += 1
                return tuple(items)
        return self.scalar()


def _resolve_name(name: str) -> type[Policy]:
    reg = registered_policies()
    if name in reg:
        return reg[name]
    folded = {k.lower(): v for k, v in reg.items()}
    if name.lower() in folded:
        return folded[name.lower()]
    raise unknown_policy_error(name)


def parse_policy(text: str, budget: int | None = None) -> Policy:
    """Build a policy from a command-line spec, without ``eval``.

    Accepted: ``"Quest"``, ``"Quest()"``, ``"Quest(budget=1024, page_size=16, gqa='max')"``. Values are
    ints, floats, quoted or bare-word strings, ``True``/``False``/``None`` and flat tuples such as
    ``(4, 8)`` or ``[4, 8]``. Names match case-insensitively (``quest`` is ``Quest``).
    ``Policy.describe()`` output reads back to an equal policy.

    ``budget`` (the ``--budget`` option) sets the token budget: as the ``budget`` field where the policy
    has one (overriding the spec), else through the policy's ``with_budget`` (StreamingLLM:
    ``window = budget - sinks``).

    Raises:
        ValueError: a malformed spec, an unknown policy or parameter, or a value the policy rejects;
            the message says what was expected.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"kvpass: empty policy; expected a name such as {sorted(registered_policies())} or "
            f"Name(key=value, ...), got {text!r}"
        )
    r = _Reader(text)
    name = r.take("name", expected="a policy name")
    cls = _resolve_name(name)
    kwargs: dict[str, Any] = {}
    if r.at("("):
        r.i += 1
        while not r.at(")"):
            key = r.take("name", expected="a parameter name (key=value)")
            r.take("punct", "=", f"'=' after {key!r} (parameters are given as key=value)")
            if key in kwargs:
                raise ValueError(f"kvpass: cannot read the policy {text!r}: {key!r} is given twice")
            kwargs[key] = r.value()
            if not r.at(")"):
                r.take("punct", ",", "',' or ')'")
        r.i += 1
    if r.peek() is not None:
        raise r.fail("the end of the policy")

    check_fields(cls, kwargs)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    if budget is not None:
        if "budget" in fields:
            kwargs["budget"] = budget
            if "cache_ratio" in fields:
                kwargs["cache_ratio"] = None  # a token budget replaces a ratio budget
        elif hasattr(cls, "with_budget"):
            try:
                return cls.with_budget(budget, **kwargs)
            except TypeError as e:
                raise ValueError(f"kvpass: {cls.name}.with_budget({budget}, {kwargs}) failed: {e}") from None
        else:
            raise ValueError(f"kvpass: {cls.name} takes no budget; drop --budget")
    return policy_from_dict({"name": cls.name, **kwargs})


def policy_from_dict(spec: dict[str, Any] | str) -> Policy:
    """Build a policy from ``{"name": "Quest", "budget": 512}`` or from a string spec, ``"Quest"`` or
    ``"Quest(budget=512)"`` (read by :func:`parse_policy`)."""
    if isinstance(spec, str):
        return parse_policy(spec)
    if not isinstance(spec, dict):
        raise TypeError(
            f"kvpass: a policy spec is a dict such as {{'name': 'Quest', 'budget': 1024}} or a string such "
            f"as 'Quest(budget=1024)', got {type(spec).__name__}: {spec!r}"
        )
    spec, registry = dict(spec), registered_policies()
    if "name" not in spec:
        raise ValueError(
            f"kvpass: a policy dict needs a 'name' key, one of {sorted(registry)}, got {spec!r}; "
            f"e.g. {{'name': 'Quest', 'budget': 1024}}"
        )
    name = spec.pop("name")
    if not isinstance(name, str) or name not in registry:
        raise unknown_policy_error(name)
    cls = registry[name]
    check_fields(cls, spec)
    return cls(**spec)


def add_policy_arguments(parser: argparse.ArgumentParser, default: str | None) -> None:
    """``--policy SPEC`` and ``--budget N``, shared by the subcommands."""
    names = ", ".join(sorted(registered_policies()))
    parser.add_argument(
        "--policy",
        default=default,
        metavar="SPEC",
        help=f"Name or Name(key=value, ...); one of {names} (default: {default})",
    )
    parser.add_argument(
        "--budget", type=int, default=None, metavar="N", help="token budget, overrides the one in --policy"
    )


def policy_from_args(args: argparse.Namespace) -> Policy:
    return parse_policy(args.policy, budget=args.budget)

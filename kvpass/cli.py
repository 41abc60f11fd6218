"""The ``kvpass`` command line: ``kvpass demo | bench | explain | coverage | check``; it only dispatches.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; :data:`COMMANDS` lists them. Adding a subcommand is one line there plus the
module. The modules are imported only to build the parser, and they import transformers lazily, so
``kvpass --help`` stays quick. What the subcommands share lives below them (policy specs in
:mod:`kvpass.policies.parse`, generation timing in :mod:`kvpass.bench.timing`): nothing imports this
module but the ``kvpass`` script.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import kvpass
from kvpass.api import KVPassError, constant_floats

__all__ = ["main", "build_parser", "COMMANDS"]

#: (subcommand, module, one-line help). Each module defines ``add_arguments(parser)`` and ``run(args)``.
COMMANDS: list[tuple[str, str, str]] = [
    ("demo", "kvpass.demo", "find a fact hidden in a long prompt with Full and a compressed policy; "
                            "compare answers, memory and decode speed (loads the bundled SmolLM2)"),
    ("bench", "kvpass.bench.cli", "sweep policies x budgets on long-context tasks (resumable); table, plots"),
    ("explain", "kvpass.explain", "show which attention sites the graph pass rewrote, which it left "
                                  "exact and why; optionally dump the rewritten graphs"),
    ("coverage", "kvpass.coverage", "the model coverage matrix: every decoder family as a tiny random model, "
                                    "sites per layer, Full vs eager (writes docs/models.md)"),
    ("check", "kvpass.check", "every policy end to end on the simulated CUDA device (--device simulated-cuda): "
                              "tokens vs the CPU run, mixed-device ops, host-to-device bytes per step"),
]


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpass",
        description="kvpass: a torch.compile backend that compresses the KV cache of unmodified "
        "Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"kvpass {kvpass.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_ in COMMANDS:
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _clean(msg: str) -> str:
    msg = str(msg).strip().splitlines()[0] if str(msg).strip() else "error"
    return msg[len("kvpass:"):].strip() if msg.startswith("kvpass:") else msg


def _kvpass_cause(e: BaseException) -> KVPassError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KVPassError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpass`` script. Returns the exit status (0 ok, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2

    try:
        with constant_floats():  # dynamic=True compiles once, not twice (see constant_floats)
            return int(args._run(args) or 0)
    except (KVPassError, ValueError) as e:
        # User mistakes: a bad policy, a budget the policy rejects, an unsupported model or cache.
        print(f"kvpass: {_clean(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        # torch.compile wraps errors raised while compiling (BackendCompilerFailed): unwrap ours.
        cause = _kvpass_cause(e)
        if cause is None:
            raise
        print(f"kvpass: {_clean(cause)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpass: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

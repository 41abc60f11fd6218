"""The model coverage matrix: which Hugging Face decoder families kvpass rewrites, and whether ``Full``
equals eager on each. docs/models.md is written by this module, never typed:

    python -m kvpass.coverage --out docs/models.md        (or: kvpass coverage --out docs/models.md)

Every family is a tiny random model built from its config class (nothing is downloaded): 2 layers,
hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 16, vocab 128, unless the family needs otherwise
(GPT-NeoX and GPT-2 have no GQA; Gemma-2/3 get one sliding-window layer and one global layer). For each
family and cache type (DynamicCache, StaticCache) it runs greedy ``generate()`` eagerly and compiled
with ``kvpass(Full())`` and records, per compiled graph, which layers were rewritten (and by which
pattern) and which were left exact (and why); the compiled tokens and logits are compared with eager.
tests/test_families.py asserts on these rows and checks that docs/models.md is up to date.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from kvpass import Full, kvpass

__all__ = ["FAMILIES", "Family", "FamilyUnavailable", "CoverageRow", "CacheResult", "family", "build",
           "check_family", "matrix", "to_markdown", "main"]

COMMAND = "python -m kvpass.coverage --out docs/models.md"
CACHES = ("dynamic", "static")

#: What every tiny model shares (a family's ``config`` overrides it; ``None`` removes a key).
COMMON: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    # token ids inside the tiny vocabulary (several configs default to ids of their real vocabularies)
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # random weights: never stop early
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family: its transformers classes and what its tiny config changes."""

    name: str
    model_class: str
    config_class: str
    config: dict = dataclasses.field(default_factory=dict)
    note: str = ""


_SLIDING_GLOBAL = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}

FAMILIES: tuple[Family, ...] = (
    Family("Llama", "LlamaForCausalLM", "LlamaConfig"),
    Family("Mistral", "MistralForCausalLM", "MistralConfig", {"sliding_window": None},
           "sliding_window=None (Mistral-7B v0.2 and later); with a window every layer is a sliding layer, "
           "left exact"),
    Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", note="q/k RMSNorm before RoPE"),
    Family("Gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", _SLIDING_GLOBAL,
           "layer 0 sliding-window (8 tokens, shorter than the prompt), layer 1 global; q/k norm"),
    Family("Phi3", "Phi3ForCausalLM", "Phi3Config", note="fused QKV projection"),
    Family("OLMo2", "Olmo2ForCausalLM", "Olmo2Config", note="q/k norm over all heads"),
    Family("Granite", "GraniteForCausalLM", "GraniteConfig", note="attention_multiplier as the SDPA scale"),
    Family("GPT-NeoX", "GPTNeoXForCausalLM", "GPTNeoXConfig", {"num_key_value_heads": None, "head_dim": None},
           "fused QKV, partial rotary (25 %), no GQA"),
    Family("GPT-2", "GPT2LMHeadModel", "GPT2Config",
           {"num_key_value_heads": None, "head_dim": None, "intermediate_size": None},
           "Conv1D projections, learned positions, no GQA"),
    Family("Gemma2", "Gemma2ForCausalLM", "Gemma2Config", {**_SLIDING_GLOBAL, "attn_logit_softcapping": None},
           "layer 0 sliding-window, layer 1 global; attention soft-capping off (SDPA cannot apply it)"),
    Family("SmolLM3", "SmolLM3ForCausalLM", "SmolLM3Config", {"no_rope_layers": [1, 0]},
           "layer 1 without RoPE (NoPE)"),
    Family("Mixtral", "MixtralForCausalLM", "MixtralConfig",
           {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}, "mixture of experts"),
)


class FamilyUnavailable(RuntimeError):
    """The installed transformers lacks the family's classes."""


def family(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"kvpass: no family {name!r}; expected one of {[f.name for f in FAMILIES]}")


def build(fam: Family | str, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32,
          seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The family's tiny random model in eval mode. Raises :class:`FamilyUnavailable` when the installed
    transformers has no such class (the reason names the version)."""
    import transformers

    fam = family(fam) if isinstance(fam, str) else fam
    model_cls = getattr(transformers, fam.model_class, None)
    config_cls = getattr(transformers, fam.config_class, None)
    if model_cls is None or config_cls is None:
        raise FamilyUnavailable(
            f"transformers {transformers.__version__} has no {fam.model_class}/{fam.config_class}"
        )
    kw = {**COMMON, **fam.config, **overrides}
    kw = {k: v for k, v in kw.items() if v is not None or k in ("eos_token_id", "sliding_window")}
    torch.manual_seed(seed)
    cfg = config_cls(**kw, attn_implementation=attn_implementation)
    return model_cls(cfg).eval().to(dtype)


def sliding_layers(model) -> list[int]:
    """Layers whose config says sliding-window attention (what kvpass must leave exact)."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return list(range(cfg.num_hidden_layers))
    return []


@dataclasses.dataclass
class CacheResult:
    """One family with one cache type."""

    cache: str
    # (kind, layer -> pattern) per compiled graph
    graphs: list[tuple[str, dict[int, str]]] = dataclasses.field(default_factory=list)
    left_exact: dict[int, str] = dataclasses.field(default_factory=dict)  # layer -> reason (first seen)
    missing: list[str] = dataclasses.field(default_factory=list)  # graphs where a layer is neither
    calls: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # layer -> (prefill, decode)
    tokens_equal: bool = False
    logits_close: bool = False
    max_logit_diff: float = float("nan")
    error: str | None = None

    @property
    def patterns(self) -> dict[int, list[str]]:
        """layer -> the patterns (P1/P2/P3) it was rewritten with, in graph order."""
        out: dict[int, list[str]] = {}
        for _, sites in self.graphs:
            for layer, pattern in sites.items():
                short = pattern.split()[0]
                if short not in out.setdefault(layer, []):
                    out[layer].append(short)
        return dict(sorted(out.items()))

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens_equal and self.logits_close and not self.missing


@dataclasses.dataclass
class CoverageRow:
    family: Family
    model_class: str
    layers: int
    sliding: list[int]
    results: dict[str, CacheResult]
    unavailable: str | None = None


def _generate(model, ids, new_tokens, **kw):
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, **kw)


def check_cache(model, cache: str, *, prompt_len: int = 12, new_tokens: int = 3, policy=None) -> CacheResult:
    """Greedy generate eagerly and through ``kvpass(policy)`` (default ``Full()``); compare tokens and
    logits; collect what the pass found per compiled graph. 3 new tokens compile the prefill graph,
    the first decode graph and (DynamicCache) the decode graph with a symbolic length."""

    res = CacheResult(cache)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    torch._dynamo.reset()
    with torch.no_grad():
        ref = _generate(model, ids, new_tokens, **kw)
    be = kvpass(policy if policy is not None else Full())
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=be)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # left-exact sites are recorded below
            out = _generate(model, ids, new_tokens, **kw)
    except Exception as e:  # recorded: a matrix cell, not a crash of the whole matrix
        res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return res
    finally:
        model.forward = fwd
        torch._dynamo.reset()
    seen: set = set()
    for rec in be.graphs:
        sites: dict[int, str] = {}
        for r in rec.sites:
            if r["layer"] in sites:
                res.missing.append(f"graph {rec.index}: layer {r['layer']} rewritten twice")
            sites[r["layer"]] = r["pattern"]
        for u in rec.unmatched:
            res.left_exact.setdefault(u.layer, u.reason)
        seen |= set(sites) | {u.layer for u in rec.unmatched}
        res.graphs.append((rec.kind, sites))
    # every layer was rewritten or reported somewhere (a site of unknown layer, None, is reported)
    lost = [layer for layer in range(model.config.num_hidden_layers) if layer not in seen]
    if lost and None not in seen:
        res.missing.append(f"layers {lost} neither rewritten nor reported in any graph")
    for r in be.report_rows():
        if "reason" not in r:
            res.calls[r["layer"]] = (r["prefill_calls"], r["decode_calls"])
    res.tokens_equal = torch.equal(out.sequences, ref.sequences)
    diffs = [float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)]
    res.max_logit_diff = max(diffs) if diffs else float("nan")
    res.logits_close = len(out.logits) == len(ref.logits) and all(
        torch.allclose(a, b, rtol=1.3e-6, atol=1e-5) for a, b in zip(out.logits, ref.logits)  # fp32 defaults
    )
    return res


def check_family(fam: Family | str, caches=CACHES, **kw) -> CoverageRow:
    fam = family(fam) if isinstance(fam, str) else fam
    try:
        model = build(fam)
    except FamilyUnavailable as e:
        return CoverageRow(fam, fam.model_class, 0, [], {}, unavailable=str(e))
    return CoverageRow(
        fam, type(model).__name__, model.config.num_hidden_layers, sliding_layers(model),
        {c: check_cache(model, c, **kw) for c in caches},
    )


def matrix(families=FAMILIES, caches=CACHES) -> list[CoverageRow]:
    return [check_family(f, caches) for f in families]


# ---------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------


def _sites_cell(r: CacheResult) -> str:
    if r.error is not None:
        return "–"
    return ", ".join(f"{layer}: {'→'.join(p)}" for layer, p in r.patterns.items()) or "none"


def _equal_cell(r: CacheResult) -> str:
    if r.error is not None:
        return f"error: {r.error}"
    if r.ok:
        return f"yes ({len(r.graphs)} graphs)"
    why = []
    if not r.tokens_equal:
        why.append("tokens differ")
    if not r.logits_close:
        why.append("logits differ")
    why += r.missing
    return "**no**: " + "; ".join(why)


def _exact_cell(row: CoverageRow) -> str:
    reasons: dict[int, str] = {}
    for r in row.results.values():
        for layer, why in r.left_exact.items():
            reasons.setdefault(layer, why.split(":")[0].split(" (")[0])
    return "; ".join(f"{layer}: {why}" for layer, why in sorted(reasons.items())) or "–"


def to_markdown(rows: list[CoverageRow]) -> str:
    import transformers

    lines = [
        "# Model coverage",
        "",
        f"Generated by `{COMMAND}`.",
        "Do not edit by hand: tests/test_families.py fails when this page differs from what the command",
        "writes.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}, CPU, fp32,"
        ' `attn_implementation="sdpa"`.',
        "Each family is a tiny random model built from its config class (2 layers, hidden 64, 4 query heads,",
        "2 KV heads, head_dim 16, vocab 128; nothing downloaded), compiled with `kvpass(Full())` and run",
        "through greedy `generate()` (a 12-token prompt, 3 new tokens) with a DynamicCache and with",
        '`cache_implementation="static"`. *Sites* lists, per layer, the patterns that rewrote it across',
        "the compiled graphs (P3 prefill → P1 cat for a DynamicCache, P2 index_put for a StaticCache; see",
        "docs/architecture.md); every compiled graph rewrites each listed layer exactly once. *Full = eager*",
        "means the compiled tokens equal eager's and every step's logits agree within fp32 rounding.",
        "",
        "| family | model class | layers | sites (DynamicCache) | sites (StaticCache) | left exact (why) "
        "| Full = eager, DynamicCache | Full = eager, StaticCache | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        f = row.family
        if row.unavailable:
            lines.append(
                f"| {f.name} | `{f.model_class}` | – | – | – | – | skipped: {row.unavailable} | – | {f.note} |"
            )
            continue
        dyn, sta = row.results.get("dynamic"), row.results.get("static")
        lines.append(
            f"| {f.name} | `{row.model_class}` | {row.layers} | {_sites_cell(dyn) if dyn else '–'} "
            f"| {_sites_cell(sta) if sta else '–'} | {_exact_cell(row)} "
            f"| {_equal_cell(dyn) if dyn else '–'} | {_equal_cell(sta) if sta else '–'} | {f.note} |"
        )
    lines += [
        "",
        "Not in the table (tested elsewhere):",
        "",
        "- SmolLM2-135M-Instruct, the bundled model (Llama architecture, 30 layers): `tests/test_smollm2.py`",
        "  (marked `slow`) checks that compiled `Full` equals eager token for token.",
        '- `attn_implementation="eager"`: the graph has no SDPA node; kvpass warns, runs the model exact and',
        "  says so in `backend.report()` (`tests/test_patterns.py`).",
        "- transformers 4.57.x: the same tests run in the second environment",
        "  (`make test VENV=.venv-tf457 TRANSFORMERS=4.57.6`, see the README); this page is written with the",
        "  pinned version.",
        "- Policies other than `Full`, left padding, batch sizes, fp16/bf16, recompilation and memory over",
        "  long decodes: `tests/test_robustness.py`, `tests/test_families.py`, `tests/test_policies.py`.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Command line: python -m kvpass.coverage / kvpass coverage
# ---------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the markdown here (docs/models.md); default: print it")
    p.add_argument("--families", default=None, metavar="A,B",
                   help=f"only these families (default: all of {', '.join(f.name for f in FAMILIES)})")


def run(args: argparse.Namespace) -> int:
    try:
        fams = FAMILIES if not args.families else tuple(family(n.strip()) for n in args.families.split(","))
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    rows = matrix(fams)
    text = to_markdown(rows)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0 if all(r.unavailable or all(c.ok for c in r.results.values()) for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpass.coverage", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

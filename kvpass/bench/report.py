"""Tables and plots from a ``results.jsonl`` written by :func:`kvpass.bench.runner.run_grid`.

- :func:`markdown_table`: one row per policy and budget, one accuracy column per (context, task) with
  Full's accuracy from the same run next to every compressed figure ("0.50 (Full 1.00)"; where Full
  scores 0 the cell says "Full fails", since the compression is then not what loses the answer),
  then mean attention recall (mass / top-k), decode ms/token with its ratio to Full over the same
  cells, and the cache bytes held at the largest context.
- :func:`plot_all`: PNGs (matplotlib, Agg): accuracy vs budget per task, decode ms/token vs context,
  bytes held vs context, recall per layer.
- :func:`write_results_md`: a generated page with the machine, versions, command, table and plots.

Rows of a model with random weights (``tiny``) are marked structure-only: their accuracy means nothing.
"""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpass.bench.runner import KERNELS, PERPLEXITY, RESULTS, load_results
from kvpass.tailorkv import Profile

__all__ = ["markdown_table", "perplexity_table", "kernel_table", "plot_all", "write_results_md",
           "STRUCTURE_ONLY_MODELS"]

#: Models with random weights: the table shows their accuracy but says it means nothing.
STRUCTURE_ONLY_MODELS = ("tiny",)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def _mib(n: float) -> str:
    return "–" if math.isnan(n) else f"{n / (1 << 20):.1f} MiB"


def _kib(n: float) -> str:
    return "–" if math.isnan(n) else f"{n / 1024:.1f} KiB"


def _pct(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.1f} %"


def _f(x: float, digits: int = 2) -> str:
    return "–" if math.isnan(x) else f"{x:.{digits}f}"


def _structure_only(model: str) -> bool:
    return model in STRUCTURE_ONLY_MODELS or model.startswith("tiny")


def _row_label(r: dict[str, Any]) -> tuple[str, int]:
    return r["policy_name"], (r["budget"] if r["budget"] is not None else -1)


def _sort_key(label: tuple[str, int]) -> tuple:
    return (label[0] != "Full", label[0], label[1])


def _by_model(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r["model"]].append(r)
    return dict(out)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One table per model (see the module docstring)."""
    parts = []
    for model, mrows in _by_model(rows).items():
        parts.append(_table_for_model(model, mrows))
    return "\n\n".join(parts)


def _table_for_model(model: str, rows: list[dict[str, Any]]) -> str:
    contexts = sorted({r["context"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cols = [(c, t) for c in contexts for t in tasks]
    labels = sorted({_row_label(r) for r in rows}, key=_sort_key)
    full = {(r["context"], r["task"], r["sample"]): r for r in rows if r["policy_name"] == "Full"}
    biggest = max(contexts)

    head = ["policy", "budget"] + [f"{c} {t}" for c, t in cols] + [
        "recall mass / top-k", "decode ms/tok (× Full)", "policy overhead: prefill / decode",
        "moved/step", f"bytes held @ {biggest}"]
    lines = []
    if _structure_only(model):
        lines.append(f"**{model}: structure only** (random weights: the accuracy figures mean nothing; "
                     f"this run checks that the suite runs end to end)\n")
    else:
        lines.append(f"**{model}**\n")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|")
    for label in labels:
        lrows = [r for r in rows if _row_label(r) == label]
        is_full = label[0] == "Full"
        cells = [label[0], "–" if label[1] < 0 else str(label[1])]
        for c, t in cols:
            sel = [r for r in lrows if r["context"] == c and r["task"] == t]
            if not sel:
                cells.append("–")
                continue
            acc = _mean([r["accuracy"] for r in sel])
            if is_full:
                cells.append(_f(acc) + (" (Full fails)" if acc == 0 else ""))
                continue
            fulls = [full[(c, t, r["sample"])]["accuracy"] for r in sel if (c, t, r["sample"]) in full]
            if not fulls:
                cells.append(f"{_f(acc)} (no Full)")
                continue
            facc = _mean(fulls)
            note = ": Full fails" if facc == 0 else ""
            cells.append(f"{_f(acc)} (Full {_f(facc)}{note})")
        mass = _mean([r["recall"]["mass"] for r in lrows if r.get("recall")])
        topk = _mean([r["recall"]["topk"] for r in lrows if r.get("recall")])
        cells.append(f"{_f(mass, 3)} / {_f(topk, 3)}")
        ms = _mean([r["decode_ms"] for r in lrows])
        pairs = [(r["decode_ms"], full[k]["decode_ms"]) for r in lrows
                 if (k := (r["context"], r["task"], r["sample"])) in full]
        ratio = _mean([a / b for a, b in pairs if b and b > 0])
        cells.append(f"{_f(ms, 1)} ({_f(ratio)}×)")
        pre = _mean([r.get("overhead_prefill_share", float("nan")) for r in lrows])
        dec = _mean([r.get("overhead_decode_share", float("nan")) for r in lrows])
        cells.append(f"{_pct(pre)} / {_pct(dec)}")
        cells.append(_kib(_mean([r.get("bytes_moved_per_step", float("nan")) for r in lrows])))
        cells.append(_mib(_mean([r["device_bytes"] + r.get("host_bytes", 0) for r in lrows
                                 if r["context"] == biggest])))
        lines.append("| " + " | ".join(cells) + " |")
    n_samples = len({r["sample"] for r in rows})
    lines.append("")
    lines.append(f"Accuracy: mean over {n_samples} sample(s) of the fraction of expected answers found in the "
                 f"output. Recall: mean over layers and sampled decode steps of the share of the true "
                 f"attention weight (mass) and of the true top-N tokens (top-k) the policy attended. "
                 f"Decode ratio: the policy's ms/token over Full's on the same cells (below 1: faster). "
                 f"Policy overhead: the policy's own work (metadata, clustering, selection) as a share of "
                 f"prefill time and of a decode step. Moved/step: bytes copied between tiers per decode step. "
                 f"Bytes: device + host bytes of every site's keys, values and metadata at the last step.")
    return "\n".join(lines)


def decode_by_context_table(rows: list[dict[str, Any]]) -> str:
    """Decode ms/token per policy and context (mean over tasks and samples), with the ratio to Full's
    cells of the same context: how a policy's gain grows with the share of a step the cache takes.
    Empty with fewer than two contexts."""
    parts = []
    for model, mrows in _by_model(rows).items():
        contexts = sorted({r["context"] for r in mrows})
        if len(contexts) < 2:
            continue
        full = {(r["context"], r["task"], r["sample"]): r["decode_ms"] for r in mrows if r["policy_name"] == "Full"}
        head = ["policy", "budget"] + [f"{c} tokens" for c in contexts]
        lines = [f"**{model}**\n", "| " + " | ".join(head) + " |",
                 "|" + "|".join(["---"] * 2 + ["---:"] * len(contexts)) + "|"]
        for label in sorted({_row_label(r) for r in mrows}, key=_sort_key):
            cells = [label[0], "–" if label[1] < 0 else str(label[1])]
            for c in contexts:
                sel = [r for r in mrows if _row_label(r) == label and r["context"] == c]
                if not sel:
                    cells.append("–")
                    continue
                ratios = [r["decode_ms"] / full[k] for r in sel
                          if (k := (c, r["task"], r["sample"])) in full and full[k] > 0]
                cells.append(f"{_f(_mean([r['decode_ms'] for r in sel]), 1)} ({_f(_mean(ratios))}×)")
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def site_details_table(rows: list[dict[str, Any]]) -> str:
    """Per layer, for policies that report tiers (TailorKV): tier, dense-preference P, where the query
    estimate came from and its mean cosine similarity to the true query, the packed/fp16 byte ratio of
    a quantised layer, bytes per tier and moved per decode step. From the row with the longest
    context of each such policy and budget."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r.get("site_details"):
            key = (r["policy_name"], r["budget"])
            if key not in best or r["context"] > best[key]["context"]:
                best[key] = r
    if not best:
        return ""
    head = ["policy", "budget", "context", "layer", "tier", "P", "estimate from", "estimate cos",
            "packed / fp16", "attended", "device MiB", "host MiB", "moved KiB/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (name, budget), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        for d in r["site_details"]:
            steps = max(1, int(d.get("steps", 0)))
            cells = [name, str(budget), str(r["context"]), str(d.get("layer")), d.get("tier", "-"),
                     _num(d.get("P"), 3), d.get("estimate", "-"), _num(d.get("estimate_cos"), 3),
                     _num(d.get("quant_ratio"), 3), str(d.get("tokens_attended", "")),
                     f"{d.get('device_bytes', 0) / 2**20:.2f}", f"{d.get('host_bytes', 0) / 2**20:.2f}",
                     f"{d.get('bytes_moved', 0) / 1024 / steps:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(v, digits: int) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:.{digits}f}"


def perplexity_table(rows: list[dict[str, Any]]) -> str:
    """Perplexity per policy and budget (rows) and window (columns), with the delta to Full of the same
    run: "12.17 (+0.49)"."""
    if not rows:
        return "(no perplexity rows)"
    parts = []
    for model, mrows in _by_model(rows).items():
        windows = sorted({(r["window"], r["eval_tokens"]) for r in mrows})
        labels = sorted({_row_label(r) for r in mrows}, key=_sort_key)
        head = ["policy", "budget"] + [f"window {w} (last {e} scored)" for w, e in windows]
        lines = [f"**{model}**" + (" (structure only)" if _structure_only(model) else "") + "\n",
                 "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * len(windows)]
        for label in labels:
            cells = [label[0], "–" if label[1] < 0 else str(label[1])]
            for w, e in windows:
                sel = [r for r in mrows if _row_label(r) == label and (r["window"], r["eval_tokens"]) == (w, e)]
                if not sel:
                    cells.append("–")
                    continue
                r = sel[-1]
                cells.append(f"{r['ppl']:.2f}" if label[0] == "Full" else f"{r['ppl']:.2f} ({r['delta']:+.2f})")
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + (
        "\n\nPerplexity of `pydoc_data.topics` prose decoded token by token with teacher forcing: the window's "
        "first tokens are prefilled, the last ones are each predicted by a decode step over the compressed "
        "cache. In parentheses: the difference to Full in the same run.")


def kernel_table(rows: list[dict[str, Any]]) -> str:
    """Each kernel against its dense torch counterpart: ms, speedup, achieved GB/s (and % of peak on CUDA)."""
    if not rows:
        return "(no kernel rows)"
    cuda = any("pct_peak" in r for r in rows)
    head = ["kernel", "shape", "S", "N", "dtype", "impl", "ms", "baseline", "baseline ms", "speedup", "GB/s"]
    if cuda:
        head.append("% of peak")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 6 + "---:|" * (len(head) - 6)]
    for r in rows:
        cells = [r["kernel"], r["shape"], str(r["S"]), str(r["N"]), r["dtype"], r["impl"], f"{r['ms']:.3f}",
                 r["baseline"], f"{r['baseline_ms']:.3f}", f"{r['speedup']:.2f}×", f"{r['gbps']:.1f}"]
        if cuda:
            cells.append(f"{r.get('pct_peak', float('nan')):.0f} %")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ plots


def plot_all(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the PNGs into ``out_dir`` (one set per model; file names start with the model name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str) -> None:
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)

    for model, mrows in _by_model(rows).items():
        slug = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
        tag = " (structure only)" if _structure_only(model) else ""
        tasks = list(dict.fromkeys(r["task"] for r in mrows))
        contexts = sorted({r["context"] for r in mrows})
        names = sorted({r["policy_name"] for r in mrows if r["policy_name"] != "Full"})
        labels = sorted({_row_label(r) for r in mrows}, key=_sort_key)

        # accuracy vs budget, one panel per task
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
        for ax, t in zip(axes[0], tasks):
            for name in names:
                pts = sorted({r["budget"] for r in mrows if r["policy_name"] == name and r["task"] == t} - {None})
                ys = [_mean([r["accuracy"] for r in mrows if r["policy_name"] == name and r["task"] == t
                             and r["budget"] == b]) for b in pts]
                ax.plot(pts, ys, marker="o", label=name)
            facc = _mean([r["accuracy"] for r in mrows if r["policy_name"] == "Full" and r["task"] == t])
            ax.axhline(facc, color="k", linestyle="--", label="Full")
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.05, 1.05)
            ax.set_title(t)
            ax.set_xlabel("budget (tokens)")
            ax.set_ylabel("accuracy")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{model}{tag}: accuracy vs budget (mean over contexts and samples)")
        save(fig, f"{slug}_accuracy_vs_budget.png")

        # decode ms/token and bytes held vs context, one line per policy × budget
        for key, ylabel, fname, scale in (
            ("decode_ms", "decode ms/token", "decode_vs_context.png", 1.0),
            ("bytes", "KV bytes held (MiB)", "bytes_vs_context.png", 1 / (1 << 20)),
        ):
            fig, ax = plt.subplots(figsize=(6, 4))
            for label in labels:
                ys = []
                for c in contexts:
                    sel = [r for r in mrows if _row_label(r) == label and r["context"] == c]
                    vals = [r["decode_ms"] if key == "decode_ms" else r["device_bytes"] + r.get("host_bytes", 0)
                            for r in sel]
                    ys.append(_mean(vals) * scale)
                name = label[0] if label[1] < 0 else f"{label[0]} {label[1]}"
                ax.plot(contexts, ys, marker="o", label=name, linestyle="--" if label[0] == "Full" else "-")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}{tag}: {ylabel} vs context")
            ax.legend(fontsize=7)
            save(fig, f"{slug}_{fname}")

        # recall per layer, one line per policy × budget
        fig, ax = plt.subplots(figsize=(6, 4))
        for label in labels:
            per: dict[int, list[float]] = defaultdict(list)
            for r in mrows:
                if _row_label(r) == label:
                    for layer, v in (r.get("recall_per_layer") or {}).items():
                        per[int(layer)].append(v["mass"])
            if not per:
                continue
            layers = sorted(per)
            name = label[0] if label[1] < 0 else f"{label[0]} {label[1]}"
            ax.plot(layers, [_mean(per[lay]) for lay in layers], marker=".", label=name,
                    linestyle="--" if label[0] == "Full" else "-")
        ax.set_xlabel("layer")
        ax.set_ylabel("attention mass recalled")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{model}{tag}: recall per layer")
        ax.legend(fontsize=7)
        save(fig, f"{slug}_recall_per_layer.png")
    return written


# ------------------------------------------------------------------------------------------- page


def page_rows_and_plots(results: Path, path: Path, plot, plots_dir: Path, rerun: str):
    """What a generated page needs: the rows of ``results`` (a ValueError naming
    ``rerun`` when there are none), and ``plot(rows, plots_dir)``'s PNGs copied into
    ``<path without suffix>/`` next to the page. Returns ``(rows, img_dir, pngs)``."""
    rows = load_results(results)
    if not rows:
        raise ValueError(f"kvpass: no results in {results}; run `{rerun}` first")
    path.parent.mkdir(parents=True, exist_ok=True)
    img_dir = path.parent / path.stem
    pngs = plot(rows, plots_dir)
    if img_dir.resolve() != Path(plots_dir).resolve():
        img_dir.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            shutil.copyfile(p, img_dir / p.name)
    return rows, img_dir, pngs


def write_results_md(out_dir: Path, path: Path, command: str) -> Path:
    """Write a generated page at ``path`` from ``out_dir/results.jsonl``: machine, versions, the
    exact command, the table and the plots (PNGs copied into ``<path without suffix>/`` next to it,
    linked relatively)."""
    out_dir, path = Path(out_dir), Path(path)
    rows, img_dir, pngs = page_rows_and_plots(out_dir / RESULTS, path, plot_all, out_dir / "plots",
                                              f"kvpass bench --out {out_dir}")

    machines = list({tuple(sorted((k, str(v)) for k, v in r["machine"].items())): r["machine"] for r in rows}.values())
    commands = list(dict.fromkeys(r.get("command", "") for r in rows))
    lines = [
        "# kvpass bench results",
        "",
        "<!-- Generated by `kvpass bench` (kvpass.bench.report.write_results_md); do not edit by hand: "
        "rerun the command below. -->",
        "",
        "This page is generated by `kvpass bench` from `results.jsonl`; rerun the command to update it.",
        "",
        "## Command",
        "",
        "```bash",
        command,
        "```",
        "",
    ]
    if any(c and c != command for c in commands):
        lines += ["Rows were produced by:", ""] + [f"- `{c}`" for c in commands if c] + [""]
    lines += ["## Machine", ""]
    for m in machines:
        lines.append(
            f"- {m.get('cpu_count')} cores, {m.get('threads')} torch threads, {m.get('processor')}, "
            f"{m.get('platform')}; Python {m.get('python')}, torch {m.get('torch')}, "
            f"transformers {m.get('transformers')}" + (", CUDA" if m.get("cuda") else ", CPU")
        )
    first, last = min(r["finished"] for r in rows), max(r["finished"] for r in rows)
    lines += ["", f"{len(rows)} cells, finished between {first} and {last} (UTC).", "", "## Accuracy, recall, speed, memory", ""]
    lines.append(markdown_table(rows))
    by_context = decode_by_context_table(rows)
    if by_context:
        lines += ["", "## Decode ms/token by context", "", "Mean over the context's cells; in parentheses the "
                  "ratio to Full's ms/token on the same cells (below 1: faster).", "", by_context]
    profile = out_dir / "tailorkv_profile.json"
    if profile.exists():
        lines += ["", "## TailorKV profile", "", f"Calibrated by the bench into `{profile.name}` (see "
                  "docs/methods.md, TailorKV):", "", "```", Profile.load(profile).describe(), "```"]
    details = site_details_table(rows)
    if details:
        lines += ["", "## Per layer: tiers, query estimates, bytes", "", details]
    ppl = load_results(out_dir / PERPLEXITY)
    if ppl:
        lines += ["", "## Perplexity", "", perplexity_table(ppl)]
    kern = load_results(out_dir / KERNELS)
    if kern:
        dev = "CUDA (Triton)" if kern[0].get("device") == "cuda" else "CPU (the torch reference path)"
        lines += ["", "## Kernel micro-benchmarks", "", f"On {dev}; N: tokens attended (quest: pages); "
                  "GB/s: bytes the op must read and write over its time.", "", kernel_table(kern)]
    lines += ["", "## Plots", ""]
    for p in pngs:
        rel = f"{img_dir.name}/{p.name}"
        lines += [f"![{p.stem}]({rel})", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path

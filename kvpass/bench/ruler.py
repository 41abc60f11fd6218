"""RULER through lm-eval's tasks with one exact prefill per sample shared by every policy.

lm-eval's own model loop (:mod:`kvpass.bench.lm_eval`) prefills every sample once per policy; on two
cores a 4k prefill costs about 10 s and an 8k one 30 s, so a page of 50 samples, two lengths and a
dozen policies would spend nearly all its time prefilling the same prompts again. Every kvpass policy
attends exactly at prefill, so here each sample is prefilled once, exactly, with the model's own
forward, and every policy continues from a copy of that cache (``backend.adopt``), greedily, for the
task's ``max_gen_toks`` tokens or to the end-of-sequence token. What lm-eval decides stays lm-eval's:
the samples and the prompt text (``task.build_all_requests``: the context with RULER's ``gen_prefix``),
the stop strings and the score (``task.process_results``). What its ``HFLM`` loop does is done the same
way: the context tokenized without special tokens and left-truncated to ``max_length - max_gen_toks``,
the answer decoded with ``skip_special_tokens`` and cut at each ``until`` string. Batch 1, so no row is
padded (lm-eval's loop, with its left-padded batches, is the check: ``kvpass bench --lm-eval`` on the
same samples; :func:`agreement` compares the two runs' answers).

Policies that share a graph (``graph_key()``) share one compiled backend (``set_policy``); each graph
gets its own backend compiled with ``isolate_recompiles=True`` on the same model, so all of them live in
one process without resetting dynamo. ``eager`` continues with the model's own forward (the reference
of the compiled Full). A policy whose continuation attended no fewer tokens than it held is marked
``compressed: no`` on the page.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from lm_eval.tasks import TaskManager, get_task_dict

from kvpass import Full, KVPassError, kvpass
from kvpass.bench import lm_eval as le
from kvpass.bench.common import load_model, parse_ints
from kvpass.bench.fidelity import _prefill
from kvpass.bench.lm_eval import SHARED, agreement, batch_summary, loop_agreement, shared_cells
from kvpass.bench.ruler_tasks import TASKS_DIR

__all__ = ["Request", "requests", "continue_greedy", "run_shared", "agreement", "shared_cells", "run_bench_shared"]

class Request:
    """One lm-eval ``generate_until`` request: the task object, its doc, the context text, the stop
    strings and ``max_gen_toks``."""

    __slots__ = ("task_name", "task", "doc", "doc_id", "context", "until", "max_gen_toks", "length")

    def __init__(self, task_name, task, doc, doc_id, context, until, max_gen_toks, length):
        self.task_name, self.task, self.doc, self.doc_id = task_name, task, doc, doc_id
        self.context, self.until, self.max_gen_toks, self.length = context, until, max_gen_toks, length

    def score(self, text: str) -> float:
        """lm-eval's score of ``text`` as this request's answer (RULER: the metric named by the length)."""
        res = self.task.process_results(self.doc, [text])
        key = str(self.length) if self.length else next(iter(res))
        return float(res[key])


def requests(tasks: Iterable[str], lengths: list[int], limit: int | None, tokenizer_dir: str,
             max_gen_toks: int | None = None, chat_template: Callable | None = None) -> list[Request]:
    """The requests lm-eval would send a model for ``tasks`` (RULER's ``max_seq_lengths`` from
    ``lengths``; the first ``limit`` docs of each task), with lm-eval's prompt construction."""
    meta: dict[str, Any] = {"max_seq_lengths": list(lengths), "tokenizer": tokenizer_dir, "pretrained": tokenizer_dir}
    if limit is not None:
        meta["num_samples"] = limit  # the first N of RULER's samples: the same docs, generated faster
    # simple_evaluate's default seeds, set before the tasks are built as it sets them: lm-eval's own RULER
    # generators draw from the global random state, so the same docs as lm-eval's loop need the same seeds
    random.seed(0)
    np.random.seed(1234)
    torch.manual_seed(1234)
    tm = TaskManager(include_path=str(TASKS_DIR), metadata=meta)
    out: list[Request] = []
    found = dict(_flat(get_task_dict(list(tasks), tm)))
    order = [t for t in tasks if t in found] + [t for t in found if t not in tasks]  # the caller's order
    for name, task in ((t, found[t]) for t in order):
        if task.OUTPUT_TYPE != "generate_until":
            raise ValueError(f"kvpass: the shared-prefill RULER runner serves generate_until tasks; {name} is "
                             f"{task.OUTPUT_TYPE}. Fix: run it through lm-eval's loop (kvpass bench --lm-eval).")
        task.build_all_requests(limit=limit, rank=0, world_size=1, apply_chat_template=chat_template is not None,
                                chat_template=chat_template)
        for inst in task.instances:
            context, gen = inst.args
            gen = dict(gen)
            until = gen.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n_gen = int(max_gen_toks or gen.get("max_gen_toks", 256))
            length = int(inst.doc["max_length"]) if "max_length" in inst.doc else 0
            out.append(Request(name, task, inst.doc, inst.doc_id, context, until, n_gen, length))
    return out


def _flat(task_dict: dict):
    for name, obj in task_dict.items():
        if isinstance(obj, dict):
            yield from _flat(obj)
        else:
            yield getattr(name, "group_name", name), obj  # a group's key is an object, a task's a str


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def continue_greedy(fwd, cache, first: torch.Tensor, steps: int, eos: set[int], adopt=None) -> list[int]:
    """Greedy tokens from a prefilled ``cache`` whose next token is ``first (1, 1)``: up to ``steps``
    tokens, ``first`` included, ending at the first end-of-sequence token (kept, as generate keeps it).
    ``adopt``: the backend's ``adopt`` for a kvpass forward (the cache is copied first)."""
    cache = copy.deepcopy(cache)
    if adopt is not None:
        cache = adopt(cache)
    tok, new = first, [int(first)]
    while len(new) < steps and new[-1] not in eos:
        out = fwd(input_ids=tok, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(int(tok))
    return new


def answer(tokenizer, new_ids: list[int], until: list[str]) -> str:
    """What lm-eval's HFLM scores: the new tokens decoded without special tokens, cut at each stop string."""
    s = tokenizer.decode(new_ids, skip_special_tokens=True)
    for term in until:
        if term:
            s = s.split(term)[0]
    return s


def run_shared(model, tokenizer, reqs: list[Request], policies: list, *, max_length: int | None = None,
               on_sample: Callable[[dict], None] | None = None, done: set | None = None,
               progress: bool = True) -> list[dict]:
    """Every policy of ``policies`` (kvpass policies or ``"eager"``) on every request, one exact prefill per
    request. Returns (and passes to ``on_sample`` as they finish) one row per policy and request:
    ``policy, task, max_seq_length, doc, target, response, score, prompt_tokens, new_tokens, compressed,
    attended, seconds``. ``done``: ``(policy, task, length, doc)`` keys to skip (a resumed run)."""

    eager = type(model).forward.__get__(model)  # model.forward may be compiled already
    limit = max_length or int(getattr(model.config, "max_position_embeddings", 0)) or None
    eos = _eos_ids(model, tokenizer)
    names = [p if isinstance(p, str) else p.describe() for p in policies]
    backends: dict[str, tuple] = {}  # graph_key -> (backend, compiled forward)

    def served(p):
        key = p.graph_key()
        if key not in backends:
            be = kvpass(Full() if key == Full().graph_key() else p, strict=True)
            backends[key] = (be, torch.compile(eager, backend=be, dynamic=True, isolate_recompiles=True))
        be, fwd = backends[key]
        be.set_policy(p)
        return be, fwd

    rows: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(reqs) * len(policies), desc="ruler (shared prefill)", unit="run", dynamic_ncols=True)
    try:
        with torch.no_grad():
            for r in reqs:
                todo = [(n, p) for n, p in zip(names, policies)
                        if not done or (n, r.task_name, r.length, r.doc_id) not in done]
                if not todo:
                    if bar is not None:
                        bar.update(len(policies))
                    continue
                ids = tokenizer(r.context, return_tensors="pt", add_special_tokens=False)["input_ids"]
                if limit:
                    ids = ids[:, -(limit - r.max_gen_toks):]  # HFLM's left truncation
                t0 = time.perf_counter()
                first, cache = _prefill(eager, ids)  # fidelity's exact prefill: (next token (1, 1), cache)
                prefill_s = time.perf_counter() - t0
                for name, p in todo:
                    t1 = time.perf_counter()
                    if isinstance(p, str):
                        new = continue_greedy(eager, cache, first, r.max_gen_toks, eos)
                        summary = {"compressed": False}
                    else:
                        be, fwd = served(p)
                        calls = be.graph_calls()
                        new = continue_greedy(fwd, cache, first, r.max_gen_toks, eos, adopt=be.adopt)
                        if len(new) > 1 and be.graph_calls() == calls:
                            raise KVPassError(f"kvpass: {name} decoded {r.task_name} #{r.doc_id} without kvpass's "
                                              "graphs: compression was off. See backend.report().")
                        summary = batch_summary(be, [ids.shape[1]], len(new))
                        be.clear_state()
                    text = answer(tokenizer, new, r.until)
                    row = {"policy": name, "task": r.task_name, "max_seq_length": r.length, "doc": r.doc_id,
                           "target": r.doc.get("outputs"), "response": text, "score": r.score(text),
                           "prompt_tokens": int(ids.shape[1]), "new_tokens": len(new),
                           "compressed": bool(summary.get("compressed")),
                           "attended": (summary.get("attended") or [None])[0],
                           "prefill_s": round(prefill_s, 2), "seconds": round(time.perf_counter() - t1, 2)}
                    rows.append(row)
                    if on_sample is not None:
                        on_sample(row)
                    if bar is not None:
                        bar.set_postfix_str(f"{name[:32]} {r.task_name} #{r.doc_id}: {row['score']:.2f}")
                        bar.update(1)
                del cache
    finally:
        if bar is not None:
            bar.close()
    return rows


def run_bench_shared(args) -> int:
    """``kvpass bench --lm-eval TASKS --shared-prefill``: :func:`run_shared` over lm-eval's requests for
    TASKS, every sample's row in ``OUT/lm_eval_samples.jsonl`` as it finishes (a rerun resumes), the page
    with the cells of both loops found in OUT and, where both ran the same samples, their agreement."""
    import datetime
    import json


    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    lengths = parse_ints(args.max_seq_lengths or "4096", "max-seq-lengths")
    budgets = parse_ints(args.budgets or "1024", "budgets")
    policies = le._policy_specs(args.policies or "Full", budgets)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"kvpass: --limit needs a positive number of samples, got {args.limit}")
    if getattr(args, "chat_template", False):
        raise ValueError("kvpass: --shared-prefill does not apply chat templates yet. Fix: drop --chat-template, "
                         "or run lm-eval's loop (no --shared-prefill).")
    command = le._command(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    page = Path(args.results_md) if args.results_md else out / "lm-eval.md"
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(parse_ints(str(args.threads), "threads")[0])
    samples_path = out / le.SAMPLES
    done = {(r["policy"], r["task"], r["max_seq_length"], r["doc"]) for r in le._read(samples_path)
            if r.get("mode") == SHARED and r.get("limit") == args.limit}
    t_all = time.perf_counter()
    try:
        model, tok, model_name = load_model(args.model)
        reqs = requests(tasks, lengths, args.limit, le._tokenizer_dir(args.model), args.max_gen_toks)
        print(f"kvpass bench: {len(reqs)} requests x {len(policies)} policies, one shared prefill each "
              f"({len(done)} sample rows in {samples_path} already)", flush=True)

        def keep(row: dict) -> None:
            row |= {"mode": SHARED, "limit": args.limit, "model": model_name,
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
            with samples_path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")

        run_shared(model, tok, reqs, policies, on_sample=keep, done=done, progress=not args.no_progress)
    finally:
        torch.set_num_threads(threads)
    rows = le._read(out / le.RESULTS) + shared_cells(le._read(samples_path), args.limit)
    le.write_page(rows, page, command, meta=le.versions() | {"model": args.model},
                  agreement=loop_agreement(le._read(samples_path)))
    print(f"kvpass bench: wrote {page} ({len(rows)} cells); this run took {time.perf_counter() - t_all:.0f} s",
          flush=True)
    return 0

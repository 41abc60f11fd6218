"""What each policy answers on one needle sample of the bench suite (a look inside a score, not a test).

    python demos/needle_answers.py --context 2048 --policies 'CentroidKV(cache_ratio=0.75),CentroidKV(cache_ratio=0.5)'

The bench scores an answer by whether the expected number appears in it; this prints the answer
itself, so a 0.00 can be told apart: the model lost the needle, or found it and garbled it. Full
runs first. Each policy gets a fresh ``torch.compile`` (about 100 s of compilation at 2k tokens on
one core) that serves every seed; greedy decoding, ``--new-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpass import kvpass
from kvpass.bench.common import build_policies
from kvpass.bench.tasks import TASKS, score
from kvpass.models import chat_prompt, load_smollm2


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    ap.add_argument("--policies", default="CentroidKV(cache_ratio=0.75)", help="as for kvpass bench; Full is added")
    ap.add_argument("--budget", type=int, default=1024, help="budget for specs without one (default 1024)")
    ap.add_argument("--task", default="single_needle", choices=sorted(TASKS))
    ap.add_argument("--seeds", default="0", help="comma-separated sample seeds (default 0)")
    ap.add_argument("--new-tokens", type=int, default=28)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, tok = load_smollm2()
    policies = build_policies(args.policies, [args.budget])
    samples = []
    for seed in (int(s) for s in args.seeds.split(",")):
        sample = TASKS[args.task](tok, args.context, seed)
        ids = tok(chat_prompt(tok, sample.prompt), return_tensors="pt").input_ids
        print(f"{args.task} seed {seed}: {ids.shape[1]} prompt tokens, expected {', '.join(sample.answers)}")
        samples.append((seed, sample, ids))
    for policy in policies:
        print(repr(policy), flush=True)
        torch._dynamo.reset()
        fwd = model.forward
        model.forward = torch.compile(fwd, backend=kvpass(policy))
        try:
            for seed, sample, ids in samples:
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
                answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                print(f"  seed {seed}: {score(sample, answer):.2f} {answer!r}  ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        finally:
            model.forward = fwd


if __name__ == "__main__":
    main()

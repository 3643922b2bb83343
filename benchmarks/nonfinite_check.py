"""The cost of the engine's non-finite logits check (docs/reliability.md, issue 13 item 7): one reduction
per step over the batch's logits (`engine.non_finite`) against a check with a host sync per row, and
both against a decode step of demo-mistral4, at batch 1, 8 and 32; then the two checks alone on a
release-sized vocabulary.

    .venv/bin/python benchmarks/nonfinite_check.py [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moesaic  # noqa: E402
from moesaic.engine.engine import non_finite  # noqa: E402
from moesaic.engine.sequence import Sequence  # noqa: E402


def best(f, repeats=7, calls=50) -> float:
    """Best of `repeats` mean times of `calls` calls (seconds)."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        out.append((time.perf_counter() - t) / calls)
    return min(out)


def per_row(logits: torch.Tensor) -> list[bool]:
    return [bool(torch.isfinite(r).all()) for r in logits]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = moesaic.LLM("demo-mistral4", dtype="bfloat16", device=args.device)
    eng, vocab = llm.engine, llm.cfg.vocab_size
    print(f"demo-mistral4 on {args.device}, vocab {vocab}, {args.threads} thread(s)")
    for batch in (1, 8, 32):
        sp = moesaic.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        seqs = [Sequence([1] + [5 + i] * 8, sp) for i in range(batch)]
        for s in seqs:
            eng.add(s)
        eng.step(), eng.step()  # prefill, first decode
        steps = []
        for _ in range(25):
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        while eng.has_work():
            eng.step()
        step = sorted(steps)[len(steps) // 2]
        logits = torch.randn(batch, vocab, device=args.device)
        sched = [(s, 1) for s in seqs]
        one, rows = best(lambda: non_finite(sched, logits)), best(lambda: per_row(logits))
        print(
            f"batch {batch:2d}: decode step {step * 1e3:7.2f} ms; one reduction {one * 1e6:7.1f} us "
            f"({one / step:.3%} of a step); per-row check {rows * 1e6:8.1f} us ({rows / step:.3%}); "
            f"per-row / reduction {rows / one:.1f}x"
        )
    for batch in (1, 8, 32):
        logits = torch.randn(batch, 131072, device=args.device)
        sched = [(Sequence([1], moesaic.SamplingParams()), 1) for _ in range(batch)]
        one = best(lambda: non_finite(sched, logits), calls=20)
        rows = best(lambda: per_row(logits), calls=20)
        print(
            f"vocab 131072, batch {batch:2d}: one reduction {one * 1e6:8.1f} us; per-row check "
            f"{rows * 1e6:8.1f} us; per-row / reduction {rows / one:.1f}x"
        )


if __name__ == "__main__":
    main()

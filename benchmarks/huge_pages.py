"""Weights in 2 MiB pages against 4 KiB pages (kernels/memory.py), alternated in one process.

    .venv/bin/python benchmarks/huge_pages.py [--models mistral4,glm5_next] [--rounds 12] [--threads 1]
        [--precision "*=mxfp4"] [--streams 16]

1. The stream alone: one bf16 row against `--streams` cold 2048 x 2048 bf16 weights (8 MB each), the same
   weights copied into huge-page memory and into torch's own; per round the two are read in turn (the
   order swapped every round), median time per read and the median per-round ratio.
2. Whole decode steps: each model of benchmarks/serving.py written once, loaded twice in this process
   (MOESAIC_HUGE_PAGES=0 for the first load: torch's memory; then the default), a batch-1 greedy step
   (time(prompt + 25 new) - time(prompt + 1 new), / 24) of each in turn, the same tokens checked.

Ratios > 1: huge pages faster. The system's THP mode is printed; under `never` both arms are the same memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import MODELS, VOCAB, write_checkpoint  # noqa: E402

import moesaic  # noqa: E402
from moesaic.kernels import cpu, memory  # noqa: E402

SWITCH = "MOESAIC_HUGE_PAGES"


def anon_huge_mb() -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


def alternate(a, b, rounds: int) -> tuple[list[float], list[float]]:
    ta, tb = [], []
    a(), b()  # warm
    for r in range(rounds):
        for f, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            out.append(f())
    return ta, tb


def report(label: str, small: list[float], huge: list[float], unit: str) -> None:
    ratio = statistics.median(s / h for s, h in zip(small, huge))
    print(
        f"{label:<28} 4 KiB {statistics.median(small):9.2f} {unit}   2 MiB {statistics.median(huge):9.2f} {unit}"
        f"   4 KiB / 2 MiB per round {ratio:.3f}"
    )


def stream(args) -> None:
    g = torch.Generator().manual_seed(0)
    dense = [(torch.randn(2048, 2048, generator=g) * 0.02).to(torch.bfloat16) for _ in range(args.streams)]
    os.environ[SWITCH] = "0"
    small = [memory.copy_of(w) for w in dense]
    del os.environ[SWITCH]
    huge = [memory.copy_of(w) for w in dense]
    del dense
    x = torch.randn(1, 2048, generator=g).to(torch.bfloat16)

    def read(ws):
        def f():
            t = time.perf_counter()
            for w in ws:
                cpu.bf16_matmul(x, w)
            return (time.perf_counter() - t) * 1e3

        return f

    a, b = alternate(read(small), read(huge), 4 * args.rounds)
    report(f"{args.streams} x 8 MB bf16, one row", a, b, "ms")


def steps(name: str, args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / name
        write_checkpoint(folder, MODELS[name], torch.bfloat16)
        before = anon_huge_mb()
        os.environ[SWITCH] = "0"
        small = moesaic.LLM(str(folder), dtype="bfloat16", precision=args.precision)
        del os.environ[SWITCH]
        huge = moesaic.LLM(str(folder), dtype="bfloat16", precision=args.precision)
        lent = anon_huge_mb() - before
        prompt = torch.randint(3, VOCAB, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        sp = lambda n: moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
        tokens = {}

        def step(llm, key):
            def f():
                t = time.perf_counter()
                llm.generate([prompt], sp(1))
                one = time.perf_counter() - t
                t = time.perf_counter()
                out = llm.generate([prompt], sp(25))
                tokens.setdefault(key, out[0].token_ids)
                return (time.perf_counter() - t - one) / 24 * 1e3

            return f

        a, b = alternate(step(small, "small"), step(huge, "huge"), args.rounds)
        report(f"{name} step (b1)", a, b, "ms")
        print(
            f"{'':<28} {lent:.0f} MB of huge pages lent to the second load; same tokens: {tokens['small'] == tokens['huge']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mistral4,glm5_next,nemotron_h,deepseek_v4")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--streams", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"THP mode: {memory.thp_mode()}; huge pages used: {memory.enabled()}; {args.threads} thread(s)")
    stream(args)
    for name in [m for m in args.models.split(",") if m]:
        steps(name, args)


if __name__ == "__main__":
    main()

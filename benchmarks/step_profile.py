"""Where one batch-1 decode step goes: aten ops per step by op name and the step's time split into matrix
products and the rest, for the Mistral-Small-4-shaped benchmark model (random weights, bf16) and the trained
demo (demo-glm5-code, fp32).

    .venv/bin/python benchmarks/step_profile.py [--models mistral4,demo] [--threads 1] [--new 9] [--top 20]

Ops are counted with a TorchDispatchMode (every aten op that reaches the dispatcher, C++ extension calls
excluded) over a `new`-token and a 1-token greedy generate; their difference over `new - 1` is one decode
step (prefill cancels). The time split is decode_roofline.py's `gemm_share` (the kernels' calls, the fp32
tiles and torch's bmm / matmul timed around each call) with F.linear timed as well (the demo's fp32
products take it), best of `--repeats`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_roofline import gemm_share, moesaic_gen  # noqa: E402
from serving import MODELS, VOCAB, write_checkpoint  # noqa: E402

import moesaic  # noqa: E402
from moesaic.demo import trained_demo_path  # noqa: E402


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step_ops(gen, prompt, new: int) -> Counter:
    """aten ops of one decode step by name: (ops of a `new`-token generate - ops of a 1-token one) / (new - 1)."""
    counts = []
    for n in (1, new):
        with OpCounter() as c:
            gen([prompt], n)
        counts.append(c.ops)
    diff = Counter(counts[1])
    diff.subtract(counts[0])
    return Counter({k: v / (new - 1) for k, v in diff.items() if v > 0})


def split(llm, prompt, new: int, repeats: int) -> tuple[float, float]:
    """(ms per decode step, ms of it in matrix products), best of `repeats`: decode_roofline's gemm_share
    with F.linear timed as well."""
    f_linear, spent = F.linear, [0.0]

    def timed_linear(*a, **k):
        t = time.perf_counter()
        try:
            return f_linear(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    gen, best = moesaic_gen(llm), None
    F.linear = timed_linear
    try:
        for _ in range(repeats):
            spent[0] = 0.0
            gen([prompt], 1)
            one = spent[0]
            step, mm = gemm_share(llm, prompt, new, 1)  # runs a 1- and a `new`-token generate
            # F.linear in the new-token run minus a 1-token run's (three 1-token-sized parts in all)
            lin = (spent[0] - 3 * one) / (new - 1) * 1e3
            best = (step, mm + lin) if best is None or step < best[0] else best
    finally:
        F.linear = f_linear
    return best


def profile(name: str, llm, prompt, args) -> None:
    gen = moesaic_gen(llm)
    gen([prompt], 2)  # warm-up (and the kernels' build)
    ops = step_ops(gen, prompt, args.new)
    step, mm = split(llm, prompt, args.new, args.repeats)
    total = sum(ops.values())
    print(
        f"{name}: {total:.0f} aten ops / step, step {step:.2f} ms, matrix products {mm:.2f} ms, "
        f"rest {step - mm:.2f} ms ({100 * (step - mm) / step:.0f} %)"
    )
    for op, n in ops.most_common(args.top):
        print(f"    {op:<28} {n:7.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mistral4,demo")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                path, dtype, vocab = trained_demo_path(), "float32", 4096
            else:
                path, dtype, vocab = Path(tmp) / name, "bfloat16", VOCAB
                write_checkpoint(path, MODELS[name], torch.bfloat16)
            prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
            profile(f"{name} ({dtype})", moesaic.LLM(str(path), dtype=dtype), prompt, args)


if __name__ == "__main__":
    main()

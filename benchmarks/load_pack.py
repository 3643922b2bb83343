"""Loading a bf16 checkpoint, as it is and packed at load (`--precision "*=fp8" / "*=mxfp4" / "*=nvfp4"`), and
decoding with streamed experts packed as they are read (`expert_cache=`), against the floor of one copy.

    .venv/bin/python benchmarks/load_pack.py [--model mistral4] [--arms bf16,fp8,mxfp4,nvfp4] [--repeats 3]
        [--threads 1] [--cache 25%] [--no-stream]

1. Load: benchmarks/serving.py's model written once (random bf16 weights, the family's release naming), then
   `load_tensors` under each arm, best of `--repeats` (the file in the page cache after the first). The peer is
   the floor every load pays: one copy of the checkpoint's bytes out of the same file mapping (into memory
   already mapped: the copy alone; best of the repeats); each arm is reported as a multiple of it, and as GB/s
   of bf16 read.
2. Streamed decode (`--cache`, a share of the experts held in memory): a batch-1 greedy step
   ((time(17 new) - time(1 new)) / 16, median of `--repeats`) with `expert=<arm>`, each expert read from the
   file and packed on its way in; beside it the same step with every expert resident and packed at load, so
   the difference is what reading and packing on demand cost.

The encoders are compiled passes (kernels/cpu.encode_fp4 / encode_fp8) where the CPU kernels are built; with
MOESAIC_CPU_KERNELS=0 the torch code (the reference) packs.
"""

from __future__ import annotations

import argparse
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
from moesaic.kernels import memory  # noqa: E402
from moesaic.models import Checkpoint  # noqa: E402
from moesaic.weights.contract import load_tensors  # noqa: E402
from moesaic.weights.precision import PrecisionSchedule  # noqa: E402


def copy_floor(ckpt, repeats: int) -> tuple[float, int]:
    """(seconds, bytes): every checkpoint tensor copied once out of the file mapping into memory already
    mapped and touched (no page faults: the copy alone, best of the repeats)."""
    views = [ckpt.store.get(n, count=False) for n in ckpt.store.names()]
    total = sum(v.nbytes for v in views)
    dest = memory.empty((total,), torch.uint8).fill_(0)
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        at = 0
        for v in views:
            dest[at : at + v.nbytes].copy_(v.contiguous().view(-1).view(torch.uint8))
            at += v.nbytes
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best, total


def load_time(ckpt, precision: str | None, repeats: int) -> float:
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = load_tensors(ckpt.plan(), ckpt.store, torch.bfloat16, "cpu", PrecisionSchedule.parse(precision))
        dt = time.perf_counter() - t
        del out
        best = dt if best is None else min(best, dt)
    return best


def step_ms(folder: Path, precision: str | None, cache: str | None, repeats: int) -> tuple[float, list[int]]:
    llm = moesaic.LLM(str(folder), dtype="bfloat16", precision=precision, expert_cache=cache)
    prompt = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = lambda n: moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    llm.generate([prompt], sp(2))
    steps = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = llm.generate([prompt], sp(17))
        t17 = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([prompt], sp(1))
        steps.append((t17 - (time.perf_counter() - t)) / 16)
    return statistics.median(steps) * 1e3, out[0].token_ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistral4")
    ap.add_argument("--arms", default="bf16,fp8,mxfp4,nvfp4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default="25%")
    ap.add_argument("--no-stream", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arms = args.arms.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.model
        params = write_checkpoint(folder, MODELS[args.model], torch.bfloat16)
        ckpt = Checkpoint.open(folder)
        floor, nbytes = copy_floor(ckpt, args.repeats)
        print(
            f"{args.model}: {params / 1e6:.0f}M parameters, {nbytes / 1e9:.2f} GB of bf16; {args.threads} thread(s)"
        )
        print(f"floor (one copy of the checkpoint's bytes): {floor:.3f} s ({nbytes / floor / 1e9:.2f} GB/s)")
        print(f"{'arm':8s} {'load s':>8s} {'x floor':>8s} {'GB/s':>6s}")
        for arm in arms:
            s = load_time(ckpt, None if arm == "bf16" else f"*={arm}", args.repeats)
            print(f"{arm:8s} {s:8.3f} {s / floor:8.2f} {nbytes / s / 1e9:6.2f}")
        if args.no_stream:
            return
        print(f"\nbatch-1 decode step, experts streamed (expert_cache={args.cache}) against resident")
        print(f"{'arm':8s} {'streamed ms':>12s} {'resident ms':>12s} {'ratio':>6s}  same tokens")
        for arm in arms:
            precision = None if arm == "bf16" else f"expert={arm}"
            streamed, a = step_ms(folder, precision, args.cache, args.repeats)
            resident, b = step_ms(folder, precision, None, args.repeats)
            print(f"{arm:8s} {streamed:12.1f} {resident:12.1f} {streamed / resident:6.2f}  {a == b}")


if __name__ == "__main__":
    main()

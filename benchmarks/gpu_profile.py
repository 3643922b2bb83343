"""Where a CUDA decode step goes (eager, or with --graphs replayed as CUDA graphs): wall time per step against
the GPU's busy time, kernel launches per step, and the top kernels and host-side ops (torch.profiler), for
checkpoints given as folders; first the host cost of one launch.

    python benchmarks/gpu_profile.py /tmp/e2e/mistral4 [/tmp/e2e/glm5_next ...] [--batch 1] [--new 9] [--graphs]
    python benchmarks/gpu_profile.py --proxy /tmp/e2e/mistral4    # no GPU: the CUDA path's launches, counted

--proxy runs the CUDA code path on CPU tensors (MOESAIC_TRITON=interpret, the compiled CPU kernels off) and
counts what a GPU would launch in one decode step: the torch ops that are not views (each a kernel on a GPU)
and the Triton launches, with the torch ops' top call sites. A launch-bound eager step costs ~23 us a
launch on the H200 (2026-12-04), so the count is the lever it measures without one.

One step is the difference between a `new`-token and a 1-token greedy generate over `new - 1` (prefill
cancels). Busy time is the sum of the kernels' own times over the profiled run, so busy / wall says how
much of a step the GPU works and how much it waits on the host (Python, dispatch, launches): the share
CUDA graphs can take back (docs/gpu.md). Runs on CPU too (no kernel rows), to rehearse it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
from pathlib import Path

if "--proxy" in sys.argv:  # the CUDA path on CPU tensors: chosen before moesaic or triton is imported
    os.environ.update(MOESAIC_TRITON="interpret", MOESAIC_CPU_KERNELS="0")

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moesaic  # noqa: E402


def _gen(llm, prompts, n):
    sp = moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp)


def host_split(llm, prompts, new: int, sync) -> None:
    """Where the host's time of a decode step goes (us a step, by wall-clock wrappers; the difference of a
    `new`- and a 1-token run): the scheduler, the forward call (a graph's inputs, upload and replay, or the
    eager launches), waiting for the GPU before the tokens are read (the draw's device sync, forced first),
    the draws themselves, and the rest of the engine's step (bookkeeping, outputs, stop checks)."""
    from moesaic.engine.engine import Engine
    from moesaic.engine.scheduler import Scheduler

    spent = collections.Counter()

    def timed(cls, name, key, wait=False):
        f = getattr(cls, name)

        def g(*a, **k):
            t = time.perf_counter()
            if wait:
                sync()
                spent["GPU wait (before the draws)"] += time.perf_counter() - t
                t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(cls, name, g)
        return f

    saved = [
        (Engine, "step", timed(Engine, "step", "step")),
        (Scheduler, "schedule", timed(Scheduler, "schedule", "scheduler")),
        (Engine, "_forward", timed(Engine, "_forward", "forward call")),
        (Engine, "_greedy_rows", timed(Engine, "_greedy_rows", "draws", wait=True)),
        (Engine, "_draw", timed(Engine, "_draw", "draws", wait=True)),
    ]
    try:
        runs = []
        for n in (1, new):
            spent.clear()
            _gen(llm, prompts, n)
            sync()
            runs.append(dict(spent))
    finally:
        for cls, name, f in saved:
            setattr(cls, name, f)
    per = {k: (runs[1].get(k, 0.0) - runs[0].get(k, 0.0)) / (new - 1) * 1e6 for k in runs[1]}
    rest = per.get("step", 0.0) - sum(v for k, v in per.items() if k != "step")
    print("   host time of a step (us): " + ", ".join(f"{k} {v:.0f}" for k, v in per.items() if k != "step")
          + f", the rest of the engine's step {rest:.0f}; the step {per.get('step', 0.0):.0f}")  # fmt: skip


def _device_us(e) -> float:
    """An event's own device time, us (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


def profile_model(folder: str, batch: int, new: int, device: str, top: int, graphs: bool = False) -> None:
    llm = moesaic.LLM(
        folder,
        dtype="bfloat16",
        device=device,
        max_num_seqs=max(batch, 1),
        enable_prefix_caching=False,
        cuda_graphs=graphs,
    )
    prompts = [[3 + (i * 7 + j) % 200 for j in range(32)] for i in range(batch)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    _gen(llm, prompts, new)  # warm: kernels compiled, caches allocated
    walls = []
    for n in (1, new):
        sync()
        t = time.perf_counter()
        _gen(llm, prompts, n)
        sync()
        walls.append(time.perf_counter() - t)
    step_ms = (walls[1] - walls[0]) / (new - 1) * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    runs = {}
    for n in (1, new):
        with profile(activities=acts) as prof:
            _gen(llm, prompts, n)
            sync()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        runs[n] = (len(kernels), sum(e.device_time for e in kernels) / 1e3, prof)
    launches = (runs[new][0] - runs[1][0]) / (new - 1)
    busy_ms = (runs[new][1] - runs[1][1]) / (new - 1)
    how = "CUDA graphs" if graphs and llm.engine.graphs is not None else "eager"
    print(f"\n== {folder} on {device} ({how}), batch {batch}: {step_ms:.2f} ms a decode step (unprofiled)")
    print(
        f"   {launches:.0f} kernel launches a step, GPU busy {busy_ms:.3f} ms a step ({100 * busy_ms / step_ms:.0f} %)"
    )
    host_split(llm, prompts, new, sync)
    avg = runs[new][2].key_averages()
    if device == "cuda":
        print(f"   top kernels by own device time over {new} tokens (prefill included):")
        rows = sorted((e for e in avg if _device_us(e) > 0), key=_device_us, reverse=True)[:top]
        for e in rows:
            print(f"   {_device_us(e) / 1e3:9.3f} ms {e.count:6d} x  {e.key[:90]}")
    print(f"   top host ops by own CPU time over {new} tokens:")
    for e in sorted(avg, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        print(f"   {e.self_cpu_time_total / 1e3:9.3f} ms {e.count:6d} x  {e.key[:90]}")


VIEWS = {
    "view",
    "_unsafe_view",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "expand",
    "permute",
    "transpose",
    "t",
    "as_strided",
    "alias",
    "unbind",
    "split",
    "split_with_sizes",
    "chunk",
    "detach",
    "reshape",
    "lift_fresh",
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "_reshape_alias",
    "unflatten",
    "flatten",
    "narrow",
    "diagonal",
}  # fmt: skip  (ops that launch no kernel on a GPU)


def _triton_dir() -> str:
    try:
        import triton

        return os.path.dirname(triton.__file__) + os.sep
    except ImportError:
        return "//no triton//"


TRITON_DIR = _triton_dir() if "--proxy" in sys.argv else "//no triton//"


class LaunchCounter(TorchDispatchMode):
    """Counts the torch ops that would launch a kernel on a GPU (not views, not the interpreter's own), by
    op name and by the moesaic line that made them, and the Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops, self.sites, self.triton = (
            collections.Counter(),
            collections.Counter(),
            collections.Counter(),
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in VIEWS or (name == "to" and args and out is args[0]):  # (a `to` that changes nothing)
            return out
        stack = traceback.extract_stack()[:-1]
        # the interpreter's own torch calls are not launches; moesaic's kernels/triton glue is
        if not any(f.filename.startswith(TRITON_DIR) for f in stack):
            own = [f for f in stack if "/moesaic/" in f.filename]
            self.ops[name] += 1
            self.sites[f"{own[-1].filename.split('/moesaic/')[1]}:{own[-1].lineno}" if own else "?"] += 1
        return out


def proxy(folder: str, batch: int, new: int, top: int, graphs: bool = False) -> None:
    """--proxy: one decode step's would-be launches on the CUDA code path, counted on the CPU (with --graphs
    the static step a graph holds, run eagerly)."""
    from triton.runtime.interpreter import InterpretedFunction

    llm = moesaic.LLM(
        folder,
        dtype="bfloat16",
        device="cpu",
        max_num_seqs=max(batch, 1),
        enable_prefix_caching=False,
        cuda_graphs=graphs,
    )
    prompts = [[3 + (i * 7 + j) % 200 for j in range(12)] for i in range(batch)]
    _gen(llm, prompts, 2)
    counters = []
    run = InterpretedFunction.run
    for n in (2, new):
        c = LaunchCounter()

        def counted(self, *args, c=c, **kwargs):
            c.triton[self.fn.__name__] += 1
            return run(self, *args, **kwargs)

        InterpretedFunction.run = counted
        try:
            with c:
                _gen(llm, prompts, n)
        finally:
            InterpretedFunction.run = run
        counters.append(c)
    a, b = counters

    def step(x, y):
        return {k: (y[k] - x.get(k, 0)) / (new - 2) for k in y if y[k] - x.get(k, 0)}

    ops, sites, kernels = step(a.ops, b.ops), step(a.sites, b.sites), step(a.triton, b.triton)
    how = "a static decode step" if graphs and llm.engine.graphs is not None else "an eager decode step"
    print(f"\n== {folder}, batch {batch}, the CUDA path on CPU tensors ({how}):")
    print(f"   {sum(ops.values()):.0f} torch ops that launch + {sum(kernels.values()):.0f} Triton launches")
    print(
        "   torch ops: "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top])
    )
    print(
        "   Triton: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
    )
    for site, v in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {v:6.1f}  {site}")


def launch_cost(device: str, n: int = 300) -> None:
    """Host time a call of one tiny Triton kernel (the RMS norm of a [1, 1024] row) and of one torch op (an add)
    costs, dispatch and launch included: what an eager step pays per launch, and graphs take back."""
    from moesaic.kernels.triton import norm

    x, w = torch.randn(1, 1024, device=device), torch.ones(1024, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    calls = {
        "Triton rms_norm": lambda: norm.rms_norm(x, w, 1e-6, None, torch.float32, torch.float32),
        "torch add": lambda: x + x,
    }
    for name, fn in calls.items():
        fn()
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e6
        sync()
        print(f"   host time a call, {name}: {host:.1f} us")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=9)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--proxy", action="store_true", help="no GPU: count the CUDA path's launches on CPU")
    ap.add_argument(
        "--graphs", action="store_true", help="decode steps as CUDA graphs (where the model allows)"
    )
    args = ap.parse_args()
    if args.device == "cuda" and not args.proxy:
        print("== launch costs")
        launch_cost("cuda")
    for folder in args.folders:
        try:
            if args.proxy:
                proxy(folder, args.batch, max(args.new, 4), args.top, args.graphs)
                continue
            profile_model(folder, args.batch, args.new, args.device, args.top, args.graphs)
        except Exception as e:  # one model's failure must not hide the next one's profile
            print(f"\n== {folder}: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

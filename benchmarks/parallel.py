"""Tensor parallelism: one rank vs two (one thread per rank) on two random-weight ~0.3B models.

    .venv/bin/python benchmarks/parallel.py [--models mistral4,kimi_linear] [--prompt 512] [--new 32]
        [--batch 1,8] [--dtype float32] [--json out.json]

The models are serving.py's (written by moesaic's own writers into a temp folder): mistral4 (MLA + MoE,
32 experts top-4) and kimi_linear (KDA + MLA + MoE). Each configuration — one rank, two ranks with the
experts split by width, two ranks with expert parallelism — runs in a fresh process (its workers spawned
by it), so peak memory is that configuration's own. Measured in each:

  prefill   one prompt of --prompt tokens, its first token (TTFT): prompt tokens / s
  decode    --batch B sequences of 16-token prompts, --new greedy tokens each: the time of a
            (new + 1)-token run minus a 1-token run (the prefill cancels), B * new / that
  comm      the share of each rank's wall time spent waiting in collectives during prefill / decode
            (waiting includes the other rank arriving late: an upper bound of the transfer itself),
            collectives and bytes all-reduced / gathered per decode step
  memory    per rank: weight bytes held, private RSS after the run (the weights, the cache, ~230 MB of
            Python + torch) and peak RSS (which also counts the checkpoint's pages mapped during load)

and, once, a loopback microbenchmark of gloo's all-reduce between two processes (latency of a small one,
bandwidth of a large one), from which the prediction of each decode step's collective time follows:
(collectives per step) x latency + (bytes per step) / bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving import MODELS, write_checkpoint  # noqa: E402

import moesaic  # noqa: E402

CONFIGS = [(1, False), (2, False), (2, True)]  # (ranks, expert parallel)


def child(args) -> None:
    """One configuration, in this process (and its workers): prints one JSON line."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    llm = moesaic.LLM(
        args.child,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        expert_parallel=args.ep,
        max_num_batched_tokens=max(args.prompt, 256),
        max_num_seqs=max(args.batch),
        enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    vocab = llm.cfg.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
    one = moesaic.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:32]], one)  # warm-up

    def phase(fn):
        before = llm.parallel_stats()
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        after = llm.parallel_stats()
        delta = {
            k: [a - b for a, b in zip(after[k], before[k])]
            for k in ("collectives", "collective_seconds", "collective_bytes")
        }
        return wall, delta

    out = dict(model=Path(args.child).name, ranks=args.tp, expert_parallel=args.ep, load_s=load_s, rows=[])
    wall, comm = phase(lambda: llm.generate([prompt], one))
    out["prefill"] = dict(
        tok_s=args.prompt / wall, wall_s=wall, comm_share=[s / wall for s in comm["collective_seconds"]]
    )
    for B in args.batch:
        prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(B)]
        first, _ = phase(lambda: llm.generate(prompts, one))
        many = moesaic.SamplingParams(max_tokens=args.new + 1, temperature=0.0, ignore_eos=True)
        wall, comm = phase(lambda: llm.generate(prompts, many))
        dec = wall - first
        steps = args.new + 1
        out["rows"].append(
            dict(
                batch=B,
                tok_s=B * args.new / dec,
                step_ms=1e3 * dec / args.new,
                comm_share=[s / wall for s in comm["collective_seconds"]],
                collectives_per_step=comm["collectives"][0] / steps,
                bytes_per_step=comm["collective_bytes"][0] / steps,
                comm_ms_per_step=[1e3 * s / steps for s in comm["collective_seconds"]],
            )
        )
    st = llm.parallel_stats()
    out["weight_bytes"] = st.get("weight_bytes", st["bytes_read"])
    out["peak_rss"] = st["peak_rss_bytes"]
    out["anon_rss"] = st["anon_rss_bytes"]
    print("RESULT " + json.dumps(out), flush=True)


def _allreduce_worker(rank: int, port: int, sizes: list[int], reps: int, q) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    pg = torch.distributed.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    res = {}
    for n in sizes:
        t = torch.ones(n // 4)
        for _ in range(3):
            pg.allreduce([t]).wait()
        best = float("inf")
        for _ in range(5):  # the best of 5 rounds: the other helpers' processes share these cores
            t0 = time.perf_counter()
            for _ in range(reps):
                pg.allreduce([t]).wait()
            best = min(best, (time.perf_counter() - t0) / reps)
        res[n] = best
    if rank == 0:
        q.put(res)


def loopback(sizes=(4096, 16384, 65536, 1 << 18, 1 << 20, 4 << 20, 16 << 20), reps: int = 20) -> dict:
    """Seconds per gloo all-reduce of each size (bytes, fp32) between two local processes."""
    import torch.multiprocessing as mp

    s = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    port = s.port
    del s
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, list(sizes), reps, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mistral4,kimi_linear")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--dtype", default="float32", help="bf16 GEMMs are ~3x slower on CPUs without AMX")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ep", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.child:
        return child(args)
    lb = loopback()
    big = max(lb)  # latency: the fastest small one (a busy machine delays some of them by a millisecond)
    latency, bw = min(t for n, t in lb.items() if n <= 65536), big / lb[big]
    print(
        "loopback gloo all-reduce (2 processes): "
        + ", ".join(f"{n / 1024:.0f} KiB {t * 1e6:.0f} us" for n, t in sorted(lb.items()))
        + f"; latency ~{latency * 1e6:.0f} us, bandwidth ~{bw / 1e9:.2f} GB/s",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = Path(tmp) / name
            n = write_checkpoint(folder, MODELS[name], getattr(torch, args.dtype))
            print(f"{name}: {n / 1e6:.0f}M parameters (random weights)", flush=True)
            for ranks, ep in CONFIGS:
                cmd = [sys.executable, __file__, "--child", str(folder), "--tp", str(ranks)]
                cmd += ["--prompt", str(args.prompt), "--new", str(args.new), "--dtype", args.dtype]
                cmd += ["--batch", ",".join(map(str, args.batch))] + (["--ep"] if ep else [])
                env = dict(os.environ, OMP_NUM_THREADS="1")
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(proc.stdout[-2000:], proc.stderr[-4000:])
                    raise SystemExit(f"{name} ranks={ranks} ep={ep} failed")
                r = json.loads(line[len("RESULT ") :])
                results.append(r)
                print(report(r, latency, bw), flush=True)
    print("\nratios (two ranks / one):")
    for name in args.models.split(","):
        base = next(r for r in results if r["model"] == name and r["ranks"] == 1)
        for r in (r for r in results if r["model"] == name and r["ranks"] == 2):
            dec = ", ".join(
                f"decode B={x['batch']} {x['tok_s'] / b['tok_s']:.2f}x"
                for x, b in zip(r["rows"], base["rows"])
            )
            mem = max(r["weight_bytes"]) / base["weight_bytes"][0]
            print(
                f"  {name} {'ep' if r['expert_parallel'] else 'tp'}: prefill "
                f"{r['prefill']['tok_s'] / base['prefill']['tok_s']:.2f}x, {dec}, weights per rank {mem:.2f}x"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(loopback=lb, results=results), indent=1))


def report(r: dict, latency: float, bw: float) -> str:
    mode = "1 rank" if r["ranks"] == 1 else f"{r['ranks']} ranks {'ep' if r['expert_parallel'] else 'tp'}"
    lines = [
        f"{r['model']:<12} {mode:<10} load {r['load_s']:.1f}s  prefill {r['prefill']['tok_s']:7.1f} tok/s "
        f"(comm {', '.join(f'{s:.0%}' for s in r['prefill']['comm_share'])})  weights "
        f"{', '.join(f'{b / 2**20:.0f}' for b in r['weight_bytes'])} MiB  private RSS "
        f"{', '.join(f'{b / 2**20:.0f}' for b in r['anon_rss'])} MiB  peak RSS "
        f"{', '.join(f'{b / 2**20:.0f}' for b in r['peak_rss'])} MiB"
    ]
    for x in r["rows"]:
        pred = x["collectives_per_step"] * latency + x["bytes_per_step"] / bw
        lines.append(
            f"{'':<24}decode B={x['batch']:<2} {x['tok_s']:6.1f} tok/s  {x['step_ms']:6.1f} ms/step  comm "
            f"{', '.join(f'{s:.0%}' for s in x['comm_share'])} ({', '.join(f'{m:.1f}' for m in x['comm_ms_per_step'])} ms/step; "
            f"{x['collectives_per_step']:.0f} collectives, {x['bytes_per_step'] / 1024:.0f} KiB: predicted {pred * 1e3:.1f} ms)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

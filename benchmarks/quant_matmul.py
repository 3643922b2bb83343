"""Decode-size matmul from bf16, FP8 and packed FP4 weights: the compiled CPU kernels vs the plain path
vs torch's dense bf16 F.linear, in GB/s of weight bytes against the read bandwidth measured in the
same run.

    python benchmarks/quant_matmul.py [--quick] [--threads N] [--rows 1,4,8,16] [--pool-mb 384]
                                      [--dtype bfloat16|float32] [--grouped]

For each weight (real-model shapes: K3 MXFP4 experts, DeepSeek-V4.1 fp4 experts and 32x32 UE8M0 fp8
projections, a V4-style 128x128 fp8 projection, GLM-5.3 / Mistral NVFP4 experts, a per-tensor fp8 and a
bf16 projection) and each row count it times

    kernel   QuantizedTensor.matmul(x) (bf16: moesaic.kernels.cpu.linear): the compiled kernel
    int8x    E2M1 weights: the same with MOESAIC_CPU_INT8_ACTIVATIONS=1 (x rounded to int8 a block of 32)
    no-amx   on a CPU with AMX: the same with MOESAIC_CPU_AMX=0 (vdpbf16ps; above 16 rows the plain path
             or F.linear), what the kernel did before it took AMX tiles
    plain    the same with MOESAIC_CPU_KERNELS=0 (tile-by-tile dequantize; bf16: F.linear)
    torch    F.linear(x_bf16, W_bf16) on the same weights stored dense in bf16 (the peer)
    hot      the kernel on a slice of the weight that stays in L2: its compute ceiling

Columns: weight bytes one call reads, best time, GB/s of those bytes, % of the streaming-read
bandwidth (the kernels' own access pattern, timed like the rows: best of 16 MB slices rotating through
512 MB, same run and thread count), and the prediction bytes / read bandwidth. Weights rotate through a pool larger than the last-level cache so
that every call reads them from DRAM. `--grouped` adds one MoE step's experts (top-k of E, rows grouped
by expert): one grouped kernel call vs one kernel call per expert vs the plain per-expert loop.
Times are the best of repeated calls; nothing is asserted. On a shared machine run with --threads 1
and mark noisy numbers (the load average is printed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moesaic.kernels import cpu  # noqa: E402
from moesaic.weights.quant import (  # noqa: E402
    QuantizedTensor,
    from_suffix_dict,
    quantize_fp8_block,
    quantize_fp8_tensor,
    quantize_mxfp4,
    quantize_nvfp4,
    stack,
)

# name, N (out), K (in), encoder (None: the bf16 weight itself)
SHAPES = [
    ("bf16 projection", 2048, 4096, None),
    ("K3 expert w1/w3 (mxfp4, ct)", 3072, 3584, lambda w: quantize_mxfp4(w)),
    ("V4.1 expert w1 (fp4 I8 + E8M0)", 2304, 5120, lambda w: quantize_mxfp4(w, naming="deepseek")),
    ("GLM-5.3 expert (nvfp4, ct)", 2048, 4096, lambda w: quantize_nvfp4(w)),
    ("MS4 expert (nvfp4, modelopt)", 2048, 4096, lambda w: quantize_nvfp4(w, naming="modelopt")),
    ("V4 shared w1 (fp8 128x128 f32)", 2048, 4096, lambda w: quantize_fp8_block(w, (128, 128), "float")),
    (
        "V4.1 wq_a (fp8 32x32 ue8m0)",
        1280,
        5120,
        lambda w: quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek"),
    ),
    ("fp8 per-tensor (ModelOpt)", 2048, 4096, lambda w: quantize_fp8_tensor(w)),
]
QUICK = [0, 1, 3, 5, 6]


def timeit(fn, min_time: float, min_iters: int = 5) -> float:
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 400:
            break
    return min(times)


def bandwidths(threads: int, min_time: float) -> dict:
    """GB/s: the kernels' streaming read of 512 MB, a tensor copy (read + write counted) and MKL's fp32
    GEMV over 256 MB (another reader's view of the same ceiling)."""
    out = {"read": cpu.read_bandwidth(512 << 20, threads)}
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    out["copy"] = 2 * src.nbytes / timeit(lambda: dst.copy_(src), min_time) / 1e9
    w = torch.ones((256 << 20) // 4 // 8192, 8192)
    x = torch.ones(1, 8192)
    out["fp32 gemv"] = w.nbytes / timeit(lambda: x @ w.T, min_time) / 1e9
    return out


def clone_qt(qt: QuantizedTensor) -> QuantizedTensor:
    return qt._replace(
        codes=qt.codes.clone(),
        scale=qt.scale.clone(),
        global_scale=None if qt.global_scale is None else qt.global_scale.clone(),
    )


def rows_of(qt, r: int):
    """The first r rows of a weight (an L2-resident slice for the `hot` column)."""
    if isinstance(qt, torch.Tensor):
        return qt[:r].clone()
    bn = qt.block[0] if qt.format == "fp8_block" else 1
    r = max(bn, r // bn * bn)
    scale = qt.scale[: r // bn].clone() if qt.scale.ndim else qt.scale
    return qt._replace(codes=qt.codes[:r].clone(), scale=scale, shape=torch.Size((r, qt.shape[-1])))


def matmul_fn(w):
    return (lambda x: cpu.linear(x, w)) if isinstance(w, torch.Tensor) else w.matmul


def set_kernels(on: bool, amx: bool = True, int8x: bool = False) -> None:
    os.environ["MOESAIC_CPU_KERNELS"] = "1" if on else "0"
    os.environ["MOESAIC_CPU_AMX"] = "1" if amx else "0"
    os.environ["MOESAIC_CPU_INT8_ACTIVATIONS"] = "1" if int8x else "0"


def row(cols) -> str:
    name, nk, m, method, t, mb, gbs, bw, pred = cols
    return (
        f"{name:32s} {nk:>10s} {m:4d} {method:>6s} {t * 1e3:9.3f} {mb:7.2f} {gbs:7.2f} "
        f"{100 * gbs / bw:6.1f}% {pred * 1e3:9.3f}"
    )


def bench_shapes(args, shapes, dtype, bw, min_time, pool_bytes):
    hdr = (
        f"{'weight':32s} {'N x K':>10s} {'rows':>4s} {'method':>6s} {'ms':>9s} {'wt MB':>7s} {'GB/s':>7s} "
        f"{'%read':>7s} {'pred ms':>9s}"
    )
    print(hdr)
    print("-" * len(hdr))
    g = torch.Generator().manual_seed(0)
    for name, n, k, enc in shapes:
        w = torch.randn(n, k, generator=g) * k**-0.5
        dense = w.to(torch.bfloat16)
        qt = dense if enc is None else from_suffix_dict(enc(w), name="w")
        del w
        nbytes = qt.nbytes
        copy = (lambda t: t.clone()) if enc is None else clone_qt
        pool = [qt] + [copy(qt) for _ in range(max(0, math.ceil(pool_bytes / nbytes) - 1))]
        dense_pool = [dense] + [
            dense.clone() for _ in range(max(0, math.ceil(pool_bytes / dense.nbytes) - 1))
        ]
        hot = rows_of(qt, max(16, (512 << 10) // max(1, nbytes // n)))
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            xb = x.to(torch.bfloat16)
            it = {"p": 0, "d": 0}

            def nxt(p, key):
                it[key] = (it[key] + 1) % len(p)
                return p[it[key]]

            cases = [
                ("kernel", True, nbytes, lambda: matmul_fn(nxt(pool, "p"))(x)),
                ("int8x", True, nbytes, lambda: matmul_fn(nxt(pool, "p"))(x)),
                ("no-amx", True, nbytes, lambda: matmul_fn(nxt(pool, "p"))(x)),
                ("plain", False, nbytes, lambda: matmul_fn(nxt(pool, "p"))(x)),
                ("torch", True, dense.nbytes, lambda: F.linear(xb, nxt(dense_pool, "d"))),
                ("hot", True, hot.nbytes, lambda: matmul_fn(hot)(x)),
            ]
            if enc is None:  # plain bf16 is F.linear itself
                cases = [c for c in cases if c[0] != "plain"]
            if not (cpu.has_amx() and dtype == torch.bfloat16):
                cases = [c for c in cases if c[0] != "no-amx"]
            if getattr(qt, "format", None) not in ("mxfp4", "nvfp4"):  # int8 activations: E2M1 weights only
                cases = [c for c in cases if c[0] != "int8x"]
            times = {}
            for method, kernels, nb, fn in cases:
                set_kernels(kernels, amx=method != "no-amx", int8x=method == "int8x")
                t = timeit(fn, min_time)
                times[method] = t
                gbs = nb / t / 1e9
                print(row((name, f"{n}x{k}", m, method, t, nb / 1e6, gbs, bw, nb / bw / 1e9)), flush=True)
            set_kernels(True)
            ratios = f"kernel vs torch dense {times['torch'] / times['kernel']:.2f}x"
            if "plain" in times:
                ratios += f", vs plain {times['plain'] / times['kernel']:.1f}x"
            if "int8x" in times:
                ratios += f", int8x vs kernel {times['kernel'] / times['int8x']:.2f}x"
            if "no-amx" in times:
                ratios += f", vs no-amx {times['no-amx'] / times['kernel']:.2f}x"
            print(f"{'':32s} {'':>10s} {m:4d} {'ratio':>6s}  {ratios}")


def bench_grouped(args, dtype, min_time):
    """One MoE step: T tokens x top-k of E experts [I, K], rows grouped by expert."""
    print("\n# grouped experts: one call for all selected experts vs one call per expert")
    g = torch.Generator().manual_seed(1)
    e, inter, k, topk = 64, 512, 2048, 8
    experts = {
        "bf16": (torch.randn(e, inter, k, generator=g) * k**-0.5).bfloat16(),
        "mxfp4": stack(
            [from_suffix_dict(quantize_mxfp4(torch.randn(inter, k, generator=g) * 0.02)) for _ in range(e)]
        ),
        "nvfp4": stack(
            [from_suffix_dict(quantize_nvfp4(torch.randn(inter, k, generator=g) * 0.02)) for _ in range(e)]
        ),
    }
    for tokens in (1, 4):
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)]).reshape(-1)
        counts = torch.bincount(ids, minlength=e)
        offs = counts.cumsum(0)
        x = torch.randn(tokens * topk, k, generator=g).to(dtype)
        active = int((counts > 0).sum())
        for name, w in experts.items():
            per_expert = w.nbytes // e
            nbytes = per_expert * active

            def grouped(w=w):
                return (
                    cpu.grouped_linear(x, w, offs)
                    if isinstance(w, torch.Tensor)
                    else w.grouped_matmul(x, offs)
                )

            def loop(w=w):
                start = 0
                for i, end in enumerate(offs.tolist()):
                    if end > start:
                        matmul_fn(w[i])(x[start:end])
                    start = end

            cases = [("grouped", True, grouped), ("loop", True, loop), ("plain", False, loop)]
            if name == "bf16":  # torch's grouped GEMM (what run_experts uses for dense stacks today)
                offs32 = offs.to(torch.int32)
                xb = x.to(torch.bfloat16)
                cases[2] = ("F.linear", False, loop)
                cases.append(
                    ("grouped_mm", True, lambda w=w: F.grouped_mm(xb, w.transpose(-2, -1), offs=offs32))
                )
            res = []
            for label, kernels, fn in cases:
                set_kernels(kernels)
                t = timeit(fn, min_time)
                res.append(f"{label} {t * 1e3:7.3f} ms {nbytes / t / 1e9:6.2f} GB/s")
            set_kernels(True)
            print(
                f"{name:6s} tokens {tokens} ({active} experts of {inter}x{k}, {nbytes / 1e6:.1f} MB): "
                + " | ".join(res)
            )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 shapes, shorter timing")
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    ap.add_argument("--rows", default="1,4,8,16", help="rows of x (decode batch)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    ap.add_argument(
        "--pool-mb", type=int, default=None, help="distinct weight copies per case (default 384, quick 256)"
    )
    ap.add_argument(
        "--grouped", action="store_true", help="also time one MoE step's experts, grouped vs per expert"
    )
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    args = ap.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu.load() is None:
        sys.exit(f"the CPU kernels could not be built: {cpu._state['error']}")
    dtype = getattr(torch, args.dtype)
    min_time = 0.15 if args.quick else 0.3
    pool_bytes = (args.pool_mb or (256 if args.quick else 384)) << 20
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    else:
        shapes = [SHAPES[i] for i in QUICK] if args.quick else SHAPES

    t0 = time.perf_counter()
    nt = torch.get_num_threads()
    bw = bandwidths(nt, min_time)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cpu_name = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    path = "AVX2+FMA+F16C" if cpu.load().has_avx2() else "portable (no AVX2)"
    print(
        f"# {cpu_name}, {os.cpu_count()} cpus, kernels {path}, torch {torch.__version__}, {nt} threads, "
        f"x {args.dtype}, load {load:.2f}"
    )
    print(
        f"# read bandwidth {bw['read']:.1f} GB/s (kernels' streaming read, best 16 MB slice of 512 MB); copy {bw['copy']:.1f} GB/s "
        f"(read + write); MKL fp32 GEMV {bw['fp32 gemv']:.1f} GB/s"
    )
    # on a shared machine one snapshot of the bandwidth can land in a busy moment: the best of the
    # start and a second measurement after the table is the ceiling the rows are compared with
    again = cpu.read_bandwidth(512 << 20, nt)
    read = max(bw["read"], again)
    print(f"# read bandwidth again {again:.1f} GB/s: %read and pred ms use {read:.1f} GB/s")
    print(f"# weight pool per case {pool_bytes >> 20} MB; pred ms = weight bytes / read bandwidth\n")
    bench_shapes(args, shapes, dtype, read, min_time, pool_bytes)
    if args.grouped:
        bench_grouped(args, dtype, min_time)
    print(
        f"\n# read bandwidth at the end {cpu.read_bandwidth(512 << 20, nt):.1f} GB/s; total "
        f"{time.perf_counter() - t0:.0f} s, load average now {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()

"""Packed-weight matmul vs dequantize-then-matmul vs dense bf16, on real-model weight shapes.

    python benchmarks/quant_matmul.py [--quick] [--dtype bfloat16|float32] [--pool-mb 768]

For each weight (shapes from reference/: K3 MXFP4 experts, DeepSeek-V4.1 fp4 experts and 32x32
UE8M0 fp8 projections, a V4-style 128x128 fp8 projection, GLM-5.3 NVFP4 experts) and each
activation count (decode: 1 and 8 rows, prefill: 512 rows) it times

    packed      QuantizedTensor.matmul(x): dequantizes tile by tile, codes stay packed
    deq+mm      W = qt.dequantize(dtype); x @ W.T  (the whole matrix every call)
    dense       x @ W.T with W stored dense in bf16 (what an unquantized checkpoint costs)

and reports GB/s of weight bytes read (packed bytes for the first two, 2 B/weight for dense)
against the machine's memory bandwidth measured in the same run with a large tensor copy.
Weights rotate through a pool larger than the last-level cache, so every call reads them from
DRAM as a real forward pass over many layers does. Times are the best of repeated calls (robust
to other processes sharing the CPU; the load average is printed); nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moesaic.weights.quant import (  # noqa: E402
    QuantizedTensor,
    from_suffix_dict,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)

# name, N (out), K (in), format, encoder
SHAPES = [
    ("K3 expert w1/w3 (mxfp4, ct)", 3072, 3584, lambda w: quantize_mxfp4(w)),
    ("K3 expert w2 (mxfp4, ct)", 3584, 3072, lambda w: quantize_mxfp4(w)),
    ("V4.1 expert w1 (fp4 I8 + E8M0)", 2304, 5120, lambda w: quantize_mxfp4(w, naming="deepseek")),
    (
        "V4.1 attn.wq_a (fp8 32x32 ue8m0)",
        1280,
        5120,
        lambda w: quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek"),
    ),
    ("V4 shared w1 (fp8 128x128 f32)", 2048, 4096, lambda w: quantize_fp8_block(w, (128, 128), "float")),
    ("GLM-5.3 expert gate (nvfp4, ct)", 2048, 4096, lambda w: quantize_nvfp4(w)),
    ("MS4 expert gate (nvfp4, modelopt)", 2048, 4096, lambda w: quantize_nvfp4(w, naming="modelopt")),
]
QUICK = [0, 3, 5]


def measure_bandwidth(mb: int, min_time: float) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, streaming-read GB/s of a bf16 GEMV) on `mb` MB."""
    n = mb * 2**20 // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_bw = 2 * n * 4 / timeit(lambda: dst.copy_(src), min_time) / 1e9
    w = torch.ones(mb * 2**20 // 2 // 8192, 8192, dtype=torch.bfloat16)
    x = torch.ones(1, 8192, dtype=torch.bfloat16)
    read_bw = w.numel() * 2 / timeit(lambda: x @ w.T, min_time) / 1e9
    return copy_bw, read_bw


def timeit(fn, min_time: float, min_iters: int = 3) -> float:
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return min(times)


def clone_qt(qt: QuantizedTensor) -> QuantizedTensor:
    return qt._replace(
        codes=qt.codes.clone(),
        scale=qt.scale.clone(),
        global_scale=None if qt.global_scale is None else qt.global_scale.clone(),
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 shapes, shorter timing (about 30 s)")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="activation / compute dtype of the packed and deq+mm paths",
    )
    ap.add_argument(
        "--pool-mb",
        type=int,
        default=None,
        help="bytes of distinct weight copies to rotate through (default 640, quick 512: above this machine's 260 MB LLC)",
    )
    ap.add_argument("--rows", default="1,8,512")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    min_time = 0.2 if args.quick else 0.4
    pool_bytes = (args.pool_mb or (512 if args.quick else 640)) * 2**20
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = [SHAPES[i] for i in QUICK] if args.quick else SHAPES

    t_start = time.perf_counter()
    copy_bw, read_bw = measure_bandwidth(1024 if not args.quick else 512, min_time)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, compute dtype {args.dtype}, "
        f"load average {load:.2f}"
    )
    print(
        f"# memory bandwidth: tensor copy {copy_bw:.1f} GB/s (read + write counted), streaming read "
        f"{read_bw:.1f} GB/s (bf16 GEMV over a {1024 if not args.quick else 512} MB matrix)"
    )
    print("# %copy / %read: weight GB/s over those; 'wt MB' = weight bytes one call reads")
    print(f"# weight pool per case: {pool_bytes / 2**20:.0f} MB of distinct copies (defeats the LLC)\n")
    hdr = (
        f"{'weight':36s} {'N x K':>11s} {'rows':>4s} {'method':>7s} {'ms':>9s} {'wt MB':>7s} "
        f"{'GB/s':>7s} {'%copy':>6s} {'%read':>6s} {'GFLOP/s':>8s}"
    )
    print(hdr)
    print("-" * len(hdr))
    g = torch.Generator().manual_seed(0)
    for name, n, k, enc in shapes:
        w = torch.randn(n, k, generator=g) * k**-0.5
        qt = from_suffix_dict(enc(w), name="w")
        dense = w.to(torch.bfloat16)
        del w
        packed_pool = [qt] + [clone_qt(qt) for _ in range(max(0, math.ceil(pool_bytes / qt.nbytes) - 1))]
        dense_pool = [dense] + [dense.clone() for _ in range(max(0, math.ceil(pool_bytes / (2 * n * k)) - 1))]
        for m in rows_list:
            x = torch.randn(m, k, generator=g).to(dtype)
            xb = x.to(torch.bfloat16)
            it = {"p": 0, "d": 0}

            def nxt(pool, key):
                it[key] = (it[key] + 1) % len(pool)
                return pool[it[key]]

            cases = [
                ("packed", qt.nbytes, lambda: nxt(packed_pool, "p").matmul(x)),
                ("deq+mm", qt.nbytes, lambda: x @ nxt(packed_pool, "p").dequantize(dtype).T),
                ("dense", 2 * n * k, lambda: xb @ nxt(dense_pool, "d").T),
            ]
            times = {}
            for method, nbytes, fn in cases:
                t = timeit(fn, min_time)
                times[method] = t
                gbs = nbytes / t / 1e9
                print(
                    f"{name:36s} {f'{n}x{k}':>11s} {m:4d} {method:>7s} {t * 1e3:9.2f} {nbytes / 1e6:7.1f} "
                    f"{gbs:7.2f} {100 * gbs / copy_bw:5.1f}% {100 * gbs / read_bw:5.1f}% {2 * m * n * k / t / 1e9:8.1f}",
                    flush=True,
                )
            print(
                f"{'':36s} {'':>11s} {m:4d} {'ratio':>7s}  time packed/dense {times['packed'] / times['dense']:.2f}x, "
                f"deq+mm/dense {times['deq+mm'] / times['dense']:.2f}x, packed/deq+mm "
                f"{times['packed'] / times['deq+mm']:.2f}x"
            )
    print(f"\n# total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()

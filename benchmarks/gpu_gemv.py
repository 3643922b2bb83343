"""Decode GEMV on a GPU: the packed-weight kernel (moesaic/kernels/triton/quant.py `_gemm_kernel`) at several
tile shapes, against cuBLAS on the same weight in bf16 and against the bytes / measured-copy roofline.

    python benchmarks/gpu_gemv.py            # a table: format, rows, tiles, us, GB/s of packed bytes, % of copy
    python benchmarks/gpu_gemv.py --ncu      # one launch per format at the shipped tiles (for ncu -k _gemm)

Each kernel time is `triton.testing.do_bench_cudagraph` of the bare launch (the host's tile layout made
once, outside), so it is the kernel alone; `matmul` is the whole call the engine makes (`quant.matmul`:
operand views, tile layout, launch) timed by do_bench, so the two differ by the host's share. Outputs are
checked against the dequantized weight's product (relative max error; exit 1 when one misses).
`--dry-run` runs the same launches on a small weight through Triton's interpreter (the tests do).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesaic.kernels.triton import quant as tq  # noqa: E402
from moesaic.weights import quant as Q  # noqa: E402

N, K = 8192, 5120  # a 5120 -> 8192 projection: 84 MB in bf16, 42 MB in fp8, 22 MB in 4 bits
# (BM, BN, BK, warps, stages, K slices); the first is what quant._grouped ships for a few rows per expert.
# Compiled for sm_90 with the device's triton 3.6 (2026-12-04), the fp8 fp32-scale tile of the first spills
# (255 registers + 16 B of stack; 177 and none with triton 3.9) and every mxfp4 / fp8 tile here but
# (16, 64, 64) and (16, 32, *) needs >= 150 registers: one program per SM. Hence narrower K steps, and K
# in slices (quant's `splits`).
TILES = [
    (16, 64, 128, 8, 3, 1),
    (16, 64, 128, 8, 3, 4),
    (16, 64, 64, 8, 3, 1),
    (16, 64, 64, 8, 3, 4),
    (16, 32, 128, 4, 3, 1),
    (16, 32, 128, 4, 3, 4),
    (16, 32, 64, 4, 3, 1),
    (16, 32, 64, 4, 3, 4),
    (16, 16, 512, 4, 3, 1),
    (32, 128, 64, 8, 3, 1),
]


def packed(fmt: str, w: torch.Tensor):
    if fmt == "bf16":
        return w.bfloat16()
    if fmt == "fp8_128":
        return Q.from_suffix_dict(Q.quantize_fp8_block(w, (128, 128)), format="fp8_block")
    if fmt == "fp8_32_ue8m0":
        return Q.from_suffix_dict(Q.quantize_fp8_block(w, (32, 32), "ue8m0", "deepseek"), format="fp8_block")
    if fmt == "mxfp4":
        return Q.from_suffix_dict(Q.quantize_mxfp4(w))
    return Q.from_suffix_dict(Q.quantize_nvfp4(w))


def nbytes(qt) -> int:
    """The bytes a product must read: a dense weight, or a packed one's codes and scales."""
    if isinstance(qt, torch.Tensor):
        return qt.numel() * qt.element_size()
    parts = (qt.codes, qt.scale, qt.global_scale)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def row(fmt, M, what, us, nb, copy_gbs, err=None):
    gbs = nb / us / 1e3 if us == us else float("nan")
    e = f"{err:8.1e}" if err is not None else ""
    print(f"{fmt:<14} {M:>2} {what:<30} {us:8.1f} {gbs:6.0f} {100 * gbs / copy_gbs:6.0f} {e}")


def main() -> int:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ncu", action="store_true", help="one launch per format at the shipped tiles, no timing"
    )
    ap.add_argument("--rows", default="1,8")
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, Triton's interpreter, a small weight, no timing"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    n, k = (64, 256) if dry else (N, K)

    def bench(fn, graph=True):
        if dry:
            fn()
            return float("nan")
        return (triton.testing.do_bench_cudagraph(fn) if graph else triton.testing.do_bench(fn)) * 1e3

    copy_gbs = float("nan")
    if not dry:
        src = torch.empty(1 << 32, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy_gbs = 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), rep=100) * 1e-3) / 1e9
        del src, dst
    w = torch.randn(n, k, device=dev) * 0.02
    print(f"measured copy {copy_gbs:.0f} GB/s; W [{n}, {k}]")
    print(
        f"{'format':<14} {'M':>2} {'tiles (BM,BN,BK,warps,stages,S)':<30} {'us':>8} {'GB/s':>6} {'%copy':>6} {'err':>8}"
    )
    bad = []  # tiles whose output misses the reference (bf16 output: ~4e-3 relative)
    for fmt in ("bf16", "fp8_128", "fp8_32_ue8m0", "mxfp4", "nvfp4"):
        qt = packed(fmt, w)
        op = tq._operands(qt)
        nb = nbytes(qt)
        ref_w = qt.float() if fmt == "bf16" else qt.dequantize(torch.bfloat16).float()
        for M in [int(m) for m in args.rows.split(",")]:
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ref_w)
            offsets = torch.full((1,), M, dtype=torch.int32, device=dev)
            if fmt == "bf16":
                row(fmt, M, "cuBLAS (F.linear)", bench(lambda x=x: F.linear(x, qt)), nb, copy_gbs)
            for BM, BN, BK, warps, stages, S in TILES[:1] if args.ncu else TILES:
                tiles = tq._layout(offsets, M, 1, BM)
                out = torch.full((M, n), float("nan"), device=dev, dtype=torch.bfloat16)
                part = torch.empty(S, M, n, device=dev)
                what = str((BM, BN, BK, warps, stages, S))
                try:
                    tq._run(x, op, tiles, out, BM, BN, BK, warps, stages, S, part)
                    err = float((out.float() - ref).abs().max() / ref.abs().max())
                    if args.ncu:
                        continue
                    us = bench(lambda: tq._run(x, op, tiles, out, BM, BN, BK, warps, stages, S, part))
                except Exception as e:  # a tile shape that does not build: a row, not a lost table
                    print(f"{fmt:<14} {M:>2} {what:<30} {type(e).__name__}: {str(e)[:80]}")
                    continue
                row(fmt, M, what, us, nb, copy_gbs, err)
                bad += [f"{fmt} M={M} {what}: err {err:.1e}"] if not err <= 2e-2 else []
            if not args.ncu:
                row(
                    fmt,
                    M,
                    "quant.matmul (whole call)",
                    bench(lambda x=x: tq.matmul(qt, x), False),
                    nb,
                    copy_gbs,
                )
    print("\n".join(["", "wrong outputs:", *bad]) if bad else "\nevery output matches its reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The one device check of issue 19: every Triton kernel against its torch reference on real layer shapes,
achieved GB/s of the bandwidth-bound kernels against the HBM peak, and a hook for end-to-end decode.

    python benchmarks/gpu_check.py              # one GPU: real shapes (K3, GLM-5.3, DeepSeek-V4, Nemotron-H)
    python benchmarks/gpu_check.py --dry-run    # CPU: Triton's interpreter, tiny shapes (tests run this)
    python benchmarks/gpu_check.py --compile-only  # no GPU: every kernel built for sm_90, registers,
                                                   # spills and shared memory (a device run's pre-flight)

Sized for <= 8 minutes on one H200 (a --budget in seconds stops starting new checks once spent).

(a) correctness: each kernel and its reference (moesaic/layers/*, weights/quant.py) on the same inputs;
    max |kernel - reference| relative to max |reference| against a tolerance per dtype.
(b) bandwidth: KDA decode (state read + written), MLA decode (paged latent read once), the W4A16 MoE
    GEMV (active experts' packed bytes) and the other decode kernels, timed by triton.testing.do_bench
    (median ms); GB/s = bytes that must move / time, and % of the HBM peak (H200: 4.8 TB/s; aim >= 70 %).
(c) end to end, the engine's CUDA path (LLM(device="cuda"): every layer on its Triton kernel): first every
    family's built-in demo, whose greedy tokens on CUDA must equal the CPU references' (fp32), then decode
    tok/s at batch 1/8/32 of the checkpoints in MOESAIC_E2E_MODELS (two ~1B models of two families; the
    demos otherwise) against the roofline of the weight bytes one step reads, eager and with CUDA graphs
    (`cuda_graphs=`, docs/gpu.md; parity runs LLM's default, graphs where the family allows).

It prints one report and, when $OUT is set, writes $OUT/gpu_check.json with every number. It exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"
# the kernel checks call the references in moesaic/layers and weights/quant.py, which on CUDA tensors would
# dispatch to the kernels themselves: they run with the dispatch off (e2e_decode turns it back on)
os.environ["MOESAIC_TRITON"] = "off"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moesaic.layers import csa, dsa, kda, mamba2, mhc, mla, moe  # noqa: E402
from moesaic.weights import quant as Q  # noqa: E402

PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "B200": 8000.0, "GB10": 273.0}  # HBM / LPDDR peak, GB/s

# real layer shapes (release configs: moesaic/models/*.py, /docs/families) and the dry run's tiny ones
REAL = dict(
    kda=dict(H=64, D=128, batch=32, prefill=2048),  # GLM-5.3 (K3: 96 heads)
    ssd=dict(H=128, P=64, N=128, batch=32, prefill=2048, chunk=128),  # Nemotron-H
    mla=dict(H=96, kvr=512, dr=64, lens=(1024, 2048, 4096, 8192) * 8),  # K3's MLA, 32 sequences
    dsa=dict(H=64, kvr=512, dn=256, dv=256, width=2051, lens=(8192,) * 32),  # GLM-5.3's DSA
    kpool=dict(nI=32, c=128, P=4, T=8192, n=32, topk=2048),
    csa_index=dict(nI=64, c=128, ratio=4, T=8192, n=32, topk=512),  # DeepSeek-V4
    compressor=dict(C=512, rows=4096),
    mhc=dict(n=4, d=4096, tokens=(32, 2048)),
    router=dict(tokens=2048),
    moe=dict(d=3584, I=3072, E=64, tokens=8, k=16),  # K3's MXFP4 experts (latent 3584 -> 2x3072)
    moe_nv=dict(d=4096, I=2048, E=64, tokens=8, k=8),  # GLM-5.3's NVFP4 experts
    fp8=dict(N=8192, K=5120, rows=(1, 32, 512)),
    norm=dict(rows=(1, 32, 4096), d=7168, heads=128, rope=64),  # DeepSeek-V4's width; 128 heads of 64 rope
)
TINY = dict(
    kda=dict(H=2, D=16, batch=2, prefill=20),
    ssd=dict(H=2, P=16, N=16, batch=2, prefill=20, chunk=16),
    mla=dict(H=4, kvr=32, dr=16, lens=(5, 70)),
    dsa=dict(H=4, kvr=32, dn=16, dv=16, width=9, lens=(30, 70)),
    kpool=dict(nI=16, c=16, P=4, T=40, n=3, topk=8),
    csa_index=dict(nI=16, c=16, ratio=4, T=40, n=3, topk=4),
    compressor=dict(C=16, rows=16),
    mhc=dict(n=4, d=16, tokens=(5,)),
    router=dict(tokens=2),
    moe=dict(d=64, I=32, E=4, tokens=2, k=2),
    moe_nv=dict(d=64, I=32, E=4, tokens=2, k=2),
    fp8=dict(N=48, K=64, rows=(1,)),
    norm=dict(rows=(1, 3), d=40, heads=3, rope=8),
)
# --compile-only: the real widths (they set the kernels' tile constexprs), few tokens / experts / sequences
COMPILE = dict(
    REAL,
    kda=dict(H=4, D=128, batch=2, prefill=64),
    ssd=dict(H=4, P=64, N=128, batch=2, prefill=64, chunk=128),
    mla=dict(H=96, kvr=512, dr=64, lens=(70, 130)),
    dsa=dict(H=64, kvr=512, dn=256, dv=256, width=2051, lens=(2100, 2200)),
    kpool=dict(nI=32, c=128, P=4, T=256, n=2, topk=64),
    csa_index=dict(nI=64, c=128, ratio=4, T=256, n=2, topk=16),
    compressor=dict(C=512, rows=256),
    mhc=dict(n=4, d=4096, tokens=(16,)),
    router=dict(tokens=2),
    moe=dict(d=512, I=256, E=4, tokens=2, k=2),
    moe_nv=dict(d=512, I=256, E=4, tokens=2, k=2),
    fp8=dict(N=256, K=512, rows=(1, 24, 600)),
)
SM90_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """The card's measured ceiling: a device-to-device copy of `nbytes`, bytes read + written per second
    (median of do_bench). The datasheet peak is the aim's reference; this one says how far it is reachable."""
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100))
    return 2 * nbytes / (ms * 1e-3) / 1e9


class Check:
    """Runs the checks, times them on a GPU, collects one row per check. Modes: "gpu", "dry" (the
    interpreter on CPU, fp32), "compile" (CPU tensors, launches replaced by sm_90 compiles)."""

    def __init__(self, mode: str, budget: float):
        self.dry, self.compile = mode == "dry", mode == "compile"
        self.budget, self.t0 = budget, time.time()
        self.dev = torch.device("cuda" if mode == "gpu" else "cpu")
        self.half = torch.float32 if self.dry else torch.bfloat16  # the dtype of caches and activations
        self.rows: list[dict] = []
        self.compiled: list[dict] = []
        name = {"dry": "cpu (interpreter)", "compile": "sm_90 compile only (no GPU)"}.get(mode)
        self.device_name = name or torch.cuda.get_device_name()
        self.peak = next((v for k, v in PEAK_GBS.items() if k in self.device_name), PEAK_GBS["H200"])
        self.copy_gbs = None if (self.dry or self.compile) else copy_bandwidth()

    def verdict(self, kernel, shape, ok_fn, note="selection vs reference scores"):
        """A row whose check is a predicate (skipped in compile mode: the outputs are not computed)."""
        self.rows.append(
            dict(kernel=kernel, shape=shape, ok=True if self.compile else bool(ok_fn()), note=note)
        )

    def rand(self, *shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, device=self.dev) * scale).to(dtype)

    def time_ms(self, fn) -> float | None:
        if self.dry or self.compile:
            return None
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50))

    def add(self, kernel, shape, got, ref, tol, fn=None, nbytes=None, note=""):
        if self.compile:  # the kernels only compiled: their outputs are not computed
            self.rows.append(dict(kernel=kernel, shape=shape, ok=True, note="compiled"))
            return
        got = got if isinstance(got, (list, tuple)) else [got]
        ref = ref if isinstance(ref, (list, tuple)) else [ref]
        err = 0.0
        for g, r in zip(got, ref):
            scale = float(r.float().abs().max()) if r.numel() else 0.0
            e = float((g.float() - r.float()).abs().max()) if r.numel() else 0.0
            err = max(err, e / (scale + 1e-30) if scale else e)
        ms = self.time_ms(fn) if fn is not None else None
        gbs = nbytes / (ms * 1e-3) / 1e9 if (ms and nbytes) else None
        self.rows.append(
            dict(
                kernel=kernel,
                shape=shape,
                rel_err=err,
                tol=tol,
                ok=bool(err <= tol),
                ms=ms,
                bytes=nbytes,
                gbs=gbs,
                pct_peak=100 * gbs / self.peak if gbs else None,
                note=note,
            )
        )

    def run(self, name, fn):
        if time.time() - self.t0 > self.budget:
            self.rows.append(dict(kernel=name, shape="", ok=True, note="skipped: time budget spent"))
            return
        try:
            fn(self)
        except Exception as e:  # a kernel that fails to build or run is a failed check, not a lost report
            self.rows.append(dict(kernel=name, shape="", ok=False, note=f"error: {e!r}"))
            traceback.print_exc()


# ----------------------------------------------------------------------------------------- the checks


def check_kda(c: Check, s):
    from moesaic.kernels.triton import kda as tk

    H, D, B, n = s["kda"]["H"], s["kda"]["D"], s["kda"]["batch"], s["kda"]["prefill"]
    for law in (None, -5.0):
        z, A_log, dt_bias = c.rand(n, H * D, scale=2), c.rand(H, scale=0.5), c.rand(H * D)
        g_ref = kda.kda_gate(z, A_log, dt_bias, D, law)
        c.add(
            f"kda_gate[{'glm/k3' if law else 'kimi'}]",
            f"n={n} H={H} D={D}",
            tk.kda_gate(z, A_log, dt_bias, D, law),
            g_ref,
            1e-5,
        )
        q = (kda.l2norm(c.rand(H, n, D)) * D**-0.5).contiguous()
        k, v = kda.l2norm(c.rand(H, n, D)).contiguous(), c.rand(H, n, D)
        g, beta, S = g_ref.transpose(0, 1).contiguous(), torch.rand(H, n, device=c.dev), c.rand(H, D, D)
        ref = kda.delta_rule_chunked(q, k, v, g, beta, S, 64)
        c.add(
            f"kda_chunked[{'glm/k3' if law else 'kimi'}]",
            f"prefill n={n} H={H} D={D}",
            list(tk.delta_rule_chunked(q, k, v, g, beta, S, 64)),
            list(ref),
            1e-4,
            fn=lambda: tk.delta_rule_chunked(q, k, v, g, beta, S, 64),
        )
    qk = c.rand(n, H, D)
    c.add("kda_l2norm", f"n={n} H={H} D={D}", tk.l2norm(qk, 1e-6), kda.l2norm(qk, 1e-6), 1e-5,
          fn=lambda: tk.l2norm(qk, 1e-6), nbytes=2 * qk.numel() * 4, note="read + written")  # fmt: skip
    for n_rows in (1, n):  # the short conv + SiLU of q | k | v from a state's tail (K = 4)
        x, tail, wc = c.rand(n_rows, 3 * H * D, dtype=c.half), c.rand(3, 3 * H * D), c.rand(3 * H * D, 4)
        c.add("kda_short_conv", f"n={n_rows} C={3 * H * D}", tk.short_conv(x, tail, wc)[0],
              kda.short_conv(x, tail, wc)[0], 1e-5, fn=lambda x=x, tail=tail, wc=wc: tk.short_conv(x, tail, wc))  # fmt: skip
    # decode: a batch of B sequences, one token each: the state is read and written once
    q = kda.l2norm(c.rand(B, H, 1, D)) * D**-0.5
    k, v = kda.l2norm(c.rand(B, H, 1, D)), c.rand(B, H, 1, D)
    g = kda.kda_gate(c.rand(B, H * D), c.rand(H), c.rand(H * D), D, -5.0).view(B, 1, H, D).transpose(1, 2)
    beta, S = torch.rand(B, H, 1, device=c.dev), c.rand(B, H, D, D)
    got = tk.delta_rule_recurrent(q, k, v, g, beta, S)
    refs = [kda.delta_rule_recurrent(q[b], k[b], v[b], g[b], beta[b], S[b]) for b in range(B)]
    c.add(
        "kda_recurrent",
        f"decode batch={B} H={H} D={D}",
        [got[0], got[1]],
        [torch.stack([r[0] for r in refs]), torch.stack([r[1] for r in refs])],
        1e-5,
        fn=lambda: tk.delta_rule_recurrent(q, k, v, g, beta, S),
        nbytes=2 * S.numel() * 4 + 4 * (3 * q.numel() + v.numel()),
        note="state read + written",
    )


def check_ssd(c: Check, s):
    from moesaic.kernels.triton import mamba2 as tm

    p = s["ssd"]
    H, P, N, B, T, chunk = p["H"], p["P"], p["N"], p["batch"], p["prefill"], p["chunk"]
    x, dt = c.rand(T, H, P), F.softplus(c.rand(T, H)).clamp(1e-3)
    A = -torch.exp(c.rand(H, scale=0.5))
    Bm, Cm, h0 = c.rand(T, H, N), c.rand(T, H, N), c.rand(H, P, N)
    c.add(
        "ssd_chunked",
        f"prefill T={T} H={H} P={P} N={N}",
        list(tm.ssd_chunked(x, dt, A, Bm, Cm, h0, chunk)),
        list(mamba2.ssd_chunked(x, dt, A, Bm, Cm, h0, chunk)),
        1e-4,
        fn=lambda: tm.ssd_chunked(x, dt, A, Bm, Cm, h0, chunk),
    )
    xb, dtb, Bb, Cb, hb = x[:B], dt[:B], Bm[:B], Cm[:B], c.rand(B, H, P, N)
    got = tm.ssd_step(xb, dtb, A, Bb, Cb, hb)
    refs = [mamba2.ssd_step(xb[i], dtb[i], A, Bb[i], Cb[i], hb[i]) for i in range(B)]
    c.add(
        "ssd_step",
        f"decode batch={B} H={H} P={P} N={N}",
        list(got),
        [torch.stack([r[0] for r in refs]), torch.stack([r[1] for r in refs])],
        1e-5,
        fn=lambda: tm.ssd_step(xb, dtb, A, Bb, Cb, hb),
        nbytes=2 * hb.numel() * 4,
        note="state read + written",
    )


def _pages(c: Check, lens, widths, dtype):
    nb = [math.ceil(n / 64) for n in lens]
    pools = [c.rand(sum(nb) + 1, 2, 64, w, dtype=dtype) for w in widths]
    table = torch.zeros(len(lens), max(nb), dtype=torch.int32)
    perm, at = torch.randperm(sum(nb)), 0
    for i, b in enumerate(nb):
        table[i, :b] = perm[at : at + b].to(torch.int32)
        at += b
    return pools, table.to(c.dev)


def check_mla(c: Check, s):
    from moesaic.kernels.triton import mla as tk

    p = s["mla"]
    H, kvr, dr, lens = p["H"], p["kvr"], p["dr"], list(p["lens"])
    dtype = c.half
    (lat, rope), table = _pages(c, lens, (kvr, dr), dtype)
    S = len(lens)
    qs = torch.arange(S + 1, dtype=torch.int32, device=c.dev)  # one decode token per sequence
    q_lat, q_rope = c.rand(H, S, kvr, dtype=dtype, scale=0.1), c.rand(S, H, dr, dtype=dtype, scale=0.1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=c.dev)
    scale = (128 + dr) ** -0.5

    def run():
        return tk.paged_latent_attention(q_lat, q_rope, lat, rope, 1, table, seq_lens, qs, scale)

    ref = torch.cat(
        [
            mla.latent_attention(
                q_lat[:, i : i + 1],
                q_rope[i : i + 1],
                tk.gather_pages(lat, 1, table[i], n),
                tk.gather_pages(rope, 1, table[i], n),
                scale,
            )
            for i, n in enumerate(lens)
        ],
        dim=1,
    )
    c.add(
        "mla_decode",
        f"{S} seqs, {sum(lens)} cached tokens, H={H} kvr={kvr} dr={dr} {str(dtype)[6:]}",
        run(),
        ref,
        1e-5 if c.dry else 2e-2,
        fn=run,
        nbytes=sum(lens) * (kvr + dr) * dtype.itemsize,
        note="paged latent read once",
    )

    p = s["dsa"]
    H, kvr, dn, dv, W, lens = p["H"], p["kvr"], p["dn"], p["dv"], p["width"], list(p["lens"])
    (lat,), table = _pages(c, lens, (kvr,), dtype)
    S = len(lens)
    qs = torch.arange(S + 1, dtype=torch.int32, device=c.dev)
    q = c.rand(S, H, dn, dtype=dtype, scale=0.1)
    w_kv_b = c.rand(H * (dn + dv), kvr, dtype=dtype, scale=0.05)
    sel = torch.stack([torch.randperm(n, device=c.dev)[:W] for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=c.dev)
    ref = torch.cat(
        [
            dsa.sparse_mla_attend(
                q[i : i + 1], tk.gather_pages(lat, 0, table[i], n), w_kv_b, dv, dn**-0.5, sel[i : i + 1]
            )
            for i, n in enumerate(lens)
        ]
    )
    got = tk.paged_sparse_mla_attend(q, lat, 0, table, seq_lens, qs, w_kv_b, dv, dn**-0.5, sel)
    q_lat = torch.einsum("nhd,hdk->hnk", q, w_kv_b.view(H, dn + dv, kvr)[:, :dn]).contiguous()
    c.add(
        "dsa_decode",
        f"{S} seqs x {W} selected keys, H={H} kvr={kvr} {str(dtype)[6:]}",
        got,
        ref,
        1e-5 if c.dry else 3e-2,
        fn=lambda: tk.paged_sparse_latent_attention(q_lat, lat, 0, table, seq_lens, qs, dn**-0.5, sel),
        nbytes=S * W * kvr * dtype.itemsize,
        note="latent part only (gathered rows)",
    )


def _selection_ok(got, ref_scores, k):
    """Tie-robust: every selected entry scores (by the reference) at least the reference's k-th best."""
    kth = ref_scores.topk(k, dim=-1).values[:, -1:]
    picked = ref_scores.gather(1, got.clamp(min=0))
    tol = 1e-4 * ref_scores.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return bool(((picked >= kth - tol) | (got < 0)).all())


def check_indexers(c: Check, s):
    from moesaic.kernels.triton import compressor as tc
    from moesaic.kernels.triton import indexer as ti

    p = s["kpool"]
    nI, cI, P, T, n, topk = p["nI"], p["c"], p["P"], p["T"], p["n"], p["topk"]
    q, w = c.rand(n, nI, cI), c.rand(n, nI, scale=nI**-0.5)
    k, z, ape = c.rand(T, cI), c.rand(T, cI), c.rand(P, cI)
    pos = torch.arange(T - n, T, device=c.dev)
    pooled = dsa.pool_keys(k, z, ape)
    ref_scores = dsa.index_scores(q, w, pooled)
    c.add("kpool_pool_keys", f"T={T} P={P} c={cI}", tc.pool_keys(k, z, ape), pooled, 1e-5)
    c.add(
        "indexer[dsa scores]",
        f"n={n} pools={pooled.shape[0]} heads={nI}",
        ti.index_scores(q, w, pooled),
        ref_scores,
        1e-5,
    )
    sel = ti.kpool_select(q, w, k, z, ape, pos, topk, True)
    pools = sel[:, : (topk // P) * P : P] // P
    visible = torch.arange(pooled.shape[0], device=c.dev)[None, :] < ((pos + 1) // P)[:, None]
    k_pools = min(topk // P, pooled.shape[0])
    c.verdict(
        "indexer",
        f"dsa kpool top-{topk} tokens",
        lambda: _selection_ok(pools, ref_scores.masked_fill(~visible, -1e30), k_pools),
    )
    p = s["csa_index"]
    nI, cI, m, T, n, topk = p["nI"], p["c"], p["ratio"], p["T"], p["n"], p["topk"]
    q, w, keys = c.rand(n, nI, cI), c.rand(n, nI, scale=nI**-0.5), c.rand(T // m, cI)
    pos = torch.arange(T - n, T, device=c.dev)
    ref = torch.cat([sc for _, _, sc, _ in csa.index_score_blocks(q, w, keys, pos, m)])
    got = ti.indexer_scores(q, w, keys, pos, m)
    vis = ref > float("-inf")
    c.add(
        "indexer[csa scores]",
        f"n={n} entries={T // m} heads={nI}",
        got[vis],
        ref[vis],
        1e-5,
        fn=lambda: ti.indexer_select(q, w, keys, pos, m, topk),
    )
    sel = ti.indexer_select(q, w, keys, pos, m, topk)[0]
    c.verdict(
        "indexer", f"csa top-{topk} entries", lambda: _selection_ok(sel, ref.masked_fill(~vis, -1e30), topk)
    )


def check_compressors(c: Check, s):
    from moesaic.kernels.triton import compressor as tc

    C, rows = s["compressor"]["C"], s["compressor"]["rows"]
    dtype = c.half
    for ratio, overlap in ((4, True), (128, False)):
        if rows < ratio:
            ratio = 4
        d = csa.CompressorDims(ratio, C, overlap)
        kv, gate = c.rand(rows, d.proj_width, dtype=dtype), c.rand(rows, d.proj_width, dtype=dtype)
        ape = c.rand(ratio, d.proj_width)
        c.add(
            "compressor",
            f"{'CSA' if overlap else 'HCA'} m={ratio} C={C} rows={rows} {str(dtype)[6:]}",
            tc.pool_windows(kv, gate, ape, d, True),
            csa.pool_windows(kv, gate, ape, d, True),
            1e-5 if c.dry else 2e-2,
            fn=lambda kv=kv, gate=gate, ape=ape, d=d: tc.pool_windows(kv, gate, ape, d, True),
        )


def check_mhc(c: Check, s):
    from moesaic.kernels.triton import mhc as tm

    n, d = s["mhc"]["n"], s["mhc"]["d"]
    dims = mhc.MhcDims(n, 20, 1e-6, 1e-5)
    site = mhc.MhcSite(c.rand(dims.site_width, n * d, scale=0.02), c.rand(dims.site_width), c.rand(3))
    # a decode step's one token, sliced over the machine and (splits=1) as one program, then batches
    for N, splits in [(1, None), (1, 1)] + [(N, None) for N in s["mhc"]["tokens"]]:
        h = c.rand(N, n, d, dtype=c.half)
        c.add(
            "mhc",
            f"site_maps N={N} n={n} d={d}" + (" one program" if splits == 1 else ""),
            list(tm.site_maps(h, site, dims, splits)),
            list(mhc.site_maps(h, site, dims)),
            1e-4,
            fn=lambda h=h, splits=splits: tm.site_maps(h, site, dims, splits),
            nbytes=h.numel() * h.element_size() + site.fn.numel() * 4,
        )
    for N in (1, *s["mhc"]["tokens"]):
        h, y = c.rand(N, n, d, dtype=c.half), c.rand(N, d, dtype=c.half)
        pre, post, comb = torch.rand(N, n, device=c.dev), 2 * torch.rand(N, n, device=c.dev), c.rand(N, n, n)
        tol = 1e-5 if c.dry else 1e-2
        nb = h.numel() * h.element_size()
        c.add("mhc", f"collapse N={N} n={n} d={d}", tm.collapse(h, pre), mhc.collapse(h, pre), tol,
              fn=lambda h=h, pre=pre: tm.collapse(h, pre), nbytes=nb + nb // n)  # fmt: skip
        c.add("mhc", f"update N={N} n={n} d={d}", tm.update(h, y, post, comb), mhc.update(h, y, post, comb), tol,
              fn=lambda h=h, y=y, post=post, comb=comb: tm.update(h, y, post, comb), nbytes=2 * nb + nb // n)  # fmt: skip
    logits = c.rand(4 if c.dry else 2048, n, n, scale=3)
    c.add(
        "mhc",
        f"sinkhorn {logits.shape[0]} x {n}x{n}",
        tm.sinkhorn(logits, 20, 1e-6),
        mhc.sinkhorn(logits, 20, 1e-6),
        1e-5,
    )


def _same_routes(got, ref):
    """(tokens whose expert set differs, weights by ascending id of the kernel, of the reference)."""
    (wg, ig), (wr, ir) = got, ref
    ig, pg = ig.sort(1)
    ir, pr = ir.sort(1)
    return int((ig != ir).any(1).sum()), wg.gather(1, pg), wr.gather(1, pr)


def check_router(c: Check, s):
    from moesaic.kernels.triton import router as tr

    N = s["router"]["tokens"]
    cases = [
        ("sigmoid K3 896 top-16", lambda x, b: (x, 16, b), 896, tr.route_sigmoid, moe.route_sigmoid),
        ("sigmoid V3 256 top-8 groups 8/4", lambda x, b: (x, 8, b, 8, 4, True, 2.5), 256, tr.route_sigmoid, moe.route_sigmoid),
        ("sqrtsoftplus V4 256 top-6", lambda x, b: (x, 6, b, 1.5), 256, tr.route_sqrtsoftplus, moe.route_sqrtsoftplus),
        ("softmax Mistral-4 128 top-4", lambda x, b: (x, 4), 128, tr.route_softmax, moe.route_softmax),
    ]  # fmt: skip
    for name, args, E, fast, ref_fn in cases:
        x, b = c.rand(N, E), c.rand(E, scale=0.1)
        differ, wg, wr = _same_routes(fast(*args(x, b)), ref_fn(*args(x, b)))
        c.add("router", f"{name}, {N} tokens", wg, wr, 1e-5, fn=lambda x=x, b=b, a=args, f=fast: f(*a(x, b)))
        c.rows[-1]["ok"] = c.rows[-1]["ok"] and (differ == 0 or c.compile)
        c.rows[-1]["note"] = f"{differ} tokens with other experts" if differ and not c.compile else ""


def _quantize(fmt, w):
    if fmt == "mxfp4":
        return Q.from_suffix_dict(Q.quantize_mxfp4(w))
    if fmt == "deepseek_fp4":
        return Q.from_suffix_dict(Q.quantize_mxfp4(w, naming="deepseek"), format="mxfp4")
    if fmt == "nvfp4":
        return Q.from_suffix_dict(Q.quantize_nvfp4(w))
    if fmt == "fp8_128":
        return Q.from_suffix_dict(Q.quantize_fp8_block(w, (128, 128)), format="fp8_block")
    return Q.from_suffix_dict(Q.quantize_fp8_block(w, (32, 32), "ue8m0", "deepseek"), format="fp8_block")


def _moe(c: Check, name, fmt, p):
    from moesaic.kernels.triton import quant as tq

    d, I, E, N, k = p["d"], p["I"], p["E"], p["tokens"], p["k"]
    dtype = c.half
    w_in = Q.stack([_quantize(fmt, c.rand(2 * I, d, scale=0.02)) for _ in range(E)])
    w_out = Q.stack([_quantize(fmt, c.rand(d, I, scale=0.02)) for _ in range(E)])
    x = c.rand(N, d, dtype=dtype)
    weights, ids = moe.route_sigmoid(c.rand(N, E), k)
    act = moe.swiglu
    got = tq.run_experts(x, weights, ids, w_in, w_out, act)
    ref = moe.run_experts(x, weights, ids, w_in, w_out, act)
    # the GEMV alone: the active experts' gate|up projection over their rows
    flat = ids.sort(dim=1).values.reshape(-1)
    order = flat.argsort(stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[order // k]
    active = int((torch.bincount(flat, minlength=E) > 0).sum())
    per_expert = w_in.nbytes // E
    c.add(
        name,
        f"run_experts {N} tokens top-{k} of {E}, d={d} I={I} {fmt} {str(dtype)[6:]}",
        got,
        ref,
        1e-5 if c.dry else 2e-2,
        fn=lambda: tq.grouped_matmul(xs, offsets, w_in),
        nbytes=active * per_expert,
        note=f"timed: the gate|up GEMV of {active} active experts",
    )


def check_gemms(c: Check, s):
    from moesaic.kernels.triton import quant as tq

    _moe(c, "moe_gemm_mxfp4", "mxfp4", s["moe"])
    _moe(c, "moe_gemm_nvfp4", "nvfp4", s["moe_nv"])
    _moe(c, "moe_gemm_deepseek_fp4", "deepseek_fp4", s["moe_nv"])
    p = s["fp8"]
    dtype = c.half
    for fmt in ("fp8_128", "fp8_32_ue8m0"):
        qt = _quantize(fmt, c.rand(p["N"], p["K"], scale=0.02))
        for M in p["rows"]:
            x = c.rand(M, p["K"], dtype=dtype)
            c.add(
                "fp8_block_gemm",
                f"{fmt} [{p['N']}, {p['K']}] x M={M} {str(dtype)[6:]}",
                tq.matmul(qt, x),
                qt.matmul(x),
                1e-5 if c.dry else 2e-2,
                fn=lambda qt=qt, x=x: tq.matmul(qt, x),
                nbytes=qt.nbytes if M <= 32 else None,
            )
    qt = _quantize("mxfp4", c.rand(p["N"], p["K"], scale=0.02))
    c.add(
        "dequantize", f"mxfp4 [{p['N']}, {p['K']}] fp32, bit exact", tq.dequantize(qt), qt.dequantize(), 0.0
    )


def check_norms(c: Check, s):
    from moesaic.kernels.triton import norm as tn
    from moesaic.layers import norms, rope

    p = s["norm"]
    for N in p["rows"]:
        x, w = c.rand(N, p["d"], dtype=c.half), c.rand(p["d"], dtype=c.half)
        nb = 2 * x.numel() * x.element_size()
        r = norms.roundings(norms.rms_norm, x.dtype, w.dtype)
        tol = 1e-5 if c.dry else 1e-2
        fn = lambda x=x, w=w, r=r: tn.rms_norm(x, w, 1e-6, *r)  # noqa: E731
        c.add("rms_norm", f"{N} x {p['d']} {str(x.dtype)[6:]}", fn(), norms.rms_norm(x, w, 1e-6), tol, fn=fn,
              nbytes=nb, note="read + written")  # fmt: skip
    half = p["rope"] // 2
    for N in p["rows"]:
        x = c.rand(N, p["heads"], p["rope"], dtype=c.half)
        cos, sin = rope.cos_sin(torch.rand(half, device=c.dev), torch.arange(N, device=c.dev) * 3)
        for layout, ref in ((0, rope.rope_interleaved), (2, rope.rope_pairs)):
            fn = lambda x=x, cos=cos, sin=sin, layout=layout: tn.rope(x, cos, sin, layout)  # noqa: E731
            c.add(f"rope[{'interleaved' if layout == 0 else 'pairs'}]", f"{N} x {p['heads']} heads x {p['rope']}",
                  fn(), ref(x, cos, sin), 1e-5 if c.dry else 1e-2, fn=fn, nbytes=2 * x.numel() * x.element_size(),
                  note="read + written")  # fmt: skip
    for N in p["rows"]:  # a residual add and the norm after it
        x, delta, w = (
            c.rand(N, p["d"], dtype=c.half),
            c.rand(N, p["d"], dtype=c.half),
            c.rand(p["d"], dtype=c.half),
        )
        r = norms.roundings(norms.rms_norm, x.dtype, w.dtype)
        fn = lambda x=x, delta=delta, w=w, r=r: torch.cat(tn.add_rms_norm(x, delta, w, 1e-6, *r))  # noqa: E731
        ref = torch.cat([x + delta, norms.rms_norm(x + delta, w, 1e-6)])
        c.add("add_rms_norm", f"{N} x {p['d']} {str(x.dtype)[6:]}", fn(), ref, 1e-5 if c.dry else 1e-2, fn=fn,
              nbytes=4 * x.numel() * x.element_size(), note="x, delta read; sum, norm written")  # fmt: skip
    for N in p["rows"]:  # SwiGLU's product over the halves of gate|up rows
        gate, up = c.rand(N, 2 * p["d"], dtype=c.half).chunk(2, dim=-1)
        fn = lambda gate=gate, up=up: tn.silu_mul(gate, up)  # noqa: E731
        c.add("silu_mul", f"{N} x {p['d']} {str(gate.dtype)[6:]}", fn(), F.silu(gate) * up, 1e-5 if c.dry else 1e-2,
              fn=fn, nbytes=3 * gate.numel() * gate.element_size(), note="gate, up read, product written")  # fmt: skip


# ----------------------------------------------------------------------------------------- compile only


def compile_instead_of_launch(c: Check) -> None:
    """Every kernel launch becomes an ahead-of-time compile for sm_90 (triton's own ptxas; no GPU
    needed): its constexprs, registers, stack (spills) and shared memory go to c.compiled, so a
    kernel that cannot build, or asks more shared memory than an H100/H200 block has, shows up before
    a device run. The kernels' outputs stay uncomputed."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction

    from moesaic.kernels import triton as kt

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
             torch.int8: "i8", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}  # fmt: skip
    seen = set()

    def run(fn, *args, grid, warmup, **kwargs):
        opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(fn.arg_names, args), **kwargs)
        sig, consts, attrs = {}, {}, {}
        for i, p in enumerate(fn.params):
            v = bound[p.name]
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = "*" + types[v.dtype]
                if v.data_ptr() % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            else:
                sig[p.name] = "fp32" if isinstance(v, float) else ("i32" if abs(v) < 2**31 else "i64")
        shown = {k: (v.name if hasattr(v, "name") else v) for k, v in consts.items()}
        key = (fn.__name__, str(sorted(sig.items())), str(sorted(shown.items())), str(sorted(opts.items())))
        if key in seen:
            return
        seen.add(key)
        row = dict(kernel=fn.__name__, constexprs=shown, options=opts)
        try:
            src = ASTSource(fn, sig, consts, attrs)
            cc = triton.compile(src, target=target, options=make_backend(target).parse_options(opts).__dict__)
        except Exception as e:
            c.compiled.append(dict(row, ok=False, error=str(e)[-1500:]))
            return
        usage = ""
        if cuobjdump.exists():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cc.asm["cubin"])
                f.flush()
                usage = subprocess.run(
                    [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
                ).stdout
        regs, stack = re.findall(r"REG:(\d+)", usage), re.findall(r"STACK:(\d+)", usage)
        smem = cc.metadata.shared
        c.compiled.append(dict(row, ok=smem <= SM90_SHARED, regs=int(regs[0]) if regs else None,
                               stack=int(stack[0]) if stack else None, shared=smem))  # fmt: skip

    JITFunction.run = run
    for name in ("kda", "mamba2", "mla", "indexer", "compressor", "mhc", "router", "quant", "norm"):
        __import__(f"moesaic.kernels.triton.{name}")
        getattr(kt, name).check_device = lambda *t: None  # CPU tensors stand in for the GPU's
    kt.mhc.num_sms = lambda device: 132  # an H200's: site_maps' sliced (decode) form compiles too
    # no kernel runs, so a kernel's outputs stay as allocated: zeros in this process, so that torch code
    # indexing by them (run_experts' rows from _align_kernel) stays in bounds
    empty = torch.empty
    torch.empty = lambda *a, **kw: empty(*a, **kw).zero_()


# ----------------------------------------------------------------------------------------- end to end


E2E_DEMOS = (
    "demo-mistral4",
    "demo-nemotron-h",
    "demo-kimi-linear",
    "demo-kimi-k3",
    "demo-glm5-next-nvfp4",
    "demo-deepseek-v4",
    "demo-deepseek-v41",
)


def _greedy(llm, prompt, n):
    import moesaic

    sp = moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], sp)[0].token_ids


def _tok_s(llm, batch: int, sync) -> float:
    """Decode tok/s at `batch`: 65 new tokens minus 1 (the prefill and the first token), per second. A
    warm-up generate first: the first call at a batch size compiles kernels (the device run of 2026-12-04
    timed without one and overstated tok/s up to 3x); `llm` must not cache prefixes, or the prefill would
    be timed in one run only."""
    import moesaic

    prompts = [[3 + (i * 7 + j) % 200 for j in range(32)] for i in range(batch)]
    llm.generate(prompts, moesaic.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    times = []
    for new in (1, 65):
        sync()
        t = time.time()
        llm.generate(prompts, moesaic.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        sync()
        times.append(time.time() - t)
    return batch * 64 / max(times[1] - times[0], 1e-9)


def e2e_decode(args, peak_gbs: float, device: str = "cuda", demos=E2E_DEMOS) -> dict:
    """(c): the engine on CUDA. Every family's demo: greedy tokens on CUDA (fp32, Triton kernels) equal the
    CPU's; then decode tok/s of the MOESAIC_E2E_MODELS checkpoints (comma-separated folders; the demos
    when unset) at batch 1/8/32, with and without CUDA graphs where LLM has them, against the roofline of
    the weight bytes one step reads (the routed experts: those a batch is expected to pick). (`device` "cpu": a rehearsal of this code.)"""
    if args.dry_run or args.compile_only:
        return {"status": "skipped: no GPU in this mode"}
    import inspect

    import moesaic
    from moesaic.demo import ensure_demo, is_demo_name

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_roofline import step_bytes  # the weight bytes a decode step reads, active experts only

    os.environ["MOESAIC_TRITON"] = "auto"  # the engine's own dispatch: Triton kernels on CUDA tensors
    graphs_ok = "cuda_graphs" in inspect.signature(moesaic.LLM).parameters
    parity, results, errors = [], [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for demo in demos:
        if time.time() > args.deadline:
            errors.append(f"{demo}: skipped, over the budget")
            continue
        try:
            path = str(ensure_demo(demo))
            prompt = [3 + (j * 11) % 50 for j in range(12)]
            cpu = _greedy(moesaic.LLM(path, dtype="float32", device="cpu"), prompt, 8)
            gpu = _greedy(moesaic.LLM(path, dtype="float32", device=device), prompt, 8)
            parity.append(dict(model=demo, cpu=cpu, cuda=gpu, ok=cpu == gpu))
        except Exception as e:  # one family's failure must not hide the others'
            parity.append(dict(model=demo, ok=False, error=f"{type(e).__name__}: {e}"[:400]))
    models = [m for m in os.environ.get("MOESAIC_E2E_MODELS", "").split(",") if m] or list(demos[:2])
    for path in models:
        for graphs in (False, True) if graphs_ok else (False,):
            if time.time() > args.deadline:
                errors.append(f"{path} graphs={graphs}: skipped, over the budget")
                continue
            try:
                kw = dict(cuda_graphs=graphs) if graphs_ok else {}
                path = str(ensure_demo(path)) if is_demo_name(path) else path
                llm = moesaic.LLM(
                    path, dtype="bfloat16", device=device, max_num_seqs=32, enable_prefix_caching=False, **kw
                )
                if graphs and llm.engine.graphs is None:  # the family's state is not all pages (logged why)
                    errors.append(f"{path} graphs=True: not for this model, its steps run eager (not timed)")
                    continue
                for batch in (1, 8, 32):
                    tok_s = _tok_s(llm, batch, sync)
                    roof = batch * peak_gbs * 1e9 / step_bytes(Path(path), None, batch)
                    results.append(
                        dict(model=path, cuda_graphs=graphs, batch=batch, tok_s=tok_s, roofline_tok_s=roof)
                    )
            except Exception as e:
                errors.append(f"{path} graphs={graphs}: {type(e).__name__}: {e}"[:400])
    status = "ran" + ("" if graphs_ok else " (no CUDA graphs: LLM has no cuda_graphs yet, docs/gpu.md)")
    return {"status": status, "parity": parity, "results": results, "errors": errors}


# ----------------------------------------------------------------------------------------- main

CHECKS = [
    ("kda", check_kda),
    ("ssd", check_ssd),
    ("mla/dsa", check_mla),
    ("indexer", check_indexers),
    ("compressor", check_compressors),
    ("mhc", check_mhc),
    ("router", check_router),
    ("gemm", check_gemms),
    ("norm", check_norms),
]


def report(c: Check, e2e: dict) -> str:
    lines = [f"gpu_check on {c.device_name} (HBM peak {c.peak:.0f} GB/s), {time.time() - c.t0:.0f} s"]
    if c.copy_gbs:
        lines.append(
            f"measured copy (read + write): {c.copy_gbs:.0f} GB/s, {100 * c.copy_gbs / c.peak:.0f} % of peak"
        )
    lines.append("")
    lines.append(f"{'kernel':<24} {'ok':<4} {'rel err':>9} {'ms':>9} {'GB/s':>8} {'%peak':>6}  shape / note")
    for r in c.rows:
        err = f"{r['rel_err']:.2e}" if r.get("rel_err") is not None else "-"
        ms = f"{r['ms']:.4f}" if r.get("ms") else "-"
        gbs = f"{r['gbs']:.0f}" if r.get("gbs") else "-"
        pct = f"{r['pct_peak']:.0f}" if r.get("pct_peak") else "-"
        ok = "ok" if r["ok"] else "FAIL"
        lines.append(
            f"{r['kernel']:<24} {ok:<4} {err:>9} {ms:>9} {gbs:>8} {pct:>6}  {r['shape']} {r.get('note', '')}"
        )
    if c.compiled:
        lines += ["", f"sm_90 builds (shared memory limit {SM90_SHARED} B; stack > 0: register spills)"]
        for r in c.compiled:
            res = r.get("error") or f"regs {r['regs']} stack {r['stack']} shared {r['shared']}"
            res += " SPILLS" if r.get("stack") else ""
            cx = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
            lines.append(f"  {'ok' if r['ok'] else 'FAIL'} {r['kernel']} {cx} {r['options']}: {res}")
    lines += ["", f"end-to-end decode: {e2e['status']}"]
    for r in e2e.get("parity", []):
        what = (
            "greedy tokens on CUDA = CPU" if r["ok"] else r.get("error") or f"cpu {r['cpu']} cuda {r['cuda']}"
        )
        lines.append(f"  {'ok' if r['ok'] else 'FAIL'} {r['model']}: {what}")
    lines += [f"  error: {e}" for e in e2e.get("errors", [])]
    for r in e2e.get("results", []):
        lines.append(
            f"  {r['model']} graphs={r['cuda_graphs']} batch={r['batch']}: {r['tok_s']:.1f} tok/s (roofline {r['roofline_tok_s']:.0f})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: build every kernel for sm_90")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which no new check starts")
    ap.add_argument("--only", default="", help="comma-separated check groups (kda,ssd,mla/dsa,...)")
    ap.add_argument("--no-e2e", action="store_true", help="the kernel checks only (e.g. under a profiler)")
    ap.add_argument(
        "--demos", default="", help="comma-separated demos for the CUDA = CPU parity (default: all)"
    )
    args = ap.parse_args(argv)
    if not (args.dry_run or args.compile_only) and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run (interpreter) or --compile-only (sm_90 builds)")
        return 2
    torch.manual_seed(0)
    c = Check("dry" if args.dry_run else ("compile" if args.compile_only else "gpu"), args.budget)
    if args.compile_only:
        compile_instead_of_launch(c)
    shapes = TINY if args.dry_run else (COMPILE if args.compile_only else REAL)
    only = {o for o in args.only.split(",") if o}
    for name, fn in CHECKS:
        if not only or name in only:
            c.run(name, lambda c, fn=fn: fn(c, shapes))
    args.deadline = c.t0 + args.budget + 60  # the end-to-end part starts nothing a minute past the budget
    demos = tuple(d for d in args.demos.split(",") if d) or E2E_DEMOS
    e2e = {"status": "skipped: --no-e2e"} if args.no_e2e else e2e_decode(args, c.peak, demos=demos)
    print(report(c, e2e))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        data = dict(
            device=c.device_name,
            peak_gbs=c.peak,
            copy_gbs=c.copy_gbs,
            dry_run=args.dry_run,
            checks=c.rows,
            e2e=e2e,
        )
        data["sm90_builds"] = c.compiled
        (Path(out) / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str))
    return 0 if all(r["ok"] for r in c.rows + c.compiled + e2e.get("parity", [])) else 1


if __name__ == "__main__":
    sys.exit(main())

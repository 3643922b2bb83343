"""The Triton kernels (moesaic/kernels/triton) against their plain-torch references, run by Triton's
interpreter on CPU tensors.

TRITON_INTERPRET=1 must be set before triton itself is first imported (its standard library is
decorated then), and other test modules import triton earlier in a full run; so the `case_*` functions
below run in one child pytest process started with the variable set (and nothing leaks into other
tests), and each `test_kernel[case_...]` of this process reports its case's result from that run.

Small shapes with odd sizes (masks), several sequences of different lengths, every packed format,
both KDA gate laws. The interpreter is slow: every shape here is as small as the path it covers allows.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cases_in_child

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")
pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")

from moesaic.layers import csa, dsa, kda, mamba2, mhc, mla, moe  # noqa: E402
from moesaic.weights import quant as Q  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("kda", "mamba2", "mla", "indexer", "compressor", "mhc", "router", "quant", "norm")
CHILD = os.environ.get("MOESAIC_TRITON_CASES") == "1"  # this process runs the cases under the interpreter

if CHILD:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the child run needs TRITON_INTERPRET=1 from the start"
    T = {name: importlib.import_module(f"moesaic.kernels.triton.{name}") for name in KERNELS}


def close(got, ref, rel=2e-6):
    """Equal shapes and max |got - ref| <= rel * max |ref| (+ a floor for all-zero references)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if not ref.numel():
        return
    scale = float(ref.float().abs().max()) + 1e-6
    err = float((got.float() - ref.float()).abs().max())
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x {scale:.3g}"


def case_helpers_say_where_kernels_run(monkeypatch):
    from moesaic.kernels import triton as kt

    assert kt.interpreting() and kt.available()
    assert kt.use_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kt.use_triton(torch.zeros(1)) is False
    with pytest.raises(ValueError, match="CUDA tensors"):
        T["mhc"].sinkhorn(torch.zeros(1, 2, 2), 3, 1e-6)


# ------------------------------------------------------------------------------------------ KDA

LAWS = [None, -5.0]  # Kimi Linear's -exp(A) softplus(.) and GLM-5.3 / K3's lb * sigmoid(exp(A) .)


def _kda_inputs(H, n, Dk, Dv, lower_bound, gen, lead=()):
    q = kda.l2norm(torch.randn(*lead, H, n, Dk, generator=gen)) * Dk**-0.5
    k = kda.l2norm(torch.randn(*lead, H, n, Dk, generator=gen))
    v = torch.randn(*lead, H, n, Dv, generator=gen)
    z = torch.randn(n, H * Dk, generator=gen) * 2
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(H * Dk, generator=gen)
    g = kda.kda_gate(z, A_log, dt_bias, Dk, lower_bound).transpose(0, 1)  # [H, n, Dk]
    g = g.expand(*lead, H, n, Dk).contiguous()
    beta = torch.rand(*lead, H, n, generator=gen)
    S = torch.randn(*lead, H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, S


@pytest.mark.parametrize("lower_bound", LAWS)
def case_kda_gate_both_laws(lower_bound):
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(7, 3 * 24, generator=gen) * 4
    z[0, :4] = torch.tensor([30.0, -30.0, 19.9, -1e3])  # softplus threshold and far tail
    A_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3 * 24, generator=gen)
    ref = kda.kda_gate(z, A_log, dt_bias, 24, lower_bound)
    close(T["kda"].kda_gate(z, A_log, dt_bias, 24, lower_bound), ref)


@pytest.mark.parametrize("lower_bound", LAWS)
def case_kda_recurrent_matches_reference(lower_bound):
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, S = _kda_inputs(3, 9, 24, 20, lower_bound, gen)
    o, S1, states = kda.delta_rule_recurrent(q, k, v, g, beta, S, keep_states=True)
    to, tS1, tstates = T["kda"].delta_rule_recurrent(q, k, v, g, beta, S, keep_states=True)
    close(to, o), close(tS1, S1), close(tstates, states)
    assert T["kda"].delta_rule_recurrent(q, k, v, g, beta, S)[2] is None


def case_kda_recurrent_batch_of_sequences():
    """Leading dims are independent heads: a batch of 2 sequences x 2 heads, one decode token each,
    equals the reference run per sequence (each with its own state)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta, S = _kda_inputs(2, 1, 16, 16, -5.0, gen, lead=(2,))
    to, tS, _ = T["kda"].delta_rule_recurrent(q, k, v, g, beta, S)
    for b in range(2):
        o, S1, _ = kda.delta_rule_recurrent(q[b], k[b], v[b], g[b], beta[b], S[b])
        close(to[b], o), close(tS[b], S1)


@pytest.mark.parametrize("lower_bound,n,chunk", [(None, 37, 16), (-5.0, 70, 64)])
def case_kda_chunked_matches_reference(lower_bound, n, chunk):
    gen = torch.Generator().manual_seed(4 + n)
    q, k, v, g, beta, S = _kda_inputs(2, n, 24, 20, lower_bound, gen)
    o, S1 = kda.delta_rule_chunked(q, k, v, g, beta, S, chunk)
    to, tS1 = T["kda"].delta_rule_chunked(q, k, v, g, beta, S, chunk)
    close(to, o, 1e-5), close(tS1, S1, 1e-5)


# ------------------------------------------------------------------------------------------ Mamba-2


def _ssd_inputs(T_, H, P, N, gen):
    x = torch.randn(T_, H, P, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(T_, H, generator=gen)).clamp(1e-3)
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    B, C = torch.randn(T_, H, N, generator=gen), torch.randn(T_, H, N, generator=gen)
    return x, dt, A, B, C, torch.randn(H, P, N, generator=gen)


@pytest.mark.parametrize("T_,chunk", [(45, 16), (130, 128)])
def case_ssd_chunked_matches_reference(T_, chunk):
    x, dt, A, B, C, h0 = _ssd_inputs(T_, 3, 12, 10, torch.Generator().manual_seed(5))
    y, h = mamba2.ssd_chunked(x, dt, A, B, C, h0, chunk)
    ty, th = T["mamba2"].ssd_chunked(x, dt, A, B, C, h0, chunk)
    close(ty, y, 1e-5), close(th, h, 1e-5)


def case_ssd_step_batch_matches_reference():
    x, dt, A, B, C, h0 = _ssd_inputs(3, 3, 12, 10, torch.Generator().manual_seed(6))
    hs = torch.stack([h0, 2 * h0, -h0])
    ty, th = T["mamba2"].ssd_step(x, dt, A, B, C, hs)  # 3 sequences, one token each
    for b in range(3):
        y, h = mamba2.ssd_step(x[b], dt[b], A, B[b], C[b], hs[b])
        close(ty[b], y), close(th[b], h)


# ------------------------------------------------------------------------------------------ MLA / DSA


def _paged(lens, widths, layers, dtype, gen):
    """Pools [blocks, layers, 64, w] per width and a block table scattering each sequence's pages."""
    nb = [-(-n // 64) for n in lens]
    blocks = sum(nb) + 2
    pools = [torch.randn(blocks, layers, 64, w, generator=gen).to(dtype) for w in widths]
    perm = torch.randperm(blocks, generator=gen)
    table = torch.full((len(lens), max(nb) + 1), blocks - 1, dtype=torch.int32)
    at = 0
    for s, b in enumerate(nb):
        table[s, :b] = perm[at : at + b].to(torch.int32)
        at += b
    return pools, table


LENS, NEW = [70, 3, 130], [1, 3, 2]  # cached tokens (this step's included) and new tokens per sequence


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def case_paged_mla_decode_matches_gathered_reference(dtype, rel):
    gen = torch.Generator().manual_seed(7)
    H, kvr, dr, layer = 5, 40, 8, 1
    (lat, rope), table = _paged(LENS, (kvr, dr), 2, dtype, gen)
    qs = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    q_lat = torch.randn(H, 6, kvr, generator=gen).to(dtype)
    q_rope = torch.randn(6, H, dr, generator=gen).to(dtype)
    lens = torch.tensor(LENS, dtype=torch.int32)
    # split-KV on: two splits of 96 keys, the short sequence's second one empty
    o = T["mla"].paged_latent_attention(q_lat, q_rope, lat, rope, layer, table, lens, qs, 0.15, num_splits=2)
    for s in range(3):
        rows = slice(int(qs[s]), int(qs[s + 1]))
        keys = T["mla"].gather_pages(lat, layer, table[s], LENS[s])
        krope = T["mla"].gather_pages(rope, layer, table[s], LENS[s])
        close(o[:, rows], mla.latent_attention(q_lat[:, rows], q_rope[rows], keys, krope, 0.15), rel)


def case_latent_attention_same_signature():
    gen = torch.Generator().manual_seed(8)
    q_lat, q_rope = torch.randn(4, 3, 32, generator=gen), torch.randn(3, 4, 16, generator=gen)
    latent, k_rope = torch.randn(77, 32, generator=gen), torch.randn(77, 16, generator=gen)
    close(
        T["mla"].latent_attention(q_lat, q_rope, latent, k_rope, 0.2),
        mla.latent_attention(q_lat, q_rope, latent, k_rope, 0.2),
    )
    no_rope = torch.empty(77, 0)
    close(
        T["mla"].latent_attention(q_lat, q_rope[..., :0], latent, no_rope, 0.2),
        mla.latent_attention(q_lat, q_rope[..., :0], latent, no_rope, 0.2),
    )


def case_paged_dsa_sparse_attention_matches_reference():
    gen = torch.Generator().manual_seed(9)
    H, kvr, dn, dv, layer = 4, 32, 16, 12, 0
    (lat,), table = _paged(LENS, (kvr,), 1, torch.float32, gen)
    qs = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    q = torch.randn(6, H, dn, generator=gen)
    w_kv_b = torch.randn(H * (dn + dv), kvr, generator=gen) * 0.2
    sel = torch.full((6, 11), -1, dtype=torch.long)
    for t, (s, n) in enumerate([(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]):
        pos = LENS[s] - NEW[s] + n
        pick = torch.randperm(pos + 1, generator=gen)[: 11 - t]  # fewer keys for later queries
        sel[t, : pick.numel()] = pick
    sel[3] = -1  # a query with nothing selected gets 0
    got = T["mla"].paged_sparse_mla_attend(
        q, lat, layer, table, torch.tensor(LENS), qs, w_kv_b, dv, 0.25, sel, num_splits=2
    )
    for s in range(3):
        rows = slice(int(qs[s]), int(qs[s + 1]))
        keys = T["mla"].gather_pages(lat, layer, table[s], LENS[s])
        ref = dsa.sparse_mla_attend(q[rows], keys, w_kv_b, dv, 0.25, sel[rows])
        close(got[rows], ref)
        close(T["mla"].sparse_mla_attend(q[rows], keys, w_kv_b, dv, 0.25, sel[rows]), ref)
    assert float(got[3].abs().max()) == 0.0


# ------------------------------------------------------------------------------------------ indexers


def case_dsa_kpool_indexer_scores_and_selection():
    gen = torch.Generator().manual_seed(10)
    n, nI, c, P, T_ = 6, 16, 24, 4, 41
    q = torch.randn(n, nI, c, generator=gen)
    w = torch.randn(n, nI, generator=gen) * nI**-0.5
    k, z, ape = (
        torch.randn(T_, c, generator=gen),
        torch.randn(T_, c, generator=gen),
        torch.randn(P, c, generator=gen),
    )
    pos = torch.tensor([2, 9, 15, 22, 38, 40])  # the first sees no complete pool, the others 2..10
    pooled = dsa.pool_keys(k, z, ape)
    close(T["indexer"].index_scores(q, w, pooled), dsa.index_scores(q, w, pooled))
    for topk in (8, 64):  # fewer than the visible pools, and more
        ref = dsa.kpool_select(q, w, k, z, ape, pos, topk, True)
        got = T["indexer"].kpool_select(q, w, k, z, ape, pos, topk, True)
        assert torch.equal(got.sort(1).values, ref.sort(1).values)
        scores = dsa.index_scores(q, w, pooled)
        assert torch.equal(
            T["indexer"].select(scores, pos, P, topk, False).sort(1).values,
            dsa.select(scores, pos, P, topk, False).sort(1).values,
        )


def case_csa_indexer_select():
    gen = torch.Generator().manual_seed(11)
    q, w = torch.randn(5, 16, 20, generator=gen), torch.randn(5, 16, generator=gen) * 0.25
    keys, pos = torch.randn(70, 20, generator=gen), torch.tensor([1, 7, 30, 200, 283])
    for topk in (3, 100):
        (ref, none), (got, none2) = (
            csa.indexer_select(q, w, keys, pos, 4, topk),
            T["indexer"].indexer_select(q, w, keys, pos, 4, topk),
        )
        assert none is None and none2 is None
        assert got.shape == ref.shape and torch.equal(got.sort(1).values, ref.sort(1).values)
    # V4.1's candidate blocks (8 entries each, the top 3 and the newest's), then a layer limited to them
    ref, ref_keep = csa.indexer_select(q, w, keys, pos, 4, 6, 8, 3)
    got, keep = T["indexer"].indexer_select(q, w, keys, pos, 4, 6, 8, 3)
    assert torch.equal(keep, ref_keep) and torch.equal(got.sort(1).values, ref.sort(1).values)
    ref, _ = csa.indexer_select(q, w, keys, pos, 4, 6, 8, 0, ref_keep)
    got, _ = T["indexer"].indexer_select(q, w, keys, pos, 4, 6, 8, 0, ref_keep)
    assert torch.equal(got.sort(1).values, ref.sort(1).values)
    s = T["indexer"].indexer_scores(q, w, keys, pos, 4)
    for i, j, ref, _ in csa.index_score_blocks(q, w, keys, pos, 4):
        vis = ref > float("-inf")
        assert torch.equal(vis, s[i:j] > float("-inf"))
        close(s[i:j][vis], ref[vis])


# ------------------------------------------------------------------------------------------ compressors


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("overlap,has_prev", [(False, False), (True, False), (True, True)])
def case_pool_windows(dtype, rel, overlap, has_prev):
    gen = torch.Generator().manual_seed(12)
    d = csa.CompressorDims(4, 12, overlap)
    kv = torch.randn(20, d.proj_width, generator=gen).to(dtype)
    gate = torch.randn(20, d.proj_width, generator=gen).to(dtype)
    ape = torch.randn(4, d.proj_width, generator=gen)
    close(
        T["compressor"].pool_windows(kv, gate, ape, d, has_prev),
        csa.pool_windows(kv, gate, ape, d, has_prev),
        rel,
    )


def case_pool_keys_drops_the_open_pool():
    gen = torch.Generator().manual_seed(13)
    k, z, ape = (
        torch.randn(23, 20, generator=gen),
        torch.randn(23, 20, generator=gen),
        torch.randn(4, 20, generator=gen),
    )
    close(T["compressor"].pool_keys(k, z, ape), dsa.pool_keys(k, z, ape))


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def case_compressor_update_over_prefill_and_decode(ratio, overlap):
    """Two compressor states fed the same rows (a 13-token prefill, then 3 one-token decodes): the Triton
    update returns the reference's entries at every step."""
    gen = torch.Generator().manual_seed(14)
    d = csa.CompressorDims(ratio, 16, overlap)
    w = csa.CompressorWeights(
        torch.empty(0),
        torch.empty(0),
        torch.randn(ratio, d.proj_width, generator=gen),
        torch.rand(16, generator=gen),
    )
    rope = csa.RopeTail(torch.rand(4, generator=gen))
    states = [csa.CompressorState(d, torch.float32, "cpu", 64, 2) for _ in range(2)]
    for n in (13, 1, 1, 1):
        kv, gate = torch.randn(n, d.proj_width, generator=gen), torch.randn(n, d.proj_width, generator=gen)
        entries, latent, first = csa.compressor_update(states[0], kv, gate, w, 1e-6, rope)
        got = T["compressor"].compressor_update(states[1], kv, gate, w, 1e-6, rope)
        close(got[0], entries), close(got[1], latent)
        assert got[2] == first
    assert states[1].entries.length == (13 + 3) // ratio


# ------------------------------------------------------------------------------------------ mHC


@pytest.mark.parametrize("n", [4, 3])
def case_sinkhorn_and_site_maps(n):
    gen = torch.Generator().manual_seed(15 + n)
    logits = torch.randn(2, 5, n, n, generator=gen) * 3
    close(T["mhc"].sinkhorn(logits, 20, 1e-6), mhc.sinkhorn(logits, 20, 1e-6))
    dims, d = mhc.MhcDims(n, 20, 1e-6, 1e-5), 40
    site = mhc.MhcSite(
        torch.randn(dims.site_width, n * d, generator=gen) * 0.1,
        torch.randn(dims.site_width, generator=gen),
        torch.randn(3, generator=gen),
    )
    for dtype in (torch.float32, torch.bfloat16):
        for N in (19, 1):
            h = torch.randn(N, n, d, generator=gen).to(dtype)
            ref = mhc.site_maps(h, site, dims)
            # one program per tile of tokens, and n·d cut into slices (3 asked: 2 of 64 and one of 32 at n=4)
            # whose partial sums a second kernel adds: the GPU's decode form (the interpreter has 1 SM)
            for splits in (None, 3):
                for got, want in zip(T["mhc"].site_maps(h, site, dims, splits=splits), ref):
                    close(got, want, 1e-5)


@pytest.mark.parametrize("n", [4, 3])
def case_mhc_collapse_and_update(n):
    """The streams' weighted sum and their update by a block's output, odd widths, bf16 and fp32, streams
    given as a non-contiguous view."""
    gen = torch.Generator().manual_seed(33 + n)
    for dtype, rel in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        for d in (40, 1100):
            h = torch.randn(5, d, n, generator=gen).to(dtype).transpose(1, 2)  # [5, n, d], strided
            pre, post = torch.rand(5, n, generator=gen), torch.rand(5, n, generator=gen) * 2
            comb, y = torch.rand(5, n, n, generator=gen), torch.randn(5, d, generator=gen).to(dtype)
            close(T["mhc"].collapse(h, pre), mhc.collapse(h, pre), rel)
            close(T["mhc"].update(h, y, post, comb), mhc.update(h, y, post, comb), rel)
        lead = (
            h.reshape(5, 1, n, d),
            y.view(5, 1, d),
            post.view(5, 1, n),
            comb.view(5, 1, n, n),
        )  # [.., n, d]
        close(T["mhc"].update(*lead), mhc.update(h, y, post, comb).view(5, 1, n, d), rel)
        close(T["mhc"].collapse(lead[0], pre.view(5, 1, n)), mhc.collapse(h, pre).view(5, 1, d), rel)


def case_kda_l2norm():
    """KDA's q / k normalisation: rows of 128 and of an odd width, contiguous and strided."""
    gen = torch.Generator().manual_seed(36)
    for x in (torch.randn(5, 3, 128, generator=gen), torch.randn(4, 70, generator=gen).t()[:33]):
        close(T["kda"].l2norm(x, 1e-6), kda.l2norm(x, 1e-6))


def case_kda_short_conv():
    """KDA's causal conv + SiLU from a state's tail, one row and a prompt's rows, bf16 and fp32 inputs."""
    gen = torch.Generator().manual_seed(34)
    for n, dtype in ((1, torch.bfloat16), (37, torch.float32)):
        x, tail = torch.randn(n, 300, generator=gen).to(dtype), torch.randn(3, 300, generator=gen)
        w = torch.randn(300, 4, generator=gen)
        (y, full), (ry, rfull) = T["kda"].short_conv(x, tail, w), kda.short_conv(x, tail, w)
        close(y, ry)
        assert torch.equal(full, rfull)


def case_row_stack_in_one_product(monkeypatch):
    """Where the Triton kernels serve x, a RowStack's weights (dense bf16, or packed) are one product whose
    column views equal the separate products (layers/linear.py)."""
    from moesaic.layers.linear import linear, stack_rows

    gen = torch.Generator().manual_seed(35)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    for make in (lambda w: w.bfloat16(), FORMATS["mxfp4"]):
        ws = [make(torch.randn(rows, 64, generator=gen)) for rows in (48, 16, 32)]
        (stack,) = stack_rows(ws)
        monkeypatch.setenv("MOESAIC_TRITON", "off")
        refs = [linear(x, p) for p in stack.parts]
        monkeypatch.setenv("MOESAIC_TRITON", "interpret")
        ys = stack.products(x)
        assert ys is not None and len(ys) == 3
        for y, ref in zip(ys, refs):
            close(y, ref, 2e-2)


# ------------------------------------------------------------------------------------------ norms, ropes


def case_rms_norm_orders():
    """Every order of layers/norms.py (its roundings) and the grouped weight of Mamba-2's gated norm, odd
    widths, bf16 and fp32: the kernel's norm against the torch reference's."""
    from moesaic.layers import mamba2, norms

    gen = torch.Generator().manual_seed(31)
    for d in (48, 129):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(3, 5, d, generator=gen) * 3).to(dtype)
            rel = 2e-6 if dtype == torch.float32 else 2e-2  # the interpreter rounds to bf16 by truncation
            for order in (norms.rms_norm, norms.rms_norm_fp32_weight, norms.rms_norm_cast_once):
                for wd in (dtype, torch.float32):
                    w = torch.randn(d, generator=gen).to(wd)
                    got = T["norm"].rms_norm(x, w, 1e-6, *norms.roundings(order, x.dtype, w.dtype))
                    close(got, order(x, w, 1e-6), rel)
            got = T["norm"].rms_norm(x, w, 1e-6, None, dtype, dtype, factor=dtype)
            close(got, x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(dtype) * w, rel)
    y, z, w = (
        torch.randn(4, 64, generator=gen),
        torch.randn(4, 64, generator=gen),
        torch.randn(64, generator=gen),
    )
    g = (y * torch.nn.functional.silu(z)).unflatten(-1, (4, -1))
    ref = mamba2.gated_rmsnorm(y, z, w, 4, 1e-5)
    close(T["norm"].rms_norm(g, w.view(4, -1), 1e-5, None, w.dtype, w.dtype).flatten(-2), ref)


def case_ropes():
    """The three layouts of layers/rope.py (interleaved, halves, pairs with kept channels), bf16 and fp32,
    several heads, an odd pair count."""
    from moesaic.layers import rope

    gen = torch.Generator().manual_seed(32)
    for dtype in (torch.float32, torch.bfloat16):
        rel = 2e-6 if dtype == torch.float32 else 2e-2
        for half, keep in ((8, 0), (5, 0), (8, 6)):
            x = torch.randn(4, 3, keep + 2 * half, generator=gen).to(dtype)
            cos, sin = rope.cos_sin(torch.rand(half, generator=gen), torch.arange(4) * 7)
            if not keep:
                close(T["norm"].rope(x, cos, sin, 0), rope.rope_interleaved(x, cos, sin), rel)
                close(T["norm"].rope(x, cos, sin, 1), rope.rope_half(x, cos, sin), rel)
            close(T["norm"].rope(x, cos, sin, 2, keep), rope.rope_pairs(x, cos, sin, keep), rel)
    assert T["norm"].rope(torch.randn(4, 10), cos, sin, 2, 3) is None  # widths that do not add up


def case_add_rms_norm():
    """A residual add and the norm after it in one launch: the sum in x's dtype, and the norm of that sum."""
    from moesaic.layers import norms

    gen = torch.Generator().manual_seed(34)
    for dtype, rel in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        x, delta = (
            (torch.randn(2, 3, 40, generator=gen) * 2).to(dtype),
            torch.randn(2, 3, 40, generator=gen).to(dtype),
        )
        w = torch.rand(40, generator=gen).to(dtype)
        h, y = T["norm"].add_rms_norm(x, delta, w, 1e-6, *norms.roundings(norms.rms_norm, dtype, dtype))
        close(h, x + delta, 0 if dtype == torch.float32 else rel)
        close(y, norms.rms_norm(x + delta, w, 1e-6), rel)
    assert T["norm"].add_rms_norm(x, delta[:, :2], w, 1e-6, None, dtype, dtype) is None  # shapes that differ


def case_silu_mul():
    """SwiGLU's SiLU(gate) · up over the halves of gate|up rows (strided views), odd width, bf16 and fp32."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(33)
    for dtype, rel in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        gu = (torch.randn(5, 2 * 37, generator=gen) * 3).to(dtype)
        gate, up = gu.chunk(2, dim=-1)
        close(T["norm"].silu_mul(gate, up), F.silu(gate) * up, rel)
    assert T["norm"].silu_mul(gate, up[:, :5]) is None  # shapes that differ


# ------------------------------------------------------------------------------------------ routers


def _same_routes(got, ref, rel=2e-6):
    (wg, ig), (wr, ir) = got, ref
    ig, pg = ig.sort(1)
    ir, pr = ir.sort(1)
    assert torch.equal(ig, ir)
    assert wg.dtype == wr.dtype
    close(wg.gather(1, pg), wr.gather(1, pr), rel)


def case_routers():
    gen = torch.Generator().manual_seed(17)
    x, bias = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen) * 0.3
    r = T["router"]
    _same_routes(r.route_sigmoid(x, 6, bias, 8, 3, True, 2.5), moe.route_sigmoid(x, 6, bias, 8, 3, True, 2.5))
    _same_routes(r.route_sigmoid(x, 5), moe.route_sigmoid(x, 5))
    _same_routes(r.route_sigmoid(x, 3, None, 1, 1, False), moe.route_sigmoid(x, 3, None, 1, 1, False))
    _same_routes(r.route_softmax(x, 4, 4, 2), moe.route_softmax(x, 4, 4, 2))
    _same_routes(
        r.route_softmax(x, 3, normalize=False, scale=2.0), moe.route_softmax(x, 3, normalize=False, scale=2.0)
    )
    _same_routes(r.route_sqrtsoftplus(x, 6, bias, 1.5), moe.route_sqrtsoftplus(x, 6, bias, 1.5))
    ids = torch.randint(0, 40, (3, 6), generator=gen)  # a hash layer's static experts
    _same_routes(r.route_sqrtsoftplus(x, 6, None, 1.5, ids), moe.route_sqrtsoftplus(x, 6, None, 1.5, ids))
    wide = torch.randn(2, 300, generator=gen)  # odd expert count, many experts, top-16
    _same_routes(
        r.route_sigmoid(wide, 16, bias.repeat(8)[:300]), moe.route_sigmoid(wide, 16, bias.repeat(8)[:300])
    )
    _same_routes(r.route_softmax(x.bfloat16(), 3), moe.route_softmax(x.bfloat16(), 3), 2e-2)


# ------------------------------------------------------------------------------------------ packed GEMMs

FORMATS = {
    "mxfp4": lambda w: Q.from_suffix_dict(Q.quantize_mxfp4(w)),
    "deepseek_fp4": lambda w: Q.from_suffix_dict(Q.quantize_mxfp4(w, naming="deepseek"), format="mxfp4"),
    "nvfp4_ct": lambda w: Q.from_suffix_dict(Q.quantize_nvfp4(w)),  # global scale divides
    "nvfp4_modelopt": lambda w: Q.from_suffix_dict(Q.quantize_nvfp4(w, naming="modelopt"), format="nvfp4"),
    "fp8_128_fp32": lambda w: Q.from_suffix_dict(Q.quantize_fp8_block(w, (128, 128)), format="fp8_block"),
    "fp8_32_ue8m0": lambda w: Q.from_suffix_dict(
        Q.quantize_fp8_block(w, (32, 32), "ue8m0", "deepseek"), format="fp8_block"
    ),
    "fp8_tensor": lambda w: Q.from_suffix_dict(Q.quantize_fp8_tensor(w), format="fp8_tensor"),
    # blocks a tile straddles (one scale read per element): 48x48, and per channel [1, K]
    "fp8_48_fp32": lambda w: _fp8_block(w, (48, 48)),
    "fp8_channel": lambda w: _fp8_block(w, (1, w.shape[1])),
}


def _fp8_block(w, block):
    d = Q.quantize_fp8_block(w, block)
    return Q.QuantizedTensor("fp8_block", d["weight"], d["weight_scale_inv"], block=block)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def case_packed_dequantize_is_exact_and_matmul_close(fmt):
    gen = torch.Generator().manual_seed(18)
    # fp8: K not a multiple of the block or the tile; both > 128 (the decode tile's K step), so 2 slices
    K = 160 if not fmt.startswith("fp8") else 228
    qt = FORMATS[fmt](torch.randn(70, K, generator=gen))
    assert torch.equal(T["quant"].dequantize(qt, torch.float32), qt.dequantize(torch.float32))
    for m, dtype, rel in ((1, torch.float32, 2e-6), (5, torch.float32, 2e-6), (3, torch.bfloat16, 2e-2)):
        x = torch.randn(m, K, generator=gen).to(dtype)
        # whole K, and K in slices whose partial sums are added after (the GPU's form when few tiles)
        for splits in (None, 2):
            got = T["quant"].matmul(qt, x, splits)
            assert got.dtype == dtype
            close(got, qt.matmul(x), rel)


def case_mxfp4_dequantizes_exactly_in_bf16():
    qt = FORMATS["mxfp4"](torch.randn(8, 64, generator=torch.Generator().manual_seed(19)))
    assert torch.equal(T["quant"].dequantize(qt, torch.bfloat16), qt.dequantize(torch.bfloat16))


def _stack(fmt, E, N, K, gen):
    if fmt == "dense":
        return torch.randn(E, N, K, generator=gen) * 0.2
    return Q.stack([FORMATS[fmt](torch.randn(N, K, generator=gen) * 0.2) for _ in range(E)])


@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "nvfp4_ct", "fp8_32_ue8m0"])
def case_grouped_matmul_matches_per_expert_loop(fmt):
    """Uneven groups: an empty expert, one row, more rows than a tile (20 > 16); and 20 experts (more than the
    kernel's 16-wide layout block) with leading, inner and trailing empty ones."""
    gen = torch.Generator().manual_seed(20)
    # K whole, and K = 288 in 3 slices of the 128-wide K step (the last one partial)
    sparse = [0, 0, 2] + [0] * 12 + [17, 0, 1, 0, 0]
    for counts, K, splits in (([3, 0, 20, 1], 64, None), ([3, 0, 20, 1], 288, 3), (sparse, 64, None)):
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        w = _stack(fmt, len(counts), 48, K, gen)
        xs = torch.randn(sum(counts), K, generator=gen)
        got = T["quant"].grouped_matmul(xs, offsets, w, splits)
        start = 0
        for e, c in enumerate(counts):
            ref = moe.linear(xs[start : start + c], w[e])
            close(got[start : start + c], ref)
            start += c
    w = w[:4]
    close(
        T["quant"].matmul(w, xs[:8].view(4, 2, K)),
        torch.stack([moe.linear(xs[2 * e : 2 * e + 2], w[e]) for e in range(4)]),
    )


@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "nvfp4_modelopt", "fp8_128_fp32"])
def case_run_experts_matches_reference(fmt):
    gen = torch.Generator().manual_seed(21)
    E, d, I, N, k = 6, 64, 32, 7, 3
    w_in, w_out = _stack(fmt, E, 2 * I, d, gen), _stack(fmt, E, d, I, gen)
    x = torch.randn(N, d, generator=gen)
    weights, ids = moe.route_sigmoid(torch.randn(N, E, generator=gen), k)
    act = moe.clamped_swiglu(7.0)
    close(
        T["quant"].run_experts(x, weights, ids, w_in, w_out, act),
        moe.run_experts(x, weights, ids, w_in, w_out, act),
        1e-5,
    )


def case_run_experts_slot_layouts(monkeypatch):
    """A decode step's slots laid out by one program (70 experts: more than one block of the counts; 120
    slots: more than one block of the ranks) and a batch's by torch's sorts (300 slots) match the reference,
    and the two layouts give the same bits."""
    gen = torch.Generator().manual_seed(22)
    for N, k, E in ((30, 4, 70), (100, 3, 9)):
        d, I = 32, 16
        w_in, w_out = torch.randn(E, 2 * I, d, generator=gen) * 0.2, torch.randn(E, d, I, generator=gen) * 0.2
        x = torch.randn(N, d, generator=gen)
        weights, ids = moe.route_softmax(torch.randn(N, E, generator=gen), k)
        got = T["quant"].run_experts(x, weights, ids, w_in, w_out, moe.swiglu)
        close(got, moe.run_experts(x, weights, ids, w_in, w_out, moe.swiglu), 1e-5)
        limit = T["quant"].ALIGN_MAX
        monkeypatch.setattr(T["quant"], "ALIGN_MAX", 0 if N * k <= limit else 10**6)
        assert torch.equal(got, T["quant"].run_experts(x, weights, ids, w_in, w_out, moe.swiglu))
        monkeypatch.setattr(T["quant"], "ALIGN_MAX", limit)


def case_run_experts_with_separately_quantized_gate_and_up():
    gen = torch.Generator().manual_seed(22)
    E, d, I = 4, 64, 32
    w_in = Q.ConcatRows([_stack("mxfp4", E, I, d, gen), _stack("mxfp4", E, I, d, gen)])
    w_out = _stack("mxfp4", E, d, I, gen)
    x = torch.randn(5, d, generator=gen)
    weights, ids = moe.route_softmax(torch.randn(5, E, generator=gen), 2)
    got = T["quant"].run_experts(x, weights, ids, w_in, w_out, moe.swiglu)
    close(got, moe.run_experts(x, weights, ids, w_in, w_out, moe.swiglu), 1e-5)


# ------------------------------------------------------------------------------------------ no host syncs


def case_decode_kernels_never_read_device_values_on_the_host(monkeypatch):
    """The decode-step wrappers size everything from shapes: no .item() / .tolist() / int() / bool() of a
    tensor (each would be a device-to-host sync on a GPU, and rules out CUDA graphs)."""
    gen = torch.Generator().manual_seed(23)
    (lat, rope), table = _paged(LENS, (32, 16), 2, torch.float32, gen)
    qs, lens = torch.tensor([0, 1, 4, 6], dtype=torch.int32), torch.tensor(LENS, dtype=torch.int32)
    q_lat, q_rope = torch.randn(4, 6, 32, generator=gen), torch.randn(6, 4, 16, generator=gen)
    sel = torch.randint(0, 3, (6, 5), generator=gen)
    logits = torch.randn(6, 16, generator=gen)
    w_in, w_out = _stack("mxfp4", 16, 64, 64, gen), _stack("mxfp4", 16, 64, 32, gen)
    x = torch.randn(6, 64, generator=gen)
    kda_in = _kda_inputs(2, 1, 16, 16, -5.0, gen, lead=(3,))
    site = mhc.MhcSite(
        torch.randn(24, 64, generator=gen), torch.randn(24, generator=gen), torch.randn(3, generator=gen)
    )

    def sync(*_):
        raise AssertionError("a device value read on the host")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    T["mla"].paged_latent_attention(q_lat, q_rope, lat, rope, 1, table, lens, qs, 0.1)
    T["mla"].paged_sparse_latent_attention(q_lat, lat, 0, table, lens, qs, 0.1, sel)
    weights, ids = T["router"].route_sigmoid(logits, 4, None, 4, 2)
    T["quant"].run_experts(x, weights, ids, w_in, w_out, moe.swiglu)
    T["kda"].delta_rule_recurrent(*kda_in)
    T["mhc"].site_maps(torch.randn(6, 4, 16, generator=gen), site, mhc.MhcDims(4))


# ------------------------------------------------------------------------------------------ this process

CASES = sorted(name for name in list(globals()) if name.startswith("case_"))


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    """Runs every case once in a child pytest with TRITON_INTERPRET=1; {test id: outcome} and the output."""
    folder = tmp_path_factory.mktemp("triton")
    env = dict(os.environ, MOESAIC_TRITON_CASES="1", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return run_cases_in_child(__file__, folder, env)


@pytest.mark.parametrize("case", CASES)
def test_kernel(case, interpreted_run):
    outcomes, output = interpreted_run
    runs = {n: o for n, o in outcomes.items() if n == case or n.startswith(case + "[")}
    assert runs, f"{case} did not run in the interpreter process:\n{output}"
    bad = {n: o for n, o in runs.items() if o != "passed"}
    assert not bad, f"{bad}\n{output}"


# ------------------------------------------------------------------------------------------ device check


def test_gpu_check_dry_run(tmp_path):
    """benchmarks/gpu_check.py --dry-run (interpreter, tiny shapes) checks every kernel and writes its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checked = {r["kernel"].split("[")[0] for r in report["checks"]}
    assert {"kda_recurrent", "kda_chunked", "ssd_chunked", "ssd_step", "mla_decode", "dsa_decode"} <= checked
    assert {
        "indexer",
        "compressor",
        "mhc",
        "router",
        "moe_gemm_mxfp4",
        "moe_gemm_nvfp4",
        "fp8_block_gemm",
    } <= checked
    assert all(r["ok"] for r in report["checks"]), [r for r in report["checks"] if not r["ok"]]
    assert report["e2e"]["status"].startswith("skipped:")


def test_gpu_gemv_dry_run():
    """benchmarks/gpu_gemv.py --dry-run: every tile shape of its sweep, every format, through the interpreter,
    matches the dequantized product (it exits 1 when one does not)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_gemv.py"), "--dry-run", "--rows", "1,3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] and line[0] != " "]
    for fmt in ("bf16", "fp8_128", "fp8_32_ue8m0", "mxfp4", "nvfp4"):
        tiles = [r for r in rows if r[0] == fmt and r[2].startswith("(")]
        assert len(tiles) == 2 * 10, (fmt, run.stdout[-3000:])


def test_auto_splits_only_where_the_output_tiles_leave_the_machine_idle(monkeypatch):
    """K in 4 slices for one matrix's decode on a 132-SM GPU (128 output tiles), not for a grouped MoE step's
    thousands of tiles, nor for a K too short to give each slice two steps (the H200's sweep: docs/perf.md)."""
    from moesaic.kernels.triton import quant as tq

    monkeypatch.setattr(tq, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")  # only passed through to num_sms
    assert tq._auto_splits(1, 128, 5120, 128, cuda) == 4
    assert tq._auto_splits(34, 64, 4096, 128, cuda) == 1
    assert tq._auto_splits(1, 128, 512, 128, cuda) == 1

"""Issue 18 item 2: the fused CPU RMSNorm and rope (kernels/cpu.py `rms_norm` / `rope`) give the torch code's
bits (layers/norms.py, layers/rope.py with MOESAIC_CPU_KERNELS=0) over widths, rows, dtypes and strided
inputs, are the path inference actually takes, and leave autograd to the torch code. KDA's token-by-token
delta rule in one call (`delta_rule`) matches its torch loop to rounding and is bit-consistent with itself."""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moesaic.kernels import cpu
from moesaic.layers import kda, mamba2, mla, norms, rope
from moesaic.models import glm5next

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def head_rms(x, w, eps):  # the unweighted norm whose factor is rounded first (w unused)
    return norms.head_rms(x, eps)


NORMS = (norms.rms_norm, norms.rms_norm_fp32_weight, norms.rms_norm_cast_once, head_rms)
ROPES = (rope.rope_interleaved, rope.rope_half, rope.rope_pairs)
# odd widths, the sum's vector (8 / 16 lanes) and cascade (16 x 4 vectors) boundaries, model widths
WIDTHS = (1, 3, 7, 8, 9, 15, 16, 17, 33, 63, 127, 129, 192, 511, 513, 1000, 1024, 2049, 4096, 7168)


@pytest.fixture
def kernels():
    if cpu.load() is None or not cpu.sum_lanes():
        pytest.skip("CPU kernels unavailable (or a CPU build whose sum order they do not follow)")
    return cpu


def torch_path(f, *args, **kw):
    """f run as the plain torch code (the reference)."""
    old = os.environ.get("MOESAIC_CPU_KERNELS")
    os.environ["MOESAIC_CPU_KERNELS"] = "0"
    try:
        return f(*args, **kw)
    finally:
        if old is None:
            del os.environ["MOESAIC_CPU_KERNELS"]
        else:
            os.environ["MOESAIC_CPU_KERNELS"] = old


def same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item()}"


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def count_ops(f, *args, **kw) -> int:
    with Ops() as m:
        f(*args, **kw)
    return m.n


@pytest.mark.parametrize("xd", DTYPES)
@pytest.mark.parametrize("wd", DTYPES)
def test_fused_rms_norm_keeps_the_torch_bits(kernels, xd, wd):
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for d in WIDTHS:
            for rows in (1, 3, 17):
                # rows of different scales (the sum's rounding matters), weights around 1
                x = (torch.randn(rows, d, generator=g) * torch.rand(rows, 1, generator=g) * 8).to(xd)
                w = (1 + 0.3 * torch.randn(d, generator=g)).to(wd)
                for f in NORMS:
                    same(f(x, w, 1e-6), torch_path(f, x, w, 1e-6))


@pytest.mark.parametrize("xd", DTYPES)
def test_add_rms_norm_keeps_the_torch_bits(kernels, monkeypatch, xd):
    """A residual add and the norm after it in one call (norms.add_rms_norm through cpu.add_rms_norm): the
    torch add's sum and rms_norm's bits, every width, 1-17 rows, 2-D and 3-D; the call is taken; a delta of
    another shape or dtype, or strided rows, run the two torch ops."""
    g = torch.Generator().manual_seed(31)
    with torch.inference_mode():
        for d in WIDTHS:
            for shape in ((1, d), (3, d), (17, d), (2, 3, d)):
                h = (torch.randn(*shape, generator=g) * 4).to(xd)
                delta = (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g)).to(xd)
                w = (1 + 0.3 * torch.randn(d, generator=g)).to(xd)
                got, want = fused_and_torch(
                    monkeypatch, "add_rms_norm", norms.add_rms_norm, h, delta, w, 1e-6
                )
                same(got[0], want[0])
                same(got[1], want[1])
                same(want[0], h + delta)
        h = torch.randn(4, 64, generator=g).to(xd)
        assert cpu.add_rms_norm(h, h[:, :32], torch.ones(64).to(xd), 1e-6, None, xd, xd) is None
        assert cpu.add_rms_norm(h, h.double(), torch.ones(64).to(xd), 1e-6, None, xd, xd) is None
        wide = torch.randn(4, 128, generator=g).to(xd)
        assert cpu.add_rms_norm(wide[:, ::2], h, torch.ones(64).to(xd), 1e-6, None, xd, xd) is None


@pytest.mark.parametrize("wd", [torch.bfloat16, torch.float32])
def test_grouped_gated_norm_keeps_the_torch_bits(kernels, monkeypatch, wd):
    """Mamba-2's gated norm over G groups of each row, each group with its slice of the full-width weight, in
    one call of the compiled norm (a [G, d] weight: row r takes w[r % G]); the torch code's bits for 1-8
    groups and 1-17 rows, and the call is taken."""
    from moesaic.layers.mamba2 import gated_rmsnorm

    g = torch.Generator().manual_seed(29)
    with torch.inference_mode():
        for groups, width in ((1, 96), (4, 512), (8, 2048)):
            for rows in (1, 3, 17):
                y = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g) * 4
                z = torch.randn(rows, width, generator=g).bfloat16()
                w = (1 + 0.3 * torch.randn(width, generator=g)).to(wd)
                taken = []
                monkeypatch.setattr(cpu, "rms_norm", _spy(cpu.rms_norm, taken))
                got = gated_rmsnorm(y, z, w, groups, 1e-5)
                monkeypatch.undo()
                assert taken == [True]
                same(got, torch_path(gated_rmsnorm, y, z, w, groups, 1e-5))


def test_fused_rms_norm_strided_and_batched_inputs(kernels):
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        kv = torch.randn(5, 576, generator=g).to(torch.bfloat16)
        heads = torch.randn(4, 6, 80, generator=g).to(torch.bfloat16)
        wide = torch.randn(300, 1024, generator=g).to(torch.bfloat16)  # enough rows to use the threads
        cases = [
            (kv[:, :512], torch.randn(512, generator=g).to(torch.bfloat16)),  # MLA's latent: a row slice
            (heads[:, 1:5, :64], torch.randn(64, generator=g).to(torch.bfloat16)),  # 3-D, strided heads
            (heads.float(), torch.randn(80, generator=g)),
            (wide, torch.randn(1024, generator=g).to(torch.bfloat16)),
            (heads.transpose(0, 1), torch.randn(80, generator=g).to(torch.bfloat16)),
        ]
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            for x, w in cases:
                for f in NORMS:
                    same(f(x, w, 1e-5), torch_path(f, x, w, 1e-5))
            # values not contiguous: the torch code (which sums in another order there) runs
            xt = torch.randn(64, 5, generator=g).to(torch.bfloat16).t()
            assert cpu.rms_norm(xt, torch.ones(64, dtype=torch.bfloat16), 1e-5, None, None, xt.dtype) is None
            same(
                norms.rms_norm(xt, torch.ones(64, dtype=torch.bfloat16), 1e-5),
                torch_path(norms.rms_norm, xt, torch.ones(64, dtype=torch.bfloat16), 1e-5),
            )
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("xd", DTYPES)
def test_fused_rope_keeps_the_torch_bits(kernels, xd):
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for dim in (2, 6, 16, 64, 66, 128):
            for shape in ((1,), (7,), (3, 4), (2, 3, 2), (300, 4)):
                n = shape[0]
                x = torch.randn(*shape, dim, generator=g).to(xd)
                ang = torch.randn(n, dim // 2, generator=g) * 20
                for cd in (torch.float32, xd):  # fp32 cos/sin, or rounded once per forward by the caller
                    c, s = ang.cos().to(cd), ang.sin().to(cd)
                    for f in ROPES:
                        same(f(x, c, s), torch_path(f, x, c, s))
                        same(f(x, c, -s), torch_path(f, x, c, -s))  # the inverse rotation (csa.py)
        # the rope part of wider heads (a strided view), as the attention layers pass it
        q = torch.randn(5, 8, 96, generator=g).to(torch.bfloat16)
        ang = torch.randn(5, 16, generator=g)
        c, s = ang.cos(), ang.sin()
        for f in ROPES:
            same(f(q[..., 64:], c, s), torch_path(f, q[..., 64:], c, s))
            same(f(q[:, 0, 64:], c, s), torch_path(f, q[:, 0, 64:], c, s))
        # V4's whole heads: the first `keep` channels copied, the rest rotated in place, one call
        for x in (q, q[:, 0], q[:, 1:7:2], q.float()):
            for keep in (64, 94, 30):
                h = (x.shape[-1] - keep) // 2
                cc, ss = torch.randn(5, h, generator=g).cos(), torch.randn(5, h, generator=g).sin()
                want = torch.cat([x[..., :keep], torch_path(rope.rope_pairs, x[..., keep:], cc, ss)], dim=-1)
                same(rope.rope_pairs(x, cc, ss, keep=keep), want)
                same(torch_path(rope.rope_pairs, x, cc, ss, keep=keep), want)


def test_the_fused_paths_are_taken(kernels):
    """One aten op (the output's allocation) per fused call instead of the torch code's 8-13: fails if the
    wiring in norms.py / rope.py breaks."""
    with torch.inference_mode():
        x, w = torch.randn(2, 256).to(torch.bfloat16), torch.randn(256).to(torch.bfloat16)
        for f in NORMS:
            assert count_ops(f, x, w, 1e-6) <= 2
            assert torch_path(count_ops, f, x, w, 1e-6) >= 7
        q = torch.randn(2, 4, 64).to(torch.bfloat16)
        c = s = torch.randn(2, 32)
        for f in ROPES:
            assert count_ops(f, q, c, s) <= 2
            assert torch_path(count_ops, f, q, c, s) >= 8
        c = s = torch.randn(2, 16)
        assert count_ops(rope.rope_pairs, q, c, s, keep=32) <= 2  # V4's [nope | rope] heads: no cat


def test_autograd_keeps_the_torch_code(kernels):
    x = torch.randn(3, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    for f in NORMS:
        assert cpu.rms_norm(x, w, 1e-6, None, None, x.dtype) is None
        y = f(x, w, 1e-6)
        assert y.grad_fn is not None
        y.sum().backward()
        assert x.grad is not None and (w.grad is not None or f is head_rms)  # head_rms has no weight
        x.grad = w.grad = None
    c = s = torch.randn(3, 32)
    for f in ROPES:
        y = f(x, c, s)
        assert y.grad_fn is not None
    with torch.no_grad():  # no grad: the fused path, the same numbers
        for f in NORMS:
            same(f(x, w, 1e-6), torch_path(f, x, w, 1e-6))


# ---- KDA's delta rule (kernels/cpu.py `delta_rule`): the same recurrence as the torch loop to rounding,
# and self-consistent to the bit (a block of tokens = the tokens one call at a time; heads are independent)


def delta_inputs(H, n, Dk, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, Dk, generator=g).transpose(0, 1)  # head-major views of [n, H, D], as kda_attend
    k = F.normalize(torch.randn(n, H, Dk, generator=g), dim=-1).transpose(0, 1)
    v = torch.randn(n, H, Dv, generator=g).transpose(0, 1)
    gate = -torch.rand(n, H, Dk, generator=g).transpose(0, 1) * 2
    beta = torch.rand(n, H, generator=g).T
    return q, k, v, gate, beta, torch.randn(H, Dk, Dv, generator=g)


@pytest.mark.parametrize(
    "H,n,Dk,Dv", [(1, 1, 1, 1), (4, 1, 48, 48), (3, 7, 5, 9), (4, 8, 48, 48), (2, 3, 128, 64)]
)
def test_delta_rule_kernel_matches_the_torch_loop(kernels, H, n, Dk, Dv):
    args = delta_inputs(H, n, Dk, Dv)
    calls = cpu.stats["kernel_calls"]
    o, S, states = kda.delta_rule_recurrent(*args, keep_states=True)
    ro, rS, rstates = kda.delta_rule_loop(*args, keep_states=True)
    assert cpu.stats["kernel_calls"] == calls  # the delta rule is not counted as a GEMM
    for a, b in ((o, ro), (S, rS), (states, rstates)):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert kda.delta_rule_recurrent(*args)[2] is None
    # a kernel that skipped the decay or the beta would be far off
    q, k, v, gate, beta, S0 = args
    bad = kda.delta_rule_loop(q, k, v, gate * 0, beta, S0)[0]
    assert (bad - o).abs().max() > 1e-2


def test_delta_rule_kernel_is_bit_consistent(kernels):
    """Token by token equals one block (a verify block vs decode steps); two sequences' heads side by side
    equal each alone (the recurrent fold of layers/recurrent.py); the kernel path is the one taken."""
    q, k, v, gate, beta, S0 = delta_inputs(4, 6, 48, 48, seed=1)
    o, S, states = kda.delta_rule_recurrent(q, k, v, gate, beta, S0, keep_states=True)
    St, parts = S0, []
    for t in range(6):
        ot, St, st = kda.delta_rule_recurrent(*(x[:, t : t + 1] for x in (q, k, v, gate, beta)), St, True)
        same(st[0], states[t])
        parts.append(ot)
    same(torch.cat(parts, 1), o)
    same(St, S)
    other = delta_inputs(4, 6, 48, 48, seed=2)
    both = kda.delta_rule_recurrent(*(torch.cat([a, b]) for a, b in zip((q, k, v, gate, beta, S0), other)))
    same(both[0][:4], o)
    same(both[1][4:], kda.delta_rule_recurrent(*other)[1])
    off = torch_path(kda.delta_rule_recurrent, q, k, v, gate, beta, S0)[0]  # MOESAIC_CPU_KERNELS=0: the loop
    same(off, kda.delta_rule_loop(q, k, v, gate, beta, S0)[0])
    assert not torch.equal(off, o)  # so the block above ran the kernel (it sums in another order)
    # heads shared out to threads (work past cpu.DELTA_PARALLEL) give the one-thread bits
    big = delta_inputs(8, 4, 64, 64, seed=3)
    assert 8 * 4 * 64 * 64 >= cpu.DELTA_PARALLEL
    for one, two in zip(*threads_1_and_2(kda.delta_rule_recurrent, *big, True)):
        same(one, two)


def threads_1_and_2(f, *args):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = f(*args)
        torch.set_num_threads(2)
        return a, f(*args)
    finally:
        torch.set_num_threads(old)


def ssd_inputs(m, H, P, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, P, generator=g)
    dt = torch.rand(m, H, generator=g) * 0.5 + 0.01
    A = -torch.rand(H, generator=g) * 4
    B, C = torch.randn(m, H, N, generator=g), torch.randn(m, H, N, generator=g)
    return x, dt, A, B, C, torch.randn(H, P, N, generator=g)


@pytest.mark.parametrize(
    "m,H,P,N", [(1, 1, 1, 1), (1, 8, 16, 16), (5, 3, 7, 9), (8, 4, 32, 64), (4, 16, 32, 64)]
)
def test_ssd_steps_kernel_matches_the_torch_step(kernels, m, H, P, N):
    """Mamba-2's recurrent steps in one call (kernels/cpu.py `ssd_steps`) against layers/mamba2.py's ssd_step
    token by token: the states to the bit (the same float operations), y to rounding; and bit-consistent."""
    x, dt, A, B, C, h0 = ssd_inputs(m, H, P, N)
    y, h, states = cpu.ssd_steps(x, dt, A, B, C, h0, True)
    hr = h0
    for t in range(m):
        yr, hr = mamba2.ssd_step(x[t], dt[t], A, B[t], C[t], hr)
        same(states[t], hr)
        torch.testing.assert_close(y[t], yr, rtol=1e-5, atol=1e-5)
    same(h, hr)
    one = [
        cpu.ssd_steps(
            x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], states[t - 1] if t else h0, False
        )
        for t in range(m)
    ]
    same(torch.cat([o[0] for o in one]), y)
    assert one[0][2] is None
    wrong = cpu.ssd_steps(x, dt, A * 0, B, C, h0, False)[0]  # no decay: far from the step's y
    assert (wrong - y).abs().max() > 1e-2
    if m * H * P * N >= cpu.DELTA_PARALLEL:  # heads shared out to threads: the one-thread bits
        for one, two in zip(*threads_1_and_2(cpu.ssd_steps, x, dt, A, B, C, h0, True)):
            same(one, two)


def test_mamba2_mixer_takes_the_kernel_and_keeps_its_snapshots(kernels):
    """mamba2_recur's recurrent tokens (decode, and a verify block's snapshot tokens) run through the kernel:
    the same outputs and snapshots as the torch steps (MOESAIC_CPU_KERNELS=0) to rounding, and a block's
    snapshots are the states one-token calls reach."""
    dims = mamba2.Mamba2Dims(
        hidden_size=32, num_heads=4, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8
    )
    g = torch.Generator().manual_seed(3)
    w = mamba2.Mamba2Weights(
        in_proj=torch.randn(dims.in_proj_dim, 32, generator=g) * 0.2,
        conv_weight=torch.randn(dims.conv_dim, 1, 4, generator=g) * 0.5,
        conv_bias=torch.randn(dims.conv_dim, generator=g) * 0.1,
        dt_bias=torch.randn(4, generator=g) * 0.1,
        A_log=torch.rand(4, generator=g),
        D=torch.ones(4),
        norm_weight=torch.ones(dims.inner),
        out_proj=torch.randn(32, dims.inner, generator=g) * 0.2,
    )
    x = torch.randn(11, 32, generator=g)
    st = mamba2.Mamba2State.zeros(dims)
    y, new, snaps = mamba2.mamba2_mixer(x, w, dims, st, snapshot_last=4)
    ry, rnew, rsnaps = torch_path(mamba2.mamba2_mixer, x, w, dims, st, 4)
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    for a, b in zip(snaps + [new], rsnaps + [rnew]):
        same(a.conv, b.conv)
        torch.testing.assert_close(a.ssm, b.ssm, rtol=1e-6, atol=1e-6)
    cur = mamba2.mamba2_mixer(x[:7], w, dims, st)[1]
    for t in range(7, 11):
        _, cur, one = mamba2.mamba2_mixer(x[t : t + 1], w, dims, cur, snapshot_last=1)
        # (to rounding: torch's conv1d over 1 or 11 inputs may round differently; the kernel's own
        # bit-consistency is the test above)
        torch.testing.assert_close(one[0].ssm, snaps[t - 7].ssm, rtol=1e-6, atol=1e-6)


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "H, dn, dv, kvr, dr, lens, Ts",
    [
        (8, 64, 64, 128, 32, [1], [40]),  # the benchmark model's decode
        (4, 16, 24, 33, 0, [1, 3, 2], [5, 9, 2]),  # no rope part, odd latent width, a block of 3 (causal)
        (16, 128, 128, 512, 64, [4, 1], [300, 77]),  # release-sized heads, verify rows
        (6, 32, 32, 40, 8, [2], [257]),  # heads in a group of 4 and two alone, a 40-wide latent
    ],
)
def test_mla_absorbed_matches_the_torch_code(kernels, H, dn, dv, kvr, dr, lens, Ts):
    """The fused absorbed attention against layers/mla.py's absorb_queries / latent_attention /
    absorb_output per sequence: bf16 roundings in the same places, so at most one bf16 step apart and
    almost every value bit-equal (a rounding placed elsewhere breaks that)."""
    from moesaic.layers.mla import absorb_output, absorb_queries, latent_attention, split_kv_b

    g = torch.Generator().manual_seed(kvr)
    w_uk, w_uv = split_kv_b((torch.randn(H * (dn + dv), kvr, generator=g) * 0.1).bfloat16(), H, dn, dv)
    N = sum(lens)
    qn = torch.randn(N, H, dn, generator=g).bfloat16()
    qr = torch.randn(N, H, dr, generator=g).bfloat16()
    lat = [torch.randn(T, kvr + 5, generator=g).bfloat16()[:, :kvr] for T in Ts]  # strided rows
    kr = [torch.randn(T, dr, generator=g).bfloat16() for T in Ts]
    ref, at = [], 0
    for n, L, R in zip(lens, lat, kr):
        o_lat = latent_attention(absorb_queries(qn[at : at + n], w_uk), qr[at : at + n], L, R, 0.125)
        ref.append(absorb_output(o_lat, w_uv))
        at += n
    ref = torch.cat(ref)
    got = kernels.mla_absorbed(qn, qr, w_uk, w_uv, lat, kr, lens, 0.125)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    step = 2.0**-7 * ref.float().abs().amax()
    assert (got.float() - ref.float()).abs().max() <= step
    assert (got == ref).float().mean() >= 0.99
    assert (
        kernels.mla_absorbed(qn.float(), qr.float(), w_uk.float(), w_uv.float(), lat, kr, lens, 0.1) is None
    )
    cols = [torch.randn(kvr, T, generator=g).bfloat16().T for T in Ts]  # latent columns not contiguous
    assert kernels.mla_absorbed(qn, qr, w_uk, w_uv, cols, kr, lens, 0.1) is None


def test_mla_absorbed_reads_pages_in_place(kernels):
    """The fused absorbed attention over paged caches (a pool's views and each sequence's block ids, read in
    place) gives the bits of the same call over the rows gathered: lengths inside, at and past a block's end,
    queries of one row and causal blocks, two sequences in one call."""
    g = torch.Generator().manual_seed(11)
    H, dn, dv, kvr, dr, rows = 8, 64, 64, 128, 32, 64
    w = (torch.randn(H * (dn + dv), kvr, generator=g) * 0.1).bfloat16().view(H, dn + dv, kvr)
    lat = torch.randn(20, 3, rows, kvr, generator=g).bfloat16()  # [blocks, layers, block rows, width]
    rope = torch.randn(20, 3, rows, dr, generator=g).bfloat16()
    seqs = [(150, 1, [5, 2, 9]), (64, 1, [7]), (65, 2, [1, 3]), (300, 3, [0, 4, 8, 12, 16])]
    for pair in (seqs[:1], seqs[1:2], seqs[2:3], seqs[3:], seqs[::3]):
        n = sum(q for _, q, _ in pair)
        qn = torch.randn(n, H, dn, generator=g).bfloat16()
        qr = torch.randn(n, H, dr, generator=g).bfloat16()
        gathered = [
            (lat[ids, 1].reshape(-1, kvr)[:T], rope[ids, 1].reshape(-1, dr)[:T]) for T, _, ids in pair
        ]
        lens = [q for _, q, _ in pair]
        want = kernels.mla_absorbed(
            qn, qr, w[:, :dn], w[:, dn:], [a for a, _ in gathered], [b for _, b in gathered], lens, 0.125
        )
        got = kernels.mla_absorbed(
            qn,
            qr,
            w[:, :dn],
            w[:, dn:],
            [lat[:, 1]] * len(pair),
            [rope[:, 1]] * len(pair),
            lens,
            0.125,
            blocks=[ids for _, _, ids in pair],
            lengths=[T for T, _, _ in pair],
        )
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["demo-mistral4", "demo-kimi-linear"])
def test_mla_decode_reads_its_pages_in_place(kernels, monkeypatch, name):
    """The engine's bf16 MLA decode reads its paged caches in place (no gather per layer and step) and
    generates the tokens of the gathered path (prefix caching off: a hit would change the prefill's rows)."""
    import moesaic
    from moesaic.layers import mla

    llm = moesaic.LLM(name, dtype="bfloat16", enable_prefix_caching=False)
    params = moesaic.SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    ps = [[5, 6, 7] * 30, [9, 10], list(range(3, 140))]
    taken = []
    monkeypatch.setattr(cpu, "mla_block", lambda *a: None)  # the module's code (the fused block: below)
    monkeypatch.setattr(mla, "_absorbed_in_place", _spy(mla._absorbed_in_place, taken))
    fast = [o.token_ids for o in llm.generate(ps, params)]
    assert sum(taken) >= 60  # the decode steps' calls read in place
    monkeypatch.setattr(mla, "_absorbed_in_place", lambda *a: None)
    assert fast == [o.token_ids for o in llm.generate(ps, params)]


@pytest.mark.parametrize("name", ["demo-mistral4", "demo-kimi-linear"])
def test_mla_decode_takes_the_fused_call(kernels, monkeypatch, name):
    """A bf16 MLA model's decode runs no bmm / matmul (the absorbed folds and the latent attention are one
    call), and gives the tokens of the torch code (MOESAIC_CPU_KERNELS=0, which runs them as matmuls)."""
    import moesaic

    llm = moesaic.LLM(name, dtype="bfloat16")
    params = moesaic.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5], [7]]  # one-row prompts: every forward is a decode (a longer prefill may take matmuls)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MOESAIC_CPU_KERNELS", flag)
        with OpNames() as m:
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
        runs[flag] = (tokens, m.names.count("bmm") + m.names.count("matmul"))  # matmul: layers.linear.matmul
    assert runs["1"][1] == 0 and runs["0"][1] > 0
    assert runs["1"][0] == runs["0"][0]


def _spy(f, taken: list):
    """f, noting in `taken` whether each call returned a result (None: it did not apply)."""

    def call(*args, **kw):
        out = f(*args, **kw)
        taken.append(out is not None)
        return out

    return call


def fused_and_torch(monkeypatch, name: str, f, *args, **kw):
    """f's result with the fused call cpu.<name> (asserted to be taken, once) and with the torch code."""
    taken = []
    monkeypatch.setattr(cpu, name, _spy(getattr(cpu, name), taken))
    got = f(*args, **kw)
    assert taken == [True], name
    monkeypatch.setattr(cpu, name, lambda *a: None)
    want = f(*args, **kw)
    monkeypatch.undo()
    return got, want


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fn_dtype", [torch.bfloat16, torch.float32])
def test_mhc_site_and_update_keep_the_torch_bits(kernels, monkeypatch, dtype, fn_dtype):
    """layers/mhc.py's site_input and update in one call each (cpu.mhc_enter / mhc_update) give the torch
    code's bits: 4 streams, rows 1 to MAX_ROWS + 1 (the site's product by f32_rows: tiles past 4 rows),
    bf16, fp16 and fp32 streams, bf16 and fp32 fn, signed zeros in the streams; the calls are taken (a stream
    count the fused Sinkhorn does not take runs the torch code)."""
    from moesaic.layers import mhc

    g = torch.Generator().manual_seed(7)
    dims = mhc.MhcDims(4, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-5)
    # rows 7 and 8: the sigmoids of 28 values are torch's scalar code (by hand in the call), of 32 its vector code
    for N, d in ((1, 96), (3, 96), (7, 64), (8, 64), (cpu.MAX_ROWS, 64), (cpu.MAX_ROWS + 1, 64), (2, 4096)):
        site = mhc.MhcSite(
            (torch.randn(dims.site_width, 4 * d, generator=g) * 0.05).to(fn_dtype),
            torch.randn(dims.site_width, generator=g),
            torch.rand(3, generator=g) + 0.5,
        )
        h = (torch.randn(N, 4, d, generator=g) * 3).to(dtype)
        h[0, :, :3] = -0.0  # a collapse of signed zeros: torch's sum starts from +0
        y = torch.randn(N, d, generator=g).to(dtype)
        taken = []
        for name in ("mhc_enter", "mhc_update"):
            monkeypatch.setattr(cpu, name, _spy(getattr(cpu, name), taken))
        fused = mhc.site_input(h, site, dims)
        fused_h = mhc.update(h, y, fused[1], fused[2])
        assert taken == [True, True]  # both fused calls ran and returned
        monkeypatch.undo()
        monkeypatch.setattr(cpu, "mhc_enter", lambda *a: None)
        monkeypatch.setattr(cpu, "mhc_update", lambda *a: None)
        want = mhc.site_input(h, site, dims)
        want_h = mhc.update(h, y, want[1], want[2])
        monkeypatch.undo()
        for got, ref in zip((*fused, fused_h), (*want, want_h)):
            assert got.dtype == ref.dtype and torch.equal(_bits(got), _bits(ref)), (
                N,
                d,
            )  # signs of zeros too
    five = mhc.MhcDims(5)
    h5 = torch.randn(1, 5, 8, generator=g)
    site5 = mhc.MhcSite(
        torch.randn(five.site_width, 40, generator=g), torch.zeros(five.site_width), torch.ones(3)
    )
    assert cpu.mhc_enter(h5, None, site5.fn, site5.columns, site5.base, 1e-6, 1e-6, 20) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fn_dtype", [torch.bfloat16, torch.float32])
def test_mhc_weighted_head_keeps_the_torch_bits(kernels, monkeypatch, dtype, fn_dtype):
    """layers/mhc.py's head_weighted (DeepSeek-V4's final collapse) in one call (cpu.mhc_head) gives the torch
    code's bits: rows 1 to MAX_ROWS (the sigmoids of fewer than 32 values by torch's scalar code, of more by its
    vector code), 2 and 4 streams, bf16 / fp16 / fp32 streams, bf16 and fp32 fn / base / scale, signed zeros;
    more than MAX_ROWS rows are declined (the torch code)."""
    from moesaic.layers import mhc

    g = torch.Generator().manual_seed(11)
    for n in (2, 4):
        dims = mhc.MhcDims(n, hc_eps=1e-6, norm_eps=1e-6)
        for N, d in ((1, 1024), (3, 96), (7, 64), (8, 64), (cpu.MAX_ROWS, 64)):
            fn = (torch.randn(n, n * d, generator=g) * 0.05).to(fn_dtype)
            base, scale = (
                torch.randn(n, generator=g).to(fn_dtype),
                (torch.rand(1, generator=g) + 0.5).to(fn_dtype),
            )
            h = (torch.randn(N, n, d, generator=g) * 3).to(dtype)
            h[0, :, :3] = -0.0
            got, want = fused_and_torch(monkeypatch, "mhc_head", mhc.head_weighted, h, fn, base, scale, dims)
            assert got.dtype == want.dtype == dtype and torch.equal(_bits(got), _bits(want)), (n, N, d)
    h = torch.randn(cpu.MAX_ROWS + 1, 4, 64, generator=g)
    assert (
        cpu.mhc_head(h, torch.randn(4, 256, generator=g), torch.zeros(4), torch.ones(1), 1e-6, 1e-6) is None
    )


def test_mhc_mean_head_keeps_the_torch_bits(kernels, monkeypatch):
    """layers/mhc.py's head_mean (GLM-5.3's final collapse) in one call (cpu.mhc_mean) gives torch's mean's bits for
    bf16 and fp32 streams of 1, 2 and 4 streams, 1 to 33 rows, signed zeros; 3 streams (1/3 inexact) and fp16 (a
    rounded sum divided) are declined."""
    from moesaic.layers import mhc

    g = torch.Generator().manual_seed(13)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 2, 4):
            for N, d in ((1, 1024), (3, 96), (16, 64), (33, 64)):
                h = (torch.randn(N, n, d, generator=g) * 3).to(dtype)
                h[0, :, :3] = -0.0
                got, want = fused_and_torch(monkeypatch, "mhc_mean", mhc.head_mean, h)
                assert got.dtype == want.dtype == dtype and torch.equal(_bits(got), _bits(want)), (n, N, d)
    assert cpu.mhc_mean(torch.randn(2, 3, 64, generator=g)) is None
    assert cpu.mhc_mean(torch.randn(2, 4, 64, generator=g).half()) is None


@pytest.mark.parametrize("limit", [None, 7.0, 0.3])
def test_glu_rows_keep_the_torch_bits(kernels, monkeypatch, limit):
    """layers/moe.py's silu_glu / clamped_silu_glu on a prompt's bf16 gate|up rows in one call (cpu.glu_rows) give
    the torch code's bits: the halves of a [R, 2I] row (strided views), values past the limit on both sides, NaN
    and infinities (NaN where torch gives NaN); fp32 rows declined."""
    from moesaic.layers import moe

    g = torch.Generator().manual_seed(3)
    for R, I in ((1, 16), (37, 40), (300, 512)):
        gu = (torch.randn(R, 2 * I, generator=g) * 4).bfloat16()
        gu[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        gu[-1, I : I + 3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        gate, up = gu.chunk(2, dim=-1)
        f = moe.silu_glu if limit is None else partial(moe.clamped_silu_glu, limit=limit)
        got, want = fused_and_torch(monkeypatch, "glu_rows", f, gate, up)
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got.isnan(), want.isnan()), (R, I)
        # a NaN's bits aside (torch's own vector and scalar code round a NaN to different bf16 NaNs)
        ok = want.isnan()
        assert torch.equal(_bits(got.masked_fill(ok, 0)), _bits(want.masked_fill(ok, 0))), (R, I)
        assert want.isnan().any() and (got == want).sum() > got.numel() // 2
    assert cpu.glu_rows(gate.float(), up.float(), limit) is None


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 5, 37])
def test_combine_rows_keep_the_torch_bits(kernels, monkeypatch, N, wdtype):
    """layers/moe.py run_experts' combine (each token's expert rows times its routing weights, added over the
    slots) in one call (cpu.combine_rows) gives the torch code's bits: one token (its slots' rows in place) and
    many (gathered by the inverse permutation), zero and negative-zero rows, every slot of a token on one expert,
    fp32 routing weights (sums in fp32) and bf16 ones (a softmax router in the model's dtype: every product and
    sum rounded); fp16 routing weights take the torch code; a row past ys raises."""
    from moesaic.layers import moe

    g = torch.Generator().manual_seed(13)
    E, d, inter, k = 6, 64, 32, 4
    w_in = (torch.randn(E, 2 * inter, d, generator=g) * 0.2).bfloat16()
    w_out = (torch.randn(E, d, inter, generator=g) * 0.2).bfloat16()
    w_out[2] = -0.0  # expert 2's rows are -0: the sum from +0 gives +0
    x = torch.randn(N, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    ids[0] = torch.tensor([2, 2, 2, 2]) if N > 1 else ids[0]
    weights = torch.rand(N, k, generator=g).to(wdtype)
    got, want = fused_and_torch(monkeypatch, "combine_rows", moe.run_experts, x, weights, ids, w_in, w_out)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(_bits(got), _bits(want)), N
    taken = []
    monkeypatch.setattr(cpu, "combine_rows", _spy(cpu.combine_rows, taken))
    moe.run_experts(x, weights.half(), ids, w_in, w_out)
    monkeypatch.undo()
    assert taken == [False]
    with pytest.raises(RuntimeError, match="a row past ys"):
        cpu.combine_rows(torch.zeros(3, d).bfloat16(), torch.tensor([0, 1, 5]), torch.ones(1, 3))


def test_f32_rows_products(kernels):
    """cpu.f32_rows (fp32 x against fp32 rows: the mHC site's product where fn is fp32, as DeepSeek-V4 ships it):
    within fp32 rounding of the fp64 product at odd K and N, a row's bits the same alone, among 16 rows and (on
    AVX-512: tiles of 4 x 6 and the row-by-row loop for the rest) among 39, and under 2 threads; bf16 rows (GLM-5.3's
    fn) give the bits of their fp32 values; other dtypes declined (None)."""
    g = torch.Generator().manual_seed(5)
    for K, N in ((4096, 24), (1000, 7), (13, 5), (200, 13)):
        w = torch.randn(N, K, generator=g)
        x = torch.randn(39, K, generator=g)
        got = cpu.f32_rows(x, w)
        want = x.double() @ w.double().T
        tol = 4 * K * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T)
        assert ((got.double() - want).abs() <= tol).all(), (K, N)
        if cpu.has_bf16dp():  # (AVX-512: the tiles; without them more than MAX_ROWS rows take torch's GEMM)
            for i in (0, 3, 35, 38):
                assert torch.equal(cpu.f32_rows(x[i : i + 1], w), got[i : i + 1]), (K, N, i)
            assert torch.equal(cpu.f32_rows(x[5:21], w), got[5:21])
        assert torch.equal(cpu.f32_rows(x[3:4], w), cpu.f32_rows(x[:16], w)[3:4])
        wb = w.bfloat16()
        assert torch.equal(cpu.f32_rows(x, wb), cpu.f32_rows(x, wb.float())), (K, N)
        saved = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(cpu.f32_rows(x, w), got)
        finally:
            torch.set_num_threads(saved)
    assert cpu.f32_rows(x.bfloat16(), w) is None
    assert cpu.f32_rows(x, w.half()) is None


def test_product_seconds_counts_the_fused_calls_products(kernels):
    """cpu.product_seconds: the weight products inside cpu.mhc_enter (bf16 and fp32 fn) and cpu.dsa_gathered
    (bf16) add to the count while it is on, and nothing adds while it is off (the benchmark's split of a step
    reads it); the calls' outputs do not depend on it."""
    from moesaic.layers import mhc
    from moesaic.layers.linear import SMALL_PRODUCT

    g = torch.Generator().manual_seed(29)
    dims = mhc.MhcDims(4)
    h = torch.randn(1, 4, 512, generator=g).bfloat16()
    q = torch.randn(1, 8, 64, generator=g).bfloat16()
    latent = torch.randn(300, 128, generator=g).bfloat16()
    w = (torch.randn(8 * 96, 128, generator=g) * 0.1).bfloat16()
    sel = torch.randperm(300, generator=g)[:200].view(1, -1)
    fn = torch.randn(dims.site_width, 4 * 512, generator=g) * 0.01
    site = mhc.MhcSite(fn, torch.zeros(dims.site_width), torch.ones(3))

    def enter(fn):
        return lambda: cpu.mhc_enter(h, None, fn, site.columns, site.base, 1e-6, 1e-6, 20)[1]

    calls = [enter(fn), enter(fn.bfloat16())]
    calls.append(lambda: cpu.dsa_gathered(q, latent, w, 32, 0.125, sel, 0, SMALL_PRODUCT))
    try:
        for call in calls:
            before = cpu.product_seconds(False)
            off = call()
            assert cpu.product_seconds(True) == before  # off: nothing counted
            on = call()
            assert cpu.product_seconds(False) > before and torch.equal(on, off)
    finally:
        cpu.product_seconds(False)


def _three_blocks(h0, dims, sites, norm, weight, shift) -> list:
    """Three blocks over mhc.Streams(h0): each block's input, the streams after the second (a tap) and after
    the last. A block's output is made from its input (so a wrong input shows downstream); the first is in
    the streams' dtype, the others fp32 (the update rounds them)."""
    from moesaic.layers import mhc

    s, seen = mhc.Streams(h0, dims), []
    for i, site in enumerate(sites):
        x = s.enter(site, norm, weight, 1e-5)
        seen.append(x)
        y = x.float() * 0.75 + shift
        s.leave(y if i else y.to(h0.dtype))
        if i == 1:
            seen.append(s.value())  # a tap between blocks: the update runs alone
    return [*seen, s.value()]


@pytest.mark.parametrize("order", ["rms_norm", "rms_norm_cast_once"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_streams_keep_the_torch_bits(kernels, monkeypatch, order, dtype):
    """mhc.Streams: at each enter after the first, the waiting update, the site's maps and collapse and the
    block's norm are one call (cpu.mhc_run, taken at every enter; its plan kept for decode rows), with the bits
    of site_input, update and the norm run in turn (the fused mHC calls off): the inputs of three blocks (each
    block's output made from its input, so a wrong input shows downstream), the streams after them, and a tap's
    value between; GLM's and DeepSeek-V4's norm orders, rows on both sides of the sigmoids' scalar / vector
    split, an fp32 block output for bf16 streams (the update's y.to(dtype))."""
    from moesaic.layers import mhc

    g = torch.Generator().manual_seed(11)
    norm = getattr(norms, order)
    dims = mhc.MhcDims(4, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-5)
    for N, d in ((1, 128), (7, 64), (cpu.MAX_ROWS + 1, 32)):
        sites = [
            mhc.MhcSite(
                (torch.randn(dims.site_width, 4 * d, generator=g) * 0.05).bfloat16(),
                torch.randn(dims.site_width, generator=g),
                torch.rand(3, generator=g) + 0.5,
            )
            for _ in range(3)
        ]
        weight = (torch.rand(d, generator=g) + 0.5).to(dtype if order == "rms_norm" else torch.float32)
        h0 = (torch.randn(N, 4, d, generator=g) * 3).to(dtype)
        shift = torch.randn(N, d, generator=g)

        args = (h0, dims, sites, norm, weight, shift)
        planned, taken = [], []
        monkeypatch.setattr(cpu, "mhc_plan", _spy(cpu.mhc_plan, planned))
        monkeypatch.setattr(cpu, "mhc_run", _spy(cpu.mhc_run, taken))
        fused = _three_blocks(*args)  # grad mode on: every call checked
        with torch.inference_mode():  # off: decode's rows through the plans kept on the sites (twice: kept)
            kept = [_three_blocks(*args) for _ in range(2)]
        kept_calls = 3 if N <= cpu.MAX_ROWS else 0  # the second pass's (more rows: checked at every call)
        assert planned == [True] * (9 - kept_calls) and taken == [True] * 9, (N, planned, taken)
        monkeypatch.undo()
        monkeypatch.setattr(cpu, "mhc_enter", lambda *a: None)
        monkeypatch.setattr(cpu, "mhc_plan", lambda *a: None)
        monkeypatch.setattr(cpu, "mhc_update", lambda *a: None)
        want = _three_blocks(*args)
        monkeypatch.undo()
        for outs in (fused, *kept):
            for got, ref in zip(outs, want, strict=True):
                assert got.dtype == ref.dtype and torch.equal(_bits(got), _bits(ref)), (N, d)
    s = mhc.Streams(h0, dims)
    with pytest.raises(RuntimeError, match="follows an enter"):
        s.leave(h0[:, 0])
    # float64 streams (an exact reference's): the call declines, the torch code runs
    assert mhc.Streams(h0.double(), dims).enter(sites[0], norm, weight.float(), 1e-5).dtype == torch.float64


def test_sum_lanes_found_on_x86_builds():
    """The fused norm's sum order is found by probing torch (an AVX-512 build may still sum on AVX2
    vectors): on the x86 builds it must find one, or every norm silently takes the slower torch code."""
    if cpu.load() is None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no CPU kernels, or not an x86 build")
    assert cpu.sum_lanes() in (8, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_routers_keep_the_torch_bits(kernels, monkeypatch, dtype):
    """layers/moe.py's routers in one call each (cpu.route) give the torch code's weights and ids: softmax,
    sigmoid and sqrt(softplus) scores, with and without a correction bias (bf16 and fp32), normalised or
    not, scaled, a hash layer's given ids, 1 to 17 rows, 1 to 15 experts a token (the weights' sum in torch's
    order below its vector width: cpu.route's loops); the calls are taken."""
    from moesaic.layers import moe

    g = torch.Generator().manual_seed(11)
    shapes = ((1, 32, 4), (3, 256, 8), (17, 64, 6), (2, 16, 1), (1, 64, 2), (4, 16, 3), (2, 128, 5))
    for N, E, k in shapes + ((1, 256, 7), (5, 64, 9), (1, 256, 12), (2, 32, 15), (3, 64, 16)):
        logits = (torch.randn(N, E, generator=g) * 2).to(dtype)
        bias_f = torch.randn(E, generator=g) * 0.1
        hash_ids = torch.randint(0, E, (N, k), generator=g)
        cases = [
            (moe.route_softmax, (logits, k), dict(normalize=nz, scale=s))
            for nz in (True, False)
            for s in (1.0, 2.5)
        ]
        cases += [
            (moe.route_sigmoid, (logits, k), dict(bias=b, normalize=nz, scale=2.5))
            for b in (None, bias_f, bias_f.bfloat16())
            for nz in (True, False)
        ]
        cases += [
            (moe.route_sqrtsoftplus, (logits, k), dict(bias=b, scale=1.5, ids=i))
            for b in (None, bias_f.to(dtype))
            for i in (None, hash_ids)
        ]
        for f, args, kw in cases:
            got, want = fused_and_torch(monkeypatch, "route", f, *args, **kw)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (f.__name__, N, kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kda_recur_keeps_the_torch_bits(kernels, monkeypatch, dtype):
    """layers/kda.py's kda_recur in one call (cpu.kda_recur: the short conv, the l2 norms, the delta rule) for
    decode rows, verify blocks and prompts gives the torch code's output, state, snapshots and conv tails bit for
    bit: one row with and without its snapshot, blocks of 2-5 rows with every snapshot or all but the first,
    prompts of 3-40 rows with 0, 1 or 17 snapshots (the token recurrence for every row on the CPU), 2-8 heads,
    bf16 and fp32 rows."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(13)
    for H, D, K, n, snap in (
        (2, 16, 4, 1, 0),
        (2, 16, 4, 1, 1),
        (4, 32, 4, 4, 4),
        (4, 32, 4, 5, 4),
        (8, 8, 3, 2, 1),
        (2, 16, 4, 3, 1),
        (4, 32, 4, 30, 0),
        (4, 16, 4, 40, 17),
    ):
        C = 3 * H * D
        w = SimpleNamespace(conv=torch.randn(C, K, generator=g) * 0.5)
        dims = SimpleNamespace(num_heads=H, head_dim=D, conv_kernel=K, chunk_size=64)
        rows = (
            torch.randn(n, C, generator=g).to(dtype),
            -torch.rand(n, H, D, generator=g),  # log-decay
            torch.rand(n, H, generator=g),
            None,
        )
        state = kda.KdaState(torch.randn(K - 1, C, generator=g), torch.randn(H, D, D, generator=g) * 0.1)
        got, want = fused_and_torch(monkeypatch, "kda_recur", kda.kda_recur, rows, w, dims, state, snap)
        assert torch.equal(got[0], want[0]) and got[0].dtype == want[0].dtype, (n, snap)
        for a, b in zip([got[1], *got[2]], [want[1], *want[2]]):
            assert torch.equal(a.conv, b.conv) and torch.equal(a.recurrent, b.recurrent), (n, snap)
        assert len(got[2]) == len(want[2]) == snap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dsa_gathered_matches_the_torch_code(kernels, monkeypatch, dtype):
    """layers/dsa.py's attend_gathered in one call (cpu.dsa_gathered): fp32 gives the torch code's bits; bf16
    its roundings with the sums in another order, so within one bf16 step of each head's largest output (and
    mostly equal). 1-5 queries, selections padded with -1, a query with nothing selected (zeros), blocks of
    queries (a small block budget), operands small enough for linear.matmul's fp32 rule and large ones that
    are not; the call is taken."""
    from moesaic.layers import dsa

    g = torch.Generator().manual_seed(17)
    for n, H, dn, dv, kvr, T, W, block in (
        (1, 4, 48, 48, 64, 200, 200, 1 << 25),
        (3, 4, 48, 48, 64, 90, 64, 64 * 64),  # one query a block
        (5, 8, 64, 32, 128, 700, 512, 1 << 25),
        (2, 16, 128, 128, 512, 300, 256, 1 << 25),  # operands past SMALL_PRODUCT
        (2, 6, 32, 32, 40, 150, 100, 1 << 25),  # heads in a group of 4 and two alone, a 40-wide latent
    ):
        q = torch.randn(n, H, dn, generator=g).to(dtype)
        latent = torch.randn(T, kvr, generator=g).to(dtype)
        w = (torch.randn(H * (dn + dv), kvr, generator=g) * 0.1).to(dtype)
        sel = torch.stack([torch.randperm(T, generator=g)[:W] for _ in range(n)])
        sel[:, W // 2 :] = torch.where(torch.rand(n, W - W // 2, generator=g) < 0.3, -1, sel[:, W // 2 :])
        sel[-1] = -1 if n > 1 else sel[-1]  # nothing selected
        got, want = fused_and_torch(
            monkeypatch, "dsa_gathered", dsa.attend_gathered, q, latent, w, dv, 0.125, sel, block
        )
        assert got.dtype == want.dtype, (n, H, T, W)
        if dtype == torch.float32:
            assert torch.equal(got, want), (n, H, T, W)
        else:
            step = want.float().abs().amax(-1, keepdim=True) * 2**-8
            assert ((got.float() - want.float()).abs() <= step).all() and (got == want).float().mean() > 0.99


def test_dsa_gathered_reads_pages_in_place(kernels):
    """cpu.dsa_gathered with `pages`: the latent rows read from a page pool's view (blocks in any order, a
    layer's slice of a pool shared by several layers, a partly filled last block) give the same bits as the
    same rows gathered first; a block id past the pool is an error; fp32 declines (the caller gathers)."""
    from moesaic.layers.linear import SMALL_PRODUCT

    g = torch.Generator().manual_seed(23)
    for n, H, dn, dv, kvr, T, bs, layers in ((1, 4, 48, 48, 64, 37, 16, 3), (3, 8, 64, 32, 128, 300, 16, 2)):
        nb = -(-T // bs)
        pool = torch.randn(nb + 5, layers, bs, kvr, generator=g).to(torch.bfloat16)
        view = pool[:, 1]  # this layer's pages: [blocks, block rows, kvr], a block stride of `layers` blocks
        ids = torch.randperm(nb + 5, generator=g)[:nb].tolist()
        latent = view[ids].reshape(nb * bs, kvr)[:T]
        q = torch.randn(n, H, dn, generator=g).to(torch.bfloat16)
        w = (torch.randn(H * (dn + dv), kvr, generator=g) * 0.1).to(torch.bfloat16)
        sel = torch.stack([torch.randperm(T, generator=g) for _ in range(n)])
        sel[:, T // 2 :] = -1
        want = cpu.dsa_gathered(q, latent, w, dv, 0.125, sel, 0, SMALL_PRODUCT)
        got = cpu.dsa_gathered(q, view, w, dv, 0.125, sel, 0, SMALL_PRODUCT, pages=(ids, T))
        assert want is not None and torch.equal(got, want), (n, T)
        with pytest.raises(RuntimeError, match="past the pool"):
            cpu.dsa_gathered(q, view, w, dv, 0.125, sel, 0, SMALL_PRODUCT, pages=([i + 100 for i in ids], T))
        with pytest.raises(RuntimeError, match="past the cache"):
            cpu.dsa_gathered(q, view, w, dv, 0.125, sel, 0, SMALL_PRODUCT, pages=(ids, T // 2))
        f32 = (q.float(), view.float(), w.float())
        assert cpu.dsa_gathered(*f32[:2], f32[2], dv, 0.125, sel, 0, SMALL_PRODUCT, pages=(ids, T)) is None


@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
def test_sink_attention_matches_the_torch_code(kernels, monkeypatch, kind):
    """layers/csa.py's sink_attention in one call (cpu.sink_attention) for bf16: the torch code's logits,
    softmax and roundings with its dots and value sums added in another order, so within one bf16 step of
    the torch code (and mostly equal); 1 to MAX_ROWS queries, a window shorter than the block (later queries
    mask the first keys), blocks of queries (a small score budget), CSA picks padded with -1, HCA entries a
    query cannot see yet; the call is taken for bf16 and declines fp32."""
    from moesaic.layers import csa

    g = torch.Generator().manual_seed(23)
    H, D = 4, 96
    for n, window, first, budget in (
        (1, 128, 200, 1 << 22),
        (4, 8, 37, 1 << 22),
        (cpu.MAX_ROWS, 16, 90, 2000),
    ):
        monkeypatch.setattr(csa, "_SCORE_BUDGET", budget)
        win_start = max(0, first - window - 5)
        win = torch.randn(first + n - win_start, D, generator=g).bfloat16()
        q = torch.randn(n, H, D, generator=g).bfloat16() * 2
        pos = torch.arange(first, first + n)
        extra = ()
        if kind == "csa":
            comp = torch.randn((first + n) // 4, D, generator=g).bfloat16()
            sel = torch.randint(0, comp.shape[0], (n, 10), generator=g)
            sel[:, -3:] = -1
            extra = (comp, sel, 4)
        elif kind == "hca":
            extra = (torch.randn((first + n) // 16 + 2, D, generator=g).bfloat16(), None, 16)
        args = (q, pos, first, win, win_start, window, torch.randn(H, generator=g), D**-0.5, *extra)
        got, want = fused_and_torch(monkeypatch, "sink_attention", csa.sink_attention, *args)
        assert got.dtype == want.dtype == torch.bfloat16
        step = (want.float().abs() * 2**-7).clamp(min=2**-126)  # one bf16 step (8 significant bits)
        assert ((got.float() - want.float()).abs() <= step).all(), (n, window)
        assert (got == want).float().mean() > 0.99
        monkeypatch.undo()
    f32 = (q.float(), pos, first, win.float(), win_start, window, torch.ones(H), 0.1)
    assert cpu.sink_attention(*f32, None, None, 0, 1) is None
    if kind == "csa":  # a pick past the entries is an error, raised before the threads start
        bad = (q, pos, first, win, win_start, window, torch.ones(H), 0.1, comp, sel + comp.shape[0], 4, 1)
        with pytest.raises(RuntimeError, match="past the compressed rows"):
            cpu.sink_attention(*bad)


@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
def test_sink_prompt_matches_the_torch_code(kernels, monkeypatch, kind):
    """layers/csa.py's sink_attention for a prompt's rows (more than MAX_ROWS) in one call (cpu.sink_prompt, by
    vdpbf16ps tiles): within one bf16 step of the torch code and mostly its bits; windows shorter than the prompt
    starting at odd and even keys, a prompt after a cached past, 6 heads (a pass of 4, then 2), 96-dim heads, CSA
    picks padded with -1 (a query with none; distinct picks within 2k entries, repeated ones, one past them), HCA
    entries a query cannot see yet."""
    from moesaic.layers import csa

    if not cpu.has_bf16dp():
        pytest.skip("needs AVX-512 BF16")
    g = torch.Generator().manual_seed(29)
    H, D = 6, 96
    for n, window, first, win_start in ((cpu.MAX_ROWS + 1, 16, 0, 0), (70, 24, 37, 5), (40, 128, 3, 0)):
        win = torch.randn(first + n - win_start, D, generator=g).bfloat16()
        q = torch.randn(n, H, D, generator=g).bfloat16() * 2
        pos = torch.arange(first, first + n)
        extra = (None, None, 0)
        if kind == "csa":
            E = (first + n) // 4 + 1
            comp = torch.randn(E + 40, D, generator=g).bfloat16()  # entries past the picks' 2k: packed picks
            sel = torch.randint(0, E, (n, 21), generator=g)  # repeats: the picks packed
            for i in range(0, n, 2):  # distinct picks within the first 2k: the entries' logits read
                sel[i] = (
                    torch.randperm(E, generator=g)[:21] if E >= 21 else torch.randperm(21, generator=g) % E
                )
            sel[3, 0] = E + 39
            sel[:, -5:] = -1
            sel[1] = -1
            extra = (comp, sel, 4)
        elif kind == "hca":
            extra = (torch.randn((first + n) // 8 + 2, D, generator=g).bfloat16(), None, 8)
        args = (q, pos, first, win, win_start, window, torch.randn(H, generator=g), D**-0.5, *extra)
        got, want = fused_and_torch(monkeypatch, "sink_prompt", csa.sink_attention, *args)
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
        mag = want.float().abs()
        if kind == "csa":  # two bf16 sums added: where they cancel, a step of theirs (~ the row's size) shows
            mag = mag + mag.mean(-1, keepdim=True)
        step = (mag * 2**-7).clamp(min=2**-126)  # one bf16 step (8 significant bits)
        assert ((got.float() - want.float()).abs() <= step).all(), (n, window)
        assert (got == want).float().mean() > 0.99
    if kind == "csa":  # a pick past the entries is an error, raised before the threads start
        with pytest.raises(RuntimeError, match="past the compressed rows"):
            cpu.sink_prompt(
                q, first, win, win_start, window, torch.ones(H), 0.1, comp, sel + comp.shape[0], 4
            )
    assert (
        cpu.sink_prompt(q.float(), first, win.float(), win_start, window, torch.ones(H), 0.1, None, None, 0)
        is None
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mamba2_recur_keeps_the_torch_bits(kernels, monkeypatch, dtype):
    """layers/mamba2.py's mamba2_recur in one call (cpu.mamba2_recur: the causal conv, the split, the recurrent
    steps, the D skip) for decode rows and verify blocks gives the torch code's output, state and snapshots bit
    for bit: one row with and without its snapshot, a block of 4 with every snapshot, with and without a conv
    bias, bf16 and fp32 rows; the call is taken; a block the chunked scan starts keeps the torch code."""
    dims = mamba2.Mamba2Dims(
        hidden_size=32, num_heads=4, head_dim=8, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8
    )
    g = torch.Generator().manual_seed(19)
    for n, snap, bias in ((1, 0, True), (1, 1, False), (4, 4, True), (3, 3, False)):
        w = mamba2.Mamba2Weights(
            in_proj=torch.randn(dims.in_proj_dim, 32, generator=g) * 0.2,
            conv_weight=torch.randn(dims.conv_dim, 1, 4, generator=g) * 0.5,
            conv_bias=torch.randn(dims.conv_dim, generator=g) * 0.1 if bias else None,
            dt_bias=torch.randn(4, generator=g) * 0.1,
            A_log=torch.rand(4, generator=g),
            D=torch.randn(4, generator=g),
            norm_weight=torch.ones(dims.inner),
            out_proj=torch.randn(32, dims.inner, generator=g) * 0.2,
        )
        rows = (
            None,
            torch.randn(n, dims.conv_dim, generator=g).to(dtype),
            torch.rand(n, 4, generator=g) * 0.5,
        )
        st = mamba2.Mamba2State(
            torch.randn(dims.conv_dim, 3, generator=g), torch.randn(4, 8, 16, generator=g) * 0.1
        )
        got, want = fused_and_torch(monkeypatch, "mamba2_recur", mamba2.mamba2_recur, rows, w, dims, st, snap)
        assert torch.equal(got[0], want[0]), (n, snap)
        assert len(got[2]) == len(want[2]) == snap
        for a, b in zip([got[1], *got[2]], [want[1], *want[2]]):
            assert torch.equal(a.conv, b.conv) and torch.equal(a.ssm, b.ssm), (n, snap)
    rows = (None, torch.randn(5, dims.conv_dim, generator=g), torch.rand(5, 4, generator=g))
    st = mamba2.Mamba2State.zeros(dims)
    assert cpu.mamba2_recur(*rows[1:], st.conv, w.conv_weight, None, w.A_log, w.D, st.ssm, dims, 4) is None


def test_dsa_projections_and_keys_keep_the_torch_bits(kernels, monkeypatch):
    """layers/dsa.py's project_rows_and_keys in one call (cpu.dsa_project: q_a, its norm, q_b, kv_a, its norm,
    then the indexer's wk with its LayerNorm and gate) gives the torch code's q, latent, qr, k and z bit for bit
    at 1 to MAX_ROWS rows, bf16 and mxfp4 weights; the call is taken; without an indexer it is project_rows."""
    from moesaic.layers import dsa
    from moesaic.weights.quant import from_suffix_dict, quantize_mxfp4

    g = torch.Generator().manual_seed(41)
    d, H, dn, kvr, qr, c = 96, 3, 32, 64, 64, 32
    makes = {
        "bf16": lambda *s: (torch.randn(*s, generator=g) * 0.2).bfloat16(),
        "mxfp4": lambda *s: from_suffix_dict(quantize_mxfp4(torch.randn(*s, generator=g) * 0.2)),
    }
    norm = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()  # noqa: E731
    for name, make in makes.items():
        w = mla.MlaWeights(
            kv_a=make(kvr, d), kv_a_norm=norm(kvr), kv_b=None, o=None, q=None,
            q_a=make(qr, d), q_a_norm=norm(qr), q_b=make(H * dn, qr),
        )  # fmt: skip
        ix = dsa.IndexerWeights(
            wq_b=None, wk=make(c, d), k_norm=norm(c), k_norm_bias=(0.1 * torch.randn(c, generator=g)).bfloat16(),
            weights_proj=None, ape=None, gate=make(c, d),
        )  # fmt: skip
        for n in (1, 3, cpu.MAX_ROWS):
            x = torch.randn(n, d, generator=g).bfloat16()
            got, want = fused_and_torch(
                monkeypatch, "dsa_project", dsa.project_rows_and_keys, x, w, ix, kvr, 1e-6
            )
            for a, b in zip([*got[:3], *got[3]], [*want[:3], *want[3]]):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, n)
        plain = dsa.project_rows_and_keys(x, w, None, kvr, 1e-6)
        assert plain[3] is None and torch.equal(plain[0], got[0])


def test_mla_project_keeps_the_torch_bits(kernels, monkeypatch):
    """layers/mla.py's mla_project in one call (cpu.mla_project: the two or three products as `linear` computes
    each, the q_a and kv_a norms as layers/norms.py's rms_norm) gives the torch code's q, latent and key slice
    bit for bit at 1 to MAX_ROWS rows: with and without q's low rank, bf16, mxfp4 and fp8 weights; the call is
    taken; fp32 norms or more rows keep the torch code."""
    from types import SimpleNamespace

    from moesaic.weights.quant import from_suffix_dict, quantize_fp8_block, quantize_mxfp4

    g = torch.Generator().manual_seed(29)
    d, H, dn, dr, kvr, qr = 96, 3, 32, 16, 64, 32
    c = SimpleNamespace(num_attention_heads=H, qk_head_dim=dn + dr, qk_nope_head_dim=dn, kv_lora_rank=kvr)
    makes = {
        "bf16": lambda *s: (torch.randn(*s, generator=g) * 0.2).bfloat16(),
        "mxfp4": lambda *s: from_suffix_dict(quantize_mxfp4(torch.randn(*s, generator=g) * 0.2)),
        "fp8": lambda *s: from_suffix_dict(quantize_fp8_block(torch.randn(*s, generator=g) * 0.2, (32, 32))),
    }
    norm = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).bfloat16()  # noqa: E731
    for name, make in makes.items():
        for low_rank in (True, False):
            w = mla.MlaWeights(
                kv_a=make(kvr + dr, d), kv_a_norm=norm(kvr), kv_b=None, o=None,
                q=None if low_rank else make(H * (dn + dr), d),
                q_a=make(qr, d) if low_rank else None, q_a_norm=norm(qr) if low_rank else None,
                q_b=make(H * (dn + dr), qr) if low_rank else None,
            )  # fmt: skip
            for n in (1, 3, cpu.MAX_ROWS):
                x = torch.randn(n, d, generator=g).bfloat16()
                got, want = fused_and_torch(monkeypatch, "mla_project", mla.mla_project, x, w, c)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and torch.equal(a, b), (name, low_rank, n)
    ops = [mla.operand(m) for m in (w.q, w.kv_a)]
    assert cpu.mla_project(x, ops, [w.kv_a_norm.float()], 1e-6, kvr) is None  # an fp32 norm
    more = torch.randn(cpu.MAX_ROWS + 1, d, generator=g).bfloat16()
    assert cpu.mla_project(more, ops, [w.kv_a_norm], 1e-6, kvr) is None


@pytest.mark.parametrize("variant", ["kimi_linear", "glm5_next", "kimi_k3"])
def test_kda_project_keeps_the_torch_bits(kernels, monkeypatch, variant):
    """layers/kda.py's kda_project in one call (cpu.kda_project: the eight products as `linear` computes each,
    the log-decay, beta) gives the torch code's qkv, g, beta and gate bit for bit at 1 to MAX_ROWS rows: the
    Kimi-Linear law, GLM-5.3's bounded one, K3's full-rank gate, bf16 and mxfp4 weights; the call is taken;
    more rows, or an fp32 weight, keep the torch code. The six products of x stacked by rows (stack_inputs:
    one call, where all six stack together) give the same bits."""
    from moesaic.weights.quant import from_suffix_dict, quantize_mxfp4

    g = torch.Generator().manual_seed(23)
    d, H, D = 64, 2, 32
    dims = kda.KdaDims.for_variant(variant, d, H, D)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.2).bfloat16()  # noqa: E731
    mx = lambda *s: from_suffix_dict(quantize_mxfp4(torch.randn(*s, generator=g) * 0.2))  # noqa: E731
    for make, b_make in ((bf, bf), (mx, bf), (mx, mx)):
        w = kda.KdaWeights(
            q_proj=make(H * D, d), k_proj=make(H * D, d), v_proj=make(H * D, d),
            conv=torch.randn(3 * H * D, 4, generator=g), f_a_proj=make(D, d), f_b_proj=make(H * D, D),
            dt_bias=torch.randn(H * D, generator=g), A_log=torch.rand(H, generator=g), b_proj=b_make(H, d),
            o_norm=torch.ones(D), o_proj=bf(d, H * D),
            g_a_proj=None if dims.full_rank_gate else make(D, d),
            g_b_proj=None if dims.full_rank_gate else make(H * D, D),
            g_proj=make(H * D, d) if dims.full_rank_gate else None,
        )  # fmt: skip
        stacked = kda.stack_inputs(w)
        assert (stacked.x_stack is not None) == (b_make is make)  # a dense b among packed ones: no stack
        for n in (1, 3, cpu.MAX_ROWS):
            x = torch.randn(n, d, generator=g).bfloat16()
            got, want = fused_and_torch(monkeypatch, "kda_project", kda.kda_project, x, w, dims)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (variant, make, n)
            got, _ = fused_and_torch(monkeypatch, "kda_project", kda.kda_project, x, stacked, dims)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b), (variant, make, n)
    x = torch.randn(cpu.MAX_ROWS + 1, d, generator=g).bfloat16()
    ops = [kda.operand(m) for m in (w.q_proj, w.k_proj, w.v_proj, w.f_a_proj, w.f_b_proj, w.b_proj)]
    assert cpu.kda_project(x, ops + [ops[0]], w.A_log, w.dt_bias, D, None) is None
    assert kda.operand(torch.randn(4, 4)) is None  # an fp32 weight: kda_project is not asked


@pytest.mark.parametrize("variant", ["kimi_linear", "glm5_next", "kimi_k3"])
def test_kda_row_keeps_the_phases_bits(kernels, variant):
    """layers/kda.py's kda_row (cpu.kda_block: kda_project, kda_recur and kda_output for one decode row in one
    call) gives the three phases' output, state and conv tail bit for bit: the three variants' laws and gates,
    bf16 and mxfp4 weights, stacked and not, from a fresh state and then from its own state for a few rows; it
    declines a second row, and an fp32 output weight."""
    from moesaic.weights.quant import from_suffix_dict, quantize_mxfp4

    g = torch.Generator().manual_seed(37)
    d, H, D, K = 64, 2, 32, 4
    dims = kda.KdaDims.for_variant(variant, d, H, D)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.2).bfloat16()  # noqa: E731
    mx = lambda *s: from_suffix_dict(quantize_mxfp4(torch.randn(*s, generator=g) * 0.2))  # noqa: E731
    for make in (bf, mx):
        w = kda.KdaWeights(
            q_proj=make(H * D, d), k_proj=make(H * D, d), v_proj=make(H * D, d),
            conv=torch.randn(3 * H * D, K, generator=g), f_a_proj=make(D, d), f_b_proj=make(H * D, D),
            dt_bias=torch.randn(H * D, generator=g), A_log=torch.rand(H, generator=g), b_proj=make(H, d),
            o_norm=1 + 0.1 * torch.randn(D, generator=g), o_proj=bf(d, H * D),
            g_a_proj=None if dims.full_rank_gate else make(D, d),
            g_b_proj=None if dims.full_rank_gate else make(H * D, D),
            g_proj=make(H * D, d) if dims.full_rank_gate else None,
        )  # fmt: skip
        for weights in (w, kda.stack_inputs(w)):
            state = ref = kda.KdaState.zeros(dims)
            for _ in range(3):
                x = torch.randn(1, d, generator=g).bfloat16()
                y, state = kda.kda_row(x, weights, dims, state)
                want, ref, _ = kda.KDA.run(x, weights, dims, ref)
                assert torch.equal(y, want) and y.dtype == want.dtype, (variant, make)
                assert torch.equal(state.recurrent, ref.recurrent) and torch.equal(state.conv, ref.conv)
            assert kda.kda_row(torch.randn(2, d, generator=g).bfloat16(), weights, dims, state) is None
    w32 = dataclasses.replace(w, o_proj=torch.randn(d, H * D, generator=g))
    assert kda.kda_row(torch.randn(1, d, generator=g).bfloat16(), w32, dims, state) is None


def _block_runs(monkeypatch, llm, prompts, sp, name: str) -> list:
    """llm.generate(prompts, sp) with the compiled block cpu.<name> and with it declined (the module's code):
    per run (tokens, every forward's logits, the rows of each call that reached the block, 0 where it declined)."""
    runs = []
    for fused in (True, False):
        logits, rows = [], []
        forward, real = llm.model.forward, getattr(cpu, name)

        def spy(x, *a, _real=real, _rows=rows, **k):
            y = _real(x, *a, **k)
            _rows.append(x.shape[0] if y is not None else 0)
            return y

        keep = lambda b, f=forward, out=logits: (y := f(b), out.append(y.clone()))[0]  # noqa: E731
        monkeypatch.setattr(llm.model, "forward", keep)
        monkeypatch.setattr(cpu, name, spy if fused else lambda *a: None)
        tokens = [r.token_ids for r in llm.generate(prompts, sp)]
        monkeypatch.undo()
        runs.append((tokens, logits, rows))
    return runs


@pytest.mark.parametrize("demo", ["demo-mistral4", "demo-kimi-linear"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_mla_block_keeps_the_engine_bits(kernels, monkeypatch, demo, chunk):
    """layers/mla.py's mla_block (cpu.mla_block: mla_project, the rotations, the new rows written to their pages,
    the absorbed attention over them and o's product in one call) gives the engine the logits of the module's
    code bit for bit, forward by forward, for two sequences of different lengths: decoding together (the call
    taken for every MLA layer of every decode step; the prompts together keep the code), and with prompts
    chunked to 4 rows a step (blocks of several rows over the pages written before them, as verify blocks)."""
    import moesaic

    kw = {} if chunk is None else {"max_num_batched_tokens": chunk, "enable_prefix_caching": False}
    llm = moesaic.LLM(demo, dtype="bfloat16", **kw)
    prompts = [list(range(5, 40)), list(range(50, 61))]
    sp = moesaic.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (tokens, got, rows), (want_tokens, want, _) = _block_runs(monkeypatch, llm, prompts, sp, "mla_block")
    mla_layers = sum(isinstance(getattr(w, "attn", None), mla.MlaWeights) for w in llm.model.layers)
    assert mla_layers and 0 not in rows  # every call that reached it was taken
    if chunk is None:
        assert rows == [2] * (mla_layers * (len(got) - 1))  # every decode step's MLA layers, both rows
    else:
        assert max(rows) > 1  # blocks of several rows
    assert tokens == want_tokens and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_mla_block_scales_queries_past_the_original_context(kernels, monkeypatch):
    """Mistral-4's llama-4 query scaling (positions past the original context: qscale [N, 1, 1]) inside the
    compiled block: the module code's logits bit for bit, the call taken for every decode step's layers (it
    had declined every step past the original context, 8192 tokens in the release); the scale is applied (the
    logits differ from those without it)."""
    import moesaic

    llm = moesaic.LLM("demo-mistral4", dtype="bfloat16", enable_prefix_caching=False)
    plain = llm.model.cfg
    llm.model.cfg = dataclasses.replace(plain, llama4_beta=0.5, llama4_original_max=16)
    prompts = [list(range(5, 40)), list(range(50, 61))]  # past 16 and 32 positions as they decode
    sp = moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (tokens, got, rows), (want_tokens, want, _) = _block_runs(monkeypatch, llm, prompts, sp, "mla_block")
    mla_layers = sum(isinstance(getattr(w, "attn", None), mla.MlaWeights) for w in llm.model.layers)
    assert rows == [2] * (mla_layers * (len(got) - 1))
    assert tokens == want_tokens and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    llm.model.cfg = plain
    (_, unscaled, _), _ = _block_runs(monkeypatch, llm, prompts, sp, "mla_block")
    assert not torch.equal(unscaled[-1], got[-1])


@pytest.mark.parametrize(
    "demo, prompts, chunk",
    [
        # index_topk 512: every decode step fused; then blocks of 4 rows over the pages
        ("demo-glm5-code", [list(range(5, 40)), list(range(50, 61))], None),
        ("demo-glm5-code", [list(range(5, 40)), list(range(50, 61))], 4),
        # index_topk 8: fused while the contexts hold fewer than 12 tokens
        ("demo-glm5-next-nvfp4", [[5, 6, 7], list(range(9, 16))], None),
    ],
)
def test_dsa_block_keeps_the_engine_bits(kernels, monkeypatch, demo, prompts, chunk):
    """layers/dsa.py's fused_block (cpu.dsa_block: the projections and indexer keys, the new rows written to their
    pages, the compact causal selection, the gathered attention over the pages and o's product in one call) gives
    the engine the logits of the module's code bit for bit, forward by forward, for two sequences of different
    lengths decoding together (the call taken for every DSA layer, full and shared, of every decode step while
    the contexts fit index_topk), with prompts chunked to 4 rows a step, and past index_topk (the call declined
    before the caches advance: the indexer's scores choose)."""
    import moesaic

    kw = {} if chunk is None else {"max_num_batched_tokens": chunk, "enable_prefix_caching": False}
    llm = moesaic.LLM(demo, dtype="bfloat16", **kw)
    sp = moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (tokens, got, rows), (want_tokens, want, _) = _block_runs(monkeypatch, llm, prompts, sp, "dsa_block")
    dsa_layers = sum(isinstance(w.mixer, glm5next.Dsa) for w in llm.model.layers)
    assert dsa_layers and 0 not in rows  # every call that reached it was taken
    if chunk is not None:
        assert max(rows) > 1  # blocks of several rows
    elif demo == "demo-glm5-code":
        assert rows == [2] * (dsa_layers * (len(got) - 1))  # every decode step's DSA layers, both rows
    else:
        assert 0 < len(rows) < dsa_layers * (len(got) - 1)  # until a context passes index_topk
    assert tokens == want_tokens and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk", [None, 4])
def test_v4_attention_keeps_the_engine_bits(kernels, monkeypatch, chunk):
    """layers/csa.py's fused_attention (cpu.v4_attention: DeepSeek-V4's attention inputs, the window's and the
    compressors' new rows written into their rings, the sink attention over the window and the entries, and the
    output's products in one call) gives the engine the logits of the model's code bit for bit, forward by
    forward, for two sequences decoding together: taken while a CSA layer's entries fit index_topk (3 in the demo:
    a context past 15 tokens declines there, before any state moves), a compressor that closes a window in the
    step (every 4 or 8 tokens here) pooling it by the code first; and for prompts chunked to 4 rows a step
    (blocks of several rows)."""
    import moesaic

    kw = {} if chunk is None else {"max_num_batched_tokens": chunk, "enable_prefix_caching": False}
    llm = moesaic.LLM("demo-deepseek-v4", dtype="bfloat16", **kw)
    prompts = [list(range(5, 10)), list(range(50, 59))]
    sp = moesaic.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (tokens, got, rows), (want_tokens, want, _) = _block_runs(monkeypatch, llm, prompts, sp, "v4_attention")
    layers = len(llm.model.layers)
    assert 0 not in rows and 0 < len(rows) < layers * len(got)  # taken where it applies, not everywhere
    assert max(rows) > 1  # more than one row: both sequences' decode rows, or a prompt's block
    assert tokens == want_tokens and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _keeps_the_engine_bits(monkeypatch, demo: str, name: str, took=lambda out: out is not None):
    """Runs `demo` on two sequences decoding together and their prompts with the fused call cpu.<name> and
    with it declined (the code): the same tokens and logits bit for bit, forward by forward, and every call
    taken (`took` of its result)."""
    import moesaic

    llm = moesaic.LLM(demo, dtype="bfloat16")
    prompts = [list(range(5, 14)), list(range(50, 56))]
    sp = moesaic.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    runs = []
    for fused in (True, False):
        logits, taken = [], []
        forward = llm.model.forward
        keep = lambda b, f=forward, out=logits: (y := f(b), out.append(y.clone()))[0]  # noqa: E731
        monkeypatch.setattr(llm.model, "forward", keep)
        real = getattr(cpu, name)

        def spy(*a, _real=real, _taken=taken):
            out = _real(*a)
            _taken.append(took(out))
            return out

        monkeypatch.setattr(cpu, name, spy if fused else lambda *a: None)
        tokens = [r.token_ids for r in llm.generate(prompts, sp)]
        monkeypatch.undo()
        runs.append((tokens, logits, taken))
    (tokens, got, taken), (want_tokens, want, _) = runs
    assert taken and all(taken)
    assert tokens == want_tokens and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("demo", ["demo-glm5-code", "demo-glm5-next-nvfp4"])
def test_dsa_projections_keep_the_engine_bits(kernels, monkeypatch, demo):
    """GLM-5.3's DSA layers take their input's products and norms (q_a, its norm, q_b, kv_a, its norm) in one
    call (layers/mla.project_rows -> cpu.mla_project, which also gives q_b's input for the indexer's queries):
    the engine's logits are those of the code bit for bit, bf16 and with NVFP4 weights; the call taken, with
    qr, for every DSA layer of every forward."""
    _keeps_the_engine_bits(monkeypatch, demo, "mla_project", lambda out: out is not None and len(out) == 4)


@pytest.mark.parametrize("fused_call", ["v4_inputs", "v4_output"])
@pytest.mark.parametrize("demo", ["demo-deepseek-v4", "demo-deepseek-v41"])
def test_v4_inputs_keep_the_engine_bits(kernels, monkeypatch, demo, fused_call):
    """DeepSeek-V4's (and V4.1's, without the head RMS) attention inputs after x's products in one call
    (cpu.v4_inputs: the two cast-once norms, q_b's product, the head RMS and the two rotations), and its
    attention output (cpu.v4_output: the inverse rotation, the grouped o_a product and o_b's) give the engine
    the logits of the code bit for bit, forward by forward, for two sequences decoding together and their
    prompts (each call taken for every attention layer of every forward of up to MAX_ROWS rows; on V4 with the
    layer's one call, cpu.v4_attention, declined)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "v4_attention", lambda *a: None)
        _keeps_the_engine_bits(monkeypatch, demo, fused_call)


def test_v4_output_rows_and_packed_o_b(kernels):
    """cpu.v4_output (layers/csa.fused_output) equals the code it replaces (the inverse rotation, then
    csa.grouped_out: each group's rows of o_a through `linear`, o_b's product) bit for bit at 1..MAX_ROWS rows,
    with o_b dense bf16 and packed (fp8 blocks, MXFP4); and declines what it cannot take: more rows, fp32
    o, a rotation wider than the head, o_a not dense bf16."""
    from moesaic.layers import csa
    from moesaic.weights.contract import pack

    g = torch.Generator().manual_seed(11)
    H, D, G, r, d, rd = 4, 64, 2, 64, 256, 32
    rope = csa.RopeTail(torch.rand(rd // 2, generator=g) * 0.5)
    w = lambda *s: (torch.randn(*s, generator=g) * 0.1).bfloat16()  # noqa: E731
    wo_a, wo_b = w(G * r, H * D // G), w(d, G * r)
    for o_b in (wo_b, pack(wo_b, "o_b", "fp8"), pack(wo_b, "o_b", "mxfp4")):
        for n in (1, 2, 5, cpu.MAX_ROWS):
            o, pos = w(n, H, D), torch.arange(40, 40 + n)
            got = csa.fused_output(o, wo_a, o_b, G, rope, pos)
            want = csa.grouped_out(rope(o, pos, inverse=True).reshape(n, -1), wo_a, o_b, G)
            assert got is not None and got.dtype == want.dtype and torch.equal(got, want), (type(o_b), n)
    pos = torch.arange(cpu.MAX_ROWS + 1)
    assert csa.fused_output(w(cpu.MAX_ROWS + 1, H, D), wo_a, wo_b, G, rope, pos) is None
    assert csa.fused_output(w(1, H, D).float(), wo_a, wo_b, G, rope, pos[:1]) is None
    assert csa.fused_output(w(1, H, D), wo_a.float(), wo_b, G, rope, pos[:1]) is None
    wide = csa.RopeTail(torch.rand(D, generator=g))  # rotates 2 D channels of a D-wide head
    assert csa.fused_output(w(1, H, D), wo_a, wo_b, G, wide, pos[:1]) is None


def test_mla_block_declines_what_it_cannot_take(kernels):
    """mla_plan keeps the module's code for fp32 norms, more rows than MAX_ROWS, or an operand it cannot run;
    mla_block for pages it cannot write or a rotation of another width, before the caches advance."""
    g = torch.Generator().manual_seed(3)
    d, H, dn, dv, kvr, dr = 64, 2, 16, 16, 32, 8
    w = lambda *s: (torch.randn(*s, generator=g) * 0.2).bfloat16()  # noqa: E731
    ops = [mla.operand(m) for m in (w(H * (dn + dr), d), w(kvr + dr, d), w(d, H * dv))]
    norm = w(kvr)
    w_uk, w_uv = w(H, dn, kvr), w(H, dv, kvr)
    pools = (w(4, 16, kvr), w(4, 16, dr))
    plan = cpu.mla_plan(ops, [norm], w_uk, w_uv, 1)
    assert plan is not None
    assert cpu.mla_plan(ops, [norm.float()], w_uk, w_uv, 1) is None
    assert cpu.mla_plan(ops, [norm], w_uk, w_uv, cpu.MAX_ROWS + 1) is None
    assert cpu.mla_plan([*ops[:2], None], [norm], w_uk, w_uv, 1) is None
    x, placed = w(1, d), []
    place = lambda: placed.append(1)  # noqa: E731
    assert cpu.mla_block(x, plan, (pools[0].float(), pools[1]), 1e-6, kvr, H, dn, None, 1.0, place) is None
    cos = torch.ones(1, dr // 2 + 1).bfloat16()  # a rotation of another width than the key's rope part
    assert cpu.mla_block(x, plan, pools, 1e-6, kvr, H, dn, (cos, cos, 0), 1.0, place) is None
    assert placed == []


def test_the_logits_checks_match_torch(kernels):
    """cpu.all_finite and cpu.argmax_rows (the engine's non_finite check and greedy draws on the CPU) against
    torch: isfinite().all() and argmax(-1) over rows of 1 to 100003 values, ties (the first of equal largest
    values, -0.0 equal to 0.0), NaN (the first NaN), +-inf; and None for what they do not take."""
    g = torch.Generator().manual_seed(23)
    for V in (1, 7, 8, 9, 32768, 100003):
        for case in range(7):
            x = torch.randn(3, V, generator=g)
            if case == 1:
                x[:] = 1.0  # all tied
            elif case == 2:
                x[1, V // 2] = float("nan")
            elif case == 3:
                x[0, -1], x[2, 0] = float("inf"), float("-inf")
            elif case == 4:
                x[1, V // 3], x[1, V // 4] = float("nan"), float("nan")
            elif case == 5:
                x[:] = -1.0
                x[:, V // 2 :] = 0.0
                x[:, V // 3] = -0.0  # the first zero, whatever its sign
            elif case == 6:
                x[2] = float("-inf")
            assert kernels.argmax_rows(x) == x.argmax(-1).tolist(), (V, case)
            assert kernels.all_finite(x) == bool(torch.isfinite(x).all()), (V, case)
    assert kernels.argmax_rows(torch.randn(2, 8).bfloat16()) is None
    assert kernels.argmax_rows(torch.randn(8, 2).t()) is None  # not contiguous
    assert kernels.all_finite(torch.randn(4).double()) is None


def test_native_bf16_gemm_by_cpu_features():
    """Prefill takes oneDNN's bf16 GEMM where it beats the fp32 tiles: AMX tiles, or an AMD CPU with
    avx512_bf16 (Zen 4); an Intel CPU with avx512_bf16 and no AMX, AVX2 alone, or no cpuinfo keep the tiles."""
    info = lambda vendor, flags: f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu {flags}\n"  # noqa: E731
    assert cpu._native_bf16_gemm(info("AuthenticAMD", "avx2 avx512f avx512_bf16"))
    assert cpu._native_bf16_gemm(info("GenuineIntel", "avx512f avx512_bf16 amx_bf16 amx_tile"))
    assert not cpu._native_bf16_gemm(info("GenuineIntel", "avx2 avx512f avx512_bf16"))
    assert not cpu._native_bf16_gemm(info("AuthenticAMD", "avx2 avx512f"))
    assert not cpu._native_bf16_gemm("")


def test_ring_rows_are_written_as_torch_writes_them(kernels, monkeypatch):
    """cpu.write_rows (TailRows.append's in-place writes) puts each field's rows where the slice assignment puts
    them, strided sources included, and writes nothing where a pair does not fit (a dtype to convert, a width,
    rows past the buffer): the caller's torch code then runs. A TailRows fed the same rows with the kernels on
    and off holds the same rows through compactions and a rollback."""
    from moesaic.cache.state import TailRows

    g = torch.Generator().manual_seed(5)
    bufs = [torch.zeros(12, 6).bfloat16(), torch.zeros(12, 10)]
    src = [torch.randn(3, 8, generator=g).bfloat16()[:, 1:7], torch.randn(3, 10, generator=g)]
    want = [b.clone() for b in bufs]
    for w, s in zip(want, src):
        w[4:7] = s
    assert kernels.write_rows(bufs, 4, src)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))
    for dsts, at, srcs in (
        ([bufs[0]], 0, [src[1][:, :6]]),  # fp32 rows into a bf16 buffer
        ([bufs[1]], 0, [src[0]]),  # a width that differs (and the dtype)
        ([bufs[1]], 10, [src[1]]),  # past the end
    ):
        before = [b.clone() for b in bufs]
        assert not kernels.write_rows(dsts, at, srcs)
        assert all(torch.equal(a, b) for a, b in zip(bufs, before))

    def feed(on: bool):
        monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1" if on else "0")
        ring, seen = TailRows({"kv": 4, "gate": 6}, torch.bfloat16, "cpu", keep=5, need=3), []
        r = torch.Generator().manual_seed(9)
        for n in (1, 2, 1, 1, 3, 1, 1, 1, 2, 1, 1, 1):
            rows = {
                "gate": torch.randn(n, 6, generator=r).bfloat16(),
                "kv": torch.randn(n, 4, generator=r).bfloat16(),
            }
            seen.append({k: v.clone() for k, v in ring.append(**rows).items()})
            if len(seen) == 7:
                ring.rollback(2)
        return seen

    on, off = feed(True), feed(False)
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(on, off))


@pytest.mark.parametrize("overlap", [False, True])
def test_compress_rows_equals_the_compressor_code(kernels, overlap):
    """cpu.compress_rows (compressor_update's pooling, entry norm and rotation where windows close, in one call)
    gives the code's bits (pool_windows, rms_norm_cast_once, RopeTail): one window and several, with and without
    a predecessor window (overlap: CSA), the rope's factor 1 and not, large and small activations; and declines
    fp32 rows."""
    from moesaic.layers import csa, norms

    g = torch.Generator().manual_seed(3)
    m, C, eps = 4, 24, 1e-6
    d = csa.CompressorDims(m, C, overlap)
    ape = torch.randn(m, d.proj_width, generator=g)
    norm = torch.rand(C, generator=g) + 0.5
    freqs = torch.rand(8, generator=g)  # 16 rotated channels of 24: 8 kept
    for W, has_prev, factor, E0, scale in [(1, False, 1.0, 0, 1), (2, True, 1.0, 5, 8), (3, False, 1.0, 0, 1),
                                           (4, True, 0.7, 9, 0.1), (2, False, 1.3, 0, 3)]:  # fmt: skip
        has_prev = has_prev and overlap
        kv = (torch.randn(W * m, d.proj_width, generator=g) * scale).bfloat16()
        gate = (torch.randn(W * m, d.proj_width, generator=g) * scale).bfloat16()
        latent, turned = kernels.compress_rows(
            kv, gate, ape, m, C, overlap, has_prev, norm, eps, freqs, factor, E0
        )
        want_latent = norms.rms_norm_cast_once(csa.pool_windows(kv, gate, ape, d, has_prev), norm, eps)
        want = csa.RopeTail(freqs, factor)(want_latent, torch.arange(E0, E0 + want_latent.shape[0]) * m)
        assert latent.shape == (W - 1 if has_prev else W, C)
        assert torch.equal(latent.view(torch.int16), want_latent.view(torch.int16)), (W, has_prev)
        assert torch.equal(turned.view(torch.int16), want.view(torch.int16)), (W, has_prev, factor)
    assert (
        kernels.compress_rows(kv.float(), gate.float(), ape, m, C, overlap, False, norm, eps, freqs, 1.0, 0)
        is None
    )


def _attention_paths(monkeypatch, f, *args):
    """f's result with cpu.causal_attention (asserted to be taken, once) and with the torch code."""
    taken = []
    monkeypatch.setattr(cpu, "causal_attention", _spy(cpu.causal_attention, taken))
    got = f(*args)
    assert taken == [True]
    monkeypatch.setattr(cpu, "causal_attention", lambda *a, **k: None)
    want = f(*args)
    monkeypatch.undo()
    return got, want


def _close_as_torch(got, want, exact, equal: float):
    """got as close to the fp32 result as the torch code is (its largest and its mean error within twice the
    torch code's, plus a bf16 step of the largest output), and equal to the torch code's bits in at least
    `equal` of the outputs."""
    err_got, err_want = (got.float() - exact).abs(), (want.float() - exact).abs()
    step = exact.abs().max() * 2**-8
    assert err_got.max() <= 2 * err_want.max() + step, (err_got.max().item(), err_want.max().item())
    assert err_got.mean() <= 2 * err_want.mean() + step / 64, (err_got.mean().item(), err_want.mean().item())
    assert (got == want).float().mean() >= equal


def _exact_attention(q, k, v, scale):  # fp32 causal attention: q [n, H, D], k [T, H, D], v [T, H, Dv]
    n, T = q.shape[0], k.shape[0]
    mask = torch.ones(n, T, dtype=torch.bool).tril(T - n)
    s = torch.einsum("nhd,thd->hnt", q.float(), k.float()) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hnt,thd->nhd", p, v.float())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_causal_attention_matches_the_gqa_code(kernels, monkeypatch, heads, kv_heads):
    """layers/attention.py's gqa_attend for prompts in one call (cpu.causal_attention, the bf16 logits and the
    normalized bf16 probabilities of the torch code, sums in another order): as close to the fp32 result as the
    torch code is, mostly its bits; one query over one key to 70 queries over 200 keys (the 64-key and 4-row
    passes' edges), value widths off the 32-value vectors, grouped heads; a decode row keeps the torch code."""
    from moesaic.layers import attention

    if not cpu.has_bf16dp():
        pytest.skip("no vdpbf16ps here: causal_attention declines")
    g = torch.Generator().manual_seed(5)
    for n, T, D, Dv in (
        (2, 2, 2, 16),
        (3, 9, 64, 40),
        (17, 64, 128, 128),
        (70, 70, 64, 64),
        (33, 200, 96, 72),
    ):
        q = (torch.randn(n, heads, D, generator=g) * 2).bfloat16()
        k = torch.randn(T, kv_heads, D, generator=g).bfloat16()
        v = torch.randn(T, kv_heads, Dv, generator=g).bfloat16()
        got, want = _attention_paths(monkeypatch, attention.gqa_attend, q, k, v, D**-0.5)
        assert got.shape == want.shape == (n, heads, Dv) and got.dtype == torch.bfloat16
        r = heads // kv_heads
        exact = _exact_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), D**-0.5)
        _close_as_torch(got, want, exact, 0.95)
    taken = []
    monkeypatch.setattr(cpu, "causal_attention", _spy(cpu.causal_attention, taken))
    attention.gqa_attend(q[-1:], k, v, D**-0.5)
    assert taken == []


def test_causal_attention_matches_mla_expanded(kernels, monkeypatch):
    """layers/mla.py's expanded attention (a prompt against its expanded latent) in one call: SDPA's math (fp32
    logits, probabilities unnormalized in bf16, the sum divided last), as close to the fp32 result as SDPA is;
    the rope part's key shared by every head (an expanded view); with and without a rope part, a cache longer
    than the prompt. Declines odd head dims, more queries than keys and fp32."""
    if not cpu.has_bf16dp():
        pytest.skip("no vdpbf16ps here: causal_attention declines")
    g = torch.Generator().manual_seed(6)
    H, dn, dv, kvr = 4, 32, 24, 48
    w_kv_b = (torch.randn(H * (dn + dv), kvr, generator=g) * 0.2).bfloat16()
    for n, T, dr in ((5, 5, 16), (66, 80, 16), (9, 30, 0)):
        q_nope = torch.randn(n, H, dn, generator=g).bfloat16()
        q_rope = torch.randn(n, H, dr, generator=g).bfloat16()
        latent = torch.randn(T, kvr, generator=g).bfloat16()
        k_rope = torch.randn(T, dr, generator=g).bfloat16()
        args = (q_nope, q_rope, latent, k_rope, w_kv_b, dv, 0.2)
        got, want = _attention_paths(monkeypatch, mla.expanded_attention, *args)
        assert got.shape == want.shape == (n, H, dv) and got.dtype == torch.bfloat16
        kv = (latent.float() @ w_kv_b.float().T).bfloat16().view(T, H, dn + dv)
        k = torch.cat([kv[..., :dn], k_rope[:, None, :].expand(T, H, dr)], -1)
        exact = _exact_attention(torch.cat([q_nope, q_rope], -1), k, kv[..., dn:], 0.2)
        _close_as_torch(got, want, exact, 0.5)
    q, kk, v = (
        torch.randn(4, 2, 8).bfloat16(),
        torch.randn(6, 2, 8).bfloat16(),
        torch.randn(6, 2, 8).bfloat16(),
    )
    assert cpu.causal_attention(q, kk, v, 1.0, round_scores=False, normalize_first=False) is not None
    assert (
        cpu.causal_attention(q[..., :7], kk[..., :7], v, 1.0, round_scores=False, normalize_first=False)
        is None
    )
    assert cpu.causal_attention(q, kk[:3], v[:3], 1.0, round_scores=False, normalize_first=False) is None
    assert (
        cpu.causal_attention(q.float(), kk.float(), v.float(), 1.0, round_scores=False, normalize_first=False)
        is None
    )

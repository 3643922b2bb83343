"""The optional compiled CPU kernels (moesaic/kernels/cpu.py) against the fp32 reference (dequantize in
fp32, then matmul): bf16, FP8 (block scales fp32 / UE8M0, per channel, per tensor), MXFP4 and NVFP4
(compressed-tensors and ModelOpt global scales), single and grouped; QuantizedTensor / ConcatRows
dispatch and fallback; thread-count selection; the quantized demos give the same tokens either way."""

import functools
import time

import pytest
import torch

import moesaic
from moesaic.kernels import cpu
from moesaic.weights.quant import (
    ConcatRows,
    QuantizedTensor,
    from_suffix_dict,
    quantize_fp8_block,
    quantize_fp8_tensor,
    quantize_mxfp4,
    quantize_nvfp4,
    stack,
)


@pytest.fixture(scope="module")
def kernel():
    if not cpu.enabled():
        pytest.skip("MOESAIC_CPU_KERNELS=0 in the environment")
    mod = cpu.load()
    if mod is None:
        pytest.skip(f"the CPU kernels could not be built here: {cpu._state['error']}")
    return mod


def _random_fp4(fmt, n, k, gen, divides=True, lead=()):
    """A QuantizedTensor with uniformly random codes (all 16, incl. -0) and random scale bytes."""
    group = 32 if fmt == "mxfp4" else 16
    codes = torch.randint(0, 256, lead + (n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    if fmt == "mxfp4":
        scale = torch.randint(112, 140, lead + (n, k // group), generator=gen, dtype=torch.int64).to(
            torch.uint8
        )
        scale[..., 0, 0] = 0  # 2^-127: a subnormal multiplier
        return QuantizedTensor("mxfp4", codes, scale)
    sb = torch.randint(0, 0x7F, lead + (n, k // group), generator=gen, dtype=torch.int64)  # no NaN byte
    sb = torch.where(torch.rand(sb.shape, generator=gen) < 0.5, sb, sb | 0x80)  # negative scales too
    scale = sb.to(torch.uint8).view(torch.float8_e4m3fn)
    g = torch.rand(lead if lead else (), generator=gen) * 3 + 0.1
    return QuantizedTensor("nvfp4", codes, scale, global_scale=g, global_divides=divides)


def _random_fp8(n, k, gen, block, e8m0, lead=()):
    """fp8_block (block given) or fp8_tensor (block None) with random codes: every byte but the two
    NaN codes, so subnormals, -0 and +-448 all occur; random scales."""
    codes = torch.randint(0, 255, lead + (n, k), generator=gen, dtype=torch.int64)
    codes = torch.where(codes == 0x7F, 0x7E, codes).to(torch.uint8).view(torch.float8_e4m3fn)  # 0xFF excluded
    if block is None:
        return QuantizedTensor("fp8_tensor", codes, torch.rand(lead, generator=gen) + 0.01)
    shape = lead + (-(-n // block[0]), -(-k // block[1]))
    if e8m0:
        scale = torch.randint(110, 135, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
        scale = scale.view(torch.float8_e8m0fnu)
    else:
        scale = torch.rand(shape, generator=gen) * 1e-2 + 1e-4
    return QuantizedTensor("fp8_block", codes, scale, block=block)


def _reference(qt, x):
    """fp32: dequantize the whole weight in fp32, then matmul."""
    w = qt.dequantize(torch.float32) if not isinstance(qt, torch.Tensor) else qt.float()
    return x.float() @ w.transpose(-1, -2)


def _assert_fp32_close(got, ref):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    scale = ref.abs().amax().clamp_min(1e-30)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=float(scale) * 2e-6)


def _assert_bf16_rounding(got, ref):
    """bf16 output: within one bf16 rounding of the fp32 reference."""
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref, rtol=2**-8, atol=float(ref.abs().amax()) * 1e-5)


def _raw(qt, x, **kw):
    """The raw kernel on qt's plain tensors (what QuantizedTensor._kernel passes)."""
    if isinstance(qt, torch.Tensor):
        return cpu.bf16_matmul(x, qt, **kw)
    if qt.format in ("mxfp4", "nvfp4"):
        group = 32 if qt.format == "mxfp4" else 16
        return cpu.fp4_matmul(x, qt.codes, qt.scale, group, qt.global_scale, qt.global_divides, **kw)
    if qt.format == "fp8_block":
        return cpu.fp8_matmul(x, qt.codes, qt.scale, qt.block, **kw)
    n, k = qt.shape[-2:]
    return cpu.fp8_matmul(x, qt.codes, qt.scale.reshape(*qt.scale.shape, 1, 1), (n, k), **kw)


# every format and scale layout: name -> (min K multiple, builder(n, k, gen))
FORMATS = {
    "mxfp4": (32, lambda n, k, g: _random_fp4("mxfp4", n, k, g)),
    "nvfp4-ct": (16, lambda n, k, g: _random_fp4("nvfp4", n, k, g, divides=True)),
    "nvfp4-modelopt": (16, lambda n, k, g: _random_fp4("nvfp4", n, k, g, divides=False)),
    "fp8-128x128-f32": (1, lambda n, k, g: _random_fp8(n, k, g, (128, 128), False)),
    "fp8-32x32-f32": (1, lambda n, k, g: _random_fp8(n, k, g, (32, 32), False)),
    "fp8-32x32-ue8m0": (1, lambda n, k, g: _random_fp8(n, k, g, (32, 32), True)),
    "fp8-128x128-ue8m0": (1, lambda n, k, g: _random_fp8(n, k, g, (128, 128), True)),
    "fp8-channel": (1, lambda n, k, g: _random_fp8(n, k, g, (1, k), False)),
    "fp8-tensor": (1, lambda n, k, g: _random_fp8(n, k, g, None, False)),
    "bf16": (1, lambda n, k, g: (torch.randn(n, k, generator=g) * 0.1).bfloat16()),
}
# K: tails inside a bf16 (32), fp8 (64) and E2M1 (128 values) load, below / at / above one
SHAPES = [(67, 96), (131, 48), (200, 256), (5, 32), (3, 97), (33, 200), (9, 1088)]
SHAPES += [(40, 1), (37, 31), (36, 33), (9, 112), (64, 144), (64, 2049), (5, 4096)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("generic", [False, True])
def test_raw_kernel_matches_fp32_reference(kernel, fmt, n, k, generic):
    multiple, make = FORMATS[fmt]
    if k % multiple:
        pytest.skip("K not a multiple of the group")
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = make(n, k, gen)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=gen)
        ref = _reference(w, x)
        xb = x.bfloat16()  # bf16 activations (exact in fp32): the vdpbf16ps paths on AVX-512 BF16 CPUs
        ref_b = _reference(w, xb)
        for threads in (1, 3) if m in (1, 5, 8, 16) else (1,):
            _assert_fp32_close(_raw(w, x, threads=threads, generic=generic), ref)
            _assert_fp32_close(_raw(w, xb, out=torch.empty(m, n), threads=threads, generic=generic), ref_b)
        if m in (1, 4, 11):  # bf16 out: one rounding of the output
            _assert_bf16_rounding(_raw(w, xb, generic=generic), ref_b)


@pytest.mark.parametrize("n,k", [(40, 1), (37, 31), (36, 33), (64, 2049)])
def test_grouped_bf16_activations_fp32_outputs(kernel, n, k):
    """A grouped bf16 stack against bf16 activations into fp32 outputs (an expert with no rows between two
    with rows; K tails below, at and above a 32-value load): each expert's rows are its reference's."""
    gen = torch.Generator().manual_seed(n + 7 * k)
    w = (torch.randn(3, n, k, generator=gen) * 0.1).bfloat16()
    x = torch.randn(13, k, generator=gen).bfloat16()
    offs = torch.tensor([5, 5, 13])  # expert 0: rows 0-4, expert 1: none, expert 2: rows 5-12
    got = cpu.bf16_matmul(x, w, offs=offs, out=torch.empty(13, n))
    _assert_fp32_close(got[:5], _reference(w[0], x[:5]))
    _assert_fp32_close(got[5:], _reference(w[2], x[5:]))


ENCODE = {  # real weights quantized (values in fp16 range, unlike random codes and scales)
    "bf16": lambda w: w.bfloat16(),
    "mxfp4": lambda w: from_suffix_dict(quantize_mxfp4(w)),
    "nvfp4-ct": lambda w: from_suffix_dict(quantize_nvfp4(w)),
    "fp8-32x32-ue8m0": lambda w: from_suffix_dict(quantize_fp8_block(w, (32, 32), "ue8m0")),
}


@pytest.mark.parametrize("fmt", list(ENCODE))
def test_fp16_activations(kernel, fmt):
    """fp16 x (exact in fp32) -> fp16 output: one fp16 rounding of the fp32 reference."""
    gen = torch.Generator().manual_seed(9)
    w = ENCODE[fmt](torch.randn(45, 160, generator=gen) * 0.1)
    x = torch.randn(3, 160, generator=gen).half()
    y, ref = _raw(w, x), _reference(w, x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref, rtol=2**-10, atol=float(ref.abs().amax()) * 1e-5)


def test_scale_edge_values(kernel):
    """E8M0 0 (2^-127), E4M3 scale subnormals: the kernel's multipliers are the reference's."""
    gen = torch.Generator().manual_seed(11)
    qt = _random_fp4("mxfp4", 20, 128, gen)
    qt.scale[1, :] = 150
    qt.scale[2, :] = 0
    x = torch.randn(3, 128, generator=gen)
    y, ref = _raw(qt, x), _reference(qt, x)
    _assert_fp32_close(y[:, [0, 1, 3, 19]], ref[:, [0, 1, 3, 19]])
    _assert_fp32_close(y[:, 2:3] * 2.0**127, ref[:, 2:3] * 2.0**127)  # rows whose values are ~1e-38
    nv = _random_fp4("nvfp4", 20, 64, gen)
    nv.scale.view(torch.uint8)[3, :] = torch.arange(1, 5, dtype=torch.uint8)  # E4M3 subnormal scales
    _assert_fp32_close(_raw(nv, x[:, :64]), _reference(nv, x[:, :64]))


@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_outside_the_scaled_decode(kernel, e8m0):
    """The AVX2 fp8 tiles read x times 2^64 and scales times 2^56 (codes as fp32 times 2^-120): an x of 2^63 or
    more, or a scale of 2^72 or more, takes the portable loops instead, with the reference's results."""
    gen = torch.Generator().manual_seed(5)
    qt = _random_fp8(40, 192, gen, (32, 32), e8m0)
    x = torch.randn(3, 192, generator=gen)
    x[1, 7] = 2.0**70
    _assert_fp32_close(_raw(qt, x), _reference(qt, x))
    x[1, 7] = 1.0
    if e8m0:
        qt.scale.view(torch.uint8)[1, 2] = 127 + 90
    else:
        qt.scale[1, 2] = 2.0**90
    _assert_fp32_close(_raw(qt, x), _reference(qt, x))


def test_fp8_subnormal_codes(kernel):
    """E4M3 subnormals decode to fp32 subnormals on the AVX2 tiles: exact, and with subnormals read as zero
    (torch.set_flush_denormal) the call takes the portable loops."""
    gen = torch.Generator().manual_seed(6)
    qt = _random_fp8(24, 256, gen, (128, 128), False)
    codes = torch.randint(1, 8, (24, 256), generator=gen, dtype=torch.int64)  # every code subnormal
    codes = torch.where(torch.rand(24, 256, generator=gen) < 0.5, codes, codes | 0x80)
    qt.codes.view(torch.uint8).copy_(codes.to(torch.uint8))
    x = torch.randn(2, 256, generator=gen)
    ref = _reference(qt, x)
    _assert_fp32_close(_raw(qt, x), ref)
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-denormal mode on this CPU")
    try:
        got = _raw(qt, x)
    finally:
        torch.set_flush_denormal(False)
    _assert_fp32_close(got, ref)


def test_nan_scale_propagates(kernel):
    gen = torch.Generator().manual_seed(1)
    qt = _random_fp4("mxfp4", 70, 64, gen)
    qt.scale[5, 1] = 255  # E8M0 NaN
    x = torch.randn(2, 64, generator=gen)
    y = qt.matmul(x)
    ref = _reference(qt, x)
    assert torch.isnan(y[:, 5]).all() and torch.isnan(ref[:, 5]).all()
    assert not torch.isnan(y[:, [0, 4, 6, 69]]).any()
    torch.testing.assert_close(
        y, ref, rtol=1e-5, atol=1e-5 * float(ref.nan_to_num().abs().amax()), equal_nan=True
    )
    f8 = _random_fp8(70, 96, gen, (32, 32), True)
    f8.scale[1, 2] = 255  # rows 32..63, columns 64..95
    y = f8.matmul(x.repeat(1, 2)[:, :96])
    assert torch.isnan(y[:, 32:64]).all() and not torch.isnan(y[:, :32]).any()


@pytest.mark.parametrize(
    "naming", ["mxfp4", "nvfp4-compressed-tensors", "nvfp4-modelopt", "fp8", "fp8-tensor"]
)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_dispatches_to_kernel(kernel, naming, m, dtype):
    gen = torch.Generator().manual_seed(m)
    n, k = 150, 160
    w = torch.randn(n, k, generator=gen) * 0.05
    if naming == "mxfp4":
        qt = from_suffix_dict(quantize_mxfp4(w))
    elif naming == "fp8":
        qt = from_suffix_dict(quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek"))
    elif naming == "fp8-tensor":
        qt = from_suffix_dict(quantize_fp8_tensor(w))
    else:
        qt = from_suffix_dict(quantize_nvfp4(w, naming=naming.split("-", 1)[1]))
        assert qt.global_divides == (naming == "nvfp4-compressed-tensors")
    x = torch.randn(2, m, k, generator=gen).to(dtype)  # leading batch dims flatten to 2*m rows
    before = dict(cpu.stats)
    y = qt.matmul(x)
    assert cpu.stats["kernel_calls"] == before["kernel_calls"] + 1
    assert y.dtype == dtype and y.shape == (2, m, n)
    ref = _reference(qt, x)
    if dtype == torch.float32:
        _assert_fp32_close(y, ref)
    else:  # one rounding of the fp32 result to bf16
        _assert_bf16_rounding(y, ref)
        # and exactly the rounding of the fp32 kernel result
        y32 = _raw(qt, x.reshape(-1, k), out=torch.empty(2 * m, n))
        assert torch.equal(y.reshape(-1, n), y32.to(dtype))


@pytest.mark.parametrize("fmt,divides", [("mxfp4", True), ("nvfp4", True), ("nvfp4", False)])
def test_stacked_experts(kernel, fmt, divides):
    gen = torch.Generator().manual_seed(7)
    e, n, k, m = 3, 90, 128, 4
    qt = _random_fp4(fmt, n, k, gen, divides, lead=(e,))
    x = torch.randn(e, m, k, generator=gen)
    before = cpu.stats["kernel_calls"]
    y = qt.matmul(x)  # one kernel call per expert
    assert cpu.stats["kernel_calls"] == before + e
    for i in range(e):
        ref = _reference(qt[i], x[i])
        _assert_fp32_close(y[i], ref)
        _assert_fp32_close(qt[i].matmul(x[i]), ref)  # the expert view


def test_bias_and_strided_output(kernel):
    """bf16 weights with a bias, written into a column slice of a wider output (ConcatRows' use)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(70, 99, generator=gen).bfloat16()
    bias = torch.randn(70, generator=gen)
    x = torch.randn(5, 99, generator=gen)
    wide = torch.full((5, 100), 7.0)
    y = cpu.bf16_matmul(x, w, bias, out=wide[:, 20:90])
    assert y.data_ptr() == wide[:, 20:90].data_ptr()
    _assert_fp32_close(wide[:, 20:90], _reference(w, x) + bias)
    assert (wide[:, :20] == 7).all() and (wide[:, 90:] == 7).all()


# ------------------------------------------------------------------------ AMX


@pytest.fixture
def amx(kernel):
    if not cpu.has_amx():
        pytest.skip("no AMX tiles on this CPU (or the kernels were not built for them)")


@pytest.mark.parametrize("n,k", [(64, 1024), (96, 64), (37, 31), (40, 1), (160, 33), (33, 2049), (512, 256)])
def test_amx_bf16_rows_invariant(amx, monkeypatch, n, k):
    """bf16 x bf16 by AMX tiles (row counts that split into 32 sections and ones that do not; K tails inside
    a 32-value step): the fp32 reference to rounding, and every output the same bits whatever else is in the
    call (that row alone, any M up to AMX_ROWS, other experts in a grouped call, 1 or 3 threads; `linear`
    serves AMX_ROWS rows); the vdpbf16ps path (MOESAIC_CPU_AMX=0, 16 rows) agrees to rounding."""
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    t = cpu.AMX_ROWS
    x = torch.randn(t, k, generator=gen).bfloat16()
    alone = torch.cat([cpu.bf16_matmul(x[i : i + 1], w, out=torch.empty(1, n), threads=1) for i in range(t)])
    _assert_fp32_close(alone, _reference(w, x))
    for m in (2, 5, 8, 16, 17, 31, 32, 33, 50, 64):  # one or two B tiles a pass, one or two passes
        for threads in (1, 3) if m in (5, 33) else (1,):
            got = cpu.bf16_matmul(x[:m], w, out=torch.empty(m, n), threads=threads)
            assert torch.equal(got, alone[:m]), (m, threads)
    stack = torch.stack([w, w.flip(0), w])
    grouped = cpu.bf16_matmul(x[:40], stack, offs=torch.tensor([3, 3, 40]), out=torch.empty(40, n))
    assert torch.equal(grouped, alone[:40])
    assert cpu.dense_rows() == t and torch.equal(cpu.linear(x, w), alone.bfloat16())
    bias = torch.randn(n, generator=gen).bfloat16()
    _assert_bf16_rounding(cpu.linear(x[:20], w, bias), _reference(w, x[:20]) + bias.float())
    monkeypatch.setenv("MOESAIC_CPU_AMX", "0")
    assert cpu.dense_rows() == cpu.DP_ROWS  # (an AMX CPU has vdpbf16ps)
    _assert_fp32_close(cpu.bf16_matmul(x[:16], w, out=torch.empty(16, n)), alone[:16])


@pytest.mark.parametrize(
    "fmt", [f for f in FORMATS if f != "bf16"] + [f"real-{f}" for f in ENCODE if f != "bf16"]
)
@pytest.mark.parametrize("n,k", [(67, 96), (200, 256), (64, 2049), (600, 512), (37, 4096)])
def test_amx_packed(amx, fmt, n, k):
    """Packed weights against 8 or more bf16 rows by AMX tiles (decoded to bf16 a block of rows at a time;
    fp32 block scales applied to each k-block's sums, nvfp4's global scale to the sums), within and above
    MAX_ROWS: the fp32 reference to rounding, in fp32 and bf16 outputs, and QuantizedTensor.matmul takes the
    kernel above MAX_ROWS. Random mxfp4 scales include 2^-127, which no bf16 product holds exactly: that call
    takes the vdpbf16ps path."""
    gen = torch.Generator().manual_seed(n + k)
    if fmt.startswith("real-"):  # quantized by moesaic's encoders: scales in range, the AMX path
        if k % 32:
            pytest.skip("K not a multiple of the group")
        w = ENCODE[fmt[5:]]((torch.randn(n, k, generator=gen) * 0.05).bfloat16())
    else:
        multiple, make = FORMATS[fmt]
        if k % multiple:
            pytest.skip("K not a multiple of the group")
        w = make(n, k, gen)
    for m in (8, 16, 17, 33, 100):
        x = torch.randn(m, k, generator=gen).bfloat16()
        ref = _reference(w, x)
        _assert_fp32_close(_raw(w, x, out=torch.empty(m, n)), ref)
        _assert_bf16_rounding(_raw(w, x), ref)
    assert cpu.packed_rows(x) > m
    before = cpu.stats["kernel_calls"]
    _assert_bf16_rounding(w.matmul(x), ref)
    assert cpu.stats["kernel_calls"] == before + 1


# x rows from which fp32-scaled E4M3 rows take the pair tiles on the vdpbf16ps path (cpu_src's PAIR_ROWS)
PAIR_ROWS = 20


def _rows_alone(w, x):
    """w times each row of x in a call of its own (one row: the decode tiles' bits)."""
    return torch.cat([w.matmul(x[i : i + 1]) for i in range(x.shape[0])])


def _order_sensitive_rows(n: int, k: int, gen) -> torch.Tensor:
    """n bf16 rows whose sums depend on their order: small values with +-2^20 at columns 0 and 32, which cancel
    in one lane's running sum and each absorb other small values where they fall in two lanes."""
    x = torch.randn(n, k, generator=gen) * 2**-10
    x[:, 0], x[:, 32] = 2**20, -(2**20)
    return x.bfloat16()


# formats whose prompt rows (more than MAX_ROWS) take the weights decoded to exact bf16 on the vdpbf16ps path
DECODED = ("mxfp4", "nvfp4-ct", "nvfp4-modelopt", "fp8-32x32-ue8m0", "fp8-128x128-ue8m0")


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
def test_packed_bf16_rows_by_vdpbf16ps(kernel, monkeypatch, fmt):
    """Packed weights against more than MAX_ROWS bf16 rows on the vdpbf16ps path (AMX off): QuantizedTensor's
    matmul and grouped_matmul take the kernels at any number of rows, in one call, the fp32 reference to bf16
    rounding: E2M1 and E8M0-scaled E4M3 by their weights decoded to exact bf16 (the bf16 kernel's bits on them),
    fp32-scaled E4M3 from PAIR_ROWS rows by the pair tiles (each output the bits it has at any M from there); up to
    MAX_ROWS rows the decode bits."""
    monkeypatch.setenv("MOESAIC_CPU_AMX", "0")
    if not cpu.has_bf16dp():
        pytest.skip("no vdpbf16ps path on this CPU")
    multiple, make = FORMATS[fmt]
    gen = torch.Generator().manual_seed(17)
    k = 8 * max(multiple, 16)
    w = make(48, k, gen)
    x = torch.randn(40, k, generator=gen).bfloat16()
    assert cpu.packed_rows(x) == cpu.PACKED_DP_ROWS
    alone = _rows_alone(w, x)
    before = cpu.stats["kernel_calls"]
    got = w.matmul(x)
    assert cpu.stats["kernel_calls"] == before + 1
    _assert_bf16_rounding(alone, _reference(w, x))
    _assert_bf16_rounding(got, _reference(w, x))
    assert torch.equal(w.matmul(x[: cpu.MAX_ROWS]), alone[: cpu.MAX_ROWS])  # decode batches: the decode bits
    # 47 weight rows (a last tile of 3), a K tail inside a load and 37 x rows (a last tile of 1): the edges of the
    # prompt and pair tiles
    k2 = k + (3 * multiple if multiple > 1 else 72)
    w2, x2 = make(47, k2, gen), torch.randn(37, k2, generator=gen).bfloat16()
    got2 = w2.matmul(x2)
    _assert_bf16_rounding(got2, _reference(w2, x2))
    if fmt in DECODED:
        # more than MAX_ROWS rows: the weights decoded to exact bf16 once and the bf16 prompt tiles, each row the
        # bits of its bf16 product with them whatever M (the bf16 kernel's, where no global scale goes on the sums)
        more = cpu.MAX_ROWS + 1
        assert torch.equal(got[:more], w.matmul(x[:more])) and torch.equal(got2[:more], w2.matmul(x2[:more]))
        if getattr(w, "global_scale", None) is None:
            assert torch.equal(got, cpu.bf16_matmul(x, w.dequantize(torch.bfloat16)))
            assert torch.equal(got2, cpu.bf16_matmul(x2, w2.dequantize(torch.bfloat16)))
    else:  # fp32-scaled E4M3: from PAIR_ROWS rows the pair tiles, each row the bits it has at any M from there
        assert torch.equal(got[:PAIR_ROWS], w.matmul(x[:PAIR_ROWS]))
        assert torch.equal(got2[:PAIR_ROWS], w2.matmul(x2[:PAIR_ROWS]))
        assert torch.equal(w.matmul(x[: PAIR_ROWS - 1]), alone[: PAIR_ROWS - 1])  # below: the decode tiles
        alone2 = _rows_alone(w2, x2[: PAIR_ROWS - 1])
        assert torch.equal(w2.matmul(x2[: PAIR_ROWS - 1]), alone2)
    if fmt in STACKS:  # one grouped call for experts of 17 and 23 rows
        stack = STACKS[fmt](2, 48, k, gen)
        offs = torch.tensor([17, 40], dtype=torch.int32)
        before = cpu.stats["kernel_calls"]
        got = stack.grouped_matmul(x, offs)
        assert cpu.stats["kernel_calls"] == before + 1
        assert torch.equal(got[:17], stack[0].matmul(x[:17]))
        assert torch.equal(got[17:], stack[1].matmul(x[17:]))
    # a prompt of any length: one call (no fp32 fallback), each row the bits it has at fewer rows
    many = torch.randn(300, k, generator=gen).bfloat16()
    before = cpu.stats["kernel_calls"], cpu.stats["fallback_calls"]
    got = w.matmul(many)
    assert (cpu.stats["kernel_calls"], cpu.stats["fallback_calls"]) == (before[0] + 1, before[1])
    assert torch.equal(got[:PAIR_ROWS], w.matmul(many[:PAIR_ROWS]))
    _assert_bf16_rounding(got, _reference(w, many))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4-ct", "fp8-32x32-ue8m0"])
def test_packed_prompt_rows_decoded_to_bf16(kernel, monkeypatch, fmt):
    """On the vdpbf16ps path (AMX off) E2M1 or E8M0-scaled E4M3 rows against more than MAX_ROWS prompt rows are
    decoded to exact bf16 once and multiplied by the bf16 prompt tiles: the bf16 kernel's bits on the dequantized
    weights (nvfp4: its global scale on the sums), not a decode row's; a scale byte that does not fold exactly
    (E8M0 0: 2^-127) keeps the packed tiles and a decode row's bits. x rows whose sums depend on their order (two
    values of +-2^20, 32 apart: one lane of the bf16 tiles, two of the packed tiles' decoded order, so each
    absorbs other small values) tell the two apart."""
    monkeypatch.setenv("MOESAIC_CPU_AMX", "0")
    if not cpu.has_bf16dp():
        pytest.skip("no vdpbf16ps path on this CPU")
    gen = torch.Generator().manual_seed(23)
    w = ENCODE[fmt](torch.ones(8, 1024))
    x = _order_sensitive_rows(cpu.MAX_ROWS + 8, 1024, gen)
    got = w.matmul(x)
    alone = _rows_alone(w, x)
    assert (got != alone).float().mean() > 0.5  # the bf16 tiles, not the packed ones
    assert torch.equal(w.matmul(x[: cpu.MAX_ROWS]), alone[: cpu.MAX_ROWS])  # decode batches: the packed tiles
    assert torch.equal(got[: cpu.MAX_ROWS + 1], w.matmul(x[: cpu.MAX_ROWS + 1]))  # whatever M
    if w.global_scale is None:
        assert torch.equal(got, cpu.bf16_matmul(x, w.dequantize(torch.float32).bfloat16()))
    if fmt == "mxfp4":
        w.scale[0, 0] = 0
        assert torch.equal(w.matmul(x), _rows_alone(w, x))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4-ct", "fp8-32x32-ue8m0"])
def test_wide_packed_prompt_rows_by_pair_tiles(kernel, monkeypatch, fmt):
    """Past PAIR_WIDE_K columns, E2M1 and E8M0-scaled E4M3 rows against more than MAX_ROWS prompt rows take the
    pair tiles on their weights decoded to exact bf16 (the scales folded; nvfp4's global scale on the sums): each
    row the bits it has at any M from MAX_ROWS + 1, neither a decode row's nor the prompt tiles' (which sum lanes
    along K: the +-2^20 pair 32 apart falls in one lane's running sum here, in separate lanes there), within one
    bf16 rounding of the fp32 reference."""
    monkeypatch.setenv("MOESAIC_CPU_AMX", "0")
    if not cpu.has_bf16dp():
        pytest.skip("no vdpbf16ps path on this CPU")
    gen = torch.Generator().manual_seed(31)
    k = 2560  # past PAIR_WIDE_K (2048)
    w = ENCODE[fmt](torch.ones(8, k))
    x = _order_sensitive_rows(cpu.MAX_ROWS + 8, k, gen)
    got = w.matmul(x)
    alone = _rows_alone(w, x)
    assert (got != alone).float().mean() > 0.5  # not the decode tiles
    assert torch.equal(got[: cpu.MAX_ROWS + 1], w.matmul(x[: cpu.MAX_ROWS + 1]))  # whatever M
    assert torch.equal(w.matmul(x[: cpu.MAX_ROWS]), alone[: cpu.MAX_ROWS])  # decode batches: the decode tiles
    if w.global_scale is None:  # not the prompt tiles on the dequantized weights
        tiles = cpu.bf16_matmul(x, w.dequantize(torch.float32).bfloat16())
        assert (got != tiles).float().mean() > 0.5
    wr = ENCODE[fmt](torch.randn(40, k, generator=gen) * 0.1)
    xr = torch.randn(cpu.MAX_ROWS + 8, k, generator=gen).bfloat16()
    _assert_bf16_rounding(wr.matmul(xr), _reference(wr, xr))


def test_fp8_prompt_rows_by_pair_tiles(kernel, monkeypatch):
    """On the vdpbf16ps path (AMX off) E4M3 rows with fp32 block scales against PAIR_ROWS or more prompt rows take
    the pair tiles (a weight pair broadcast against 16 x rows' pairs: each lane one output summed along K, a
    k-block's sums times its scale), and so do E8M0-scaled rows whose scale does not fold: each row the bits it
    has at any M from PAIR_ROWS, not a decode row's, within one rounding of the fp32 reference. x rows whose sums
    depend on their order (_order_sensitive_rows: one lane's running sum here, two lanes of the decode tiles)
    tell the two apart."""
    monkeypatch.setenv("MOESAIC_CPU_AMX", "0")
    if not cpu.has_bf16dp():
        pytest.skip("no vdpbf16ps path on this CPU")
    gen = torch.Generator().manual_seed(29)
    dense = torch.ones(128, 1024)
    x = _order_sensitive_rows(PAIR_ROWS + 13, 1024, gen)
    w8 = from_suffix_dict(quantize_fp8_block(dense, (128, 128), "ue8m0"))
    w8.scale[0, 7] = 0  # 2^-127 (the last k-block): does not fold into bf16 exponents
    for w in (from_suffix_dict(quantize_fp8_block(dense, (128, 128))), w8):
        got = w.matmul(x)
        alone = _rows_alone(w, x)
        assert (got != alone).float().mean() > 0.5  # the pair tiles, not the decode tiles
        assert torch.equal(got[:PAIR_ROWS], w.matmul(x[:PAIR_ROWS]))  # whatever M from PAIR_ROWS
        assert torch.equal(_raw(w, x, threads=3), got)  # x packed once, shared by the threads' items
        assert torch.equal(w.matmul(x[: PAIR_ROWS - 1]), alone[: PAIR_ROWS - 1])  # below: the decode tiles
        xr = torch.randn(PAIR_ROWS + 13, 1024, generator=gen).bfloat16()  # sums without cancellation
        _assert_bf16_rounding(w.matmul(xr), _reference(w, xr))


# ------------------------------------------------------------------------ dense entry points


@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_linear_bf16(kernel, m):
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(130, 200, generator=gen).bfloat16()
    b = torch.randn(130, generator=gen).bfloat16()
    x = torch.randn(m, 200, generator=gen).bfloat16()
    before = cpu.stats["kernel_calls"]
    y = cpu.linear(x, w, b)
    assert cpu.stats["kernel_calls"] == before + 1
    _assert_bf16_rounding(y, _reference(w, x) + b.float())
    # fp32 activations compute like layers/linear.py: x cast to bf16, the result cast back
    xf = torch.randn(m, 200, generator=gen)
    yf = cpu.linear(xf, w)
    assert yf.dtype == torch.float32
    assert torch.equal(yf, cpu.linear(xf.bfloat16(), w).float())
    # beyond the rows the kernels serve (dense_rows()) and for fp32 weights: F.linear itself
    big = torch.randn(cpu.dense_rows() + 1, 200, generator=gen).bfloat16()
    assert torch.equal(cpu.linear(big, w), torch.nn.functional.linear(big, w))
    w32 = w.float()
    assert torch.equal(cpu.linear(xf, w32), torch.nn.functional.linear(xf, w32))


def test_linear_bf16_rows_alike_up_to_dense_rows(kernel):
    """`linear` takes the kernel up to dense_rows() rows of x (64 by AMX tiles, 256 by vdpbf16ps, else 16), in
    one call, and there each output has the bits it has alone, so a prompt's products of up to that many rows
    equal its decode rows'."""
    amx = cpu.has_amx() and cpu.amx_enabled()
    assert cpu.dense_rows() == (cpu.AMX_ROWS if amx else cpu.DP_ROWS if cpu.has_bf16dp() else cpu.MAX_ROWS)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(130, 1000, generator=gen) * 0.1).bfloat16()
    x = torch.randn(cpu.dense_rows(), 1000, generator=gen).bfloat16()
    alone = torch.cat([cpu.linear(x[i : i + 1], w) for i in range(x.shape[0])])
    before = cpu.stats["kernel_calls"]
    assert torch.equal(cpu.linear(x, w), alone)
    assert cpu.stats["kernel_calls"] == before + 1
    _assert_bf16_rounding(alone, _reference(w, x))


@pytest.mark.parametrize("n,k", [(37, 1000), (13, 31), (5, 33), (6, 2049), (1, 64)])
def test_bf16_prompt_tiles_rows_alike(kernel, n, k):
    """bf16 x bf16 at prompt sizes (20+ rows of x a matrix: 6 x 4 tiles whose sums are reduced 16 at a time,
    on AVX-512 BF16 CPUs): every output the bits it has alone (one row takes the decode tiles) whatever M,
    the weight rows' tail (n not a multiple of 6), the K tail, the x blocks (K = 2049: 44 rows a block), the
    other experts of a grouped call and the threads; the fp32 reference to rounding; bias and bf16 output."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    x = torch.randn(130, k, generator=gen).bfloat16()
    alone = torch.cat(
        [cpu.bf16_matmul(x[i : i + 1], w, out=torch.empty(1, n), threads=1) for i in range(130)]
    )
    _assert_fp32_close(alone, _reference(w, x))
    for m in (19, 20, 23, 64, 97, 130):
        for threads in (1, 3) if m == 97 else (1,):
            got = cpu.bf16_matmul(x[:m], w, out=torch.empty(m, n), threads=threads)
            assert torch.equal(got, alone[:m]), (m, threads)
    stack = torch.stack([w.flip(0), w, w])
    grouped = cpu.bf16_matmul(x[:90], stack, offs=torch.tensor([5, 30, 90]), out=torch.empty(90, n))
    assert torch.equal(grouped[5:], alone[5:90])
    bias = torch.randn(n, generator=gen).bfloat16()
    _assert_bf16_rounding(cpu.bf16_matmul(x[:40], w, bias), _reference(w, x[:40]) + bias.float())
    # `linear` gives the kernel up to dense_rows(K) rows: fewer past DP_WIDE_K columns, then F.linear
    if cpu.has_bf16dp() and not (cpu.has_amx() and cpu.amx_enabled()):
        assert cpu.dense_rows(k) == (cpu.DP_ROWS if k <= cpu.DP_WIDE_K else cpu.DP_WIDE_ROWS)
        rows = cpu.dense_rows(k)
        xs = torch.randn(rows + 1, k, generator=gen).bfloat16()
        assert torch.equal(cpu.linear(xs[:rows], w), cpu.bf16_matmul(xs[:rows], w))
        assert torch.equal(cpu.linear(xs, w), torch.nn.functional.linear(xs, w))


# ------------------------------------------------------------------------ grouped


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_sum_alike_at_any_count(kernel, fmt, dtype):
    """Each output is the same sum at 1 to 16 rows of x where x fits in 256 KB (the weight rows streamed whole,
    not in blocks of K), and at 1 to 4 rows of a longer x, bit for bit, with int8 activations too for E2M1:
    fp32 x (the AVX2 tiles, VNNI's with int8 activations) and bf16 x (vdpbf16ps and VNNI where the CPU has
    them; up to 7 rows, below the AMX tiles' 8)."""
    multiple, make = FORMATS[fmt]
    gen = torch.Generator().manual_seed(31)
    for k, most in ((4096 - 3 * multiple if multiple > 1 else 4093, 16), (8192 + 3 * max(multiple, 2), 4)):
        most = most if dtype == torch.float32 else min(most, 7)
        w = make(40, k, gen)
        x = torch.randn(most, k, generator=gen).to(dtype)
        for int8 in ("0", "1") if fmt.startswith(("mx", "nv")) else ("0",):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", int8)
                every = _raw(w, x, threads=2, out=torch.empty(most, 40))  # fp32 sums (of bf16 x too)
                for m in range(1, most):
                    got = _raw(w, x[most - m :], out=torch.empty(m, 40))
                    assert torch.equal(got, every[most - m :]), (k, m, int8)


def _offsets(counts):
    return torch.tensor(counts).cumsum(0)


STACKS = {
    "bf16": lambda e, n, k, g: (torch.randn(e, n, k, generator=g) * 0.1).bfloat16(),
    "mxfp4": lambda e, n, k, g: _random_fp4("mxfp4", n, k, g, lead=(e,)),
    "nvfp4-ct": lambda e, n, k, g: _random_fp4("nvfp4", n, k, g, True, lead=(e,)),
    "nvfp4-modelopt": lambda e, n, k, g: _random_fp4("nvfp4", n, k, g, False, lead=(e,)),
    "fp8-128x128-f32": lambda e, n, k, g: _random_fp8(n, k, g, (128, 128), False, lead=(e,)),
    "fp8-32x32-ue8m0": lambda e, n, k, g: _random_fp8(n, k, g, (32, 32), True, lead=(e,)),
    "fp8-tensor": lambda e, n, k, g: _random_fp8(n, k, g, None, False, lead=(e,)),
}


@pytest.mark.parametrize("fmt", list(STACKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_per_expert_loop(kernel, fmt, dtype):
    """All experts of a step in one call = one call per expert, bit for bit (the same tiles), and the
    fp32 reference; experts without rows are skipped."""
    gen = torch.Generator().manual_seed(21)
    counts = [3, 0, 1, 16, 0, 2, 5, 0]
    e, n, k = len(counts), 72, 160
    w = STACKS[fmt](e, n, k, gen)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)
    offs = _offsets(counts)
    for threads in (1, 2, 5):
        y = _raw(w, x, offs=offs, threads=threads)
        start = 0
        for i, c in enumerate(counts):
            if c:
                one = _raw(w[i], x[start : start + c], threads=1)
                assert torch.equal(y[start : start + c], one)
                ref = _reference(w[i], x[start : start + c])
                (_assert_fp32_close if dtype == torch.float32 else _assert_bf16_rounding)(one, ref)
            start += c
    # the public entry points: QuantizedTensor.grouped_matmul / cpu.grouped_linear
    before = cpu.stats["kernel_calls"]
    if fmt == "bf16":  # computed in the weights' dtype, like layers/linear.py
        got = cpu.grouped_linear(x, w, offs)
        want = _raw(w, x.bfloat16(), offs=offs).to(dtype)
    else:
        got = w.grouped_matmul(x, offs.to(torch.int32))
        want = _raw(w, x, offs=offs)
    assert cpu.stats["kernel_calls"] == before + 2  # got, want: one call each
    assert torch.equal(got, want)


def _unfused(monkeypatch, block: bool = True, ffn: bool = True):
    """Turns the fused MoE calls off: cpu.moe_rows (the whole block) and / or cpu.ffn_rows (its feed-forward
    part after the Python router)."""
    if block:
        monkeypatch.setattr(cpu, "moe_rows", lambda *a, **k: None)
    if ffn:
        monkeypatch.setattr(cpu, "ffn_rows", lambda *a, **k: None)


def _moe_three_ways(monkeypatch, M, x, w, spec, token_ids=None):
    """layers/moe.py's moe three ways, asserting the same bits: the whole block fused (cpu.moe_rows, which must
    be taken), the router in Python with the fused feed-forward block, the torch code. Returns the result."""
    taken, real = [], cpu.moe_rows
    monkeypatch.setattr(cpu, "moe_rows", lambda *a, **k: (y := real(*a, **k), taken.append(y is not None))[0])
    fused = M.moe(x, w, spec, token_ids)
    assert taken == [True]
    _unfused(monkeypatch, ffn=False)
    half = M.moe(x, w, spec, token_ids)
    _unfused(monkeypatch)
    want = M.moe(x, w, spec, token_ids)
    monkeypatch.undo()
    assert torch.equal(fused.view(torch.int16), want.view(torch.int16))
    assert torch.equal(half.view(torch.int16), want.view(torch.int16))
    return fused


@pytest.mark.parametrize("fmt", list(STACKS))
def test_fused_ffn_equals_torch_code(kernel, monkeypatch, fmt):
    """layers/moe.py's block at decode sizes (cpu.ffn_rows: routed experts, shared expert, dense MLP in one
    call) gives the torch code's bits: 1 to MAX_ROWS tokens (experts shared between tokens), softmax and
    sigmoid routers, bf16 and fp32 routing weights, SwiGLU plain and clamped (GLM-5.3, DeepSeek-V4), with
    and without a shared expert, activations large and small; the fused call is taken (one call in the kernel counter's terms per product); more rows than
    MAX_ROWS, or a stack it cannot take (gate | up quantized apart), run the torch code."""
    from moesaic.layers import moe as M

    gen = torch.Generator().manual_seed(len(fmt))
    e, d, i, si = 8, 96, 64, 32
    mats = STACKS[fmt]
    single = lambda n, k: mats(1, n, k, gen)[0]  # noqa: E731  one matrix of the format
    shared = M.Mlp(up=single(si, d), down=single(d, si), gate=single(si, d))
    for trial, n in enumerate([1, 1, 3, 16, 2, 7]):
        w = M.MoeWeights(
            router=torch.randn(e, d, generator=gen).bfloat16(),
            experts_in=mats(e, 2 * i, d, gen),
            experts_out=mats(e, d, i, gen),
            bias=torch.randn(e, generator=gen) if trial % 2 else None,
            shared=shared if trial < 4 else None,
        )
        glu = (
            functools.partial(M.clamped_silu_glu, limit=0.3) if trial >= 3 else M.silu_glu
        )  # clamps (0.3: not a bf16)
        spec = M.MoeSpec(M.Router("sigmoid" if trial % 2 else "softmax", 3, fp32=trial % 3 == 0), glu=glu)
        x = (torch.randn(n, d, generator=gen) * (8 if trial == 2 else 1)).bfloat16()
        before = cpu.stats["kernel_calls"]
        M.moe(x, w, spec)
        router_calls = 0 if spec.router.fp32 else 1  # an fp32 router is F.linear
        assert cpu.stats["kernel_calls"] - before == router_calls + 2 + (3 if trial < 4 else 0)
        _moe_three_ways(monkeypatch, M, x, w, spec)
        _unfused(monkeypatch)
        dense_want = shared(x, glu)
        monkeypatch.undo()
        assert torch.equal(shared(x, glu).view(torch.int16), dense_want.view(torch.int16))
    # gate and up quantized apart (a ConcatRows stack; a streamed one is alike): the torch code, no fused
    # call, not even for the shared expert alone (the routed experts would be left out)
    parts = ConcatRows([mats(e, i, d, gen), mats(e, i, d, gen)])
    w = M.MoeWeights(router=w.router, experts_in=parts, experts_out=w.experts_out, shared=shared)
    weights, ids = M.route(x, w, spec.router)
    assert M.operand(parts) is None and M._fused_parts(w, spec, True) is None
    assert cpu.ffn_rows(x, weights, ids, None, M.operand(w.experts_out), shared.operands()) is None
    assert (
        M.swiglu_limit(M.situ_glu) is False
        and M.swiglu_limit(functools.partial(M.clamped_silu_glu, 0.5)) is False
    )
    many = torch.randn(cpu.MAX_ROWS + 1, d, generator=gen).bfloat16()
    assert cpu.ffn_rows(many, dense=shared.operands()) is None


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_fused_block_sqrtsoftplus_and_hash_routers(kernel, monkeypatch, fmt):
    """DeepSeek-V4's routers in the whole fused block (cpu.moe_rows): sqrtsoftplus with and without a selection
    bias, a hash layer's static experts (tid2eid[token]), a router kept in fp32, and one expert group of a
    sigmoid router: the torch code's bits, at 1 to MAX_ROWS tokens; more than one expert group runs the
    torch code."""
    from moesaic.layers import moe as M

    gen = torch.Generator().manual_seed(17)
    e, d, i, k = 8, 96, 64, 3
    mats = STACKS[fmt]
    vocab = 50
    for trial, n in enumerate([1, 4, 16, 2]):
        w = M.MoeWeights(
            router=torch.randn(e, d, generator=gen).bfloat16(),
            experts_in=mats(e, 2 * i, d, gen),
            experts_out=mats(e, d, i, gen),
            bias=torch.randn(e, generator=gen) if trial != 1 else None,
            hash_ids=torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(vocab)])
            if trial == 2
            else None,
        )
        spec = M.MoeSpec(M.Router("sqrtsoftplus", k, scale=1.5, fp32=trial == 3), glu=M.silu_glu)
        x = torch.randn(n, d, generator=gen).bfloat16()
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        _moe_three_ways(monkeypatch, M, x, w, spec, tokens)
    grouped = M.MoeSpec(M.Router("sigmoid", 2, n_group=2, topk_group=1))
    w = M.MoeWeights(router=w.router, experts_in=w.experts_in, experts_out=w.experts_out, bias=w.bias)
    assert M._fused_block(x, w, grouped.router, None, M._fused_parts(w, grouped, True)) is None


@pytest.mark.parametrize("fmt", list(STACKS))
def test_fused_ffn_ungated_relu2_equals_torch_code(kernel, monkeypatch, fmt):
    """Nemotron-H's ungated block (experts w_in [E, I, d], relu(h)^2, an ungated shared expert) through
    cpu.ffn_rows gives the torch code's bits at 1 to MAX_ROWS tokens, with and without the shared expert, and
    so does the ungated MLP alone; the fused call is taken; another activation, or a gated shared expert
    beside ungated experts, runs the torch code."""
    from moesaic.layers import moe as M

    gen = torch.Generator().manual_seed(11 + len(fmt))
    e, d, i, si = 8, 96, 64, 32
    mats = STACKS[fmt]
    single = lambda n, k: mats(1, n, k, gen)[0]  # noqa: E731  one matrix of the format
    shared = M.Mlp(up=single(si, d), down=single(d, si))
    spec = M.MoeSpec(M.Router("sigmoid", 3), gated=False, act=M.relu2)
    for trial, n in enumerate([1, 3, 16, 5]):
        w = M.MoeWeights(
            router=torch.randn(e, d, generator=gen).bfloat16(),
            experts_in=mats(e, i, d, gen),
            experts_out=mats(e, d, i, gen),
            shared=shared if trial < 3 else None,
        )
        x = (torch.randn(n, d, generator=gen) * (4 if trial == 1 else 1)).bfloat16()
        before = cpu.stats["kernel_calls"]
        M.moe(x, w, spec)
        assert cpu.stats["kernel_calls"] - before == 1 + 2 + (
            2 if trial < 3 else 0
        )  # router, experts, shared
        _moe_three_ways(monkeypatch, M, x, w, spec)
        dense = shared(x, act=M.relu2)
        _unfused(monkeypatch)
        dense_want = shared(x, act=M.relu2)
        monkeypatch.undo()
        assert torch.equal(dense.view(torch.int16), dense_want.view(torch.int16)), trial
    other = M.MoeSpec(spec.router, gated=False, act=torch.nn.functional.gelu)
    assert M._fused_parts(w, other, True) is None
    gated_shared = M.Mlp(up=single(si, d), down=single(d, si), gate=single(si, d))
    mixed = M.MoeWeights(
        router=w.router, experts_in=w.experts_in, experts_out=w.experts_out, shared=gated_shared
    )
    assert M._fused_parts(mixed, spec, True) is None


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_fused_ffn_weighted_sum_rounds_like_torch(kernel, monkeypatch, score):
    """The fused block's weighted sum over many tokens of a wide layer, in bf16 (softmax over bf16 logits)
    and in fp32 (the sigmoid router's weights): each product rounded before it is added, as torch's `y * w`
    then sum does (an FMA-contracted fp32 sum differs in about one token in fifty at this width)."""
    from moesaic.layers import moe as M

    gen = torch.Generator().manual_seed(3)
    e, d, i = 16, 1024, 32
    w = M.MoeWeights(
        router=torch.randn(e, d, generator=gen).bfloat16(),
        experts_in=(torch.randn(e, 2 * i, d, generator=gen) / 16).bfloat16(),
        experts_out=(torch.randn(e, d, i, generator=gen) / 4).bfloat16(),
    )
    spec = M.MoeSpec(M.Router(score, 4, scale=2.446))
    xs = [(torch.randn(1 + t % 5, d, generator=gen) * (0.3 + t / 10)).bfloat16() for t in range(60)]
    fused = [M.moe(x, w, spec) for x in xs]
    _unfused(monkeypatch)
    for x, got in zip(xs, fused):
        assert torch.equal(got.view(torch.int16), M.moe(x, w, spec).view(torch.int16))


def test_grouped_concat_rows_and_fallback(kernel, monkeypatch):
    """ConcatRows (gate | up quantized separately) grouped: one call per part into its columns; with
    the kernels off the plain path gives the same values within fp32 rounding."""
    gen = torch.Generator().manual_seed(5)
    counts = [2, 0, 4, 1]
    e, i, k = len(counts), 40, 96
    gate = stack([from_suffix_dict(quantize_nvfp4(torch.randn(i, k, generator=gen) * 0.1)) for _ in range(e)])
    up = stack([from_suffix_dict(quantize_nvfp4(torch.randn(i, k, generator=gen) * 0.1)) for _ in range(e)])
    cr = ConcatRows([gate, up])
    x = torch.randn(sum(counts), k, generator=gen)
    offs = _offsets(counts)
    before = cpu.stats["kernel_calls"]
    y = cr.grouped_matmul(x, offs)
    assert cpu.stats["kernel_calls"] == before + 2 and y.shape == (7, 2 * i)
    start = 0
    for j, c in enumerate(counts):
        if c:
            _assert_fp32_close(y[start : start + c], _reference(cr[j], x[start : start + c]))
            _assert_fp32_close(cr[j].matmul(x[start : start + c]), y[start : start + c])
        start += c
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
    before = dict(cpu.stats)
    plain = cr.grouped_matmul(x, offs)
    assert cpu.stats["kernel_calls"] == before["kernel_calls"]
    assert cpu.stats["fallback_calls"] == before["fallback_calls"] + 2 * 3  # 2 parts x 3 experts with rows
    _assert_fp32_close(plain, y)


# ------------------------------------------------------------------------ dispatch and fallback


def test_large_m_uses_plain_path(kernel):
    gen = torch.Generator().manual_seed(3)
    qt = _random_fp4("nvfp4", 40, 64, gen)
    x = torch.randn(cpu.MAX_ROWS + 1, 64, generator=gen)
    before = dict(cpu.stats)
    y = qt.matmul(x)
    assert cpu.stats["kernel_calls"] == before["kernel_calls"]
    assert cpu.stats["fallback_calls"] == before["fallback_calls"] + 1
    _assert_fp32_close(y, _reference(qt, x))


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
@pytest.mark.parametrize("n,k", [(67, 96), (3, 97), (33, 200), (9, 1088), (37, 31), (64, 2049)])
def test_tile_decode_equals_dequantize_rows(kernel, fmt, n, k):
    """cpu.operand_rows (the plain tiles' decode) gives QuantizedTensor.dequantize_rows' fp32 values bit for
    bit, every row range, NaN codes included, 1 and 3 threads, the portable loops too; and a matmul of more rows than the kernels
    take runs through those tiles to the fp32 reference."""
    multiple, make = FORMATS[fmt]
    if k % multiple:
        pytest.skip("K not a multiple of the group")
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = make(n, k, gen)
    if w.format.startswith("fp8"):  # NaN codes, one row with one in each 64-value load, one row without
        codes = w.codes.view(torch.uint8).clone()
        codes[0, ::64] = 0x7F
        codes[n - 1, k // 2] = 0xFF
        w = w._replace(codes=codes.view(torch.float8_e4m3fn))
    op = w.kernel_operand(0)
    for r0, r1 in [(0, n), (1, n), (n // 2, n // 2 + 1), (n - 1, n)]:
        want = w.dequantize_rows(r0, r1, torch.float32)
        for threads, generic in ((1, False), (3, False), (1, True)):
            got = cpu.operand_rows(op, r0, torch.full((r1 - r0, k), 7.0), threads=threads, generic=generic)
            nan = want.isnan()  # (NaN where the reference has NaN; a NaN's payload bits are not compared)
            assert torch.equal(got.isnan(), nan), (r0, r1, threads)
            assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), (r0, r1, threads)
    x = torch.randn(cpu.MAX_ROWS + 3, k, generator=gen)
    if not w.format.startswith("fp8"):  # (NaN codes make NaN rows either way)
        before = cpu.stats["fallback_calls"]
        got = w.matmul(x)
        assert cpu.stats["fallback_calls"] == before + 1  # the tiles' path, not the kernels' rows
        _assert_fp32_close(got, _reference(w, x))


# ------------------------------------------------------------------------ int8 activations


def _int8_reference(qt, x):
    """x rounded as MOESAIC_CPU_INT8_ACTIVATIONS rounds it (each 32 values scaled by d = max |x| / 127 and
    rounded to the nearest integer code, in fp32), then the exact products in float64."""
    m, k = x.shape
    blocks = torch.nn.functional.pad(x.float(), (0, -k % 32)).view(m, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = (blocks * inv).round().clamp(-127, 127)
    rounded = (q.double() * (amax / 127.0).double()).view(m, -1)[:, :k]
    return rounded @ qt.dequantize(torch.float32).double().transpose(-1, -2)


INT8_SHAPES = [(67, 96), (5, 32), (7, 16), (33, 208), (7, 80), (9, 1088), (64, 2048), (36, 48)]


@pytest.fixture
def int8x(kernel, monkeypatch):
    if not kernel.has_avx2():
        pytest.skip("int8 activations take the AVX2 tiles")
    monkeypatch.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "1")
    return monkeypatch


@pytest.mark.parametrize("tiles", ["best", "avx2"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4-ct", "nvfp4-modelopt"])
def test_int8_activations_equal_their_rounding(int8x, kernel, fmt, tiles):
    """MOESAIC_CPU_INT8_ACTIVATIONS=1: E2M1 weights against x rounded to int8 codes a 32-value block at a
    time give the float64 products of the rounded x to fp32 accumulation (1e-6 of sum |x| |w|), every M up
    to 16, fp32 and bf16 x, 1 and 3 threads alike, tails of a 64- and a 128-value load included; the exact
    path misses that bound (the switch changes the arithmetic), and unset it is off. On the CPU's best tiles
    (VNNI where it has AVX-512 VNNI) and on the AVX2 ones (cpu.AVX2_ONLY)."""
    if tiles == "avx2":
        int8x.setattr(cpu, "AVX2_ONLY", True)
    elif not kernel.has_vnni512():
        pytest.skip("no AVX-512 VNNI: the best tiles are the AVX2 ones")
    multiple, make = FORMATS[fmt]
    missed = 0
    for n, k in INT8_SHAPES:
        if k % multiple:
            continue
        gen = torch.Generator().manual_seed(n * 100 + k)
        w = make(n, k, gen)
        for m in (1, 2, 3, 5, 16):
            x = torch.randn(m, k, generator=gen) * 3
            if m == 3:  # bf16 rows (vdpbf16ps's exact products where the int8 switch is off)
                x = x.bfloat16()
            want = _int8_reference(w, x)
            bound = x.double().abs() @ w.dequantize(torch.float32).double().abs().T
            got = _raw(w, x, threads=1, out=torch.empty(m, n))  # (fp32 sums of bf16 x too)
            assert torch.equal(got, _raw(w, x, threads=3, out=torch.empty(m, n)))
            # (+ 1e-40: a row with the subnormal scale 2^-127 rounds its products in fp32's subnormal range)
            assert ((got.double() - want).abs() <= 1e-6 * bound + 1e-40).all(), (n, k, m)
            # the portable loops stay exact
            _assert_fp32_close(_raw(w, x, generic=True, out=torch.empty(m, n)), _reference(w, x.float()))
            int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "0")
            exact = _raw(w, x, out=torch.empty(m, n))
            missed += not ((exact.double() - want).abs() <= 1e-6 * bound + 1e-40).all()
            int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "1")
    assert missed > 0
    int8x.delenv("MOESAIC_CPU_INT8_ACTIVATIONS")
    assert not cpu.int8_activations() and cpu._path() & cpu.Q8_PATH == 0


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4-ct"])
def test_int8_activations_grouped_and_not_finite(int8x, fmt):
    """The grouped form with int8 activations equals one call per expert bit for bit; a call whose x holds
    an inf or a NaN keeps the exact fp32 tiles (the same bits as with the switch off)."""
    gen = torch.Generator().manual_seed(22)
    counts = [3, 0, 1, 16, 2]
    w = STACKS[fmt](len(counts), 72, 160, gen)
    x = torch.randn(sum(counts), 160, generator=gen)
    offs = _offsets(counts)
    y = _raw(w, x, offs=offs, threads=2)
    start = 0
    for i, c in enumerate(counts):
        if c:
            assert torch.equal(y[start : start + c], _raw(w[i], x[start : start + c], threads=1))
            start += c
    one = _random_fp4(fmt.split("-")[0], 40, 128, gen)
    for bad in (float("inf"), float("nan")):
        xb = torch.randn(3, 128, generator=gen)
        xb[1, 70] = bad
        got = _raw(one, xb)
        int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "0")
        exact = _raw(one, xb)
        int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "1")
        assert torch.equal(got.isnan(), exact.isnan()) and torch.equal(got.nan_to_num(), exact.nan_to_num())
        assert not torch.equal(_raw(one, xb[:1]), exact[:1])  # a finite x alone: the int8 tiles


def test_env_var_disables_kernel(monkeypatch):
    """MOESAIC_CPU_KERNELS=0: the plain path (no build needed), same results."""
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
    assert not cpu.enabled() and not cpu.available()
    gen = torch.Generator().manual_seed(4)
    qt = _random_fp4("mxfp4", 50, 64, gen)
    x = torch.randn(2, 64, generator=gen)
    before = dict(cpu.stats)
    y = qt.matmul(x)
    assert cpu.stats["kernel_calls"] == before["kernel_calls"]
    assert cpu.stats["fallback_calls"] == before["fallback_calls"] + 1
    _assert_fp32_close(y, _reference(qt, x))
    w = torch.randn(30, 64, generator=gen).bfloat16()
    assert torch.equal(cpu.linear(x.bfloat16(), w), torch.nn.functional.linear(x.bfloat16(), w))
    assert cpu.stats["kernel_calls"] == before["kernel_calls"]


def test_build_failure_falls_back(monkeypatch):
    """A failed build (simulated) leaves matmul on the plain path, working."""
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu, "_state", {"tried": True, "mod": None, "error": "simulated"})
    assert not cpu.available()
    gen = torch.Generator().manual_seed(5)
    qt = _random_fp4("nvfp4", 33, 48, gen, divides=False)
    x = torch.randn(1, 48, generator=gen).bfloat16()
    before = dict(cpu.stats)
    y = qt.matmul(x)
    assert cpu.stats["kernel_calls"] == before["kernel_calls"]
    assert y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="simulated"):
        cpu.fp4_matmul(x, qt.codes, qt.scale, 16, qt.global_scale)
    w = torch.randn(8, 48, generator=gen).bfloat16()
    assert torch.equal(cpu.linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("seconds,said", [(0.3, True), (0.0, False)])
def test_a_slow_build_says_so(monkeypatch, capsys, seconds, said):
    """A load that takes longer than BUILD_NOTICE_S (a build, simulated) prints one line on stderr saying that it
    is building the kernels, so that a first prompt's minute does not look hung; a cached load prints nothing."""
    import torch.utils.cpp_extension as ext

    def slow_load(**kw):
        time.sleep(seconds)
        return "module"

    monkeypatch.setattr(ext, "load_inline", slow_load)
    monkeypatch.setattr(cpu, "BUILD_NOTICE_S", 0.05)
    monkeypatch.setattr(cpu, "_state", {"tried": False, "mod": None, "error": None})
    assert cpu.load() == "module"
    time.sleep(0.1)  # (a timer that should have been cancelled would print by now)
    err = capsys.readouterr().err
    assert (cpu.BUILD_NOTICE in err) == said
    assert err.count(cpu.BUILD_NOTICE) <= 1


def test_fp8_block_not_multiple_of_32_uses_plain_path(kernel):
    gen = torch.Generator().manual_seed(6)
    qt = _random_fp8(40, 96, gen, (16, 48), False)
    assert not cpu.fp8_block_ok(qt.block, 96)
    x = torch.randn(2, 96, generator=gen)
    before = dict(cpu.stats)
    y = qt.matmul(x)
    assert cpu.stats["kernel_calls"] == before["kernel_calls"]
    _assert_fp32_close(y, _reference(qt, x))


# ------------------------------------------------------------------------ threads


def test_thread_count_never_above_torch_threads():
    saved = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            picks = [
                cpu.threads_for(b, r) for b in (0, 1 << 10, 1 << 20, 1 << 24, 1 << 34) for r in (1, 4, 16)
            ]
            assert all(1 <= p <= n for p in picks)
            assert cpu.threads_for(1 << 34) == n  # a large matrix uses every thread torch has
            assert cpu.threads_for(1 << 10, 1) == 1  # a tiny one runs on one thread
    finally:
        torch.set_num_threads(saved)


def test_read_bandwidths_best_and_median_of_the_same_reads(kernel):
    """The roof (the best read) and the median come from one set of reads, so the best is never below the
    median (two separate probes gave a median above the roof)."""
    best, median = cpu.read_bandwidths(nbytes=4 << 20, slice_bytes=1 << 20, repeats=9)
    assert best >= median > 0


# ------------------------------------------------------------------------ whole models


@pytest.mark.parametrize(
    "name",
    [
        "demo-deepseek-v4",
        "demo-deepseek-v41",
        "demo-kimi-k3-mxfp4",
        "demo-glm5-next-nvfp4",
        "demo-mistral4-nvfp4",
        "demo-nemotron-h-nvfp4",
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_tokens_kernel_vs_plain(kernel, monkeypatch, name, dtype):
    """Greedy tokens of the quantized demos with the kernels (MOESAIC_CPU_KERNELS=1) and without. In bf16 the
    kernels sum in other orders than the plain path (vdpbf16ps, AMX tiles), so a greedy near-tie one bf16 step
    wide may go either way: there, teacher-forced on the plain tokens (prefill rows above and below MAX_ROWS),
    the logits agree to a few bf16 steps at 9 in 10 positions or more (a router's top-k may flip on a near tie
    at one: DeepSeek-V4's 20-token score, layer 2, position 12, since its dense products at 17-32 rows take
    the kernel), and the argmax is the plain one wherever the plain margin is wider."""
    llm = moesaic.LLM(name, dtype=dtype)
    params = moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["Hello, world", [5, 17, 3, 9]]
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1")
    before = cpu.stats["kernel_calls"]
    fast = [o.token_ids for o in llm.generate(prompts, params)]
    assert cpu.stats["kernel_calls"] > before  # the packed weights went through the kernels
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
    before = cpu.stats["kernel_calls"]
    outs = llm.generate(prompts, params)
    assert cpu.stats["kernel_calls"] == before
    if dtype == "float32":
        assert fast == [o.token_ids for o in outs]
        return
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.token_ids[:-1])
        plain = llm.score(seq)
        monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1")
        got = llm.score(seq)
        monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
        tol = 8 * 2**-8 * max(1.0, plain.abs().max().item())  # 8 bf16 steps at the logits' size
        close = (got - plain).abs().amax(-1) <= tol
        assert close.float().mean().item() >= 0.9
        top = plain.topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 2 * tol
        assert clear.any() and torch.equal(got.argmax(-1)[clear], plain.argmax(-1)[clear])


@pytest.mark.parametrize("name", ["demo-kimi-k3-mxfp4", "demo-mistral4-nvfp4", "demo-deepseek-v4"])
def test_demo_logits_with_int8_activations(int8x, name):
    """The E2M1 demos with MOESAIC_CPU_INT8_ACTIVATIONS=1, teacher-forced on their exact greedy tokens: the
    logits move (the switch is on) but at 4 in 5 positions by at most 5 % of their size (measured: 1-2 %, a
    position where a router's top-k flips on a near tie more), and the argmax is the exact one wherever the
    exact margin is wider than twice that position's change."""
    llm = moesaic.LLM(name, dtype="float32")
    params = moesaic.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "0")
    outs = llm.generate(["Hello, world", [5, 17, 3, 9]], params)
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.token_ids[:-1])
        int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "0")
        plain = llm.score(seq)
        int8x.setenv("MOESAIC_CPU_INT8_ACTIVATIONS", "1")
        got = llm.score(seq)
        change = (got - plain).abs().amax(-1)
        assert change.max() > 0
        assert (change <= 0.05 * plain.abs().max()).float().mean() >= 0.8
        top = plain.topk(2, dim=-1).values
        clear = top[:, 0] - top[:, 1] > 2 * change
        assert torch.equal(got.argmax(-1)[clear], plain.argmax(-1)[clear])


# ------------------------------------------------------------------------ import direction


def test_kernels_import_no_moesaic_package_but_codecs():
    """kernels/*.py import torch, the standard library and each other (the codec module, the C++
    source, the environment switches, the huge-page memory) only; weights/quant.py imports the kernels, never the reverse (no cycle)."""
    import ast
    import sys
    from pathlib import Path

    root = Path(cpu.__file__).parent
    allowed_local = {"codecs", "cpu", "cpu_src", "env", "memory"}
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: only siblings inside kernels/
                    assert node.level == 1 and (node.module or "") in allowed_local | {""}, (
                        path.name,
                        node.module,
                    )
                    if not node.module:
                        assert {a.name for a in node.names} <= allowed_local, (path.name, node.names)
                    continue
                mod = node.module or ""
            elif isinstance(node, ast.Import):
                mod = node.names[0].name
            else:
                continue
            top = mod.split(".")[0]
            assert top == "torch" or top == "__future__" or top in sys.stdlib_module_names, (path.name, mod)
    quant = (root.parent / "weights" / "quant.py").read_text()
    assert "from ..kernels import cpu" in quant and "from ..kernels.codecs import" in quant

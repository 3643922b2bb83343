"""The optional fused CPU fp4 kernel (moesaic/kernels/cpu_fp4.py) against the fp32 reference
(dequantize in fp32, then matmul), and QuantizedTensor.matmul's dispatch to it / its fallback."""

import pytest
import torch

from moesaic.kernels import cpu_fp4
from moesaic.weights.quant import QuantizedTensor, from_suffix_dict, quantize_mxfp4, quantize_nvfp4


@pytest.fixture(scope="module")
def kernel():
    if not cpu_fp4.enabled():
        pytest.skip("MOESAIC_CPU_KERNELS=0 in the environment")
    mod = cpu_fp4.load()
    if mod is None:
        pytest.skip(f"the fused CPU kernel could not be built here: {cpu_fp4._state['error']}")
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


def _reference(qt, x):
    """fp32: dequantize the whole weight in fp32, then matmul."""
    w = qt.dequantize(torch.float32)
    return x.float() @ w.transpose(-1, -2)


def _assert_fp32_close(got, ref):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    scale = ref.abs().amax().clamp_min(1e-30)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=float(scale) * 2e-6)


CASES = [("mxfp4", True), ("nvfp4", True), ("nvfp4", False)]


@pytest.mark.parametrize("fmt,divides", CASES)
@pytest.mark.parametrize("n,k", [(67, 96), (131, 48), (200, 256), (5, 32)])
@pytest.mark.parametrize("m", [1, 3, 8, 11])
@pytest.mark.parametrize("generic", [False, True])
def test_raw_kernel_matches_fp32_reference(kernel, fmt, divides, n, k, m, generic):
    if k % (32 if fmt == "mxfp4" else 16):
        pytest.skip("K not a multiple of the group")
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    qt = _random_fp4(fmt, n, k, gen, divides)
    x = torch.randn(m, k, generator=gen)
    stab = cpu_fp4._scale_table(fmt, qt.global_scale, qt.global_divides)
    for threads in (1, 3):
        y = cpu_fp4.fp4_matmul(
            x,
            qt.codes,
            qt.scale.view(torch.uint8),
            stab,
            32 if fmt == "mxfp4" else 16,
            threads=threads,
            generic=generic,
        )
        _assert_fp32_close(y, _reference(qt, x))


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


@pytest.mark.parametrize("naming", ["mxfp4", "nvfp4-compressed-tensors", "nvfp4-modelopt"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_dispatches_to_kernel(kernel, naming, m, dtype):
    gen = torch.Generator().manual_seed(m)
    n, k = 150, 160
    w = torch.randn(n, k, generator=gen) * 0.05
    if naming == "mxfp4":
        qt = from_suffix_dict(quantize_mxfp4(w))
    else:
        qt = from_suffix_dict(quantize_nvfp4(w, naming=naming.split("-", 1)[1]))
        assert qt.global_divides == (naming == "nvfp4-compressed-tensors")
    x = torch.randn(2, m, k, generator=gen).to(dtype)  # leading batch dims flatten to 2*m rows
    before = dict(cpu_fp4.stats)
    y = qt.matmul(x)
    assert cpu_fp4.stats["kernel_calls"] == before["kernel_calls"] + 1
    assert y.dtype == dtype and y.shape == (2, m, n)
    ref = _reference(qt, x)
    if dtype == torch.float32:
        _assert_fp32_close(y, ref)
    else:  # one rounding of the fp32 result to bf16
        torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=float(ref.abs().amax()) * 1e-5)
        # and exactly the rounding of the fp32 kernel result
        codes, scale, g = qt._matrix(0)
        y32 = cpu_fp4.fp4_matmul(
            x.reshape(-1, k),
            codes,
            scale.view(torch.uint8),
            cpu_fp4._scale_table(qt.format, g, qt.global_divides),
            32 if qt.format == "mxfp4" else 16,
        )
        assert torch.equal(y.reshape(-1, n), y32.to(dtype))


@pytest.mark.parametrize("fmt,divides", CASES)
def test_stacked_experts(kernel, fmt, divides):
    gen = torch.Generator().manual_seed(7)
    e, n, k, m = 3, 90, 128, 4
    qt = _random_fp4(fmt, n, k, gen, divides, lead=(e,))
    x = torch.randn(e, m, k, generator=gen)
    before = cpu_fp4.stats["kernel_calls"]
    y = qt.matmul(x)  # one kernel call per expert
    assert cpu_fp4.stats["kernel_calls"] == before + e
    for i in range(e):
        ref = _reference(qt[i], x[i])
        _assert_fp32_close(y[i], ref)
        _assert_fp32_close(qt[i].matmul(x[i]), ref)  # the expert view


def test_large_m_uses_plain_path(kernel):
    gen = torch.Generator().manual_seed(3)
    qt = _random_fp4("nvfp4", 40, 64, gen)
    x = torch.randn(cpu_fp4.MAX_ROWS + 1, 64, generator=gen)
    before = dict(cpu_fp4.stats)
    y = qt.matmul(x)
    assert cpu_fp4.stats["kernel_calls"] == before["kernel_calls"]
    assert cpu_fp4.stats["fallback_calls"] == before["fallback_calls"] + 1
    _assert_fp32_close(y, _reference(qt, x))


def test_env_var_disables_kernel(monkeypatch):
    """MOESAIC_CPU_KERNELS=0: the plain path (no build needed), same results."""
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
    assert not cpu_fp4.enabled() and not cpu_fp4.available()
    gen = torch.Generator().manual_seed(4)
    qt = _random_fp4("mxfp4", 50, 64, gen)
    x = torch.randn(2, 64, generator=gen)
    before = dict(cpu_fp4.stats)
    y = qt.matmul(x)
    assert cpu_fp4.stats["kernel_calls"] == before["kernel_calls"]
    assert cpu_fp4.stats["fallback_calls"] == before["fallback_calls"] + 1
    _assert_fp32_close(y, _reference(qt, x))


def test_build_failure_falls_back(monkeypatch):
    """A failed build (simulated) leaves matmul on the plain path, working."""
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_fp4, "_state", {"tried": True, "mod": None, "error": "simulated"})
    assert not cpu_fp4.available()
    gen = torch.Generator().manual_seed(5)
    qt = _random_fp4("nvfp4", 33, 48, gen, divides=False)
    x = torch.randn(1, 48, generator=gen).bfloat16()
    before = dict(cpu_fp4.stats)
    y = qt.matmul(x)
    assert cpu_fp4.stats["kernel_calls"] == before["kernel_calls"]
    assert y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="simulated"):
        cpu_fp4.fp4_matmul(x, qt.codes, qt.scale.view(torch.uint8), torch.ones(256), 16)

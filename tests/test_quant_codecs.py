"""Quantized-weight codecs: bit-exact against compressed-tensors, FP8 blocks against an independent
reference, tiled matmul, encoders, malformed checkpoints and per-tensor format resolution."""

from __future__ import annotations

import pytest
import torch

from moesaic.errors import CheckpointError
from moesaic.weights.quant import (
    QuantizedTensor,
    e8m0_to_float,
    float_to_e2m1_codes,
    load_quantized,
    pack_fp4_codes,
    quantize_fp8_block,
    quantize_fp8_tensor,
    quantize_mxfp4,
    quantize_nvfp4,
    resolve_format,
    stack,
    unpack_fp4,
    unpack_fp4_codes,
)

ct_quant = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.mx_utils import decompress_mx_scale  # noqa: E402
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

K3_CONFIG = {  # Kimi K3 config.json quantization_config (reference/kimi_k3.md)
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "ignore": ["re:.*shared_experts.*"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "weights": {
                "num_bits": 4,
                "group_size": 32,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "scale_dtype": "torch.uint8",
                "dynamic": False,
            },
        }
    },
}
CT_NVFP4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "group_size": 16,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor_group",
                "scale_dtype": "torch.float8_e4m3fn",
                "dynamic": False,
            },
        }
    },
}
V41_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}
MODELOPT_CONFIG = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "kv_cache_quant_algo": None,
    "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "*.mlp.gate"],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern (so -0.0 != 0.0 and NaN == NaN)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def rand_weight(n, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # rows and groups of very different magnitude, so the scales span many exponents
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-12, 6, (n, 1), generator=g).float())
    w = w * torch.exp2(torch.randint(-3, 3, (n, k // 16), generator=g).float()).repeat_interleave(16, 1)
    w[0, :16] = 0.0  # an all-zero group
    return w.to(dtype)


# ---------------------------------------------------------------------------------------------
# element types
# ---------------------------------------------------------------------------------------------


def test_fp4_nibble_order_and_e2m1_rounding():
    # byte 0x72: low nibble 2 (1.0) is element 0, high nibble 7 (6.0) element 1; 0x9F: -6.0, -0.5
    assert unpack_fp4(torch.tensor([[0x72, 0x9F]], dtype=torch.uint8)).tolist() == [[1.0, 6.0, -6.0, -0.5]]
    allb = torch.arange(256, dtype=torch.uint8).view(1, 256)
    assert torch.equal(pack_fp4_codes(unpack_fp4_codes(allb)), allb)
    assert torch.equal(unpack_fp4(allb.view(torch.int8)), unpack_fp4(allb))  # I8 (DeepSeek) == U8
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(bits(unpack_fp4(allb, dt).float()), bits(unpack_fp4(allb)))
    # round to nearest, ties to the even code, saturate at 6
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, -0.1, -3.0])
    vals = unpack_fp4(pack_fp4_codes(float_to_e2m1_codes(x))).tolist()
    assert vals == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -3.0]
    assert torch.signbit(torch.tensor(vals[10]))


def test_e8m0_decoding_matches_ocp_and_compressed_tensors():
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float(e)
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[6])
    assert torch.equal(bits(e8m0_to_float(e.view(torch.float8_e8m0fnu))), bits(got))
    every = torch.arange(255, dtype=torch.uint8)  # 0..254: compressed-tensors defines these the same way
    assert torch.equal(bits(e8m0_to_float(every)), bits(decompress_mx_scale(every).float()))


# ---------------------------------------------------------------------------------------------
# bit-exact against compressed-tensors' own decompression
# ---------------------------------------------------------------------------------------------


def _ct_compress(w: torch.Tensor, preset: str, compressor):
    scheme = ct_quant.preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    groups = w.unflatten(-1, (-1, args.group_size))
    sd = {"weight": w}
    gs = None
    if compressor is NVFP4PackedCompressor:
        gs = generate_gparam(w.amin(), w.amax())
        sd["weight_global_scale"] = gs
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
    sd.update(weight_scale=scale, weight_zero_point=zp)
    return compressor.compress(sd, scheme), scheme


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_equals_compressed_tensors_bit_for_bit(dtype):
    w = rand_weight(96, 256, seed=1, dtype=dtype)
    packed, scheme = _ct_compress(w, "MXFP4A16", MXFP4PackedCompressor)
    assert packed["weight_packed"].dtype == torch.uint8 and packed["weight_scale"].dtype == torch.uint8
    theirs = MXFP4PackedCompressor.decompress(packed, scheme)["weight"]
    assert theirs.dtype == torch.bfloat16
    base = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    ckpt = {f"{base}.{k}": v for k, v in packed.items()}
    fmt = resolve_format(K3_CONFIG, {k: str(v.dtype) for k, v in ckpt.items()}, base)
    assert fmt == "mxfp4"
    qt = load_quantized(base, ckpt, fmt, K3_CONFIG, shape=(96, 256))
    assert torch.equal(bits(qt.dequantize(torch.bfloat16)), bits(theirs))
    assert torch.equal(bits(qt.dequantize(torch.float32).bfloat16()), bits(theirs))
    assert qt.nbytes == 96 * 256 // 2 + 96 * 256 // 32


def test_mxfp4_equals_compressed_tensors_on_arbitrary_bytes():
    """Every code and every scale byte 0..254 (incl. e = 0 -> 2^-127), decoded by both."""
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 255, (64, 8), dtype=torch.uint8, generator=g)
    scale[0, 0], scale[0, 1], scale[1, 0] = 0, 254, 1
    scheme = ct_quant.preset_name_to_scheme("MXFP4A16", ["Linear"])
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)[
        "weight"
    ]
    ours = QuantizedTensor("mxfp4", packed, scale, name="w").dequantize(torch.bfloat16)
    assert torch.equal(bits(ours), bits(theirs))
    # a broken twin: reading the high nibble first must not pass the same comparison
    swapped = (packed >> 4) | (packed << 4)
    assert not torch.equal(
        bits(QuantizedTensor("mxfp4", swapped, scale).dequantize(torch.bfloat16)), bits(theirs)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_equals_compressed_tensors_bit_for_bit(dtype):
    w = rand_weight(80, 256, seed=3, dtype=dtype)
    packed, scheme = _ct_compress(w, "NVFP4A16", NVFP4PackedCompressor)
    assert packed["weight_scale"].dtype == torch.float8_e4m3fn
    theirs = NVFP4PackedCompressor.decompress(packed, scheme)["weight"]
    base = "model.layers.3.mlp.experts.7.down_proj"
    ckpt = {f"{base}.{k}": v for k, v in packed.items()}
    fmt = resolve_format(CT_NVFP4_CONFIG, {k: str(v.dtype) for k, v in ckpt.items()}, base)
    assert fmt == "nvfp4"
    qt = load_quantized(base, ckpt, fmt, CT_NVFP4_CONFIG)
    assert qt.global_divides
    assert torch.equal(bits(qt.dequantize(torch.bfloat16)), bits(theirs))
    # the classic loader bug (global scale used as a multiplier) fails this comparison
    wrong = QuantizedTensor("nvfp4", qt.codes, qt.scale, global_scale=qt.global_scale, global_divides=False)
    assert not torch.equal(wrong.dequantize(torch.bfloat16), theirs)


def test_nvfp4_equals_compressed_tensors_on_arbitrary_bytes():
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=g)
    sbytes = torch.randint(0, 0x7F, (48, 8), dtype=torch.uint8, generator=g)  # positive, finite E4M3
    scale = sbytes.view(torch.float8_e4m3fn)
    gscale = torch.tensor([1234.567])
    scheme = ct_quant.preset_name_to_scheme("NVFP4A16", ["Linear"])
    theirs = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gscale}, scheme
    )["weight"]
    ours = QuantizedTensor("nvfp4", packed, scale, global_scale=gscale, global_divides=True).dequantize(
        torch.bfloat16
    )
    assert torch.equal(bits(ours), bits(theirs))


# ---------------------------------------------------------------------------------------------
# FP8 blocks against an independent reference
# ---------------------------------------------------------------------------------------------


def _fp8_reference(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int, e8m0: bool) -> torch.Tensor:
    """Block by block, with explicit loops and Python floats for the scales."""
    n, k = q.shape
    out = torch.empty(n, k)
    qf = q.to(torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            v = 2.0 ** (int(s[i, j].view(torch.uint8)) - 127) if e8m0 else float(s[i, j])
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (
                qf[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] * v
            )
    return out


@pytest.mark.parametrize(
    "shape,block",
    [
        ((300, 200), (128, 128)),
        ((300, 200), (32, 32)),
        ((256, 128), (128, 128)),
        ((70, 45), (1, 45)),
        ((65, 33), (32, 16)),
    ],
)
@pytest.mark.parametrize("e8m0", [False, True])
def test_fp8_block_dequant_equals_reference(shape, block, e8m0):
    g = torch.Generator().manual_seed(5)
    n, k = shape
    nb, kb = -(-n // block[0]), -(-k // block[1])
    raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    q = raw.view(torch.float8_e4m3fn)
    if e8m0:
        s = torch.randint(110, 140, (nb, kb), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    else:
        s = torch.rand(nb, kb, generator=g) * 1e-2 + 1e-4
    qt = QuantizedTensor("fp8_block", q, s, block=block, name="attn.wq_a")
    ref = _fp8_reference(q, s, *block, e8m0)
    assert torch.equal(qt.dequantize(), ref)
    assert torch.equal(qt.dequantize(torch.bfloat16), ref.bfloat16())
    for tr in (block[0], 2 * block[0] if block[0] > 1 else 7):  # tiles that cut the matrix differently
        assert torch.equal(torch.cat([qt.dequantize_rows(r, min(n, r + tr)) for r in range(0, n, tr)]), ref)
    assert torch.equal(qt.dequantize_rows(5, n - 2), ref[5 : n - 2])  # rows not aligned to the block
    with pytest.raises(IndexError):
        qt.dequantize_rows(0, n + 1)


# ---------------------------------------------------------------------------------------------
# matmul, stacking
# ---------------------------------------------------------------------------------------------


def _make(fmt: str, w: torch.Tensor) -> QuantizedTensor:
    if fmt == "fp8_block_f32":
        d = quantize_fp8_block(w, (128, 128), "float")
        return QuantizedTensor("fp8_block", d["weight"], d["weight_scale_inv"], block=(128, 128))
    if fmt == "fp8_block_ue8m0":
        d = quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek")
        return QuantizedTensor("fp8_block", d["weight"], d["scale"], block=(32, 32))
    if fmt == "fp8_tensor":
        d = quantize_fp8_tensor(w)
        return QuantizedTensor("fp8_tensor", d["weight"], d["weight_scale"])
    if fmt == "mxfp4":
        d = quantize_mxfp4(w)
        return QuantizedTensor("mxfp4", d["weight_packed"], d["weight_scale"])
    if fmt == "nvfp4_ct":
        d = quantize_nvfp4(w)
        return QuantizedTensor(
            "nvfp4",
            d["weight_packed"],
            d["weight_scale"],
            global_scale=d["weight_global_scale"],
            global_divides=True,
        )
    d = quantize_nvfp4(w, naming="modelopt")
    return QuantizedTensor("nvfp4", d["weight"], d["weight_scale"], global_scale=d["weight_scale_2"])


FMTS = ["fp8_block_f32", "fp8_block_ue8m0", "fp8_tensor", "mxfp4", "nvfp4_ct", "nvfp4_modelopt"]


@pytest.mark.parametrize("fmt", FMTS)
def test_matmul_equals_dequantize_then_matmul(fmt):
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(6))
    qt = _make(fmt, w)
    dq = qt.dequantize()
    for rows in (1, 8, 37):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        for tr in (None, 32):  # default tiles and many small ones (300 = 9 * 32 + 12)
            if fmt == "fp8_block_f32" and tr == 32:
                tr = 128
            torch.testing.assert_close(qt.matmul(x, tile_rows=tr), x @ dq.T, rtol=1e-5, atol=1e-4)
        xb = x.bfloat16()
        yb = qt.matmul(xb)
        assert yb.dtype == torch.bfloat16
        # against the exact weights: within bf16 rounding of the output (the plain path's fp32 tiles
        # and the CPU kernels both keep the weights exact and round the output once)
        ref = xb.float() @ dq.T
        torch.testing.assert_close(yb.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    x3 = torch.randn(2, 3, 256)
    assert qt.matmul(x3).shape == (2, 3, 300)
    torch.testing.assert_close(qt.matmul(x3), x3 @ dq.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_stacked_experts_index_without_copy(fmt):
    ws = [torch.randn(96, 128, generator=torch.Generator().manual_seed(10 + e)) for e in range(3)]
    experts = [_make(fmt, w) for w in ws]
    st = stack(experts, name="layers.1.experts.w1")
    assert st.shape == (3, 96, 128) and len(st) == 3
    assert st.nbytes == sum(e.nbytes for e in experts)
    full = st.dequantize()
    for e in range(3):
        one = st[e]
        assert one.shape == (96, 128)
        assert one.codes.data_ptr() == st.codes[e].data_ptr()  # a view into the stacked storage
        assert torch.equal(one.dequantize(), experts[e].dequantize())
        assert torch.equal(full[e], experts[e].dequantize())
        x = torch.randn(5, 128)
        torch.testing.assert_close(one.matmul(x), x @ experts[e].dequantize().T, rtol=1e-5, atol=1e-4)
    assert torch.equal(st[-1].dequantize(), experts[2].dequantize())
    assert st[1:3].shape == (2, 96, 128)
    xs = torch.randn(3, 4, 128)
    torch.testing.assert_close(
        st.matmul(xs), torch.stack([xs[e] @ full[e].T for e in range(3)]), rtol=1e-5, atol=1e-4
    )
    with pytest.raises(IndexError):
        st[3]
    with pytest.raises(TypeError):
        experts[0][0]


# ---------------------------------------------------------------------------------------------
# encoders: round trips
# ---------------------------------------------------------------------------------------------


def test_roundtrip_within_quantization_error():
    w = torch.randn(160, 256, generator=torch.Generator().manual_seed(7))
    for fmt in FMTS:
        qt = _make(fmt, w)
        dq = qt.dequantize()
        rel = ((dq - w).norm() / w.norm()).item()
        if fmt.startswith("fp8"):
            # E4M3: 3 mantissa bits -> at most half an ulp, 2^-4 relative (+ subnormal floor)
            scale_max = w.abs().max() / 448
            assert ((dq - w).abs() <= w.abs() * 2.0**-4 + scale_max * 2.0**-9 + 1e-12).all(), fmt
            assert rel < 0.03, (fmt, rel)
        else:
            assert rel < 0.12, (fmt, rel)  # 4-bit: ~0.09 on Gaussian weights
    # MXFP4: per element, at most half the widest E2M1 gap (2) times the group scale
    d = quantize_mxfp4(w)
    qt = QuantizedTensor("mxfp4", d["weight_packed"], d["weight_scale"])
    s = e8m0_to_float(d["weight_scale"]).repeat_interleave(32, 1)
    assert ((qt.dequantize() - w).abs() <= s + 1e-12).all()
    assert (w.abs() <= 6 * s).all()  # pow2_ceil(amax / 6): nothing clips


def test_roundtrip_exact_on_representable_values():
    g = torch.Generator().manual_seed(8)
    vals = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = vals[torch.randint(0, 15, (64, 128), generator=g)]
    codes[:, ::32] = 6.0  # every MXFP4 group reaches 6 -> pow2_ceil(amax/6) is its exact scale
    pow2 = torch.exp2(torch.randint(-20, 10, (64, 4), generator=g).float()).repeat_interleave(32, 1)
    w = codes * pow2
    d = quantize_mxfp4(w)
    assert torch.equal(QuantizedTensor("mxfp4", d["weight_packed"], d["weight_scale"]).dequantize(), w)
    d = quantize_mxfp4(w, naming="deepseek")
    assert d["weight"].dtype == torch.int8 and d["scale"].dtype == torch.float8_e8m0fnu
    assert torch.equal(QuantizedTensor("mxfp4", d["weight"], d["scale"]).dequantize(), w)
    # NVFP4: group scales that are E4M3 values, the largest 448 so the global scale is exactly 2^k
    s16 = torch.tensor([448.0, 0.5, 1.0, 2.5, 13.0, 96.0, 0.0078125, 320.0])
    gsc = s16[torch.randint(0, 8, (64, 8), generator=g)]
    gsc[0, 0] = 448.0
    codes16 = codes.clone()
    codes16[:, ::16] = -6.0
    for k2 in (1.0, 2.0**-7):
        w16 = codes16 * gsc.repeat_interleave(16, 1) * k2
        for naming in ("compressed-tensors", "modelopt"):
            d = quantize_nvfp4(w16, naming=naming)
            c, s, gs = d.values()
            qt = QuantizedTensor(
                "nvfp4", c, s, global_scale=gs, global_divides=naming == "compressed-tensors"
            )
            assert torch.equal(qt.dequantize(), w16), naming
    # FP8: E4M3 values times a block scale whose block reaches 448
    q = torch.randint(0, 256, (96, 64), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0
    qv = q.view(torch.float8_e4m3fn).float()
    qv[::32, ::32] = 448.0
    blocks = torch.exp2(torch.randint(-10, 4, (3, 2), generator=g).float())
    w8 = qv * blocks.repeat_interleave(32, 0).repeat_interleave(32, 1)
    for fmt in ("float", "ue8m0"):
        d = quantize_fp8_block(w8, (32, 32), fmt)
        qt = QuantizedTensor("fp8_block", d["weight"], d["weight_scale_inv"], block=(32, 32))
        assert torch.equal(qt.dequantize(), w8), fmt


# ---------------------------------------------------------------------------------------------
# malformed checkpoints
# ---------------------------------------------------------------------------------------------


def test_malformed_scales_raise_checkpoint_errors_naming_the_tensor():
    w = torch.randn(64, 96)
    d = quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek")
    base = "layers.0.attn.wq_a"
    # wrong scale shape (a 128-block scale given to a 32-block weight)
    bad = {f"{base}.weight": d["weight"], f"{base}.scale": d["scale"][:1, :1]}
    with pytest.raises(CheckpointError, match=rf"{base}\.scale.*\[1, 1\].*\[2, 3\]"):
        load_quantized(base, bad, "fp8_block", V41_CONFIG)
    # unsupported block sizes
    with pytest.raises(CheckpointError, match=rf"{base}.*weight_block_size"):
        resolve_format(
            {**V41_CONFIG, "weight_block_size": [128]},
            {f"{base}.weight": "F8_E4M3", f"{base}.scale": "F8_E8M0"},
            base,
        )
    with pytest.raises(CheckpointError, match="unsupported fp8 block size"):
        QuantizedTensor("fp8_block", d["weight"], d["scale"], block=(0, 32), name=base)
    ct64 = {
        **K3_CONFIG,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "group_size": 64, "type": "float", "strategy": "group"},
            }
        },
    }
    with pytest.raises(CheckpointError, match="experts.0.w1.*group_size 64"):
        resolve_format(
            ct64, {"experts.0.w1.weight_packed": "U8", "experts.0.w1.weight_scale": "U8"}, "experts.0.w1"
        )
    # missing companions
    with pytest.raises(CheckpointError, match=rf"{base}\.weight_scale_inv is missing"):
        resolve_format(V41_CONFIG, {f"{base}.weight": "F8_E4M3"}, base)
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight_scale is missing"):
        resolve_format(K3_CONFIG, {"experts.3.w2.weight_packed": "U8"}, "experts.3.w2")
    with pytest.raises(CheckpointError, match=r"e\.weight_global_scale is missing"):
        resolve_format(None, {"e.weight_packed": "U8", "e.weight_scale": "F8_E4M3"}, "e")
    with pytest.raises(CheckpointError, match=r"e\.weight_scale_2 is missing"):
        resolve_format(MODELOPT_CONFIG, {"e.weight": "U8", "e.weight_scale": "F8_E4M3"}, "e")
    with pytest.raises(CheckpointError, match=r"m\.weight is not in the checkpoint"):
        resolve_format(None, {}, "m")
    with pytest.raises(CheckpointError, match=rf"{base}\.scale is missing"):
        load_quantized(base, {f"{base}.weight": d["weight"]}, "mxfp4")
    # wrong dtypes
    m = quantize_mxfp4(torch.randn(8, 64))
    with pytest.raises(CheckpointError, match=r"x\.weight_scale: dtype torch\.float32"):
        load_quantized(
            "x", {"x.weight_packed": m["weight_packed"], "x.weight_scale": m["weight_scale"].float()}, "mxfp4"
        )
    with pytest.raises(CheckpointError, match=r"x\.weight_scale: dtype F32"):
        resolve_format(K3_CONFIG, {"x.weight_packed": "U8", "x.weight_scale": "F32"}, "x")
    with pytest.raises(CheckpointError, match="not supported"):
        resolve_format({"quant_method": "gptq"}, {"x.weight": "I8", "x.weight_scale": "F16"}, "x")
    with pytest.raises(CheckpointError, match=r"y\.weight is BF16 .*inconsistent"):
        resolve_format(None, {"y.weight": "BF16", "y.weight_scale_inv": "F32"}, "y")
    # mxfp4 scale of the wrong group size / nvfp4 global scale of the wrong size
    with pytest.raises(CheckpointError, match=r"\[8, 4\].*\[8, 2\]"):
        QuantizedTensor("mxfp4", m["weight_packed"], torch.zeros(8, 4, dtype=torch.uint8), name="z")
    n4 = quantize_nvfp4(torch.randn(8, 64))
    with pytest.raises(CheckpointError, match="g2.*one value per matrix"):
        QuantizedTensor(
            "nvfp4",
            n4["weight_packed"],
            n4["weight_scale"],
            global_scale=torch.ones(2),
            tensor_names={"global_scale": "g2"},
        )
    with pytest.raises(CheckpointError, match=r"expected \[8, 128\]"):
        QuantizedTensor("mxfp4", m["weight_packed"], m["weight_scale"], shape=(8, 128))


# ---------------------------------------------------------------------------------------------
# resolve_format on the released configs
# ---------------------------------------------------------------------------------------------


def test_resolve_format_k3_compressed_tensors_mxfp4():
    p = "language_model.model.layers.5.block_sparse_moe"
    names = {
        f"{p}.experts.0.w1.weight_packed": "U8",
        f"{p}.experts.0.w1.weight_scale": "U8",
        f"{p}.shared_experts.gate_proj.weight": "BF16",
        f"{p}.gate.weight": "BF16",
        f"{p}.routed_expert_up_proj.weight": "BF16",
        "language_model.model.layers.5.self_attn.q_proj.weight": "BF16",
    }
    assert resolve_format(K3_CONFIG, names, f"{p}.experts.0.w1") == "mxfp4"
    assert resolve_format(K3_CONFIG, names, f"{p}.experts.0.w1.weight") == "mxfp4"
    for dense in (
        f"{p}.shared_experts.gate_proj",
        f"{p}.gate",
        f"{p}.routed_expert_up_proj",
        "language_model.model.layers.5.self_attn.q_proj",
    ):
        assert resolve_format(K3_CONFIG, names, dense) is None, dense
    # the ignore list says shared experts stay bf16: quantized ones there are a contradiction
    bad = {
        f"{p}.shared_experts.down_proj.weight_packed": "U8",
        f"{p}.shared_experts.down_proj.weight_scale": "U8",
    }
    with pytest.raises(CheckpointError, match=r"shared_experts\.down_proj.*inconsistent"):
        resolve_format(K3_CONFIG, bad, f"{p}.shared_experts.down_proj")
    # an nvfp4 tensor set under an mxfp4 config
    nv = {"a.weight_packed": "U8", "a.weight_scale": "F8_E4M3", "a.weight_global_scale": "F32"}
    with pytest.raises(CheckpointError, match="assigns mxfp4 .* are nvfp4"):
        resolve_format(K3_CONFIG, nv, "a")


def test_resolve_format_deepseek_v41_fp8_32x32_ue8m0():
    names = {
        "layers.0.attn.wq_a.weight": "F8_E4M3",
        "layers.0.attn.wq_a.scale": "F8_E8M0",
        "layers.0.attn.compressor.wkv.weight": "BF16",
        "layers.0.attn.indexer.wq_b.weight": "BF16",
        "layers.0.ffn.experts.3.w1.weight": "I8",
        "layers.0.ffn.experts.3.w1.scale": "F8_E8M0",
        "layers.0.attn.q_norm.weight": "BF16",
        "layers.0.hc_attn_fn": "F32",
    }
    assert resolve_format(V41_CONFIG, names, "layers.0.attn.wq_a") == "fp8_block"
    assert resolve_format(V41_CONFIG, names, "layers.0.ffn.experts.3.w1") == "mxfp4"
    for dense in ("layers.0.attn.compressor.wkv", "layers.0.attn.indexer.wq_b", "layers.0.attn.q_norm"):
        assert resolve_format(V41_CONFIG, names, dense) is None
    # load both from a tiny checkpoint and check they decode like their encoders say
    w = torch.randn(64, 96)
    d = quantize_fp8_block(w, (32, 32), "ue8m0", naming="deepseek")
    e = quantize_mxfp4(torch.randn(48, 64), naming="deepseek")
    ckpt = {
        "layers.0.attn.wq_a.weight": d["weight"],
        "layers.0.attn.wq_a.scale": d["scale"],
        "layers.0.ffn.experts.3.w1.weight": e["weight"],
        "layers.0.ffn.experts.3.w1.scale": e["scale"],
    }
    qt = load_quantized("layers.0.attn.wq_a", ckpt.__getitem__, "fp8_block", V41_CONFIG, names=set(ckpt))
    assert qt.block == (32, 32) and qt.scale_kind == "e8m0" and qt.scale.shape == (2, 3)
    assert torch.equal(qt.dequantize(), _fp8_reference(d["weight"], d["scale"], 32, 32, True))
    ex = load_quantized("layers.0.ffn.experts.3.w1", ckpt, "mxfp4", V41_CONFIG)
    assert ex.shape == (48, 64)
    same = QuantizedTensor("mxfp4", e["weight"].view(torch.uint8), e["scale"].view(torch.uint8))
    assert torch.equal(ex.dequantize(), same.dequantize())
    # with no config the block is inferred from the shapes; a 128-block config reads it wrongly -> error
    assert load_quantized("layers.0.attn.wq_a", ckpt, "fp8_block", None).block == (32, 32)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale"):
        load_quantized(
            "layers.0.attn.wq_a", ckpt, "fp8_block", {**V41_CONFIG, "weight_block_size": [128, 128]}
        )
    # HF DeepSeek-V3 style: weight_scale_inv fp32, 128x128
    h = quantize_fp8_block(torch.randn(300, 200), (128, 128), "float", naming="hf")
    hf = {"q.weight": h["weight"], "q.weight_scale_inv": h["weight_scale_inv"]}
    cfg = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    assert resolve_format(cfg, {k: v.dtype for k, v in hf.items()}, "q") == "fp8_block"
    assert load_quantized("q", hf, "fp8_block", cfg).scale_kind == "float"
    with pytest.raises(CheckpointError, match="lm_head.*inconsistent"):
        resolve_format(cfg, {"lm_head.weight": "F8_E4M3", "lm_head.weight_scale_inv": "F32"}, "lm_head")


def test_resolve_format_modelopt_nvfp4():
    L = "model.layers.2"
    names = {
        f"{L}.mlp.experts.4.up_proj.weight": "U8",
        f"{L}.mlp.experts.4.up_proj.weight_scale": "F8_E4M3",
        f"{L}.mlp.experts.4.up_proj.weight_scale_2": "F32",
        f"{L}.mlp.experts.4.up_proj.input_scale": "F32",
        f"{L}.self_attn.q_proj.weight": "BF16",
        f"{L}.mlp.gate.weight": "BF16",
        "lm_head.weight": "BF16",
    }
    assert resolve_format(MODELOPT_CONFIG, names, f"{L}.mlp.experts.4.up_proj") == "nvfp4"
    for dense in (f"{L}.self_attn.q_proj", f"{L}.mlp.gate", "lm_head"):
        assert resolve_format(MODELOPT_CONFIG, names, dense) is None
    # the hf_quant_config.json spelling gives the same answers
    hfq = {
        "producer": {"name": "modelopt", "version": "0.29"},
        "quantization": {k: v for k, v in MODELOPT_CONFIG.items() if k != "quant_method"},
    }
    assert resolve_format(hfq, names, f"{L}.mlp.experts.4.up_proj") == "nvfp4"
    with pytest.raises(CheckpointError, match=r"self_attn\.o_proj.*inconsistent"):
        resolve_format(
            MODELOPT_CONFIG,
            {
                f"{L}.self_attn.o_proj.weight": "U8",
                f"{L}.self_attn.o_proj.weight_scale": "F8_E4M3",
                f"{L}.self_attn.o_proj.weight_scale_2": "F32",
            },
            f"{L}.self_attn.o_proj",
        )
    # ModelOpt multiplies by weight_scale_2; loading keeps that convention
    w = torch.randn(32, 64)
    d = quantize_nvfp4(w, naming="modelopt")
    base = f"{L}.mlp.experts.4.up_proj"
    ckpt = {f"{base}.{k}": v for k, v in d.items()} | {f"{base}.input_scale": torch.tensor(0.5)}
    qt = load_quantized(base, ckpt, "nvfp4", MODELOPT_CONFIG)
    assert not qt.global_divides and qt.input_scale is not None
    ref = unpack_fp4(d["weight"]) * (d["weight_scale"].float() * d["weight_scale_2"]).repeat_interleave(16, 1)
    assert torch.equal(qt.dequantize(), ref)
    # FP8 per-tensor under ModelOpt FP8
    f = quantize_fp8_tensor(w)
    cfg8 = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    assert (
        resolve_format(cfg8, {"p.weight": "F8_E4M3", "p.weight_scale": "F32", "p.input_scale": "F32"}, "p")
        == "fp8_tensor"
    )
    qt8 = load_quantized(
        "p", {"p.weight": f["weight"], "p.weight_scale": f["weight_scale"]}, "fp8_tensor", cfg8
    )
    assert torch.equal(qt8.dequantize(), f["weight"].float() * f["weight_scale"])


def test_tiny_quantized_checkpoint_through_the_weight_store(tmp_path):
    """Encoders -> safetensors -> WeightStore (mmap) -> resolve_format / load_quantized, every format
    and naming, with a stacked expert matmul on the loaded (still packed) tensors."""
    import json

    from moesaic.weights.store import WeightStore, save_safetensors

    g = torch.Generator().manual_seed(9)
    ws = {f"layers.0.ffn.experts.{e}.w1": torch.randn(64, 96, generator=g) for e in range(2)}
    tensors = {}
    for base, w in ws.items():
        tensors.update({f"{base}.{k}": v for k, v in quantize_mxfp4(w, naming="deepseek").items()})
    dense_fp8 = torch.randn(40, 96, generator=g)
    tensors.update(
        {
            f"layers.0.attn.wq_a.{k}": v
            for k, v in quantize_fp8_block(dense_fp8, (32, 32), "ue8m0", naming="deepseek").items()
        }
    )
    tensors["layers.0.attn.compressor.wkv.weight"] = torch.randn(8, 96, generator=g).bfloat16()
    save_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v41", "quantization_config": V41_CONFIG})
    )
    store = WeightStore(tmp_path)
    qc = store.config["quantization_config"]
    dtypes = {n: store.info(n).dtype for n in store.names()}
    assert (
        dtypes["layers.0.ffn.experts.0.w1.scale"] == "F8_E8M0"
        and dtypes["layers.0.ffn.experts.0.w1.weight"] == "I8"
    )
    assert resolve_format(qc, dtypes, "layers.0.attn.compressor.wkv") is None
    fmt = resolve_format(qc, dtypes, "layers.0.attn.wq_a")
    wq = load_quantized("layers.0.attn.wq_a", store, fmt, qc, shape=(40, 96))
    assert wq.block == (32, 32) and torch.equal(
        wq.dequantize(),
        _fp8_reference(
            tensors["layers.0.attn.wq_a.weight"], tensors["layers.0.attn.wq_a.scale"], 32, 32, True
        ),
    )
    experts = [load_quantized(b, store, resolve_format(qc, dtypes, b), qc) for b in ws]
    st = stack(experts, name="layers.0.ffn.experts.w1")
    x = torch.randn(2, 3, 96, generator=g)
    want = torch.stack([x[e] @ experts[e].dequantize().T for e in range(2)])
    torch.testing.assert_close(st.matmul(x), want, rtol=1e-5, atol=1e-4)
    for e, w in enumerate(ws.values()):  # and the codes are a faithful 4-bit image of the weight
        assert ((st[e].dequantize() - w).norm() / w.norm()).item() < 0.12


def test_resolve_format_compressed_tensors_fp8_strategies():
    def ct_fp8(strategy, **extra):
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "symmetric": True,
                        **extra,
                    },
                }
            },
        }

    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(11))
    names = {"p.weight": "F8_E4M3", "p.weight_scale": "F32"}
    # per-channel: scale [N, 1] -> the block [1, K]
    cfg = ct_fp8("channel")
    assert resolve_format(cfg, names, "p") == "fp8_block"
    d = quantize_fp8_block(w, (1, 96), "float", naming="compressed-tensors")
    qt = load_quantized("p", {f"p.{k}": v for k, v in d.items()}, "fp8_block", cfg)
    assert qt.block == (1, 96) and torch.equal(
        qt.dequantize(), _fp8_reference(d["weight"], d["weight_scale"], 1, 96, False)
    )
    # block strategy with its block_structure
    cfg = ct_fp8("block", block_structure=[32, 32])
    d = quantize_fp8_block(w, (32, 32), "float", naming="compressed-tensors")
    assert resolve_format(cfg, names, "p") == "fp8_block"
    assert load_quantized("p", {f"p.{k}": v for k, v in d.items()}, "fp8_block", cfg).block == (32, 32)
    # per-tensor
    assert resolve_format(ct_fp8("tensor"), names, "p") == "fp8_tensor"
    # packed codes must be bytes; int4 "pack-quantized" is not a format moesaic reads
    with pytest.raises(CheckpointError, match=r"q\.weight_packed: dtype F32"):
        resolve_format(K3_CONFIG, {"q.weight_packed": "F32", "q.weight_scale": "U8"}, "q")
    int4 = {
        **K3_CONFIG,
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
            }
        },
    }
    with pytest.raises(
        CheckpointError, match=r"q: compressed-tensors format 'pack-quantized' is not supported"
    ):
        resolve_format(int4, {"q.weight_packed": "I32", "q.weight_scale": "BF16"}, "q")


def _same(a: dict, b: dict) -> bool:
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(raw(a[k]).nan_to_num(7.0), raw(b[k]).nan_to_num(7.0))
        for k in a
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encoders_by_row_chunks_equal_the_whole_matrix(monkeypatch, dtype):
    """The encoders work a few rows at a time (weights/quant.py CHUNK_BYTES; whole-matrix temporaries made
    packing at load ~8x slower): chunks a few rows long, ending inside a scale block's rows, give the codes and
    scales of one chunk over the whole matrix (what the compressed-tensors oracles above check), zero and
    non-finite blocks included; an fp32 input is left as it was."""
    import moesaic.weights.quant as Q

    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")  # the torch code (the compiled fp4 pass takes no chunks)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(300, 160, generator=g) * 0.05).to(dtype)
    w[128:140] = 0  # a zero block row
    w[7, 3] = float("nan")
    before = w.clone()
    encoders = [
        lambda w: Q.quantize_fp8_block(w),
        lambda w: Q.quantize_fp8_block(w, (32, 32), "ue8m0", "deepseek"),
        lambda w: Q.quantize_fp8_block(w[:, :150], (128, 128)),  # K and N not whole blocks
        lambda w: Q.quantize_mxfp4(w.nan_to_num()),
        lambda w: Q.quantize_mxfp4(w.nan_to_num(), "deepseek"),
        lambda w: Q.quantize_nvfp4(w.nan_to_num()),
        lambda w: Q.quantize_nvfp4(w.nan_to_num(), "modelopt"),
    ]
    monkeypatch.setattr(Q, "CHUNK_BYTES", 1 << 30)
    assert Q._row_chunks(300, 160) == [(0, 300)]
    whole = [f(w) for f in encoders]
    monkeypatch.setattr(Q, "CHUNK_BYTES", 7 * 160 * 4)  # 7 rows a chunk: 43 chunks, none on a block's edge
    assert len(Q._row_chunks(300, 160)) == 43 and Q._row_chunks(300, 160, 32)[0] == (0, 32)
    for f, want in zip(encoders, whole):
        assert _same(f(w), want)
    assert torch.equal(w.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_fp4_encoders_compiled_equal_the_torch_code(monkeypatch, dtype):
    """kernels/cpu.encode_fp4 (one compiled pass) writes the torch code's bytes for MXFP4 and both NVFP4
    conventions: values on the E2M1 grid's ties, zero groups, groups whose E8M0 scale is a subnormal or
    2^127, rows of mixed magnitudes; a non-finite value leaves the work to the torch code."""
    import moesaic.weights.quant as Q
    from moesaic.kernels import cpu

    if cpu.load() is None:
        pytest.skip("no compiled kernels here")
    g = torch.Generator().manual_seed(9)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    w = torch.randn(37, 128, generator=g) * torch.logspace(-6, 3, 37)[:, None]
    w[0, :16] = torch.cat([ties, -ties]) * 0.5  # ties of a group whose amax is 3 (scales 0.5 / 1)
    w[1, :32] = torch.cat([ties, -ties, ties / 4, -ties / 4])
    w[2] = 0.0  # zero groups
    w[3, :32] = 1e-39  # a subnormal amax: the floored E8M0 scale
    w[4, 32:64] = 3e38 if dtype == torch.float32 else 3e4
    w = w.to(dtype)
    encoders = {
        "mxfp4": lambda w: Q.quantize_mxfp4(w),
        "nvfp4": lambda w: Q.quantize_nvfp4(w),
        "nvfp4-modelopt": lambda w: Q.quantize_nvfp4(w, "modelopt"),
    }
    bad = w.clone()
    bad[5, 7] = float("nan")
    bad[6, 9] = float("inf")
    for name, f in encoders.items():
        gs = 1.0 if name == "mxfp4" else 0.5
        G = 32 if name == "mxfp4" else 16
        probe = (torch.empty(37, 64, dtype=torch.uint8), torch.empty(37, 128 // G, dtype=torch.uint8))
        assert cpu.encode_fp4(name, w, gs, *probe)  # the compiled pass serves finite weights
        assert not cpu.encode_fp4(name, bad, gs, *probe)
        monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1")
        compiled = [f(w), f(bad)]
        monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
        plain = [f(w), f(bad)]
        monkeypatch.delenv("MOESAIC_CPU_KERNELS")
        for a, b in zip(compiled, plain):
            assert _same(a, b), name


def test_fp8_encoder_compiled_equals_the_torch_code(monkeypatch):
    """kernels/cpu.encode_fp8 (one pass per block row, 8 values at a time) writes the torch code's bytes: every
    1024th float of [-448, 448] rounded alone (a block whose amax is 448: scale 1, so its codes are the values'
    E4M3 roundings, torch's own conversion), both scale formats, partial blocks, bf16 / fp16 / fp32, zero blocks;
    a non-finite value leaves the work to the torch code."""
    import moesaic.weights.quant as Q
    from moesaic.kernels import cpu

    if cpu.load() is None:
        pytest.skip("no compiled kernels here")
    top = torch.tensor(448.0).view(torch.int32).item()
    mags = torch.arange(0, top + 1, 1024, dtype=torch.int32).view(torch.float32)
    vals = torch.cat([mags, -mags])
    rows = torch.nn.functional.pad(vals, (0, -len(vals) % 127)).view(-1, 127)
    w = torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1)  # [R, 128]: each row one block
    got = Q.quantize_fp8_block(w, (1, 128))
    assert torch.equal(got["weight_scale_inv"], torch.ones(rows.shape[0], 1))
    assert torch.equal(got["weight"].view(torch.uint8), w.to(torch.float8_e4m3fn).view(torch.uint8))

    g = torch.Generator().manual_seed(11)
    base = torch.randn(300, 200, generator=g) * torch.logspace(-8, 2, 300)[:, None]
    base[128:256, :128] = 0  # a zero block
    bad = base.clone()
    bad[3, 5] = float("nan")
    probe = torch.empty(300, 200, dtype=torch.uint8), torch.empty(3, 2)
    assert cpu.encode_fp8(base, (128, 128), False, *probe) and not cpu.encode_fp8(
        bad, (128, 128), False, *probe
    )
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for args in (((128, 128), "float"), ((128, 128), "ue8m0"), ((32, 32), "ue8m0"), ((1, 64), "float")):
            for x in (base.to(dtype), bad.to(dtype)):
                monkeypatch.setenv("MOESAIC_CPU_KERNELS", "1")
                compiled = Q.quantize_fp8_block(x, *args)
                monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")
                plain = Q.quantize_fp8_block(x, *args)
                monkeypatch.delenv("MOESAIC_CPU_KERNELS")
                assert _same(compiled, plain), (dtype, args)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("rows", [256, 200])
def test_a_stack_packs_to_the_bytes_of_its_matrices(fmt, rows):
    """contract.pack encodes a stack [E, N, K] as one [E N, K] matrix where every scale block lies within one
    expert's matrix (mxfp4; fp8 where 128 divides N): the codes and scales of packing each matrix and stacking
    them (what NVFP4, with a global scale per matrix, and fp8 at other N still do)."""
    from moesaic.weights.contract import pack

    g = torch.Generator().manual_seed(13)
    stack = (
        torch.randn(3, rows, 256, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None, None]
    ).bfloat16()
    got = pack(stack, "experts.w.weight", fmt)
    want = QuantizedTensor.stack(
        [pack(m, f"experts.w.weight[{i}]", fmt) for i, m in enumerate(stack.unbind(0))]
    )
    assert got.shape == want.shape == stack.shape and got.format == want.format
    assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
    gs = (got.global_scale, want.global_scale)
    assert (gs[0] is None and gs[1] is None) or torch.equal(*gs)
    assert torch.equal(got.dequantize(torch.float32), want.dequantize(torch.float32))

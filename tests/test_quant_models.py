"""Whole models from quantized checkpoints in the released layouts: packed weights give the same
logits as the dequantized weights loaded dense in fp32; loading keeps them packed; the precision
schedule; malformed scales."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import max_err, peak_cpu_bytes, weights_of
from torch.profiler import ProfilerActivity, profile

from moesaic.cache.batch import ForwardBatch
from moesaic.demo import random_tensors
from moesaic.demo.mistral4 import DEMO_CONFIG
from moesaic.errors import CheckpointError, ConfigError
from moesaic.models import Checkpoint, mistral4, nemotron_h
from moesaic.weights.contract import to_checkpoint
from moesaic.weights.precision import PrecisionSchedule
from moesaic.weights.quant import (
    COMPANION_SUFFIXES,
    ConcatRows,
    QuantizedTensor,
    load_quantized,
    resolve_format,
)
from moesaic.weights.store import _native_scale_name as native_scale_name
from moesaic.weights.store import save_safetensors
from moesaic.weights.writers import quantize_checkpoint

MISTRAL = dict(
    DEMO_CONFIG,
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=128,
    moesaic_demo={},
    moesaic_tokenizer=None,
)
NEMOTRON = {
    "model_type": "nemotron_h",
    "vocab_size": 101,
    "hidden_size": 64,
    "layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "max_position_embeddings": 128,
}

EXPERTS_NATIVE = r"layers\.\d+\.(experts\.\d+|shared_experts)\.w[123]\.weight"
ATTN_HF = r"model\.layers\.\d+\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight"
NEMO_EXPERTS = r"backbone\.layers\.\d+\.mixer\.(experts\.\d+|shared_experts)\.(up|down)_proj\.weight"
NEMO_LINEAR = r"backbone\.layers\.\d+\.mixer\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj)\.weight"


def _tiny(test_module: str, config_class: str) -> dict:
    """The tiny config a family's oracle test uses, as the config.json transformers writes."""
    import importlib

    tiny = importlib.import_module(test_module).TINY
    return getattr(transformers, config_class)(**tiny).to_dict()


GLM_EXPERTS = r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.\w+_proj\.weight"
DSV4_DENSE = r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b)|ffn\.shared_experts\.w[123])\.weight"
DSV4_EXPERTS = r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight"

# name, family, config, layout ("native" = Mistral params.json + consolidated), what to quantize, format
# (several (regex, format) pairs where a release mixes formats)
CASES = [
    ("mistral4-native-nvfp4", mistral4, MISTRAL, "native", EXPERTS_NATIVE, "nvfp4"),
    ("mistral4-native-mxfp4", mistral4, MISTRAL, "native", EXPERTS_NATIVE, "mxfp4"),
    (
        "mistral4-native-fp8",
        mistral4,
        MISTRAL,
        "native",
        r"layers\.\d+\.(attention\.w\w+|experts\.\d+\.w[123])\.weight",
        "fp8-mistral",
    ),
    ("mistral4-hf-fp8", mistral4, MISTRAL, "hf", ATTN_HF, "fp8"),
    ("mistral4-hf-fp8-ue8m0", mistral4, MISTRAL, "hf", ATTN_HF, "fp8-ue8m0"),
    ("nemotron-nvfp4-modelopt", nemotron_h, NEMOTRON, "hf", NEMO_EXPERTS, "nvfp4-modelopt"),
    ("nemotron-fp8-deepseek", nemotron_h, NEMOTRON, "hf", NEMO_LINEAR, "fp8-deepseek"),
    ("glm5next-nvfp4", "glm5next", ("test_glm5next", "Glm5NextTextConfig"), "hf", GLM_EXPERTS, "nvfp4"),
    (
        "deepseek_v4-fp8+fp4",
        "deepseek_v4",
        ("test_deepseek_v4", "DeepseekV4Config"),
        "upstream",
        [(DSV4_DENSE, "fp8-deepseek"), (DSV4_EXPERTS, "fp4-deepseek")],
        None,
    ),
    (
        "deepseek_v4-fp8-ue8m0",
        "deepseek_v4",
        ("test_deepseek_v4", "DeepseekV4Config"),
        "upstream",
        DSV4_DENSE,
        "fp8-ue8m0",
    ),
]


def release_tensors(family, raw, layout):
    """Random dense weights of the family, named as its release checkpoints name them."""
    cfg = family.parse_config(raw)
    specs = family.tensor_specs(cfg)
    tensors = random_tensors(specs, seed=3)
    for s in specs:  # integer tables: a valid hash routing (token -> distinct experts)
        if s.name.endswith("tid2eid"):
            vocab, k = s.shape
            tensors[s.name] = (
                (torch.arange(vocab)[:, None] * 3 + torch.arange(k)[None, :]) % cfg.n_routed_experts
            ).float()
    if layout == "native":
        naming = mistral4.native_naming(cfg)
    elif layout == "upstream":
        naming = family.checkpoint_naming(upstream=True)
    else:
        naming = family.namings(cfg, "hf", [])
    return to_checkpoint(specs, naming, tensors)


def write(folder, raw, layout, tensors, qc=None):
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "native":
        params = mistral4.params_json(raw)
        if qc:  # Mistral's own FP8 files say "quantization"; its NVFP4 release a quantization_config
            params["quantization" if "qformat_weight" in qc else "quantization_config"] = qc
        (folder / "params.json").write_text(json.dumps(params))
        save_safetensors(tensors, folder / "consolidated.safetensors")
    else:
        (folder / "config.json").write_text(
            json.dumps(dict(raw, **({"quantization_config": qc} if qc else {})))
        )
        save_safetensors(tensors, folder / "model.safetensors")
    return folder


def dequantized(tensors, qc):
    """Every quantized weight of a checkpoint dict dequantized to fp32 (an independent dense copy)."""
    tensors = {native_scale_name(n): t for n, t in tensors.items()}  # Mistral's .qscale_weight
    dtypes = {n: t.dtype for n, t in tensors.items()}
    suffixes = ("weight",) + COMPANION_SUFFIXES
    out, done = {}, set()
    for n, t in tensors.items():
        base, _, suffix = n.rpartition(".")
        if suffix not in suffixes:
            out[n] = t
            continue
        if base in done:
            continue
        fmt = resolve_format(qc, dtypes, base)
        if fmt is None:
            out[n] = t
            continue
        done.add(base)
        out[base + ".weight"] = load_quantized(base, tensors, fmt, qc).dequantize(torch.float32)
    return out


def logits(model, ids):
    st = model.new_state()
    return model.forward(ForwardBatch.build([(st, ids)], logits="all"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_packed_equals_dequantized_dense(case, tmp_path):
    import importlib

    name, family, raw, layout, select, fmt = case
    if isinstance(family, str):
        family = importlib.import_module(f"moesaic.models.{family}")
    if isinstance(raw, tuple):
        raw = _tiny(*raw)
    dense = release_tensors(family, raw, layout)
    quant, qc = dense, {}
    for sel, f in select if isinstance(select, list) else [(select, fmt)]:
        quant, q = quantize_checkpoint(quant, sel, f)
        qc = {**q, **qc}
    assert len(quant) > len(dense), "the selection quantized nothing"
    packed_model = Checkpoint.open(write(tmp_path / "q", raw, layout, quant, qc)).build("float32")
    ref_model = Checkpoint.open(write(tmp_path / "d", raw, layout, dequantized(quant, qc))).build("float32")
    ids = torch.randint(
        3, 100, (19,), generator=torch.Generator().manual_seed(0)
    ).tolist()  # every tiny vocab > 100
    a, b = logits(packed_model, ids), logits(ref_model, ids)
    err = max_err(a, b)
    print(f"{name}: packed vs dequantized-dense max abs err {err:.2e}")
    assert err < 1e-4

    # and the packed model really holds packed weights, while the plain model holds none
    def packed(m):
        return sum(isinstance(v, (QuantizedTensor, ConcatRows)) for v in weights_of(m.layers))

    assert packed(packed_model) > 0 and packed(ref_model) == 0
    # quantization changed the model: the dense original differs
    orig = Checkpoint.open(write(tmp_path / "o", raw, layout, dense)).build("float32")
    assert max_err(logits(orig, ids), a) > 1e-3


def test_loading_mxfp4_experts_stays_near_the_packed_size(tmp_path):
    raw = dict(MISTRAL, n_routed_experts=16, moe_intermediate_size=64)
    dense = release_tensors(mistral4, raw, "native")
    quant, qc = quantize_checkpoint(dense, EXPERTS_NATIVE, "mxfp4")
    path = write(tmp_path, raw, "native", quant, qc)
    ckpt = Checkpoint.open(path)
    plan = ckpt.plan()
    packed_bytes = sum(
        ckpt.store.info(n).nbytes
        for n in ckpt.store.names()
        if any(n.startswith(p[: -len(".weight")] + ".") for p in plan.quantized)
    )
    dense_bytes = sum(
        4 * torch.Size(ckpt.store.info(n).shape).numel()
        for src in plan.sources.values()
        for n, _ in src.parts
        if n not in plan.quantized
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = ckpt.build("float32")
    peak = peak_cpu_bytes(prof)
    budget = packed_bytes + dense_bytes
    print(
        f"mxfp4 load: peak {peak} B; packed {packed_bytes} B + dense {dense_bytes} B; ratio {peak / budget:.3f}"
    )
    assert peak <= 1.3 * budget
    # a whole-model dequantization would have needed the experts 8x larger (fp32 vs 4.25 bits)
    experts_fp32 = sum(
        4 * torch.Size(s.shape).numel() for s in mistral4.tensor_specs(ckpt.cfg) if s.role == "expert"
    )
    assert experts_fp32 > 2 * packed_bytes and peak < budget + experts_fp32 / 2
    assert isinstance(model.layers[1].mlp.experts_in, ConcatRows)


def test_precision_schedule(tmp_path):
    dense = release_tensors(mistral4, MISTRAL, "native")
    quant, qc = quantize_checkpoint(dense, EXPERTS_NATIVE, "nvfp4")
    ckpt = Checkpoint.open(write(tmp_path, MISTRAL, "native", quant, qc))
    ids = list(range(3, 20))
    packed = logits(ckpt.build("float32"), ids)
    # experts dequantized to fp32 at load: same numbers, dense tensors
    m = Checkpoint.open(ckpt.store.folder).build("float32", precision="expert=fp32,shared_expert=fp32")
    assert isinstance(m.layers[1].mlp.experts_in, torch.Tensor)
    assert max_err(logits(m, ids), packed) < 1e-4
    # attention quantized to fp8 at load (a dense weight becomes packed): close, not equal
    m8 = Checkpoint.open(ckpt.store.folder).build("float32", precision="attention=fp8")
    assert isinstance(m8.layers[0].attn.q_b, QuantizedTensor)
    assert isinstance(m8.layers[0].attn.kv_b, torch.Tensor)  # used as views: stays dense
    err = max_err(logits(m8, ids), packed)
    assert 0 < err < 0.2 * packed.abs().max().item()
    # router kept in bf16 inside an fp32 model still runs
    mb = Checkpoint.open(ckpt.store.folder).build("float32", precision="router=bf16")
    assert mb.layers[1].mlp.router.dtype == torch.bfloat16
    assert logits(mb, ids).shape == packed.shape


def test_precision_schedule_rules():
    s = PrecisionSchedule.parse("router=bf16,expert=fp8,expert@0-1+5=fp32,*=fp16")
    assert s.dtype_for(3, "router") == "bf16"
    assert (
        s.dtype_for(3, "expert") == "fp8"
        and s.dtype_for(1, "expert") == "fp32"
        and s.dtype_for(5, "expert") == "fp32"
    )
    assert s.dtype_for(3, "norm") == "fp16" and PrecisionSchedule().dtype_for(0, "expert") == "inherit"
    for bad in ("expert", "expert=fp5", "expert@x=fp8"):
        with pytest.raises(ConfigError):
            PrecisionSchedule.parse(bad)


def test_malformed_scales_in_a_checkpoint_are_reported(tmp_path):
    dense = release_tensors(mistral4, MISTRAL, "native")
    quant, qc = quantize_checkpoint(dense, EXPERTS_NATIVE, "nvfp4")
    del quant["layers.1.experts.2.w1.weight_global_scale"]
    quant["layers.2.experts.0.w2.weight_scale"] = quant["layers.2.experts.0.w2.weight_scale"][
        :, :1
    ].contiguous()
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(write(tmp_path / "a", MISTRAL, "native", quant, qc)).build("float32")
    msg = str(e.value)
    assert "layers.1.experts.2.w1.weight_global_scale" in msg and "layers.2.experts.0.w2" in msg
    # an unsupported fp8 block size named by the config
    q8, qc8 = quantize_checkpoint(release_tensors(mistral4, MISTRAL, "hf"), ATTN_HF, "fp8")
    with pytest.raises(CheckpointError, match="block"):
        Checkpoint.open(
            write(tmp_path / "b", MISTRAL, "hf", q8, dict(qc8, weight_block_size=[128, 0]))
        ).build("float32")


def test_inspect_shows_formats_and_schedule(tmp_path):
    from moesaic.inspect import inspect_checkpoint

    quant, qc = quantize_checkpoint(release_tensors(mistral4, MISTRAL, "native"), EXPERTS_NATIVE, "mxfp4")
    info = inspect_checkpoint(write(tmp_path, MISTRAL, "native", quant, qc), precision="router=bf16")
    assert info["contract"] == "ok"
    assert info["quantized_formats"] == {"mxfp4": 3 * 2 * 8 + 3 * 2}
    assert info["precision"]["router"] == "bf16" and info["precision"]["expert"] == "inherit"

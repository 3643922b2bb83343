"""DeepSeek-V4.1-Flash: the release's top-level config layout, tiny checkpoints in the release naming and
formats (tests), and the demo."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..layers.engram import build_token_map
from ..models.deepseek_v41 import (
    RELEASE_QUANTIZATION,
    RELEASE_TEXT_CONFIG,
    DeepseekV41Config,
    parse_config,
    release_naming,
    tensor_specs,
    tokenizer_vocab,
)
from ..tokenizer import ByteTokenizer
from ..weights.contract import to_checkpoint
from ..weights.quant import quantize_fp8_block
from ..weights.store import save_safetensors
from ..weights.writers import quantize_checkpoint
from . import Demo, chat_tokens
from . import random_tensors as base_random_tensors


def release_config(text_config: dict, **top) -> dict:
    """The released top-level layout around a text config (nested `text_config`)."""
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text_config,
        "vision_config": {"downsample_ratio": 3},
        "expert_dtype": "fp4",
        **top,
    }


RELEASE_CONFIG = release_config(RELEASE_TEXT_CONFIG, quantization_config=RELEASE_QUANTIZATION)


# A tiny release-shaped V4.1 model: vocab 259 (moesaic's byte tokenizer, 230 token-map
# classes), 16 index heads x 16 (no top-k ties), routed width 32 (fp4 groups of 32), rms eps 1e-6.
TINY_TEXT_CONFIG = {
    "model_type": "deepseek_v41",
    "vocab_size": 259,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "o_groups": 2,
    "sliding_window": 8,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "compress_rope_theta": 40000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 2,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "compress_ratios": [0, 0, 2, 2, 1, 1, 0],
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 6,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "dspark_target_layer_ids": [
        2,
        3,
        5,
    ],  # not 4: the drafter reads a layer's input, and 4 is an Engram layer
    "dspark_block_size": 5,
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "dspark_noise_token_id": 0,
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [462, 630],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 64,
    "engram_compressed_vocab_size": 230,
    "engram_pad_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# the demo: the tiny model with three DSpark stages, as released (stage 0 owns main_proj and main_norm, the
# last the norm, Markov and confidence heads)
DEMO_TEXT_CONFIG = dict(
    TINY_TEXT_CONFIG, num_nextn_predict_layers=3, compress_ratios=TINY_TEXT_CONFIG["compress_ratios"] + [0, 0]
)
DEMO_CONFIG = release_config(DEMO_TEXT_CONFIG, moesaic_tokenizer="bytes")


def chat_config() -> dict:
    """The demo's config: the tiny model with the chat markers as tokens (the vocabulary and Engram's
    compressed classes grow by them) and the end of a turn as EOS."""
    chat = chat_tokens("deepseek_v41")
    specials = chat.pop("moesaic_special_tokens")
    classes = int(build_token_map(tokenizer_vocab(ByteTokenizer(specials))).max()) + 1
    text = dict(DEMO_TEXT_CONFIG, **chat, engram_compressed_vocab_size=classes)
    return release_config(text, moesaic_tokenizer="bytes", moesaic_special_tokens=specials)


CHAT_DEMO_CONFIG = chat_config()
# the release's quantized layout: dense fp8 (E4M3 + UE8M0 32x32 `.scale`; the DSpark stages' too, main_proj
# included), routed experts fp4 (`.weight` I8 + E8M0 `.scale`)
DENSE_FP8 = (
    r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|engram\.wkv|main_proj)"
    r"\.weight"
)
EXPERTS_FP4 = r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight"


def random_tensors(cfg: DeepseekV41Config, seed: int = 0) -> dict[str, Tensor]:
    """demo.random_tensors, with the tensors a constant start would hide made live: sinks that take a
    share of the softmax, a router bias that changes choices, Engram gate weights around 1."""
    specs = tensor_specs(cfg)
    out = base_random_tensors(specs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for s in specs:
        if s.name.endswith(("sinks", "e_score_correction_bias")):
            out[s.name] = torch.randn(s.shape, generator=g) * (1.0 if s.name.endswith("sinks") else 0.3)
        elif s.name.endswith(("q_weight", "k_weight")):
            out[s.name] = 1.0 + 0.5 * torch.randn(s.shape, generator=g)
        elif s.name.endswith("embed.scale"):
            del out[s.name]  # a float table has no scales; `write_checkpoint(quantized=True)` makes them
    return out


def quantize_table(weight: Tensor) -> dict[str, Tensor]:
    """An Engram table in the release's row format: E4M3 codes + one UE8M0 scale per 32 columns of a row."""
    return quantize_fp8_block(weight.float(), (1, 32), "ue8m0", naming="deepseek")


def write_checkpoint(
    path,
    config: dict | None = None,
    seed: int = 0,
    quantized: bool = False,
    tensors: dict[str, Tensor] | None = None,
    extra: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Writes a V4.1 checkpoint in the release naming: `config` (a whole config.json, default the tiny
    DEMO_CONFIG) and `tensors` (model names, default `random_tensors`) as float32, or with quantized=True in
    the release's formats: dense weights fp8 E4M3 + UE8M0 32x32 scales, routed experts fp4, Engram tables
    as fp8 rows + E8M0 scales (quantization_config as released). `extra`: checkpoint tensors written as
    they are (e.g. ones the release ships and this model ignores; a weight given here replaces a quantized
    one and its `.scale`). Returns the checkpoint's tensors."""
    path = Path(path)
    raw = json.loads(json.dumps(config or DEMO_CONFIG))
    cfg = parse_config(raw)
    tensors = random_tensors(cfg, seed) if tensors is None else tensors
    ckpt = to_checkpoint(tensor_specs(cfg), release_naming(cfg), {k: v.float() for k, v in tensors.items()})
    if quantized:
        ckpt, qc = quantize_checkpoint(ckpt, DENSE_FP8, "fp8-ue8m0")
        ckpt, _ = quantize_checkpoint(ckpt, EXPERTS_FP4, "fp4-deepseek")
        for name in [k for k in ckpt if k.endswith("engram.embed.weight")]:
            rows = quantize_table(ckpt[name])
            ckpt[name], ckpt[name[: -len("weight")] + "scale"] = rows["weight"], rows["scale"]
        raw["quantization_config"] = qc
    for name in extra or {}:
        if name.endswith(".weight"):
            ckpt.pop(name[: -len("weight")] + "scale", None)
    ckpt.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(ckpt, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    return ckpt


DEMOS = {
    # Engram, shared KV/index sources, candidate blocks, as released: dense fp8 E4M3 + UE8M0 32x32 `.scale`
    # blocks, routed experts fp4, Engram tables fp8 rows
    "demo-deepseek-v41": Demo(
        CHAT_DEMO_CONFIG,
        ((DENSE_FP8, "fp8-ue8m0"), (EXPERTS_FP4, "fp4-deepseek")),
        lambda folder, config: write_checkpoint(folder, config, quantized=True),
    ),
}

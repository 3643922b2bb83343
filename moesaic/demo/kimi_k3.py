"""Kimi K3: tiny checkpoints in the release naming (tests) and the demos (byte tokenizer; MXFP4-compatible
expert widths)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.kimi_k3 import K3Config, parse_config, release_naming, tensor_specs
from ..weights.contract import to_checkpoint
from ..weights.store import save_safetensors
from ..weights.writers import quantize_checkpoint
from . import Demo, chat_tokens

TINY_TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 259,
    "hidden_size": 32,
    "num_hidden_layers": 5,
    "intermediate_size": 48,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4, 5],
    },
    "attn_res_block_size": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 2,
    "moe_intermediate_size": 12,
    "routed_expert_hidden_size": 16,
    "latent_moe_use_norm": True,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


def random_tensors(cfg: K3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 random weights for the contract (model names), scaled so that a tiny model is not
    chaotic (its logits then move by ~1e-5 under fp32-rounding-sized input changes, which makes
    1e-5 comparisons meaningful): matrices ~ N(0, 1/fan_in), norms near 1, embeddings ~ N(0, 1),
    block output projections x0.25 (each block updates the stream a little), GLU gate rows x3 (so
    that SiTU's soft cap on the gate is reached), KDA decays mild (dt_bias ~ -4, A_log ~ log U(0.5,
    1.5): gates near -0.1, a memory of ~10 tokens, so head outputs are rarely near zero before
    their RMSNorm)."""
    g = torch.Generator().manual_seed(seed)
    outputs = (
        "o_proj.weight",
        "mlp.down_proj.weight",
        "routed_expert_up_proj.weight",
        "shared_experts.down_proj.weight",
    )
    out = {}
    for s in tensor_specs(cfg):
        name = s.name
        if name.endswith("A_log"):
            t = torch.empty(s.shape).uniform_(0.5, 1.5, generator=g).log()
        elif name.endswith("dt_bias"):
            t = -4.0 + 0.5 * torch.randn(s.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(s.shape, generator=g)
        elif len(s.shape) == 1:
            t = 1.0 + 0.1 * torch.randn(s.shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(s.shape, generator=g)
        else:
            t = torch.randn(s.shape, generator=g) * s.shape[-1] ** -0.5
            if name.endswith("gate_up_proj"):
                t[:, : s.shape[1] // 2] *= 3.0
            elif name.endswith("gate_proj.weight"):
                t *= 3.0
            elif name.endswith(outputs):
                t *= 0.25
        out[name] = t
    return out


# The demos' text config: the tiny model at widths the MXFP4 group (32) divides, its vocabulary grown by
# the chat markers (K3's XTML specials)
CHAT = chat_tokens("kimi_k3")
DEMO_TEXT_CONFIG = dict(
    TINY_TEXT_CONFIG,
    vocab_size=CHAT["vocab_size"],
    hidden_size=64,
    intermediate_size=96,
    routed_expert_hidden_size=32,
    moe_intermediate_size=32,
)
MXFP4_EXPERTS = (
    r"language_model\.model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight",
    "mxfp4",
)


def release_config(text_config: dict, **top) -> dict:
    """The released top-level layout around a text config."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "text_config": text_config,
        "vision_config": {"model_type": "moonvit3d"},
        **top,
    }


DEMO_CONFIG = release_config(
    DEMO_TEXT_CONFIG,
    bos_token_id=1,
    eos_token_id=CHAT["eos_token_id"],
    pad_token_id=0,
    moesaic_tokenizer="bytes",
    moesaic_special_tokens=CHAT["moesaic_special_tokens"],
)


def write_checkpoint(
    path,
    text_config: dict | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    tensors: dict[str, torch.Tensor] | None = None,
    a_log_width: int | None = None,
    expert_format: str = "bf16",
    **top,
) -> dict[str, torch.Tensor]:
    """Writes a K3 checkpoint in the release naming (`language_model.` prefix, per-expert
    `experts.E.w1|w3|w2`, q/k/v_conv1d, A_log padded with zeros to `a_log_width`, default
    max(H, head_dim) = 128 for the release, two vision tensors that a text model must ignore).
    The trunk is `dtype` (A_log and dt_bias fp32); the routed experts are `dtype` too
    (`.weight`) or, with expert_format="mxfp4", compressed-tensors mxfp4-pack-quantized
    (`.weight_packed` + `.weight_scale`, with the release's quantization_config; expert widths
    must be multiples of 32). `tensors` (model names) default to `random_tensors`. Returns the
    model-named tensors before quantization (in `dtype`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = release_config(dict(TINY_TEXT_CONFIG if text_config is None else text_config), **top)
    cfg = parse_config(raw)
    tensors = random_tensors(cfg, seed) if tensors is None else tensors
    tensors = {
        k: v.to(torch.float32 if k.endswith(("A_log", "dt_bias")) else dtype) for k, v in tensors.items()
    }
    ckpt = to_checkpoint(tensor_specs(cfg), release_naming(cfg, ()), tensors)
    width = a_log_width or max(cfg.linear_attn.num_heads, cfg.linear_attn.head_dim)
    for name in [n for n in ckpt if n.endswith("self_attn.A_log")]:
        a = ckpt[name].reshape(-1)
        ckpt[name] = torch.cat([a, a.new_zeros(width - a.numel())])
    if expert_format == "mxfp4":
        ckpt, qc = quantize_checkpoint(ckpt, MXFP4_EXPERTS[0], "mxfp4")
        raw["quantization_config"] = dict(qc, ignore=["re:.*shared_experts.*"])
        parse_config(raw)  # the expert widths suit the group
    elif expert_format != "bf16":
        raise ValueError(f"expert_format {expert_format!r}: bf16 (dense, in `dtype`) or mxfp4")
    ckpt["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3, 2, 2, dtype=dtype)
    ckpt["mm_projector.proj.0.weight"] = torch.zeros(4, 4, dtype=dtype)
    save_safetensors(ckpt, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    return tensors


DEMOS = {
    "demo-kimi-k3": Demo(DEMO_CONFIG),
    "demo-kimi-k3-mxfp4": Demo(
        DEMO_CONFIG, (MXFP4_EXPERTS,)
    ),  # the release's compressed-tensors MXFP4 experts
}

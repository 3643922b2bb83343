"""The built-in demo models: tiny checkpoints of each family with RANDOM weights from a fixed seed
and a byte-level tokenizer, written on first use into a cache folder in the family's release
naming (and, for the `-nvfp4` ones, its quantized release format). They exercise the whole engine
without downloading anything; their text is noise, and they say so. `demo` (the default model) is
Mistral-Small-4-shaped."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEMO_NAME = "demo"
DEMO_VERSION = 1
DEMO_CONFIG = {
    "model_type": "mistral4",
    "architectures": ["Mistral4ForCausalLM"],
    "vocab_size": 259,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_interleave": True,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "moesaic_tokenizer": "bytes",
}


NEMOTRON_DEMO_CONFIG = {
    "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 259, "hidden_size": 128,
    "layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"], "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "mamba_num_heads": 8, "mamba_head_dim": 32,
    "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 32, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "moe_shared_expert_intermediate_size": 128,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "moesaic_tokenizer": "bytes",
}

from .models import deepseek_v41 as _v41  # noqa: E402  (its release-shaped demo config)
from .models import kimi_k3 as _k3  # noqa: E402  (its release-shaped demo config)

# name -> (config, quantization: (regex of release tensor names, writer format) or None)
DEMOS: dict[str, tuple[dict, tuple[str, str] | None]] = {
    "demo": (DEMO_CONFIG, None),
    # Mistral's NVFP4 release is in its native layout (params.json + consolidated, per-expert tensors)
    "demo-mistral4-nvfp4": (DEMO_CONFIG, (r"layers\.\d+\.(experts\.\d+|shared_experts)\.w[123]\.weight", "nvfp4")),
    "demo-nemotron-h": (NEMOTRON_DEMO_CONFIG, None),
    "demo-nemotron-h-nvfp4": (NEMOTRON_DEMO_CONFIG,
                              (r"backbone\.layers\.\d+\.mixer\.(experts\.\d+|shared_experts)\.\w+\.weight", "nvfp4-modelopt")),
    "demo-kimi-k3": (_k3.DEMO_CONFIG, None),
    "demo-kimi-k3-mxfp4": (_k3.DEMO_CONFIG, _k3.MXFP4_EXPERTS),  # the release's compressed-tensors MXFP4 experts
    # DeepSeek-V4.1 (Engram, shared KV/index sources, candidate blocks) with its dense weights in the release's
    # fp8 E4M3 + UE8M0 32x32 blocks; deepseek_v41.write_checkpoint also writes the fp4 experts and fp8 table rows
    "demo-deepseek-v41": (_v41.DEMO_CONFIG, (_v41.DENSE_FP8, "fp8-ue8m0")),
}


def cache_dir() -> Path:
    return Path(os.environ.get("MOESAIC_CACHE", Path.home() / ".cache" / "moesaic"))


def demo_path(name: str = DEMO_NAME) -> Path:
    return cache_dir() / f"{name}-v{DEMO_VERSION}"


def is_demo_name(name: str) -> bool:
    return str(name) in DEMOS


def random_tensors(specs, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random weights for a tensor contract: norms near 1, matrices ~ N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        if s.role == "norm":
            out[s.name] = 1.0 + 0.05 * torch.randn(s.shape, generator=g)
        else:
            out[s.name] = torch.randn(s.shape, generator=g) * s.shape[-1] ** -0.5
    return out


def ensure_demo(name: str = DEMO_NAME) -> Path:
    """The demo checkpoint folder `name` (one of DEMOS), written (atomically) the first time, in the
    release naming of its family and, for the quantized ones, the release's quantized format."""
    import importlib

    from .config import FAMILIES
    from .weights.contract import to_checkpoint
    from .weights.store import save_safetensors
    from .weights.writers import quantize_checkpoint

    path = demo_path(name)
    if (path / "config.json").exists() or (path / "params.json").exists():
        return path
    config, quant = DEMOS[name]
    config = dict(config, moesaic_demo={"random_weights": True, "seed": 0, "version": DEMO_VERSION, "name": name})
    family = importlib.import_module(FAMILIES[config["model_type"]])
    cfg = family.parse_config(config)
    specs = family.tensor_specs(cfg)
    native = quant is not None and config["model_type"] == "mistral4"
    naming = family.native_naming(cfg) if native else family.namings(cfg, "hf", [])
    tensors = to_checkpoint(specs, naming, random_tensors(specs, seed=0))
    if quant:
        tensors, config["quantization_config"] = quantize_checkpoint(tensors, *quant)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".demo-"))
    if native:  # params.json carries what the native layout cannot say (demo marker, byte tokenizer)
        params = dict(family.params_json(config), quantization_config=config["quantization_config"],
                      moesaic_tokenizer="bytes", moesaic_demo=config["moesaic_demo"])
        save_safetensors(tensors, tmp / "consolidated.safetensors")
        (tmp / "params.json").write_text(json.dumps(params, indent=1))
    else:
        save_safetensors(tensors, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
    try:
        tmp.rename(path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def is_demo(raw_config: dict) -> bool:
    return bool((raw_config.get("moesaic_demo") or {}).get("random_weights"))

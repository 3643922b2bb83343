"""The built-in demo model: a tiny Mistral-Small-4-shaped checkpoint with RANDOM weights from a
fixed seed and a byte-level tokenizer, written on first use into a cache folder. It exercises the
whole engine without downloading anything; its text is noise, and it says so."""

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
    "moesaic_demo": {"random_weights": True, "seed": 0, "version": DEMO_VERSION},
}


def cache_dir() -> Path:
    return Path(os.environ.get("MOESAIC_CACHE", Path.home() / ".cache" / "moesaic"))


def demo_path() -> Path:
    return cache_dir() / f"demo-mistral4-v{DEMO_VERSION}"


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


def ensure_demo() -> Path:
    """The demo checkpoint folder, written (atomically) the first time."""
    path = demo_path()
    if (path / "model.safetensors").exists():
        return path
    from .models import mistral4
    from .weights.store import save_safetensors

    cfg = mistral4.parse_config(DEMO_CONFIG)
    tensors = random_tensors(mistral4.tensor_specs(cfg), seed=DEMO_CONFIG["moesaic_demo"]["seed"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".demo-"))
    save_safetensors(tensors, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=1))
    try:
        tmp.rename(path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def is_demo(raw_config: dict) -> bool:
    return bool((raw_config.get("moesaic_demo") or {}).get("random_weights"))

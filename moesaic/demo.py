"""The built-in demo models: tiny checkpoints of each family with RANDOM weights from a fixed seed
and a byte-level tokenizer, written on first use into a cache folder in the family's release
naming and, for the quantized ones, its release's quantized formats. They exercise the whole engine
without downloading anything; their text is noise, and they say so. `demo` (the default model) is
Mistral-Small-4-shaped."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

DEMO_NAME = "demo"
DEMO_VERSION = 2  # 2: the V4.1 demo in the release layout (fp4 experts, fp8 Engram rows)
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
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "moesaic_tokenizer": "bytes",
}


NEMOTRON_DEMO_CONFIG = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 259,
    "hidden_size": 128,
    "layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "moesaic_tokenizer": "bytes",
}

from .models import deepseek_v4 as _v4  # noqa: E402  (the families' release-shaped demo configs)
from .models import deepseek_v41 as _v41  # noqa: E402
from .models import glm5next as _glm  # noqa: E402
from .models import kimi_k3 as _k3  # noqa: E402
from .models import kimi_linear as _kl  # noqa: E402


class Demo(NamedTuple):
    """A demo: its config.json; what of its release naming is quantized and how, as (regex of release
    tensor names, writer format) pairs (several where the release mixes formats); and `write(folder,
    config)`, the family's own checkpoint writer, where the release has a layout the pairs cannot say."""

    config: dict
    quant: tuple[tuple[str, str], ...] = ()
    write: Callable | None = None


def demo_entry(entry) -> Demo:
    """A DEMOS entry as a Demo; a plain (config, quant) tuple may give quant as one pair or None."""
    d = Demo(*entry)
    quant = (
        ()
        if not d.quant
        else (tuple(d.quant),)
        if isinstance(d.quant[0], str)
        else tuple(map(tuple, d.quant))
    )
    return d._replace(quant=quant)


GLM_EXPERTS_NVFP4 = (
    r"model\.language_model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.\w+_proj\.weight",
    "nvfp4",
)
DSV4_DENSE_FP8 = (
    r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight",
    "fp8-deepseek",
)
DSV4_EXPERTS_FP4 = (r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight", "fp4-deepseek")

DEMOS: dict[str, Demo] = {
    "demo": Demo(DEMO_CONFIG),
    # Mistral's NVFP4 release is in its native layout (params.json + consolidated, per-expert tensors)
    "demo-mistral4-nvfp4": Demo(
        DEMO_CONFIG, [(r"layers\.\d+\.(experts\.\d+|shared_experts)\.w[123]\.weight", "nvfp4")]
    ),
    "demo-nemotron-h": Demo(NEMOTRON_DEMO_CONFIG),
    "demo-nemotron-h-nvfp4": Demo(
        NEMOTRON_DEMO_CONFIG,
        [(r"backbone\.layers\.\d+\.mixer\.(experts\.\d+|shared_experts)\.\w+\.weight", "nvfp4-modelopt")],
    ),
    "demo-kimi-k3": Demo(_k3.DEMO_CONFIG),
    "demo-kimi-k3-mxfp4": Demo(
        _k3.DEMO_CONFIG, [_k3.MXFP4_EXPERTS]
    ),  # the release's compressed-tensors MXFP4 experts
    # GLM-5.3-Flash as its NVFP4 release: compressed-tensors NVFP4 routed and shared experts, the rest bf16
    "demo-glm5-next-nvfp4": Demo(_glm.DEMO_CONFIG, [GLM_EXPERTS_NVFP4]),
    # DeepSeek-V4-Flash as released: dense attention and shared experts fp8 E4M3 with fp32 128x128 `.scale`
    # blocks, routed experts fp4 (E2M1 in I8 + E8M0 `.scale` per 32), the MTP block likewise
    "demo-deepseek-v4": Demo(_v4.DEMO_CONFIG, [DSV4_DENSE_FP8, DSV4_EXPERTS_FP4]),
    "demo-kimi-linear": Demo(_kl.DEMO_CONFIG),
    # DeepSeek-V4.1 (Engram, shared KV/index sources, candidate blocks) as released: dense fp8 E4M3 + UE8M0
    # 32x32 `.scale` blocks, routed experts fp4, Engram tables fp8 rows (deepseek_v41.write_checkpoint)
    "demo-deepseek-v41": Demo(
        _v41.DEMO_CONFIG,
        [(_v41.DENSE_FP8, "fp8-ue8m0"), (_v41.EXPERTS_FP4, "fp4-deepseek")],
        lambda folder, config: _v41.write_checkpoint(folder, config, quantized=True),
    ),
}

# The release naming where the one a family reads from a folder without tensors (`namings(cfg, "hf", [])`)
# is another: GLM-5.3's multimodal `model.language_model.*`, DeepSeek-V4's upstream `embed.weight`,
# `layers.N.attn.*` (not transformers' `model.layers.N.*`)
RELEASE_NAMINGS: dict[str, Callable] = {
    "glm5_next": lambda cfg: _glm.checkpoint_naming(),
    "deepseek_v4": lambda cfg: _v4.checkpoint_naming(upstream=True),
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


def hash_table(vocab: int, k: int, experts: int) -> torch.Tensor:
    """A valid hash routing table [vocab, k] (token -> k distinct experts), int64 as released."""
    return (torch.arange(vocab)[:, None] * 3 + torch.arange(k)[None, :]) % experts


def ensure_demo(name: str = DEMO_NAME) -> Path:
    """The demo checkpoint folder `name` (one of DEMOS), written (atomically) the first time, in the
    release naming of its family and, for the quantized ones, the release's quantized formats."""
    path = demo_path(name)
    if (path / "config.json").exists() or (path / "params.json").exists():
        return path
    demo = demo_entry(DEMOS[name])
    config = dict(
        demo.config, moesaic_demo={"random_weights": True, "seed": 0, "version": DEMO_VERSION, "name": name}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".demo-"))
    if demo.write is not None:
        demo.write(tmp, config)
    else:
        _write(tmp, config, demo.quant)
    try:
        tmp.rename(path)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write(folder: Path, config: dict, quant) -> None:
    """Random weights (seed 0) in the family's release naming, the `quant` pairs applied in order."""
    import importlib

    from .config import FAMILIES
    from .weights.contract import to_checkpoint
    from .weights.store import save_safetensors
    from .weights.writers import quantize_checkpoint

    model_type = config["model_type"]
    family = importlib.import_module(FAMILIES[model_type])
    cfg = family.parse_config(config)
    specs = family.tensor_specs(cfg)
    native = bool(quant) and model_type == "mistral4"
    if native:
        naming = family.native_naming(cfg)
    elif model_type in RELEASE_NAMINGS:
        naming = RELEASE_NAMINGS[model_type](cfg)
    else:
        naming = family.namings(cfg, "hf", [])
    weights = random_tensors(specs, seed=0)
    for s in specs:
        if s.integer:  # DeepSeek-V4's hash routing
            weights[s.name] = hash_table(*s.shape, cfg.n_routed_experts)
    tensors = to_checkpoint(specs, naming, weights)
    for regex, fmt in quant:
        tensors, qc = quantize_checkpoint(tensors, regex, fmt)
        config.setdefault(
            "quantization_config", qc
        )  # the first pair's; the formats are read from the tensors
    if native:  # params.json carries what the native layout cannot say (demo marker, byte tokenizer)
        params = dict(
            family.params_json(config),
            quantization_config=config["quantization_config"],
            moesaic_tokenizer="bytes",
            moesaic_demo=config["moesaic_demo"],
        )
        save_safetensors(tensors, folder / "consolidated.safetensors")
        (folder / "params.json").write_text(json.dumps(params, indent=1))
    else:
        save_safetensors(tensors, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config, indent=1))


def is_demo(raw_config: dict) -> bool:
    return bool((raw_config.get("moesaic_demo") or {}).get("random_weights"))

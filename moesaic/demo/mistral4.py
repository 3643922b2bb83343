"""Mistral Small 4 demos: a tiny Mistral-Small-4-shaped model (byte tokenizer + the chat markers) (transformers layout; the NVFP4 one in
Mistral's native layout, as that release is: params.json + consolidated, per-expert tensors)."""

from . import Demo, chat_tokens

DEMO_CONFIG = {
    "model_type": "mistral4",
    "architectures": ["Mistral4ForCausalLM"],
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
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "moesaic_tokenizer": "bytes",
    **chat_tokens("mistral4"),  # vocab 259 + its chat markers, eos_token_id
}

DEMOS = {
    "demo-mistral4": Demo(DEMO_CONFIG),
    "demo-mistral4-nvfp4": Demo(
        DEMO_CONFIG, ((r"layers\.\d+\.(experts\.\d+|shared_experts)\.w[123]\.weight", "nvfp4"),)
    ),
}

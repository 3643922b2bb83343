"""Kimi Linear demo: the tiny model of tests/test_kimi_linear.py (the byte tokenizer and
the chat markers) as the
release's config.json states it (transformers' field names, 1-based `linear_attn_config` lists)."""

from . import Demo, chat_tokens

DEMO_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 2,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "model_max_length": 4096,
    "linear_attn_config": {
        "num_heads": 2,
        "head_dim": 8,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "pad_token_id": 0,
    "moesaic_tokenizer": "bytes",
    **chat_tokens("kimi_linear"),  # vocab 259 + its chat markers, eos_token_id
}

DEMOS = {"demo-kimi-linear": Demo(DEMO_CONFIG)}

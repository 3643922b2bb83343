"""DeepSeek-V4-Flash demos: the tiny model of tests/test_deepseek_v4.py (the byte tokenizer and
the chat markers)
as the release's config.json states it (`compress_ratios` per layer plus the MTP slot, `num_hash_layers`,
`rope_scaling`), with the tiny HCA rate 8 in transformers' `compress_rates`. Widths are multiples of 32, so
the experts take DeepSeek's fp4."""

from ..models.deepseek_v4 import CSA, HCA
from . import Demo, chat_tokens

DEMO_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.0,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 8, 4, 0],
    "compress_rates": {CSA: 4, HCA: 8},
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "pad_token_id": 0,
    "moesaic_tokenizer": "bytes",
    **chat_tokens("deepseek_v4"),  # vocab 259 + its chat markers, eos_token_id
}

# as released: dense attention and shared experts fp8 E4M3 with fp32 128x128 `.scale` blocks, routed experts
# fp4 (E2M1 in I8 + E8M0 `.scale` per 32), the MTP block likewise
DENSE_FP8 = (
    r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight",
    "fp8-deepseek",
)
EXPERTS_FP4 = (r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight", "fp4-deepseek")

DEMOS = {"demo-deepseek-v4": Demo(DEMO_CONFIG, (DENSE_FP8, EXPERTS_FP4))}

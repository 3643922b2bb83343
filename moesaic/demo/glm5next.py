"""GLM-5.3-Flash demos: the tiny text model of tests/test_glm5next.py (the byte tokenizer and
the chat markers) in
the release's config.json layout (the multimodal wrapper; no vision tower is written), with its MTP layer.
Widths are multiples of 16, so the experts take NVFP4."""

from . import Demo, chat_tokens

CHAT = chat_tokens("glm5_next")  # vocab 259 + the chat markers, eos_token_id

DEMO_CONFIG = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "text_config": {
        "model_type": "glm5_next_text",
        "vocab_size": CHAT["vocab_size"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        "indexer_types": ["full", "full", "shared", "full"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 0,
        "v_head_dim": 32,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 1.0,
        "index_topk": 8,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_kpool": 4,
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hc_mult": 4,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": CHAT["eos_token_id"],
        "pad_token_id": 0,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": CHAT["eos_token_id"],
    "pad_token_id": 0,
    "moesaic_tokenizer": "bytes",
    "moesaic_special_tokens": CHAT["moesaic_special_tokens"],
}

# the NVFP4 release: compressed-tensors NVFP4 routed and shared experts, the rest bf16
EXPERTS_NVFP4 = (
    r"model\.language_model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.\w+_proj\.weight",
    "nvfp4",
)

DEMOS = {"demo-glm5-next-nvfp4": Demo(DEMO_CONFIG, (EXPERTS_NVFP4,))}

"""Nemotron-H demos: a tiny hybrid (Mamba-2, MoE, GQA attention, dense MLP) with one MTP block (attention,
then MoE: the default `*E` block of `mtp_layers_block_type`); the NVFP4 one in ModelOpt's
layout, as NVIDIA's releases are."""

from . import Demo, chat_tokens

DEMO_CONFIG = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
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
    "num_nextn_predict_layers": 1,
    "mtp_layers_block_type": ["attention", "moe"],
    "bos_token_id": 1,
    "pad_token_id": 0,
    "moesaic_tokenizer": "bytes",
    **chat_tokens("nemotron_h"),  # vocab 259 + its chat markers, eos_token_id
}

DEMOS = {
    "demo-nemotron-h": Demo(DEMO_CONFIG),
    "demo-nemotron-h-nvfp4": Demo(
        DEMO_CONFIG,
        ((r"backbone\.layers\.\d+\.mixer\.(experts\.\d+|shared_experts)\.\w+\.weight", "nvfp4-modelopt"),),
    ),
}

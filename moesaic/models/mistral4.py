"""Mistral Small 4 (`mistral4`): MLA attention with interleaved YaRN rope + softmax-routed MoE.

Math and pitfalls: shared/reference/mistral4_nemotron.md, Part A. Oracle: transformers `mistral4`.

Checkpoint namings read here:
* transformers (`config.json`, as `save_pretrained` writes it): `model.layers.L.self_attn.q_a_proj.weight`,
  fused experts `mlp.experts.gate_up_proj [E, 2I, d]` / `mlp.experts.down_proj [E, d, I]`; multimodal
  releases put the text model under `model.language_model.`.
* Mistral native (`params.json` + `consolidated*.safetensors`): `layers.N.attention.wq_a.weight`,
  per-expert `layers.N.experts.E.w1|w3|w2.weight`. The mapping and the params.json keys follow
  transformers' own converter `src/transformers/models/mistral4/convert_mistral4_weight_to_hf.py`
  (its rename table and `EXPERT_KEY_PATTERN`; it copies `wq_b`/`wkv_a_with_mqa` unpermuted, so native
  rope rows are already in the interleaved layout `rope_interleave=True` expects) and vLLM's
  `vllm/model_executor/models/mistral_large_3.py` + `vllm/transformers_utils/configs/mistral.py`
  (Mistral Large 3 uses the same scheme; `moe.*` and `yarn.*` keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.batch import ForwardBatch
from ..cache.state import SequenceState, TokenRows
from ..config import eos_ids, field, positive
from ..errors import ConfigError
from ..layers import mla
from ..layers.linear import linear
from ..layers.moe import glu_mlp, route_softmax, run_experts, swiglu
from ..layers.norms import rms_norm
from ..layers.rope import (
    RopeConfig,
    cos_sin,
    cos_sin_attention_factor,
    inv_freq,
    rope_half,
    rope_interleaved,
    yarn_mscale,
)
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs

MODEL_TYPES = ("mistral4",)


@dataclass(frozen=True)
class Mistral4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool
    llama4_beta: float  # llama-4 query scaling; 0 disables it
    llama4_original_max: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = "mistral4"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.kind != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def parse_config(raw: dict, layout: str = "hf") -> Mistral4Config:
    """Absent fields take transformers' `Mistral4Config` defaults (= the released Small 4 shape)."""
    if layout == "mistral":
        raw = _from_params_json(raw)
    w = "config.json" if layout == "hf" else "params.json"
    rp = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "rope_theta" not in rp and "rope_theta" in raw:
        rp["rope_theta"] = raw["rope_theta"]
    if not rp:
        rp = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 128.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        }
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{w}: rope_parameters.rope_type {kind!r} is not supported (yarn or default)")
    rw = f"{w} rope_parameters"
    rope_dim = field(
        raw,
        "qk_rope_head_dim",
        int,
        64,
        where=w,
        check=lambda v: v > 0 and v % 2 == 0,
        why="must be a positive even number",
    )
    rope = RopeConfig(
        dim=rope_dim,
        theta=field(rp, "rope_theta", float, 10000.0, where=rw, check=positive),
        kind=kind,
        factor=field(rp, "factor", float, 1.0, where=rw, check=positive),
        original_max_position_embeddings=field(
            rp, "original_max_position_embeddings", int, 8192, where=rw, check=positive
        ),
        beta_fast=field(rp, "beta_fast", float, 32.0, where=rw),
        beta_slow=field(rp, "beta_slow", float, 1.0, where=rw),
        mscale=field(rp, "mscale", float, 1.0, where=rw),
        mscale_all_dim=field(rp, "mscale_all_dim", float, 0.0, where=rw),
        truncate=field(rp, "truncate", bool, True, where=rw),
    )
    act = field(raw, "hidden_act", str, "silu", where=w)
    if act not in ("silu", "swish"):
        raise ConfigError(
            f"{w}: field 'hidden_act' has unsupported value {act!r} (Mistral Small 4 uses silu)"
        )
    if raw.get("attention_bias"):
        raise ConfigError(
            f"{w}: field 'attention_bias' = true is not supported (the released model has no biases)"
        )
    if field(raw, "moe_layer_freq", int, 1, where=w) != 1:
        raise ConfigError(
            f"{w}: field 'moe_layer_freq' must be 1 (every layer after the dense prefix is MoE)"
        )
    heads = field(raw, "num_attention_heads", int, 32, where=w, check=positive)
    experts = field(raw, "n_routed_experts", int, 128, where=w, check=positive)
    n_group = field(raw, "n_group", int, 1, where=w, check=positive)
    if experts % n_group:
        raise ConfigError(f"{w}: field 'n_group' = {n_group} must divide n_routed_experts = {experts}")
    q_lora = raw.get("q_lora_rank", 1024)  # an explicit null selects the plain q_proj
    cfg = Mistral4Config(
        vocab_size=field(raw, "vocab_size", int, 131072, where=w, check=positive),
        hidden_size=field(raw, "hidden_size", int, 4096, where=w, check=positive),
        num_hidden_layers=field(raw, "num_hidden_layers", int, 36, where=w, check=positive),
        num_attention_heads=heads,
        q_lora_rank=None
        if q_lora is None
        else field({"q_lora_rank": q_lora}, "q_lora_rank", int, where=w, check=positive),
        kv_lora_rank=field(raw, "kv_lora_rank", int, 256, where=w, check=positive),
        qk_nope_head_dim=field(raw, "qk_nope_head_dim", int, 64, where=w, check=positive),
        qk_rope_head_dim=rope_dim,
        v_head_dim=field(raw, "v_head_dim", int, 128, where=w, check=positive),
        intermediate_size=field(raw, "intermediate_size", int, 12288, where=w, check=lambda v: v >= 0),
        moe_intermediate_size=field(raw, "moe_intermediate_size", int, 2048, where=w, check=positive),
        n_routed_experts=experts,
        num_experts_per_tok=field(
            raw,
            "num_experts_per_tok",
            int,
            4,
            where=w,
            check=lambda v: 0 < v <= experts,
            why=f"must be in 1..n_routed_experts={experts}",
        ),
        n_shared_experts=field(raw, "n_shared_experts", int, 1, where=w, check=lambda v: v >= 0),
        first_k_dense_replace=field(raw, "first_k_dense_replace", int, 0, where=w, check=lambda v: v >= 0),
        n_group=n_group,
        topk_group=field(
            raw,
            "topk_group",
            int,
            1,
            where=w,
            check=lambda v: 0 < v <= n_group,
            why=f"must be in 1..n_group={n_group}",
        ),
        norm_topk_prob=field(raw, "norm_topk_prob", bool, True, where=w),
        routed_scaling_factor=field(raw, "routed_scaling_factor", float, 1.0, where=w),
        rms_norm_eps=field(raw, "rms_norm_eps", float, 1e-6, where=w, check=positive),
        max_position_embeddings=field(raw, "max_position_embeddings", int, 1048576, where=w, check=positive),
        rope=rope,
        rope_interleave=field(raw, "rope_interleave", bool, True, where=w),
        llama4_beta=field(rp, "llama_4_scaling_beta", float, 0.0, where=rw),
        llama4_original_max=rope.original_max_position_embeddings,
        tie_word_embeddings=field(raw, "tie_word_embeddings", bool, False, where=w),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids(raw.get("eos_token_id", 2)),
    )
    if cfg.first_k_dense_replace > 0 and cfg.intermediate_size <= 0:
        raise ConfigError(f"{w}: field 'intermediate_size' must be positive when first_k_dense_replace > 0")
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise ConfigError(
            f"{w}: field 'first_k_dense_replace' = {cfg.first_k_dense_replace} exceeds num_hidden_layers"
        )
    return cfg


def _from_params_json(p: dict) -> dict:
    """Mistral native params.json -> the transformers field names (keys as the converter reads them)."""
    moe = p.get("moe") or {}
    yarn = p.get("yarn")
    l4 = p.get("llama_4_scaling") or {}
    need = [
        "dim",
        "n_layers",
        "n_heads",
        "vocab_size",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    ]
    for k in need:
        if k not in p:
            raise ConfigError(f"params.json: required field {k!r} is missing")
    if not moe:
        raise ConfigError("params.json: required field 'moe' is missing (Mistral Small 4 is a MoE model)")
    raw = {
        "vocab_size": p["vocab_size"],
        "hidden_size": p["dim"],
        "num_hidden_layers": p["n_layers"],
        "num_attention_heads": p["n_heads"],
        "num_key_value_heads": p.get("n_kv_heads", p["n_heads"]),
        "q_lora_rank": p.get("q_lora_rank"),
        "kv_lora_rank": p["kv_lora_rank"],
        "qk_nope_head_dim": p["qk_nope_head_dim"],
        "qk_rope_head_dim": p["qk_rope_head_dim"],
        "v_head_dim": p["v_head_dim"],
        "intermediate_size": p.get("hidden_dim", 0),
        "rms_norm_eps": p.get("norm_eps", 1e-6),
        "tie_word_embeddings": p.get("tied_embeddings", False),
        "max_position_embeddings": p.get("max_position_embeddings", p.get("max_seq_len", 1048576)),
        "hidden_act": p.get("activation", "silu"),
        "n_routed_experts": moe.get("num_experts"),
        "num_experts_per_tok": moe.get("num_experts_per_tok"),
        "moe_intermediate_size": moe.get("expert_hidden_dim"),
        "n_shared_experts": moe.get("num_shared_experts", 0),
        "first_k_dense_replace": moe.get("first_k_dense_replace", 0),
        "routed_scaling_factor": moe.get("routed_scale", 1.0),
        "n_group": moe.get("num_expert_groups", 1),
        "topk_group": moe.get("num_expert_groups_per_tok", 1),
        "moe_layer_freq": moe.get("route_every_n", 1),
        "norm_topk_prob": True,
        "bos_token_id": p.get("bos_token_id", 1),
        "eos_token_id": p.get("eos_token_id", 2),
    }
    theta = p.get("rope_theta", 10000.0)
    if yarn:
        # The converter fixes mscale = mscale_all_dim = 1 (the softmax-scale correction of YaRN).
        raw["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": yarn.get("factor"),
            "original_max_position_embeddings": yarn.get("original_max_position_embeddings"),
            "beta_fast": yarn.get("beta", 32.0),
            "beta_slow": yarn.get("alpha", 1.0),
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": l4.get("beta", 0.0),
        }
    else:
        raw["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": theta,
            "llama_4_scaling_beta": l4.get("beta", 0.0),
        }
        if l4:
            raw["rope_parameters"]["original_max_position_embeddings"] = l4.get(
                "original_max_position_embeddings", 8192
            )
    return raw


# ---------------------------------------------------------------- tensor contract


def tensor_specs(cfg: Mistral4Config) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding")]
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}."
        a = p + "self_attn."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (d,), "norm", L),
            TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", L),
        ]
        specs += mla.mla_specs(a, cfg, L)
        m = p + "mlp."
        if cfg.is_moe(L):
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            specs += [
                TensorSpec(m + "gate.weight", (E, d), "router", L),
                TensorSpec(m + "experts.gate_up_proj", (E, 2 * I, d), "expert", L),
                TensorSpec(m + "experts.down_proj", (E, d, I), "expert", L),
            ]
            if cfg.n_shared_experts:
                S = I * cfg.n_shared_experts
                specs += [
                    TensorSpec(m + "shared_experts.gate_proj.weight", (S, d), "shared_expert", L),
                    TensorSpec(m + "shared_experts.up_proj.weight", (S, d), "shared_expert", L),
                    TensorSpec(m + "shared_experts.down_proj.weight", (d, S), "shared_expert", L),
                ]
        else:
            I = cfg.intermediate_size
            specs += [
                TensorSpec(m + "gate_proj.weight", (I, d), "mlp", L),
                TensorSpec(m + "up_proj.weight", (I, d), "mlp", L),
                TensorSpec(m + "down_proj.weight", (d, I), "mlp", L),
            ]
    specs.append(TensorSpec("model.norm.weight", (d,), "norm"))
    specs.append(
        TensorSpec("lm_head.weight", (cfg.vocab_size, d), "lm_head", optional=cfg.tie_word_embeddings)
    )
    return specs


_VISION_HF = [
    r"model\.vision_tower\..*",
    r"model\.multi_modal_projector\..*",
    r"vision_tower\..*",
    r"multi_modal_projector\..*",
]
_VISION_NATIVE = [
    r"vision_encoder\..*",
    r"vision_language_adapter\..*",
    r"patch_merger\..*",
    r"pre_mm_projector_norm\..*",
]


def hf_naming(text_prefix: str = "model.") -> Naming:
    """transformers names; `text_prefix` is `model.language_model.` in multimodal releases."""

    def source(spec: TensorSpec) -> Source:
        name = spec.name if not spec.name.startswith("model.") else text_prefix + spec.name[len("model.") :]
        return direct(name, spec.shape)

    return Naming(f"transformers ({text_prefix}*)", source, _VISION_HF)


_NATIVE_ATTN = {
    "q_proj": "wq",
    "q_a_proj": "wq_a",
    "q_a_layernorm": "q_a_norm",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a_with_mqa",
    "kv_a_layernorm": "kv_a_norm",
    "kv_b_proj": "wkv_b",
    "o_proj": "wo",
}
_NATIVE_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def native_naming(cfg: Mistral4Config) -> Naming:
    """Mistral's consolidated names (see the module docstring for the sources)."""
    top = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }

    def source(spec: TensorSpec) -> Source:
        if spec.name in top:
            return direct(top[spec.name], spec.shape)
        parts = spec.name.split(".")  # model.layers.L.<block>.<...>
        L, rest = parts[2], parts[3:]
        p = f"layers.{L}."
        if rest[0] == "input_layernorm":
            return direct(p + "attention_norm.weight", spec.shape)
        if rest[0] == "post_attention_layernorm":
            return direct(p + "ffn_norm.weight", spec.shape)
        if rest[0] == "self_attn":
            return direct(p + f"attention.{_NATIVE_ATTN[rest[1]]}.weight", spec.shape)
        # mlp.*
        if rest[1] == "gate":
            return direct(p + "gate.weight", spec.shape)
        if rest[1] == "shared_experts":
            return direct(p + f"shared_experts.{_NATIVE_MLP[rest[2]]}.weight", spec.shape)
        if rest[1] == "experts":
            E = spec.shape[0]
            ex = [f"{p}experts.{e}." for e in range(E)]
            if rest[2] == "gate_up_proj":
                half = (spec.shape[1] // 2, spec.shape[2])
                return stacked_pairs([x + "w1.weight" for x in ex], [x + "w3.weight" for x in ex], half)
            return stacked([x + "w2.weight" for x in ex], spec.shape[1:])
        return direct(p + f"feed_forward.{_NATIVE_MLP[rest[1]]}.weight", spec.shape)

    return Naming("Mistral native", source, _VISION_NATIVE)


def namings(cfg: Mistral4Config, layout: str, store_names) -> Naming:
    if layout == "mistral":
        return native_naming(cfg)
    names = set(store_names)
    if "model.language_model.embed_tokens.weight" in names:
        return hf_naming("model.language_model.")
    return hf_naming("model.")


# ---------------------------------------------------------------- model


class Model:
    """The Mistral Small 4 decoder over a ForwardBatch."""

    def __init__(self, cfg: Mistral4Config, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        t = tensors
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.layers = []
        for L in range(cfg.num_hidden_layers):
            p = f"model.layers.{L}."
            self.layers.append({k[len(p) :]: v for k, v in t.items() if k.startswith(p)})
        self.freqs = inv_freq(cfg.rope).to(device)
        self.rope_factor = cos_sin_attention_factor(cfg.rope)
        self.rope_fn = rope_interleaved if cfg.rope_interleave else rope_half

    # -- state
    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """Latent rows per layer; rows roll back exactly at any depth, so the window needs nothing."""
        c = self.cfg
        widths = {"latent": c.kv_lora_rank, "k_rope": c.qk_rope_head_dim}
        return SequenceState(
            [
                TokenRows(widths, self.dtype, self.device, c.max_position_embeddings)
                for _ in range(c.num_hidden_layers)
            ]
        )

    # -- blocks
    def attention(
        self, L: int, w: dict, x: torch.Tensor, batch: ForwardBatch, cos, sin, qscale
    ) -> torch.Tensor:
        c = self.cfg
        q_nope, q_rope, latent, k_rope = mla.mla_project(x, w, c)
        k_rope = self.rope_fn(k_rope[:, None], cos, sin)[:, 0]
        q_rope = self.rope_fn(q_rope, cos, sin)
        if qscale is not None:
            q_nope, q_rope = q_nope * qscale, q_rope * qscale
        out = mla.mla_batch(
            L,
            batch,
            q_nope,
            q_rope,
            latent,
            k_rope,
            w["self_attn.kv_b_proj.weight"],
            c.v_head_dim,
            c.softmax_scale,
        )
        return linear(out.flatten(1), w["self_attn.o_proj.weight"])

    def mlp(self, L: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if not c.is_moe(L):
            return glu_mlp(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
        logits = linear(x, w["mlp.gate.weight"])
        weights, ids = route_softmax(
            logits, c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor
        )
        out = run_experts(x, weights, ids, w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"], swiglu)
        if c.n_shared_experts:
            s = "mlp.shared_experts."
            out = out + glu_mlp(
                x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]
            )
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        h = F.embedding(batch.token_ids, self.embed)
        cos, sin = cos_sin(self.freqs, batch.positions, self.rope_factor)
        qscale = None
        if c.llama4_beta and int(batch.positions.max()) >= c.llama4_original_max:
            s = 1 + c.llama4_beta * torch.log1p(torch.floor(batch.positions.float() / c.llama4_original_max))
            qscale = s.to(h.dtype)[:, None, None]
        for L, w in enumerate(self.layers):
            h = h + self.attention(
                L, w, rms_norm(h, w["input_layernorm.weight"], c.rms_norm_eps), batch, cos, sin, qscale
            )
            h = h + self.mlp(L, w, rms_norm(h, w["post_attention_layernorm.weight"], c.rms_norm_eps))
        batch.finish()
        h = rms_norm(h[batch.logit_rows], self.norm, c.rms_norm_eps)
        return linear(h, self.lm_head).float()


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: Mistral4Config) -> list[str]:
    return ["mla+moe" if cfg.is_moe(L) else "mla+mlp" for L in range(cfg.num_hidden_layers)]


def state_bytes(cfg: Mistral4Config, dtype_bytes: int) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence): the latent and the shared rope key per layer."""
    return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes, 0


def max_context(cfg: Mistral4Config) -> int:
    return cfg.max_position_embeddings


def facts(cfg: Mistral4Config) -> dict:
    d, I = cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_params": 3 * d * I,
        "expert_bytes_bf16": 3 * d * I * 2,
    }


def params_json(raw: dict) -> dict:
    """A transformers `mistral4` config dict written as Mistral's native params.json (the inverse of
    `_from_params_json`; used by checkpoint writers)."""
    rp = raw.get("rope_parameters") or {}
    p = {
        "dim": raw["hidden_size"],
        "n_layers": raw["num_hidden_layers"],
        "n_heads": raw["num_attention_heads"],
        "n_kv_heads": raw.get("num_key_value_heads", raw["num_attention_heads"]),
        "head_dim": raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"],
        "hidden_dim": raw.get("intermediate_size", 0),
        "vocab_size": raw["vocab_size"],
        "norm_eps": raw.get("rms_norm_eps", 1e-6),
        "q_lora_rank": raw.get("q_lora_rank"),
        "kv_lora_rank": raw["kv_lora_rank"],
        "qk_nope_head_dim": raw["qk_nope_head_dim"],
        "qk_rope_head_dim": raw["qk_rope_head_dim"],
        "v_head_dim": raw["v_head_dim"],
        "tied_embeddings": raw.get("tie_word_embeddings", False),
        "max_position_embeddings": raw.get("max_position_embeddings", 1048576),
        "rope_theta": rp.get("rope_theta", 10000.0),
        "moe": {
            "num_experts": raw["n_routed_experts"],
            "num_experts_per_tok": raw["num_experts_per_tok"],
            "expert_hidden_dim": raw["moe_intermediate_size"],
            "num_shared_experts": raw.get("n_shared_experts", 0),
            "first_k_dense_replace": raw.get("first_k_dense_replace", 0),
            "routed_scale": raw.get("routed_scaling_factor", 1.0),
            "num_expert_groups": raw.get("n_group", 1),
            "num_expert_groups_per_tok": raw.get("topk_group", 1),
            "route_every_n": 1,
        },
    }
    if rp.get("rope_type", rp.get("type")) == "yarn":
        p["yarn"] = {
            "factor": rp["factor"],
            "original_max_position_embeddings": rp["original_max_position_embeddings"],
            "beta": rp.get("beta_fast", 32.0),
            "alpha": rp.get("beta_slow", 1.0),
            "apply_scale": False,
        }
    if rp.get("llama_4_scaling_beta"):
        p["llama_4_scaling"] = {
            "beta": rp["llama_4_scaling_beta"],
            "original_max_position_embeddings": rp.get("original_max_position_embeddings", 8192),
        }
    return p


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg) -> tuple[str, ...]:
    return ()


def build(cfg, tensors, dtype, device, folder):
    return Model(cfg, tensors.all(), dtype, device)

"""Mistral Small 4 (`mistral4`): MLA attention with interleaved YaRN rope + softmax-routed MoE.

Layer schedule, state and proof: docs/families.md. Oracle: transformers `mistral4`.

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
from functools import cached_property

import torch

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import SequenceState, TokenRows
from ..config import declared, eos_ids, field, non_negative, positive, read_config, require, section
from ..errors import ConfigError
from ..layers.linear import embedding, linear
from ..layers.mla import MlaWeights, mla_batch, mla_block, mla_project
from ..layers.moe import Mlp, MoeSpec, MoeWeights, Router, moe
from ..layers.norms import pre_norm_layers, rms_norm
from ..layers.rope import (
    RopeConfig,
    cos_sin,
    cos_sin_attention_factor,
    inv_freq,
    rope_half,
    rope_interleaved,
    yarn_mscale,
)
from ..weights.bind import Tensors
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs
from .parts import bind_mla, bind_mlp, bind_moe, mla_specs, mlp_specs, moe_specs

MODEL_TYPES = ("mistral4",)


@dataclass(frozen=True, kw_only=True)
class Mistral4Config:
    """Absent fields take transformers' `Mistral4Config` defaults (= the released Small 4 shape)."""

    vocab_size: int = declared(131072, check=positive)
    hidden_size: int = declared(4096, check=positive)
    num_hidden_layers: int = declared(36, check=positive)
    num_attention_heads: int = declared(32, check=positive)
    q_lora_rank: int | None = declared(1024, check=positive)  # an explicit null selects the plain q_proj
    kv_lora_rank: int = declared(256, check=positive)
    qk_nope_head_dim: int = declared(64, check=positive)
    qk_rope_head_dim: int = declared(
        64, check=lambda v: v > 0 and v % 2 == 0, why="must be a positive even number"
    )
    v_head_dim: int = declared(128, check=positive)
    intermediate_size: int = declared(12288, check=non_negative)
    moe_intermediate_size: int = declared(2048, check=positive)
    n_routed_experts: int = declared(128, check=positive)
    num_experts_per_tok: int = declared(4, check=positive)
    n_shared_experts: int = declared(1, check=non_negative)
    first_k_dense_replace: int = declared(0, check=non_negative)
    n_group: int = declared(1, check=positive)
    topk_group: int = declared(1, check=positive)
    norm_topk_prob: bool = declared(True)
    routed_scaling_factor: float = declared(1.0)
    rms_norm_eps: float = declared(1e-6, check=positive)
    max_position_embeddings: int = declared(1048576, check=positive)
    rope_interleave: bool = declared(True)
    tie_word_embeddings: bool = declared(False)
    bos_token_id: int | None = declared(None)
    rope: RopeConfig
    llama4_beta: float  # llama-4 query scaling; 0 disables it
    llama4_original_max: int
    eos_token_ids: tuple[int, ...]
    model_type: str = "mistral4"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @cached_property  # read by every attention call
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.kind != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def moe_spec(self) -> MoeSpec:
        return MoeSpec(
            Router(
                "softmax",
                self.num_experts_per_tok,
                self.n_group,
                self.topk_group,
                self.norm_topk_prob,
                self.routed_scaling_factor,
            )
        )


_RELEASE_ROPE = {
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


def parse_config(raw: dict, layout: str = "hf") -> Mistral4Config:
    if layout == "mistral":
        raw = _from_params_json(raw)
    w = "config.json" if layout == "hf" else "params.json"
    rp = dict(section(raw, "rope_parameters", w) or section(raw, "rope_scaling", w))
    if "rope_theta" not in rp and "rope_theta" in raw:
        rp["rope_theta"] = raw["rope_theta"]
    rp = rp or _RELEASE_ROPE
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
    rope = read_config(
        RopeConfig, rp, rw, {"original_max_position_embeddings": 8192}, dim=rope_dim, kind=kind
    )
    act = field(raw, "hidden_act", str, "silu", where=w)
    require(act in ("silu", "swish"), w, "hidden_act", act, "Mistral Small 4 uses silu")
    require(
        not raw.get("attention_bias"),
        w,
        "attention_bias",
        raw.get("attention_bias"),
        "the released model has no biases",
    )
    freq = field(raw, "moe_layer_freq", int, 1, where=w)
    require(freq == 1, w, "moe_layer_freq", freq, "every layer after the dense prefix is MoE")
    cfg = read_config(
        Mistral4Config,
        raw,
        w,
        rope=rope,
        llama4_beta=field(rp, "llama_4_scaling_beta", float, 0.0, where=rw),
        llama4_original_max=rope.original_max_position_embeddings,
        eos_token_ids=eos_ids(raw.get("eos_token_id", 2), w),
    )
    E, G = cfg.n_routed_experts, cfg.n_group
    require(E % G == 0, w, "n_group", G, f"must divide n_routed_experts = {E}")
    require(
        cfg.num_experts_per_tok <= E,
        w,
        "num_experts_per_tok",
        cfg.num_experts_per_tok,
        f"must be in 1..n_routed_experts={E}",
    )
    require(cfg.topk_group <= G, w, "topk_group", cfg.topk_group, f"must be in 1..n_group={G}")
    require(
        cfg.first_k_dense_replace == 0 or cfg.intermediate_size > 0,
        w,
        "intermediate_size",
        cfg.intermediate_size,
        "must be positive when first_k_dense_replace > 0",
    )
    require(
        cfg.first_k_dense_replace <= cfg.num_hidden_layers,
        w,
        "first_k_dense_replace",
        cfg.first_k_dense_replace,
        "exceeds num_hidden_layers",
    )
    return cfg


def _from_params_json(p: dict) -> dict:
    """Mistral native params.json -> the transformers field names (keys as the converter reads them)."""
    moe = section(p, "moe", "params.json")
    yarn = section(p, "yarn", "params.json")
    l4 = section(p, "llama_4_scaling", "params.json")
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
        specs += [
            TensorSpec(p + "input_layernorm.weight", (d,), "norm", L),
            TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", L),
        ]
        specs += mla_specs(p + "self_attn.", cfg, L)
        if cfg.is_moe(L):
            I = cfg.moe_intermediate_size
            specs += moe_specs(
                p + "mlp.", cfg.n_routed_experts, I, d, L, bias=False, shared=I * cfg.n_shared_experts
            )
        else:
            specs += mlp_specs(p + "mlp.", cfg.intermediate_size, d, "mlp", L)
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


@dataclass
class Layer:
    attn_norm: torch.Tensor
    attn: MlaWeights
    mlp_norm: torch.Tensor
    mlp: Mlp | MoeWeights


class Model:
    """The Mistral Small 4 decoder over a ForwardBatch."""

    # its state is MLA's paged rows only: a static decode step serves it (engine/graphs.py)
    graph_decode = True

    def __init__(self, cfg: Mistral4Config, t: Tensors, dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed = t("model.embed_tokens.weight")
        self.norm = t("model.norm.weight")
        self.lm_head = t.optional("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = self.embed
        self.layers = []
        for L in range(cfg.num_hidden_layers):
            w = t.under(f"model.layers.{L}.")
            mlp = bind_moe(w.under("mlp.")) if cfg.is_moe(L) else bind_mlp(w.under("mlp."))
            self.layers.append(
                Layer(
                    w("input_layernorm.weight"),
                    bind_mla(w.under("self_attn.")),
                    w("post_attention_layernorm.weight"),
                    mlp,
                )
            )
        self.moe = cfg.moe_spec
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
        self, L: int, w: MlaWeights, x: torch.Tensor, batch: ForwardBatch, cos, sin, qscale
    ) -> torch.Tensor:
        c = self.cfg
        if batch.paged is None:
            rope = (cos, sin, 0 if self.rope_fn is rope_interleaved else 1)
            if (y := mla_block(L, batch, x, w, c, rope, qscale=qscale)) is not None:
                return y
        q_nope, q_rope, latent, k_rope = mla_project(x, w, c)
        k_rope = self.rope_fn(k_rope[:, None], cos, sin)[:, 0]
        q_rope = self.rope_fn(q_rope, cos, sin)
        if qscale is not None:
            q_nope, q_rope = q_nope * qscale, q_rope * qscale
        out = mla_batch(L, batch, q_nope, q_rope, latent, k_rope, w.kv_b, c.v_head_dim, c.softmax_scale)
        return linear(out.flatten(1), w.o)

    def mlp(self, w: Mlp | MoeWeights, x: torch.Tensor) -> torch.Tensor:
        return moe(x, w, self.moe) if isinstance(w, MoeWeights) else w(x)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        h = embedding(batch.token_ids, self.embed)
        cos, sin = cos_sin(self.freqs, batch.positions, self.rope_factor)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)  # the rotation's rounding, done once, not per layer
        qscale = None
        if c.llama4_beta and batch.max_position >= c.llama4_original_max:
            s = 1 + c.llama4_beta * torch.log1p(torch.floor(batch.positions.float() / c.llama4_original_max))
            qscale = s.to(h.dtype)[:, None, None]
        layers = [
            [
                (w.attn_norm, lambda x, L=L, w=w: self.attention(L, w.attn, x, batch, cos, sin, qscale)),
                (w.mlp_norm, lambda x, w=w: self.mlp(w.mlp, x)),
            ]
            for L, w in enumerate(self.layers)
        ]
        h = pre_norm_layers(h, layers, c.rms_norm_eps, batch.tap)
        batch.finish()
        batch.tap(FINAL, h)
        h = rms_norm(h[batch.logit_rows], self.norm, c.rms_norm_eps)
        return linear(h, self.lm_head).float()


def build(cfg: Mistral4Config, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    return Model(cfg, tensors, dtype, device)


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: Mistral4Config) -> list[str]:
    return ["mla+moe" if cfg.is_moe(L) else "mla+mlp" for L in range(cfg.num_hidden_layers)]


def state_bytes(cfg: Mistral4Config, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence): the latent and the shared rope key per layer. Rows
    roll back for free, so the rollback window adds nothing."""
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


# ---------------------------------------------------------------- tensor parallelism (moesaic/parallel/plan.py)

# The config counts each of N ranks takes 1/N of, and how its attention tensors split (axis 0: output
# rows, 1: input columns; experts, MLPs, embedding and lm_head follow parallel/plan.py's common rules).
# MLA: per-head q, the latent's up-projection per head, o_proj by its input heads; the latent (kv_a) and
# q's LoRA down-projection are replicated.
TP_HEADS = ("num_attention_heads",)


def tp_plan(cfg: Mistral4Config) -> list:
    return [
        (r".*\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight", 0),
        (r".*\.self_attn\.o_proj\.weight", 1),
    ]

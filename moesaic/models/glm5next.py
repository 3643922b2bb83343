"""GLM-5.3-Flash (`glm5_next`, text model `glm5_next_text`): KDA + DSA mixers inside mHC residual
streams, clamped-SwiGLU dense and MoE FFNs, no positional embeddings anywhere.

    h = copies of embed(ids) in hc_mult streams                   # [N, n, d]
    for each layer:
        x, post, comb = mHC site (attention);  y = KDA or DSA (RMSNorm(x));  h = post ⊗ y + combᵀ h
        x, post, comb = mHC site (FFN);        y = MLP or MoE (RMSNorm(x));  h = post ⊗ y + combᵀ h
    logits = lm_head(RMSNorm(mean over the streams of h)).float()

Math, names and pitfalls: shared/reference/glm5next.md. Oracle: transformers 5.23 `glm5_next`.
Shared math: layers/kda.py, layers/dsa.py, layers/mhc.py, layers/moe.py.

Config. `config.json` is the multimodal wrapper (`model_type` glm5_next, text fields under
`text_config`) or a flat text config; both are read. The schedules follow transformers'
`Glm5NextTextConfig.__post_init__`: `layer_types` (`linear_attention` = KDA; `indexed_attention`,
and the aliases `full_attention` / `deepseek_sparse_attention` = DSA), default DSA at i % 4 == 3 (or
`linear_attn_config.full_attn_layers` when only that is given); `mlp_layer_types` (`dense` /
`sparse`), default `first_k_dense_replace` (3) dense; `indexer_types` (`full` / `shared`), else
`index_topk_pattern` (`"FSS…"` or a list), else `index_topk_freq` / `index_skip_topk_offset`;
`linear_attn_config` overrides the `linear_*` fields (`safe_gate` with a null bound means -5).

Shared indexer layers reuse the selection of the most recent full DSA layer (GLM-5's index
sharing). transformers passes a selection only to the layer right after a full one, so it raises
on other chains (e.g. full, KDA, shared); moesaic runs them and refuses only a shared layer with no
full DSA layer before it. The released checkpoint marks every DSA layer full.

Names. The model's own names are transformers' in-memory ones (`model.layers.L.attn_hc.fn`,
fused `self_attn.conv1d.weight [3C, 1, K]`, `self_attn.forget_gate.*`, fused experts). Checkpoints —
the release and what transformers' `save_pretrained` writes — use `hc_attn_fn`, `q/k/v_conv1d`,
`self_attn.f_a_proj`, one tensor per expert, under `model.language_model.` (multimodal) or
`model.` (flat). The MTP layer stored as layer `num_hidden_layers` is declared optional and loaded
when present (`Model.mtp`); transformers has no MTP module, so nothing here runs it yet.

State per sequence: KDA layers a RecurrentState over the fp32 conv tail [K-1, 3C] and recurrent
matrix [H, Dk, Dv] (rollback window chosen at `new_state(rollback_window=...)`); DSA layers
TokenRows of the latent (kv_lora_rank) and, on full layers, the indexer's k and gate scores z
(index_head_dim each), in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..cache.batch import ForwardBatch
from ..cache.state import RecurrentState, SequenceState, TokenRows
from ..config import eos_ids, field, positive
from ..errors import CheckpointError, ConfigError
from ..layers import dsa, mhc
from ..layers.kda import KdaDims, KdaState, kda_mixer
from ..layers.linear import linear
from ..layers.moe import clamped_silu_glu, clamped_swiglu, glu_mlp, route_sigmoid, run_experts
from ..layers.norms import rms_norm
from ..layers.recurrent import run_recurrent
from ..weights.bind import Tensors
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs
from .parts import bind_kda

MODEL_TYPES = ("glm5_next", "glm5_next_text")

KDA, DSA = "kda", "dsa"
_MIXERS = {
    "linear_attention": KDA,
    "indexed_attention": DSA,
    "full_attention": DSA,
    "deepseek_sparse_attention": DSA,
}


@dataclass(frozen=True)
class Glm5NextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None  # None: the Kimi Linear gate law
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    layer_types: tuple[str, ...]  # "kda" | "dsa"
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse"
    indexer_types: tuple[str, ...]  # "full" | "shared" (read on DSA layers only)
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = "glm5_next"

    def is_full_indexer(self, layer: int) -> bool:
        return self.layer_types[layer] == DSA and self.indexer_types[layer] == "full"

    @property
    def kda_dims(self) -> KdaDims:
        return KdaDims.for_variant(
            "glm5_next",
            self.hidden_size,
            self.linear_num_heads,
            self.linear_head_dim,
            conv_kernel=self.linear_conv_kernel_dim,
            lower_bound=self.linear_lower_bound,
            norm_eps=self.rms_norm_eps,
        )

    @property
    def mhc_dims(self) -> mhc.MhcDims:
        return mhc.MhcDims(self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps, self.rms_norm_eps)


# ---------------------------------------------------------------- config


def _str_list(raw: dict, key: str, allowed, n: int, w: str) -> list[str]:
    v = raw[key]
    if not isinstance(v, list) or len(v) != n or any(x not in allowed for x in v):
        raise ConfigError(
            f"{w}: field {key!r} must be a list of {n} values from {sorted(allowed)}, got {v!r}"
        )
    return list(v)


def parse_config(raw: dict, layout: str = "hf") -> Glm5NextConfig:
    """Absent fields take transformers' `Glm5NextTextConfig` defaults (index_kpool 16 and vocab
    154880 there; the release says 4 and 154624, and its config states both)."""
    if layout != "hf":
        raise ConfigError(f"GLM-5.3 checkpoints come with a config.json, not a {layout} layout")
    outer = raw
    t = raw.get("text_config")
    if t is not None and not isinstance(t, dict):
        raise ConfigError(f"config.json: field 'text_config' must be an object, got {t!r}")
    t = t if t is not None else raw
    w = "config.json text_config" if t is not raw else "config.json"
    lin = t.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"{w}: field 'linear_attn_config' must be an object, got {lin!r}")

    for key, want in (("scoring_func", "sigmoid"), ("moe_router_dtype", "float32"), ("hidden_act", "silu")):
        if t.get(key) not in (None, want):
            raise ConfigError(f"{w}: field {key!r} = {t[key]!r} is not supported (GLM-5.3 uses {want!r})")
    for key in ("mhc", "mla_use_nope", "index_kpool_compress"):
        if t.get(key) is False:
            raise ConfigError(f"{w}: field {key!r} = false is not supported (GLM-5.3 has it on)")
    if t.get("attention_bias"):
        raise ConfigError(
            f"{w}: field 'attention_bias' = true is not supported (the released model has no biases)"
        )
    if field(t, "qk_rope_head_dim", int, 0, where=w) != 0:
        raise ConfigError(f"{w}: field 'qk_rope_head_dim' must be 0: GLM-5.3's DSA attention is NoPE")
    if "q_lora_rank" in t and t["q_lora_rank"] is None:
        raise ConfigError(f"{w}: field 'q_lora_rank' must not be null (the DSA indexer reads the q latent)")

    L = field(t, "num_hidden_layers", int, 45, where=w, check=positive)
    heads = field(t, "num_attention_heads", int, 64, where=w, check=positive)
    if field(t, "num_key_value_heads", int, heads, where=w) != heads:
        raise ConfigError(f"{w}: field 'num_key_value_heads' must equal num_attention_heads ({heads})")
    experts = field(t, "n_routed_experts", int, t.get("num_local_experts", 288), where=w, check=positive)
    n_group = field(t, "n_group", int, 1, where=w, check=positive)
    if experts % n_group:
        raise ConfigError(f"{w}: field 'n_group' = {n_group} must divide n_routed_experts = {experts}")
    kpool = field(t, "index_kpool", int, 16, where=w, check=positive)
    topk = field(
        t,
        "index_topk",
        int,
        2048,
        where=w,
        check=lambda v: v > 0 and v % kpool == 0,
        why=f"must be a positive multiple of index_kpool = {kpool}",
    )

    # KDA fields, then the linear_attn_config overrides (transformers' order)
    lw = f"{w} linear_attn_config"
    lin_heads = field(
        lin,
        "num_heads",
        int,
        field(t, "linear_num_heads", int, 64, where=w, check=positive),
        where=lw,
        check=positive,
    )
    lin_dim = field(
        lin,
        "head_dim",
        int,
        field(t, "linear_head_dim", int, 128, where=w, check=positive),
        where=lw,
        check=positive,
    )
    conv_k = field(
        lin,
        "short_conv_kernel_size",
        int,
        field(t, "linear_conv_kernel_dim", int, 4, where=w, check=positive),
        where=lw,
        check=lambda v: v >= 2,
        why="the short convolution needs at least 2 taps",
    )
    bound = t.get("linear_lower_bound", -5.0)
    if "gate_lower_bound" in lin:
        bound = lin["gate_lower_bound"]
    if lin and lin.get("safe_gate", True) and bound is None:
        bound = -5.0
    if bound is not None:
        bound = field(
            {"linear_lower_bound": bound},
            "linear_lower_bound",
            float,
            where=w,
            check=lambda v: v < 0,
            why="the gate lower bound is a negative log-decay",
        )

    # schedules
    if t.get("layer_types") is not None:
        layer_types = [_MIXERS[x] for x in _str_list(t, "layer_types", _MIXERS, L, w)]
    elif lin.get("full_attn_layers") is not None:
        full = lin["full_attn_layers"]
        if not isinstance(full, list) or any(not isinstance(i, int) or not 0 <= i < L for i in full):
            raise ConfigError(
                f"{lw}: field 'full_attn_layers' must list layer indices in 0..{L - 1}, got {full!r}"
            )
        layer_types = [DSA if i in full else KDA for i in range(L)]
    else:
        layer_types = [DSA if i % 4 == 3 else KDA for i in range(L)]
    if t.get("mlp_layer_types") is not None:
        mlp_types = _str_list(t, "mlp_layer_types", {"dense", "sparse"}, L, w)
    else:
        k_dense = field(t, "first_k_dense_replace", int, 3, where=w, check=lambda v: v >= 0)
        mlp_types = ["dense" if i < k_dense else "sparse" for i in range(L)]
    indexer_types = _indexer_types(t, L, w)
    last_full = None
    for i in range(L):
        if layer_types[i] == DSA:
            if indexer_types[i] == "full":
                last_full = i
            elif last_full is None:
                raise ConfigError(
                    f"{w}: layer {i} is a shared DSA layer with no full DSA layer before it "
                    f"(indexer_types {indexer_types!r})"
                )

    inter = field(t, "intermediate_size", int, 12288, where=w, check=lambda v: v >= 0)
    if "dense" in mlp_types and inter <= 0:
        raise ConfigError(f"{w}: field 'intermediate_size' must be positive when a layer has a dense MLP")
    eos = t.get("eos_token_id", outer.get("eos_token_id"))
    return Glm5NextConfig(
        vocab_size=field(t, "vocab_size", int, 154880, where=w, check=positive),
        hidden_size=field(t, "hidden_size", int, 4096, where=w, check=positive),
        num_hidden_layers=L,
        num_attention_heads=heads,
        q_lora_rank=field(t, "q_lora_rank", int, 1536, where=w, check=positive),
        kv_lora_rank=field(t, "kv_lora_rank", int, 512, where=w, check=positive),
        qk_nope_head_dim=field(t, "qk_nope_head_dim", int, 256, where=w, check=positive),
        v_head_dim=field(t, "v_head_dim", int, 256, where=w, check=positive),
        intermediate_size=inter,
        moe_intermediate_size=field(t, "moe_intermediate_size", int, 2048, where=w, check=positive),
        n_routed_experts=experts,
        num_experts_per_tok=field(
            t,
            "num_experts_per_tok",
            int,
            8,
            where=w,
            check=lambda v: 0 < v <= experts,
            why=f"must be in 1..n_routed_experts={experts}",
        ),
        n_shared_experts=field(t, "n_shared_experts", int, 1, where=w, check=lambda v: v >= 0),
        n_group=n_group,
        topk_group=field(
            t,
            "topk_group",
            int,
            1,
            where=w,
            check=lambda v: 0 < v <= n_group,
            why=f"must be in 1..n_group={n_group}",
        ),
        norm_topk_prob=field(t, "norm_topk_prob", bool, True, where=w),
        routed_scaling_factor=field(t, "routed_scaling_factor", float, 2.5, where=w),
        swiglu_limit=field(t, "swiglu_limit", float, 10.0, where=w, check=positive),
        rms_norm_eps=field(t, "rms_norm_eps", float, 1e-5, where=w, check=positive),
        max_position_embeddings=field(t, "max_position_embeddings", int, 1048576, where=w, check=positive),
        index_n_heads=field(t, "index_n_heads", int, 32, where=w, check=positive),
        index_head_dim=field(t, "index_head_dim", int, 128, where=w, check=positive),
        index_topk=topk,
        index_kpool=kpool,
        index_kpool_always_select_tail=field(t, "index_kpool_always_select_tail", bool, True, where=w),
        linear_num_heads=lin_heads,
        linear_head_dim=lin_dim,
        linear_conv_kernel_dim=conv_k,
        linear_lower_bound=bound,
        hc_mult=field(t, "hc_mult", int, 4, where=w, check=positive),
        hc_sinkhorn_iters=field(t, "hc_sinkhorn_iters", int, 20, where=w, check=positive),
        hc_eps=field(t, "hc_eps", float, 1e-6, where=w, check=lambda v: v >= 0),
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        indexer_types=tuple(indexer_types),
        num_nextn_predict_layers=field(
            t, "num_nextn_predict_layers", int, 1, where=w, check=lambda v: v >= 0
        ),
        tie_word_embeddings=field(
            t, "tie_word_embeddings", bool, outer.get("tie_word_embeddings") or False, where=w
        ),
        bos_token_id=t.get("bos_token_id", outer.get("bos_token_id")),
        eos_token_ids=eos_ids(eos),
        model_type=str(outer.get("model_type") or "glm5_next"),
    )


def _indexer_types(t: dict, L: int, w: str) -> list[str]:
    if t.get("indexer_types") is not None:
        return _str_list(t, "indexer_types", {"full", "shared"}, L, w)
    pattern = t.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and len(pattern) == L and set(pattern) <= set(letters):
            return [letters[c] for c in pattern]
        if isinstance(pattern, list) and len(pattern) == L and all(x in ("full", "shared") for x in pattern):
            return list(pattern)
        raise ConfigError(
            f"{w}: field 'index_topk_pattern' must be {L} letters F/S or a list of {L} "
            f"'full'/'shared', got {pattern!r}"
        )
    freq = max(field(t, "index_topk_freq", int, 1, where=w), 1)
    offset = field(t, "index_skip_topk_offset", int, 2, where=w)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]


# ---------------------------------------------------------------- tensor contract


def _layer_specs(
    cfg: Glm5NextConfig, L: int, p: str, mixer: str, full: bool, mlp: str, mtp: bool
) -> list[TensorSpec]:
    d, H = cfg.hidden_size, cfg.num_attention_heads
    opt = dict(layer=L, optional=mtp)
    specs = [
        TensorSpec(p + "input_layernorm.weight", (d,), "norm", **opt),
        TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", **opt),
    ]
    if not mtp:
        shapes = mhc.site_shapes(cfg.mhc_dims, d)
        for site in ("attn_hc", "ffn_hc"):
            specs += [
                TensorSpec(f"{p}{site}.fn", shapes["fn"], "mhc", L),
                TensorSpec(f"{p}{site}.base", shapes["base"], "mhc", L, keep_fp32=True),
                TensorSpec(f"{p}{site}.scale", shapes["scale"], "mhc", L, keep_fp32=True),
            ]
    a = p + "self_attn."
    if mixer == KDA:
        kd = cfg.kda_dims
        C, D, K = kd.qkv_dim, kd.head_dim, kd.conv_kernel
        specs += [
            TensorSpec(a + "q_proj.weight", (C, d), "kda", **opt),
            TensorSpec(a + "k_proj.weight", (C, d), "kda", **opt),
            TensorSpec(a + "v_proj.weight", (C, d), "kda", **opt),
            TensorSpec(a + "conv1d.weight", (3 * C, 1, K), "kda", keep_fp32=True, **opt),
            TensorSpec(a + "forget_gate.f_a_proj.weight", (D, d), "kda", **opt),
            TensorSpec(a + "forget_gate.f_b_proj.weight", (C, D), "kda", **opt),
            TensorSpec(a + "forget_gate.dt_bias", (C,), "kda", keep_fp32=True, **opt),
            TensorSpec(a + "forget_gate.A_log", (kd.num_heads,), "kda", keep_fp32=True, **opt),
            TensorSpec(a + "b_proj.weight", (kd.num_heads, d), "kda", **opt),
            TensorSpec(a + "g_a_proj.weight", (D, d), "kda", **opt),
            TensorSpec(a + "g_b_proj.weight", (C, D), "kda", **opt),
            TensorSpec(a + "o_norm.weight", (D,), "norm", **opt),
            TensorSpec(a + "o_proj.weight", (d, C), "kda", **opt),
        ]
    else:
        qr, kvr, dn, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
        specs += [
            TensorSpec(a + "q_a_proj.weight", (qr, d), "attention", **opt),
            TensorSpec(a + "q_a_layernorm.weight", (qr,), "norm", **opt),
            TensorSpec(a + "q_b_proj.weight", (H * dn, qr), "attention", **opt),
            TensorSpec(a + "kv_a_proj_with_mqa.weight", (kvr, d), "attention", **opt),
            TensorSpec(a + "kv_a_layernorm.weight", (kvr,), "norm", **opt),
            TensorSpec(
                a + "kv_b_proj.weight", (H * (dn + dv), kvr), "attention", dense=True, **opt
            ),  # viewed per head
            TensorSpec(a + "o_proj.weight", (d, H * dv), "attention", **opt),
        ]
        if full:
            nI, cI, i = cfg.index_n_heads, cfg.index_head_dim, a + "indexer."
            specs += [
                TensorSpec(i + "wq_b.weight", (nI * cI, qr), "indexer", **opt),
                TensorSpec(i + "wk.weight", (cI, d), "indexer", **opt),
                TensorSpec(i + "k_norm.weight", (cI,), "indexer", **opt),
                TensorSpec(i + "k_norm.bias", (cI,), "indexer", **opt),
                TensorSpec(i + "weights_proj.weight", (nI, d), "indexer", **opt),
                TensorSpec(i + "index_kpool_compress_ape", (cfg.index_kpool, cI), "indexer", **opt),
                TensorSpec(i + "index_kpool_compress_gate", (cI, d), "indexer", **opt),
            ]
    m = p + "mlp."
    if mlp == "sparse":
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        specs += [
            TensorSpec(m + "gate.weight", (E, d), "router", **opt),
            TensorSpec(m + "gate.e_score_correction_bias", (E,), "router", keep_fp32=True, **opt),
            TensorSpec(m + "experts.gate_up_proj", (E, 2 * I, d), "expert", **opt),
            TensorSpec(m + "experts.down_proj", (E, d, I), "expert", **opt),
        ]
        if cfg.n_shared_experts:
            S = I * cfg.n_shared_experts
            specs += [
                TensorSpec(m + "shared_experts.gate_proj.weight", (S, d), "shared_expert", **opt),
                TensorSpec(m + "shared_experts.up_proj.weight", (S, d), "shared_expert", **opt),
                TensorSpec(m + "shared_experts.down_proj.weight", (d, S), "shared_expert", **opt),
            ]
    else:
        I = cfg.intermediate_size
        specs += [
            TensorSpec(m + "gate_proj.weight", (I, d), "mlp", **opt),
            TensorSpec(m + "up_proj.weight", (I, d), "mlp", **opt),
            TensorSpec(m + "down_proj.weight", (d, I), "mlp", **opt),
        ]
    if mtp:
        specs += [
            TensorSpec(p + "eh_proj.weight", (d, 2 * d), "mtp", L, optional=True),
            TensorSpec(p + "enorm.weight", (d,), "mtp", L, optional=True),
            TensorSpec(p + "hnorm.weight", (d,), "mtp", L, optional=True),
            TensorSpec(p + "shared_head.norm.weight", (d,), "mtp", L, optional=True),
        ]
    return specs


def tensor_specs(cfg: Glm5NextConfig) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding")]
    for L in range(cfg.num_hidden_layers):
        specs += _layer_specs(
            cfg,
            L,
            f"model.layers.{L}.",
            cfg.layer_types[L],
            cfg.is_full_indexer(L),
            cfg.mlp_layer_types[L],
            mtp=False,
        )
    for j in range(cfg.num_nextn_predict_layers):  # the MTP layer(s): DSA (own indexer) + MoE, no mHC
        L = cfg.num_hidden_layers + j
        specs += _layer_specs(cfg, L, f"model.layers.{L}.", DSA, True, "sparse", mtp=True)
    specs.append(TensorSpec("model.norm.weight", (d,), "norm"))
    specs.append(
        TensorSpec("lm_head.weight", (cfg.vocab_size, d), "lm_head", optional=cfg.tie_word_embeddings)
    )
    return specs


_IGNORED = [  # the vision tower, and MTP heads some exports add (the target lm_head serves)
    r"model\.visual\..*",
    r"visual\..*",
    r"model\.vision_tower\..*",
    r"(model\.)?(language_model\.)?layers\.\d+\.shared_head\.head\.weight",
]


def _concat_rows(names: list[str], shape) -> Source:
    """Tensors concatenated along rows: the q | k | v short convolutions into transformers' conv1d."""
    return Source(
        [(n, tuple(shape)) for n in names], lambda ts: torch.cat(ts), lambda t: list(t.chunk(len(names)))
    )


def checkpoint_naming(text_prefix: str = "model.language_model.") -> Naming:
    """The release names, which are also what transformers' `save_pretrained` writes."""

    def source(spec: TensorSpec) -> Source:
        name = spec.name
        if name.startswith("model."):
            name = text_prefix + name[len("model.") :]
        for site, ck in (("attn_hc", "hc_attn"), ("ffn_hc", "hc_ffn")):
            for part in ("fn", "base", "scale"):
                name = name.replace(f".{site}.{part}", f".{ck}_{part}")
        name = name.replace("self_attn.forget_gate.", "self_attn.")
        if name.endswith("self_attn.conv1d.weight"):
            base = name[: -len("conv1d.weight")]
            C = spec.shape[0] // 3
            return _concat_rows([f"{base}{x}_conv1d.weight" for x in "qkv"], (C, *spec.shape[1:]))
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            E, I2, d = spec.shape
            return stacked_pairs(
                [f"{base}{e}.gate_proj.weight" for e in range(E)],
                [f"{base}{e}.up_proj.weight" for e in range(E)],
                (I2 // 2, d),
            )
        if name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            return stacked([f"{base}{e}.down_proj.weight" for e in range(spec.shape[0])], spec.shape[1:])
        return direct(name, spec.shape)

    return Naming(f"GLM-5.3 release / transformers-saved ({text_prefix}*)", source, _IGNORED)


def module_naming(text_prefix: str = "model.language_model.") -> Naming:
    """transformers' in-memory module names (a raw `state_dict()` dump)."""

    def source(spec: TensorSpec) -> Source:
        name = spec.name
        return direct(text_prefix + name[len("model.") :] if name.startswith("model.") else name, spec.shape)

    return Naming(f"transformers modules ({text_prefix}*)", source, _IGNORED)


def namings(cfg: Glm5NextConfig, layout: str, store_names) -> Naming:
    names = set(store_names)
    prefix = (
        "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
    )
    if any(n.endswith(".attn_hc.fn") for n in names):
        return module_naming(prefix)
    return checkpoint_naming(prefix)


# ---------------------------------------------------------------- model


class Model:
    """The GLM-5.3-Flash text decoder over a ForwardBatch."""

    def __init__(self, cfg: Glm5NextConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.kda_dims = cfg.kda_dims
        self.hc = cfg.mhc_dims
        self.act = clamped_swiglu(cfg.swiglu_limit)  # the routed experts' fused gate|up rows
        self.glu = partial(clamped_silu_glu, limit=cfg.swiglu_limit)  # the dense MLP and shared experts
        t = tensors
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.layers, self.sites, self.kda = [], [], {}
        for L in range(cfg.num_hidden_layers):
            p = f"model.layers.{L}."
            w = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            self.layers.append(w)
            self.sites.append(
                tuple(
                    mhc.MhcSite(w[f"{s}.fn"], w[f"{s}.base"], w[f"{s}.scale"]) for s in ("attn_hc", "ffn_hc")
                )
            )
            if cfg.layer_types[L] == KDA:
                sub = {k[len("self_attn.") :]: v for k, v in w.items() if k.startswith("self_attn.")}
                self.kda[L] = bind_kda(Tensors(sub), self.kda_dims)  # TODO(#11): bind at build
        self.mtp = []  # the MTP layer(s)' tensors, for a drafter (spec/); empty when the checkpoint has none
        mtp_specs = [s for s in tensor_specs(cfg) if s.optional and s.layer is not None]
        for j in range(cfg.num_nextn_predict_layers):
            p = f"model.layers.{cfg.num_hidden_layers + j}."
            w = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            if w:
                missing = [s.name for s in mtp_specs if s.name.startswith(p) and s.name not in t]
                if missing:
                    raise CheckpointError(
                        f"the MTP layer {p[:-1]} is incomplete: {len(missing)} tensor(s) missing, "
                        f"e.g. {missing[:3]} (ship all of it or none)"
                    )
                self.mtp.append(w)

    # -- state
    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """`rollback_window`: how many of its last tokens a sequence can forget exactly (KDA layers
        keep one state snapshot per token of it; DSA caches roll back for free)."""
        c = self.cfg
        layers = []
        for L in range(c.num_hidden_layers):
            if c.layer_types[L] == KDA:
                layers.append(RecurrentState(KdaState.zeros(self.kda_dims, self.device), rollback_window))
            else:
                widths = {"latent": c.kv_lora_rank}
                if c.is_full_indexer(L):
                    widths.update(k=c.index_head_dim, z=c.index_head_dim)
                layers.append(TokenRows(widths, self.dtype, self.device, c.max_position_embeddings))
        return SequenceState(layers)

    # -- mixers
    def dsa_block(self, L: int, w: dict, x: torch.Tensor, batch: ForwardBatch, shared: list | None):
        """DSA over every sequence; returns (output, the selections it used, one per sequence)."""
        c = self.cfg
        N, H, dn, dv = x.shape[0], c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        qr = rms_norm(
            linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"], c.rms_norm_eps
        )
        q = linear(qr, w["self_attn.q_b_proj.weight"]).view(N, H, dn)
        latent = rms_norm(
            linear(x, w["self_attn.kv_a_proj_with_mqa.weight"]),
            w["self_attn.kv_a_layernorm.weight"],
            c.rms_norm_eps,
        )
        full = c.is_full_indexer(L)
        if full:
            i = "self_attn.indexer."
            qi = linear(qr, w[i + "wq_b.weight"]).view(N, c.index_n_heads, c.index_head_dim)
            wts = linear(x, w[i + "weights_proj.weight"]).float() * c.index_n_heads**-0.5
            k, z = dsa.indexer_keys(
                x,
                w[i + "wk.weight"],
                w[i + "k_norm.weight"],
                w[i + "k_norm.bias"],
                w[i + "index_kpool_compress_gate"],
            )
        out = x.new_empty(N, H, dv)
        selections = []
        for j, s in enumerate(batch.seqs):
            rows = slice(s.start, s.start + s.n)
            if full:
                cache = s.state.layers[L].append(latent=latent[rows], k=k[rows], z=z[rows])
                sel = dsa.kpool_select(
                    qi[rows],
                    wts[rows],
                    cache["k"],
                    cache["z"],
                    w[i + "index_kpool_compress_ape"],
                    batch.positions[rows],
                    c.index_topk,
                    c.index_kpool_always_select_tail,
                )
            else:
                cache = s.state.layers[L].append(latent=latent[rows])
                sel = shared[j]
            selections.append(sel)
            out[rows] = dsa.sparse_mla_attend(
                q[rows], cache["latent"], w["self_attn.kv_b_proj.weight"], dv, dn**-0.5, sel
            )
        return linear(out.reshape(N, H * dv), w["self_attn.o_proj.weight"]), selections

    def mlp(self, L: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.mlp_layer_types[L] == "dense":
            return glu_mlp(
                x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"], self.glu
            )
        logits = F.linear(x.float(), w["mlp.gate.weight"].float())
        weights, ids = route_sigmoid(
            logits,
            c.num_experts_per_tok,
            w["mlp.gate.e_score_correction_bias"],
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        out = run_experts(
            x, weights, ids, w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"], self.act
        )
        if c.n_shared_experts:
            s = "mlp.shared_experts."
            out = out + glu_mlp(
                x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"], self.glu
            )
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        h = mhc.expand(F.embedding(batch.token_ids, self.embed), c.hc_mult)  # [N, n, d]
        selections = None  # of the most recent full DSA layer, one per sequence
        for L, w in enumerate(self.layers):
            attn_site, ffn_site = self.sites[L]
            x, post, comb = mhc.site_input(h, attn_site, self.hc)
            x = rms_norm(x, w["input_layernorm.weight"], c.rms_norm_eps)
            if c.layer_types[L] == KDA:
                y = run_recurrent(kda_mixer, self.kda[L], self.kda_dims, L, x, batch)
            else:
                y, sel = self.dsa_block(L, w, x, batch, selections)
                if c.is_full_indexer(L):
                    selections = sel
            h = mhc.update(h, y, post, comb)
            x, post, comb = mhc.site_input(h, ffn_site, self.hc)
            h = mhc.update(
                h,
                self.mlp(L, w, rms_norm(x, w["post_attention_layernorm.weight"], c.rms_norm_eps)),
                post,
                comb,
            )
        batch.finish()
        h = rms_norm(mhc.head_mean(h[batch.logit_rows]), self.norm, c.rms_norm_eps)
        return linear(h, self.lm_head).float()


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: Glm5NextConfig) -> list[str]:
    out = []
    for L in range(cfg.num_hidden_layers):
        mixer = "kda" if cfg.layer_types[L] == KDA else ("dsa" if cfg.is_full_indexer(L) else "dsa-shared")
        out.append(f"{mixer}+{'moe' if cfg.mlp_layer_types[L] == 'sparse' else 'mlp'}")
    return out


def state_bytes(cfg: Glm5NextConfig, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence). Per token: the latent of every DSA layer and the
    indexer k and z of every full one, in the cache dtype. Fixed: every KDA layer's fp32 recurrent
    state and conv tail, once plus once per token of the rollback window."""
    n_dsa = cfg.layer_types.count(DSA)
    n_full = sum(cfg.is_full_indexer(L) for L in range(cfg.num_hidden_layers))
    per_token = (n_dsa * cfg.kv_lora_rank + n_full * 2 * cfg.index_head_dim) * dtype_bytes
    fixed = cfg.layer_types.count(KDA) * KdaState.nbytes_for(cfg.kda_dims) * (1 + rollback_window)
    return per_token, fixed


def max_context(cfg: Glm5NextConfig) -> int:
    return cfg.max_position_embeddings


def facts(cfg: Glm5NextConfig) -> dict:
    d, I = cfg.hidden_size, cfg.moe_intermediate_size
    full = [L for L in range(cfg.num_hidden_layers) if cfg.is_full_indexer(L)]
    routed = dense = 0
    for s in tensor_specs(cfg):
        n = 1
        for x in s.shape:
            n *= x
        if s.role == "expert":
            routed += n
        else:
            dense += n
    return {
        "params_active_per_token": dense + routed * cfg.num_experts_per_tok // cfg.n_routed_experts,
        "kda_layers": cfg.layer_types.count(KDA),
        "dsa_layers": cfg.layer_types.count(DSA),
        "dsa_full_indexer_layers": full,
        "dense_mlp_layers": cfg.mlp_layer_types.count("dense"),
        "moe_layers": cfg.mlp_layer_types.count("sparse"),
        "mtp_layers": cfg.num_nextn_predict_layers,
        "kda_state_bytes_per_layer": KdaState.nbytes_for(cfg.kda_dims),
        "index_kpool": cfg.index_kpool,
        "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult,
        "experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_params": 3 * d * I,
        "expert_bytes_bf16": 3 * d * I * 2,
    }


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg) -> tuple[str, ...]:
    return ()


def build(cfg, tensors, dtype, device, folder):
    return Model(cfg, tensors.all(), dtype, device)

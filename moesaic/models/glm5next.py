"""GLM-5.3-Flash (`glm5_next`, text model `glm5_next_text`): KDA + DSA mixers inside mHC residual
streams, clamped-SwiGLU dense and MoE FFNs, no positional embeddings anywhere.

    h = copies of embed(ids) in hc_mult streams                   # [N, n, d]
    for each layer:
        x, post, comb = mHC site (attention);  y = KDA or DSA (RMSNorm(x));  h = post ⊗ y + combᵀ h
        x, post, comb = mHC site (FFN);        y = MLP or MoE (RMSNorm(x));  h = post ⊗ y + combᵀ h
    logits = lm_head(RMSNorm(mean over the streams of h)).float()

Layer schedule, state kinds, namings and proof: docs/families/glm5next.md. Oracle: transformers 5.23
`src/transformers/models/glm5_next/modeling_glm5_next.py`. Shared math: layers/kda.py, layers/dsa.py,
layers/mhc.py, layers/moe.py.

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

Names. The contract uses transformers' in-memory names (`model.layers.L.attn_hc.fn`, fused
`self_attn.conv1d.weight [3C, 1, K]`, `self_attn.forget_gate.*`, fused experts). Checkpoints —
the release and what transformers' `save_pretrained` writes — use `hc_attn_fn`, `q/k/v_conv1d`,
`self_attn.f_a_proj`, one tensor per expert, under `model.language_model.` (multimodal) or
`model.` (flat). The MTP layer stored as layer `num_hidden_layers` is optional, all of it or none,
and bound into `Model.mtp` (`MtpLayer`); transformers has no MTP module, and the speculative decoder
runs it, not this forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import RecurrentState, SequenceState, TokenRows
from ..config import declared, eos_ids, field, non_negative, positive, read_config, require, section
from ..errors import CheckpointError, ConfigError
from ..layers import dsa, kda, mhc
from ..layers.kda import KdaDims, KdaState, KdaWeights
from ..layers.linear import embedding, linear
from ..layers.mla import MlaWeights
from ..layers.moe import Mlp, MoeSpec, MoeWeights, Router, clamped_silu_glu, moe
from ..layers.norms import rms_norm
from ..layers.recurrent import run_recurrent
from ..weights.bind import Tensors
from ..weights.contract import Naming, Shard, Source, TensorSpec, direct, stacked, stacked_pairs
from .parts import bind_kda, bind_mla, bind_mlp, bind_moe, mla_specs, mlp_specs, moe_specs

MODEL_TYPES = ("glm5_next", "glm5_next_text")

KDA, DSA = "kda", "dsa"
_MIXERS = {
    "linear_attention": KDA,
    "indexed_attention": DSA,
    "full_attention": DSA,
    "deepseek_sparse_attention": DSA,
}


def _negative(v) -> bool:
    return v < 0


@dataclass(frozen=True, kw_only=True)
class Glm5NextConfig:
    """Absent fields take transformers' `Glm5NextTextConfig` defaults (index_kpool 16 and vocab 154880
    there; the release says 4 and 154624, and its config states both)."""

    vocab_size: int = declared(154880, check=positive)
    hidden_size: int = declared(4096, check=positive)
    num_hidden_layers: int = declared(45, check=positive)
    num_attention_heads: int = declared(64, check=positive)
    q_lora_rank: int = declared(1536, check=positive)
    kv_lora_rank: int = declared(512, check=positive)
    qk_nope_head_dim: int = declared(256, check=positive)
    qk_rope_head_dim: int = declared(
        0, check=lambda v: v == 0, why="must be 0: GLM-5.3's DSA attention is NoPE"
    )
    v_head_dim: int = declared(256, check=positive)
    intermediate_size: int = declared(12288, check=non_negative)
    moe_intermediate_size: int = declared(2048, check=positive)
    n_routed_experts: int = declared(288, aliases=("num_local_experts",), check=positive)
    num_experts_per_tok: int = declared(8, check=positive)
    n_shared_experts: int = declared(1, check=non_negative)
    n_group: int = declared(1, check=positive)
    topk_group: int = declared(1, check=positive)
    norm_topk_prob: bool = declared(True)
    routed_scaling_factor: float = declared(2.5)
    swiglu_limit: float = declared(10.0, check=positive)
    rms_norm_eps: float = declared(1e-5, check=positive)
    max_position_embeddings: int = declared(1048576, check=positive)
    index_n_heads: int = declared(32, check=positive)
    index_head_dim: int = declared(128, check=positive)
    index_topk: int = declared(2048, check=positive)
    index_kpool: int = declared(16, check=positive)
    index_kpool_always_select_tail: bool = declared(True)
    linear_num_heads: int = declared(64, check=positive)
    linear_head_dim: int = declared(128, check=positive)
    linear_conv_kernel_dim: int = declared(
        4, check=lambda v: v >= 2, why="the short convolution needs at least 2 taps"
    )
    linear_lower_bound: float | None = declared(  # None: the Kimi Linear gate law
        -5.0, check=_negative, why="the gate lower bound is a negative log-decay"
    )
    hc_mult: int = declared(4, check=positive)
    hc_sinkhorn_iters: int = declared(20, check=positive)
    hc_eps: float = declared(1e-6, check=non_negative)
    num_nextn_predict_layers: int = declared(1, check=non_negative)
    tie_word_embeddings: bool = declared(False)
    bos_token_id: int | None = declared(None)
    layer_types: tuple[str, ...]  # "kda" | "dsa"
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse"
    indexer_types: tuple[str, ...]  # "full" | "shared" (read on DSA layers only)
    eos_token_ids: tuple[int, ...]
    model_type: str = "glm5_next"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim  # NoPE: no rope slice

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

    @property
    def moe_spec(self) -> MoeSpec:
        """Sigmoid router with the selection bias, logits in fp32 (transformers keeps the router fp32);
        clamped SwiGLU in the routed and shared experts."""
        router = Router(
            "sigmoid",
            self.num_experts_per_tok,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
            fp32=True,
        )
        return MoeSpec(router, glu=partial(clamped_silu_glu, limit=self.swiglu_limit))


@dataclass(frozen=True, kw_only=True)
class _LinearAttnConfig:
    """transformers' `linear_attn_config`: what it states overrides the text config's `linear_*`."""

    linear_num_heads: int | None = declared(None, key="num_heads", check=positive)
    linear_head_dim: int | None = declared(None, key="head_dim", check=positive)
    linear_conv_kernel_dim: int | None = declared(
        None,
        key="short_conv_kernel_size",
        check=lambda v: v >= 2,
        why="the short convolution needs at least 2 taps",
    )


# ---------------------------------------------------------------- config


def _str_list(raw: dict, key: str, allowed, n: int, w: str) -> list[str]:
    v = raw[key]
    if not isinstance(v, list) or len(v) != n or any(x not in allowed for x in v):
        raise ConfigError(
            f"{w}: field {key!r} must be a list of {n} values from {sorted(allowed)}, got {v!r}"
        )
    return list(v)


def parse_config(raw: dict, layout: str = "hf") -> Glm5NextConfig:
    if layout != "hf":
        raise ConfigError(f"GLM-5.3 checkpoints come with a config.json, not a {layout} layout")
    outer = raw
    t = raw.get("text_config")
    if t is not None and not isinstance(t, dict):
        raise ConfigError(f"config.json: field 'text_config' must be an object, got {t!r}")
    t = t if t is not None else raw
    w = "config.json text_config" if t is not raw else "config.json"
    lw = f"{w} linear_attn_config"
    lin = section(t, "linear_attn_config", w)

    for key, want in (("scoring_func", "sigmoid"), ("moe_router_dtype", "float32"), ("hidden_act", "silu")):
        require(t.get(key) in (None, want), w, key, t.get(key), f"not supported: GLM-5.3 uses {want!r}")
    for key in ("mhc", "mla_use_nope", "index_kpool_compress"):
        require(t.get(key) is not False, w, key, False, "not supported: GLM-5.3 has it on")
    require(
        not t.get("attention_bias"),
        w,
        "attention_bias",
        t.get("attention_bias"),
        "the released model has no biases",
    )
    require(
        not ("q_lora_rank" in t and t["q_lora_rank"] is None),
        w,
        "q_lora_rank",
        None,
        "must not be null: the DSA indexer reads the q latent",
    )

    given = {k: v for k, v in vars(read_config(_LinearAttnConfig, lin, lw)).items() if v is not None}
    if lin:  # transformers: the config's gate_lower_bound wins; safe_gate turns a null bound into -5
        bound = lin["gate_lower_bound"] if "gate_lower_bound" in lin else t.get("linear_lower_bound", -5.0)
        if bound is None and lin.get("safe_gate", True):
            bound = -5.0
        if bound is not None:
            bound = field(
                {"linear_lower_bound": bound},
                "linear_lower_bound",
                float,
                where=w,
                check=_negative,
                why="the gate lower bound is a negative log-decay",
            )
        given["linear_lower_bound"] = bound

    L = field(t, "num_hidden_layers", int, 45, where=w, check=positive)
    layer_types, mlp_types, indexer_types = _schedules(t, lin, L, w, lw)
    cfg = read_config(
        Glm5NextConfig,
        t,
        w,
        {
            "tie_word_embeddings": bool(outer.get("tie_word_embeddings") or False),
            "bos_token_id": outer.get("bos_token_id"),
        },
        **given,
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        indexer_types=tuple(indexer_types),
        eos_token_ids=eos_ids(t.get("eos_token_id", outer.get("eos_token_id"))),
        model_type=str(outer.get("model_type") or "glm5_next"),
    )

    heads, E, G = cfg.num_attention_heads, cfg.n_routed_experts, cfg.n_group
    kv_heads = field(t, "num_key_value_heads", int, heads, where=w)
    require(
        kv_heads == heads, w, "num_key_value_heads", kv_heads, f"must equal num_attention_heads ({heads})"
    )
    require(E % G == 0, w, "n_group", G, f"must divide n_routed_experts = {E}")
    k = cfg.num_experts_per_tok
    require(k <= E, w, "num_experts_per_tok", k, f"must be in 1..n_routed_experts={E}")
    require(cfg.topk_group <= G, w, "topk_group", cfg.topk_group, f"must be in 1..n_group={G}")
    P = cfg.index_kpool
    require(
        cfg.index_topk % P == 0,
        w,
        "index_topk",
        cfg.index_topk,
        f"must be a positive multiple of index_kpool = {P}",
    )
    require(
        "dense" not in mlp_types or cfg.intermediate_size > 0,
        w,
        "intermediate_size",
        cfg.intermediate_size,
        "must be positive when a layer has a dense MLP",
    )
    return cfg


def _schedules(t: dict, lin: dict, L: int, w: str, lw: str) -> tuple[list[str], list[str], list[str]]:
    """(layer_types, mlp_layer_types, indexer_types), as transformers' `__post_init__` derives them."""
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
        k_dense = field(t, "first_k_dense_replace", int, 3, where=w, check=non_negative)
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
    return layer_types, mlp_types, indexer_types


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


def _kda_specs(cfg: Glm5NextConfig, a: str, opt: dict) -> list[TensorSpec]:
    """One KDA layer in transformers' module names (models/parts.py `bind_kda` reads them)."""
    kd, d = cfg.kda_dims, cfg.hidden_size
    C, D, K = kd.qkv_dim, kd.head_dim, kd.conv_kernel
    return [
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


def _indexer_specs(cfg: Glm5NextConfig, i: str, opt: dict) -> list[TensorSpec]:
    d, qr, nI, cI = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    return [
        TensorSpec(i + "wq_b.weight", (nI * cI, qr), "indexer", **opt),
        TensorSpec(i + "wk.weight", (cI, d), "indexer", **opt),
        TensorSpec(i + "k_norm.weight", (cI,), "indexer", **opt),
        TensorSpec(i + "k_norm.bias", (cI,), "indexer", **opt),
        TensorSpec(i + "weights_proj.weight", (nI, d), "indexer", **opt),
        TensorSpec(i + "index_kpool_compress_ape", (cfg.index_kpool, cI), "indexer", **opt),
        TensorSpec(i + "index_kpool_compress_gate", (cI, d), "indexer", **opt),
    ]


def _layer_specs(cfg: Glm5NextConfig, L: int, mtp: bool = False) -> list[TensorSpec]:
    """Decoder layer L, or (mtp) the MTP layer stored at index L: a full DSA + MoE layer without mHC,
    all optional, plus its input projection and norms."""
    d, p = cfg.hidden_size, f"model.layers.{L}."
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
    if not mtp and cfg.layer_types[L] == KDA:
        specs += _kda_specs(cfg, a, opt)
    else:
        specs += mla_specs(a, cfg, L, optional=mtp)
        if mtp or cfg.is_full_indexer(L):
            specs += _indexer_specs(cfg, a + "indexer.", opt)
    m = p + "mlp."
    if mtp or cfg.mlp_layer_types[L] == "sparse":
        I = cfg.moe_intermediate_size
        specs += moe_specs(m, cfg.n_routed_experts, I, d, L, shared=I * cfg.n_shared_experts, optional=mtp)
    else:
        specs += mlp_specs(m, cfg.intermediate_size, d, "mlp", L, optional=mtp)
    if mtp:
        specs += [
            TensorSpec(p + "eh_proj.weight", (d, 2 * d), "mtp", L, optional=True),
            TensorSpec(p + "enorm.weight", (d,), "mtp", L, optional=True),
            TensorSpec(p + "hnorm.weight", (d,), "mtp", L, optional=True),
            TensorSpec(p + "shared_head.norm.weight", (d,), "mtp", L, optional=True),
        ]
    return specs


def _mtp_layers(cfg: Glm5NextConfig) -> range:
    """The indices the MTP layer(s) are stored at."""
    return range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def tensor_specs(cfg: Glm5NextConfig) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding")]
    for L in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, L)
    for L in _mtp_layers(cfg):
        specs += _layer_specs(cfg, L, mtp=True)
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


# ---------------------------------------------------------------- bound weights


@dataclass
class Dsa:
    """One DSA mixer: NoPE MLA projections and, on a full layer, its k-pool indexer (None on a shared
    layer, which reuses the selection of the last full one)."""

    mla: MlaWeights
    indexer: dsa.IndexerWeights | None


@dataclass
class Layer:
    attn_site: mhc.MhcSite
    attn_norm: torch.Tensor
    mixer: KdaWeights | Dsa
    ffn_site: mhc.MhcSite
    mlp_norm: torch.Tensor
    mlp: Mlp | MoeWeights


@dataclass
class MtpLayer:
    """The multi-token-prediction block as GLM-5.3 ships it (DeepSeek-V3's MTP; vLLM
    `vllm/model_executor/models/deepseek_mtp.py`): x = eh_proj([enorm(embed(next token)) ;
    hnorm(target hidden)]), one DSA (own indexer) + MoE pre-norm layer with a plain residual (no mHC),
    then shared_head.norm and the target's lm_head. Run by the speculative decoder, not `Model.forward`."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: object  # [d, 2d]
    attn_norm: torch.Tensor
    attn: Dsa
    mlp_norm: torch.Tensor
    mlp: MoeWeights
    head_norm: torch.Tensor


def _site(t: Tensors, name: str) -> mhc.MhcSite:
    return mhc.MhcSite(t(f"{name}.fn"), t(f"{name}.base"), t(f"{name}.scale"))


def _bind_dsa(t: Tensors, full: bool) -> Dsa:
    """The DSA mixer under `self_attn.` (the `mla_specs` names, plus `_indexer_specs` under `indexer.`)."""
    if not full:
        return Dsa(bind_mla(t), None)
    i = t.under("indexer.")
    indexer = dsa.IndexerWeights(
        wq_b=i("wq_b.weight"),
        wk=i("wk.weight"),
        k_norm=i("k_norm.weight"),
        k_norm_bias=i("k_norm.bias"),
        weights_proj=i("weights_proj.weight"),
        ape=i("index_kpool_compress_ape"),
        gate=i("index_kpool_compress_gate"),
    )
    return Dsa(bind_mla(t), indexer)


def _bind_layer(cfg: Glm5NextConfig, t: Tensors, L: int) -> Layer:
    w = t.under(f"model.layers.{L}.")
    a = w.under("self_attn.")
    mixer = bind_kda(a, cfg.kda_dims) if cfg.layer_types[L] == KDA else _bind_dsa(a, cfg.is_full_indexer(L))
    sparse = cfg.mlp_layer_types[L] == "sparse"
    return Layer(
        _site(w, "attn_hc"),
        w("input_layernorm.weight"),
        mixer,
        _site(w, "ffn_hc"),
        w("post_attention_layernorm.weight"),
        bind_moe(w.under("mlp.")) if sparse else bind_mlp(w.under("mlp.")),
    )


def _bind_mtp(cfg: Glm5NextConfig, t: Tensors) -> list[MtpLayer]:
    """The MTP layer(s) when the checkpoint has them: all of them or none (a CheckpointError otherwise)."""
    present = [L for L in _mtp_layers(cfg) if t.any_under(f"model.layers.{L}.")]
    if not present:
        return []
    missing = [s.name for L in _mtp_layers(cfg) for s in _layer_specs(cfg, L, mtp=True) if not t.has(s.name)]
    if missing:
        raise CheckpointError(
            f"the MTP layer model.layers.{present[0]} is incomplete: {len(missing)} tensor(s) missing, "
            f"e.g. {missing[:3]} (ship all of it or none)"
        )
    out = []
    for L in _mtp_layers(cfg):
        w = t.under(f"model.layers.{L}.")
        out.append(
            MtpLayer(
                enorm=w("enorm.weight"),
                hnorm=w("hnorm.weight"),
                eh_proj=w("eh_proj.weight"),
                attn_norm=w("input_layernorm.weight"),
                attn=_bind_dsa(w.under("self_attn."), full=True),
                mlp_norm=w("post_attention_layernorm.weight"),
                mlp=bind_moe(w.under("mlp.")),
                head_norm=w("shared_head.norm.weight"),
            )
        )
    return out


# ---------------------------------------------------------------- model


class Model:
    """The GLM-5.3-Flash text decoder over a ForwardBatch."""

    def __init__(self, cfg: Glm5NextConfig, t: Tensors, dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.kda_dims = cfg.kda_dims
        self.hc = cfg.mhc_dims
        self.moe = cfg.moe_spec
        self.embed = t("model.embed_tokens.weight")
        self.norm = t("model.norm.weight")
        self.lm_head = t.optional("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = self.embed
        self.layers = [_bind_layer(cfg, t, L) for L in range(cfg.num_hidden_layers)]
        self.mtp = _bind_mtp(cfg, t)  # for the drafter (spec/); empty when the checkpoint has none

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
    def dsa_block(
        self, L: int, w: Dsa, x: torch.Tensor, batch: ForwardBatch, shared: list | None, causal: dict
    ):
        """DSA over every sequence; returns (output, the selections it used, one per sequence, or None where the
        fused call ran: every context within index_topk). causal: the forward's selections of contexts within
        index_topk (every pool), which no layer's scores change."""
        c, m, ix = self.cfg, w.mla, w.indexer
        if (y := dsa.fused_block(L, batch, x, m, ix, c)) is not None:
            return y, None
        N, H, dn, dv = x.shape[0], c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
        q, latent, qr, keys = dsa.project_rows_and_keys(x, m, ix, c.kv_lora_rank, c.rms_norm_eps)
        q = q.view(N, H, dn)
        if ix is not None:
            k, z = keys
            queries = None  # the indexer's queries, computed for the first sequence that needs scores
        selections = []
        for j, s in enumerate(batch.seqs):
            held = s.state.layers[L]
            if ix is not None:
                held.write(latent=s.rows(latent), k=s.rows(k), z=s.rows(z))
            else:
                held.write(latent=s.rows(latent))
            P, T, tail = c.index_kpool, held.length, c.index_kpool_always_select_tail
            pos = s.rows(batch.positions)
            if ix is None and shared is not None:
                sel = shared[j]  # the last full layer's
            elif dsa.every_pool_fits(T, P, c.index_topk):  # a context within index_topk: all of it (also a
                # shared layer whose full layer ran the fused call, which returns no selections)
                if (sel := causal.get((j, T))) is None:
                    sel = causal[j, T] = dsa.causal_selection(pos, T, P, c.index_topk, tail, newest=True)
            else:
                if queries is None:
                    queries = dsa.indexer_queries(qr, x, ix, c.index_n_heads)
                qi, wts = queries
                sel = dsa.kpool_select_held(s.rows(qi), s.rows(wts), held, ix.ape, pos, c.index_topk, tail)
            selections.append(sel)
        paged = [s.state.layers[L] for s in batch.seqs]
        out = dsa.paged_sparse_mla_attend(
            q, paged, [s.n for s in batch.seqs], m.kv_b, dv, dn**-0.5, selections
        )
        if out is None and len(batch.seqs) == 1:  # the CPU / torch path: one sequence's rows are all
            out = dsa.sparse_mla_attend_held(q, paged[0], m.kv_b, dv, dn**-0.5, selections[0])
        elif out is None:  # sequence by sequence
            out = x.new_empty(N, H, dv)
            for s, held, sel in zip(batch.seqs, paged, selections):
                rows = slice(s.start, s.start + s.n)
                out[rows] = dsa.sparse_mla_attend_held(q[rows], held, m.kv_b, dv, dn**-0.5, sel)
        return linear(out.reshape(N, H * dv), m.o), selections

    def mlp(self, w: Mlp | MoeWeights, x: torch.Tensor) -> torch.Tensor:
        return moe(x, w, self.moe) if isinstance(w, MoeWeights) else w(x, self.moe.glu)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        hs = mhc.Streams(mhc.expand(embedding(batch.token_ids, self.embed), c.hc_mult), self.hc)  # [N, n, d]
        selections = None  # of the most recent full DSA layer, one per sequence
        causal = {}  # (sequence, keys) -> its selection where every pool fits: the same in every layer
        for L, w in enumerate(self.layers):
            x = hs.enter(w.attn_site, rms_norm, w.attn_norm, eps)
            if isinstance(w.mixer, KdaWeights):
                y = run_recurrent(kda.KDA, w.mixer, self.kda_dims, L, x, batch)
            else:
                y, sel = self.dsa_block(L, w.mixer, x, batch, selections, causal)
                if w.mixer.indexer is not None:
                    selections = sel
            hs.leave(y)
            x = hs.enter(w.ffn_site, rms_norm, w.mlp_norm, eps)
            hs.leave(self.mlp(w.mlp, x))
            if L in batch.taps:
                batch.tap(L, hs.value(), mhc.head_mean)
        h = hs.value()
        batch.finish()
        batch.tap(FINAL, h, mhc.head_mean)
        h = rms_norm(mhc.head_mean(h[batch.logit_rows]), self.norm, eps)
        return linear(h, self.lm_head).float()


def build(cfg: Glm5NextConfig, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    return Model(cfg, tensors, dtype, device)


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: Glm5NextConfig) -> list[str]:
    out = []
    for L in range(cfg.num_hidden_layers):
        mixer = "kda" if cfg.layer_types[L] == KDA else ("dsa" if cfg.is_full_indexer(L) else "dsa-shared")
        out.append(f"{mixer}+{'moe' if cfg.mlp_layer_types[L] == 'sparse' else 'mlp'}")
    return out


def state_bytes(cfg: Glm5NextConfig, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence). Per token: the latent of every DSA layer and the
    indexer k and z of every full one, in the cache dtype; these rows roll back for free. Fixed: every
    KDA layer's fp32 recurrent state and conv tail, once plus once per token of the rollback window. Not
    counted: the torch path's pooled indexer keys kept beside the rows (layers/dsa.kpool_select_held), one
    row of index_head_dim per complete pool, 1 / (2 index_kpool) of a full layer's k and z (up to twice
    that while its buffer doubles)."""
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
        n = torch.Size(s.shape).numel()
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


def draft_heads(cfg: Glm5NextConfig) -> tuple[str, ...]:
    """The config's MTP layer(s) serve MTP drafting."""
    return ("mtp",) if cfg.num_nextn_predict_layers > 0 else ()


# ---------------------------------------------------------------- tensor parallelism (moesaic/parallel/plan.py)

# The config counts each of N ranks takes 1/N of, and how its mixers' tensors split (axis 0: output rows,
# 1: input columns; experts, MLPs, embedding and lm_head follow parallel/plan.py's rules). DSA: NoPE MLA
# by heads, the latent, q's LoRA down-projection and the k-pool indexer replicated (every rank selects
# the same pools). KDA by heads: q/k/v and the fused conv's q | k | v channels, f_b, dt_bias, A_log, beta,
# g_b; f_a, g_a and o_norm replicated. mHC replicated.
TP_HEADS = ("num_attention_heads", "linear_num_heads")


def tp_plan(cfg: Glm5NextConfig) -> list:
    C = cfg.kda_dims.qkv_dim
    return [
        (r".*\.self_attn\.(q_b_proj|kv_b_proj|q_proj|k_proj|v_proj|b_proj|g_b_proj)\.weight", 0),
        (r".*\.self_attn\.forget_gate\.(f_b_proj\.weight|dt_bias|A_log)", 0),
        (r".*\.self_attn\.conv1d\.weight", Shard(0, (C, C, C))),
        (r".*\.self_attn\.o_proj\.weight", 1),
    ]

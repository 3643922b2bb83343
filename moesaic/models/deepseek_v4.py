"""DeepSeek-V4-Flash (`deepseek_v4`): sliding-window / CSA / HCA attention over one shared KV head,
inside mHC residual streams, with a sqrt-softplus MoE (hash-routed on the first layers).

    h = copies of embed(ids) in hc_mult streams                       # [N, n, d]
    for each layer:
        x, post, comb = mHC site (attention);  y = attention(RMSNorm(x));  h = post ⊗ y + combᵀ h
        x, post, comb = mHC site (FFN);        y = MoE(RMSNorm(x), ids);   h = post ⊗ y + combᵀ h
    logits = head(RMSNorm(weighted hyper head(h))).float()

    attention:  qr = RMSNorm(x Wq_a);  q = rope(headRMS(qr Wq_b));  kv = rope(RMSNorm(x Wkv))  (K = V)
                o = sink softmax over the window (+ HCA entries | + indexer-picked CSA entries)
                out = Wo_b · grouped Wo_a(rope⁻¹(o))
    MoE:        s = sqrt(softplus(x Wg)); experts = topk(s + bias) | tid2eid[id]; w = 1.5 s/Σs
                clamped SwiGLU experts + one shared expert

Layer schedule, state kinds, namings and proof: docs/families/deepseek_v4.md. Oracle: transformers
5.23 `src/transformers/models/deepseek_v4/modeling_deepseek_v4.py`. Shared math: layers/csa.py
(window + sink, compressors, indexer, grouped o-proj, the layer state), layers/mhc.py, layers/moe.py
(the MoE block with the sqrt-softplus router and a hash layer's static table), layers/rope.py.

Config. Field names and defaults are transformers' `DeepseekV4Config`, with its legacy keys:
`layer_types` (sliding / CSA / HCA), else the release's per-layer `compress_ratios` (0 / 4 / 128,
truncated to num_hidden_layers — the release lists one more entry, for the MTP layer), else
transformers' default (2 HCA, then CSA/HCA alternating); `compress_rates` (or `compress_rate_csa` /
`compress_rate_hca`); `mlp_layer_types`, else the first `num_hash_layers` (3) hash-routed. Two rope
sets: "main" (`rope_theta`, plain) on sliding layers, "compress" (`compress_rope_theta` + the YaRN
`rope_scaling` / `rope_parameters`, attention factor 1) on CSA/HCA layers, their compressors and the
indexer; a saved config carries them nested as `rope_parameters.{main,compress}`. The rotated width is
`head_dim · partial_rotary_factor` (legacy `qk_rope_head_dim`), the trailing channels of every vector.

The released DeepSeek-V4-Flash config (as inlined from the published `config.json` in alibaba/rtp-llm's
DeepSeek-V4 tests; the same schedule in antirez/ds4 MODEL_CARD.md): 43 layers, `compress_ratios`
[0, 0, then 4, 128 alternating …, 4, 0] = 2 sliding + 21 CSA + 20 HCA (+ the MTP slot), 3 hash
layers, 64 indexer heads, rope_theta 10000 / compress_rope_theta 160000, YaRN 16 over 65536.

Names. The model's own names are transformers' in-memory module names (`model.layers.L.self_attn.
q_a_proj.weight`, fused `mlp.experts.gate_up_proj [E, 2I, d]`, `model.hc_head.hc_fn`). Three
checkpoint namings are read: those module names (a `state_dict()` dump); what transformers'
`save_pretrained` writes (`model.layers.L.attn.wq_a.weight`, `attn.norm.weight`, `hc_attn_fn`,
`ffn.experts.E.w1.weight`, `head.weight`); and the upstream release names (`embed.weight`,
`layers.L.attn.wq_a.weight`, `attn.kv_norm.weight`, `attn.attn_sink`, `hc_head_fn`, `mtp.0.*`).
The MTP layer (`mtp.J.*`: e_proj, h_proj, enorm, hnorm, norm, hc_head_*, and one sliding-window
block) is declared optional and bound into `Model.mtp` (`MtpBlock`); spec/mtp.py drafts with it
(`Model.block`; no oracle: docs/families/deepseek_v4.md). Quantized weights (fp8 / fp4 with `.scale` companions) stay packed.

Where DeepSeek's own inference code (`inference/model.py` of the release) and the oracle disagree,
moesaic follows the oracle:
* Softmax dtype: the release's eager softmax runs in the compute dtype; transformers concatenates
  the fp32 sink parameter onto the logits, which promotes them: the softmax runs in fp32 even in a
  bf16 run (the logits q·k·scale are rounded to bf16 first). moesaic does the same.
* Layer schedule: transformers' default `layer_types` is "20 CSA + 23 HCA" (3,292 elements per
  token); the release's `compress_ratios` give 2 sliding + 21 CSA + 20 HCA: 21·(512+128)/4 +
  20·512/128 = 3,440 elements per token.
* `norm_topk_prob` and `n_shared_experts`: transformers always renormalises the routed weights and
  builds exactly one shared expert of width moe_intermediate_size; moesaic requires
  n_shared_experts = 1 and ignores norm_topk_prob.
* YaRN `truncate`: transformers reads it from the top level of `rope_parameters`, which for V4 only
  holds `main` / `compress`, so the correction range is always truncated (floor/ceil).
* `num_key_value_heads`: transformers ignores it (one shared KV head); moesaic requires 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import SequenceState
from ..config import (
    declared,
    eos_ids,
    field,
    layer_count,
    non_negative,
    positive,
    read_config,
    require,
    section,
)
from ..errors import CheckpointError, ConfigError
from ..layers import mhc
from ..layers.csa import (
    CSA,
    HCA,
    SLIDING,
    CompressorDims,
    CompressorWeights,
    RopeTail,
    attention_state_bytes,
    compressor_inputs,
    compressor_update,
    fused_attention,
    fused_inputs,
    fused_output,
    grouped_out,
    indexer_select,
    layer_compressors,
    new_attention_state,
    sink_attention,
    visible_entries,
)
from ..layers.linear import embedding, linear, products, replacement, stack_rows
from ..layers.moe import MoeSpec, MoeWeights, Router, clamped_silu_glu, moe
from ..layers.norms import head_rms, rms_norm_cast_once
from ..layers.rope import RopeConfig, cos_sin_attention_factor, inv_freq
from ..weights.bind import Tensors
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs
from .parts import bind_moe, moe_specs

MODEL_TYPES = ("deepseek_v4",)

HASH_MOE, MOE = "hash_moe", "moe"
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' map of the legacy compress_ratios
_SHORT = {SLIDING: "swa", CSA: "csa", HCA: "hca"}


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config:
    """Absent fields take transformers' `DeepseekV4Config` defaults (= the released Flash shape, except
    `layer_types`: the release states `compress_ratios`)."""

    vocab_size: int = declared(129280, check=positive)
    hidden_size: int = declared(4096, check=positive)
    num_hidden_layers: int = declared(43, check=positive)
    num_attention_heads: int = declared(64, check=positive)
    head_dim: int = declared(512, check=positive)
    q_lora_rank: int = declared(1024, check=positive)
    o_groups: int = declared(8, check=positive)
    o_lora_rank: int = declared(1024, check=positive)
    sliding_window: int = declared(128, check=positive)
    layer_types: tuple[str, ...]  # csa.SLIDING | csa.CSA | csa.HCA
    csa_ratio: int
    hca_ratio: int
    index_n_heads: int = declared(64, check=positive)
    index_head_dim: int = declared(128, check=positive)
    index_topk: int = declared(512, check=positive)
    mlp_layer_types: tuple[str, ...]  # "hash_moe" | "moe"
    n_routed_experts: int = declared(256, check=positive)
    num_experts_per_tok: int = declared(6, check=positive)
    moe_intermediate_size: int = declared(2048, check=positive)
    routed_scaling_factor: float = declared(1.5)
    swiglu_limit: float = declared(10.0, check=positive)
    hc_mult: int = declared(4, check=positive)
    hc_sinkhorn_iters: int = declared(20, check=positive)
    hc_eps: float = declared(1e-6, check=non_negative)
    rms_norm_eps: float = declared(1e-6, check=positive)
    rope_main: RopeConfig
    rope_main_factor: float  # cos/sin factor (YaRN attention factor; 1 for the plain set)
    rope_compress: RopeConfig
    rope_compress_factor: float
    max_position_embeddings: int = declared(1048576, check=positive)
    num_nextn_predict_layers: int = declared(1, check=non_negative)
    tie_word_embeddings: bool = declared(False)
    bos_token_id: int | None = declared(0)
    eos_token_ids: tuple[int, ...]
    model_type: str = "deepseek_v4"

    @property
    def mhc_dims(self) -> mhc.MhcDims:
        return mhc.MhcDims(self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps, self.rms_norm_eps)

    def compressors(self, layer: int):
        """(compressor dims, indexer compressor dims) of a layer; None where it has none."""
        return layer_compressors(
            self.layer_types[layer], self.head_dim, self.index_head_dim, self.csa_ratio, self.hca_ratio
        )

    @property
    def moe_spec(self) -> MoeSpec:
        """sqrt-softplus routing (a hash layer's experts from its table), clamped SwiGLU experts."""
        return MoeSpec(
            Router("sqrtsoftplus", self.num_experts_per_tok, scale=self.routed_scaling_factor),
            glu=partial(clamped_silu_glu, limit=self.swiglu_limit),
        )


# ---------------------------------------------------------------- config


def read_kinds(raw: dict, key: str, allowed, n: int, w: str) -> list:
    v = raw[key]
    if (
        not isinstance(v, list)
        or len(v) < n
        or any(not isinstance(x, str) or x not in allowed for x in v[:n])
    ):
        raise ConfigError(
            f"{w}: field {key!r} must list at least num_hidden_layers = {n} values from "
            f"{sorted(allowed, key=str)}, got {v!r}"
        )
    return list(v[:n])


def _rope(d: dict, head_dim: int, partial_factor: float, where: str) -> tuple[RopeConfig, float]:
    """One rope set: its RopeConfig and its cos/sin factor."""
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported (default or yarn)")
    factor = field(d, "partial_rotary_factor", float, partial_factor, where=where, check=lambda v: 0 < v <= 1)
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2:
        raise ConfigError(
            f"{where}: the rotated width head_dim·partial_rotary_factor = {dim} must be a positive even number"
        )
    if kind == "yarn" and "factor" not in d:
        raise ConfigError(f"{where}: field 'factor' is missing (YaRN needs it)")
    # transformers: `beta_fast or 32`, `beta_slow or 1`; `truncate` is read from the top level, where
    # V4 has none (always truncated)
    d = {k: v for k, v in d.items() if k not in ("beta_fast", "beta_slow") or v}
    rope = read_config(RopeConfig, d, where, {"mscale": 0.0}, dim=dim, kind=kind, truncate=True)
    if kind != "yarn":
        return rope, 1.0
    return rope, field(
        d, "attention_factor", float, cos_sin_attention_factor(rope), where=where, check=positive
    )


def _compress_rates(raw: dict, w: str) -> tuple[int, int]:
    rates = dict(section(raw, "compress_rates", w))
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    rw = f"{w} compress_rates"
    return field(rates, CSA, int, 4, where=rw, check=positive), field(
        rates, HCA, int, 128, where=rw, check=positive
    )


def _layer_types(raw: dict, n: int, csa_ratio: int, hca_ratio: int, w: str) -> list[str]:
    if raw.get("layer_types") is not None:
        return read_kinds(raw, "layer_types", {SLIDING, CSA, HCA}, n, w)
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        known = {0: SLIDING, **_RATIO_KIND, csa_ratio: CSA, hca_ratio: HCA}
        if (
            not isinstance(ratios, list)
            or len(ratios) < n
            or any(isinstance(r, bool) or not isinstance(r, int) or r not in known for r in ratios[:n])
        ):
            raise ConfigError(
                f"{w}: field 'compress_ratios' must list at least num_hidden_layers = {n} values from "
                f"{sorted(known)}, got {ratios!r}"
            )
        return [known[r] for r in ratios[:n]]
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def _ropes(raw: dict, head_dim: int, w: str) -> dict:
    """rope_main / rope_compress (and their factors): main on sliding layers, compress on CSA/HCA
    layers, their compressors and the indexer."""
    rp = section(raw, "rope_parameters", w) or section(raw, "rope_scaling", w)
    partial_factor = raw.get("partial_rotary_factor")
    if partial_factor is None:
        partial_factor = field(raw, "qk_rope_head_dim", int, 64, where=w, check=positive) / head_dim
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_d, comp_d = rp["main"], rp["compress"]
    else:
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta")}
        main_d = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        comp_d = {**yarn, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        if comp_d.get("rope_type", comp_d.get("type")) == "yarn":
            comp_d.setdefault("attention_factor", 1.0)  # transformers: V4 does not scale cos/sin
    main, main_factor = _rope(main_d, head_dim, partial_factor, f"{w} rope_parameters.main")
    comp, comp_factor = _rope(comp_d, head_dim, partial_factor, f"{w} rope_parameters.compress")
    return dict(
        rope_main=main, rope_main_factor=main_factor, rope_compress=comp, rope_compress_factor=comp_factor
    )


def parse_config(raw: dict, layout: str = "hf") -> DeepseekV4Config:
    if layout != "hf":
        raise ConfigError(f"DeepSeek-V4 checkpoints come with a config.json, not a {layout} layout")
    w = "config.json"
    n = layer_count(raw, "num_hidden_layers", 43, where=w)
    head_dim = field(raw, "head_dim", int, 512, where=w, check=positive)
    kv_heads = field(raw, "num_key_value_heads", int, 1, where=w)
    require(kv_heads == 1, w, "num_key_value_heads", kv_heads, "must be 1: DeepSeek-V4 shares one KV head")
    for key, want, why in (
        ("hidden_act", "silu", "uses silu"),
        ("scoring_func", "sqrtsoftplus", "routes by sqrtsoftplus"),
    ):
        got = field(raw, key, str, want, where=w)
        require(got == want, w, key, got, f"not supported: DeepSeek-V4 {why}")
    for key in ("attention_bias", "mlp_bias"):
        require(not raw.get(key), w, key, raw.get(key), "not supported: the released model has no biases")
    shared = field(raw, "n_shared_experts", int, 1, where=w)
    require(
        shared == 1,
        w,
        "n_shared_experts",
        shared,
        "must be 1: DeepSeek-V4 has one shared expert of width moe_intermediate_size",
    )
    csa_ratio, hca_ratio = _compress_rates(raw, w)
    if raw.get("mlp_layer_types") is not None:
        mlp_types = read_kinds(raw, "mlp_layer_types", {HASH_MOE, MOE}, n, w)
    else:
        n_hash = field(raw, "num_hash_layers", int, 3, where=w, check=non_negative)
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    cfg = read_config(
        DeepseekV4Config,
        raw,
        w,
        layer_types=tuple(_layer_types(raw, n, csa_ratio, hca_ratio, w)),
        csa_ratio=csa_ratio,
        hca_ratio=hca_ratio,
        mlp_layer_types=tuple(mlp_types),
        eos_token_ids=eos_ids(raw.get("eos_token_id", 1), w),
        **_ropes(raw, head_dim, w),
    )
    H, E = cfg.num_attention_heads, cfg.n_routed_experts
    require(
        H % cfg.o_groups == 0,
        w,
        "o_groups",
        cfg.o_groups,
        f"must divide num_attention_heads = {H} (groups are whole heads)",
    )
    k = cfg.num_experts_per_tok
    require(k <= E, w, "num_experts_per_tok", k, f"must be in 1..n_routed_experts={E}")
    require(
        cfg.rope_compress.dim <= cfg.index_head_dim,
        w,
        "index_head_dim",
        cfg.index_head_dim,
        f"narrower than the rotated width {cfg.rope_compress.dim} the indexer ropes",
    )
    return cfg


# ---------------------------------------------------------------- tensor contract


def attention_block_specs(cfg, p: str, L: int, optional: bool = False) -> list[TensorSpec]:
    """A block's norms, mHC sites and attention core (no compressors): the same in V4 and V4.1."""
    d, H, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    opt = dict(layer=L, optional=optional)
    f32 = dict(keep_fp32=True, **opt)
    shapes = mhc.site_shapes(cfg.mhc_dims, d)
    specs = [
        TensorSpec(p + "input_layernorm.weight", (d,), "norm", **f32),
        TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", **f32),
    ]
    for site in ("attn_hc", "ffn_hc"):
        specs += [TensorSpec(f"{p}{site}.{k}", shapes[k], "mhc", **f32) for k in ("fn", "base", "scale")]
    a = p + "self_attn."
    specs += [
        TensorSpec(a + "q_a_proj.weight", (cfg.q_lora_rank, d), "attention", **opt),
        TensorSpec(a + "q_a_norm.weight", (cfg.q_lora_rank,), "norm", **f32),
        TensorSpec(a + "q_b_proj.weight", (H * D, cfg.q_lora_rank), "attention", **opt),
        TensorSpec(a + "kv_proj.weight", (D, d), "attention", **opt),
        TensorSpec(a + "kv_norm.weight", (D,), "norm", **f32),
        TensorSpec(
            a + "o_a_proj.weight",
            (cfg.o_groups * cfg.o_lora_rank, H * D // cfg.o_groups),
            "attention",
            dense=True,
            **opt,
        ),  # read per group through views
        TensorSpec(a + "o_b_proj.weight", (d, cfg.o_groups * cfg.o_lora_rank), "attention", **opt),
        TensorSpec(a + "sinks", (H,), "attention", **f32),
    ]
    return specs


def compressor_specs(
    c: str, dims: CompressorDims, d: int, role: str, L: int, optional=False, gate=True, ape=True
) -> list[TensorSpec]:
    """A compressor under `c`: wkv, its gate (V4.1's ratio 1 has none), the gate's position bias (V4
    only) and the entry norm."""
    opt = dict(layer=L, optional=optional)
    specs = [TensorSpec(c + "kv_proj.weight", (dims.proj_width, d), role, **opt)]
    if gate:
        specs.append(TensorSpec(c + "gate_proj.weight", (dims.proj_width, d), role, **opt))
    if ape:
        specs.append(
            TensorSpec(c + "position_bias", (dims.ratio, dims.proj_width), role, keep_fp32=True, **opt)
        )
    return specs + [TensorSpec(c + "kv_norm.weight", (dims.width,), "norm", keep_fp32=True, **opt)]


def index_query_specs(cfg, a: str, L: int, optional: bool = False) -> list[TensorSpec]:
    """The indexer's query side under `a` (= "…self_attn."): its q from qr and its head weights."""
    i, opt = a + "compressor.indexer.", dict(layer=L, optional=optional)
    return [
        TensorSpec(
            i + "q_b_proj.weight", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "indexer", **opt
        ),
        TensorSpec(i + "scorer.weights_proj.weight", (cfg.index_n_heads, cfg.hidden_size), "indexer", **opt),
    ]


def moe_layer_specs(cfg, m: str, L: int, hashed: bool, optional: bool = False) -> list[TensorSpec]:
    """The MoE under `m`: parts.moe_specs with one shared expert; a hash layer has its tid2eid table
    (int64 in checkpoints; fp32 holds expert ids exactly) where the others have the selection bias."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    specs = moe_specs(m, E, I, cfg.hidden_size, L, bias=not hashed, shared=I, optional=optional)
    if hashed:
        table = (cfg.vocab_size, cfg.num_experts_per_tok)
        t = TensorSpec(m + "gate.tid2eid", table, "router", L, optional, keep_fp32=True, integer=True)
        specs.insert(1, t)
    return specs


def _layer_specs(
    cfg: DeepseekV4Config, p: str, kind: str, mlp: str, L: int, optional: bool
) -> list[TensorSpec]:
    """One decoder block's tensors; an MTP block (optional=True) reports every tensor under role "mtp"."""
    d, a = cfg.hidden_size, p + "self_attn."
    specs = attention_block_specs(cfg, p, L, optional)
    comp, idx = layer_compressors(kind, cfg.head_dim, cfg.index_head_dim, cfg.csa_ratio, cfg.hca_ratio)
    if comp is not None:
        specs += compressor_specs(a + "compressor.", comp, d, "compressor", L, optional)
    if idx is not None:
        specs += compressor_specs(a + "compressor.indexer.", idx, d, "indexer", L, optional)
        specs += index_query_specs(cfg, a, L, optional)
    specs += moe_layer_specs(cfg, p + "mlp.", L, mlp == HASH_MOE, optional)
    return [dataclasses.replace(s, role="mtp") for s in specs] if optional else specs


def hc_head_specs(cfg: DeepseekV4Config, p: str, role: str, optional: bool) -> list[TensorSpec]:
    n, d = cfg.hc_mult, cfg.hidden_size
    return [
        TensorSpec(p + "hc_head.hc_fn", (n, n * d), role, keep_fp32=True, optional=optional),
        TensorSpec(p + "hc_head.hc_base", (n,), role, keep_fp32=True, optional=optional),
        TensorSpec(p + "hc_head.hc_scale", (1,), role, keep_fp32=True, optional=optional),
    ]


def tensor_specs(cfg: DeepseekV4Config) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding")]
    for L in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, f"model.layers.{L}.", cfg.layer_types[L], cfg.mlp_layer_types[L], L, False)
    specs.append(TensorSpec("model.norm.weight", (d,), "norm", keep_fp32=True))
    specs += hc_head_specs(cfg, "model.", "mhc", False)
    specs.append(
        TensorSpec("lm_head.weight", (cfg.vocab_size, d), "lm_head", optional=cfg.tie_word_embeddings)
    )
    for j in range(cfg.num_nextn_predict_layers):  # the MTP layer(s): a sliding-window block + its own head
        p, L = f"mtp.{j}.", cfg.num_hidden_layers + j
        specs += _layer_specs(cfg, p, SLIDING, MOE, L, True)
        specs += [
            TensorSpec(p + "e_proj.weight", (d, d), "mtp", L, optional=True),
            TensorSpec(p + "h_proj.weight", (d, d), "mtp", L, optional=True),
            TensorSpec(p + "enorm.weight", (d,), "mtp", L, optional=True, keep_fp32=True),
            TensorSpec(p + "hnorm.weight", (d,), "mtp", L, optional=True, keep_fp32=True),
            TensorSpec(p + "norm.weight", (d,), "mtp", L, optional=True, keep_fp32=True),
        ]
        specs += hc_head_specs(cfg, p, "mtp", True)
    return specs


# module-name suffix -> checkpoint suffix (transformers-saved = upstream, except the attention's kv norm)
_SUFFIX = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{
        f"{site}.{k}": f"hc_{ck}_{k}"
        for site, ck in (("attn_hc", "attn"), ("ffn_hc", "ffn"))
        for k in ("fn", "base", "scale")
    },
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    **{
        f"self_attn.compressor.{a}": f"attn.compressor.{b}"
        for a, b in (
            ("kv_proj.weight", "wkv.weight"),
            ("gate_proj.weight", "wgate.weight"),
            ("position_bias", "ape"),
            ("kv_norm.weight", "norm.weight"),
        )
    },
    **{
        f"self_attn.compressor.indexer.{a}": f"attn.indexer.compressor.{b}"
        for a, b in (
            ("kv_proj.weight", "wkv.weight"),
            ("gate_proj.weight", "wgate.weight"),
            ("position_bias", "ape"),
            ("kv_norm.weight", "norm.weight"),
        )
    },
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    **{f"hc_head.hc_{k}": f"hc_head_{k}" for k in ("fn", "base", "scale")},  # the MTP layer's head
}


def checkpoint_naming(upstream: bool) -> Naming:
    """The names transformers' `save_pretrained` writes (upstream=False) or DeepSeek's release uses."""
    top = {
        "model.embed_tokens.weight": "embed.weight" if upstream else "model.embed_tokens.weight",
        "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight" if upstream else "model.norm.weight",
    }
    for k in ("fn", "base", "scale"):
        top[f"model.hc_head.hc_{k}"] = f"hc_head_{k}" if upstream else f"model.hc_head.hc_{k}"
    kv_norm = "attn.kv_norm.weight" if upstream else "attn.norm.weight"

    def source(spec: TensorSpec) -> Source:
        if spec.name in top:
            return direct(top[spec.name], spec.shape)
        if spec.name.startswith("mtp."):
            j, rest = spec.name.split(".", 2)[1:]
            prefix = f"mtp.{j}."
        else:
            L, rest = spec.name.split(".", 3)[2:]
            prefix = f"layers.{L}." if upstream else f"model.layers.{L}."
        if rest == "mlp.experts.gate_up_proj":
            E, I2, d = spec.shape
            ex = [f"{prefix}ffn.experts.{e}." for e in range(E)]
            return stacked_pairs([x + "w1.weight" for x in ex], [x + "w3.weight" for x in ex], (I2 // 2, d))
        if rest == "mlp.experts.down_proj":
            return stacked(
                [f"{prefix}ffn.experts.{e}.w2.weight" for e in range(spec.shape[0])], spec.shape[1:]
            )
        if rest == "self_attn.kv_norm.weight":
            return direct(prefix + kv_norm, spec.shape)
        return direct(prefix + _SUFFIX.get(rest, rest), spec.shape)

    if upstream:
        return Naming("DeepSeek-V4 release (embed.weight, layers.N.attn.*)", source, [r"mtp\..*"])
    return Naming("transformers-saved (model.layers.N.attn.*)", source)


def module_naming() -> Naming:
    """transformers' in-memory module names (a raw `state_dict()` dump)."""
    return Naming(
        "transformers modules (model.layers.N.self_attn.*)", lambda spec: direct(spec.name, spec.shape)
    )


def namings(cfg: DeepseekV4Config, layout: str, store_names) -> Naming:
    names = set(store_names)
    if "embed.weight" in names or any(n.startswith("layers.") for n in names):
        return checkpoint_naming(upstream=True)
    if any(n.endswith(".attn_hc.fn") for n in names):
        return module_naming()
    return checkpoint_naming(upstream=False)


# ---------------------------------------------------------------- bound weights


@dataclass
class IndexQuery:
    """The lightning indexer's query side: q_b [n_I·c_I, q_lora_rank] (from qr), weights [n_I, d]."""

    q_b: object
    weights: object


@dataclass
class Attention:
    """One attention layer: the core every layer has, and the compressor (CSA/HCA), the indexer's own
    compressor and its query side (CSA) where the layer has them."""

    q_a: object
    q_a_norm: Tensor
    q_b: object
    kv: object
    kv_norm: Tensor
    o_a: Tensor  # [groups·r, H·D / groups], read per group as a view
    o_b: object
    sinks: Tensor
    compressor: CompressorWeights | None = None
    index_compressor: CompressorWeights | None = None
    index: IndexQuery | None = None
    # q_a, kv and the compressors' kv / gate (all of the layer input), stacked: one product each at decode sizes
    x_stacks: tuple = ()
    # cpu.v4_plan by (rows, threads), made at the first call (layers/csa.py fused_attention)
    fused_plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


def stack_inputs(a: Attention) -> Attention:
    """`a` with its products of the layer input stacked (layers/linear.stack_rows: the dense bf16 ones in one,
    the packed ones that share a scale layout in another): its fields become views of the stacks' rows."""
    comps = [a.compressor, a.index_compressor]
    stacks = stack_rows([a.q_a, a.kv] + [w for c in comps if c is not None for w in (c.wkv, c.wgate)])
    if not stacks:
        return a
    swap = replacement(stacks)
    v = lambda w: swap.get(id(w), w)  # noqa: E731

    def comp(c):
        return None if c is None else dataclasses.replace(c, wkv=v(c.wkv), wgate=v(c.wgate))

    return dataclasses.replace(
        a,
        q_a=v(a.q_a),
        kv=v(a.kv),
        compressor=comp(a.compressor),
        index_compressor=comp(a.index_compressor),
        x_stacks=stacks,
    )


@dataclass
class Layer:
    attn_norm: Tensor
    attn_hc: mhc.MhcSite
    attn: Attention
    mlp_norm: Tensor
    mlp_hc: mhc.MhcSite
    mlp: MoeWeights


@dataclass
class MtpBlock:
    """One MTP layer (`mtp.J.*`), kept for a drafter: h' = block(e_proj(enorm(embed(t+1))) +
    h_proj(hnorm(h))) over the main model's streams, then its own hyper head and norm."""

    e_proj: object
    h_proj: object
    enorm: Tensor
    hnorm: Tensor
    norm: Tensor
    hc_head: mhc.MhcSite
    layer: Layer


def bind_site(t: Tensors, p: str) -> mhc.MhcSite:
    """An mHC site's weights `p`fn, `p`base, `p`scale (the hyper head's: p = "hc_head.hc_")."""
    return mhc.MhcSite(t(p + "fn"), t(p + "base"), t(p + "scale"))


def bind_compressor(t: Tensors, dims: CompressorDims, device) -> CompressorWeights:
    """A compressor under `t`'s prefix; no gate (V4.1's ratio 1) and no position bias (V4.1) read as
    gate weight 1 and a zero bias."""
    ape = t.optional("position_bias")
    return CompressorWeights(
        t("kv_proj.weight"),
        t.optional("gate_proj.weight"),
        torch.zeros(dims.ratio, dims.proj_width, device=device) if ape is None else ape,
        t("kv_norm.weight"),
    )


def bind_attention(
    t: Tensors, comp: CompressorDims | None, index_comp: CompressorDims | None, query: bool, device
) -> Attention:
    """The attention under `t`'s prefix (`…self_attn.`): its compressor (comp), the indexer's
    compressor (index_comp) and the indexer's query side (query) where the layer has them."""
    return stack_inputs(
        Attention(
            q_a=t("q_a_proj.weight"),
            q_a_norm=t("q_a_norm.weight"),
            q_b=t("q_b_proj.weight"),
            kv=t("kv_proj.weight"),
            kv_norm=t("kv_norm.weight"),
            o_a=t("o_a_proj.weight"),
            o_b=t("o_b_proj.weight"),
            sinks=t("sinks"),
            compressor=None if comp is None else bind_compressor(t.under("compressor."), comp, device),
            index_compressor=None
            if index_comp is None
            else bind_compressor(t.under("compressor.indexer."), index_comp, device),
            index=IndexQuery(
                t("compressor.indexer.q_b_proj.weight"), t("compressor.indexer.scorer.weights_proj.weight")
            )
            if query
            else None,
        )
    )


def bind_hash_table(t: Tensors, experts: int) -> Tensor:
    """A hash layer's tid2eid [vocab, k] (under `…mlp.`) as int64 expert ids, checked."""
    table = t("gate.tid2eid")
    if table.min() < 0 or table.max() >= experts or not torch.equal(table, table.round()):
        raise CheckpointError(f"{t.prefix}gate.tid2eid holds expert ids outside 0..{experts - 1}")
    return table.long()


def bind_layer(t: Tensors, attn: Attention, mlp: MoeWeights, cls=Layer, **extra) -> Layer:
    """A decoder block under `t`'s prefix around its bound attention and MoE (`cls`, `extra`: a
    family's Layer that adds fields, V4.1's)."""
    return cls(
        attn_norm=t("input_layernorm.weight"),
        attn_hc=bind_site(t, "attn_hc."),
        attn=attn,
        mlp_norm=t("post_attention_layernorm.weight"),
        mlp_hc=bind_site(t, "ffn_hc."),
        mlp=mlp,
        **extra,
    )


def bind_v4_layer(t: Tensors, cfg: DeepseekV4Config, kind: str, mlp: str, device) -> Layer:
    comp, idx = layer_compressors(kind, cfg.head_dim, cfg.index_head_dim, cfg.csa_ratio, cfg.hca_ratio)
    m = t.under("mlp.")
    table = bind_hash_table(m, cfg.n_routed_experts) if mlp == HASH_MOE else None
    return bind_layer(
        t,
        bind_attention(t.under("self_attn."), comp, idx, idx is not None, device),
        bind_moe(m, hash_ids=table),
    )


def bind_mtp(t: Tensors, cfg: DeepseekV4Config, device) -> MtpBlock:
    return MtpBlock(
        e_proj=t("e_proj.weight"),
        h_proj=t("h_proj.weight"),
        enorm=t("enorm.weight"),
        hnorm=t("hnorm.weight"),
        norm=t("norm.weight"),
        hc_head=bind_site(t, "hc_head.hc_"),
        layer=bind_v4_layer(t, cfg, SLIDING, MOE, device),
    )


# ---------------------------------------------------------------- attention pieces (V4.1 uses them too)


def attention_inputs(
    w: Attention, x: Tensor, cfg, rope: RopeTail, positions: Tensor, q_head_norm: bool = True, lin=None
):
    """(qr, q [N, H, D] roped, kv [N, D] roped) of the packed layer input: qr = RMSNorm(x Wq_a),
    q = rope(headRMS(qr Wq_b)) (V4.1: no head RMS), kv = rope(RMSNorm(x Wkv)). `lin`: linear(x, ·) as
    layers/linear.products gives it (the stacked products), else linear."""
    lin = lin or products(x, ())
    return inputs_of(w, lin(w.q_a), lin(w.kv), cfg, rope, positions, q_head_norm)


def inputs_of(
    w: Attention, qa: Tensor, kv: Tensor, cfg, rope: RopeTail, positions: Tensor, q_head_norm: bool = True
):
    """attention_inputs from x's products qa = x Wq_a, kv = x Wkv."""
    eps, N, H = cfg.rms_norm_eps, qa.shape[0], cfg.num_attention_heads
    fused = fused_inputs(qa, kv, w.q_b, w.q_a_norm, w.kv_norm, eps, H, q_head_norm, rope, positions)
    if fused is not None:  # the CPU: the code below in one call
        return fused
    qr = rms_norm_cast_once(qa, w.q_a_norm, eps)
    q = linear(qr, w.q_b).view(N, H, cfg.head_dim)
    q = rope(head_rms(q, eps) if q_head_norm else q, positions)
    return qr, q, _kv_rows(kv, w, cfg, rope, positions)


def attention_kv(w: Attention, x: Tensor, cfg, rope: RopeTail, positions: Tensor, lin=None) -> Tensor:
    """kv [N, D] = rope(RMSNorm(x Wkv)), the one key (= value) row of each input row."""
    return _kv_rows((lin or products(x, ()))(w.kv), w, cfg, rope, positions)


def _kv_rows(kv: Tensor, w: Attention, cfg, rope: RopeTail, positions: Tensor) -> Tensor:
    return rope(rms_norm_cast_once(kv, w.kv_norm, cfg.rms_norm_eps), positions)


def index_query(w: IndexQuery, qr: Tensor, x: Tensor, cfg, rope: RopeTail, positions: Tensor):
    """(q_I [N, n_I, c_I] roped, head weights [N, n_I] fp32 scaled by n_I^-1/2) of the indexer."""
    nI = cfg.index_n_heads
    qi = rope(linear(qr, w.q_b).view(x.shape[0], nI, cfg.index_head_dim), positions)
    return qi, linear(x, w.weights).float() * nI**-0.5


def attention_output(w: Attention, o: Tensor, cfg, rope: RopeTail, positions: Tensor) -> Tensor:
    """Wo_b · grouped Wo_a(rope⁻¹(o)) for o [N, H, D]."""
    fused = fused_output(o, w.o_a, w.o_b, cfg.o_groups, rope, positions)
    if fused is not None:  # the CPU: the code below in one call
        return fused
    o = rope(o, positions, inverse=True)
    return grouped_out(o.reshape(o.shape[0], -1), w.o_a, w.o_b, cfg.o_groups)


# ---------------------------------------------------------------- model


class Model:
    """The DeepSeek-V4 decoder over a ForwardBatch."""

    def __init__(self, cfg: DeepseekV4Config, t: Tensors, dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.hc = cfg.mhc_dims
        self.moe = cfg.moe_spec
        self.rope = {SLIDING: RopeTail(inv_freq(cfg.rope_main).to(device), cfg.rope_main_factor)}
        self.rope[CSA] = self.rope[HCA] = RopeTail(
            inv_freq(cfg.rope_compress).to(device), cfg.rope_compress_factor
        )
        self.embed = t("model.embed_tokens.weight")
        self.norm = t("model.norm.weight")
        self.lm_head = t.optional("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = self.embed
        self.hc_head = bind_site(t, "model.hc_head.hc_")
        self.layers = [
            bind_v4_layer(
                t.under(f"model.layers.{L}."), cfg, cfg.layer_types[L], cfg.mlp_layer_types[L], device
            )
            for L in range(cfg.num_hidden_layers)
        ]
        # the MTP layer(s), for a drafter (spec/); empty when the checkpoint has none
        self.mtp = [
            bind_mtp(t.under(f"mtp.{j}."), cfg, device)
            for j in range(cfg.num_nextn_predict_layers)
            if t.any_under(f"mtp.{j}.")
        ]

    # -- state
    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """`rollback_window`: how many of its last tokens a sequence can forget exactly (each window and
        compressor buffer keeps that many rows more than it reads)."""
        c = self.cfg
        return SequenceState(
            [
                new_attention_state(
                    c.layer_types[L],
                    c.head_dim,
                    c.index_head_dim,
                    c.csa_ratio,
                    c.hca_ratio,
                    c.sliding_window,
                    self.dtype,
                    self.device,
                    c.max_position_embeddings,
                    rollback_window,
                )
                for L in range(c.num_hidden_layers)
            ]
        )

    # -- blocks
    def attention(
        self, L: int, w: Attention, x: Tensor, batch: ForwardBatch, kind: str | None = None
    ) -> Tensor:
        """Layer L's attention (L indexes the sequences' states); `kind` for a block outside the decoder
        (the MTP layer's sliding window)."""
        c = self.cfg
        kind = kind or c.layer_types[L]
        rope, pos = self.rope[kind], batch.positions
        lin = products(x, w.x_stacks)
        comp = None if w.compressor is None else compressor_inputs(x, w.compressor, lin)
        idx = None if w.index_compressor is None else compressor_inputs(x, w.index_compressor, lin)
        # each product once, whichever path runs (an unstacked weight's lin is a product at each call)
        qa, kv = lin(w.q_a), lin(w.kv)
        layers = [s.state.layers[L] for s in batch.seqs]
        fused = fused_attention(layers, batch, qa, kv, comp, idx, w, c, kind, rope)
        if fused is not None:  # the CPU: the code below in one call
            return fused
        qr, q, kv = inputs_of(w, qa, kv, c, rope, pos)
        queries = []  # the indexer's queries of every row, made for the first sequence that needs scores

        def index_rows():
            if not queries:
                queries.extend(index_query(w.index, qr, x, c, rope, pos))
            return queries

        out = None
        for s in batch.seqs:
            parts = [None if t is None else [s.rows(r) for r in t] for t in (comp, idx)]
            o = self.attend(
                L,
                w,
                kind,
                s,
                s.rows(q),
                s.rows(pos),
                s.rows(kv),
                *parts,
                lambda s=s: [s.rows(t) for t in index_rows()],
            )
            out = s.place(out, o, q)
        return attention_output(w, out, c, rope, pos)

    def attend(self, L: int, w: Attention, kind: str, s, q, pos, kv, comp, idx, index_rows) -> Tensor:
        """One sequence's rows of layer L's attention: q [n, H, D], pos, kv [n, D] and the compressors'
        inputs (kv, gate) its rows of them; index_rows() gives the indexer's queries of its rows. Appends
        the rows to the sequence's window and compressors."""
        c, eps, rope = self.cfg, self.cfg.rms_norm_eps, self.rope[kind]
        st = s.state.layers[L]
        win_start = s.past - st.window.held
        win = st.window.append(kv=kv)["kv"]
        entries = sel = None
        if comp is not None:
            entries = compressor_update(st.compressor, *comp, w.compressor, eps, rope)[0]
        if idx is not None:
            keys = compressor_update(st.indexer, *idx, w.index_compressor, eps, rope)[0]
            if keys.shape[0] <= c.index_topk:  # every entry fits in the top-k: each visible one is kept
                sel = visible_entries(pos, keys.shape[0], c.csa_ratio, newest=True)
            else:
                qi, wts = index_rows()
                sel = indexer_select(qi, wts, keys, pos, c.csa_ratio, c.index_topk)[0]
        ratio = c.hca_ratio if kind == HCA else c.csa_ratio
        scale = c.head_dim**-0.5
        return sink_attention(
            q, pos, s.past, win, win_start, c.sliding_window, w.sinks, scale, entries, sel, ratio
        )

    def block(self, L: int, w: Layer, hs: mhc.Streams, batch: ForwardBatch, kind: str | None = None) -> None:
        """One decoder block over the streams hs (the MTP layer's too: `kind` SLIDING); its last update
        waits in hs for the next block's site (mhc.Streams)."""
        eps = self.cfg.rms_norm_eps
        x = hs.enter(w.attn_hc, rms_norm_cast_once, w.attn_norm, eps)
        hs.leave(self.attention(L, w.attn, x, batch, kind))
        x = hs.enter(w.mlp_hc, rms_norm_cast_once, w.mlp_norm, eps)
        hs.leave(moe(x, w.mlp, self.moe, batch.token_ids))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        eps = c.rms_norm_eps
        hs = mhc.Streams(mhc.expand(embedding(batch.token_ids, self.embed), c.hc_mult), self.hc)  # [N, n, d]
        for L, w in enumerate(self.layers):
            self.block(L, w, hs, batch)
            if L in batch.taps:
                batch.tap(L, hs.value(), mhc.head_mean)
        h = hs.value()
        batch.finish()
        head = self.hc_head
        batch.tap(FINAL, h, lambda s: mhc.head_weighted(s, head.fn, head.base, head.scale, self.hc))
        h = mhc.head_weighted(h[batch.logit_rows], head.fn, head.base, head.scale, self.hc)
        return linear(rms_norm_cast_once(h, self.norm, eps), self.lm_head).float()


def build(cfg: DeepseekV4Config, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    return Model(cfg, tensors, dtype, device)


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: DeepseekV4Config) -> list[str]:
    return [f"{_SHORT[cfg.layer_types[L]]}+{cfg.mlp_layer_types[L]}" for L in range(cfg.num_hidden_layers)]


def state_bytes(cfg: DeepseekV4Config, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence). Per token: each compressor's entries (width/ratio
    elements; CSA layers also their indexer's). Fixed: each layer's window rows (window − 1) and each
    compressor's open-window raw rows, plus `rollback_window` rows of each."""
    per_token = fixed = 0
    for kind in cfg.layer_types:
        pt, fx = attention_state_bytes(
            kind,
            cfg.head_dim,
            cfg.index_head_dim,
            cfg.csa_ratio,
            cfg.hca_ratio,
            cfg.sliding_window,
            dtype_bytes,
            rollback_window,
        )
        per_token, fixed = per_token + pt, fixed + fx
    return per_token, fixed


def max_context(cfg: DeepseekV4Config) -> int:
    return cfg.max_position_embeddings


def facts(cfg: DeepseekV4Config) -> dict:
    d, I = cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "sliding_layers": cfg.layer_types.count(SLIDING),
        "csa_layers": cfg.layer_types.count(CSA),
        "hca_layers": cfg.layer_types.count(HCA),
        "compress_rates": {"csa": cfg.csa_ratio, "hca": cfg.hca_ratio},
        "sliding_window": cfg.sliding_window,
        "index_heads": cfg.index_n_heads,
        "index_topk": cfg.index_topk,
        "hash_moe_layers": cfg.mlp_layer_types.count(HASH_MOE),
        "mtp_layers": cfg.num_nextn_predict_layers,
        "hc_mult": cfg.hc_mult,
        "experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_params": 3 * d * I,
        "expert_bytes_bf16": 3 * d * I * 2,
    }


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg: DeepseekV4Config) -> tuple[str, ...]:
    """The MTP layer(s) the config declares (`num_nextn_predict_layers`) serve MTP drafting."""
    return ("mtp",) if cfg.num_nextn_predict_layers > 0 else ()


# ---------------------------------------------------------------- tensor parallelism (moesaic/parallel/plan.py)

# The config counts each of N ranks takes 1/N of, and how the attention's tensors split (axis 0: output
# rows, 1: input columns; experts, shared experts, embedding and lm_head follow parallel/plan.py's
# rules). Heads and the grouped output projection's groups (whole heads) split: q_b by heads, the sinks,
# o_a by groups, o_b by its input groups. The one shared KV head, q's LoRA down-projection, the
# compressors, the lightning indexer, mHC and the hyper head are replicated.
TP_HEADS = ("num_attention_heads", "o_groups")


def tp_plan(cfg) -> list:
    return [
        (r".*\.self_attn\.(q_b_proj|o_a_proj)\.weight", 0),
        (r".*\.self_attn\.sinks", 0),
        (r".*\.self_attn\.o_b_proj\.weight", 1),
    ]

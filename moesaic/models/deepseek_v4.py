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

Math, names and pitfalls: shared/reference/deepseek_v4.md. Oracle: transformers 5.23 `deepseek_v4`.
Shared math: layers/csa.py (window + sink, compressors, indexer, grouped o-proj, the layer state),
layers/mhc.py, layers/moe.py (`route_sqrtsoftplus`, `clamped_swiglu`), layers/rope.py (`rope_pairs`).

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
block) is declared optional and kept in `Model.mtp` for a drafter; nothing runs it yet (no oracle).
FP8 / FP4 weights (`.scale` companions) are refused with a CheckpointError until the quantization
issue lands; bf16 / fp32 checkpoints load.

State per sequence: one `csa.AttentionState` per layer — the window's key rows, and on CSA/HCA layers
the compressor's open-window raw rows and closed entries (plus the indexer's on CSA layers);
rollback(n) is exact for n <= the `rollback_window` given to `new_state`. MoE, mHC: none.

Where the reference and the oracle disagree, moesaic follows the oracle:
* Softmax dtype (reference §2.3: "the eager softmax runs in the compute dtype"). transformers
  concatenates the fp32 sink parameter onto the logits, which promotes them: the softmax runs in
  fp32 even in a bf16 run (the logits q·k·scale are rounded to bf16 first). moesaic does the same.
* Layer schedule (reference §1.1, §6: "20 CSA + 23 HCA", 3,292 elements per token). That is
  transformers' default `layer_types`; the release's `compress_ratios` give 2 sliding + 21 CSA +
  20 HCA: 21·(512+128)/4 + 20·512/128 = 3,440 elements per token.
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

import torch
import torch.nn.functional as F

from ..cache.batch import ForwardBatch
from ..cache.state import SequenceState
from ..config import field, positive
from ..errors import CheckpointError, ConfigError
from ..layers import mhc
from ..layers.csa import (
    CSA,
    HCA,
    SLIDING,
    CompressorWeights,
    RopeTail,
    attention_state_bytes,
    compressor_update,
    grouped_out,
    head_rms,
    indexer_select,
    layer_compressors,
    new_attention_state,
    sink_attention,
)
from ..layers.linear import linear
from ..layers.moe import clamped_swiglu, route_sqrtsoftplus, run_experts
from ..layers.norms import rms_norm_cast_once
from ..layers.rope import RopeConfig, cos_sin_attention_factor, inv_freq
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs

MODEL_TYPES = ("deepseek_v4",)

HASH_MOE, MOE = "hash_moe", "moe"
_RATIO_KIND = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' map of the legacy compress_ratios
_SHORT = {SLIDING: "swa", CSA: "csa", HCA: "hca"}


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # csa.SLIDING | csa.CSA | csa.HCA
    csa_ratio: int
    hca_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_layer_types: tuple[str, ...]  # "hash_moe" | "moe"
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeConfig
    rope_main_factor: float  # cos/sin factor (YaRN attention factor; 1 for the plain set)
    rope_compress: RopeConfig
    rope_compress_factor: float
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    bos_token_id: int | None
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


# ---------------------------------------------------------------- config


def _eos(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, list) else (int(v),)


def _kinds(raw: dict, key: str, allowed, n: int, w: str) -> list:
    v = raw[key]
    if not isinstance(v, list) or len(v) < n or any(x not in allowed for x in v[:n]):
        raise ConfigError(
            f"{w}: field {key!r} must list at least num_hidden_layers = {n} values from "
            f"{sorted(allowed, key=str)}, got {v!r}"
        )
    return list(v[:n])


def _rope(d: dict, head_dim: int, partial: float, where: str) -> tuple[RopeConfig, float]:
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported (default or yarn)")
    partial = field(d, "partial_rotary_factor", float, partial, where=where, check=lambda v: 0 < v <= 1)
    dim = int(head_dim * partial)
    if dim <= 0 or dim % 2:
        raise ConfigError(
            f"{where}: the rotated width head_dim·partial_rotary_factor = {dim} must be a positive even number"
        )
    rope = RopeConfig(
        dim=dim,
        theta=field(d, "rope_theta", float, 10000.0, where=where, check=positive),
        kind=kind,
        factor=field(d, "factor", float, 1.0, where=where, check=positive),
        original_max_position_embeddings=field(
            d, "original_max_position_embeddings", int, 4096, where=where, check=positive
        ),
        beta_fast=field(d, "beta_fast", float, 32.0, where=where) or 32.0,
        beta_slow=field(d, "beta_slow", float, 1.0, where=where) or 1.0,
        mscale=field(d, "mscale", float, 0.0, where=where),
        mscale_all_dim=field(d, "mscale_all_dim", float, 0.0, where=where),
        truncate=True,  # transformers reads `truncate` from the top level, where V4 has none
    )
    if kind == "yarn" and "factor" not in d:
        raise ConfigError(f"{where}: field 'factor' is missing (YaRN needs it)")
    factor = 1.0
    if kind == "yarn":
        factor = field(
            d, "attention_factor", float, cos_sin_attention_factor(rope), where=where, check=positive
        )
    return rope, factor


def parse_config(raw: dict, layout: str = "hf") -> DeepseekV4Config:
    """Absent fields take transformers' `DeepseekV4Config` defaults (= the released Flash shape, except
    `layer_types`: the release states `compress_ratios`)."""
    if layout != "hf":
        raise ConfigError(f"DeepSeek-V4 checkpoints come with a config.json, not a {layout} layout")
    w = "config.json"
    n = field(raw, "num_hidden_layers", int, 43, where=w, check=positive)
    heads = field(raw, "num_attention_heads", int, 64, where=w, check=positive)
    head_dim = field(raw, "head_dim", int, 512, where=w, check=positive)
    if field(raw, "num_key_value_heads", int, 1, where=w) != 1:
        raise ConfigError(f"{w}: field 'num_key_value_heads' must be 1 (DeepSeek-V4 shares one KV head)")
    if field(raw, "hidden_act", str, "silu", where=w) != "silu":
        raise ConfigError(
            f"{w}: field 'hidden_act' = {raw['hidden_act']!r} is not supported (DeepSeek-V4 uses silu)"
        )
    if field(raw, "scoring_func", str, "sqrtsoftplus", where=w) != "sqrtsoftplus":
        raise ConfigError(
            f"{w}: field 'scoring_func' = {raw['scoring_func']!r} is not supported (sqrtsoftplus)"
        )
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ConfigError(
                f"{w}: field {key!r} = true is not supported (the released model has no biases)"
            )
    if field(raw, "n_shared_experts", int, 1, where=w) != 1:
        raise ConfigError(
            f"{w}: field 'n_shared_experts' must be 1 (DeepSeek-V4 has one shared expert of "
            f"width moe_intermediate_size)"
        )
    o_groups = field(
        raw,
        "o_groups",
        int,
        8,
        where=w,
        check=lambda v: v > 0 and heads % v == 0,
        why=f"must divide num_attention_heads = {heads} (groups are whole heads)",
    )
    experts = field(raw, "n_routed_experts", int, 256, where=w, check=positive)

    rates = dict(raw.get("compress_rates") or {})
    if not isinstance(raw.get("compress_rates") or {}, dict):
        raise ConfigError(f"{w}: field 'compress_rates' must be an object, got {raw['compress_rates']!r}")
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    csa_ratio = field(rates, CSA, int, 4, where=f"{w} compress_rates", check=positive)
    hca_ratio = field(rates, HCA, int, 128, where=f"{w} compress_rates", check=positive)

    if raw.get("layer_types") is not None:
        layer_types = _kinds(raw, "layer_types", {SLIDING, CSA, HCA}, n, w)
    elif raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        known = {0: SLIDING, **_RATIO_KIND, csa_ratio: CSA, hca_ratio: HCA}
        if not isinstance(ratios, list) or len(ratios) < n or any(r not in known for r in ratios[:n]):
            raise ConfigError(
                f"{w}: field 'compress_ratios' must list at least num_hidden_layers = {n} values from "
                f"{sorted(known)}, got {ratios!r}"
            )
        layer_types = [known[r] for r in ratios[:n]]
    else:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if raw.get("mlp_layer_types") is not None:
        mlp_types = _kinds(raw, "mlp_layer_types", {HASH_MOE, MOE}, n, w)
    else:
        n_hash = field(raw, "num_hash_layers", int, 3, where=w, check=lambda v: v >= 0)
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)

    # rope: main (sliding layers) and compress (CSA/HCA layers, compressors, indexer)
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{w}: field 'rope_parameters' must be an object, got {rp!r}")
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        partial = field(raw, "qk_rope_head_dim", int, 64, where=w, check=positive) / head_dim
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main_d, comp_d = rp["main"], rp["compress"]
    else:
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta")}
        main_d = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        comp_d = {**yarn, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        if comp_d.get("rope_type", comp_d.get("type")) == "yarn":
            comp_d.setdefault("attention_factor", 1.0)  # transformers: V4 does not scale cos/sin
    rope_main, main_factor = _rope(main_d, head_dim, partial, f"{w} rope_parameters.main")
    rope_comp, comp_factor = _rope(comp_d, head_dim, partial, f"{w} rope_parameters.compress")
    index_head_dim = field(raw, "index_head_dim", int, 128, where=w, check=positive)
    if rope_comp.dim > index_head_dim:
        raise ConfigError(
            f"{w}: field 'index_head_dim' = {index_head_dim} is narrower than the rotated width "
            f"{rope_comp.dim} the indexer ropes"
        )

    eos = raw.get("eos_token_id", 1)
    return DeepseekV4Config(
        vocab_size=field(raw, "vocab_size", int, 129280, where=w, check=positive),
        hidden_size=field(raw, "hidden_size", int, 4096, where=w, check=positive),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=field(raw, "q_lora_rank", int, 1024, where=w, check=positive),
        o_groups=o_groups,
        o_lora_rank=field(raw, "o_lora_rank", int, 1024, where=w, check=positive),
        sliding_window=field(raw, "sliding_window", int, 128, where=w, check=positive),
        layer_types=tuple(layer_types),
        csa_ratio=csa_ratio,
        hca_ratio=hca_ratio,
        index_n_heads=field(raw, "index_n_heads", int, 64, where=w, check=positive),
        index_head_dim=index_head_dim,
        index_topk=field(raw, "index_topk", int, 512, where=w, check=positive),
        mlp_layer_types=tuple(mlp_types),
        n_routed_experts=experts,
        num_experts_per_tok=field(
            raw,
            "num_experts_per_tok",
            int,
            6,
            where=w,
            check=lambda v: 0 < v <= experts,
            why=f"must be in 1..n_routed_experts={experts}",
        ),
        moe_intermediate_size=field(raw, "moe_intermediate_size", int, 2048, where=w, check=positive),
        routed_scaling_factor=field(raw, "routed_scaling_factor", float, 1.5, where=w),
        swiglu_limit=field(raw, "swiglu_limit", float, 10.0, where=w, check=positive),
        hc_mult=field(raw, "hc_mult", int, 4, where=w, check=positive),
        hc_sinkhorn_iters=field(raw, "hc_sinkhorn_iters", int, 20, where=w, check=positive),
        hc_eps=field(raw, "hc_eps", float, 1e-6, where=w, check=lambda v: v >= 0),
        rms_norm_eps=field(raw, "rms_norm_eps", float, 1e-6, where=w, check=positive),
        rope_main=rope_main,
        rope_main_factor=main_factor,
        rope_compress=rope_comp,
        rope_compress_factor=comp_factor,
        max_position_embeddings=field(raw, "max_position_embeddings", int, 1048576, where=w, check=positive),
        num_nextn_predict_layers=field(
            raw, "num_nextn_predict_layers", int, 1, where=w, check=lambda v: v >= 0
        ),
        tie_word_embeddings=field(raw, "tie_word_embeddings", bool, False, where=w),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=_eos(eos),
    )


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


def _layer_specs(
    cfg: DeepseekV4Config, p: str, kind: str, mlp: str, L: int, optional: bool
) -> list[TensorSpec]:
    """One decoder block's tensors; an MTP block (optional=True) reports every tensor under role "mtp"."""
    d, D = cfg.hidden_size, cfg.head_dim
    opt = dict(layer=L, optional=optional)
    f32 = dict(keep_fp32=True, **opt)
    specs = attention_block_specs(cfg, p, L, optional)
    a = p + "self_attn."
    comp, idx = layer_compressors(kind, D, cfg.index_head_dim, cfg.csa_ratio, cfg.hca_ratio)
    for dims, c in ((comp, a + "compressor."), (idx, a + "compressor.indexer.")):
        if dims is None:
            continue
        role = "compressor" if dims is comp else "indexer"
        specs += [
            TensorSpec(c + "kv_proj.weight", (dims.proj_width, d), role, **opt),
            TensorSpec(c + "gate_proj.weight", (dims.proj_width, d), role, **opt),
            TensorSpec(c + "position_bias", (dims.ratio, dims.proj_width), role, **f32),
            TensorSpec(c + "kv_norm.weight", (dims.width,), "norm", **f32),
        ]
    if idx is not None:
        i = a + "compressor.indexer."
        specs += [
            TensorSpec(
                i + "q_b_proj.weight",
                (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                "indexer",
                **opt,
            ),
            TensorSpec(i + "scorer.weights_proj.weight", (cfg.index_n_heads, d), "indexer", **opt),
        ]
    m, E, I = p + "mlp.", cfg.n_routed_experts, cfg.moe_intermediate_size
    specs.append(TensorSpec(m + "gate.weight", (E, d), "router", **opt))
    if mlp == HASH_MOE:  # int64 in checkpoints; fp32 holds expert ids exactly
        specs.append(
            TensorSpec(
                m + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "router", integer=True, **f32
            )
        )
    else:
        specs.append(TensorSpec(m + "gate.e_score_correction_bias", (E,), "router", **f32))
    specs += [
        TensorSpec(m + "experts.gate_up_proj", (E, 2 * I, d), "expert", **opt),
        TensorSpec(m + "experts.down_proj", (E, d, I), "expert", **opt),
        TensorSpec(m + "shared_experts.gate_proj.weight", (I, d), "shared_expert", **opt),
        TensorSpec(m + "shared_experts.up_proj.weight", (I, d), "shared_expert", **opt),
        TensorSpec(m + "shared_experts.down_proj.weight", (d, I), "shared_expert", **opt),
    ]
    return [dataclasses.replace(s, role="mtp") for s in specs] if optional else specs


def _hc_head_specs(cfg: DeepseekV4Config, p: str, role: str, optional: bool) -> list[TensorSpec]:
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
    specs += _hc_head_specs(cfg, "model.", "mhc", False)
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
        specs += _hc_head_specs(cfg, p, "mtp", True)
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


# ---------------------------------------------------------------- model


class Model:
    """The DeepSeek-V4 decoder over a ForwardBatch."""

    def __init__(self, cfg: DeepseekV4Config, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.hc = cfg.mhc_dims
        self.act = clamped_swiglu(cfg.swiglu_limit)
        self.rope = {SLIDING: RopeTail(inv_freq(cfg.rope_main).to(device), cfg.rope_main_factor)}
        self.rope[CSA] = self.rope[HCA] = RopeTail(
            inv_freq(cfg.rope_compress).to(device), cfg.rope_compress_factor
        )
        t = tensors
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.hc_head = [t[f"model.hc_head.hc_{k}"] for k in ("fn", "base", "scale")]
        self.layers, self.sites, self.compressors, self.tid2eid = [], [], [], {}
        for L in range(cfg.num_hidden_layers):
            p = f"model.layers.{L}."
            w = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            self.layers.append(w)
            self.sites.append(
                tuple(
                    mhc.MhcSite(w[f"{s}.fn"], w[f"{s}.base"], w[f"{s}.scale"]) for s in ("attn_hc", "ffn_hc")
                )
            )
            comp, idx = cfg.compressors(L)
            self.compressors.append(
                tuple(
                    None
                    if dims is None
                    else CompressorWeights(
                        w[c + "kv_proj.weight"],
                        w[c + "gate_proj.weight"],
                        w[c + "position_bias"],
                        w[c + "kv_norm.weight"],
                    )
                    for dims, c in ((comp, "self_attn.compressor."), (idx, "self_attn.compressor.indexer."))
                )
            )
            if cfg.mlp_layer_types[L] == HASH_MOE:
                table = w["mlp.gate.tid2eid"]
                if (
                    table.min() < 0
                    or table.max() >= cfg.n_routed_experts
                    or not torch.equal(table, table.round())
                ):
                    raise CheckpointError(
                        f"layer {L}: mlp.gate.tid2eid holds expert ids outside 0..{cfg.n_routed_experts - 1}"
                    )
                self.tid2eid[L] = table.long()
        self.mtp = []  # the MTP layer(s)' tensors, for a drafter (spec/); empty when the checkpoint has none
        for j in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{j}."
            w = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            if w:
                self.mtp.append(w)

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
    def attention(self, L: int, w: dict, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c = self.cfg
        kind, eps = c.layer_types[L], c.rms_norm_eps
        N, H, D = x.shape[0], c.num_attention_heads, c.head_dim
        rope, pos = self.rope[kind], batch.positions
        qr = rms_norm_cast_once(
            linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_norm.weight"], eps
        )
        q = rope(head_rms(linear(qr, w["self_attn.q_b_proj.weight"]).view(N, H, D), eps), pos)
        kv = rope(
            rms_norm_cast_once(linear(x, w["self_attn.kv_proj.weight"]), w["self_attn.kv_norm.weight"], eps),
            pos,
        )
        comp, idx = self.compressors[L]
        if comp is not None:
            ckv, cgate = linear(x, comp.wkv), linear(x, comp.wgate)
        if idx is not None:
            ikv, igate = linear(x, idx.wkv), linear(x, idx.wgate)
            i = "self_attn.compressor.indexer."
            qi = rope(linear(qr, w[i + "q_b_proj.weight"]).view(N, c.index_n_heads, c.index_head_dim), pos)
            wts = linear(x, w[i + "scorer.weights_proj.weight"]).float() * c.index_n_heads**-0.5
        out = torch.empty_like(q)
        for s in batch.seqs:
            r = slice(s.start, s.start + s.n)
            st = s.state.layers[L]
            win_start = s.past - st.window.held
            win = st.window.append(kv=kv[r])["kv"]
            entries = sel = None
            if comp is not None:
                entries = compressor_update(st.compressor, ckv[r], cgate[r], comp, eps, rope)
            if idx is not None:
                keys = compressor_update(st.indexer, ikv[r], igate[r], idx, eps, rope)
                sel = indexer_select(qi[r], wts[r], keys, pos[r], c.csa_ratio, c.index_topk)
            out[r] = sink_attention(
                q[r],
                pos[r],
                win,
                win_start,
                c.sliding_window,
                w["self_attn.sinks"],
                D**-0.5,
                entries,
                sel,
                c.hca_ratio if kind == HCA else c.csa_ratio,
            )
        out = rope(out, pos, inverse=True)
        return grouped_out(
            out.reshape(N, H * D), w["self_attn.o_a_proj.weight"], w["self_attn.o_b_proj.weight"], c.o_groups
        )

    def moe(self, L: int, w: dict, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        logits = linear(x, w["mlp.gate.weight"])
        if c.mlp_layer_types[L] == HASH_MOE:
            weights, ids = route_sqrtsoftplus(
                logits, c.num_experts_per_tok, scale=c.routed_scaling_factor, ids=self.tid2eid[L][token_ids]
            )
        else:
            weights, ids = route_sqrtsoftplus(
                logits, c.num_experts_per_tok, w["mlp.gate.e_score_correction_bias"], c.routed_scaling_factor
            )
        out = run_experts(
            x, weights, ids, w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"], self.act
        )
        sh = torch.cat(
            [
                linear(x, w["mlp.shared_experts.gate_proj.weight"]),
                linear(x, w["mlp.shared_experts.up_proj.weight"]),
            ],
            dim=-1,
        )
        return out + linear(self.act(sh), w["mlp.shared_experts.down_proj.weight"])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        eps = c.rms_norm_eps
        h = mhc.expand(F.embedding(batch.token_ids, self.embed), c.hc_mult)  # [N, n, d]
        for L, w in enumerate(self.layers):
            attn_site, ffn_site = self.sites[L]
            x, post, comb = mhc.site_input(h, attn_site, self.hc)
            y = self.attention(L, w, rms_norm_cast_once(x, w["input_layernorm.weight"], eps), batch)
            h = mhc.update(h, y, post, comb)
            x, post, comb = mhc.site_input(h, ffn_site, self.hc)
            y = self.moe(
                L, w, rms_norm_cast_once(x, w["post_attention_layernorm.weight"], eps), batch.token_ids
            )
            h = mhc.update(h, y, post, comb)
        batch.finish()
        h = mhc.head_weighted(h[batch.logit_rows], *self.hc_head, self.hc)
        return linear(rms_norm_cast_once(h, self.norm, eps), self.lm_head).float()


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


def draft_heads(cfg) -> tuple[str, ...]:
    return ()


def build(cfg, tensors, dtype, device, folder):
    return Model(cfg, tensors.all(), dtype, device)

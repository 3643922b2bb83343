"""DeepSeek-V4.1-Flash (`deepseek_v41`): DeepSeek-V4 with Engram n-gram memory, compressed KV and
indexer selections shared across layers, candidate blocks, delayed-pre mHC, no per-head q norm and
no hash routing.

    h = copies of embed(ids) in hc_mult streams;  pre = one-hot(stream 0)            # [N, n, d]
    for each layer:
        h = Engram(h, n-gram rows of the ids)                         (Engram layers only)
        pre', post, comb = mHC maps (attention site);  x = Σ pre·h;  pre = pre'        # delayed pre
        h = post ⊗ attention(RMSNorm(x)) + combᵀ h
        pre', post, comb = mHC maps (FFN site);        x = Σ pre·h;  pre = pre'
        h = post ⊗ MoE(RMSNorm(x)) + combᵀ h
    logits = head(RMSNorm(Σ pre·h)).float()                                            # no hc_head

    attention (layer L, compress ratio r):
        qr = RMSNorm(x Wq_a);  q = rope(qr Wq_b)  (no per-head RMS);  kv = rope(RMSNorm(x Wkv))  (K = V)
        KV source:     entry g = rope(RMSNorm(Σ_j softmax_j(x_j Wgate) ⊙ x_j Wkv), g·r) over the r
                       tokens of group g (r = 1: RMSNorm(x Wkv), no gate); publishes the entries and
                       index keys k_g = rope(RMSNorm(latent_g Wk; k_norm), g·r) (latent before rope)
        index source:  score(t, g) = Σ_h w_h ReLU(q_I[h]·k_g) / sqrt(c_I), q_I = rope(qr Wq_b_I),
                       w = x W_weights / sqrt(n_I); publishes the top index_topk visible entries
        candidate source: per query, the candidate_topk_blocks blocks of candidate_block_size
                       entries with the highest max score (the newest entry's block pinned);
                       later index sources on the same entries score only inside them
        every layer:   sink softmax over its window + the selected entries of its KV source
                       (all visible entries when no index source serves it, V4's HCA)
        out = Wo_b · grouped Wo_a(rope⁻¹(o))
    MoE: s = sqrt(softplus(x Wg)); experts = topk(s + bias); w = 1.5 s/Σs; clamped SwiGLU + 1 shared

Math, names and pitfalls: shared/reference/deepseek_v4.md §3 (V4.1 deltas), seed_system.md §7, §10.
No package implements V4.1; the proof is moesaic's own (tests/test_deepseek_v41.py): with Engram off,
V4's layer kinds and every layer its own KV/index source, this module equals `deepseek_v4` (proven
against transformers) on the same weights; each V4.1 feature switched on changes the logits; a
plain per-token reference in the test, written from the reference text, checks the V4.1 paths.

Shared with deepseek_v4 (imported): the config parser for the common fields, the release names,
layers/csa.py (window + sink attention, pooling, compressor state, grouped o-proj, trailing rope),
layers/mhc.py (`site_maps` + `collapse` express the delayed pre), layers/moe.py, layers/engram.py.
Variants added here (V4's functions have no hook for them): `compress` (csa.compressor_update that
also returns the new entries before rope, which the index keys need), `index_select`
(csa.indexer_select with candidate blocks; the same arithmetic), `IndexKeys` (index keys made from
the latent, rolled back with its compressor).

Config (`config.json`: the release nests it in `text_config`; top-level ids are read too):
* `compress_ratios`: one per layer (0 = sliding window only, r > 0 = compressed, ratio r), then one
  per MTP stage (`num_nextn_predict_layers`; kept in `mtp_compress_ratios`, not run).
* `kv_source_layer_ids` (default: every compressed layer): layers that own a compressor. Any other
  compressed layer reads the entries of the nearest KV source at or below it with its ratio (and
  kind); there must be one. `index_source_layer_ids` (default: every compressed layer but V4's HCA
  ones): layers that own the indexer's query side (`wq_b`, `weights_proj`); a compressed layer uses
  the selection of the nearest index source at or below it that reads the same entries, or, with
  none, attends to all visible entries. A KV source makes index keys (`wk`, `k_norm`; V4's CSA
  kind: its index compressor) when an index source reads its entries. (The release's role lists
  give these rules no exception; reference §3.2 infers them the same way.)
* `candidate_source_layer_id`, `candidate_topk_blocks`, `candidate_block_size` (optional).
* Engram: `engram_layer_ids`, `engram_num_embeddings`, ... (layers/engram.py `EngramConfig`).
* `route_scale` is read as `routed_scaling_factor`. `num_hash_layers` > 0 or hash_moe layers are a
  ConfigError (V4.1 has no hash routing).
* moesaic-only keys (not in the release; the tests use them to switch V4.1 features off):
  `layer_types` (V4's sliding / CSA / HCA kinds with `compress_rates`, instead of `compress_ratios`),
  `q_head_norm` (V4's per-head q RMS, default false), `mhc_delayed_pre` (default true; false = V4's
  per-site pre and weighted `hc_head`).
Absent scalar fields take the release's values (reference §1.2, `RELEASE_TEXT_CONFIG`).

Names: the model's own names are deepseek_v4's (transformers' module names), plus
`model.layers.L.self_attn.indexer.{wk,k_norm}` and `model.layers.L.engram.*`. Checkpoints are read in
the release naming: deepseek_v4's upstream names plus `layers.L.attn.indexer.{wk,k_norm}.weight`,
`layers.L.engram.{embed.weight, embed.scale, wkv.weight, q_weight, k_weight}`. Not loaded (ignored):
`mtp.*` (the DSpark drafter), `ffn.gate.bias_vl` and the vision tower (text only). Quantized weights
(fp8 E4M3 + UE8M0 32x32 `.scale`, fp4 experts) stay packed; `attn.wo_a` (used as a grouped view)
is dequantized at load. The Engram tables stay in the file (read-only mapping, `TensorSpec.mapped`)
and are read row by row; the token map is built from the checkpoint's tokenizer at load
(`bind_checkpoint`), or passed as `token_map` to `Model`.

State per sequence (`new_state`): every layer a window of key rows; KV sources their compressor's
open-group raw rows and closed entries and, when read by an index source, the index keys; one
Engram lookback of the last max_ngram_size − 1 compressed ids. Layers that share read their
source's state and hold none. rollback(n) is exact for n <= `rollback_window`; snapshot/restore;
`state_bytes` sizes it from the config.

Where moesaic departs from the reference implementation (numerics, all inferred harmless in fp32):
the window rows, the latents and the index q/k are kept in the model dtype (the reference rounds
them to fp8 / fp4); the streams stay in the model dtype (the reference keeps an fp32 highway);
the vendor's index-key republishing quirk (reference §3.2, alternate decode steps scoring layer
20's keys at layers 2, 8, 14) is not reproduced: each index source scores the keys of its own KV
source. The candidate source's own selection is not restricted by its candidates (inferred:
"consumer layers" restrict).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache.batch import ForwardBatch
from ..cache.state import SequenceState, TailRows, TokenRows
from ..config import field
from ..errors import ConfigError
from ..layers import mhc
from ..layers.csa import (
    CSA,
    HCA,
    SLIDING,
    AttentionState,
    CompressorDims,
    CompressorState,
    CompressorWeights,
    RopeTail,
    compressor_update,
    grouped_out,
    head_rms,
    index_score_blocks,
    pool_windows,
    sink_attention,
)
from ..layers.engram import (
    EngramConfig,
    EngramHash,
    EngramState,
    EngramTable,
    EngramWeights,
    build_token_map,
    engram_bytes,
    engram_forward,
)
from ..layers.linear import linear
from ..layers.moe import clamped_swiglu, route_sqrtsoftplus, run_experts
from ..layers.norms import rms_norm_cast_once
from ..layers.rope import inv_freq
from ..weights.contract import Naming, TensorSpec, direct
from . import deepseek_v4
from .deepseek_v4 import HASH_MOE, MOE, DeepseekV4Config, attention_block_specs

MODEL_TYPES = ("deepseek_v41",)

CSA2 = "csa2_attention"  # a V4.1 compressed layer: ratio r, no overlap, no position bias, index keys from the latent
_SHORT = {SLIDING: "swa", CSA: "csa", HCA: "hca", CSA2: "csa2"}

# The release's text_config, from the values published in shared/reference/deepseek_v4.md §1.2 (the
# release config.json itself is not in the reference; field spellings follow transformers' V4 config
# where the reference abbreviates, e.g. "heads 64" -> num_attention_heads).
RELEASE_TEXT_CONFIG = {
    "model_type": "deepseek_v41",
    "num_hidden_layers": 40,
    "hidden_size": 5120,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "max_position_embeddings": 1048576,
    "rope_theta": 160000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16000000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_block_size": 5,
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "dspark_noise_token_id": 128799,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
RELEASE_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}
_DEFAULTS = {
    k: v
    for k, v in RELEASE_TEXT_CONFIG.items()
    if not isinstance(v, list) and not k.startswith(("engram_", "candidate_", "dspark_"))
}


@dataclass(frozen=True)
class DeepseekV41Config(DeepseekV4Config):
    """DeepSeek-V4's config (`layer_types` may also hold CSA2; `mlp_layer_types` is all "moe") plus:"""

    compress_ratios: tuple[int, ...] = ()  # per layer; 0 = sliding only
    mtp_compress_ratios: tuple[int, ...] = ()
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 1
    kv_from: tuple[int | None, ...] = ()  # per layer: the KV source whose entries it attends to
    index_from: tuple[int | None, ...] = ()  # per layer: the index source whose selection it uses (None: all)
    index_keys: tuple[bool, ...] = ()  # per layer: a KV source whose entries an index source scores
    uses_candidates: tuple[bool, ...] = ()  # per layer: an index source restricted to the candidate blocks
    engram: EngramConfig | None = None
    q_head_norm: bool = False
    delayed_pre: bool = True
    model_type: str = "deepseek_v41"

    def compressor_dims(self, L: int) -> CompressorDims | None:
        kind, r = self.layer_types[L], self.compress_ratios[L]
        return None if r == 0 else CompressorDims(r, self.head_dim, kind == CSA)

    def index_compressor_dims(self, L: int) -> CompressorDims:
        """V4's CSA index keys: their own overlapped compressor of width index_head_dim."""
        return CompressorDims(self.compress_ratios[L], self.index_head_dim, True)

    @property
    def engram_layers(self) -> tuple[int, ...]:
        return () if self.engram is None else self.engram.layer_ids


# ---------------------------------------------------------------- config


def _text(raw: dict) -> tuple[dict, str]:
    text = raw.get("text_config")
    if text is None:
        return raw, "config.json"
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: field 'text_config' must be an object, got {text!r}")
    top = {
        k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings") if k in raw
    }
    return {**top, **text}, "config.json text_config"


def _layer_ids(raw: dict, key: str, default: list[int], n: int, w: str) -> tuple[int, ...]:
    v = raw.get(key)
    if v is None:
        return tuple(default)
    if (
        not isinstance(v, list)
        or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n for x in v)
        or len(set(v)) != len(v)
    ):
        raise ConfigError(f"{w}: field {key!r} must list distinct layer ids in 0..{n - 1}, got {v!r}")
    return tuple(sorted(v))


def parse_config(raw: dict, layout: str = "hf") -> DeepseekV41Config:
    if layout != "hf":
        raise ConfigError(f"DeepSeek-V4.1 checkpoints come with a config.json, not a {layout} layout")
    text, w = _text(raw)
    text = {**_DEFAULTS, **text}
    if text.get("route_scale") is not None and text.get("routed_scaling_factor") is None:
        text["routed_scaling_factor"] = text["route_scale"]
    n = field(text, "num_hidden_layers", int, where=w, check=lambda v: v > 0)
    if text.get("num_hash_layers") or any(k == HASH_MOE for k in text.get("mlp_layer_types") or []):
        raise ConfigError(
            f"{w}: field 'num_hash_layers' / 'mlp_layer_types' asks for hash-routed layers; "
            f"DeepSeek-V4.1 has no hash routing (every layer routes by score + bias)"
        )
    base = deepseek_v4.parse_config(
        {
            **{k: v for k, v in text.items() if k not in ("compress_ratios", "model_type")},
            "layer_types": [SLIDING] * n,
            "mlp_layer_types": [MOE] * n,
            "num_hash_layers": 0,
        }
    )

    if text.get("layer_types") is not None:  # moesaic: V4's kinds under V4.1's wiring (tests)
        kinds = deepseek_v4._kinds(text, "layer_types", {SLIDING, CSA, HCA}, n, w)
        ratios = [{SLIDING: 0, CSA: base.csa_ratio, HCA: base.hca_ratio}[k] for k in kinds]
        mtp_ratios: list[int] = []
    else:
        cr, nextn = text.get("compress_ratios"), base.num_nextn_predict_layers
        if (
            not isinstance(cr, list)
            or len(cr) not in (n, n + nextn)
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in cr)
        ):
            raise ConfigError(
                f"{w}: field 'compress_ratios' must list a ratio >= 0 for each of the {n} layers "
                f"(then one per MTP stage, {nextn}), got {cr!r}"
            )
        ratios, mtp_ratios = list(cr[:n]), list(cr[n:])
        kinds = [SLIDING if r == 0 else CSA2 for r in ratios]

    compressed = [L for L in range(n) if ratios[L]]
    kv_src = _layer_ids(text, "kv_source_layer_ids", compressed, n, w)
    idx_src = _layer_ids(text, "index_source_layer_ids", [L for L in compressed if kinds[L] != HCA], n, w)
    for key, ids in (("kv_source_layer_ids", kv_src), ("index_source_layer_ids", idx_src)):
        index = key.startswith("index")
        bad = [L for L in ids if ratios[L] == 0 or (index and kinds[L] == HCA)]
        if bad:
            raise ConfigError(
                f"{w}: field {key!r} names layer(s) {bad} that have no compressed attention (compress "
                f"ratio 0{', or V4 HCA layers, which have no indexer' if index else ''})"
            )
    kv_from: list[int | None] = []
    for L in range(n):
        src = max(
            (j for j in kv_src if j <= L and (kinds[j], ratios[j]) == (kinds[L], ratios[L])), default=None
        )
        if ratios[L] and src is None:
            raise ConfigError(
                f"{w}: field 'kv_source_layer_ids' = {list(kv_src)} leaves layer {L} (compress ratio "
                f"{ratios[L]}) without a KV source of its kind and ratio at or below it"
            )
        kv_from.append(src if ratios[L] else None)
    index_from = [
        max((j for j in idx_src if j <= L and kv_from[j] == kv_from[L]), default=None) if ratios[L] else None
        for L in range(n)
    ]
    index_keys = [L in kv_src and any(kv_from[j] == L for j in idx_src) for L in range(n)]

    cand = text.get("candidate_source_layer_id")
    blocks = size = 0
    uses = [False] * n
    if cand is not None:
        if cand not in idx_src:
            raise ConfigError(
                f"{w}: field 'candidate_source_layer_id' = {cand!r} is not one of the index sources "
                f"{list(idx_src)}"
            )
        blocks = field(text, "candidate_topk_blocks", int, where=w, check=lambda v: v > 0)
        size = field(text, "candidate_block_size", int, where=w, check=lambda v: v > 0)
        uses = [L in idx_src and L > cand and kv_from[L] == kv_from[cand] for L in range(n)]

    engram = EngramConfig.from_config(
        {
            **text,
            "hc_mult": base.hc_mult,
            "rms_norm_eps": base.rms_norm_eps,
            "hidden_size": base.hidden_size,
            "vocab_size": base.vocab_size,
        },
        w,
    )
    common = {
        f.name: getattr(base, f.name)
        for f in dataclasses.fields(base)
        if f.name not in ("layer_types", "model_type")
    }
    return DeepseekV41Config(
        **common,
        layer_types=tuple(kinds),
        compress_ratios=tuple(ratios),
        mtp_compress_ratios=tuple(mtp_ratios),
        kv_source_layer_ids=kv_src,
        index_source_layer_ids=idx_src,
        candidate_source_layer_id=cand,
        candidate_topk_blocks=blocks,
        candidate_block_size=size or 1,
        kv_from=tuple(kv_from),
        index_from=tuple(index_from),
        index_keys=tuple(index_keys),
        uses_candidates=tuple(uses),
        engram=engram,
        q_head_norm=field(text, "q_head_norm", bool, False, where=w),
        delayed_pre=field(text, "mhc_delayed_pre", bool, True, where=w),
    )


# ---------------------------------------------------------------- tensor contract


def _compressor_specs(
    c: str, dims: CompressorDims, d: int, gate: bool, ape: bool, role: str, L: int
) -> list[TensorSpec]:
    specs = [TensorSpec(c + "kv_proj.weight", (dims.proj_width, d), role, L)]
    if gate:
        specs.append(TensorSpec(c + "gate_proj.weight", (dims.proj_width, d), role, L))
    if ape:
        specs.append(TensorSpec(c + "position_bias", (dims.ratio, dims.proj_width), role, L, keep_fp32=True))
    return specs + [TensorSpec(c + "kv_norm.weight", (dims.width,), "norm", L, keep_fp32=True)]


def _layer_specs(cfg: DeepseekV41Config, L: int) -> list[TensorSpec]:
    d, D = cfg.hidden_size, cfg.head_dim
    p, kind, r = f"model.layers.{L}.", cfg.layer_types[L], cfg.compress_ratios[L]
    f32 = dict(layer=L, keep_fp32=True)
    specs = attention_block_specs(cfg, p, L)
    a = p + "self_attn."
    if L in cfg.kv_source_layer_ids:
        specs += _compressor_specs(
            a + "compressor.", cfg.compressor_dims(L), d, kind != CSA2 or r > 1, kind != CSA2, "compressor", L
        )
    if cfg.index_keys[L]:
        cI = cfg.index_head_dim
        if kind == CSA:
            specs += _compressor_specs(
                a + "compressor.indexer.", cfg.index_compressor_dims(L), d, True, True, "indexer", L
            )
        else:
            specs += [
                TensorSpec(a + "indexer.wk.weight", (cI, D), "indexer", L),
                TensorSpec(a + "indexer.k_norm.weight", (cI,), "norm", **f32),
            ]
    if L in cfg.index_source_layer_ids:
        i = a + "compressor.indexer."
        specs += [
            TensorSpec(
                i + "q_b_proj.weight", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), "indexer", L
            ),
            TensorSpec(i + "scorer.weights_proj.weight", (cfg.index_n_heads, d), "indexer", L),
        ]
    m, E, I = p + "mlp.", cfg.n_routed_experts, cfg.moe_intermediate_size
    specs += [
        TensorSpec(m + "gate.weight", (E, d), "router", L),
        TensorSpec(m + "gate.e_score_correction_bias", (E,), "router", **f32),
        TensorSpec(m + "experts.gate_up_proj", (E, 2 * I, d), "expert", L),
        TensorSpec(m + "experts.down_proj", (E, d, I), "expert", L),
        TensorSpec(m + "shared_experts.gate_proj.weight", (I, d), "shared_expert", L),
        TensorSpec(m + "shared_experts.up_proj.weight", (I, d), "shared_expert", L),
        TensorSpec(m + "shared_experts.down_proj.weight", (d, I), "shared_expert", L),
    ]
    if L in cfg.engram_layers:
        e = cfg.engram
        rows = e.num_embeddings[e.layer_ids.index(L)]
        g = p + "engram."
        specs += [
            # the table stays in the file (fp8 rows + one E8M0 scale per 32 columns; a float table has no scale)
            TensorSpec(g + "embed.weight", (rows, e.head_dim), "engram_table", L, mapped=True),
            TensorSpec(
                g + "embed.scale", (rows, -(-e.head_dim // 32)), "engram_scale", L, mapped=True, optional=True
            ),
            TensorSpec(g + "wkv.weight", ((e.hc_mult + 1) * d, e.n_hash * e.head_dim), "engram", L),
            TensorSpec(g + "q_weight", (e.hc_mult, d), "engram", **f32),
            TensorSpec(g + "k_weight", (e.hc_mult, d), "engram", **f32),
        ]
    return specs


def tensor_specs(cfg: DeepseekV41Config) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding")]
    for L in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, L)
    specs.append(TensorSpec("model.norm.weight", (d,), "norm", keep_fp32=True))
    if not cfg.delayed_pre:  # V4's weighted hyper head
        n = cfg.hc_mult
        specs += [
            TensorSpec("model.hc_head.hc_fn", (n, n * d), "mhc", keep_fp32=True),
            TensorSpec("model.hc_head.hc_base", (n,), "mhc", keep_fp32=True),
            TensorSpec("model.hc_head.hc_scale", (1,), "mhc", keep_fp32=True),
        ]
    specs.append(
        TensorSpec("lm_head.weight", (cfg.vocab_size, d), "lm_head", optional=cfg.tie_word_embeddings)
    )
    return specs


_V41_NAMES = {
    "self_attn.indexer.wk.weight": "attn.indexer.wk.weight",
    "self_attn.indexer.k_norm.weight": "attn.indexer.k_norm.weight",
}
IGNORED = [
    r"mtp\..*",  # the DSpark drafter stages (spec/)
    r"layers\.\d+\.ffn\.gate\.bias_vl",  # the router bias of image tokens (vision is not supported)
    r"(vision|visual|vision_model|vision_tower|aligner|mm_projector|projector)\..*",
]  # inferred names


def release_naming(cfg: DeepseekV41Config | None = None) -> Naming:
    """DeepSeek's release names: deepseek_v4's upstream names (`embed.weight`, `layers.L.attn.wq_a.weight`,
    `attn.kv_norm`, `attn.attn_sink`, `hc_attn_fn`, `ffn.experts.E.w1`, `attn.compressor.{wkv,wgate,norm}`,
    `attn.indexer.{wq_b,weights_proj}`) plus `attn.indexer.{wk,k_norm}` and `layers.L.engram.*`."""
    v4 = deepseek_v4.checkpoint_naming(upstream=True)

    def source(spec: TensorSpec):
        if spec.name.startswith("model.layers."):
            L, rest = spec.name.split(".", 3)[2:]
            if rest in _V41_NAMES:
                return direct(f"layers.{L}.{_V41_NAMES[rest]}", spec.shape)
        return v4.source(spec)

    return Naming("DeepSeek-V4.1 release (embed.weight, layers.N.attn.*, layers.N.engram.*)", source, IGNORED)


def namings(cfg: DeepseekV41Config, layout: str, store_names) -> Naming:
    return release_naming(cfg)


# ---------------------------------------------------------------- compression and the indexer (V4.1 variants)


def compress(
    state: CompressorState, kv: Tensor, gate: Tensor, w: CompressorWeights, eps: float, rope: RopeTail
) -> tuple[Tensor, Tensor, int]:
    """csa.compressor_update, also returning the new entries before rope: (all entries [E, width]
    roped, the new ones [E1 − E0, width] before rope, E0)."""
    d, m = state.dims, state.dims.ratio
    T0, n, held = state.raw.length, kv.shape[0], state.raw.held
    raw = state.raw.append(kv=kv, gate=gate)
    E0, E1 = T0 // m, (T0 + n) // m
    if E1 == E0:
        return state.entries.bufs["entry"][: state.entries.length], kv.new_empty(0, d.width), E0
    has_prev = d.overlap and E0 > 0
    a, b = (E0 - 1 if has_prev else E0) * m - (T0 - held), E1 * m - (T0 - held)
    latent = rms_norm_cast_once(
        pool_windows(raw["kv"][a:b], raw["gate"][a:b], w.ape, d, has_prev).to(kv.dtype), w.norm, eps
    )
    roped = rope(latent, torch.arange(E0, E1, device=kv.device) * m)
    return state.entries.append(entry=roped)["entry"], latent, E0


class IndexKeys:
    """A V4.1 KV source's index keys: one row per entry of its compressor, forgotten with them."""

    def __init__(self, compressor: CompressorState, width: int, dtype, device, max_tokens: int):
        self.compressor = compressor
        self.entries = TokenRows({"entry": width}, dtype, device, max_tokens // compressor.dims.ratio + 1)

    def rollback(self, n: int) -> None:  # runs after the compressor's (AttentionState's order)
        self.entries.rollback(self.entries.length - self.compressor.entries.length)

    def snapshot(self):
        return self.entries.snapshot()

    def restore(self, snap) -> None:
        self.entries.restore(snap)

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes


def _held(part) -> Tensor:
    """The entries (or index keys) a compressor state holds, [E, width]."""
    return part.entries.bufs["entry"][: part.entries.length]


def index_select(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    positions: Tensor,
    ratio: int,
    topk: int,
    block: int = 1,
    topk_blocks: int = 0,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """csa.indexer_select (same arithmetic) with candidate blocks. q [n, H, c] roped, weights [n, H]
    (scaled by H^-0.5), keys [E, c]. Returns (sel [n, min(topk, E)], -1 where nothing is selected;
    with topk_blocks > 0, the candidate blocks [n, ceil(E / block)] bool: the topk_blocks blocks of
    `block` entries with the highest max score, the one holding the newest visible entry pinned).
    `allowed` [n, nb] (another layer's candidate blocks) sets the scores outside them to −inf."""
    n = q.shape[0]
    E = keys.shape[0]
    k = min(topk, E)
    nb = -(-E // block)
    sel = torch.full((n, k), -1, dtype=torch.long, device=q.device)
    keep = torch.zeros(n, nb, dtype=torch.bool, device=q.device) if topk_blocks else None
    if E == 0:
        return sel, keep
    entry = torch.arange(E, device=q.device)
    for i, j, s, vis in index_score_blocks(q, weights, keys, positions, ratio):
        if topk_blocks:
            bs = F.pad(s, (0, nb * block - E), value=float("-inf")).view(j - i, nb, block).amax(-1)
            newest = vis[:, 0] - 1
            rows = torch.nonzero(newest >= 0).flatten()
            bs[rows, newest[rows] // block] = float("inf")
            val, idx = bs.topk(min(topk_blocks, nb), dim=-1)
            keep[i:j].scatter_(1, idx, val > float("-inf"))
        if allowed is not None:
            s = s.masked_fill(~allowed[i:j][:, entry // block], float("-inf"))
        val, idx = s.topk(k, dim=-1)
        sel[i:j] = torch.where(val == float("-inf"), -1, idx)
    return sel, keep


# ---------------------------------------------------------------- model


class _TableOn:
    """An Engram table whose gathered rows are moved to the model's device (the table stays on the host)."""

    def __init__(self, table: EngramTable, device):
        self.table, self.device, self.head_dim = table, device, table.head_dim

    def gather(self, rows: Tensor) -> Tensor:
        return self.table.gather(rows).to(self.device)


def _table(weight: Tensor, scale: Tensor | None, name: str) -> EngramTable:
    """The release's fp8 rows + E8M0 scales as they are; a float table with float scales (what
    demo.random_tensors writes for the demo list) multiplied out once."""
    if scale is not None and weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        block = -(-weight.shape[1] // scale.shape[1])
        weight, scale = (
            weight.float() * scale.float().repeat_interleave(block, dim=1)[:, : weight.shape[1]],
            None,
        )
    return EngramTable(weight, scale, name)


def tokenizer_vocab(tok):
    """What `engram.build_token_map` reads from a tokenizer: the tokenizer itself, or, for moesaic's byte
    tokenizer, (decoded, raw token) pairs (specials decode to their names, as tokenizers' decode with
    skip_special_tokens=False does; a lone byte >= 0x80 decodes to U+FFFD and keys on its raw name)."""
    from ..tokenizer import BYTE_OFFSET, ByteTokenizer

    if isinstance(tok, ByteTokenizer):
        names = ["<pad>", "<s>", "</s>"]
        return [(s, s) for s in names] + [
            (tok.decode([i]), f"<0x{i - BYTE_OFFSET:02X}>") for i in range(BYTE_OFFSET, tok.vocab_size)
        ]
    return tok


class Model:
    """The DeepSeek-V4.1 decoder over a ForwardBatch. `token_map` (Engram's compressed token map, int64
    [V]) may be given here; a model loaded through `Checkpoint` builds it from the checkpoint's tokenizer."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        tensors: dict[str, Tensor],
        dtype: torch.dtype,
        device,
        token_map: Tensor | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.hc = cfg.mhc_dims
        self.act = clamped_swiglu(cfg.swiglu_limit)
        main = RopeTail(inv_freq(cfg.rope_main).to(device), cfg.rope_main_factor)
        comp = RopeTail(inv_freq(cfg.rope_compress).to(device), cfg.rope_compress_factor)
        self.rope = [comp if r else main for r in cfg.compress_ratios]
        self.rope_compress = comp
        t = tensors
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.hc_head = (
            None if cfg.delayed_pre else [t[f"model.hc_head.hc_{k}"] for k in ("fn", "base", "scale")]
        )
        self.layers, self.sites, self.compressors, self.engram = [], [], {}, {}
        for L in range(cfg.num_hidden_layers):
            p = f"model.layers.{L}."
            w = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            self.layers.append(w)
            self.sites.append(
                tuple(
                    mhc.MhcSite(w[f"{s}.fn"], w[f"{s}.base"], w[f"{s}.scale"]) for s in ("attn_hc", "ffn_hc")
                )
            )
            if L in cfg.kv_source_layer_ids:
                self.compressors[L] = self._compressor(w, "self_attn.compressor.", cfg.compressor_dims(L))
            if cfg.index_keys[L] and cfg.layer_types[L] == CSA:
                self.compressors[(L, "index")] = self._compressor(
                    w, "self_attn.compressor.indexer.", cfg.index_compressor_dims(L)
                )
            if L in cfg.engram_layers:
                g = "engram."
                table = _table(w[g + "embed.weight"], w.get(g + "embed.scale"), f"layers.{L}.engram.embed")
                if torch.device(device).type != "cpu":
                    table = _TableOn(table, device)
                self.engram[L] = EngramWeights(
                    table, w[g + "wkv.weight"], w[g + "q_weight"], w[g + "k_weight"]
                )
        self.hasher = None
        if cfg.engram is not None and token_map is not None:
            self.hasher = EngramHash(cfg.engram, token_map)

    def _compressor(self, w: dict, c: str, dims: CompressorDims) -> CompressorWeights:
        ape = w.get(c + "position_bias")
        if ape is None:  # V4.1: no position bias
            ape = torch.zeros(dims.ratio, dims.proj_width, device=self.device)
        return CompressorWeights(
            w[c + "kv_proj.weight"], w.get(c + "gate_proj.weight"), ape, w[c + "kv_norm.weight"]
        )

    def bind_checkpoint_folder(self, folder) -> None:
        """Builds Engram's token map from the checkpoint's tokenizer (`build` calls this)."""
        if self.cfg.engram is None or self.hasher is not None:
            return
        from ..tokenizer import load_tokenizer
        from ..weights.store import WeightStore

        tok = load_tokenizer(folder, WeightStore(folder).config, self.cfg.eos_token_ids)
        if tok is None:
            raise ConfigError(
                f"{folder}: DeepSeek-V4.1's Engram layers hash compressed token ids, whose map is "
                f"built from the checkpoint's tokenizer, and this folder has none (tokenizer.json)"
            )
        self.hasher = EngramHash(
            self.cfg.engram, build_token_map(tokenizer_vocab(tok), self.cfg.engram.compressed_vocab_size)
        )

    # -- state
    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """One AttentionState per layer (window; KV sources also their compressor and index keys), then,
        with Engram, the lookback ids. `rollback_window`: how many of its last tokens a sequence can forget."""
        c, R, dt, dev = self.cfg, rollback_window, self.dtype, self.device
        T = c.max_position_embeddings
        layers = []
        for L in range(c.num_hidden_layers):
            comp = idx = None
            if L in c.kv_source_layer_ids:
                comp = CompressorState(c.compressor_dims(L), dt, dev, T, R)
                if c.index_keys[L]:
                    idx = (
                        CompressorState(c.index_compressor_dims(L), dt, dev, T, R)
                        if c.layer_types[L] == CSA
                        else IndexKeys(comp, c.index_head_dim, dt, dev, T)
                    )
            window = TailRows({"kv": c.head_dim}, dt, dev, c.sliding_window - 1 + R, c.sliding_window - 1)
            layers.append(AttentionState(window, comp, idx))
        if c.engram is not None:
            layers.append(EngramState.for_config(c.engram, R))
        return SequenceState(layers)

    # -- blocks
    def attention(self, L: int, w: dict, x: Tensor, batch: ForwardBatch, published: dict) -> Tensor:
        c = self.cfg
        eps, r = c.rms_norm_eps, c.compress_ratios[L]
        N, H, D = x.shape[0], c.num_attention_heads, c.head_dim
        rope, pos = self.rope[L], batch.positions
        qr = rms_norm_cast_once(
            linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_norm.weight"], eps
        )
        q = linear(qr, w["self_attn.q_b_proj.weight"]).view(N, H, D)
        q = rope(head_rms(q, eps) if c.q_head_norm else q, pos)
        kv = rope(
            rms_norm_cast_once(linear(x, w["self_attn.kv_proj.weight"]), w["self_attn.kv_norm.weight"], eps),
            pos,
        )
        src, isrc = c.kv_from[L], c.index_from[L]
        if src == L:
            comp = self.compressors[L]
            ckv = linear(x, comp.wkv)
            cgate = (
                torch.zeros_like(ckv) if comp.wgate is None else linear(x, comp.wgate)
            )  # ratio 1: one member
            if (L, "index") in self.compressors:
                icomp = self.compressors[(L, "index")]
                ikv, igate = linear(x, icomp.wkv), linear(x, icomp.wgate)
        if isrc == L:
            i = "self_attn.compressor.indexer."
            qi = linear(qr, w[i + "q_b_proj.weight"]).view(N, c.index_n_heads, c.index_head_dim)
            qi = self.rope_compress(qi, pos)
            wts = linear(x, w[i + "scorer.weights_proj.weight"]).float() * c.index_n_heads**-0.5
        out = torch.empty_like(q)
        for b, s in enumerate(batch.seqs):
            rows = slice(s.start, s.start + s.n)
            st = s.state.layers[L]
            win_start = s.past - st.window.held
            win = st.window.append(kv=kv[rows])["kv"]
            entries = sel = None
            if r:
                if src == L:
                    entries, latent, E0 = compress(st.compressor, ckv[rows], cgate[rows], comp, eps, rope)
                    if isinstance(st.indexer, CompressorState):  # V4 CSA: the index keys' own compressor
                        compressor_update(st.indexer, ikv[rows], igate[rows], icomp, eps, rope)
                    elif st.indexer is not None and latent.shape[0]:  # V4.1: keys from the latent before rope
                        k = rms_norm_cast_once(
                            linear(latent, w["self_attn.indexer.wk.weight"]),
                            w["self_attn.indexer.k_norm.weight"],
                            eps,
                        )
                        st.indexer.entries.append(
                            entry=rope(k, torch.arange(E0, E0 + k.shape[0], device=k.device) * r)
                        )
                else:
                    entries = _held(s.state.layers[src].compressor)
                if isrc == L:
                    keys = _held(s.state.layers[src].indexer)
                    cand = L == c.candidate_source_layer_id
                    sel, keep = index_select(
                        qi[rows],
                        wts[rows],
                        keys,
                        pos[rows],
                        r,
                        c.index_topk,
                        c.candidate_block_size,
                        c.candidate_topk_blocks if cand else 0,
                        published[("candidates", b)] if c.uses_candidates[L] else None,
                    )
                    published[(L, b)] = sel
                    if cand:
                        published[("candidates", b)] = keep
                elif isrc is not None:
                    sel = published[(isrc, b)]
            out[rows] = sink_attention(
                q[rows],
                pos[rows],
                win,
                win_start,
                c.sliding_window,
                w["self_attn.sinks"],
                D**-0.5,
                entries,
                sel,
                r,
            )
        out = rope(out, pos, inverse=True)
        return grouped_out(
            out.reshape(N, H * D), w["self_attn.o_a_proj.weight"], w["self_attn.o_b_proj.weight"], c.o_groups
        )

    def moe(self, w: dict, x: Tensor) -> Tensor:
        c = self.cfg
        weights, ids = route_sqrtsoftplus(
            linear(x, w["mlp.gate.weight"]),
            c.num_experts_per_tok,
            w["mlp.gate.e_score_correction_bias"],
            c.routed_scaling_factor,
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

    def engram_rows(self, batch: ForwardBatch) -> Tensor:
        """[N, engram layers, rows per token] table rows of the batch's tokens; appends each sequence's
        tokens to its lookback (the last entry of its state)."""
        if self.hasher is None:
            raise ConfigError(
                "this DeepSeek-V4.1 model has Engram layers but no token map: load it through "
                "moesaic (the checkpoint's tokenizer builds it) or pass token_map to Model"
            )
        ids = batch.token_ids.cpu()
        return torch.cat(
            [self.hasher.rows(ids[s.start : s.start + s.n], s.state.layers[-1]) for s in batch.seqs]
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        eps, n = c.rms_norm_eps, c.hc_mult
        h = mhc.expand(F.embedding(batch.token_ids, self.embed), n)  # [N, n, d]
        rows = self.engram_rows(batch) if c.engram is not None else None
        pre = None
        if c.delayed_pre:  # layer 0 collapses with a one-hot on stream 0 (the streams are equal copies)
            pre = torch.zeros(h.shape[0], n, device=h.device)
            pre[:, 0] = 1.0
        published: dict = {}  # this forward's index selections and candidate blocks, per (layer, sequence)
        for L, w in enumerate(self.layers):
            if L in self.engram:
                h = engram_forward(h, rows[:, c.engram.layer_ids.index(L)], self.engram[L], c.engram)
            for site, norm, block in (
                (self.sites[L][0], "input_layernorm.weight", "attention"),
                (self.sites[L][1], "post_attention_layernorm.weight", "moe"),
            ):
                if c.delayed_pre:
                    site_pre, post, comb = mhc.site_maps(h, site, self.hc)
                    x, pre = mhc.collapse(h, pre), site_pre
                else:
                    x, post, comb = mhc.site_input(h, site, self.hc)
                x = rms_norm_cast_once(x, w[norm], eps)
                y = self.attention(L, w, x, batch, published) if block == "attention" else self.moe(w, x)
                h = mhc.update(h, y, post, comb)
        batch.finish()
        h = h[batch.logit_rows]
        out = (
            mhc.collapse(h, pre[batch.logit_rows])
            if c.delayed_pre
            else mhc.head_weighted(h, *self.hc_head, self.hc)
        )
        return linear(rms_norm_cast_once(out, self.norm, eps), self.lm_head).float()


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: DeepseekV41Config) -> list[str]:
    """e.g. "engram+swa+moe", "csa2(r2,kv,idx)+moe", "csa2(r2)+moe" (reads layer 2's entries and selection)."""
    out = []
    for L in range(cfg.num_hidden_layers):
        kind, r = cfg.layer_types[L], cfg.compress_ratios[L]
        roles = [f"r{r}"] if r else []
        roles += [
            name
            for name, on in (
                ("kv", L in cfg.kv_source_layer_ids),
                ("idx", L in cfg.index_source_layer_ids),
                ("cand", L == cfg.candidate_source_layer_id),
            )
            if on
        ]
        mixer = _SHORT[kind] + (f"({','.join(roles)})" if roles else "")
        out.append(("engram+" if L in cfg.engram_layers else "") + f"{mixer}+moe")
    return out


def state_bytes(cfg: DeepseekV41Config, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence) of `Model.new_state(rollback_window)`. Per token: each
    KV source's entries (head_dim / ratio elements) and index keys (index_head_dim / ratio); fixed:
    every layer's window rows (window − 1 + rollback_window), each KV source's open-group raw rows, and
    the Engram lookback (int64 ids). Layers that read a source's entries hold nothing of their own."""
    R = rollback_window
    per_token, fixed = (
        0,
        cfg.num_hidden_layers
        * TailRows.nbytes_for({"kv": cfg.head_dim}, cfg.sliding_window - 1 + R, dtype_bytes),
    )
    for L in cfg.kv_source_layer_ids:
        pt, fx = CompressorState.nbytes_for(cfg.compressor_dims(L), R, dtype_bytes)
        if cfg.index_keys[L] and cfg.layer_types[L] == CSA:
            ipt, ifx = CompressorState.nbytes_for(cfg.index_compressor_dims(L), R, dtype_bytes)
            pt, fx = pt + ipt, fx + ifx
        elif cfg.index_keys[L]:
            pt += math.ceil(cfg.index_head_dim * dtype_bytes / cfg.compress_ratios[L])
        per_token, fixed = per_token + pt, fixed + fx
    if cfg.engram is not None:
        fixed += EngramState.nbytes_for(cfg.engram, R)
    return per_token, fixed


def max_context(cfg: DeepseekV41Config) -> int:
    return cfg.max_position_embeddings


def expert_bytes_fp4(cfg: DeepseekV41Config) -> int:
    """One routed expert in the release's fp4 (E2M1 nibbles + one E8M0 byte per 32): 18,800,640 B."""
    d, I = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * (I * d // 2 + I * d // 32) + (d * I // 2 + d * I // 32)


def facts(cfg: DeepseekV41Config) -> dict:
    d, I, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_hidden_layers
    ratios = {str(r): cfg.compress_ratios.count(r) for r in sorted(set(cfg.compress_ratios)) if r}
    out = {
        "sliding_layers": cfg.compress_ratios.count(0),
        "compressed_layers_by_ratio": ratios,
        "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
        "index_source_layer_ids": list(cfg.index_source_layer_ids),
        "candidates": None
        if cfg.candidate_source_layer_id is None
        else {
            "source_layer": cfg.candidate_source_layer_id,
            "topk_blocks": cfg.candidate_topk_blocks,
            "block_size": cfg.candidate_block_size,
            "consumer_layers": [L for L in range(n) if cfg.uses_candidates[L]],
        },
        "sliding_window": cfg.sliding_window,
        "index_heads": cfg.index_n_heads,
        "index_topk": cfg.index_topk,
        "mtp_layers": cfg.num_nextn_predict_layers,
        "mtp_compress_ratios": list(cfg.mtp_compress_ratios),
        "hash_moe_layers": 0,
        "q_head_norm": cfg.q_head_norm,
        "mhc": "delayed pre, no hc_head" if cfg.delayed_pre else "per-site pre, weighted hc_head",
        "hc_mult": cfg.hc_mult,
        "experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "expert_params": 3 * d * I,
        "expert_bytes_fp4": expert_bytes_fp4(cfg),
        "expert_bytes_bf16": 3 * d * I * 2,
        "routed_expert_bytes_fp4": n * cfg.n_routed_experts * expert_bytes_fp4(cfg),
        "routed_expert_code_bytes_fp4": n * cfg.n_routed_experts * 3 * d * I // 2,  # without the E8M0 scales
    }
    if cfg.engram is not None:
        tables = engram_bytes(cfg.engram)
        out.update(
            engram_layers=list(cfg.engram.layer_ids),
            engram_tables=tables,
            engram_table_bytes=sum(t["table_bytes"] for t in tables),
            engram_rows_per_token=cfg.engram.n_hash * len(tables),
            engram_lookback_bytes_per_sequence=EngramState.nbytes_for(cfg.engram),
        )
    return out


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg) -> tuple[str, ...]:
    return ()


def build(cfg, tensors, dtype, device, folder):
    model = Model(cfg, tensors.all(), dtype, device)
    if folder is not None:
        model.bind_checkpoint_folder(folder)
    return model

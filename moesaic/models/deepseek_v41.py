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

Sources: DeepSeek's release (`deepseek-ai/DeepSeek-V4.1-Flash`: `config.json`, `inference/model.py`,
`inference/engram.py`) as read by TRT-LLM's `modeling_deepseekv41.py`; the layer schedule, state,
namings and proof are written down in docs/families/deepseek_v41.md. No package implements V4.1; the
proof is moesaic's own (tests/test_deepseek_v41.py): with Engram off, V4's layer kinds and every layer
its own KV/index source, this module equals `deepseek_v4` (proven against transformers) on the same
weights; each V4.1 feature switched on changes the logits; a plain per-token reference in the test,
written from the description above, checks the V4.1 paths.

Shared with deepseek_v4 (imported, never copied): the config parser for the common fields, the
contract pieces and binders of a block (`attention_block_specs`, `compressor_specs`,
`index_query_specs`, `moe_layer_specs`, `bind_attention`, `bind_layer`), the attention pieces
(`attention_inputs`, `index_query`, `attention_output`), the release names, the MoE law; layers/csa.py
(window + sink attention, compressors and their state, the indexer with candidate blocks, grouped
o-proj, trailing rope), layers/mhc.py (`site_maps` + `collapse` express the delayed pre),
layers/moe.py, layers/engram.py. Added here: `IndexKeys` (index keys made from the latent, rolled
back with its compressor) and the Engram binding.

Config (`config.json`: the release nests it in `text_config`; top-level ids are read too):
* `compress_ratios`: one per layer (0 = sliding window only, r > 0 = compressed, ratio r), then one
  per MTP stage (`num_nextn_predict_layers`; kept in `mtp_compress_ratios`: the DSpark stages are
  window-only, 0).
* DSpark (`DsparkConfig`, when there are MTP stages): `dspark_target_layer_ids` (the layers whose input
  the drafter reads), `dspark_block_size`, `dspark_markov_rank`, `dspark_n_routed_experts`,
  `dspark_num_experts_per_tok`, `dspark_noise_token_id`.
* `kv_source_layer_ids` (default: every compressed layer): layers that own a compressor. Any other
  compressed layer reads the entries of the nearest KV source at or below it with its ratio (and
  kind); there must be one. `index_source_layer_ids` (default: every compressed layer but V4's HCA
  ones): layers that own the indexer's query side (`wq_b`, `weights_proj`); a compressed layer uses
  the selection of the nearest index source at or below it that reads the same entries, or, with
  none, attends to all visible entries. A KV source makes index keys (`wk`, `k_norm`; V4's CSA
  kind: its index compressor) when an index source reads its entries. (The release's role lists
  give these rules no exception.)
* `candidate_source_layer_id`, `candidate_topk_blocks`, `candidate_block_size` (optional).
* Engram: `engram_layer_ids`, `engram_num_embeddings`, ... (layers/engram.py `EngramConfig`).
* `route_scale` is read as `routed_scaling_factor`. `num_hash_layers` > 0 or hash_moe layers are a
  ConfigError (V4.1 has no hash routing).
* moesaic-only keys (not in the release; the tests use them to switch V4.1 features off):
  `layer_types` (V4's sliding / CSA / HCA kinds with `compress_rates`, instead of `compress_ratios`),
  `q_head_norm` (V4's per-head q RMS, default false), `mhc_delayed_pre` (default true; false = V4's
  per-site pre and weighted `hc_head`).
Absent scalar fields take the release's values (`RELEASE_TEXT_CONFIG`).

Names: the model's own names are deepseek_v4's (transformers' module names), plus
`model.layers.L.self_attn.indexer.{wk,k_norm}` and `model.layers.L.engram.*`. Checkpoints are read in
the release naming: deepseek_v4's upstream names plus `layers.L.attn.indexer.{wk,k_norm}.weight`,
`layers.L.engram.{embed.weight, embed.scale, wkv.weight, q_weight, k_weight}`. The DSpark stages
`mtp.{j}.*` (a block's release names, `mtp.0.main_proj`/`main_norm`, the last stage's `norm`,
`markov_head.{embed,head}`, `confidence_head.proj`) are optional, all or none, and bound into
`Model.dspark` for the drafter (spec/dspark.py; docs/families/deepseek_v41.md). Not loaded (ignored):
`ffn.gate.bias_vl` (of the layers and the stages) and the vision tower (text only). Quantized weights (fp8 E4M3 + UE8M0 32x32 `.scale`, fp4 experts) stay packed;
`attn.wo_a` (used as a grouped view) is dequantized at load. The Engram tables stay in the file (the
contract marks them `mapped`: a read-only view of the file's map) and are read row by row; `build`
makes the token map from the checkpoint's tokenizer, or it is passed as `token_map` to `Model`.

State per sequence (`new_state`): every layer a window of key rows; KV sources their compressor's
open-group raw rows and closed entries and, when read by an index source, the index keys; one
Engram lookback of the last max_ngram_size − 1 compressed ids. Layers that share read their
source's state and hold none. rollback(n) is exact for n <= `rollback_window`; snapshot/restore;
`state_bytes` sizes it from the config.

Where moesaic departs from DeepSeek's inference code (numerics, all inferred harmless in fp32):
the window rows, the latents and the index q/k are kept in the model dtype (the release rounds them
to fp8 / fp4); the streams stay in the model dtype (the release keeps an fp32 highway); the vendor's
index-key republishing quirk (alternate decode steps scoring layer 20's keys at layers 2, 8, 14) is
not reproduced: each index source scores the keys of its own KV source. The candidate source's own
selection is not restricted by its candidates (inferred: "consumer layers" restrict).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import SequenceState, TailRows, TokenRows
from ..config import declared, field, layer_count, non_negative, positive, read_config, require
from ..errors import CheckpointError, ConfigError
from ..layers import mhc
from ..layers.csa import (
    CSA,
    HCA,
    SLIDING,
    AttentionState,
    CompressorDims,
    CompressorState,
    RopeTail,
    compressor_inputs,
    compressor_update,
    indexer_select,
    sink_attention,
)
from ..layers.engram import (
    SCALE_BLOCK,
    EngramConfig,
    EngramHash,
    EngramState,
    EngramTable,
    EngramWeights,
    build_token_map,
    engram_forward,
)
from ..layers.linear import embedding, linear, products
from ..layers.moe import moe
from ..layers.norms import rms_norm_cast_once
from ..layers.rope import inv_freq
from ..tokenizer import BYTE_OFFSET, ByteTokenizer, load_tokenizer
from ..weights.bind import Tensors
from ..weights.contract import Naming, TensorSpec, direct
from . import deepseek_v4
from .deepseek_v4 import (
    HASH_MOE,
    MOE,
    DeepseekV4Config,
    attention_block_specs,
    attention_inputs,
    attention_output,
    bind_attention,
    bind_site,
    compressor_specs,
    index_query,
    index_query_specs,
    moe_layer_specs,
)
from .parts import bind_moe, moe_specs

MODEL_TYPES = ("deepseek_v41",)

CSA2 = "csa2_attention"  # a V4.1 compressed layer: ratio r, no overlap, no position bias, index keys from the latent
_SHORT = {SLIDING: "swa", CSA: "csa", HCA: "hca", CSA2: "csa2"}

# The release's text_config (the values of deepseek-ai/DeepSeek-V4.1-Flash's config.json; field
# spellings follow transformers' V4 config where a write-up abbreviates, e.g. "heads 64" ->
# num_attention_heads).
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


@dataclass(frozen=True, kw_only=True)
class DsparkConfig:
    """The DSpark drafter the MTP stages make up (`dspark_*`; absent keys take the release's values):
    stage 0 projects the concatenated hidden states of the target layers `target_layer_ids` (their input
    streams' mean); a block of `block_size` rows, [token, noise x (block_size - 1)], drafts one token per
    row; the stages' MoE has its own expert count and top-k; the Markov head has rank `markov_rank`."""

    target_layer_ids: tuple[int, ...]
    block_size: int = declared(5, key="dspark_block_size", check=positive)
    markov_rank: int = declared(256, key="dspark_markov_rank", check=positive)
    n_routed_experts: int = declared(128, key="dspark_n_routed_experts", check=positive)
    num_experts_per_tok: int = declared(3, key="dspark_num_experts_per_tok", check=positive)
    noise_token_id: int = declared(128799, key="dspark_noise_token_id", check=non_negative)


@dataclass(frozen=True, kw_only=True)
class DeepseekV41Config(DeepseekV4Config):
    """DeepSeek-V4's config (`layer_types` may also hold CSA2; `mlp_layer_types` is all "moe") plus:"""

    compress_ratios: tuple[int, ...]  # per layer; 0 = sliding only
    mtp_compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    kv_from: tuple[int | None, ...]  # per layer: the KV source whose entries it attends to
    index_from: tuple[int | None, ...]  # per layer: the index source whose selection it uses (None: all)
    index_keys: tuple[bool, ...]  # per layer: a KV source whose entries an index source scores
    uses_candidates: tuple[bool, ...]  # per layer: an index source restricted to the candidate blocks
    engram: EngramConfig | None
    dspark: DsparkConfig | None  # the MTP stages' drafter (None: the config has no stages)
    q_head_norm: bool = declared(False)
    delayed_pre: bool = declared(True, key="mhc_delayed_pre")
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


def _compression(text: dict, base: DeepseekV4Config, n: int, w: str):
    """(layer kinds, compress ratios, the MTP stages' ratios): the release's `compress_ratios`, or
    (moesaic's tests) V4's `layer_types` with `compress_rates`."""
    if text.get("layer_types") is not None:
        kinds = deepseek_v4.read_kinds(text, "layer_types", {SLIDING, CSA, HCA}, n, w)
        return kinds, [{SLIDING: 0, CSA: base.csa_ratio, HCA: base.hca_ratio}[k] for k in kinds], []
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
    return [SLIDING if r == 0 else CSA2 for r in cr[:n]], list(cr[:n]), list(cr[n:])


def _roles(text: dict, kinds: list, ratios: list, n: int, w: str) -> dict:
    """Which layer owns what (KV sources, index sources) and which source each layer reads."""
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
    return dict(
        kv_source_layer_ids=kv_src,
        index_source_layer_ids=idx_src,
        kv_from=tuple(kv_from),
        index_from=tuple(index_from),
        index_keys=tuple(L in kv_src and any(kv_from[j] == L for j in idx_src) for L in range(n)),
    )


def _candidates(text: dict, roles: dict, n: int, w: str) -> dict:
    cand, idx_src, kv_from = (
        text.get("candidate_source_layer_id"),
        roles["index_source_layer_ids"],
        roles["kv_from"],
    )
    if cand is None:
        return dict(
            candidate_source_layer_id=None,
            candidate_topk_blocks=0,
            candidate_block_size=1,
            uses_candidates=(False,) * n,
        )
    if cand not in idx_src:
        raise ConfigError(
            f"{w}: field 'candidate_source_layer_id' = {cand!r} is not one of the index sources {list(idx_src)}"
        )
    return dict(
        candidate_source_layer_id=cand,
        candidate_topk_blocks=field(text, "candidate_topk_blocks", int, where=w, check=positive),
        candidate_block_size=field(text, "candidate_block_size", int, where=w, check=positive),
        uses_candidates=tuple(L in idx_src and L > cand and kv_from[L] == kv_from[cand] for L in range(n)),
    )


def parse_config(raw: dict, layout: str = "hf") -> DeepseekV41Config:
    if layout != "hf":
        raise ConfigError(f"DeepSeek-V4.1 checkpoints come with a config.json, not a {layout} layout")
    text, w = _text(raw)
    text = {**_DEFAULTS, **text}
    if text.get("route_scale") is not None and text.get("routed_scaling_factor") is None:
        text["routed_scaling_factor"] = text["route_scale"]
    n = layer_count(text, "num_hidden_layers", where=w)
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
    kinds, ratios, mtp_ratios = _compression(text, base, n, w)
    roles = _roles(text, kinds, ratios, n, w)
    model = {"hc_mult": base.hc_mult, "rms_norm_eps": base.rms_norm_eps, "hidden_size": base.hidden_size}
    engram = EngramConfig.from_config({**text, **model, "vocab_size": base.vocab_size}, w)
    dspark = _dspark(text, base, n, mtp_ratios, engram, w)
    common = {
        f.name: getattr(base, f.name)
        for f in dataclasses.fields(base)
        if f.name not in ("layer_types", "model_type")
    }
    return read_config(
        DeepseekV41Config,
        text,
        w,
        **common,
        layer_types=tuple(kinds),
        compress_ratios=tuple(ratios),
        mtp_compress_ratios=tuple(mtp_ratios),
        **roles,
        **_candidates(text, roles, n, w),
        engram=engram,
        dspark=dspark,
    )


def _dspark(
    text: dict, base: DeepseekV4Config, n: int, mtp_ratios: list, engram, w: str
) -> DsparkConfig | None:
    """The DSpark stages' config, when the config has stages (`num_nextn_predict_layers`)."""
    if not base.num_nextn_predict_layers:
        return None
    raw = {k: v for k, v in RELEASE_TEXT_CONFIG.items() if k.startswith("dspark_")} | text
    ids = raw["dspark_target_layer_ids"]
    engram_layers = () if engram is None else engram.layer_ids
    if (
        not isinstance(ids, list)
        or not ids
        or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 < i < n or i in engram_layers for i in ids
        )
    ):
        raise ConfigError(
            f"{w}: field 'dspark_target_layer_ids' must list layers in 1..{n - 1} (the drafter reads their "
            f"input, i.e. the previous layer's output; not an Engram layer {list(engram_layers)}), got {ids!r}"
        )
    require(
        not any(mtp_ratios), w, "compress_ratios", mtp_ratios, "the DSpark stages are window-only (ratio 0)"
    )
    ds = read_config(DsparkConfig, raw, w, target_layer_ids=tuple(ids))
    require(
        ds.num_experts_per_tok <= ds.n_routed_experts,
        w,
        "dspark_num_experts_per_tok",
        ds.num_experts_per_tok,
        f"must be at most dspark_n_routed_experts = {ds.n_routed_experts}",
    )
    require(
        ds.noise_token_id < base.vocab_size,
        w,
        "dspark_noise_token_id",
        ds.noise_token_id,
        f"must be a token id below vocab_size = {base.vocab_size}",
    )
    return ds


# ---------------------------------------------------------------- tensor contract


def _engram_specs(cfg: DeepseekV41Config, g: str, L: int) -> list[TensorSpec]:
    e = cfg.engram
    rows, d, f32 = e.num_embeddings[e.layer_ids.index(L)], cfg.hidden_size, dict(layer=L, keep_fp32=True)
    return [
        # the table stays in the file (fp8 rows + one E8M0 scale per 32 columns; a float table has no scale)
        TensorSpec(g + "embed.weight", (rows, e.head_dim), "engram_table", L, mapped=True),
        TensorSpec(
            g + "embed.scale",
            (rows, -(-e.head_dim // SCALE_BLOCK)),
            "engram_scale",
            L,
            mapped=True,
            optional=True,
        ),
        TensorSpec(g + "wkv.weight", ((e.hc_mult + 1) * d, e.n_hash * e.head_dim), "engram", L),
        TensorSpec(g + "q_weight", (e.hc_mult, d), "engram", **f32),
        TensorSpec(g + "k_weight", (e.hc_mult, d), "engram", **f32),
    ]


def _layer_specs(cfg: DeepseekV41Config, L: int) -> list[TensorSpec]:
    d, D = cfg.hidden_size, cfg.head_dim
    p, kind, r = f"model.layers.{L}.", cfg.layer_types[L], cfg.compress_ratios[L]
    a = p + "self_attn."
    specs = attention_block_specs(cfg, p, L)
    if L in cfg.kv_source_layer_ids:  # V4.1's own kind: no position bias, and no gate at ratio 1
        v41 = kind == CSA2
        specs += compressor_specs(
            a + "compressor.", cfg.compressor_dims(L), d, "compressor", L, gate=not v41 or r > 1, ape=not v41
        )
    if cfg.index_keys[L] and kind == CSA:
        specs += compressor_specs(a + "compressor.indexer.", cfg.index_compressor_dims(L), d, "indexer", L)
    elif cfg.index_keys[L]:
        cI = cfg.index_head_dim
        specs += [
            TensorSpec(a + "indexer.wk.weight", (cI, D), "indexer", L),
            TensorSpec(a + "indexer.k_norm.weight", (cI,), "norm", L, keep_fp32=True),
        ]
    if L in cfg.index_source_layer_ids:
        specs += index_query_specs(cfg, a, L)
    specs += moe_layer_specs(cfg, p + "mlp.", L, hashed=False)
    if L in cfg.engram_layers:
        specs += _engram_specs(cfg, p + "engram.", L)
    return specs


def dspark_specs(cfg: DeepseekV41Config) -> list[TensorSpec]:
    """The DSpark stages `mtp.{j}.` (optional, role "mtp", all or none): each a V4.1 block's norms, mHC
    sites and window-only attention core with its own MoE (dspark experts, one shared expert); stage 0
    also `main_proj` [d, taps·d] and `main_norm`; the last stage `norm`, the Markov head `markov_head.
    {embed,head}` [V, r] and the confidence head `confidence_head.proj` [1, d + r]."""
    ds, d, I = cfg.dspark, cfg.hidden_size, cfg.moe_intermediate_size
    if ds is None:
        return []
    specs, last = [], cfg.num_nextn_predict_layers - 1
    for j in range(cfg.num_nextn_predict_layers):
        p, L = f"mtp.{j}.", cfg.num_hidden_layers + j
        specs += attention_block_specs(cfg, p, L, optional=True)
        specs += moe_specs(p + "mlp.", ds.n_routed_experts, I, d, L, shared=I, optional=True)
        opt = dict(layer=L, optional=True)
        if j == 0:
            specs += [
                TensorSpec(p + "main_proj.weight", (d, len(ds.target_layer_ids) * d), "mtp", **opt),
                TensorSpec(p + "main_norm.weight", (d,), "norm", keep_fp32=True, **opt),
            ]
        if j == last:
            r = ds.markov_rank
            specs += [
                TensorSpec(p + "norm.weight", (d,), "norm", keep_fp32=True, **opt),
                TensorSpec(p + "markov_head.embed.weight", (cfg.vocab_size, r), "mtp", **opt),
                TensorSpec(p + "markov_head.head.weight", (cfg.vocab_size, r), "mtp", **opt),
                TensorSpec(p + "confidence_head.proj.weight", (1, d + r), "mtp", keep_fp32=True, **opt),
            ]
    return [dataclasses.replace(s, role="mtp") for s in specs]


def tensor_specs(cfg: DeepseekV41Config) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), "embedding")]
    for L in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, L)
    specs.append(TensorSpec("model.norm.weight", (d,), "norm", keep_fp32=True))
    if not cfg.delayed_pre:  # V4's weighted hyper head
        specs += deepseek_v4.hc_head_specs(cfg, "model.", "mhc", False)
    specs.append(
        TensorSpec("lm_head.weight", (cfg.vocab_size, d), "lm_head", optional=cfg.tie_word_embeddings)
    )
    return specs + dspark_specs(cfg)


_V41_NAMES = {
    "self_attn.indexer.wk.weight": "attn.indexer.wk.weight",
    "self_attn.indexer.k_norm.weight": "attn.indexer.k_norm.weight",
}
IGNORED = [
    r"(layers|mtp)\.\d+\.ffn\.gate\.bias_vl",  # the router bias of image tokens (vision is not supported)
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


# ---------------------------------------------------------------- the state V4.1 adds


class IndexKeys:
    """A V4.1 KV source's index keys: one row per entry of its compressor, forgotten with them."""

    def __init__(self, compressor: CompressorState, width: int, dtype, device, max_tokens: int):
        self.compressor = compressor
        self.entries = TokenRows({"entry": width}, dtype, device, max_tokens // compressor.dims.ratio + 1)

    def held_entries(self) -> Tensor:
        return self.entries.bufs["entry"][: self.entries.length]

    def rollback(self, n: int) -> None:  # runs after the compressor's (AttentionState's order)
        self.entries.rollback(self.entries.length - self.compressor.entries.length)

    def snapshot(self):
        return self.entries.snapshot()

    def snapshot_at(self, t: int):
        """After t tokens: as many keys as the compressor had entries then."""
        return self.entries.snapshot_at(t // self.compressor.dims.ratio)

    def restore(self, snap) -> None:
        self.entries.restore(snap)

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes


# ---------------------------------------------------------------- bound weights


@dataclass
class Layer(deepseek_v4.Layer):
    """deepseek_v4's layer (bound by its binders), plus what V4.1 adds to a layer."""

    key_proj: object | None = None  # indexer.wk [c_I, D]: a KV source's index keys from its latent
    key_norm: Tensor | None = None  # indexer.k_norm [c_I]
    engram: EngramWeights | None = None


def engram_table(weight: Tensor, scale: Tensor | None, name: str) -> EngramTable:
    """An Engram table as the load hands it over (mapped: views of the file, dtype as stored): the
    release's fp8 rows + E8M0 scales as they are; a float table with float scales multiplied out once."""
    if scale is not None and weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        block = -(-weight.shape[1] // scale.shape[1])
        weight, scale = (
            weight.float() * scale.float().repeat_interleave(block, dim=1)[:, : weight.shape[1]],
            None,
        )
    return EngramTable(weight, scale, name)


def bind_engram(t: Tensors) -> EngramWeights:
    """One Engram layer under `t`'s prefix (`…engram.`)."""
    table = engram_table(t("embed.weight"), t.optional("embed.scale"), t.prefix + "embed")
    return EngramWeights(table, t("wkv.weight"), t("q_weight"), t("k_weight"))


def bind_layer(t: Tensors, cfg: DeepseekV41Config, L: int, device) -> Layer:
    """Layer L under `t`'s prefix: deepseek_v4's binders with V4.1's roles (a compressor on KV sources,
    the indexer's query side on index sources), the index-key projection and the Engram."""
    kind, a = cfg.layer_types[L], t.under("self_attn.")
    comp = cfg.compressor_dims(L) if L in cfg.kv_source_layer_ids else None
    index_comp = cfg.index_compressor_dims(L) if cfg.index_keys[L] and kind == CSA else None
    attn = bind_attention(a, comp, index_comp, L in cfg.index_source_layer_ids, device)
    latent_keys = cfg.index_keys[L] and kind != CSA
    return deepseek_v4.bind_layer(
        t,
        attn,
        bind_moe(t.under("mlp.")),
        cls=Layer,
        key_proj=a("indexer.wk.weight") if latent_keys else None,
        key_norm=a("indexer.k_norm.weight") if latent_keys else None,
        engram=bind_engram(t.under("engram.")) if L in cfg.engram_layers else None,
    )


@dataclass
class Dspark:
    """The bound DSpark drafter (spec/dspark.py runs it): its stages (V4.1 blocks, window-only attention),
    stage 0's input projection and norm, the last stage's norm, Markov and confidence heads."""

    stages: list[Layer]
    main_proj: object  # [d, taps·d]
    main_norm: Tensor
    norm: Tensor
    markov_embed: Tensor  # [V, r]
    markov_head: Tensor  # [V, r]
    confidence: Tensor  # [1, d + r]


def bind_dspark(t: Tensors, cfg: DeepseekV41Config, device) -> Dspark | None:
    """The DSpark stages when the checkpoint has them: all of their tensors or none (a CheckpointError)."""
    specs = dspark_specs(cfg)
    missing = [s.name for s in specs if not t.has(s.name)]
    if len(missing) == len(specs):
        return None
    if missing:
        raise CheckpointError(
            f"the DSpark stages (mtp.*) are incomplete: {len(missing)} of their {len(specs)} tensor(s) "
            f"missing, e.g. {missing[:3]} (ship all of them or none)"
        )
    stages = []
    for j in range(cfg.num_nextn_predict_layers):
        w = t.under(f"mtp.{j}.")
        attn = bind_attention(w.under("self_attn."), None, None, False, device)
        stages.append(deepseek_v4.bind_layer(w, attn, bind_moe(w.under("mlp.")), cls=Layer))
    first, last = t.under("mtp.0."), t.under(f"mtp.{cfg.num_nextn_predict_layers - 1}.")
    return Dspark(
        stages,
        first("main_proj.weight"),
        first("main_norm.weight"),
        last("norm.weight"),
        last("markov_head.embed.weight"),
        last("markov_head.head.weight"),
        last("confidence_head.proj.weight"),
    )


def tokenizer_vocab(tok):
    """What `engram.build_token_map` reads from a tokenizer: the tokenizer itself, or, for moesaic's byte
    tokenizer, (decoded, raw token) pairs (specials decode to their names, as tokenizers' decode with
    skip_special_tokens=False does; a lone byte >= 0x80 decodes to U+FFFD and keys on its raw name)."""
    if isinstance(tok, ByteTokenizer):
        names = ["<pad>", "<s>", "</s>"]
        return (
            [(s, s) for s in names]
            + [(tok.decode([i]), f"<0x{i - BYTE_OFFSET:02X}>") for i in range(BYTE_OFFSET, 256 + BYTE_OFFSET)]
            + [(s, s) for s in tok.added]  # a demo's chat markers, after the bytes
        )
    return tok


def checkpoint_token_map(cfg: DeepseekV41Config, folder: Path) -> Tensor:
    """Engram's compressed token map, built from the tokenizer of the checkpoint in `folder`."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tok = load_tokenizer(folder, raw, cfg.eos_token_ids)
    if tok is None:
        raise ConfigError(
            f"{folder}: DeepSeek-V4.1's Engram layers hash compressed token ids, whose map is "
            f"built from the checkpoint's tokenizer, and this folder has none (tokenizer.json)"
        )
    return build_token_map(tokenizer_vocab(tok), cfg.engram.compressed_vocab_size)


# ---------------------------------------------------------------- model


class Model:
    """The DeepSeek-V4.1 decoder over a ForwardBatch. `token_map` (Engram's compressed token map, int64
    [V]) is what `build` makes from the checkpoint's tokenizer; a model with Engram layers needs it."""

    def __init__(
        self, cfg: DeepseekV41Config, t: Tensors, dtype: torch.dtype, device, token_map: Tensor | None = None
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.hc = cfg.mhc_dims
        self.moe = cfg.moe_spec
        main = RopeTail(inv_freq(cfg.rope_main).to(device), cfg.rope_main_factor)
        comp = RopeTail(inv_freq(cfg.rope_compress).to(device), cfg.rope_compress_factor)
        self.rope = [comp if r else main for r in cfg.compress_ratios]
        self.rope_compress = comp
        self.embed = t("model.embed_tokens.weight")
        self.norm = t("model.norm.weight")
        self.lm_head = t.optional("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = self.embed
        self.hc_head = None if cfg.delayed_pre else bind_site(t, "model.hc_head.hc_")
        self.layers = [
            bind_layer(t.under(f"model.layers.{L}."), cfg, L, device) for L in range(cfg.num_hidden_layers)
        ]
        self.dspark = bind_dspark(t, cfg, device)  # the MTP stages, for the drafter (spec/); None when absent
        self.hasher = None
        if cfg.engram is not None and token_map is not None:
            self.hasher = EngramHash(cfg.engram, token_map)

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
    def attention(self, L: int, w: Layer, x: Tensor, batch: ForwardBatch, published: dict) -> Tensor:
        c, a = self.cfg, w.attn
        eps, r = c.rms_norm_eps, c.compress_ratios[L]
        rope, pos = self.rope[L], batch.positions
        lin = products(x, a.x_stacks)
        qr, q, kv = attention_inputs(a, x, c, rope, pos, c.q_head_norm, lin)
        src, isrc = c.kv_from[L], c.index_from[L]
        if a.compressor is not None:  # a KV source
            ckv, cgate = compressor_inputs(x, a.compressor, lin)
        if a.index_compressor is not None:  # V4's CSA kind: the index keys' own compressor
            ikv, igate = compressor_inputs(x, a.index_compressor, lin)
        if a.index is not None:  # an index source
            qi, wts = index_query(a.index, qr, x, c, self.rope_compress, pos)
        out = None
        for b, s in enumerate(batch.seqs):
            st = s.state.layers[L]
            win_start = s.past - st.window.held
            win = st.window.append(kv=s.rows(kv))["kv"]
            entries = sel = None
            if r:
                if src == L:
                    entries, latent, E0 = compressor_update(
                        st.compressor, s.rows(ckv), s.rows(cgate), a.compressor, eps, rope
                    )
                    if a.index_compressor is not None:
                        compressor_update(
                            st.indexer, s.rows(ikv), s.rows(igate), a.index_compressor, eps, rope
                        )
                    elif w.key_proj is not None and latent.shape[0]:  # V4.1: keys from the latent before rope
                        k = rms_norm_cast_once(linear(latent, w.key_proj), w.key_norm, eps)
                        at = torch.arange(E0, E0 + k.shape[0], device=k.device) * r
                        st.indexer.entries.append(entry=rope(k, at))
                else:
                    entries = s.state.layers[src].compressor.held_entries()
                if isrc == L:
                    cand = L == c.candidate_source_layer_id
                    sel, keep = indexer_select(
                        s.rows(qi),
                        s.rows(wts),
                        s.state.layers[src].indexer.held_entries(),
                        s.rows(pos),
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
            o = sink_attention(
                s.rows(q),
                s.rows(pos),
                s.past,
                win,
                win_start,
                c.sliding_window,
                a.sinks,
                c.head_dim**-0.5,
                entries,
                sel,
                r,
            )
            out = s.place(out, o, q)
        return attention_output(a, out, c, rope, pos)

    def engram_rows(self, batch: ForwardBatch) -> Tensor:
        """[N, engram layers, rows per token] table rows of the batch's tokens; appends each sequence's
        tokens to its lookback (the last entry of its state)."""
        if self.hasher is None:
            raise ConfigError(
                "this DeepSeek-V4.1 model has Engram layers but no token map: load it through "
                "moesaic (the checkpoint's tokenizer builds it) or pass token_map to Model"
            )
        ids = batch.host_token_ids  # the hash runs on the host, where the tables are mapped (no sync)
        if ids is None:
            ids = batch.token_ids.cpu()
        return torch.cat(
            [self.hasher.rows(ids[s.start : s.start + s.n], s.state.layers[-1]) for s in batch.seqs]
        )

    def block(self, w: Layer, h: Tensor, pre: Tensor | None, attention, moe_spec=None):
        """One block over the streams h [N, n, d]: each site collapses with the previous site's pre
        (delayed pre) or its own, then attention(x) -> y (the caller's: a decoder layer's, or a DSpark
        stage's) and the MoE (`moe_spec`: a DSpark stage's top-k). Returns (streams, the pre to carry)."""
        eps = self.cfg.rms_norm_eps
        for site, norm, attend in ((w.attn_hc, w.attn_norm, True), (w.mlp_hc, w.mlp_norm, False)):
            if self.cfg.delayed_pre:
                site_pre, post, comb = mhc.site_maps(h, site, self.hc)
                x, pre = mhc.collapse(h, pre), site_pre
            else:
                x, post, comb = mhc.site_input(h, site, self.hc)
            x = rms_norm_cast_once(x, norm, eps)
            y = attention(x) if attend else moe(x, w.mlp, moe_spec or self.moe)
            h = mhc.update(h, y, post, comb)
        return h, pre

    @torch.inference_mode()
    def final_hidden(self, h: Tensor, pre: Tensor | None) -> Tensor:
        """The final norm's input: the streams collapsed by the delayed pre map, or V4's weighted head."""
        if self.cfg.delayed_pre:
            return mhc.collapse(h, pre)
        return mhc.head_weighted(h, self.hc_head.fn, self.hc_head.base, self.hc_head.scale, self.hc)

    def forward(self, batch: ForwardBatch) -> Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        eps, n = c.rms_norm_eps, c.hc_mult
        h = mhc.expand(embedding(batch.token_ids, self.embed), n)  # [N, n, d]
        rows = self.engram_rows(batch) if c.engram is not None else None
        pre = None
        if c.delayed_pre:  # layer 0 collapses with a one-hot on stream 0 (the streams are equal copies)
            pre = torch.zeros(h.shape[0], n, device=h.device)
            pre[:, 0] = 1.0
        published: dict = {}  # this forward's index selections and candidate blocks, per (layer, sequence)
        for L, w in enumerate(self.layers):
            if w.engram is not None:
                h = engram_forward(h, rows[:, c.engram.layer_ids.index(L)], w.engram, c.engram)
            h, pre = self.block(w, h, pre, lambda x, L=L, w=w: self.attention(L, w, x, batch, published))
            batch.tap(L, h, mhc.head_mean)
        batch.finish()
        batch.tap(FINAL, h, lambda s: self.final_hidden(s, pre))
        rows = batch.logit_rows
        out = self.final_hidden(h[rows], None if pre is None else pre[rows])
        return linear(rms_norm_cast_once(out, self.norm, eps), self.lm_head).float()


def build(cfg: DeepseekV41Config, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    """The model; with Engram, its token map built from the checkpoint's tokenizer in `folder`."""
    token_map = None if cfg.engram is None or folder is None else checkpoint_token_map(cfg, folder)
    return Model(cfg, tensors, dtype, device, token_map)


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


def engram_tensor_shapes(
    cfg: EngramConfig, block: int = SCALE_BLOCK
) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every Engram tensor in the release's naming and formats."""
    d, hc, hd = cfg.hidden_size, cfg.hc_mult, cfg.head_dim
    k, n = cfg.n_hash * hd, (hc + 1) * d
    out = {}
    for lid, rows in zip(cfg.layer_ids, cfg.num_embeddings):
        p = f"layers.{lid}.engram."
        out[p + "embed.weight"] = ((rows, hd), "F8_E4M3")
        out[p + "embed.scale"] = ((rows, -(-hd // block)), "F8_E8M0")
        out[p + "wkv.weight"] = ((n, k), "F8_E4M3")
        out[p + "wkv.scale"] = ((-(-n // block), -(-k // block)), "F8_E8M0")
        out[p + "q_weight"] = ((hc, d), "BF16")
        out[p + "k_weight"] = ((hc, d), "BF16")
    return out


def engram_bytes(cfg: EngramConfig, block: int = SCALE_BLOCK) -> list[dict]:
    """Per Engram layer: its table's rows, bytes per row (fp8 codes + E8M0 scales: 264 in the
    release), table bytes (on disk, read by row) and the bytes of its projection and gate weights."""
    shapes = engram_tensor_shapes(cfg, block)
    size = {"F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2}
    out = []
    for lid, rows in zip(cfg.layer_ids, cfg.num_embeddings):
        p = f"layers.{lid}.engram."
        nbytes = {k[len(p) :]: math.prod(s) * size[dt] for k, (s, dt) in shapes.items() if k.startswith(p)}
        row_bytes = (nbytes["embed.weight"] + nbytes["embed.scale"]) // rows
        out.append(
            {
                "layer": lid,
                "rows": rows,
                "row_bytes": row_bytes,
                "table_bytes": rows * row_bytes,
                "dense_bytes": sum(v for k, v in nbytes.items() if not k.startswith("embed.")),
            }
        )
    return out


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg: DeepseekV41Config) -> tuple[str, ...]:
    """The release's MTP stages (`mtp.{0,1,2}`, `num_nextn_predict_layers`) are its DSpark drafter."""
    return ("dspark",) if cfg.num_nextn_predict_layers > 0 else ()


# ---------------------------------------------------------------- tensor parallelism (moesaic/parallel/plan.py)

# DeepSeek-V4's split; the shared index keys (indexer.wk / k_norm) and Engram are replicated.
TP_HEADS = deepseek_v4.TP_HEADS
tp_plan = deepseek_v4.tp_plan

"""Nemotron-H (`nemotron_h`): one mixer per layer, chosen by `layers_block_type` — Mamba-2, NoPE GQA
attention, a relu² MLP, or a relu² MoE with a sigmoid router and optional latent projections.

    h = embeddings(ids)
    for each layer:  h = h + mixer(RMSNorm(h))          # no second sub-block inside a layer
    logits = lm_head(RMSNorm_f(h)).float()

Math and pitfalls: shared/reference/mistral4_nemotron.md, Part B. Oracle: transformers `nemotron_h`
(5.23). Released shapes: Nemotron-3 Nano 30B-A3B and Super 120B-A12B (LatentMoE, one MTP block).

Config. The layer list is `layers_block_type` (alias `layer_types`; the release names `mamba` and
`attention` are read as `linear_attention` and `full_attention`, as transformers' remap does) or the
legacy `hybrid_override_pattern` string (`M` Mamba-2, `E` MoE, `*` attention, `-` MLP). The layer
count is its length; `num_hidden_layers` is ignored. The legacy `mamba_*` aliases override the
plain names, as in transformers. MTP fields: `num_nextn_predict_layers` (N blocks) and the block's
layer list `mtp_layers_block_type` / legacy `mtp_hybrid_override_pattern` (P layers, default `*E`).

MTP. Declared optional (role "mtp", so `inspect` counts it apart from the published totals) and, when
the checkpoint has it, shape-checked and loaded into `Model.mtp`; nothing runs it yet (transformers
builds no MTP module, so there is no oracle). All of it or none: a partial block is a CheckpointError.
The checkpoint flattens the N x P layers as `mtp.layers.{k}.` with k = block * P + position, each a
Nemotron-H layer (`norm.weight`, `mixer.*` named as in the backbone, per-expert
`mixer.experts.{e}.up_proj.weight`), plus `enorm.weight`, `hnorm.weight` and `eh_proj.weight`
[d, 2d] on each block's first layer and `final_layernorm.weight` on its last. Sources for the names:
vLLM `vllm/model_executor/models/nemotron_h_mtp.py` (`NemotronHMTP.load_weights`, which keeps only
`mtp.*` after stripping a `language_model.` prefix), SGLang `python/sglang/srt/models/nemotron_h_mtp.py`,
and Megatron-Bridge `src/megatron/bridge/models/nemotronh/nemotron_h_bridge.py` (its flattened HF MTP
mapping); no released safetensors index was read from here.

dt convention. softplus(dt + dt_bias) is clamped below at `time_step_min` in prefill AND decode
(see moesaic/layers/mamba2.py). transformers clamps in its chunked prefill only, so moesaic equals
transformers everywhere except decode steps where softplus(dt + dt_bias) < time_step_min; there
moesaic's decode equals its own (and transformers') prefill. `time_step_limit` is parsed but, as in
transformers, the bounds used are (time_step_min, inf).

Names. The model's own names are transformers' in-memory ones (`model.*`, fused experts
`model.layers.L.mixer.experts.up_proj [E, I, in]`). Checkpoints — the releases and what
transformers' `save_pretrained` writes — use `backbone.*` and one tensor per expert
(`backbone.layers.L.mixer.experts.{e}.up_proj.weight [I, in]`). Both prefixes and both expert
layouts are read (chosen per checkpoint from the names it holds).

State per sequence: attention layers keep K and V rows (TokenRows, model dtype); Mamba-2 layers a
RecurrentState over the fp32 conv tail [conv_dim, K-1] and SSM state [H, P, N], with a rollback
window of per-token snapshots chosen at `new_state(rollback_window=...)`; MLP and MoE layers none.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.batch import ForwardBatch
from ..cache.state import RecurrentState, SequenceState, TokenRows
from ..config import eos_ids, field, positive
from ..errors import CheckpointError, ConfigError
from ..layers.attention import gqa_attend
from ..layers.linear import linear
from ..layers.mamba2 import Mamba2Dims, Mamba2State, Mamba2Weights, mamba2_mixer
from ..layers.moe import relu2, route_sigmoid, run_experts
from ..layers.norms import rms_norm_fp32_weight
from ..layers.recurrent import run_recurrent
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked

MODEL_TYPES = ("nemotron_h",)

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_PATTERN = {"M": MAMBA, "E": MOE, "*": ATTENTION, "-": MLP}
_LEGACY = {"mamba": MAMBA, "attention": ATTENTION}
_SCHEDULE = {MAMBA: "mamba2", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}


@dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # linear_attention | full_attention | mlp | moe, one per layer
    # attention (NoPE GQA)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    # dense relu² MLP
    intermediate_size: int
    # Mamba-2
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool  # Mamba in/out projection biases
    chunk_size: int
    time_step_min: float
    time_step_max: float
    time_step_limit: tuple[float, float]
    time_step_floor: float
    mamba_ssm_cache_dtype: str
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # the rest
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    mtp_layer_types: tuple[str, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = "nemotron_h"

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_dims(self) -> Mamba2Dims:
        return Mamba2Dims(
            hidden_size=self.hidden_size,
            num_heads=self.mamba_num_heads,
            head_dim=self.mamba_head_dim,
            n_groups=self.n_groups,
            state_size=self.ssm_state_size,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
            eps=self.layer_norm_epsilon,
            dt_min=self.time_step_min,
            dt_max=math.inf,
        )

    @property
    def expert_in(self) -> int:
        """Width the routed experts read and write: the latent size in LatentMoE, else hidden."""
        return self.moe_latent_size or self.hidden_size

    def count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)


# ---------------------------------------------------------------- config


def _layer_list(value, key: str, w: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{w}: field {key!r} must be a non-empty list of layer types, got {value!r}")
    out = []
    for i, t in enumerate(value):
        t = _LEGACY.get(t, t)
        if t not in _SCHEDULE:
            raise ConfigError(
                f"{w}: field {key!r} has unknown layer type {value[i]!r} at index {i} "
                f"(one of {', '.join(sorted(_SCHEDULE))}, or mamba/attention)"
            )
        out.append(t)
    return tuple(out)


def _pattern(value, key: str, w: str) -> tuple[str, ...]:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{w}: field {key!r} must be a non-empty string of M/E/*/-, got {value!r}")
    bad = sorted(set(value) - set(_PATTERN))
    if bad:
        raise ConfigError(
            f"{w}: field {key!r} = {value!r} has characters {bad} (only M, E, *, - are layer kinds)"
        )
    return tuple(_PATTERN[c] for c in value)


def _float_or_inf(v, key: str, w: str) -> float:
    """A float as JSON writes it, including transformers' {"__float__": "Infinity"} and the string form."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    try:
        if isinstance(v, bool):
            raise TypeError
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{w}: field {key!r} has a non-numeric bound {v!r}") from None


def _key(raw: dict, plain: str, legacy: str) -> str:
    """The key to read: transformers lets the legacy `mamba_*` name override the plain one."""
    return legacy if raw.get(legacy) is not None else plain


def parse_config(raw: dict, layout: str = "hf") -> NemotronHConfig:
    """Absent fields take transformers' `NemotronHConfig` defaults."""
    w = "config.json"
    if layout != "hf":
        raise ConfigError(f"nemotron_h checkpoints are read from config.json, not the {layout!r} layout")

    if raw.get("layers_block_type") is not None:
        layers = _layer_list(raw["layers_block_type"], "layers_block_type", w)
    elif raw.get("layer_types") is not None:
        layers = _layer_list(raw["layer_types"], "layer_types", w)
    elif raw.get("hybrid_override_pattern") is not None:
        layers = _pattern(raw["hybrid_override_pattern"], "hybrid_override_pattern", w)
    else:
        layers = (MAMBA, MOE, ATTENTION, MLP)
    mtp = (ATTENTION, MOE)
    if raw.get("mtp_layers_block_type") is not None:
        mtp = _layer_list(raw["mtp_layers_block_type"], "mtp_layers_block_type", w)
    if mtp == (ATTENTION, MOE) and raw.get("mtp_hybrid_override_pattern") is not None:
        mtp = _pattern(raw["mtp_hybrid_override_pattern"], "mtp_hybrid_override_pattern", w)

    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        got = field(raw, key, str, want, where=w)
        if got != want:
            raise ConfigError(f"{w}: field {key!r} = {got!r} is not supported (Nemotron-H uses {want})")
    if raw.get("mlp_bias"):
        raise ConfigError(
            f"{w}: field 'mlp_bias' = true is not supported (the released models have no MLP biases)"
        )

    heads = field(raw, "num_attention_heads", int, 32, where=w, check=positive)
    kv_raw = {
        "num_key_value_heads": raw.get("num_key_value_heads", 8)
    }  # transformers: absent 8, null = heads
    kv = field(
        kv_raw,
        "num_key_value_heads",
        int,
        heads,
        where=w,
        check=lambda v: v > 0 and heads % v == 0,
        why=f"must divide num_attention_heads={heads}",
    )
    head_dim = field(
        raw, "head_dim", int, field(raw, "attention_head_dim", int, 128, where=w), where=w, check=positive
    )
    m_heads = field(raw, "mamba_num_heads", int, 128, where=w, check=positive)
    n_groups = field(
        raw,
        _key(raw, "n_groups", "mamba_n_groups"),
        int,
        8,
        where=w,
        check=lambda v: v > 0 and m_heads % v == 0,
        why=f"must divide mamba_num_heads={m_heads}",
    )
    experts = field(raw, "n_routed_experts", int, 8, where=w, check=positive)
    n_group = field(
        raw,
        "n_group",
        int,
        1,
        where=w,
        check=lambda v: v > 0 and experts % v == 0,
        why=f"must divide n_routed_experts={experts}",
    )
    topk_group = field(
        raw,
        "topk_group",
        int,
        1,
        where=w,
        check=lambda v: 0 < v <= n_group,
        why=f"must be in 1..n_group={n_group}",
    )
    top_k = field(
        raw,
        "num_experts_per_tok",
        int,
        2,
        where=w,
        check=lambda v: 0 < v <= topk_group * (experts // n_group),
        why=f"must be in 1..{topk_group * (experts // n_group)} (the experts of topk_group groups)",
    )
    latent = raw.get("moe_latent_size")
    if latent is not None:
        latent = field(raw, "moe_latent_size", int, where=w, check=positive)

    lim_key = _key(raw, "time_step_limit", "mamba_dt_limit")
    lim_raw = raw.get(lim_key) if raw.get(lim_key) is not None else [0.0, math.inf]
    if not isinstance(lim_raw, (list, tuple)) or len(lim_raw) != 2:
        raise ConfigError(f"{w}: field {lim_key!r} must be a pair [low, high], got {lim_raw!r}")
    limit = (_float_or_inf(lim_raw[0], lim_key, w), _float_or_inf(lim_raw[1], lim_key, w))

    return NemotronHConfig(
        vocab_size=field(raw, "vocab_size", int, 131072, where=w, check=positive),
        hidden_size=field(raw, "hidden_size", int, 4096, where=w, check=positive),
        layer_types=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=field(raw, "max_position_embeddings", int, 4096, where=w, check=positive),
        intermediate_size=field(
            raw,
            "intermediate_size",
            int,
            21504,
            where=w,
            check=lambda v: v > 0 or MLP not in layers,
            why="an MLP layer needs it",
        ),
        mamba_num_heads=m_heads,
        mamba_head_dim=field(raw, "mamba_head_dim", int, 64, where=w, check=positive),
        n_groups=n_groups,
        ssm_state_size=field(raw, "ssm_state_size", int, 128, where=w, check=positive),
        conv_kernel=field(raw, _key(raw, "conv_kernel", "mamba_d_conv"), int, 4, where=w, check=positive),
        use_conv_bias=field(raw, _key(raw, "use_conv_bias", "mamba_conv_bias"), bool, True, where=w),
        use_bias=field(raw, "use_bias", bool, False, where=w),
        chunk_size=field(raw, _key(raw, "chunk_size", "mamba_chunk_size"), int, 128, where=w, check=positive),
        time_step_min=field(
            raw, _key(raw, "time_step_min", "mamba_dt_min"), float, 1e-3, where=w, check=lambda v: v >= 0
        ),
        time_step_max=field(raw, _key(raw, "time_step_max", "mamba_dt_max"), float, 0.1, where=w),
        time_step_limit=limit,
        time_step_floor=field(raw, _key(raw, "time_step_floor", "mamba_dt_init_floor"), float, 1e-4, where=w),
        mamba_ssm_cache_dtype=field(raw, "mamba_ssm_cache_dtype", str, "float32", where=w),
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=field(raw, "moe_intermediate_size", int, 7688, where=w, check=positive),
        moe_shared_expert_intermediate_size=field(
            raw, "moe_shared_expert_intermediate_size", int, 7688, where=w, check=positive
        ),
        moe_latent_size=latent,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=field(raw, "norm_topk_prob", bool, True, where=w),
        routed_scaling_factor=field(raw, "routed_scaling_factor", float, 1.0, where=w),
        layer_norm_epsilon=field(raw, "layer_norm_epsilon", float, 1e-5, where=w, check=positive),
        tie_word_embeddings=field(raw, "tie_word_embeddings", bool, False, where=w),
        num_nextn_predict_layers=field(
            raw, "num_nextn_predict_layers", int, 0, where=w, check=lambda v: v >= 0
        ),
        mtp_layer_types=mtp,
        bos_token_id=raw.get("bos_token_id", 1),
        eos_token_ids=eos_ids(raw.get("eos_token_id", 2)),
    )


# ---------------------------------------------------------------- tensor contract


def _layer_specs(cfg: NemotronHConfig, kind: str, p: str, L: int) -> list[TensorSpec]:
    """One layer's tensors under prefix `p`: its norm and its mixer."""
    d = cfg.hidden_size
    m = p + "mixer."
    specs = [TensorSpec(p + "norm.weight", (d,), "norm", L)]
    if kind == MAMBA:
        dims = cfg.mamba_dims
        H, HP = cfg.mamba_num_heads, dims.inner
        specs += [
            TensorSpec(m + "in_proj.weight", (dims.in_proj_dim, d), "mamba", L),
            TensorSpec(m + "conv1d.weight", (dims.conv_dim, 1, cfg.conv_kernel), "mamba", L, dense=True),
            TensorSpec(m + "dt_bias", (H,), "mamba", L),
            TensorSpec(m + "A_log", (H,), "mamba", L),
            TensorSpec(m + "D", (H,), "mamba", L),
            TensorSpec(m + "norm.weight", (HP,), "norm", L),
            TensorSpec(m + "out_proj.weight", (d, HP), "mamba", L),
        ]
        if cfg.use_conv_bias:
            specs.append(TensorSpec(m + "conv1d.bias", (dims.conv_dim,), "mamba", L))
        if cfg.use_bias:
            specs += [
                TensorSpec(m + "in_proj.bias", (dims.in_proj_dim,), "mamba", L),
                TensorSpec(m + "out_proj.bias", (d,), "mamba", L),
            ]
    elif kind == ATTENTION:
        q, k = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        specs += [
            TensorSpec(m + "q_proj.weight", (q, d), "attention", L),
            TensorSpec(m + "k_proj.weight", (k, d), "attention", L),
            TensorSpec(m + "v_proj.weight", (k, d), "attention", L),
            TensorSpec(m + "o_proj.weight", (d, q), "attention", L),
        ]
    elif kind == MLP:
        I = cfg.intermediate_size
        specs += [
            TensorSpec(m + "up_proj.weight", (I, d), "mlp", L),
            TensorSpec(m + "down_proj.weight", (d, I), "mlp", L),
        ]
    else:
        E, I, S, x = (
            cfg.n_routed_experts,
            cfg.moe_intermediate_size,
            cfg.moe_shared_expert_intermediate_size,
            cfg.expert_in,
        )
        specs += [
            TensorSpec(m + "gate.weight", (E, d), "router", L),
            TensorSpec(m + "gate.e_score_correction_bias", (E,), "router", L, keep_fp32=True),
            TensorSpec(m + "experts.up_proj", (E, I, x), "expert", L),
            TensorSpec(m + "experts.down_proj", (E, x, I), "expert", L),
            TensorSpec(m + "shared_experts.up_proj.weight", (S, d), "shared_expert", L),
            TensorSpec(m + "shared_experts.down_proj.weight", (d, S), "shared_expert", L),
        ]
        if cfg.moe_latent_size:
            specs += [
                TensorSpec(m + "fc1_latent_proj.weight", (x, d), "expert_latent_proj", L),
                TensorSpec(m + "fc2_latent_proj.weight", (d, x), "expert_latent_proj", L),
            ]
    return specs


def mtp_specs(cfg: NemotronHConfig) -> list[TensorSpec]:
    """The MTP blocks' tensors (all optional, role "mtp"), in the checkpoint's flat `mtp.layers.{k}.` names."""
    d, P, specs = cfg.hidden_size, len(cfg.mtp_layer_types), []
    for j in range(cfg.num_nextn_predict_layers):
        for i, kind in enumerate(cfg.mtp_layer_types):
            k = j * P + i
            p, L = f"mtp.layers.{k}.", cfg.num_hidden_layers + k
            layer = _layer_specs(cfg, kind, p, L)
            if (
                i == 0
            ):  # the block's input: RMSNorm'd embeddings and hidden states, concatenated and projected
                layer += [
                    TensorSpec(p + "enorm.weight", (d,), "norm", L),
                    TensorSpec(p + "hnorm.weight", (d,), "norm", L),
                    TensorSpec(p + "eh_proj.weight", (d, 2 * d), "mtp", L),
                ]
            if i == P - 1:
                layer.append(TensorSpec(p + "final_layernorm.weight", (d,), "norm", L))
            specs += [dataclasses.replace(s, role="mtp", optional=True) for s in layer]
    return specs


def tensor_specs(cfg: NemotronHConfig) -> list[TensorSpec]:
    d = cfg.hidden_size
    specs = [TensorSpec("model.embeddings.weight", (cfg.vocab_size, d), "embedding")]
    for L, kind in enumerate(cfg.layer_types):
        specs += _layer_specs(cfg, kind, f"model.layers.{L}.", L)
    specs.append(TensorSpec("model.norm_f.weight", (d,), "norm"))
    specs.append(
        TensorSpec("lm_head.weight", (cfg.vocab_size, d), "lm_head", optional=cfg.tie_word_embeddings)
    )
    return specs + mtp_specs(cfg)


def namings(cfg: NemotronHConfig, layout: str, store_names) -> Naming:
    """`backbone.*` (releases, save_pretrained) or `model.*` (transformers' state_dict), `mtp.*` in
    both; per layer, per-expert tensors when the fused one is absent."""
    names = set(store_names)
    prefix = "model." if "model.embeddings.weight" in names else "backbone."

    def source(spec: TensorSpec) -> Source:
        name = spec.name if not spec.name.startswith("model.") else prefix + spec.name[len("model.") :]
        if not name.endswith((".experts.up_proj", ".experts.down_proj")) or name in names:
            return direct(name, spec.shape)
        base, proj = name.rsplit(".", 1)  # <...>.mixer.experts, up_proj | down_proj
        return stacked([f"{base}.{e}.{proj}.weight" for e in range(spec.shape[0])], spec.shape[1:])

    return Naming(f"Nemotron-H ({prefix}*)", source)


# ---------------------------------------------------------------- model


class Model:
    """The Nemotron-H decoder over a ForwardBatch."""

    def __init__(self, cfg: NemotronHConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.dims = cfg.mamba_dims
        t = tensors
        self.embed = t["model.embeddings.weight"]
        self.norm_f = t["model.norm_f.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.layers = []
        for L, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{L}."
            w = {k[len(p) :]: v for k, v in t.items() if k.startswith(p)}
            if kind == MAMBA:
                w["mamba"] = Mamba2Weights.from_state_dict(w, "mixer.")
            self.layers.append(w)
        # the MTP layers' tensors (flat, as the checkpoint numbers them), for a drafter; empty without MTP
        mtp = mtp_specs(cfg)
        missing = [s.name for s in mtp if s.name not in t]
        if len(missing) not in (0, len(mtp)):
            raise CheckpointError(
                f"the MTP block is incomplete: {len(missing)} of its {len(mtp)} tensor(s) missing, "
                f"e.g. {missing[:3]} (ship all of it or none)"
            )
        self.mtp = []
        for k in range(0 if missing else cfg.num_nextn_predict_layers * len(cfg.mtp_layer_types)):
            p = f"mtp.layers.{k}."
            self.mtp.append({n[len(p) :]: v for n, v in t.items() if n.startswith(p)})

    # -- state
    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """`rollback_window`: how many of its last tokens a sequence can forget exactly
        (Mamba-2 layers keep one state snapshot per token of it)."""
        c = self.cfg
        kv = c.num_key_value_heads * c.head_dim
        layers = []
        for kind in c.layer_types:
            if kind == MAMBA:
                layers.append(RecurrentState(Mamba2State.zeros(self.dims, self.device), rollback_window))
            elif kind == ATTENTION:
                layers.append(
                    TokenRows({"k": kv, "v": kv}, self.dtype, self.device, c.max_position_embeddings)
                )
            else:
                layers.append(None)
        return SequenceState(layers)

    # -- mixers
    def attention(self, L: int, w: dict, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c = self.cfg
        N, D = x.shape[0], c.head_dim
        q = linear(x, w["mixer.q_proj.weight"]).view(N, c.num_attention_heads, D)
        k = linear(x, w["mixer.k_proj.weight"])
        v = linear(x, w["mixer.v_proj.weight"])
        out = x.new_empty(N, c.num_attention_heads, D)
        for s in batch.seqs:
            rows = slice(s.start, s.start + s.n)
            cache = s.state.layers[L].append(k=k[rows], v=v[rows])
            T = cache["k"].shape[0]
            out[rows] = gqa_attend(q[rows], cache["k"].view(T, -1, D), cache["v"].view(T, -1, D), D**-0.5)
        return linear(out.reshape(N, -1), w["mixer.o_proj.weight"])

    def mlp(self, w: dict, x: torch.Tensor, prefix: str = "mixer.") -> torch.Tensor:
        return linear(relu2(linear(x, w[prefix + "up_proj.weight"])), w[prefix + "down_proj.weight"])

    def moe(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        logits = F.linear(x.float(), w["mixer.gate.weight"].float())
        weights, ids = route_sigmoid(
            logits,
            c.num_experts_per_tok,
            w["mixer.gate.e_score_correction_bias"],
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        xl = linear(x, w["mixer.fc1_latent_proj.weight"]) if c.moe_latent_size else x
        y = run_experts(xl, weights, ids, w["mixer.experts.up_proj"], w["mixer.experts.down_proj"], relu2)
        if c.moe_latent_size:
            y = linear(y, w["mixer.fc2_latent_proj.weight"])
        return y + self.mlp(w, x, "mixer.shared_experts.")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        c = self.cfg
        h = F.embedding(batch.token_ids, self.embed)
        for L, (kind, w) in enumerate(zip(c.layer_types, self.layers)):
            x = rms_norm_fp32_weight(h, w["norm.weight"], c.layer_norm_epsilon)
            if kind == MAMBA:
                y = run_recurrent(mamba2_mixer, w["mamba"], self.dims, L, x, batch)
            elif kind == ATTENTION:
                y = self.attention(L, w, x, batch)
            elif kind == MLP:
                y = self.mlp(w, x)
            else:
                y = self.moe(w, x)
            h = h + y
        batch.finish()
        h = rms_norm_fp32_weight(h[batch.logit_rows], self.norm_f, c.layer_norm_epsilon)
        return linear(h, self.lm_head).float()


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: NemotronHConfig) -> list[str]:
    return [_SCHEDULE[t] for t in cfg.layer_types]


def state_bytes(cfg: NemotronHConfig, dtype_bytes: int) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence): K and V of every attention layer per token; the
    fp32 conv tail and SSM state of every Mamba-2 layer per sequence (rollback window not included:
    each token of it adds one more Mamba state per layer)."""
    per_token = cfg.count(ATTENTION) * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return per_token, cfg.count(MAMBA) * cfg.mamba_dims.state_nbytes


def max_context(cfg: NemotronHConfig) -> int:
    return cfg.max_position_embeddings


def facts(cfg: NemotronHConfig) -> dict:
    x, I = cfg.expert_in, cfg.moe_intermediate_size
    return {
        "layer_counts": {_SCHEDULE[k]: cfg.count(k) for k in (MAMBA, ATTENTION, MLP, MOE)},
        "experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "moe_latent_size": cfg.moe_latent_size,
        "expert_params": 2 * x * I,
        "expert_bytes_bf16": 2 * x * I * 2,
        "mamba_state_bytes_per_layer": cfg.mamba_dims.state_nbytes,
        "dt_clamp": f"softplus(dt) >= {cfg.time_step_min} in prefill and decode",
        "mtp_layers": cfg.num_nextn_predict_layers,
        "mtp_layer_schedule": [_SCHEDULE[t] for t in cfg.mtp_layer_types]
        if cfg.num_nextn_predict_layers
        else [],
    }


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg) -> tuple[str, ...]:
    return ()


def build(cfg, tensors, dtype, device, folder):
    return Model(cfg, tensors.all(), dtype, device)

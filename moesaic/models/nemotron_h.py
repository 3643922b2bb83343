"""Nemotron-H (`nemotron_h`): one mixer per layer, chosen by `layers_block_type` — Mamba-2, NoPE GQA
attention, a relu² MLP, or a relu² MoE with a sigmoid router and optional latent projections.

    h = embeddings(ids)
    for each layer:  h = h + mixer(RMSNorm(h))          # no second sub-block inside a layer
    logits = lm_head(RMSNorm_f(h)).float()

Layer schedule, state kinds, namings and proof: docs/families/nemotron_h.md. Oracle: transformers
`nemotron_h` (5.23, `src/transformers/models/nemotron_h/modeling_nemotron_h.py`). Released shapes:
Nemotron-3 Nano 30B-A3B and Super 120B-A12B (LatentMoE, one MTP block).

Config. The layer list is `layers_block_type` (alias `layer_types`; the release names `mamba` and
`attention` are read as `linear_attention` and `full_attention`, as transformers' remap does) or the
legacy `hybrid_override_pattern` string (`M` Mamba-2, `E` MoE, `*` attention, `-` MLP); its length is
the layer count (`num_hidden_layers` is ignored). The legacy `mamba_*` keys override the plain names,
as in transformers. MTP: `num_nextn_predict_layers` blocks (N) of the layers `mtp_layers_block_type` /
legacy `mtp_hybrid_override_pattern` (P, default `*E`).

Names. The contract uses transformers' in-memory names (`model.*`, fused experts
`model.layers.L.mixer.experts.up_proj [E, I, in]`); the releases and `save_pretrained` write
`backbone.*` with one tensor per expert (`backbone.layers.L.mixer.experts.{e}.up_proj.weight [I, in]`).
Both are read, chosen per checkpoint. MTP blocks, optional (role "mtp") but all or none, are flattened
as `mtp.layers.{k}.` (k = block * P + position), each a Nemotron-H layer, with `enorm`, `hnorm`,
`eh_proj [d, 2d]` on a block's first layer and `final_layernorm` on its last: the names vLLM
`vllm/model_executor/models/nemotron_h_mtp.py` (`NemotronHMTP.load_weights`), SGLang
`python/sglang/srt/models/nemotron_h_mtp.py` and Megatron-Bridge
`src/megatron/bridge/models/nemotronh/nemotron_h_bridge.py` load. They are bound into `Model.mtp`; spec/mtp.py
drafts with them (transformers builds no MTP module: no oracle; docs/families/nemotron_h.md).

dt convention. softplus(dt + dt_bias) is clamped below at `time_step_min` in prefill AND decode
(moesaic/layers/mamba2.py); transformers clamps in its chunked prefill only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import RecurrentState, SequenceState, TokenRows
from ..config import declared, eos_ids, field, non_negative, positive, read_config, require
from ..errors import CheckpointError, ConfigError
from ..layers.attention import gqa_batch
from ..layers.linear import embedding, linear
from ..layers.mamba2 import MAMBA2, Mamba2Dims, Mamba2State, Mamba2Weights
from ..layers.moe import Mlp, MoeSpec, MoeWeights, Router, moe, relu2
from ..layers.norms import rms_norm_fp32_weight
from ..layers.recurrent import run_recurrent
from ..weights.bind import Tensors
from ..weights.contract import Naming, Shard, Source, TensorSpec, direct, stacked
from .parts import bind_mlp, bind_moe, mlp_specs, moe_specs

MODEL_TYPES = ("nemotron_h",)

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_PATTERN = {"M": MAMBA, "E": MOE, "*": ATTENTION, "-": MLP}
_LEGACY = {"mamba": MAMBA, "attention": ATTENTION}
_SCHEDULE = {MAMBA: "mamba2", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}


@dataclass(frozen=True, kw_only=True)
class NemotronHConfig:
    """Absent fields take transformers' `NemotronHConfig` defaults. Where a field has a legacy `mamba_*`
    key, that key is declared first: it overrides the plain name, as transformers' `__post_init__` does."""

    vocab_size: int = declared(131072, check=positive)
    hidden_size: int = declared(4096, check=positive)
    layer_types: tuple[str, ...]  # linear_attention | full_attention | mlp | moe, one per layer
    # attention (NoPE GQA)
    num_attention_heads: int = declared(32, check=positive)
    num_key_value_heads: int = declared(8, check=positive)  # an explicit null: one per head
    head_dim: int = declared(128, aliases=("attention_head_dim",), check=positive)
    max_position_embeddings: int = declared(4096, check=positive)
    # dense relu² MLP
    intermediate_size: int = declared(21504)
    # Mamba-2
    mamba_num_heads: int = declared(128, check=positive)
    mamba_head_dim: int = declared(64, check=positive)
    n_groups: int = declared(8, key="mamba_n_groups", aliases=("n_groups",), check=positive)
    ssm_state_size: int = declared(128, check=positive)
    conv_kernel: int = declared(4, key="mamba_d_conv", aliases=("conv_kernel",), check=positive)
    use_conv_bias: bool = declared(True, key="mamba_conv_bias", aliases=("use_conv_bias",))
    use_bias: bool = declared(False)  # Mamba in/out projection biases
    chunk_size: int = declared(128, key="mamba_chunk_size", aliases=("chunk_size",), check=positive)
    time_step_min: float = declared(1e-3, key="mamba_dt_min", aliases=("time_step_min",), check=non_negative)
    time_step_max: float = declared(0.1, key="mamba_dt_max", aliases=("time_step_max",))
    time_step_limit: tuple[float, float]  # parsed, not used: transformers' mixer uses (time_step_min, inf)
    time_step_floor: float = declared(1e-4, key="mamba_dt_init_floor", aliases=("time_step_floor",))
    mamba_ssm_cache_dtype: str = declared("float32")
    # MoE
    n_routed_experts: int = declared(8, check=positive)
    num_experts_per_tok: int = declared(2)
    moe_intermediate_size: int = declared(7688, check=positive)
    moe_shared_expert_intermediate_size: int = declared(7688, check=positive)
    moe_latent_size: int | None = declared(None, check=positive)
    n_group: int = declared(1)
    topk_group: int = declared(1)
    norm_topk_prob: bool = declared(True)
    routed_scaling_factor: float = declared(1.0)
    # the rest
    layer_norm_epsilon: float = declared(1e-5, check=positive)
    tie_word_embeddings: bool = declared(False)
    num_nextn_predict_layers: int = declared(0, check=non_negative)
    mtp_layer_types: tuple[str, ...]  # the layers of one MTP block
    bos_token_id: int | None = declared(1)
    eos_token_ids: tuple[int, ...]
    model_type: str = "nemotron_h"

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_dims(self) -> Mamba2Dims:
        """The mixer's dims; the dt clamp is (time_step_min, inf), the bounds transformers' mixer uses."""
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
    def moe_spec(self) -> MoeSpec:
        """Sigmoid router over fp32 logits with a selection bias; ungated relu² experts and shared expert."""
        router = Router(
            "sigmoid",
            self.num_experts_per_tok,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
            fp32=True,
        )
        return MoeSpec(router, gated=False, act=relu2)

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


def _layer_types(raw: dict, w: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the decoder's layer list, one MTP block's), from the lists or the legacy pattern strings."""
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
    return layers, mtp


def _time_step_limit(raw: dict, w: str) -> tuple[float, float]:
    """The pair as JSON writes it, infinity included (transformers' {"__float__": "Infinity"}, the string
    form, or Python's json `Infinity`): the one place a config may hold a float that is not finite."""
    key = "mamba_dt_limit" if raw.get("mamba_dt_limit") is not None else "time_step_limit"
    pair = raw.get(key)
    if pair is None:
        return 0.0, math.inf
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise ConfigError(f"{w}: field {key!r} must be a pair [low, high], got {pair!r}")
    out = []
    for v in pair:
        if isinstance(v, dict) and "__float__" in v:
            v = v["__float__"]
        try:
            if isinstance(v, bool) or math.isnan(float(v)):
                raise TypeError
            out.append(float(v))
        except (TypeError, ValueError):
            raise ConfigError(f"{w}: field {key!r} has a non-numeric bound {v!r}") from None
    return out[0], out[1]


def parse_config(raw: dict, layout: str = "hf") -> NemotronHConfig:
    w = "config.json"
    if layout != "hf":
        raise ConfigError(f"nemotron_h checkpoints are read from config.json, not the {layout!r} layout")
    layers, mtp = _layer_types(raw, w)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        got = field(raw, key, str, want, where=w)
        require(got == want, w, key, got, f"Nemotron-H uses {want}")
    require(
        not raw.get("mlp_bias"), w, "mlp_bias", raw.get("mlp_bias"), "the released models have no MLP biases"
    )
    cfg = read_config(
        NemotronHConfig,
        raw,
        w,
        layer_types=layers,
        mtp_layer_types=mtp,
        time_step_limit=_time_step_limit(raw, w),
        eos_token_ids=eos_ids(raw.get("eos_token_id", 2), w),
    )
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:  # transformers: null = MHA
        cfg = dataclasses.replace(cfg, num_key_value_heads=cfg.num_attention_heads)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    require(heads % kv == 0, w, "num_key_value_heads", kv, f"must divide num_attention_heads={heads}")
    groups_key = "mamba_n_groups" if raw.get("mamba_n_groups") is not None else "n_groups"
    require(
        cfg.mamba_num_heads % cfg.n_groups == 0,
        w,
        groups_key,
        cfg.n_groups,
        f"must divide mamba_num_heads={cfg.mamba_num_heads}",
    )
    E, G, kg = cfg.n_routed_experts, cfg.n_group, cfg.topk_group
    require(G > 0 and E % G == 0, w, "n_group", G, f"must divide n_routed_experts={E}")
    require(0 < kg <= G, w, "topk_group", kg, f"must be in 1..n_group={G}")
    most = kg * (E // G)
    require(
        0 < cfg.num_experts_per_tok <= most,
        w,
        "num_experts_per_tok",
        cfg.num_experts_per_tok,
        f"must be in 1..{most} (the experts of topk_group groups)",
    )
    require(
        cfg.intermediate_size > 0 or MLP not in layers,
        w,
        "intermediate_size",
        cfg.intermediate_size,
        "an MLP layer needs it",
    )
    return cfg


# ---------------------------------------------------------------- tensor contract


def _mixer_specs(cfg: NemotronHConfig, kind: str, m: str, L: int) -> list[TensorSpec]:
    """One layer's mixer under prefix `m` (`...layers.L.mixer.`)."""
    d = cfg.hidden_size
    if kind == MAMBA:
        dims = cfg.mamba_dims
        H, HP, C = cfg.mamba_num_heads, dims.inner, dims.conv_dim
        specs = [
            TensorSpec(m + "in_proj.weight", (dims.in_proj_dim, d), "mamba", L),
            TensorSpec(m + "conv1d.weight", (C, 1, cfg.conv_kernel), "mamba", L, dense=True),
            TensorSpec(m + "dt_bias", (H,), "mamba", L),
            TensorSpec(m + "A_log", (H,), "mamba", L),
            TensorSpec(m + "D", (H,), "mamba", L),
            TensorSpec(m + "norm.weight", (HP,), "norm", L),
            TensorSpec(m + "out_proj.weight", (d, HP), "mamba", L),
        ]
        if cfg.use_conv_bias:
            specs.append(TensorSpec(m + "conv1d.bias", (C,), "mamba", L))
        if cfg.use_bias:
            specs += [
                TensorSpec(m + "in_proj.bias", (dims.in_proj_dim,), "mamba", L),
                TensorSpec(m + "out_proj.bias", (d,), "mamba", L),
            ]
        return specs
    if kind == ATTENTION:
        q, k = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return [
            TensorSpec(m + "q_proj.weight", (q, d), "attention", L),
            TensorSpec(m + "k_proj.weight", (k, d), "attention", L),
            TensorSpec(m + "v_proj.weight", (k, d), "attention", L),
            TensorSpec(m + "o_proj.weight", (d, q), "attention", L),
        ]
    if kind == MLP:
        return mlp_specs(m, cfg.intermediate_size, d, "mlp", L, gated=False)
    x = cfg.expert_in
    specs = moe_specs(
        m,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
        d,
        L,
        expert_width=x,
        shared=cfg.moe_shared_expert_intermediate_size,
        gated=False,
    )
    if cfg.moe_latent_size:
        specs += [
            TensorSpec(m + "fc1_latent_proj.weight", (x, d), "expert_latent_proj", L),
            TensorSpec(m + "fc2_latent_proj.weight", (d, x), "expert_latent_proj", L),
        ]
    return specs


def _layer_specs(cfg: NemotronHConfig, kind: str, p: str, L: int) -> list[TensorSpec]:
    """One layer's tensors under prefix `p`: its norm and its mixer."""
    return [TensorSpec(p + "norm.weight", (cfg.hidden_size,), "norm", L)] + _mixer_specs(
        cfg, kind, p + "mixer.", L
    )


def mtp_specs(cfg: NemotronHConfig) -> list[TensorSpec]:
    """The MTP blocks' tensors (all optional, role "mtp"), in the checkpoint's flat `mtp.layers.{k}.` names."""
    d, P, specs = cfg.hidden_size, len(cfg.mtp_layer_types), []
    for j in range(cfg.num_nextn_predict_layers):
        for i, kind in enumerate(cfg.mtp_layer_types):
            k = j * P + i
            p, L = f"mtp.layers.{k}.", cfg.num_hidden_layers + k
            layer = _layer_specs(cfg, kind, p, L)
            if i == 0:  # the block's input: RMSNorm'd embeddings and hidden states, concatenated, projected
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


# ---------------------------------------------------------------- bound weights


@dataclass
class Attention:
    """A NoPE GQA mixer: q_proj [Hq D, d], k_proj and v_proj [Hkv D, d], o_proj [d, Hq D]."""

    q: object
    k: object
    v: object
    o: object


@dataclass
class Layer:
    """One decoder layer: its kind, its pre-norm and its one mixer."""

    kind: str  # MAMBA | ATTENTION | MLP | MOE
    norm: torch.Tensor
    mixer: Mamba2Weights | Attention | Mlp | MoeWeights


@dataclass
class MtpBlock:
    """One MTP block, to be run as a draft head: its input (enorm over the next tokens' embeddings, hnorm
    over the hidden states, eh_proj [d, 2d] over the two concatenated), its Nemotron-H layers and
    final_layernorm. The checkpoint keeps the input on the block's first layer, the norm on its last."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: object
    layers: list[Layer]
    final_norm: torch.Tensor


def bind_mamba2(t: Tensors) -> Mamba2Weights:
    """One Mamba-2 mixer under `t`'s prefix (transformers' `NemotronHMamba2Mixer` names)."""
    return Mamba2Weights(
        in_proj=t("in_proj.weight"),
        conv_weight=t("conv1d.weight"),
        conv_bias=t.optional("conv1d.bias"),
        dt_bias=t("dt_bias"),
        A_log=t("A_log"),
        D=t("D"),
        norm_weight=t("norm.weight"),
        out_proj=t("out_proj.weight"),
        in_proj_bias=t.optional("in_proj.bias"),
        out_proj_bias=t.optional("out_proj.bias"),
    )


def bind_layer(kind: str, t: Tensors) -> Layer:
    """The layer under `t`'s prefix (`model.layers.L.` or `mtp.layers.k.`), names as `_layer_specs`."""
    m = t.under("mixer.")
    if kind == MAMBA:
        mixer = bind_mamba2(m)
    elif kind == ATTENTION:
        mixer = Attention(m("q_proj.weight"), m("k_proj.weight"), m("v_proj.weight"), m("o_proj.weight"))
    elif kind == MLP:
        mixer = bind_mlp(m)
    else:
        mixer = bind_moe(
            m, latent_in=m.optional("fc1_latent_proj.weight"), latent_out=m.optional("fc2_latent_proj.weight")
        )
    return Layer(kind, t("norm.weight"), mixer)


def bind_mtp(cfg: NemotronHConfig, t: Tensors) -> list[MtpBlock]:
    """The MTP blocks when the checkpoint has them (all their tensors: a partial block is refused),
    else []."""
    specs = mtp_specs(cfg)
    missing = [s.name for s in specs if not t.has(s.name)]
    if len(missing) == len(specs):
        return []
    if missing:
        raise CheckpointError(
            f"the MTP block is incomplete: {len(missing)} of its {len(specs)} tensor(s) missing, "
            f"e.g. {missing[:3]} (ship all of it or none)"
        )
    P, blocks = len(cfg.mtp_layer_types), []
    for j in range(cfg.num_nextn_predict_layers):
        layers = [
            bind_layer(kind, t.under(f"mtp.layers.{j * P + i}."))
            for i, kind in enumerate(cfg.mtp_layer_types)
        ]
        first, last = t.under(f"mtp.layers.{j * P}."), t.under(f"mtp.layers.{j * P + P - 1}.")
        blocks.append(
            MtpBlock(
                first("enorm.weight"),
                first("hnorm.weight"),
                first("eh_proj.weight"),
                layers,
                last("final_layernorm.weight"),
            )
        )
    return blocks


# ---------------------------------------------------------------- model


class Model:
    """The Nemotron-H decoder over a ForwardBatch."""

    def __init__(self, cfg: NemotronHConfig, t: Tensors, dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.dims = cfg.mamba_dims
        self.moe = cfg.moe_spec
        self.embed = t("model.embeddings.weight")
        self.norm_f = t("model.norm_f.weight")
        self.lm_head = t.optional("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = self.embed
        self.layers = [
            bind_layer(kind, t.under(f"model.layers.{L}.")) for L, kind in enumerate(cfg.layer_types)
        ]
        self.mtp = bind_mtp(cfg, t)  # for the MTP drafter; [] when the checkpoint has none

    # -- state
    def new_state(self, rollback_window: int = 0, kinds: tuple[str, ...] | None = None) -> SequenceState:
        """K and V rows per attention layer; a Mamba-2 state per Mamba layer, keeping one snapshot per
        token of `rollback_window` (the last tokens it can forget exactly); nothing for MLP/MoE layers.
        `kinds`: other layers than the decoder's (an MTP block's)."""
        c = self.cfg
        kv = c.num_key_value_heads * c.head_dim
        layers = []
        for kind in c.layer_types if kinds is None else kinds:
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
    def attention(self, L: int, w: Attention, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c = self.cfg
        N, D = x.shape[0], c.head_dim
        q = linear(x, w.q).view(N, c.num_attention_heads, D)
        k = linear(x, w.k).view(N, c.num_key_value_heads, D)
        v = linear(x, w.v).view(N, c.num_key_value_heads, D)
        return linear(gqa_batch(L, batch, q, k, v, D**-0.5).reshape(N, -1), w.o)

    def mixer(self, L: int, w: Layer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if w.kind == MAMBA:
            return run_recurrent(MAMBA2, w.mixer, self.dims, L, x, batch)
        if w.kind == ATTENTION:
            return self.attention(L, w.mixer, x, batch)
        if w.kind == MLP:
            return w.mixer(x, act=relu2)
        return moe(x, w.mixer, self.moe)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        eps = self.cfg.layer_norm_epsilon
        h = embedding(batch.token_ids, self.embed)
        for L, w in enumerate(self.layers):
            h = h + self.mixer(L, w, rms_norm_fp32_weight(h, w.norm, eps), batch)
            batch.tap(L, h)
        batch.finish()
        batch.tap(FINAL, h)
        h = rms_norm_fp32_weight(h[batch.logit_rows], self.norm_f, eps)
        return linear(h, self.lm_head).float()


def build(cfg: NemotronHConfig, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    return Model(cfg, tensors, dtype, device)


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg: NemotronHConfig) -> list[str]:
    return [_SCHEDULE[t] for t in cfg.layer_types]


def state_bytes(cfg: NemotronHConfig, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence): K and V of every attention layer per token (model
    dtype); per Mamba-2 layer its fp32 conv tail and SSM state, plus one more of them per token of the
    rollback window (the snapshots that make rollback exact). Token rows roll back for free."""
    per_token = cfg.count(ATTENTION) * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return per_token, cfg.count(MAMBA) * cfg.mamba_dims.state_nbytes * (1 + rollback_window)


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


def draft_heads(cfg: NemotronHConfig) -> tuple[str, ...]:
    """The config's MTP blocks serve MTP drafting (whether this checkpoint ships their tensors or not)."""
    return ("mtp",) if cfg.num_nextn_predict_layers else ()


# ---------------------------------------------------------------- tensor parallelism (moesaic/parallel/plan.py)

# The config counts each of N ranks takes 1/N of, and how its mixers' tensors split (axis 0: output rows,
# 1: input columns; experts, shared experts, embedding and lm_head follow parallel/plan.py's rules).
# GQA by heads (q and kv heads both divide); Mamba-2 by heads and groups (a rank's heads read its groups):
# in_proj's z | x | B | C | dt rows and the conv's x | B | C channels each split; the relu² MLP by width.
TP_HEADS = ("num_attention_heads", "num_key_value_heads", "mamba_num_heads", "n_groups")


def tp_plan(cfg: NemotronHConfig) -> list:
    dims = cfg.mamba_dims
    HP, GN, H = dims.inner, dims.n_groups * dims.state_size, dims.num_heads
    return [
        (r".*\.mixer\.(q_proj|k_proj|v_proj)\.weight", 0),
        (r".*\.mixer\.(o_proj|out_proj)\.weight", 1),
        (r".*\.mixer\.in_proj\.(weight|bias)", Shard(0, (HP, HP, GN, GN, H))),
        (r".*\.mixer\.conv1d\.(weight|bias)", Shard(0, (HP, GN, GN))),
        (r".*\.mixer\.(dt_bias|A_log|D|norm\.weight)", 0),
        (r".*\.mixer\.up_proj\.weight", 0),
        (r".*\.mixer\.down_proj\.weight", 1),
    ]

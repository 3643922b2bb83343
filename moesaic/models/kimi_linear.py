"""Kimi Linear 48B (`kimi_linear`): a KDA + MLA hybrid with a sigmoid-routed MoE; the Kimi K3 ancestor.

Sources: the Kimi Linear report (arXiv:2510.26692) and transformers'
`src/transformers/models/kimi_linear/modeling_kimi_linear.py` (the oracle of tests/test_kimi_linear.py).
Layer schedule, state and proof: docs/families/kimi_linear.md.

    h += mixer(RMSNorm(h))     KDA (gate -exp(A_log) softplus(z + dt_bias), low-rank output gate)
                               or MLA
    h += ffn(RMSNorm(h))       SwiGLU MLP on the dense layers; elsewhere a sigmoid router with a
                               selection-only bias, expert groups, renormalised and scaled weights,
                               SwiGLU experts, plus shared experts on the same input
    logits = lm_head(RMSNorm(h))

MLA without rotation: the per-head key is [k_nope | one shared key slice], the shared slice and
q's matching slice meet unrotated (never dropped), the scale is (nope + rope)^-0.5, and the cache
holds the normalised latent and the shared slice. `q_a_layernorm` and `kv_a_layernorm` use eps
1e-6 (transformers' class default; the config's rms_norm_eps is not passed there); every other
norm uses rms_norm_eps.

Layer kinds come from `linear_attn_config.kda_layers` / `full_attn_layers`, which are 1-BASED
(reading them 0-based shifts every mixer by one layer and still runs); an explicit `layer_types`
must agree with them; with neither, transformers' default (MLA at 0-based 4, 8, ...).

Checkpoint names are the release names, which transformers also writes on `save_pretrained`:
`block_sparse_moe.experts.E.w1|w3|w2.weight` (gate, up, down), `self_attn.q|k|v_conv1d.weight`,
`self_attn.A_log [1, 1, H, 1]`; the dense MLP sits under `mlp.` in some exports and
`block_sparse_moe.` in others (both read). The model's own names are the release names with
`mlp.` for every FFN and the experts fused (`mlp.experts.gate_up_proj [E, 2I, d]`,
`mlp.experts.down_proj [E, d, I]`).

Kimi K3 (models/kimi_k3.py) extends this module: its config class, `Layer` and `Model` subclass the
ones here, and it reuses the config reader, layer kinds, contract pieces, naming, binders and blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.batch import FINAL, ForwardBatch
from ..cache.state import RecurrentState, SequenceState, TokenRows
from ..config import (
    declared,
    eos_ids,
    field,
    int_list,
    layer_count,
    non_negative,
    positive,
    read_config,
    require,
    section,
)
from ..errors import ConfigError
from ..layers.kda import KDA, KdaDims, KdaState, KdaWeights
from ..layers.linear import embedding, linear
from ..layers.mla import MlaWeights, mla_batch, mla_block, mla_project
from ..layers.moe import Mlp, MoeSpec, MoeWeights, Router, moe, silu_glu
from ..layers.norms import pre_norm_layers, rms_norm
from ..layers.recurrent import run_recurrent
from ..weights.bind import Tensors
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs
from .parts import bind_kda, bind_mla, bind_mlp, bind_moe, kda_shapes, mla_specs, mlp_specs, moe_specs

MODEL_TYPES = ("kimi_linear",)
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the RMSNorm class default, as transformers builds them


# ---------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True)
class LinearAttnConfig:
    """`linear_attn_config`: the KDA sizes (older exports also spell them at the top level as
    linear_num_heads, linear_head_dim, linear_conv_kernel_dim) and Kimi K3's gate switches. Absent
    fields take transformers' defaults; K3's switches are off unless set."""

    num_heads: int = declared(32, aliases=("linear_num_heads",), check=positive)
    head_dim: int = declared(128, aliases=("linear_head_dim",), check=positive)
    short_conv_kernel_size: int = declared(
        4,
        aliases=("linear_conv_kernel_dim",),
        check=lambda v: v >= 2,
        why="the short convolution needs at least 2 taps",
    )
    gate_lower_bound: float | None = declared(None, check=lambda v: v < 0, why="must be negative")
    use_full_rank_gate: bool = declared(False)


_TOP_LEVEL_KDA = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")


@dataclass(frozen=True, kw_only=True)
class KimiLinearConfig:
    """Absent fields take transformers' `KimiLinearConfig` defaults (= the released 48B shape); the
    aliases are the spellings transformers accepts."""

    vocab_size: int = declared(163840, check=positive)
    hidden_size: int = declared(2304, check=positive)
    num_hidden_layers: int = declared(27, check=positive)
    num_attention_heads: int = declared(32, check=positive)
    q_lora_rank: int | None = declared(None, check=positive)  # None: a plain q_proj
    kv_lora_rank: int = declared(512, check=positive)
    qk_nope_head_dim: int = declared(128, check=positive)
    qk_rope_head_dim: int = declared(64, check=non_negative)
    v_head_dim: int = declared(128, check=positive)
    intermediate_size: int = declared(9216)  # checked against the dense layers in `read_kimi_config`
    moe_intermediate_size: int = declared(1024, check=positive)
    num_experts: int = declared(256, aliases=("num_local_experts", "n_routed_experts"), check=positive)
    num_experts_per_token: int = declared(8, aliases=("num_experts_per_tok",))
    num_shared_experts: int = declared(1, aliases=("n_shared_experts",), check=non_negative)
    n_group: int = declared(1, key="num_expert_group", aliases=("n_group",), check=positive)
    topk_group: int = declared(1)
    moe_renormalize: bool = declared(True, aliases=("norm_topk_prob",))
    routed_scaling_factor: float = declared(2.446)
    rms_norm_eps: float = declared(1e-5, check=positive)
    max_position_embeddings: int = declared(
        1048576, key="model_max_length", aliases=("max_position_embeddings",), check=positive
    )
    tie_word_embeddings: bool = declared(False)
    bos_token_id: int | None = declared(163584)
    linear_attn: LinearAttnConfig
    layer_kinds: tuple[str, ...]  # per layer: "kda" | "mla"
    mlp_kinds: tuple[str, ...]  # per layer: "dense" | "moe"
    eos_token_ids: tuple[int, ...]
    mla_use_output_gate: bool = False  # Kimi K3's gated MLA (read there; a Kimi Linear config has none)
    model_type: str = "kimi_linear"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def kda_gate(self) -> tuple[float | None, bool]:
        """(gate lower bound, full-rank output gate): Kimi Linear's unbounded law and low-rank gate
        (Kimi K3 reads both from its config)."""
        return None, False

    @property
    def kda_dims(self) -> KdaDims:
        la, (lower_bound, full_rank) = self.linear_attn, self.kda_gate
        return KdaDims(
            self.hidden_size,
            la.num_heads,
            la.head_dim,
            conv_kernel=la.short_conv_kernel_size,
            lower_bound=lower_bound,
            full_rank_gate=full_rank,
            norm_eps=self.rms_norm_eps,
        )

    @property
    def glu(self):
        """The gated activation of the experts, shared experts and dense MLPs."""
        return silu_glu

    @property
    def moe_spec(self) -> MoeSpec:
        """The sigmoid router in fp32 on the full hidden state, with its selection-only bias."""
        r = Router(
            "sigmoid",
            self.num_experts_per_token,
            self.n_group,
            self.topk_group,
            self.moe_renormalize,
            self.routed_scaling_factor,
            fp32=True,
        )
        return MoeSpec(r, glu=self.glu, eps=self.rms_norm_eps)


def handoff(raw: dict) -> str | None:
    """A `kimi_linear` config carrying Kimi K3's fields is K3's text config (K3's remote code is
    `KimiLinearForCausalLM` with these switched on): its family is `kimi_k3`."""
    k3 = ("attn_res_block_size", "routed_expert_hidden_size", "mla_use_output_gate", "latent_moe_use_norm")
    if any(raw.get(k) not in (None, False) for k in k3) or raw.get("hidden_act") == "situ":
        return "kimi_k3"
    return None


def layer_kinds(raw: dict, n: int, w: str, default_schedule: bool) -> tuple[str, ...]:
    """ "kda" / "mla" per layer from the 1-based lists (and/or `layer_types`); n is already bounded
    (`layer_count`)."""
    lac = section(raw, "linear_attn_config", w)
    lists = {
        k: int_list(lac, k, f"{w} linear_attn_config", empty=True)
        for k in ("kda_layers", "full_attn_layers")
        if lac.get(k) is not None
    }
    from_lists = None
    if lists:
        seen: dict[int, str] = {}
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            vals = lists.get(key, ())
            where = f"{w}: field 'linear_attn_config.{key}'"
            for v in vals:
                if not 1 <= v <= n:
                    raise ConfigError(f"{where} has {v}, outside 1..{n} (the lists are 1-based)")
                if v in seen:
                    raise ConfigError(f"{where}: layer {v} is listed twice (also as {seen[v]})")
                seen[v] = kind
        if len(lists) == 2 and len(seen) != n:
            missing = sorted(set(range(1, n + 1)) - set(seen))
            raise ConfigError(
                f"{w}: fields 'linear_attn_config.kda_layers' and 'full_attn_layers' leave layers "
                f"{missing[:8]} (1-based) without a mixer"
            )
        other = "mla" if "kda_layers" in lists else "kda"
        from_lists = tuple(seen.get(L + 1, other) for L in range(n))
    explicit = raw.get("layer_types")
    if explicit is not None:
        names = {"linear_attention": "kda", "full_attention": "mla"}
        if (
            not isinstance(explicit, list)
            or len(explicit) != n
            or any(not isinstance(t, str) or t not in names for t in explicit)
        ):
            raise ConfigError(
                f"{w}: field 'layer_types' must list {n} entries of {sorted(names)}, got {explicit!r}"
            )
        kinds = tuple(names[t] for t in explicit)
        if from_lists is not None and kinds != from_lists:
            raise ConfigError(
                f"{w}: field 'layer_types' disagrees with 'linear_attn_config' kda_layers/"
                f"full_attn_layers (1-based): {list(kinds)} vs {list(from_lists)}"
            )
        return kinds
    if from_lists is not None:
        return from_lists
    if not default_schedule:
        raise ConfigError(
            f"{w}: field 'linear_attn_config.kda_layers' (1-based) is missing; "
            "this model has no default layer schedule"
        )
    return tuple("mla" if L and L % 4 == 0 else "kda" for L in range(n))


def mlp_kinds(raw: dict, n: int, w: str) -> tuple[str, ...]:
    """ "dense" / "moe" per layer: `mlp_layer_types`, or the dense prefix `first_k_dense_replace`."""
    freq = field(raw, "moe_layer_freq", int, 1, where=w)
    require(freq == 1, w, "moe_layer_freq", freq, "must be 1: every layer after the dense prefix is MoE")
    explicit = raw.get("mlp_layer_types")
    if explicit is not None:
        if (
            not isinstance(explicit, list)
            or len(explicit) != n
            or any(t not in ("dense", "sparse") for t in explicit)
        ):
            raise ConfigError(
                f"{w}: field 'mlp_layer_types' must list {n} entries of 'dense'/'sparse', got {explicit!r}"
            )
        return tuple("moe" if t == "sparse" else "dense" for t in explicit)
    k = field(
        raw,
        "first_k_dense_replace",
        int,
        1,
        where=w,
        check=lambda v: 0 <= v <= n,
        why=f"must be within 0..num_hidden_layers={n}",
    )
    return tuple("dense" if L < k else "moe" for L in range(n))


def read_kimi_config(
    cls, raw: dict, w: str, defaults: dict, kda_defaults: dict, default_schedule: bool, **given
):
    """A config of class `cls` (KimiLinearConfig or Kimi K3's subclass): the declared fields (with a
    family's `defaults`), the `linear_attn_config` section, the layer kinds and the cross-field checks
    the two families share; `given` holds the fields the family computes itself."""
    require(
        not raw.get("attention_bias"),
        w,
        "attention_bias",
        raw.get("attention_bias"),
        "not supported: the released models have no biases",
    )
    n = layer_count(
        raw, "num_hidden_layers", defaults.get("num_hidden_layers", cls.num_hidden_layers), where=w
    )
    lac = section(raw, "linear_attn_config", w)
    top = {k: raw[k] for k in _TOP_LEVEL_KDA if k in raw}
    linear_attn = read_config(LinearAttnConfig, {**top, **lac}, f"{w} linear_attn_config", kda_defaults)
    cfg = read_config(
        cls,
        raw,
        w,
        defaults,
        linear_attn=linear_attn,
        layer_kinds=layer_kinds(raw, n, w, default_schedule),
        mlp_kinds=mlp_kinds(raw, n, w),
        eos_token_ids=eos_ids(raw.get("eos_token_id", 163586), w),
        **given,
    )
    H, E, G = cfg.num_attention_heads, cfg.num_experts, cfg.n_group
    kv_heads = raw.get("num_key_value_heads")
    require(
        kv_heads is None or kv_heads == H,
        w,
        "num_key_value_heads",
        kv_heads,
        f"must equal num_attention_heads = {H}: MLA expands per-head keys from the latent",
    )
    require(E % G == 0, w, "num_expert_group", G, f"must divide num_experts = {E}")
    k = cfg.num_experts_per_token
    require(0 < k <= E, w, "num_experts_per_token", k, f"must be in 1..num_experts={E}")
    require(0 < cfg.topk_group <= G, w, "topk_group", cfg.topk_group, f"must be in 1..num_expert_group={G}")
    require(
        cfg.intermediate_size > 0 or "dense" not in cfg.mlp_kinds,
        w,
        "intermediate_size",
        cfg.intermediate_size,
        "the dense layers need it",
    )
    return cfg


def parse_config(raw: dict, layout: str = "hf") -> KimiLinearConfig:
    w = "config.json"
    act = field(raw, "hidden_act", str, "silu", where=w)
    require(
        act in ("silu", "swish"),
        w,
        "hidden_act",
        act,
        "Kimi Linear uses silu, which also activates the KDA short convolution",
    )
    return read_kimi_config(KimiLinearConfig, raw, w, {}, {}, default_schedule=True)


# ---------------------------------------------------------------- tensor contract


def kda_specs(p: str, dims: KdaDims, L: int, a_log_shape) -> list[TensorSpec]:
    """One KDA layer under `p + "self_attn."`: the release names of `parts.kda_shapes`."""
    return [
        TensorSpec(
            p + "self_attn." + name,
            shape,
            "norm" if name == "o_norm.weight" else "attention",
            L,
            keep_fp32=name in ("A_log", "dt_bias"),
            dense="conv1d" in name,  # conv taps, never a matmul
        )
        for name, shape in kda_shapes(dims, a_log_shape).items()
    ]


def norm_specs(p: str, d: int, L: int) -> list[TensorSpec]:
    """The two pre-norms of decoder layer L under `p` (= "model.layers.L.")."""
    return [
        TensorSpec(p + "input_layernorm.weight", (d,), "norm", L),
        TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", L),
    ]


def mixer_specs(c, p: str, L: int, a_log_shape) -> list[TensorSpec]:
    """Layer L's KDA (A_log stored as `a_log_shape`) or MLA (+ Kimi K3's output gate g_proj)."""
    if c.layer_kinds[L] == "kda":
        return kda_specs(p, c.kda_dims, L, a_log_shape)
    specs = mla_specs(p + "self_attn.", c, L)
    if c.mla_use_output_gate:
        H, dv = c.num_attention_heads, c.v_head_dim
        specs.append(TensorSpec(p + "self_attn.g_proj.weight", (H * dv, c.hidden_size), "attention", L))
    return specs


def tensor_specs(cfg: KimiLinearConfig) -> list[TensorSpec]:
    c, d = cfg, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, d), "embedding")]
    for L in range(c.num_hidden_layers):
        p, I = f"model.layers.{L}.", c.moe_intermediate_size
        specs += norm_specs(p, d, L) + mixer_specs(c, p, L, (1, 1, c.linear_attn.num_heads, 1))
        m = p + "mlp."
        if c.mlp_kinds[L] == "dense":
            specs += mlp_specs(m, c.intermediate_size, d, "mlp", L)
        else:
            specs += moe_specs(m, c.num_experts, I, d, L, router_fp32=True, shared=I * c.num_shared_experts)
    specs.append(TensorSpec("model.norm.weight", (d,), "norm"))
    specs.append(TensorSpec("lm_head.weight", (c.vocab_size, d), "lm_head", optional=c.tie_word_embeddings))
    return specs


def release_naming(label: str, store_names, prefix: str = "", ignore=(), override=None) -> Naming:
    """The release names (under `prefix`). Where releases differ in spelling, the one present in
    the checkpoint wins: `mlp.` / `block_sparse_moe.` for the FFN, `model.layers.` / `layers.`
    (vLLM's re-export). `override(spec, where)` may return a Source for a family's special tensors."""
    names = set(store_names)

    def where(name: str, moe: bool = False) -> str:
        cands = [name]
        if ".mlp." in name:
            block = name.replace(".mlp.", ".block_sparse_moe.")
            cands = [block, name] if moe else [name, block]
        cands += [c[len("model.") :] for c in cands if c.startswith("model.layers.")]
        full = [prefix + c for c in cands]
        return next((f for f in full if f in names), full[0])

    def source(spec: TensorSpec) -> Source:
        if override is not None and (src := override(spec, where)) is not None:
            return src
        moe = spec.role in ("router", "expert", "shared_expert", "latent_moe")
        if spec.name.endswith("experts.gate_up_proj"):
            base = spec.name[: -len("gate_up_proj")]
            E, half = spec.shape[0], (spec.shape[1] // 2, spec.shape[2])
            return stacked_pairs(
                [where(f"{base}{e}.w1.weight", True) for e in range(E)],
                [where(f"{base}{e}.w3.weight", True) for e in range(E)],
                half,
            )
        if spec.name.endswith("experts.down_proj"):
            base = spec.name[: -len("down_proj")]
            return stacked(
                [where(f"{base}{e}.w2.weight", True) for e in range(spec.shape[0])], spec.shape[1:]
            )
        return direct(where(spec.name, moe), spec.shape)

    return Naming(label, source, list(ignore))


def namings(cfg: KimiLinearConfig, layout: str, store_names) -> Naming:
    return release_naming("Kimi Linear release / transformers", store_names)


# ---------------------------------------------------------------- model


@dataclass
class Layer:
    attn_norm: torch.Tensor
    attn: KdaWeights | MlaWeights
    mlp_norm: torch.Tensor
    mlp: Mlp | MoeWeights


def bind_layer(w: Tensors, c, L: int, **latent) -> Layer:
    """Layer L under `w` (= "model.layers.L."); `latent`: Kimi K3's latent projections of its MoE."""
    a, m = w.under("self_attn."), w.under("mlp.")
    return Layer(
        w("input_layernorm.weight"),
        bind_kda(a, c.kda_dims) if c.layer_kinds[L] == "kda" else bind_mla(a),
        w("post_attention_layernorm.weight"),
        bind_mlp(m) if c.mlp_kinds[L] == "dense" else bind_moe(m, **latent),
    )


class Model:
    """The Kimi Linear decoder over a ForwardBatch (Kimi K3's Model extends it)."""

    def __init__(self, cfg: KimiLinearConfig, t: Tensors, dtype: torch.dtype, device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.embed = t("model.embed_tokens.weight")
        self.norm = t("model.norm.weight")
        lm_head = t.optional("lm_head.weight")
        self.lm_head = self.embed if lm_head is None else lm_head
        self.moe = cfg.moe_spec
        self.kda_dims = cfg.kda_dims  # a property that builds its dataclass: once, not once a layer a step
        self.layers = [self.bind(t.under(f"model.layers.{L}."), L) for L in range(cfg.num_hidden_layers)]

    def bind(self, w: Tensors, L: int) -> Layer:
        """Layer L from its tensors `w` (= "model.layers.L.")."""
        return bind_layer(w, self.cfg, L)

    def new_state(self, rollback_window: int = 0) -> SequenceState:
        """Per layer: the MLA latent rows (exact rollback at any depth), or the KDA recurrent state +
        conv tail keeping the states after each of the last `rollback_window` tokens (exact
        `rollback(n)` for n <= window)."""
        c, layers = self.cfg, []
        for kind in c.layer_kinds:
            if kind == "kda":
                layers.append(
                    RecurrentState(KdaState.zeros(self.kda_dims, device=self.device), rollback_window)
                )
            else:
                widths = {"latent": c.kv_lora_rank, "k_rope": c.qk_rope_head_dim}
                layers.append(TokenRows(widths, self.dtype, self.device, c.max_position_embeddings))
        return SequenceState(layers)

    # -- blocks
    def mixer(self, L: int, w: Layer, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """KDA, or MLA without rotation (with Kimi K3's output gate where bound: o_proj(o * sigmoid(g_proj
        x))). Appends each sequence's new tokens to its layer-L state."""
        c, a = self.cfg, w.attn
        if isinstance(a, KdaWeights):
            return run_recurrent(KDA, a, self.kda_dims, L, x, batch)
        if a.gate is None and (y := mla_block(L, batch, x, a, c, None, MLA_NORM_EPS)) is not None:
            return y
        q_nope, q_shared, latent, k_shared = mla_project(x, a, c, MLA_NORM_EPS)
        o = mla_batch(L, batch, q_nope, q_shared, latent, k_shared, a.kv_b, c.v_head_dim, c.softmax_scale)
        o = o.flatten(1)
        if a.gate is not None:
            o = (o.float() * torch.sigmoid(linear(x, a.gate).float())).to(o.dtype)
        return linear(o, a.o)

    def ffn(self, w: Layer, x: torch.Tensor) -> torch.Tensor:
        return moe(x, w.mlp, self.moe) if isinstance(w.mlp, MoeWeights) else w.mlp(x, self.moe.glu)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        eps = self.cfg.rms_norm_eps
        h = embedding(batch.token_ids, self.embed)
        layers = [
            [
                (w.attn_norm, lambda x, L=L, w=w: self.mixer(L, w, x, batch)),
                (w.mlp_norm, lambda x, w=w: self.ffn(w, x)),
            ]
            for L, w in enumerate(self.layers)
        ]
        h = pre_norm_layers(h, layers, eps, batch.tap)
        batch.finish()
        batch.tap(FINAL, h)
        h = rms_norm(h[batch.logit_rows], self.norm, eps)
        return linear(h, self.lm_head).float()


def build(cfg: KimiLinearConfig, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    return Model(cfg, tensors, dtype, device)


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg) -> list[str]:
    return [f"{k}+{'moe' if m == 'moe' else 'mlp'}" for k, m in zip(cfg.layer_kinds, cfg.mlp_kinds)]


def state_bytes(cfg, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence): the MLA latent + shared key slice per MLA layer
    in the model dtype (rows roll back for free); per KDA layer one fp32 recurrent state + conv tail,
    times (1 + window) for the states a rollback window keeps."""
    mla = cfg.layer_kinds.count("mla")
    kda = cfg.layer_kinds.count("kda")
    per_token = mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return per_token, kda * KdaState.nbytes_for(cfg.kda_dims) * (1 + rollback_window)


def max_context(cfg) -> int:
    return cfg.max_position_embeddings


def facts(cfg) -> dict:
    d, I = cfg.hidden_size, cfg.moe_intermediate_size
    return {
        "kda_layers": [L for L, k in enumerate(cfg.layer_kinds) if k == "kda"],
        "mla_layers": [L for L, k in enumerate(cfg.layer_kinds) if k == "mla"],
        "kda_state_bytes_per_layer": KdaState.nbytes_for(cfg.kda_dims),
        "experts": cfg.num_experts,
        "experts_per_token": cfg.num_experts_per_token,
        "expert_params": 3 * d * I,
        "expert_bytes_bf16": 3 * d * I * 2,
    }


def draft_heads(cfg) -> tuple[str, ...]:
    """Kimi Linear has no draft head."""
    return ()


# ---------------------------------------------------------------- tensor parallelism (moesaic/parallel/plan.py)

# The config counts each of N ranks takes 1/N of, and how its mixers' tensors split (axis 0: output rows,
# 1: input columns; experts, MLPs, embedding and lm_head follow parallel/plan.py's rules). MLA by heads
# (the latent replicated); KDA by heads: q/k/v and their conv channels, the gate's per-channel f_b, dt_bias,
# A_log, beta and the output gate's g_b; its low-rank down-projections (f_a, g_a) and o_norm replicated.
TP_HEADS = ("num_attention_heads", "linear_attn.num_heads")


def tp_plan(cfg) -> list:
    return [
        (r".*\.self_attn\.(q_proj|q_b_proj|kv_b_proj|k_proj|v_proj|g_proj|g_b_proj)\.weight", 0),
        (r".*\.self_attn\.(q_conv1d|k_conv1d|v_conv1d|f_b_proj|b_proj)\.weight", 0),
        (r".*\.self_attn\.dt_bias", 0),
        (r".*\.self_attn\.A_log", 2),  # stored [1, 1, H, 1]
        (r".*\.self_attn\.o_proj\.weight", 1),
    ]

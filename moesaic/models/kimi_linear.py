"""Kimi Linear 48B (`kimi_linear`): a KDA + MLA hybrid with a sigmoid-routed MoE; the Kimi K3 ancestor.

Math and pitfalls: shared/reference/kimi_k3.md section 8 (3.2 and 3.3 for the shared blocks).
Oracle: transformers `kimi_linear`.

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

K3's config class extends `KimiLinearConfig`; the other pieces K3 shares with this family (config
fields, layer kinds, MLA block, router, states, names) are module-level functions here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.batch import ForwardBatch
from ..cache.state import RecurrentState, SequenceState, TokenRows
from ..config import eos_ids, field, positive
from ..errors import ConfigError
from ..layers.kda import KdaDims, KdaState, KdaWeights, kda_mixer
from ..layers.linear import linear
from ..layers.mla import mla_batch, mla_project
from ..layers.moe import glu_mlp, route_sigmoid, run_experts, swiglu
from ..layers.norms import rms_norm
from ..layers.recurrent import run_recurrent
from ..weights.bind import Tensors
from ..weights.contract import Naming, Source, TensorSpec, direct, stacked, stacked_pairs
from .parts import bind_kda, bind_mla, kda_shapes, mla_specs

MODEL_TYPES = ("kimi_linear",)
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: the RMSNorm class default, as transformers builds them

# transformers' KimiLinearConfig defaults (= the released 48B shape)
DEFAULTS = dict(
    vocab_size=163840,
    hidden_size=2304,
    num_hidden_layers=27,
    num_attention_heads=32,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=9216,
    moe_intermediate_size=1024,
    num_experts=256,
    num_experts_per_token=8,
    num_shared_experts=1,
    n_group=1,
    topk_group=1,
    moe_renormalize=True,
    routed_scaling_factor=2.446,
    rms_norm_eps=1e-5,
    max_position_embeddings=1048576,
    tie_word_embeddings=False,
    bos_token_id=163584,
    eos_token_id=163586,
    kda_num_heads=32,
    kda_head_dim=128,
    conv_kernel=4,
    first_k_dense_replace=1,
)

# config.json spellings: the first is the name transformers writes, the others its aliases
ALIASES = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
    "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "n_group": ("num_expert_group", "n_group"),
    "moe_renormalize": ("moe_renormalize", "norm_topk_prob"),
    "max_position_embeddings": ("model_max_length", "max_position_embeddings"),
}


@dataclass(frozen=True)
class KimiLinearConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: tuple[str, ...]  # per layer: "kda" | "mla"
    mlp_kinds: tuple[str, ...]  # per layer: "dense" | "moe"
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = "kimi_linear"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def kda_dims(self) -> KdaDims:
        return KdaDims.for_variant(
            "kimi_linear",
            self.hidden_size,
            self.kda_num_heads,
            self.kda_head_dim,
            conv_kernel=self.conv_kernel,
            norm_eps=self.rms_norm_eps,
        )


# ---------------------------------------------------------------- config


def handoff(raw: dict) -> str | None:
    """A `kimi_linear` config carrying Kimi K3's fields is K3's text config (K3's remote code is
    `KimiLinearForCausalLM` with these switched on): its family is `kimi_k3`."""
    k3 = ("attn_res_block_size", "routed_expert_hidden_size", "mla_use_output_gate", "latent_moe_use_norm")
    if any(raw.get(k) not in (None, False) for k in k3) or raw.get("hidden_act") == "situ":
        return "kimi_k3"
    return None


def _get(raw: dict, key: str, kind, default, w: str, **kw):
    names = ALIASES.get(key, (key,))
    present = [n for n in names if raw.get(n) is not None]
    return field(raw, present[0] if present else names[0], kind, default, where=w, **kw)


def layer_kinds(raw: dict, n: int, w: str, default_schedule: bool) -> tuple[str, ...]:
    """ "kda" / "mla" per layer from the 1-based lists (and/or `layer_types`)."""
    lac = raw.get("linear_attn_config") or {}
    lists = {k: lac.get(k) for k in ("kda_layers", "full_attn_layers") if lac.get(k) is not None}
    from_lists = None
    if lists:
        seen: dict[int, str] = {}
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            vals = lists.get(key, [])
            where = f"{w}: field 'linear_attn_config.{key}'"
            if not isinstance(vals, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in vals
            ):
                raise ConfigError(f"{where} must be a list of layer numbers, got {vals!r}")
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
        if not isinstance(explicit, list) or len(explicit) != n or any(t not in names for t in explicit):
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


def mlp_kinds(raw: dict, n: int, w: str, first_dense_default: int) -> tuple[str, ...]:
    if _get(raw, "moe_layer_freq", int, 1, w) != 1:
        raise ConfigError(
            f"{w}: field 'moe_layer_freq' must be 1 (every layer after the dense prefix is MoE)"
        )
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
        first_dense_default,
        where=w,
        check=lambda v: 0 <= v <= n,
        why=f"must be within 0..num_hidden_layers={n}",
    )
    return tuple("dense" if L < k else "moe" for L in range(n))


def parse_common(raw: dict, w: str, defaults: dict, default_schedule: bool) -> dict:
    """The fields Kimi Linear and Kimi K3 share, as keyword arguments of their config classes."""
    d = defaults
    if raw.get("attention_bias"):
        raise ConfigError(
            f"{w}: field 'attention_bias' = true is not supported (the released models have no biases)"
        )
    n = _get(raw, "num_hidden_layers", int, d["num_hidden_layers"], w, check=positive)
    heads = _get(raw, "num_attention_heads", int, d["num_attention_heads"], w, check=positive)
    kv_heads = raw.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(
            f"{w}: field 'num_key_value_heads' = {kv_heads!r} must equal num_attention_heads = {heads} "
            "(MLA expands per-head keys from the latent)"
        )
    experts = _get(raw, "num_experts", int, d["num_experts"], w, check=positive)
    n_group = _get(raw, "n_group", int, d["n_group"], w, check=positive)
    if experts % n_group:
        raise ConfigError(f"{w}: field 'num_expert_group' = {n_group} must divide num_experts = {experts}")
    lac = raw.get("linear_attn_config") or {}
    lw = f"{w} linear_attn_config"
    q_lora = raw.get("q_lora_rank", d["q_lora_rank"])
    kinds = mlp_kinds(raw, n, w, d["first_k_dense_replace"])
    out = dict(
        vocab_size=_get(raw, "vocab_size", int, d["vocab_size"], w, check=positive),
        hidden_size=_get(raw, "hidden_size", int, d["hidden_size"], w, check=positive),
        num_hidden_layers=n,
        layer_kinds=layer_kinds(raw, n, w, default_schedule),
        mlp_kinds=kinds,
        num_attention_heads=heads,
        q_lora_rank=None
        if q_lora is None
        else field({"q_lora_rank": q_lora}, "q_lora_rank", int, where=w, check=positive),
        kv_lora_rank=_get(raw, "kv_lora_rank", int, d["kv_lora_rank"], w, check=positive),
        qk_nope_head_dim=_get(raw, "qk_nope_head_dim", int, d["qk_nope_head_dim"], w, check=positive),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim", int, d["qk_rope_head_dim"], w, check=lambda v: v >= 0),
        v_head_dim=_get(raw, "v_head_dim", int, d["v_head_dim"], w, check=positive),
        kda_num_heads=field(
            lac,
            "num_heads",
            int,
            _get(raw, "linear_num_heads", int, d["kda_num_heads"], w),
            where=lw,
            check=positive,
        ),
        kda_head_dim=field(
            lac,
            "head_dim",
            int,
            _get(raw, "linear_head_dim", int, d["kda_head_dim"], w),
            where=lw,
            check=positive,
        ),
        conv_kernel=field(
            lac,
            "short_conv_kernel_size",
            int,
            _get(raw, "linear_conv_kernel_dim", int, d["conv_kernel"], w),
            where=lw,
            check=lambda v: v >= 2,
            why="the short convolution needs at least 2 taps",
        ),
        intermediate_size=_get(
            raw,
            "intermediate_size",
            int,
            d["intermediate_size"],
            w,
            check=lambda v: v > 0 or "dense" not in kinds,
            why="the dense layers need it",
        ),
        moe_intermediate_size=_get(
            raw, "moe_intermediate_size", int, d["moe_intermediate_size"], w, check=positive
        ),
        num_experts=experts,
        num_experts_per_token=_get(
            raw,
            "num_experts_per_token",
            int,
            d["num_experts_per_token"],
            w,
            check=lambda v: 0 < v <= experts,
            why=f"must be in 1..num_experts={experts}",
        ),
        num_shared_experts=_get(
            raw, "num_shared_experts", int, d["num_shared_experts"], w, check=lambda v: v >= 0
        ),
        n_group=n_group,
        topk_group=_get(
            raw,
            "topk_group",
            int,
            d["topk_group"],
            w,
            check=lambda v: 0 < v <= n_group,
            why=f"must be in 1..num_expert_group={n_group}",
        ),
        moe_renormalize=_get(raw, "moe_renormalize", bool, d["moe_renormalize"], w),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, d["routed_scaling_factor"], w),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, d["rms_norm_eps"], w, check=positive),
        max_position_embeddings=_get(
            raw, "max_position_embeddings", int, d["max_position_embeddings"], w, check=positive
        ),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, d["tie_word_embeddings"], w),
        bos_token_id=raw.get("bos_token_id", d["bos_token_id"]),
        eos_token_ids=eos_ids(raw.get("eos_token_id", d["eos_token_id"])),
    )
    return out


def parse_config(raw: dict, layout: str = "hf") -> KimiLinearConfig:
    """Absent fields take transformers' `KimiLinearConfig` defaults (= the released 48B shape)."""
    w = "config.json"
    act = field(raw, "hidden_act", str, "silu", where=w)
    if act not in ("silu", "swish"):
        raise ConfigError(
            f"{w}: field 'hidden_act' has unsupported value {act!r} (Kimi Linear uses silu, "
            "which also activates the KDA short convolution)"
        )
    return KimiLinearConfig(**parse_common(raw, w, DEFAULTS, default_schedule=True))


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
            dense="conv1d" in name,
        )  # conv taps, never a matmul
        for name, shape in kda_shapes(dims, a_log_shape).items()
    ]


def glu_specs(m: str, inner: int, d: int, role: str, L: int) -> list[TensorSpec]:
    return [
        TensorSpec(m + "gate_proj.weight", (inner, d), role, L),
        TensorSpec(m + "up_proj.weight", (inner, d), role, L),
        TensorSpec(m + "down_proj.weight", (d, inner), role, L),
    ]


def router_specs(m: str, c, L: int) -> list[TensorSpec]:
    E, d = c.num_experts, c.hidden_size
    return [
        TensorSpec(m + "gate.weight", (E, d), "router", L, keep_fp32=True),
        TensorSpec(m + "gate.e_score_correction_bias", (E,), "router", L, keep_fp32=True),
    ]


def tensor_specs(cfg: KimiLinearConfig) -> list[TensorSpec]:
    c, d = cfg, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, d), "embedding")]
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (d,), "norm", L),
            TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", L),
        ]
        if c.layer_kinds[L] == "kda":
            specs += kda_specs(p, c.kda_dims, L, (1, 1, c.kda_num_heads, 1))
        else:
            specs += mla_specs(p + "self_attn.", c, L)
        m = p + "mlp."
        if c.mlp_kinds[L] == "dense":
            specs += glu_specs(m, c.intermediate_size, d, "mlp", L)
            continue
        E, I = c.num_experts, c.moe_intermediate_size
        specs += router_specs(m, c, L)
        specs += [
            TensorSpec(m + "experts.gate_up_proj", (E, 2 * I, d), "expert", L),
            TensorSpec(m + "experts.down_proj", (E, d, I), "expert", L),
        ]
        if c.num_shared_experts:
            specs += glu_specs(m + "shared_experts.", I * c.num_shared_experts, d, "shared_expert", L)
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


# ---------------------------------------------------------------- blocks shared with Kimi K3


def new_state(cfg, dtype: torch.dtype, device, rollback_window: int = 0) -> SequenceState:
    """Per layer: the MLA latent rows, or the KDA recurrent state + conv tail keeping the states
    after each of the last `rollback_window` tokens (exact `rollback(n)` for n <= window)."""
    layers = []
    for kind in cfg.layer_kinds:
        if kind == "kda":
            layers.append(RecurrentState(KdaState.zeros(cfg.kda_dims, device=device), rollback_window))
        else:
            layers.append(
                TokenRows(
                    {"latent": cfg.kv_lora_rank, "k_rope": cfg.qk_rope_head_dim},
                    dtype,
                    device,
                    cfg.max_position_embeddings,
                )
            )
    return SequenceState(layers)


def mla_heads(L: int, c, w: dict, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """MLA without rotation up to (not including) o_proj: [N, H * v_head_dim]. Appends each
    sequence's latent and shared key slice to its cache."""
    q_nope, q_shared, latent, k_shared = mla_project(
        x, bind_mla(Tensors(w).under("self_attn.")), c, MLA_NORM_EPS
    )  # TODO(#11): bind at build
    out = mla_batch(
        L,
        batch,
        q_nope,
        q_shared,
        latent,
        k_shared,
        w["self_attn.kv_b_proj.weight"],
        c.v_head_dim,
        c.softmax_scale,
    )
    return out.flatten(1)


def route(c, w: dict, x: torch.Tensor):
    """Sigmoid router on the full hidden state, in fp32: (weights [N, k] fp32, expert ids)."""
    logits = F.linear(x.float(), w["mlp.gate.weight"].float())
    return route_sigmoid(
        logits,
        c.num_experts_per_token,
        w["mlp.gate.e_score_correction_bias"],
        c.n_group,
        c.topk_group,
        c.moe_renormalize,
        c.routed_scaling_factor,
    )


def layer_tensors(tensors: dict, L: int) -> dict:
    p = f"model.layers.{L}."
    return {k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)}


def kda_weights(w: dict, dims: KdaDims) -> KdaWeights:
    return bind_kda(Tensors(w).under("self_attn."), dims)  # TODO(#11): bind at build


# ---------------------------------------------------------------- model


class Model:
    """The Kimi Linear decoder over a ForwardBatch."""

    def __init__(self, cfg: KimiLinearConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.embed = tensors["model.embed_tokens.weight"]
        self.norm = tensors["model.norm.weight"]
        self.lm_head = tensors.get("lm_head.weight", self.embed)
        self.layers = [layer_tensors(tensors, L) for L in range(cfg.num_hidden_layers)]
        self.kda = {
            L: kda_weights(w, cfg.kda_dims) for L, w in enumerate(self.layers) if cfg.layer_kinds[L] == "kda"
        }

    def new_state(self, rollback_window: int = 0) -> SequenceState:
        return new_state(self.cfg, self.dtype, self.device, rollback_window)

    def mixer(self, L: int, w: dict, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.cfg.layer_kinds[L] == "kda":
            return run_recurrent(kda_mixer, self.kda[L], self.cfg.kda_dims, L, x, batch)
        return linear(mla_heads(L, self.cfg, w, x, batch), w["self_attn.o_proj.weight"])

    def ffn(self, L: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.mlp_kinds[L] == "dense":
            return glu_mlp(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
        weights, ids = route(c, w, x)
        out = run_experts(x, weights, ids, w["mlp.experts.gate_up_proj"], w["mlp.experts.down_proj"], swiglu)
        if c.num_shared_experts:
            s = "mlp.shared_experts."
            out = out + glu_mlp(
                x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"]
            )
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state."""
        eps = self.cfg.rms_norm_eps
        h = F.embedding(batch.token_ids, self.embed)
        for L, w in enumerate(self.layers):
            h = h + self.mixer(L, w, rms_norm(h, w["input_layernorm.weight"], eps), batch)
            h = h + self.ffn(L, w, rms_norm(h, w["post_attention_layernorm.weight"], eps))
        batch.finish()
        h = rms_norm(h[batch.logit_rows], self.norm, eps)
        return linear(h, self.lm_head).float()


# ---------------------------------------------------------------- facts for inspect and the planner


def layer_schedule(cfg) -> list[str]:
    return [f"{k}+{'moe' if m == 'moe' else 'mlp'}" for k, m in zip(cfg.layer_kinds, cfg.mlp_kinds)]


def state_bytes(cfg, dtype_bytes: int, rollback_window: int = 0) -> tuple[int, int]:
    """(bytes per token, fixed bytes per sequence): the MLA latent + shared key slice per MLA layer
    in the model dtype; per KDA layer one fp32 recurrent state + conv tail, times (1 + window)
    while snapshots for rollback are kept."""
    mla = cfg.layer_kinds.count("mla")
    kda = cfg.layer_kinds.count("kda")
    per_token = mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return per_token, kda * KdaState.nbytes_for(cfg.kda_dims) * (1 + rollback_window)


def max_context(cfg) -> int:
    return cfg.max_position_embeddings


def facts(cfg: KimiLinearConfig) -> dict:
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
    return ()


def build(cfg, tensors, dtype, device, folder):
    return Model(cfg, tensors.all(), dtype, device)

"""Contract pieces several families share, each beside its binder: the tensors a block needs (in
transformers' names under a prefix) and how they are bound into the block's weight structure. The
names are written once here; `Tensors.check_all_taken` catches a contract and a binder that disagree.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..layers.kda import KdaDims, KdaWeights, stack_inputs
from ..layers.mla import MlaWeights
from ..layers.moe import Mlp, MoeWeights
from ..weights.bind import Tensors
from ..weights.contract import TensorSpec

# ---------------------------------------------------------------- MLA (DeepSeek-V2 names)


def mla_specs(a: str, c, L: int, optional: bool = False) -> list[TensorSpec]:
    """One MLA module under prefix `a` (e.g. "model.layers.3.self_attn."), for a config with the
    DeepSeek-V2 MLA fields (q_lora_rank None: a plain q_proj)."""
    d, H = c.hidden_size, c.num_attention_heads
    o = {"layer": L, "optional": optional}
    specs = [
        TensorSpec(
            a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, d), "attention", **o
        ),
        TensorSpec(a + "kv_a_layernorm.weight", (c.kv_lora_rank,), "norm", **o),
        # split into W_uk / W_uv views for absorbed attention
        TensorSpec(
            a + "kv_b_proj.weight",
            (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "attention",
            dense=True,
            **o,
        ),
        TensorSpec(a + "o_proj.weight", (d, H * c.v_head_dim), "attention", **o),
    ]
    if c.q_lora_rank is None:
        specs.append(TensorSpec(a + "q_proj.weight", (H * c.qk_head_dim, d), "attention", **o))
    else:
        specs += [
            TensorSpec(a + "q_a_proj.weight", (c.q_lora_rank, d), "attention", **o),
            TensorSpec(a + "q_a_layernorm.weight", (c.q_lora_rank,), "norm", **o),
            TensorSpec(a + "q_b_proj.weight", (H * c.qk_head_dim, c.q_lora_rank), "attention", **o),
        ]
    return specs


def bind_mla(t: Tensors) -> MlaWeights:
    """The MLA module under `t`'s prefix (the `mla_specs` names; a gated one also has g_proj)."""
    return MlaWeights(
        kv_a=t("kv_a_proj_with_mqa.weight"),
        kv_a_norm=t("kv_a_layernorm.weight"),
        kv_b=t("kv_b_proj.weight"),
        o=t("o_proj.weight"),
        q=t.optional("q_proj.weight"),
        q_a=t.optional("q_a_proj.weight"),
        q_a_norm=t.optional("q_a_layernorm.weight"),
        q_b=t.optional("q_b_proj.weight"),
        gate=t.optional("g_proj.weight"),
    )


# ---------------------------------------------------------------- MLPs and MoE (DeepSeek-V3 names)


def mlp_specs(
    m: str, inner: int, d: int, role: str, L: int | None, gated: bool = True, optional: bool = False
) -> list[TensorSpec]:
    """A dense MLP or shared expert under `m`: gate_proj (when gated), up_proj, down_proj."""
    o = {"layer": L, "optional": optional}
    gate = [TensorSpec(m + "gate_proj.weight", (inner, d), role, **o)] if gated else []
    return gate + [
        TensorSpec(m + "up_proj.weight", (inner, d), role, **o),
        TensorSpec(m + "down_proj.weight", (d, inner), role, **o),
    ]


def bind_mlp(t: Tensors) -> Mlp:
    return Mlp(up=t("up_proj.weight"), down=t("down_proj.weight"), gate=t.optional("gate_proj.weight"))


def moe_specs(
    m: str,
    experts: int,
    inner: int,
    d: int,
    L: int | None,
    *,
    expert_width: int | None = None,
    bias: bool = True,
    router_fp32: bool = False,
    shared: int = 0,
    gated: bool = True,
    optional: bool = False,
) -> list[TensorSpec]:
    """A MoE layer under `m` (e.g. "model.layers.3.mlp."): the router `gate.weight` [E, d] (kept fp32
    when the reference keeps it so) and its fp32 selection bias, the routed expert stacks (gate|up fused,
    or up alone when not gated) over `expert_width` (default d; a latent width for latent MoE), marked
    streamable, and a shared expert of width `shared` (0: none)."""
    dx = d if expert_width is None else expert_width
    o = {"layer": L, "optional": optional}
    specs = [TensorSpec(m + "gate.weight", (experts, d), "router", keep_fp32=router_fp32, **o)]
    if bias:
        specs.append(
            TensorSpec(m + "gate.e_score_correction_bias", (experts,), "router", keep_fp32=True, **o)
        )
    if gated:
        specs.append(
            TensorSpec(m + "experts.gate_up_proj", (experts, 2 * inner, dx), "expert", streamable=True, **o)
        )
    else:
        specs.append(TensorSpec(m + "experts.up_proj", (experts, inner, dx), "expert", streamable=True, **o))
    specs.append(TensorSpec(m + "experts.down_proj", (experts, dx, inner), "expert", streamable=True, **o))
    if shared:
        specs += mlp_specs(m + "shared_experts.", shared, d, "shared_expert", L, gated, optional)
    return specs


def bind_moe(t: Tensors, **extra) -> MoeWeights:
    """The MoE layer under `t`'s prefix (the `moe_specs` names); `extra` binds what a family adds
    (hash_ids, latent projections)."""
    return MoeWeights(
        router=t("gate.weight"),
        bias=t.optional("gate.e_score_correction_bias"),
        experts_in=t.optional("experts.gate_up_proj")
        if t.has("experts.gate_up_proj")
        else t("experts.up_proj"),
        experts_out=t("experts.down_proj"),
        shared=bind_mlp(t.under("shared_experts.")) if t.has("shared_experts.up_proj.weight") else None,
        **extra,
    )


# ---------------------------------------------------------------- KDA (the releases' names)


def kda_shapes(dims: KdaDims, a_log_shape: tuple[int, ...] | None = None) -> dict[str, tuple[int, ...]]:
    """The release names (under `self_attn.`) and shapes of one KDA layer. `a_log_shape` is the
    stored shape where a family differs: Kimi Linear [1, 1, H, 1], K3 [128] for 96 heads."""
    d, H, D, C, K = dims.hidden_size, dims.num_heads, dims.head_dim, dims.qkv_dim, dims.conv_kernel
    shapes = {
        "q_proj.weight": (C, d),
        "k_proj.weight": (C, d),
        "v_proj.weight": (C, d),
        "q_conv1d.weight": (C, 1, K),
        "k_conv1d.weight": (C, 1, K),
        "v_conv1d.weight": (C, 1, K),
        "f_a_proj.weight": (D, d),
        "f_b_proj.weight": (C, D),
        "dt_bias": (C,),
        "A_log": a_log_shape or (H,),
        "b_proj.weight": (H, d),
        "o_norm.weight": (D,),
        "o_proj.weight": (d, C),
    }
    if dims.full_rank_gate:
        shapes["g_proj.weight"] = (C, d)
    else:
        shapes["g_a_proj.weight"] = (D, d)
        shapes["g_b_proj.weight"] = (C, D)
    return shapes


def bind_kda(t: Tensors, dims: KdaDims) -> KdaWeights:
    """One KDA layer under `t`'s prefix, in the release names (`q_conv1d.weight`, `f_a_proj.weight`,
    `A_log`, ...) or transformers' (`conv1d.weight` [3C, 1, K], `forget_gate.f_a_proj.weight`, ...)."""
    H, C, K = dims.num_heads, dims.qkv_dim, dims.conv_kernel
    gate = t.under("forget_gate.") if t.has("forget_gate.A_log") else t
    if t.has("conv1d.weight"):
        conv = t("conv1d.weight").reshape(3 * C, -1)
    else:
        conv = torch.cat([t(f"{p}_conv1d.weight").reshape(C, -1) for p in "qkv"])
    if conv.shape != (3 * C, K):
        raise CheckpointError(f"KDA conv weight has {conv.shape[-1]} taps, config says {K}")
    a_log = gate("A_log").reshape(-1).float()
    if a_log.numel() < H:
        raise CheckpointError(f"KDA A_log has {a_log.numel()} entries for {H} heads")
    if a_log.numel() > H and torch.any(a_log[H:] != 0):
        raise CheckpointError(
            f"KDA A_log is stored with {a_log.numel()} entries for {H} heads and its tail is not zero; "
            "only a zero tail (Kimi K3's export) can be dropped"
        )
    full = dims.full_rank_gate
    return stack_inputs(
        KdaWeights(
            q_proj=t("q_proj.weight"),
            k_proj=t("k_proj.weight"),
            v_proj=t("v_proj.weight"),
            conv=conv.float(),
            f_a_proj=gate("f_a_proj.weight"),
            f_b_proj=gate("f_b_proj.weight"),
            dt_bias=gate("dt_bias").reshape(-1).float(),
            A_log=a_log[:H].contiguous(),
            b_proj=t("b_proj.weight"),
            o_norm=t("o_norm.weight"),
            o_proj=t("o_proj.weight"),
            g_proj=t("g_proj.weight") if full else None,
            g_a_proj=None if full else t("g_a_proj.weight"),
            g_b_proj=None if full else t("g_b_proj.weight"),
        )
    )

"""Kimi K3 (`kimi_k3`, text config `kimi_linear`): Kimi Linear's KDA + MLA hybrid with five
additions. Sources: Moonshot's remote code `modeling_kimi_linear.py` in the Hugging Face repository
`moonshotai/Kimi-K3` (K3's reference; transformers' `kimi_linear` has none of the five), the
Attention Residuals report (arXiv:2603.15031) and the Kimi Linear report (arXiv:2510.26692). No
transformers oracle exists; the shared parts are checked against transformers `kimi_linear` /
`glm5_next`, the rest against an independent reference in tests/test_kimi_k3.py. Layer schedule,
state and proof: docs/families/kimi_k3.md.

    partial, bank = embed(ids), []                          AttnRes stream, fp32 (layers/attnres.py)
    for L:
        x = mix(partial, bank)  (no mix while the bank is empty)
        every attn_res_block_size layers: archive partial into the bank, restart it at zero
        partial += mixer(RMSNorm(x))       KDA: lower-bounded gate -5 sigmoid(exp(A_log)(z + dt_bias)),
                                           full-rank output gate g_proj; or gated NoPE MLA:
                                           o_proj(attention * sigmoid(g_proj x))
        x = mix(partial, bank)
        partial += ffn(RMSNorm(x))         layer 0: SiTU-GLU MLP; then LatentMoE
    logits = lm_head(RMSNorm(mix(partial, bank)))   the model-level output mix

LatentMoE (layers/moe.py `moe` with latent projections): the sigmoid router reads the full hidden
state; the routed experts run in a latent space (`routed_expert_down_proj` d -> r, SiTU-GLU experts
r -> I -> r, weighted sum, RMSNorm `routed_expert_norm`, `routed_expert_up_proj` r -> d); the shared
experts (one MLP of width num_shared_experts * I) read the full hidden state.

SiTU-GLU(g, u) = [b1 tanh(g / b1) sigmoid(g)] * [b2 tanh(u / b2)], b1 = 4, b2 = 25, in fp32, in
the experts, the shared experts and the dense MLP. The KDA short convolution stays SiLU.

The released config is multimodal: top-level `kimi_k3` with `text_config` of type `kimi_linear`;
a bare text config (type `kimi_linear` with K3's fields) is read as well (`kimi_linear.handoff`).
`kda_layers` / `full_attn_layers` are 1-based: MLA at 0-based 3, 7, ..., 91 and 92.
Checkpoint tensors sit under `language_model.` (or none in a text-only export); `vision_tower.*`
and `mm_projector.*` are ignored. `self_attn.A_log` is stored wider than the head count ([128]
for 96 heads): the first H are used and the rest must be zero. Routed experts are MXFP4 in the
release (`quantization_config`, `experts.E.w1|w3|w2.weight_packed` + `.weight_scale`); the contract
keeps them packed (`weights/quant.py`) and the experts run through their packed matmul. Dense
exports (`experts.E.w1|w3|w2.weight`, bf16 or fp32) load the same way. `inspect` reports the
bytes per expert that the config implies.

Everything K3 shares with Kimi Linear comes from models/kimi_linear.py: the config reader, layer
kinds, contract pieces, release naming, layer binder, state, mixers and MLP/MoE blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..cache.batch import FINAL, ForwardBatch
from ..config import declared, field, positive, require, section
from ..errors import ConfigError
from ..layers.attnres import attnres_mix, bank_size, is_block_start
from ..layers.linear import linear
from ..layers.moe import silu_glu, situ_glu
from ..layers.norms import rms_norm
from ..weights.bind import Tensors
from ..weights.contract import Naming, Source, TensorSpec
from ..weights.quant import check_config
from . import kimi_linear as kl
from .parts import mlp_specs, moe_specs

MODEL_TYPES = ("kimi_k3",)

# The released text config where it differs from Kimi Linear's defaults (field names); absent fields
# take these
DEFAULTS = dict(
    hidden_size=7168,
    num_hidden_layers=93,
    num_attention_heads=96,
    q_lora_rank=1536,
    intermediate_size=33792,
    moe_intermediate_size=3072,
    num_experts=896,
    num_experts_per_token=16,
    num_shared_experts=2,
    routed_scaling_factor=1.0,
)
KDA_DEFAULTS = dict(num_heads=96)
VISION = [
    r"(language_model\.)?(model\.)?vision_tower\..*",
    r"(language_model\.)?(model\.)?mm_projector\..*",
    r"(language_model\.)?(model\.)?multi_modal_projector\..*",
]


@dataclass(frozen=True, kw_only=True)
class K3Config(kl.KimiLinearConfig):
    """Kimi Linear's fields and what K3 adds. Absent switches are off, as in the Kimi Linear code that
    K3's remote code extends (the release sets them all)."""

    attn_res_block_size: int = declared(check=positive)
    routed_expert_hidden_size: int = declared(check=positive)
    latent_moe_use_norm: bool = declared(False)
    mla_use_output_gate: bool = declared(False)
    situ_beta: float = declared(4.0, key="activation_situ_beta", check=positive)
    situ_linear_beta: float = declared(25.0, key="activation_situ_linear_beta", check=positive)
    hidden_act: str  # "situ" (the release) | "silu"
    expert_format: str  # "bf16" | "mxfp4" (as the config declares the routed experts)
    expert_group_size: int  # MXFP4 scale group
    model_type: str = "kimi_k3"

    @property
    def kda_gate(self) -> tuple[float | None, bool]:
        """`gate_lower_bound` (None: Kimi Linear's unbounded law, as K3's 0.40B twin has it; -5 in the
        release) and `use_full_rank_gate`, from `linear_attn_config`."""
        return self.linear_attn.gate_lower_bound, self.linear_attn.use_full_rank_gate

    @property
    def glu(self):
        if self.hidden_act == "situ":
            return partial(situ_glu, beta=self.situ_beta, linear_beta=self.situ_linear_beta)
        return silu_glu


def _quantization(top: dict, text: dict, w: str) -> tuple[str, int]:
    """(format of the routed experts, group size) from `quantization_config` (top level or text)."""
    qc = section(top, "quantization_config", w) or section(text, "quantization_config", w)
    if not qc:
        return "bf16", 32
    check_config(qc, f"{w}: field 'quantization_config'")
    fmt = str(qc.get("format", "")) + " " + str(qc.get("quant_method", ""))
    if "mxfp4" not in fmt:
        raise ConfigError(
            f"{w}: quantization_config {qc.get('quant_method')!r}/{qc.get('format')!r} is not the "
            "MXFP4 (mxfp4-pack-quantized) format Kimi K3 ships"
        )
    group = 32
    for g in (qc.get("config_groups") or {}).values():
        group = (g.get("weights") or {}).get("group_size") or group
    require(group > 0, w, "quantization_config.config_groups.*.weights.group_size", group, "must be positive")
    return "mxfp4", group


def parse_config(raw: dict, layout: str = "hf") -> K3Config:
    """The released layout (top-level `kimi_k3` + `text_config`) or a bare K3 text config. Absent
    sizes take the release's values; absent switches (`gate_lower_bound`, `use_full_rank_gate`,
    `mla_use_output_gate`, `latent_moe_use_norm`) are off (the release sets all four; its 0.40B twin
    has no gate lower bound, and forcing -5 on it is a known-bad mutant). The 1-based layer lists
    are required."""
    wrapped = isinstance(raw.get("text_config"), dict)
    text = raw["text_config"] if wrapped else raw
    w = "config.json text_config" if wrapped else "config.json"
    ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if wrapped and raw.get(k) is not None}
    act = field(text, "hidden_act", str, "situ", where=w)
    require(act in ("situ", "silu", "swish"), w, "hidden_act", act, "Kimi K3 uses situ")
    nope = field(text, "mla_use_nope", bool, True, where=w)
    require(
        nope, w, "mla_use_nope", nope, "Kimi K3's MLA has no rotary embedding; its config has no rope_theta"
    )
    router = field(text, "moe_router_activation_func", str, "sigmoid", where=w)
    require(router == "sigmoid", w, "moe_router_activation_func", router, "Kimi K3's router is sigmoid")
    fmt, group = _quantization(raw, text, w)
    cfg = kl.read_kimi_config(
        K3Config,
        {**text, **ids},
        w,
        DEFAULTS,
        KDA_DEFAULTS,
        default_schedule=False,
        hidden_act="situ" if act == "situ" else "silu",
        expert_format=fmt,
        expert_group_size=group,
    )
    d, r = cfg.hidden_size, cfg.routed_expert_hidden_size
    require(r <= d, w, "routed_expert_hidden_size", r, f"must be in 1..hidden_size={d}")
    if fmt == "mxfp4":
        for name, width in (
            ("routed_expert_hidden_size", r),
            ("moe_intermediate_size", cfg.moe_intermediate_size),
        ):
            require(width % group == 0, w, name, width, f"not a multiple of the MXFP4 group {group}")
    return cfg


# ---------------------------------------------------------------- tensor contract


def attnres_specs(site: str, d: int, L: int | None = None) -> list[TensorSpec]:
    """One AttnRes read under `site` (e.g. "model.layers.3.mlp_res"): its norm and pseudo-query, fp32."""
    return [
        TensorSpec(site + "_norm.weight", (d,), "attnres", L, keep_fp32=True),
        TensorSpec(site + "_proj.weight", (1, d), "attnres", L, keep_fp32=True),
    ]


def latent_moe_specs(c: K3Config, m: str, L: int) -> list[TensorSpec]:
    """The LatentMoE under `m`, in the release's order (the demo's random weights follow it): router,
    latent down projection, expert stacks over the latent width, latent norm + up projection, shared
    experts on the full width."""
    d, r, E, I = c.hidden_size, c.routed_expert_hidden_size, c.num_experts, c.moe_intermediate_size
    routed = moe_specs(m, E, I, d, L, expert_width=r, router_fp32=True)  # router, its bias, 2 expert stacks
    specs = routed[:2] + [TensorSpec(m + "routed_expert_down_proj.weight", (r, d), "latent_moe", L)]
    specs += routed[2:] + [TensorSpec(m + "routed_expert_up_proj.weight", (d, r), "latent_moe", L)]
    if c.latent_moe_use_norm:
        specs.append(TensorSpec(m + "routed_expert_norm.weight", (r,), "latent_moe", L))
    if c.num_shared_experts:
        specs += mlp_specs(m + "shared_experts.", I * c.num_shared_experts, d, "shared_expert", L)
    return specs


def tensor_specs(cfg: K3Config) -> list[TensorSpec]:
    c, d = cfg, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, d), "embedding")]
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}."
        specs += kl.norm_specs(p, d, L) + attnres_specs(p + "self_attention_res", d, L)
        specs += attnres_specs(p + "mlp_res", d, L)
        specs += kl.mixer_specs(c, p, L, (c.linear_attn.num_heads,))
        if c.mlp_kinds[L] == "dense":
            specs += mlp_specs(p + "mlp.", c.intermediate_size, d, "mlp", L)
        else:
            specs += latent_moe_specs(c, p + "mlp.", L)
    specs += [TensorSpec("model.norm.weight", (d,), "norm")] + attnres_specs("model.output_attn_res", d)
    specs.append(TensorSpec("lm_head.weight", (c.vocab_size, d), "lm_head", optional=c.tie_word_embeddings))
    return specs


def release_naming(cfg: K3Config, store_names, prefix: str = "language_model.") -> Naming:
    def override(spec: TensorSpec, where):
        # A_log is stored wider than the heads ([128] for 96): read as stored; bind_kda keeps the
        # first H and refuses a non-zero tail
        if spec.name.endswith("self_attn.A_log"):
            return Source([(where(spec.name), (-1,))])
        return None

    return kl.release_naming(
        f"Kimi K3 release ({prefix or 'no prefix'})", store_names, prefix, VISION, override
    )


def namings(cfg: K3Config, layout: str, store_names) -> Naming:
    """The release naming; a checkpoint without any `language_model.` tensor is a text-only export.
    With no names at all (a writer) the release's prefix."""
    names = list(store_names)
    prefix = "" if names and not any(n.startswith("language_model.") for n in names) else "language_model."
    return release_naming(cfg, names, prefix)


# ---------------------------------------------------------------- model


@dataclass
class Site:
    """One AttnRes read: its pseudo-query `proj` [1, d] and its `norm` [d], fp32."""

    proj: torch.Tensor
    norm: torch.Tensor


def bind_site(t: Tensors, site: str) -> Site:
    return Site(t(site + "_proj.weight"), t(site + "_norm.weight"))


@dataclass
class Layer(kl.Layer):
    """A Kimi Linear layer and its two AttnRes reads (before the mixer, before the FFN)."""

    attn_res: Site
    mlp_res: Site


class Model(kl.Model):
    """The Kimi K3 text decoder over a ForwardBatch: Kimi Linear's blocks on the AttnRes stream."""

    def __init__(self, cfg: K3Config, t: Tensors, dtype: torch.dtype, device):
        super().__init__(cfg, t, dtype, device)
        self.out_res = bind_site(t, "model.output_attn_res")

    def bind(self, w: Tensors, L: int) -> Layer:
        """Layer L: Kimi Linear's binder with the LatentMoE's projections, plus the AttnRes reads."""
        latent = {}
        if self.cfg.mlp_kinds[L] == "moe":
            m = w.under("mlp.")
            latent = dict(
                latent_in=m("routed_expert_down_proj.weight"),
                latent_norm=m.optional("routed_expert_norm.weight"),
                latent_out=m("routed_expert_up_proj.weight"),
            )
        base = kl.bind_layer(w, self.cfg, L, **latent)
        return Layer(
            **vars(base), attn_res=bind_site(w, "self_attention_res"), mlp_res=bind_site(w, "mlp_res")
        )

    def mix(self, partial: torch.Tensor, bank: list[torch.Tensor], site: Site) -> torch.Tensor:
        return attnres_mix(partial, bank, site.proj, site.norm, self.cfg.rms_norm_eps)

    def output_mix(self, partial: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        return self.mix(partial, bank, self.out_res)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.to(self.dtype), weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state.
        The AttnRes stream (bank and partial sums) is fp32; the blocks run in the model dtype."""
        block = self.cfg.attn_res_block_size
        partial = F.embedding(batch.token_ids, self.embed).float()
        bank: list[torch.Tensor] = []
        for L, w in enumerate(self.layers):
            x = self.mix(partial, bank, w.attn_res) if bank else partial
            if is_block_start(L, block):
                bank.append(partial)
                partial = None
            a = self.mixer(L, w, self._norm(x, w.attn_norm), batch).float()
            partial = a if partial is None else partial + a
            x = self.mix(partial, bank, w.mlp_res)
            partial = partial + self.ffn(w, self._norm(x, w.mlp_norm)).float()
            batch.tap(L, partial, lambda p: p.to(self.dtype))
        batch.finish()
        batch.tap(FINAL, partial, lambda p: self.output_mix(p, bank))
        rows = batch.logit_rows
        h = self.output_mix(partial[rows], [b[rows] for b in bank])
        return linear(self._norm(h, self.norm), self.lm_head).float()


def build(cfg: K3Config, tensors: Tensors, dtype: torch.dtype, device, folder) -> Model:
    return Model(cfg, tensors, dtype, device)


# ---------------------------------------------------------------- facts for inspect and the planner

layer_schedule = kl.layer_schedule
state_bytes = kl.state_bytes  # AttnRes keeps nothing across tokens
max_context = kl.max_context


def expert_bytes(cfg: K3Config) -> int:
    """Bytes of one routed expert (w1, w3: [I, r]; w2: [r, I]) in the format the config declares.
    MXFP4: per matrix rows * cols/2 packed code bytes + rows * cols/group E8M0 scale bytes."""
    r, I = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    if cfg.expert_format == "mxfp4":
        g = cfg.expert_group_size
        return 2 * (I * r // 2 + I * r // g) + (r * I // 2 + r * I // g)
    return 3 * r * I * 2


def facts(cfg: K3Config) -> dict:
    r, I = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    banked = bank_size(cfg.num_hidden_layers, cfg.attn_res_block_size)
    return {
        **kl.facts(cfg),
        "attn_res_block_size": cfg.attn_res_block_size,
        "attn_res_bank_entries": banked,
        "attn_res_activation_bytes_per_token": (banked + 1) * cfg.hidden_size * 4,
        "routed_expert_hidden_size": r,
        "expert_params": 3 * r * I,
        "expert_format": cfg.expert_format,
        "expert_bytes": expert_bytes(cfg),
        "expert_bytes_bf16": 3 * r * I * 2,
    }


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg) -> tuple[str, ...]:
    """Kimi K3 ships no draft head (num_nextn_predict_layers 0): speculative decoding needs an
    external drafter."""
    return ()

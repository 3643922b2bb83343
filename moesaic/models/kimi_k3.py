"""Kimi K3 (`kimi_k3`, text config `kimi_linear`): Kimi Linear's KDA + MLA hybrid with five
additions. Math, names and traps: shared/reference/kimi_k3.md. No transformers oracle exists;
the shared parts are checked against transformers `kimi_linear` / `glm5_next`, the rest against
an independent reference in tests/test_kimi_k3.py.

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

LatentMoE: the sigmoid router reads the full hidden state; the routed experts run in a latent
space (`routed_expert_down_proj` d -> r, SiTU-GLU experts r -> I -> r, weighted sum, RMSNorm
`routed_expert_norm`, `routed_expert_up_proj` r -> d); the shared experts (one MLP of width
num_shared_experts * I) read the full hidden state.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.batch import ForwardBatch
from ..config import field, positive
from ..errors import ConfigError
from ..layers.attnres import attnres_mix, bank_size, is_block_start
from ..layers.kda import KdaDims, KdaState, kda_mixer
from ..layers.linear import linear
from ..layers.moe import glu_mlp, run_experts, silu_glu, situ_glu
from ..layers.norms import rms_norm
from ..layers.recurrent import run_recurrent
from ..weights.contract import Naming, Source, TensorSpec
from . import kimi_linear as kl
from .parts import mla_specs

MODEL_TYPES = ("kimi_k3",)

# the released text config (shared/reference/kimi_k3.md section 1): absent fields take these
DEFAULTS = dict(
    kl.DEFAULTS,
    vocab_size=163840,
    hidden_size=7168,
    num_hidden_layers=93,
    num_attention_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=33792,
    moe_intermediate_size=3072,
    num_experts=896,
    num_experts_per_token=16,
    num_shared_experts=2,
    n_group=1,
    topk_group=1,
    moe_renormalize=True,
    routed_scaling_factor=1.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=1048576,
    kda_num_heads=96,
    kda_head_dim=128,
    conv_kernel=4,
    first_k_dense_replace=1,
    bos_token_id=163584,
    eos_token_id=163586,
)
VISION = [
    r"(language_model\.)?(model\.)?vision_tower\..*",
    r"(language_model\.)?(model\.)?mm_projector\..*",
    r"(language_model\.)?(model\.)?multi_modal_projector\..*",
]


@dataclass(frozen=True, kw_only=True)
class K3Config(kl.KimiLinearConfig):
    """Kimi Linear's fields and what K3 adds."""

    attn_res_block_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool
    mla_use_output_gate: bool
    gate_lower_bound: float | None  # None: Kimi Linear's unbounded gate law (the 0.40B twin)
    use_full_rank_gate: bool
    hidden_act: str  # "situ" (the release) | "silu"
    situ_beta: float
    situ_linear_beta: float
    expert_format: str  # "bf16" | "mxfp4" (as the config declares the routed experts)
    expert_group_size: int  # MXFP4 scale group
    model_type: str = "kimi_k3"

    @property
    def kda_dims(self) -> KdaDims:
        return KdaDims.for_variant(
            "kimi_k3",
            self.hidden_size,
            self.kda_num_heads,
            self.kda_head_dim,
            conv_kernel=self.conv_kernel,
            norm_eps=self.rms_norm_eps,
            lower_bound=self.gate_lower_bound,
            full_rank_gate=self.use_full_rank_gate,
        )


def _quantization(top: dict, text: dict, w: str) -> tuple[str, int]:
    """(format of the routed experts, group size) from `quantization_config` (top level or text)."""
    qc = top.get("quantization_config") or text.get("quantization_config")
    if not qc:
        return "bf16", 32
    fmt = str(qc.get("format", "")) + " " + str(qc.get("quant_method", ""))
    if "mxfp4" not in fmt:
        raise ConfigError(
            f"{w}: quantization_config {qc.get('quant_method')!r}/{qc.get('format')!r} is not the "
            "MXFP4 (mxfp4-pack-quantized) format Kimi K3 ships"
        )
    group = 32
    for g in (qc.get("config_groups") or {}).values():
        group = (g.get("weights") or {}).get("group_size", group) or group
    return "mxfp4", int(group)


def parse_config(raw: dict, layout: str = "hf") -> K3Config:
    """The released layout (top-level `kimi_k3` + `text_config`) or a bare K3 text config. Absent
    sizes take the release's values; absent switches (`gate_lower_bound`, `use_full_rank_gate`,
    `mla_use_output_gate`, `latent_moe_use_norm`) are off, as in the Kimi Linear code that K3's
    remote code extends (the release sets all four; its 0.40B twin has no gate lower bound, and
    forcing -5 on it is a known-bad mutant). The 1-based layer lists are required."""
    wrapped = isinstance(raw.get("text_config"), dict)
    text = raw["text_config"] if wrapped else raw
    w = "config.json text_config" if wrapped else "config.json"
    ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if wrapped and raw.get(k) is not None}
    common = kl.parse_common({**text, **ids}, w, DEFAULTS, default_schedule=False)
    lac = text.get("linear_attn_config") or {}
    lw = f"{w} linear_attn_config"
    act = field(text, "hidden_act", str, "situ", where=w)
    if act not in ("situ", "silu", "swish"):
        raise ConfigError(f"{w}: field 'hidden_act' has unsupported value {act!r} (Kimi K3 uses situ)")
    if not field(text, "mla_use_nope", bool, True, where=w):
        raise ConfigError(
            f"{w}: field 'mla_use_nope' = false is not supported (Kimi K3's MLA has no rotary "
            "embedding; its config carries no rope_theta)"
        )
    router = field(text, "moe_router_activation_func", str, "sigmoid", where=w)
    if router != "sigmoid":
        raise ConfigError(f"{w}: field 'moe_router_activation_func' = {router!r} is not supported (sigmoid)")
    fmt, group = _quantization(raw, text, w)
    d = common["hidden_size"]
    cfg = K3Config(
        **common,
        attn_res_block_size=field(text, "attn_res_block_size", int, where=w, check=positive),
        routed_expert_hidden_size=field(
            text,
            "routed_expert_hidden_size",
            int,
            where=w,
            check=lambda v: 0 < v <= d,
            why=f"must be in 1..hidden_size={d}",
        ),
        latent_moe_use_norm=field(text, "latent_moe_use_norm", bool, False, where=w),
        mla_use_output_gate=field(text, "mla_use_output_gate", bool, False, where=w),
        gate_lower_bound=None
        if lac.get("gate_lower_bound") is None
        else field(lac, "gate_lower_bound", float, where=lw, check=lambda v: v < 0, why="must be negative"),
        use_full_rank_gate=field(lac, "use_full_rank_gate", bool, False, where=lw),
        hidden_act="situ" if act == "situ" else "silu",
        situ_beta=field(text, "activation_situ_beta", float, 4.0, where=w, check=positive),
        situ_linear_beta=field(text, "activation_situ_linear_beta", float, 25.0, where=w, check=positive),
        expert_format=fmt,
        expert_group_size=group,
    )
    if fmt == "mxfp4":
        for name, width in (
            ("routed_expert_hidden_size", cfg.routed_expert_hidden_size),
            ("moe_intermediate_size", cfg.moe_intermediate_size),
        ):
            if width % group:
                raise ConfigError(
                    f"{w}: field {name!r} = {width} is not a multiple of the MXFP4 group {group}"
                )
    return cfg


# ---------------------------------------------------------------- tensor contract


def tensor_specs(cfg: K3Config) -> list[TensorSpec]:
    c, d, r = cfg, cfg.hidden_size, cfg.routed_expert_hidden_size

    def attnres(name, L=None):
        return [
            TensorSpec(name + "_norm.weight", (d,), "attnres", L, keep_fp32=True),
            TensorSpec(name + "_proj.weight", (1, d), "attnres", L, keep_fp32=True),
        ]

    specs = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, d), "embedding")]
    for L in range(c.num_hidden_layers):
        p = f"model.layers.{L}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (d,), "norm", L),
            TensorSpec(p + "post_attention_layernorm.weight", (d,), "norm", L),
        ]
        specs += attnres(p + "self_attention_res", L) + attnres(p + "mlp_res", L)
        if c.layer_kinds[L] == "kda":
            specs += kl.kda_specs(p, c.kda_dims, L, (c.kda_num_heads,))
        else:
            specs += mla_specs(p + "self_attn.", c, L)
            if c.mla_use_output_gate:
                specs.append(
                    TensorSpec(
                        p + "self_attn.g_proj.weight",
                        (c.num_attention_heads * c.v_head_dim, d),
                        "attention",
                        L,
                    )
                )
        m = p + "mlp."
        if c.mlp_kinds[L] == "dense":
            specs += kl.glu_specs(m, c.intermediate_size, d, "mlp", L)
            continue
        E, I = c.num_experts, c.moe_intermediate_size
        specs += kl.router_specs(m, c, L)
        specs += [
            TensorSpec(m + "routed_expert_down_proj.weight", (r, d), "latent_moe", L),
            TensorSpec(m + "experts.gate_up_proj", (E, 2 * I, r), "expert", L),
            TensorSpec(m + "experts.down_proj", (E, r, I), "expert", L),
            TensorSpec(m + "routed_expert_up_proj.weight", (d, r), "latent_moe", L),
        ]
        if c.latent_moe_use_norm:
            specs.append(TensorSpec(m + "routed_expert_norm.weight", (r,), "latent_moe", L))
        if c.num_shared_experts:
            specs += kl.glu_specs(m + "shared_experts.", I * c.num_shared_experts, d, "shared_expert", L)
    specs += [TensorSpec("model.norm.weight", (d,), "norm")] + attnres("model.output_attn_res")
    specs.append(TensorSpec("lm_head.weight", (c.vocab_size, d), "lm_head", optional=c.tie_word_embeddings))
    return specs


def release_naming(cfg: K3Config, store_names, prefix: str = "language_model.") -> Naming:
    def override(spec: TensorSpec, where):
        # A_log is stored wider than the heads ([128] for 96): read as stored; KdaWeights keeps the
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


# ---------------------------------------------------------------- blocks


class Model:
    """The Kimi K3 text decoder over a ForwardBatch."""

    def __init__(self, cfg: K3Config, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        t = tensors
        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        self.lm_head = t.get("lm_head.weight", self.embed)
        self.out_res_norm = t["model.output_attn_res_norm.weight"]
        self.out_res_proj = t["model.output_attn_res_proj.weight"]
        self.layers = [kl.layer_tensors(t, L) for L in range(cfg.num_hidden_layers)]
        self.kda = {
            L: kl.kda_weights(w, cfg.kda_dims)
            for L, w in enumerate(self.layers)
            if cfg.layer_kinds[L] == "kda"
        }

    def new_state(self, rollback_window: int = 0):
        """Per-sequence state; `rollback_window` > 0 keeps the KDA states of the last tokens so
        that `state.rollback(n)` for n <= window is exact (speculative decoding)."""
        return kl.new_state(self.cfg, self.dtype, self.device, rollback_window)

    # -- blocks
    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.hidden_act == "situ":
            return situ_glu(gate, up, c.situ_beta, c.situ_linear_beta)
        return silu_glu(gate, up)

    def mlp(self, w: dict, m: str, x: torch.Tensor) -> torch.Tensor:
        return glu_mlp(
            x, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"], self.glu
        )

    def mixer(self, L: int, w: dict, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        c = self.cfg
        if c.layer_kinds[L] == "kda":
            return run_recurrent(kda_mixer, self.kda[L], c.kda_dims, L, x, batch)
        o = kl.mla_heads(L, c, w, x, batch)
        if c.mla_use_output_gate:
            o = (o.float() * torch.sigmoid(linear(x, w["self_attn.g_proj.weight"]).float())).to(o.dtype)
        return linear(o, w["self_attn.o_proj.weight"])

    def latent_moe(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        weights, ids = kl.route(c, w, x)
        h = linear(x, w["mlp.routed_expert_down_proj.weight"])
        y = run_experts(
            h,
            weights,
            ids,
            w["mlp.experts.gate_up_proj"],
            w["mlp.experts.down_proj"],
            lambda gu: self.glu(*gu.chunk(2, dim=-1)),
        )
        if c.latent_moe_use_norm:
            y = rms_norm(y, w["mlp.routed_expert_norm.weight"], c.rms_norm_eps)
        y = linear(y, w["mlp.routed_expert_up_proj.weight"])
        if c.num_shared_experts:
            y = y + self.mlp(w, "mlp.shared_experts.", x)
        return y

    def ffn(self, L: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(w, "mlp.", x) if self.cfg.mlp_kinds[L] == "dense" else self.latent_moe(w, x)

    def output_mix(self, partial: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        return attnres_mix(partial, bank, self.out_res_proj, self.out_res_norm, self.cfg.rms_norm_eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.to(self.dtype), weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of `batch.logit_rows`; appends every sequence's new tokens to its state.
        The AttnRes stream (bank and partial sums) is fp32; the blocks run in the model dtype."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        partial = F.embedding(batch.token_ids, self.embed).float()
        bank: list[torch.Tensor] = []
        for L, w in enumerate(self.layers):
            x = (
                attnres_mix(
                    partial,
                    bank,
                    w["self_attention_res_proj.weight"],
                    w["self_attention_res_norm.weight"],
                    eps,
                )
                if bank
                else partial
            )
            if is_block_start(L, c.attn_res_block_size):
                bank.append(partial)
                partial = None
            a = self.mixer(L, w, self._norm(x, w["input_layernorm.weight"]), batch).float()
            partial = a if partial is None else partial + a
            x = attnres_mix(partial, bank, w["mlp_res_proj.weight"], w["mlp_res_norm.weight"], eps)
            partial = partial + self.ffn(L, w, self._norm(x, w["post_attention_layernorm.weight"])).float()
        batch.finish()
        rows = batch.logit_rows
        h = self.output_mix(partial[rows], [b[rows] for b in bank])
        return linear(self._norm(h, self.norm), self.lm_head).float()


# ---------------------------------------------------------------- facts for inspect and the planner

layer_schedule = kl.layer_schedule
state_bytes = kl.state_bytes
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
    return {
        "kda_layers": [L for L, k in enumerate(cfg.layer_kinds) if k == "kda"],
        "mla_layers": [L for L, k in enumerate(cfg.layer_kinds) if k == "mla"],
        "kda_state_bytes_per_layer": KdaState.nbytes_for(cfg.kda_dims),
        "attn_res_block_size": cfg.attn_res_block_size,
        "attn_res_bank_entries": bank_size(cfg.num_hidden_layers, cfg.attn_res_block_size),
        "attn_res_activation_bytes_per_token": (bank_size(cfg.num_hidden_layers, cfg.attn_res_block_size) + 1)
        * cfg.hidden_size
        * 4,
        "experts": cfg.num_experts,
        "experts_per_token": cfg.num_experts_per_token,
        "routed_expert_hidden_size": r,
        "expert_params": 3 * r * I,
        "expert_format": cfg.expert_format,
        "expert_bytes": expert_bytes(cfg),
        "expert_bytes_bf16": 3 * r * I * 2,
    }


def handoff(raw: dict) -> str | None:
    return None


def draft_heads(cfg) -> tuple[str, ...]:
    return ()


def build(cfg, tensors, dtype, device, folder):
    return Model(cfg, tensors.all(), dtype, device)

"""Kimi K3: no transformers oracle exists, so the checks are

* the parts K3 shares with an oracle family: its KDA layer (lower-bounded gate, full-rank output
  gate, A_log stored wider than the heads) against transformers' glm5_next KDA module, and its
  MLA with the output gate forced open against transformers' kimi_linear MLA;
* an independent reference written here from the forward pass of docs/families/kimi_k3.md (after
  Moonshot's remote code in `moonshotai/Kimi-K3` and the AttnRes report arXiv:2603.15031): loops for
  AttnRes and the MoE, plain softmax attention, the KDA recurrence from transformers' glm5_next
  chunked function, reading the checkpoint's release-named tensors itself;
* AttnRes and SiTU against closed forms and invariants;
* broken twins: each must change K3's logits AND fail the check it targets;
* consistency: chunked prefill, decode and rollback against one full prefill;
* the released config.json alone through `moesaic inspect --json`.

Tiny checkpoints come from `k3demo.write_checkpoint` (release naming, `language_model.` prefix,
vision tensors present). Max abs errors are printed (-s)."""

from __future__ import annotations

import dataclasses
import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    calm_kda_,
    check_batch_equals_singles,
    check_state_bytes_exact,
    max_err,
    random_ids,
    randomize_,
    run,
)
from safetensors.torch import load_file, save_file
from transformers.models.glm5_next import modeling_glm5_next as hf_glm
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cli import main as cli_main
from moesaic.demo import kimi_k3 as k3demo
from moesaic.errors import CheckpointError, ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.layers.attnres import attnres_mix
from moesaic.layers.moe import MoeWeights
from moesaic.layers.norms import rms_norm
from moesaic.models import Checkpoint, family_for, kimi_k3

TOL = 1e-5
# The independent reference evaluates every op in another order (per-token loops, transformers'
# KDA chunking); this tiny model's logits move by ~1e-5 when its embeddings change by one fp32
# rounding step (measured and printed below), so the reference comparison gets twice TOL.
TOL_REF = 2e-5
TC = k3demo.TINY_TEXT_CONFIG
D, EPS, BLOCK = TC["hidden_size"], TC["rms_norm_eps"], TC["attn_res_block_size"]
LAC = TC["linear_attn_config"]
H_KDA, DK, KERNEL = LAC["num_heads"], LAC["head_dim"], LAC["short_conv_kernel_size"]
A_LOG_WIDTH = 16  # stored wider than the 2 heads, tail zero (the release: 128 for 96)
MLA_NORM_EPS = 1e-6  # q_a / kv_a layernorm eps, as in transformers' kimi_linear (an assumption for K3)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def glm_kda():
    """transformers' glm5_next KDA module (lower bound -5) with K3's tiny dims; layer 0 of the
    checkpoint is written from it, so that layer can be compared with the oracle."""
    torch.manual_seed(0)
    cfg = Glm5NextTextConfig(
        hidden_size=D,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
        num_attention_heads=4,
        num_key_value_heads=4,
        linear_num_heads=H_KDA,
        linear_head_dim=DK,
        linear_conv_kernel_dim=KERNEL,
        rms_norm_eps=EPS,
    )
    module = hf_glm.Glm5NextTextLinearAttention(cfg, 0).eval()
    assert cfg.linear_lower_bound == -5.0
    randomize_(module, seed=1)
    calm_kda_(module, seed=2)
    return module


def kda_tensors_from(module, prefix: str) -> dict[str, torch.Tensor]:
    """A glm5_next KDA module as K3 model-named tensors: q/k/v_conv1d split, A_log of the heads,
    the low-rank output gate folded into one full-rank g_proj."""
    p = {n: t.detach().clone() for n, t in module.named_parameters()}
    C = H_KDA * DK
    conv = p["conv1d.weight"]
    a = prefix + "self_attn."
    return {
        a + "q_proj.weight": p["q_proj.weight"],
        a + "k_proj.weight": p["k_proj.weight"],
        a + "v_proj.weight": p["v_proj.weight"],
        a + "q_conv1d.weight": conv[:C],
        a + "k_conv1d.weight": conv[C : 2 * C],
        a + "v_conv1d.weight": conv[2 * C :],
        a + "f_a_proj.weight": p["forget_gate.f_a_proj.weight"],
        a + "f_b_proj.weight": p["forget_gate.f_b_proj.weight"],
        a + "dt_bias": p["forget_gate.dt_bias"],
        a + "A_log": p["forget_gate.A_log"],
        a + "b_proj.weight": p["b_proj.weight"],
        a + "g_proj.weight": p["g_b_proj.weight"] @ p["g_a_proj.weight"],
        a + "o_norm.weight": p["o_norm.weight"],
        a + "o_proj.weight": p["o_proj.weight"],
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, glm_kda):
    cfg = kimi_k3.parse_config(k3demo.release_config(TC))
    tensors = k3demo.random_tensors(cfg, seed=0)
    tensors.update(kda_tensors_from(glm_kda, "model.layers.0."))
    path = tmp_path_factory.mktemp("kimi_k3")
    k3demo.write_checkpoint(path, dtype=torch.float32, tensors=tensors, a_log_width=A_LOG_WIDTH)
    return path


@pytest.fixture(scope="module")
def release(ckpt):
    """The checkpoint's text tensors by release name (prefix removed), read without moesaic."""
    raw = load_file(ckpt / "model.safetensors")
    return {k[len("language_model.") :]: v for k, v in raw.items() if k.startswith("language_model.")}


@pytest.fixture(scope="module")
def model(ckpt):
    return Checkpoint.open(ckpt).build("float32")


prompt = partial(random_ids, vocab=TC["vocab_size"], low=0)
IDS = prompt(37)


@pytest.fixture(scope="module")
def real_logits(model):
    return run(model, [IDS])[0]


def fresh_batch(m, n):
    return ForwardBatch.build([(m.new_state(), [0] * n)], logits="all")


# ----------------------------------------------------------------------------- the independent reference


def ref_rms(x, w, eps=EPS):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_situ(g, u, b1=4.0, b2=25.0):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def ref_mix(partial, bank, proj, norm, eps=EPS):
    """AttnRes, one token and one candidate at a time."""
    out = torch.empty_like(partial)
    q = norm * proj.reshape(-1)
    for t in range(partial.shape[0]):
        cands = [b[t] for b in bank] + [partial[t]]
        logits = torch.stack([(c / torch.sqrt((c * c).mean() + eps) * q).sum() for c in cands])
        p = torch.exp(logits - logits.max())
        p = p / p.sum()
        out[t] = sum(pi * c for pi, c in zip(p, cands))
    return out


def ref_kda(R, p, x):
    a = p + "self_attn."
    T, C = x.shape[0], H_KDA * DK
    qkv = torch.cat([x @ R[a + f"{n}_proj.weight"].T for n in "qkv"], -1)  # [T, 3C]
    w = torch.cat([R[a + f"{n}_conv1d.weight"] for n in "qkv"])  # [3C, 1, K]
    y = F.silu(F.conv1d(qkv.T[None], w, padding=KERNEL - 1, groups=3 * C)[0, :, :T].T)
    q, k, v = (t.reshape(1, T, H_KDA, DK) for t in y.split(C, -1))
    A = R[a + "A_log"][:H_KDA]
    assert torch.all(R[a + "A_log"][H_KDA:] == 0)
    z = (x @ R[a + "f_a_proj.weight"].T) @ R[a + "f_b_proj.weight"].T + R[a + "dt_bias"]
    g = LAC["gate_lower_bound"] * torch.sigmoid(torch.exp(A)[:, None] * z.reshape(T, H_KDA, DK))
    beta = torch.sigmoid(x @ R[a + "b_proj.weight"].T)
    o, _ = hf_glm.chunk_kimi_delta_attention(
        q, k, v, g[None], beta[None], chunk_size=16, use_qk_l2norm_in_kernel=True
    )
    o = ref_rms(o[0], R[a + "o_norm.weight"]) * torch.sigmoid(x @ R[a + "g_proj.weight"].T).reshape(
        T, H_KDA, DK
    )
    return o.reshape(T, C) @ R[a + "o_proj.weight"].T


def ref_mla(R, p, x):
    a, T = p + "self_attn.", x.shape[0]
    H, nope, rope = TC["num_attention_heads"], TC["qk_nope_head_dim"], TC["qk_rope_head_dim"]
    dv, kvr = TC["v_head_dim"], TC["kv_lora_rank"]
    q = (
        ref_rms(x @ R[a + "q_a_proj.weight"].T, R[a + "q_a_layernorm.weight"], MLA_NORM_EPS)
        @ R[a + "q_b_proj.weight"].T
    )
    q = q.reshape(T, H, nope + rope)
    ckv = x @ R[a + "kv_a_proj_with_mqa.weight"].T
    kv = ref_rms(ckv[:, :kvr], R[a + "kv_a_layernorm.weight"], MLA_NORM_EPS) @ R[a + "kv_b_proj.weight"].T
    kv = kv.reshape(T, H, nope + dv)
    k = torch.cat([kv[..., :nope], ckv[:, None, kvr:].expand(T, H, rope)], -1)  # the shared slice, unrotated
    s = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), kv[..., nope:]).reshape(T, H * dv)
    return (o * torch.sigmoid(x @ R[a + "g_proj.weight"].T)) @ R[a + "o_proj.weight"].T


def ref_glu(R, m, x):
    return (
        ref_situ(x @ R[m + "gate_proj.weight"].T, x @ R[m + "up_proj.weight"].T) @ R[m + "down_proj.weight"].T
    )


def ref_moe(R, p, x):
    m = p + "block_sparse_moe."
    k = TC["num_experts_per_token"]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        s = torch.sigmoid(x[t] @ R[m + "gate.weight"].T)
        order = sorted(
            range(len(s)), key=lambda e: (-(s[e] + R[m + "gate.e_score_correction_bias"][e]).item(), e)
        )
        ids = order[:k]
        w = s[ids] / (s[ids].sum() + 1e-20) * TC["routed_scaling_factor"]
        h = R[m + "routed_expert_down_proj.weight"] @ x[t]
        y = sum(
            wi
            * (
                R[m + f"experts.{e}.w2.weight"]
                @ ref_situ(R[m + f"experts.{e}.w1.weight"] @ h, R[m + f"experts.{e}.w3.weight"] @ h)
            )
            for wi, e in zip(w, ids)
        )
        y = R[m + "routed_expert_up_proj.weight"] @ ref_rms(y, R[m + "routed_expert_norm.weight"])
        out[t] = y + ref_glu(R, m + "shared_experts.", x[t][None])[0]
    return out


def ref_forward(R, ids):
    """The forward pass of docs/families/kimi_k3.md, literally."""
    h, bank = R["model.embed_tokens.weight"][ids], []
    kda = set(LAC["kda_layers"])
    for L in range(TC["num_hidden_layers"]):
        p = f"model.layers.{L}."
        partial = h
        if bank:
            h = ref_mix(
                partial,
                bank,
                R[p + "self_attention_res_proj.weight"],
                R[p + "self_attention_res_norm.weight"],
            )
        if L % BLOCK == 0:
            bank.append(partial)
            partial = None
        x = ref_rms(h, R[p + "input_layernorm.weight"])
        a = ref_kda(R, p, x) if (L + 1) in kda else ref_mla(R, p, x)
        partial = a if partial is None else partial + a
        h = ref_mix(partial, bank, R[p + "mlp_res_proj.weight"], R[p + "mlp_res_norm.weight"])
        x = ref_rms(h, R[p + "post_attention_layernorm.weight"])
        m = ref_glu(R, p + "mlp.", x) if L < TC["first_k_dense_replace"] else ref_moe(R, p, x)
        partial = partial + m
        h = partial
    h = ref_mix(h, bank, R["model.output_attn_res_proj.weight"], R["model.output_attn_res_norm.weight"])
    return ref_rms(h, R["model.norm.weight"]) @ R["lm_head.weight"].T


# ----------------------------------------------------------------------------- the checks (each takes what it checks)


def check_forward(logits, release) -> float:
    """Error of a model's prefill logits of IDS against the independent reference."""
    with torch.no_grad():
        return max_err(logits, ref_forward(release, IDS))


def check_attnres(mix) -> float:
    """`mix` against the in-test reference on random candidates of different scales."""
    g = torch.Generator().manual_seed(3)
    bank = [torch.randn(9, D, generator=g) * s for s in (0.2, 1.0, 5.0)]
    partial = torch.randn(9, D, generator=g) * 2
    proj, norm = torch.randn(1, D, generator=g) * D**-0.5 * 3, 1 + 0.1 * torch.randn(D, generator=g)
    return max_err(mix(partial, bank, proj, norm, EPS), ref_mix(partial, bank, proj, norm))


def check_situ(glu) -> float:
    g = torch.linspace(-40, 40, 801)
    u = torch.linspace(-120, 120, 801).flip(0)
    return max_err(glu(g, u, 4.0, 25.0), ref_situ(g, u))


def check_latent_moe(m, release, L=1) -> float:
    x = rms_norm(torch.randn(23, D, generator=torch.Generator().manual_seed(4)), torch.ones(D), EPS)
    with torch.no_grad():
        return max_err(m.ffn(m.layers[L], x), ref_moe(release, f"model.layers.{L}.", x))


def check_kda(m, module, L=0) -> float:
    """K3's KDA layer L on random inputs against transformers' glm5_next KDA module; relative
    to max(1, |ref|) as in tests/test_kda_layer.py."""
    x = torch.randn(45, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = module(x[None])[0]
        got = m.mixer(L, m.layers[L], x, fresh_batch(m, 45))
    return ((got - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


# ----------------------------------------------------------------------------- tests: the real model


def test_checkpoint_is_in_release_naming(ckpt, release, model):
    names = set(load_file(ckpt / "model.safetensors"))
    for n in [
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",
        "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.3.self_attn.g_proj.weight",
        "language_model.model.layers.2.self_attn.q_conv1d.weight",
        "language_model.model.output_attn_res_proj.weight",
        "language_model.lm_head.weight",
        "vision_tower.patch_embed.proj.weight",
        "mm_projector.proj.0.weight",
    ]:
        assert n in names, n
    assert release["model.layers.0.self_attn.A_log"].shape == (A_LOG_WIDTH,)
    assert model.layers[0].attn.A_log.shape == (H_KDA,)
    assert model.cfg.layer_kinds == ("kda", "kda", "kda", "mla", "mla")  # 1-based [1,2,3] / [4,5]
    assert kimi_k3.layer_schedule(model.cfg) == ["kda+mlp", "kda+moe", "kda+moe", "mla+moe", "mla+moe"]


def noise_floor(m) -> float:
    """How far the logits move when the embeddings change by one fp32 rounding step (2^-23 relative)."""
    emb, worst = m.embed, 0.0
    for seed in range(2):
        noise = torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed))
        m.embed = emb * (1 + 2.0**-23 * noise)
        worst = max(worst, max_err(run(m, [IDS])[0], run_plain(m)))
    m.embed = emb
    return worst


def run_plain(m):
    e, m.embed = m.embed, m._plain_embed
    out = run(m, [IDS])[0]
    m.embed = e
    return out


def test_full_forward_matches_the_independent_reference(model, real_logits, release):
    err = check_forward(real_logits, release)
    model._plain_embed = model.embed
    floor = noise_floor(model)
    print(
        f"kimi_k3 prefill vs reference max abs err {err:.2e} (|logits| max {real_logits.abs().max():.2f}; "
        f"fp32 noise floor of this model {floor:.2e})"
    )
    assert err < TOL_REF and floor < TOL_REF


def test_kda_matches_glm5_next_oracle(model, glm_kda):
    err = check_kda(model, glm_kda)
    print(f"kimi_k3 KDA (lower bound, full-rank gate, A_log [16] for 2 heads) vs glm5_next: {err:.2e}")
    assert err < TOL


def test_mla_with_gate_open_matches_kimi_linear_mla(model):
    """K3's gated MLA with sigmoid(g) forced to 1 (g_proj = 0 gives 1/2; o_proj doubled undoes it
    exactly: both are powers of two) equals transformers' kimi_linear MLA with q_lora."""
    L = 3
    cfg = KimiLinearConfig(
        hidden_size=D,
        num_attention_heads=TC["num_attention_heads"],
        num_key_value_heads=TC["num_attention_heads"],
        q_lora_rank=TC["q_lora_rank"],
        kv_lora_rank=TC["kv_lora_rank"],
        qk_nope_head_dim=TC["qk_nope_head_dim"],
        qk_rope_head_dim=TC["qk_rope_head_dim"],
        v_head_dim=TC["v_head_dim"],
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_hidden_layers=1,
        linear_attn_config={"kda_layers": [], "full_attn_layers": [1]},
    )
    cfg._attn_implementation = "eager"
    hf = KimiLinearAttention(cfg, 0).eval()
    w = model.layers[L]
    bound = {  # transformers' parameter -> the bound MlaWeights field
        "q_a_proj.weight": "q_a",
        "q_a_layernorm.weight": "q_a_norm",
        "q_b_proj.weight": "q_b",
        "kv_a_proj_with_mqa.weight": "kv_a",
        "kv_a_layernorm.weight": "kv_a_norm",
        "kv_b_proj.weight": "kv_b",
        "o_proj.weight": "o",
    }
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(getattr(w.attn, bound[name]))
    T = 29
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = hf(x[None], attention_mask=mask)[0][0]
    opened = dataclasses.replace(
        w, attn=dataclasses.replace(w.attn, gate=torch.zeros_like(w.attn.gate), o=2 * w.attn.o)
    )
    got = model.mixer(L, opened, x, fresh_batch(model, T))
    gated = model.mixer(L, w, x, fresh_batch(model, T))
    err = max_err(got, ref)
    print(
        f"kimi_k3 MLA (gate open) vs kimi_linear MLA: {err:.2e}; the real gate moves it by {max_err(gated, ref):.2e}"
    )
    assert err < TOL and max_err(gated, ref) > 1e-2


def test_attnres_reference_and_invariants():
    err = check_attnres(attnres_mix)
    assert err < 5e-6  # candidates up to ~15 in size
    g = torch.Generator().manual_seed(8)
    x, proj, norm = (
        torch.randn(5, D, generator=g),
        torch.randn(D, generator=g),
        torch.rand(D, generator=g) + 0.5,
    )
    bank = [torch.randn(5, D, generator=g) for _ in range(3)]
    # one candidate: the identity, exactly, and never the input object itself
    out = attnres_mix(x, [], proj, norm, EPS)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    # candidate order does not matter
    a = attnres_mix(x, bank, proj, norm, EPS)
    b = attnres_mix(bank[1], [bank[2], x, bank[0]], proj, norm, EPS)
    assert max_err(a, b) < 1e-6
    # a convex combination of the raw candidates, per coordinate
    stack = torch.stack(bank + [x])
    assert torch.all(a <= stack.amax(0) + 1e-6) and torch.all(a >= stack.amin(0) - 1e-6)
    # the logits see RMS-normalised candidates: scaling one candidate by 7 keeps every weight,
    # so the output moves by 6 * p_0 * bank_0 only (parallel to that candidate, per token)
    c = attnres_mix(x, [bank[0] * 7.0, bank[1], bank[2]], proj, norm, EPS)
    p0 = ((c - a) * bank[0]).sum(-1, keepdim=True) / (6 * bank[0].pow(2).sum(-1, keepdim=True))
    assert max_err(c - a, 6 * p0 * bank[0]) < 5e-5 and torch.all((p0 >= 0) & (p0 <= 1))
    # a zero query weighs the candidates equally
    assert max_err(attnres_mix(x, bank, torch.zeros(D), norm, EPS), stack.mean(0)) < 1e-6
    # fp32 whatever comes in, and the inputs are left alone
    x16 = x.bfloat16()
    assert attnres_mix(x16, [b.bfloat16() for b in bank], proj, norm, EPS).dtype == torch.float32
    print(f"attnres vs in-test reference: {err:.2e}")


def test_situ_closed_form():
    err = check_situ(kimi_k3.situ_glu)
    g, u = torch.tensor([0.0, 100.0, -100.0, 1.0]), torch.tensor([3.0, 100.0, 100.0, 0.0])
    out = kimi_k3.situ_glu(g, u)
    assert out[0] == 0 and out[3] == 0  # a closed gate, a zero up branch
    assert 99.9 < out[1] < 100 and abs(out[2]) < 1e-30  # the caps: |SiTU| < 4 * 25
    assert kimi_k3.situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16
    print(f"situ vs closed form: {err:.2e}")
    assert err < 1e-6


def test_latent_moe_matches_reference(model, release):
    err = check_latent_moe(model, release)
    print(f"kimi_k3 latent MoE vs reference: {err:.2e}")
    assert err < TOL


# ----------------------------------------------------------------------------- tests: broken twins


def assert_twin(name, twin_logits, real_logits, check_err, tol):
    moved = max_err(twin_logits, real_logits)
    print(
        f"twin {name}: logits move by {moved:.2e}; its check reads {check_err:.2e} (passes below {tol:.0e})"
    )
    assert moved > 1e-3, f"{name} does not change K3's logits"
    assert check_err > tol, f"{name} passes the check it targets"


def test_twin_plain_residuals(monkeypatch, model, real_logits):
    def plain(partial, bank, proj, norm, eps):  # the sum of all candidates IS the plain residual stream
        return sum(b.float() for b in bank) + partial.float()

    monkeypatch.setattr(kimi_k3, "attnres_mix", plain)
    assert_twin(
        "AttnRes -> plain residuals",
        run(model, [IDS])[0],
        real_logits,
        check_attnres(kimi_k3.attnres_mix),
        5e-6,
    )


def test_twin_output_mix_left_out(ckpt, release, real_logits):
    twin = Checkpoint.open(ckpt).build("float32")
    twin.output_mix = lambda partial, bank: partial
    logits = run(twin, [IDS])[0]
    assert_twin("output mix left out", logits, real_logits, check_forward(logits, release), TOL_REF)


def test_twin_swiglu_instead_of_situ(monkeypatch, ckpt, real_logits):
    monkeypatch.setattr(
        kimi_k3, "situ_glu", lambda g, u, beta=4.0, linear_beta=25.0: F.silu(g.float()) * u.float()
    )
    twin = Checkpoint.open(ckpt).build("float32")  # the activation is bound at build
    assert_twin("SwiGLU for SiTU", run(twin, [IDS])[0], real_logits, check_situ(kimi_k3.situ_glu), 1e-6)


def test_twin_latent_norm_left_out(ckpt, release, real_logits):
    twin = Checkpoint.open(ckpt).build("float32")
    moe_layers = [w.mlp for w in twin.layers if isinstance(w.mlp, MoeWeights)]
    assert moe_layers and all(m.latent_norm is not None for m in moe_layers)
    for m in moe_layers:
        m.latent_norm = None
    assert_twin(
        "latent norm left out", run(twin, [IDS])[0], real_logits, check_latent_moe(twin, release), TOL
    )


def test_twin_wrong_a_log_slice(ckpt, release, glm_kda, real_logits):
    twin = Checkpoint.open(ckpt).build("float32")
    stored = release["model.layers.0.self_attn.A_log"]
    twin.layers[0].attn.A_log = stored[A_LOG_WIDTH - H_KDA :].clone()  # the zero tail read as the heads
    assert_twin("wrong A_log slice", run(twin, [IDS])[0], real_logits, check_kda(twin, glm_kda), TOL)


# ----------------------------------------------------------------------------- tests: states


def test_chunked_decode_and_rollback_agree_with_full_prefill(model, real_logits):
    chunked, _ = run(model, [IDS[a:b] for a, b in zip([0, 2, 7, 20, 21], [2, 7, 20, 21, 37])])
    decoded, _ = run(model, [IDS[:25]] + [[t] for t in IDS[25:]], logits="last")
    e_chunk, e_dec = max_err(chunked, real_logits), max_err(decoded, real_logits[24:])
    # speculative window 4: draft 4 tokens in one forward, roll back, re-feed
    drafted, st = run(model, [IDS[:33], IDS[33:]], rollback_window=4)
    e_draft = max_err(drafted, real_logits)
    st.rollback(4)
    again = model.forward(ForwardBatch.build([(st, IDS[33:])], logits="all"))
    e_again = max_err(again, drafted[33:])  # same chunking: only the KDA snapshots differ, which must not
    st.rollback(3)
    other = prompt(5, seed=9)
    changed = model.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(model, [IDS[:34] + other])
    e_other = max_err(changed, fresh[34:])
    print(
        f"kimi_k3 vs full prefill: chunked {e_chunk:.2e}, decode {e_dec:.2e}, window prefill {e_draft:.2e}, "
        f"rollback re-feed {e_again:.2e}, rollback + other tokens {e_other:.2e}"
    )
    assert max(e_chunk, e_dec, e_draft, e_other) < TOL and e_again < 1e-6
    with pytest.raises(ValueError, match="window"):
        st.rollback(5)


def test_snapshot_restore_and_state_bytes(model):
    st = model.new_state()
    model.forward(ForwardBatch.build([(st, IDS[:20])]))
    snap = st.snapshot()
    a = model.forward(ForwardBatch.build([(st, IDS[20:])], logits="all"))
    st2 = model.new_state()
    st2.restore(snap)
    b = model.forward(ForwardBatch.build([(st2, IDS[20:])], logits="all"))
    assert torch.equal(a, b) and st2.num_tokens == 37
    per_token, fixed = kimi_k3.state_bytes(model.cfg, 4)
    assert st.nbytes == st2.nbytes == 37 * per_token + fixed
    kv = TC["kv_lora_rank"] + TC["qk_rope_head_dim"]
    assert per_token == 2 * kv * 4 and fixed == 3 * 4 * (3 * 3 * H_KDA * DK + H_KDA * DK * DK)
    win = model.new_state(rollback_window=3)
    model.forward(ForwardBatch.build([(win, IDS)]))
    assert win.nbytes <= 37 * per_token + kimi_k3.state_bytes(model.cfg, 4, rollback_window=3)[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 4])
def test_state_bytes_are_exact_on_the_demo(dtype, window):
    """The planner's (per token, fixed) bytes are what a sequence of the demo model holds after T
    one-token forwards, T past the rollback window (KDA keeps 1 + window states, MLA one row a token,
    AttnRes nothing across tokens)."""
    per_token, fixed = check_state_bytes_exact("demo-kimi-k3", dtype, window, T=9)
    # 3 KDA layers of 2 x 16 x 16 fp32 states + 3-row conv tails (1 + window of them); 2 MLA layers
    assert fixed == 3 * 4 * (3 * 3 * 32 + 2 * 16 * 16) * (1 + window)
    assert per_token == 2 * (8 + 4) * (4 if dtype == "float32" else 2)


def test_llm_batch_equals_singles(ckpt):
    prompts = [prompt(n, seed=20 + n) for n in (3, 19, 8)]
    check_batch_equals_singles(ckpt, prompts, max_tokens=6, max_batch_tokens=16)


def test_bf16_checkpoint_runs_and_stays_close(tmp_path, ckpt, real_logits):
    """The writer's default: bf16 everywhere (experts included), A_log and dt_bias fp32."""
    cfg = kimi_k3.parse_config(k3demo.release_config(TC))
    k3demo.write_checkpoint(tmp_path, tensors=k3demo.random_tensors(cfg, seed=0))
    m = Checkpoint.open(tmp_path)
    assert m.store.info("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight").dtype == "BF16"
    assert m.store.info("language_model.model.layers.0.self_attn.A_log").dtype == "F32"
    bf = run(m.build("bfloat16"), [IDS])[0]
    ref = run(m.build("float32"), [IDS])[0]
    # bf16 keeps ~3 digits; a router near-tie may pick another expert for a token or two
    rows = (bf - ref).abs().amax(-1)
    assert bf.dtype == torch.float32 and rows.median() < 0.03 * ref.abs().max()
    assert (bf.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    print(
        f"kimi_k3 bf16 vs fp32 (same bf16 weights): median row err {rows.median():.3f}, max {rows.max():.2f}"
    )


# ----------------------------------------------------------------------------- tests: loading


def test_checkpoint_variants(tmp_path, ckpt, real_logits):
    raw = load_file(ckpt / "model.safetensors")
    config = (ckpt / "config.json").read_text()
    # vLLM's re-export: language_model.layers.* for language_model.model.layers.*
    renamed = {k.replace("language_model.model.layers.", "language_model.layers."): v for k, v in raw.items()}
    (tmp_path / "vllm").mkdir()
    save_file(renamed, tmp_path / "vllm" / "model.safetensors")
    (tmp_path / "vllm" / "config.json").write_text(config)
    assert torch.equal(run(Checkpoint.open(tmp_path / "vllm").build("float32"), [IDS])[0], real_logits)
    # a text-only export: no prefix, no wrapper (model_type kimi_linear with K3's fields)
    text_only = {k[len("language_model.") :]: v for k, v in raw.items() if k.startswith("language_model.")}
    (tmp_path / "text").mkdir()
    save_file(text_only, tmp_path / "text" / "model.safetensors")
    (tmp_path / "text" / "config.json").write_text(
        json.dumps({**json.loads(config)["text_config"], "eos_token_id": 2})
    )
    ck = Checkpoint.open(tmp_path / "text")
    assert ck.family is kimi_k3 and ck.cfg.eos_token_ids == (2,)
    assert torch.equal(run(ck.build("float32"), [IDS])[0], real_logits)
    # A_log's tail must be zero; the contract reports a missing tensor by its release name
    bad = dict(raw)
    bad["language_model.model.layers.1.self_attn.A_log"] = torch.ones(A_LOG_WIDTH)
    (tmp_path / "bad").mkdir()
    save_file(bad, tmp_path / "bad" / "model.safetensors")
    (tmp_path / "bad" / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match="A_log"):
        Checkpoint.open(tmp_path / "bad").build("float32")
    del bad["language_model.model.layers.4.block_sparse_moe.experts.5.w3.weight"]
    save_file(bad, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"missing: language_model\.model\.layers\.4\.block_sparse_moe\.experts\.5\.w3"
    ):
        Checkpoint.open(tmp_path / "bad").build("float32")


def test_mxfp4_experts_stay_packed_and_match_their_dequantized_model(tmp_path, monkeypatch):
    """The release format of the routed experts (compressed-tensors mxfp4-pack-quantized): loaded
    packed, run through the packed matmul, equal to the same model with the experts dequantized;
    the bytes one expert occupies in the file are the bytes `inspect` derives from the config."""
    from moesaic.weights.quant import QuantizedTensor

    tc = k3demo.DEMO_TEXT_CONFIG
    k3demo.write_checkpoint(tmp_path, tc, dtype=torch.float32, expert_format="mxfp4")
    ck = Checkpoint.open(tmp_path)
    e0 = "language_model.model.layers.2.block_sparse_moe.experts.0."
    assert {n for n in ck.store.names() if n.startswith(e0)} == {
        e0 + f"w{i}.weight_{s}" for i in (1, 2, 3) for s in ("packed", "scale")
    }
    assert (
        sum(ck.store.info(e0 + f"w{i}.weight_{s}").nbytes for i in (1, 2, 3) for s in ("packed", "scale"))
        == kimi_k3.expert_bytes(ck.cfg)
        == 3 * (32 * 16 + 32 * 1)
    )
    packed = ck.build("float32")
    assert isinstance(packed.layers[2].mlp.experts_out, QuantizedTensor)
    dense = Checkpoint.open(tmp_path).build("float32")
    for w in dense.layers:
        if isinstance(w.mlp, MoeWeights):
            w.mlp.experts_in = w.mlp.experts_in.dequantize(torch.float32)
            w.mlp.experts_out = w.mlp.experts_out.dequantize(torch.float32)
    ids = prompt(21, seed=30)
    err = max_err(run(packed, [ids])[0], run(dense, [ids])[0])
    print(f"kimi_k3 MXFP4 experts packed vs dequantized: {err:.2e}")
    assert err < 1e-5  # the fused CPU kernel sums its dot products in another fp32 order
    monkeypatch.setenv("MOESAIC_CPU_KERNELS", "0")  # the plain path dequantizes tiles: the very same numbers
    assert max_err(run(packed, [ids])[0], run(dense, [ids])[0]) == 0
    info = inspect_checkpoint(tmp_path)
    assert info["contract"] == "ok" and info["expert_format"] == "mxfp4"


def test_demo_entries(monkeypatch):
    """The demo list entries offered for moesaic.demo.DEMOS: written on first use in the release
    naming (+ MXFP4 experts), generating through the public API."""
    llm = moesaic.LLM("demo-kimi-k3-mxfp4", dtype="float32")
    assert llm.family is kimi_k3 and llm.cfg.expert_format == "mxfp4"
    out = llm.generate(["Hi"], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)


# ----------------------------------------------------------------------------- the released config


def released_config(quant_in_text: bool = False) -> dict:
    """config.json of moonshotai/Kimi-K3 as docs/families/kimi_k3.md cites it
    (fixture pinned to HF commit f831ab66814297da540d832a5235f8e904f29d06). The file itself was not
    reachable from here; this is rebuilt field by field from its published description."""
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "ignore": ["re:.*shared_experts.*"],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "weights": {
                    "num_bits": 4,
                    "group_size": 32,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "group",
                    "scale_dtype": "torch.uint8",
                },
            }
        },
    }
    text = {
        "model_type": "kimi_linear",
        "hidden_size": 7168,
        "num_hidden_layers": 93,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "vocab_size": 163840,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5,
        "dtype": "bfloat16",
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 33792,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "kda_layers": [i for i in range(1, 92) if i % 4],
            "full_attn_layers": list(range(4, 93, 4)) + [93],
        },
    }
    top = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {},
    }
    if quant_in_text:
        text["quantization_config"] = quant
    else:
        top["quantization_config"] = quant
    return top


def test_inspect_released_config_alone(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(released_config()))
    assert cli_main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    mla = list(range(3, 92, 4)) + [92]
    assert info["family"] == "kimi_k3" and info["model_type"] == "kimi_k3" and info["num_layers"] == 93
    assert info["mla_layers"] == mla and len(mla) == 24 and 91 in mla and 92 in mla
    assert len(info["kda_layers"]) == 69 and 0 in info["kda_layers"]
    sched = info["layer_schedule"]
    assert (
        sched[0] == "kda+mlp" and sched[3] == "mla+moe" and sched[92] == "mla+moe" and sched[1] == "kda+moe"
    )
    assert sum(s.startswith("mla") for s in sched) == 24
    assert info["expert_format"] == "mxfp4" and info["expert_bytes"] == 17_547_264
    assert info["expert_bytes_bf16"] == 3 * 3584 * 3072 * 2
    assert info["state_bytes_per_token"] == 27_648  # 24 MLA layers x 576 bf16 values
    assert info["kda_state_bytes_per_layer"] == 4 * (96 * 128 * 128 + 3 * 3 * 12288)
    assert info["state_bytes_fixed_per_sequence"] == 69 * info["kda_state_bytes_per_layer"]
    assert info["attn_res_bank_entries"] == 8  # archives at layers 0, 12, ..., 84
    assert info["experts"] == 896 and info["experts_per_token"] == 16
    assert round(info["params_total"] / 1e12, 2) == 2.78  # "2.78T total" (text model)
    print(
        "released K3:",
        {
            k: info[k]
            for k in (
                "num_layers",
                "expert_bytes",
                "state_bytes_per_token",
                "state_bytes_fixed_per_sequence",
                "params_total",
            )
        },
    )
    # the quantization block may sit in text_config too
    assert kimi_k3.parse_config(released_config(quant_in_text=True)).expert_format == "mxfp4"


def test_released_config_errors():
    raw = released_config()
    shifted = json.loads(json.dumps(raw))  # the lists read 0-based: layer 93 would not exist
    shifted["text_config"]["linear_attn_config"]["full_attn_layers"] = [i - 1 for i in range(4, 93, 4)] + [92]
    shifted["text_config"]["linear_attn_config"]["kda_layers"] = [i for i in range(0, 91) if (i + 1) % 4]
    with pytest.raises(ConfigError, match="kda_layers.*1-based"):
        kimi_k3.parse_config(shifted)
    no_lists = json.loads(json.dumps(raw))
    lac = no_lists["text_config"]["linear_attn_config"]
    del lac["kda_layers"], lac["full_attn_layers"]
    with pytest.raises(ConfigError, match="kda_layers"):
        kimi_k3.parse_config(no_lists)
    for key, value, match in [
        ("attn_res_block_size", 0, "attn_res_block_size"),
        ("mla_use_nope", False, "mla_use_nope"),
        ("hidden_act", "gelu", "hidden_act"),
        ("routed_expert_hidden_size", None, "routed_expert_hidden_size"),
    ]:
        bad = json.loads(json.dumps(raw))
        bad["text_config"][key] = value
        with pytest.raises(ConfigError, match=match):
            kimi_k3.parse_config(bad)
    assert family_for(raw, "hf")[0] is kimi_k3
    # absent switches are off (the Kimi Linear law and gates), not the release's values
    bare = json.loads(json.dumps(raw))
    for k in ("gate_lower_bound", "use_full_rank_gate"):
        del bare["text_config"]["linear_attn_config"][k]
    cfg = kimi_k3.parse_config(bare)
    assert cfg.kda_dims.lower_bound is None and not cfg.kda_dims.full_rank_gate
    assert kimi_k3.parse_config(raw).kda_dims.lower_bound == -5.0

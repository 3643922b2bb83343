"""KDA (moesaic/layers/kda.py) against itself and against transformers' glm5_next / kimi_linear."""

import pytest
import torch
from transformers import DynamicCache
from transformers.models.glm5_next import modeling_glm5_next as hf_glm
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from moesaic.errors import CheckpointError
from moesaic.layers.kda import (
    KdaDims,
    KdaState,
    delta_rule_chunked,
    delta_rule_recurrent,
    kda_attend,
    kda_gate,
    kda_mixer,
    l2norm,
)
from moesaic.models.parts import bind_kda, kda_shapes
from moesaic.weights.bind import Tensors

HIDDEN, HEADS, HEAD_DIM, KERNEL = 32, 3, 8, 4
TOL = 1e-5


def err(a, ref):
    """Max abs difference, relative once |ref| exceeds 1: block outputs reach ~3 and the 8-wide
    head RMSNorm amplifies fp32 rounding (HF's own chunked and recurrent forms differ by ~1e-5)."""
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def random_core_inputs(n, lower_bound, seed):
    gen = torch.Generator().manual_seed(seed)
    H, D = HEADS, 16
    q, k, v = (torch.randn(n, H, D, generator=gen) for _ in range(3))
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    g = kda_gate(
        2 * torch.randn(n, H * D, generator=gen), A_log, torch.randn(H * D, generator=gen), D, lower_bound
    )
    beta = torch.rand(n, H, generator=gen)
    S0 = torch.randn(H, D, D, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("n", [1, 5, 16, 37])
def test_chunked_matches_recurrent_and_hf_functions(n, lower_bound):
    q, k, v, g, beta, S0 = random_core_inputs(n, lower_bound, seed=n)
    qn = (l2norm(q) * q.shape[-1] ** -0.5).transpose(0, 1)
    kn = l2norm(k).transpose(0, 1)
    o_chunk, S_chunk = delta_rule_chunked(qn, kn, v.transpose(0, 1), g.transpose(0, 1), beta.T, S0, 16)
    o_chunk = o_chunk.transpose(0, 1)
    o_rec, S_rec, _ = delta_rule_recurrent(qn, kn, v.transpose(0, 1), g.transpose(0, 1), beta.T, S0)
    o_rec = o_rec.transpose(0, 1)
    assert (o_chunk - o_rec).abs().max() < TOL
    assert (S_chunk - S_rec).abs().max() < TOL
    # kda_attend on the CPU: the token recurrence for every row, the same bits as calling it
    o_att, S_att, _ = kda_attend(q, k, v, g, beta, S0, chunk_size=16)
    assert torch.equal(o_att, o_rec.contiguous()) and torch.equal(S_att, S_rec)

    # transformers' torch fallbacks (batch of one), with the l2norm inside the kernel
    args = (q[None], k[None], v[None], g[None], beta[None])
    o_hf, S_hf = hf_glm.chunk_kimi_delta_attention(
        *args, chunk_size=16, initial_state=S0[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert (o_chunk - o_hf[0]).abs().max() < TOL
    assert (S_chunk - S_hf[0]).abs().max() < TOL
    o_hf, S_hf = hf_glm.recurrent_kimi_delta_attention(
        *args, initial_state=S0[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert (o_rec - o_hf[0]).abs().max() < TOL
    assert (S_rec - S_hf[0]).abs().max() < TOL


# ----------------------------------------------------------------------------- whole block vs HF


def hf_module(family, seed=0):
    torch.manual_seed(seed)
    if family == "glm5_next":
        cfg = Glm5NextTextConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=1,
            layer_types=["linear_attention"],
            mlp_layer_types=["dense"],
            num_attention_heads=4,
            num_key_value_heads=4,
            linear_num_heads=HEADS,
            linear_head_dim=HEAD_DIM,
            linear_conv_kernel_dim=KERNEL,
        )
        module = hf_glm.Glm5NextTextLinearAttention(cfg, 0)
        assert cfg.linear_lower_bound == -5.0
    else:
        cfg = KimiLinearConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=4,
            linear_attn_config={
                "head_dim": HEAD_DIM,
                "num_heads": HEADS,
                "short_conv_kernel_size": KERNEL,
                "kda_layers": [1],
                "full_attn_layers": [],
            },
        )
        module = KimiLinearDeltaAttention(cfg, 0)
    assert cfg.layer_types == ["linear_attention"]
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape))
            elif name == "conv1d.weight":
                p.copy_(0.5 * torch.randn(p.shape))
            else:
                p.copy_(0.3 * torch.randn(p.shape))
    return module.eval(), cfg


def dims_for(family, **overrides):
    return KdaDims.for_variant(
        family, HIDDEN, HEADS, HEAD_DIM, conv_kernel=KERNEL, norm_eps=1e-5, **overrides
    )


def ours(module, dims):
    return bind_kda(Tensors(dict(module.named_parameters())), dims)


def hf_state(cache):
    layer = cache.layers[0]
    return KdaState(
        conv=layer.conv_states[0][0, :, 1:].T.float(), recurrent=layer.recurrent_states[0][0].float()
    )


def run_in_pieces(w, dims, x, cuts):
    state, outs = None, []
    for a, b in zip([0, *cuts], [*cuts, x.shape[0]]):
        out, state, _ = kda_mixer(x[a:b], w, dims, state)
        outs.append(out)
    return torch.cat(outs), state


@pytest.mark.parametrize("family", ["glm5_next", "kimi_linear"])
@torch.no_grad()
def test_block_matches_transformers(family):
    module, cfg = hf_module(family)
    dims = dims_for(family, chunk_size=16)
    w = ours(module, dims)
    T, steps = 45, 3
    x = torch.randn(T + steps, HIDDEN)

    # full prefill, no cache
    ref = module(x[None, :T])[0]
    out, state, _ = kda_mixer(x[:T], w, dims)
    err_prefill = err(out, ref)
    assert err_prefill < TOL

    # prefill + decode with transformers' cache; the states match too
    cache = DynamicCache(config=cfg)
    ref_pre = module(x[None, :T], cache_params=cache)[0]
    assert err(ref_pre, ref) < TOL
    errs = []
    for t in range(T, T + steps):
        ref_t = module(x[None, t : t + 1], cache_params=cache)[0]
        out_t, state, _ = kda_mixer(x[t : t + 1], w, dims, state)
        errs.append(err(out_t, ref_t))
    err_state = max(err(state.conv, hf_state(cache).conv), err(state.recurrent, hf_state(cache).recurrent))
    assert max(errs) < TOL and err_state < TOL

    # chunked continuation: odd cuts across the 16-token chunk borders, a 1-token piece in the
    # middle (recurrent path) and pieces shorter than the conv kernel
    ref_all = module(x[None])[0]
    out_split, state_split = run_in_pieces(w, dims, x, [13, 14, 31, 33, 47])
    err_split = err(out_split, ref_all)
    assert err_split < TOL
    assert err(state_split.recurrent, state.recurrent) < TOL
    assert err(state_split.conv, state.conv) < 1e-6
    print(
        f"{family}: prefill {err_prefill:.2e} decode {max(errs):.2e} state {err_state:.2e} split {err_split:.2e}"
    )


@torch.no_grad()
def test_gate_without_lower_bound_fails_glm_oracle():
    module, _ = hf_module("glm5_next", seed=1)
    x = torch.randn(40, HIDDEN)
    ref = module(x[None])[0]
    real = kda_mixer(x, ours(module, dims_for("glm5_next")), dims_for("glm5_next"))[0]
    broken_dims = dims_for("glm5_next", lower_bound=None)  # Kimi Linear's law on a GLM layer
    broken = kda_mixer(x, ours(module, broken_dims), broken_dims)[0]
    err_real, err_broken = err(real, ref), err(broken, ref)
    print(f"real {err_real:.2e} broken {err_broken:.2e} (|ref| max {ref.abs().max():.2e})")
    assert err_real < TOL
    assert err_broken > 1e-2


@torch.no_grad()
def test_k3_layout_full_rank_gate_and_wide_A_log():
    """K3 shape of the same math: release names (q/k/v_conv1d, A_log on self_attn), A_log wider
    than the heads with a zero tail, and a full-rank g_proj equal to g_b_proj @ g_a_proj, must
    reproduce the glm5_next oracle."""
    module, _ = hf_module("glm5_next", seed=2)
    p = dict(module.named_parameters())
    C = HEADS * HEAD_DIM
    conv = p["conv1d.weight"]
    release = {
        "q_proj.weight": p["q_proj.weight"],
        "k_proj.weight": p["k_proj.weight"],
        "v_proj.weight": p["v_proj.weight"],
        "q_conv1d.weight": conv[:C],
        "k_conv1d.weight": conv[C : 2 * C],
        "v_conv1d.weight": conv[2 * C :],
        "f_a_proj.weight": p["forget_gate.f_a_proj.weight"],
        "f_b_proj.weight": p["forget_gate.f_b_proj.weight"],
        "dt_bias": p["forget_gate.dt_bias"],
        "A_log": torch.cat([p["forget_gate.A_log"], torch.zeros(5)]),
        "b_proj.weight": p["b_proj.weight"],
        "g_proj.weight": p["g_b_proj.weight"] @ p["g_a_proj.weight"],
        "o_norm.weight": p["o_norm.weight"],
        "o_proj.weight": p["o_proj.weight"],
    }
    dims = dims_for("kimi_k3", chunk_size=16)
    shapes = kda_shapes(dims, a_log_shape=(HEADS + 5,))
    assert {n: tuple(t.shape) for n, t in release.items()} == shapes
    w = bind_kda(Tensors(release), dims)
    x = torch.randn(37, HIDDEN)
    ref = module(x[None])[0]
    out, _, _ = kda_mixer(x, w, dims)
    assert err(out, ref) < TOL

    # a non-zero tail is not an export quirk: refuse it; so is a missing tensor
    bad = {**release, "A_log": torch.cat([p["forget_gate.A_log"], torch.ones(5)])}
    with pytest.raises(CheckpointError, match="A_log"):
        bind_kda(Tensors(bad), dims)
    with pytest.raises(CheckpointError, match="g_proj"):
        bind_kda(Tensors({k: v for k, v in release.items() if k != "g_proj.weight"}), dims)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_snapshots_restore_bit_exactly(lower_bound):
    """The core: restore the state from k tokens back, re-feed those k tokens with the same
    snapshot window: outputs and final state repeat bit for bit."""
    q, k, v, g, beta, S0 = random_core_inputs(30, lower_bound, seed=7)
    o, S_end, snaps = kda_attend(q, k, v, g, beta, S0, chunk_size=16, snapshot_last=6)
    assert snaps.shape == (6, *S0.shape) and torch.equal(snaps[-1], S_end)
    for n_back in range(1, 7):
        start = (
            snaps[5 - n_back]
            if n_back < 6
            else kda_attend(q[:24], k[:24], v[:24], g[:24], beta[:24], S0, 16)[1]
        )
        tail = slice(30 - n_back, 30)
        again, S_again, _ = kda_attend(
            q[tail], k[tail], v[tail], g[tail], beta[tail], start, 16, snapshot_last=n_back
        )
        assert torch.equal(again, o[tail]) and torch.equal(S_again, S_end), n_back


@pytest.mark.parametrize("family", ["glm5_next", "kimi_linear"])
@torch.no_grad()
def test_mixer_snapshots_roll_back(family):
    """The block: each snapshot (conv tail + recurrent state) is the state after its token, and
    re-feeding from it repeats the outputs. Only the projections' GEMMs (whose rounding depends
    on the row count) keep this from being bitwise, so the bound is 1e-6."""
    module, _ = hf_module(family, seed=3)
    dims = dims_for(family, chunk_size=16)
    w = ours(module, dims)
    assert KdaState.zeros(dims).nbytes == KdaState.nbytes_for(dims)
    x = torch.randn(26, HIDDEN)
    _, prefix_state, _ = kda_mixer(x[:20], w, dims)
    before = prefix_state.clone()
    drafted = x[20:26]
    out, end_state, snaps = kda_mixer(drafted, w, dims, prefix_state, snapshot_last=6)
    assert torch.equal(prefix_state.recurrent, before.recurrent) and torch.equal(
        prefix_state.conv, before.conv
    )
    assert len(snaps) == 6
    worst_snap = 0.0
    for i, snap in enumerate(snaps):  # the state after token 20 + i, from a chunked prefill
        _, direct, _ = kda_mixer(x[: 21 + i], w, dims)
        worst_snap = max(worst_snap, err(snap.conv, direct.conv), err(snap.recurrent, direct.recurrent))
    assert worst_snap < TOL
    worst = 0.0
    for n_back in range(1, 7):
        restored = snaps[5 - n_back].clone() if n_back < 6 else prefix_state.clone()
        again, state, _ = kda_mixer(drafted[6 - n_back :], w, dims, restored, snapshot_last=n_back)
        worst = max(
            worst,
            err(again, out[6 - n_back :]),
            err(state.recurrent, end_state.recurrent),
            err(state.conv, end_state.conv),
        )
    print(f"{family}: snapshot vs prefill {worst_snap:.2e}, rollback re-feed {worst:.2e}")
    assert worst < 1e-6
    # and the speculative (token by token) path agrees with the oracle's chunked prefill
    assert err(out, module(x[None])[0][20:]) < TOL

"""Nemotron-H Mamba-2 mixer against transformers' `nemotron_h` torch path (fp32, tiny config)."""

import dataclasses
import importlib.util
import math

import pytest
import torch
from test_nemotron_h import tiny_config as nemotron_tiny_config
from transformers.cache_utils import DynamicCache
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from moesaic.layers.mamba2 import Mamba2State, Mamba2Weights, mamba2_mixer
from moesaic.models import nemotron_h
from moesaic.weights.bind import Tensors

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def torch_path_only():
    # transformers picks these CUDA kernels up automatically; the oracle must be its torch path.
    for pkg in ("mamba_ssm", "causal_conv1d", "kernels"):
        assert importlib.util.find_spec(pkg) is None, (
            f"{pkg} is installed; the oracle would not be the torch path"
        )


def tiny_config():
    """test_nemotron_h's tiny shape (8 Mamba heads x 16, 2 groups, state 16, conv 4, chunk 8), one
    Mamba-2 layer."""
    return nemotron_tiny_config(layers_block_type=["linear_attention"])


def build(seed=0, dt_bias=None):
    """A HF mixer with every tensor random, and the same layer as moesaic weights + dims (bound and
    parsed as the Nemotron-H family does: its names, its config reader)."""
    cfg = tiny_config()
    torch.manual_seed(seed)
    m = hf.NemotronHMamba2Mixer(cfg, layer_idx=0).float().eval()
    H = cfg.mamba_num_heads
    with torch.no_grad():
        m.in_proj.weight.normal_(0, 0.1)
        m.in_proj.weight[-H:].normal_(0, 0.02)  # the dt rows: keep softplus(dt) above the floor unless asked
        m.conv1d.weight.normal_(0, 0.3)
        m.conv1d.bias.normal_(0, 0.1)
        m.A_log.copy_(torch.log(torch.empty(H).uniform_(1, 16)))
        m.D.normal_(0, 1)
        if dt_bias is None:  # inverse softplus of dt drawn log-uniformly in [1e-2, 1e-1]
            dt = torch.exp(torch.empty(H).uniform_(math.log(1e-2), math.log(1e-1)))
            m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:
            m.dt_bias.fill_(dt_bias)
        m.norm.weight.copy_(1 + 0.2 * torch.randn(H * cfg.mamba_head_dim))
        m.out_proj.weight.normal_(0, 0.1)
    t = Tensors({k: v.detach().clone() for k, v in m.state_dict().items()})
    w = nemotron_h.bind_mamba2(t)
    t.check_all_taken()
    return cfg, m, w, nemotron_h.parse_config(cfg.to_dict()).mamba_dims


def tokens(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g)


def softplus_dt(m, x):
    dt = torch.nn.functional.linear(x, m.in_proj.weight)[:, -m.num_heads :]
    return torch.nn.functional.softplus(dt + m.dt_bias)


def err(a, b):
    return (a.float() - b.float()).abs().max().item()


def run_pieces(x, w, dims, cuts, state=None):
    """Feed x in pieces of the given lengths, then one token at a time for the rest."""
    state = state or Mamba2State.zeros(dims)
    ys, s = [], 0
    for c in list(cuts) + [1] * (x.shape[0] - sum(cuts)):
        y, state, _ = mamba2_mixer(x[s : s + c], w, dims, state)
        ys.append(y)
        s += c
    return torch.cat(ys), state


@pytest.mark.parametrize("T", [1, 7, 8, 21])
def test_prefill_matches_transformers(T):
    cfg, m, w, dims = build()
    x = tokens(T)
    with torch.no_grad():
        ref = m(x[None])[0]
    y, state, snaps = mamba2_mixer(x, w, dims, Mamba2State.zeros(dims))
    e = err(y, ref)
    print(f"prefill T={T}: max abs err {e:.2e} (|ref| max {ref.abs().max():.2f})")
    assert y.shape == (T, 64) and snaps == []
    assert state.conv.shape == (dims.conv_dim, 3) and state.ssm.shape == (8, 16, 16)
    assert e < TOL


def test_chunked_prefill_then_decode_equals_full_prefill():
    _, _, w, dims = build()
    x = tokens(25)
    full, s_full, _ = mamba2_mixer(x, w, dims, Mamba2State.zeros(dims))
    # 5 + 9 + 7 crosses the chunk borders at 8 and 16 at odd offsets; then 4 decode steps
    pieces, s_pieces = run_pieces(x, w, dims, [5, 9, 7])
    e, es = err(pieces, full), err(s_pieces.ssm, s_full.ssm)
    print(f"chunked 5+9+7 + 4 decodes vs full: out {e:.2e}, ssm state {es:.2e}")
    assert e < TOL and es < TOL
    assert err(s_pieces.conv, s_full.conv) < 1e-6  # the conv tail: the last K-1 raw inputs
    # a piece shorter than K-1 keeps the older tail entries from the piece before
    short, s_short = run_pieces(x[:12], w, dims, [10, 2])
    _, s_12, _ = mamba2_mixer(x[:12], w, dims, Mamba2State.zeros(dims))
    assert err(short, full[:12]) < TOL and err(s_short.conv, s_12.conv) < 1e-6


def test_cached_prefill_and_decode_match_transformers_cache():
    cfg, m, w, dims = build()
    x = tokens(20)
    assert softplus_dt(m, x).min() > cfg.time_step_min  # HF decode does not clamp: stay clear of the floor
    cache = DynamicCache(config=cfg)
    refs = []
    with torch.no_grad():
        refs.append(m(x[None, :5], cache_params=cache)[0])  # prefill
        refs.append(m(x[None, 5:14], cache_params=cache)[0])  # second prefill continues from the cache
        for t in range(14, 20):
            refs.append(m(x[None, t : t + 1], cache_params=cache)[0])  # decode steps
    ref = torch.cat(refs)
    y, state = run_pieces(x, w, dims, [5, 9])
    e = err(y, ref)
    es = err(state.ssm, cache.layers[0].recurrent_states[0][0])
    ec = err(state.conv, cache.layers[0].conv_states[0][0, :, 1:])  # HF keeps K inputs, moesaic K-1
    print(f"HF cached prefill 5 + 9 + 6 decodes: out {e:.2e}, ssm {es:.2e}, conv {ec:.2e}")
    assert e < TOL and es < TOL and ec == 0.0


def test_dt_floor_prefill_and_decode_agree():
    # dt_bias = -8: softplus ~ 3.4e-4, below time_step_min = 1e-3 on every head and token.
    cfg, m, w, dims = build(dt_bias=-8.0)
    x = tokens(16)
    assert softplus_dt(m, x).max() < cfg.time_step_min
    full, _, _ = mamba2_mixer(x, w, dims, Mamba2State.zeros(dims))
    with torch.no_grad():
        hf_full = m(x[None])[0]
    assert err(full, hf_full) < TOL  # HF prefill clamps too

    decoded, _ = run_pieces(x, w, dims, [6])
    e = err(decoded[6:], full[6:])
    print(f"dt below floor: moesaic prefill vs decode {e:.2e}")
    assert e < TOL

    # broken twin: the decode steps without the clamp (what HF's decode does) disagree
    ys, state = [], Mamba2State.zeros(dims)
    y, state, _ = mamba2_mixer(x[:6], w, dims, state)
    unclamped = dataclasses.replace(dims, dt_min=0.0)
    for t in range(6, 16):
        y, state, _ = mamba2_mixer(x[t : t + 1], w, unclamped, state)
        ys.append(y)
    twin = torch.cat(ys)
    e_twin = err(twin, full[6:])
    # ... and the twin is exactly HF's cached decode, which is why HF's decode differs from its prefill
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        m(x[None, :6], cache_params=cache)
        hf_dec = torch.cat([m(x[None, t : t + 1], cache_params=cache)[0] for t in range(6, 16)])
    print(
        f"broken twin vs prefill {e_twin:.2e}; twin vs HF decode {err(twin, hf_dec):.2e}; "
        f"HF decode vs HF prefill {err(hf_dec, hf_full[6:]):.2e}"
    )
    assert e_twin > 100 * TOL
    assert err(twin, hf_dec) < TOL


def test_snapshot_rollback_and_replay():
    # Replaying after a rollback reproduces the outputs up to GEMM rounding only: CPU GEMMs round a
    # row differently depending on how many rows share the call, so bitwise equality across
    # different batchings is not a property any engine has.
    _, _, w, dims = build()
    x = tokens(16)
    _, s0, _ = mamba2_mixer(x[:10], w, dims, Mamba2State.zeros(dims))
    s0_copy = s0.clone()
    k = 6  # a verify window: 6 tokens, a snapshot after each
    y, s_end, snaps = mamba2_mixer(x[10:], w, dims, s0, snapshot_last=k)
    assert len(snaps) == k
    assert torch.equal(s0.ssm, s0_copy.ssm) and torch.equal(s0.conv, s0_copy.conv)  # input state untouched
    assert torch.equal(snaps[-1].ssm, s_end.ssm) and torch.equal(snaps[-1].conv, s_end.conv)
    assert snaps[-1].ssm.data_ptr() != s_end.ssm.data_ptr()  # snapshots do not alias the live state
    # the snapshots are the states a token-by-token decode passes through (off by one: errors ~1e-3)
    s, e_snap = s0, 0.0
    for i in range(k):
        _, s, _ = mamba2_mixer(x[10 + i : 11 + i], w, dims, s)
        e_snap = max(e_snap, err(s.ssm, snaps[i].ssm), err(s.conv, snaps[i].conv))
    e_out = e_state = 0.0
    for r in range(1, k + 1):  # forget the last r tokens, then feed them again
        restored = snaps[-1 - r] if r < k else s0
        y2, s2, _ = mamba2_mixer(x[16 - r :], w, dims, restored.clone(), snapshot_last=r)
        e_out = max(e_out, err(y2, y[-r:]))
        e_state = max(e_state, err(s2.ssm, s_end.ssm), err(s2.conv, s_end.conv))
    print(f"snapshots vs decode states {e_snap:.2e}; rollback+replay: out {e_out:.2e}, state {e_state:.2e}")
    assert e_snap < 1e-6 and e_out < TOL and e_state < 1e-6
    # a partial snapshot window: only the last 2 of 6 tokens leave snapshots
    y3, s3, snaps3 = mamba2_mixer(x[10:], w, dims, s0, snapshot_last=2)
    assert len(snaps3) == 2 and err(y3, y) < TOL and err(snaps3[0].ssm, snaps[-2].ssm) < 1e-6
    with pytest.raises(ValueError):
        mamba2_mixer(x[10:12], w, dims, s0, snapshot_last=3)


def test_state_bytes_and_bf16_weights():
    _, _, w, dims = build()
    st = Mamba2State.zeros(dims)
    assert st.nbytes == dims.state_nbytes == 4 * (dims.conv_dim * 3 + 8 * 16 * 16)
    x = tokens(21)
    ref, _, _ = mamba2_mixer(x, w, dims, st)
    w16 = Mamba2Weights(
        **{
            f.name: (None if getattr(w, f.name) is None else getattr(w, f.name).bfloat16())
            for f in dataclasses.fields(Mamba2Weights)
        }
    )
    y, s, _ = mamba2_mixer(x.bfloat16(), w16, dims, st)
    assert y.dtype == torch.bfloat16 and s.ssm.dtype == torch.float32 and s.conv.dtype == torch.float32
    e = err(y, ref)
    print(f"bf16 weights vs fp32: {e:.2e} (|ref| max {ref.abs().max():.2f})")
    assert e < 0.05 * ref.abs().max().item()
    y1, _, _ = mamba2_mixer(x[:0], w, dims, st)
    assert y1.shape == (0, 64)

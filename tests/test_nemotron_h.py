"""Nemotron-H against transformers `nemotron_h` (the oracle), plain and latent MoE, on tiny
checkpoints that transformers itself saves; plus the dt convention, rollback, namings and
`inspect` on the released shapes. Max abs errors are printed (-s)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import math
from functools import partial

import pytest
import torch
import transformers
from helpers import (
    check_batch_equals_singles,
    check_greedy_matches_transformers,
    check_state_bytes_exact,
    max_err,
    mixed_batch_err,
    random_ids,
    randomize_,
    run,
)

from moesaic.cache.batch import ForwardBatch
from moesaic.cli import main as cli_main
from moesaic.demo import ensure_demo
from moesaic.errors import CheckpointError, ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.models import Checkpoint, nemotron_h
from moesaic.weights.contract import to_checkpoint
from moesaic.weights.store import save_safetensors

TOL = 1e-5
VOCAB = 101
prompt = partial(random_ids, vocab=VOCAB)
# every layer kind, the MoE twice, Mamba-2 twice
LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]


@pytest.fixture(scope="module", autouse=True)
def torch_path_only():
    # transformers picks these CUDA kernels up automatically; the oracle must be its torch path.
    for pkg in ("mamba_ssm", "causal_conv1d"):
        assert importlib.util.find_spec(pkg) is None, (
            f"{pkg} is installed; the oracle would not be the torch path"
        )


def tiny_config(latent=None, **over):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        layers_block_type=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=latent,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        eos_token_id=2,
    )
    kw.update(over)
    return transformers.NemotronHConfig(**kw)


def inv_softplus(y):
    return y + torch.log(-torch.expm1(-y))


def build_hf(latent=None, seed=1, dt=None, **over):
    """A transformers model with every tensor random, constants included: norms, router, correction
    bias, A_log, D, dt_bias. dt: the softplus(dt) each Mamba head sits at (default log-uniform in
    [0.01, 0.1], clear of the 1e-3 floor); the dt rows of in_proj are scaled down so that it stays there."""
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(tiny_config(latent, **over)).eval()
    randomize_(model, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for block in model.model.layers:
            m = block.mixer
            if hasattr(m, "gate"):  # a buffer, which randomize_ does not reach
                m.gate.e_score_correction_bias.copy_(
                    0.1 * torch.randn(m.gate.e_score_correction_bias.shape, generator=g)
                )
            if hasattr(m, "A_log"):
                H = m.num_heads
                m.A_log.copy_(torch.log(torch.empty(H).uniform_(1, 8, generator=g)))
                m.in_proj.weight[-H:] *= 0.05
                target = (
                    torch.exp(torch.empty(H).uniform_(math.log(1e-2), math.log(1e-1), generator=g))
                    if dt is None
                    else torch.full((H,), dt)
                )
                m.dt_bias.copy_(inv_softplus(target))
    return model


@pytest.fixture(scope="module", params=["plain", "latent"])
def hf_ckpt(request, tmp_path_factory):
    latent = 32 if request.param == "latent" else None
    model = build_hf(latent)
    path = tmp_path_factory.mktemp(f"nemotron_h_{request.param}")
    model.save_pretrained(path)
    return model, path, request.param


@pytest.fixture(scope="module")
def ours(hf_ckpt):
    return Checkpoint.open(hf_ckpt[1]).build("float32")


def hf_cached(hf, ids, first):
    """transformers: a prefill of ids[:first], then one cached decode step per token."""
    with torch.no_grad():
        out = hf(torch.tensor([ids[:first]]), use_cache=True)
        ref, cache = [out.logits[0, -1]], out.past_key_values
        for t in ids[first:]:
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref.append(out.logits[0, -1])
    return torch.stack(ref)


# ---------------------------------------------------------------- against transformers


def test_prefill_logits_match_transformers(hf_ckpt, ours):
    hf, _, kind = hf_ckpt
    ids = prompt(37)  # 4 full SSD chunks of 8 and a partial one
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got, _ = run(ours, [ids])
    err = max_err(got, ref)
    print(f"nemotron_h[{kind}] prefill max abs err {err:.2e} (|logit| max {ref.abs().max():.2f})")
    assert got.shape == ref.shape and err < TOL


def test_cached_decode_matches_transformers_cache(hf_ckpt, ours):
    hf, _, kind = hf_ckpt
    ids = prompt(40, seed=1)
    ref = hf_cached(hf, ids, 19)
    got, _ = run(ours, [ids[:19]] + [[t] for t in ids[19:]], logits="last")
    err = max_err(got, ref)
    print(f"nemotron_h[{kind}] cached decode max abs err {err:.2e}")
    assert err < TOL


def test_chunked_prefill_across_ssd_chunk_borders(hf_ckpt, ours):
    hf, _, kind = hf_ckpt
    ids = prompt(45, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    cuts = [0, 5, 14, 15, 27, 40, 45]  # pieces start mid-chunk and cross the borders at 8, 16, 24, 32, 40
    got, st = run(ours, [ids[a:b] for a, b in zip(cuts, cuts[1:])])
    err = max_err(got, ref)
    print(f"nemotron_h[{kind}] chunked prefill max abs err {err:.2e}")
    assert err < TOL and st.num_tokens == 45


def test_greedy_tokens_match_transformers_generate(hf_ckpt):
    hf, path, _ = hf_ckpt
    ids = prompt(11, seed=3)
    check_greedy_matches_transformers(hf, path, ids, 20)


def test_batch_of_different_lengths_equals_singles(hf_ckpt):
    prompts = [prompt(n, seed=10 + n) for n in (5, 19, 30, 2)]
    check_batch_equals_singles(hf_ckpt[1], prompts, max_tokens=10, max_batch_tokens=13)


def test_mixed_prefill_and_decode_in_one_forward(ours):
    a, b = prompt(12, seed=5), prompt(9, seed=6)
    assert mixed_batch_err(ours, a, b) < TOL


# ---------------------------------------------------------------- the dt convention


def mamba_softplus_dt(hf, ids):
    """softplus(dt + dt_bias) that every Mamba-2 mixer of `hf` sees on `ids`."""
    seen = []

    def hook(mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        dt = torch.nn.functional.linear(x, mod.in_proj.weight)[..., -mod.num_heads :]
        seen.append(torch.nn.functional.softplus(dt + mod.dt_bias))

    handles = [
        b.mixer.register_forward_pre_hook(hook, with_kwargs=True)
        for b in hf.model.layers
        if b.block_type == "linear_attention"
    ]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return torch.cat([s.flatten() for s in seen])


def test_dt_below_the_floor_prefill_and_decode_agree(tmp_path):
    # Every head sits at softplus(dt) ~ 0.01, below time_step_min = 0.05: the clamp decides dt.
    hf = build_hf(latent=32, dt=0.01, time_step_min=0.05)
    hf.save_pretrained(tmp_path)
    ours = Checkpoint.open(tmp_path).build("float32")
    ids = prompt(30, seed=4)
    assert mamba_softplus_dt(hf, ids).max() < 0.05
    with torch.no_grad():
        hf_full = hf(torch.tensor([ids])).logits[0]
    full, _ = run(ours, [ids])
    decoded, _ = run(ours, [ids[:12]] + [[t] for t in ids[12:]], logits="last")
    hf_dec = hf_cached(hf, ids, 12)
    e_prefill, e_ours = max_err(full, hf_full), max_err(decoded, full[11:])
    e_hf = max_err(hf_dec, hf_full[11:])
    print(
        f"dt below floor: moesaic prefill vs HF prefill {e_prefill:.2e}; moesaic decode vs its prefill "
        f"{e_ours:.2e}; HF decode vs HF prefill {e_hf:.2e} (HF clamps in prefill only)"
    )
    assert e_prefill < TOL  # transformers' prefill clamps as moesaic does
    assert e_ours < TOL  # moesaic's decode clamps too, so it continues its prefill exactly
    assert e_hf > 100 * TOL  # the floor matters here: an unclamped decode (transformers') departs


# ---------------------------------------------------------------- state: rollback, snapshots, bytes


def test_chunked_prefill_decode_and_rollback_agree_with_full_prefill(ours):
    W = 4
    ids = prompt(27, seed=7)
    other = prompt(3, seed=8)
    full, _ = run(ours, [ids])
    st = ours.new_state(rollback_window=W)
    got, _ = run(ours, [ids[:13], ids[13:21]] + [[t] for t in ids[21:]], logits="all", state=st)
    assert max_err(got, full) < TOL and st.num_tokens == 27  # chunked prefill + decode == full prefill

    st.rollback(W)  # the whole window after single-token steps
    again = ours.forward(ForwardBatch.build([(st, ids[23:])], logits="all"))  # a verify-sized chunk
    st.rollback(3)
    changed = ours.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(ours, [ids[:24] + other])
    e_again, e_changed = max_err(again, full[23:]), max_err(changed, fresh[24:])

    # a chunk longer than the window still keeps the whole window
    st2 = ours.new_state(rollback_window=W)
    ours.forward(ForwardBatch.build([(st2, ids[:20])]))
    st2.rollback(W)
    tail = ours.forward(ForwardBatch.build([(st2, ids[16:20])], logits="all"))
    e_tail = max_err(tail, full[16:20])
    print(f"rollback: refeed {e_again:.2e}, other tokens {e_changed:.2e}, after a long chunk {e_tail:.2e}")
    assert e_again < TOL and e_changed < TOL and e_tail < TOL
    with pytest.raises(ValueError, match="speculative window"):
        st2.rollback(W + 1)
    with pytest.raises(ValueError):  # no window: no rollback of a Mamba state
        s0 = ours.new_state()
        ours.forward(ForwardBatch.build([(s0, ids[:5])]))
        s0.rollback(1)


def test_snapshot_restore(ours):
    ids = prompt(20, seed=9)
    st = ours.new_state()
    ours.forward(ForwardBatch.build([(st, ids[:15])]))
    snap = st.snapshot()
    a = ours.forward(ForwardBatch.build([(st, ids[15:])], logits="all"))
    st2 = ours.new_state()
    st2.restore(snap)
    b = ours.forward(ForwardBatch.build([(st2, ids[15:])], logits="all"))
    assert torch.equal(a, b) and st.nbytes == st2.nbytes and st2.num_tokens == 20


def test_state_bytes_match_the_planner(ours):
    c = ours.cfg
    per_token, fixed = nemotron_h.state_bytes(c, 4)
    # one attention layer: K and V of 2 heads x 16; two Mamba layers: fp32 conv tail [8*16 + 2*2*16, 3] + ssm [8, 16, 16]
    assert per_token == 1 * 2 * 2 * 16 * 4 and fixed == 2 * 4 * ((8 * 16 + 2 * 2 * 16) * 3 + 8 * 16 * 16)
    _, st = run(ours, [prompt(13)])
    assert st.nbytes == 13 * per_token + fixed
    W = 3  # a rollback window holds W more Mamba states per layer
    _, st = run(ours, [prompt(13)] + [[5]] * W, state=ours.new_state(rollback_window=W))
    assert st.nbytes == (13 + W) * per_token + fixed * (1 + W)
    assert nemotron_h.state_bytes(c, 4, rollback_window=W) == (per_token, fixed * (1 + W))


@functools.cache
def demo_model(dtype: str):
    return Checkpoint.open(ensure_demo("demo-nemotron-h")).build(dtype)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_bytes_are_exact_on_the_demo(dtype, window):
    """The planner's (per token, fixed) is what a sequence of the demo model holds: fed one token per
    forward past its rollback window, and after a prefill longer than the window."""
    per_token, fixed = check_state_bytes_exact("demo-nemotron-h", dtype, window, T=2 * window + 7)
    assert fixed > 0 and per_token > 0
    model = demo_model(dtype)
    ids = random_ids(2 * window + 7, model.cfg.vocab_size, seed=31)
    _, st = run(model, [ids[:-2], ids[-2:-1], ids[-1:]], rollback_window=window)
    assert st.nbytes == per_token * len(ids) + fixed


# ---------------------------------------------------------------- names, config


def test_both_namings(hf_ckpt, ours, tmp_path):
    hf, path, _ = hf_ckpt
    saved = Checkpoint.open(path)
    names = set(saved.store.names())
    # what save_pretrained writes: backbone.* names, one tensor per expert
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in names and "backbone.norm_f.weight" in names
    assert not any(n.startswith("model.") for n in names)
    ids = prompt(20, seed=11)
    ref, _ = run(ours, [ids])

    # transformers' in-memory names (model.*, fused experts)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mixer.experts.up_proj" in sd
    save_safetensors(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    other = Checkpoint.open(tmp_path)
    assert other.cfg == saved.cfg
    assert "model.*" in other.family.namings(other.cfg, "hf", other.store.names()).name
    got, _ = run(other.build("float32"), [ids])
    assert torch.equal(got, ref)

    # an unexpected tensor is an error; so are MTP tensors when the config declares no MTP block
    for extra in ("model.layers.0.mixer.surprise", "mtp.layers.0.eh_proj.weight"):
        save_safetensors(dict(sd, **{extra: torch.zeros(3)}), tmp_path / "model.safetensors")
        with pytest.raises(CheckpointError, match=f"unexpected: {extra}"):
            Checkpoint.open(tmp_path).build("float32")


def mtp_checkpoint(hf_ckpt, folder, naming: str, drop=(), replace=None, mtp=True):
    """The saved checkpoint (`backbone.*`, per-expert) or transformers' state_dict (`model.*`, fused)
    with config num_nextn_predict_layers=1 and, if `mtp`, a random MTP block in the release names
    (`mtp.layers.{0,1}.*`, per-expert), less the tensors in `drop`, with `replace` swapped in."""
    hf, path, _ = hf_ckpt
    raw = dict(json.loads((path / "config.json").read_text()), num_nextn_predict_layers=1)
    cfg = nemotron_h.parse_config(raw)
    if naming == "backbone":
        ck = Checkpoint.open(path)
        tensors = {n: ck.store.get(n) for n in ck.store.names()}
    else:
        tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    specs = nemotron_h.mtp_specs(cfg)
    g = torch.Generator().manual_seed(23)
    release = nemotron_h.namings(cfg, "hf", [])  # mtp.* is named alike in both namings
    extra = (
        to_checkpoint(specs, release, {s.name: torch.randn(s.shape, generator=g) for s in specs})
        if mtp
        else {}
    )
    extra = {n: t for n, t in extra.items() if n not in drop}
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors({**tensors, **extra, **(replace or {})}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))
    return extra


@pytest.mark.parametrize("naming", ["backbone", "model"])
def test_mtp_block_loads_when_present(hf_ckpt, ours, tmp_path, naming):
    """num_nextn_predict_layers=1 with the default `*E` block: an attention layer (with enorm, hnorm,
    eh_proj) and a MoE layer (with final_layernorm), per-expert names; loaded into Model.mtp with the
    declared shapes, the text model unchanged."""
    extra = mtp_checkpoint(hf_ckpt, tmp_path, naming)
    x = 32 if hf_ckpt[2] == "latent" else 64
    for name, shape in [
        ("mtp.layers.0.enorm.weight", [64]),
        ("mtp.layers.0.hnorm.weight", [64]),
        ("mtp.layers.0.eh_proj.weight", [64, 128]),
        ("mtp.layers.0.norm.weight", [64]),
        ("mtp.layers.0.mixer.q_proj.weight", [64, 64]),
        ("mtp.layers.0.mixer.k_proj.weight", [32, 64]),
        ("mtp.layers.1.mixer.gate.e_score_correction_bias", [8]),
        ("mtp.layers.1.mixer.experts.7.up_proj.weight", [32, x]),
        ("mtp.layers.1.mixer.experts.7.down_proj.weight", [x, 32]),
        ("mtp.layers.1.mixer.shared_experts.up_proj.weight", [48, 64]),
        ("mtp.layers.1.final_layernorm.weight", [64]),
    ]:
        assert list(extra[name].shape) == shape, name
    assert ("mtp.layers.1.mixer.fc1_latent_proj.weight" in extra) == (x == 32)
    assert not any(n.startswith("mtp.layers.2.") for n in extra)
    model = Checkpoint.open(tmp_path).build("float32")
    # one block of two layers; its input (enorm, hnorm, eh_proj) bound from the first layer's names,
    # final_layernorm from the last's
    assert len(model.mtp) == 1 and [w.kind for w in model.mtp[0].layers] == ["full_attention", "moe"]
    block, (attn, moe) = model.mtp[0], model.mtp[0].layers
    assert block.eh_proj.shape == (64, 128) and torch.equal(
        block.eh_proj, extra["mtp.layers.0.eh_proj.weight"]
    )
    assert torch.equal(block.enorm, extra["mtp.layers.0.enorm.weight"])
    assert torch.equal(block.hnorm, extra["mtp.layers.0.hnorm.weight"])
    assert torch.equal(attn.mixer.k, extra["mtp.layers.0.mixer.k_proj.weight"])
    assert moe.mixer.experts_in.shape == (8, 32, x)
    assert torch.equal(moe.mixer.experts_out[7], extra["mtp.layers.1.mixer.experts.7.down_proj.weight"])
    assert torch.equal(moe.norm, extra["mtp.layers.1.norm.weight"])
    assert torch.equal(block.final_norm, extra["mtp.layers.1.final_layernorm.weight"])
    assert (moe.mixer.latent_in is not None) == (x == 32)
    assert nemotron_h.draft_heads(model.cfg) == ("mtp",) and nemotron_h.draft_heads(ours.cfg) == ()
    ids = prompt(12, seed=24)
    assert torch.equal(run(model, [ids])[0], run(ours, [ids])[0])
    # inspect counts the block apart (role "mtp"), every tensor of it
    info = inspect_checkpoint(tmp_path)
    assert info["contract"] == "ok" and info["params_by_role"]["mtp"] == sum(
        t.numel() for t in extra.values()
    )


def test_mtp_block_absent_loads(hf_ckpt, ours, tmp_path):
    mtp_checkpoint(hf_ckpt, tmp_path, "backbone", mtp=False)
    model = Checkpoint.open(tmp_path).build("float32")
    assert model.cfg.num_nextn_predict_layers == 1 and model.mtp == []
    ids = prompt(12, seed=25)
    assert torch.equal(run(model, [ids])[0], run(ours, [ids])[0])


@pytest.mark.parametrize(
    "drop,expect",
    [
        (["mtp.layers.0.enorm.weight"], "MTP block is incomplete.*mtp.layers.0.enorm.weight"),
        (
            ["mtp.layers.1.final_layernorm.weight"],
            "MTP block is incomplete.*mtp.layers.1.final_layernorm.weight",
        ),
        (
            ["mtp.layers.1.mixer.experts.3.up_proj.weight"],
            "missing: mtp.layers.1.mixer.experts.3.up_proj.weight",
        ),
    ],
)
def test_partial_mtp_block_is_refused(hf_ckpt, tmp_path, drop, expect):
    mtp_checkpoint(hf_ckpt, tmp_path, "backbone", drop=drop)
    with pytest.raises(CheckpointError, match=expect):
        Checkpoint.open(tmp_path).build("float32")


def test_misshaped_mtp_tensor_is_refused(hf_ckpt, tmp_path):
    mtp_checkpoint(
        hf_ckpt, tmp_path, "backbone", replace={"mtp.layers.0.eh_proj.weight": torch.zeros(64, 64)}
    )
    with pytest.raises(
        CheckpointError, match=r"misshaped: mtp.layers.0.eh_proj.weight is \[64, 64\], expected \[64, 128\]"
    ):
        Checkpoint.open(tmp_path).build("float32")


def test_config_fields_and_aliases_as_transformers_reads_them(hf_ckpt):
    saved = Checkpoint.open(hf_ckpt[1]).cfg
    assert saved.time_step_limit == (0.0, math.inf)  # written as {"__float__": "Infinity"}
    assert saved.layer_types == tuple(LAYERS) and saved.num_hidden_layers == 6
    raw = dict(
        hybrid_override_pattern="M-*EM",
        num_hidden_layers=99,
        mamba_num_heads=8,
        mamba_head_dim=16,
        hidden_size=64,
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=16,
        mamba_dt_min=0.02,
        mamba_dt_max=0.2,
        mamba_conv_bias=False,
        mamba_dt_init_floor=1e-3,
        mtp_hybrid_override_pattern="*E",
        num_nextn_predict_layers=1,
        moe_latent_size=16,
        eos_token_id=[2, 11],
    )
    hf = transformers.NemotronHConfig(**raw)
    c = nemotron_h.parse_config(raw)
    assert c.layer_types == tuple(hf.layers_block_type) and c.num_hidden_layers == hf.num_hidden_layers == 5
    assert (
        (c.n_groups, c.conv_kernel, c.chunk_size, c.use_conv_bias)
        == (hf.n_groups, hf.conv_kernel, hf.chunk_size, hf.use_conv_bias)
        == (4, 3, 16, False)
    )
    assert (c.time_step_min, c.time_step_max, c.time_step_floor) == (
        hf.time_step_min,
        hf.time_step_max,
        hf.time_step_floor,
    )
    assert c.mtp_layer_types == tuple(hf.mtp_layers_block_type) == ("full_attention", "moe")
    assert c.moe_latent_size == 16 and c.eos_token_ids == (2, 11)
    # num_key_value_heads: absent 8 (transformers' default), null one per head (its __post_init__)
    assert transformers.NemotronHConfig(num_attention_heads=16).num_key_value_heads == 8
    assert nemotron_h.parse_config(dict(num_attention_heads=16)).num_key_value_heads == 8
    assert (
        nemotron_h.parse_config(dict(num_attention_heads=16, num_key_value_heads=None)).num_key_value_heads
        == 16
    )
    # the release names in layers_block_type, as transformers remaps them
    rel = dict(raw, layers_block_type=["mamba", "mlp", "attention", "moe", "mamba"])
    assert nemotron_h.parse_config(rel).layer_types == tuple(
        transformers.NemotronHConfig(**rel).layers_block_type
    )


@pytest.mark.parametrize(
    "edit,expect",
    [
        ({"hybrid_override_pattern": "ME*X"}, "'hybrid_override_pattern'"),
        ({"layers_block_type": ["mamba", "sliding"]}, "'sliding'"),
        ({"mamba_num_heads": 8, "n_groups": 3}, "'n_groups'"),
        ({"mlp_hidden_act": "silu"}, "'mlp_hidden_act'"),
        ({"n_routed_experts": 8, "num_experts_per_tok": 9}, "'num_experts_per_tok'"),
        ({"n_routed_experts": 8, "n_group": 3}, "'n_group'"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "'num_key_value_heads'"),
        ({"time_step_limit": [0.0]}, "'time_step_limit'"),
        ({"time_step_limit": [0.0, float("nan")]}, "'time_step_limit'"),
        ({"mamba_num_heads": 8, "mamba_n_groups": 3}, "'mamba_n_groups'"),
        ({"routed_scaling_factor": float("inf")}, "'routed_scaling_factor' must be a finite number"),
        ({"topk_group": 2}, "'topk_group'"),
    ],
)
def test_bad_configs_name_the_field(edit, expect):
    with pytest.raises(ConfigError, match=expect):
        nemotron_h.parse_config(dict({"model_type": "nemotron_h"}, **edit))


# ---------------------------------------------------------------- inspect on the released shapes

# Values as published for the releases (see the report for the sources; not a verbatim config.json).
NANO = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 131072,
    "hidden_size": 2688,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "intermediate_size": 1856,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "time_step_limit": [0.0, math.inf],
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
SUPER = dict(
    NANO,
    hidden_size=4096,
    num_hidden_layers=88,
    mamba_num_heads=128,
    n_routed_experts=512,
    num_experts_per_tok=22,
    moe_intermediate_size=2688,
    moe_shared_expert_intermediate_size=5376,
    moe_latent_size=1024,
    routed_scaling_factor=5.0,
    num_nextn_predict_layers=1,
    mtp_hybrid_override_pattern="*E",
    eos_token_id=[2, 11],
    hybrid_override_pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
)


def inspect_json(tmp_path, name, config, capsys):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))  # json writes inf as Infinity, as the releases do
    capsys.readouterr()
    assert cli_main(["inspect", str(folder), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "name,config,layers,counts,H,latent,total_b,active_b",
    [
        (
            "nano",
            NANO,
            52,
            (23, 23, 6),
            64,
            None,
            31.6,
            3.6,
        ),  # published: 31.6B total, 3.6B active with embeddings
        ("super", SUPER, 88, (40, 40, 8), 128, 1024, 120.0, 12.7),  # published: 120B total, ~12.7B active
    ],
)
def test_inspect_released_configs(
    tmp_path, capsys, name, config, layers, counts, H, latent, total_b, active_b
):
    info = inspect_json(tmp_path, name, config, capsys)
    assert info["family"] == "nemotron_h" and info["num_layers"] == layers
    sched = info["layer_schedule"]
    n_mamba, n_moe, n_attn = counts
    assert (sched.count("mamba2"), sched.count("moe"), sched.count("attention"), sched.count("mlp")) == (
        n_mamba,
        n_moe,
        n_attn,
        0,
    )
    assert sched[:6] == ["mamba2", "moe", "mamba2", "moe", "mamba2", "attention" if name == "nano" else "moe"]
    # K and V of 2 heads x 128 per attention layer in bf16; fp32 conv tail (K-1 = 3) + SSM state per Mamba layer
    per_token = n_attn * 2 * 2 * 128 * 2
    fixed = n_mamba * 4 * ((H * 64 + 2 * 8 * 128) * 3 + H * 64 * 128)
    assert info["state_bytes_per_token"] == per_token and info["state_bytes_fixed_per_sequence"] == fixed
    assert info["state_bytes_per_sequence"] == per_token * 262144 + fixed
    x, I = latent or config["hidden_size"], config["moe_intermediate_size"]
    assert info["expert_bytes_bf16"] == 2 * x * I * 2 and info["moe_latent_size"] == latent
    assert info["mtp_layers"] == config.get("num_nextn_predict_layers", 0)
    roles = info["params_by_role"]
    # the published totals leave the MTP block out (as DeepSeek's do); inspect counts it under role "mtp"
    backbone = info["params_total"] - roles.get("mtp", 0)
    active = backbone - roles["expert"] * (1 - config["num_experts_per_tok"] / config["n_routed_experts"])
    assert abs(backbone / 1e9 - total_b) < 0.01 * total_b
    assert abs(active / 1e9 - active_b) < 0.02 * active_b
    if name == "super":
        assert (
            info["mtp_layer_schedule"] == ["attention", "moe"] and per_token == 8192
        )  # "8 KiB/token" published
        d, E, S = (
            4096,
            512,
            5376,
        )  # the `*E` block: attention + latent MoE layer, 2 layer norms, enorm, hnorm,
        # final_layernorm, eh_proj
        attention = d * 32 * 128 * 2 + 2 * d * 2 * 128
        moe = E * d + E + 2 * E * 1024 * I + 2 * d * S + 2 * d * 1024
        assert roles["mtp"] == attention + moe + 2 * d + 3 * d + 2 * d * d
        # the same model written with layers_block_type in the release names
        rel = dict(
            config,
            layers_block_type=[
                {"M": "mamba", "E": "moe", "*": "attention"}[ch] for ch in config["hybrid_override_pattern"]
            ],
        )
        del rel["hybrid_override_pattern"]
        assert inspect_json(tmp_path, "super_list", rel, capsys)["layer_schedule"] == sched
    else:
        assert "mtp" not in roles
    print(
        f"{name}: {backbone / 1e9:.2f}B total without MTP, {active / 1e9:.2f}B active, "
        f"{per_token} B/token, {fixed} B/sequence fixed"
    )


def test_bf16_matches_transformers_bf16(hf_ckpt):
    # bf16 against bf16 (fp32 would not do: bf16 rounding flips some expert choices in both engines).
    # The router, its weights and the expert sum stay fp32 as in transformers; a bf16 expert sum
    # flips a routing decision downstream here and misses by ~0.4.
    hf, path, kind = hf_ckpt
    ids = prompt(24, seed=12)
    with torch.no_grad():
        ref = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([ids])).logits[0]
    got, _ = run(Checkpoint.open(path).build("bfloat16"), [ids])
    err = max_err(got, ref)
    print(
        f"nemotron_h[{kind}] bf16 vs transformers bf16 max abs err {err:.2e} (|logit| max {ref.abs().max():.2f})"
    )
    assert got.dtype == torch.float32 and err < 0.15

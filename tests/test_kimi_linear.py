"""Kimi Linear against transformers `kimi_linear` (the oracle), on a tiny checkpoint that
transformers itself saves (release names: block_sparse_moe.experts.E.w1|w3|w2, q/k/v_conv1d,
A_log [1, 1, H, 1]). Logits are compared in fp32; the max abs error is printed (-s).

The random weights are "calmed" (mild KDA decays, small block outputs, O(1) embeddings): with
transformers' plain random init a 4-layer model is chaotic (a 1e-7 relative change of the
embeddings moves the logits by ~1e-4, and transformers' own prefill and decode disagree by up
to 8e-5), which would make a 1e-5 comparison meaningless. Every parameter stays random."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import transformers
from helpers import (
    calm_kda_,
    check_batch_equals_singles,
    check_greedy_matches_transformers,
    check_state_bytes_exact,
    max_err,
    random_ids,
    randomize_,
    run,
)

from moesaic.cache.batch import ForwardBatch
from moesaic.errors import ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.models import Checkpoint, family_for, kimi_linear

TOL = 1e-5
VOCAB = 101
prompt = partial(random_ids, vocab=VOCAB)
LINEAR_ATTN = {
    "head_dim": 8,
    "num_heads": 2,
    "short_conv_kernel_size": 4,
    "kda_layers": [1, 2, 4],
    "full_attn_layers": [3],
}


def tiny_config(**over):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        n_group=2,
        topk_group=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config=LINEAR_ATTN,
    )
    kw.update(over)
    return transformers.KimiLinearConfig(**kw)


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(tiny_config()).eval()
    randomize_(model, seed=1)
    calm_kda_(model, seed=2)
    path = tmp_path_factory.mktemp("kimi_linear_hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ours(hf_ckpt):
    return Checkpoint.open(hf_ckpt[1]).build("float32")


def hf_decode(hf, ids, prefix):
    """transformers' logits of a `prefix`-token prefill then one token at a time with its cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prefix]]), use_cache=True)
        ref, cache = [out.logits[0, -1]], out.past_key_values
        for t in ids[prefix:]:
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref.append(out.logits[0, -1])
    return torch.stack(ref)


def test_checkpoint_names_and_schedule(hf_ckpt, ours):
    ck = Checkpoint.open(hf_ckpt[1])
    names = set(ck.store.names())
    # transformers writes the release names; the dense layer-0 MLP under block_sparse_moe
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names
    assert "model.layers.0.self_attn.q_conv1d.weight" in names
    assert family_for(ck.store.config, "hf")[0] is kimi_linear
    # 1-based lists: [1, 2, 4] KDA, [3] MLA -> MLA at 0-based 2
    assert ours.cfg.layer_kinds == ("kda", "kda", "mla", "kda")
    assert kimi_linear.layer_schedule(ours.cfg) == ["kda+mlp", "kda+moe", "mla+moe", "kda+moe"]


def test_prefill_logits_match_transformers(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(70)  # crosses the 64-token KDA chunk
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got, _ = run(ours, [ids])
    err = max_err(got, ref)
    print(f"kimi_linear prefill max abs err {err:.2e} (|logits| max {ref.abs().max():.2f})")
    assert got.shape == ref.shape and err < TOL


def test_cached_decode_matches_transformers_cache(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(36, seed=1)
    ref = hf_decode(hf, ids, 20)
    got, _ = run(ours, [ids[:20]] + [[t] for t in ids[20:]], logits="last")
    err = max_err(got, ref)
    with torch.no_grad():  # transformers' own prefill vs its own decode: the noise floor
        floor = max_err(ref, hf(torch.tensor([ids])).logits[0, 19:])
    print(f"kimi_linear cached decode max abs err {err:.2e} (transformers prefill vs its decode {floor:.2e})")
    assert err < TOL


def test_chunked_prefill_at_odd_offsets(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(61, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    cuts = [0, 2, 7, 20, 21, 38, 61]  # a piece shorter than the conv kernel, a 1-token piece
    got, st = run(ours, [ids[a:b] for a, b in zip(cuts, cuts[1:])])
    err = max_err(got, ref)
    print(f"kimi_linear chunked prefill max abs err {err:.2e}")
    assert err < TOL and st.num_tokens == 61


def test_greedy_tokens_match_transformers_generate(hf_ckpt):
    hf, path = hf_ckpt
    ids = prompt(9, seed=3)
    check_greedy_matches_transformers(hf, path, ids, 20)


def test_batch_of_different_lengths_equals_singles(hf_ckpt):
    prompts = [prompt(n, seed=10 + n) for n in (5, 17, 23, 2)]
    check_batch_equals_singles(hf_ckpt[1], prompts, max_tokens=8, max_batch_tokens=16)


def test_rollback_snapshot_and_state_bytes(ours):
    ids, other = prompt(30, seed=7), prompt(4, seed=8)
    full, _ = run(ours, [ids])
    # a speculative window of 4: KDA keeps the states after each of the last tokens
    draft, st = run(ours, [ids[:26], ids[26:]], rollback_window=4)
    assert max_err(draft, full) < TOL
    st.rollback(4)
    again = ours.forward(ForwardBatch.build([(st, ids[26:])], logits="all"))
    assert st.num_tokens == 30 and max_err(again, full[26:]) < 1e-6
    st.rollback(4)
    changed = ours.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(ours, [ids[:26] + other])
    assert max_err(changed, fresh[26:]) < TOL
    with pytest.raises(ValueError, match="window"):
        st.rollback(5)
    # snapshot / restore for prefix reuse
    snap = st.snapshot()
    a = ours.forward(ForwardBatch.build([(st, ids[:3])], logits="all"))
    st2 = ours.new_state(rollback_window=4)
    st2.restore(snap)
    b = ours.forward(ForwardBatch.build([(st2, ids[:3])], logits="all"))
    assert torch.equal(a, b)
    # the planner's bytes, before the model exists
    _, plain = run(ours, [ids[:13]])
    per_token, fixed = kimi_linear.state_bytes(ours.cfg, 4)
    assert plain.nbytes == 13 * per_token + fixed
    assert per_token == 1 * (8 + 4) * 4 and fixed == 3 * 4 * (3 * 3 * 16 + 2 * 8 * 8)
    assert st.nbytes <= 33 * per_token + kimi_linear.state_bytes(ours.cfg, 4, rollback_window=4)[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 4])
def test_state_bytes_are_exact_on_the_demo(dtype, window):
    """The planner's (per token, fixed) bytes are what a sequence of the demo model holds after T
    one-token forwards, T past the rollback window (KDA keeps 1 + window states, MLA one row a token)."""
    per_token, fixed = check_state_bytes_exact("demo-kimi-linear", dtype, window, T=9)
    # 3 KDA layers of 2 x 8 x 8 fp32 states + 3-row conv tails (1 + window of them); 1 MLA layer
    assert fixed == 3 * 4 * (3 * 3 * 16 + 2 * 8 * 8) * (1 + window)
    assert per_token == 1 * (8 + 4) * (4 if dtype == "float32" else 2)


def test_config_reading(tmp_path, hf_ckpt):
    raw = json.loads((hf_ckpt[1] / "config.json").read_text())
    assert raw["model_max_length"] == 1048576 and "num_experts_per_token" in raw  # transformers' spellings
    cfg = kimi_linear.parse_config(raw)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.n_group, cfg.routed_scaling_factor) == (
        8,
        2,
        2,
        2.446,
    )
    # the lists are 1-based: 0 is no layer; a gap, a duplicate and a layer_types that disagrees are refused
    bad = {**raw, "linear_attn_config": {**LINEAR_ATTN, "kda_layers": [0, 1, 3]}}
    with pytest.raises(ConfigError, match="kda_layers.*1-based"):
        kimi_linear.parse_config(bad)
    bad = {**raw, "linear_attn_config": {**LINEAR_ATTN, "kda_layers": [1, 2]}}
    with pytest.raises(ConfigError, match="without a mixer"):
        kimi_linear.parse_config(bad)
    bad = {**raw, "layer_types": ["linear_attention"] * 4}
    with pytest.raises(ConfigError, match="layer_types"):
        kimi_linear.parse_config(bad)
    # without lists or layer_types: transformers' default, MLA at 0-based 4, 8, ...
    bare = {k: v for k, v in raw.items() if k not in ("linear_attn_config", "layer_types", "mlp_layer_types")}
    assert kimi_linear.parse_config({**bare, "num_hidden_layers": 9}).layer_kinds.count("mla") == 2
    # a kimi_linear text config with K3's fields belongs to the K3 family
    from moesaic.models import kimi_k3

    assert family_for({**raw, "attn_res_block_size": 2}, "hf")[0] is kimi_k3
    # inspect on the config alone
    (tmp_path / "config.json").write_text(json.dumps(raw))
    info = inspect_checkpoint(tmp_path, kv_dtype_bytes=2)
    assert info["family"] == "kimi_linear" and info["num_layers"] == 4 and info["mla_layers"] == [2]
    assert info["state_bytes_per_token"] == 12 * 2

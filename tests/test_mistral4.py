"""Mistral Small 4 against transformers `mistral4` (the oracle), on tiny checkpoints that
transformers itself saves. Logits are compared in fp32; the max abs error is printed (-s)."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import transformers
from helpers import (
    check_batch_equals_singles,
    check_greedy_matches_transformers,
    max_err,
    mixed_batch_err,
    random_ids,
    randomize_,
    run,
)

from moesaic.cache.batch import ForwardBatch
from moesaic.models import Checkpoint, mistral4
from moesaic.weights.contract import to_checkpoint
from moesaic.weights.store import save_safetensors, save_sharded

TOL = 2e-5
VOCAB = 101
prompt = partial(random_ids, vocab=VOCAB)


def tiny_config(**over):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        max_position_embeddings=256,
        eos_token_id=2,
        # original_max 32 so that the llama-4 query scaling (position >= 32) and YaRN both matter
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    )
    kw.update(over)
    return transformers.Mistral4Config(**kw)


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Mistral4ForCausalLM(tiny_config()).eval()
    randomize_(model, seed=1)
    path = tmp_path_factory.mktemp("mistral4_hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ours(hf_ckpt):
    return Checkpoint.open(hf_ckpt[1]).build("float32")


def test_prefill_logits_match_transformers(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(70)  # crosses original_max_position_embeddings=32 twice: the llama-4 scaling is on
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got, _ = run(ours, [ids])
    err = max_err(got, ref)
    print(f"mistral4 prefill max abs err {err:.2e}")
    assert got.shape == ref.shape and err < TOL


def test_cached_decode_matches_transformers_cache(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(50, seed=1)
    with torch.no_grad():
        out = hf(torch.tensor([ids[:20]]), use_cache=True)
        ref = [out.logits[0, -1]]
        cache = out.past_key_values
        for t in ids[20:]:
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            ref.append(out.logits[0, -1])
    ref = torch.stack(ref)
    got, _ = run(ours, [ids[:20]] + [[t] for t in ids[20:]], logits="last")
    err = max_err(got, ref)
    print(f"mistral4 cached decode max abs err {err:.2e}")
    assert err < TOL


def test_chunked_prefill_at_odd_offsets(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(61, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    cuts = [0, 7, 20, 21, 38, 61]
    got, st = run(ours, [ids[a:b] for a, b in zip(cuts, cuts[1:])])
    err = max_err(got, ref)
    print(f"mistral4 chunked prefill max abs err {err:.2e}")
    assert err < TOL and st.num_tokens == 61


def test_greedy_tokens_match_transformers_generate(hf_ckpt):
    hf, path = hf_ckpt
    ids = prompt(9, seed=3)
    check_greedy_matches_transformers(hf, path, ids, 24)


def test_absorbed_and_expanded_attention_agree(ours):
    # A 40-token chunk takes the expanded path, 1-token steps the absorbed one: same logits.
    ids = prompt(41, seed=4)
    full, _ = run(ours, [ids])
    steps, _ = run(ours, [ids[:1]] + [[t] for t in ids[1:]], logits="last")
    assert max_err(full, steps) < TOL


def test_batch_of_different_lengths_equals_singles(hf_ckpt):
    prompts = [prompt(n, seed=10 + n) for n in (5, 17, 31, 2)]
    check_batch_equals_singles(hf_ckpt[1], prompts, max_tokens=12, max_batch_tokens=24)


def test_mixed_prefill_and_decode_in_one_forward(ours):
    # One ForwardBatch with a sequence decoding and another prefilling gives each its own logits.
    a, b = prompt(12, seed=5), prompt(9, seed=6)
    assert mixed_batch_err(ours, a, b) < TOL


def test_rollback_then_refeed_is_exact(ours):
    ids = prompt(30, seed=7)
    other = prompt(5, seed=8)
    full, st = run(ours, [ids[:25], ids[25:]])
    st.rollback(5)
    assert st.num_tokens == 25
    again = ours.forward(ForwardBatch.build([(st, ids[25:])], logits="all"))
    assert torch.equal(again, full[25:])
    st.rollback(5)
    changed = ours.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(ours, [ids[:25] + other])
    assert max_err(changed, fresh[25:]) < TOL


def test_snapshot_restore(ours):
    ids = prompt(20, seed=9)
    st = ours.new_state()
    ours.forward(ForwardBatch.build([(st, ids[:15])]))
    snap = st.snapshot()
    a = ours.forward(ForwardBatch.build([(st, ids[15:])], logits="all"))
    st2 = ours.new_state()
    st2.restore(snap)
    b = ours.forward(ForwardBatch.build([(st2, ids[15:])], logits="all"))
    assert torch.equal(a, b) and st.nbytes == st2.nbytes == 20 * 3 * (16 + 8) * 4


def test_state_bytes_match_the_planner(ours):
    _, st = run(ours, [prompt(13)])
    per_token, fixed = mistral4.state_bytes(ours.cfg, 4)
    assert st.nbytes == 13 * per_token + fixed


def write_native(hf_path, out):
    """Writes the transformers-saved checkpoint in Mistral's native layout (params.json + consolidated)."""
    ck = Checkpoint.open(hf_path)
    specs = mistral4.tensor_specs(ck.cfg)
    tensors = {n: ck.store.get(n) for n in ck.store.names()}
    native = to_checkpoint(specs, mistral4.native_naming(ck.cfg), tensors)
    out.mkdir(exist_ok=True)
    save_safetensors(native, out / "consolidated.safetensors")
    (out / "params.json").write_text(json.dumps(mistral4.params_json(ck.raw)))
    return native


def test_native_format_loads_to_the_same_logits(hf_ckpt, ours, tmp_path):
    native = write_native(hf_ckpt[1], tmp_path / "native")
    assert "layers.1.experts.3.w1.weight" in native and "layers.0.feed_forward.w2.weight" in native
    assert "layers.2.attention.wkv_a_with_mqa.weight" in native and "tok_embeddings.weight" in native
    theirs = Checkpoint.open(tmp_path / "native")
    assert theirs.store.layout == "mistral" and theirs.cfg == ours.cfg
    ids = prompt(40, seed=11)
    a, _ = run(ours, [ids])
    b, _ = run(theirs.build("float32"), [ids])
    assert torch.equal(a, b)


def test_sharded_checkpoint_reads_each_tensor_once(hf_ckpt, tmp_path):
    ck = Checkpoint.open(hf_ckpt[1])
    tensors = {n: ck.store.get(n).clone() for n in ck.store.names()}
    tensors["model.vision_tower.patch.weight"] = torch.zeros(4, 4)  # ignored by a text model, never read
    save_sharded(tensors, tmp_path, max_shard_bytes=60_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    (tmp_path / "config.json").write_text((hf_ckpt[1] / "config.json").read_text())
    sharded = Checkpoint.open(tmp_path)
    model = sharded.build("float32")
    assert set(sharded.store.reads.values()) == {1}
    assert "model.vision_tower.patch.weight" not in sharded.store.reads
    assert sharded.store.bytes_read == sharded.store.total_bytes - 64
    ids = prompt(10)
    assert torch.equal(run(model, [ids])[0], run(Checkpoint.open(hf_ckpt[1]).build("float32"), [ids])[0])


def test_bf16_model_runs_and_stays_close(hf_ckpt, ours):
    ids = prompt(24, seed=12)
    ref, _ = run(ours, [ids])
    got, _ = run(Checkpoint.open(hf_ckpt[1]).build("bfloat16"), [ids])
    assert got.dtype == torch.float32
    # bf16 keeps ~3 significant digits; logits of this tiny model are O(1)
    assert max_err(got, ref) < 0.15 * ref.abs().max().item()

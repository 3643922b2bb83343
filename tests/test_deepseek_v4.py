"""DeepSeek-V4 against transformers `deepseek_v4` (the oracle), on tiny checkpoints that transformers
itself saves; one sequence at a time (the oracle pools pad tokens, so it cannot batch). Logits are
compared in fp32; the max abs errors are printed (-s)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    check_batch_equals_singles,
    check_greedy_matches_transformers,
    check_state_bytes_exact,
    demo_model,
    max_err,
    mixed_batch_err,
    randomize_,
)

from moesaic.cache.batch import ForwardBatch
from moesaic.errors import CheckpointError, ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.models import Checkpoint, deepseek_v4
from moesaic.weights.contract import load_tensors, to_checkpoint
from moesaic.weights.store import save_safetensors

transformers = pytest.importorskip("transformers")

TOL = 2e-5  # logits are O(4); fp32 rounding through mHC streams and three softmaxes per layer
VOCAB, E, K = 256, 8, 2
SW, CSA_M, HCA_M, TOPK = 8, 4, 8, 3  # window and ratios well below the prompts; top-3 of up to 25 entries
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# every path: sliding, CSA (16 indexer heads, overlapped pooling) and HCA layers; hash and routed MoE;
# YaRN on the compress rope; a SwiGLU limit low enough to clamp
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=[SWA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=E,
    num_experts_per_tok=K,
    moe_intermediate_size=32,
    compress_rates={CSA: CSA_M, HCA: HCA_M},
    sliding_window=SW,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=TOPK,
    swiglu_limit=1.0,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    eos_token_id=1,
    pad_token_id=0,
)


def hf_model(seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY)).eval()
    randomize_(model, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # large enough that the sink takes a real share of the softmax
                p.copy_(torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # transformers initialises both to 0
            if name.endswith("tid2eid"):  # a valid table: K distinct experts per token
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(VOCAB)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    model = hf_model()
    path = tmp_path_factory.mktemp("deepseek_v4_hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ours(hf_ckpt):
    return Checkpoint.open(hf_ckpt[1]).build("float32")


def prompt(n, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, chunks, logits="all", state=None, rollback_window=0):
    st = state if state is not None else model.new_state(rollback_window)
    outs = [model.forward(ForwardBatch.build([(st, c)], logits=logits)) for c in chunks]
    return torch.cat(outs), st


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_logits_match_transformers(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(150)  # 18 HCA entries, 37 CSA entries of which the indexer keeps 3, 2 query blocks of csa
    ref = hf_logits(hf, ids)
    got, _ = run(ours, [ids])
    err = max_err(got, ref)
    print(f"deepseek_v4 prefill max abs err {err:.2e}")
    assert got.shape == ref.shape and err < TOL


def test_indexer_selection_matters(hf_ckpt):
    # the oracle with a larger top-k differs: the tiny config's selection is not a no-op
    hf, path = hf_ckpt
    ids = prompt(75)
    cfg = json.loads((path / "config.json").read_text())
    wide = transformers.DeepseekV4ForCausalLM(
        transformers.DeepseekV4Config(**{**TINY, "index_topk": 64})
    ).eval()
    wide.load_state_dict(hf.state_dict())
    assert cfg["index_topk"] == TOPK and max_err(hf_logits(wide, ids), hf_logits(hf, ids)) > 1e-2


def test_cached_decode_matches_transformers_cache(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(38, seed=1)  # decode steps cross CSA/HCA group ends at 16, 20, 24, 28, 32, 36
    with torch.no_grad():
        out = hf(torch.tensor([ids[:13]]), use_cache=True)
        ref, cache = [out.logits[0, -1]], out.past_key_values
        for t in ids[13:]:
            out = hf(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            ref.append(out.logits[0, -1])
    ref = torch.stack(ref)
    got, _ = run(ours, [ids[:13]] + [[t] for t in ids[13:]], logits="last")
    err = max_err(got, ref)
    print(f"deepseek_v4 cached decode max abs err {err:.2e}")
    assert err < TOL


def test_chunked_prefill_at_unaligned_cuts(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(61, seed=2)
    ref = hf_logits(hf, ids)
    worst = 0.0
    for cuts in (
        [0, 7, 20, 21, 38, 61],
        [0, 1, 2, 3, 30, 61],
        [0, 13, 61],
    ):  # none on a multiple of 4 or 8 after 0
        got, st = run(ours, [ids[a:b] for a, b in zip(cuts, cuts[1:])])
        worst = max(worst, max_err(got, ref))
        assert st.num_tokens == 61
    print(f"deepseek_v4 chunked prefill max abs err {worst:.2e}")
    assert worst < TOL


def test_greedy_tokens_match_transformers_generate(hf_ckpt):
    hf, path = hf_ckpt
    ids = prompt(9, seed=3)
    check_greedy_matches_transformers(hf, path, ids, 16)


def test_batch_of_different_lengths_equals_singles(hf_ckpt):
    prompts = [prompt(n, seed=10 + n) for n in (5, 19, 30, 2)]
    check_batch_equals_singles(hf_ckpt[1], prompts, max_tokens=8, max_batch_tokens=13)


def test_mixed_prefill_and_decode_in_one_forward(ours):
    a, b = prompt(22, seed=5), prompt(17, seed=6)
    err = mixed_batch_err(ours, a, b)
    print(f"deepseek_v4 mixed batch max abs err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize(
    "past, new", [(21, 6), (13, 5)]
)  # crosses 24 (CSA and HCA groups) / 16, and the window
def test_rollback_then_refeed_is_exact(ours, past, new):
    R = 6
    ids, other = prompt(past + new, seed=7), prompt(new, seed=8)
    full, st = run(ours, [ids[:past], ids[past:]], rollback_window=R)
    st.rollback(new)
    assert st.num_tokens == past
    again = ours.forward(ForwardBatch.build([(st, ids[past:])], logits="all"))
    st.rollback(new)
    changed = ours.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(ours, [ids[:past], other])
    # decode steps rolled back across the same boundaries
    steps, st2 = run(ours, [ids[:past]] + [[t] for t in ids[past:]], logits="last", rollback_window=R)
    st2.rollback(new)
    refed = torch.cat([ours.forward(ForwardBatch.build([(st2, [t])])) for t in other])
    err = max(max_err(again, full[past:]), max_err(changed, fresh[past:]), max_err(refed, fresh[past:]))
    print(f"deepseek_v4 rollback/re-feed (past {past}, new {new}) max abs err {err:.2e}")
    assert err < 1e-5


def test_rollback_beyond_the_window_is_refused_and_harmless(ours):
    ids = prompt(30, seed=9)
    full, st = run(ours, [ids[:20], ids[20:]], rollback_window=4)
    with pytest.raises(ValueError, match="speculative window"):
        st.rollback(5)
    assert st.num_tokens == 30
    st.rollback(4)
    again = ours.forward(ForwardBatch.build([(st, ids[26:])], logits="all"))
    assert max_err(again, full[26:]) < 1e-5


def test_snapshot_restore(ours):
    ids = prompt(27, seed=9)
    st = ours.new_state()
    ours.forward(ForwardBatch.build([(st, ids[:19])]))
    snap = st.snapshot()
    a = ours.forward(ForwardBatch.build([(st, ids[19:])], logits="all"))
    st2 = ours.new_state()
    st2.restore(snap)
    assert st2.num_tokens == 19
    b = ours.forward(ForwardBatch.build([(st2, ids[19:])], logits="all"))
    assert torch.equal(a, b) and st.nbytes == st2.nbytes


def test_state_bytes_match_the_planner(ours):
    for R in (0, 3):
        per_token, fixed = deepseek_v4.state_bytes(ours.cfg, 4, rollback_window=R)
        for n in (5, 48, 57):  # 48: whole groups of 4 and 8 and every buffer full -> exact
            _, st = run(ours, [prompt(n)], rollback_window=R)
            assert st.nbytes <= n * per_token + fixed
            if n == 48:
                assert st.nbytes == n * per_token + fixed
    # entries: 2 CSA layers x (32 + 16) / 4 + 1 HCA layer x 32 / 8 elements of 4 bytes
    assert deepseek_v4.state_bytes(ours.cfg, 4)[0] == (2 * 48 // 4 + 32 // 8) * 4


def module_tensors(path):
    """The model's own tensors (by contract name) read from a checkpoint."""
    ck = Checkpoint.open(path)
    return ck, load_tensors(ck.plan(), ck.store, torch.float32, "cpu")


def write_upstream(hf_path, out, extra=None):
    ck, tensors = module_tensors(hf_path)
    specs = deepseek_v4.tensor_specs(ck.cfg)
    g = torch.Generator().manual_seed(4)
    mtp = {s.name: torch.randn(s.shape, generator=g) for s in specs if s.name.startswith("mtp.")}
    native = to_checkpoint(specs, deepseek_v4.checkpoint_naming(upstream=True), {**tensors, **mtp})
    for name in native:
        if name.endswith("tid2eid"):
            native[name] = native[name].long()  # int64, as released
    native.update(extra or {})
    out.mkdir(exist_ok=True)
    save_safetensors(native, out / "model.safetensors")
    (out / "config.json").write_text((hf_path / "config.json").read_text())
    return native


def test_upstream_names_load_to_the_same_logits(hf_ckpt, ours, tmp_path):
    native = write_upstream(hf_ckpt[1], tmp_path / "up")
    for name in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "layers.1.attn.wq_a.weight",
        "layers.1.attn.kv_norm.weight",
        "layers.0.attn.attn_sink",
        "layers.0.hc_attn_fn",
        "layers.2.ffn.experts.3.w1.weight",
        "layers.0.ffn.gate.tid2eid",
        "layers.2.ffn.gate.bias",
        "layers.1.attn.compressor.ape",
        "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.3.attn.indexer.weights_proj.weight",
        "mtp.0.e_proj.weight",
        "mtp.0.hc_head_fn",
        "mtp.0.attn.wq_a.weight",
        "mtp.0.ffn.experts.0.w2.weight",
    ):
        assert name in native, name
    theirs = Checkpoint.open(tmp_path / "up")
    assert theirs.cfg == ours.cfg
    model = theirs.build("float32")
    assert len(model.mtp) == 1 and isinstance(model.mtp[0].e_proj, torch.Tensor)
    # the MTP block is bound like a decoder layer: a sliding-window attention and a routed MoE
    mtp = model.mtp[0].layer
    assert mtp.attn.compressor is None and mtp.mlp.bias is not None and mtp.mlp.hash_ids is None
    ids = prompt(40, seed=11)
    assert torch.equal(run(ours, [ids])[0], run(model, [ids])[0])


def test_module_names_and_a_malformed_scale(hf_ckpt, ours, tmp_path):
    hf, path = hf_ckpt
    dump = tmp_path / "dump"
    dump.mkdir()
    save_safetensors({k: v.contiguous() for k, v in hf.state_dict().items()}, dump / "model.safetensors")
    (dump / "config.json").write_text((path / "config.json").read_text())
    ids = prompt(30, seed=12)
    assert torch.equal(run(ours, [ids])[0], run(Checkpoint.open(dump).build("float32"), [ids])[0])
    # a `.scale` beside a weight that is not fp8: a broken quantized checkpoint, named in the error
    write_upstream(path, tmp_path / "fp8", extra={"layers.0.attn.wq_a.scale": torch.ones(1, 1)})
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a"):
        Checkpoint.open(tmp_path / "fp8").build("float32")


# The published DeepSeek-V4-Flash config.json (as inlined in alibaba/rtp-llm's DeepSeek-V4 tests).
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "topk_method": "noaux_tc",
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],  # 43 layers + the MTP slot
}


def test_inspect_reports_the_released_flash_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH))
    info = inspect_checkpoint(tmp_path)
    sched = info["layer_schedule"]
    assert info["family"] == "deepseek_v4" and info["num_layers"] == 43
    assert sched[:4] == ["swa+hash_moe", "swa+hash_moe", "csa+hash_moe", "hca+moe"] and sched[-1] == "csa+moe"
    assert (info["sliding_layers"], info["csa_layers"], info["hca_layers"]) == (2, 21, 20)
    # bf16: 21 x (512 + 128) / 4 + 20 x 512 / 128 = 3,440 elements per token
    assert info["state_bytes_per_token"] == 3440 * 2
    # windows 43 x 127 x 512; CSA buffers 7 x (2048 + 512); HCA buffers 127 x 1024
    assert info["state_bytes_fixed_per_sequence"] == (43 * 127 * 512 + 21 * 7 * 2560 + 20 * 127 * 1024) * 2
    assert info["state_bytes_per_sequence"] == 6880 * 1048576 + info["state_bytes_fixed_per_sequence"]
    backbone = info["params_total"] - info["params_by_role"]["mtp"]
    assert 284.0e9 < backbone < 284.5e9  # "284B total"
    # transformers reads the same schedule and rope sets
    hf = transformers.DeepseekV4Config(**FLASH)
    cfg = deepseek_v4.parse_config(FLASH)
    assert list(cfg.layer_types) == hf.layer_types and list(cfg.mlp_layer_types) == hf.mlp_layer_types
    assert (
        cfg.rope_compress.theta == 160000
        and cfg.rope_compress.kind == "yarn"
        and cfg.rope_main.theta == 10000
    )
    assert cfg.rope_compress.dim == cfg.rope_main.dim == 64 and cfg.rope_compress_factor == 1.0
    # the MTP layer serves MTP drafting; a config without one has no draft head
    assert deepseek_v4.draft_heads(cfg) == ("mtp",)
    assert deepseek_v4.draft_heads(deepseek_v4.parse_config({**FLASH, "num_nextn_predict_layers": 0})) == ()


def test_saved_config_round_trips(hf_ckpt, ours):
    saved = json.loads((hf_ckpt[1] / "config.json").read_text())
    assert "rope_parameters" in saved and "main" in saved["rope_parameters"]  # the nested form
    flat = {
        k: v
        for k, v in saved.items()
        if k
        not in (
            "rope_parameters",
            "layer_types",
            "mlp_layer_types",
            "compress_rates",
            "partial_rotary_factor",
        )
    }
    flat.update(
        rope_scaling=TINY["rope_parameters"],
        compress_ratios=[0, CSA_M, HCA_M, CSA_M, 0],
        num_hash_layers=2,
        compress_rate_csa=CSA_M,
        compress_rate_hca=HCA_M,
    )
    assert deepseek_v4.parse_config(flat) == ours.cfg


@pytest.mark.parametrize(
    "over, field",
    [
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"o_groups": 3}, "o_groups"),
        ({"layer_types": [SWA, "full_attention", HCA, CSA]}, "layer_types"),
        ({"layer_types": None, "compress_ratios": [0, 4, 7, 4]}, "compress_ratios"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
    ],
)
def test_config_errors_name_the_field(hf_ckpt, over, field):
    saved = json.loads((hf_ckpt[1] / "config.json").read_text())
    with pytest.raises(ConfigError, match=field):
        deepseek_v4.parse_config({**saved, **over})


def test_bf16_model_runs_and_stays_close(hf_ckpt, ours):
    # transformers' own bf16 run of this tiny model differs from fp32 by up to ~1 on rows where a
    # routing or indexer top-k flips; most rows stay within bf16 rounding
    ids = prompt(30, seed=12)
    ref, _ = run(ours, [ids])
    got, _ = run(Checkpoint.open(hf_ckpt[1]).build("bfloat16"), [ids])
    rows = (got - ref).abs().amax(-1)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rows.median() < 0.2 and (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 4])
def test_state_bytes_of_the_demo_are_exact(dtype, window):
    # the planner's (per token, fixed) bytes are what a sequence holds once every window, tail and
    # compressor group has filled: 48 tokens, a multiple of both ratios (4, 8)
    per_token, fixed = check_state_bytes_exact("demo-deepseek-v4", dtype, window, T=48)
    cfg = demo_model("demo-deepseek-v4", dtype)[0].cfg
    assert fixed > deepseek_v4.state_bytes(cfg, getattr(torch, dtype).itemsize, 0)[1] or window == 0


@pytest.mark.parametrize("ratio", [1, 4])
def test_visible_entries_are_what_the_indexer_keeps_within_topk(ratio):
    """While a CSA layer has at most index_topk closed entries, the lightning indexer's top-k keeps every
    entry a query sees whatever the scores, so the model skips its queries (`visible_entries`): the same
    entries for every query; one entry more and the scores drop one."""
    from moesaic.layers.csa import indexer_select, visible_entries

    g = torch.Generator().manual_seed(ratio)
    topk = 6
    for E in range(0, topk + 1):
        positions = torch.arange(max(0, E * ratio - 3), E * ratio + ratio)  # queries around the last entry
        q, w = torch.randn(len(positions), 2, 8, generator=g), torch.rand(len(positions), 2, generator=g)
        keys = torch.randn(E, 8, generator=g)
        want = indexer_select(q, w, keys, positions, ratio, topk)[0]
        got = visible_entries(positions, E, ratio)
        assert got.shape == want.shape == (len(positions), E)
        assert [set(r.tolist()) for r in got] == [set(r.tolist()) for r in want]
        # a decode row, its sequence's newest token with E entries closed: the fast path, the same tensor
        for p in (p for p in range(E * ratio + ratio) if (p + 1) // ratio == E):
            one = torch.tensor([p])
            assert torch.equal(visible_entries(one, E, ratio, newest=True), visible_entries(one, E, ratio))
    E = topk + 1
    want = indexer_select(
        torch.randn(1, 2, 8, generator=g),
        torch.rand(1, 2, generator=g),
        torch.randn(E, 8, generator=g),
        torch.tensor([E * ratio]),
        ratio,
        topk,
    )[0]
    assert want.shape == (1, topk) and (want >= 0).sum() == topk < E  # the scores choose


def test_rope_tail_makes_its_angles_once_per_positions_tensor():
    """A forward's layers rope at one batch.positions tensor several times each, between a compressor's
    entries at their own positions: the angles of the last two positions tensors are kept, by the tensor
    object. Each call's rotation is the one its own positions give (a stale entry would rotate by another
    tensor's angles, e.g. a later step's positions of the same shape)."""
    from moesaic.layers.csa import RopeTail
    from moesaic.layers.rope import cos_sin, rope_pairs

    gen = torch.Generator().manual_seed(0)
    rope = RopeTail(torch.rand(4, generator=gen), factor=0.7)
    x = torch.randn(3, 2, 16, generator=gen)

    def want(pos, inverse=False):
        cos, sin = cos_sin(rope.freqs, pos, rope.factor)
        return torch.cat([x[..., :-8], rope_pairs(x[..., -8:], cos, -sin if inverse else sin)], dim=-1)

    step, entries, later = torch.tensor([5, 6, 7]), torch.tensor([0, 4, 8]), torch.tensor([8, 9, 10])
    for pos, inverse in ((step, False), (entries, False), (step, True), (step, False), (later, False)):
        assert torch.equal(rope(x, pos, inverse), want(pos, inverse))
    cos = rope.angles(later)[0]
    assert rope.angles(later)[0] is cos and rope.angles(torch.tensor([8, 9, 10]))[0] is not cos

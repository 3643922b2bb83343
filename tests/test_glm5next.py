"""GLM-5.3-Flash against transformers `glm5_next` (the oracle), on tiny checkpoints that transformers
itself saves. Logits are compared in fp32; the max abs errors are printed (-s)."""

from __future__ import annotations

import dataclasses
import json
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
    rounding_floor,
    run,
    weights_of,
)
from transformers import DynamicCache
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from moesaic.cache.batch import ForwardBatch
from moesaic.demo import ensure_demo
from moesaic.errors import CheckpointError, ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.layers import dsa
from moesaic.layers.moe import MoeWeights
from moesaic.models import Checkpoint, glm5next
from moesaic.weights.contract import load_tensors, to_checkpoint
from moesaic.weights.store import save_safetensors

TOL = 3e-5  # logits are O(5): ~6e-6 relative. Each KDA layer adds ~1e-6 relative (its per-head RMSNorm
# amplifies fp32 rounding of small head outputs); transformers disagrees with itself by ~3e-5 between a
# full and a chunked prefill of the same model


def within_oracle(err: float, oracle_self_err: float) -> bool:
    """Against transformers' full prefill, a run cut differently may differ as much as transformers'
    own run with the same cuts does (the KDA head RMSNorm amplifies fp32 rounding)."""
    return err < max(TOL, 1.5 * oracle_self_err)


VOCAB = 256
prompt = partial(random_ids, vocab=VOCAB)
KPOOL, TOPK = 4, 8  # selection: 2 pools + a tail of up to 3 tokens, out of prompts of up to 150

# every path: KDA, full and shared DSA (16 indexer heads), dense and MoE with group limiting
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense"],
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    qk_rope_head_dim=0,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=32,
    intermediate_size=96,
    index_topk=TOPK,
    index_n_heads=16,
    index_head_dim=16,
    index_kpool=KPOOL,
    linear_num_heads=4,
    linear_head_dim=16,
    hc_mult=4,
    swiglu_limit=1.0,
    pad_token_id=0,
    eos_token_id=2,
    max_position_embeddings=4096,
)
VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=32,
    out_hidden_size=64,
    projection_intermediate_size=32,
    patch_size=2,
    image_size=8,
)


def hf_model(text: dict, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.Glm5NextConfig(text_config=text, vision_config=VISION)
    model = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    randomize_(model, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        # KDA decays that vary by head and keep a memory of ~10 tokens (across pools and chunk cuts);
        # with the strong random decays of dt_bias ~ 0 many heads output ~1e-3 and the head RMSNorm
        # turns fp32 rounding into 1e-4 logit differences (transformers' own chunked vs full runs too)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(-2.0 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # the router's correction bias is a buffer, not a parameter
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    model = hf_model(TINY, seed=0)
    path = tmp_path_factory.mktemp("glm5next_hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ours(hf_ckpt):
    return Checkpoint.open(hf_ckpt[1]).build("float32")


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def hf_chunks(hf, chunks):
    """transformers' own cache: one forward per chunk, the logits of every row."""
    cache = DynamicCache(config=hf.config.text_config)
    outs = []
    with torch.no_grad():
        for c in chunks:
            out = hf(torch.tensor([c]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            outs.append(out.logits[0])
    return torch.cat(outs)


# ---------------------------------------------------------------- against transformers


def test_checkpoint_is_release_named_and_selection_is_sparse(hf_ckpt, ours, monkeypatch):
    ck = Checkpoint.open(hf_ckpt[1])
    names = set(ck.store.names())
    p = "model.language_model.layers."
    assert {
        p + "0.hc_attn_fn",
        p + "0.self_attn.q_conv1d.weight",
        p + "0.self_attn.f_a_proj.weight",
        p + "1.mlp.experts.7.up_proj.weight",
        p + "1.self_attn.indexer.index_kpool_compress_ape",
    } <= names
    assert not any(".attn_hc." in n or "gate_up_proj" in n for n in names)
    assert ck.plan().skipped_optional  # the MTP layer (index 4) is optional and absent here
    # perturbed constants: ape, gate and correction bias are not their init values
    w = ours.layers[1]
    assert w.mixer.indexer.ape.abs().sum() > 0
    assert w.mlp.bias.abs().sum() > 0
    # a 150-token prompt: each query attends to at most TOPK + KPOOL - 1 = 11 of the 150 keys
    seen = []
    attend = dsa.sparse_mla_attend
    monkeypatch.setattr(glm5next.dsa, "sparse_mla_attend", lambda *a: seen.append(a[-1]) or attend(*a))
    st = ours.new_state()
    ours.forward(ForwardBatch.build([(st, prompt(150))]))
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])  # the shared layer reuses the full layer's
    counts = (seen[0] >= 0).sum(-1)
    assert counts.max() == TOPK + KPOOL - 1 and bool((seen[0] <= torch.arange(150)[:, None]).all())  # causal
    assert st.layers[1].length == 150 and sorted(st.layers[1].bufs) == ["k", "latent", "z"]
    assert sorted(st.layers[2].bufs) == ["latent"]  # a shared layer keeps no indexer rows


def test_prefill_logits_match_transformers(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(150, seed=1)  # > 2 KDA chunks of 64, 37 pools, top-2 pools + tail selected
    ref = hf_logits(hf, ids)
    got, _ = run(ours, [ids])
    err = max_err(got, ref)
    print(f"glm5next prefill max abs err {err:.2e} (|logit| max {ref.abs().max():.2f})")
    assert got.shape == ref.shape and err < TOL


def test_cached_decode_matches_transformers_cache(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(90, seed=2)
    chunks = [ids[:70]] + [[t] for t in ids[70:]]  # decode crosses pool borders 72, 76, ... and the tail
    ref = hf_chunks(hf, chunks)[69:]
    got, _ = run(ours, chunks)
    got = got[69:]
    err = max_err(got, ref)
    full = hf_logits(hf, ids)[69:]
    err_full, err_hf_self = max_err(got, full), max_err(ref, full)
    print(
        f"glm5next cached decode max abs err {err:.2e} vs transformers' cache; {err_full:.2e} vs its full prefill "
        f"(transformers' own {err_hf_self:.2e})"
    )
    assert err < TOL and within_oracle(err_full, err_hf_self)


def test_chunked_prefill_at_pool_and_kda_chunk_borders(hf_ckpt, ours):
    hf, _ = hf_ckpt
    ids = prompt(140, seed=3)
    # cuts off the pool grid (4) and around the KDA chunk size (64): 63, 64, 65, 129
    cuts = [0, 5, 11, 63, 64, 65, 66, 101, 129, 140]
    chunks = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
    ref, ref_chunked = hf_logits(hf, ids), hf_chunks(hf, chunks)
    got, st = run(ours, chunks)
    err, err_full, err_hf_self = max_err(got, ref_chunked), max_err(got, ref), max_err(ref_chunked, ref)
    print(
        f"glm5next chunked prefill max abs err {err:.2e} vs transformers with the same cuts; {err_full:.2e} vs "
        f"its full prefill (transformers' own chunked vs full {err_hf_self:.2e})"
    )
    assert err < TOL and within_oracle(err_full, err_hf_self) and st.num_tokens == 140


def test_greedy_tokens_match_transformers_generate(hf_ckpt):
    hf, path = hf_ckpt
    ids = prompt(30, seed=4)
    check_greedy_matches_transformers(hf, path, ids, 20)


def test_release_like_schedule_from_defaults_and_freq_form(tmp_path):
    """3 KDA then DSA (the default layer_types), dense then MoE from first_k_dense_replace, indexer
    types from index_topk_freq, the KDA fields from linear_attn_config, transformers' default kpool."""
    text = {
        k: v
        for k, v in TINY.items()
        if k
        not in (
            "layer_types",
            "indexer_types",
            "mlp_layer_types",
            "linear_num_heads",
            "linear_head_dim",
            "index_kpool",
        )
    }
    text.update(
        num_hidden_layers=5,
        index_topk=16,
        index_topk_freq=1,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 3, "safe_gate": True},
    )
    hf = hf_model(text, seed=5)
    assert (
        hf.config.text_config.layer_types[3] == "indexed_attention"
        and hf.config.text_config.index_kpool == 16
    )
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for k in (
        "layer_types",
        "indexer_types",
        "mlp_layer_types",
    ):  # let moesaic derive them, as transformers did
        raw["text_config"].pop(k)
    raw["text_config"]["first_k_dense_replace"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = Checkpoint.open(tmp_path)
    assert glm5next.layer_schedule(ck.cfg) == ["kda+mlp"] * 3 + ["dsa+moe", "kda+moe"]
    assert ck.cfg.linear_conv_kernel_dim == 3 and ck.cfg.index_kpool == 16
    ids = prompt(100, seed=6)
    chunks = [ids[:50], ids[50:51], ids[51:]]
    model = ck.build("float32")
    full, _ = run(model, [ids])
    got, _ = run(model, chunks)
    # on the CPU every KDA row takes the token recurrence (layers/kda.py kda_attend): transformers is asked
    # the same way, its cached recurrence for each token
    hf_cut = hf_chunks(hf, token_by_token(chunks))
    err_full, err = max_err(full, hf_cut), max_err(got, hf_cut)
    print(f"glm5next release-like schedule (kpool 16) max abs err: prefill {err_full:.2e}, chunked {err:.2e}")
    oracle_self = max_err(hf_cut, hf_logits(hf, ids))
    print(f"transformers' own token-by-token vs full prefill: {oracle_self:.2e}")
    assert within_oracle(err_full, oracle_self) and within_oracle(err, oracle_self)


def token_by_token(chunks: list[list[int]]) -> list[list[int]]:
    """The chunks' tokens one at a time (transformers' recurrent KDA for each, as moesaic's CPU path takes them)."""
    return [[t] for c in chunks for t in c]


# ---------------------------------------------------------------- broken twins


def broken(model, **changes):
    twin = object.__new__(glm5next.Model)
    twin.__dict__.update(model.__dict__)
    twin.cfg = dataclasses.replace(model.cfg, **changes)
    twin.kda_dims = twin.cfg.kda_dims
    return twin


@pytest.mark.parametrize(
    "change",
    [dict(linear_lower_bound=None), dict(index_kpool_always_select_tail=False)],
    ids=["gate-without-lower-bound", "tail-left-out"],
)
def test_broken_twins_fail_the_oracle(hf_ckpt, ours, change):
    hf, _ = hf_ckpt
    ids = prompt(60, seed=7)
    ref = hf_logits(hf, ids)
    good, _ = run(ours, [ids])
    bad, _ = run(broken(ours, **change), [ids])
    print(f"glm5next broken twin {change}: err {max_err(bad, ref):.2e} (real {max_err(good, ref):.2e})")
    assert max_err(good, ref) < TOL and max_err(bad, ref) > 1e-3


# ---------------------------------------------------------------- engine, states


def test_batch_of_different_lengths_equals_singles(hf_ckpt):
    prompts = [prompt(n, seed=10 + n) for n in (5, 17, 31, 2)]
    check_batch_equals_singles(hf_ckpt[1], prompts, max_tokens=10, max_batch_tokens=24)


def test_mixed_prefill_and_decode_in_one_forward(ours):
    a, b = prompt(22, seed=11), prompt(13, seed=12)
    assert mixed_batch_err(ours, a, b) < 1e-5


def test_rollback_then_refeed(ours):
    ids, other = prompt(45, seed=13), prompt(5, seed=14)
    st = ours.new_state(rollback_window=5)
    full, _ = run(ours, [ids[:40], ids[40:]], state=st)
    st.rollback(5)
    assert st.num_tokens == 40 and st.layers[1].length == 40
    again = ours.forward(ForwardBatch.build([(st, ids[40:])], logits="all"))
    assert torch.equal(again, full[40:])  # same state, same shapes: bit for bit
    st.rollback(3)  # shorter re-feed: GEMMs over fewer rows round differently
    part = ours.forward(ForwardBatch.build([(st, ids[42:44])], logits="all"))
    assert max_err(part, full[42:44]) < 1e-5
    st.rollback(4)
    changed = ours.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(ours, [ids[:40] + other])
    err = max_err(changed, fresh[40:])
    print(f"glm5next rollback + different tokens vs fresh run max abs err {err:.2e}")
    assert err < 1e-5
    with pytest.raises(ValueError, match="window"):
        st.rollback(6)


def test_snapshot_restore_and_state_bytes(ours):
    ids = prompt(30, seed=15)
    st = ours.new_state()
    ours.forward(ForwardBatch.build([(st, ids[:21])]))
    snap = st.snapshot()
    a = ours.forward(ForwardBatch.build([(st, ids[21:])], logits="all"))
    st2 = ours.new_state()
    st2.restore(snap)
    b = ours.forward(ForwardBatch.build([(st2, ids[21:])], logits="all"))
    assert torch.equal(a, b)
    per_token, fixed = glm5next.state_bytes(ours.cfg, 4)
    # latent 32 on 2 DSA layers + k, z 16 each on the full one; KDA: conv 3 x 192 + S 4 x 16 x 16, fp32, x 2
    assert (per_token, fixed) == ((2 * 32 + 2 * 16) * 4, 2 * 4 * (3 * 192 + 4 * 16 * 16))
    assert st.nbytes == st2.nbytes == 30 * per_token + fixed
    win = ours.new_state(rollback_window=3)
    run(ours, [ids[:10], ids[10:12], ids[12:]], state=win)
    assert win.nbytes == 30 * per_token + glm5next.state_bytes(ours.cfg, 4, rollback_window=3)[1]


@pytest.fixture(scope="module")
def demo_models():
    """The GLM demo (moesaic.demo: the release layout with its MTP layer, NVFP4 experts) in fp32 and bf16."""
    path = ensure_demo("demo-glm5-next-nvfp4")
    return {dt: Checkpoint.open(path).build(dt) for dt in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 4])
def test_state_bytes_are_exact_on_the_demo(demo_models, dtype, window):
    """The planner's (per token, fixed) is what a sequence holds after T tokens fed one per forward, with
    T past the rollback window, the k-pool (4) and the KDA conv tail (3)."""
    model = demo_models[dtype]
    per_token, fixed = check_state_bytes_exact("demo-glm5-next-nvfp4", dtype, window, T=13)
    assert fixed == (1 + window) * glm5next.state_bytes(model.cfg, model.dtype.itemsize)[1] > 0


def test_demo_binds_its_mtp_layer_and_serves_mtp(demo_models):
    """The demo ships the MTP layer: it is bound into typed structures (one weight per contract tensor of
    that layer; the build's check_all_taken has seen every loaded tensor bound), and the config's draft
    heads say "mtp"; a config without MTP layers has none."""
    model = demo_models["float32"]
    cfg, L = model.cfg, model.cfg.num_hidden_layers
    assert len(model.mtp) == 1
    mtp = model.mtp[0]
    assert isinstance(mtp, glm5next.MtpLayer) and isinstance(mtp.mlp, MoeWeights)
    assert mtp.attn.indexer is not None and mtp.eh_proj.shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    specs = [s for s in glm5next.tensor_specs(cfg) if s.layer == L]
    assert specs and all(s.optional for s in specs)
    assert len(list(weights_of(mtp))) == len(specs)
    assert glm5next.draft_heads(cfg) == ("mtp",)
    assert glm5next.draft_heads(dataclasses.replace(cfg, num_nextn_predict_layers=0)) == ()
    assert glm5next.draft_heads(glm5next.parse_config({"model_type": "glm5_next", **TINY})) == ("mtp",)


# ---------------------------------------------------------------- the indexer and DSA pieces


def test_selection_rule_by_hand():
    """Pools [0..3], [4..7], [8..11]; query 10 sees pools 0 and 1 (pool 2 ends at 11) and the tail
    8, 9, 10; with top-1 it keeps the better of its two candidates."""
    scores = torch.tensor([[0.5, 0.9, 5.0], [0.5, 0.9, 5.0], [0.5, 0.9, 5.0]])
    positions = torch.tensor([10, 11, 3])
    sel = dsa.select(scores, positions, kpool=4, index_topk=4, always_select_tail=True)
    assert sel.tolist() == [[4, 5, 6, 7, 8, 9, 10], [8, 9, 10, 11, -1, -1, -1], [0, 1, 2, 3, -1, -1, -1]]
    no_tail = dsa.select(scores, positions, kpool=4, index_topk=4, always_select_tail=False)
    assert no_tail.tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("kpool,topk", [(1, 8), (4, 16), (4, 18), (3, 9)])
def test_causal_selection_is_what_scores_select_within_topk(kpool, topk, tail):
    """While a context's complete pools all fit in index_topk, `select` keeps all of them whatever the
    scores, so the model skips the indexer's queries and scores (`causal_selection`): the same token sets,
    in a selection only as wide as they need (not index_topk); one more pool and it is not the same rule."""
    g = torch.Generator().manual_seed(kpool * topk)
    for T in range(1, topk + kpool + 1):
        positions = torch.arange(max(0, T - 5), T)  # a verify-sized block at the end of the context
        fits = dsa.every_pool_fits(T, kpool, topk)
        assert fits == (T // kpool <= topk // kpool)
        if not fits:
            continue
        scores = torch.randn(len(positions), T // kpool, generator=g)
        want = dsa.select(scores, positions, kpool, topk, tail)
        got = dsa.causal_selection(positions, T, kpool, topk, tail)
        # as wide as its tokens (the torch path), at most select's width
        assert got.shape[0] == want.shape[0] and got.shape[1] == max(
            1, T // kpool * kpool + (kpool - 1) * tail
        )
        valid = lambda sel: [{t for t in r.tolist() if t >= 0} for r in sel]  # noqa: E731
        assert valid(got) == valid(want), (T, kpool, topk)
        # a decode row, the newest token: the short form (one arange) lays it out as the general one
        last = positions[-1:]
        assert torch.equal(
            dsa.causal_selection(last, T, kpool, topk, tail, newest=True),
            dsa.causal_selection(last, T, kpool, topk, tail),
        ), (T, kpool, topk)
        # the newest block (a verify block, a prompt chunk): the same token sets, each row in increasing
        # order from its start and -1 after, as a decode row at that position lays it out
        short = dsa.causal_selection(positions, T, kpool, topk, tail, newest=True)
        assert short.shape == got.shape and valid(short) == valid(want), (T, kpool, topk)
        for i, p in enumerate(positions.tolist()):
            alone = dsa.causal_selection(torch.tensor([p]), p + 1, kpool, topk, tail, newest=True)[0]
            k = int((alone >= 0).sum())
            assert short[i, :k].tolist() == alone[:k].tolist() and (short[i, k:] == -1).all(), (T, p)
    T = (topk // kpool + 1) * kpool  # one pool too many: the scores drop one of the query's T tokens
    want = dsa.select(torch.randn(1, T // kpool, generator=g), torch.tensor([T - 1]), kpool, topk, tail)
    assert not dsa.every_pool_fits(T, kpool, topk) and 0 < (want[0] >= 0).sum() < T


def test_selection_matches_transformers_indexer(hf_ckpt, ours):
    hf, _ = hf_ckpt
    idx = hf.model.language_model.layers[1].self_attn.indexer
    T = 70
    g = torch.Generator().manual_seed(16)
    x, qr = torch.randn(1, T, 64, generator=g), torch.randn(1, T, 48, generator=g)
    with torch.no_grad():
        ref = idx(x, qr, torch.ones(1, T, dtype=torch.bool), None)[0].long()
    w = ours.layers[1].mixer.indexer
    k, z = dsa.indexer_keys(x[0], w)
    q, wts = dsa.indexer_queries(qr[0], x[0], w, 16)
    assert q.shape == (T, 16, 16)
    got = dsa.kpool_select(q, wts, k, z, w.ape, torch.arange(T), TOPK)
    assert got.shape == ref.shape == (T, TOPK + KPOOL - 1)
    assert [set(r.tolist()) - {-1} for r in got] == [set(r.tolist()) - {-1} for r in ref]


def test_expanded_and_gathered_attention_agree():
    g = torch.Generator().manual_seed(17)
    n, T, H, dn, dv, kvr = 9, 40, 3, 8, 6, 12
    q, latent = torch.randn(n, H, dn, generator=g), torch.randn(T, kvr, generator=g)
    w = torch.randn(H * (dn + dv), kvr, generator=g) * 0.3
    scores = torch.randn(n, T // 4, generator=g)
    sel = dsa.select(scores, torch.arange(T - n, T), 4, 8, True)
    a = dsa.attend_expanded(q, latent, w, dv, 0.3, sel)
    b = dsa.attend_gathered(q, latent, w, dv, 0.3, sel, block_elems=50)  # several query blocks
    # dense reference: softmax over the selected keys only
    kv = torch.nn.functional.linear(latent, w).view(T, H, dn + dv)
    mask = dsa.selection_mask(sel, T)
    s = torch.einsum("nhd,thd->nht", q, kv[..., :dn]) * 0.3
    ref = torch.einsum("nht,thv->nhv", s.masked_fill(~mask[:, None], float("-inf")).softmax(-1), kv[..., dn:])
    assert max_err(a, ref) < 1e-5 and max_err(b, ref) < 1e-5


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "extra",
    [
        dict(indexer_types=None, index_topk_pattern="FFSF"),
        dict(indexer_types=None, index_topk_pattern=["full", "full", "shared", "full"]),
        dict(indexer_types=None, index_topk_freq=2, index_skip_topk_offset=1),
        dict(indexer_types=None, index_topk_freq=3),
        dict(layer_types=None, mlp_layer_types=None, indexer_types=None),
        dict(layer_types=["linear_attention", "full_attention", "indexed_attention", "linear_attention"]),
        dict(
            linear_attn_config={
                "head_dim": 8,
                "num_heads": 2,
                "short_conv_kernel_size": 2,
                "gate_lower_bound": None,
            }
        ),
        dict(linear_attn_config={"gate_lower_bound": None, "safe_gate": False}),
        dict(linear_lower_bound=None),
    ],
    ids=[
        "pattern-str",
        "pattern-list",
        "freq-offset",
        "freq3",
        "defaults",
        "full_attention-alias",
        "linear_attn_config",
        "no-safe-gate",
        "null-bound",
    ],
)
def test_config_schedules_match_transformers(extra):
    raw = {**TINY, **extra}
    raw = {k: v for k, v in raw.items() if v is not None or k == "linear_lower_bound"}
    hf = Glm5NextTextConfig(**raw)
    try:
        cfg = glm5next.parse_config(
            {"model_type": "glm5_next", "text_config": {**raw, "model_type": "glm5_next_text"}}
        )
    except ConfigError as e:  # moesaic refuses a shared layer with no full DSA layer before it
        assert "shared DSA layer" in str(e)
        return
    kinds = {"linear_attention": "kda", "indexed_attention": "dsa"}
    assert list(cfg.layer_types) == [kinds[t] for t in hf.layer_types]
    assert list(cfg.mlp_layer_types) == hf.mlp_layer_types and list(cfg.indexer_types) == hf.indexer_types
    assert (
        cfg.linear_num_heads,
        cfg.linear_head_dim,
        cfg.linear_conv_kernel_dim,
        cfg.linear_lower_bound,
    ) == (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim, hf.linear_lower_bound)


def test_flat_and_nested_configs_agree_and_errors_name_the_field():
    nested = glm5next.parse_config({"model_type": "glm5_next", "text_config": dict(TINY)})
    flat = glm5next.parse_config({"model_type": "glm5_next", **TINY})
    assert nested == flat and nested.eos_token_ids == (2,)
    # full DSA (1), KDA, shared DSA (3): transformers raises at run time (it hands a selection only to
    # the very next layer); moesaic shares the selection across the KDA layer
    kda_between = dict(
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full", "full", "full", "shared"],
    )
    assert (
        glm5next.parse_config({"model_type": "glm5_next", **{**TINY, **kda_between}}).indexer_types[3]
        == "shared"
    )
    for bad, word in [
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(index_topk=10), "index_topk"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(indexer_types=["shared"] * 4), "shared DSA layer"),
        (dict(index_topk_pattern="FFS"), "index_topk_pattern"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(mhc=False), "mhc"),
    ]:
        raw = {**TINY, **bad}
        if "index_topk_pattern" in bad:
            raw.pop("indexer_types")
        with pytest.raises(ConfigError, match=word):
            glm5next.parse_config({"model_type": "glm5_next", **raw})


# ---------------------------------------------------------------- the release: contract and inspect

# GLM-5.3-Flash text config as released (sources: transformers 5.23 Glm5NextTextConfig defaults;
# a served checkpoint's config.json quoted in a public test suite (engine/profiles/glm53, "read off
# srv2 ... st-glm53-nvidia-tp4-9391/config.json"); Metrale's MODEL.toml for LibertAIDAI/GLM-5.3-Flash-NVFP4
# @ 9e0d74e3 (vocab 154624, index_kpool 4); layer_types spelled "deepseek_sparse_attention" as
# in several public ports' copies of the checkpoint config).
RELEASE_TEXT = {
    "model_type": "glm5_next_text",
    "vocab_size": 154624,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 45,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "first_k_dense_replace": 3,
    "n_routed_experts": 288,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "moe_router_dtype": "float32",
    "n_group": 1,
    "topk_group": 1,
    "mhc": True,
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "mla_use_nope": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 256,
    "qk_rope_head_dim": 0,
    "v_head_dim": 256,
    "head_dim": 0,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_kpool": 4,
    "index_kpool_compress": True,
    "index_kpool_always_select_tail": True,
    "index_share_for_mtp_iteration": True,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "linear_lower_bound": -5.0,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
    "indexer_types": ["full"] * 45,
    "linear_attn_config": {
        "full_attn_layers": [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43],
        "gate_lower_bound": -5.0,
        "head_dim": 128,
        "kda_layers": [i for i in range(45) if i % 4 != 3],
        "num_heads": 64,
        "short_conv_kernel_size": 4,
    },
}


def test_inspect_release_config_and_contract(tmp_path):
    raw = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": RELEASE_TEXT,
        "vision_config": {"model_type": "glm5_next_vision"},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = glm5next.parse_config(raw)
    # the checkpoint names the contract reads (an index file in the release layout, no shards)
    names = [n for s in glm5next.tensor_specs(cfg) for n, _ in glm5next.checkpoint_naming().source(s).parts]
    structural = [n for n in names if ".mlp." not in n]
    assert len(structural) == 1047 and sum("hc_" in n for n in names) == 270  # Metrale's skeleton counts
    assert "model.language_model.layers.45.eh_proj.weight" in names
    assert "model.language_model.layers.44.self_attn.v_conv1d.weight" in names
    assert "model.language_model.layers.45.mlp.experts.287.down_proj.weight" in names
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001.safetensors" for n in names}})
    )

    info = inspect_checkpoint(tmp_path)
    sched = info["layer_schedule"]
    assert info["family"] == "glm5next" and info["num_layers"] == 45
    assert sched[:4] == ["kda+mlp"] * 3 + ["dsa+moe"] and sched[4:8] == ["kda+moe"] * 3 + ["dsa+moe"]
    assert sched.count("dsa+moe") == 11 and sum(s.startswith("kda") for s in sched) == 34
    assert info["tensor_count"] == len(names)
    # bf16 caches: latent 11 x 512 x 2 + indexer k, z 11 x 256 x 2 per token; KDA fp32 state per sequence
    kda_state = 4 * (3 * 3 * 8192 + 64 * 128 * 128)  # conv tail (K-1 = 3 rows of 24576) + 64 x 128 x 128
    assert info["state_bytes_per_token"] == 11 * 512 * 2 + 11 * 256 * 2 == 16896
    assert info["state_bytes_fixed_per_sequence"] == 34 * kda_state == 152_633_344
    assert info["state_bytes_per_sequence"] == 16896 * 1048576 + 34 * kda_state
    assert info["index_kpool"] == 4 and info["mtp_layers"] == 1
    # "320B-A18B" (Metrale MODEL.toml; the MTP layer included, routed experts at 8 of 288)
    assert 320e9 < info["params_total"] < 321e9 and 17e9 < info["params_active_per_token"] < 19e9
    print(
        f"glm5next release: {info['state_bytes_per_token']} B/token, {info['state_bytes_fixed_per_sequence']:,} B/sequence "
        f"fixed, {info['params_total']:,} parameters, {info['tensor_count']} tensors"
    )


def test_module_names_load_and_release_names_round_trip(hf_ckpt, ours, tmp_path):
    """A raw state_dict (transformers' module names) loads to the same model; writing the loaded
    tensors back through the release naming gives the saved checkpoint bit for bit."""
    hf, path = hf_ckpt
    sd = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if k.startswith(("model.language_model.", "lm_head"))
    }
    assert "model.language_model.layers.0.self_attn.conv1d.weight" in sd
    save_safetensors(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    other = Checkpoint.open(tmp_path).build("float32")
    ids = prompt(20, seed=18)
    assert torch.equal(run(other, [ids])[0], run(ours, [ids])[0])
    ck = Checkpoint.open(path)
    tensors = load_tensors(ck.plan(), ck.store, torch.float32, "cpu")
    written = to_checkpoint(glm5next.tensor_specs(ck.cfg), glm5next.checkpoint_naming(), tensors)
    text_names = [n for n in ck.store.names() if not n.startswith("model.visual.")]
    assert sorted(written) == sorted(text_names)
    assert all(torch.equal(written[n], ck.store.get(n)) for n in written)


def test_mtp_layer_loads_when_present(hf_ckpt, ours, tmp_path):
    """The MTP layer at index num_hidden_layers (release names, no hc_* tensors) is optional: loaded
    when the checkpoint has it, refused when it has only part of it; the text model is unchanged."""
    _, path = hf_ckpt
    ck = Checkpoint.open(path)
    cfg = ck.cfg
    mtp = [s for s in glm5next.tensor_specs(cfg) if s.optional and s.layer == cfg.num_hidden_layers]
    g = torch.Generator().manual_seed(19)
    extra = to_checkpoint(
        mtp, glm5next.checkpoint_naming(), {s.name: torch.randn(s.shape, generator=g) for s in mtp}
    )
    assert "model.language_model.layers.4.eh_proj.weight" in extra and not any("hc_" in n for n in extra)
    assert "model.language_model.layers.4.self_attn.indexer.wk.weight" in extra
    tensors = {n: ck.store.get(n) for n in ck.store.names()}
    save_safetensors({**tensors, **extra}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with_mtp = Checkpoint.open(tmp_path).build("float32")
    assert len(with_mtp.mtp) == 1 and with_mtp.mtp[0].eh_proj.shape == (64, 128)
    ids = prompt(12, seed=20)
    assert torch.equal(run(with_mtp, [ids])[0], run(ours, [ids])[0])
    extra.pop("model.language_model.layers.4.enorm.weight")
    save_safetensors({**tensors, **extra}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="MTP layer"):
        Checkpoint.open(tmp_path).build("float32")


def test_recurrent_decode_equals_chunked_prefill(hf_ckpt, ours):
    """One token at a time from the first (KDA recurrence, gathered latent attention) against one
    prefill (KDA chunked WY form), row by row within 3x the row's fp32 rounding floor measured in this
    run (`rounding_floor`: how far the row moves when the embeddings change by one rounding step).

    Why not a fixed constant: this model is ill-conditioned at some rows. At row 37 of this prompt a
    head of the last KDA layer has outputs ~1e-3 (rms) where its inputs are O(1), and its per-head
    RMSNorm scales them ~500x, so fp32 rounding anywhere upstream moves that logit by ~4e-5 (its
    floor here). Against a float64 evaluation of the same weights the token-by-token pass is off by
    1.0e-5 and the prefill by 3.8e-5 (transformers' prefill 1.3e-5, its decode 1.8e-5), and which
    fp32 kernels run decides the rest: with `ATEN_CPU_CAPABILITY=default` the same code on the same
    machine gives 1.4e-5 instead of 4.8e-5; an AVX-512 Xeon gave < 3e-5, an AVX2 EPYC 4.8e-5.
    Over 20 prompts the worst row was at 1.6x its floor, so 3x holds a margin; a real difference
    between the two paths (a 1% change of an eps) is off by 1e-2 or more."""
    hf, _ = hf_ckpt
    ids = prompt(40, seed=21)
    chunks_full, chunks_steps = [ids], [[t] for t in ids]
    full, _ = run(ours, chunks_full)
    steps, _ = run(ours, chunks_steps)
    rows = (steps - full).abs().amax(-1)
    floor = torch.maximum(rounding_floor(ours, chunks_full), rounding_floor(ours, chunks_steps))
    ratio = rows / floor
    hf_self = max_err(hf_chunks(hf, chunks_steps), hf_logits(hf, ids))
    print(
        f"glm5next token-by-token vs prefill max abs err {rows.max():.2e} (row {int(rows.argmax())}, whose "
        f"fp32 rounding floor is {floor[rows.argmax()]:.2e}); worst row {ratio.max():.2f}x its floor; "
        f"transformers' own token-by-token vs prefill {hf_self:.2e}"
    )
    assert ratio.max() < 3 and floor.max() < 1e-4  # and the model is not chaotic: one rounding moves < 1e-4


def test_bf16_model_tracks_transformers_in_bf16(hf_ckpt, ours):
    """In bf16 this tiny random model flips pool and expert choices (transformers' own bf16 run is
    ~2.5 off its fp32 one), so bf16 is held to transformers' bf16: row by row until choices diverge,
    and no further from fp32 than the oracle is."""
    hf, path = hf_ckpt
    ids = prompt(40, seed=22)
    ref32, _ = run(ours, [ids])
    got, _ = run(Checkpoint.open(path).build("bfloat16"), [ids])
    hf16 = transformers.Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()
    ref16 = hf_logits(hf16, ids).float()
    rows = (got - ref16).abs().max(-1).values
    assert got.dtype == torch.float32
    assert rows.median() < 0.2 and rows[:10].max() < 0.2
    assert max_err(got, ref32) < 1.5 * max_err(ref16, ref32) + 0.1


@pytest.mark.parametrize("paged", [False, True])
def test_pooled_keys_kept_with_the_rows(paged, monkeypatch):
    """kpool_select_held keeps each complete pool's pooled keys with the held rows (the torch path): a step
    pools only the pools it completed, and its selection is kpool_select's over all the rows held, after a
    prompt, token by token, after a rollback into a pool with other rows written again, and after a restore;
    pool_keys of pools alone or in runs is pool_keys of all of them, to the bit (what the memo relies on)."""
    from moesaic.cache.paged import BLOCK_SIZE, BlockTable, PagePool
    from moesaic.cache.state import SequenceState, TokenRows

    g = torch.Generator().manual_seed(21)
    c, P, topk, heads = 16, 4, 8, 3
    ape = torch.randn(P, c, generator=g)
    fresh = lambda: SequenceState([TokenRows({"k": c, "z": c}, torch.bfloat16, "cpu", 4 * BLOCK_SIZE)])  # noqa: E731
    state = fresh()
    if paged:
        state = PagePool(state, num_blocks=6).page(fresh(), BlockTable([3, 0, 5, 1]))
    held = state.layers[0]
    real, pooled = dsa.pool_keys, []
    monkeypatch.setattr(dsa, "pool_keys", lambda k, z, a: (pooled.append(k.shape[0]), real(k, z, a))[1])

    def step(n_new: int) -> list[int]:
        """Writes n_new rows, selects for them; the rows each pool_keys call of the held path took."""
        held.write(**{f: torch.randn(n_new, c, generator=g).bfloat16() for f in ("k", "z")})
        T = held.length
        q, w = torch.randn(n_new, heads, c, generator=g), torch.randn(n_new, heads, generator=g)
        pos = torch.arange(T - n_new, T)
        pooled.clear()
        got = dsa.kpool_select_held(q, w, held, ape, pos, topk)
        calls = list(pooled)
        want = dsa.kpool_select(q, w, held.rows("k")["k"], held.rows("z")["z"], ape, pos, topk)
        assert torch.equal(got, want), T
        return calls

    assert step(37) == [36]  # a prompt: its 9 complete pools
    calls = [step(1) for _ in range(10)]  # token by token: a pool when its last row arrives
    assert calls == [[4] if (38 + i) % P == 0 else [] for i in range(10)]
    held.rollback(6)  # 41 rows: into pool 10, whose pooled keys go (and pool 11's)
    assert held.memo("pooled_keys", P).count == 10
    assert step(6) == [4]  # pool 10 again, from its new rows
    mark = held.snapshot()
    step(9)
    held.restore(mark)  # paged: the pages keep the rows written last, so the pools below 47 stay
    assert held.memo("pooled_keys", P).count == (11 if paged else 0)  # contiguous: the snapshot's buffers
    step(3)
    for dtype in (torch.bfloat16, torch.float32):
        k, z = torch.randn(2, 103, c, generator=g).to(dtype)
        whole = real(k, z, ape)
        for cuts in ([0, 1, 25], [0, 24, 25], [0, 3, 10, 11, 25]):
            parts = [real(k[a * P : b * P], z[a * P : b * P], ape) for a, b in zip(cuts[:-1], cuts[1:])]
            assert torch.equal(torch.cat(parts), whole), (dtype, cuts)

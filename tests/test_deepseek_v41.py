"""DeepSeek-V4.1-Flash, proven without an oracle (no package implements it):

* with Engram off, V4's layer kinds and every layer its own KV/index source, the V4.1 model equals
  the V4 model (itself proven against transformers in test_deepseek_v4.py) on the same weights;
* each V4.1 feature switched on changes the logits, and each switched off on the release-shaped
  tiny model changes them too (no feature silently ignored);
* a plain token-by-token reference written here from the description of the release
  (docs/families/deepseek_v41.md: pooling by ratio, index keys from the latent, shared entries and
  selections, candidate blocks, delayed pre, no q norm, Engram before the attention site) gives the
  same logits as the model;
* chunked prefill, decode, rollback, snapshot/restore and batches agree with one full prefill;
* the release's quantized layout (fp8 E4M3 + UE8M0 32x32 dense, fp4 experts, fp8 table rows) gives
  the logits of its dequantized weights, kept packed;
* `inspect` on the release config alone reports the published Engram rows and sizes.
Max abs errors are printed (-s)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers import check_batch_equals_singles, check_state_bytes_exact, demo_model, max_err

from moesaic.cache.batch import ForwardBatch
from moesaic.demo import deepseek_v41 as v41demo
from moesaic.demo import random_tensors as demo_random_tensors
from moesaic.errors import ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.layers import mhc
from moesaic.layers.csa import CSA, HCA, SLIDING, grouped_out
from moesaic.layers.engram import EngramState, build_token_map, engram_forward, table_rows
from moesaic.layers.moe import moe
from moesaic.models import Checkpoint, deepseek_v4
from moesaic.models import deepseek_v41 as v41
from moesaic.tokenizer import ByteTokenizer
from moesaic.weights.bind import Tensors
from moesaic.weights.quant import (
    QuantizedTensor,
    e4m3_to_float,
    e8m0_to_float,
    load_quantized,
    resolve_format,
)
from moesaic.weights.store import save_safetensors

TOL = 2e-5
GIB = 2**30

# V4's kinds (sliding, overlapped CSA with its own index compressor, HCA) without hash layers
V4_TINY = dict(
    model_type="deepseek_v4",
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=[SLIDING, CSA, HCA, CSA],
    mlp_layer_types=["moe"] * 4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    compress_rates={CSA: 4, HCA: 8},
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=3,
    swiglu_limit=1.0,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
)
V41_AS_V4 = dict(V4_TINY, model_type="deepseek_v41", q_head_norm=True, mhc_delayed_pre=False)
ENGRAM = dict(
    engram_layer_ids=[0, 2],
    engram_num_embeddings=list(table_rows([64] * 3, 2, 4, 2)),
    engram_max_ngram_size=4,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_vocab_size=64,
    engram_compressed_vocab_size=256,
    engram_pad_id=0,
)

TEXT = (
    v41demo.TINY_TEXT_CONFIG
)  # release-shaped: ratios (0, 0, 2, 2, 1, 1), sources, candidates, Engram at 1 and 4


def prompt(n, seed=0, vocab=256):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, chunks, logits="all", state=None, rollback_window=0):
    st = state if state is not None else model.new_state(rollback_window)
    return torch.cat([model.forward(ForwardBatch.build([(st, c)], logits=logits)) for c in chunks]), st


def live(tensors: dict, seed: int) -> dict:
    """Sinks that take a share of the softmax and a router bias that changes choices."""
    g = torch.Generator().manual_seed(seed)
    for k in tensors:
        if k.endswith("sinks"):
            tensors[k] = torch.randn(tensors[k].shape, generator=g)
        elif k.endswith("e_score_correction_bias"):
            tensors[k] = 0.3 * torch.randn(tensors[k].shape, generator=g)
    return tensors


@pytest.fixture(scope="module")
def v4_weights():
    """V4 weights (V4's contract) plus Engram tensors for layers 0 and 2."""
    cfg4 = deepseek_v4.parse_config(V4_TINY)
    tensors = live(demo_random_tensors(deepseek_v4.tensor_specs(cfg4), seed=1), seed=2)
    with_engram = v41.parse_config(dict(V41_AS_V4, **ENGRAM))
    tensors.update({k: v for k, v in v41demo.random_tensors(with_engram, seed=3).items() if ".engram." in k})
    return cfg4, tensors


def v41_model(raw, tensors, token_map=None):
    return v41.Model(v41.parse_config(raw), Tensors(tensors), torch.float32, "cpu", token_map=token_map)


# ---------------------------------------------------------------- V4.1 with its features off is V4


def test_v41_with_its_features_off_equals_v4(v4_weights):
    cfg4, tensors = v4_weights
    ours4 = deepseek_v4.Model(cfg4, Tensors(tensors), torch.float32, "cpu")
    ours41 = v41_model(V41_AS_V4, tensors)
    assert ours41.cfg.kv_source_layer_ids == (1, 2, 3) and ours41.cfg.index_source_layer_ids == (1, 3)
    ids = prompt(45)  # 11 CSA entries (top-3 kept), 5 HCA entries
    ref, st4 = run(ours4, [ids])
    got, st41 = run(ours41, [ids])
    steps, _ = run(ours41, [ids[:30]] + [[t] for t in ids[30:]], logits="last")
    err = max(max_err(got, ref), max_err(steps, ref[29:]))
    print(f"deepseek_v41 (V4 kinds, features off) vs deepseek_v4: max abs err {err:.2e}")
    assert err < 1e-5
    assert st41.nbytes == st4.nbytes
    assert v41.state_bytes(ours41.cfg, 2, 3) == deepseek_v4.state_bytes(cfg4, 2, 3)


# each V4.1 feature switched on, against the same model without it
FEATURES = {
    "no per-head q norm": ({"q_head_norm": False}, {}),
    "delayed pre (no hc_head)": ({"mhc_delayed_pre": True}, {}),
    "shared KV source": ({"kv_source_layer_ids": [1, 2]}, {}),
    "shared index source": (
        {"kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1]},
        {"kv_source_layer_ids": [1, 2]},
    ),
    "candidate blocks": (
        {
            "kv_source_layer_ids": [1, 2],
            "candidate_source_layer_id": 1,
            "candidate_topk_blocks": 1,
            "candidate_block_size": 2,
        },
        {"kv_source_layer_ids": [1, 2]},
    ),
    "Engram": (ENGRAM, {}),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_v41_feature_switched_on_changes_the_logits(v4_weights, feature):
    _, tensors = v4_weights
    on, off = FEATURES[feature]
    ids = prompt(45, seed=1)
    identity = torch.arange(256)
    with_it = v41_model(dict(V41_AS_V4, **on), tensors, identity)
    without = v41_model(dict(V41_AS_V4, **off), tensors, identity)
    a, st = run(with_it, [ids])
    b, _ = run(without, [ids])
    diff = max_err(a, b)
    print(f"deepseek_v41 feature {feature!r}: logits move by {diff:.2e}")
    assert diff > 1e-3
    if feature == "shared KV source":  # layer 3 holds no compressor of its own: it reads layer 1's entries
        assert (
            st.layers[3].compressor is None
            and st.layers[3].indexer is None
            and st.layers[1].indexer is not None
        )
        saved = (32 + 16) // 4 * 4  # one CSA layer's entries + index entries per token, fp32
        assert v41.state_bytes(with_it.cfg, 4)[0] == v41.state_bytes(without.cfg, 4)[0] - saved


# ---------------------------------------------------------------- the release-shaped tiny model


def byte_map():
    return build_token_map(v41.tokenizer_vocab(ByteTokenizer()), TEXT["engram_compressed_vocab_size"])


@pytest.fixture(scope="module")
def superset():
    """Weights for the tiny model and every twin below: all compressed layers own sources, hc_head."""
    raw = dict(TEXT, kv_source_layer_ids=None, index_source_layer_ids=None, mhc_delayed_pre=False)
    return v41demo.random_tensors(v41.parse_config(raw), seed=5)


@pytest.fixture(scope="module")
def tiny(superset):
    return v41_model(TEXT, superset, byte_map())


def test_tiny_config_roles(tiny):
    c = tiny.cfg
    assert v41.layer_schedule(c) == [
        "swa+moe",
        "engram+swa+moe",
        "csa2(r2,kv,idx)+moe",
        "csa2(r2)+moe",
        "engram+csa2(r1,kv,idx,cand)+moe",
        "csa2(r1,idx)+moe",
    ]
    assert c.kv_from == (None, None, 2, 2, 4, 4) and c.index_from == (None, None, 2, 2, 4, 5)
    assert c.uses_candidates == (False,) * 5 + (True,) and c.mtp_compress_ratios == (0,)
    assert c.mlp_layer_types == ("moe",) * 6 and not c.q_head_norm and c.delayed_pre
    names = {s.name for s in v41.tensor_specs(c)}
    assert "model.layers.3.self_attn.compressor.kv_proj.weight" not in names  # shares layer 2's
    assert "model.layers.4.self_attn.compressor.gate_proj.weight" not in names  # ratio 1: no gate
    assert (
        "model.layers.5.self_attn.indexer.wk.weight" not in names
    )  # index source only: scores layer 4's keys
    assert "model.layers.5.self_attn.compressor.indexer.q_b_proj.weight" in names
    assert not any("tid2eid" in n or "position_bias" in n or "hc_head" in n for n in names)


TWINS = {
    "Engram off": {"engram_layer_ids": []},
    "candidate blocks off": {"candidate_source_layer_id": None},
    "every layer its own KV and index source": {"kv_source_layer_ids": None, "index_source_layer_ids": None},
    "per-head q norm on": {"q_head_norm": True},
    "delayed pre off (V4's hc_head)": {"mhc_delayed_pre": False},
}


@pytest.mark.parametrize("twin", list(TWINS))
def test_each_v41_feature_switched_off_changes_the_logits(tiny, superset, twin):
    ids = prompt(30, seed=2, vocab=259)
    ref, _ = run(tiny, [ids])
    got, _ = run(v41_model(dict(TEXT, **TWINS[twin]), superset, byte_map()), [ids])
    diff = max_err(got, ref)
    print(f"deepseek_v41 twin {twin!r}: logits move by {diff:.2e}")
    assert diff > 1e-3


def reference_logits(model, ids):
    """One full prefill written from the description of the release, token by token, on the model's
    weights (read through the bound layers' attributes). Shared with
    the model (and proven through V4): rope sets, the mHC maps, the MoE block, grouped_out, the Engram
    layer (layers/engram.py, tested on its own)."""
    c = model.cfg
    T, n, eps = len(ids), c.hc_mult, c.rms_norm_eps
    pos, tok = torch.arange(T), torch.tensor(ids)
    H, D, nI, cI, W = c.num_attention_heads, c.head_dim, c.index_n_heads, c.index_head_dim, c.sliding_window

    def rms(x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w

    rows = model.hasher.rows(tok, EngramState.for_config(c.engram))
    entries, keys, selected, candidates = {}, {}, {}, {}

    def attention(L, w, x):
        r, rope, a = c.compress_ratios[L], model.rope[L], w.attn
        qr = rms(x @ a.q_a.T, a.q_a_norm)
        q = rope((qr @ a.q_b.T).view(T, H, D), pos)  # no per-head RMS
        kv = rope(rms(x @ a.kv.T, a.kv_norm), pos)
        if L in c.kv_source_layer_ids:  # groups of r tokens: per-channel softmax of the gate over members
            comp = a.compressor
            ent, ks = [], []
            for g in range(T // r):
                xs = x[g * r : (g + 1) * r]
                k = xs @ comp.wkv.T
                s = xs @ comp.wgate.T if r > 1 else torch.zeros_like(k)
                latent = rms((s.softmax(0) * k).sum(0), comp.norm)
                at = torch.tensor([g * r])
                ent.append(rope(latent[None], at)[0])
                if c.index_keys[L]:  # keys from the latent before its rope
                    ik = rms(latent @ w.key_proj.T, w.key_norm)
                    ks.append(rope(ik[None], at)[0])
            entries[L], keys[L] = torch.stack(ent), torch.stack(ks) if ks else None
        src = c.kv_from[L]
        if L in c.index_source_layer_ids:
            qi = rope((qr @ a.index.q_b.T).view(T, nI, cI), pos)
            wts = (x @ a.index.weights.T) * nI**-0.5
            selected[L] = []
            for t in range(T):
                score = {
                    p: float((wts[t] * torch.relu(qi[t] @ keys[src][p])).sum() * cI**-0.5)
                    for p in range((t + 1) // r)
                }
                B = c.candidate_block_size
                if L == c.candidate_source_layer_id:
                    best = {}
                    for p, v in score.items():
                        best[p // B] = max(best.get(p // B, -math.inf), v)
                    if score:
                        best[max(score) // B] = math.inf  # the block of the newest entry
                    candidates[t] = set(sorted(best, key=lambda b: -best[b])[: c.candidate_topk_blocks])
                if c.uses_candidates[L]:
                    score = {p: v for p, v in score.items() if p // B in candidates[t]}
                selected[L].append(sorted(score, key=lambda p: -score[p])[: c.index_topk])
        out = torch.empty(T, H, D)
        for t in range(T):
            keys_t = kv[max(0, t - W + 1) : t + 1]
            if c.compress_ratios[L]:
                isrc = c.index_from[L]
                chosen = (
                    selected[isrc][t] if isrc is not None else list(range((t + 1) // c.compress_ratios[L]))
                )
                keys_t = torch.cat([keys_t, entries[src][chosen]])
            logits = (keys_t @ q[t].T).T * D**-0.5  # [H, keys]
            m = torch.maximum(logits.max(-1).values, a.sinks)
            p = (logits - m[:, None]).exp()
            p = p / (p.sum(-1) + (a.sinks - m).exp())[:, None]
            out[t] = p @ keys_t
        out = rope(out, pos, inverse=True).reshape(T, H * D)
        return grouped_out(out, a.o_a, a.o_b, c.o_groups)

    h = model.embed[tok][:, None, :].repeat(1, n, 1)
    pre = torch.zeros(T, n)
    pre[:, 0] = 1.0
    for L, w in enumerate(model.layers):
        if L in c.engram_layers:
            h = engram_forward(h, rows[:, c.engram.layer_ids.index(L)], w.engram, c.engram)
        for site, norm, block in ((w.attn_hc, w.attn_norm, "attention"), (w.mlp_hc, w.mlp_norm, "moe")):
            next_pre, post, comb = mhc.site_maps(h, site, model.hc)
            x = rms((pre[..., None] * h).sum(1), norm)  # the previous site's pre
            pre = next_pre
            y = attention(L, w, x) if block == "attention" else moe(x, w.mlp, c.moe_spec)
            h = post[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, h)
    return rms((pre[..., None] * h).sum(1), model.norm) @ model.lm_head.T


def test_model_matches_the_reference_written_from_the_text(tiny):
    ids = prompt(
        30, seed=3, vocab=259
    )  # 15 ratio-2 entries, 30 ratio-1 entries: top-6 and 3 blocks of 2 bind
    got, _ = run(tiny, [ids])
    ref = reference_logits(tiny, ids)
    err = max_err(got, ref)
    print(f"deepseek_v41 vs the token-by-token reference: max abs err {err:.2e}")
    assert err < TOL


def test_chunked_prefill_and_decode_equal_one_prefill(tiny):
    ids = prompt(33, seed=4, vocab=259)
    full, _ = run(tiny, [ids])
    worst = 0.0
    for cuts in ([0, 5, 6, 13, 20, 33], [0, 1, 2, 3, 17, 33], [0, 9, 33]):  # odd cuts split ratio-2 groups
        got, st = run(tiny, [ids[a:b] for a, b in zip(cuts, cuts[1:])])
        worst = max(worst, max_err(got, full))
        assert st.num_tokens == 33 and st.layers[-1].length == 33
    steps, _ = run(tiny, [ids[:11]] + [[t] for t in ids[11:]], logits="last")
    worst = max(worst, max_err(steps, full[10:]))
    print(f"deepseek_v41 chunked prefill / decode max abs err {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.parametrize("past, new", [(20, 5), (13, 4)])
def test_rollback_then_refeed_is_exact(tiny, past, new):
    R = 5
    ids, other = prompt(past + new, seed=5, vocab=259), prompt(new, seed=6, vocab=259)
    full, st = run(tiny, [ids[:past], ids[past:]], rollback_window=R)
    st.rollback(new)
    assert st.num_tokens == past and st.layers[-1].length == past
    again = tiny.forward(ForwardBatch.build([(st, ids[past:])], logits="all"))
    st.rollback(new)
    changed = tiny.forward(ForwardBatch.build([(st, other)], logits="all"))
    fresh, _ = run(tiny, [ids[:past], other])
    steps, st2 = run(tiny, [ids[:past]] + [[t] for t in ids[past:]], logits="last", rollback_window=R)
    st2.rollback(new)
    refed = torch.cat([tiny.forward(ForwardBatch.build([(st2, [t])])) for t in other])
    err = max(max_err(again, full[past:]), max_err(changed, fresh[past:]), max_err(refed, fresh[past:]))
    print(f"deepseek_v41 rollback/re-feed (past {past}, new {new}) max abs err {err:.2e}")
    assert err < 1e-5
    assert max_err(changed, full[past:]) > 1e-3  # the re-fed tokens matter (lookback, entries, window)


def test_rollback_beyond_the_window_is_refused_and_harmless(tiny):
    ids = prompt(30, seed=7, vocab=259)
    full, st = run(tiny, [ids[:20], ids[20:]], rollback_window=4)
    with pytest.raises(ValueError, match="window"):
        st.rollback(5)
    assert st.num_tokens == 30 and st.layers[-1].length == 30
    st.rollback(4)
    again = tiny.forward(ForwardBatch.build([(st, ids[26:])], logits="all"))
    assert max_err(again, full[26:]) < 1e-5


def test_snapshot_restore(tiny):
    ids = prompt(27, seed=8, vocab=259)
    st = tiny.new_state()
    tiny.forward(ForwardBatch.build([(st, ids[:19])]))
    snap = st.snapshot()
    a = tiny.forward(ForwardBatch.build([(st, ids[19:])], logits="all"))
    st2 = tiny.new_state()
    st2.restore(snap)
    b = tiny.forward(ForwardBatch.build([(st2, ids[19:])], logits="all"))
    assert torch.equal(a, b) and st.nbytes == st2.nbytes


def test_state_bytes_match_the_planner_and_only_sources_hold_entries(tiny):
    for R in (0, 3):
        per_token, fixed = v41.state_bytes(tiny.cfg, 4, rollback_window=R)
        for n in (5, 17, 24):  # 24: every group closed, every buffer full -> exact
            _, st = run(tiny, [prompt(n, vocab=259)], rollback_window=R)
            assert st.nbytes <= n * per_token + fixed
            if n == 24:
                assert st.nbytes == n * per_token + fixed
    # per token: layer 2 (ratio 2) entry 32 + index key 16, layer 4 (ratio 1) 32 + 16; fp32
    assert v41.state_bytes(tiny.cfg, 4)[0] == ((32 + 16) // 2 + (32 + 16)) * 4
    _, st = run(tiny, [prompt(12, vocab=259)])
    held = [L for L, s in enumerate(st.layers[:-1]) if s.compressor is not None]
    assert held == [2, 4] and all(st.layers[L].indexer is not None for L in held)
    assert isinstance(st.layers[-1], EngramState)


# ---------------------------------------------------------------- checkpoints, engine, inspect


def dequantized(ckpt: dict, qc: dict) -> dict:
    """Every quantized weight of a checkpoint as float32 (the Engram rows too)."""
    out = {k: v for k, v in ckpt.items() if not k.endswith(".scale")}
    for name in [k for k in ckpt if k.endswith(".weight") and k[: -len("weight")] + "scale" in ckpt]:
        base = name[: -len(".weight")]
        if base.endswith("engram.embed"):
            s = e8m0_to_float(ckpt[base + ".scale"].view(torch.uint8)).repeat_interleave(32, dim=1)
            out[name] = e4m3_to_float(ckpt[name].view(torch.uint8)) * s
        else:
            fmt = resolve_format(qc, {k: v.dtype for k, v in ckpt.items() if k.startswith(base + ".")}, base)
            out[name] = load_quantized(base, ckpt, fmt, qc).dequantize(torch.float32)
    return out


def test_quantized_release_layout_equals_its_dequantized_weights(tmp_path):
    extra = {"mtp.0.main_proj.weight": torch.zeros(64, 192), "layers.2.ffn.gate.bias_vl": torch.zeros(4)}
    ckpt = v41demo.write_checkpoint(tmp_path / "q", quantized=True, extra=extra)
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = raw["quantization_config"]
    assert qc["weight_block_size"] == [32, 32] and qc["scale_fmt"] == "ue8m0"
    assert ckpt["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert (
        ckpt["layers.2.attn.wq_a.scale"].shape == (1, 2)
        and ckpt["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    )
    assert ckpt["layers.1.engram.wkv.scale"].shape == (10, 6)  # [(4 + 1)·64, 6·32] in 32x32 blocks
    assert ckpt["layers.2.ffn.experts.0.w1.weight"].dtype == torch.int8 and ckpt[
        "layers.2.ffn.experts.0.w2.scale"
    ].shape == (64, 1)
    assert ckpt["layers.1.engram.embed.weight"].shape == (462, 32) and ckpt[
        "layers.1.engram.embed.scale"
    ].shape == (462, 1)
    (tmp_path / "d").mkdir()
    save_safetensors(dequantized(ckpt, qc), tmp_path / "d" / "model.safetensors")
    (tmp_path / "d" / "config.json").write_text(
        json.dumps({k: v for k, v in raw.items() if k != "quantization_config"})
    )

    packed = Checkpoint.open(tmp_path / "q").build("float32")
    dense = Checkpoint.open(tmp_path / "d").build("float32")
    w = packed.layers[2]
    assert isinstance(w.attn.q_a, QuantizedTensor) and isinstance(
        packed.layers[1].engram.wkv, QuantizedTensor
    )
    assert not isinstance(w.mlp.experts_in, torch.Tensor)  # fp4 experts stay packed
    assert (
        packed.layers[1].engram.table.weight.dtype == torch.float8_e4m3fn
    )  # rows read from the file, as fp8
    ids = prompt(30, seed=9, vocab=259)
    a, _ = run(packed, [ids])
    b, _ = run(dense, [ids])
    err = max_err(a, b)
    print(f"deepseek_v41 fp8-ue8m0 + fp4 + fp8 rows vs dequantized dense: max abs err {err:.2e}")
    assert err < 1e-5


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v41")
    v41demo.write_checkpoint(path)
    return path


def test_batch_of_different_lengths_equals_singles(tiny_ckpt):
    prompts = [prompt(n, seed=10 + n, vocab=259) for n in (5, 19, 30, 2)]
    llm = check_batch_equals_singles(tiny_ckpt, prompts, max_tokens=8, max_batch_tokens=13)
    scored = llm.score(prompts[2])
    direct, _ = run(llm.model, [prompts[2]])
    assert torch.equal(scored, direct)


def test_token_map_comes_from_the_checkpoints_tokenizer(tiny_ckpt, tmp_path):
    model = Checkpoint.open(tiny_ckpt).build("float32")
    assert torch.equal(model.hasher.token_map, byte_map())  # the byte tokenizer: 259 ids, 230 classes
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    for name, change, match in (
        ("wrong-classes", {"engram_compressed_vocab_size": 231}, "230 classes"),
        ("no-tokenizer", None, "tokenizer"),
    ):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(tiny_ckpt / "model.safetensors", folder / "model.safetensors")
        bad = dict(raw, text_config=dict(raw["text_config"], **(change or {})))
        if change is None:
            bad.pop("moesaic_tokenizer")
        (folder / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=match):
            Checkpoint.open(folder).build("float32")


def test_inspect_reports_the_release_config(tmp_path):
    # the release config.json, built from its published values (RELEASE_TEXT_CONFIG); the file alone
    (tmp_path / "config.json").write_text(json.dumps(v41demo.RELEASE_CONFIG))
    info = inspect_checkpoint(tmp_path)
    assert (
        info["family"] == "deepseek_v41"
        and info["num_layers"] == 40
        and info["contract"].startswith("not checked")
    )
    tables = info["engram_tables"]
    assert [(t["layer"], t["rows"], t["row_bytes"]) for t in tables] == [
        (1, 384006168, 264),
        (14, 384016682, 264),
    ]
    assert [round(t["table_bytes"] / GIB, 1) for t in tables] == [94.4, 94.4]  # "94.4 GiB per table"
    assert round(info["engram_table_bytes"] / GIB, 1) == 188.8  # "Engram 188.8 GiB"
    assert info["params_by_role"]["engram_table"] == (384006168 + 384016682) * 256  # ≈196.6B
    drafter = info["params_by_role"][
        "mtp"
    ]  # the three DSpark stages, mostly 3 x 128 experts of 3 x 2304 x 5120
    assert 13.5e9 < drafter < 14.5e9
    backbone = (
        info["params_total"]
        - info["params_by_role"]["engram_table"]
        - info["params_by_role"]["engram_scale"]
        - drafter
    )
    assert 551e9 < backbone < 553e9  # "≈552B backbone"
    assert info["expert_bytes_fp4"] == 18_800_640  # 3 x (2304 x 5120 / 2 nibble bytes + 1 E8M0 byte per 32)
    assert round(info["routed_expert_code_bytes_fp4"] / GIB, 1) == 253.1  # "routed experts 253.1 GiB" (codes)
    sched = info["layer_schedule"]
    assert (
        sched[1] == "engram+swa+moe"
        and sched[2] == "csa2(r2,kv,idx)+moe"
        and sched[14] == "engram+csa2(r2,kv,idx)+moe"
    )
    assert (
        sched[20] == "csa2(r1,kv,idx,cand)+moe"
        and sched[24] == "csa2(r1,idx)+moe"
        and sched[39] == "csa2(r1)+moe"
    )
    assert info["candidates"]["consumer_layers"] == [24, 28, 32, 36] and info["mtp_compress_ratios"] == [
        0,
        0,
        0,
    ]
    # bf16 state: layers 2, 8, 14 keep (512 + 128) / 2 elements a token, layer 20 512 + 128
    assert info["state_bytes_per_token"] == (3 * 320 + 640) * 2
    # 40 windows of 127 rows; one open ratio-2 group row (kv + gate) at each of 3 sources; 3 lookback ids
    assert info["state_bytes_fixed_per_sequence"] == 40 * 127 * 512 * 2 + 3 * 1024 * 2 + 3 * 8
    assert info["state_bytes_per_sequence"] == 3200 * 1048576 + info["state_bytes_fixed_per_sequence"]
    assert info["engram_rows_per_token"] == 48 and info["hash_moe_layers"] == 0
    # the three MTP stages are the DSpark drafter (not loaded); without them there is no draft head
    text = v41demo.RELEASE_CONFIG["text_config"]
    assert v41.draft_heads(v41.parse_config(v41demo.RELEASE_CONFIG)) == ("dspark",)
    no_stages = dict(text, num_nextn_predict_layers=0, compress_ratios=text["compress_ratios"][:40])
    assert v41.draft_heads(v41.parse_config(v41demo.release_config(no_stages))) == ()


@pytest.mark.parametrize(
    "over, field",
    [
        ({"num_hash_layers": 3}, "num_hash_layers"),
        ({"compress_ratios": [0, 0, 2]}, "compress_ratios"),
        ({"kv_source_layer_ids": [2]}, "kv_source_layer_ids"),  # layer 4 (ratio 1) would read ratio-2 entries
        ({"kv_source_layer_ids": [4]}, "kv_source_layer_ids"),  # layer 2 has no source at or below it
        ({"index_source_layer_ids": [0, 2, 4]}, "index_source_layer_ids"),  # a sliding layer
        ({"candidate_source_layer_id": 3}, "candidate_source_layer_id"),  # not an index source
        ({"engram_num_embeddings": [462, 631]}, "engram_num_embeddings"),  # not the primes' sum
    ],
)
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        v41.parse_config(v41demo.release_config(dict(TEXT, **over)))
    v41.parse_config(v41demo.release_config(TEXT))


def test_bf16_equals_v4_and_runs(v4_weights, tiny_ckpt):
    # in bf16 too, V4.1 with its features off is V4 (whose bf16 run moves ~0.2 from fp32 on this tiny model)
    cfg4, tensors = v4_weights
    keep = {s.name for s in deepseek_v4.tensor_specs(cfg4) if s.keep_fp32}
    t16 = {k: v if k in keep else v.to(torch.bfloat16) for k, v in tensors.items()}
    ids = prompt(45)
    a, _ = run(deepseek_v4.Model(cfg4, Tensors(t16), torch.bfloat16, "cpu"), [ids])
    b, _ = run(v41.Model(v41.parse_config(V41_AS_V4), Tensors(t16), torch.bfloat16, "cpu"), [ids])
    assert torch.equal(a, b)
    # the release-shaped model loads and runs in bf16 (random weights: a top-k flip moves a row by ~1)
    ids = prompt(30, seed=12, vocab=259)
    ref, _ = run(Checkpoint.open(tiny_ckpt).build("float32"), [ids])
    got, _ = run(Checkpoint.open(tiny_ckpt).build("bfloat16"), [ids])
    rows = (got - ref).abs().amax(-1)
    print(f"deepseek_v41 bf16 vs fp32: median row max err {rows.median():.2e}")
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and rows.median() < 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 4])
def test_state_bytes_of_the_demo_are_exact(dtype, window):
    # what a sequence of the demo holds once every window, open group and Engram lookback has filled
    # (24 tokens, a multiple of the ratios 2 and 1) is the planner's count exactly
    per_token, fixed = check_state_bytes_exact("demo-deepseek-v41", dtype, window, T=24)
    cfg = demo_model("demo-deepseek-v41", dtype)[0].cfg
    assert fixed > v41.state_bytes(cfg, getattr(torch, dtype).itemsize, 0)[1] or window == 0

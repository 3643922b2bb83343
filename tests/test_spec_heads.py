"""The models' own draft heads (moesaic/spec/mtp.py, moesaic/spec/dspark.py): each head's logits equal an
independent reference of its formula written here (fp32, tiny random weights); each head through the
DraftProposer interface on its demo rolls its own cache back exactly (after simulated verifies that accept
some drafts and reject others, it holds what a fresh head fed only the committed rows holds, and drafts
the same); the trained GLM demo's MTP layer agrees with its trunk as often as docs/train_demo.md records."""

from __future__ import annotations

import json
import platform
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import demo_model, random_ids

from moesaic.cache.batch import FINAL, ForwardBatch
from moesaic.cache.state import RecurrentState, TailRows, TokenRows
from moesaic.demo import hash_table
from moesaic.demo import random_tensors as demo_random_tensors
from moesaic.demo.deepseek_v4 import DEMO_CONFIG as V4_DEMO
from moesaic.demo.glm5next import DEMO_CONFIG as GLM_DEMO
from moesaic.demo.nemotron_h import DEMO_CONFIG as NEMOTRON_DEMO
from moesaic.errors import ConfigError
from moesaic.layers.csa import AttentionState
from moesaic.models import deepseek_v4, glm5next, nemotron_h
from moesaic.spec.base import DraftProposer
from moesaic.spec.mtp import make_proposer
from moesaic.weights.bind import Tensors

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "moesaic" / "demo" / "trained" / "glm5-code"


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def with_taps(model, items, taps=(FINAL,)):
    """One target forward over (state, ids) items asking for taps: (all logits, the batch's taps)."""
    batch = ForwardBatch.build(items, logits="all")
    batch.taps = taps
    return model.forward(batch), batch.tapped


def held_rows(state) -> list[torch.Tensor]:
    """Every tensor a state holds for its tokens, in order (what two equal caches agree on)."""
    out = []
    for layer in state.layers:
        parts = layer._parts() if isinstance(layer, AttentionState) else [layer]
        for p in parts:
            if isinstance(p, TokenRows):
                out += [b[: p.length] for b in p.bufs.values()]
            elif isinstance(p, TailRows):
                out += list(p.rows().values())
            elif isinstance(p, RecurrentState):
                out += [v for v in vars(p.value).values() if isinstance(v, torch.Tensor)]
            elif p is not None:
                out += held_rows(p) if hasattr(p, "layers") else []
    return out


# ---------------------------------------------------------------- the formulas, written out here


def glm_reference(T: dict, cfg, L: int, next_ids: list[int], h: torch.Tensor) -> torch.Tensor:
    """docs/train_demo.md §3 for rows 0..n-1 given t_{r+1} and h_r, with every key selected (context below
    index_topk): the logits [n, V] of t_{r+2}, and z [n, d]."""
    p, eps = f"model.layers.{L}.", cfg.rms_norm_eps
    W = {k[len(p) :]: v.float() for k, v in T.items() if k.startswith(p)}
    n, H, dn, dv = h.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    e = T["model.embed_tokens.weight"].float()[next_ids]
    x = torch.cat([rms(e, W["enorm.weight"], eps), rms(h.float(), W["hnorm.weight"], eps)], -1)
    x = x @ W["eh_proj.weight"].T
    a = rms(x, W["input_layernorm.weight"], eps)
    qr = rms(a @ W["self_attn.q_a_proj.weight"].T, W["self_attn.q_a_layernorm.weight"], eps)
    q = (qr @ W["self_attn.q_b_proj.weight"].T).view(n, H, dn)
    lat = rms(a @ W["self_attn.kv_a_proj_with_mqa.weight"].T, W["self_attn.kv_a_layernorm.weight"], eps)
    kv = (lat @ W["self_attn.kv_b_proj.weight"].T).view(n, H, dn + dv)
    s = torch.einsum("qhd,khd->hqk", q, kv[..., :dn]) * dn**-0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), kv[..., dn:]).reshape(n, H * dv)
    y = x + o @ W["self_attn.o_proj.weight"].T
    b = rms(y, W["post_attention_layernorm.weight"], eps)
    score = torch.sigmoid(b @ W["mlp.gate.weight"].T)
    ids = (score + W["mlp.gate.e_score_correction_bias"]).topk(cfg.num_experts_per_tok, -1).indices
    wts = score.gather(1, ids)
    wts = wts / wts.sum(-1, keepdim=True) * cfg.routed_scaling_factor

    def glu(x, w_gate, w_up, w_down):
        lim = cfg.swiglu_limit
        return (F.silu((x @ w_gate.T).clamp(max=lim)) * (x @ w_up.T).clamp(-lim, lim)) @ w_down.T

    I = cfg.moe_intermediate_size
    moe = torch.stack(
        [
            sum(
                wts[i, j]
                * glu(
                    b[i : i + 1],
                    W["mlp.experts.gate_up_proj"][e][:I],
                    W["mlp.experts.gate_up_proj"][e][I:],
                    W["mlp.experts.down_proj"][e],
                )[0]
                for j, e in enumerate(ids[i].tolist())
            )
            for i in range(n)
        ]
    )
    sh = "mlp.shared_experts."
    moe = moe + glu(b, W[sh + "gate_proj.weight"], W[sh + "up_proj.weight"], W[sh + "down_proj.weight"])
    z = y + moe
    return rms(z, W["shared_head.norm.weight"], eps) @ T["lm_head.weight"].float().T, z


@pytest.fixture(scope="module")
def glm_tiny():
    """The GLM demo's shape with a wide index_topk (every MTP row sees every earlier one), one router
    group, random fp32 weights."""
    text = dict(GLM_DEMO["text_config"], index_topk=64, n_group=1)
    cfg = glm5next.parse_config({"model_type": "glm5_next", **text})
    T = demo_random_tensors(glm5next.tensor_specs(cfg), seed=3)
    return cfg, T, glm5next.Model(cfg, Tensors(T), torch.float32, "cpu")


def test_glm_mtp_logits_equal_the_formula(glm_tiny):
    cfg, T, model = glm_tiny
    ids = random_ids(21, cfg.vocab_size, seed=4)
    _, taps = with_taps(model, [(model.new_state(), ids)])
    prop = make_proposer(model, cfg, {"num_speculative_tokens": 3})
    head = prop.head
    # rows 0..19 from (t_{r+1}, h_r), in two pieces (the cache carries across forwards)
    st = head.new_state(0)
    z = torch.cat([prop.run([(st, ids[a + 1 : b + 1], taps[FINAL][a:b])]) for a, b in ((0, 7), (7, 20))])
    ref_logits, ref_z = glm_reference(T, cfg, cfg.num_hidden_layers, ids[1:], taps[FINAL][:20])
    err = (head.logits(z) - ref_logits).abs().max().item()
    print(f"GLM MTP vs the in-test formula: max abs logit err {err:.2e}")
    assert err < 1e-4 and (z - ref_z).abs().max() < 1e-4
    # a broken twin: the concat order [hidden, embedding] gives other logits
    swapped = dict(T)
    eh = T[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"]
    swapped[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = torch.cat(eh.chunk(2, 1)[::-1], 1)
    assert (
        glm_reference(swapped, cfg, cfg.num_hidden_layers, ids[1:], taps[FINAL][:20])[0] - ref_logits
    ).abs().max() > 1e-2
    # the drafts recurse through the layer with its own output: d_{i+1} from (d_i, z of the row before)
    prop.start(0)
    prop.observe(0, 0, ids[:20], {FINAL: taps[FINAL][:20]})
    drafts = prop.propose([(0, ids[20], 3)])[0].tokens
    toks, hs = list(ids[1:21]), taps[FINAL][:20]
    for _ in range(3):
        lg, zz = glm_reference(T, cfg, cfg.num_hidden_layers, toks, hs)
        toks.append(int(lg[-1].argmax()))
        hs = torch.cat([hs, zz[-1:]])
    assert drafts == toks[20:]


def v4_tiny():
    cfg = deepseek_v4.parse_config(dict(V4_DEMO))
    specs = deepseek_v4.tensor_specs(cfg)
    T = demo_random_tensors(specs, seed=5)
    for s in specs:
        if s.integer:
            T[s.name] = hash_table(*s.shape, cfg.n_routed_experts)
        elif s.name.endswith("sinks"):
            T[s.name] = torch.randn(s.shape)
    return cfg, T, deepseek_v4.Model(cfg, Tensors(T), torch.float32, "cpu")


def test_deepseek_v4_mtp_logits_equal_the_formula():
    """x = e_proj(RMSNorm(E[t]; enorm)) + h_proj(RMSNorm(h; hnorm)) written here, then the MTP block,
    its hc_head, norm and the shared head evaluated as a one-layer V4 model whose embedding rows are x."""
    cfg, T, model = v4_tiny()
    ids = random_ids(17, cfg.vocab_size, seed=6)  # 16 MTP rows: past the window of 8
    _, taps = with_taps(model, [(model.new_state(), ids)])
    prop = make_proposer(model, cfg, {"num_speculative_tokens": 2})
    st = prop.head.new_state(0)
    z = torch.cat(
        [prop.run([(st, ids[a + 1 : b + 1], taps[FINAL][a:b])]) for a, b in ((0, 5), (5, 6), (6, 16))]
    )
    eps, p = cfg.rms_norm_eps, "mtp.0."
    e = rms(T["model.embed_tokens.weight"][ids[1:]], T[p + "enorm.weight"], eps)
    x = (
        e @ T[p + "e_proj.weight"].T
        + rms(taps[FINAL][:16], T[p + "hnorm.weight"], eps) @ T[p + "h_proj.weight"].T
    )
    one = dict(
        V4_DEMO, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0, num_nextn_predict_layers=0
    )
    cfg1 = deepseek_v4.parse_config(one)
    T1 = {"model." + k[len(p) :]: v for k, v in T.items() if k.startswith(p + "hc_head.")}
    T1.update({"model.layers.0." + k[len(p) :]: v for k, v in T.items() if k.startswith(p)})
    T1.update({"model.norm.weight": T[p + "norm.weight"], "lm_head.weight": T["lm_head.weight"]})
    embed = torch.zeros_like(T["model.embed_tokens.weight"])
    embed[:16] = x
    T1["model.embed_tokens.weight"] = embed
    ref = deepseek_v4.Model(cfg1, Tensors(T1), torch.float32, "cpu")
    ref_logits, _ = with_taps(ref, [(ref.new_state(), list(range(16)))])
    err = (prop.head.logits(z) - ref_logits).abs().max().item()
    print(f"DeepSeek-V4 MTP vs the formula (one-layer V4 over x): max abs logit err {err:.2e}")
    assert err < 1e-4


def test_nemotron_h_mtp_logits_equal_the_formula():
    """x = eh_proj([RMSNorm(E[t]; enorm) ; RMSNorm(RMSNorm(FINAL; norm_f); hnorm)]) written here, then
    the block's layers, final_layernorm and lm_head as a Nemotron-H model of those layers over rows x."""
    cfg = nemotron_h.parse_config(dict(NEMOTRON_DEMO))
    T = demo_random_tensors(nemotron_h.tensor_specs(cfg), seed=7)
    model = nemotron_h.Model(cfg, Tensors(T), torch.float32, "cpu")
    ids = random_ids(14, cfg.vocab_size, seed=8)
    _, taps = with_taps(model, [(model.new_state(), ids)])
    prop = make_proposer(model, cfg, {})
    st, h = prop.head.new_state(0), prop.head.hidden(taps[FINAL])  # the head's h: the post-norm hidden
    z = torch.cat([prop.run([(st, ids[a + 1 : b + 1], h[a:b])]) for a, b in ((0, 9), (9, 13))])
    eps, p0, p1 = cfg.layer_norm_epsilon, "mtp.layers.0.", "mtp.layers.1."
    h = rms(rms(taps[FINAL][:13], T["model.norm_f.weight"], eps), T[p0 + "hnorm.weight"], eps)
    e = rms(T["model.embeddings.weight"][ids[1:]], T[p0 + "enorm.weight"], eps)
    x = torch.cat([e, h], -1) @ T[p0 + "eh_proj.weight"].T
    one = {
        k: v
        for k, v in NEMOTRON_DEMO.items()
        if k not in ("num_nextn_predict_layers", "mtp_layers_block_type")
    }
    cfg1 = nemotron_h.parse_config(dict(one, layers_block_type=["attention", "moe"]))
    T1 = {"model.layers.0." + k[len(p0) :]: v for k, v in T.items() if k.startswith(p0)}
    T1.update({"model.layers.1." + k[len(p1) :]: v for k, v in T.items() if k.startswith(p1)})
    T1.update(
        {"model.norm_f.weight": T[p1 + "final_layernorm.weight"], "lm_head.weight": T["lm_head.weight"]}
    )
    embed = torch.zeros_like(T["model.embeddings.weight"])
    embed[:13] = x
    T1["model.embeddings.weight"] = embed
    ref = nemotron_h.Model(cfg1, Tensors(T1), torch.float32, "cpu")
    ref_logits, _ = with_taps(ref, [(ref.new_state(), list(range(13)))])
    err = (prop.head.logits(z) - ref_logits).abs().max().item()
    print(f"Nemotron-H MTP vs the formula (its layers as a model over x): max abs logit err {err:.2e}")
    assert err < 1e-4


# ---------------------------------------------------------------- the proposer on the demos


def simulate(model, proposer, prompts: list[list[int]], rounds: list[tuple[int, int]]):
    """Drafting sequences as the engine runs them: prefill (observe), then per round (k, accepted m):
    propose k for every sequence together, one target forward over [last, d_1..d_k] each, keep the
    first m drafts (forced, whatever the target says) and the target's token after them as the bonus,
    roll the target back, observe the committed rows. Returns per sequence (committed tokens, their
    taps {layer: [rows, d]}, the newest committed token, the last drafts)."""
    states = [model.new_state(rollback_window=8) for _ in prompts]
    logits, taps = with_taps(model, list(zip(states, prompts)), proposer.taps)
    seqs, row = [], 0
    for i, p in enumerate(prompts):
        hidden = {L: t[row : row + len(p)] for L, t in taps.items()}
        proposer.start(i)
        proposer.observe(i, 0, p, hidden)
        row += len(p)
        seqs.append([list(p), hidden, int(logits[row - 1].argmax()), None])
    for k, m in rounds:
        drafts = proposer.propose([(i, s[2], k) for i, s in enumerate(seqs)])
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            assert 1 <= len(d.tokens) <= k and d.probs is None
            s[3] = d.tokens
            block = [s[2]] + d.tokens
            lg, tp = with_taps(model, [(states[i], block)], proposer.taps)
            acc = min(m, len(d.tokens))
            states[i].rollback(len(block) - acc - 1)
            proposer.observe(i, len(s[0]), block[: acc + 1], {L: t[: acc + 1] for L, t in tp.items()})
            s[0] += block[: acc + 1]
            s[1] = {L: torch.cat([s[1][L], tp[L][: acc + 1]]) for L in s[1]}
            s[2] = int(lg[acc].argmax())
    return seqs


HEAD_DEMOS = ["demo-glm5-next-nvfp4", "demo-deepseek-v4", "demo-nemotron-h"]


@pytest.mark.parametrize("demo", HEAD_DEMOS)
def test_mtp_cache_rolls_back_to_the_committed_rows(demo):
    """Two sequences drafting together, k = 1..3, rounds that keep 0, some or all drafts: each head's
    cache then holds exactly what a fresh head fed only the committed rows holds, and both draft the
    same next round."""
    ck, model = demo_model(demo, "float32")
    prop = make_proposer(model, ck.cfg, {"num_speculative_tokens": 3})
    assert isinstance(prop, DraftProposer) and prop.taps == (FINAL,) and prop.max_k == 3
    prompts = [random_ids(9, ck.cfg.vocab_size, seed=11), random_ids(4, ck.cfg.vocab_size, seed=12)]
    seqs = simulate(model, prop, prompts, [(3, 1), (2, 0), (1, 1), (3, 3), (3, 2)])
    for i, (tokens, hidden, last, _) in enumerate(seqs):
        fresh = make_proposer(model, ck.cfg, {"num_speculative_tokens": 3})
        fresh.start(0)
        fresh.observe(0, 0, tokens, hidden)
        ours, ref = prop.propose([(i, last, 3)])[0], fresh.propose([(0, last, 3)])[0]
        assert ours.tokens == ref.tokens
        a, b = prop.seqs[i].state, fresh.seqs[0].state
        assert a.num_tokens == b.num_tokens == len(tokens) + 2  # committed rows + 2 drafted ones
        rows_a, rows_b = held_rows(a), held_rows(b)
        assert len(rows_a) == len(rows_b) > 0
        assert all(
            x.shape == y.shape and torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(rows_a, rows_b)
        )
    prop.finish(0)
    assert 0 not in prop.seqs


def test_a_rollback_that_forgets_too_little_is_caught():
    """The broken twin of the check above: a head that keeps its drafted rows holds more rows than a
    fresh head fed the committed ones."""
    ck, model = demo_model("demo-glm5-next-nvfp4", "float32")
    prop = make_proposer(model, ck.cfg, {"num_speculative_tokens": 3})
    prop._forget_drafts = lambda s: None
    seqs = simulate(model, prop, [random_ids(6, ck.cfg.vocab_size, seed=13)], [(3, 1)])
    assert prop.seqs[0].state.num_tokens != len(seqs[0][0]) - 1


def test_mtp_config_errors(glm_tiny):
    cfg, T, model = glm_tiny
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ConfigError, match="num_speculative_tokens"):
            make_proposer(model, cfg, {"num_speculative_tokens": bad})
    no_mtp = {k: v for k, v in T.items() if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    bare = glm5next.Model(cfg, Tensors(no_mtp, [k for k in T if k not in no_mtp]), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="MTP weights"):
        make_proposer(bare, cfg, {})
    with pytest.raises(ConfigError, match="method 'mtp'"):
        make_proposer(object(), None, {})


# ---------------------------------------------------------------- the trained demo


def heldout_windows(folder: Path) -> torch.Tensor:
    """The held-out windows docs/train_demo.md §7 measures on, rebuilt as scripts/train_demo.py builds
    them: each held-out stdlib file as `[gMASK]<sop>{source}<|endoftext|>`, tokenized and packed, cut
    into windows of the run's context, the run's number of them chosen by randperm(seed 5)."""
    from tokenizers import Tokenizer

    meta = json.loads((folder / "config.json").read_text())["moesaic_demo"]
    corpus, run = meta["corpus"], meta["run"]
    if platform.python_version() != corpus["python"]:
        pytest.skip(f"the held-out files are those of Python {corpus['python']}")
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / n).read_bytes().decode("utf-8") for n in corpus["heldout_files"]]
    if sum(len(t.encode()) for t in texts) != corpus["heldout_bytes"]:
        pytest.skip("this machine's copies of the held-out stdlib files differ from the training run's")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = [f"[gMASK]<sop>{t}<|endoftext|>" for t in texts]
    ids = [i for enc in tok.encode_batch(docs, add_special_tokens=False) for i in enc.ids]
    argv = run["argv"]
    count = int(argv[argv.index("--heldout-windows") + 1]) if "--heldout-windows" in argv else 24
    T = run["context"]
    n = len(ids) // T
    windows = torch.tensor(ids[: n * T]).view(n, T)
    return windows[torch.randperm(n, generator=torch.Generator().manual_seed(5))[:count]]


def test_trained_demo_mtp_agreement_matches_the_recorded_number():
    """moesaic's MTP layer (the trunk's FINAL taps, rows 0..T-3 of each held-out window, teacher forced)
    agrees with the trunk's next greedy token as often as the training run measured (`heads_heldout.
    mtp_agree` in the demo's config.json), within 0.005: the same math on the same rows."""
    if not (TRAINED / "config.json").exists():
        pytest.skip("the trained demo (moesaic/demo/trained/glm5-code) is not in this tree")
    from moesaic.models import Checkpoint

    recorded = json.loads((TRAINED / "config.json").read_text())["moesaic_demo"]["heads_heldout"]["mtp_agree"]
    windows = heldout_windows(TRAINED)
    ck = Checkpoint.open(TRAINED)
    model = ck.build("float32")
    prop = make_proposer(model, ck.cfg, {})
    agree = rows = 0
    for w in windows.tolist():
        logits, taps = with_taps(model, [(model.new_state(), w)])
        z = prop.run([(prop.head.new_state(0), w[1:], taps[FINAL][:-1])])
        agree += (prop.head.logits(z)[:-1].argmax(-1) == logits[1:-1].argmax(-1)).sum().item()
        rows += len(w) - 2
    print(f"trained demo MTP agreement: {agree / rows:.4f} over {rows} rows (recorded {recorded:.4f})")
    assert abs(agree / rows - recorded) < 0.005


# ---------------------------------------------------------------- DeepSeek-V4.1's DSpark stages


def v41_tiny(seed: int = 9):
    """The V4.1 demo's config (three DSpark stages) with random fp32 weights and the byte token map."""
    from moesaic.demo import deepseek_v41 as v41demo
    from moesaic.layers.engram import build_token_map
    from moesaic.models import deepseek_v41 as v41
    from moesaic.tokenizer import ByteTokenizer

    cfg = v41.parse_config(v41demo.DEMO_CONFIG)
    T = v41demo.random_tensors(cfg, seed)
    cmap = build_token_map(v41.tokenizer_vocab(ByteTokenizer()), cfg.engram.compressed_vocab_size)
    return cfg, T, v41.Model(cfg, Tensors(T), torch.float32, "cpu", token_map=cmap)


def rope_tail(x, pos, cfg):
    """V4's rope on the trailing qk_rope dims, adjacent pairs as complex numbers (plain theta: ratio 0)."""
    rd = cfg.rope_main.dim
    freqs = 1.0 / (cfg.rope_main.theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    cis = torch.polar(torch.ones(len(pos), rd // 2), pos[:, None].float() * freqs)
    cis = cis.view(len(pos), *[1] * (x.dim() - 2), rd // 2)
    z = torch.view_as_complex(x[..., -rd:].float().contiguous().unflatten(-1, (-1, 2)))
    return torch.cat([x[..., :-rd], torch.view_as_real(z * cis).flatten(-2)], -1)


def dspark_reference(model, T: dict, cfg, taps: torch.Tensor, y: int):
    """The module docstring's round written out: taps [p+1, taps·d] of positions 0..p, y the committed
    token at p+1. Returns (drafts, base logits [B, V], confidence [B])."""
    from moesaic.layers import mhc
    from moesaic.layers.moe import moe

    ds, eps, H, D, G = cfg.dspark, cfg.rms_norm_eps, cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    B, W, n = ds.block_size, cfg.sliding_window, cfg.num_nextn_predict_layers
    c = rms(taps @ T["mtp.0.main_proj.weight"].T, T["mtp.0.main_norm.weight"], eps)
    p = taps.shape[0] - 1
    ctx_pos, pos = torch.arange(max(0, p - W + 1), p + 1), torch.arange(p + 1, p + 1 + B)
    ids = torch.tensor([y] + [ds.noise_token_id] * (B - 1))
    h = T["model.embed_tokens.weight"][ids][:, None].repeat(1, cfg.hc_mult, 1)
    pre = torch.zeros(B, cfg.hc_mult)
    pre[:, 0] = 1
    spec = model.moe.__class__(
        model.moe.router.__class__("sqrtsoftplus", ds.num_experts_per_tok, scale=cfg.routed_scaling_factor),
        glu=model.moe.glu,
    )
    for j, stage in enumerate(model.dspark.stages):
        a = f"mtp.{j}.self_attn."
        site_pre, post, comb = mhc.site_maps(h, stage.attn_hc, model.hc)
        x = rms(mhc.collapse(h, pre), T[f"mtp.{j}.input_layernorm.weight"], eps)
        pre = site_pre
        qr = rms(x @ T[a + "q_a_proj.weight"].T, T[a + "q_a_norm.weight"], eps)
        q = rope_tail((qr @ T[a + "q_b_proj.weight"].T).view(B, H, D), pos, cfg)

        def kv_of(v, at, a=a):
            return rope_tail(rms(v @ T[a + "kv_proj.weight"].T, T[a + "kv_norm.weight"], eps), at, cfg)

        keys = torch.cat([kv_of(c[ctx_pos], ctx_pos), kv_of(x, pos)])
        logit = torch.einsum("bhd,kd->bhk", q, keys) * D**-0.5
        sink = T[a + "sinks"].view(1, H, 1).expand(B, H, 1)
        o = torch.einsum("bhk,kd->bhd", torch.cat([logit, sink], -1).softmax(-1)[..., :-1], keys)
        rd = cfg.rope_main.dim
        o = torch.cat([o[..., :-rd], rope_tail(o, -pos, cfg)[..., -rd:]], -1).reshape(B, G, -1)  # rope^-1
        wo_a = T[a + "o_a_proj.weight"].view(G, -1, o.shape[-1])
        y_attn = torch.einsum("bgi,gri->bgr", o, wo_a).reshape(B, -1) @ T[a + "o_b_proj.weight"].T
        h = mhc.update(h, y_attn, post, comb)
        site_pre, post, comb = mhc.site_maps(h, stage.mlp_hc, model.hc)
        x = rms(mhc.collapse(h, pre), T[f"mtp.{j}.post_attention_layernorm.weight"], eps)
        pre = site_pre
        h = mhc.update(h, moe(x, stage.mlp, spec), post, comb)
    x = mhc.collapse(h, pre)
    last = f"mtp.{n - 1}."
    u = rms(x, T[last + "norm.weight"], eps) @ T["lm_head.weight"].T
    drafts, prev, embeds = [], y, []
    for b in range(B):
        e = T[last + "markov_head.embed.weight"][prev]
        prev = int((u[b] + T[last + "markov_head.head.weight"] @ e).argmax())
        drafts.append(prev)
        embeds.append(e)
    conf = torch.sigmoid(torch.cat([x, torch.stack(embeds)], -1) @ T[last + "confidence_head.proj.weight"].T)[
        :, 0
    ]
    return drafts, u, conf


def test_dspark_round_equals_the_formula():
    """Three stages over a context longer than the window (13 positions, window 8), two sequences in one
    batch: the drafts, the base logits and the confidence of each equal the reference."""
    from moesaic.spec.dspark import make_proposer as make_dspark

    cfg, T, model = v41_tiny()
    prop = make_dspark(model, cfg, {})
    assert isinstance(prop, DraftProposer) and prop.max_k == cfg.dspark.block_size == 5
    assert prop.taps == (1, 2, 4)  # the inputs of layers 2, 3, 5
    prompts = [random_ids(13, cfg.vocab_size, seed=21), random_ids(6, cfg.vocab_size, seed=22)]
    logits, taps = with_taps(model, [(model.new_state(), p) for p in prompts], prop.taps)
    row, ys, refs = 0, [], []
    for i, p in enumerate(prompts):
        hidden = {L: t[row : row + len(p)] for L, t in taps.items()}
        prop.start(i)
        for a, b in ((0, 4), (4, len(p))):  # the context arrives in two pieces
            prop.observe(i, a, p[a:b], {L: t[a:b] for L, t in hidden.items()})
        row += len(p)
        ys.append(int(logits[row - 1].argmax()))
        refs.append(dspark_reference(model, T, cfg, torch.cat([hidden[L] for L in prop.taps], -1), ys[-1]))
    drafts = prop.propose([(0, ys[0], 5), (1, ys[1], 3)])
    u, _ = prop.block_logits([prop.seqs[0], prop.seqs[1]], ys)
    for i, (ref_drafts, ref_u, ref_conf) in enumerate(refs):
        err = (u[i] - ref_u).abs().max().item()
        print(f"DSpark sequence {i}: max abs base-logit err vs the formula {err:.2e}")
        assert err < 1e-4
        assert drafts[i].tokens == ref_drafts[: (5, 3)[i]]
        assert torch.allclose(torch.tensor(prop.confidence(i)), ref_conf[: (5, 3)[i]], atol=1e-5)
    # a broken twin: a causal mask inside the block changes the drafts' logits
    import moesaic.spec.dspark as dspark_mod

    real = dspark_mod.attend_all
    try:
        dspark_mod.attend_all = lambda q, k, s, sc: real(q[:1].expand_as(q), k, s, sc)
        assert (prop.block_logits([prop.seqs[0]], ys[:1])[0][0] - refs[0][1]).abs().max() > 1e-3
    finally:
        dspark_mod.attend_all = real


def test_dspark_on_its_demo_keeps_committed_context_only():
    """The V4.1 demo (release layout: fp8 stages and main_proj, fp4 experts): drafting rounds that keep
    some drafts leave each stage's ring equal to a fresh drafter's fed only the committed rows, and
    both draft the same."""
    from moesaic.spec.dspark import make_proposer as make_dspark

    ck, model = demo_model("demo-deepseek-v41", "float32")
    assert model.dspark is not None and len(model.dspark.stages) == 3
    prop = make_dspark(model, ck.cfg, {"num_speculative_tokens": 4})
    prompts = [random_ids(10, ck.cfg.vocab_size, seed=31), random_ids(3, ck.cfg.vocab_size, seed=32)]
    seqs = simulate(model, prop, prompts, [(4, 1), (2, 0), (4, 4), (3, 2)])
    for i, (tokens, hidden, last, _) in enumerate(seqs):
        fresh = make_dspark(model, ck.cfg, {"num_speculative_tokens": 4})
        fresh.start(0)
        fresh.observe(0, 0, tokens, hidden)
        assert prop.propose([(i, last, 4)])[0].tokens == fresh.propose([(0, last, 4)])[0].tokens
        a, b = prop.seqs[i], fresh.seqs[0]
        assert a.seen == b.seen == len(tokens)
        for ra, rb in zip(a.rings, b.rings):
            x, y = ra.rows()["kv"], rb.rows()["kv"]
            assert x.shape == y.shape == (min(len(tokens), ck.cfg.sliding_window), ck.cfg.head_dim)
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)


def test_dspark_stages_in_the_release_layout(tmp_path):
    """The demo writes the stages as released (fp8 main_proj and attention with UE8M0 32x32 scales, fp4
    experts, bf16/fp32 heads); a checkpoint without them loads with no drafter, one with part of them is
    refused; the proposer refuses what it cannot run."""
    from moesaic.demo import deepseek_v41 as v41demo
    from moesaic.errors import CheckpointError
    from moesaic.models import Checkpoint
    from moesaic.spec.dspark import make_proposer as make_dspark
    from moesaic.weights.store import save_safetensors

    ckpt = v41demo.write_checkpoint(tmp_path / "q", quantized=True)
    assert ckpt["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn and ckpt[
        "mtp.0.main_proj.scale"
    ].shape == (2, 6)
    assert (
        ckpt["mtp.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
        and ckpt["mtp.2.ffn.experts.3.w2.weight"].dtype == torch.int8
    )
    assert not any(k.startswith(("mtp.1.main", "mtp.0.markov", "mtp.1.norm")) for k in ckpt)
    assert ckpt["mtp.2.markov_head.embed.weight"].shape == (259, 16) and ckpt[
        "mtp.2.confidence_head.proj.weight"
    ].shape == (1, 80)
    model = Checkpoint.open(tmp_path / "q").build("float32")
    assert model.dspark is not None and model.dspark.stages[0].attn.compressor is None
    for name, keep in (
        ("none", lambda k: not k.startswith("mtp.")),
        ("part", lambda k: not k.startswith("mtp.2.")),
    ):
        folder = tmp_path / name
        folder.mkdir()
        save_safetensors({k: v for k, v in ckpt.items() if keep(k)}, folder / "model.safetensors")
        (folder / "config.json").write_text((tmp_path / "q" / "config.json").read_text())
        if name == "none":
            bare = Checkpoint.open(folder).build("float32")
            assert bare.dspark is None
            with pytest.raises(ConfigError, match="DSpark stages"):
                make_dspark(bare, bare.cfg, {})
        else:
            with pytest.raises(CheckpointError, match="incomplete"):
                Checkpoint.open(folder).build("float32")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        make_dspark(model, model.cfg, {"num_speculative_tokens": 6})  # more than the block of 5
    with pytest.raises(ConfigError, match="method 'dspark'"):
        make_dspark(object(), None, {})


@pytest.mark.parametrize(
    "over, field",
    [
        ({"dspark_target_layer_ids": [0, 2]}, "dspark_target_layer_ids"),  # layer 0's input is the embedding
        ({"dspark_target_layer_ids": [2, 4]}, "dspark_target_layer_ids"),  # an Engram layer
        ({"dspark_target_layer_ids": [2, 6]}, "dspark_target_layer_ids"),  # past the last layer
        ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
        ({"dspark_noise_token_id": 259}, "dspark_noise_token_id"),
        ({"dspark_block_size": 0}, "dspark_block_size"),
        ({"compress_ratios": [0, 0, 2, 2, 1, 1, 0, 2, 0]}, "compress_ratios"),  # a compressed stage
    ],
)
def test_dspark_config_errors_name_the_field(over, field):
    from moesaic.demo import deepseek_v41 as v41demo
    from moesaic.models import deepseek_v41 as v41

    with pytest.raises(ConfigError, match=field):
        v41.parse_config(v41demo.release_config(dict(v41demo.DEMO_TEXT_CONFIG, **over)))


# ---------------------------------------------------------------- what the engine may also do


@pytest.mark.parametrize("demo, method", [("demo-glm5-next-nvfp4", "mtp"), ("demo-deepseek-v41", "dspark")])
def test_prefix_rows_without_hidden_fork_and_the_registry_signature(demo, method):
    """The registry's call `factory(model, cfg, spec, folder)` with a parsed config (an object with
    `num_speculative_tokens`); rows a prefix cache served come with no hidden states and still leave
    the head drafting from the rows it has; `fork` gives a parallel sample the parent's rows, and the
    two then move apart without touching each other. A drafter folder does not apply to a model's own
    heads."""
    import types

    from moesaic.spec import dspark, mtp

    factory = {"mtp": mtp.make_proposer, "dspark": dspark.make_proposer}[method]
    ck, model = demo_model(demo, "float32")
    prop = factory(model, ck.cfg, types.SimpleNamespace(num_speculative_tokens=3), None)
    assert prop.max_k == 3 and prop.method == method
    with pytest.raises(ConfigError, match="'model'"):
        factory(model, ck.cfg, types.SimpleNamespace(num_speculative_tokens=3), ROOT)
    ids = random_ids(12, ck.cfg.vocab_size, seed=41)
    st = model.new_state(rollback_window=4)
    with_taps(model, [(st, ids[:7])], prop.taps)  # the cached prefix: computed once, its taps not kept
    logits, taps = with_taps(model, [(st, ids[7:])], prop.taps)
    prop.start(0)
    prop.observe(0, 0, ids[:7], {})
    prop.observe(0, 7, ids[7:], taps)
    last = int(logits[-1].argmax())
    prop.fork(0, 1)
    a, b = prop.propose([(0, last, 3), (1, last, 3)])
    assert len(a.tokens) == 3 and a.tokens == b.tokens
    st2 = model.new_state(rollback_window=4)
    st2.restore(st.snapshot())
    _, t0 = with_taps(model, [(st, [last, a.tokens[0]])], prop.taps)
    _, t1 = with_taps(model, [(st2, [last, 5])], prop.taps)
    prop.observe(0, 12, [last, a.tokens[0]], t0)
    prop.observe(1, 12, [last, 5], t1)
    c, d = prop.propose([(0, 7, 3), (1, 7, 3)])
    fresh = factory(model, ck.cfg, {"num_speculative_tokens": 3}, None)
    fresh.start(0)
    fresh.observe(0, 0, ids[:7], {})
    fresh.observe(0, 7, ids[7:] + [last, a.tokens[0]], {L: torch.cat([taps[L], t0[L]]) for L in taps})
    fresh.start(1)
    fresh.observe(1, 0, ids[:7], {})
    fresh.observe(1, 7, ids[7:] + [last, 5], {L: torch.cat([taps[L], t1[L]]) for L in taps})
    e, f = fresh.propose([(0, 7, 3), (1, 7, 3)])
    assert c.tokens == e.tokens and d.tokens == f.tokens  # parent and child each drafted from their own rows
    prop.finish(1)
    prop.finish(1)  # finishing twice (or a sequence never started) is harmless

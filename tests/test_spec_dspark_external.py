"""External DSpark drafters (moesaic/spec/dspark.py, method "dspark" with a drafter folder): a tiny drafter in
the released layout (DFlash backbone + markov_head + confidence_head) on the Kimi K3 and GLM demos. The block
logits equal an in-test formula (the row shift and the Markov walk included), the confidence estimates too;
zeroing the Markov weights changes the drafts; greedy with drafting equals plain greedy token for token, with
prefix caching on a hybrid; every config that cannot work is a ConfigError naming the field."""

from __future__ import annotations

import pytest
import torch
from helpers import drafter_reference, drafting_prompts, random_ids, write_drafter

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cache.paged import BLOCK_SIZE
from moesaic.errors import ConfigError
from moesaic.spec.base import DraftProposer
from moesaic.spec.dspark import ExternalDsparkProposer

VOCAB = 258  # the demos' byte vocabulary is 259; random_ids(n, 258) stays below it
RANK = 8


def write_dspark(folder, llm, taps, rank=RANK, confidence=True, with_markov=True, zero_markov=False, **over):
    """A random DSpark drafter in the released layout (vLLM qwen3_dspark / deepseek-ai/dspark_qwen3_8b_block7):
    the DFlash backbone, `markov_head.markov_w1/w2` [vocab, rank], `confidence_head.proj` weight and bias,
    the DSpark fields at the config's top level."""
    d, V = llm.cfg.hidden_size, llm.cfg.vocab_size
    g = torch.Generator().manual_seed(11)
    tensors = {}
    if rank:
        w1, w2 = torch.randn(V, rank, generator=g), 2 * torch.randn(V, rank, generator=g) * rank**-0.5
        tensors["markov_head.markov_w1.weight"] = 0 * w1 if zero_markov else w1
        tensors["markov_head.markov_w2.weight"] = 0 * w2 if zero_markov else w2
    if confidence:
        width = d + rank if with_markov else d
        tensors["confidence_head.proj.weight"] = torch.randn(1, width, generator=g) * width**-0.5
        tensors["confidence_head.proj.bias"] = torch.tensor([0.3])
    fields = {
        "architectures": ["Qwen3DSparkModel"],
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "confidence_head_with_markov": with_markov,
    }
    fields.update(over)
    return write_drafter(folder, llm, taps, tensors=tensors, **fields)


def spec(folder, k=4, **kw):
    return {"method": "dspark", "num_speculative_tokens": k, "model": str(folder), "adaptive": False, **kw}


def greedy(n):
    return moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def feed(llm, proposer, ids, cuts):
    """The rows the engine would give the proposer: a prompt, then committed rows of verify rounds."""
    st = llm.model.new_state()
    proposer.start(0)
    for lo, hi in zip(cuts, cuts[1:]):
        batch = ForwardBatch.build([(st, ids[lo:hi])])
        batch.taps = proposer.taps
        llm.model.forward(batch)
        proposer.observe(0, lo, ids[lo:hi], batch.tapped)


def reference(folder, model, committed, anchor, first_row=0):
    """The DSpark round written from its formula on a full recompute: (logits [B, vocab], confidence [B]).
    Row j of the block [anchor, MASK...] drafts the token after it: z_j = lm_head(h_j) + w2 · w1[prev_j],
    prev_0 = the anchor, prev_j = argmax z_{j-1}; conf_j = sigmoid(proj · [h_j ; w1[prev_j]] + bias).
    `first_row` 1: the same walk over DFlash's rows 1 .. B - 1 (a drafter that forgot the shift)."""
    from safetensors.torch import load_file

    w = load_file(str(folder / "model.safetensors"))
    h = drafter_reference(folder, model, committed, anchor)[first_row:]  # [B, d], every row
    u = h @ model.lm_head.float().T
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    prev, zs, conf = anchor, [], []
    for j in range(h.shape[0]):
        e = w1[prev]
        z = u[j] + w2 @ e
        x = torch.cat([h[j], e])
        conf.append(
            torch.sigmoid(w["confidence_head.proj.weight"][0] @ x + w["confidence_head.proj.bias"][0])
        )
        zs.append(z)
        prev = int(z.argmax())
    return torch.stack(zs), torch.stack(conf)


@pytest.mark.parametrize("name", ["demo-kimi-k3", "demo-glm5-next-nvfp4"])
def test_block_logits_and_confidence_equal_the_formula(name, tmp_path):
    base = moesaic.LLM(name, dtype="float32")
    layers = len(base.model.layers)
    folder = write_dspark(tmp_path / "drafter", base, taps=[0, layers // 2, layers - 1])
    llm = moesaic.LLM(name, dtype="float32", speculative_config=spec(folder, k=5))
    proposer = llm.engine.proposer
    assert isinstance(proposer, ExternalDsparkProposer) and isinstance(proposer, DraftProposer)
    assert proposer.max_k == 5  # block 5: the anchor row drafts too
    ids = random_ids(40, VOCAB, seed=81)
    feed(llm, proposer, ids, (0, 25, 29, 31))
    got = proposer.block_logits([(0, ids[31], 5)])[0]
    want, want_conf = reference(folder, llm.model, ids[:31], ids[31])
    tol = 1e-3 * max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    print(f"{name}: max abs DSpark block-logit err vs the formula {err:.2e}")
    assert err < tol
    drafts = proposer.propose([(0, ids[31], 5)])[0]
    assert drafts.probs is None and drafts.tokens == want.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(proposer.confidence(0)), want_conf, atol=1e-4)
    # broken twins: DFlash's rows (no shift) or no Markov bias do not pass the same check
    unshifted, _ = reference(folder, llm.model, ids[:31], ids[31], first_row=1)
    assert (got[:-1] - unshifted).abs().max() > 100 * tol
    h = drafter_reference(folder, llm.model, ids[:31], ids[31])
    assert (got - h @ llm.model.lm_head.float().T).abs().max() > 100 * tol  # no Markov bias
    proposer.finish(0)
    assert proposer.confidence(0) == []


def test_the_markov_head_changes_the_drafts(tmp_path):
    base = moesaic.LLM("demo-kimi-k3", dtype="float32")
    taps = [1, len(base.model.layers) - 1]
    ids = random_ids(30, VOCAB, seed=82)
    drafts = []
    for zero in (False, True):
        folder = write_dspark(tmp_path / f"d{zero}", base, taps, zero_markov=zero)
        llm = moesaic.LLM("demo-kimi-k3", dtype="float32", speculative_config=spec(folder, k=5))
        feed(llm, llm.engine.proposer, ids, (0, 20, 27))
        drafts.append(llm.engine.proposer.propose([(0, ids[27], 5)])[0].tokens)
    assert drafts[0] != drafts[1]


def prompts() -> list[list[int]]:
    return drafting_prompts(VOCAB, long=70)


@pytest.mark.parametrize(
    "name, heads",
    [
        ("demo-kimi-k3", {}),
        ("demo-glm5-next-nvfp4", {}),
        ("demo-deepseek-v41", {}),  # a folder instead of V4.1's own stages
        ("demo-kimi-k3", {"rank": 0, "with_markov": False, "sample_from_anchor": False}),
    ],
)
def test_greedy_with_dspark_drafting_equals_plain(name, heads, tmp_path):
    base = moesaic.LLM(name, dtype="float32", max_num_batched_tokens=24)
    ps, sp = prompts(), greedy(16)
    want = [o.token_ids for o in base.generate(ps, sp)]
    layers = len(base.model.layers)
    folder = write_dspark(tmp_path / "drafter", base, taps=[0, layers - 1], **heads)
    llm = moesaic.LLM(name, dtype="float32", max_num_batched_tokens=24, speculative_config=spec(folder))
    assert isinstance(llm.engine.proposer, ExternalDsparkProposer)
    assert llm.engine.proposer.max_k == (4 if heads.get("sample_from_anchor") is False else 5)
    assert [o.token_ids for o in llm.generate(ps, sp)] == want
    s = llm.stats()["speculative"]
    assert s["drafted"] > 0 and s["rolled_back_rows"] > 0
    assert llm.stats()["blocks"]["used"] == 0


def test_prefix_cache_with_dspark_drafting_on_a_hybrid_equals_no_cache_no_drafting(tmp_path):
    name = "demo-kimi-k3"
    system = random_ids(2 * BLOCK_SIZE + 10, VOCAB, seed=50)
    turns = [system + random_ids(7 + i, VOCAB, seed=60 + i) for i in range(3)]
    sp = greedy(40)
    base = moesaic.LLM(name, dtype="float32", enable_prefix_caching=False)
    want = [base.generate([t], sp)[0].token_ids for t in turns]
    follow = turns[0] + want[0] + random_ids(5, VOCAB, seed=70)
    want.append(base.generate([follow], sp)[0].token_ids)
    folder = write_dspark(tmp_path / "drafter", base, taps=[0, len(base.model.layers) - 1])
    llm = moesaic.LLM(name, dtype="float32", speculative_config=spec(folder, k=3))
    got = [llm.generate([t], sp)[0].token_ids for t in turns + [follow]]
    assert got == want
    stats = llm.stats()
    assert stats["speculative"]["rollbacks"] > 0 and stats["snapshots"] > 0
    assert llm.engine.scheduler.cached_tokens >= 2 * BLOCK_SIZE


def test_dspark_without_a_folder_on_a_target_without_stages_names_the_folder():
    with pytest.raises(ConfigError, match=r"dspark \(with a drafter folder 'model'\)"):
        moesaic.LLM(
            "demo-kimi-k3",
            dtype="float32",
            speculative_config={"method": "dspark", "num_speculative_tokens": 3},
        )


def test_drafters_that_cannot_work_are_config_errors_naming_the_field(tmp_path):
    base = moesaic.LLM("demo-glm5-next-nvfp4", dtype="float32")
    vocab = base.cfg.vocab_size
    taps = {"mask_token_id": 1, "target_layer_ids": [0, 1]}
    cases = [
        (dict(hidden_size=base.cfg.hidden_size + 8), "hidden_size"),
        (dict(vocab_size=vocab + 1), "vocab_size"),
        (dict(draft_vocab_size=vocab - 3), "draft_vocab_size"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 99]}), "target_layer_ids"),
        (dict(dflash_config={"mask_token_id": vocab + 5, "target_layer_ids": [0]}), "mask_token_id"),
        (dict(markov_head_type="gated"), "markov_head_type"),
        (dict(markov_rank=-1), "markov_rank"),
        (dict(kv_lora_rank=64), "kv_lora_rank"),  # an MLA-layer drafter (lightseekorg/kimi-k3-dspark)
        (dict(dflash_config={**taps, "aux_hidden_stream": "attn_res"}), "aux_hidden_stream"),
        (dict(dflash_config={**taps, "projector_type": "conv"}), "projector_type"),
    ]
    for i, (over, field) in enumerate(cases):
        folder = write_dspark(tmp_path / f"d{i}", base, taps=[0, 1], **over)
        with pytest.raises(ConfigError, match=field):
            moesaic.LLM("demo-glm5-next-nvfp4", dtype="float32", speculative_config=spec(folder, k=3))
    # markov_rank 0 with a confidence head that reads the Markov feature
    folder = write_dspark(
        tmp_path / "r0", base, taps=[0, 1], rank=0, with_markov=False, confidence_head_with_markov=True
    )
    with pytest.raises(ConfigError, match="confidence_head_with_markov"):
        moesaic.LLM("demo-glm5-next-nvfp4", dtype="float32", speculative_config=spec(folder, k=3))
    # more drafts than a block of 5 drafts; a DSpark folder under method "dflash"
    folder = write_dspark(tmp_path / "ok", base, taps=[0, 1])
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        moesaic.LLM("demo-glm5-next-nvfp4", dtype="float32", speculative_config=spec(folder, k=6))
    with pytest.raises(ConfigError, match="method 'dspark'"):
        moesaic.LLM(
            "demo-glm5-next-nvfp4",
            dtype="float32",
            speculative_config={"method": "dflash", "num_speculative_tokens": 3, "model": str(folder)},
        )

"""The trained demo (moesaic/demo/trained/, written by scripts/train_demo.py): moesaic loads it and equals
transformers on it, its greedy text is code (and the same check fails on a random-weight twin), its
metadata records how it was trained and what its draft heads accept, and the shipped heads still agree
with the trunk on held-out stdlib code."""

from __future__ import annotations

import importlib.util
import json
import platform
import re
import sysconfig
from pathlib import Path

import pytest
import torch

import moesaic

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "moesaic" / "demo" / "trained" / "glm5-code"
DRAFTER = ROOT / "moesaic" / "demo" / "trained" / "glm5-code-dflash"
PROMPT = "import os\nimport sys\n\n\ndef main(argv=None):\n    "
KEYWORDS = {
    "def", "return", "if", "elif", "else", "for", "while", "in", "not", "is", "and", "or", "None", "True",
    "False", "self", "import", "from", "class", "raise", "try", "except", "with", "as", "yield", "pass",
}  # fmt: skip


def _script():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


td = _script()


@pytest.fixture(scope="module")
def llm():
    return moesaic.LLM(str(TARGET), dtype="float32")


@pytest.fixture(scope="module")
def oracle():
    """The artifact in the training framework (transformers' glm5_next modules), fp32."""
    return td.load_target(TARGET)


def code_like(text: str) -> list[str]:
    """What keeps `text` from looking like Python source (empty: nothing)."""
    problems = []
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / max(1, len(text))
    if printable < 0.95:
        problems.append(f"only {printable:.0%} printable ASCII")
    words = set(re.findall(r"[A-Za-z_]\w*", text)) & KEYWORDS
    if len(words) < 3:
        problems.append(f"Python keywords {sorted(words)}")
    lines = [line for line in text.split("\n")[1:] if line.strip()]  # the first line continues the prompt's
    if len(lines) < 3:
        problems.append(f"{len(lines)} lines")
    elif sum((len(line) - len(line.lstrip(" "))) % 4 == 0 for line in lines) < 0.8 * len(lines):
        problems.append("indentation not in steps of 4 spaces")
    return problems


def greedy(model, n: int = 64) -> str:
    out = model.generate(PROMPT, moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    return out.text


@pytest.mark.parametrize("n", [300, 700])  # 700 > index_topk + 3: DSA selects pools with the trained indexers
def test_loads_with_mtp_and_logits_equal_the_training_framework(llm, oracle, n):
    trunk, _, _ = oracle
    assert len(llm.model.mtp) == 1  # the MTP layer (layer num_hidden_layers) was found and loaded
    ids = llm.encode(Path(__file__).read_text())[:n]  # code the model has not seen
    got = llm.score(ids)
    with torch.no_grad():
        td.use_fast_kda(False)  # transformers' own KDA, the oracle
        ref = trunk(torch.tensor([ids]))[0][0]
        td.use_fast_kda(True)  # the kernel it was trained with
        try:
            trained = trunk(torch.tensor([ids]))[0][0]
        finally:  # transformers' module is shared by the other tests (test_kda_layer calls its KDA)
            td.use_fast_kda(False)
    err, err_trained = (got - ref).abs().max().item(), (got - trained).abs().max().item()
    print(f"trained demo: {n} tokens, max abs logit err {err:.2e} vs transformers, {err_trained:.2e} vs "
          f"the training kernel (|logit| max {ref.abs().max():.1f})")  # fmt: skip
    assert err < 1e-4 * ref.abs().max().item() and err_trained < 1e-4 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_text_is_code_and_a_random_twin_is_not(llm, tmp_path):
    text = greedy(llm)
    print(f"trained demo, greedy after {PROMPT!r}:\n{text}")
    assert code_like(text) == [], text
    # the same folder with random weights (the init the training started from) fails the same check
    torch.manual_seed(0)
    cfg = json.loads((TARGET / "config.json").read_text())
    trunk, mtp = td.Trunk(cfg["text_config"]), td.MTPLayer(cfg["text_config"])
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "moesaic_demo": {"trained": False}}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / f).write_bytes((TARGET / f).read_bytes())
    from safetensors.torch import save_file

    tensors = td.release_tensors(trunk, mtp, cfg["text_config"]["num_hidden_layers"])
    save_file(
        {k: v.to(td.stored_dtype(k)).contiguous() for k, v in tensors.items()},
        str(tmp_path / "model.safetensors"),
    )
    noise = greedy(moesaic.LLM(str(tmp_path), dtype="float32"))
    assert code_like(noise) != [], noise


def test_tokenizer_specials_and_chat_template(llm):
    tok = llm.tokenizer
    for i, s in enumerate(td.SPECIAL_TOKENS):
        assert tok.encode(s) == [i], s  # every marker is one token
    assert set(llm.cfg.eos_token_ids) == {
        tok.encode(s)[0] for s in ("<|endoftext|>", "<|user|>", "<|observation|>")
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sort a list."},
        {
            "role": "assistant",
            "content": "<think>sorted()</think>Use sorted().",
            "tool_calls": [{"function": {"name": "run", "arguments": {"code": "sorted(x)", "n": 2}}}],
        },
        {"role": "tool", "content": "[1, 2]"},
    ]
    assert tok.apply_chat_template(messages) == (
        "[gMASK]<sop><|system|>Be brief.<|user|>Sort a list.<|assistant|><think>sorted()</think>Use sorted()."
        "<tool_call>run<arg_key>code</arg_key><arg_value>sorted(x)</arg_value><arg_key>n</arg_key>"
        "<arg_value>2</arg_value></tool_call><|observation|><tool_response>[1, 2]</tool_response><|assistant|><think>"
    )


def test_metadata_and_drafter_layout():
    cfg = json.loads((TARGET / "config.json").read_text())
    meta = cfg["moesaic_demo"]
    assert meta["trained"] is True and "random_weights" not in meta
    corpus = meta["corpus"]
    assert corpus["python"].count(".") == 2 and corpus["bytes"] > 1_000_000 and corpus["heldout_files"]
    heads, rounds = meta["heads_heldout"], meta["draft_rounds"]
    assert heads["mtp_agree"] >= 0.5  # the MTP head's top-1 agreement with the trunk's greedy next token
    acc = rounds["dflash_acceptance"]
    assert len(acc) == td.BLOCK - 1 and acc[0] > 0.3 and all(a >= b for a, b in zip(acc, acc[1:]))
    assert rounds["dflash_tau"] == pytest.approx(1 + sum(acc), abs=1e-2) and rounds["mtp_acceptance"][0] > 0.3
    # the last phase (on the trunk's greedy text) ran, and its heads draft longer than those it started from
    before = meta["distill"]["draft_rounds_before"]
    assert rounds["mtp_tau_k3"] > before["mtp_tau_k3"] and rounds["dflash_tau"] > before["dflash_tau"]
    text = cfg["text_config"]
    assert text["index_topk"] >= meta["run"]["context"]  # DSA dropped no key while training

    from safetensors import safe_open

    dcfg = json.loads((DRAFTER / "config.json").read_text())
    dc = dcfg["dflash_config"]
    assert dcfg["hidden_size"] == text["hidden_size"] and dcfg["vocab_size"] == text["vocab_size"]
    assert dc["mask_token_id"] == td.SPECIAL_TOKENS.index("[MASK]") and dcfg["block_size"] == dc["block_size"]
    assert all(0 <= i < text["num_hidden_layers"] for i in dc["target_layer_ids"])
    d = text["hidden_size"]
    with safe_open(str(DRAFTER / "model.safetensors"), "pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [d, len(dc["target_layer_ids"]) * d]
        assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= set(f.keys())
        assert not any("embed" in k or "lm_head" in k for k in f.keys())  # the target's are used
    mtp = f"model.language_model.layers.{text['num_hidden_layers']}."
    with safe_open(str(TARGET / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {
        mtp + n for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
    } <= names
    assert not any(n.startswith(mtp) and ("hc_" in n or "shared_head.head" in n) for n in names)


def test_shipped_heads_agree_with_the_trunk_on_heldout_code(oracle):
    """On this machine's copies of the held-out stdlib files (skipped where they differ)."""
    trunk, mtp, cfg = oracle
    corpus = cfg["moesaic_demo"]["corpus"]
    if platform.python_version() != corpus["python"]:
        pytest.skip(f"held-out files are those of Python {corpus['python']}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(f"[gMASK]<sop>{(root / n).read_text()}<|endoftext|>" for n in corpus["heldout_files"][:6])
    ids = torch.tensor(tok.encode(text).ids[: 2 * 384]).view(2, 384)
    anchors = td.sample_anchors(2, 384, 16, torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, m_agree, _, d_agree = td.head_losses(trunk, mtp, td.load_drafter(DRAFTER), ids, anchors)
    print(f"held-out agreement with the trunk: MTP {m_agree:.2f}, DFlash per position {d_agree.tolist()}")
    # this sample is small (32 blocks), so it is held to 40 % of the run's recorded agreement (24 held-out
    # windows); heads that do not fit the trunk (random, or another run's) agree on ~1 % or less
    heads = cfg["moesaic_demo"]["heads_heldout"]
    assert m_agree > 0.4 * heads["mtp_agree"] and d_agree[0] > 0.4 * heads["dflash_agree"][0]


def test_distill_phase_data_is_the_trunks_greedy_text(oracle):
    """scripts/train_demo.py's last phase trains the heads on `greedy_sequences`: from each start on, the
    tokens are the trunk's own greedy choices (checked here against the training framework's trunk), and
    `greedy_losses` scores only the rows whose target lies there."""
    from tokenizers import Tokenizer

    trunk, mtp, _ = oracle
    docs, _ = td.read_corpus(8)
    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    train = td.windows(td.token_stream(tok, [text for _, text, _ in docs]), 80)[:2]
    seqs, starts = td.greedy_sequences(TARGET, train, 2, torch.Generator().manual_seed(0))
    assert seqs.shape == (2, 80) and all(32 <= s <= 40 for s in starts.tolist())
    with torch.no_grad():
        logits, h, _ = trunk(seqs)
    for b, s in enumerate(starts.tolist()):
        assert torch.equal(seqs[b, :s], train[b, :s])  # the prompt is the window's start
        match = (logits[b, s - 1 : -1].argmax(-1) == seqs[b, s:]).float().mean().item()
        assert match > 0.95, f"sequence {b}: {match:.0%} of the continuation is the trunk's argmax"
    drafter = td.load_drafter(DRAFTER)
    anchors = td.continuation_anchors(starts, 80, 4, torch.Generator().manual_seed(1))
    assert (anchors >= starts[:, None]).all() and (anchors <= 80 - td.BLOCK).all()
    with torch.no_grad():
        m_loss, d_loss, m_agree, d_agree = td.greedy_losses(trunk, mtp, drafter, seqs, starts, anchors, 3)
        # depth 1 by hand: row p (token p+1, hidden p) -> the trunk's row p+1, scored where p + 1 >= start
        x = mtp(trunk.embed(seqs[:, 1:]), h[:, :-1])[:, :-1]
        ce = td.soft_ce(trunk.lm_head(mtp.shared_head.norm(x)), logits[:, 1:-1])
        scored = torch.arange(1, 79)[None, :] >= starts[:, None]
    torch.testing.assert_close(m_loss[0], ce[scored].mean())
    assert not torch.allclose(m_loss[0], ce.mean())  # every row would be another number
    assert m_loss.shape == (3,) and d_loss.shape == (td.BLOCK - 1,) and torch.isfinite(d_loss).all()
    assert ((m_agree >= 0) & (m_agree <= 1)).all() and d_agree.shape == (td.BLOCK - 1,)

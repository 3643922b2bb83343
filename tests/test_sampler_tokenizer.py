"""The sampler (greedy, temperature, top-k, top-p, seeds, stops) and the tokenizers."""

from __future__ import annotations

import json

import torch

import moesaic
from moesaic.engine.sampler import SamplingParams, make_generator, sample
from moesaic.tokenizer import ByteTokenizer, HFTokenizer


def draws(logits, n=400, **kw):
    p = SamplingParams(seed=123, **kw)
    g = make_generator(p)
    return [sample(logits, p, g) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    assert sample(logits, SamplingParams(temperature=0.0), None) == 1


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([3.0, 2.9, 2.8, 2.7, 2.6])
    assert set(draws(logits, top_k=2)) == {0, 1}
    assert set(draws(logits, top_k=0)) == {0, 1, 2, 3, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert set(draws(logits, top_p=0.75)) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert set(draws(logits, top_p=0.81)) == {0, 1, 2}
    assert set(draws(logits, top_p=0.4)) == {0}  # the best token always stays


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 0.0])
    cold = draws(logits, n=1000, temperature=0.25).count(0) / 1000  # p0 = 1/(1+e^-4) = 0.982
    hot = draws(logits, n=1000, temperature=4.0).count(0) / 1000  # p0 = 1/(1+e^-0.25) = 0.562
    assert cold > 0.95 and 0.45 < hot < 0.68


def test_seed_reproduces_and_differs():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert draws(logits, n=50) == draws(logits, n=50)
    p = SamplingParams(seed=7)
    other = [sample(logits, p, g) for g in [make_generator(p)] for _ in range(50)]
    assert other != draws(logits, n=50)


def test_stops_on_eos_stop_ids_and_max_tokens():
    llm = moesaic.LLM("demo-mistral4", dtype="float32")
    base = llm.generate([[1, 70, 71]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_at = base.token_ids[4]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        [[1, 70, 71]], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    # the same token as the model's EOS
    llm.engine.eos_ids = {stop_at}
    out = llm.generate([[1, 70, 71]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_at


def test_seeded_sampling_through_the_engine_is_batch_independent():
    llm = moesaic.LLM("demo-mistral4", dtype="float32")
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=5, ignore_eos=True)
    alone = llm.generate(["abc"], sp)[0].token_ids
    together = llm.generate(["abc", "xyz", "hello"], sp)[0].token_ids
    assert alone == together


def test_byte_tokenizer_round_trip_and_stream():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text
    feed = tok.stream_decoder()
    assert "".join(feed(i) for i in ids) == text  # multi-byte characters wait for their last byte


def write_hf_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "[INST]": 5, "[/INST]": 6, "!": 7}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<s>", "</s>", "[INST]", "[/INST]"])
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "chat_template": "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
            }
        )
    )


def test_hf_tokenizer_and_chat_template(tmp_path):
    write_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.encode("hello world !") == [0, 3, 4, 7]
    assert tok.eos_ids == (1,)
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat == "<s>[INST] hello [/INST]"
    assert tok.decode([0, 3, 4, 1]) == "hello world"

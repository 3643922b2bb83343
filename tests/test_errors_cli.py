"""What a user can get wrong: broken checkpoints, bad configs, bad requests, and how the CLI reports them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import moesaic
from moesaic.demo import DEMO_CONFIG
from moesaic.errors import CapacityError, CheckpointError, ConfigError, RequestError
from moesaic.models import mistral4
from moesaic.demo import random_tensors
from moesaic.weights.load import Checkpoint
from moesaic.weights.store import save_safetensors

SMALL = dict(DEMO_CONFIG, num_hidden_layers=2, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
             max_position_embeddings=64, moesaic_demo={})


def write(folder, config=SMALL, edit=None):
    folder.mkdir(parents=True, exist_ok=True)
    cfg = mistral4.parse_config(config)
    tensors = random_tensors(mistral4.tensor_specs(cfg), seed=0)
    if edit:
        edit(tensors)
    save_safetensors(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def open_err(folder, kind):
    with pytest.raises(kind) as e:
        Checkpoint.open(folder).build("float32")
    return str(e.value)


def test_missing_misshaped_and_unexpected_tensors_reported_together(tmp_path):
    def edit(t):
        del t["model.layers.1.self_attn.kv_b_proj.weight"]
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 47)
        t["model.layers.0.mlp.surprise.weight"] = torch.zeros(3)

    msg = open_err(write(tmp_path, edit=edit), CheckpointError)
    assert "missing: model.layers.1.self_attn.kv_b_proj.weight" in msg
    assert "misshaped: model.layers.0.mlp.down_proj.weight is [32, 47], expected [32, 48]" in msg
    assert "unexpected: model.layers.0.mlp.surprise.weight" in msg
    assert "3 problem(s)" in msg


def test_unknown_model_type(tmp_path):
    msg = open_err(write(tmp_path, dict(SMALL, model_type="llama99")), ConfigError)
    assert "model_type 'llama99'" in msg


@pytest.mark.parametrize("field,value,expect", [
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("hidden_act", "gelu", "hidden_act"),
    ("hidden_size", "wide", "hidden_size"),
    ("n_group", 3, "n_group"),
    ("vocab_size", -1, "vocab_size"),
])
def test_invalid_config_values_name_the_field(tmp_path, field, value, expect):
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, **{field: value})))
    with pytest.raises(ConfigError) as e:
        Checkpoint.open(tmp_path)
    assert expect in str(e.value)


def test_missing_config_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ConfigError, match="'model_type' is missing"):
        Checkpoint.open(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "params.json").write_text(json.dumps({"dim": 8, "n_layers": 1, "kv_lora_rank": 4}))
    with pytest.raises(ConfigError, match="'n_heads' is missing"):
        Checkpoint.open(tmp_path)


def test_bad_requests_do_not_disturb_the_engine(tmp_path):
    llm = moesaic.LLM(str(write(tmp_path)), dtype="float32")
    sp = moesaic.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = llm.generate(["abc"], sp)[0].token_ids
    for bad, kind in [(moesaic.SamplingParams(max_tokens=0), RequestError),
                      (moesaic.SamplingParams(top_p=1.5), RequestError),
                      (moesaic.SamplingParams(temperature=-1.0), RequestError)]:
        with pytest.raises(kind):
            llm.generate(["abc"], bad)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10_000]], sp)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], sp)
    with pytest.raises(CapacityError, match="context"):
        llm.generate([[5] * 100], sp)
    # a failing prompt among good ones: nothing is left behind in the engine
    with pytest.raises(RequestError):
        llm.generate(["abc", [10_000]], sp)
    assert not llm.engine.has_work()
    assert llm.generate(["abc"], sp)[0].token_ids == before


def test_state_budget_refuses_or_queues(tmp_path):
    path = write(tmp_path)
    per_token, _ = mistral4.state_bytes(mistral4.parse_config(SMALL), 4)
    llm = moesaic.LLM(str(path), dtype="float32", max_state_bytes=per_token * 20)
    sp = moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with pytest.raises(CapacityError, match="bytes of state"):
        llm.generate([[5] * 15], sp)
    # two requests of 16 tokens each cannot be held at once: the second waits, both finish
    outs = llm.generate([[5] * 8, [6] * 8], sp)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    alone = llm.generate([[6] * 8], sp)[0]
    assert outs[1].token_ids == alone.token_ids


def cli(*args, env_cache):
    import os

    env = dict(os.environ, MOESAIC_CACHE=str(env_cache))
    return subprocess.run([sys.executable, "-m", "moesaic", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_prints_errors_without_traceback(tmp_path):
    path = write(tmp_path / "m", edit=lambda t: t.pop("model.norm.weight"))
    r = cli("generate", "--model", str(path), env_cache=tmp_path / "cache")
    assert r.returncode != 0
    assert "model.norm.weight" in r.stderr and "Traceback" not in r.stderr
    r = cli("inspect", str(tmp_path / "nowhere"), env_cache=tmp_path / "cache")
    assert r.returncode != 0 and "no such checkpoint folder" in r.stderr and "Traceback" not in r.stderr


def test_cli_generate_demo_streams_and_reports_rate(tmp_path):
    r = cli("generate", "--max-tokens", "6", "--prompt", "hi", env_cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stderr and "tokens/s" in r.stderr and "6 tokens (length)" in r.stderr
    assert (tmp_path / "cache").exists()


def test_inspect_json_on_config_only_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.Mistral4Config().save_pretrained(tmp_path)  # the class defaults = the released Small 4 shape
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    r = cli("inspect", str(tmp_path), "--json", env_cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == "mistral4" and info["num_layers"] == 36
    assert info["layer_schedule"] == ["mla+moe"] * 36
    assert info["state_bytes_per_token"] == 36 * (256 + 64) * 2 == 23040
    assert info["state_bytes_per_sequence"] == 23040 * 1048576
    assert info["tensor_count"] == 2 and info["tensor_count_source"] == "checkpoint"
    assert info["params_by_role"]["expert"] == 36 * 128 * 3 * 4096 * 2048


def test_inspect_text_on_a_full_checkpoint(tmp_path):
    r = cli("inspect", str(write(tmp_path / "m")), env_cache=tmp_path / "cache")
    assert r.returncode == 0 and "contract: ok" in r.stdout and "1x mla+mlp, 1x mla+moe" in r.stdout


def test_score_checks_its_input(tmp_path):
    llm = moesaic.LLM(str(write(tmp_path)), dtype="float32")
    logits = llm.score([1, 5, 6])
    assert logits.shape == (3, SMALL["vocab_size"]) and logits.dtype == torch.float32
    with pytest.raises(RequestError):
        llm.score([])
    with pytest.raises(RequestError):
        llm.score([1, 99999])


def test_checkpoint_tokenizer_and_chat_flag(tmp_path):
    from test_sampler_tokenizer import write_hf_tokenizer

    path = write(tmp_path / "m", dict(SMALL, moesaic_tokenizer=None))
    write_hf_tokenizer(path)
    llm = moesaic.LLM(str(path), dtype="float32")
    out = llm.generate(["hello world"], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == [0, 3, 4] and len(out.token_ids) == 4
    r = cli("generate", "--model", str(path), "--prompt", "hello", "--chat", "--max-tokens", "3", env_cache=tmp_path / "c")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr

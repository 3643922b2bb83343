"""What a user can get wrong: broken checkpoints, bad configs, bad requests, and how the CLI reports them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import moesaic
from moesaic.demo import random_tensors
from moesaic.demo.mistral4 import DEMO_CONFIG
from moesaic.errors import CapacityError, CheckpointError, ConfigError, RequestError
from moesaic.models import Checkpoint, mistral4
from moesaic.weights.store import save_safetensors

SMALL = dict(
    DEMO_CONFIG,
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=64,
    moesaic_demo={},
)


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


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
        ("hidden_act", "gelu", "hidden_act"),
        ("hidden_size", "wide", "hidden_size"),
        ("n_group", 3, "n_group"),
        ("vocab_size", -1, "vocab_size"),
    ],
)
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
    for bad, kind in [
        (moesaic.SamplingParams(max_tokens=0), RequestError),
        (moesaic.SamplingParams(top_p=1.5), RequestError),
        (moesaic.SamplingParams(temperature=-1.0), RequestError),
    ]:
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
    seen = []
    step = llm.engine.step
    llm.engine.step = lambda: (seen.append((len(llm.engine.running), llm.engine.used_bytes)), step())[1]
    outs = llm.generate([[5] * 8, [6] * 8], sp)
    llm.engine.step = step
    assert max(n for n, _ in seen) == 1 and max(b for _, b in seen) <= per_token * 20
    assert [len(o.token_ids) for o in outs] == [8, 8]
    alone = llm.generate([[6] * 8], sp)[0]
    assert outs[1].token_ids == alone.token_ids


def cli(*args, env_cache):
    import os

    env = dict(os.environ, MOESAIC_CACHE=str(env_cache))
    return subprocess.run(
        [sys.executable, "-m", "moesaic", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_prints_errors_without_traceback(tmp_path):
    path = write(tmp_path / "m", edit=lambda t: t.pop("model.norm.weight"))
    r = cli("generate", "--model", str(path), env_cache=tmp_path / "cache")
    assert r.returncode != 0
    assert "model.norm.weight" in r.stderr and "Traceback" not in r.stderr
    r = cli("inspect", str(tmp_path / "nowhere"), env_cache=tmp_path / "cache")
    assert r.returncode != 0 and "no such checkpoint folder" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("model, banner", [(None, "trained demo"), ("demo-mistral4", "RANDOM weights")])
def test_cli_generate_demo_streams_and_reports_rate(tmp_path, model, banner):
    """The default demo (trained, shipped in the package: nothing is written) and a random one (written to the
    cache on first use), each saying what it is."""
    args = ["generate", "--max-tokens", "6", "--prompt", "hi"] + (["--model", model] if model else [])
    r = cli(*args, env_cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert banner in r.stderr and "tokens/s" in r.stderr and "6 tokens (length)" in r.stderr
    assert (tmp_path / "cache").exists() == (model is not None)


def test_inspect_json_on_config_only_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.Mistral4Config().save_pretrained(tmp_path)  # the class defaults = the released Small 4 shape
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
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
    first = llm.generate([[1, 5, 6]], moesaic.SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    assert int(logits[-1].argmax()) == first
    with pytest.raises(RequestError):
        llm.score([])
    with pytest.raises(RequestError):
        llm.score([1, 99999])


def test_checkpoint_tokenizer_and_chat_flag(tmp_path):
    from test_sampler_tokenizer import write_hf_tokenizer

    path = write(tmp_path / "m", dict(SMALL, moesaic_tokenizer=None))
    write_hf_tokenizer(path)
    llm = moesaic.LLM(str(path), dtype="float32")
    out = llm.generate(
        ["hello world"], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )[0]
    assert out.prompt_token_ids == [0, 3, 4] and len(out.token_ids) == 4
    r = cli(
        "generate",
        "--model",
        str(path),
        "--prompt",
        "hello",
        "--chat",
        "--max-tokens",
        "3",
        env_cache=tmp_path / "c",
    )
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stderr


def test_stream_yields_every_token_even_when_generate_runs_meanwhile(tmp_path):
    llm = moesaic.LLM(str(write(tmp_path)), dtype="float32")
    sp = moesaic.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = llm.generate(["abc"], sp)[0].token_ids
    it = llm.stream("abc", sp)
    got = [next(it)]
    llm.generate(
        ["xyz"], moesaic.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )  # steps "abc" too
    got += list(it)
    assert got == want and it.finish_reason == "length"


def test_request_values_are_checked_before_any_work(tmp_path):
    llm = moesaic.LLM(str(write(tmp_path)), dtype="float32")
    for bad in (
        dict(temperature="0.5"),
        dict(stop_token_ids=None),
        dict(top_k=1.5),
        dict(max_tokens=True),
        dict(top_p=float("nan")),
        dict(seed="7"),
        dict(stop_token_ids=[1, "2"]),
    ):
        with pytest.raises(RequestError):
            llm.generate(["abc"], moesaic.SamplingParams(**bad))
    with pytest.raises(RequestError, match="SamplingParams"):
        llm.generate(["a", "b", "c"], [moesaic.SamplingParams()])
    assert not llm.engine.has_work()
    # a temperature too small to sample from is greedy
    tiny = llm.generate(["abc"], moesaic.SamplingParams(max_tokens=4, temperature=1e-45, ignore_eos=True))[0]
    greedy = llm.generate(["abc"], moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert tiny.token_ids == greedy.token_ids


def test_planner_counts_at_most_the_context(tmp_path):
    path = write(tmp_path)
    per_token, _ = mistral4.state_bytes(mistral4.parse_config(SMALL), 4)
    llm = moesaic.LLM(
        str(path), dtype="float32", max_state_bytes=per_token * SMALL["max_position_embeddings"]
    )
    out = llm.generate([[5, 6]], moesaic.SamplingParams(max_tokens=10**9, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "length" and len(out.token_ids) == SMALL["max_position_embeddings"] - 2


def test_rollback_is_all_or_nothing():
    from moesaic.cache.state import RecurrentState, SequenceState, TokenRows

    class Value:
        def __init__(self, v):
            self.v = v
            self.nbytes = 8

        def clone(self):
            return Value(self.v)

    rows = TokenRows({"k": 2}, torch.float32, "cpu", 100)
    rec = RecurrentState(Value(0), window=1)
    st = SequenceState([rows, rec])
    for t in range(1, 6):
        rows.append(k=torch.full((1, 2), float(t)))
        rec.advance(Value(t), [Value(t)], 1)
        st.num_tokens += 1
    with pytest.raises(ValueError, match="speculative window"):
        st.rollback(2)
    assert rows.length == 5 and rec.value.v == 5 and st.num_tokens == 5
    st.rollback(1)
    assert rows.length == 4 and rec.value.v == 4 and st.num_tokens == 4


def test_broken_safetensors_files(tmp_path):
    import struct

    good = write(tmp_path / "g")
    raw = (good / "model.safetensors").read_bytes()
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text((good / "config.json").read_text())
    (tmp_path / "t" / "model.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint.open(tmp_path / "t")
    # the same tensor in two shards
    (tmp_path / "t" / "model.safetensors").write_bytes(raw)
    (tmp_path / "t" / "extra.safetensors").write_bytes(raw)
    with pytest.raises(CheckpointError, match="in both"):
        Checkpoint.open(tmp_path / "t")
    (tmp_path / "t" / "extra.safetensors").unlink()
    # a header that is JSON but not an object
    header = b"[1, 2]   "
    (tmp_path / "t" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="not a JSON object"):
        Checkpoint.open(tmp_path / "t")
    # a config.json that is not text
    (tmp_path / "t" / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Checkpoint.open(tmp_path / "t")


def test_wrong_dtype_of_a_dense_tensor(tmp_path):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int64)
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].to(
            torch.float8_e5m2
        )

    msg = open_err(write(tmp_path, edit=edit), CheckpointError)
    assert "wrong dtype: model.norm.weight is I64" in msg
    assert "model.layers.0.self_attn.o_proj" in msg


def test_chat_flag_needs_a_template(tmp_path):
    from test_sampler_tokenizer import write_hf_tokenizer

    path = write(tmp_path / "m", dict(SMALL, moesaic_tokenizer=None))
    write_hf_tokenizer(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = cli(
        "generate",
        "--model",
        str(path),
        "--prompt",
        "hello",
        "--chat",
        "--max-tokens",
        "2",
        env_cache=tmp_path / "c",
    )
    assert r.returncode != 0 and "chat template" in r.stderr and "Traceback" not in r.stderr
    r = cli(
        "generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "2", env_cache=tmp_path / "c"
    )
    assert r.returncode == 0, r.stderr


def test_bad_device_and_precision_roles_are_config_errors(tmp_path):
    path = str(write(tmp_path / "m"))
    with pytest.raises(ConfigError, match="not a device name"):
        moesaic.LLM(path, dtype="float32", device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            moesaic.LLM(path, dtype="float32", device="cuda")
        r = cli("generate", "--model", path, "--device", "cuda", env_cache=tmp_path / "c")
        assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(ConfigError, match="experts, rooter"):
        moesaic.LLM(path, dtype="float32", precision="experts=fp8,rooter=bf16")
    r = cli("inspect", path, "--precision", "rooter=bf16", env_cache=tmp_path / "c")
    assert r.returncode == 2 and "rooter" in r.stderr
    assert moesaic.LLM(path, dtype="float32", precision="router=bf16,*=inherit").model is not None


def test_serve_moves_the_loaded_model_out_of_the_gc(monkeypatch):
    """`moesaic serve` freezes what is alive once the model is loaded (gc.freeze), so the cyclic GC's full
    collections no longer walk the model's and engine's objects (a ~60 ms stall on a benchmark model)."""
    import gc

    from moesaic import cli
    from moesaic.server import main as server_main

    seen = {}

    def fake_serve(llm, **kw):  # instead of uvicorn: what the server would have been handed
        seen["frozen"] = gc.get_freeze_count()
        return 0

    monkeypatch.setattr(server_main, "serve", fake_serve)
    gc.unfreeze()
    try:
        assert cli.main(["serve", "demo-mistral4", "--dtype", "float32", "--port", "0"]) == 0
        assert seen["frozen"] > 0
    finally:
        gc.unfreeze()

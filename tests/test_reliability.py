"""Hostile inputs, by class (issue 13): safetensors headers, checkpoint folders, config field types,
non-finite weights and scales, oversized configs, precision rules, tokenizer files and the CLI. Where
the input space is wide the test is a property (hypothesis) over it; each class also has the
reproducers of the issue as plain cases. Every user-caused failure must be a MoesaicError that names
what was wrong; nothing may escape as a raw Python exception, hang, or load silently wrong."""

from __future__ import annotations

import copy
import json
import os
import re
import struct
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_errors_cli import SMALL, write

import moesaic
from moesaic import cli
from moesaic.demo import ensure_demo
from moesaic.errors import CheckpointError, ConfigError, MoesaicError, RequestError
from moesaic.inspect import inspect_checkpoint
from moesaic.models import Checkpoint, read_config
from moesaic.weights.contract import load_tensors
from moesaic.weights.dtypes import SAFETENSORS
from moesaic.weights.precision import PrecisionSchedule, takes
from moesaic.weights.store import WeightStore, save_safetensors

FAST = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The tiny Mistral-4 checkpoint of test_errors_cli (2 layers, 30 tensors)."""
    return write(tmp_path_factory.mktemp("small") / "m")


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- safetensors headers (items 5, 8)

ITEMSIZE = {code: t.itemsize for code, t in SAFETENSORS.items()}


def write_raw(path: Path, header, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@st.composite
def headers(draw):
    """A valid gapless header over a data section, then one mutation of the kinds a broken or hostile
    writer makes (or none)."""
    n = draw(st.integers(1, 4))
    header, offset = {}, 0
    for i in range(n):
        dtype = draw(st.sampled_from(sorted(SAFETENSORS)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = ITEMSIZE[dtype]
        for d in shape:
            size *= d
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if draw(st.booleans()):  # a twin of t0 (same dtype and shape): aliasing it keeps every size right
        size0 = header["t0"]["data_offsets"][1]
        header[f"t{n}"] = dict(header["t0"], data_offsets=[offset, offset + size0])
        offset += size0
    data = bytes(draw(st.binary(min_size=offset, max_size=offset)))
    name = draw(st.sampled_from(sorted(header)))
    entry = header[name]
    kind = draw(
        st.sampled_from(
            ["none", "alias", "reverse", "negative", "float", "bool", "beyond", "shape", "dtype", "key"]
            + ["entry", "metadata", "offsets_len", "shorter"]
        )
    )
    junk = draw(st.sampled_from([-1, 1.5, True, "2", None, [1], {"a": 1}, 2**70]))
    b, e = entry["data_offsets"]
    if kind == "alias":  # two tensors on the same bytes
        other = header[draw(st.sampled_from(sorted(header)))]
        entry["data_offsets"] = list(other["data_offsets"])
    elif kind == "reverse":
        entry["data_offsets"] = [e, b]
    elif kind == "negative":
        entry["data_offsets"] = [-b - 1, e]
    elif kind == "float":
        entry["data_offsets"] = [float(b), float(e)]
    elif kind == "bool":
        entry["data_offsets"] = [False, True]
    elif kind == "beyond":
        entry["data_offsets"] = [b, e + 8]
    elif kind == "shape":
        entry["shape"] = entry["shape"] + [junk] if draw(st.booleans()) else junk
    elif kind == "dtype":
        entry["dtype"] = draw(st.sampled_from([junk, "F7", "f32", "BF16 "]))
    elif kind == "key":
        del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif kind == "entry":
        header[name] = junk
    elif kind == "metadata":
        header["__metadata__"] = draw(st.sampled_from([junk, {"format": "pt"}, {"a": 1}, [], "x"]))
    elif kind == "offsets_len":
        entry["data_offsets"] = [b, e, e][: draw(st.sampled_from([0, 1, 3]))]
    elif kind == "shorter":
        data = data[: len(data) // 2]
    return header, data


def official_reads(path: Path) -> bool:
    """Whether the safetensors package (the format's reference reader) reads every tensor of the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        return True
    except Exception:
        return False


@FAST
@given(headers())
def test_safetensors_headers_are_read_exactly_or_refused_like_the_reference_reader(tmp_path_factory, case):
    header, data = case
    folder = tmp_path_factory.mktemp("h")
    (folder / "config.json").write_text("{}")
    write_raw(folder / "model.safetensors", header, data)
    try:
        store = WeightStore(folder)
    except CheckpointError:
        ours = False
    else:
        ours = True
        spans = []
        for name, info in store.infos.items():
            t = store.get(name)
            assert tuple(t.shape) == info.shape and t.dtype == SAFETENSORS[info.dtype]
            raw = (folder / "model.safetensors").read_bytes()[info.start : info.end]
            assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == raw
            if info.end > info.start:
                spans.append((info.start, info.end))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two tensors share bytes"
    # the files the generator makes have no gaps, so the reference reader's verdict is the one to match
    assert ours == official_reads(folder / "model.safetensors")


def test_header_messages_agree_with_their_numbers(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    def err(offsets, dtype="F32", shape=(2,), data=b"\0" * 16):
        write_raw(
            tmp_path / "model.safetensors",
            {"a": {"dtype": dtype, "shape": list(shape), "data_offsets": offsets}},
            data,
        )
        with pytest.raises(CheckpointError) as e:
            WeightStore(tmp_path)
        return str(e.value)

    assert "data_offsets [8, 0] end before they begin" in err([8, 0])
    assert "data_offsets [-8, 0] are not two non-negative integers" in err([-8, 0])
    msg = err([0, 12])
    assert "F32[2] (8 bytes)" in msg and "[0, 12] hold 12 bytes" in msg
    assert "truncated" in err([0, 8], data=b"\0" * 4)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="header says it is 1000000 bytes but the file ends after 2"):
        WeightStore(tmp_path)
    # two tensors sharing bytes: refused, naming both
    write_raw(
        tmp_path / "model.safetensors",
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        b"\0" * 8,
    )
    with pytest.raises(CheckpointError, match="'a' and 'b' share bytes"):
        WeightStore(tmp_path)


def test_overlapping_offsets_in_a_real_checkpoint_are_refused_by_load_and_inspect(small, tmp_path):
    path = copy_of(small, tmp_path / "m")
    f = path / "model.safetensors"
    n = struct.unpack("<Q", f.read_bytes()[:8])[0]
    header = json.loads(f.read_bytes()[8 : 8 + n])
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]  # same shape and dtype: only the aliasing is wrong
    write_raw(f, header, f.read_bytes()[8 + n :])
    with pytest.raises(CheckpointError, match="share bytes"):
        Checkpoint.open(path)
    with pytest.raises(CheckpointError, match="share bytes"):
        inspect_checkpoint(path)


# ---------------------------------------------------------------- checkpoint folders (items 5, 11)


def broken_folder(tmp_path: Path, small: Path, case: str) -> Path:
    path = copy_of(small, tmp_path / case)
    shard = path / "model.safetensors"
    if case.startswith("config"):
        (path / "config.json").unlink()
    if case.startswith("shard"):
        shard.unlink()
    kind = case.split("-", 1)[1]
    target = path / ("config.json" if case.startswith("config") else "model.safetensors")
    if kind == "dir":
        target.mkdir()
    elif kind == "dangling":
        target.symlink_to(path / "nowhere")
    elif kind == "loop":
        target.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "devzero":
        target.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize(
    "case,kind,words",
    [
        ("config-dir", ConfigError, "is a folder"),
        ("config-dangling", ConfigError, "broken symlink"),
        ("config-loop", ConfigError, "symlink loop"),
        ("config-fifo", ConfigError, "not a regular file"),  # opening it would block forever
        ("config-devzero", ConfigError, "not a regular file"),  # reading it would never end
        ("shard-dir", CheckpointError, "is a folder"),
        ("shard-dangling", CheckpointError, "broken symlink"),
        ("shard-loop", CheckpointError, "symlink loop"),
        ("shard-fifo", CheckpointError, "not a regular file"),
    ],
)
def test_config_or_shard_that_is_not_a_file(small, tmp_path, case, kind, words):
    path = broken_folder(tmp_path, small, case)
    with pytest.raises(kind, match=words):
        Checkpoint.open(path).build("float32")


@pytest.mark.parametrize(
    "weight_map,words",
    [
        ([["model.norm.weight", "model.safetensors"]], "must be a non-empty object"),
        ({}, "must be a non-empty object"),
        ({"model.norm.weight": 5}, "is not a shard file name"),
        ({"model.norm.weight": "../m/model.safetensors"}, "is not a shard file name"),
        ({"model.norm.weight": "/etc/passwd"}, "is not a shard file name"),
        ({"model.norm.weight": "gone.safetensors"}, "absent"),
    ],
)
def test_bad_index_weight_map(small, tmp_path, weight_map, words):
    path = copy_of(small, tmp_path / "m")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=words):
        Checkpoint.open(path)


def test_a_folder_without_weights_says_so_once(small, tmp_path):
    path = copy_of(small, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        moesaic.LLM(str(path))
    assert "no *.safetensors here" in str(e.value) and "missing:" not in str(e.value)
    assert len(str(e.value)) < 300
    # inspect still describes the config alone
    assert inspect_checkpoint(path)["contract"] == "not checked (tensor files absent)"


def test_an_empty_path_never_opens_the_current_directory(small, monkeypatch, capsys):
    monkeypatch.chdir(small)  # a valid checkpoint is right here: it must not be picked up
    with pytest.raises(CheckpointError, match="empty path"):
        inspect_checkpoint("")
    with pytest.raises(CheckpointError, match="empty path"):
        WeightStore("")
    for cmd in (["inspect", ""], ["generate", "--model", "", "--max-tokens", "1"]):
        assert cli.main(cmd) == 2 and "empty path" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["", " ", "\t\n"])  # (Path("") is Path("."): a folder named on purpose)
def test_llm_of_an_empty_path_is_refused(small, monkeypatch, model):
    monkeypatch.chdir(small)  # a valid checkpoint is right here: it must not be picked up
    with pytest.raises(CheckpointError, match="empty path"):
        moesaic.LLM(model)


# ---------------------------------------------------------------- config field types (item 5)

# One demo config of each family (and both Mistral layouts), their fields replaced by values of every
# JSON kind and the extremes of each.
CONFIGS = [
    "demo-mistral4",
    "demo-mistral4-nvfp4",
    "demo-nemotron-h",
    "demo-kimi-k3",
    "demo-glm5-next-nvfp4",
    "demo-deepseek-v4",
    "demo-kimi-linear",
    "demo-deepseek-v41",
]
EXTREMES = ["abc", "", [], [1], ["x"], {}, {"a": 1}, True, False, -1, 0, 1.5, -0.5, float("nan")]
EXTREMES += [float("inf"), -float("inf"), 2**31, 2**63, 10**30, 1e308]
HOSTILE = st.one_of(
    st.sampled_from(EXTREMES).map(copy.deepcopy),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)


@cache
def _config_text(demo: str) -> tuple[str, str]:
    p = ensure_demo(demo)
    layout = "hf" if (p / "config.json").exists() else "mistral"
    return (p / ("config.json" if layout == "hf" else "params.json")).read_text(), layout


def _raw(demo: str) -> tuple[dict, str]:
    text, layout = _config_text(demo)
    return json.loads(text), layout


@st.composite
def edited_configs(draw):
    demo = draw(st.sampled_from(CONFIGS))
    raw, layout = _raw(demo)
    paths = [(k,) for k in raw] + [(k, k2) for k in raw if isinstance(raw[k], dict) for k2 in raw[k]]
    path = draw(st.sampled_from(paths))
    value = draw(HOSTILE)
    target = raw
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return demo, layout, raw


def _contract_of(raw: dict, layout: str):
    from types import SimpleNamespace

    from moesaic.models import num_layers
    from moesaic.weights.contract import check_scale

    family, _, cfg = read_config(SimpleNamespace(config=raw, layout=layout, folder=Path("x")))
    check_scale(num_layers(family, cfg), 0)
    family.layer_schedule(cfg)
    family.state_bytes(cfg, 2)
    family.max_context(cfg)
    return family.tensor_specs(cfg)


@settings(FAST, max_examples=300)
@given(edited_configs())
def test_any_config_field_of_any_kind_parses_or_is_a_config_error(case):
    demo, layout, raw = case
    try:
        specs = _contract_of(raw, layout)
    except MoesaicError:
        return
    assert all(all(isinstance(d, int) for d in s.shape) for s in specs)


@pytest.mark.parametrize(
    "edit,words",
    [
        (dict(eos_token_id="abc"), "eos_token_id"),
        (dict(eos_token_id={}), "eos_token_id"),
        (dict(eos_token_id=2**64), "eos_token_id"),
        (dict(model_type=["mistral4"]), "model_type"),
        (dict(rope_parameters=[1]), "rope_parameters"),
        (dict(quantization_config="fp8"), "quantization_config"),
        (
            dict(quantization_config={"quant_method": "compressed-tensors", "config_groups": [1]}),
            "config_groups",
        ),
        (dict(quantization_config={"config_groups": {"g": {"targets": "Linear"}}}), "targets"),
        (dict(quantization_config={"ignore": "lm_head"}), "ignore"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": float("inf")}), "factor"),
        (dict(num_hidden_layers=2**64), "num_hidden_layers"),
        (dict(quantization_config={"quant_method": 5}), "quant_method"),
    ],
)
def test_issue_config_cases_are_config_errors(small, tmp_path, edit, words):
    path = copy_of(small, tmp_path / "m")
    (path / "config.json").write_text(json.dumps(dict(SMALL, **edit)))
    with pytest.raises(ConfigError, match=words):
        Checkpoint.open(path).build("float32")


def _text_config(demo: str) -> tuple[dict, dict]:
    """(the whole config, the dict that holds the text model's fields) of a demo's config.json."""
    raw, _ = _raw(demo)
    return raw, raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


@pytest.mark.parametrize(
    "demo", ["demo-kimi-linear", "demo-kimi-k3", "demo-deepseek-v4", "demo-deepseek-v41"]
)
@pytest.mark.parametrize("layers", [10**15, 2**62, 10_001])
def test_layer_counts_are_bounded_before_per_layer_lists_are_built(demo, layers):
    # these parsers build a kind per layer: 10**15 layers hung (Kimi) or ran out of memory (DeepSeek)
    raw, text = _text_config(demo)
    text["num_hidden_layers"] = layers
    with pytest.raises(
        ConfigError, match=r"'num_hidden_layers' has invalid value \d+ \(must be in 1\.\.10000\)"
    ):
        _contract_of(raw, "hf")


@pytest.mark.parametrize("demo", ["demo-kimi-linear", "demo-kimi-k3"])
@pytest.mark.parametrize(
    "edit,words",
    [
        (dict(linear_attn_config=[1]), "'linear_attn_config' must be an object"),
        (dict(linear_attn_config="kda"), "'linear_attn_config' must be an object"),
        (dict(linear_attn_config={"kda_layers": [[1]]}), "'kda_layers' must be a list of integers"),
        (dict(linear_attn_config={"kda_layers": "1,2"}), "'kda_layers' must be a list of integers"),
        (
            dict(linear_attn_config={"full_attn_layers": [True]}),
            "'full_attn_layers' must be a list of integers",
        ),
        (
            dict(linear_attn_config={"full_attn_layers": [2**64]}),
            "'full_attn_layers' must be a list of integers",
        ),
        (dict(layer_types=[["linear_attention"]]), "'layer_types' must list"),
    ],
)
def test_kimi_layer_lists_of_the_wrong_kind_name_the_field(demo, edit, words):
    raw, text = _text_config(demo)
    for k, v in edit.items():
        if isinstance(v, dict) and isinstance(text.get(k), dict):
            v = {**text[k], **v}
        if k == "layer_types":  # one entry per layer: the entries' kind is at fault, not the count
            v = v * text["num_hidden_layers"]
        text[k] = v
    with pytest.raises(ConfigError, match=words):
        _contract_of(raw, "hf")


@pytest.mark.parametrize(
    "field,value",
    [
        ("engram_max_ngram_size", 2**62),
        ("engram_max_ngram_size", 17),
        ("engram_max_ngram_size", 1),
        ("engram_n_heads", 10**30),
        ("engram_n_heads", 10**15),
        ("engram_n_heads", 65),
        ("engram_head_dim", 2**40),
        ("engram_vocab_size", 2**62),
        ("engram_vocab_size", [16, 2**41, 16]),
        ("engram_vocab_size", [[64]]),
        ("engram_vocab_size", "64"),
        ("engram_layer_ids", {}),
        ("engram_layer_ids", [True]),
        ("engram_num_embeddings", [462, "630"]),
        ("engram_num_embeddings", 2**64),
        ("engram_pad_id", 2**62),
    ],
)
def test_engram_sizes_are_bounded_and_name_the_field(field, value):
    # the sizes drive a prime search and per-token gathers: unbounded, 2**62 ran out of memory and
    # 10**15 heads searched primes without end
    raw, text = _text_config("demo-deepseek-v41")
    text[field] = value
    with pytest.raises(ConfigError, match=f"'{field}'"):
        _contract_of(raw, "hf")


def test_engram_tables_past_the_bound_on_primes_are_refused_naming_the_heads():
    raw, text = _text_config("demo-deepseek-v41")
    text.update(engram_max_ngram_size=16, engram_n_heads=64)  # 2 layers x 15 sizes x 64 heads = 1920
    with pytest.raises(ConfigError, match="'engram_num_embeddings'"):  # within the bound: the rows decide
        _contract_of(raw, "hf")
    text.update(engram_layer_ids=[1, 2, 4], engram_num_embeddings=[1] * 3)  # 2880
    with pytest.raises(ConfigError, match="'engram_num_embeddings'.*primes"):
        _contract_of(raw, "hf")
    text.update(engram_layer_ids=[1, 2, 3, 4, 5], engram_num_embeddings=[1] * 5)  # 4800 > 4096
    with pytest.raises(ConfigError, match="'engram_n_heads'.*4800 tables, more than 4096"):
        _contract_of(raw, "hf")


@pytest.mark.parametrize("demo", ["demo-kimi-k3", "demo-deepseek-v4"])
@pytest.mark.parametrize("eos", ["7", True, [1, "2"], [1, None], {}, -1, 2**64, 1.5])
def test_eos_token_ids_of_the_wrong_kind_name_the_field(demo, eos):
    raw, _ = _text_config(demo)
    raw["eos_token_id"] = eos  # K3 reads it at the top level of its wrapped config
    with pytest.raises(ConfigError, match="'eos_token_id'"):
        _contract_of(raw, "hf")


@pytest.mark.parametrize(
    "edit,words",
    [
        (dict(compress_rates=[4, 128]), "'compress_rates' must be an object"),
        (dict(compress_rates="4"), "'compress_rates' must be an object"),
        (
            dict(compress_rates={"compressed_sparse_attention": "4"}),
            "'compressed_sparse_attention' must be int",
        ),
        (
            dict(compress_rates={"heavily_compressed_attention": 1.5}),
            "'heavily_compressed_attention' must be int",
        ),
        (
            dict(compress_rates={"heavily_compressed_attention": 0}),
            "'heavily_compressed_attention' has invalid",
        ),
        (dict(compress_rate_csa="x"), "'compressed_sparse_attention' must be int"),
        (dict(compress_ratios=[[4]] * 8), "'compress_ratios' must list"),
        (dict(layer_types=[["sliding_attention"]] * 8), "'layer_types' must list"),
    ],
)
def test_deepseek_v4_compression_fields_name_the_field(edit, words):
    raw, _ = _text_config("demo-deepseek-v4")
    raw.pop("layer_types", None) if "compress_ratios" in edit else None
    raw.update(edit)
    with pytest.raises(ConfigError, match=words):
        _contract_of(raw, "hf")


QC_CT = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}


def _ct(**weights) -> dict:
    w = {"num_bits": 4, "group_size": 32, "type": "float", "strategy": "group", **weights}
    return dict(QC_CT, config_groups={"group_0": {"targets": ["Linear"], "weights": w}})


@pytest.mark.parametrize(
    "qc,words",
    [
        (_ct(group_size="32"), r"config_groups\['group_0'\]\.weights\.'group_size' must be an integer"),
        (_ct(group_size=32.0), "'group_size' must be an integer"),
        (_ct(num_bits=8.0), "'num_bits' must be an integer"),
        (_ct(num_bits="4"), "'num_bits' must be an integer"),
        (_ct(type=4), "'type' must be a name"),
        (_ct(strategy=["group"]), "'strategy' must be a name"),
        (_ct(block_structure="128x128"), "'block_structure' must be a list of integers"),
        (_ct(block_structure=[128, "128"]), "'block_structure' must be a list of integers"),
        (
            dict(QC_CT, config_groups={"g": {"targets": ["Linear"], "weights": [4]}}),
            "weights must be an object",
        ),
        (dict(QC_CT, config_groups={"g": {"targets": ["Linear"], "format": 4}}), "'format' must be a name"),
        (dict(QC_CT, config_groups=[1]), "'config_groups' must be an object"),
        (
            {"quant_method": "fp8", "weight_block_size": "128"},
            "'weight_block_size' must be a list of integers",
        ),
        ({"quant_method": "fp8", "weight_block_size": [128.0, 128]}, "'weight_block_size' must be"),
        ({"quant_algo": "NVFP4", "group_size": "16"}, "'group_size' must be an integer"),
        ({"quantization": {"quant_algo": "NVFP4", "group_size": [16]}}, r"\.quantization: 'group_size'"),
        ({"quant_method": "modelopt", "quantized_layers": {"x": {"quant_algo": 4}}}, "'quant_algo' must be"),
    ],
)
def test_quantization_config_values_of_the_wrong_type_name_the_key(small, tmp_path, qc, words):
    from moesaic.weights.quant import resolve_format

    # through the reader directly (a packed weight, so it reads the config) ...
    with pytest.raises(ConfigError, match=words):
        resolve_format(qc, {"x.weight_packed": "U8", "x.weight_scale": "U8"}, "x")
    # ... and through a checkpoint's config.json
    path = copy_of(small, tmp_path / "m")
    (path / "config.json").write_text(json.dumps(dict(SMALL, quantization_config=qc)))
    with pytest.raises(ConfigError, match=f"quantization_config.*{words}"):
        Checkpoint.open(path).build("float32")


@pytest.mark.parametrize(
    "qc,words",
    [
        ("mxfp4", "'quantization_config' must be an object"),
        ([1], "'quantization_config' must be an object"),
        (
            dict(QC_CT, config_groups={"g": {"weights": {"group_size": "32"}}}),
            "'group_size' must be an integer",
        ),
        (dict(QC_CT, config_groups={"g": {"weights": {"group_size": -32}}}), "group_size"),
        (dict(QC_CT, config_groups={"g": 5}), r"config_groups\['g'\] must be an object"),
    ],
)
def test_kimi_k3_quantization_config_names_the_key(qc, words):
    raw, _ = _text_config("demo-kimi-k3")
    raw["quantization_config"] = qc
    with pytest.raises(ConfigError, match=words):
        _contract_of(raw, "hf")


@pytest.mark.parametrize("field", ["moe", "yarn", "llama_4_scaling"])
@pytest.mark.parametrize("value", [[1], "x", 3])
def test_params_json_sections_must_be_objects(field, value, tmp_path):
    raw, layout = _raw("demo-mistral4-nvfp4")
    assert layout == "mistral"
    with pytest.raises(ConfigError, match=field):
        _contract_of(dict(raw, **{field: value}), layout)


def test_binary_and_nested_json_configs(small, tmp_path):
    path = copy_of(small, tmp_path / "m")
    duplicate = json.dumps(SMALL)[:-1].encode() + b', "hidden_size": 40}'  # which one is meant?
    for content in (b"\x89PNG\r\n\x1a\n\0\0", b"[" * 100_000 + b"]" * 100_000, b"[1, 2]", b"", duplicate):
        (path / "config.json").write_bytes(content)
        with pytest.raises(ConfigError, match="config.json"):
            Checkpoint.open(path)


# ---------------------------------------------------------------- NaN / Inf (item 6)


def rewrite(folder: Path, pick, edit) -> str:
    """Rewrites the shard holding the first tensor (by its name in the file) for which `pick(name, info)`
    holds, with `edit(tensor)` in its place. Returns that name."""
    store = WeightStore(folder)
    infos = {i.name: i for i in store.infos.values()}
    name = next(n for n, i in sorted(infos.items()) if pick(n, i))
    file = infos[name].file
    by_file = {n: k for k, i in store.infos.items() if i.file == file for n in [i.name]}
    tensors = {n: store.get(k).clone() for n, k in by_file.items()}
    tensors[name] = edit(tensors[name])
    store.close()
    save_safetensors(tensors, file)
    return name


def set_byte(value: int):
    def edit(t):
        t.view(torch.uint8).view(-1)[1] = value
        return t

    return edit


def set_float(value: float):
    def edit(t):
        t.view(-1)[-1] = value
        return t

    return edit


@pytest.mark.parametrize(
    "demo,pick,edit,words",
    [
        ("demo-mistral4", lambda n, i: n.endswith("o_proj.weight"), set_float(float("nan")), "holds nan"),
        ("demo-mistral4", lambda n, i: n.endswith("layernorm.weight"), set_float(float("inf")), "holds inf"),
        ("demo-mistral4", lambda n, i: n.endswith("down_proj.weight"), set_float(1e5), "overflow"),  # in fp16
        (
            "demo-mistral4-nvfp4",
            lambda n, i: n.endswith("weight_global_scale"),
            set_float(float("nan")),
            "global scale.* is 0, NaN",
        ),
        ("demo-mistral4-nvfp4", lambda n, i: n.endswith("weight_global_scale"), set_float(0.0), "is 0, NaN"),
        ("demo-mistral4-nvfp4", lambda n, i: n.endswith("weight_scale"), set_byte(0x7F), "NaN E4M3 scale"),
        ("demo-kimi-k3-mxfp4", lambda n, i: n.endswith("weight_scale"), set_byte(0xFF), "E8M0 0xFF"),
        (
            "demo-deepseek-v4",
            lambda n, i: n.endswith(".scale") and i.dtype == "F32",
            set_float(float("nan")),
            "NaN or Inf scale",
        ),
        ("demo-deepseek-v4", lambda n, i: i.dtype == "F8_E4M3", set_byte(0xFF), "NaN FP8 code"),
        (
            "demo-deepseek-v41",
            lambda n, i: n.endswith(".scale") and i.dtype == "F8_E8M0",
            set_byte(0xFF),
            "0xFF",
        ),
    ],
)
def test_non_finite_weights_and_scales_are_refused_at_load_naming_the_tensor(
    demo, pick, edit, words, tmp_path
):
    path = copy_of(ensure_demo(demo), tmp_path / "m")
    name = rewrite(path, pick, edit)
    dtype = "float16" if words == "overflow" else "bfloat16"
    with pytest.raises(CheckpointError, match=words) as e:
        moesaic.LLM(str(path), dtype=dtype)
    assert name.rsplit(".", 1)[0] in str(e.value)
    # the same folder without the edit loads (the check refuses only what is broken)
    moesaic.LLM(demo, dtype=dtype)


# ---------------------------------------------------------------- oversized configs (item 7)


@pytest.mark.parametrize("layers", [20_000, 10**6, 10**15])
def test_a_config_far_larger_than_its_checkpoint_is_refused_at_once(small, tmp_path, layers):
    path = copy_of(small, tmp_path / "m")
    (path / "config.json").write_text(json.dumps(dict(SMALL, num_hidden_layers=layers)))
    with pytest.raises(CheckpointError, match=f"{layers} layers but the checkpoint holds only 30") as e:
        moesaic.LLM(str(path))
    assert len(str(e.value)) < 300
    with pytest.raises(CheckpointError, match="does not belong"):
        inspect_checkpoint(path)
    # config alone: nothing to compare with, so a count no model comes near is refused
    (path / "model.safetensors").unlink()
    if layers > 10_000:
        with pytest.raises(ConfigError, match="layers"):
            inspect_checkpoint(path)


def test_many_experts_in_a_per_expert_layout_are_refused_before_listing_them(tmp_path):
    # the native layout stores one tensor per expert: a million experts would be 3 million names
    path = copy_of(ensure_demo("demo-mistral4-nvfp4"), tmp_path / "m")
    params = json.loads((path / "params.json").read_text())
    params["moe"]["num_experts"] = 10**6
    (path / "params.json").write_text(json.dumps(params))
    with pytest.raises(CheckpointError, match="does not belong to these weights") as e:
        moesaic.LLM(str(path))
    assert len(str(e.value)) < 400


def test_every_list_in_a_load_error_is_capped(small, tmp_path):
    # every tensor of another width: all misshaped, the count exact, the list capped
    path = copy_of(small, tmp_path / "m")
    (path / "config.json").write_text(json.dumps(dict(SMALL, hidden_size=40)))
    with pytest.raises(CheckpointError) as e:
        moesaic.LLM(str(path))
    msg = str(e.value)
    count = int(re.search(r"\((\d+) problem\(s\)\)", msg)[1])
    lines = [line.strip() for line in msg.splitlines()[1:]]
    hidden = {m[2]: int(m[1]) for line in lines if (m := re.fullmatch(r"\.\.\. and (\d+) more (.+)", line))}
    shown = [line for line in lines if not line.startswith("...")]
    assert count > 20 and len(shown) + sum(hidden.values()) == count
    assert "misshaped" in hidden and sum(line.startswith("misshaped") for line in shown) == 20


# ---------------------------------------------------------------- precision schedule (items 3, 12)

MIXED = [
    ("bfloat16", "*=fp32"),
    ("bfloat16", "*=fp16"),
    ("bfloat16", "attention=fp32"),
    ("float32", "*=fp16"),
]


@pytest.mark.parametrize(
    "demo", ["demo-mistral4", "demo-nemotron-h-nvfp4", "demo-kimi-linear", "demo-deepseek-v4"]
)
@pytest.mark.parametrize("dtype,rule", MIXED)
def test_mixed_precision_rules_load_the_dtypes_they_say_and_generate(demo, dtype, rule):
    # MLA, Mamba-2 + NoPE GQA, KDA, CSA/HCA + mHC: every kind of tensor use outside `linear`
    ck = Checkpoint.open(ensure_demo(demo))
    schedule = PrecisionSchedule.parse(rule)
    dt = getattr(torch, dtype)
    tensors = load_tensors(ck.plan(), ck.store, dt, "cpu", schedule)
    want = {"fp32": torch.float32, "fp16": torch.float16}[rule.split("=")[1]]
    changed = 0
    for name, spec in ck.plan().specs.items():
        t = tensors.get(name)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or spec.mapped:
            continue
        if spec.keep_fp32:
            assert t.dtype == torch.float32, name
        elif (
            takes(spec, schedule.dtype_for(spec.layer, spec.role))
            and schedule.dtype_for(spec.layer, spec.role) != "inherit"
        ):
            assert t.dtype == want, name
            changed += 1
        else:
            assert t.dtype == dt, name  # a norm, an embedding, a viewed matrix: the model dtype
    assert changed > 0
    llm = moesaic.LLM(demo, dtype=dtype, precision=rule)
    out = llm.generate(["hi"], moesaic.SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize(
    "rule,words",
    [
        ("router@5-2=bf16", "empty"),
        ("router@999=bf16", r"matches no tensor \(this model's router tensors are in layers 1\)"),
        ("*@7=fp32", "matches no tensor"),
        ("=fp32", "role is empty"),
        ("@3=fp32", "role is empty"),
        (" @0-1 = bf16", "role is empty"),
        ("norm=fp32", "norms, lookups, views"),
        ("embedding=fp16", "norms, lookups, views"),
        ("router=fp8", "fp8 packs only projection weights"),
        ("expert=fp8,expert=bf16", "name the same tensors"),
        ("router@1-1+1=bf16,router@1=fp32", "name the same tensors"),
        ("router@0-99999999999999999999=bf16", None),  # a huge range is no memory: it is fine
        ("router@-1=bf16", "not like 0-2\\+7"),
        ("router@1_0=bf16", "not like 0-2\\+7"),
        ("router@\u0661=bf16", "not like 0-2\\+7"),  # an Arabic-Indic one is a digit to int(), not here
        ("rou ter=bf16", "not a role name"),
    ],
)
def test_precision_rules_that_change_nothing_are_refused_showing_the_rule(small, rule, words):
    if words is None:
        moesaic.LLM(str(small), dtype="float32", precision=rule)
        return
    with pytest.raises(ConfigError, match=words) as e:
        moesaic.LLM(str(small), dtype="float32", precision=rule)
    assert repr(rule.split(",")[-1].strip()) in str(e.value)


def test_precision_must_be_text(small):
    for bad in (123, ["router=bf16"], {"router": "bf16"}):
        with pytest.raises(ConfigError, match="precision schedule is text"):
            PrecisionSchedule.parse(bad)
        with pytest.raises(ConfigError):
            moesaic.LLM(str(small), dtype="float32", precision=bad)


RULE_TEXT = st.lists(
    st.tuples(
        st.sampled_from(
            ["*", "router", "expert", "attention", "norm", "embedding", "mlp", "lm_head", "", "x y"]
        ),
        st.one_of(st.none(), st.lists(st.tuples(st.integers(-2, 1000), st.integers(-2, 1000)), max_size=3)),
        st.sampled_from(["inherit", "fp32", "bf16", "fp16", "fp8", "int8", ""]),
    ),
    max_size=4,
).map(
    lambda rules: ",".join(
        role
        + ("" if layers is None else "@" + "+".join(f"{a}-{b}" if a != b else str(a) for a, b in layers))
        + "="
        + dt
        for role, layers, dt in rules
    )
)


@FAST
@given(st.one_of(RULE_TEXT, st.text(max_size=30)))
def test_any_precision_text_is_a_schedule_that_changes_what_it_names_or_a_config_error(small, text):
    ck = Checkpoint.open(small)
    specs = list(ck.plan().specs.values())
    try:
        schedule = PrecisionSchedule.parse(text)
        schedule.check(specs)
    except ConfigError:
        return
    for rule in schedule.rules:
        hits = [s for s in specs if rule.matches(s.layer, s.role)]
        assert hits and any(takes(s, rule.dtype) for s in hits), rule
    for s in specs:
        got = schedule.resolve(s)
        assert got == "inherit" or takes(s, got)


# ---------------------------------------------------------------- tokenizer files (item 5)


@pytest.fixture
def with_tokenizer(small, tmp_path):
    from test_sampler_tokenizer import write_hf_tokenizer

    path = copy_of(small, tmp_path / "m")
    (path / "config.json").write_text(json.dumps(dict(SMALL, moesaic_tokenizer=None)))
    write_hf_tokenizer(path)
    return path


def _set_template(path: Path, template) -> None:
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(tc))


@pytest.mark.parametrize(
    "file,content,kind,words",
    [
        ("tokenizer.json", b"garbage", CheckpointError, "tokenizers package"),
        ("tokenizer.json", b'{"version": "1.0"}', CheckpointError, "tokenizers package"),
        ("tokenizer_config.json", b"garbage", ConfigError, "not valid JSON"),
        ("tokenizer_config.json", b"[1, 2]", ConfigError, "expected a JSON object"),
        ("tokenizer_config.json", b'{"bos_token": 5}', ConfigError, "bos_token"),
        ("tokenizer_config.json", b'{"add_bos_token": "yes"}', ConfigError, "add_bos_token"),
        ("tokenizer_config.json", b'{"chat_template": 5}', ConfigError, "chat_template"),
        (
            "tokenizer_config.json",
            b'{"chat_template": "{% for m in messages %}"}',
            ConfigError,
            "syntax error",
        ),
    ],
)
def test_broken_tokenizer_files_fail_at_load(with_tokenizer, file, content, kind, words):
    (with_tokenizer / file).write_bytes(content)
    with pytest.raises(kind, match=words):
        moesaic.LLM(str(with_tokenizer), dtype="float32")


@pytest.mark.parametrize(
    "template,words",
    [
        ("{{ messages[5]['content'] }}", "UndefinedError|failed"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError|failed"),
        ("{{ raise_exception('no system role') }}", "no system role"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError|unsafe"),  # the template is code
        ("{{ messages.pop() }}", "SecurityError|unsafe"),  # and may not change the request
        # what one render may build is bounded: loops, repetition, powers, widths
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "builds more"),
        ('{{ "x" * 10**9 }}', "builds more"),
        ("{{ 2 ** 100000 }}", "power"),
        ('{{ "x" | center(10**9) }}', "builds more"),
        ('{{ "{:>1000000000}".format(1) }}', "builds more"),
        ('{{ "%1000000000s" % 1 }}', "builds more"),
        ('{{ "%1000000000s" | format(1) }}', "builds more"),
        ('{{ "a\nb" | indent(10**8) }}', "builds more"),
    ],
)
def test_a_template_that_fails_on_a_request_is_that_requests_error(with_tokenizer, template, words):
    _set_template(with_tokenizer, template)
    llm = moesaic.LLM(str(with_tokenizer), dtype="float32")
    with pytest.raises(RequestError, match=words):
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])


def test_the_budget_leaves_ordinary_templates_alone(with_tokenizer):
    _set_template(
        with_tokenizer,
        "{% for m in messages %}{{ '%-6s|' % m['role'] }}{{ m['content'] | center(9) }}{{ '{:>3}'.format(loop.index) }}"
        "{% for i in range(3) %}{{ i }}{% endfor %}{{ '-' * 4 }}{{ 'a\nb' | indent(2) }}{% endfor %}",
    )
    llm = moesaic.LLM(str(with_tokenizer), dtype="float32")
    for _ in range(3):  # the budget is per render, not per template
        out = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}] * 50)
        one = "user".ljust(6) + "|" + "hi".center(9) + "1".rjust(3) + "012----a\n  b"
        assert out.startswith(one) and out.count("012----a\n  b") == 50


def test_named_templates_and_lone_surrogates(with_tokenizer):
    _set_template(
        with_tokenizer, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    )
    llm = moesaic.LLM(str(with_tokenizer), dtype="float32")
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "D"
    with pytest.raises(RequestError, match="lone surrogate"):
        llm.generate(["hello \udcff"], moesaic.SamplingParams(max_tokens=1))
    demo = moesaic.LLM("demo-mistral4", dtype="float32")
    with pytest.raises(RequestError, match="lone surrogate"):
        demo.generate(["\ud800"], moesaic.SamplingParams(max_tokens=1))


# ---------------------------------------------------------------- CLI (item 10)


def run_cli(args, env_cache) -> subprocess.CompletedProcess:
    env = dict(os.environ, MOESAIC_CACHE=str(env_cache))
    return subprocess.run([sys.executable, "-m", "moesaic", *args], capture_output=True, env=env, timeout=120)


def test_cli_output_into_a_closed_pipe_exits_quietly(tmp_path):
    env = dict(os.environ, MOESAIC_CACHE=str(tmp_path / "c"))
    p = subprocess.Popen(
        [sys.executable, "-m", "moesaic", "generate", "--max-tokens", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    p.stdout.read(1)  # `| head -c1`
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_cli_non_utf8_prompt_bytes(tmp_path):
    r = run_cli(["generate", "--max-tokens", "2", "--prompt", b"caf\xe9"], tmp_path / "c")
    assert r.returncode == 2 and b"lone surrogate" in r.stderr and b"Traceback" not in r.stderr


@pytest.mark.parametrize("cache", ["file", "file/sub", "/proc/moesaic-cache"])
def test_cli_demo_cache_that_cannot_be_written(tmp_path, monkeypatch, capsys, cache):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MOESAIC_CACHE", cache if cache.startswith("/") else str(tmp_path / cache))
    assert cli.main(["generate", "--model", "demo-mistral4", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "demo cache" in err and "MOESAIC_CACHE" in err


ARGS = st.lists(
    st.sampled_from(
        ["--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--dtype", "--precision"]
    ).flatmap(
        lambda flag: st.tuples(
            st.just(flag),
            st.sampled_from(["0", "-1", "1", "2", "nan", "inf", "-inf", "1e400", "99999999999999999999999"])
            | st.sampled_from(
                ["", "abc", "0x10", "1.5", "float32", "bf16", "int8", "router=bf16", "=", "\udcff"]
            ),
        )
    ),
    max_size=4,
)


@settings(FAST, max_examples=60)
@given(ARGS)
@example([("--seed", "99999999999999999999999"), ("--temperature", "1")])  # the issue's reproducers
@example([("--seed", "-1")])
@example([("--temperature", "nan")])
@example([("--max-tokens", "-1")])
@example([("--dtype", "int8")])
@example([("--precision", "\udcff")])
def test_any_generate_arguments_give_tokens_or_a_short_error(small, capsys, args):
    argv = ["generate", "--model", str(small)] + [x for pair in args for x in pair]
    if "--max-tokens" not in argv:
        argv += ["--max-tokens", "2"]
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse refusing an argument: its usage message, exit 2
        rc = e.code
        assert rc == 2
    out = capsys.readouterr()
    assert rc in (0, 2), out.err
    assert "Traceback" not in out.err
    if rc == 2:
        assert "error:" in out.err


@pytest.mark.parametrize("model", ["", "nowhere", "/dev/null", "demo-nonexistent"])
def test_cli_inspect_bad_models(tmp_path, capsys, model):
    assert cli.main(["inspect", model]) == 2
    assert "moesaic: error:" in capsys.readouterr().err


# ---------------------------------------------------------------- inspect agrees with load (item 11)


@pytest.mark.parametrize(
    "edit",
    [
        "size",  # a header whose shape does not fit its bytes
        "dtype",  # an int tensor where a float one belongs
        "missing",
        "nan",  # only the bytes show it: inspect cannot, load must
    ],
)
def test_inspect_says_ok_only_where_load_succeeds(small, tmp_path, edit):
    path = copy_of(small, tmp_path / "m")
    f = path / "model.safetensors"
    name = "model.layers.1.post_attention_layernorm.weight"
    if edit in ("size", "dtype"):
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        header = json.loads(f.read_bytes()[8 : 8 + n])
        if edit == "size":  # BF16 of the right shape, over F32's bytes: only the byte count is wrong
            header[name]["dtype"] = "BF16"
        else:
            header[name]["dtype"] = "I32"
        write_raw(f, header, f.read_bytes()[8 + n :])
    elif edit == "missing":
        store = WeightStore(path)
        tensors = {k: store.get(k).clone() for k in store.names() if k != name}
        store.close()
        save_safetensors(tensors, f)
    else:
        rewrite(path, lambda n, i: n == name, set_float(float("nan")))
    try:
        said_ok = inspect_checkpoint(path)["contract"] == "ok"
    except MoesaicError:
        said_ok = False
    with pytest.raises(MoesaicError):
        Checkpoint.open(path).build("float32")
    assert said_ok == (edit == "nan")
    assert inspect_checkpoint(small)["contract"] == "ok"
    assert Checkpoint.open(small).build("float32") is not None


# ---------------------------------------------------------------- API arguments (items 9, 11, 12)


@pytest.fixture(scope="module")
def small_llm(small):
    return moesaic.LLM(str(small), dtype="float32")


@pytest.mark.parametrize(
    "prompt,words",
    [
        ([True, 5], "bool"),  # one prompt of ids that starts with a bool
        ([[5, True]], "item 1 is bool"),
        ([[5, False]], "item 1 is bool"),
        ([[-1, 5]], r"\[-1\] are outside the vocabulary \(0\.\.272\)"),  # SMALL's vocab is 273
        ([[5, 273]], r"\[273\] are outside the vocabulary"),
        ([[2**70]], "outside the vocabulary"),
    ],
)
def test_bool_and_out_of_range_token_ids_are_refused(small_llm, prompt, words):
    sp = moesaic.SamplingParams(max_tokens=1)
    with pytest.raises(RequestError, match=words):
        small_llm.generate(prompt, sp)
    with pytest.raises(RequestError, match=words.replace("item 1 is ", "")):
        small_llm.score(prompt[0] if isinstance(prompt[0], list) else prompt)
    assert not small_llm.engine.has_work()


@pytest.mark.parametrize("ids", [[True, 5], [5, False], [5, 2.0], [5, "6"], [5, None]])
def test_the_engine_refuses_ids_that_are_not_integers(small_llm, ids):
    # the engine's own check (AsyncLLM, the server and direct callers do not go through LLM.encode)
    from moesaic.engine.sequence import Sequence

    with pytest.raises(RequestError, match="token ids must be integers"):
        small_llm.engine.add(Sequence(ids, moesaic.SamplingParams(max_tokens=1)))
    assert not small_llm.engine.has_work()


@pytest.mark.parametrize("prompts", [{"a": 1}, {"hi": "there"}, {}, {1, 2}, frozenset({"a"})])
def test_prompts_in_a_dict_or_set_are_refused_saying_what_is_accepted(small_llm, prompts):
    with pytest.raises(RequestError, match="not accepted") as e:
        small_llm.generate(prompts, moesaic.SamplingParams(max_tokens=1))
    assert type(prompts).__name__ in str(e.value) and "list of token ids" in str(e.value)


@pytest.mark.parametrize(
    "arg,words",
    [
        (None, "got NoneType"),
        (5, "got int"),
        ({"a": 1}, "got dict"),
        (b"hi", "got bytes"),
        (torch.zeros(2, 3, dtype=torch.long), "2-D"),
        (torch.tensor(3), "0-D"),
        (torch.tensor([1.0, 2.0]), "torch.float32"),
        (torch.tensor([True]), "torch.bool"),
        ([[1, 2], [3]], "a list of prompts"),
        (["hi", "there"], "a list of prompts"),
    ],
)
def test_score_says_what_it_takes(small_llm, arg, words):
    with pytest.raises(RequestError, match=words) as e:
        small_llm.score(arg)
    assert str(e.value).startswith("score takes one prompt")
    assert small_llm.score(range(3)).shape == (3, small_llm.cfg.vocab_size)
    assert torch.equal(small_llm.score(torch.tensor([1, 2])), small_llm.score([1, 2]))


def test_score_of_text_without_a_tokenizer_says_so(tmp_path):
    llm = moesaic.LLM(str(write(tmp_path / "m", dict(SMALL, moesaic_tokenizer=None))), dtype="float32")
    assert llm.tokenizer is None
    with pytest.raises(RequestError, match="score takes one prompt.*has no tokenizer for the text 'hi'"):
        llm.score("hi")
    assert llm.score([1, 2]).shape == (2, llm.cfg.vocab_size)


@pytest.mark.parametrize("bad", [object(), "greedy", 0.5, [1]])
def test_a_bad_entry_in_a_list_of_params_is_named_by_its_index(small_llm, bad):
    sp = moesaic.SamplingParams(max_tokens=1)
    with pytest.raises(RequestError, match=r"params\[1\] must be a SamplingParams"):
        small_llm.generate([[1], [2], [3]], [sp, bad, sp])
    with pytest.raises(RequestError, match=r"params\[0\]"):
        small_llm.generate([[1]], (bad,))
    # None is the default params, as for a single prompt
    outs = small_llm.generate([[1], [2]], [sp, None])
    assert len(outs[0].outputs[0].token_ids) == 1
    # the defaults sample (T = 1, no seed), so an end-of-sequence token may end it before max_tokens
    out, default = outs[1].outputs[0], moesaic.SamplingParams().max_tokens
    assert len(out.token_ids) == default or (out.finish_reason == "stop" and len(out.token_ids) < default)
    assert not small_llm.engine.has_work()


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**64 + 5, True, 1.0, "7"])
def test_seeds_outside_uint64_are_refused(small_llm, seed):
    # torch.Generator.manual_seed takes [-2**63, 2**64) and wraps negatives; vLLM's seeds are
    # None (random) or a non-negative int: moesaic takes 0 .. 2**64 - 1
    with pytest.raises(RequestError, match="seed"):
        small_llm.generate([[1]], moesaic.SamplingParams(max_tokens=1, temperature=1.0, seed=seed))
    for ok in (0, 2**64 - 1):
        small_llm.generate([[1]], moesaic.SamplingParams(max_tokens=1, temperature=1.0, seed=ok))

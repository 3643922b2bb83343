"""Routed experts streamed from the shards into a bounded cache (issue 16): for every family with routed
experts, in a dense (bf16) checkpoint and in its release's quantized format, the same greedy tokens and
the same fp32 logits (0.0) as the fully loaded model, prefetch on and off, batch 1 and 4; peak memory
bounded by trunk + cache; the budget held at every step; a broken shard reported for the request that
needs it; the trace replay the benchmark checks against the counters; V4.1's Engram rows read through
the same reader."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moesaic
from moesaic.cache.batch import ForwardBatch
from moesaic.cli import main
from moesaic.demo import demo_entry, ensure_demo, write_random
from moesaic.errors import CheckpointError, ConfigError
from moesaic.inspect import inspect_checkpoint
from moesaic.layers.engram import EngramTable
from moesaic.layers.moe import MoeWeights
from moesaic.models import Checkpoint, mistral4
from moesaic.weights.experts import ExpertCache, ExpertStack, FileRows, parse_size, replay
from moesaic.weights.quant import ConcatRows, QuantizedTensor
from moesaic.weights.store import WeightStore, save_safetensors

ROOT = Path(__file__).resolve().parent.parent
QUANTIZED = [  # the release formats: NVFP4 (compressed-tensors, ModelOpt), DeepSeek fp4 + fp8, MXFP4
    "demo-mistral4-nvfp4",
    "demo-nemotron-h-nvfp4",
    "demo-glm5-next-nvfp4",
    "demo-deepseek-v4",
    "demo-deepseek-v41",
    "demo-kimi-k3-mxfp4",
]
# one bf16 checkpoint per family: the dense demos converted, the others written without their quantization
DENSE = ["mistral4", "nemotron-h", "glm5-next", "deepseek-v4", "deepseek-v41", "kimi-linear", "kimi-k3"]
DENSE_SOURCE = {"glm5-next": "demo-glm5-next-nvfp4", "deepseek-v4": "demo-deepseek-v4"}
CKPTS = QUANTIZED + [f"bf16-{f}" for f in DENSE]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41], [100, 3, 4, 5]]
GREEDY = moesaic.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def to_bf16(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` with every float32 tensor stored as bf16 (the release's dense dtype)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    store = WeightStore(src)
    by_file: dict[Path, dict] = {}
    for name, info in store.infos.items():
        t = store.get(name, count=False)
        by_file.setdefault(info.file, {})[name] = t.to(torch.bfloat16) if t.dtype == torch.float32 else t
    for file, tensors in by_file.items():
        save_safetensors(tensors, dst / file.name)
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """name -> checkpoint folder (the quantized demos as written; the bf16 ones made once)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            if not name.startswith("bf16-"):
                made[name] = ensure_demo(name)
            else:
                family = name[len("bf16-") :]
                tmp = tmp_path_factory.mktemp(name)
                if family == "deepseek-v41":
                    from moesaic.demo.deepseek_v41 import DEMO_CONFIG, write_checkpoint

                    write_checkpoint(tmp / "f32", DEMO_CONFIG, quantized=False)
                    src = tmp / "f32"
                elif family in DENSE_SOURCE:
                    src = tmp / "f32"
                    src.mkdir()
                    write_random(src, dict(demo_entry(DENSE_SOURCE[family]).config), ())
                else:
                    src = ensure_demo(f"demo-{family}")
                made[name] = to_bf16(src, tmp / "bf16")
        return made[name]

    return get


def dtype_of(name: str) -> str:
    return "bfloat16" if name.startswith("bf16-") else "float32"


def logits_of(model, prompts: list[list[int]]) -> torch.Tensor:
    """fp32 logits of every row: the prompts prefilled together, then a decode step of all of them."""
    states = [model.new_state() for _ in prompts]
    out = [model.forward(ForwardBatch.build(list(zip(states, prompts)), logits="all"))]
    out.append(model.forward(ForwardBatch.build([(s, [17]) for s in states], logits="all")))
    return torch.cat(out)


_loaded: dict = {}


def demand_bytes(s: dict) -> int:
    """Bytes the misses must have read: each layer's misses at that layer's expert size (an MTP
    block may be kept unquantized, so its experts are larger than the trunk's)."""
    return sum(u["misses"] * u["expert_bytes_each"] for u in s["per_layer"].values())


def reference(path: Path, dtype: str, batch: int):
    """(greedy tokens, logits) of the fully loaded model."""
    key = (path, dtype, batch)
    if key not in _loaded:
        llm = moesaic.LLM(path, dtype=dtype)
        prompts = PROMPTS[:batch]
        _loaded[key] = ([o.token_ids for o in llm.generate(prompts, GREEDY)], logits_of(llm.model, prompts))
    return _loaded[key]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("name", CKPTS)
def test_streamed_equals_loaded(ckpt, name, prefetch, batch):
    path, dtype = ckpt(name), dtype_of(name)
    tokens, logits = reference(path, dtype, batch)
    llm = moesaic.LLM(path, dtype=dtype, expert_cache="10%", expert_prefetch=prefetch)
    s = llm.stats()["expert_cache"]
    assert s["slots"] == max(1, int(0.1 * s["experts"]))  # "10%" is a share of the experts, by count
    got = [o.token_ids for o in llm.generate(PROMPTS[:batch], GREEDY)]
    assert got == tokens
    got_logits = logits_of(llm.model, PROMPTS[:batch])
    assert (got_logits - logits).abs().max().item() == 0.0
    s = llm.stats()["expert_cache"]
    assert s["misses"] > 0 and s["bytes_read_demand"] == demand_bytes(s)
    assert (s["prefetch_issued"] > 0 or s["prefetch_precision"] is not None) == prefetch


@pytest.mark.parametrize("name", ["demo-kimi-k3-mxfp4", "bf16-mistral4"])
def test_direct_reads_equal_buffered(ckpt, name, monkeypatch):
    # O_DIRECT (aligned staging buffer, scattered into the slot) where the file system has it
    path, dtype = ckpt(name), dtype_of(name)
    tokens, logits = reference(path, dtype, 4)
    monkeypatch.setenv("MOESAIC_EXPERT_DIRECT", "1")
    try:
        llm = moesaic.LLM(path, dtype=dtype, expert_cache="10%")
    except ConfigError as e:
        pytest.skip(str(e))
    assert llm.stats()["expert_cache"]["io"] == "direct"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
    assert torch.equal(logits_of(llm.model, PROMPTS), logits)


def moe_layers(model) -> list[MoeWeights]:
    return [v for layer in model.layers for v in vars(layer).values() if isinstance(v, MoeWeights)]


def same_weight(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, ConcatRows):
        return isinstance(b, ConcatRows) and all(
            same_weight(x, y) for x, y in zip(a.parts, b.parts, strict=True)
        )
    fields = ("codes", "scale", "global_scale", "input_scale")
    return (
        isinstance(b, QuantizedTensor)
        and (a.format, a.shape, a.block, a.global_divides) == (b.format, b.shape, b.block, b.global_divides)
        and all(
            (getattr(a, f) is None) == (getattr(b, f) is None)
            and (getattr(a, f) is None or torch.equal(getattr(a, f), getattr(b, f)))
            for f in fields
        )
    )


@pytest.mark.parametrize("name", CKPTS)
def test_streamed_expert_is_the_loaded_expert_and_nothing_is_read_at_load(ckpt, name):
    path, dtype = ckpt(name), dtype_of(name)
    loaded = Checkpoint.open(path).build(dtype)
    ck = Checkpoint.open(path)
    streamed = ck.build(dtype, expert_cache="1MiB")
    plan = ck.plan()
    parts = {n for name, src in plan.sources.items() if plan.specs[name].streamable for n, _ in src.parts}
    assert parts and not parts & set(ck.store.reads)  # no expert tensor was read while loading
    pairs = list(zip(moe_layers(loaded), moe_layers(streamed), strict=True))
    for a, b in pairs[:1] + pairs[-1:]:
        assert isinstance(b.experts_in, ExpertStack) and b.experts_in.shape == a.experts_in.shape
        for e in range(a.experts_in.shape[0]):
            assert same_weight(a.experts_in[e], b.experts_in[e]) and same_weight(
                a.experts_out[e], b.experts_out[e]
            )


@pytest.mark.parametrize(
    "name,dtype,precision",
    [
        ("demo-mistral4", "bfloat16", None),  # fp32 rows converted to the model's bf16 as they are used
        ("demo-mistral4", "float32", "expert=fp8"),  # runtime FP8 of each expert as loading makes it
        ("demo-mistral4-nvfp4", "float32", "expert=bf16"),  # NVFP4 dequantized as loading does
    ],
)
def test_streamed_converts_like_loading(name, dtype, precision):
    path = ensure_demo(name)
    ref = moesaic.LLM(path, dtype=dtype, precision=precision)
    llm = moesaic.LLM(path, dtype=dtype, precision=precision, expert_cache="25%")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in ref.generate(PROMPTS, GREEDY)
    ]
    assert torch.equal(logits_of(llm.model, PROMPTS), logits_of(ref.model, PROMPTS))


def budget_watch(cache: ExpertCache) -> list:
    """Installs a hook that checks the budget at every change of what the cache holds."""
    seen = []

    def hook(c: ExpertCache) -> None:
        assert c.resident_bytes() <= c.budget and c.arena.numel() <= c.budget
        assert c.pinned() <= c.slots and c.prefetch_pins <= c.max_prefetch_pins
        seen.append(c.resident_bytes())

    cache.hook = hook
    return seen


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_budget_never_exceeded_and_one_expert_is_enough(prefetch):
    path = ensure_demo("demo-kimi-k3-mxfp4")
    tokens, logits = reference(path, "float32", 4)
    slot = moesaic.LLM(path, dtype="float32", expert_cache="1MiB").stats()["expert_cache"]["slot_bytes"]
    for budget in (slot, 3 * slot + slot // 2):  # one expert; three and a half (the half holds nothing)
        llm = moesaic.LLM(path, dtype="float32", expert_cache=budget, expert_prefetch=prefetch)
        seen = budget_watch(llm.expert_cache)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
        assert torch.equal(logits_of(llm.model, PROMPTS), logits)
        s = llm.stats()["expert_cache"]
        assert s["slots"] == budget // slot and len(seen) > 100 and max(seen) <= budget
        assert s["peak_resident_bytes"] <= budget


def test_budget_smaller_than_one_expert_is_refused():
    with pytest.raises(ConfigError, match="holds no expert"):
        moesaic.LLM("demo-mistral4", dtype="float32", expert_cache=1000)


@pytest.mark.parametrize(
    "text,want",
    [("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5k", 1500), ("4096", 4096), (123, 123), ("10%", 0.1)],
)
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "lots", "-1GB", "8 GiBs", 0, -5, "0%", "150%", True])
def test_bad_sizes_and_policies_are_config_errors(bad):
    with pytest.raises(ConfigError, match="expert_cache"):
        parse_size(bad)


def test_bad_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="expert_cache_policy 'fifo'"):
        moesaic.LLM("demo-mistral4", expert_cache="10%", expert_cache_policy="fifo")


def test_counters_add_up():
    llm = moesaic.LLM(ensure_demo("demo-deepseek-v4"), dtype="float32", expert_cache="30%")
    llm.generate(PROMPTS, GREEDY)
    s = llm.stats()["expert_cache"]
    each = s["expert_bytes_each"]
    assert s["hits"] + s["misses"] == sum(v["hits"] + v["misses"] for v in s["per_layer"].values())
    assert s["expert_bytes_read"] == (s["misses"] + s["prefetch_issued"]) * each
    assert s["bytes_wasted_prefetch"] == (s["prefetch_issued"] - s["prefetch_used"]) * each
    assert 0 < s["prefetch_precision"] <= 1 and 0 < s["prefetch_recall"] <= 1
    assert s["peak_resident_bytes"] <= s["budget_bytes"] and s["read_seconds"] > 0


# ---------------------------------------------------------------- memory: a checkpoint of several hundred MB

BIG = {  # Mistral Small 4's layout, wide: 64 experts of 1.5 MiB (bf16) in each of 3 MoE layers
    **demo_entry("demo-mistral4").config,
    "hidden_size": 512,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "n_routed_experts": 64,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_shared_experts": 0,
}
MEASURE = r"""
import json, sys
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
import moesaic, torch
base = hwm()
cache = None if sys.argv[2] == "none" else sys.argv[2]
llm = moesaic.LLM(sys.argv[1], dtype="bfloat16", expert_cache=cache, expert_prefetch=False)
out = llm.generate([[5, 6, 7, 8]], moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
print(json.dumps({"base": base, "hwm": hwm(), "tokens": out[0].token_ids, "stats": llm.stats()}))
"""


def write_big(folder: Path) -> tuple[int, int]:
    """A Mistral-4-shaped bf16 checkpoint, one shard per layer (64 experts of 1.5 MiB in each of 3 MoE
    layers: 288 MiB of experts). Returns (trunk bytes, expert bytes)."""
    cfg = mistral4.parse_config(BIG)
    naming = mistral4.namings(cfg, "hf", [])
    g = torch.Generator().manual_seed(0)
    shards: dict[str, dict] = {}
    trunk = experts = 0
    for s in mistral4.tensor_specs(cfg):
        if s.optional:
            continue
        t = (
            (1 + 0.05 * torch.randn(s.shape, generator=g))
            if s.role == "norm"
            else torch.randn(s.shape, generator=g) * s.shape[-1] ** -0.5
        )
        t = t.to(torch.bfloat16)
        ((name, _),) = naming.source(s).parts
        shards.setdefault(f"layer{s.layer}", {})[name] = t
        nbytes = t.numel() * t.element_size()
        experts += nbytes if s.streamable else 0
        trunk += 0 if s.streamable else nbytes
    weight_map = {}
    for shard, tensors in shards.items():
        save_safetensors(tensors, folder / f"{shard}.safetensors")
        weight_map.update(dict.fromkeys(tensors, f"{shard}.safetensors"))
        tensors.clear()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(BIG))
    return trunk, experts


def test_memory_stays_below_trunk_plus_cache(tmp_path):
    trunk, experts = write_big(tmp_path)
    assert experts >= 280 * 2**20
    runs = {}
    for arm in ("none", "10%"):
        r = subprocess.run(
            [sys.executable, "-c", MEASURE, str(tmp_path), arm],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[arm] = json.loads(r.stdout.strip().splitlines()[-1])
    full, streamed = runs["none"], runs["10%"]
    assert streamed["tokens"] == full["tokens"]
    s = streamed["stats"]["expert_cache"]
    cache = s["budget_bytes"]
    assert abs(cache - 0.1 * experts) < 0.02 * experts
    slack = 96 * 2**20  # the read pool's threads, torch's workspace, the decode's activations
    # the trunk counts twice while it loads (the shard's pages, then the copy)
    grown = streamed["hwm"] - streamed["base"]
    assert grown < 2 * trunk + cache + slack, (grown, trunk, cache)
    assert full["hwm"] - full["base"] > experts  # the fully loaded run holds every expert
    assert grown < 0.3 * (full["hwm"] - full["base"])
    assert s["expert_bytes_read"] == s["misses"] * s["expert_bytes_each"] and s["prefetch_issued"] == 0
    assert s["expert_bytes"] == experts


# ---------------------------------------------------------------- faults


def copy_demo(tmp_path: Path, name: str = "demo-mistral4") -> Path:
    dst = tmp_path / name
    shutil.copytree(ensure_demo(name), dst)
    return dst


def test_a_shard_that_shrinks_or_disappears_fails_only_the_request_that_reads_it(tmp_path):
    path = copy_demo(tmp_path)
    shard = path / "model.safetensors"
    good = shard.read_bytes()
    ref = moesaic.LLM(path, dtype="float32").generate(PROMPTS, GREEDY)
    warm = moesaic.LLM(path, dtype="float32", expert_cache="100%")  # will hold every expert it has read
    small = moesaic.LLM(path, dtype="float32", expert_cache="10%")
    assert warm.generate(PROMPTS[:1], GREEDY)[0].token_ids == ref[0].token_ids
    misses = warm.stats()["expert_cache"]["misses"]
    for damage in ("truncate", "delete"):
        if damage == "truncate":
            with open(shard, "r+b") as f:
                f.truncate(len(good) // 2)
        else:
            shard.unlink()
        # a request served from the cache is unaffected; one that must read fails, naming the shard
        assert warm.generate(PROMPTS[:1], GREEDY)[0].token_ids == ref[0].token_ids
        assert warm.stats()["expert_cache"]["misses"] == misses
        with pytest.raises(CheckpointError, match="model.safetensors"):
            small.generate(PROMPTS, GREEDY)
        assert not small.engine.has_work()
        assert small.expert_cache.pinned() == 0
        shard.write_bytes(good)  # put back: the same process serves again
        assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref]


def test_a_replaced_shard_is_refused(tmp_path):
    path = copy_demo(tmp_path)
    llm = moesaic.LLM(path, dtype="float32", expert_cache="10%")
    llm.generate(PROMPTS[:1], GREEDY)
    other = copy_demo(tmp_path / "other", "demo-mistral4-nvfp4")
    shutil.copy(other / "consolidated.safetensors", path / "model.safetensors")
    with pytest.raises(CheckpointError, match="replaced"):
        llm.generate(PROMPTS, GREEDY)


# ---------------------------------------------------------------- policies and the replay


def test_replay_reproduces_the_engine_counters():
    path = ensure_demo("demo-deepseek-v4")
    prompts = [[3 + i, 7 + 2 * i, 11, 13 + i] for i in range(6)]
    for policy in ("lru", "lfru"):
        for frac in ("10%", "40%"):
            llm = moesaic.LLM(
                path, dtype="float32", expert_cache=frac, expert_cache_policy=policy, expert_prefetch=False
            )
            llm.expert_cache.trace = []
            llm.generate(prompts, moesaic.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            s = llm.stats()["expert_cache"]
            trace = llm.expert_cache.trace
            assert replay(trace, s["slots"], policy) == (s["hits"], s["misses"])
            keys = {k for group in trace for k in group}  # room for all: every access after the first hits
            assert replay(trace, len(keys), policy) == (s["hits"] + s["misses"] - len(keys), len(keys))
            assert len(keys) < s["misses"]  # so the check above can fail
            best = replay(trace, s["slots"], "min")
            assert best[0] >= s["hits"] and sum(best) == s["hits"] + s["misses"]


def test_lfru_keeps_a_hot_expert_that_lru_drops():
    a, b, c, d = "abcd"
    trace = [[a], [b], [a], [c], [d], [a]]
    assert replay(trace, 2, "lru") == (1, 5)
    assert replay(trace, 2, "lfru") == (2, 4)
    assert replay(trace, 2, "min") == (2, 4)


def test_a_fetch_larger_than_the_cache_reads_in_turn():
    # one slot, one layer asking three experts: each read after the previous one is used
    assert replay([[1, 2, 3]], 1, "lru") == (0, 3)
    assert replay([[1, 2, 3], [3, 1]], 2, "lru") == (1, 4)


# ---------------------------------------------------------------- Engram rows through the reader


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_engram_rows_are_read_through_the_row_reader(prefetch):
    path = ensure_demo("demo-deepseek-v41")
    plain = moesaic.LLM(path, dtype="float32")
    tables = [layer.engram.table for layer in plain.model.layers if layer.engram is not None]
    assert tables and all(isinstance(t.weight, torch.Tensor) for t in tables)  # mapped without a cache
    llm = moesaic.LLM(path, dtype="float32", expert_cache="10%", expert_prefetch=prefetch)
    tables = [layer.engram.table for layer in llm.model.layers if layer.engram is not None]
    assert all(isinstance(t, EngramTable) and isinstance(t.weight, FileRows) for t in tables)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in plain.generate(PROMPTS, GREEDY)
    ]
    rows = llm.stats()["expert_cache"]["rows"]
    assert rows["bytes_read"] > 0
    if prefetch:  # every token's rows were asked for before its first layer ran
        assert rows["prefetch_jobs"] > 0
    else:
        assert rows["misses"] > 0 and rows["prefetch_jobs"] == 0


# ---------------------------------------------------------------- inspect and the command line


def test_inspect_plans_the_streaming():
    path = ensure_demo("demo-kimi-k3-mxfp4")
    x = inspect_checkpoint(path, expert_cache="10%")["expert_streaming"]
    s = moesaic.LLM(path, expert_cache="10%").stats()["expert_cache"]
    total = WeightStore(path).total_bytes
    assert x["expert_bytes"] == s["expert_bytes"] and x["trunk_bytes"] == total - x["expert_bytes"]
    assert x["per_token_expert_bytes"] == 4 * 2 * x["expert_bytes_each"]  # 4 MoE layers, top-2
    assert x["cache_experts"] == s["slots"]
    assert x["planned_resident_bytes"] == x["trunk_bytes"] + x["cache_bytes"]
    assert math.isclose(x["expert_bytes_each"] * 32, x["expert_bytes"])


def test_cli_expert_cache(capsys):
    assert main(["inspect", "demo-nemotron-h", "--expert-cache", "64KiB"]) == 0
    out = capsys.readouterr().out
    assert "expert streaming" in out and "planned resident" in out
    assert main(["inspect", "demo-nemotron-h", "--expert-cache", "64KiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_streaming"]["cache_bytes"] == 64 * 1024
    assert main(["generate", "--model", "demo-nemotron-h", "--expert-cache", "20%", "--max-tokens", "3"]) == 0
    assert main(["generate", "--model", "demo-nemotron-h", "--expert-cache", "lots"]) == 2
    assert "expert_cache 'lots'" in capsys.readouterr().err


def test_a_fetch_that_raises_ends_the_predictions_it_made(tmp_path):
    """A layer's fetch predicts the next layer's experts (their pins hold slots until that layer fetches);
    when the forward fails inside the fetch, the next layer never runs, so those pins must end too."""
    llm = moesaic.LLM(copy_demo(tmp_path), dtype="float32", expert_cache="50%")
    cache = llm.expert_cache
    a, b = cache.unit_list[0], cache.unit_list[1]
    with pytest.raises(RuntimeError, match="a failing layer"):
        with cache.fetch(a, [0, 1], [0]) as got:
            cache.prefetch(b, [0, 1, 2])
            assert cache.pinned() > 2  # the fetch's own and the predictions'
            next(got)
            raise RuntimeError("a failing layer")
    assert cache.pinned() == 0
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids  # and the cache still serves

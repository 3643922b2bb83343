"""Serving benchmark: a concurrency ladder over the async engine, with the prefix cache on and off.

    .venv/bin/python benchmarks/serving.py [--models mistral4,kimi_linear] [--ladder 1,2,4,8,16]
        [--system 512] [--question 64] [--new 64] [--waves 1] [--dtype bfloat16] [--threads N]

Two random-weight models of ~0.3B parameters, written with moesaic's own writers into a temp folder: an
MLA-only one (Mistral-Small-4-shaped) and a hybrid one (Kimi-Linear-shaped: KDA + MLA). Every request is
a shared system prompt plus a distinct question, and generates a fixed number of tokens (greedy, EOS
ignored). For each concurrency C, `waves * C` requests run with at most C in flight; reported: output
throughput (generated tok/s over the rung's wall time), TTFT and TPOT p50/p90, the prefix hit rate.
With the cache on, one warm-up request first puts the system prompt in the cache (the steady state of a
server with a shared system prompt); with it off there is nothing to warm.

The load generator (`run_rung`) talks to a `Backend` with one method, `stream(prompt_ids, max_tokens)`,
an async iterator of token-id lists; `InProcess` drives moesaic.AsyncLLM, `Http` a `moesaic serve`
process through the official `openai` client (streamed /v1/completions of token ids, `return_token_ids`).

`--server` runs the ladder through both, cache on, rung by rung alternately: the AsyncLLM in this process
and `moesaic serve` on the same checkpoint in a child process (the same engine settings), and reports the
HTTP layer's cost as server tok/s / in-process tok/s per rung (the summary: at the lowest and highest C).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_vs_transformers import SHAPE  # noqa: E402  (the Mistral-Small-4-shaped benchmark model)

import moesaic  # noqa: E402
from moesaic.demo.deepseek_v4 import DEMO_CONFIG as DSV4_DEMO  # noqa: E402
from moesaic.demo.glm5next import DEMO_CONFIG as GLM5_DEMO  # noqa: E402
from moesaic.demo.nemotron_h import DEMO_CONFIG as NEMOTRON_DEMO  # noqa: E402

VOCAB = SHAPE["vocab_size"]
MISTRAL4 = dict(SHAPE, model_type="mistral4")
KIMI_LINEAR = dict(
    model_type="kimi_linear",
    vocab_size=VOCAB,
    hidden_size=1024,
    num_hidden_layers=8,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=None,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_experts=16,
    num_experts_per_token=4,
    num_shared_experts=1,
    num_expert_group=1,
    topk_group=1,
    moe_renormalize=True,
    routed_scaling_factor=2.446,
    first_k_dense_replace=1,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    model_max_length=32768,
    linear_attn_config={
        "num_heads": 16,
        "head_dim": 64,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
    },
    tie_word_embeddings=False,
    eos_token_id=2,
)


def _bench(demo: dict, **sizes) -> dict:
    """A family's demo config (its layout and fixed choices) at the benchmark's widths and vocabulary, without
    the demo's tokenizer / chat entries (the benchmarks feed token ids) and without draft heads."""
    c = {k: v for k, v in copy.deepcopy(demo).items() if not k.startswith("moesaic_")}
    inner = c["text_config"] if "text_config" in c else c
    inner.update(vocab_size=VOCAB, eos_token_id=2, num_nextn_predict_layers=0, **sizes)
    inner.pop("mtp_layers_block_type", None)
    c["eos_token_id"] = 2
    return c


# ~0.3B models of the other families, the widths of the two above (hidden 1024, experts 16 x 512, top 4)
GLM5_NEXT = _bench(
    GLM5_DEMO,
    hidden_size=1024,
    num_hidden_layers=8,
    layer_types=["linear_attention", "indexed_attention"] * 4,
    indexer_types=["full"] * 8,
    mlp_layer_types=["dense"] + ["sparse"] * 7,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    v_head_dim=64,
    intermediate_size=2816,
    moe_intermediate_size=512,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    index_topk=256,
    index_n_heads=8,
    index_head_dim=64,
    linear_num_heads=16,
    linear_head_dim=64,
)
DEEPSEEK_V4 = _bench(
    DSV4_DEMO,
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    head_dim=128,
    qk_rope_head_dim=64,
    q_lora_rank=384,
    o_lora_rank=256,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    num_hash_layers=1,
    sliding_window=128,
    compress_ratios=[0, 4, 128, 4, 128, 4, 128, 0, 0],
    index_n_heads=8,
    index_head_dim=64,
    index_topk=128,
    rope_scaling=dict(DSV4_DEMO["rope_scaling"], factor=4, original_max_position_embeddings=4096),
    max_position_embeddings=16384,
)
NEMOTRON_H = _bench(
    NEMOTRON_DEMO,
    hidden_size=1024,
    layers_block_type=["mamba", "moe"] * 7 + ["attention", "moe"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=2816,
    mamba_num_heads=32,
    mamba_head_dim=64,
    n_groups=4,
    ssm_state_size=64,
    chunk_size=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    moe_shared_expert_intermediate_size=1024,
)
MODELS = {
    "mistral4": MISTRAL4,
    "kimi_linear": KIMI_LINEAR,
    "glm5_next": GLM5_NEXT,
    "deepseek_v4": DEEPSEEK_V4,
    "nemotron_h": NEMOTRON_H,
}


def write_checkpoint(folder: Path, config: dict, dtype: torch.dtype) -> int:
    """A random-weight checkpoint (seed 0) in the family's release naming; returns its parameter count."""
    from moesaic.demo import write_random

    return write_random(folder, copy.deepcopy(config), dtype=dtype)


class InProcess:
    """The backend of an AsyncLLM in this process."""

    def __init__(self, llm: moesaic.AsyncLLM):
        self.llm = llm

    async def stream(self, prompt_ids: list[int], max_tokens: int):
        sp = moesaic.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for item in self.llm.add_request(prompt_ids, sp):
            yield [t for out in item.outputs for t in out.token_ids]

    def stats(self) -> dict:
        return self.llm.stats()


class Http:
    """The backend of a `moesaic serve` process, through the openai client (made per event loop)."""

    def __init__(self, url: str):
        import openai

        self.url = url
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)

    async def stream(self, prompt_ids: list[int], max_tokens: int):
        extra = {"ignore_eos": True, "return_token_ids": True}
        s = await self.client.completions.create(
            model="bench",
            prompt=prompt_ids,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body=extra,
        )
        async for chunk in s:
            yield [t for c in chunk.choices for t in (c.model_extra or {}).get("token_ids") or ()]

    def stats(self) -> dict:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=60).read().decode()

        def value(name):
            m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
            return float(m.group(1)) if m else 0.0

        return dict(
            cached_prompt_tokens=value("moesaic_prefix_cache_hits_total"),
            preemptions=int(value("moesaic_num_preemptions_total")),
        )


def start_server(folder: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    """`moesaic serve` on `folder` with the in-process engine's settings; (process, URL) once it is ready."""
    cmd = [sys.executable, "-m", "moesaic.cli", "serve", str(folder), "--port", "0", "--dtype", args.dtype]
    cmd += ["--served-model-name", "bench", "--max-num-seqs", str(max(args.ladder))]
    cmd += ["--max-num-batched-tokens", str(args.batch_tokens)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while True:
        m = re.search(r"ready at (http://\S+)/v1", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"moesaic serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def rung(make_backend, prompts, concurrency, max_tokens) -> tuple[dict, dict, dict]:
    """One rung on a backend made inside its own event loop: (row, stats before, stats after)."""

    async def go():
        backend = make_backend()
        before = backend.stats()
        row = await run_rung(backend, prompts, concurrency, max_tokens)
        after = backend.stats()
        if isinstance(backend, Http):
            await backend.client.close()
        return row, before, after

    return asyncio.run(go())


def bench_server(name: str, folder: Path, args) -> list[dict]:
    """The ladder in process and through `moesaic serve`, cache on, rung by rung alternately."""
    llm = moesaic.AsyncLLM(
        str(folder), dtype=args.dtype, max_num_seqs=max(args.ladder), max_num_batched_tokens=args.batch_tokens
    )
    log = Path(tempfile.mkstemp(prefix="moesaic-serve-", suffix=".log")[1])
    proc, url = start_server(folder, args, log)
    backends = {"in-process": lambda: InProcess(llm), "server": lambda: Http(url)}
    system = torch.randint(3, args.vocab, (args.system,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    try:
        for make in backends.values():  # warm-up: the system prompt into each cache
            rung(make, make_prompts(system, args.question, 1, 0, args.vocab), 1, 2)
        for c in args.ladder:
            prompts = make_prompts(system, args.question, c * args.waves, seed=c, vocab=args.vocab)
            for backend, make in backends.items():
                row, before, after = rung(make, prompts, c, args.new)
                row.update(
                    model=name,
                    cache="on",
                    backend=backend,
                    hit_rate=(after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
                    / sum(len(p) for p in prompts),
                    preemptions=after["preemptions"] - before["preemptions"],
                )
                rows.append(row)
                print(fmt(row), flush=True)
    finally:
        llm.shutdown(timeout=5)
        proc.terminate()
        code = proc.wait(120)
        print(f"moesaic serve exited {code}; its log: {log}", flush=True)
    return rows


async def one_request(backend, prompt_ids: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async for toks in backend.stream(prompt_ids, max_tokens):
        if toks:
            now = time.perf_counter()
            first = first or now
            last = now
            n += len(toks)
    return dict(ttft=first - t0, tpot=(last - first) / (n - 1) if n > 1 else 0.0, tokens=n, end=last)


async def run_rung(backend, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """All prompts, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(p):
        async with gate:
            return await one_request(backend, p, max_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    wall = time.perf_counter() - t0
    pct = lambda xs, q: statistics.quantiles(xs, n=10)[q // 10 - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    ttft, tpot = [r["ttft"] for r in results], [r["tpot"] for r in results]
    return dict(
        concurrency=concurrency,
        requests=len(prompts),
        tok_s=sum(r["tokens"] for r in results) / wall,
        ttft_p50=statistics.median(ttft),
        ttft_p90=pct(ttft, 90),
        tpot_p50=statistics.median(tpot),
        tpot_p90=pct(tpot, 90),
        wall_s=wall,
    )


def make_prompts(
    system: list[int], question: int, count: int, seed: int, vocab: int = VOCAB
) -> list[list[int]]:
    """`count` requests: the system prompt plus a distinct random question each."""
    g = torch.Generator().manual_seed(seed)
    return [system + torch.randint(3, vocab, (question,), generator=g).tolist() for _ in range(count)]


def bench_model(name: str, folder: Path, args) -> list[dict]:
    """The ladder with the cache on and off, rung by rung alternately (both engines loaded at once), so that
    a drift in the machine's load hits both alike."""
    engines = {
        cache: moesaic.AsyncLLM(
            str(folder),
            dtype=args.dtype,
            max_num_seqs=max(args.ladder),
            max_num_batched_tokens=args.batch_tokens,
            enable_prefix_caching=cache == "on",
        )
        for cache in ("on", "off")
    }
    system = torch.randint(3, args.vocab, (args.system,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    try:
        for llm in engines.values():  # warm-up; with the cache on it puts the system prompt in the cache
            asyncio.run(run_rung(InProcess(llm), make_prompts(system, args.question, 1, 0, args.vocab), 1, 2))
        for c in args.ladder:
            prompts = make_prompts(
                system, args.question, c * args.waves, seed=c, vocab=args.vocab
            )  # distinct per rung
            for cache, llm in engines.items():
                backend = InProcess(llm)
                before = backend.stats()
                row = asyncio.run(run_rung(backend, prompts, c, args.new))
                after = backend.stats()
                row.update(
                    model=name,
                    cache=cache,
                    hit_rate=(after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
                    / sum(len(p) for p in prompts),
                    preemptions=after["preemptions"] - before["preemptions"],
                )
                rows.append(row)
                print(fmt(row), flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown(timeout=5)
    return rows


def fmt(r: dict) -> str:
    return (
        f"{r['model']:<12} {r.get('backend', 'in-process'):<10} cache {r['cache']:<3} C={r['concurrency']:<3} {r['tok_s']:7.1f} tok/s  "
        f"TTFT p50 {r['ttft_p50'] * 1e3:7.0f} ms p90 {r['ttft_p90'] * 1e3:7.0f} ms  "
        f"TPOT p50 {r['tpot_p50'] * 1e3:6.0f} ms p90 {r['tpot_p90'] * 1e3:6.0f} ms  "
        f"hit {r['hit_rate']:.0%}  preempt {r['preemptions']}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--models", default="mistral4,kimi_linear", help="mistral4, kimi_linear or a built-in demo name"
    )
    ap.add_argument("--ladder", default="1,2,4,8,16")
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--waves", type=int, default=1, help="requests per rung = waves x C")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument(
        "--dtype", default="float32", help="float32: bf16 GEMMs are ~3x slower on CPUs without AMX"
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument(
        "--server", action="store_true", help="the ladder in process and through `moesaic serve` (cache on)"
    )
    args = ap.parse_args()
    args.ladder = [int(c) for c in args.ladder.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, dtype {args.dtype}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name in MODELS:
                folder, args.vocab = Path(tmp) / name, VOCAB
                n = write_checkpoint(folder, MODELS[name], getattr(torch, args.dtype))
                print(f"{name}: {n / 1e6:.0f}M parameters (random weights)", flush=True)
            else:  # a built-in demo (tiny: the per-token cost of everything around the model shows)
                from moesaic.demo import ensure_demo

                folder, args.vocab = ensure_demo(name), 259  # prompts of byte ids
            rows += (bench_server if args.server else bench_model)(name, folder, args)
    if args.server:
        print("\nsummary (HTTP overhead: server tok/s / in-process tok/s, cache on):")
        for name in args.models.split(","):
            by = {(r["backend"], r["concurrency"]): r for r in rows if r["model"] == name}
            ratios = [
                f"C={c}: {by['server', c]['tok_s'] / by['in-process', c]['tok_s']:.2f}" for c in args.ladder
            ]
            print(f"{name}: " + ", ".join(ratios))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    print("\nsummary (cache on vs off):")
    for name in args.models.split(","):
        on = {r["concurrency"]: r for r in rows if r["model"] == name and r["cache"] == "on"}
        off = {r["concurrency"]: r for r in rows if r["model"] == name and r["cache"] == "off"}
        c0, c1 = min(args.ladder), max(args.ladder)
        print(
            f"{name}: TTFT p50 at C={c0} uncached / cached = {off[c0]['ttft_p50'] / on[c0]['ttft_p50']:.1f}x; "
            f"throughput C={c1} / C={c0}: cache on {on[c1]['tok_s'] / on[c0]['tok_s']:.1f}x, "
            f"off {off[c1]['tok_s'] / off[c0]['tok_s']:.1f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

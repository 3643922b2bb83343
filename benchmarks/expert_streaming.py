"""Expert streaming (issue 16): cache policies against Belady's MIN on routing traces from real
generation, and the engine's speed, bytes and stall with experts read from the shards.

    python benchmarks/expert_streaming.py [--folder DIR] [--tokens 32] [--prompts 8] [--quick]

The model is a random Mistral-Small-4-shaped checkpoint written once into --folder (bf16, 64 routed
experts of 1.5 MiB per layer, top-4, 7 MoE layers: 672 MiB of experts, 42 MiB of them per cold token).
Its router rows are scaled by a log-normal factor per expert so that expert popularity is skewed as in
trained models (random routers are nearly uniform, which no cache can exploit); everything else is
N(0, 1/fan_in).

1. Trace: greedy generation of --tokens tokens for each of --prompts rotating prompts (batch 1, >= 200
   tokens in all) with the cache holding every expert, recording each layer's demand fetch.
2. Replay: the trace through LRU, LFRU and MIN (Belady) at the same capacity, 5 %..50 % of the experts,
   with the engine's fetch discipline (weights/experts.py `replay`); then the engine itself at two of
   those capacities (prefetch off) and its hit/miss counters compared with the replay's.
3. Timed arms: fully loaded; streamed at two cache sizes, prefetch on/off, cold (the shards' pages
   evicted with posix_fadvise(DONTNEED) first) and warm (pages in the OS cache, the expert cache
   empty). Each arm reports tok/s, expert bytes per token, demand hit rate, stall (time the forward
   waited for reads) as a share of the run, achieved read GB/s against the start-up probe, and the
   hash of every generated token, which must be the same in every arm.

Nothing is asserted; the box is shared (see docs/perf.md), so the load average is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import moesaic  # noqa: E402
from moesaic.demo import demo_entry  # noqa: E402
from moesaic.models import mistral4  # noqa: E402
from moesaic.weights.experts import replay  # noqa: E402
from moesaic.weights.store import save_safetensors  # noqa: E402

CONFIG = {
    **demo_entry("demo-mistral4").config,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 512,
    "n_routed_experts": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 8,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}


def write_model(folder: Path) -> None:
    """The checkpoint (one shard per layer); skipped when `folder` already holds it."""
    if (folder / "config.json").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    cfg = mistral4.parse_config(CONFIG)
    naming = mistral4.namings(cfg, "hf", [])
    g = torch.Generator().manual_seed(0)
    popularity = torch.exp(0.8 * torch.randn(cfg.n_routed_experts, generator=g))  # skewed expert use
    shards: dict[str, dict] = {}
    for s in mistral4.tensor_specs(cfg):
        if s.optional:
            continue
        if s.role == "norm":
            t = 1 + 0.05 * torch.randn(s.shape, generator=g)
        else:
            t = torch.randn(s.shape, generator=g) * s.shape[-1] ** -0.5
        if s.role == "router":
            t = t * popularity[:, None] * 4
        ((name, _),) = naming.source(s).parts
        shards.setdefault(f"layer{s.layer}", {})[name] = t.to(torch.bfloat16)
    weight_map = {}
    for shard, tensors in shards.items():
        save_safetensors(tensors, folder / f"{shard}.safetensors")
        weight_map.update(dict.fromkeys(tensors, f"{shard}.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(CONFIG))


def evict(folder: Path) -> None:
    """Drops the shards' pages from the OS page cache (a cold start)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(n)]


def generate(llm, ps, tokens: int) -> tuple[list[list[int]], float]:
    """Greedy generation of each prompt in turn (batch 1); (token ids, seconds)."""
    sp = moesaic.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = [llm.generate([p], sp)[0].token_ids for p in ps]
    return out, time.perf_counter() - t0


def digest(outs) -> str:
    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--folder", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "moesaic-bench-streaming")
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="fewer arms (one cache size, warm only)")
    args = ap.parse_args()
    folder = Path(args.folder)
    write_model(folder)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, folder {folder}")
    ps = prompts(args.prompts, CONFIG["vocab_size"])
    n_tokens = args.prompts * args.tokens

    # 1. the trace (every expert fits: the fetch groups are what any capacity sees)
    llm = moesaic.LLM(folder, dtype="bfloat16", expert_cache="100%", expert_prefetch=False)
    llm.expert_cache.trace = []
    ref, _ = generate(llm, ps, args.tokens)
    trace = llm.expert_cache.trace
    units = sum(u.E for u in llm.expert_cache.unit_list)
    each = llm.expert_cache.stats()["expert_bytes_each"]
    print(
        f"model: {len(llm.expert_cache.unit_list)} MoE layers x {CONFIG['n_routed_experts']} experts of "
        f"{each / 2**20:.2f} MiB, top-{CONFIG['num_experts_per_tok']}; trace of {n_tokens} tokens, "
        f"{sum(map(len, trace))} expert uses in {len(trace)} layer fetches; output {digest(ref)}"
    )
    del llm

    # 2. replay at equal capacity
    print(
        "\nhit rate at equal capacity (replayed trace)\n| cache | slots | LRU | LFRU | MIN | LRU/MIN | LFRU/MIN |"
    )
    print("|---|---|---|---|---|---|---|")
    fractions = [0.05, 0.10, 0.20, 0.30, 0.50]
    for f in fractions:
        cap = max(1, int(f * units))
        rates = {p: replay(trace, cap, p) for p in ("lru", "lfru", "min")}
        hr = {p: h / (h + m) for p, (h, m) in rates.items()}
        print(
            f"| {f:.0%} | {cap} | {hr['lru']:.3f} | {hr['lfru']:.3f} | {hr['min']:.3f} | "
            f"{hr['lru'] / hr['min']:.2f} | {hr['lfru'] / hr['min']:.2f} |"
        )
    print("\nengine counters vs replay (prefetch off)")
    for f in [0.10] if args.quick else [0.10, 0.30]:
        for policy in ("lru", "lfru"):
            llm = moesaic.LLM(
                folder,
                dtype="bfloat16",
                expert_cache=f"{f:.0%}",
                expert_cache_policy=policy,
                expert_prefetch=False,
            )
            llm.expert_cache.trace = []
            outs, _ = generate(llm, ps, args.tokens)
            s = llm.stats()["expert_cache"]
            want = replay(llm.expert_cache.trace, s["slots"], policy)
            same = "match" if want == (s["hits"], s["misses"]) else "MISMATCH"
            print(
                f"  {f:.0%} {policy}: engine hits/misses {s['hits']}/{s['misses']}, replay {want[0]}/{want[1]} "
                f"{same}; trace identical to the recorded one: {llm.expert_cache.trace == trace}; "
                f"output {digest(outs)}"
            )
            del llm

    # 3. timed arms, interleaved
    arms = [("loaded", None, None, "warm")]
    sizes = ["10%"] if args.quick else ["10%", "30%"]
    temps = ["warm"] if args.quick else ["cold", "warm"]
    for temp in temps:
        for size in sizes:
            for pf in (False, True):
                arms.append((f"{size} {'prefetch' if pf else 'no prefetch'}", size, pf, temp))
    if not args.quick:
        arms.append(("loaded", None, None, "cold"))
    print(
        "\n| arm | pages | tok/s | expert MB/token | demand hit rate | stall % | read GB/s | probe GB/s "
        "(mode) | prefetch precision / recall | output |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, size, pf, temp in arms:
        if temp == "cold":
            evict(folder)
        llm = moesaic.LLM(folder, dtype="bfloat16", expert_cache=size, expert_prefetch=bool(pf))
        if llm.expert_cache is not None:
            llm.expert_cache.reset_counters()
        outs, secs = generate(llm, ps, args.tokens)
        same = "=" if outs == ref else "DIFFERENT"
        if llm.expert_cache is None:
            print(
                f"| {name} | {temp} | {n_tokens / secs:.1f} | - | - | - | - | - | - | {digest(outs)} {same} |"
            )
        else:
            s = llm.stats()["expert_cache"]
            pr = s["prefetch_precision"]
            rc = s["prefetch_recall"]
            pfs = "-" if pr is None else f"{pr:.2f} / {rc:.2f}"
            gbps = s["read_gbps"] or 0.0
            probe = s["probe"]
            ceiling = max(v for k, v in probe.items() if k.endswith("_gbps"))
            print(
                f"| {name} | {temp} | {n_tokens / secs:.1f} | {s['expert_bytes_read'] / n_tokens / 1e6:.1f} | "
                f"{s['hit_rate']:.3f} | {100 * s['stall_seconds'] / secs:.0f} | {gbps:.2f} | {ceiling:.2f} "
                f"({probe['mode']}) | {pfs} | {digest(outs)} {same} |"
            )
        del llm
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""CPU decode against its memory roofline (issue 18): for a ~0.3B random-weight model of a family (written
by moesaic's own writers into a temp folder), in bf16, in its release's quantized format and packed at load
with `*=fp8`, `*=mxfp4`, `*=nvfp4`: the weight bytes one batch-1 decode step reads, the read bandwidth
measured in the same run, decode tok/s at batch 1 and 8, % of the roofline, prefill tok/s, and the ratio to
transformers `generate` on the same bf16 weights where transformers runs the family on the CPU. Then where
a batch-1 bf16 step's time goes (GEMM vs the rest).

    .venv/bin/python benchmarks/decode_roofline.py [--models mistral4,kimi_linear] [--threads N]
        [--new 16] [--prompt 32] [--prefill 256[,2048]] [--arms bf16,release,fp8,mxfp4,nvfp4,nvfp4+int8x] [--no-hf]
        [--alternate R]

Decode time is time(prompt + N new) - time(prompt + 1 new) (prefill cancels), best of `--repeats`. The
roofline is bandwidth / bytes per step: the bytes are every weight a token reads under the arm's schedule
(the model's `inspect --precision` bytes minus the embedding table and the routed experts a token does not
pick: top-k of E per MoE layer). The release format stands in as the schedule that packs what the release
packs (Mistral Small 4: NVFP4 experts; Kimi Linear is released in bf16, so it has no release arm). An arm
ending in `+int8x` runs with MOESAIC_CPU_INT8_ACTIVATIONS=1 (E2M1 weights against int8 activation rows).

`--layers N` gives the models N layers: a CPU whose L3 holds a packed 0.3B model (the AMX Xeon VM reports
480 MB, and holds ~100 MB: a 50 MB packed model is read at ~1.5x the memory's speed) is measured from memory
with weights larger than that (Mistral-4 at 48 layers: ~1 GB a bf16 step, ~280 MB a mxfp4 one).

`--alternate R` adds, per model, R rounds of batch-1 decode with every arm loaded at once and run in turn
(one repeat each a round): on a shared, noisy machine the per-round ratios to the first arm, and their median,
say more than one best-of run per arm taken minutes apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import MODELS, VOCAB, write_checkpoint  # noqa: E402

import moesaic  # noqa: E402
from moesaic.kernels import cpu, memory  # noqa: E402
from moesaic.weights.precision import PrecisionSchedule  # noqa: E402

# what the releases ship packed (Kimi Linear and Nemotron-H ship bf16)
RELEASE = {
    "mistral4": "expert=nvfp4,shared_expert=nvfp4",
    "glm5_next": "expert=nvfp4,shared_expert=nvfp4",
    "deepseek_v4": "*=fp8,expert=mxfp4",
}
ARMS = {"bf16": None, "fp8": "*=fp8", "mxfp4": "*=mxfp4", "nvfp4": "*=nvfp4"}
INT8X = "+int8x"  # arm suffix: int8 activations (kernels/cpu.py int8_activations)


def arm_precision(name: str, arm: str) -> str | None:
    """The precision schedule of `arm` for model `name` ("missing": a release arm the family does not have)."""
    base = arm.removesuffix(INT8X)
    return RELEASE.get(name, "missing") if base == "release" else ARMS[base]


def use_arm(arm: str) -> None:
    """MOESAIC_CPU_INT8_ACTIVATIONS as `arm` runs: 1 for a `+int8x` arm, else 0."""
    os.environ["MOESAIC_CPU_INT8_ACTIVATIONS"] = "1" if arm.endswith(INT8X) else "0"


def layers_of(config: dict, n: int) -> dict:
    """`config` with n layers, for a family whose layers are alike past the first (Mistral-4: one dense, then
    MoE); a family that lists its layers' kinds keeps its own count (ValueError)."""
    listed = [k for k, v in config.items() if isinstance(v, (list, dict)) and k != "rope_parameters"]
    if listed:
        raise ValueError(f"--layers: this config lists per-layer facts ({', '.join(listed)}); not rescaled")
    return dict(config, num_hidden_layers=n)


def step_bytes(folder: Path, precision: str | None, batch: int = 1) -> int:
    """Weight bytes one decode step of `batch` tokens reads under `precision`: all but the embedding table and
    the routed experts no token picks (each token top-k of E in each MoE layer; for a batch, the expected
    share of experts picked at least once when tokens pick independently and uniformly)."""
    from moesaic.models import Checkpoint

    ckpt = Checkpoint.open(folder)
    specs = ckpt.family.tensor_specs(ckpt.cfg)
    by_role = PrecisionSchedule.parse(precision).loaded_bytes(specs, 2)
    cfg, raw = ckpt.cfg, ckpt.store.config
    text = raw.get("text_config") or raw  # the parsed config's names differ per family; these are the HF ones
    experts = text.get("n_routed_experts") or text.get("num_experts") or cfg.n_routed_experts
    k = text.get("num_experts_per_tok") or text.get("num_experts_per_token") or cfg.num_experts_per_tok
    tied = text.get("tie_word_embeddings", False)
    return sum(
        b * (1 - (1 - k / experts) ** batch if role == "expert" else 1)
        for role, b in by_role.items()
        if role != "embedding" or tied
    )


def time_decode(gen, prompts, new: int, repeats: int) -> float:
    """Best decode tok/s over `repeats`: (new - 1) tokens per sequence over time(new) - time(1)."""
    gen(prompts, 2)  # warm-up
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        gen(prompts, 1)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        gen(prompts, new)
        tn = time.perf_counter() - t
        if tn > t1:  # a shared box can make the 1-token run the slower one: that repeat says nothing
            best = max(best, (new - 1) * len(prompts) / (tn - t1))
    return best or float("nan")


def time_prefill(gen, prompts: list, repeats: int) -> float:
    """Prompt tokens/s of a prefill that generates one token (best of `repeats`): prompts[0] warms up, each
    timed run takes the next prompt, so that no run finds its prompt in the prefix cache (a repeated prompt
    is a cache hit for every full block: 3x the tokens/s of a new one, Mistral-4 at 256 tokens)."""
    gen([prompts[0]], 1)
    best = float("inf")
    for i in range(repeats):
        prompt = prompts[1 + i % (len(prompts) - 1)]
        t = time.perf_counter()
        gen([prompt], 1)
        best = min(best, time.perf_counter() - t)
    return len(prompts[0]) / best


def moesaic_gen(llm):
    def gen(prompts, n):
        sp = moesaic.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, sp)]

    return gen


def hf_gen(model):
    def gen(prompts, n):
        ids = torch.tensor(prompts)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=n, max_new_tokens=n)
        with torch.inference_mode():
            return model.generate(ids, **kw)[:, ids.shape[1] :].tolist()

    return gen


def gemm_share(llm, prompt, new: int, repeats: int) -> tuple[float, float]:
    """(ms per batch-1 decode step, ms of it in matrix products): the kernels' calls, the fp32 tiles and
    torch's mm / bmm / matmul are timed (wall clock) around each call; cpu.ffn_rows (a token's whole
    feed-forward block: its products, a silu, a mul and the weighted sum), cpu.moe_rows (the same with the
    router's product and the routing's few ops), cpu.kda_project (KDA's eight row-wise products, the log-decay
    and beta), cpu.mla_project (MLA's q_a, q_b and kv_a products and two norms; cpu.dsa_project: those and the
    DSA indexer's wk, its LayerNorm and gate), cpu.mla_block (an MLA module's
    decode rows: mla_project's products, o's, and with them the ropes, the page writes and the absorbed
    attention, ~50 us a layer of Mistral-4's at these lengths), cpu.v4_inputs (DeepSeek-V4's q_b product with
    its two norms, head RMS and ropes) and cpu.v4_output (its inverse rope, grouped o_a and o_b products) are
    counted as products (inside cpu.v4_attention too, which times them itself), and so are the weight products
    inside
    cpu.mhc_enter (the mHC site's), cpu.dsa_gathered (DSA's W_k and W_v), cpu.dsa_block (a DSA decode row's
    projections, W_k, W_v and o's product, not its page writes, selection or attention) and cpu.kda_block (a KDA
    decode row's kda_project and o's product, not its recurrence), which those calls time themselves
    (cpu.product_seconds)."""
    acc = [0.0]

    def timed(f):
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t

        return g

    names = (
        "_gemm",
        "tiled_linear",
        "ffn_rows",
        "moe_rows",
        "kda_project",
        "mla_project",
        "dsa_project",
        "mla_block",
        "v4_inputs",
        "v4_output",
    )
    saved = [getattr(cpu, n) for n in names], torch.bmm, torch.matmul
    for n in names:
        setattr(cpu, n, timed(getattr(cpu, n)))
    torch.bmm, torch.matmul = timed(torch.bmm), timed(torch.matmul)
    try:
        gen = moesaic_gen(llm)
        best = None
        for _ in range(repeats):
            acc[0] = 0.0
            t, inner = time.perf_counter(), cpu.product_seconds(True)  # (on: the fused calls' own count)
            gen([prompt], 1)
            t1, g1 = time.perf_counter() - t, acc[0] + cpu.product_seconds(True) - inner
            acc[0] = 0.0
            t, inner = time.perf_counter(), cpu.product_seconds(True)
            gen([prompt], new)
            tn, gn = time.perf_counter() - t, acc[0] + cpu.product_seconds(True) - inner
            step, mm = (tn - t1) / (new - 1), (gn - g1) / (new - 1)
            best = (step, mm) if best is None or step < best[0] else best
    finally:
        cpu.product_seconds(False)
        for n, f in zip(names, saved[0]):
            setattr(cpu, n, f)
        torch.bmm, torch.matmul = saved[1:]
    return best[0] * 1e3, best[1] * 1e3


HF_CLASSES = {
    "mistral4": "Mistral4ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "glm5_next": "Glm5NextForConditionalGeneration",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}


def load_hf(folder: Path, name: str):
    import transformers

    cls = getattr(transformers, HF_CLASSES[name])
    # pad / bos ids inside this vocabulary (Kimi-Linear's config defaults point past it)
    return cls.from_pretrained(folder, dtype=torch.bfloat16, pad_token_id=0, bos_token_id=1).eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mistral4,kimi_linear")
    ap.add_argument("--arms", default="bf16,release,fp8,mxfp4,nvfp4,nvfp4+int8x")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument(
        "--prefill",
        default="256",
        help="prompt lengths of the prefill columns, comma-separated (e.g. 256,2048: attention grows with the square)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--alternate", type=int, default=0, help="rounds of batch-1 decode, the arms in turn")
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="the models' layer count (default: their own): weights larger than a big L3 cache",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # malloc's thresholds are the process's: set before anything runs, so that transformers' forwards keep their
    # freed memory as moesaic's engine makes its own do (else only the models after moesaic's first engine would)
    memory.keep_freed_memory()
    threads = torch.get_num_threads()
    bw, mid = cpu.read_bandwidths(threads=threads)
    print(
        f"{threads} thread(s); read bandwidth (kernels' streaming read, this run): {bw:.1f} GB/s "
        f"(the roof; the same reads' median {mid:.1f})"
    )
    g = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in args.prefill.split(",")]
    tag = lambda n: "" if len(lengths) == 1 else f" {n}"  # noqa: E731
    head = (
        f"{'model':<12} {'arm':<12} {'MB/step':>8} {'roof tok/s':>10} {'b1 tok/s':>9} {'% roof':>7} "
        f"{'b8 tok/s':>9} {'vs hf b1':>9} {'vs hf b8':>9}"
        + "".join(f" {'prefill' + tag(n) + ' tok/s':>18} {'vs hf prefill' + tag(n):>18}" for n in lengths)
    )
    rows, shares, alts = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            config = MODELS[name]
            if args.layers:
                config = layers_of(config, args.layers)
            folder = Path(tmp) / name
            nparams = write_checkpoint(folder, config, torch.bfloat16)
            vocab = VOCAB  # every benchmark model has it
            prompts = torch.randint(3, vocab, (8, args.prompt), generator=g).tolist()
            # a new prompt for every timed prefill (time_prefill): none of them a prefix-cache hit
            long_prompts = [
                torch.randint(3, vocab, (args.repeats + 1, n), generator=g).tolist() for n in lengths
            ]
            hf = None
            if not args.no_hf:
                try:
                    hf = load_hf(folder, name)
                except Exception as e:  # a family transformers does not run on the CPU here
                    print(f"{name}: transformers n/a ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
            print(f"{name}: {nparams / 1e6:.0f}M parameters")
            hf_b1 = hf_b8 = None
            hf_pf = [None] * len(lengths)
            if hf is not None:
                try:
                    hf_b1 = time_decode(hf_gen(hf), prompts[:1], args.new, args.repeats)
                    hf_b8 = time_decode(hf_gen(hf), prompts, args.new, args.repeats)
                    hf_pf = [time_prefill(hf_gen(hf), p, args.repeats) for p in long_prompts]
                except Exception as e:
                    print(f"{name}: transformers generate failed ({type(e).__name__}: {str(e)[:100]})")
                del hf
            for arm in args.arms.split(","):
                precision = arm_precision(name, arm)
                if precision == "missing":
                    continue
                use_arm(arm)
                llm = moesaic.LLM(str(folder), dtype="bfloat16", precision=precision)
                gen = moesaic_gen(llm)
                b1 = time_decode(gen, prompts[:1], args.new, args.repeats)
                b8 = time_decode(gen, prompts, args.new, args.repeats)
                pf = [time_prefill(gen, p, args.repeats) for p in long_prompts]
                mb = step_bytes(folder, precision) / 1e6
                roof = bw * 1e3 / mb
                ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
                bf = arm == "bf16"
                rows.append(
                    f"{name:<12} {arm:<12} {mb:>8.1f} {roof:>10.1f} {b1:>9.1f} {100 * b1 / roof:>6.0f}% "
                    f"{b8:>9.1f} {ratio(b1, hf_b1) if bf else '-':>9} {ratio(b8, hf_b8) if bf else '-':>9}"
                    + "".join(f" {a:>18.0f} {ratio(a, b) if bf else '-':>18}" for a, b in zip(pf, hf_pf))
                )
                print(rows[-1], flush=True)
                if arm == "bf16":
                    step, mm = gemm_share(llm, prompts[0], args.new, args.repeats)
                    shares.append(
                        f"{name}: batch-1 bf16 step {step:.1f} ms, matrix products {mm:.1f} ms, the rest "
                        f"{step - mm:.1f} ms ({100 * (step - mm) / step:.0f} %)"
                    )
                del llm
                os.environ.pop("MOESAIC_CPU_INT8_ACTIVATIONS")
            if hf_b1:
                pfs = ", ".join(f"prefill{tag(n)} {p:.0f}" for n, p in zip(lengths, hf_pf) if p)
                print(f"{name}: transformers bf16 tok/s b1 {hf_b1:.1f}, b8 {hf_b8:.1f}, {pfs}")
            if args.alternate:
                lines = alternate(folder, name, args.arms.split(","), prompts[:1], args.new, args.alternate)
                print("\n".join(lines), flush=True)
                alts += lines
    print("\n" + head)
    print("\n".join(rows))
    print("\n".join(shares))
    print("\n".join(alts))


def alternate(folder: Path, name: str, arms: list, prompt, new: int, rounds: int) -> list:
    """Batch-1 decode tok/s of every arm, all loaded, run in turn for `rounds` rounds: lines with each arm's
    median and its per-round ratio to the first arm (min-max, median)."""
    gens = {}
    for arm in arms:
        if (precision := arm_precision(name, arm)) != "missing":
            gens[arm] = moesaic_gen(moesaic.LLM(str(folder), dtype="bfloat16", precision=precision))
    tps = {arm: [] for arm in gens}
    for _ in range(rounds):
        for arm, gen in gens.items():
            use_arm(arm)
            tps[arm].append(time_decode(gen, prompt, new, 1))
    os.environ.pop("MOESAIC_CPU_INT8_ACTIVATIONS", None)
    first = tps[next(iter(tps))]
    lines = []
    for arm, t in tps.items():
        r = [a / b for a, b in zip(t, first)]
        lines.append(
            f"{name} {arm}: b1 tok/s median {statistics.median(t):.1f} over {rounds} alternated rounds; per round "
            f"x {next(iter(tps))} {min(r):.2f}-{max(r):.2f} (median {statistics.median(r):.2f})"
        )
    return lines


if __name__ == "__main__":
    main()

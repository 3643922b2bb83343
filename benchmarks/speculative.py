"""Speculative decoding benchmark: decode tok/s with and without drafting, at batch 1 and 4, for each method,
in one run, with tau and the per-position acceptance.

    .venv/bin/python benchmarks/speculative.py [--model demo-glm5-code] [--drafter DIR] [--methods ngram,dflash,mtp]
        [--batches 1,4] [--new 96] [--k 7] [--dtype float32] [--threads 1]

Model: the trained demo (GLM-5.3-shaped, with its MTP layer and the DFlash drafter `glm5-code-dflash`),
docs/train_demo.md. Prompts: the first lines of the Python standard library files the demo was not trained on
(its held-out files, listed in its config), and for n-gram a repetitive set (the same file start, then its
first lines again: the continuation copies). Each configuration (plain, then each method with a fixed draft
length and with adaptive drafting) is one `LLM`; a run generates `--new` greedy tokens (EOS ignored) for each
of `--groups` batches of prompts in turn (at batch 1: that many prompts one after another, so tau is not one
prompt's). Decode tok/s = generated tokens / (wall time - the same group's time for one token), so the
prefill is not counted; each group runs on every configuration in turn, in an order rotated from group to
group (the machine is shared, and its speed moves between stretches of a second or so), and tok/s is the
median of `--reps` repetitions, "x plain" the median of the repetitions' ratios to plain decoding. tau and
the acceptance are those of all the runs of that row. Outputs are checked equal to plain decoding at the same batch size, token for
token, in fp32 and in bf16 (the bf16 rows parted from plain decoding until a prompt's state had the same bits
in a drafting engine and a plain one: layers/recurrent.py STEPPED_ROWS).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moesaic  # noqa: E402
from moesaic.errors import ConfigError  # noqa: E402
from moesaic.llm import resolve_model_path  # noqa: E402


def code_prompts(model_path: Path, n: int, lines: int = 12) -> list[str]:
    """The first lines of the held-out stdlib files of the trained demo (any stdlib files otherwise)."""
    cfg = json.loads((model_path / "config.json").read_text())
    held = (cfg.get("moesaic_demo") or {}).get("corpus", {}).get("heldout_files") or []
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f for f in held if (root / f).exists()] or sorted(root.glob("*.py"))
    out = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace").splitlines()
        body = [x for x in text if x.strip() and not x.startswith("#")][:lines]
        if len(body) == lines:
            out.append("\n".join(body) + "\n")
        if len(out) == n:
            break
    return out


def repetitive_prompts(prompts: list[str]) -> list[str]:
    """A prompt, then its own first half again: the continuation is most likely the rest of it again."""
    out = []
    for p in prompts:
        lines = p.splitlines(keepends=True)
        out.append(p + "".join(lines[: len(lines) // 2]))
    return out


def timed(llm, groups, params) -> tuple[float, list]:
    """Wall time of generating each group of prompts in turn (one batch per group), and the outputs."""
    outs, t0 = [], time.perf_counter()
    for g in groups:
        outs += llm.generate(g, params)
    return time.perf_counter() - t0, outs


def measure(
    llms: list, prompts: list[str], batch: int, new: int, reps: int
) -> list[tuple[float, float, list]]:
    """Per LLM: decode tok/s over `prompts` run `batch` at a time (the median over `reps` repetitions), its
    ratio to the first LLM's (the median of the repetitions' ratios), and the tokens. Each group of prompts
    runs on every LLM in turn before the next group, in an order rotated from group to group: this shared
    machine's step times move by up to half between stretches of a second or so, and LLMs run one after
    another for whole repetitions mostly compared the stretches (two plain engines differed by 0.67-1.6x
    between repetitions that way)."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    one = moesaic.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = moesaic.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for llm in llms:
        llm.generate(groups[0], one)  # warm-up
    n = len(llms)
    rates, outs = [[] for _ in llms], [[] for _ in llms]
    turn = 0
    for rep in range(reps):
        spent = [0.0] * n
        for g in groups:
            for i in [(turn + j) % n for j in range(n)]:
                first = timed(llms[i], [g], one)[0]
                t, out = timed(llms[i], [g], full)
                spent[i] += t - first
                if rep == 0:
                    outs[i] += [o.token_ids for o in out]
            turn += 1
        for i in range(n):
            rates[i].append(len(prompts) * (new - 1) / spent[i])
    return [
        (statistics.median(r), statistics.median(a / b for a, b in zip(r, rates[0])), o)
        for r, o in zip(rates, outs)
    ]


def counters(llm) -> dict | None:
    c = llm.engine.spec_counters if llm.engine.spec is not None else None
    return (
        None
        if c is None
        else {**c, "drafted_at": list(c["drafted_at"]), "accepted_at": list(c["accepted_at"])}
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo-glm5-code")
    ap.add_argument("--drafter", default=None, help="DFlash drafter folder (default: the demo's own)")
    ap.add_argument("--methods", default="ngram,dflash,mtp")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4, help="batches of prompts per measurement (run in turn)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    path = resolve_model_path(a.model)
    drafter = Path(a.drafter) if a.drafter else path.parent / (path.name + "-dflash")
    batches = [int(b) for b in a.batches.split(",")]
    code = code_prompts(path, max(batches) * a.groups)
    sets = {"code": code, "repetitive": repetitive_prompts(code)}
    print(
        f"# {path.name}: dtype {a.dtype}, {a.threads} thread(s), {a.new} new tokens, torch {torch.__version__}"
    )
    print(
        "| method | k | adaptive | prompts | batch | tok/s | x plain | tau | acceptance by position | equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    configs = [("plain", "-", "-", moesaic.LLM(str(path), dtype=a.dtype))]
    for method in a.methods.split(","):
        k = a.ngram_k if method == "ngram" else a.k
        for adaptive in (False, True):
            config = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
            if method in ("dflash", "dspark"):
                config["model"] = str(drafter)
            try:
                configs.append(
                    (method, k, adaptive, moesaic.LLM(str(path), dtype=a.dtype, speculative_config=config))
                )
            except ConfigError as e:
                print(f"| {method} | {k} | {adaptive} | - | - | n/a: {e} | | | | |")
                break
    for name, prompts in sets.items():
        here = [c for c in configs if c[0] == "plain" or (c[0] == "ngram") == (name == "repetitive")]
        for b in batches:
            before = [counters(llm) for *_, llm in here]
            results = measure([llm for *_, llm in here], prompts[: b * a.groups], b, a.new, a.reps)
            ref_toks = results[0][2]
            for (method, k, adaptive, llm), c0, (rate, ratio, toks) in zip(here, before, results):
                if c0 is None:
                    print(f"| plain | - | - | {name} | {b} | {rate:.1f} | 1.00 | 1.00 | - | - |")
                    continue
                c = counters(llm)
                rounds = c["rounds"] - c0["rounds"]
                tau = (c["committed"] - c0["committed"]) / rounds if rounds else 1.0
                per = [
                    (x - x0) / (d - d0) if d > d0 else 0.0
                    for x, x0, d, d0 in zip(
                        c["accepted_at"], c0["accepted_at"], c["drafted_at"], c0["drafted_at"]
                    )
                ]
                print(
                    f"| {method} | {k} | {adaptive} | {name} | {b} | {rate:.1f} | {ratio:.2f} | "
                    f"{tau:.2f} | {' '.join(f'{x:.2f}' for x in per)} | {'yes' if toks == ref_toks else 'no'} |"
                )


if __name__ == "__main__":
    main()

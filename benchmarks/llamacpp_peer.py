"""moesaic vs llama.cpp: batch-1 CPU decode on the same random weights (issue 18).

    .venv/bin/python benchmarks/llamacpp_peer.py --llama-python /path/to/venv/bin/python \\
        --converter /path/to/llama.cpp/convert_hf_to_gguf.py [--models mistral4,kimi_linear] [--threads 1]
        [--new 16] [--prompt 32] [--repeats 3] [--check 8] [--workdir DIR]

The ~0.3B benchmark checkpoints of benchmarks/serving.py (moesaic's own writers, seed 0, bf16) are written
once (into `--workdir` when given, so a rerun reuses them and their GGUF files), converted to GGUF by
llama.cpp's own `convert_hf_to_gguf.py` (it writes with the gguf package) and run by llama-cpp-python in a
child process started with `--llama-python`, so this project's venv never needs llama-cpp-python. Without
`--llama-python` and `--converter` (or when that python cannot import llama_cpp) it says so and exits 0.

Decode tok/s (bf16 weights on both sides) is decode_roofline's: time(prompt + N new) - time(prompt + 1
new), greedy, EOS ignored. The child answers one request (prompt ids, N) per line; the pipe's round trip
is paid once per request, so it cancels in the difference like prefill does. moesaic and llama.cpp take
turns, one round each per repeat, and the best round of each is kept (other work on a shared box slows
either). Both run `--threads` threads. `agree` counts the leading greedy tokens both pick for one prompt,
in float32 (moesaic float32, an f32 GGUF) and in bf16: random weights give near-flat logits, so bf16
rounding (llama.cpp also rounds activations to bf16 before its bf16 products) flips near-ties early; in
float32 only the order of sums differs, and a flip is left only where a router or the logits tie.

What the converter needs that the benchmark checkpoint lacks: config fields the released configs carry
and moesaic defaults (`architectures`, the name llama.cpp registers the family under: Mistral Small 4's
release uses `Mistral3ForConditionalGeneration` with `model_type` mistral4; Kimi Linear's
`moe_router_activation_func` "sigmoid", without which llama.cpp refuses the file), and a tokenizer: the
one of moesaic's trained demo (moesaic/demo/trained/glm5-code: a GPT-2-style byte-level BPE of 4096
tokens; the converter pads the vocabulary to the config's size). The converter names a BPE tokenizer's
pre-tokenizer by hashing its output on a fixed text against a list of released tokenizers; the demo's is
not in it, so it is named `gpt-2` (its pre-tokenizer is GPT-2's) by wrapping the converter's
`get_vocab_base_pre`. Token ids go in and come out, so the vocabulary's text is never used.

The Kimi Linear shape differs from serving.py's in one field (see SHAPE): llama.cpp's kimi-linear has one
head count for KDA and MLA layers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_roofline import moesaic_gen, time_decode  # noqa: E402
from serving import MODELS, VOCAB, write_checkpoint  # noqa: E402

import moesaic  # noqa: E402

# config.json fields the converter reads that the benchmark configs leave to moesaic's defaults
FOR_CONVERTER = {
    "mistral4": {"architectures": ["Mistral3ForConditionalGeneration"]},
    "kimi_linear": {"architectures": ["KimiLinearForCausalLM"], "moe_router_activation_func": "sigmoid"},
}
# llama.cpp's kimi-linear takes the KDA head count from `attention.head_count`, the MLA layers' (the released
# 48B has 32 of each); serving.py's shape has 16 KDA and 8 MLA heads, so here the MLA layers get 16 too.
SHAPE = {"kimi_linear": {"num_attention_heads": 16, "num_key_value_heads": 16}}
TOKENIZER = Path(moesaic.__file__).parent / "demo" / "trained" / "glm5-code"

# Run with the llama python: convert_hf_to_gguf.py as its own __main__, its pre-tokenizer check wrapped.
CONVERT = """
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.path[:0] = [str(Path(script).parent), str(Path(script).parent / "gguf-py")]
from conversion.base import TextModel
check = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return check(self, tokenizer)
    except NotImplementedError:  # not a released tokenizer: the demo's, whose pre-tokenizer is GPT-2's
        return "gpt-2"
TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""

# Run with the llama python: one GGUF, one JSON request per stdin line, one JSON answer per stdout line.
SERVE = """
import json, sys
import llama_cpp
import numpy as np
path, threads, n_ctx, logits_all = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                      logits_all=logits_all, verbose=False)
print(llama_cpp.llama_print_system_info().decode(), file=sys.stderr, flush=True)
print(json.dumps({"ready": llama_cpp.__version__}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    outs = []
    for prompt in req["prompts"]:
        llm.reset()  # no prefix reuse: every request prefills its prompt
        if req["n"] == 0:  # each position's argmax over the whole sequence (needs logits_all)
            llm.eval(prompt)
            outs.append(np.asarray(llm.scores[: len(prompt)]).argmax(-1).tolist())
            continue
        out = []
        for t in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(t)
            if len(out) == req["n"]:
                break
        outs.append(out)
    print(json.dumps(outs), flush=True)
"""


class LlamaChild:
    """llama-cpp-python on one GGUF file in a child process; `gen(prompts, n)` as decode_roofline's
    (`n` = 0: every position's argmax instead, on a child made with `logits_all`)."""

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int, logits_all: bool = False):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [python, "-c", SERVE, str(gguf), str(threads), str(n_ctx), str(int(logits_all))]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self.proc.stdout.readline()
        if not ready:
            raise SystemExit(f"llama-cpp-python could not load {gguf} (its error is above)")
        self.version = json.loads(ready)["ready"]

    def gen(self, prompts, n):
        self.proc.stdin.write(json.dumps({"prompts": prompts, "n": n}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def convert(python: str, converter: str, folder: Path, name: str, outtype: str) -> Path:
    """`folder`'s checkpoint as a GGUF file beside it (reused when it is there)."""
    out = folder.parent / f"{name}-{outtype}.gguf"
    if out.exists():
        return out
    src = folder.parent / f"{name}-hf-for-gguf"  # the checkpoint plus what the converter needs
    src.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | FOR_CONVERTER[name]))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, src / f)
    if not (src / "model.safetensors").exists():
        (src / "model.safetensors").symlink_to(folder / "model.safetensors")
    cmd = [python, "-c", CONVERT, converter, str(src), "--outfile", str(out), "--outtype", outtype]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not out.exists():
        raise SystemExit(f"convert_hf_to_gguf.py failed on {name}:\n{(r.stdout + r.stderr)[-4000:]}")
    return out


def can_import_llama(python: str) -> bool:
    r = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True)
    if r.returncode:
        why = (r.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"skipped: {python} cannot import llama_cpp ({why})")
    return r.returncode == 0


def agreement(llm, peer, prompt: list[int], n: int) -> str:
    """'lead L/n, forced F/T': L, how many of the first `n` greedy tokens both engines pick; F, at how many
    of the T positions of prompt + moesaic's `n` tokens llama.cpp's argmax is moesaic's (teacher forcing:
    one early flip does not decide the rest)."""
    ours = moesaic_gen(llm)([prompt], n)[0]
    peer_greedy = peer.gen([prompt], n)[0]
    lead = next((i for i, (x, y) in enumerate(zip(ours, peer_greedy)) if x != y), n)
    seq = prompt + ours[:-1]
    forced = sum(a == b for a, b in zip(llm.score(seq).argmax(-1).tolist(), peer.gen([seq], 0)[0]))
    print(f"  greedy: moesaic {ours}\n          llama.cpp {peer_greedy}", flush=True)
    return f"lead {lead}/{n}, forced {forced}/{len(seq)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", help="a python with llama-cpp-python (and gguf, torch, transformers)")
    ap.add_argument("--converter", help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--models", default="mistral4,kimi_linear")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", type=int, default=8, help="greedy tokens compared (0: no check)")
    ap.add_argument("--workdir", help="keep the checkpoints and GGUF files here and reuse them")
    args = ap.parse_args()
    if not args.llama_python or not args.converter:
        print("skipped: give --llama-python (a python with llama-cpp-python) and --converter (its converter)")
        return
    if not can_import_llama(args.llama_python):
        return
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    n_ctx = args.prompt + max(args.new, args.check) + 8
    rows, version = [], None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        for name in args.models.split(","):
            folder = root / name
            if not (folder / "model.safetensors").exists():
                write_checkpoint(folder, MODELS[name] | SHAPE.get(name, {}), torch.bfloat16)
            prompt = torch.randint(3, VOCAB, (1, args.prompt), generator=g).tolist()
            agree = {}
            # float32 on both sides as well as bf16: in float32 only the order of sums differs
            for dtype, outtype in [("float32", "f32"), ("bfloat16", "bf16")] if args.check else []:
                gguf = convert(args.llama_python, args.converter, folder, name, outtype)
                llm = moesaic.LLM(str(folder), dtype=dtype)
                peer = LlamaChild(args.llama_python, gguf, args.threads, n_ctx, logits_all=True)
                print(f"{name} {outtype}:")
                agree[outtype] = agreement(llm, peer, prompt[0], args.check)
                peer.close()
                del llm
            gguf = convert(args.llama_python, args.converter, folder, name, "bf16")
            llm = moesaic.LLM(str(folder), dtype="bfloat16")
            ours, peer = moesaic_gen(llm), LlamaChild(args.llama_python, gguf, args.threads, n_ctx)
            version = peer.version
            best_ours = best_peer = 0.0
            for _ in range(args.repeats):  # one round each per repeat; the best round of each
                best_ours = max(best_ours, time_decode(ours, prompt, args.new, 1))
                best_peer = max(best_peer, time_decode(peer.gen, prompt, args.new, 1))
            peer.close()
            del llm
            rows.append((name, gguf.stat().st_size / 1e6, best_ours, best_peer, agree))
    print(f"\nllama-cpp-python {version}, {args.threads} thread(s), prompt {args.prompt}, {args.new} new")
    print(
        f"{'model':<12} {'bf16 MB':>8} {'moesaic tok/s':>13} {'llama.cpp tok/s':>15} {'ratio':>6}  agreement"
    )
    for name, mb, ours_tps, peer_tps, agree in rows:
        print(
            f"{name:<12} {mb:>8.0f} {ours_tps:>13.1f} {peer_tps:>15.1f} {ours_tps / peer_tps:>6.2f}  "
            + "; ".join(f"{k}: {v}" for k, v in agree.items())
        )


if __name__ == "__main__":
    main()

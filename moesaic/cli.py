"""The command line: `moesaic generate | inspect`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import MoesaicError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moesaic", description="Inference for hybrid and MoE frontier models.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text, streaming tokens")
    g.add_argument("--model", default="demo", help="checkpoint folder, or 'demo' (built-in, random weights)")
    g.add_argument("--prompt", default="Hello, moesaic!")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--device", default="cpu")
    g.add_argument("--precision", default=None, help='per-role weight dtypes, e.g. "router=bf16,expert=fp8"')
    parallel_flags(g)
    i = sub.add_parser("inspect", help="describe a checkpoint (config.json alone is enough)")
    i.add_argument("model")
    i.add_argument("--json", action="store_true")
    i.add_argument("--precision", default=None, help="show how this precision schedule resolves")
    parallel_flags(i)
    args = ap.parse_args(argv)
    try:
        return {"generate": _generate, "inspect": _inspect}[args.cmd](args)
    except MoesaicError as e:
        print(f"moesaic: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def parallel_flags(p) -> None:
    """-tp N / --enable-expert-parallel (generate, inspect; the server takes the same)."""
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N ranks (worker processes, or torchrun's; docs/parallel.md)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts by expert (E/N a rank) instead of by width",
    )


def _generate(args) -> int:
    from .config import is_demo
    from .engine.sampler import SamplingParams
    from .llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        precision=args.precision,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel,
    )
    if is_demo(llm.raw_config):
        print(
            f"[moesaic] demo model at {llm.path}: RANDOM weights (seed 0) and a byte tokenizer; "
            "the text below is noise, not a language model's answer.",
            file=sys.stderr,
        )
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            raise MoesaicError("--chat needs a tokenizer; this checkpoint has none")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    feed = llm.tokenizer.stream_decoder() if llm.tokenizer else (lambda t: f" {t}")
    t1 = time.perf_counter()
    first = None
    n = 0
    stream = llm.stream(prompt, params)
    for tok in stream:
        first = first or time.perf_counter()
        n += 1
        sys.stdout.write(feed(tok))
        sys.stdout.flush()
    t2 = time.perf_counter()
    decode_s = t2 - (first or t2)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    print(
        f"\n[moesaic] {n} tokens ({stream.finish_reason}); load {t1 - t0:.2f}s, "
        f"first token {((first or t2) - t1) * 1e3:.0f} ms, decode {rate:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def _inspect(args) -> int:
    from .inspect import format_text, inspect_checkpoint
    from .llm import resolve_model_path

    info = inspect_checkpoint(
        resolve_model_path(args.model),
        precision=args.precision,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel,
    )
    print(json.dumps(info, indent=1) if args.json else format_text(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

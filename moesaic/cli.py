"""The command line: `moesaic generate | inspect | serve`."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from .errors import MoesaicError


def _seed(text: str) -> int:
    """--seed: a 64-bit unsigned integer (what a torch generator takes)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v < 2**64:
        raise argparse.ArgumentTypeError(f"{text} is outside 0..2**64-1")
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moesaic", description="Inference for hybrid and MoE frontier models.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text, streaming tokens")
    g.add_argument(
        "--model",
        default="demo",
        help="checkpoint folder, or a demo name ('demo': the built-in model trained on Python's stdlib)",
    )
    g.add_argument("--prompt", default="def fibonacci(n):\n    ")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=_seed, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    model_flags(g)
    i = sub.add_parser("inspect", help="describe a checkpoint (config.json alone is enough)")
    i.add_argument("model")
    i.add_argument("--json", action="store_true")
    i.add_argument("--precision", default=None, help="show how this precision schedule resolves")
    i.add_argument("--expert-cache", default=None, help="plan expert streaming with a cache of SIZE")
    parallel_flags(i)
    s = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible HTTP server")
    s.add_argument(
        "model", nargs="?", default="demo", help="checkpoint folder, or a demo name (default: demo)"
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument(
        "--port", type=int, default=8000, help="port (0: any free port; the ready line says which)"
    )
    s.add_argument(
        "--api-key", nargs="+", action="extend", default=None, metavar="KEY", help="keys /v1 routes require"
    )
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", help="the model's name(s)")
    s.add_argument("--max-num-seqs", type=int, default=32)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    s.add_argument(
        "--max-cache-bytes", type=int, default=None, help="cache budget (default: from free memory)"
    )
    s.add_argument(
        "--chat-template", default=None, metavar="FILE", help="a Jinja chat template to use instead"
    )
    s.add_argument(
        "--tool-call-parser", default=None, metavar="NAME", help="output parser (default: by family)"
    )
    s.add_argument(
        "--reasoning-parser", default=None, metavar="NAME", help="the same parser, by its other flag"
    )
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to drain requests on a signal"
    )
    s.add_argument("--max-queued-requests", type=int, default=1024, help="requests in flight before 503")
    s.add_argument("--max-body-bytes", type=int, default=32 * 2**20, help="larger bodies get 413")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    model_flags(s)
    args = ap.parse_args(argv)
    try:
        if args.model == "":  # Path("") is the current directory: never open it by accident
            raise MoesaicError("an empty path names no checkpoint folder (--model / MODEL)")
        return {"generate": _generate, "inspect": _inspect, "serve": _serve}[args.cmd](args)
    except MoesaicError as e:
        print(f"moesaic: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`moesaic generate | head -c1`): stop quietly, as a SIGPIPE'd tool does.
        # Output still buffered for the closed pipe goes to /dev/null so that the exit flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def model_flags(p) -> None:
    """How the model loads (generate, serve): dtype, device, precision, expert streaming, drafting, ranks."""
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default=None, help='per-role weight dtypes, e.g. "router=bf16,expert=fp8"')
    p.add_argument(
        "--expert-cache", default=None, help='stream routed experts into a cache of SIZE ("8GiB", "10%%")'
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        '(methods: ngram, mtp, dspark, dflash with "model": a drafter folder)',
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: on CUDA, decode steps are replayed as graphs where the model allows (docs/gpu.md)",
    )
    parallel_flags(p)


def load_model(args, **engine):
    """The LLM that model_flags' arguments (and `engine`'s limits) describe."""
    from .llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        precision=args.precision,
        **engine,
        expert_cache=args.expert_cache,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel,
        cuda_graphs=False if args.enforce_eager else None,
    )


def say_random_demo(llm, noise: str) -> None:
    """The notice a demo with random weights gets (the text it writes is noise)."""
    print(
        f"[moesaic] demo model at {llm.path}: RANDOM weights (seed 0) and a byte tokenizer; {noise}",
        file=sys.stderr,
    )


def parallel_flags(p) -> None:
    """-tp N / --enable-expert-parallel (generate, inspect, serve)."""
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
    from .config import is_demo, is_trained_demo
    from .engine.sampler import SamplingParams

    t0 = time.perf_counter()
    llm = load_model(args)
    if is_demo(llm.raw_config):
        say_random_demo(llm, "the text below is noise, not a language model's answer.")
    elif is_trained_demo(llm.raw_config):
        print(
            f"[moesaic] trained demo at {llm.path}: a {llm.raw_config['moesaic_demo']['params'] / 1e6:.1f}M-"
            "parameter GLM-5.3-shaped model trained on Python's standard library (docs/train_demo.md)",
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
    spec = llm.stats()["speculative"]
    drafted = (
        f"; drafting ({spec['method']}): acceptance {spec['acceptance']:.0%}, tau {spec['tau']:.2f}"
        if spec is not None
        else ""
    )
    print(
        f"\n[moesaic] {n} tokens ({stream.finish_reason}); load {t1 - t0:.2f}s, "
        f"first token {((first or t2) - t1) * 1e3:.0f} ms, decode {rate:.1f} tokens/s{drafted}",
        file=sys.stderr,
    )
    return 0


def _serve(args) -> int:
    import logging
    from pathlib import Path

    from .config import is_demo
    from .errors import ConfigError

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    template = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template {args.chat_template}: no such file")
        template = path.read_text(encoding="utf-8")
    for flag, value in (
        ("--max-queued-requests", args.max_queued_requests),
        ("--max-body-bytes", args.max_body_bytes),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    llm = load_model(
        args,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_cache_bytes=args.max_cache_bytes,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if is_demo(llm.raw_config):
        say_random_demo(llm, "its answers are noise, not a language model's.")
    # The model and engine live as long as this process: their objects leave the cyclic GC's walks. A full
    # collection over a loaded model's ~180K objects took 59 ms (GLM-5.3's benchmark model), a stall of several
    # decode steps for every stream whenever the requests' garbage made one due.
    gc.collect()
    gc.freeze()
    from .server.main import serve

    names = args.served_model_name or [args.model]
    return serve(
        llm,
        host=args.host,
        port=args.port,
        api_keys=args.api_key,
        served_model_names=names,
        chat_template=template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        drain_timeout=args.shutdown_timeout,
        max_pending=args.max_queued_requests,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
    )


def _inspect(args) -> int:
    from .inspect import format_text, inspect_checkpoint
    from .llm import resolve_model_path

    info = inspect_checkpoint(
        resolve_model_path(args.model),
        precision=args.precision,
        expert_cache=args.expert_cache,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.enable_expert_parallel,
    )
    print(json.dumps(info, indent=1) if args.json else format_text(info))
    return 0


def run() -> None:
    """The `moesaic` command: main(), then the process's exit. Under torchrun a rank leaves without the
    interpreter's teardown once its output is flushed: destroying torch's process groups and stores there
    raced the other ranks going away, and under load a rank that had finished its work aborted
    (SIGABRT, "terminate called without an active exception") and failed the launch."""
    code = main()
    from .parallel import close_pools, under_torchrun

    if under_torchrun():
        close_pools()  # what atexit would run: the workers told to stop, the groups closed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()

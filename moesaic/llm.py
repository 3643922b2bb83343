"""The public API: `LLM(model, dtype, device)` with `generate`, `stream` and `score`, and `AsyncLLM` for
event loops. Both drive one engine core (engine/engine.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import os
import resource
import threading
from pathlib import Path

import torch

from . import parallel
from .cache.batch import ForwardBatch
from .demo import DEMO_NAME, DEMOS, default_drafter, ensure_demo, is_demo_name
from .engine.async_engine import AsyncEngine
from .engine.engine import Engine, EngineLimits, check_prompt
from .engine.output import CompletionOutput, RequestOutput
from .engine.sampler import SamplingParams
from .engine.sequence import Sequence
from .errors import CapacityError, CheckpointError, ConfigError, RequestError
from .models import Checkpoint
from .spec import build_proposer, parse_speculative_config
from .tokenizer import load_tokenizer
from .weights.dtypes import parse_dtype

log = logging.getLogger("moesaic")

__all__ = ["LLM", "AsyncLLM", "Stream", "RequestOutput", "CompletionOutput", "resolve_model_path"]


def resolve_model_path(model: str | Path) -> Path:
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ConfigError(
            f"model must be a checkpoint folder (a path) or a demo name, got {type(model).__name__} {model!r}"
        )
    if not model.strip():  # Path("") is Path("."): it would open the current folder
        raise CheckpointError(
            f"model {model!r} is an empty path, which names no checkpoint folder: give a folder or a demo "
            f"name ({', '.join(DEMOS)})"
        )
    if is_demo_name(model):
        return ensure_demo(model)
    path = Path(model)
    if not path.exists():
        raise CheckpointError(
            f"{model}: no such checkpoint folder (moesaic reads local folders only; "
            f"built-in demo models: {', '.join(DEMOS)})"
        )
    return path


def check_device(device) -> str:
    """The device name if this torch can run on it, else a ConfigError saying why."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {device!r} is not a device name (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: this torch build sees no CUDA device (use --device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported (cpu or cuda)")
    return str(dev)


def _status_bytes(field: str) -> int:
    """A byte count of /proc/self/status (Linux), e.g. RssAnon; 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return 0


def _peak_rss() -> int:
    """This process's peak resident bytes. VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a
    process started by a larger one would report its parent's peak."""
    return _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_parallel(tensor_parallel_size, expert_parallel, spec=None, expert_cache=None) -> None:
    """The parallel arguments, and what does not run on several ranks yet (speculative decoding, expert
    streaming), refused before the checkpoint is read."""
    if (
        not isinstance(tensor_parallel_size, int)
        or isinstance(tensor_parallel_size, bool)
        or tensor_parallel_size < 1
    ):
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    if not isinstance(expert_parallel, bool):
        raise ConfigError(f"expert_parallel must be true or false, got {expert_parallel!r}")
    if tensor_parallel_size > 1 and spec is not None:
        raise ConfigError(
            f"speculative decoding ({spec.method}) does not run tensor-parallel yet: drop speculative_config "
            f"or use tensor_parallel_size=1 (got {tensor_parallel_size})"
        )
    if tensor_parallel_size > 1 and expert_cache is not None:
        raise ConfigError(
            "expert streaming (expert_cache) does not run tensor-parallel yet: drop expert_cache or use "
            f"tensor_parallel_size=1 (got {tensor_parallel_size}); each rank holds 1/N of the experts instead"
        )


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def as_params(params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from what a caller gives: None, a SamplingParams, a dict of its fields,
    or a list / tuple of those (one per prompt)."""

    def one(p, where="params") -> SamplingParams:
        if p is None:
            return SamplingParams()
        if isinstance(p, SamplingParams):
            return p
        if isinstance(p, dict):
            return SamplingParams.from_dict(p)
        raise RequestError(
            f"{where} must be a SamplingParams, a dict of its fields or None (or a list of them, one per "
            f"prompt), got {type(p).__name__}"
        )

    if isinstance(params, (list, tuple)):
        plist = [one(p, f"params[{i}]") for i, p in enumerate(params)]
        if len(plist) != count:
            raise RequestError(
                f"{count} prompts but {len(plist)} SamplingParams: give one, or one per prompt"
            )
        return plist
    return [one(params)] * count


class Stream:
    """One request's tokens as they are sampled. Stepping happens while it is read: between reads its
    sequence is paused (not computed, and the first to be preempted when another request needs room),
    so a stream left unread does not hold the engine. Closing it, or dropping it, aborts the request."""

    def __init__(self, llm: LLM, seq: Sequence):
        self.llm = llm
        self.engine = llm.engine
        self.seq = seq
        self.sent = 0
        seq.paused = True

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    @property
    def text(self) -> str:
        """The text of the tokens so far (without a stop string)."""
        return self.seq.detok.visible(self.seq.finished)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> int:
        seq = self.seq
        with self.llm._lock:
            seq.paused = False
            try:
                while self.sent >= len(seq.output_ids):
                    if seq.error is not None:
                        raise seq.error
                    if seq.finished:
                        raise StopIteration
                    self.engine.step()
            except BaseException:
                self.close()
                raise
            finally:
                seq.paused = True
        self.sent += 1
        return seq.output_ids[self.sent - 1]

    def close(self) -> None:
        """Aborts the request if it has not finished (frees its state)."""
        if not self.seq.finished:
            self.engine.abort(self.seq)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class LLM:
    def __init__(
        self,
        model: str | Path = DEMO_NAME,
        dtype="bfloat16",
        device="cpu",
        max_num_seqs: int = 32,
        max_batch_tokens: int | None = None,
        max_state_bytes: int | None = None,
        precision: str | None = None,
        *,
        max_num_batched_tokens: int | None = None,
        max_cache_bytes: int | None = None,
        max_snapshot_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        expert_cache=None,
        expert_cache_policy: str = "lfru",
        expert_prefetch: bool = True,
        speculative_config: dict | str | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        cuda_graphs: bool | None = None,
        _rank=None,
    ):
        """precision: a precision schedule, e.g. "router=bf16,expert=fp8" (see moesaic/weights/precision.py).
        max_num_batched_tokens (old name max_batch_tokens): the tokens one step computes; max_cache_bytes:
        the paged cache and fixed state (default: a fraction of free memory, logged); max_state_bytes: an
        optional cap on the planner's worst case of the running requests (each reserved at admission).
        expert_cache: routed experts stay in the shards and are read on demand into a cache of at most
        this many bytes (an int, "8GiB", or "10%": room for that share of the experts; weights/experts.py), with
        policy "lru" or "lfru" and, unless expert_prefetch=False, the next layer's experts read ahead.
        speculative_config: drafting, off by default; {"method": "ngram" | "mtp" | "dspark" | "dflash",
        "num_speculative_tokens": k, "model": drafter folder (dflash, external dspark), "adaptive": true}
        or the same as a JSON string (moesaic/spec/__init__.py).
        tensor_parallel_size: the ranks the model is split over (worker processes spawned here, or
        torchrun's; docs/parallel.md); expert_parallel: routed experts split by expert (E/N a rank)
        instead of by width. cuda_graphs: decode steps replayed as CUDA graphs, one per batch bucket and
        context width, where the family allows (engine/graphs.py); None (default): on CUDA, False: never
        (vLLM's enforce_eager), True: also asks on a CPU, where the same static steps run eagerly. `_rank` is
        a worker's place in such a run (moesaic/parallel)."""
        # everything a caller can get wrong is checked before the checkpoint is read
        EngineLimits.checked(
            max_num_seqs,
            max_batch_tokens,
            max_num_batched_tokens,
            max_cache_bytes,
            max_snapshot_bytes,
            max_state_bytes,
            enable_prefix_caching,
        )
        parse_dtype(dtype)
        spec = parse_speculative_config(speculative_config)
        if precision is not None and not isinstance(precision, str):
            raise ConfigError(f"precision must be a string like 'router=bf16,expert=fp8', got {precision!r}")
        check_parallel(tensor_parallel_size, expert_parallel, spec, expert_cache)
        device = check_device(device)
        self.path = resolve_model_path(model)
        ckpt = Checkpoint.open(self.path)
        self.family, self.cfg, self.raw_config = ckpt.family, ckpt.cfg, ckpt.raw
        self.tokenizer = load_tokenizer(self.path, ckpt.store.config, self.cfg.eos_token_ids)
        self.expert_cache = None
        engine_args = dict(
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
            max_state_bytes=max_state_bytes,
            max_cache_bytes=max_cache_bytes,
            max_snapshot_bytes=max_snapshot_bytes,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.cuda_graphs = None if cuda_graphs is None else bool(cuda_graphs)
        self.rank = _rank
        if self.rank is None and tensor_parallel_size > 1:  # checks the split before any process starts
            self.rank = parallel.start(ckpt, tensor_parallel_size, expert_parallel, device)
        if self.rank is None:
            self.model = ckpt.build(
                dtype, device, precision, expert_cache, expert_cache_policy, expert_prefetch
            )
            self.expert_cache = ckpt.expert_cache
            self.load_stats = {"bytes_read": [ckpt.store.bytes_read]}
            self._engine(device, engine_args, None, spec)
        else:  # every rank runs this same code: rank 0 sends it to the workers as "load"
            device = self.rank.device
            args = dict(engine_args, dtype=dtype, device=device, precision=precision)
            with self.rank.command("load", type(self), (str(self.path),), args, self.rank.expert_parallel):
                self.model = parallel.build_model(ckpt, self.rank, dtype, device, precision)
                self.load_stats = self.rank.load_stats
                self._engine(device, engine_args, self.rank.lockstep(), None)
        self._lock = threading.RLock()  # generate / stream calls from several threads take turns

    def _engine(self, device, engine_args: dict, spmd, spec) -> None:
        self.dtype, self.device = self.model.dtype, device
        eos = set(self.cfg.eos_token_ids) | set(getattr(self.tokenizer, "eos_ids", ()) or ())
        if spec is not None and spec.method == "dflash" and spec.model is None and spec.proposer is None:
            drafter = default_drafter(self.path)  # the trained demo ships its DFlash drafter
            spec = spec if drafter is None else dataclasses.replace(spec, model=drafter)
        proposer = None if spec is None else build_proposer(self.family, self.model, self.cfg, spec)
        window = 0 if spec is None else spec.k + 1  # the rows a verify round may roll back, and one more
        graphs = self.cuda_graphs
        if self.expert_cache is not None and graphs is not False:  # experts paged in by host decisions
            if graphs:
                log.warning(
                    "moesaic: no CUDA graphs with streamed experts (the host picks each step's reads)"
                )
            graphs = False
        self.engine = Engine(
            self.model,
            eos,
            **engine_args,
            max_context=self.family.max_context(self.cfg),
            state_bytes=self.family.state_bytes(
                self.model.cfg, self.model.dtype.itemsize, window
            ),  # this rank's
            tokenizer=self.tokenizer,
            proposer=proposer,
            spec=spec,
            spmd=spmd,
            decode_graphs=graphs,
        )

    # ---- prompts
    def encode(self, prompt) -> list[int]:
        """Token ids of one prompt: text, or a list / tuple of token ids."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    f"the prompt is not valid Unicode: a lone surrogate {prompt[e.start]!r} at index {e.start}"
                ) from None
            if self.tokenizer is None:
                raise RequestError(f"{self.path} has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            for i, t in enumerate(prompt):
                if not _is_token(t):
                    raise RequestError(
                        f"a prompt of token ids holds integers only; item {i} is {type(t).__name__} {t!r}"
                    )
            return [int(t) for t in prompt]
        raise RequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def prompt_list(self, prompts) -> list:
        """The prompts of a generate call: one prompt (text or token ids) or an iterable of prompts."""
        if prompts is None:
            raise RequestError("the prompt is None: give text, a list of token ids, or a list of prompts")
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (bytes, bytearray)):
            raise RequestError("a prompt is text (str) or token ids, not bytes: decode the bytes first")
        if isinstance(prompts, (dict, set, frozenset)):  # iterating would take a dict's keys as prompts
            raise RequestError(
                f"prompts as a {type(prompts).__name__} are not accepted (no order to return outputs in): give "
                "text, a list of token ids, or a list / tuple of those"
            )
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)):
            if not hasattr(prompts, "__iter__"):
                raise RequestError(
                    f"prompts must be text, token ids, or a list of prompts; got {type(prompts).__name__}"
                )
            prompts = list(prompts)  # a generator of prompts
        if prompts and _is_token(prompts[0]):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    # ---- generation
    def generate(self, prompts, params=None) -> list[RequestOutput]:
        """Generates for every prompt together (continuous batching); outputs in prompt order, each with one
        CompletionOutput per sample (`n`). Calls from several threads take turns."""
        prompts = self.prompt_list(prompts)
        plist = as_params(params, len(prompts))
        seqs = [Sequence(self.encode(p), sp) for p, sp in zip(prompts, plist)]
        for s in seqs:  # every request is checked before any starts
            self.engine.check(s)
        with self._lock, self.engine.whole_batch():  # the call returns when all are done
            added = []
            try:
                for s in seqs:
                    self.engine.add(s)
                    added.append(s)
                while any(not g.finished for s in seqs for g in s.group):
                    self.engine.step()
            finally:  # an error must not leave this call's sequences in the engine
                for s in added:
                    if any(not g.finished for g in s.group):
                        self.engine.abort(s)
        for s in seqs:
            for g in s.group:
                if g.error is not None:
                    raise g.error
        return [self.engine.output(s) for s in seqs]

    def stream(self, prompt, params=None) -> Stream:
        """The token ids of one prompt as they are sampled (an iterator); its `finish_reason` is set once
        it is exhausted. Dropping or closing it before the end aborts the request."""
        (p,) = as_params(params, 1)
        if p.n != 1:
            raise RequestError(f"a stream yields one sample's tokens: n must be 1, got {p.n!r}")
        seq = Sequence(self.encode(prompt), p)
        with self._lock:
            self.engine.add(seq)
            return Stream(self, seq)

    def score(self, token_ids) -> torch.Tensor:
        """fp32 logits [T, vocab] of one full prefill of `token_ids` (or of a text's tokens)."""
        takes = "score takes one prompt: a list / tuple / 1-D tensor of token ids, or text"
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise RequestError(f"{takes}; got a {token_ids.dim()}-D {token_ids.dtype} tensor")
            token_ids = token_ids.tolist()
        if isinstance(token_ids, range):
            token_ids = list(token_ids)
        if isinstance(token_ids, str) and self.tokenizer is None:
            raise RequestError(f"{takes}; {self.path} has no tokenizer for the text {token_ids[:40]!r}")
        if not isinstance(token_ids, (str, list, tuple)):
            raise RequestError(f"{takes}; got {type(token_ids).__name__}")
        if token_ids and not isinstance(token_ids, str) and isinstance(token_ids[0], (list, tuple, str)):
            raise RequestError(f"{takes} (a batch of prompts is not scored together); got a list of prompts")
        ids = self.encode(token_ids)
        check_prompt(ids, self.cfg.vocab_size)
        if len(ids) > self.engine.max_context:
            raise CapacityError(f"{len(ids)} tokens exceed this model's context of {self.engine.max_context}")
        with self._lock, self._command("score", ids):
            state = self.model.new_state()
            return self.model.forward(ForwardBatch.build([(state, ids)], logits="all", device=self.device))

    def stats(self) -> dict:
        """The engine's counters (requests, tokens, prefix cache, preemptions, blocks, step times, and
        `speculative`: drafted, accepted, per-position acceptance, tau, target forwards; None when off), and
        the expert cache's (bytes read, hits and misses, prefetch, stall; ExpertCache.stats) under
        "expert_cache" when one is configured."""
        out = self.engine.stats()
        if self.expert_cache is not None:
            out["expert_cache"] = self.expert_cache.stats()
        return out

    # ---- tensor parallelism
    def _command(self, name: str, *args):
        return contextlib.nullcontext() if self.rank is None else self.rank.command(name, *args)

    def parallel_stats(self) -> dict:
        """Per rank (lists in rank order): bytes read from the checkpoint at load (and, tensor-parallel,
        held as weights), collectives since (count, seconds waited, bytes), peak resident memory (file
        pages of the mapped checkpoint included) and the private resident memory now (Linux; 0
        elsewhere). One rank: lists of one."""
        with self._command("stats"):
            group = None if self.rank is None else self.rank.group
            mine = {
                "collectives": 0 if group is None else group.stats["collectives"],
                "collective_seconds": 0.0 if group is None else group.stats["seconds"],
                "collective_bytes": 0 if group is None else group.stats["bytes"],
                "peak_rss_bytes": _peak_rss(),
                "anon_rss_bytes": _status_bytes("RssAnon"),
            }
            every = [mine] if group is None else group.gather(mine)
        return {**{k: [e[k] for e in every] for k in mine}, **self.load_stats}

    def close(self) -> None:
        """Frees this model on the workers of a tensor-parallel run (they stay up for the next LLM)."""
        rank, self.rank = getattr(self, "rank", None), None
        if rank is not None and rank.rank == 0:
            rank.drop()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class AsyncLLM:
    """`LLM` for asyncio: `add_request` returns an async iterator of incremental RequestOutputs; one
    background thread steps the engine. Takes LLM's arguments.

        llm = moesaic.AsyncLLM("demo")
        async for out in llm.add_request("hello", moesaic.SamplingParams(max_tokens=8)):
            print(out.outputs[0].text, end="")
    """

    def __init__(self, model: str | Path = DEMO_NAME, *args, **kwargs):
        self.llm = LLM(model, *args, **kwargs)
        self.tokenizer = self.llm.tokenizer
        self.engine = AsyncEngine(self.llm.engine)

    def add_request(self, prompt, params=None, request_id: str | None = None):
        if prompt is None:
            raise RequestError("the prompt is None: give text or a list of token ids")
        (p,) = as_params(params, 1)
        return self.engine.add_request(self.llm.encode(prompt), p, request_id)

    generate = add_request

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def stats(self) -> dict:
        out = self.engine.stats()
        if self.llm.expert_cache is not None:
            out["expert_cache"] = self.llm.expert_cache.stats()
        return out

    def shutdown(self, timeout: float = 30.0) -> None:
        self.engine.shutdown(timeout)

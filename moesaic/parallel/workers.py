"""Starting the ranks, the workers' loop, and how every rank's engine stays in step.

Launch. `LLM(model, tensor_parallel_size=N)` in a plain process spawns N - 1 workers
(torch.multiprocessing, start method "spawn"), joined by a TCPStore on 127.0.0.1; the process itself is
rank 0. The workers are kept (one pool per size and device kind) and serve every later LLM of that size,
so a second model does not spawn again. Under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, ... set) the
launcher's processes are the ranks, on one machine or several (`docs/parallel.md`): rank 0 returns from
`LLM(...)`; every other rank serves rank 0 inside that call and exits the process when rank 0 is done.

Lockstep (SPMD). Every rank runs the same engine (engine/engine.py) on the same inputs: before each step
rank 0 sends the requests added and aborted since the last one (and which streams are paused); after
the forward it sends the tokens it sampled; the workers never sample. Block tables, prefix cache,
snapshots and preemption are then identical on every rank by construction (the scheduler is
deterministic), with no mirroring code. `LLM.score` and loading are commands of the same kind.

A worker that dies makes rank 0's next collective fail at once (gloo) or at the timeout (NCCL), and the
LLM raises WorkerError naming the ranks' exit codes; a command that fails on a worker ends that worker
(its traceback on stderr), which rank 0 then reports the same way. Loading is checked on every rank: a
rank that cannot load reports its error to rank 0, which raises it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..engine.sequence import Sequence
from ..errors import ConfigError
from ..layers.moe import MoeWeights
from ..models import Checkpoint
from ..weights.bind import Tensors
from ..weights.contract import load_tensors
from ..weights.dtypes import parse_dtype
from ..weights.precision import PrecisionSchedule
from .comm import DEFAULT_TIMEOUT_S, Group, RowParallel, VocabParallel, WorkerError
from .plan import local_config, sharded_plan

log = logging.getLogger("moesaic")
STARTUP_S = 300.0  # a spawned worker that has not joined by then failed to start


def timeout_s() -> float:
    return float(os.environ.get("MOESAIC_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU, or one GPU per rank (cuda:k + r; under torchrun cuda:LOCAL_RANK)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "cpu"
    if under_torchrun():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return f"cuda:{(dev.index or 0) + rank}"


# ---------------------------------------------------------------- the pool of ranks (rank 0's side)


class Pool:
    """Rank 0's view of a run of `world` ranks: the group, and the spawned workers (none under torchrun).
    One command at a time: `lock` is held from a command's message to the end of rank 0's part of it."""

    def __init__(self, world: int, device: str):
        self.world, self.device = world, device
        self.lock = threading.RLock()
        self.procs: list = []
        self.keys = 0
        self.depth = 0  # commands in progress (nested: a load's engine, ...)
        self.dropped: list[int] = []  # keys of models to free on the workers
        if under_torchrun():
            store, rank, size = next(dist.rendezvous("env://"))
            if size != world:
                raise ConfigError(
                    f"tensor_parallel_size={world} but torchrun started WORLD_SIZE={size} processes: give "
                    "torchrun --nproc-per-node (x --nnodes) = tensor_parallel_size"
                )
            self.group = Group(store, rank, world, rank_device(device, rank), timeout_s())
            return
        store = dist.TCPStore(
            "127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=STARTUP_S), wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(
                target=_spawned,
                args=(r, world, store.port, rank_device(device, r), timeout_s(), torch.get_num_threads()),
                daemon=True,
                name=f"moesaic-tp{r}",
            )
            p.start()
            self.procs.append(p)
        self._wait_started(store)
        self.group = Group(store, 0, world, rank_device(device, 0), timeout_s())
        self.group.why_broken = self.exit_codes
        self.store = store

    def _wait_started(self, store) -> None:
        deadline = time.monotonic() + STARTUP_S
        for r, p in enumerate(self.procs, 1):
            while not store.check([f"started/{r}"]):
                if not p.is_alive() or time.monotonic() > deadline:
                    self.close()
                    raise WorkerError(
                        f"tensor parallelism: worker rank {r} did not start (exit code {p.exitcode}); "
                        "its error is on stderr"
                    )
                time.sleep(0.05)

    def exit_codes(self) -> str:
        dead = [f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return f" [{', '.join(dead)}]" if dead else ""

    @property
    def alive(self) -> bool:
        return self.group.broken is None and all(p.is_alive() for p in self.procs)

    def new_key(self) -> int:
        self.keys += 1
        return self.keys

    def close(self) -> None:
        """Tells the workers to stop and waits for them (briefly; then ends them). A broken group's
        workers are ended at once."""
        group = getattr(self, "group", None)
        clean = group is not None and group.broken is None
        if clean:
            with contextlib.suppress(Exception), self.lock:
                group.send(("exit",))
            group.broken = "tensor parallelism: the workers were stopped"
        for p in self.procs:
            p.join(timeout=10 if clean else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if group is not None:
            group.close()


_POOLS: dict[tuple[int, str], Pool] = {}


def pool_for(world: int, device: str) -> Pool:
    """The pool of `world` ranks on this device kind, started the first time (reused after)."""
    key = (world, torch.device(device).type)
    pool = _POOLS.get(key)
    if pool is not None and not pool.alive:
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[key] = Pool(world, device)
    return pool


@atexit.register
def close_pools() -> None:
    """Every pool's workers told to stop and its group closed (at exit, or before leaving without it)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


# ---------------------------------------------------------------- one LLM on every rank


class Rank:
    """One LLM's place in a tensor-parallel run: the group, the LLM's key on the workers, its device, and
    whether the routed experts are split by expert (expert_parallel) or by width."""

    def __init__(self, group: Group, key: int, expert_parallel: bool, pool: Pool | None = None):
        self.group, self.key, self.expert_parallel, self.pool = group, key, expert_parallel, pool
        self.rank, self.world, self.device = group.rank, group.world, str(group.device)
        self.load_stats: dict = {}
        self.failed_together = False  # set when every rank saw the same failure (a load they all report)

    @contextlib.contextmanager
    def command(self, name: str, *args):
        """Rank 0: sends the command to the workers and keeps the group until the block ends (the
        workers run the same code under the same command). On a worker: nothing to send. A command that
        fails on rank 0 alone leaves the workers out of step: their pool is ended (the next LLM starts
        new ones)."""
        pool = self.pool
        if pool is None:
            yield
            return
        with pool.lock:
            if pool.depth == 0:  # between commands: the models dropped since the last one
                while pool.dropped:
                    self.group.send(("unload", pool.dropped.pop()))
            self.group.send((name, self.key, *args))
            pool.depth += 1
            try:
                yield
            except BaseException:
                if not self.failed_together and self.group.broken is None:
                    self.group.broken = (
                        f"tensor parallelism: rank 0 failed during {name!r}; the workers were ended"
                    )
                    pool.close()
                raise
            finally:
                pool.depth -= 1

    def drop(self) -> None:
        """Rank 0: the workers free this model before the next command (never in the middle of one: this
        may run from a garbage collection inside a step)."""
        if self.pool is not None:
            self.pool.dropped.append(self.key)

    def lockstep(self) -> Lockstep:
        return Lockstep(self)


def start(ckpt: Checkpoint, world: int, expert_parallel: bool, device: str) -> Rank:
    """Rank 0 of a new tensor-parallel LLM: the plan checked (a ConfigError before any process starts),
    the ranks started or reused. Under torchrun on a rank other than 0, serves rank 0 and exits."""
    sharded_plan(ckpt, world, expert_parallel)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        store, rank, size = next(dist.rendezvous("env://"))
        if size != world:
            raise ConfigError(
                f"tensor_parallel_size={world} but torchrun started WORLD_SIZE={size} processes"
            )
        _serve_then_exit(Group(store, rank, size, rank_device(device, rank), timeout_s()))
    pool = pool_for(world, device)
    return Rank(pool.group, pool.new_key(), expert_parallel, pool)


def build_model(ckpt: Checkpoint, rank: Rank, dtype, device, precision):
    """This rank's model: its pieces of the weights (only they are read), the row- and vocabulary-parallel
    ones wrapped, every MoE block told how to sum over ranks; on the local config. Every rank reports
    whether it loaded; rank 0 raises the first error of any."""
    error = None
    try:
        dt = parse_dtype(dtype)
        if not isinstance(precision, PrecisionSchedule):
            precision = PrecisionSchedule.parse(precision)
        plan = sharded_plan(ckpt, rank.world, rank.expert_parallel)
        cfg = local_config(ckpt.family, ckpt.cfg, rank.world)
        loaded = load_tensors(plan, ckpt.store, dt, device, precision, rank.rank, rank.world)
        for name, t in loaded.items():
            shard, spec = plan.specs[name].shard, plan.specs[name]
            if shard is None:
                continue
            if spec.role in ("embedding", "lm_head"):
                loaded[name] = VocabParallel(t, rank.rank, spec.shape[0], rank.group)
            elif len(spec.shape) == 2 and shard.axis == 1:
                loaded[name] = RowParallel(t, rank.group)
        tensors = Tensors(loaded, plan.skipped_optional)
        model = ckpt.family.build(cfg, tensors, dt, device, ckpt.store.folder)
        tensors.check_all_taken()
        for w in _walk(model):
            if isinstance(w, MoeWeights):
                w.reduce = rank.group.all_reduce
                if rank.expert_parallel:
                    w.first_expert = rank.rank * w.experts_in.shape[0]
                if w.shared is not None and isinstance(w.shared.down, RowParallel):
                    w.shared.down = w.shared.down.local  # summed with the routed experts: one all-reduce
        stats = {
            "bytes_read": ckpt.store.bytes_read,
            "weight_bytes": sum(_nbytes(t) for t in loaded.values()),
        }
    except Exception as e:
        error = e
        stats = {"error": f"{type(e).__name__}: {e}"}
    every = rank.group.gather(stats)
    failed = [(r, s["error"]) for r, s in enumerate(every) if "error" in s]
    rank.failed_together = bool(failed)
    if failed and rank.rank != 0:
        raise LoadFailed(failed)  # every rank knows: they stop together
    if error is not None:
        raise error
    if failed:
        r, why = failed[0]
        raise WorkerError(f"tensor parallelism: rank {r} could not load the model: {why}")
    rank.load_stats = {k: [s[k] for s in every] for k in ("bytes_read", "weight_bytes")}
    return model


class LoadFailed(Exception):
    """A worker's side of a load that some rank could not do (rank 0 raises the error itself)."""


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    inner = getattr(t, "local", None)
    return _nbytes(inner) if inner is not None else getattr(t, "nbytes", 0)


def _walk(model):
    """The weight structures of a model: its attributes, and inside them lists, tuples, dicts and
    dataclasses (the bound layers), each once."""
    seen, todo = set(), list(vars(model).values())
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo += obj.values()
        elif isinstance(obj, (list, tuple)):
            todo += obj
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            yield obj
            todo += vars(obj).values()


# ---------------------------------------------------------------- the engine in lockstep


class Lockstep:
    """The hooks engine/engine.py calls when it runs on every rank. Rank 0 journals what changes the
    engine's inputs between steps (requests added and aborted, a prefix cache reset) and sends it with
    each step; a worker applies it before the same step; `share` carries rank 0's sampled tokens."""

    def __init__(self, rank: Rank):
        self.rank_ = rank
        self.rank = rank.rank
        self.journal: list = []
        self.seqs: dict[int, Sequence] = {}  # a worker's: rank 0's sequence id -> its own

    # rank 0
    def added(self, seq: Sequence) -> None:
        if self.rank == 0:
            # the workers never sample: a structured-output processor (a closure over a grammar) stays here
            params = dataclasses.replace(seq.params, logits_processor=None)
            self.journal.append(("add", seq.id, list(seq.prompt_ids), params, seq.request_id))

    def aborted(self, seq: Sequence) -> None:
        if self.rank == 0:
            self.journal.append(("abort", seq.group[0].id))

    def reset(self) -> None:
        if self.rank == 0:
            self.journal.append(("reset",))

    def turn(self, engine):
        """The context of one engine step on every rank (rank 0 sends it with what changed)."""
        journal, self.journal = self.journal, []
        paused = [s.id for s in list(engine.running) + list(engine.waiting) if s.paused and s.group[0] is s]
        return self.rank_.command("step", journal, paused)

    def share(self, outcomes: list) -> list:
        """Rank 0's sampled [(token, logprobs)] or failure per draw, on every rank (failures as text)."""
        sent = [
            RuntimeError(f"{type(o).__name__}: {o}") if isinstance(o, BaseException) else o for o in outcomes
        ]
        got = self.rank_.group.share(sent)
        return outcomes if self.rank == 0 else got

    def agree(self, budget: int) -> int:
        """The smallest of every rank's cache budget: all ranks plan the same blocks."""
        return min(self.rank_.group.gather(int(budget)))

    # a worker
    def apply(self, engine, journal: list, paused: list) -> None:
        for entry in journal:
            if entry[0] == "add":
                _, sid, prompt, params, request_id = entry
                seq = Sequence(prompt, params, request_id=request_id)
                engine.add(seq)
                self.seqs[sid] = seq
            elif entry[0] == "abort":
                seq = self.seqs.pop(entry[1], None)
                if seq is not None:
                    engine.abort(seq)
            else:
                engine.reset_prefix_cache()
        held = set(paused)
        for sid, seq in list(self.seqs.items()):
            if all(g.finished for g in seq.group):
                del self.seqs[sid]
            else:
                seq.paused = sid in held


# ---------------------------------------------------------------- a worker


def _spawned(rank: int, world: int, port: int, device: str, timeout: float, threads: int) -> None:
    """A spawned worker process: join rank 0's store and group, then serve."""
    torch.set_num_threads(max(1, threads))
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=STARTUP_S))
    store.set(f"started/{rank}", "1")
    _serve_then_exit(Group(store, rank, world, device, timeout))


def _serve_then_exit(group: Group) -> None:
    """A worker's life: serve until rank 0 says exit (or is gone), close the group, flush stdio, and end
    without the interpreter's teardown (a worker holds nothing else to clean up; see `Group.close`)."""
    serve(group)
    group.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(group: Group) -> None:
    """A worker's loop: rank 0's commands, in order, until "exit" or rank 0 is gone. The LLMs it holds
    are built by rank 0's own LLM class (sent with the "load" command), with this rank's place."""
    llms: dict = {}
    while True:
        try:
            msg = group.recv(wait_forever=True)
        except WorkerError:
            return  # rank 0 is gone
        name, args = msg[0], msg[1:]
        if name == "exit":
            return
        try:
            if name == "load":
                key, factory, fargs, fkwargs, expert_parallel = args
                try:
                    llms[key] = factory(*fargs, **fkwargs, _rank=Rank(group, key, expert_parallel))
                except LoadFailed:  # rank 0 raised it to its caller; the ranks stopped together
                    pass
            elif name == "step":
                key, journal, paused = args
                llm = llms[key]
                llm.engine.spmd.apply(llm.engine, journal, paused)
                llm.engine.step()
            elif name == "score":
                llms[args[0]].score(args[1])
            elif name == "stats":
                llms[args[0]].parallel_stats()
            elif name == "unload":
                llms.pop(args[0], None)
        except WorkerError:
            return
        except Exception:
            traceback.print_exc()
            print(
                f"moesaic tp rank {group.rank}: command {name!r} failed; this worker stops", file=sys.stderr
            )
            os._exit(1)

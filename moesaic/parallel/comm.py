"""The ranks of one tensor-parallel run and what crosses between them, on torch.distributed.

`Group` holds two process groups over the same ranks: `data` for the model's collectives (gloo on
the CPU, NCCL on CUDA: one GPU per rank) and `ctrl`, always gloo, for rank 0's messages (pickled
Python objects broadcast as bytes: the requests of each step, the tokens it sampled). Every
collective has a timeout, and one that fails (a rank died: gloo sees the closed connection at once;
or it hung past the timeout) marks the group broken and raises `WorkerError`, so a dead worker ends
the run with a clear error, never a hang. A worker waiting for rank 0's next message waits without
a deadline (rank 0 may be idle for hours); it learns of rank 0's death from the closed connection.

The weights that need a collective wrap this rank's piece and are used through `layers.linear`
(their `matmul`) and `layers.linear.embedding` (their `lookup`):

    RowParallel     x's columns are this rank's: local product, all-reduce (o_proj, down_proj, ...)
    VocabParallel   this rank's vocabulary rows: masked local lookup + all-reduce (embedding),
                    local logits + all-gather (lm_head; the same object when they are tied)
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import MoesaicError
from ..layers.linear import linear

DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer means a rank hung (MOESAIC_TP_TIMEOUT)
FOREVER = datetime.timedelta(days=365)  # a worker waiting for rank 0's next message


class WorkerError(MoesaicError):
    """A rank of a tensor-parallel run died or stopped answering; the run cannot go on."""


class Group:
    """This process's place among `world` ranks (rank 0 schedules and samples)."""

    def __init__(self, store, rank: int, world: int, device: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, world, self.timeout)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world, opts)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world, self.timeout)
        self.broken: str | None = None
        self.why_broken = None  # () -> str: what the launcher knows of its processes (exit codes)
        self.stats = {"collectives": 0, "seconds": 0.0, "bytes": 0}

    def close(self) -> None:
        """Stops both groups' threads now, while the peers' sockets are known (once, at the end of a
        run). Left to the interpreter's exit, the Gloo groups' teardown raced rank 0 and the workers going
        away: under load a rank aborted there (SIGABRT, "terminate called without an active
        exception") after its work was done."""
        for pg in (self.ctrl, self.data):
            with contextlib.suppress(Exception):
                pg.shutdown()
        self.broken = self.broken or "tensor parallelism: the group was closed"

    # ---- failures
    def _wait(self, work, what: str, nbytes: int = 0) -> None:
        if self.broken:
            raise WorkerError(self.broken)
        t0 = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as e:
            extra = self.why_broken() if self.why_broken else ""
            self.broken = (
                f"tensor parallelism: a rank stopped during {what} ({str(e).splitlines()[0][:200]}){extra}; "
                "this model cannot run any more: create the LLM again"
            )
            raise WorkerError(self.broken) from None
        self.stats["collectives"] += 1
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["bytes"] += nbytes

    def _check(self) -> None:
        if self.broken:
            raise WorkerError(self.broken)

    # ---- the model's collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `t` (every rank gets the same bits)."""
        self._check()
        t = t.contiguous()
        self._wait(self.data.allreduce([t]), "an all-reduce", t.numel() * t.element_size())
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape on every rank), in rank order."""
        self._check()
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(
            self.data.allgather([out], [t]), "an all-gather", t.numel() * t.element_size() * self.world
        )
        return out

    # ---- rank 0's messages
    def send(self, obj) -> None:
        """Rank 0: `obj` to every other rank (their `recv`)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        self._wait(self.ctrl.broadcast(n, 0, self.timeout), "a message to the workers")
        self._wait(self.ctrl.broadcast(data, 0, self.timeout), "a message to the workers")

    def recv(self, wait_forever: bool = False):
        """A worker: rank 0's next `send`."""
        n = torch.zeros(1, dtype=torch.int64)
        self._wait(self.ctrl.broadcast(n, 0, FOREVER if wait_forever else self.timeout), "rank 0's message")
        data = torch.empty(int(n), dtype=torch.uint8)
        self._wait(self.ctrl.broadcast(data, 0, self.timeout), "rank 0's message")
        return pickle.loads(data.numpy().tobytes())

    def share(self, obj):
        """Rank 0's `obj`, on every rank."""
        if self.rank == 0:
            self.send(obj)
            return obj
        return self.recv()

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._wait(self.ctrl.allgather([sizes], [n]), "a gather")
        most = int(max(int(s) for s in sizes))
        padded = torch.zeros(most, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(most, dtype=torch.uint8) for _ in range(self.world)]
        self._wait(self.ctrl.allgather([out], [padded]), "a gather")
        return [pickle.loads(o[: int(s)].numpy().tobytes()) for o, s in zip(out, sizes)]


class RowParallel:
    """A row-parallel weight [out, in / N]: this rank's input columns. The product of this rank's slice
    of x is a partial sum; the all-reduce makes the whole one, on every rank."""

    def __init__(self, local, group: Group):
        self.local, self.group = local, group
        self.shape = local.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(linear(x, self.local))


class VocabParallel:
    """An embedding or lm_head [vocab, d] split by vocabulary rows: this rank holds rows first..first+n
    (ceil(vocab / N) a rank, fewer on the last)."""

    def __init__(self, local: torch.Tensor, rank: int, vocab: int, group: Group):
        self.local, self.group, self.vocab = local, group, vocab
        self.size = -(-vocab // group.world)
        self.first = min(vocab, rank * self.size)
        self.shape = torch.Size((vocab, *local.shape[1:]))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids`: each rank looks up the ones it holds (zeros for the others); the sum is the table's."""
        n = self.local.shape[0]
        mine = (ids >= self.first) & (ids < self.first + n)
        rows = F.embedding((ids - self.first).clamp(0, max(n - 1, 0)), self.local)
        return self.group.all_reduce(rows * mine[:, None].to(rows.dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: this rank's columns, gathered."""
        y = linear(x, self.local)
        if y.shape[-1] < self.size:  # the last rank's shorter share, padded for the gather
            y = F.pad(y, (0, self.size - y.shape[-1]))
        parts = self.group.all_gather(y)
        widths = [
            min(self.vocab, (r + 1) * self.size) - min(self.vocab, r * self.size) for r in range(len(parts))
        ]
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

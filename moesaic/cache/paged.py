"""Paged token rows: the rows that grow one per token (MLA latent + rope key, DSA latent and index keys,
GQA K/V) of every sequence live in pages of BLOCK_SIZE tokens of one shared pool.

One block table per sequence serves all its paged layers: block id b addresses BLOCK_SIZE rows in every
paged layer. Layers whose rows have the same fields, widths and dtype share a pool tensor per field,
shaped [num_blocks, layers of that format, BLOCK_SIZE, width] (the page layout of FlashMLA-style
kernels, which read pages through the block table). `PagedRows` has TokenRows' interface, so a model
appends to it without knowing it is paged; the reference path gathers the sequence's pages back into
contiguous rows on every append (a copy per layer per step).

Which blocks a sequence holds, their reference counts and the prefix cache are the engine's
(engine/block_manager.py); this file only addresses memory.
"""

from __future__ import annotations

import os

import torch

from ..errors import CapacityError
from .state import LengthRollback, SequenceState, TokenRows

BLOCK_SIZE = 64


def free_memory(device="cpu") -> int:
    """Bytes free on the device now: CUDA's free memory, or the host's MemAvailable (what can be allocated
    without swapping, page cache included), else the available physical pages. The pool is sized from it,
    and expert streaming asks it whether the page cache can hold the experts."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class BlockTable:
    """A sequence's block ids, in token order (block i holds tokens i*BLOCK_SIZE ...), with the id
    tensor the paged layers index by, rebuilt only when the ids change."""

    def __init__(self, ids=()):
        self.ids: list[int] = list(ids)
        self._tensor: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def append(self, block: int) -> None:
        self.ids.append(block)
        self._tensor = None

    def replace(self, i: int, block: int) -> None:
        self.ids[i] = block
        self._tensor = None

    def clear(self) -> None:
        self.ids.clear()
        self._tensor = None

    def tensor(self, device) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self.ids, dtype=torch.long, device=device)
        return self._tensor


def row_format(rows: TokenRows) -> tuple:
    return tuple(rows.widths.items()), rows.dtype


class PagePool:
    """The pages of every paged layer. `layers[L] = (format, index of L among its format's layers)` for
    each paged layer L of the model's state (the top-level TokenRows of a fresh `new_state()`)."""

    def __init__(self, probe: SequenceState, num_blocks: int):
        self.num_blocks = num_blocks
        self.layers: dict[int, tuple[tuple, int]] = {}
        counts: dict[tuple, int] = {}
        device = None
        for L, layer in enumerate(probe.layers):
            if type(layer) is TokenRows:
                fmt = row_format(layer)
                self.layers[L] = (fmt, counts.get(fmt, 0))
                counts[fmt] = counts.get(fmt, 0) + 1
                device = layer.device
        self.device = device
        self.pools: dict[tuple, dict[str, torch.Tensor]] = {
            fmt: {
                k: torch.empty(num_blocks, n, BLOCK_SIZE, w, dtype=fmt[1], device=device) for k, w in fmt[0]
            }
            for fmt, n in counts.items()
        }
        self.bytes_per_token = sum(
            n * sum(w for _, w in fmt[0]) * fmt[1].itemsize for fmt, n in counts.items()
        )
        # each paged layer's views of its pool ({field: [num_blocks, BLOCK_SIZE, width]}), made once: the
        # sequences' PagedRows share them (a decode step writes and reads through them in every layer)
        self.views = {
            (fmt, index): {k: t[:, index] for k, t in self.pools[fmt].items()}
            for fmt, index in self.layers.values()
        }

    @staticmethod
    def paged_bytes_per_token(probe: SequenceState) -> int:
        """Bytes per token of the rows a pool would hold for states like `probe`."""
        return sum(
            sum(layer.widths.values()) * layer.dtype.itemsize
            for layer in probe.layers
            if type(layer) is TokenRows
        )

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * BLOCK_SIZE

    def page(self, state: SequenceState, table: BlockTable) -> SequenceState:
        """Replaces the (empty) top-level TokenRows of a fresh state by rows paged through `table`."""
        for L, (fmt, index) in self.layers.items():
            rows = state.layers[L]
            if type(rows) is not TokenRows or rows.length or row_format(rows) != fmt:
                raise ValueError(f"layer {L} of this state is not an empty {fmt} TokenRows")
            state.layers[L] = PagedRows(
                self.pools[fmt], index, table, rows.max_tokens, self.views[fmt, index]
            )
        return state

    def copy_block(self, src: int, dst: int) -> None:
        """Copies block src's rows of every paged layer into block dst (copy-on-write)."""
        for fields in self.pools.values():
            for t in fields.values():
                t[dst] = t[src]


class PagedRows(LengthRollback):
    """TokenRows' interface over pool pages: rows of position p live in block table[p // BLOCK_SIZE]
    at row p % BLOCK_SIZE of this layer's slice of the pool. The engine allocates the blocks before the
    forward that appends into them; `snapshot()` is just the length (the pages are shared through the
    block table, not copied)."""

    def __init__(
        self, fields: dict[str, torch.Tensor], index: int, table: BlockTable, max_tokens: int, views: dict
    ):
        self.fields = fields
        self.index = index
        self.views = views  # the pool's {field: fields[field][:, index]}, made once by the PagePool
        self.table = table
        self.max_tokens = max_tokens
        first = next(iter(fields.values()))
        self.widths = {k: t.shape[-1] for k, t in fields.items()}
        self.dtype = first.dtype
        self.device = first.device
        self.length = 0

    def append(self, **rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Writes the new rows into their pages; returns all rows held, gathered from the pages."""
        self.write(**rows)
        return self._gather(self.length)

    def pages(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        """This layer's views of the pool ({field: [num_blocks, BLOCK_SIZE, width]}, shared: not to be changed)
        and the ids of the blocks that hold rows 0..length in order: for a kernel that reads the rows in place
        (no gather)."""
        nb = -(-self.length // BLOCK_SIZE)
        return self.views, self.table.ids[:nb]

    def write(self, **rows: torch.Tensor) -> None:
        """Writes the new rows into their pages (append without the gather)."""
        n = next(iter(rows.values())).shape[0]
        end = self.length + n
        self._check(end)
        if n == 1:  # decode: one row, its place from Python ints (no index tensors built per step)
            block, offset = self.table.ids[self.length // BLOCK_SIZE], self.length % BLOCK_SIZE
            for k, r in rows.items():
                self.views[k][block, offset] = r[0]
        else:
            ids = self.table.tensor(self.device)
            pos = torch.arange(self.length, end, device=self.device)
            blocks, offsets = ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for k, r in rows.items():
                self.fields[k][blocks, self.index, offsets] = r.to(self.dtype)
        self.length = end

    def place(self, n: int) -> list[int]:
        """Where the next n rows go, block and row of each in one flat list, with write's checks; the length
        advanced: for a compiled call that writes the rows itself (kernels/cpu.py mla_block)."""
        end = self.length + n
        self._check(end)
        ids = self.table.ids
        where = [v for p in range(self.length, end) for v in (ids[p // BLOCK_SIZE], p % BLOCK_SIZE)]
        self.length = end
        return where

    def _check(self, end: int) -> None:
        if end > self.max_tokens:
            raise CapacityError(f"sequence would hold {end} tokens, more than the model's {self.max_tokens}")
        if end > len(self.table) * BLOCK_SIZE:
            raise RuntimeError(
                f"paged rows: {end} rows need {-(-end // BLOCK_SIZE)} blocks, the sequence holds "
                f"{len(self.table)} (the scheduler allocates blocks before the forward)"
            )

    def rows(self, *names: str) -> dict[str, torch.Tensor]:
        """The rows held of fields `names` (default: every field), gathered from the pages."""
        return self._gather(self.length, names)

    def rows_between(self, start: int, end: int, *names: str) -> dict[str, torch.Tensor]:
        """Rows [start, end) of fields `names` (end <= length), gathered from the blocks that hold them only."""
        b0, b1 = start // BLOCK_SIZE, -(-end // BLOCK_SIZE)
        ids = self.table.tensor(self.device)[b0:b1]
        off = start - b0 * BLOCK_SIZE
        return {
            k: self.fields[k][ids, self.index].reshape((b1 - b0) * BLOCK_SIZE, -1)[off : off + end - start]
            for k in names
        }

    def _gather(self, end: int, names=()) -> dict[str, torch.Tensor]:
        return self.rows_between(0, end, *(names or self.fields))

    @property
    def bufs(self) -> dict[str, torch.Tensor]:
        """The rows held, gathered (a copy: for code that reads TokenRows' buffers directly)."""
        return (
            self._gather(self.length)
            if self.length
            else {k: t.new_empty(0, t.shape[-1]) for k, t in self.fields.items()}
        )

    def snapshot(self) -> int:
        return self.length

    def snapshot_at(self, t: int) -> int:
        """The snapshot of its first t rows: t (the pages below the length are not written again)."""
        return self._held(t)

    def restore(self, length: int) -> None:
        if length > len(self.table) * BLOCK_SIZE:
            raise RuntimeError(f"paged rows: restoring {length} rows needs the blocks that hold them")
        self.length = length
        self._trim_memos()  # the pages hold what was written last: a memo is good up to the length

    mark = snapshot
    revert = restore

    @property
    def nbytes(self) -> int:
        return self.length * sum(self.widths.values()) * self.dtype.itemsize

"""Per-sequence state kinds and the container that holds one sequence's state for every layer.

Each kind supports the same four operations (DESIGN.md "State"): append during a forward,
`rollback(n)` that forgets the last n tokens exactly, `snapshot()`/`restore()` for prefix reuse,
and a byte size that the state planner can compute from the config before the model exists.

Snapshots of the row kinds (TokenRows, TailRows) are O(1): they keep references to the live buffers
and the kind copies its buffers before it would write over rows a snapshot holds (only after a
rollback). The engine takes one before every forward (`SequenceState.mark`) to make a failed step
undoable, and keeps some in its prefix cache; `restore` always copies, so a snapshot can be restored
into many states.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError
from ..kernels import cpu


class PoolMemo:
    """Rows derived from each complete pool of `size` held rows (GLM-5.3 DSA's pooled indexer keys), kept beside
    the rows so that a step computes only the pools it completed. Its holder (LengthRollback.memo) trims it
    whenever its length drops below the pools it covers; rows are written only past the length, so the pools
    kept are always those of the rows held."""

    def __init__(self, size: int):
        self.size = size
        self.buf: torch.Tensor | None = None
        self.count = 0  # pools held

    def trim(self, length: int) -> None:
        self.count = min(self.count, length // self.size)

    def extend(self, rows: torch.Tensor) -> None:
        """Appends the derived rows of pools count, count + 1, ... (capacity doubles)."""
        end = self.count + rows.shape[0]
        cap = 0 if self.buf is None else self.buf.shape[0]
        if end > cap:
            buf = rows.new_empty(max(end, 2 * cap, 16), rows.shape[1])
            if self.count:
                buf[: self.count] = self.buf[: self.count]
            self.buf = buf
        self.buf[self.count : end] = rows
        self.count = end

    def rows(self) -> torch.Tensor:
        return self.buf[: self.count]


class LengthRollback:
    """Rollback of a kind whose rows past `length` are ignored: forgetting n rows is free (TokenRows and
    cache/paged.py's PagedRows)."""

    length: int

    def can_rollback(self, n: int) -> bool:
        return 0 <= n <= self.length

    def rollback(self, n: int) -> None:
        if not self.can_rollback(n):
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.length -= n
        self._trim_memos()

    def _held(self, t: int) -> int:
        """t, where the first t rows are held (t <= length: rows below the length are never rewritten), for a
        snapshot at t tokens."""
        if not self.can_rollback(self.length - t):
            raise ValueError(f"no snapshot at {t} tokens: it holds {self.length}")
        return t

    def memo(self, key: str, size: int) -> PoolMemo:
        """This holder's PoolMemo `key` over pools of `size` rows, made on first use."""
        memos = self.__dict__.setdefault("memos", {})
        m = memos.get(key)
        if m is None or m.size != size:
            m = memos[key] = PoolMemo(size)
        return m

    def _trim_memos(self) -> None:
        for m in self.__dict__.get("memos", {}).values():
            m.trim(self.length)


class TokenRows(LengthRollback):
    """Rows that grow one per token (KV / latent caches): one growable buffer per field.

    Capacity doubles as tokens arrive, so appending n tokens is amortised O(n). rollback only
    moves the length: the forgotten rows are overwritten by the next append.
    """

    def __init__(self, widths: dict[str, int], dtype: torch.dtype, device, max_tokens: int):
        self.widths = widths
        self.dtype = dtype
        self.device = device
        self.max_tokens = max_tokens
        self.length = 0
        self.shared = 0  # rows [0, shared) of the buffers are also a snapshot's: copy before writing there
        self.bufs = {k: torch.empty(0, w, dtype=dtype, device=device) for k, w in widths.items()}

    def append(self, **rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Appends the new rows of every field; returns views of all rows held, old and new."""
        self.write(**rows)
        return self.rows()

    def write(self, **rows: torch.Tensor) -> None:
        """Appends the new rows of every field (append without the views: PagedRows' write)."""
        n = next(iter(rows.values())).shape[0]
        end = self.length + n
        if end > self.max_tokens:
            raise CapacityError(f"sequence would hold {end} tokens, more than the model's {self.max_tokens}")
        cap = next(iter(self.bufs.values())).shape[0]
        if end > cap or self.length < self.shared:
            new_cap = cap if end <= cap else min(max(end, 2 * cap, 16), max(end, self.max_tokens))
            for k, b in self.bufs.items():
                nb = torch.empty(new_cap, self.widths[k], dtype=self.dtype, device=self.device)
                nb[: self.length] = b[: self.length]
                self.bufs[k] = nb
            self.shared = 0
        for k, r in rows.items():
            self.bufs[k][self.length : end] = r
        self.length = end

    def rows(self, *names: str) -> dict[str, torch.Tensor]:
        """Views of the rows held of fields `names` (default: every field)."""
        return {k: self.bufs[k][: self.length] for k in names or self.bufs}

    def snapshot(self):
        self.shared = max(self.shared, self.length)
        return self.length, dict(self.bufs)

    def snapshot_at(self, t: int):
        """The snapshot of its first t rows."""
        self.shared = max(self.shared, self._held(t))
        return t, dict(self.bufs)

    def restore(self, snap) -> None:
        length, bufs = snap
        self.bufs = {k: b[:length].clone() for k, b in bufs.items()}
        self.length = length
        self.shared = 0
        self.__dict__.pop("memos", None)  # the rows are the snapshot's now: nothing derived from others stays

    def rows_between(self, start: int, end: int, *names: str) -> dict[str, torch.Tensor]:
        """Views of rows [start, end) of fields `names` (end <= length)."""
        return {k: self.bufs[k][start:end] for k in names}

    @property
    def nbytes(self) -> int:
        return self.length * sum(self.widths.values()) * self.dtype.itemsize


def can_rollback(state, n: int) -> bool:
    """Whether a state kind can forget its last n tokens. A kind without `can_rollback` (whose
    rollback is always exact, e.g. rows derived from another kind's) says yes."""
    check = getattr(state, "can_rollback", None)
    return True if check is None else check(n)


class SequenceState:
    """One sequence's state for every layer plus the count of tokens it has seen."""

    def __init__(self, layers: list):
        self.layers = layers
        self.num_tokens = 0

    def rollback(self, n: int) -> None:
        """Forgets the last n tokens in every layer, or (when any layer cannot) in none."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"cannot roll back {n} of {self.num_tokens} tokens")
        for i, layer in enumerate(self.layers):
            if layer is not None and not can_rollback(layer, n):
                raise ValueError(
                    f"cannot roll back {n} tokens: layer {i} keeps fewer (its speculative window is {getattr(layer, 'window', '?')})"
                )
        for layer in self.layers:
            if layer is not None:
                layer.rollback(n)
        self.num_tokens -= n

    def snapshot(self):
        return (self.num_tokens, [None if s is None else s.snapshot() for s in self.layers])

    @property
    def snapshots_inside(self) -> bool:
        """Whether every layer's kind can give its snapshot at a token inside a forward (`snapshot_at`), so
        that a prompt need not stop at each block boundary the prefix cache snapshots."""
        return all(s is None or hasattr(s, "snapshot_at") for s in self.layers)

    def want(self, points) -> None:
        """The token counts inside the next forward (past < t < past + n) whose snapshots `snapshot_at`
        will give: the kinds that drop or replace what they held (recurrent states, tail rows) keep them
        as the forward passes each."""
        for s in self.layers:
            if s is not None and hasattr(s, "want"):
                s.want(points)

    def snapshot_at(self, t: int):
        """The state's snapshot after its first t tokens: t its length, or a point `want` named before the
        forward that passed it (then `restore` of it continues from there, as if the forward had stopped)."""
        if t == self.num_tokens:
            return self.snapshot()
        return (t, [None if s is None else s.snapshot_at(t) for s in self.layers])

    def restore(self, snap) -> None:
        self.num_tokens, layer_snaps = snap
        for s, ls in zip(self.layers, layer_snaps):
            if s is not None:
                s.restore(ls)

    def mark(self):
        """What `revert` needs to undo the forwards after it (the engine's atomic step): per layer the
        kind's own `mark()` where it has one (O(1)), else its snapshot."""
        return (
            self.num_tokens,
            [None if s is None else (s.mark() if hasattr(s, "mark") else s.snapshot()) for s in self.layers],
        )

    def revert(self, mark) -> None:
        self.num_tokens, marks = mark
        for s, m in zip(self.layers, marks):
            if s is not None:
                s.revert(m) if hasattr(s, "revert") else s.restore(m)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers if s is not None)


def snapshot_nbytes(snap) -> int:
    """The memory a snapshot keeps alive: every tensor's storage once, plus the `nbytes` of state
    values (a KDA / Mamba-2 state) it holds."""
    seen, total, todo = set(), 0, [snap]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif hasattr(x, "nbytes") and not isinstance(x, (int, float)):
            total += int(x.nbytes)
    return total


class KeptInside:
    """`want` / `snapshot_at` of a kind that drops or replaces what it held as a forward goes on (tail rows and
    lookback ids as they append, recurrent states as layers/recurrent.py runs them): `mids` keep the snapshot at
    each wanted token count the forward passes (SequenceState.want)."""

    length: int

    def want(self, points) -> None:
        self.wants: tuple[int, ...] = tuple(points)
        self.mids: dict[int, object] = {}

    def snapshot_at(self, t: int):
        if t == self.length:
            return self.snapshot()
        if t not in self.mids:
            raise ValueError(f"nothing kept at {t} tokens (the forward that passed it was not asked)")
        return self.mids[t]


class RecurrentState(KeptInside):
    """A fixed-size per-sequence state (e.g. a Mamba-2 or KDA recurrent matrix and conv tail) that
    keeps the states after each of its last `window` tokens, so `rollback(n)` for n <= window is
    exact (the speculative window). `value` is any object with `clone()` and `nbytes`.

    A mixer updates it with `advance(new_value, snapshots, n)`, where snapshots are the states
    after each of the last `snapshots_needed(n)` new tokens (oldest first) and new_value is the
    state after all n. A mixer returns new values and never writes into the one it was given:
    the rollback history and the engine's step undo (`mark`/`revert`) keep references to it."""

    def __init__(self, initial, window: int = 0):
        self.window = window
        self.value = initial
        self.history: list = [initial]  # history[-1 - i] = state i tokens ago; at most window + 1 kept
        self.want(())

    def snapshot_at(self, t: int):
        """The value kept at t (it counts no tokens: SequenceState takes the current one as its snapshot)."""
        if t not in self.mids:
            raise ValueError(f"no state kept at {t} tokens (the forward that passed it was not asked)")
        return self.mids[t].clone()

    def snapshots_needed(self, n: int) -> int:
        """One per new token while n <= window (the state before them is already kept); for a
        longer forward the last window + 1, so that rollback(window) still reaches back."""
        return 0 if not self.window else (n if n <= self.window else self.window + 1)

    def advance(self, new_value, snapshots: list, n: int) -> None:
        if self.window:
            if len(snapshots) != self.snapshots_needed(n):
                raise ValueError(f"expected {self.snapshots_needed(n)} snapshots, got {len(snapshots)}")
            if n > self.window:  # older states are no longer reachable
                self.history = []
            self.history = (self.history + list(snapshots))[-(self.window + 1) :]
        else:
            self.history = [new_value]
        self.value = new_value

    def can_rollback(self, n: int) -> bool:
        return 0 <= n < len(self.history)

    def rollback(self, n: int) -> None:
        if n == 0:
            return
        if n >= len(self.history):
            raise ValueError(
                f"cannot roll back {n} tokens: this state keeps snapshots of the last "
                f"{len(self.history) - 1} (its speculative window is {self.window})"
            )
        self.history = self.history[: len(self.history) - n]
        self.value = self.history[-1]

    def snapshot(self):
        return self.value.clone()

    def restore(self, snap) -> None:
        self.value = snap.clone()
        self.history = [self.value]

    def mark(self):
        return self.value, list(self.history)

    def revert(self, mark) -> None:
        self.value, history = mark
        self.history = list(history)

    @property
    def nbytes(self) -> int:
        return self.value.nbytes * (1 + max(0, len(self.history) - 1))


class TailRows(KeptInside):
    """The rows of a sequence's last tokens only (a sliding-window ring, an open compressor group):
    per-token rows of the newest `keep` tokens, one buffer per field.

    `need` is how many of the newest rows the consumer reads back; keep = need + the rollback window,
    so `rollback(n)` is exact for n <= keep - need; it refuses larger n (unless it forgets every
    token) whatever it holds, so that every TailRows of one rollback window accepts the same n.
    `append` returns the rows held before it plus the new ones: positions `length - len(rows)` on.
    Storage is a buffer of 2·keep + 16 rows that is compacted into a fresh buffer when full (amortised
    O(1) a row; the old buffer stays intact for the snapshots that hold it)."""

    def __init__(self, widths: dict[str, int], dtype: torch.dtype, device, keep: int, need: int):
        if not 0 <= need <= keep:
            raise ValueError(f"TailRows needs 0 <= need ({need}) <= keep ({keep})")
        self.widths = widths
        self.dtype = dtype
        self.device = device
        self.keep = keep
        self.need = need
        self.length = 0  # tokens seen
        self.start = 0  # first held row in the buffers
        self.held = 0
        self.shared = 0  # buffer rows [0, shared) are also a snapshot's: never written in place again
        self.bufs = self._empty()
        self.want(())

    def _keep_mids(self, length: int, held: int, at: int, n: int, bufs) -> None:
        """The snapshots at the wanted points among n rows appended after `length` tokens, `held` rows
        held, the new rows at row `at` of `bufs` (the older held ones just before): each the rows held
        after its token, shared with bufs (never written in place again)."""
        for t in self.wants:
            r = t - length
            if 0 < r < n:
                h = min(self.keep, held + r)
                self.mids[t] = (t, at + r - h, h, dict(bufs))
                if bufs is self.bufs:
                    self.shared = max(self.shared, at + r)

    def _empty(self) -> dict[str, torch.Tensor]:
        cap = 2 * self.keep + 16
        return {k: torch.empty(cap, w, dtype=self.dtype, device=self.device) for k, w in self.widths.items()}

    def append(self, **rows: torch.Tensor) -> dict[str, torch.Tensor]:
        n = next(iter(rows.values())).shape[0]
        if self.room(n):  # write in place, return views
            first, at = self.claim(n)
            # one compiled call for every field's rows (a decode step makes ~17 of these appends on DeepSeek-V4)
            if not cpu.write_rows([self.bufs[k] for k in rows], at, list(rows.values())):
                for k, r in rows.items():
                    self.bufs[k][at : at + n] = r
            return {k: b[first : at + n] for k, b in self.bufs.items()}
        at = self.start + self.held
        out = {k: torch.cat([self.bufs[k][self.start : at], rows[k].to(self.dtype)]) for k in self.bufs}
        if self.wants:
            self._keep_mids(self.length, self.held, self.held, n, out)
        self.held += n
        keep = min(self.held, self.keep)
        self.bufs = self._empty()
        for k, v in out.items():
            self.bufs[k][:keep] = v[v.shape[0] - keep :]
        self.start, self.held, self.shared = 0, keep, 0
        self.length += n
        return out

    def room(self, n: int) -> bool:
        """Whether n more rows are written in place (`claim`), not through a fresh buffer."""
        at = self.start + self.held
        return at + n <= next(iter(self.bufs.values())).shape[0] and at >= self.shared

    def claim(self, n: int) -> tuple[int, int]:
        """append's bookkeeping for n rows written in place (`room(n)` first) by the caller, into every buffer's rows
        at .. at + n - 1: (first, at), where the rows append returns are the buffers' rows first .. at + n - 1."""
        first, at = self.start, self.start + self.held
        if self.wants:
            self._keep_mids(self.length, self.held, at, n, self.bufs)
        self.held += n
        self.length += n
        if self.held > self.keep:  # drop the oldest rows; they are overwritten by later appends
            self.start += self.held - self.keep
            self.held = self.keep
        return first, at

    def rows(self) -> dict[str, torch.Tensor]:
        """The held rows (positions length - held .. length - 1)."""
        return {k: b[self.start : self.start + self.held] for k, b in self.bufs.items()}

    def can_rollback(self, n: int) -> bool:
        return 0 <= n <= self.length and (n == self.length or n <= self.keep - self.need)

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        if n == self.length:
            self.length = self.start = self.held = 0
            return
        if n > self.keep - self.need:  # the same bound for every TailRows of one rollback window
            raise ValueError(
                f"cannot roll back {n} tokens: this state keeps {self.keep - self.need} rows "
                f"beyond what it reads (its speculative window)"
            )
        self.held = max(self.held - n, 0)
        self.length -= n

    def snapshot(self):
        self.shared = max(self.shared, self.start + self.held)
        return self.length, self.start, self.held, dict(self.bufs)

    def restore(self, snap) -> None:
        self.length, start, self.held, bufs = snap
        self.bufs = self._empty()
        for k, b in bufs.items():
            self.bufs[k][: self.held] = b[start : start + self.held]
        self.start = self.shared = 0

    @property
    def nbytes(self) -> int:
        return self.held * sum(self.widths.values()) * self.dtype.itemsize

    @staticmethod
    def nbytes_for(widths: dict[str, int], keep: int, dtype_bytes: int) -> int:
        """The most it holds, for the state planner."""
        return keep * sum(widths.values()) * dtype_bytes

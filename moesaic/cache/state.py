"""Per-sequence state kinds and the container that holds one sequence's state for every layer.

Each kind supports the same four operations (DESIGN.md "State"): append during a forward,
`rollback(n)` that forgets the last n tokens exactly, `snapshot()`/`restore()` for prefix reuse,
and a byte size that the state planner can compute from the config before the model exists.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError


class TokenRows:
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
        self.bufs = {k: torch.empty(0, w, dtype=dtype, device=device) for k, w in widths.items()}

    def append(self, **rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Appends the new rows of every field; returns views of all rows held, old and new."""
        n = next(iter(rows.values())).shape[0]
        end = self.length + n
        if end > self.max_tokens:
            raise CapacityError(f"sequence would hold {end} tokens, more than the model's {self.max_tokens}")
        cap = next(iter(self.bufs.values())).shape[0]
        if end > cap:
            new_cap = min(max(end, 2 * cap, 16), max(end, self.max_tokens))
            for k, b in self.bufs.items():
                nb = torch.empty(new_cap, self.widths[k], dtype=self.dtype, device=self.device)
                nb[: self.length] = b[: self.length]
                self.bufs[k] = nb
        for k, r in rows.items():
            self.bufs[k][self.length : end] = r
        self.length = end
        return {k: b[:end] for k, b in self.bufs.items()}

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.length -= n

    def snapshot(self):
        return {k: b[: self.length].clone() for k, b in self.bufs.items()}

    def restore(self, snap) -> None:
        self.bufs = {k: v.clone() for k, v in snap.items()}
        self.length = next(iter(snap.values())).shape[0]

    @property
    def nbytes(self) -> int:
        return self.length * sum(self.widths.values()) * self.dtype.itemsize


class SequenceState:
    """One sequence's state for every layer plus the count of tokens it has seen."""

    def __init__(self, layers: list):
        self.layers = layers
        self.num_tokens = 0

    def rollback(self, n: int) -> None:
        """Forgets the last n tokens in every layer."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"cannot roll back {n} of {self.num_tokens} tokens")
        for layer in self.layers:
            if layer is not None:
                layer.rollback(n)
        self.num_tokens -= n

    def snapshot(self):
        return (self.num_tokens, [None if s is None else s.snapshot() for s in self.layers])

    def restore(self, snap) -> None:
        self.num_tokens, layer_snaps = snap
        for s, ls in zip(self.layers, layer_snaps):
            if s is not None:
                s.restore(ls)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers if s is not None)


class RecurrentState:
    """A fixed-size per-sequence state (e.g. a Mamba-2 or KDA recurrent matrix and conv tail) that
    keeps the states after each of its last `window` tokens, so `rollback(n)` for n <= window is
    exact (the speculative window). `value` is any object with `clone()` and `nbytes`.

    A mixer updates it with `advance(new_value, snapshots, n)`, where snapshots are the states
    after each of the last `min(n, window)` new tokens (oldest first) and new_value is the state
    after all n."""

    def __init__(self, initial, window: int = 0):
        self.window = window
        self.value = initial
        self.history: list = [initial]  # history[-1 - i] = state i tokens ago; at most window + 1 kept
        self.seen = 0

    def snapshots_needed(self, n: int) -> int:
        return min(n, self.window)

    def advance(self, new_value, snapshots: list, n: int) -> None:
        if self.window:
            if len(snapshots) != min(n, self.window):
                raise ValueError(f"expected {min(n, self.window)} snapshots, got {len(snapshots)}")
            if n > self.window:  # older states are no longer reachable
                self.history = []
            self.history = (self.history + list(snapshots))[-(self.window + 1):]
        else:
            self.history = [new_value]
        self.value = new_value
        self.seen += n

    def rollback(self, n: int) -> None:
        if n == 0:
            return
        if n >= len(self.history):
            raise ValueError(f"cannot roll back {n} tokens: this state keeps snapshots of the last "
                             f"{len(self.history) - 1} (its speculative window is {self.window})")
        self.history = self.history[: len(self.history) - n]
        self.value = self.history[-1]
        self.seen -= n

    def snapshot(self):
        return (self.value.clone(), self.seen)

    def restore(self, snap) -> None:
        value, self.seen = snap
        self.value = value.clone()
        self.history = [self.value]

    @property
    def nbytes(self) -> int:
        return self.value.nbytes * (1 + max(0, len(self.history) - 1))

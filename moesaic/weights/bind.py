"""The loaded tensors of a model, bound by name into its typed weight structures once, at build time.

A family's `build` takes each tensor by its contract name (`t("model.norm.weight")`, or relative to a
prefix through `t.under("model.layers.3.")`) into the small dataclasses its blocks read (`MlaWeights`,
`MoeWeights`, ...). A forward then reads attributes and never looks a name up. The contract stays the
single source of names: asking for a name the load did not produce raises a CheckpointError at build,
and `check_all_taken` raises when a loaded tensor was bound by nothing (contract and binding disagree).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CheckpointError


class Tensors:
    def __init__(
        self, tensors: dict, optional_absent: Iterable[str] = (), prefix: str = "", _taken: set | None = None
    ):
        """tensors: name -> tensor as loaded; optional_absent: contract names that are optional and were
        not in the checkpoint (a model asking for one gets None)."""
        self._tensors = tensors
        self._absent = set(optional_absent)
        self.prefix = prefix
        self._taken = set() if _taken is None else _taken

    def __call__(self, name: str):
        """The tensor `prefix + name`; a CheckpointError when the load did not produce it."""
        full = self.prefix + name
        if full not in self._tensors:
            why = "an optional tensor this checkpoint lacks" if full in self._absent else "not loaded"
            raise CheckpointError(f"the model needs tensor {full!r}, {why}")
        self._taken.add(full)
        return self._tensors[full]

    def optional(self, name: str):
        """The tensor `prefix + name`, or None when it is absent."""
        full = self.prefix + name
        if full not in self._tensors:
            return None
        self._taken.add(full)
        return self._tensors[full]

    def has(self, name: str) -> bool:
        return self.prefix + name in self._tensors

    def any_under(self, prefix: str) -> bool:
        """Whether any loaded tensor's name starts with `self.prefix + prefix` (a block present at all)."""
        p = self.prefix + prefix
        return any(n.startswith(p) for n in self._tensors)

    def under(self, prefix: str) -> Tensors:
        """The same tensors, names taken relative to `self.prefix + prefix`."""
        return Tensors(self._tensors, self._absent, self.prefix + prefix, self._taken)

    def check_all_taken(self) -> None:
        left = sorted(n for n in self._tensors if n not in self._taken)
        if left:
            shown = ", ".join(left[:5]) + (f" (+{len(left) - 5} more)" if len(left) > 5 else "")
            raise CheckpointError(
                f"loaded tensors that no part of the model uses: {shown} (contract and model disagree)"
            )

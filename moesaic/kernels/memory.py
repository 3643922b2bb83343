"""CPU weight memory in 2 MiB pages (Linux transparent huge pages) where the system lends them.

A decode step reads every active weight once. In 4 KiB pages a 64 MB stream walks 16K page-table
entries, so the TLB misses all the way through; in 2 MiB pages it takes 32 entries. Measured on the
AVX2 machine (docs/perf.md, "Weights in huge pages"): one row against 16 bf16 weights of 8 MB each,
1.00-1.05x; whole batch-1 decode steps 0.99-1.03x, within that machine's spread.

Linux gives huge pages to anonymous memory by its THP mode (/sys/kernel/mm/transparent_hugepage/enabled):
`always` to every 2 MiB-aligned stretch, `madvise` (the usual default) only to ranges advised
MADV_HUGEPAGE, `never` to none. torch's allocator (malloc) never advises, and malloc's blocks are not
2 MiB aligned, so under `madvise` weights get none. `empty` maps its own private anonymous memory
instead, aligned to 2 MiB, and advises the whole 2 MiB pages of it (the tail past the last whole page
stays in 4 KiB pages: no memory is added beyond rounding to 4 KiB). The tensor owns the map: it is unmapped
when the last view of the tensor goes.

Tensors of SMALL bytes up to 2 MiB (a DSA layer's projections, an mHC site's fn, a KDA layer's low-rank gates)
are carved, page-aligned one after another, out of shared regions of ARENA bytes mapped the same way: alone,
none of them holds a whole huge page. A region is unmapped when the last view of every tensor carved from it
goes (and it is no longer the one being filled). On the Zen 4 core of docs/perf.md (thirtieth session) a
product over 786 KB matrices streamed 24.1 GB/s in 4 KiB pages and 26.1 in huge pages, and GLM-5.3's benchmark
model decoded 89.5-89.8 tok/s with its small weights in 4 KiB pages, 91.1-93.2 with them carved here.

Used for what the loader keeps (weights/contract.py), the stacks built from it (layers/linear.py
`stack_rows`) and the expert cache's slots. Tensors under SMALL bytes, other devices, `never`, systems without
THP and MOESAIC_HUGE_PAGES=0 get torch's own memory."""

from __future__ import annotations

import mmap
import sys
import threading

import torch

from . import env

HUGE = 2 << 20  # bytes in one huge page (x86-64, and arm64 with 4 KiB base pages)
SMALL = 64 << 10  # bytes from which a tensor under HUGE is carved out of a shared region
ARENA = 32 << 20  # bytes of one shared region
PAGE = 4096  # carved tensors start on their own 4 KiB page
_lock = threading.Lock()  # the region being filled (loads may run on several threads)
_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_state: dict = {}


def thp_mode() -> str | None:
    """The system's THP mode ('always', 'madvise', 'never'), None where there is none (not Linux)."""
    if "mode" not in _state:
        mode = None
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                with open(_MODE) as f:
                    text = f.read()
                mode = text[text.index("[") + 1 : text.index("]")]  # "always [madvise] never"
            except (OSError, ValueError):
                mode = None
        _state["mode"] = mode
    return _state["mode"]


def enabled() -> bool:
    """Weights go into huge pages: the system lends them and MOESAIC_HUGE_PAGES is not 0."""
    return env.flag("MOESAIC_HUGE_PAGES") and thp_mode() in ("always", "madvise")


def applies(nbytes: int, device=None) -> bool:
    """`empty` puts this many bytes on this device in huge-page memory (its own map from HUGE bytes, a carved
    slice of a shared region from SMALL)."""
    return nbytes >= SMALL and (device is None or torch.device(device).type == "cpu") and enabled()


def empty(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device), in huge-page memory where `applies`."""
    shape = tuple(shape)
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if not applies(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    if nbytes < HUGE:
        return _carve(shape, dtype, nbytes)
    return _map(shape, dtype, nbytes)


def _carve(shape: tuple, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A tensor of nbytes < HUGE at the next free page of the shared region being filled (a new one when it
    does not fit)."""
    with _lock:
        region, used = _state.get("arena", (None, 0))
        at = -(-used // PAGE) * PAGE
        if region is None or at + nbytes > region.numel():
            region, at = _map((ARENA,), torch.uint8, ARENA), 0
        _state["arena"] = (region, at + nbytes)
    return region[at : at + nbytes].view(dtype).view(shape)


def _map(shape: tuple, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A tensor in its own private anonymous map, 2 MiB-aligned, its whole huge pages advised."""
    # map one huge page more than the bytes so that a 2 MiB-aligned start lies inside; the slack before
    # it and after the bytes is never touched, so it costs address space only
    try:
        held = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space or map count left: torch's memory (the same tensor, 4 KiB pages)
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(held, dtype=torch.uint8)  # the tensor keeps `held` alive
    start = -raw.data_ptr() % HUGE
    whole = nbytes // HUGE * HUGE
    try:
        held.madvise(mmap.MADV_HUGEPAGE, start, whole)
    except OSError:  # a kernel that refuses the advice: the memory stays in 4 KiB pages
        pass
    return raw[start : start + nbytes].view(dtype).view(shape)


def cat_rows(ts: list) -> torch.Tensor:
    """torch.cat(ts) of tensors with the same trailing dims, into huge-page memory where `applies` (row stacks
    of streamed weights)."""
    out = empty((sum(t.shape[0] for t in ts), *ts[0].shape[1:]), ts[0].dtype, ts[0].device)
    return torch.cat(ts, out=out)


def stack(items: list, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """torch.stack(items), converted to `dtype` and moved to `device` in its one copy, into huge-page memory
    where `applies` (experts stacked at load straight out of the file mapping). An item may be a list of
    tensors, concatenated along rows first (an expert's gate | up)."""
    groups = [list(it) if isinstance(it, (list, tuple)) else [it] for it in items]
    if not groups or not groups[0]:
        raise ValueError("stack() of an empty list")
    shapes = [tuple(p.shape) for p in groups[0]]
    if any([tuple(p.shape) for p in g] != shapes for g in groups):
        raise ValueError(
            f"stack: items of one shape, got {[tuple(tuple(p.shape) for p in g) for g in groups]}"
        )
    t0 = groups[0][0]
    if len(shapes) > 1 and (t0.dim() == 0 or any(s[1:] != shapes[0][1:] for s in shapes)):
        raise ValueError(f"stack: parts concatenated along rows must agree past it, got {shapes}")
    item = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]
    out = empty(
        (len(groups), *item), t0.dtype if dtype is None else dtype, t0.device if device is None else device
    )
    for row, g in zip(out, groups):
        if len(g) == 1:
            row.copy_(g[0])
            continue
        at = 0
        for p in g:
            row[at : at + p.shape[0]].copy_(p)
            at += p.shape[0]
    return out


def copy_of(t: torch.Tensor, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """t.to(device=device, dtype=dtype, copy=True), contiguous, in huge-page memory where `applies`."""
    dtype = t.dtype if dtype is None else dtype
    device = t.device if device is None else torch.device(device)
    if not applies(t.numel() * dtype.itemsize, device):
        return t.to(device=device, dtype=dtype, copy=True)
    out = empty(t.shape, dtype, device)
    out.copy_(t)
    return out


def resident(t: torch.Tensor) -> torch.Tensor:
    """New memory of the caller's (a stack it just built, codes it just packed) moved into huge pages where
    `empty` applies (a copy); elsewhere t itself."""
    return copy_of(t) if applies(t.numel() * t.element_size(), t.device) else t


# glibc's malloc: keep freed memory for the next forward. By default it gives a block of more than a dynamic
# threshold (128 KB, rising with what is freed) back to the system by munmap, and the heap's free top by brk,
# so every prefill's activations are faulted in page by page again: ~10 % of a 256-token prefill's time in
# the kernel's page faults on one core (docs/perf.md, thirty-third session).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
KEEP_FREED = 1 << 30  # free bytes at the heap's top that malloc keeps instead of trimming
HEAP_BLOCKS = 32 << 20  # blocks up to this size come from the heap (glibc's own ceiling for its threshold)


def keep_freed_memory() -> bool:
    """Sets glibc malloc's trim and mmap thresholds (KEEP_FREED, HEAP_BLOCKS) once a process, so that a CPU
    forward reuses the memory the last one freed instead of faulting fresh pages in. The resident size then stays
    near the peak of the largest forward (as a GPU caching allocator's does). Not where malloc is not glibc's,
    where MOESAIC_KEEP_FREED=0, or where the user set any MALLOC_*_ variable (glibc's own tuning wins). True
    where the thresholds are set now or were before."""
    if "kept" not in _state:
        _state["kept"] = False
        if sys.platform.startswith("linux") and env.flag("MOESAIC_KEEP_FREED"):
            import ctypes
            import os

            if not any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
                try:
                    libc = ctypes.CDLL("libc.so.6")
                    mallopt = libc.mallopt
                except (OSError, AttributeError):  # not glibc (musl, say)
                    mallopt = None
                if mallopt is not None:
                    _state["kept"] = bool(
                        mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCKS) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREED)
                    )
    return _state["kept"]

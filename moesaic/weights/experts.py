"""Routed experts streamed from the checkpoint's shards into one bounded cache (issue 16).

With an expert cache configured, `load_tensors` leaves every `streamable` spec (a routed expert stack)
in its safetensors shard and puts an `ExpertStack` in its place. Nothing is converted or repacked:
each expert's tensors (dense rows, or a quantized weight's codes and scales, gate and up halves) are
byte ranges of the released files, located from the headers, and read on demand with `os.preadv`
from a small pool of threads (the call releases the GIL) into preallocated slots. No faulting mmap is
on this path: a page fault per 4 KiB measured ~40x slower than pread for experts (the peers' notes).

One `ExpertCache` serves the whole model: one byte budget over all layers. Its unit is one expert of
one MoE layer, all of its stacks together (gate|up and down, as colibri keeps them contiguous): the
two are always used together, every unit of a model has the same size, so the slots are equal and
preallocated without fragmentation, and hits and misses are counted per (layer, expert), the key a
routing trace replays. Policies: `lru`, and `lfru` (least frequently used, ties to the least
recently used, frequencies halved every 8 x slots accesses), which keeps the hot experts when the
cache is smaller than one token's working set (warp measured 29 % vs 5 % hits at a 3 % cache).

A layer's fetch pins its experts from issue to use; the reads of all of them go to the pool at
once (demand priority), and `run_experts` computes expert by expert as their reads land. A budget
smaller than the layer's working set still works: the fetch holds what fits and reads the rest as
earlier experts are consumed. Prefetch (layer L+1's router on layer L's input, issued by
layers/moe.py while layer L computes) reads at a lower priority into slots pinned until the next
layer's fetch consumes them or counts them wasted. Routing never depends on the cache: output is
bit-identical whatever its state.

Optional O_DIRECT: a start-up probe reads expert-sized records both ways (page cache evicted with
posix_fadvise before each) and keeps the faster (O_DIRECT helped on some drives and halved
throughput on others, colibri measured), buffered while the OS page cache could hold the experts.
O_DIRECT reads go through an aligned staging buffer. MOESAIC_EXPERT_DIRECT=1 / 0 forces the mode,
MOESAIC_EXPERT_THREADS the pool's size (default 4-8).

`FileRows` serves a `mapped` table the same way (V4.1's Engram rows): a row cache and reads through
the same pool, so a token's rows can be fetched before its first layer runs.

`replay` runs a recorded demand trace through the same policies (and Belady's MIN) at any capacity:
the benchmark checks it against the engine's own counters.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import mmap
import os
import queue
import re
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache.paged import free_memory
from ..errors import CheckpointError, ConfigError
from ..kernels import memory
from .dtypes import SAFETENSORS
from .precision import PACKED
from .quant import COMPANION_SUFFIXES, ConcatRows, load_quantized

POLICIES = ("lru", "lfru")
DEFAULT_POLICY = "lfru"
ALIGN = 4096  # O_DIRECT alignment (offsets, lengths and buffer addresses)
DEMAND, PREFETCH = 0, 1  # read priorities: demand reads always go first
ROW_CACHE_ROWS = 1 << 16  # rows kept per streamed table (V4.1 Engram rows are 264 B)

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({f"{u}b": v for u, v in list(_UNITS.items()) if u not in ("", "b")})
_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(size) -> int | float:
    """Bytes from an int or a size string ("8GiB", "512MB", "1.5G", "4096"); "10%" gives the fraction
    0.1 (room for that fraction of the model's routed experts, resolved when the cache knows them)."""
    if isinstance(size, bool):
        raise ConfigError(f"expert_cache {size!r}: give a byte count or a size such as '8GiB'")
    if isinstance(size, int):
        if size <= 0:
            raise ConfigError(f"expert_cache {size}: the budget must be positive")
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*", str(size))
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in _UNITS and unit != "%"):
        raise ConfigError(
            f"expert_cache {size!r}: not a size (e.g. 8GiB, 512MB, 10% of the expert bytes, or a byte count)"
        )
    value = float(m.group(1))
    if unit == "%":
        if not 0 < value <= 100:
            raise ConfigError(f"expert_cache {size!r}: a percentage must be in (0, 100]")
        return value / 100
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"expert_cache {size!r}: the budget must be positive")
    return n


# ---------------------------------------------------------------- policies (shared with `replay`)


class Lru:
    """Least recently used among the evictable entries."""

    def __init__(self, capacity: int):
        self.order: OrderedDict = OrderedDict()

    def touch(self, key) -> None:  # a demand access (before a miss inserts it)
        if key in self.order:
            self.order.move_to_end(key)

    def inserted(self, key) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def removed(self, key) -> None:
        self.order.pop(key, None)

    def victim(self, evictable):
        return next((k for k in self.order if evictable(k)), None)


class Lfru:
    """Least frequently used (demand accesses, halved every `age_every` accesses so that the counts
    follow the workload), ties broken by the least recent access. Frequencies outlive eviction, so a hot
    expert read again is protected at once. A heap with lazy deletion keeps eviction O(log n)."""

    def __init__(self, capacity: int):
        self.freq: dict = {}
        self.last: dict = {}
        self.clock = 0
        self.age_every = max(64, 8 * capacity)
        self.resident: set = set()
        self.heap: list = []

    def _push(self, key) -> None:
        heapq.heappush(self.heap, (self.freq.get(key, 0), self.last.get(key, -1), key))

    def touch(self, key) -> None:
        self.clock += 1
        self.freq[key] = self.freq.get(key, 0) + 1
        self.last[key] = self.clock
        if self.clock % self.age_every == 0:
            self.freq = {k: f // 2 for k, f in self.freq.items() if f > 1 or k in self.resident}
            self.heap = [(self.freq.get(k, 0), self.last.get(k, -1), k) for k in self.resident]
            heapq.heapify(self.heap)
        elif key in self.resident:
            self._push(key)

    def inserted(self, key) -> None:
        self.resident.add(key)
        self._push(key)

    def removed(self, key) -> None:
        self.resident.discard(key)

    def victim(self, evictable):
        skipped, found = [], None
        while self.heap:
            f, t, k = item = heapq.heappop(self.heap)
            if k not in self.resident or (f, t) != (self.freq.get(k, 0), self.last.get(k, -1)):
                continue  # stale
            if evictable(k):
                found = k
                heapq.heappush(self.heap, item)  # stays until `removed`
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found


class Belady:
    """Belady's MIN (replay only): evict the entry whose next use is farthest in the future."""

    def __init__(self, capacity: int):
        self.next_use: dict = {}
        self.resident: set = set()
        self.upcoming = None  # set by replay: the next use of the key being accessed now

    def touch(self, key) -> None:
        self.next_use[key] = self.upcoming

    def inserted(self, key) -> None:
        self.resident.add(key)

    def removed(self, key) -> None:
        self.resident.discard(key)

    def victim(self, evictable):
        best = None
        for k in self.resident:
            if evictable(k) and (best is None or self.next_use.get(k, -1) > self.next_use.get(best, -1)):
                best = k
        return best


def make_policy(name: str, capacity: int):
    if name == "lru":
        return Lru(capacity)
    if name == "lfru":
        return Lfru(capacity)
    raise ConfigError(f"expert_cache_policy {name!r}: one of {', '.join(POLICIES)}")


def replay(trace: list[list], capacity: int, policy: str) -> tuple[int, int]:
    """(hits, misses) of a demand trace (one list of keys per fetch, in the order the cache took them)
    at `capacity` slots, with the engine's fetch discipline: a fetch pins the keys it holds, holds as
    many as fit, and releases each after use, in order. policy: lru, lfru or min (Belady)."""
    flat = [k for group in trace for k in group]
    far = len(flat) + 1
    nxt, seen = [far] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i], seen[flat[i]] = seen.get(flat[i], far), i
    pol = Belady(capacity) if policy == "min" else make_policy(policy, capacity)
    pins: dict = {}
    hits = misses = i = 0
    for group in trace:
        pending, window = deque(group), deque()
        while pending or window:
            while pending:
                k = pending[0]
                if k not in pins:
                    if len(pins) >= capacity:
                        v = pol.victim(lambda x: pins[x] == 0)
                        if v is None:
                            break
                        del pins[v]
                        pol.removed(v)
                    pins[k] = 0
                    misses += 1
                    if isinstance(pol, Belady):
                        pol.upcoming = nxt[i]
                    pol.touch(k)
                    pol.inserted(k)
                else:
                    hits += 1
                    if isinstance(pol, Belady):
                        pol.upcoming = nxt[i]
                    pol.touch(k)
                pins[k] += 1
                i += 1
                window.append(pending.popleft())
            if not window:
                raise ValueError(f"replay: capacity {capacity} holds nothing")
            pins[window.popleft()] -= 1
    return hits, misses


# ---------------------------------------------------------------- the read pool (shared by every cache)


class _Job:
    """One read: `run(stage)` in a pool thread; `done` is set when it has finished, `error` set if it failed."""

    __slots__ = ("run", "cache", "done", "error", "claimed", "queued_prio")

    def __init__(self, run, cache):
        self.run, self.cache = run, cache
        self.done = threading.Event()
        self.error: Exception | None = None
        self.claimed = False
        self.queued_prio = None


class _Pool:
    def __init__(self, threads: int):
        self.q: queue.PriorityQueue = queue.PriorityQueue()
        self.seq = itertools.count()
        self.lock = threading.Lock()
        self.local = threading.local()
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, job: _Job, prio: int) -> None:
        """Queues `job` (again, at a higher priority, if it is queued lower and not started)."""
        with self.lock:
            if job.claimed or (job.queued_prio is not None and job.queued_prio <= prio):
                return
            job.queued_prio = prio
        self.q.put((prio, next(self.seq), job))

    def stage(self) -> memoryview:
        """This thread's aligned staging buffer for O_DIRECT reads (an anonymous map is page-aligned)."""
        buf = getattr(self.local, "stage", None)
        if buf is None:
            buf = self.local.stage = mmap.mmap(-1, STAGE_BYTES)
        return buf

    def _work(self) -> None:
        while True:
            _, _, job = self.q.get()
            with self.lock:
                if job.claimed:
                    continue
                job.claimed = True
            cache = job.cache
            cache._busy(+1)
            t0 = time.perf_counter()
            try:
                job.run()
            except CheckpointError as e:
                job.error = e
            except OSError as e:
                job.error = CheckpointError(f"reading streamed weights failed: {e}")
            except Exception as e:  # a bug must not kill the reader thread; the waiter raises it
                job.error = e
            finally:
                cache._busy(-1, time.perf_counter() - t0)
                job.done.set()


STAGE_BYTES = 8 << 20
_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            n = int(os.environ.get("MOESAIC_EXPERT_THREADS", "0")) or min(
                8, max(4, 2 * (os.cpu_count() or 1))
            )
            _pool = _Pool(n)
    return _pool


def _buffer(t: torch.Tensor, start: int, n: int):
    """A writable memoryview of bytes [start, start + n) of the contiguous uint8 tensor t."""
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr() + start)).cast("B")


# ---------------------------------------------------------------- shard files


class _Files:
    """The shard files the streamed tensors live in: one descriptor each (plus an O_DIRECT one when
    chosen), each read checked against the file as it is now: a shard that shrank, disappeared or was
    replaced gives a CheckpointError naming it (a shard put back unchanged is reopened)."""

    def __init__(self):
        self.paths: list[Path] = []
        self.index: dict[Path, int] = {}
        self.fds: list[int] = []
        self.direct_fds: list[int | None] = []
        self.headers: list[bytes] = []
        self.lock = threading.Lock()

    def add(self, path: Path) -> int:
        i = self.index.get(path)
        if i is None:
            fd = os.open(path, os.O_RDONLY)
            i = self.index[path] = len(self.paths)
            self.paths.append(path)
            self.fds.append(fd)
            self.direct_fds.append(None)
            self.headers.append(_header_bytes(fd, path))
        return i

    def open_direct(self) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        try:
            for i, p in enumerate(self.paths):
                if self.direct_fds[i] is None:
                    self.direct_fds[i] = os.open(p, os.O_RDONLY | flag)
        except OSError:
            return False
        return True

    def fd(self, i: int, end: int, direct: bool) -> int:
        """The descriptor of file i, checked to be the file at its path now and to hold bytes up to `end`."""
        path = self.paths[i]
        try:
            now = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"{path}: the shard was deleted or moved while serving; streamed experts are read from it "
                "(put it back)"
            ) from None
        st = os.fstat(self.fds[i])
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):  # replaced: reopen it if it is the same
            self._reopen(i)
            st = os.fstat(self.fds[i])
        if st.st_size < end:
            raise CheckpointError(
                f"{path}: the shard is {st.st_size} bytes but its header places streamed weights up to "
                f"byte {end}: it was truncated or rewritten while serving (restore the file)"
            )
        return self.direct_fds[i] if direct and self.direct_fds[i] is not None else self.fds[i]

    def _reopen(self, i: int) -> None:
        path = self.paths[i]
        with self.lock:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                raise CheckpointError(f"{path}: the shard was deleted or moved while serving") from None
            if (os.fstat(fd).st_ino, os.fstat(fd).st_dev) == (
                os.fstat(self.fds[i]).st_ino,
                os.fstat(self.fds[i]).st_dev,
            ):
                os.close(fd)  # another thread reopened it
                return
            if _header_bytes(fd, path) != self.headers[i]:
                os.close(fd)
                raise CheckpointError(f"{path}: the shard was replaced by a different file while serving")
            old, self.fds[i] = self.fds[i], fd
            os.close(old)
            if self.direct_fds[i] is not None:
                old_d, self.direct_fds[i] = self.direct_fds[i], os.open(path, os.O_RDONLY | os.O_DIRECT)
                os.close(old_d)

    def close(self) -> None:
        for fd in self.fds + [d for d in self.direct_fds if d is not None]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self.direct_fds = [], []


def _header_bytes(fd: int, path: Path) -> bytes:
    raw = os.pread(fd, 8, 0)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
    return raw + os.pread(fd, min(n, 100 << 20), 8)


def _read_exact(fd: int, dsts: list, offset: int, path: Path) -> None:
    """One contiguous file range from `offset` scattered into the buffers `dsts` (preadv), until all
    are full; a short read means the file ended early."""
    total, done = sum(len(d) for d in dsts), 0
    while done < total:
        got = os.preadv(fd, _skip(dsts, done), offset + done)
        if got <= 0:
            raise CheckpointError(
                f"{path}: read {done} of {total} bytes at offset {offset}: the shard ended early "
                "(truncated while serving?)"
            )
        done += got


def _skip(dsts: list, n: int) -> list:
    """The buffers `dsts` less their first n bytes."""
    out = []
    for d in dsts:
        if n >= len(d):
            n -= len(d)
            continue
        out.append(d[n:])
        n = 0
    return out


def _read_direct(fd: int, dsts: list, offset: int, path: Path, stage) -> None:
    """`_read_exact` through the aligned staging buffer: O_DIRECT wants aligned offsets, lengths and
    addresses, so the enclosing aligned range is read and the wanted bytes copied out."""
    end = offset + sum(len(d) for d in dsts)
    pos, out = offset - offset % ALIGN, 0
    view = memoryview(stage)
    while pos < end:
        want = min(STAGE_BYTES, -(-(end - pos) // ALIGN) * ALIGN)
        got = os.preadv(fd, [view[:want]], pos)
        lo, hi = max(offset, pos), min(end, pos + max(got, 0))
        if hi <= lo:
            raise CheckpointError(
                f"{path}: read ended at byte {pos + max(got, 0)} of {end}: the shard ended early "
                "(truncated while serving?)"
            )
        src = view[lo - pos : hi - pos]
        for d in _skip(dsts, out):  # scatter [lo, hi) into the buffers, from byte `out` of the range
            k = min(len(d), len(src))
            d[:k] = src[:k]
            src = src[k:]
            if not len(src):
                break
        out += hi - lo
        pos += want


# ---------------------------------------------------------------- what one expert is made of


@dataclass
class _Comp:
    """One checkpoint tensor (or one expert's slice of a fused [E, ...] one) of an expert."""

    name: str  # the checkpoint tensor's name
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: int
    start: int
    nbytes: int
    slot_off: int = 0


@dataclass
class _Layout:
    """Where expert e of a unit lies: contiguous file runs (file, offset, [(slot offset, bytes)] of the
    components the run holds, one preadv each), and per member stack its parts' components."""

    runs: list[tuple[int, int, list[tuple[int, int]]]]
    comps: list[list[list[_Comp]]]  # [member][part] -> components
    ends: dict  # per file, the end of the last byte read (checked against the file before each read)


class _Member:
    """One streamable spec (an expert stack) of a unit and how its experts are made, as load_tensors
    would make the whole stack: `kind` fused (one [E, ...] checkpoint tensor), stacked (one tensor per
    expert) or pairs (gate and up per expert, concatenated along rows)."""

    def __init__(self, spec, src, plan, store, target, want, packable, device):
        from .contract import _stack_any, _stack_pairs

        self.spec, self.name, self.plan, self.store = spec, spec.name, plan, store
        self.target, self.want, self.packable, self.device = target, want, packable, torch.device(device)
        self.E = spec.shape[0]
        if src.combine is None and len(src.parts) == 1:
            self.kind, self.per = "fused", 1
        elif src.combine is _stack_any and len(src.parts) == self.E:
            self.kind, self.per = "stacked", 1
        elif src.combine is _stack_pairs and len(src.parts) == 2 * self.E:
            self.kind, self.per = "pairs", 2
        else:
            raise CheckpointError(
                f"{spec.name}: expert streaming cannot read this naming's layout of the stack "
                f"({len(src.parts)} parts); run without expert_cache"
            )
        self.parts = src.parts
        self.shared: dict[str, torch.Tensor] = {}  # fused companions not split per expert (a scalar)
        self.keep_packed = packable and (want == "inherit" or want in PACKED)
        converts = self.device.type != "cpu" or want in PACKED
        for j in range(self.per):
            n = self.parts[j][0]
            fmt = plan.quantized.get(n)
            if fmt is None:
                converts |= SAFETENSORS[store.info(n).dtype] != target
            else:
                converts |= not self.keep_packed
        self.zero_copy = not converts  # its decoded experts are views of the slot: kept with it

    def part_names(self, e: int) -> list[str]:
        if self.kind == "fused":
            return [self.parts[0][0]]
        return [self.parts[e * self.per + j][0] for j in range(self.per)]

    def components(self, e: int, files: _Files) -> list[list[_Comp]]:
        out = []
        for n in self.part_names(e):
            fmt = self.plan.quantized.get(n)
            names = [n] if fmt is None else _quant_names(self.store, n)
            comps = []
            for cn in names:
                info = self.store.info(cn)
                dt = SAFETENSORS[info.dtype]
                if self.kind != "fused":
                    comps.append(_Comp(cn, dt, info.shape, files.add(info.file), info.start, info.nbytes))
                elif info.shape and info.shape[0] == self.E and info.nbytes % self.E == 0:
                    step = info.nbytes // self.E
                    f = files.add(info.file)
                    comps.append(_Comp(cn, dt, info.shape[1:], f, info.start + e * step, step))
                elif cn not in self.shared:  # one value for the whole stack: kept in memory
                    self.shared[cn] = self.store.get(cn).clone()
            out.append(comps)
        return out

    def decode(self, e: int, parts: list[list[_Comp]], slot: torch.Tensor):
        """Expert e as the fully loaded stack's `[e]` gives it, from its bytes in `slot`."""
        from .contract import _base, pack

        ws = []
        for n, comps in zip(self.part_names(e), parts):
            ts = dict(self.shared)
            for c in comps:
                raw = slot[c.slot_off : c.slot_off + c.nbytes]
                ts[c.name] = (
                    raw.view(c.dtype).view(c.shape) if c.nbytes else torch.empty(c.shape, dtype=c.dtype)
                )
            fmt = self.plan.quantized.get(n)
            if fmt is None:
                ws.append(ts[n])
                continue
            shape = self.parts[0][1][1:] if self.kind == "fused" else self.parts[0][1]
            q = load_quantized(_base(n), ts, fmt, self.plan.quant_config, names=ts, shape=shape)
            ws.append(q if self.keep_packed else q.dequantize(self.target))
        if self.kind != "pairs":
            w = ws[0]
        elif all(isinstance(t, torch.Tensor) for t in ws):
            w = torch.cat(ws)
        else:
            w = ConcatRows(ws)
        if isinstance(w, torch.Tensor):
            w = w.to(dtype=self.target)
            if self.want in PACKED and self.packable:
                w = pack(w, f"{self.name}[{e}]", self.want)
        if self.device.type != "cpu":
            w = w.to(self.device)
        return w


def _quant_names(store, n: str) -> list[str]:
    """A quantized weight's checkpoint tensors (codes and every companion present)."""
    from .contract import _base

    base = _base(n)
    return [f"{base}.{s}" for s in ("weight",) + COMPANION_SUFFIXES if f"{base}.{s}" in store]


class _Unit:
    """The experts of one MoE layer: its member stacks (gate|up, down), read and cached together."""

    def __init__(self, index: int, key: str, layer, E: int):
        self.index, self.key, self.layer, self.E = index, key, layer, E
        self.members: list[_Member] = []
        self.layouts: dict[int, _Layout] = {}
        self.nbytes = 0  # bytes of one expert (all members)
        self.slot_bound = 0  # slot bytes any expert's layout fits in
        self.prefetched: set[int] = set()  # experts whose prefetch read awaits this layer's fetch
        self.predicted: set[int] | None = None  # the last prediction for this layer (precision/recall)
        self.hits = self.misses = 0

    def layout(self, e: int, files: _Files) -> _Layout:
        lay = self.layouts.get(e)
        if lay is not None:
            return lay
        if not 0 <= e < self.E:
            raise IndexError(f"{self.key}: expert {e} out of range for {self.E} experts")
        comps = [m.components(e, files) for m in self.members]
        flat = sorted((c for mem in comps for part in mem for c in part), key=lambda c: (c.file, c.start))
        runs, cur = [], 0
        for c in flat:
            # every component 64-byte aligned in the slot, as a loaded stack's experts are: GEMM
            # results may depend on the operands' alignment (torch's CPU gemv does below 16 bytes)
            c.slot_off = cur = -(-cur // 64) * 64
            cur += c.nbytes
            if runs and runs[-1][0] == c.file and runs[-1][1] + sum(n for _, n in runs[-1][2]) == c.start:
                runs[-1][2].append((c.slot_off, c.nbytes))  # follows the previous one in its file
            else:
                runs.append((c.file, c.start, [(c.slot_off, c.nbytes)]))
        if cur > self.slot_bound:
            raise CheckpointError(
                f"{self.key}: expert {e} takes {cur} bytes, more than expert 0 ({self.slot_bound}); the "
                "experts of one layer must share their shapes and dtypes to be streamed"
            )
        ends: dict = {}
        for f, start, pieces in runs:
            ends[f] = max(ends.get(f, 0), start + sum(n for _, n in pieces))
        lay = self.layouts[e] = _Layout(runs, comps, ends)
        return lay


# ---------------------------------------------------------------- the cache


HELD, READ = 1, 2  # an entry pinned by a prediction: already resident, or read for it


class _Entry:
    """A resident (or arriving) expert: its slot, the pins holding it, its read."""

    __slots__ = ("key", "slot", "pins", "job", "prefetched", "decoded")

    def __init__(self, key, slot: int, job: _Job):
        self.key, self.slot, self.pins, self.job = key, slot, 0, job
        self.prefetched = 0  # HELD or READ while a prediction pins it
        self.decoded: list | None = None

    @property
    def ready(self) -> bool:
        return self.job.done.is_set()

    @property
    def failed(self) -> bool:
        return self.job.done.is_set() and self.job.error is not None


class ExpertCache:
    """The byte budget over every streamed expert of a model (see the module docstring).

    budget        bytes, a size string ("8GiB") or a share of the experts ("10%": room for 10 % of them)
    policy        lru | lfru
    prefetch      run the next MoE layer's router ahead and read its experts early
    direct        True / False: O_DIRECT reads or buffered; None: the start-up probe decides
    """

    def __init__(
        self, budget, policy: str = DEFAULT_POLICY, prefetch: bool = True, direct: bool | None = None
    ):
        self.budget_arg = parse_size(budget)
        if policy not in POLICIES:
            raise ConfigError(f"expert_cache_policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy_name = policy
        self.prefetch_enabled = bool(prefetch)
        if direct is None:  # MOESAIC_EXPERT_DIRECT=1 / 0 forces O_DIRECT / buffered reads
            direct = {"1": True, "0": False}.get(os.environ.get("MOESAIC_EXPERT_DIRECT", ""))
        self.direct_arg = direct
        self.files = _Files()
        weakref.finalize(self, self.files.close)
        self.units: dict[str, _Unit] = {}
        self.unit_list: list[_Unit] = []
        self.tables: list[FileRows] = []
        self.entries: dict[tuple[int, int], _Entry] = {}
        self.free: list[int] = []
        self.arena: torch.Tensor | None = None
        self.lock = threading.Lock()  # counters written by the read threads
        self.hook = None  # called as hook(cache) after every change of what is held (tests)
        self.trace: list | None = None  # set to [] to record every fetch's keys (benchmarks)
        self.direct = False
        self.probe: dict = {}
        self.ceiling_gbps = 0.0  # the probe's faster cold read rate
        self.prefetch_pins = 0
        self._active = 0
        self._busy_since = 0.0
        self.c = dict.fromkeys(
            (
                "hits",
                "misses",
                "bytes_read_demand",
                "bytes_read_prefetch",
                "bytes_wasted_prefetch",
                "prefetch_issued",
                "prefetch_used",
                "predicted",
                "predicted_used",
                "used",
                "read_seconds",
                "read_busy_seconds",
                "stall_seconds",
                "peak_resident",
            ),
            0,
        )

    # ---- built by load_tensors
    def add_stack(self, spec, src, plan, store, target, want, packable, device) -> ExpertStack:
        """The ExpertStack standing for streamable spec `spec` (its bytes stay in the shards)."""
        key = spec.name.rsplit(".", 1)[0]  # "...mlp.experts": the stacks of one layer share a unit
        unit = self.units.get(key)
        if unit is None:
            unit = self.units[key] = _Unit(len(self.unit_list), key, spec.layer, spec.shape[0])
            self.unit_list.append(unit)
        if unit.E != spec.shape[0] or self.arena is not None:
            raise CheckpointError(f"{spec.name}: {spec.shape[0]} experts where its layer has {unit.E}")
        member = _Member(spec, src, plan, store, target, want, packable, device)
        unit.members.append(member)
        return ExpertStack(self, unit, len(unit.members) - 1, torch.Size(spec.shape))

    def add_rows(self, info) -> FileRows:
        """A FileRows standing for a mapped table (Engram rows) stored as `info`."""
        rows = FileRows(self, info)
        self.tables.append(rows)
        return rows

    def finalize(self) -> None:
        """After load_tensors: sizes the slots, allocates them, probes the read mode."""
        for u in self.unit_list:
            comps = [m.components(0, self.files) for m in u.members]
            flat = [c for mem in comps for part in mem for c in part]
            u.nbytes = sum(c.nbytes for c in flat)
            u.slot_bound = u.nbytes + 64 * len(flat)
        self.expert_bytes = sum(u.nbytes * u.E for u in self.unit_list)
        if not self.unit_list:
            self.slot_bytes = self.slots = self.budget = 0
            return
        self.slot_bytes = -(-max(u.slot_bound for u in self.unit_list) // 64) * 64
        b, experts = self.budget_arg, sum(u.E for u in self.unit_list)
        # "10%": room for that share of the experts (one at least)
        self.budget = max(1, int(b * experts)) * self.slot_bytes if isinstance(b, float) else b
        self.slots = min(self.budget // self.slot_bytes, experts)
        if self.slots < 1:
            one = self.slot_bytes
            raise ConfigError(
                f"expert_cache of {self.budget} bytes holds no expert: one expert of a layer (all of its "
                f"stacks) needs a slot of {one} bytes ({one / 2**20:.2f} MiB); give at least that"
            )
        cuda = any(m.device.type == "cuda" for u in self.unit_list for m in u.members)
        size = self.slots * self.slot_bytes
        # pinned for copies to the GPU; on the CPU in huge pages (kernels/memory.py): the slots are streamed
        if cuda:
            self.arena = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            self.arena = memory.empty((size,), torch.uint8)
        self.free = list(range(self.slots - 1, -1, -1))
        self.policy = make_policy(self.policy_name, self.slots)
        self.max_prefetch_pins = self.slots // 2  # demand always finds room
        self._probe()

    def slot(self, i: int) -> torch.Tensor:
        return self.arena[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    # ---- reads
    def _read_job(self, unit: _Unit, lay: _Layout, slot: int) -> _Job:
        base = slot * self.slot_bytes
        direct, files, arena = self.direct, self.files, self.arena

        def run():
            for f, start, pieces in lay.runs:
                fd = files.fd(f, lay.ends[f], direct)
                dsts = [_buffer(arena, base + so, n) for so, n in pieces]
                if direct:
                    _read_direct(fd, dsts, start, files.paths[f], _get_pool().stage())
                else:
                    _read_exact(fd, dsts, start, files.paths[f])

        return _Job(run, self)

    def _busy(self, d: int, seconds: float = 0.0) -> None:
        with self.lock:
            now = time.perf_counter()
            if d > 0:
                if self._active == 0:
                    self._busy_since = now
                self._active += 1
            else:
                self._active -= 1
                self.c["read_seconds"] += seconds
                if self._active == 0:
                    self.c["read_busy_seconds"] += now - self._busy_since

    def _evictable(self, key) -> bool:
        e = self.entries[key]
        return e.pins == 0 and e.ready

    def _take_slot(self) -> int | None:
        """A free slot, or the policy's victim's; None when every slot is pinned or arriving."""
        if self.free:
            return self.free.pop()
        key = self.policy.victim(self._evictable)
        if key is None:
            return None
        entry = self.entries.pop(key)
        self.policy.removed(key)
        return entry.slot

    def _admit(self, unit: _Unit, e: int, slot: int, prio: int) -> _Entry:
        key = (unit.index, e)
        entry = _Entry(key, slot, self._read_job(unit, unit.layout(e, self.files), slot))
        self.entries[key] = entry
        self.policy.inserted(key)
        _get_pool().submit(entry.job, prio)
        self.c["peak_resident"] = max(self.c["peak_resident"], len(self.entries) * self.slot_bytes)
        return entry

    def _drop(self, entry: _Entry) -> None:
        """Forgets an entry whose read failed and frees its slot."""
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
            self.policy.removed(entry.key)
            self.free.append(entry.slot)

    def _unprefetch(self, unit: _Unit, e: int, entry: _Entry, used: bool) -> None:
        """Ends a prediction's pin: consumed by its layer's fetch (used) or not (wasted)."""
        if entry.prefetched == READ:
            if used:
                self.c["prefetch_used"] += 1
            else:
                self.c["bytes_wasted_prefetch"] += unit.nbytes
        entry.prefetched = 0
        entry.pins -= 1
        self.prefetch_pins -= 1
        unit.prefetched.discard(e)

    def _acquire(self, unit: _Unit, e: int) -> _Entry | None:
        """Pins expert e of `unit` for a demand use, reading it if absent; None when no slot is free now."""
        key = (unit.index, e)
        entry = self.entries.get(key)
        if entry is not None and entry.failed and entry.pins == (1 if entry.prefetched else 0):
            if entry.prefetched:  # a failed prefetch: read it again on demand
                self._unprefetch(unit, e, entry, used=False)
            self._drop(entry)
            entry = None
        if entry is None:
            slot = self._take_slot()
            if slot is None:
                return None
            self.policy.touch(key)
            entry = self._admit(unit, e, slot, DEMAND)
            unit.misses += 1
            self.c["misses"] += 1
            self.c["bytes_read_demand"] += unit.nbytes
        else:
            self.policy.touch(key)
            unit.hits += 1
            self.c["hits"] += 1
            if entry.prefetched:  # the prediction's pin becomes this use's
                self._unprefetch(unit, e, entry, used=True)
            if not entry.ready:
                _get_pool().submit(entry.job, DEMAND)  # a queued prefetch is now a demand read
        entry.pins += 1
        self._changed()
        return entry

    def _release(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.failed:
            self._drop(entry)
        self._changed()

    def _wait(self, entry: _Entry) -> None:
        job = entry.job
        if not job.done.is_set():
            t0 = time.perf_counter()
            job.done.wait()
            self.c["stall_seconds"] += time.perf_counter() - t0
        if job.error is not None:
            raise job.error

    def _wait_any_arriving(self) -> bool:
        """Waits for one unpinned read still in flight (released by a failed fetch); False if none."""
        for entry in self.entries.values():
            if entry.pins == 0 and not entry.ready:
                entry.job.done.wait()
                return True
        return False

    def _decoded(self, unit: _Unit, e: int, entry: _Entry, members: list[int]) -> list:
        if entry.decoded is None or len(entry.decoded) != len(unit.members):
            lay = unit.layout(e, self.files)
            slot = self.slot(entry.slot)
            ws = [m.decode(e, lay.comps[i], slot) for i, m in enumerate(unit.members)]
            if not all(m.zero_copy for m in unit.members):
                return [ws[i] for i in members]
            entry.decoded = ws
        return [entry.decoded[i] for i in members]

    def fetch(self, unit: _Unit, ids: list[int], members: list[int]) -> Fetch:
        ids = [int(e) for e in ids]
        if self.trace is not None:
            self.trace.append([(unit.index, e) for e in ids])
        used = set(ids)
        for e in sorted(unit.prefetched - used):  # predicted and pinned, not used: unpin
            self._unprefetch(unit, e, self.entries[(unit.index, e)], used=False)
        if unit.predicted is not None:
            self.c["predicted"] += len(unit.predicted)
            self.c["predicted_used"] += len(unit.predicted & used)
            self.c["used"] += len(used)
            unit.predicted = None
        return Fetch(self, unit, ids, members)

    def prefetch(self, unit: _Unit, ids: list[int]) -> None:
        """Pins the predicted experts `ids` of `unit` until that layer's fetch: those resident as they
        are, the others read at prefetch priority while slots allow (at most half the slots)."""
        ids = sorted({int(e) for e in ids})
        unit.predicted = set(ids)
        absent = []
        for e in ids:
            entry = self.entries.get((unit.index, e))
            if entry is None:
                absent.append(e)
            elif not entry.prefetched and not entry.failed and self.prefetch_pins < self.max_prefetch_pins:
                entry.prefetched = HELD
                entry.pins += 1
                self.prefetch_pins += 1
                unit.prefetched.add(e)
        for e in absent:
            if self.prefetch_pins >= self.max_prefetch_pins:
                break
            slot = self._take_slot()
            if slot is None:
                break
            entry = self._admit(unit, e, slot, PREFETCH)
            entry.prefetched = READ
            entry.pins += 1
            self.prefetch_pins += 1
            unit.prefetched.add(e)
            self.c["prefetch_issued"] += 1
            self.c["bytes_read_prefetch"] += unit.nbytes
        self._changed()

    def drop_predictions(self) -> None:
        """Ends every prediction's pin (a forward that failed before the predicted layers fetched)."""
        for unit in self.unit_list:
            for e in sorted(unit.prefetched):
                self._unprefetch(unit, e, self.entries[(unit.index, e)], used=False)
            unit.predicted = None
        self._changed()

    def _changed(self) -> None:
        if self.hook is not None:
            self.hook(self)

    # ---- start-up probe
    def _probe(self) -> None:
        """Buffered vs O_DIRECT reads of expert records, cold (their pages evicted first), issued
        through the pool in parallel as the forward issues them, two rounds each, interleaved, on
        distinct records; the best round of each. O_DIRECT is chosen only when it is 1.2x faster and
        the OS page cache could not hold the experts anyway (while it can, buffered reads of what
        this cache evicted come back from memory). The faster cold rate is the ceiling in stats()."""
        records = [(u, e) for u in self.unit_list for e in range(u.E)]
        per = max(1, min(self.slots, 8, (32 << 20) // self.slot_bytes))  # records in one measurement
        step = max(1, len(records) // (4 * per))
        sample = records[::step]
        want = self.direct_arg
        can_direct = want is not False and self.files.open_direct()
        if want and not can_direct:
            raise ConfigError("expert_cache direct=True: O_DIRECT is not available for these shards")
        modes = ["buffered", "direct"] if can_direct else ["buffered"]
        rates: dict[str, float] = {}
        for r in range(2):
            for i, mode in enumerate(modes):
                at = (2 * r + i) * per
                recs = sample[at : at + per] or sample[:per]
                rates[mode] = max(rates.get(mode, 0.0), self._probe_rate(recs, mode == "direct"))
        fits = self.expert_bytes < 0.5 * free_memory()
        if want is None:
            self.direct = can_direct and not fits and rates.get("direct", 0) > 1.2 * rates["buffered"]
        else:
            self.direct = bool(want)
        self.probe = {f"{k}_gbps": round(v, 3) for k, v in rates.items()}
        self.probe["page_cache_holds_experts"] = fits
        self.probe["mode"] = "direct" if self.direct else "buffered"
        self.ceiling_gbps = max(rates.values())

    def _probe_rate(self, recs, direct: bool) -> float:
        """GB/s of reading `recs` cold into the first slots, all at once through the pool."""
        for u, e in recs:
            for f, start, pieces in u.layout(e, self.files).runs:
                try:
                    os.posix_fadvise(
                        self.files.fds[f], start, sum(k for _, k in pieces), os.POSIX_FADV_DONTNEED
                    )
                except (AttributeError, OSError):
                    pass
        saved, self.direct = self.direct, direct
        jobs = [self._read_job(u, u.layout(e, self.files), i) for i, (u, e) in enumerate(recs)]
        self.direct = saved
        t0 = time.perf_counter()
        for job in jobs:
            _get_pool().submit(job, DEMAND)
        for job in jobs:
            job.done.wait()
            if job.error is not None:
                raise job.error
        t = time.perf_counter() - t0
        self.c["read_seconds"] = self.c["read_busy_seconds"] = 0  # not the workload's reads
        return sum(u.nbytes for u, _ in recs) / t / 1e9 if t > 0 else 0.0

    # ---- counters
    def resident_bytes(self) -> int:
        """Bytes of slots holding (or receiving) an expert."""
        return len(self.entries) * self.slot_bytes

    def pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins > 0)

    def stats(self) -> dict:
        c = self.c
        hits, misses = c["hits"], c["misses"]
        read = c["bytes_read_demand"] + c["bytes_read_prefetch"]
        busy = c["read_busy_seconds"]
        out = {
            "policy": self.policy_name,
            "prefetch": self.prefetch_enabled,
            "io": self.probe.get("mode"),
            "budget_bytes": self.budget,
            "slot_bytes": self.slot_bytes,
            "slots": self.slots,
            "experts": sum(u.E for u in self.unit_list),
            "expert_bytes": self.expert_bytes,
            "expert_bytes_each": max((u.nbytes for u in self.unit_list), default=0),
            "resident_bytes": self.resident_bytes(),
            "peak_resident_bytes": c["peak_resident"],
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "per_layer": {
                u.layer: {"hits": u.hits, "misses": u.misses, "expert_bytes_each": u.nbytes}
                for u in self.unit_list
            },
            "expert_bytes_read": read,
            "bytes_read_demand": c["bytes_read_demand"],
            "bytes_read_prefetch": c["bytes_read_prefetch"],
            "bytes_wasted_prefetch": c["bytes_wasted_prefetch"],
            "prefetch_issued": c["prefetch_issued"],
            "prefetch_used": c["prefetch_used"],
            "prefetch_precision": c["predicted_used"] / c["predicted"] if c["predicted"] else None,
            "prefetch_recall": c["predicted_used"] / c["used"] if c["used"] else None,
            "read_seconds": c["read_seconds"],
            "read_busy_seconds": busy,
            "stall_seconds": c["stall_seconds"],
            "read_gbps": read / busy / 1e9 if busy > 0 else None,
            "read_vs_probe": read / busy / 1e9 / self.ceiling_gbps
            if busy > 0 and self.ceiling_gbps
            else None,
            "probe": dict(self.probe),
        }
        if self.tables:
            out["rows"] = {
                "tables": len(self.tables),
                "hits": sum(t.hits for t in self.tables),
                "misses": sum(t.misses for t in self.tables),
                "bytes_read": sum(t.bytes_read for t in self.tables),
                "prefetch_jobs": sum(t.prefetched for t in self.tables),
                "stall_seconds": sum(t.stall_seconds for t in self.tables),
            }
        return out

    def reset_counters(self) -> None:
        for k in self.c:
            self.c[k] = 0
        for u in self.unit_list:
            u.hits = u.misses = 0
        for t in self.tables:
            t.hits = t.misses = t.bytes_read = t.prefetched = 0
            t.stall_seconds = 0.0

    def close(self) -> None:
        self.files.close()

    # ---- linking a built model
    def link(self, model) -> None:
        """Points each MoE layer of `model` (its `layers`, in order) at the next one for prefetch, and
        lets the Engram hasher fetch a token's rows before the first layer. Duck-typed: a layer's
        attribute with streamed `experts_in` is a MoE layer; `layer.engram.table` a streamed table."""
        moes, tables = [], []
        for layer in getattr(model, "layers", []):
            for v in vars(layer).values():
                if hasattr(getattr(v, "experts_in", None), "fetch"):
                    moes.append(v)
                table = getattr(v, "table", None)
                if table is not None and hasattr(getattr(table, "weight", None), "read_rows"):
                    tables.append(table)
        if self.prefetch_enabled:
            for a, b in zip(moes, moes[1:]):
                a.next_moe = b
        hasher = getattr(model, "hasher", None)
        if hasher is not None and tables and self.prefetch_enabled:

            def on_rows(rows: torch.Tensor) -> None:  # [T, tables, n_hash]
                for j, table in enumerate(tables):
                    for t in (table.weight, table.scale):
                        if t is not None and hasattr(t, "prefetch"):
                            t.prefetch(rows[:, j])

            hasher.on_rows = on_rows


class Fetch:
    """The experts one layer uses, in ascending id. Iterating yields (e, [weights of the members asked])
    as each read lands; an expert is pinned from its read until the next one is taken. The reads of
    all that fit are issued at construction, the rest as earlier ones are released. Use it in a `with`
    block: leaving it releases every pin, whatever happened."""

    def __init__(self, cache: ExpertCache, unit: _Unit, ids: list[int], members: list[int]):
        self.cache, self.unit, self.members = cache, unit, members
        self.pending = deque(ids)
        self.window: deque = deque()
        self.current: _Entry | None = None
        self._fill()

    def _fill(self) -> None:
        while self.pending:
            entry = self.cache._acquire(self.unit, self.pending[0])
            if entry is None:
                if self.window or self.current is not None:
                    break
                if not self.cache._wait_any_arriving():  # only reads in flight hold the slots
                    raise RuntimeError(f"expert cache: every slot is pinned, {self.unit.key} cannot run")
                continue
            self.window.append((self.pending.popleft(), entry))

    def __enter__(self) -> Fetch:
        return self

    def __iter__(self) -> Fetch:
        return self

    def __next__(self):
        if self.current is not None:
            self.cache._release(self.current)
            self.current = None
            self._fill()
        if not self.window:
            raise StopIteration
        e, self.current = self.window.popleft()
        self.cache._wait(self.current)
        return e, self.cache._decoded(self.unit, e, self.current, self.members)

    def __exit__(self, *exc) -> None:
        if self.current is not None:
            self.cache._release(self.current)
            self.current = None
        while self.window:
            self.cache._release(self.window.popleft()[1])
        self.pending.clear()
        if exc[0] is not None:  # the forward fails here: the layers its predictions were for will not run
            self.cache.drop_predictions()


class ExpertStack:
    """A routed expert stack [E, ...] left in the shards. `stack[e]` is expert e exactly as the loaded
    stack's `[e]` (a dense tensor, a QuantizedTensor, or a ConcatRows of gate and up) -- an owned copy;
    the MoE path uses `fetch`, whose weights are views of the cache's slots while pinned."""

    def __init__(self, cache: ExpertCache, unit: _Unit, member: int, shape: torch.Size):
        self.cache, self.unit, self.member, self.shape = cache, unit, member, shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole stack in the shards."""
        return (
            sum(
                c.nbytes
                for part in self.unit.members[self.member].components(0, self.cache.files)
                for c in part
            )
            * self.shape[0]
        )

    def fetch(self, ids, *others: ExpertStack) -> Fetch:
        """Pins and reads experts `ids` of this stack and of `others` (stacks of the same layer)."""
        for o in others:
            if o.unit is not self.unit:
                raise ValueError(f"{o.unit.key} and {self.unit.key} are not stacks of one layer")
        return self.cache.fetch(self.unit, list(ids), [self.member] + [o.member for o in others])

    def prefetch(self, ids) -> None:
        if self.cache.prefetch_enabled:
            self.cache.prefetch(self.unit, list(ids))

    def __getitem__(self, e: int):
        with self.fetch([int(e)]) as got:
            for _, (w,) in got:
                return _owned(w)
        raise IndexError(e)

    def __repr__(self) -> str:
        return f"ExpertStack({self.unit.members[self.member].name}, shape={list(self.shape)}, streamed)"


def _owned(w):
    """A copy of an expert's weight that no longer refers to the cache's slots."""
    if isinstance(w, torch.Tensor):
        return w.clone()
    if isinstance(w, ConcatRows):
        return ConcatRows([_owned(p) for p in w.parts])
    cp = lambda t: None if t is None else t.clone()  # noqa: E731
    return w._replace(
        codes=cp(w.codes), scale=cp(w.scale), global_scale=cp(w.global_scale), input_scale=cp(w.input_scale)
    )


# ---------------------------------------------------------------- tables read a few rows at a time


class FileRows:
    """A 2-D table left in its shard (a `mapped` spec), read row by row with preadv through the cache's
    pool, with a row cache of ROW_CACHE_ROWS rows. `read_rows(idx)` -> those rows [len(idx), cols] as
    stored; `prefetch(idx)` reads them ahead (Engram rows depend only on the token ids)."""

    def __init__(self, cache: ExpertCache, info):
        self.cache, self.info = cache, info
        self.dtype = SAFETENSORS[info.dtype]
        self.shape = torch.Size(info.shape)
        self.ndim = len(self.shape)
        self.device = torch.device("cpu")
        self.row_bytes = info.nbytes // max(1, self.shape[0])
        self.rows: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.inflight: dict[int, _Job] = {}
        self.lock = threading.Lock()
        self.file = cache.files.add(info.file)
        self.hits = self.misses = self.bytes_read = self.prefetched = 0
        self.stall_seconds = 0.0

    def _submit(self, rows: list[int], prio: int) -> list[_Job]:
        """Reads of the rows neither cached nor arriving, 64 a job (call with the lock held)."""
        files, info, jobs = self.cache.files, self.info, []
        todo = [r for r in rows if r not in self.rows and r not in self.inflight]
        for i in range(0, len(todo), 64):
            chunk = todo[i : i + 64]

            def run(chunk=chunk):
                out = torch.empty(len(chunk), self.row_bytes, dtype=torch.uint8)
                try:
                    for k, r in enumerate(chunk):
                        start = info.start + r * self.row_bytes
                        fd = files.fd(self.file, start + self.row_bytes, False)
                        dst = _buffer(out, k * self.row_bytes, self.row_bytes)
                        _read_exact(fd, [dst], start, files.paths[self.file])
                    with self.lock:
                        for k, r in enumerate(chunk):
                            self.rows[r] = out[k]
                        self.bytes_read += len(chunk) * self.row_bytes
                finally:
                    with self.lock:
                        for r in chunk:
                            self.inflight.pop(r, None)

            job = _Job(run, self.cache)
            for r in chunk:
                self.inflight[r] = job
            jobs.append(job)
        return jobs

    def prefetch(self, idx) -> None:
        rows = sorted(set(torch.as_tensor(idx).reshape(-1).tolist()))
        with self.lock:
            jobs = self._submit(rows, PREFETCH)
        for job in jobs:
            _get_pool().submit(job, PREFETCH)
        self.prefetched += len(jobs)

    def read_rows(self, idx: torch.Tensor) -> torch.Tensor:
        flat = torch.as_tensor(idx, dtype=torch.int64).reshape(-1).tolist()
        uniq = sorted(set(flat))
        with self.lock:
            missing = [r for r in uniq if r not in self.rows]
            arriving = {id(j): j for r in missing if (j := self.inflight.get(r)) is not None}
            jobs = list(arriving.values()) + self._submit(missing, DEMAND)
        self.hits += len(uniq) - len(missing)
        self.misses += len(missing)
        for job in jobs:
            _get_pool().submit(job, DEMAND)
        for job in jobs:
            if not job.done.is_set():
                t0 = time.perf_counter()
                job.done.wait()
                self.stall_seconds += time.perf_counter() - t0
            if job.error is not None:
                raise job.error
        with self.lock:  # only this thread removes rows, so every row asked for is still here
            for r in uniq:
                self.rows.move_to_end(r)
            out = (
                torch.stack([self.rows[r] for r in flat])
                if flat
                else torch.empty(0, self.row_bytes, dtype=torch.uint8)
            )
            while len(self.rows) > ROW_CACHE_ROWS:
                self.rows.popitem(last=False)
        return out.view(self.dtype).view(len(flat), *self.shape[1:])

    def __repr__(self) -> str:
        return f"FileRows({self.info.name}, shape={list(self.shape)}, {self.info.dtype}, streamed)"


# ---------------------------------------------------------------- planning (inspect)


class _Names:
    """A file index without descriptors (planning opens nothing)."""

    def __init__(self):
        self.index: dict = {}

    def add(self, path) -> int:
        return self.index.setdefault(path, len(self.index))


def plan_bytes(plan, store) -> dict[str, dict]:
    """What streaming would leave in the shards of a planned checkpoint: per MoE layer ("...experts"),
    its layer index, its experts and the bytes one expert takes as stored (all of its stacks)."""
    units: dict[str, dict] = {}
    names = _Names()
    for name, src in plan.sources.items():
        spec = plan.specs[name]
        if not spec.streamable:
            continue
        member = _Member(spec, src, plan, store, torch.float32, "inherit", True, "cpu")
        u = units.setdefault(
            name.rsplit(".", 1)[0], {"layer": spec.layer, "experts": spec.shape[0], "expert_bytes": 0}
        )
        u["expert_bytes"] += sum(c.nbytes for part in member.components(0, names) for c in part)
    return units

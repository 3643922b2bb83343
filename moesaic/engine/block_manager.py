"""The block manager: which pages each sequence holds, and the prefix cache over them.

Blocks are BLOCK_SIZE-token pages (cache/paged.py). A block is free, held (ref count >= 1: by every
sequence whose block table names it) or cached: unreferenced but still holding the rows of a full block
of committed tokens, found again by its hash. The hash of block i chains the hash of block i - 1 with the
block's token ids (nano-vllm's scheme); a hit also compares the ids themselves and the predecessor hash,
so a hash collision cannot alias two prefixes. Free blocks are used before cached ones; cached ones are
evicted least recently used first.

For families with state that is not paged (recurrent, window, compressed rows) the pages alone are not a
prefix: a hit also needs the sequence state at that block boundary, which the SnapshotStore keeps, keyed by
the boundary's block hash, under its own byte budget with its own LRU.
"""

from __future__ import annotations

from collections import OrderedDict

from ..cache.paged import BLOCK_SIZE, BlockTable, PagePool
from ..cache.state import snapshot_nbytes


def block_hash(prev: int | None, ids: tuple[int, ...]) -> int:
    return hash((prev, ids))


class Block:
    __slots__ = ("id", "ref", "hash", "prev", "ids")

    def __init__(self, id: int):
        self.id = id
        self.ref = 0
        self.hash: int | None = None  # set while the block is in the prefix cache's index
        self.prev: int | None = None  # the hash of the block before it
        self.ids: tuple[int, ...] = ()


class SnapshotStore:
    """Sequence-state snapshots at block boundaries: hash of the boundary's block -> snapshot."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, tuple[object, int]] = OrderedDict()
        self.bytes = 0

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def get(self, h: int):
        entry = self.entries.get(h)
        if entry is None:
            return None
        self.entries.move_to_end(h)
        return entry[0]

    def put(self, h: int, snap) -> bool:
        if h in self.entries:
            self.entries.move_to_end(h)
            return True
        n = snapshot_nbytes(snap)
        if n > self.max_bytes:
            return False
        while self.bytes + n > self.max_bytes:
            self.drop(next(iter(self.entries)))
        self.entries[h] = (snap, n)
        self.bytes += n
        return True

    def drop(self, h: int) -> None:
        entry = self.entries.pop(h, None)
        if entry is not None:
            self.bytes -= entry[1]


class BlockManager:
    def __init__(self, num_blocks: int, pool: PagePool | None, snapshots: SnapshotStore | None = None):
        self.num_blocks = num_blocks
        self.pool = pool
        self.snapshots = snapshots
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks of the index, LRU first
        self.index: dict[int, int] = {}  # block hash -> block id

    # ---- counts
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached ones are evicted when needed)."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # ---- one block
    def _take(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.cached.popitem(last=False)
            self._unindex(self.blocks[b])
        self.blocks[b].ref = 1
        return b

    def reserve(self) -> int:
        """A block taken for good (never freed or indexed): e.g. the scratch page static decode steps' padding
        rows write into."""
        return self._take()

    def _unindex(self, block: Block) -> None:
        if block.hash is not None:
            del self.index[block.hash]
            if self.snapshots is not None:
                self.snapshots.drop(block.hash)
            block.hash, block.prev, block.ids = None, None, ()

    def _release(self, b: int) -> None:
        block = self.blocks[b]
        block.ref -= 1
        if block.ref == 0:
            if block.hash is not None:
                self.cached[b] = None
            else:
                self.free.append(b)

    def _hold(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref == 0:
            del self.cached[b]
        block.ref += 1

    # ---- a sequence's table
    def blocks_needed(self, table: BlockTable, start: int, end: int) -> int:
        """Blocks to hand out so that rows [start, end) of the table are writable: new ones past its end,
        and a private copy of every held block in the range that is shared or in the prefix index."""
        need = max(0, -(-end // BLOCK_SIZE) - len(table))
        for i in range(start // BLOCK_SIZE, min(len(table), -(-end // BLOCK_SIZE))):
            block = self.blocks[table.ids[i]]
            need += block.ref > 1 or block.hash is not None
        return need

    def prepare(self, table: BlockTable, start: int, end: int) -> bool:
        """Makes rows [start, end) writable (see blocks_needed); False (and nothing done) if there are not
        enough blocks."""
        if self.blocks_needed(table, start, end) > self.num_free:
            return False
        for i in range(start // BLOCK_SIZE, min(len(table), -(-end // BLOCK_SIZE))):
            old = self.blocks[table.ids[i]]
            if old.ref > 1 or old.hash is not None:  # copy-on-write
                new = self._take()
                if self.pool is not None:
                    self.pool.copy_block(old.id, new)
                table.replace(i, new)
                self._release(old.id)
        while len(table) * BLOCK_SIZE < end:
            table.append(self._take())
        return True

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table holding the same blocks (copied on the first write into a shared one)."""
        for b in table.ids:
            self._hold(b)
        return BlockTable(table.ids)

    def free_table(self, table: BlockTable) -> None:
        for b in reversed(table.ids):  # the tail first: a prefix's later blocks are evicted before its head
            self._release(b)
        table.clear()

    # ---- the prefix index
    def match(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The longest chain of indexed blocks holding token_ids' first full blocks (at most max_blocks):
        (block ids, their hashes)."""
        ids, hashes, prev = [], [], None
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            h = block_hash(prev, chunk)
            b = self.index.get(h)
            if b is None or self.blocks[b].ids != chunk or self.blocks[b].prev != prev:
                break
            ids.append(b)
            hashes.append(h)
            prev = h
        return ids, hashes

    def attach(self, table: BlockTable, block_ids: list[int]) -> None:
        """Puts matched blocks at the head of an empty table."""
        for b in block_ids:
            self._hold(b)
            table.append(b)

    def revivals(self, block_ids: list[int]) -> int:
        """How many of these blocks are cached (unreferenced): attaching them takes them off the free count."""
        return sum(self.blocks[b].ref == 0 for b in block_ids)

    def register(self, table: BlockTable, hashes: list[int], token_ids: list[int], committed: int) -> None:
        """Indexes the table's full blocks of committed tokens that are not yet (hashes: the chain so far,
        extended in place)."""
        for i in range(len(hashes), committed // BLOCK_SIZE):
            chunk = tuple(token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            prev = hashes[-1] if hashes else None
            h = block_hash(prev, chunk)
            hashes.append(h)
            block = self.blocks[table.ids[i]]
            if block.hash is None and h not in self.index:
                block.hash, block.prev, block.ids = h, prev, chunk
                self.index[h] = block.id

    def reset_cache(self) -> None:
        """Forgets every cached prefix (blocks held by sequences stay theirs)."""
        for b in list(self.cached):
            del self.cached[b]
            self._unindex(self.blocks[b])
            self.free.append(b)
        for block in self.blocks:
            self._unindex(block)

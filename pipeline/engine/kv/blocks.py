"""BlockPool: a model's KV positions as fixed-size blocks lent to sequences. No torch.

A paged store keeps every layer's keys and values in `num_blocks` blocks of `block_size` positions;
which block holds which positions of which sequence is decided here, as plain integers, and the
kernels read it as block tables. A sequence holds only the blocks its length needs, so how many
sequences run at once is bounded by the tokens they hold, not by max_model_len.

Glossary
  block        block_size consecutive KV positions (of every layer); an index in [0, num_blocks)
  table        a sequence's blocks in order: its position p is offset p % block_size of block
               table[p // block_size]
  committed    positions whose tokens are decided (prompt, accepted output), as opposed to draft
               positions a round may roll back
  full block   a block whose block_size positions are all committed. Its KV is a function of its
               tokens and of every earlier token (causal attention), so it is keyed by a digest of
               them all (`chain`) and may serve any later sequence whose tokens start the same way
  shared       a full block in more than one table (ref count > 1). Shared blocks are never written:
               only full blocks are shared, and a sequence only writes past its committed positions
  cached       a full block no table holds: kept, with its key, for a later prompt, until the pool
               needs the block (least recently released first)
  free         a block holding nothing anyone may read: taken first

Rollback of rejected draft positions is a shorter length (`truncate`): the blocks wholly past it
return to the pool, the rest is overwritten by later rounds. Digests are SHA-256 over the previous
block's digest and this block's tokens: two different prefixes share a key with odds of about
2^-256 per pair, so a prefix hit is treated as equal tokens.

This module knows nothing about tensors, models, requests or the scheduler's policy.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

ROOT = b""                                  # the digest before a sequence's first block


def chain(previous: bytes, tokens: list[int]) -> bytes:
    """The key of a full block holding `tokens`, after a prefix whose last block's key is `previous`."""
    return hashlib.sha256(previous + array("q", tokens).tobytes()).digest()


class OutOfBlocks(RuntimeError):
    """The pool cannot lend the blocks asked for; nothing was taken."""


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)    # keys of blocks[:len(keys)], its full blocks


@dataclass
class PoolStats:
    num_blocks: int
    block_size: int
    used: int                # blocks some table holds
    cached: int              # full blocks no table holds, kept for their prefix
    free: int                # blocks holding nothing
    peak_used: int           # most blocks held at once, all time
    shared: int              # blocks held by more than one table now
    prefix_hits: int         # blocks a table took from another table or the cache, all time


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one position, "
                             f"got {num_blocks} blocks of {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # a stack: lowest index taken first
        self._cached: OrderedDict[int, None] = OrderedDict()          # oldest release first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}                          # full block -> its key
        self._by_key: dict[bytes, int] = {}                          # key -> the full block holding it
        self._tables: dict[object, _Table] = {}
        self.peak_used = 0
        self.prefix_hits = 0

    # --- sizes -------------------------------------------------------------------------------------

    def blocks_for(self, length: int) -> int:
        """Blocks a sequence of `length` positions holds."""
        return -(-length // self.block_size)

    @property
    def num_available(self) -> int:
        """Blocks a table may take now: free ones, then cached ones (their prefix is given up)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def table(self, owner) -> list[int]:
        """`owner`'s blocks in position order (empty for an owner that holds none)."""
        t = self._tables.get(owner)
        return list(t.blocks) if t is not None else []

    def holds(self, owner) -> bool:
        return owner in self._tables

    def need(self, owner, length: int) -> int:
        """More blocks `owner` must take to hold `length` positions."""
        t = self._tables.get(owner)
        return max(0, self.blocks_for(length) - (len(t.blocks) if t is not None else 0))

    # --- prefixes ----------------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The blocks, held or cached, whose keys are those of the first full blocks of `tokens`, as
        many as fit in `limit` positions: a new sequence with these tokens may take them instead of
        computing their KV."""
        found, key = [], ROOT
        for b in range(min(limit, len(tokens)) // self.block_size):
            key = chain(key, tokens[b * self.block_size:(b + 1) * self.block_size])
            block = self._by_key.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def share(self, owner, blocks: list[int]) -> None:
        """`owner`, holding nothing yet, starts its table with `blocks` (from `match`): their KV is
        its first len(blocks) * block_size positions, taken by reference, not copied."""
        if self.table(owner):
            raise ValueError(f"{owner!r} already holds blocks: a shared prefix starts a table")
        t = self._tables.setdefault(owner, _Table())
        for block in blocks:
            if block not in self._key_of:
                raise ValueError(f"block {block} is not a full block: only full blocks are shared")
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
            t.blocks.append(block)
            t.keys.append(self._key_of[block])
        self.prefix_hits += len(blocks)
        self._note_peak()

    # --- growing, committing, rolling back, releasing --------------------------------------------

    def grow(self, owner, length: int) -> list[int]:
        """Make `owner`'s table cover positions [0, length); returns the blocks taken (free ones
        first, then the least recently cached). Raises OutOfBlocks, taking nothing, when the pool
        has too few."""
        n = self.need(owner, length)
        if n > self.num_available:
            raise OutOfBlocks(f"{n} more blocks of {self.block_size} positions needed for {length} positions, "
                              f"{self.num_available} of {self.num_blocks} available")
        t = self._tables.setdefault(owner, _Table())
        taken = [self._take() for _ in range(n)]
        t.blocks.extend(taken)
        self._note_peak()
        return taken

    def commit(self, owner, tokens: list[int]) -> None:
        """`tokens` are `owner`'s committed tokens from position 0, their KV written: every block they
        now fill is keyed, and may serve later prefixes. A block whose key another block already
        holds keeps its KV but is not indexed twice."""
        t = self._tables[owner]
        full = min(len(tokens) // self.block_size, len(t.blocks))
        key = t.keys[-1] if t.keys else ROOT
        for b in range(len(t.keys), full):
            key = chain(key, tokens[b * self.block_size:(b + 1) * self.block_size])
            t.keys.append(key)
            block = t.blocks[b]
            if key not in self._by_key and block not in self._key_of:
                self._by_key[key] = block
                self._key_of[block] = key

    def truncate(self, owner, length: int) -> list[int]:
        """`owner` keeps positions [0, length): the blocks wholly past it go back; returns them. Its
        full blocks (committed positions) are never past a rollback."""
        t = self._tables[owner]
        if length < len(t.keys) * self.block_size:
            raise ValueError(f"truncating {owner!r} to {length} positions would drop committed blocks "
                             f"({len(t.keys)} full)")
        keep = self.blocks_for(length)
        dropped = t.blocks[keep:]
        del t.blocks[keep:]
        for block in dropped:
            self._drop(block)
        return dropped

    def release(self, owner) -> None:
        """`owner` holds nothing from now on: its blocks go back, its full ones cached for later prefixes
        (oldest released given up first), the rest free."""
        t = self._tables.pop(owner, None)
        if t is None:
            return
        for block in reversed(t.blocks):          # the last blocks of a prefix are the first given up
            self._drop(block)

    def forget_prefixes(self) -> None:
        """No cached block serves a later prefix any more (they become free); held blocks keep their keys."""
        for block in list(self._cached):
            self._unkey(block)
            self._free.append(block)
        self._cached.clear()

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.block_size, self.num_used, len(self._cached), len(self._free),
                         self.peak_used, sum(1 for r in self._refs if r > 1), self.prefix_hits)

    # --- internals -----------------------------------------------------------------------------------

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            self._unkey(block)
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if block in self._key_of:
            self._cached[block] = None
        else:
            self._free.append(block)

    def _unkey(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None and self._by_key.get(key) == block:
            del self._by_key[key]

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)

"""Paged KV cache accounting: a pool of fixed-size blocks, block tables, prefix caching.

The cache memory itself is one tensor per model (``KVCacheManager`` only hands out block ids).
A request's block table lists the blocks holding its tokens in order; token ``i`` lives in slot
``table[i // block_size] * block_size + i % block_size``.

Prefix caching: a *full* block is named by a chained hash, hash(parent block's hash, its tokens),
so equal hashes mean equal whole prefixes. Freed blocks keep their hash and stay findable until
the pool hands them out again (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict

from kiln.errors import KilnError
from kiln.llm.request import Request


class CacheCapacityError(KilnError):
    """A request needs more KV-cache blocks than the whole pool has."""


class Block:
    __slots__ = ("id", "ref", "hash")

    def __init__(self, i: int):
        self.id, self.ref, self.hash = i, 0, None


def chain_hash(parent: int | None, tokens) -> int:
    return hash((parent, tuple(tokens)))


class KVCacheManager:
    """Block ids for requests. ``num_blocks`` blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise KilnError(f"KV cache needs at least one block (got {num_blocks} blocks of "
                            f"{block_size} tokens)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # hash -> block
        self.tables: dict[str, list[Block]] = {}
        self.table_ids: dict[str, list[int]] = {}  # the same tables as block ids
        self.published: dict[str, int] = {}  # blocks of each request already looked at
        self.hits = self.queries = 0  # prefix-cache tokens found / looked up

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """``request_id``'s block ids in order (a copy: the table grows in later steps)."""
        ids = self.table_ids.get(request_id)
        return ids.copy() if ids is not None else []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, req: Request):
        need = self.blocks_for(req.max_total_tokens)
        if need > self.num_blocks:
            raise CacheCapacityError(
                f"request {req.request_id} needs {need} KV-cache blocks "
                f"({req.num_prompt_tokens} prompt + {req.params.max_tokens} max_tokens, "
                f"{self.block_size} tokens per block) but the pool has {self.num_blocks}; "
                "lower max_tokens, shorten the prompt, or give the cache more memory")

    # -- prefix cache --------------------------------------------------------------------------
    def _hashes(self, req: Request) -> list[int]:
        bs, hs = self.block_size, req.block_hashes
        while (len(hs) + 1) * bs <= req.num_tokens:
            i = len(hs)
            hs.append(chain_hash(hs[-1] if hs else None, req.tokens(i * bs, (i + 1) * bs)))
        return hs

    def computed_prefix(self, req: Request) -> int:
        """Look ``req`` up in the prefix cache; take the hit blocks. Returns tokens found."""
        if not self.prefix_caching or self.tables.get(req.request_id):
            return 0
        found: list[Block] = []
        # leave at least one token to compute: its logits give the next token
        for h in self._hashes(req)[: (req.num_tokens - 1) // self.block_size]:
            b = self.cached.get(h)
            if b is None:
                break
            found.append(b)
        for b in found:
            self._take(b)
        self.tables[req.request_id] = found
        self.table_ids[req.request_id] = [b.id for b in found]
        self.queries += req.num_tokens
        self.hits += len(found) * self.block_size
        return len(found) * self.block_size

    def cache_full_blocks(self, req: Request, num_computed: int):
        """Publish the hashes of ``req``'s blocks that ``num_computed`` tokens have filled."""
        if not self.prefix_caching:
            return
        done = self.published.get(req.request_id, 0)
        if num_computed // self.block_size <= done:  # no block filled since: most decodes
            return
        table = self.tables.get(req.request_id, [])
        hs = self._hashes(req)
        n = min(num_computed // self.block_size, len(table), len(hs))
        # from the first block not looked at yet: a decode step costs O(1), not O(blocks)
        for i in range(done, n):
            b = table[i]
            if b.hash is None and hs[i] not in self.cached:
                b.hash = hs[i]
                self.cached[hs[i]] = b
        self.published[req.request_id] = n

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow ``req``'s table to hold its computed tokens plus ``num_new_tokens``; False if the
        pool is short (nothing is taken then)."""
        table = self.tables.setdefault(req.request_id, [])
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        ids = self.table_ids.setdefault(req.request_id, [])
        for _ in range(need):
            _, b = self.free.popitem(last=False)
            if b.hash is not None:  # evict its cached prefix
                del self.cached[b.hash]
                b.hash = None
            b.ref = 1
            table.append(b)
            ids.append(b.id)
        return True

    def free_request(self, request_id: str):
        """Return ``request_id``'s blocks; hashed ones stay findable until reused."""
        self.published.pop(request_id, None)
        self.table_ids.pop(request_id, None)
        for b in reversed(self.tables.pop(request_id, [])):
            b.ref -= 1
            if b.ref == 0:
                self.free[b.id] = b

    def _take(self, b: Block):
        if b.ref == 0:
            del self.free[b.id]
        b.ref += 1

    def reset_prefix_cache(self):
        for b in self.blocks:
            if b.ref == 0 and b.hash is not None:
                del self.cached[b.hash]
                b.hash = None

"""The pool of paged KV blocks, with prefix caching of full blocks."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from latentserve.engine.request import Request
from latentserve.engine.state_pool import StatePool


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Key of a full block: its tokens *and* everything before them, through the parent's key."""
    return hash((parent_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full, computed and in the cache
        self.token_ids: tuple[int, ...] = ()  # kept to reject hash collisions

    def reset(self) -> None:
        self.block_hash = None
        self.token_ids = ()


class _Blocks(dict):
    """Block id -> Block, each made on first use: a pool sized for the worst case (the default 1 GiB holds 100k
    blocks of a small model) then costs no start-up time (~2.5 us a block)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.num_blocks = num_blocks

    def __missing__(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} is outside the pool of {self.num_blocks}")
        block = self[block_id] = Block(block_id)
        return block


class BlockManager:
    """`num_blocks` KV blocks of `block_size` tokens, shared by reference count.

    Full, computed blocks are cached by a hash chain over their tokens. A block
    whose last user frees it stays cached until the pool needs it back; free
    blocks are handed out uncached ones first, then least recently freed.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, state_pool: StatePool | None = None
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        if state_pool is not None and enable_prefix_caching:
            raise ValueError("prefix caching cannot resume a linear-attention state at a block boundary: a hybrid "
                             "model's block manager needs enable_prefix_caching=False")
        self.enable_prefix_caching = enable_prefix_caching
        # Hybrid models: a request holds a state slot while it holds blocks (taken and given back with them).
        self.state_pool = state_pool
        self.blocks = _Blocks(num_blocks)
        # Front = next to hand out. Values unused: an ordered set.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # block hash -> block id
        self._num_hashed_blocks: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        self._pending: set[int] = set()  # blocks cached for the running step to write, until it is known to have run
        self.num_forked_blocks = 0  # block references taken by fork(): KV computed once, used by several requests

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request: Request) -> list[int]:
        return request.block_ids

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to its first `num_full_blocks` blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks matching the request's leading tokens, and how many tokens they hold.

        The last token is never counted: the request must compute it to get logits.
        Nothing is reserved; pass the blocks to `allocate`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        hits: list[int] = []
        for i, block_hash in enumerate(self._block_hashes(request, (request.num_tokens - 1) // bs)):
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(request.all_token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits, len(hits) * bs

    def _num_new_blocks(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> int:
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        return max(self.num_blocks_needed(total) - len(request.block_ids) - len(computed_blocks), 0)

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether the pool can hold `num_new_tokens` more tokens for the request (after its cache hits)."""
        # A hit on a free cached block takes it out of the free pool too.
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        return self._num_new_blocks(request, num_new_tokens, computed_blocks) + revived <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> None:
        """Give the request its cache hits (first allocation only) and blocks for `num_new_tokens` more tokens."""
        if computed_blocks and request.block_ids:
            raise RuntimeError(f"request {request.request_id!r} already has blocks: cache hits apply only to a fresh request")
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            raise RuntimeError(f"not enough free KV blocks for request {request.request_id!r}: check can_allocate first")
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks)
        if not request.block_ids:  # cache hits are already in the cache
            self._num_hashed_blocks[request.request_id] = len(computed_blocks)
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_block_ids[block_id]
            block.ref_cnt += 1
            request.block_ids.append(block_id)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._take_free_block())
        if self.state_pool is not None:
            self.state_pool.allocate(request)

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Start a fresh child on the parent's first `num_blocks` blocks (shared: one more reference each)."""
        if child.block_ids:
            raise RuntimeError(f"request {child.request_id!r} already has blocks: only a fresh request can fork")
        if num_blocks > len(parent.block_ids):
            raise RuntimeError(f"request {parent.request_id!r} has {len(parent.block_ids)} blocks, not {num_blocks}")
        for block_id in parent.block_ids[:num_blocks]:
            self.blocks[block_id].ref_cnt += 1
            child.block_ids.append(block_id)
        child.block_hashes = list(parent.block_hashes[:num_blocks])
        self._num_hashed_blocks[child.request_id] = num_blocks  # the parent offered them already
        self.num_forked_blocks += num_blocks

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table for a step that adds `num_new_tokens`; False (and no change) if the pool is full."""
        if not self.can_allocate(request, num_new_tokens):
            return False
        self.allocate(request, num_new_tokens)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the cache
            if self.cached_block_ids.get(block.block_hash) == block_id:
                del self.cached_block_ids[block.block_hash]
            block.reset()
        block.ref_cnt = 1
        return block_id

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the full blocks of the request's first `num_tokens` tokens to the prefix cache.

        The scheduler offers the blocks a step will write as it schedules the step, so that a request
        scheduled later in the same step can share them (its attention runs after theirs are written,
        layer by layer). They stay pending until `commit_step`; `discard_step` drops them if the step failed.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_tokens // bs, len(request.block_ids))
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            block = self.blocks[request.block_ids[i]]
            # A block with the same content may already be cached (two requests computed it at once): keep that one.
            if block.block_hash is None and hashes[i] not in self.cached_block_ids:
                block.block_hash = hashes[i]
                block.token_ids = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
                self.cached_block_ids[hashes[i]] = block.block_id
                self._pending.add(block.block_id)
        self._num_hashed_blocks[request.request_id] = num_full

    def is_pending(self, block_id: int) -> bool:
        """Whether the block is cached for the running step to write, not yet written."""
        return block_id in self._pending

    def commit_step(self) -> None:
        """The step ran: the blocks it was to write hold their tokens."""
        self._pending.clear()

    def discard_step(self) -> None:
        """The step failed: the blocks it was to write hold nothing, so take them out of the cache."""
        for block_id in self._pending:
            block = self.blocks[block_id]
            if self.cached_block_ids.get(block.block_hash) == block_id:
                del self.cached_block_ids[block.block_hash]
            block.reset()
        self._pending.clear()

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody holds go back to the free pool."""
        # Tail first, so that under eviction a prefix outlives its continuations.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:  # holds nothing reusable: hand it out first
                    self.free_block_ids.move_to_end(block_id, last=False)
        request.block_ids = []
        self._num_hashed_blocks.pop(request.request_id, None)
        if self.state_pool is not None:
            self.state_pool.free(request)

"""Radix prefix cache for hybrid models: KV pages plus recurrent-state snapshots, at page granularity.

A node holds a run of tokens (a multiple of page_size), the device pages holding their KV, and optionally one
state snapshot: a state-pool slot with the conv + SSM state of every GDN layer *at the node's end*. A hybrid model
can only resume where a state exists, so a match is usable up to the deepest matched node that has a snapshot
(the root counts: the state at position 0 is all zeros); a model without GDN layers can use the whole match.

Invariants (tests check them):
- The tree owns one reference on each of its pages (PageAllocator refcounts) and one snapshot slot per snapshot.
  Running requests hold their own page references, so evicting a node never pulls KV from under a request.
- Pages in the tree are full pages below every writer's position: nobody writes to a cached page again.
- A locked node (a running request started from it) and its ancestors are never evicted.
- Eviction removes unlocked leaves in LRU order; snapshots are evicted by LRU on their own (their slots are the
  scarce resource), and a node left without snapshot and children goes with it, since nothing can resume there.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tinyserve.kv import PageAllocator
from tinyserve.state import StatePool

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int]
    pages: list[int]
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    snapshot: int | None = None          # state-pool snapshot slot with the state at this node's end
    lock: int = 0                        # running requests that started from this node or below
    last_use: int = 0
    depth: int = 0                       # tokens from the root to this node's end

    def touch(self) -> None:
        self.last_use = next(_clock)


@dataclass
class Match:
    node: Node                # deepest usable node (resume point); the root when nothing is usable
    length: int               # usable prefix length in tokens (multiple of page_size)
    pages: list[int]          # pages covering that prefix
    kv_length: int            # longest matched prefix regardless of state (a branch point when > length)


class RadixCache:
    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool) -> None:
        self.allocator, self.state_pool = allocator, state_pool
        self.page_size, self.hybrid = page_size, hybrid
        self.root = Node([], [])
        self.root.lock = 1                   # never evicted
        self.num_pages = 0                   # pages referenced by the tree
        self.num_snapshots = 0
        self.snapshots_evicted = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- lookup ----
    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i:i + self.page_size])

    def _walk(self, tokens: list[int], split: bool) -> tuple[list[Node], int]:
        """Follow tokens down the tree page by page. Returns the nodes fully matched and the matched length;
        with split=True a node matched part-way is split so that the match ends on a node boundary."""
        ps, node, pos, path = self.page_size, self.root, 0, []
        n = len(tokens) - len(tokens) % ps
        while pos < n:
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            m = 0
            while m < len(child.tokens) and pos + m < n and \
                    child.tokens[m:m + ps] == tokens[pos + m:pos + m + ps]:
                m += ps
            if m < len(child.tokens):
                if not split:
                    pos += m
                    break
                child = self._split(child, m)
            path.append(child)
            node, pos = child, pos + m
        return path, pos

    def _split(self, node: Node, m: int) -> Node:
        """Cut node after m tokens; the new upper node has no snapshot (the state exists only at the old end)."""
        ps = self.page_size
        upper = Node(node.tokens[:m], node.pages[:m // ps], node.parent, lock=node.lock, last_use=node.last_use,
                     depth=node.depth - len(node.tokens) + m)
        node.parent.children[self._key(node.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[m:], node.pages[m // ps:], upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def match(self, tokens: list[int]) -> Match:
        """Longest usable cached prefix of tokens, always leaving at least one token to compute."""
        ps = self.page_size
        limit = (len(tokens) - 1) // ps * ps
        path, kv_len = self._walk(tokens[:limit], split=True)
        usable = self.root
        for node in path:
            node.touch()
            if not self.hybrid or node.snapshot is not None:
                usable = node
        pages = [p for node in path[:path.index(usable) + 1] for p in node.pages] if usable is not self.root else []
        self.query_tokens += len(tokens)
        self.hit_tokens += usable.depth
        return Match(usable, usable.depth, pages, kv_len)

    def lock(self, node: Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock += delta
            assert node.lock >= 0
            node = node.parent

    # ---- insertion ----
    def insert(self, tokens: list[int], pages: list[int], snapshot: int | None) -> None:
        """Cache a page-aligned prefix (its KV pages, and the state at its end if given). Parts already cached keep
        their pages; the tree takes a reference on the new ones. A snapshot the node already has is given back."""
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) == len(tokens) // ps
        path, pos = self._walk(tokens, split=True)
        node = path[-1] if path else self.root
        if pos < len(tokens):
            new = Node(tokens[pos:], pages[pos // ps:], node, depth=len(tokens))
            self.allocator.retain(new.pages)
            self.num_pages += len(new.pages)
            node.children[self._key(new.tokens, 0)] = new
            node = new
        node.touch()
        if snapshot is None:
            return
        if node is self.root or node.snapshot is not None:
            self.state_pool.free_snapshot(snapshot)
        else:
            node.snapshot = snapshot
            self.num_snapshots += 1

    # ---- eviction ----
    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _remove_leaf(self, node: Node) -> None:
        if node.snapshot is not None:
            self.state_pool.free_snapshot(node.snapshot)
            node.snapshot = None
            self.num_snapshots -= 1
        del node.parent.children[self._key(node.tokens, 0)]
        self.allocator.release(node.pages)
        self.num_pages -= len(node.pages)

    def evict_pages(self, need_free: int) -> None:
        """Remove unlocked leaves, least recently used first, until the allocator has need_free free pages."""
        while self.allocator.num_free < need_free:
            leaves = [n for n in self._nodes() if not n.children and n.lock == 0 and n is not self.root]
            if not leaves:
                return
            self._remove_leaf(min(leaves, key=lambda n: n.last_use))

    def alloc_snapshot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used unlocked snapshot if none is free."""
        slot = self.state_pool.alloc_snapshot()
        if slot is not None:
            return slot
        held = [n for n in self._nodes() if n.snapshot is not None and n.lock == 0]
        if not held:
            return None
        victim = min(held, key=lambda n: n.last_use)
        slot, victim.snapshot = victim.snapshot, None
        self.num_snapshots -= 1
        self.snapshots_evicted += 1
        # a leaf without a state can no longer be resumed from: drop it and any stateless leaves above it
        node = victim
        while self.hybrid and node is not self.root and not node.children and node.snapshot is None \
                and node.lock == 0:
            parent = node.parent
            self._remove_leaf(node)
            node = parent
        return slot

    def flush(self) -> bool:
        """Empty the cache; refuses (returns False) while a running request holds part of it."""
        if any(n.lock for n in self._nodes() if n is not self.root):
            return False
        for node in sorted(self._nodes(), key=lambda n: -n.depth):
            if node is not self.root:
                self._remove_leaf(node)
        return True

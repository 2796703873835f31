"""Radix prefix cache for hybrid models: KV pages plus recurrent-state snapshots on the device, at page granularity.
The host tier (L2) and the file tier (L3) are not here: tiers.py's TieredRadixCache is this tree with their policy
(what is backed up and when, promotion, host eviction, file writes), reached through the hooks RadixCache lists.

A node holds a run of tokens (a multiple of page_size), its KV pages and optionally one state snapshot (conv + SSM
state of every GDN layer *at the node's end*). A hybrid model can only resume where a state exists, so a match is
usable up to the deepest matched node that has a device snapshot (the root counts: the state at position 0 is all
zeros); a model without GDN layers can use the whole match.

Invariants (radix_check.check_tree asserts them, and the tiers' of tiers.py; tests call it after every scenario):
- The tree owns one reference on each of its device pages (PageAllocator refcounts) and one device snapshot slot
  per device snapshot. Running requests hold their own page references, so evicting a node never pulls KV from
  under a request.
- Pages in the tree are full pages below every writer's position: nobody writes to a cached page again.
- A locked node (a running request matched its prompt up to it: it resumes there or above, and computes the same
  tokens below) and its ancestors keep their KV pages on the device, and stay in the tree without a state (a
  stateless node dropped under the request would be written to the file tier again when the request inserts it). A lock
  does not pin the node's snapshot: the request copied that state at admission and never reads it again, so the
  snapshot is ranked like any other (many sessions on one shared prefix would otherwise pin every slot). Only the
  snapshots of an admission in progress (`pinned`: TieredRadixCache.promote) are never taken.
- Nodes on the device form a subtree at the root: device eviction takes unlocked nodes with no child on the device,
  LRU first, and removes them (`_evict_device`; with tiers, one backed up on the host is demoted to host-only).
- Snapshots are evicted on their own (their slots are the scarce resource), in the order of snapshot_worth.py:
  copies the other tier also holds first, ..., resume points (prompt ends, branch points, request ends, the last
  messages' starts; `insert(..., resume=True)`) and leaves last, a request's together (`claim`). An interval
  snapshot (`alloc_snapshot(resume=False)`) never displaces a leaf or a resume point. A leaf left with no snapshot
  anywhere goes with it, since nothing can resume there. Held device snapshots never exceed the plan's slots,
  checked in bytes.

insert(tokens, pages, snapshot, resume, claim) caches a page-aligned prefix: parts already on the device keep their
pages (parts off it take these), the tree takes a reference on the pages it keeps, and a snapshot the node already has
is given back; resume marks a state that resumes requests (kept longer than interval snapshots), claim is the stamp
(`stamp`) of the request whose resume point or kept interval snapshot it is.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tinyserve.pools import PageAllocator, StatePool
from tinyserve.snapshot_worth import snapshot_ranks, worth

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int]
    pages: list[int] | None              # device pages (None: not on the device, only a tier keeps such a node)
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    snapshot: int | None = None          # device snapshot slot with the state at this node's end
    lock: int = 0                        # running requests that started from this node or below
    hits: int = 0
    last_use: int = 0
    depth: int = 0                       # tokens from the root to this node's end
    resume: bool = False                 # the state at this node's end resumes requests: a prompt end, a branch
                                         # point, a request end or a hinted place (not just an interval snapshot)
    claimed: int = 0                     # the stamp of the last request that had a resume point or a kept
                                         # interval snapshot here (made or found cached): snapshot_worth
    # snapshot_worth ranks the states either tier holds: a node of the tree alone holds none on the host (a field of
    # tiers.TieredNode)
    host_snapshot = None

    def touch(self) -> None:
        self.last_use = next(_clock)

    @property
    def start(self) -> int:
        return self.depth - len(self.tokens)


def cut(run: list[int] | None, k: int) -> tuple[list[int] | None, list[int] | None]:
    """A node's pages (or a tier's copy of them) split after k pages; not held (None) splits into two Nones."""
    return (None, None) if run is None else (run[:k], run[k:])


@dataclass
class Match:
    node: Node                # deepest usable node (resume point); the root when nothing is usable
    length: int               # usable prefix length in tokens (multiple of page_size)
    pages: list[int]          # pages covering that prefix
    kv_length: int            # longest matched prefix on the device regardless of state (a branch point)
    walked: int = 0           # tokens matched in the tree, any tier (page-aligned)
    branch: Node | None = None    # where the prompt left a cached path that goes on (a divergence); None: it didn't
    deepest: Node | None = None   # the node ending at kv_length (the root for none): what the request locks


class RadixCache:
    """The tree on the device. With a host or a file tier, tiers.TieredRadixCache overrides its hooks, each a no-op
    or the tree's own rule here: `_on_hit` and `_on_insert` (a node matched again, cached: a backup may be due),
    `_take_back` (nodes off the device on an inserted path), `_split` (the halves share the tiers' copies),
    `_evict_device` (a node leaving the device: removed, or demoted), `_snapshot_leaving` (a device snapshot giving
    its slot up: demoted) and `_release` (a node leaving the tree: its tiers' copies go too)."""
    node_class: type[Node] = Node

    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool) -> None:
        self.allocator, self.state_pool = allocator, state_pool
        self.page_size, self.hybrid = page_size, hybrid
        self.root = self.node_class([], [])
        self.root.lock = 1                   # never evicted
        self.pinned: set[Node] = set()       # nodes whose snapshots an admission is loading (TieredRadixCache.promote):
                                             # never taken
        self.num_pages = 0                   # device pages referenced by the tree
        self.num_snapshots = 0               # device snapshots held
        self.snapshots_evicted = 0
        self.requests = 0                    # stamps given out (`stamp`)
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- walking ----
    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i:i + self.page_size])

    def _walk(self, tokens: list[int], split: bool) -> tuple[list[Node], int]:
        # the nodes fully matched page by page (off the device too) and the length; split: a node matched part-way
        # is split there
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
        up_pages, node.pages = cut(node.pages, m // self.page_size)
        upper = self.node_class(node.tokens[:m], up_pages, node.parent, lock=node.lock, last_use=node.last_use,
                                hits=node.hits, depth=node.start + m)
        node.parent.children[self._key(node.tokens, 0)] = upper
        node.tokens, node.parent = node.tokens[m:], upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def _limit(self, tokens: list[int]) -> int:
        return (len(tokens) - 1) // self.page_size * self.page_size     # always leave one token to compute

    def coverage(self, tokens: list[int]) -> int:
        """Tokens of the prompt's usable part present in the tree (any tier), without changing it: where a read of
        the file tier continues it. A hybrid model's stops at the deepest state on them (the device's or the host
        tier's): another server's blobs start where its tree has states, the same points (page-aligned message
        starts, interval multiples), not where this tree's KV happens to end."""
        path, walked = self._walk(tokens[:self._limit(tokens)], split=False)
        if not self.hybrid:
            return walked
        return max((n.depth for n in path if n.snapshot is not None or n.host_snapshot is not None), default=0)

    def match(self, tokens: list[int]) -> Match:
        """Longest usable device-resident prefix of tokens, always leaving at least one token to compute."""
        limit = self._limit(tokens)
        path, walked = self._walk(tokens[:limit], split=True)
        usable, pages, kv_len, deepest = self.root, [], 0, self.root
        for node in path:
            if node.pages is None:                     # off the device from here on
                break
            node.touch()
            node.hits += 1
            self._on_hit(node)
            pages += node.pages
            kv_len, deepest = node.depth, node
            if not self.hybrid or node.snapshot is not None:
                usable = node
        self.query_tokens += len(tokens)
        self.hit_tokens += usable.depth
        # the walk stopped short of the limit at a node with children: no child continues the prompt's next page
        last = path[-1] if path else self.root
        branch = last if 0 < walked < limit and last.children else None
        return Match(usable, usable.depth, pages[:usable.depth // self.page_size], kv_len, walked, branch, deepest)

    def stamp(self) -> int:
        # a new request's stamp (they count requests: snapshot_worth.INTERVAL_AGE)
        self.requests += 1
        return self.requests

    def claim(self, tokens: list[int], ends: set[int], stamp: int) -> None:
        # a request's resume points and kept interval snapshots cached already count as its own (snapshot_worth)
        path, _ = self._walk(tokens, split=False)
        for node in path:
            if node.depth in ends and (node.snapshot is not None or node.host_snapshot is not None):
                node.claimed = stamp

    def lock(self, node: Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock += delta
            assert node.lock >= 0
            node = node.parent

    # ---- insertion ----
    def insert(self, tokens: list[int], pages: list[int], snapshot: int | None, resume: bool = False,
               claim: int = 0) -> Node:
        """Cache a page-aligned prefix (the module docstring); returns the node ending there (or the root)."""
        node = self._insert(tokens, pages, snapshot, resume)
        if node is not self.root:
            node.claimed = claim or node.claimed
            self._on_insert(node)
        return node

    def _insert(self, tokens: list[int], pages: list[int], snapshot: int | None, resume: bool) -> Node:
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) == len(tokens) // ps
        path, pos = self._walk(tokens, split=True)
        self._take_back(path, pages)
        node = path[-1] if path else self.root
        if pos < len(tokens):
            new = self.node_class(tokens[pos:], pages[pos // ps:], node, depth=len(tokens))
            self.allocator.retain(new.pages)
            self.num_pages += len(new.pages)
            node.children[self._key(new.tokens, 0)] = new
            node = new
        node.touch()
        if snapshot is not None:
            if node is self.root or node.snapshot is not None:
                self.state_pool.free_snapshot(snapshot)
            else:
                node.snapshot = snapshot
                self.num_snapshots += 1
        if resume and node is not self.root:
            node.resume = True
        return node

    # ---- the hooks a tier policy overrides (tiers.TieredRadixCache) ----
    def _on_hit(self, node: Node) -> None:              # node was matched again (node.hits counts its matches)
        pass

    def _on_insert(self, node: Node) -> None:           # node (not the root) was cached, or cached again
        pass

    def _take_back(self, path: list[Node], pages: list[int]) -> None:   # off-device nodes on an inserted path take
        pass                                                            # its pages (here every node is on the device)

    def _evict_device(self, victim: Node) -> None:
        """victim (unlocked, no child on the device) leaves the device: removed with its subtree."""
        self._remove_subtree(victim)

    def _snapshot_leaving(self, victim: Node) -> None:
        """victim's device snapshot is about to give its slot up (to be dropped, unless a tier takes a copy)."""

    def _release(self, node: Node) -> None:
        """node leaves the tree: give back what it holds."""
        self._drop_device(node)

    # ---- device eviction ----
    def nodes(self) -> list[Node]:
        """Every node, the root included, parents before their children."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _drop_device(self, node: Node) -> None:
        if node.snapshot is not None:
            self.state_pool.free_snapshot(node.snapshot)
            node.snapshot = None
            self.num_snapshots -= 1
        if node.pages is not None:
            self.allocator.release(node.pages)
            self.num_pages -= len(node.pages)
            node.pages = None

    def _remove_subtree(self, node: Node) -> None:
        for child in list(node.children.values()):
            self._remove_subtree(child)
        self._release(node)
        del node.parent.children[self._key(node.tokens, 0)]

    def evict_pages(self, need_free: int) -> None:
        """Free device pages until the allocator has need_free free: unlocked nodes with no child on the device,
        least recently used first, leave the device (`_evict_device`)."""
        while self.allocator.num_free < need_free:
            cands = [n for n in self.nodes() if n is not self.root and n.pages is not None and n.lock == 0
                     and all(c.pages is None for c in n.children.values())]
            if not cands:
                return
            self._evict_device(min(cands, key=lambda n: n.last_use))

    # ---- snapshot placement ----
    def alloc_snapshot(self, resume: bool = True) -> int | None:
        # a free snapshot slot, else the slot of the one least worth keeping (_take_snapshot_slot; resume: the
        # snapshot of a resume point or a kept interval one)
        slot = self.state_pool.alloc_snapshot()
        return slot if slot is not None else self._take_snapshot_slot(resume)

    def _take_snapshot_slot(self, resume: bool) -> int | None:
        """The least worth keeping snapshot (snapshot_worth.worth; a running request's lock does not pin it, an
        admission in progress does) gives its slot up (`_snapshot_leaving`: with a host tier, demoted to it when it
        has room or can make it from less worth keeping copies). resume=False (an interval snapshot) takes only
        the slot of an interior interval snapshot or of one another tier holds too: it never pushes out a resume
        point, a leaf or a branch point."""
        held = [n for n in self.nodes() if n.snapshot is not None and n not in self.pinned]
        if not held:
            return None
        ranks = snapshot_ranks(self)
        victim = min(held, key=lambda n: worth(n, ranks, n.host_snapshot is not None))
        unique, kind, *_ = worth(victim, ranks, victim.host_snapshot is not None)
        if not resume and unique and kind > 0:          # a leaf, a resume point or a group's
            return None
        self._snapshot_leaving(victim)
        slot, victim.snapshot = victim.snapshot, None
        self.num_snapshots -= 1
        self.snapshots_evicted += 1
        self._drop_stateless_leaves(victim)
        return slot

    def _drop_stateless_leaves(self, node: Node) -> None:
        """A leaf with no state anywhere can no longer be resumed from: remove it and such leaves above it."""
        while self.hybrid and node is not self.root and not node.children and node.snapshot is None \
                and node.host_snapshot is None and node.lock == 0:
            parent = node.parent
            self._remove_subtree(node)
            node = parent

    # ---- flush ----
    def flush(self) -> bool:
        """Empty the tree (and the tiers' copies it holds: the host tier's); refuses (returns False) while a running
        request holds part of it."""
        if any(n.lock for n in self.nodes() if n is not self.root):
            return False
        for child in list(self.root.children.values()):
            self._remove_subtree(child)
        return True

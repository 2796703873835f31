"""Radix prefix cache for hybrid models: KV pages plus recurrent-state snapshots, at page granularity, with an
optional host tier (L2) and file tier (L3) behind it (tinyserve/tiers.py).

A node holds a run of tokens (a multiple of page_size), where its KV lives (device pages, host pages, or both) and
optionally one state snapshot (conv + SSM state of every GDN layer *at the node's end*; on the device, on the host,
or both). A hybrid model can only resume where a state exists, so a match is usable up to the deepest matched node
that has a device snapshot (the root counts: the state at position 0 is all zeros); a model without GDN layers can
use the whole match. Before matching, `promote` brings host-only nodes on the prompt's path and blobs read from the
file tier back onto the device.

Invariants (tests check them):
- The tree owns one reference on each of its device pages (PageAllocator refcounts), one device snapshot slot per
  device snapshot and its host blocks. Running requests hold their own page references, so evicting a node never
  pulls KV from under a request.
- Pages in the tree are full pages below every writer's position: nobody writes to a cached page again.
- A locked node (a running request started from it) and its ancestors are never evicted from the device.
- Nodes on the device form a subtree at the root: device eviction takes unlocked nodes with no child on the device,
  LRU first. A node backed up on the host is demoted to host-only; one that is not is removed with its subtree.
- Host eviction takes host copies without host-backed children, LRU first; a host-only node goes with its copy.
- Snapshots are evicted by LRU on their own (their slots are the scarce resource); a leaf left with no snapshot
  anywhere goes with it, since nothing can resume there.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tinyserve.kv import PageAllocator
from tinyserve.state import StatePool
from tinyserve.tiers import Blob, Tiers, chain_hashes

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: list[int]
    pages: list[int] | None              # device pages (None: not on the device)
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    snapshot: int | None = None          # device snapshot slot with the state at this node's end
    host_pages: list[int] | None = None  # host-tier copy of the KV
    host_snapshot: int | None = None     # host-tier copy of the snapshot
    lock: int = 0                        # running requests that started from this node or below
    hits: int = 0
    last_use: int = 0
    depth: int = 0                       # tokens from the root to this node's end

    def touch(self) -> None:
        self.last_use = next(_clock)

    @property
    def start(self) -> int:
        return self.depth - len(self.tokens)


@dataclass
class Match:
    node: Node                # deepest usable node (resume point); the root when nothing is usable
    length: int               # usable prefix length in tokens (multiple of page_size)
    pages: list[int]          # pages covering that prefix
    kv_length: int            # longest matched prefix on the device regardless of state (a branch point)


class RadixCache:
    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool,
                 tiers: Tiers) -> None:
        self.allocator, self.state_pool = allocator, state_pool
        self.page_size, self.hybrid = page_size, hybrid
        self.tiers = tiers
        self.host, self.file = tiers.host, tiers.file
        self.root = Node([], [])
        self.root.lock = 1                   # never evicted
        self.num_pages = 0                   # device pages referenced by the tree
        self.num_snapshots = 0               # device snapshots held
        self.snapshots_evicted = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- walking ----
    def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i:i + self.page_size])

    def _walk(self, tokens: list[int], split: bool) -> tuple[list[Node], int]:
        """Follow tokens down the tree page by page (through device and host-only nodes). Returns the nodes fully
        matched and the matched length; with split=True a node matched part-way is split so that the match ends
        on a node boundary."""
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
        k = m // self.page_size
        cut = lambda xs: (None, None) if xs is None else (xs[:k], xs[k:])  # noqa: E731
        (up_pages, node.pages), (up_host, node.host_pages) = cut(node.pages), cut(node.host_pages)
        upper = Node(node.tokens[:m], up_pages, node.parent, host_pages=up_host, lock=node.lock,
                     last_use=node.last_use, hits=node.hits, depth=node.start + m)
        node.parent.children[self._key(node.tokens, 0)] = upper
        node.tokens, node.parent = node.tokens[m:], upper
        upper.children[self._key(node.tokens, 0)] = node
        return upper

    def _limit(self, tokens: list[int]) -> int:
        return (len(tokens) - 1) // self.page_size * self.page_size     # always leave one token to compute

    def coverage(self, tokens: list[int]) -> int:
        """Tokens of the prompt's usable part present in the tree (device or host), without changing it."""
        return self._walk(tokens[:self._limit(tokens)], split=False)[1]

    def match(self, tokens: list[int]) -> Match:
        """Longest usable device-resident prefix of tokens, always leaving at least one token to compute."""
        path, _ = self._walk(tokens[:self._limit(tokens)], split=True)
        on_device = []
        for node in path:
            if node.pages is None:
                break
            on_device.append(node)
        usable = self.root
        for node in on_device:
            node.touch()
            node.hits += 1
            if self.tiers.backup_due("hit", node.hits):
                self._backup(node)
            if not self.hybrid or node.snapshot is not None:
                usable = node
        pages = [p for node in on_device[:on_device.index(usable) + 1] for p in node.pages] \
            if usable is not self.root else []
        self.query_tokens += len(tokens)
        self.hit_tokens += usable.depth
        kv_len = on_device[-1].depth if on_device else 0
        return Match(usable, usable.depth, pages, kv_len)

    def lock(self, node: Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock += delta
            assert node.lock >= 0
            node = node.parent

    # ---- insertion ----
    def insert(self, tokens: list[int], pages: list[int], snapshot: int | None) -> None:
        """Cache a page-aligned prefix (its KV pages, and the state at its end if given). Parts already on the
        device keep their pages (host-only parts take these); the tree takes a reference on the pages it keeps.
        A snapshot the node already has is given back."""
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) == len(tokens) // ps
        path, pos = self._walk(tokens, split=True)
        for node in path:
            if node.pages is None:                     # host-only: the request's pages bring it back
                node.pages = pages[node.start // ps:node.depth // ps]
                self.allocator.retain(node.pages)
                self.num_pages += len(node.pages)
        node = path[-1] if path else self.root
        if pos < len(tokens):
            new = Node(tokens[pos:], pages[pos // ps:], node, depth=len(tokens))
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
        if node is not self.root and self.tiers.backup_due("insert", node.hits):
            self._backup(node)

    # ---- tiers: backup, promotion ----
    def _path_tokens(self, node: Node) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def _backup(self, node: Node) -> None:
        """Copy a device node (and its snapshot) to the host tier, then queue it for the file tier."""
        if node.pages is None:
            return
        if self.host is not None:
            if node.host_pages is None:
                hp = self._host_alloc_pages(len(node.pages), protect=node)
                if hp is not None:
                    self.host.save_pages(node.pages, hp)
                    node.host_pages = hp
            if node.snapshot is not None and node.host_snapshot is None:
                hs = self._host_alloc_snapshot(protect=node)
                if hs is not None:
                    self.host.save_snapshot(node.snapshot, hs)
                    node.host_snapshot = hs
        if self.file is not None:
            self._write_file(node)

    def _write_file(self, node: Node) -> None:
        ps = self.page_size
        hashes = chain_hashes(self.file.fingerprint, self._path_tokens(node), ps)
        start, end = hashes[node.start // ps], hashes[node.depth // ps]
        if self.file.writable and not self.file.has(start, end):
            self.tiers.write_file(start, end, node.tokens, node.pages, node.host_pages, node.snapshot,
                                  node.host_snapshot)

    def promote(self, tokens: list[int], blobs: list[Blob], first_page: int) -> dict[str, tuple[int, int]]:
        """Bring the prompt's cached path onto the device: host-only nodes, then file-tier blobs that continue it.
        Returns the token ranges loaded per tier, {"host": (start, end), "file": (start, end)}."""
        ps, loaded = self.page_size, {}
        path, _ = self._walk(tokens[:self._limit(tokens)], split=True)
        if path:                                        # keep the path while making room for it (locks walk up
            self.lock(path[-1], +1)                     # the parents, so nodes split meanwhile are covered)
        try:
            reach, host_start = 0, None
            for node in path:
                if node.pages is None:
                    if not self._host_load(node):
                        break
                    host_start = node.start if host_start is None else host_start
                reach = node.depth
            if host_start is not None:
                loaded["host"] = (host_start, reach)
            if self.host is not None and self.hybrid:
                self._host_load_snapshot([n for n in path if n.depth <= reach])
            if blobs and reach == first_page * ps:
                on_path = [n for n in path if n.depth <= reach]
                end = self._load_blobs(tokens, blobs, on_path)
                if end > reach:
                    loaded["file"] = (reach, end)
        finally:
            if path:
                self.lock(path[-1], -1)
        return loaded

    def _host_load(self, node: Node) -> bool:
        if self.host is None or node.host_pages is None:
            return False
        self.evict_pages(len(node.host_pages))
        pages = self.allocator.alloc(len(node.host_pages)) if node.host_pages is not None else None
        if pages is None:
            return False
        self.host.load_pages(node.host_pages, pages)
        node.pages = pages
        self.num_pages += len(pages)
        self.host.stats.hit_tokens += len(node.tokens)
        node.touch()
        return True

    def _host_load_snapshot(self, path: list[Node]) -> None:
        """Bring back the deepest host snapshot on a device path (the only one a resume needs)."""
        for node in reversed(path):
            if node.snapshot is not None:
                return
            if node.host_snapshot is not None:
                slot = self.alloc_snapshot()
                if slot is not None and node.host_snapshot is None:   # defensive: never copy from no slot
                    self.state_pool.free_snapshot(slot)
                elif slot is not None:
                    self.host.load_snapshot(node.host_snapshot, slot)
                    node.snapshot = slot
                    self.num_snapshots += 1
                return

    def _load_blobs(self, tokens: list[int], blobs: list[Blob], path: list[Node]) -> int:
        """Insert file-tier runs (continuing the device path) into the tree; returns the position reached."""
        ps = self.page_size
        prefix_pages = [p for n in path for p in n.pages]
        pos = len(prefix_pages) * ps
        for blob in blobs:
            n = blob.kv.shape[0]
            self.evict_pages(n)
            pages = self.allocator.alloc(n)
            if pages is None:
                break
            slot = self.alloc_snapshot() if blob.conv is not None and self.hybrid else None
            self.tiers.load_blob(blob, pages, slot)
            end = pos + n * ps
            self.insert(tokens[:end], prefix_pages + pages, slot)
            self.allocator.release(pages)              # the tree holds its own reference now
            prefix_pages += pages
            pos = end
            self.file.stats.hit_tokens += n * ps
        return pos

    # ---- device eviction ----
    def _nodes(self) -> list[Node]:
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

    def _drop_host(self, node: Node) -> None:
        if node.host_pages is not None:
            self.host.free_pages(node.host_pages)
            node.host_pages = None
        if node.host_snapshot is not None:
            self.host.free_snapshot(node.host_snapshot)
            node.host_snapshot = None

    def _remove_subtree(self, node: Node) -> None:
        for child in list(node.children.values()):
            self._remove_subtree(child)
        self._drop_device(node)
        self._drop_host(node)
        del node.parent.children[self._key(node.tokens, 0)]

    def evict_pages(self, need_free: int) -> None:
        """Free device pages until the allocator has need_free free: unlocked nodes with no child on the device,
        least recently used first, are demoted to the host (backed up first under write_back) or removed."""
        while self.allocator.num_free < need_free:
            cands = [n for n in self._nodes() if n is not self.root and n.pages is not None and n.lock == 0
                     and all(c.pages is None for c in n.children.values())]
            if not cands:
                return
            victim = min(cands, key=lambda n: n.last_use)
            if self.tiers.backup_due("evict", victim.hits):
                self._backup(victim)
            if victim.host_pages is not None:
                if victim.snapshot is not None and victim.host_snapshot is None:
                    hs = self._host_alloc_snapshot(protect=victim)
                    if hs is not None:
                        self.host.save_snapshot(victim.snapshot, hs)
                        victim.host_snapshot = hs
                self._drop_device(victim)                # demoted: host-only now
            else:
                self._remove_subtree(victim)

    def alloc_snapshot(self) -> int | None:
        """A free device snapshot slot, evicting the least recently used unlocked snapshot if none is free
        (kept on the host when a host tier exists)."""
        slot = self.state_pool.alloc_snapshot()
        if slot is not None:
            return slot
        held = [n for n in self._nodes() if n.snapshot is not None and n.lock == 0]
        if not held:
            return None
        victim = min(held, key=lambda n: n.last_use)
        if self.host is not None and victim.host_snapshot is None and \
                (self.tiers.backup_due("evict", victim.hits) or victim.host_pages is not None):
            hs = self._host_alloc_snapshot(protect=victim)
            if hs is not None:
                self.host.save_snapshot(victim.snapshot, hs)
                victim.host_snapshot = hs
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

    # ---- host eviction ----
    def _host_alloc_pages(self, n: int, protect: Node) -> list[int] | None:
        while self.host.num_free_pages < n:
            # a locked host-only node is being promoted (its copy is about to be read): pinned
            cands = [x for x in self._nodes() if x.host_pages is not None and x is not protect
                     and all(c.host_pages is None for c in x.children.values())
                     and (x.pages is not None or (not x.children and x.lock == 0))]
            if not cands:
                return None
            victim = min(cands, key=lambda x: x.last_use)
            if victim.pages is None:
                self._remove_subtree(victim)            # host-only leaf: nothing else holds it
            else:
                self._drop_host(victim)
        return self.host.alloc_pages(n)

    def _host_alloc_snapshot(self, protect: Node) -> int | None:
        slot = self.host.alloc_snapshot()
        if slot is not None:
            return slot
        # a locked node without a device snapshot may be about to load this one (promote): pinned
        held = [x for x in self._nodes() if x.host_snapshot is not None and x is not protect
                and (x.snapshot is not None or x.lock == 0)]
        if not held:
            return None
        victim = min(held, key=lambda x: x.last_use)
        slot, victim.host_snapshot = victim.host_snapshot, None
        if victim.pages is None:
            self._drop_stateless_leaves(victim)
        return slot

    # ---- invariants ----
    def check(self) -> None:
        """Assert the invariants at the top of this module (tests call it after every scenario)."""
        ps, nodes = self.page_size, self._nodes()
        dev_pages: list[int] = []
        host_pages: list[int] = []
        snaps: list[int] = []
        host_snaps: list[int] = []
        for n in nodes:
            assert n.lock >= 0
            if n is self.root:
                continue
            assert n.tokens and len(n.tokens) % ps == 0, "a node holds whole pages"
            assert n.parent.children.get(self._key(n.tokens, 0)) is n, "a node is filed under its first page"
            assert n.depth == n.parent.depth + len(n.tokens), "depth = parent's depth + own tokens"
            assert n.parent.lock >= n.lock, "a lock covers the whole path up to the root"
            if n.pages is not None:
                assert len(n.pages) == len(n.tokens) // ps
                assert n.parent is self.root or n.parent.pages is not None, "device nodes form a subtree"
                dev_pages += n.pages
            else:
                assert n.lock == 0, "a locked node is on the device"
                assert n.snapshot is None, "a device snapshot needs device pages"
                assert n.host_pages is not None, "a node lives on the device, the host, or both"
            if n.host_pages is not None:
                assert len(n.host_pages) == len(n.tokens) // ps
                host_pages += n.host_pages
            if n.snapshot is not None:
                snaps.append(n.snapshot)
            if n.host_snapshot is not None:
                host_snaps.append(n.host_snapshot)
        assert len(set(dev_pages)) == len(dev_pages) == self.num_pages, "each device page once, counted"
        assert all(self.allocator.refcount[p] >= 1 for p in dev_pages), "the tree holds a reference on its pages"
        assert len(set(snaps)) == len(snaps) == self.num_snapshots, "each snapshot slot once, counted"
        assert all(s >= self.state_pool.num_slots for s in snaps), "snapshots live in snapshot slots"
        assert not set(snaps) & set(self.state_pool._free_snapshots), "a held snapshot slot is not free"
        if self.host is not None:
            assert len(set(host_pages)) == len(host_pages) == self.host.num_pages - self.host.num_free_pages
            assert len(set(host_snaps)) == len(host_snaps) == \
                self.host.num_snapshots - self.host.num_free_snapshots
        else:
            assert not host_pages and not host_snaps

    # ---- flush ----
    def flush(self) -> bool:
        """Empty the device and host tiers; refuses (returns False) while a running request holds part of it."""
        if any(n.lock for n in self._nodes() if n is not self.root):
            return False
        for child in list(self.root.children.values()):
            self._remove_subtree(child)
        return True

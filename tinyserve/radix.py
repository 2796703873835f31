"""Radix prefix cache for hybrid models: KV pages plus recurrent-state snapshots, at page granularity, with an
optional host tier (L2, host_tier.py) and file tier (L3, file_tier.py) behind it. The tree decides what goes to a
tier and when (`cache.host.write_policy`); the tiers do the copies.

A node holds a run of tokens (a multiple of page_size), where its KV lives (device pages, host pages, or both) and
optionally one state snapshot (conv + SSM state of every GDN layer *at the node's end*; on the device, on the host,
or both). A hybrid model can only resume where a state exists, so a match is usable up to the deepest matched node
that has a device snapshot (the root counts: the state at position 0 is all zeros); a model without GDN layers can
use the whole match. Before matching, `promote` brings host-only nodes on the prompt's path and blobs read from the
file tier back onto the device.

Invariants (radix_check.check_tree asserts them; tests call it after every scenario):
- The tree owns one reference on each of its device pages (PageAllocator refcounts), one device snapshot slot per
  device snapshot and its host blocks. Running requests hold their own page references, so evicting a node never
  pulls KV from under a request.
- Pages in the tree are full pages below every writer's position: nobody writes to a cached page again.
- A locked node (a running request matched its prompt up to it: it resumes there or above, and computes the same
  tokens below) and its ancestors keep their KV pages on the device, and stay in the tree without a state (a
  stateless node dropped under the request would be written to the file tier again when the request inserts it). A lock
  does not pin the node's snapshot: the request copied that state at admission and never reads it again, so the
  snapshot is ranked like any other (many sessions on one shared prefix would otherwise pin every slot). Only the
  snapshots of an admission in progress (`promote`, `pinned`) are never taken.
- Nodes on the device form a subtree at the root: device eviction takes unlocked nodes with no child on the device,
  LRU first. A node backed up on the host is demoted to host-only; one that is not is removed with its subtree.
- Host eviction takes host copies without host-backed children, LRU first; a host-only node goes with its copy.
- Snapshots are evicted on their own (their slots are the scarce resource), in the order of snapshot_worth.py:
  copies the other tier also holds first, ..., resume points (prompt ends, branch points, request ends, the last
  messages' starts; `insert(..., resume=True)`) and leaves last, a request's together (`claim`). A device snapshot
  that goes is demoted to the host tier when it has room or holds a copy worth less; an interval snapshot
  (`alloc_snapshot(resume=False)`) never displaces a leaf or a resume point. A leaf left with no snapshot anywhere
  goes with it, since nothing can resume there. Held snapshots never exceed the plan's slots (device) and snapshots
  (host), checked in bytes.
- File tier: each cached page is stored once. A node records the stored run that holds its pages (`file_run`; both
  halves of a split keep it) and the blob that holds the state at its end (`file_state`; a state blob when that end
  lies inside a stored run), and is written only when the file tier lacks them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tinyserve.blob import Blob, chain_hashes
from tinyserve.config import WRITE_POLICIES
from tinyserve.file_tier import FileTier
from tinyserve.host_tier import HostTier
from tinyserve.kv import PageAllocator
from tinyserve.radix_check import check_tree
from tinyserve.snapshot_worth import snapshot_ranks, worth
from tinyserve.state import StatePool

_clock = itertools.count()
# The one table of write policies (cache.host.write_policy, in config.py's order): at which event a device node is
# backed up to the host tier (and from there, or straight from the device without a host tier, to the file tier).
BACKUP_EVENT = dict(zip(WRITE_POLICIES, ("insert", "hit", "evict")))


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
    resume: bool = False                 # the state at this node's end resumes requests: a prompt end, a branch
                                         # point, a request end or a hinted place (not just an interval snapshot)
    claimed: int = 0                     # the stamp of the last request that had a resume point or a kept
                                         # interval snapshot here (made or found cached): snapshot_worth
    file_run: tuple[bytes, bytes] | None = None    # file tier: the stored run (start, end hash) holding this
                                                   # node's pages (after a split, a run longer than the node)
    file_state: tuple[bytes, bytes] | None = None  # file tier: the blob holding the state at this node's end

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
    walked: int = 0           # tokens matched in the tree, any tier (page-aligned)
    branch: Node | None = None    # where the prompt left a cached path that goes on (a divergence); None: it didn't
    deepest: Node | None = None   # the node ending at kv_length (the root for none): what the request locks


class RadixCache:
    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool,
                 host: HostTier | None = None, file: FileTier | None = None,
                 write_policy: str = "write_through") -> None:
        assert write_policy in BACKUP_EVENT, write_policy
        assert file is None or file.needs_state == hybrid, "a prefix of a stored run is usable only up to a state"
        self.allocator, self.state_pool = allocator, state_pool
        self.page_size, self.hybrid = page_size, hybrid
        self.host, self.file, self.write_policy = host, file, write_policy
        # the event that backs a node up (_backup_due); None without a tier
        self.backup_event = BACKUP_EVENT[write_policy] if host is not None or file is not None else None
        self.root = Node([], [])
        self.root.lock = 1                   # never evicted
        self.pinned: set[Node] = set()       # nodes whose snapshots an admission is loading (promote): never taken
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
        """Cut node after m tokens; the new upper node has no snapshot (the state exists only at the old end). Both
        halves keep the stored run that holds their pages, so neither is written to the file tier again."""
        k = m // self.page_size
        cut = lambda xs: (None, None) if xs is None else (xs[:k], xs[k:])  # noqa: E731
        (up_pages, node.pages), (up_host, node.host_pages) = cut(node.pages), cut(node.host_pages)
        upper = Node(node.tokens[:m], up_pages, node.parent, host_pages=up_host, lock=node.lock,
                     last_use=node.last_use, hits=node.hits, depth=node.start + m, file_run=node.file_run)
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
        limit = self._limit(tokens)
        path, walked = self._walk(tokens[:limit], split=True)
        usable, pages, kv_len, deepest = self.root, [], 0, self.root
        for node in path:
            if node.pages is None:                     # host-only from here on
                break
            node.touch()
            node.hits += 1
            if self._backup_due("hit", node.hits):
                self._backup(node)
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
        """A new request's stamp (they count requests: snapshot_worth.INTERVAL_AGE), for `claim` and
        insert(..., claim=)."""
        self.requests += 1
        return self.requests

    def claim(self, tokens: list[int], ends: set[int], stamp: int) -> None:
        """A request's resume points and kept interval snapshots that are cached already (its prompt end or last
        message's start, found in the tree): they count as its own (snapshot_worth), as if it had made them."""
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
        """Cache a page-aligned prefix (its KV pages, and the state at its end if given). Parts already on the
        device keep their pages (host-only parts take these); the tree takes a reference on the pages it keeps.
        A snapshot the node already has is given back. resume: the state at this end resumes requests (a prompt
        end, a branch point, a request end), so it is kept longer than interval snapshots; claim: the stamp
        (`stamp`) of the request whose resume point or kept interval snapshot this is. Returns the node ending at
        tokens' end (the root for no tokens)."""
        node = self._insert(tokens, pages, snapshot, resume)
        if claim and node is not self.root:
            node.claimed = claim
        if node is not self.root and self._backup_due("insert", node.hits):
            self._backup(node)
        return node

    def _insert(self, tokens: list[int], pages: list[int], snapshot: int | None, resume: bool) -> Node:
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) == len(tokens) // ps
        path, pos = self._walk(tokens, split=True)
        if self.host is not None:
            self._take_back(path, pages)
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
        if resume and node is not self.root:
            node.resume = True
        return node

    def _take_back(self, path: list[Node], pages: list[int]) -> None:
        """Host-only nodes on an inserted path: the inserted pages bring them back to the device."""
        ps = self.page_size
        for node in path:
            if node.pages is None:
                node.pages = pages[node.start // ps:node.depth // ps]
                self.allocator.retain(node.pages)
                self.num_pages += len(node.pages)

    # ---- tiers: backup, promotion ----
    def _backup_due(self, event: str, hits: int) -> bool:
        """Is a node backed up now (never without a tier)? event: "insert" (cached), "hit" (matched again; hits
        counts its matches), "evict" (leaving the device)."""
        return event == self.backup_event and (event != "hit" or hits >= 2)

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
            if node.host_pages is None and self._evict_host_pages(len(node.pages), protect=node):
                hp = self.host.alloc_pages(len(node.pages))
                if hp is not None:
                    self.host.save_pages(node.pages, hp)
                    node.host_pages = hp
            self._snapshot_to_host(node, copied=True)
        if self.file is not None:
            self._write_file(node)

    def _write_file(self, node: Node) -> None:
        """Queue a device node for the file tier: its pages as one blob, unless a stored blob holds them already
        (a node split from a stored run keeps that run; a run stored for its parent may go on into it): no page is
        stored twice. Then the state at its end as a state blob when the file tier has none there (a branch point
        inside a stored run)."""
        if not self.file.writable:
            return
        ps = self.page_size
        hashes = chain_hashes(self.file.fingerprint, self._path_tokens(node), ps)
        end = hashes[node.depth // ps]
        state = node.snapshot is not None or node.host_snapshot is not None
        if node.file_run is None or not self.file.has(*node.file_run):
            # the parent's stored run may go on into this node (a leaf dropped for want of a state, cached again
            # now): write only what follows it
            k, run = 0, node.parent.file_run
            if run is not None and run[1] in hashes[node.start // ps + 1:node.depth // ps + 1] and \
                    self.file.has(*run):
                k = hashes.index(run[1], node.start // ps + 1) - node.start // ps
            if k < len(node.pages):
                run, start = (hashes[node.start // ps + k], end), hashes[node.start // ps + k]
                if not self.file.has(*run):
                    self.file.save_run(start, end, node.tokens[k * ps:], node.pages[k:], node.snapshot,
                                       node.host_pages[k:] if node.host_pages is not None else None,
                                       node.host_snapshot)
            node.file_run, node.file_state = run, run if state else None    # a run holds the state at its end
        if state and (node.file_state is None or not self.file.has(*node.file_state)):
            self.file.save_state(end, node.snapshot, node.host_snapshot)
            node.file_state = (end, end)

    def promote(self, tokens: list[int], blobs: list[Blob], first_page: int) -> dict[str, tuple[int, int]]:
        """Bring the prompt's cached path onto the device: host-only nodes, then file-tier blobs that continue it.
        Returns the token ranges loaded per tier, {"host": (start, end), "file": (start, end)}."""
        ps, loaded = self.page_size, {}
        path, _ = self._walk(tokens[:self._limit(tokens)], split=True)
        if path:                                        # keep the path while making room for it (locks walk up
            self.lock(path[-1], +1)                     # the parents, so nodes split meanwhile are covered)
        self.pinned = set(path)                         # and the states on it, one of which this prompt resumes
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
                on_path = [n for n in path if n.depth <= reach]
                state_from = max((n.depth for n in on_path if n.snapshot is not None), default=0)
                at = self._host_load_snapshot(on_path)
                if at is not None:      # the device KV past the last device state is usable thanks to the host
                    start, end = loaded.get("host", (at, at))
                    loaded["host"] = (min(start, state_from), max(end, at))
            if blobs and reach == first_page * ps:
                on_path = [n for n in path if n.depth <= reach]
                end = self._load_blobs(tokens, blobs, on_path)
                if end > reach:
                    loaded["file"] = (reach, end)
        finally:
            if path:
                self.lock(path[-1], -1)
            self.pinned = set()
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

    def _host_load_snapshot(self, path: list[Node]) -> int | None:
        """Bring back the deepest host snapshot on a device path (the only one a resume needs) when it lies deeper
        than every device snapshot there; returns the depth it was loaded at."""
        for node in reversed(path):
            if node.snapshot is not None:
                return None
            if node.host_snapshot is not None:
                slot = self.alloc_snapshot()
                if slot is None:
                    return None
                if node.host_snapshot is None:          # making room took this very copy
                    self.state_pool.free_snapshot(slot)
                    return None
                self.host.load_snapshot(node.host_snapshot, slot)
                node.snapshot = slot
                self.num_snapshots += 1
                return node.depth
        return None

    def _load_blobs(self, tokens: list[int], blobs: list[Blob], path: list[Node]) -> int:
        """Insert file-tier runs (continuing the device path) into the tree; returns the position reached."""
        ps = self.page_size
        prefix_pages = [p for n in path for p in n.pages]
        pos = len(prefix_pages) * ps
        held: Node | None = None             # the runs loaded so far stay locked while room is made for the next
        try:                                 # (evicted, their pages would come back as the next run's pages)
            for blob in blobs:
                n = blob.kv.shape[0]
                self.evict_pages(n)
                pages = self.allocator.alloc(n)
                if pages is None:
                    break
                slot = self.alloc_snapshot() if blob.conv is not None and self.hybrid else None
                if slot is None and blob.conv is not None and self.hybrid and held is not None and \
                        held.snapshot is not None:     # the deeper state resumes more: it takes the slot of the
                    slot, held.snapshot = held.snapshot, None   # one loaded just above it
                    self.num_snapshots -= 1
                self.file.load(blob, pages, slot)
                end = pos + n * ps
                node = self._insert(tokens[:end], prefix_pages + pages, slot, resume=False)
                self.lock(node, +1)
                self.pinned.add(node)
                if held is not None:
                    self.lock(held, -1)
                held = node
                node.file_state = blob.stored_state    # the file tier holds these: never written again
                run = node
                while run is not self.root and run.start >= pos:
                    run.file_run = blob.stored_run or (blob.start_hash, blob.end_hash)
                    run = run.parent
                if self._backup_due("insert", node.hits):
                    self._backup(node)
                self.allocator.release(pages)          # the tree holds its own reference now
                prefix_pages += pages
                pos = end
                self.file.stats.hit_tokens += n * ps
        finally:
            if held is not None:
                self.lock(held, -1)
        return pos

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
            cands = [n for n in self.nodes() if n is not self.root and n.pages is not None and n.lock == 0
                     and all(c.pages is None for c in n.children.values())]
            if not cands:
                return
            victim = min(cands, key=lambda n: n.last_use)
            if self._backup_due("evict", victim.hits):
                self._backup(victim)
            if victim.host_pages is not None:
                self._snapshot_to_host(victim)
                self._drop_device(victim)                # demoted: host-only now
            else:
                self._remove_subtree(victim)

    # ---- snapshot placement ----
    def alloc_snapshot(self, resume: bool = True) -> int | None:
        """A free device snapshot slot; when none is free, the slot of the snapshot least worth keeping
        (_take_snapshot_slot), or None. resume: a snapshot its request resumes from or keeps (a resume point, or
        one of its last interval snapshots before its prompt end), not just an interval one."""
        slot = self.state_pool.alloc_snapshot()
        return slot if slot is not None else self._take_snapshot_slot(resume)

    def _take_snapshot_slot(self, resume: bool) -> int | None:
        """The least worth keeping snapshot (snapshot_worth.worth; a running request's lock does not pin it, an
        admission in progress does) gives its slot up: demoted to the host tier when that has room (or can make
        it from less worth keeping copies), dropped otherwise. resume=False (an interval snapshot) takes only
        the slot of an interior interval snapshot or of one with a host copy: it never pushes out a resume
        point, a leaf or a branch point."""
        held = [n for n in self.nodes() if n.snapshot is not None and n not in self.pinned]
        if not held:
            return None
        ranks = snapshot_ranks(self)
        victim = min(held, key=lambda n: worth(n, ranks, n.host_snapshot is not None))
        unique, kind, *_ = worth(victim, ranks, victim.host_snapshot is not None)
        if not resume and unique and kind > 0:          # a leaf, a resume point or a group's
            return None
        if self.host is not None:
            self._snapshot_to_host(victim)
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
    def evict_host(self, pages: int = 0, snapshots: int = 0) -> None:
        """Evict host copies until the host tier has `pages` pages and `snapshots` snapshot slots free (its relief
        under memory pressure lowers its capacity first: then fewer than none are free): LRU host pages, and the
        host snapshots least worth keeping, by the rules that make room for a backup. What cannot go (the path of
        a running request or of an admission in progress) stays."""
        self._evict_host_pages(pages, protect=None)
        while self.host.num_free_snapshots < snapshots:
            victim = self._host_snapshot_victim(protect=None)
            if victim is None:
                return
            self.host.free_snapshot(self._take_host_snapshot(victim))

    def _evict_host_pages(self, n: int, protect: Node | None) -> bool:
        """Evict LRU host copies without host-backed children until n host pages are free (a host-only node goes
        with its copy); False when what is left cannot go."""
        while self.host.num_free_pages < n:
            # a locked host-only node is being promoted (its copy is about to be read): pinned
            cands = [x for x in self.nodes() if x.host_pages is not None and x is not protect
                     and all(c.host_pages is None for c in x.children.values())
                     and (x.pages is not None or (not x.children and x.lock == 0))]
            if not cands:
                return False
            victim = min(cands, key=lambda x: x.last_use)
            if victim.pages is None:
                self._remove_subtree(victim)            # host-only leaf: nothing else holds it
            else:
                self._drop_host(victim)
        return True

    def _snapshot_to_host(self, node: Node, copied: bool = False) -> None:
        """Copy node's device snapshot to the host tier if it has none there and the tier holds (or can make room
        for) it without dropping a copy worth more; copied: the device keeps its snapshot too."""
        if node.snapshot is not None and node.host_snapshot is None:
            slot = self._host_alloc_snapshot(protect=node, copy_of=node, copied=copied)
            if slot is not None:
                self.host.save_snapshot(node.snapshot, slot)
                node.host_snapshot = slot

    def _host_alloc_snapshot(self, protect: Node | None, copy_of: Node | None = None, copied: bool = False) \
            -> int | None:
        """A host snapshot slot, taking the one least worth keeping when the tier is full (_host_snapshot_victim)."""
        slot = self.host.alloc_snapshot()
        if slot is not None:
            return slot
        victim = self._host_snapshot_victim(protect, copy_of, copied)
        return self._take_host_snapshot(victim) if victim is not None else None

    def _host_snapshot_victim(self, protect: Node | None, copy_of: Node | None = None, copied: bool = False) \
            -> Node | None:
        """The node whose host snapshot is least worth keeping (snapshot_worth.worth). With copy_of (the node whose
        snapshot would take its place; copied: it stays on the device too), only one worth less than that: a copy
        never pushes out a better one."""
        # an admission in progress may be about to load the deepest host-only snapshot on its path: pinned
        loading = max((x for x in self.pinned if x.host_snapshot is not None and x.snapshot is None),
                      key=lambda x: x.depth, default=None)
        held = [x for x in self.nodes() if x.host_snapshot is not None and x is not protect and x is not loading]
        if not held:
            return None
        ranks = snapshot_ranks(self)
        victim = min(held, key=lambda x: worth(x, ranks, x.snapshot is not None))
        if copy_of is not None and worth(victim, ranks, victim.snapshot is not None) >= \
                worth(copy_of, ranks, copied):
            return None
        return victim

    def _take_host_snapshot(self, victim: Node) -> int:
        """Take victim's host snapshot slot; a host-only leaf left with no state anywhere goes."""
        slot, victim.host_snapshot = victim.host_snapshot, None
        if victim.pages is None:
            self._drop_stateless_leaves(victim)
        return slot

    def check(self) -> None:
        check_tree(self)

    # ---- flush ----
    def flush(self) -> bool:
        """Empty the device and host tiers; refuses (returns False) while a running request holds part of it."""
        if any(n.lock for n in self.nodes() if n is not self.root):
            return False
        for child in list(self.root.children.values()):
            self._remove_subtree(child)
        return True

"""The tiers' policy over the radix tree: what goes to the host tier (L2, host_tier.py) and the file tier (L3,
file_tier.py), when, and how it comes back. TieredRadixCache is radix.RadixCache with either tier or both behind it
(cache.PrefixCache builds it when one is configured; without them the tree runs alone and none of this does). The
tree decides what stays on the device; this decides what goes to a tier and when (`cache.host.write_policy`); the
tiers do the copies.

A node (TieredNode) may also have a host-tier copy of its KV and of its snapshot, so it lives on the device, the host
or both, and it records the file-tier blobs that hold its pages and its state. Before matching, `promote` brings the
host-only nodes on the prompt's path and the blobs read from the file tier that continue it onto the device.

The tree calls in at its hooks (radix.RadixCache): a node matched again or cached (`_on_hit`, `_on_insert`: a backup
may be due), host-only nodes on an inserted path (`_take_back`), a split (`_split`), a node leaving the device
(`_evict_device`), a device snapshot giving its slot up (`_snapshot_leaving`), a node leaving the tree
(`_release`). The host tier calls `evict_host` when the machine runs short of memory.

Invariants (radix_check.check_tree asserts them, with the tree's of radix.py):
- The tree owns its host blocks: each host page and host snapshot slot belongs to one node.
- A node lives on the device, the host, or both. Device eviction demotes a node backed up on the host to host-only
  (its snapshot goes to the host with it where the host takes it); one that is not is removed with its subtree.
- Host eviction takes host copies without host-backed children, LRU first; a host-only node goes with its copy.
- A device snapshot that gives its slot up is demoted to the host tier when that has room or holds a copy worth less
  (snapshot_worth); host snapshots are evicted in the same order, and a copy never pushes out one worth more. The
  host snapshot an admission in progress may load (`promote`) stays. Held host snapshots never exceed the plan's
  count, checked in bytes.
- File tier: each cached page is stored once. A node records the stored run that holds its pages (`file_run`; both
  halves of a split keep it) and the blob that holds the state at its end (`file_state`; a state blob when that end
  lies inside a stored run), and is written only when the file tier lacks them.
"""
from __future__ import annotations

from dataclasses import dataclass

from tinyserve.blob import Blob, chain_hashes
from tinyserve.config import WRITE_POLICIES
from tinyserve.file_tier import FileTier
from tinyserve.host_tier import HostTier
from tinyserve.pools import PageAllocator, StatePool
from tinyserve.radix import Node, RadixCache, cut
from tinyserve.snapshot_worth import snapshot_ranks, worth

# The one table of write policies (cache.host.write_policy, in config.py's order): at which event a device node is
# backed up to the host tier (and from there, or straight from the device without a host tier, to the file tier).
BACKUP_EVENT = dict(zip(WRITE_POLICIES, ("insert", "hit", "evict")))


@dataclass(eq=False)
class TieredNode(Node):
    """A radix node with what the tiers hold of it."""
    host_pages: list[int] | None = None  # host-tier copy of the KV
    host_snapshot: int | None = None     # host-tier copy of the snapshot
    file_run: tuple[bytes, bytes] | None = None    # file tier: the stored run (start, end hash) holding this
                                                   # node's pages (after a split, a run longer than the node)
    file_state: tuple[bytes, bytes] | None = None  # file tier: the blob holding the state at its end


class TieredRadixCache(RadixCache):
    """The radix tree with a host tier, a file tier or both behind it, and the policy that moves nodes between them."""
    node_class = TieredNode
    root: TieredNode
    pinned: set[TieredNode]

    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool,
                 host: HostTier | None, file: FileTier | None, write_policy: str = "write_through") -> None:
        assert host is not None or file is not None, "a tree without tiers is a plain RadixCache"
        assert write_policy in BACKUP_EVENT, write_policy
        assert file is None or file.needs_state == hybrid, "a prefix of a stored run is usable only up to a state"
        super().__init__(allocator, state_pool, page_size, hybrid)
        self.host, self.file, self.write_policy = host, file, write_policy
        self.backup_event = BACKUP_EVENT[write_policy]     # the event that backs a node up (_backup_due)

    # ---- the tree's hooks ----
    def _on_hit(self, node: TieredNode) -> None:
        if self._backup_due("hit", node.hits):
            self._backup(node)

    def _on_insert(self, node: TieredNode) -> None:
        if self._backup_due("insert", node.hits):
            self._backup(node)

    def _take_back(self, path: list[TieredNode], pages: list[int]) -> None:
        """Host-only nodes on an inserted path: the inserted pages bring them back to the device."""
        ps = self.page_size
        for node in path:
            if node.pages is None:
                node.pages = pages[node.start // ps:node.depth // ps]
                self.allocator.retain(node.pages)
                self.num_pages += len(node.pages)

    def _split(self, node: TieredNode, m: int) -> TieredNode:
        """Both halves keep their part of the host copy, and the stored run that holds their pages, so neither is
        written to the file tier again."""
        upper = super()._split(node, m)
        upper.host_pages, node.host_pages = cut(node.host_pages, m // self.page_size)
        upper.file_run = node.file_run
        return upper

    def _evict_device(self, victim: TieredNode) -> None:
        """Backed up first under write_back; then demoted to host-only if the host holds its KV, removed if not."""
        if self._backup_due("evict", victim.hits):
            self._backup(victim)
        if victim.host_pages is not None:
            self._snapshot_to_host(victim)
            self._drop_device(victim)                # demoted: host-only now
        else:
            super()._evict_device(victim)

    def _snapshot_leaving(self, victim: TieredNode) -> None:
        if self.host is not None:
            self._snapshot_to_host(victim)

    def _release(self, node: TieredNode) -> None:
        super()._release(node)
        self._drop_host(node)

    # ---- backup ----
    def _backup_due(self, event: str, hits: int) -> bool:
        """Is a node backed up now? event: "insert" (cached), "hit" (matched again; hits counts its matches),
        "evict" (leaving the device)."""
        return event == self.backup_event and (event != "hit" or hits >= 2)

    def _path_tokens(self, node: TieredNode) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.tokens)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def _backup(self, node: TieredNode) -> None:
        """Copy a device node (and its snapshot) to the host tier, then queue it for the file tier."""
        if node.pages is None:
            return
        if self.host is not None:
            if node.host_pages is None and self._evict_host_pages(len(node.pages), protect=node):
                host_pages = self.host.alloc_pages(len(node.pages))
                if host_pages is not None:
                    self.host.save_pages(node.pages, host_pages)
                    node.host_pages = host_pages
            self._snapshot_to_host(node, copied=True)
        if self.file is not None:
            self._write_file(node)

    def _write_file(self, node: TieredNode) -> None:
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

    # ---- promotion ----
    def promote(self, tokens: list[int], blobs: list[Blob], first_page: int) -> dict[str, tuple[int, int]]:
        """Bring the prompt's cached path onto the device: host-only nodes, then file-tier blobs that continue it.
        Returns the token ranges loaded per tier, {"host": (start, end), "file": (start, end)}."""
        ps, loaded = self.page_size, {}
        path, _ = self._walk(tokens[:self._limit(tokens)], split=True)
        if path:                                        # keep the path while making room for it (locks walk up
            self.lock(path[-1], +1)                     # the parents, so nodes split meanwhile are covered)
        self.pinned = set(path)                         # and the states on it, one of which this prompt resumes
        try:
            reach, host_start = 0, None                 # reach: the end of the path on the device
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
            if blobs and first_page * ps <= reach:    # the blobs continue the path's pages up to their start
                prefix = [p for n in path if n.depth <= reach for p in n.pages][:first_page]
                end = self._load_blobs(tokens, blobs, prefix, reach)
                if end > reach:
                    loaded["file"] = (reach, end)
        finally:
            if path:
                self.lock(path[-1], -1)
            self.pinned = set()
        return loaded

    def _host_load(self, node: TieredNode) -> bool:
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

    def _host_load_snapshot(self, path: list[TieredNode]) -> int | None:
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

    def _load_blobs(self, tokens: list[int], blobs: list[Blob], prefix_pages: list[int], reach: int) -> int:
        """Insert file-tier runs, continuing the device pages prefix_pages, into the tree; returns the position
        reached. A run's first pages may be on the device already (its KV up to reach, past the last state): the
        tree keeps its own, the run's copies of them are freed, and they count as no file-tier hit."""
        ps = self.page_size
        pos = len(prefix_pages) * ps
        held: TieredNode | None = None       # the runs loaded so far stay locked while room is made for the next
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
                self.file.stats.hit_tokens += end - max(pos, reach)
                prefix_pages += pages
                pos = end
        finally:
            if held is not None:
                self.lock(held, -1)
        return pos

    # ---- host eviction ----
    def _drop_host(self, node: TieredNode) -> None:
        if node.host_pages is not None:
            self.host.free_pages(node.host_pages)
            node.host_pages = None
        if node.host_snapshot is not None:
            self.host.free_snapshot(node.host_snapshot)
            node.host_snapshot = None

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

    def _evict_host_pages(self, n: int, protect: TieredNode | None) -> bool:
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

    def _snapshot_to_host(self, node: TieredNode, copied: bool = False) -> None:
        """Copy node's device snapshot to the host tier if it has none there and the tier holds (or can make room
        for) it without dropping a copy worth more; copied: the device keeps its snapshot too."""
        if node.snapshot is not None and node.host_snapshot is None:
            slot = self._host_alloc_snapshot(protect=node, copy_of=node, copied=copied)
            if slot is not None:
                self.host.save_snapshot(node.snapshot, slot)
                node.host_snapshot = slot

    def _host_alloc_snapshot(self, protect: TieredNode | None, copy_of: TieredNode | None = None,
                             copied: bool = False) -> int | None:
        """A host snapshot slot, taking the one least worth keeping when the tier is full (_host_snapshot_victim)."""
        slot = self.host.alloc_snapshot()
        if slot is not None:
            return slot
        victim = self._host_snapshot_victim(protect, copy_of, copied)
        return self._take_host_snapshot(victim) if victim is not None else None

    def _host_snapshot_victim(self, protect: TieredNode | None, copy_of: TieredNode | None = None,
                              copied: bool = False) -> TieredNode | None:
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

    def _take_host_snapshot(self, victim: TieredNode) -> int:
        """Take victim's host snapshot slot; a host-only leaf left with no state anywhere goes."""
        slot, victim.host_snapshot = victim.host_snapshot, None
        if victim.pages is None:
            self._drop_stateless_leaves(victim)
        return slot

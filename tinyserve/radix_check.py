"""The prefix cache's invariants as assertions: the radix tree's (listed at the top of radix.py) and, on a tree with
tiers, their bookkeeping's (tiers.py). Tests call `check_tree` (PrefixCache.check) after every scenario, so a change
that breaks one fails where it happens, not many steps later as a wrong token."""
from __future__ import annotations

from tinyserve.radix import RadixCache
from tinyserve.tiers import TieredRadixCache


def check_tree(tree: RadixCache) -> None:
    """Assert every invariant of the tree and, on a TieredRadixCache, of its tiers' bookkeeping."""
    tiered = isinstance(tree, TieredRadixCache)
    ps, nodes = tree.page_size, tree.nodes()
    dev_pages: list[int] = []
    snaps: list[int] = []
    for n in nodes:
        assert n.lock >= 0
        if n is tree.root:
            continue
        assert n.tokens and len(n.tokens) % ps == 0, "a node holds whole pages"
        assert n.parent.children.get(tuple(n.tokens[:ps])) is n, "a node is filed under its first page"
        assert n.depth == n.parent.depth + len(n.tokens), "depth = parent's depth + own tokens"
        assert n.parent is tree.root or n.parent.lock >= n.lock, "a lock covers the whole path up to the root"
        if n.pages is not None:
            assert len(n.pages) == len(n.tokens) // ps
            assert n.parent is tree.root or n.parent.pages is not None, "device nodes form a subtree"
            dev_pages += n.pages
        else:
            assert n.lock == 0, "a locked node is on the device"
            assert n.snapshot is None, "a device snapshot needs device pages"
            assert tiered and n.host_pages is not None, "a node lives on the device, the host, or both"
        if n.snapshot is not None:
            snaps.append(n.snapshot)
    assert len(set(dev_pages)) == len(dev_pages) == tree.num_pages, "each device page once, counted"
    assert all(tree.allocator.refcount[p] >= 1 for p in dev_pages), "the tree holds a reference on its pages"
    assert len(set(snaps)) == len(snaps) == tree.num_snapshots, "each snapshot slot once, counted"
    assert all(s >= tree.state_pool.num_slots for s in snaps), "snapshots live in snapshot slots"
    assert not set(snaps) & set(tree.state_pool._free_snapshots), "a held snapshot slot is not free"
    # snapshot bytes: never more than the plan's counts (the pools are sized from it)
    pool = tree.state_pool
    assert pool.conv.shape[0] == pool.ssm.shape[0] == pool.num_slots + pool.num_snapshot_slots, \
        "device snapshot memory is what the plan says"
    assert tree.num_snapshots + pool.num_free_snapshots <= pool.num_snapshot_slots, \
        "device snapshots held + free within the plan's slots (the rest track running requests)"
    if tiered:
        check_tiers(tree)


def check_tiers(tree: TieredRadixCache) -> None:
    """Assert the tiers' bookkeeping (tiers.py): each host page and host snapshot held once and counted, host
    snapshots within the plan."""
    ps = tree.page_size
    host_pages: list[int] = []
    host_snaps: list[int] = []
    for n in tree.nodes():
        if n is tree.root:
            continue
        if n.host_pages is not None:
            assert len(n.host_pages) == len(n.tokens) // ps
            host_pages += n.host_pages
        if n.host_snapshot is not None:
            host_snaps.append(n.host_snapshot)
    if tree.host is not None:
        assert len(set(host_pages)) == len(host_pages) == tree.host.num_pages - tree.host.num_free_pages
        assert len(set(host_snaps)) == len(host_snaps) == \
            tree.host.num_snapshots - tree.host.num_free_snapshots
        assert tree.host.num_snapshots <= tree.host.max_snapshots, "host snapshot capacity within the plan"
        assert len(host_snaps) * tree.host.snap_bytes <= tree.host._snaps.allocated_bytes \
            <= tree.host.max_snapshots * tree.host.snap_bytes, "host snapshot bytes within the plan"
    else:
        assert not host_pages and not host_snaps

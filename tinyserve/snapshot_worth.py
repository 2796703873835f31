"""Which cached state snapshot a full tier gives up first: the order radix.py evicts snapshots in (their slots are
the scarce resource), as a key to sort by. Least worth keeping first:
  1. a copy the other tier also holds (nothing is lost);
  2. interior interval snapshots (a deeper state lies below them: they serve only prompts that leave the path in
     between), the KEPT_INTERVALS deepest above each resume point last among them; then interval snapshots at
     leaves (the deepest state of a prompt cut short);
  3. superseded resume points: a prompt end or last message's start below which its session has gone on, and that
     no later request claimed (an earlier turn's);
  4. the states requests resume from, by request, oldest first: each leaf (the deepest state on its path) with the
     resume points above it that its request or a later one claimed (a request's prompt end, its last message's
     start and its end, made or found cached: RadixCache.claim) and the KEPT_INTERVALS interval snapshots above
     each of those, each worth a little less than a resume point of a request INTERVAL_AGE requests
     older; each branch point as its latest request.
least recently used first among equals. An agent's next turn renders the last answer back otherwise (a think block
dropped) and resumes from the prompt end, not from the leaf below it; or it drops a reminder inside the last message
and resumes from an interval snapshot after the message's start. Ranked by kind alone (leaves above interior resume
points, intervals below both), many sessions' old leaves took every slot: each new prompt end went as soon as its own
request's end came, and no interval snapshot of the current session was kept at all.
"""
from __future__ import annotations

from typing import Iterator, Mapping, Protocol, Sequence


class Node(Protocol):
    """What the ranking reads of a node (a radix.Node: named here, not imported, since radix.py imports this)."""
    snapshot: int | None           # the device's copy of the state at its end
    host_snapshot: int | None      # the host tier's (always None in a tree without tiers)
    resume: bool
    claimed: int
    last_use: int

    @property
    def parent(self) -> Node | None: ...

    @property
    def children(self) -> Mapping[tuple[int, ...], Node]: ...


class Tree(Protocol):
    """What the ranking reads of the tree (radix.RadixCache)."""
    @property
    def root(self) -> Node: ...

    def nodes(self) -> Sequence[Node]: ...

# The interval snapshots kept above each resume point: a prompt that changes the path in the last KEPT_INTERVALS
# intervals before one (an agent's last message edited) still resumes within one interval of the change. The cache
# asks for a request's last ones before its prompt end as it asks for resume points (cache.CacheRun.kept_points).
KEPT_INTERVALS = 2
# A kept interval snapshot is worth a little less than a resume point of a request this many requests older. An agent's
# session sends its turn and a side request or two (a title, a summary) before its next turn, which may need it; the
# resume points of sessions taking turns in between (each one's last request) stay before it, as do resume points
# of any request since.
INTERVAL_AGE = 2

Ranks = tuple["set[Node]", "set[Node]", "dict[Node, int]"]


def resumes(node: Node) -> bool:
    """A resume point (a prompt end, a request end, a hinted place: insert(..., resume=True)) or a branch point."""
    return node.resume or len(node.children) > 1


def ancestry(node: Node, root: Node) -> Iterator[Node]:
    """node, its parent, ..., up to the root (not included)."""
    while node is not root:
        yield node
        node = node.parent


def snapshot_ranks(tree: Tree) -> Ranks:
    """(interior, kept, requests): the nodes with a state snapshot (device or host) somewhere below them; the
    KEPT_INTERVALS deepest interval snapshots above each resume point or leaf; and the snapshots of item 4 of the
    module docstring -> the request they count as (its RadixCache.stamp, less INTERVAL_AGE for an interval)."""
    nodes = tree.nodes()
    held = {n for n in nodes if n.snapshot is not None or n.host_snapshot is not None}
    interior: set[Node] = set()
    latest: dict[Node, int] = {}                       # the latest request that claimed a node below
    for n in reversed(nodes):                          # children before their parents
        if n is not tree.root:
            latest[n] = max(latest.get(n, 0), n.claimed)
            latest[n.parent] = max(latest.get(n.parent, 0), latest[n])
            if n in interior or n in held:
                interior.add(n.parent)
    kept: set[Node] = set()
    requests = {n: latest[n] for n in held if len(n.children) > 1}
    for leaf in held - interior:
        # up from the leaf: the resume points its request or a later one claimed (a later request found them
        # cached: still in use) count as their claimer, and the kept intervals above each of those as it too
        claimer, found = leaf.claimed, 0
        for node in ancestry(leaf, tree.root):
            if node is leaf:
                pass
            elif node not in held:
                continue
            elif resumes(node):                        # the kept intervals above it are its own
                member = leaf.claimed and node.resume and node.claimed >= leaf.claimed
                claimer, found = node.claimed if member else 0, 0
            elif found < KEPT_INTERVALS:
                kept.add(node)
                found += 1
            else:
                continue
            by = claimer if node.resume else max(claimer, node.claimed)
            if by:
                counts_as = by - (0 if node.resume else INTERVAL_AGE)
                requests[node] = max(requests.get(node, -INTERVAL_AGE), counts_as)
    return interior, kept, requests


def worth(node: Node, ranks: Ranks, copied: bool) -> tuple[bool, int, int, bool, int]:
    """The sort key of a tier's copy of node's snapshot (the smallest goes first); copied: the other tier holds one
    too. The second field, the kind: 0 an interior interval snapshot, 1 an interval snapshot at a leaf, 2 a
    superseded resume point, 3 one of a request's (by the request it counts as)."""
    interior, kept, requests = ranks
    kind = 3 if node in requests else 2 if resumes(node) else 0 if node in interior else 1
    # then: among a request's, the one it counts as, an interval snapshot first; among interior intervals, the kept
    # ones last
    return not copied, kind, requests.get(node, 0), node.resume if kind == 3 else node in kept, node.last_use

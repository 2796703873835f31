"""Which cached state snapshot a full tier gives up first: the order radix.py evicts snapshots in (their slots are
the scarce resource), as a key to sort by. Least worth keeping first:
  1. a copy the other tier also holds (nothing is lost);
  2. interior interval snapshots (a deeper state lies below them: they serve only prompts that leave the path in
     between), each path's KEPT_INTERVALS deepest last among them;
  3. other interior ones (resume points with a deeper state below);
  4. leaf snapshots (the deepest state on their path), resume points last;
least recently used first within each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinyserve.radix import Node, RadixCache

# The deepest interval snapshots of each path, kept above its other interior ones: a prompt that changes the path in
# its last KEPT_INTERVALS intervals (an agent's last message edited) still resumes within one interval of the change.
KEPT_INTERVALS = 2

Ranks = tuple["set[Node]", "set[Node]"]


def resumes(node: Node) -> bool:
    """A resume point (a prompt end, a request end, a hinted place: insert(..., resume=True)) or a branch point."""
    return node.resume or len(node.children) > 1


def snapshot_ranks(tree: RadixCache) -> Ranks:
    """(interior, kept): the nodes with a state snapshot (device or host) somewhere below them, and each path's
    KEPT_INTERVALS deepest interval snapshots (up from a leaf's, passing resume points)."""
    nodes = tree.nodes()
    held = {n for n in nodes if n.snapshot is not None or n.host_snapshot is not None}
    interior: set[Node] = set()
    for n in reversed(nodes):                          # children before their parents
        if n is not tree.root and (n in interior or n in held):
            interior.add(n.parent)
    kept: set[Node] = set()
    for leaf in held - interior:
        up, found = leaf.parent, 0
        while up is not tree.root and found < KEPT_INTERVALS:
            if up in held and not resumes(up):
                kept.add(up)
                found += 1
            up = up.parent
    return interior, kept


def worth(node: Node, ranks: Ranks, copied: bool) -> tuple[bool, bool, bool, bool, int]:
    """The sort key of a tier's copy of node's snapshot (the smallest goes first); copied: the other tier holds one
    too."""
    interior, kept = ranks
    return (not copied, node not in interior, resumes(node), node in kept, node.last_use)

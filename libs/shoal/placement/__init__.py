"""Placement: from GPU shares to concrete GPUs.

* :func:`regulate_shares` — AFS network packing (appendix E): shares of 1, 2, 4 …
  below a node or multiples of a node, so that they always pack.
* :func:`regulate_for_topology` — the same per GPU type on a real topology (drained
  GPUs, mixed node sizes), checked to pack.
* :func:`place_min_migration` — CoDDL §4.4: keep as many jobs on their GPUs as
  possible, sub-node shares on one node, node multiples on whole nodes.
* :func:`place_consolidated` — Optimus §4.2 / Theorem 1: each job on the fewest servers.

All are pure functions over plain data; :func:`check_placement` states the invariants.
"""

from shoal.placement.consolidated import place_consolidated
from shoal.placement.min_migration import place_min_migration
from shoal.placement.packing import regulate_for_topology
from shoal.placement.regulate import is_regulated, regulate_shares, regulated_floor, sub_node_sizes
from shoal.placement.topology import (
    NodeSlots,
    Placement,
    PlacementError,
    Topology,
    check_placement,
    count_migrations,
    kept_gpus,
    nodes_used,
)

__all__ = [
    "NodeSlots",
    "Placement",
    "PlacementError",
    "Topology",
    "check_placement",
    "count_migrations",
    "is_regulated",
    "kept_gpus",
    "nodes_used",
    "place_consolidated",
    "place_min_migration",
    "regulate_for_topology",
    "regulate_shares",
    "regulated_floor",
    "sub_node_sizes",
]

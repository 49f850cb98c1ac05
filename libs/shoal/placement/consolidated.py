"""Consolidating placement (Optimus §4.2, Theorem 1).

Theorem 1: a synchronous job trains fastest on the fewest servers that can host it.
Optimus §4.2 sorts servers by descending available resources and gives each job the
shortest prefix of that list that holds it. Choices made here:

* Jobs go **largest first** (ties: job id), as shoal's placer does: Optimus §4.2
  goes smallest first to avoid starving small jobs, but in shoal the allocator
  already decided who runs, and largest first is what lets the fewest-servers rule
  hold for everyone (with regulated shares every job then fits packed).
* Servers are taken most free first (Optimus' "descending order of availability",
  with free GPUs as the resource); ties prefer the job's previous nodes, then node
  order. A job fills each server before the next rather than splitting evenly:
  Theorem 1's even split pairs parameter servers with workers, which an all-reduce
  job does not have, and filling leaves fewer fragments.
* Within a node a job keeps its previous GPUs first, then free GPUs no later job
  held, nearest its kept ones, lowest index first.
  Optimus does not try to avoid migrations (it restarts from checkpoints); ``previous``
  only breaks ties.
* A job is placed whole or not at all; it is unplaced when too few GPUs of its type
  are free.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.events import GpuRef
from shoal.placement._cluster import Cluster
from shoal.placement.topology import Placement, Topology


def place_consolidated(
    topology: Topology,
    shares: Mapping[str, int],
    previous: Mapping[str, tuple[GpuRef, ...]],
    gpu_types: Mapping[str, str] | None = None,
) -> Placement:
    """Place each job on the fewest servers possible, largest jobs first (Optimus Theorem 1).

    Args:
        topology: Usable GPUs per node.
        shares: job id -> GPUs.
        previous: job id -> GPUs it holds now (only used to break ties).
        gpu_types: job id -> GPU type it must run on (absent or ``""``: any node).

    Returns:
        The placement; jobs that could not be placed are in ``unplaced``.

    Raises:
        PlacementError: On a negative share.
    """
    cluster = Cluster(topology, shares, previous, gpu_types)
    for job in sorted(cluster.shares, key=lambda j: (-cluster.shares[j], j)):
        cluster.processed.add(job)
        fam = cluster.family[job]
        need = cluster.shares[job]
        if cluster.total_free.get(fam, 0) < need:
            continue
        mine = sorted(cluster.prev[job])
        while need > 0:
            o = cluster.most_free(fam)
            assert o is not None  # total_free covers need
            level = cluster.free[o]
            # Among equally free servers, prefer one the job already runs on.
            o = next((p for p in mine if cluster.free[p] == level), o)
            take = min(need, level)
            cluster.claim(o, job, cluster.choose_indices(o, job, take))
            need -= take
    return cluster.result()

"""The allocator's pure pipeline: policy → network packing → shares → placement.

``decide → regulate → SharesDecided`` then ``place → PlacementDecided``, as plain
functions over plain data. The simulator calls them in virtual time; the allocator and
placer services call them on the live log. Neither side has its own copy.

Choices:

* Network packing (AFS/CoDDL §4.4, appendix E) applies only to elastic policies
  (:attr:`shoal.policies.base.Policy.elastic`), and only when the view has servers
  (``gpus_per_node > 1``) and ``network_packing`` is on. A rigid policy (FIFO, SRTF,
  SRSF, Tiresias-L, Gandiva_fair) decides whole gangs: its shares are published as it
  decided them, so a gang it schedules is a gang that runs at its size (placed whole by
  the placer, or unplaced). An elastic policy's shares are regulated by
  :func:`shoal.placement.regulate_shares` with each job's feasible counts
  (:func:`shoal.policies.base.feasible_counts`) and ``keep_unregulable=True``: a rigid
  job none of whose counts is a regulated size (a 3-GPU gang on 4-GPU servers) keeps
  its size rather than being regulated to 0 for ever (the placer packs it when it can
  and spreads it over servers otherwise); every other job may be rounded down to a
  regulated size, and even to 0 (see that module). Heterogeneous views are regulated
  per GPU type with that type's GPU count.
* Every decision is checked with :func:`~shoal.policies.base.check_decision` before it
  leaves the allocator (a policy bug raises, it is never published).
* ``SharesDecided.shares`` lists only jobs with a positive share (absent = 0), sorted by
  job id, so equal decisions encode to equal bytes.
* Placement: ``min-migration`` (CoDDL §4.4) or ``consolidated`` (Optimus §5). A job
  the placer could not place (``Placement.unplaced``) is absent from
  ``PlacementDecided.placements`` and therefore runs on nothing at that epoch.
  A policy that chooses nodes itself (Gandiva_fair §3.2-3.3) names them in
  ``policy_memory["node_hints"]``; :func:`place` then places those jobs on those
  nodes (:func:`shoal.placement.hinted.place_hinted`) whichever placer is set, and the
  placer places only the jobs the hints cannot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shoal.events import GpuRef, PlacementDecided, SharesDecided
from shoal.policies.base import (
    ClusterView,
    Decision,
    Policy,
    check_decision,
    feasible_counts,
    jobs_by_id,
    policy_is_elastic,
    share_is_feasible,
)

if TYPE_CHECKING:
    from shoal.placement import Placement, Topology

PLACERS: tuple[str, ...] = ("min-migration", "consolidated")


def pack_shares(view: ClusterView, decision: Decision, *, checked: bool = False) -> Decision:
    """Regulate a decision's shares so they pack onto servers (AFS appendix E).

    Only for elastic policies (:func:`decide_shares` checks); a job with no regulated
    feasible count up to its share keeps its size (``keep_unregulable``).

    Args:
        view: the view the decision was made on (gives feasible counts and node size).
        decision: the policy's decision.
        checked: the decision passed :func:`check_decision` against ``view`` (every
            share is a feasible count of a job of the view, and they fit): the test
            for the common case then only reads the share sizes.

    Returns:
        A decision with regulated shares (same memory and GPU types); the input
        itself when the view is a flat pool or when regulation keeps every share.
    """
    g = view.gpus_per_node
    if g <= 1:
        return decision
    from shoal.placement import regulate_shares, sub_node_sizes

    jobs = jobs_by_id(view)
    if not (view.gpus_by_type and decision.gpu_types):
        # Every positive share already a regulated size (a sub-node size or a multiple
        # of G) and feasible, and all of them fit: regulation keeps each share (Proposition
        # 2's x_i is s_i itself) and has nothing to shave or hand back, so the decision
        # is returned as it is. With a long queue, most decisions give out such shares.
        # (shoal.placement.is_regulated's rule for a positive share, with the sizes
        # worked out once per decision instead of once per share.)
        subs = sub_node_sizes(g)
        if checked:
            for s in decision.shares.values():
                if s and not (s in subs or s % g == 0):
                    break
            else:
                return decision
        used = 0
        for job_id, s in decision.shares.items():
            if s:
                job = jobs.get(job_id)
                if job is None or not (s in subs or s % g == 0) or not share_is_feasible(job, s):
                    break
                used += s
        else:
            if used <= view.total_gpus:
                return decision
    # Only jobs with a positive share need their counts: regulation never reads the
    # counts of a job planned at 0 (it stays at 0, appendix E).
    feasible = {j: feasible_counts(jobs[j]) for j, s in decision.shares.items() if s > 0 and j in jobs}
    if view.gpus_by_type and decision.gpu_types:
        shares: dict[str, int] = {}
        for gpu_type, count in sorted(view.gpus_by_type.items()):
            part = {j: s for j, s in decision.shares.items() if decision.gpu_types.get(j, "") == gpu_type}
            shares.update(
                regulate_shares(
                    part, {j: feasible[j] for j in part if j in feasible}, g, count, keep_unregulable=True
                )
            )
        rest = {j: s for j, s in decision.shares.items() if j not in shares}
        shares.update(rest)
    else:
        shares = regulate_shares(decision.shares, feasible, g, view.total_gpus, keep_unregulable=True)
    return Decision(shares=shares, gpu_types=decision.gpu_types, memory=decision.memory)


def decide_shares(
    policy: Policy,
    view: ClusterView,
    memory: Mapping[str, Any],
    *,
    epoch: int,
    trigger: str = "",
    network_packing: bool = True,
) -> SharesDecided:
    """Run the policy once and return the fact to publish.

    Args:
        policy: the allocation policy.
        view: the cluster view (see :func:`shoal.view.build_view`).
        memory: the policy memory of the previous decision (``state.policy_memory``).
        epoch: the new epoch (strictly greater than the last one).
        trigger: what caused this decision (arrival, completion, tick …).
        network_packing: regulate an elastic policy's shares to server sizes when the
            view has servers (a rigid policy's shares are never regulated).

    Returns:
        The ``SharesDecided`` event (positive shares only, sorted by job id).

    Raises:
        shoal.policies.base.DecisionError: the policy broke an invariant.
    """
    decision = policy.decide(view, memory)
    check_decision(view, decision)
    if network_packing and policy_is_elastic(policy):
        packed = pack_shares(view, decision, checked=True)
        if packed is not decision:  # (the same object: nothing regulated, checked above)
            check_decision(view, packed)
        decision = packed
    # Sorted by job id: the ids alone are sorted (str keys compare faster than pairs, and
    # the ids are distinct, so the order is that of the pairs).
    decided = decision.shares
    shares = {j: s for j in sorted(decided) if (s := decided[j]) > 0}
    types = decision.gpu_types
    gpu_types = {j: t for j in sorted(types) if j in shares and (t := types[j])} if types else {}
    return SharesDecided(
        epoch=epoch,
        shares=shares,
        gpu_types=gpu_types,
        policy=policy.name,
        trigger=trigger,
        policy_memory=dict(decision.memory),
    )


def place(
    topology: Topology,
    shares: SharesDecided,
    previous: Mapping[str, tuple[GpuRef, ...]],
    *,
    placer: str = "min-migration",
) -> tuple[PlacementDecided, Placement]:
    """Place a shares decision on concrete GPUs.

    Args:
        topology: usable GPUs per node.
        shares: the decision to place.
        previous: job id -> GPUs each job holds now.
        placer: one of :data:`PLACERS` (for the jobs without a node hint).

    Returns:
        The ``PlacementDecided`` event (same epoch) and the placer's full result.

    Raises:
        ValueError: unknown placer.
    """
    from shoal.placement import place_consolidated, place_min_migration
    from shoal.placement.hinted import NODE_HINTS, NODE_SLOTS, place_hinted

    hints = shares.policy_memory.get(NODE_HINTS)
    if placer not in PLACERS:
        raise ValueError(f"unknown placer {placer!r}; choose one of {', '.join(PLACERS)}")
    if isinstance(hints, dict) and hints:
        fallback = place_min_migration if placer == "min-migration" else place_consolidated
        slots = shares.policy_memory.get(NODE_SLOTS)
        result = place_hinted(
            topology,
            shares.shares,
            previous,
            hints,
            shares.gpu_types or None,
            fallback=fallback,
            slots=slots if isinstance(slots, dict) else None,
        )
    elif placer == "min-migration":
        result = place_min_migration(topology, shares.shares, previous, shares.gpu_types or None)
    elif placer == "consolidated":
        result = place_consolidated(topology, shares.shares, previous, shares.gpu_types or None)
    else:
        raise ValueError(f"unknown placer {placer!r}; choose one of {', '.join(PLACERS)}")
    placements = {j: tuple(g) for j, g in sorted(result.placements.items()) if g}
    return PlacementDecided(epoch=shares.epoch, placements=placements, migrations=result.migrations), result


def policy_tick(policy: Policy) -> float | None:
    """The policy's re-run period in seconds (``tick_s``, ``lease_s`` or ``quantum_s``), if any.

    The simulator re-runs the policy on the grid ``k·tick`` while jobs are active; the
    allocator does the same on the log's virtual time, so both decide at the same instants.
    """
    for attr in ("tick_s", "lease_s", "quantum_s"):
        value = getattr(policy, attr, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def next_tick(last_at: float, tick: float, origin: float = 0.0) -> float:
    """The first grid point ``origin + k·tick`` strictly after ``last_at``."""
    import math

    return origin + (math.floor((last_at - origin) / tick + 1e-9) + 1) * tick

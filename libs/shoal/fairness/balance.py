"""Ticket-load balancing: eqs. (1)-(3), placement, migration and packing.

Gandiva_fair §3.2-§3.3 and §3.5 ("Migration"):

- (1) ``tickets_per_gpu_i = t_i / Σ_k r_ik``
- (2) ``ticket_load_per_gpu_l = Σ_{j_ab ∈ A_l} r_ab · tickets_per_gpu_a / g_l``
- (3) ``job_tickets_ik = tickets_per_gpu_i · r_ik``

A new job goes to the node(s) with the least ticket load after recomputing (1)
with the job counted; a job spanning k servers takes the k least-loaded servers
(Algorithm 2, lines 9-11). Every quantum, while the most- and least-loaded
nodes differ by more than a threshold, one small job moves from the first to the
second.

Choices where the paper is silent:

- The migration threshold is relative: migrate when ``max − min`` exceeds
  ``threshold × mean`` ticket load per GPU (default 0.25; a cluster with a tenth
  of the tickets behaves the same). A move is made only if it strictly lowers the
  pair's larger load, so the loop never ping-pongs. At most ``max_migrations``
  moves per quantum (default 1, as the heterogeneous migration policy implies).
- Among candidate jobs, 1-GPU jobs are preferred, then the job whose move leaves
  the pair closest to balanced. A balance move never raises the two nodes'
  summed idle risk (below), so it never undoes packing.
- A job spanning several servers puts ``min(g_l, rest)`` of its GPUs on each of
  its servers in order; large jobs are not migrated for balance (they are gang
  scheduled centrally by split stride).
- Packing (§3.3): a node's *idle risk* is the largest number of GPUs that must
  stay idle when some job there runs and the other jobs there cannot fill the
  remainder (a subset-sum over the other sizes). ``packing_migrations`` moves
  batches of 1-GPU jobs from nodes with surplus to a node with an idle risk, when
  the summed idle risk strictly falls (so packing terminates). New
  small jobs first avoid nodes whose idle risk they would raise, then take the
  least-loaded node (``place_job(..., node_sizes=...)``).
- Ties between equally loaded nodes go to the node listed first.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping, Sequence

from msgspec import Struct


class Migration(Struct, frozen=True, kw_only=True):
    """Move ``job_id`` from node ``source`` to node ``target``."""

    job_id: str
    source: str
    target: str
    reason: str = "balance"


def tickets_per_gpu(
    user_tickets: Mapping[str, float],
    job_sizes_by_user: Mapping[str, Sequence[int]],
) -> dict[str, float]:
    """Eq. (1): each user's tickets divided by the GPUs all its jobs need.

    Args:
        user_tickets: User -> tickets (effective tickets after readjustment, if any).
        job_sizes_by_user: User -> sizes of the user's active jobs.

    Returns:
        User -> tickets per GPU (0 for users without jobs).
    """
    out: dict[str, float] = {}
    for user, sizes in job_sizes_by_user.items():
        total = sum(sizes)
        out[user] = user_tickets.get(user, 0.0) / total if total > 0 else 0.0
    return out


def job_tickets(tickets_per_gpu_of_user: float, size: int) -> float:
    """Eq. (3): a job's tickets, its user's tickets per GPU times its size."""
    return tickets_per_gpu_of_user * size


def gpus_on_nodes(size: int, nodes: Sequence[str], node_gpus: Mapping[str, int]) -> dict[str, int]:
    """How a gang of ``size`` GPUs spreads over its nodes (fill in order)."""
    out: dict[str, int] = {}
    rest = size
    for node in nodes:
        take = min(node_gpus[node], rest)
        out[node] = out.get(node, 0) + take
        rest -= take
    return out


def ticket_load_per_gpu(
    node_gpus: Mapping[str, int],
    placement: Mapping[str, Sequence[str]],
    job_size: Mapping[str, int],
    job_tickets_per_gpu: Mapping[str, float],
) -> dict[str, float]:
    """Eq. (2): tickets each GPU of each node has to serve.

    Args:
        node_gpus: Node -> GPUs.
        placement: Job -> the node(s) it is placed on.
        job_size: Job -> GPUs.
        job_tickets_per_gpu: Job -> its user's tickets per GPU (eq. (1)).

    Returns:
        Node -> ticket load per GPU.
    """
    load = dict.fromkeys(node_gpus, 0.0)
    for job, nodes in placement.items():
        tpg = job_tickets_per_gpu[job]
        if len(nodes) == 1:  # gpus_on_nodes of a one-node gang, inline (most gangs)
            node = nodes[0]
            load[node] += min(node_gpus[node], job_size[job]) * tpg
        elif len(set(nodes)) == len(nodes):  # the same, on distinct nodes
            rest = job_size[job]
            for node in nodes:
                take = min(node_gpus[node], rest)
                load[node] += take * tpg
                rest -= take
        else:
            for node, gpus in gpus_on_nodes(job_size[job], nodes, node_gpus).items():
                load[node] += gpus * tpg
    return {n: (load[n] / g if g > 0 else math.inf) for n, g in node_gpus.items()}


def place_job(
    size: int,
    node_gpus: Mapping[str, int],
    loads: Mapping[str, float],
    node_sizes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[str, ...]:
    """Choose the node(s) for a new job: the least ticket-loaded ones (§3.2, Algorithm 2).

    Args:
        size: GPUs of the job.
        node_gpus: Node -> GPUs (of the job's generation), in tie-break order.
        loads: Node -> ticket load per GPU, recomputed with the new job's user's
            updated tickets per GPU (eq. (1)) as the paper asks.
        node_sizes: Node -> sizes of the single-node jobs there. When given, a
            small job first avoids raising a node's :func:`idle_risk` (packing,
            §3.3), then goes to the least-loaded node.

    Returns:
        The chosen nodes; empty when no node (or set of nodes) can hold the gang.
    """
    order = {n: i for i, n in enumerate(node_gpus)}
    fitting = [n for n, g in node_gpus.items() if g >= size]
    if fitting:
        if node_sizes is None:
            return (min(fitting, key=lambda n: (loads[n], order[n])),)

        def key(n: str) -> tuple[int, float, int]:
            here = list(node_sizes.get(n, ()))
            worse = idle_risk(node_gpus[n], [*here, size]) - idle_risk(node_gpus[n], here)
            return (max(worse, 0), loads[n], order[n])

        return (min(fitting, key=key),)
    ranked = sorted(node_gpus, key=lambda n: (loads[n], -node_gpus[n], order[n]))
    chosen: list[str] = []
    got = 0
    for node in ranked:
        if got >= size:
            break
        chosen.append(node)
        got += node_gpus[node]
    return tuple(chosen) if got >= size else ()


def rebalance(
    node_gpus: Mapping[str, int],
    placement: Mapping[str, Sequence[str]],
    job_size: Mapping[str, int],
    job_tickets_per_gpu: Mapping[str, float],
    *,
    threshold: float = 0.25,
    max_migrations: int = 1,
    movable: Mapping[str, bool] | None = None,
    loads: Mapping[str, float] | None = None,
) -> list[Migration]:
    """Migrations that even out ticket load per GPU (§3.2, §3.5 "Migration").

    Args:
        node_gpus: Node -> GPUs (one generation).
        placement: Job -> node(s).
        job_size: Job -> GPUs.
        job_tickets_per_gpu: Job -> its user's tickets per GPU.
        threshold: Migrate while ``max − min > threshold × mean`` load.
        max_migrations: Most moves returned.
        movable: Job -> whether it may move (default: every single-node job).
        loads: :func:`ticket_load_per_gpu` of exactly these arguments, when the caller
            has it (the first round then does not compute it again; later rounds do,
            after their move).

    Returns:
        The moves, in the order to make them.
    """
    # Built when first needed: most quanta are balanced, and the loads come from the caller.
    place: dict[str, tuple[str, ...]] | None = None
    moves: list[Migration] = []

    for _ in range(max_migrations):
        if loads is None or moves:
            if place is None:
                place = {j: tuple(n) for j, n in placement.items()}
            loads = ticket_load_per_gpu(node_gpus, place, job_size, job_tickets_per_gpu)
        finite = {n: v for n, v in loads.items() if math.isfinite(v)}
        if len(finite) < 2:
            break
        mean = sum(finite.values()) / len(finite)
        # The most loaded node and the least, each the first in node order among equals
        # (max and min return the first of equals).
        hi = max(finite, key=finite.__getitem__)
        lo = min(finite, key=finite.__getitem__)
        if finite[hi] - finite[lo] <= threshold * mean:
            break
        # The single-node jobs of both nodes (and their sizes), in placement order, read
        # from the caller's placement until a move has been made (one pass, no copy).
        on_hi: list[tuple[str, int]] = []
        on_lo: list[int] = []
        for j, n in (placement if place is None else place).items():
            if len(n) == 1:
                node = n[0]
                if node == hi:
                    on_hi.append((j, job_size[j]))
                if node == lo:
                    on_lo.append(job_size[j])
        best: tuple[tuple[int, float, str], str] | None = None
        risk_before = idle_risk(node_gpus[hi], [s for _, s in on_hi]) + idle_risk(node_gpus[lo], on_lo)
        for job, size in on_hi:
            if movable is not None and not movable.get(job, True):
                continue
            if size > node_gpus[lo]:
                continue
            delta = size * job_tickets_per_gpu[job]
            new_hi = finite[hi] - delta / node_gpus[hi]
            new_lo = finite[lo] + delta / node_gpus[lo]
            if max(new_hi, new_lo) >= finite[hi]:
                continue  # would not improve: no ping-pong
            risk_after = idle_risk(node_gpus[hi], [s for j, s in on_hi if j != job]) + idle_risk(
                node_gpus[lo], [*on_lo, size] if size else on_lo
            )
            if risk_after > risk_before:
                continue  # balance never undoes packing (§3.3)
            key = (0 if size == 1 else 1, abs(new_hi - new_lo), job)
            if best is None or key < best[0]:
                best = (key, job)
        if best is None:
            break
        job = best[1]
        moves.append(Migration(job_id=job, source=hi, target=lo))
        if place is None:
            place = {j: tuple(n) for j, n in placement.items()}
        place[job] = (lo,)
    return moves


def idle_risk(num_gpus: int, sizes: Sequence[int]) -> int:
    """GPUs a node may have to leave idle in some quantum by fragmentation (§3.3).

    For each job J on the node, the other jobs can fill at most the best subset
    sum of their sizes not exceeding the room J leaves; the risk is the worst
    shortfall over J. The room is counted against ``min(num_gpus, Σ sizes)``, so
    a node idle only for lack of jobs (an empty node, one lone 1-GPU job) has no
    risk. One 1-GPU and one 4-GPU job on 4 GPUs: risk 3.

    Args:
        num_gpus: GPUs of the node.
        sizes: Sizes of the single-node jobs placed there.

    Returns:
        The idle risk in GPUs (0 when the node is well packed or empty).

    Memoised on ``(num_gpus, sizes)`` (the answer does not depend on the order of the
    sizes): a generation's nodes hold few distinct mixes, and every quantum asks again.
    """
    return _idle_risk(num_gpus, tuple(sizes))


@functools.lru_cache(maxsize=4096)
def _idle_risk(num_gpus: int, sizes: tuple[int, ...]) -> int:
    """:func:`idle_risk`, computed."""
    usable = min(num_gpus, sum(sizes))
    count = Counter(sizes)
    worst = 0
    # Jobs of one size leave the same room and see the same others, so each distinct
    # size is one case. The subset sums of a multiset do not depend on the order in
    # which its sizes are added, and stop changing once the room is reachable or
    # another copy of a size adds nothing.
    for own in count:
        room = usable - own
        if room <= worst:
            continue  # no shortfall here can exceed ``worst`` (and room <= 0 has none)
        full = (1 << (room + 1)) - 1
        reachable = 1  # bit k set: k GPUs can be filled by some subset of the others
        for s, n in count.items():
            if s > room:
                continue
            for _ in range(n - 1 if s == own else n):
                grown = (reachable | reachable << s) & full
                if grown == reachable:
                    break
                reachable = grown
            if reachable >> room:
                break
        worst = max(worst, room - (reachable.bit_length() - 1))
    return worst


def packing_migrations(
    node_gpus: Mapping[str, int],
    placement: Mapping[str, Sequence[str]],
    job_size: Mapping[str, int],
    *,
    max_migrations: int = 1,
    movable: Mapping[str, bool] | None = None,
) -> list[Migration]:
    """Moves of 1-GPU jobs into nodes that would otherwise idle GPUs (§3.3).

    For the node with the highest idle risk, 1-GPU jobs are gathered from donor
    nodes (most 1-GPU jobs first) that can give one without raising their own
    idle risk and stay fully loaded (at least as many GPUs of jobs as GPUs),
    until the target's risk is gone; the batch is made only when it strictly
    lowers the summed idle risk and fits in ``max_migrations``.

    Args:
        node_gpus: Node -> GPUs (one generation).
        placement: Job -> node(s).
        job_size: Job -> GPUs.
        max_migrations: Most moves returned.
        movable: Job -> whether it may move.

    Returns:
        The moves.
    """
    on_node: dict[str, list[str]] = {n: [] for n in node_gpus}
    for job, node in sorted([(j, nodes[0]) for j, nodes in placement.items() if len(nodes) == 1]):
        on_node[node].append(job)

    def risk(node: str) -> int:
        here = on_node[node]
        if len(here) < 2:
            return 0  # idle_risk of one job or none (no other job to leave room for)
        return idle_risk(node_gpus[node], [job_size[j] for j in here])

    moves: list[Migration] = []
    tried: set[str] = set()
    while len(moves) < max_migrations:
        # risk() is 0 on a node with fewer than two single-node jobs: not called there.
        risks = {n: r for n in node_gpus if n not in tried and len(on_node[n]) > 1 and (r := risk(n)) > 0}
        if not risks:
            break
        target = min(risks, key=lambda n: (-risks[n], n))
        tried.add(target)
        before = {target: risk(target)}
        batch: list[tuple[str, str]] = []
        donors = sorted(
            (n for n in node_gpus if n != target),
            key=lambda n: (-sum(1 for j in on_node[n] if job_size[j] == 1), n),
        )
        for source in donors:
            while risk(target) > 0 and len(moves) + len(batch) < max_migrations:
                singles = [
                    j
                    for j in on_node[source]
                    if job_size[j] == 1 and (movable is None or movable.get(j, True))
                ]
                # A donor gives only from surplus: it stays fully loaded afterwards.
                load_after = sum(job_size[j] for j in on_node[source]) - 1
                if not singles or load_after < node_gpus[source]:
                    break
                before.setdefault(source, risk(source))
                job = singles[-1]
                on_node[source].remove(job)
                if risk(source) > before[source]:
                    on_node[source].append(job)
                    break
                on_node[target].append(job)
                batch.append((job, source))
            if risk(target) == 0:
                break
        if batch and sum(risk(n) for n in before) < sum(before.values()):
            moves.extend(Migration(job_id=j, source=src, target=target, reason="packing") for j, src in batch)
            continue
        for job, source in reversed(batch):  # not worth it: put the jobs back
            on_node[target].remove(job)
            on_node[source].append(job)
    return moves

"""Split stride: a central scheduler for multi-server jobs, a local one per server.

Gandiva_fair §3.1, Figure 3. The central scheduler keeps the pass of every
*large* job (one spanning more than one server) and of one *aggregate job* per
server, standing for all the *small* jobs on it. Every quantum it runs
gang-aware stride over {large jobs} ∪ {aggregate jobs}; a picked aggregate job
lets its server run its own gang-aware stride (Algorithm 1) over its small
jobs, a picked large job runs on its servers.

Choices where the paper is silent (NOTES §1.1.B):

- The central unit of capacity is the whole server: an entry fits when all its
  servers are still free this quantum; an aggregate needs its one server.
- Strides are in GPU-time per ticket at both levels: an aggregate's stride is
  ``stride1 · g_s / T_s`` (``g_s`` GPUs, ``T_s`` the summed job tickets of the
  small jobs there), a large job's is ``stride1 · size / job_tickets``. This
  reproduces §5.2 (2.66 GPUs per user on 2 × 4 P100). The paper's Figure 2
  remark ("2 out of every 3 slots" for 200 small tickets per server against a
  100-ticket 8-GPU job) holds only with unnormalised strides ``1/tickets``,
  which would give the §5.2 8-GPU user 4 GPUs, not 2.66; we follow §5.2.
- Central ties: (pass, size in GPUs, aggregates before large jobs, id).
- A large job that does not fill its last server leaves the rest of that server
  to the server's small jobs (work conservation): the local stride runs on the
  leftover GPUs and those jobs' local passes advance (it is real service), but
  the aggregate's central pass does not.
- Passes of new entries start at the minimum pass at their level (§3.1); a
  server's aggregate keeps its pass when its ticket sum changes (only its stride
  changes), and a job that moves to another server is a new job there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import cast

from msgspec import Struct

from shoal.fairness.stride import (
    STRIDE1,
    Gang,
    StrideJob,
    gang_aware_stride,
    gang_aware_stride_into,
    new_job_pass,
    stride,
)


class PlacedJob(Struct, frozen=True, kw_only=True):
    """A job with the server(s) it is placed on."""

    job_id: str
    size: int
    job_tickets: float
    servers: tuple[str, ...]
    """One server for a small job; several for a large job."""
    arrival_s: float = 0.0


class SplitStrideResult(Struct, frozen=True, kw_only=True):
    """One quantum of split stride."""

    scheduled: tuple[str, ...]
    """Jobs that run this quantum (large jobs first, then per server)."""
    central_passes: dict[str, float]
    """Server id -> aggregate pass, and ``"job:<id>"`` -> large-job pass."""
    local_passes: dict[str, float]
    """Small job id -> pass on its server."""
    idle_gpus: int


LargeEntry = tuple[str, int, bool, float, tuple[str, ...]]
"""A large job's central entry: (``"job:<id>"``, size in GPUs, ``True``, job tickets, servers)."""


def _large_key(job_id: str) -> str:
    return f"job:{job_id}"


def split_stride_quantum(
    server_gpus: Mapping[str, int],
    jobs: Sequence[PlacedJob],
    central_passes: Mapping[str, float],
    local_passes: Mapping[str, float],
    stride1: float = STRIDE1,
) -> SplitStrideResult:
    """Run one quantum of split gang-aware stride over a cluster (§3.1, Figure 3).

    Args:
        server_gpus: Server -> GPUs. Iteration order is the tie-break order.
        jobs: Active jobs with their placement.
        central_passes: Aggregate passes by server id, large-job passes by ``"job:<id>"``.
        local_passes: Small-job passes by job id.
        stride1: The stride constant.

    Returns:
        Who runs, and the passes after the quantum (entries for departed jobs and
        servers without small jobs are dropped).
    """
    # A small job goes to its server's local stride as it is (it has the fields
    # gang_aware_stride reads).
    small_by_server: dict[str, list[Gang]] = {s: [] for s in server_gpus}
    large: list[LargeEntry] = []
    for job in jobs:
        servers = job.servers
        if len(servers) == 1:
            small_by_server[servers[0]].append(job)
        else:
            # _large_key, inline (a call per large job per quantum is measurable).
            large.append((f"job:{job.job_id}", job.size, True, job.job_tickets, servers))
    return split_stride_entries(server_gpus, small_by_server, large, central_passes, local_passes, stride1)


def split_stride_entries(
    server_gpus: Mapping[str, int],
    small_by_server: Mapping[str, Sequence[Gang]],
    large: list[LargeEntry],
    central_passes: Mapping[str, float],
    local_passes: Mapping[str, float],
    stride1: float = STRIDE1,
) -> SplitStrideResult:
    """:func:`split_stride_quantum` on its jobs already split by level, for a caller that
    has them so (Gandiva_fair's policy builds them as it places the jobs, without a
    :class:`PlacedJob` per large job).

    Args:
        server_gpus: As for :func:`split_stride_quantum`.
        small_by_server: Every server of ``server_gpus``, in its order, -> the small jobs
            on it, in the order of ``jobs``.
        large: The large jobs' central entries (:data:`LargeEntry`), in the order of
            ``jobs`` (read only).
        central_passes: As for :func:`split_stride_quantum`.
        local_passes: As for :func:`split_stride_quantum`.
        stride1: The stride constant.

    Returns:
        The same result as :func:`split_stride_quantum` on those jobs.
    """
    # Central entries: (key, size in GPUs, is_large, tickets, servers): the servers'
    # aggregates, then the large jobs (the order of the passes returned).
    entries: list[LargeEntry] = [
        (server, server_gpus[server], False, sum(j.job_tickets for j in small), (server,))
        for server, small in small_by_server.items()
        if small
    ]
    entries += large
    known = {e[0]: central_passes.get(e[0]) for e in entries}
    central: dict[str, float]
    if None in known.values():  # new entries start at new_job_pass of the others' passes
        start = new_job_pass([p for p in known.values() if p is not None])
        central = {k: start if p is None else p for k, p in known.items()}
    else:
        central = cast("dict[str, float]", known)
    # Sorted by (no tickets, pass, size, aggregate before large, key) on decorated tuples
    # (no key function to call); the position last, so equal keys keep their order as a
    # stable sort does.
    # The servers ride after the position, which is unique, so they are never compared.
    ranked = [(e[3] <= 0, central[e[0]], e[1], e[2], e[0], i, e[4]) for i, e in enumerate(entries)]
    ranked.sort()

    # The servers still free this quantum (a server missing from ``server_gpus`` never
    # is); ``free_count`` drops by one per server an entry names, as before.
    free = set(server_gpus)
    free_count = len(server_gpus)
    capacity_left = dict(server_gpus)
    scheduled: list[str] = []
    run_local: set[str] = set()
    for _, _, size, is_large, key, i, servers in ranked:  # Algorithm 1 over central entries
        if free_count == 0:
            break
        if len(servers) == 1:
            if servers[0] not in free:
                continue
        elif not free.issuperset(servers):
            continue
        free.difference_update(servers)
        free_count -= len(servers)
        step = stride(size, entries[i][3], stride1)
        if math.isfinite(step):
            central[key] += step
        if is_large:
            scheduled.append(key[4:])
            rest = size
            for s in servers:
                take = min(server_gpus[s], rest)
                capacity_left[s] = server_gpus[s] - take
                rest -= take
        else:
            run_local.add(key)

    # Servers whose aggregate won run their small jobs on all their GPUs; servers a
    # large job left partly empty backfill their leftover GPUs (work conservation).
    # A server's GPUs left idle are ``capacity_left`` (all of them when no large job took
    # it), except where its small jobs run: there, what their stride leaves free.
    new_local: dict[str, float] = {}
    idle = sum(capacity_left.values())
    for server, small in small_by_server.items():
        if not small:  # nothing to run or to carry over
            continue
        cap = capacity_left[server] if server not in free else 0
        if server in run_local:
            cap = server_gpus[server]
        if cap > 0:
            idle += (
                gang_aware_stride_into(small, cap, local_passes, stride1, scheduled, new_local)
                - capacity_left[server]
            )
        else:  # the small jobs keep their passes; a new one starts at new_job_pass of the others'
            kept = {j.job_id: local_passes.get(j.job_id) for j in small}
            if None in kept.values():
                start_local = new_job_pass([p for p in kept.values() if p is not None])
                new_local.update({k: start_local if p is None else p for k, p in kept.items()})
            else:
                new_local.update(cast("dict[str, float]", kept))
    return SplitStrideResult(
        scheduled=tuple(scheduled), central_passes=central, local_passes=new_local, idle_gpus=idle
    )


def naive_split_stride_quantum(
    server_gpus: Mapping[str, int],
    jobs: Sequence[PlacedJob],
    central_passes: Mapping[str, float],
    local_passes: Mapping[str, float],
    stride1: float = STRIDE1,
) -> SplitStrideResult:
    """The same quantum, written the obvious quadratic way (benchmark baseline).

    The central scheduler repeatedly scans every entry for the smallest pass that
    still fits (O(entries²)) instead of sorting once. Results equal
    :func:`split_stride_quantum`.

    Args:
        server_gpus: Server -> GPUs.
        jobs: Active jobs with their placement.
        central_passes: As for :func:`split_stride_quantum`.
        local_passes: As for :func:`split_stride_quantum`.
        stride1: The stride constant.

    Returns:
        The same result as :func:`split_stride_quantum`.
    """
    small_by_server: dict[str, list[StrideJob]] = {s: [] for s in server_gpus}
    large: list[PlacedJob] = []
    for job in jobs:
        if len(job.servers) == 1:
            small_by_server[job.servers[0]].append(
                StrideJob(
                    job_id=job.job_id, size=job.size, job_tickets=job.job_tickets, arrival_s=job.arrival_s
                )
            )
        else:
            large.append(job)
    entries: list[tuple[str, int, bool, float, tuple[str, ...]]] = [
        (s, server_gpus[s], False, sum(j.job_tickets for j in small), (s,))
        for s, small in small_by_server.items()
        if small
    ] + [(_large_key(j.job_id), j.size, True, j.job_tickets, j.servers) for j in large]
    start = new_job_pass(central_passes[e[0]] for e in entries if e[0] in central_passes)
    central = {e[0]: central_passes.get(e[0], start) for e in entries}
    free = {s: True for s in server_gpus}
    capacity_left = dict(server_gpus)
    done: set[str] = set()
    scheduled: list[str] = []
    run_local: set[str] = set()
    while any(free.values()):
        best = None
        for e in entries:
            if e[0] in done:
                continue
            k = (e[3] <= 0, central[e[0]], e[1], e[2], e[0])
            if best is None or k < best[0]:
                best = (k, e)
        if best is None:
            break
        key, size, is_large, tickets, servers = best[1]
        done.add(key)
        if not all(free.get(s, False) for s in servers):
            continue
        for s in servers:
            free[s] = False
        step = stride(size, tickets, stride1)
        if math.isfinite(step):
            central[key] += step
        if is_large:
            scheduled.append(key[4:])
            rest = size
            for s in servers:
                take = min(server_gpus[s], rest)
                capacity_left[s] = server_gpus[s] - take
                rest -= take
        else:
            run_local.add(key)
    new_local: dict[str, float] = {}
    idle = 0
    for server, small in small_by_server.items():
        cap = (
            server_gpus[server] if server in run_local else (capacity_left[server] if not free[server] else 0)
        )
        if small and cap > 0:
            res = gang_aware_stride(small, cap, local_passes, stride1)
            scheduled.extend(res.scheduled)
            new_local.update(res.passes)
            idle += res.free_gpus
        else:
            start_local = new_job_pass(local_passes[j.job_id] for j in small if j.job_id in local_passes)
            new_local.update({j.job_id: local_passes.get(j.job_id, start_local) for j in small})
            idle += cap if not free[server] else server_gpus[server]
    return SplitStrideResult(
        scheduled=tuple(scheduled), central_passes=central, local_passes=new_local, idle_gpus=idle
    )

"""The SideCar paper's baselines (§V.B; NOTES 4.1.D): Default-K8s and Termination.

* :class:`DefaultK8s` (``sidecar-default-k8s``): a job's GPU count is drawn at random
  from its optional counts and never changes; jobs wait until that many GPUs are free.
  Not strict FIFO: a later job that fits takes free GPUs ahead of an earlier one that
  does not (the paper's out-of-order scheduling, which starves large jobs). The draw is
  a pure function of ``(seed, job_id)``, so every decision and every replay draws the
  same count.
* :class:`Termination` (``sidecar-termination``, the paper's "Optimus algorithm"):
  reshaping up only. An incoming job gets its smallest optional count when that many
  GPUs are idle, else it waits (arrival order, no skipping: the first that does not fit
  blocks the queue; choice). Idle GPUs left when no job waits go to a running job one
  step per decision (to its next optional count), to the job whose predicted completion
  falls the most per added GPU once the restart is paid (:func:`shoal.sim.costs.charge`
  with the policy's costs), and only when it falls; every resize is a
  terminate-and-restart. The paper adds the idle GPUs "to the job one by one" by
  Optimus's algorithm; here Optimus's greedy rule (largest gain per GPU) picks among the
  running jobs, which is the newly started one when it gains most (choice). When idle
  GPUs remain, the decision asks to be run again when
  that restart is over (``memory["next_decision_at_s"]``), so GPUs are added one
  restart at a time, as the paper's baseline does.

Both take a job's optional counts as :class:`~shoal.policies.sidecar.SideCarAdaptive`
does (powers of two and the request within its feasible counts, or its
``allowed_gpu_counts``; a rigid job its request), keep running jobs at their counts,
and never preempt. Like SideCar's, their jobs run at whatever optional count they are
given, so ``elastic = True`` (:attr:`shoal.policies.base.Policy.elastic`): on a topology
network packing may regulate their shares; the reproduction runs a flat pool, where it
does not.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts, jobs_by_id
from shoal.policies.common import arrival_order
from shoal.sim.costs import ReconfigCosts, charge, get_costs, measured


def options(job: JobView) -> tuple[int, ...]:
    """The job's optional GPU counts (SideCar jobs declare e.g. {1, 2, 4, 8})."""
    return _options(feasible_counts(job), job.elastic, job.requested_gpus, bool(job.allowed_gpu_counts))


@functools.lru_cache(maxsize=4096)
def _options(counts: tuple[int, ...], elastic: bool, requested: int, declared: bool) -> tuple[int, ...]:
    """:func:`options` of what it reads (memoised, as
    :func:`~shoal.policies.base.feasible_counts` is: a long queue asks again for each
    waiting job at every decision, and most jobs share a few shapes)."""
    if declared or not elastic:
        return counts
    return tuple(c for c in counts if c & (c - 1) == 0 or c == requested)


@functools.lru_cache(maxsize=4096)
def _fitting(opts: tuple[int, ...], total_gpus: int | None) -> tuple[int, ...]:
    """The counts of ``opts`` at most ``total_gpus`` (all of them for ``None``)."""
    return tuple(c for c in opts if total_gpus is None or c <= total_gpus)


def _rate(job: JobView, gpus: int) -> float:
    if gpus <= 0:
        return 0.0
    curve = job.throughput
    return curve[gpus] if gpus < len(curve) else curve[-1]


def _remaining(job: JobView) -> float:
    r = job.remaining_iterations
    return max(1.0, job.iterations_done) if r is None else r


def _changed_since(seq: Sequence[JobView], serial: int) -> tuple[Collection[str], Collection[str]] | None:
    """The ids of the jobs a simulator's sequence ``seq`` rebuilt, and of those that left,
    since its sequence numbered ``serial`` (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`,
    ``left_since``); ``None`` when unknown (another kind of sequence, a decision skipped)."""
    if not serial:
        return None
    rebuilt_since = getattr(seq, "rebuilt_since", None)
    left_since = getattr(seq, "left_since", None)
    if rebuilt_since is None or left_since is None:
        return None
    rebuilt, left = rebuilt_since(serial), left_since(serial)
    if rebuilt is None or left is None:
        return None
    return rebuilt, left


class _RunningJobs:
    """The jobs with GPUs (``current_gpus > 0``) among a simulator's jobs, kept from one
    decision to the next: the simulator names the jobs whose view it rebuilt and those that
    left since the decision before (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`,
    ``left_since``), so only those are looked at, not every job of a long queue. Any other
    sequence of jobs (a tuple, a decision skipped) takes the pass over every job."""

    __slots__ = ("by_id", "serial")

    def __init__(self) -> None:
        self.by_id: dict[str, JobView] = {}
        self.serial = 0
        """The serial of the jobs :attr:`by_id` was made from (0: none)."""

    def of(self, view: ClusterView, jobs: Sequence[JobView]) -> list[JobView]:
        """The running jobs of ``jobs`` (``view``'s, in arrival order), in that order."""
        serial = getattr(view.jobs, "serial", 0)
        changes = _changed_since(view.jobs, self.serial) if serial else None
        self.serial = serial
        if changes is None:
            running = [j for j in jobs if j.current_gpus]
            self.by_id = {j.job_id: j for j in running}
            if len(self.by_id) != len(running):  # an id twice: not kept
                self.serial = 0
            return running
        rebuilt, left = changes
        by_id = self.by_id
        for job_id in left:
            by_id.pop(job_id, None)
        if rebuilt:
            index = jobs_by_id(view)
            for job_id in rebuilt:
                j = index.get(job_id)
                if j is not None and j.current_gpus:
                    by_id[job_id] = j
                else:
                    by_id.pop(job_id, None)
        return arrival_order(by_id.values())


class _WaitingByCount:
    """Default-K8s's jobs without GPUs, by drawn count, kept from one decision to the next.

    For each count ``c`` (at least 1), the ranks ``(arrival_s, job_id)`` of the jobs without
    GPUs that drew ``c``, sorted. Brought up to a decision from the simulator's rebuilt and
    left jobs (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`, ``left_since``), so the
    walk below need not pass over the long tail of jobs that drew more GPUs than are free.
    Built again from every job when those are unknown or the cluster's GPUs changed (the
    draw depends on them); not kept at all for a sequence the simulator did not number.
    """

    __slots__ = ("by_count", "count_of", "serial", "total")

    def __init__(self) -> None:
        self.by_count: dict[int, list[tuple[float, str]]] = {}
        self.count_of: dict[str, tuple[tuple[float, str], int]] = {}
        """Job id -> its rank and drawn count, for every job in :attr:`by_count`."""
        self.serial = 0
        self.total = -1

    def refresh(self, view: ClusterView, jobs: Sequence[JobView], draw: Callable[[JobView], int]) -> bool:
        """Bring the index to ``view`` (``jobs``: its jobs in arrival order; ``draw``: a job's
        count). False when it cannot be kept for this view (the caller walks ``jobs``)."""
        serial = getattr(view.jobs, "serial", 0)
        changes = _changed_since(view.jobs, self.serial) if serial and self.total == view.total_gpus else None
        self.serial, self.total = serial, view.total_gpus
        if not serial:
            return False
        by_count, count_of = self.by_count, self.count_of
        if changes is None:
            by_count.clear()
            count_of.clear()
            for j in jobs:
                if j.current_gpus:
                    continue
                if j.job_id in count_of:  # an id twice: not kept
                    self.serial = 0
                    return False
                self._add(j, draw(j))
            return True
        rebuilt, left = changes
        for job_id in itertools.chain(left, rebuilt):
            had = count_of.pop(job_id, None)
            if had is not None:
                ranks = by_count[had[1]]
                del ranks[bisect.bisect_left(ranks, had[0])]
        if rebuilt:
            index = jobs_by_id(view)
            for job_id in rebuilt:
                now = index.get(job_id)
                if now is not None and not now.current_gpus and job_id not in count_of:
                    self._add(now, draw(now))
        return True

    def _add(self, job: JobView, n: int) -> None:
        if n <= 0:  # never started: not indexed
            return
        rank = (job.arrival_s, job.job_id)
        self.count_of[job.job_id] = (rank, n)
        bisect.insort(self.by_count.setdefault(n, []), rank)

    def starts(self, free: int) -> Iterator[tuple[str, int]]:
        """The jobs the arrival-order walk starts with ``free`` GPUs, and their counts: the
        earliest job whose count fits, again and again while GPUs are free. (A job passed
        over by the walk drew more than was free then, and no fewer GPUs are free later.)"""
        heads = {c: 0 for c, ranks in self.by_count.items() if ranks and c <= free}
        while heads:
            best: tuple[float, str] | None = None
            pick = 0
            for c, at in heads.items():
                rank = self.by_count[c][at]
                if best is None or rank < best:
                    best, pick = rank, c
            assert best is not None
            yield best[1], pick
            free -= pick
            heads[pick] += 1
            heads = {c: at for c, at in heads.items() if c <= free and at < len(self.by_count[c])}


def _keep_running(
    view: ClusterView, jobs: Sequence[JobView], kept: _RunningJobs | None = None
) -> tuple[dict[str, int], int]:
    """Running jobs keep their counts, oldest first, while they fit (GPUs may have been lost).
    ``kept``: the running jobs of the decision before, when the caller keeps them."""
    shares: dict[str, int] = {}
    free = view.total_gpus
    for j in kept.of(view, jobs) if kept is not None else [j for j in jobs if j.current_gpus]:
        n = j.current_gpus
        if n <= free and n in feasible_counts(j):
            shares[j.job_id] = n
            free -= n
    return shares, free


@functools.lru_cache(maxsize=1 << 16)
def _draw(seed: int, job_id: str) -> int:
    """The job's draw: the first 8 bytes of SHA-256 of ``"seed:job_id"`` (memoised: a
    waiting job is looked at again at every decision while GPUs are free)."""
    h = hashlib.sha256(f"{seed}:{job_id}".encode()).digest()
    return int.from_bytes(h[:8], "big")


class DefaultK8s:
    """Default Kubernetes: a random optional count, fixed; see the module docstring."""

    name = "sidecar-default-k8s"
    elastic = True
    reads_progress = False
    """It reads counts, arrival and current GPUs only, never progress
    (:func:`shoal.policies.base.policy_reads_progress`)."""

    def __init__(self, *, seed: int = 0) -> None:
        """Args:
        seed: seeds the per-job draw of the GPU count.
        """
        self.seed = seed
        self._running = _RunningJobs()
        """The running jobs, kept between decisions (decides nothing: see :class:`_RunningJobs`)."""
        self._waiting = _WaitingByCount()
        """The jobs without GPUs by drawn count, kept between decisions (decides nothing:
        see :class:`_WaitingByCount`)."""
        self._drawn: dict[str, tuple[JobView, int, int]] = {}
        """Job id -> (the view last drawn for, the cluster's GPUs then, :meth:`count`): a
        view is immutable and the simulator hands an unchanged job's view over again, so
        a waiting job passed over at every decision is drawn once. Decides nothing."""

    def count(self, job: JobView, total_gpus: int | None = None) -> int:
        """The job's drawn GPU count among its options that fit ``total_gpus`` (0 when none)."""
        opts = _fitting(options(job), total_gpus)
        if not opts:
            return 0
        return opts[_draw(self.seed, job.job_id) % len(opts)]

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Keep running jobs; start waiting ones, in arrival order, whose count fits.

        The queue is walked only while GPUs are free: every count is at least one GPU,
        so once none is free no later job starts."""
        jobs = view.jobs if view.arrival_ordered else arrival_order(view.jobs)
        shares, free = _keep_running(view, jobs, self._running)
        total = view.total_gpus
        drawn = self._drawn

        def draw(j: JobView) -> int:
            hit = drawn.get(j.job_id)
            if hit is not None and hit[0] is j and hit[1] == total:
                return hit[2]
            n = self.count(j, total)
            drawn[j.job_id] = (j, total, n)
            return n

        # The index is brought up to every decision (it follows the jobs changed since the
        # decision before). With every running job kept, the jobs the walk below looks at
        # are those without GPUs, which the index holds by count.
        indexed = self._waiting.refresh(view, jobs, draw)
        if free <= 0:
            return Decision(shares=shares)
        if indexed and self._running.serial and len(shares) == len(self._running.by_id):
            for job_id, n in self._waiting.starts(free):
                shares[job_id] = n
            if len(drawn) > 2 * len(jobs) + 64:  # forget the jobs that left
                self._drawn = {j.job_id: drawn[j.job_id] for j in jobs if j.job_id in drawn}
            return Decision(shares=shares)
        for j in jobs:
            job_id = j.job_id
            if job_id in shares:
                continue
            hit = drawn.get(job_id)
            if hit is not None and hit[0] is j and hit[1] == total:
                n = hit[2]
            else:
                n = self.count(j, total)
                drawn[job_id] = (j, total, n)
            if 0 < n <= free:
                shares[job_id] = n
                free -= n
                if free <= 0:
                    break
        if len(drawn) > 2 * len(jobs) + 64:  # forget the jobs that left
            self._drawn = {j.job_id: drawn[j.job_id] for j in jobs if j.job_id in drawn}
        return Decision(shares=shares)


class Termination:
    """The termination approach: start at the minimum, add by restarting; see the module docstring."""

    name = "sidecar-termination"
    elastic = True

    def __init__(self, *, costs: ReconfigCosts | str | None = None) -> None:
        """Args:
        costs: the restart costs its predictions include (as :class:`SideCarAdaptive`;
            ``None``: the simulator's when one binds them, else ``measured``).
        """
        self._explicit = get_costs(costs) if isinstance(costs, str) else costs
        self.costs = self._explicit or measured()
        self._running = _RunningJobs()
        """The running jobs, kept between decisions (decides nothing: see :class:`_RunningJobs`)."""

    def planning_costs(self) -> ReconfigCosts | None:
        """The costs named at construction, or ``None``."""
        return self._explicit

    def bind_costs(self, costs: ReconfigCosts) -> None:
        """Plan with the simulator's costs.

        Raises:
            ValueError: other costs were named at construction.
        """
        if self._explicit is not None and self._explicit != costs:
            raise ValueError(f"planning costs {self._explicit.name!r} differ from {costs.name!r}")
        self.costs = costs

    def _finish(self, job: JobView, gpus: int, gpus_per_node: int) -> float:
        rate = _rate(job, gpus)
        if rate <= 0:
            return float("inf")
        old = job.current_gpus
        stop = 0.0
        if gpus != old:
            kind = "start" if not old else "restart"
            stop = charge(
                self.costs,
                kind,
                old,
                gpus,
                rate_old=_rate(job, old),
                rate_new=rate,
                resumed=job.iterations_done > 0,
                gpus_per_node=gpus_per_node,
            ).stop_s
        return stop + _remaining(job) / rate

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Start waiting jobs at their minimum; then add idle GPUs by restarts while that helps."""
        jobs = view.jobs if view.arrival_ordered else arrival_order(view.jobs)
        shares, free = _keep_running(view, jobs, self._running)
        waiting = False
        for j in jobs:
            if j.job_id in shares:
                continue
            opts = options(j)
            if not opts or opts[0] > view.total_gpus:
                continue
            if opts[0] > free:
                waiting = True
                break
            shares[j.job_id] = opts[0]
            free -= opts[0]
        if waiting:
            return Decision(shares=shares)
        running = [j for j in jobs if j.current_gpus and shares.get(j.job_id) == j.current_gpus]
        gpn = view.gpus_per_node
        best: tuple[float, str, int] | None = None
        for j in running:
            now = shares[j.job_id]
            nxt = next((c for c in options(j) if c > now), None)
            if nxt is None or nxt - now > free:
                continue
            gain = (self._finish(j, now, gpn) - self._finish(j, nxt, gpn)) / (nxt - now)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, j.job_id, nxt)
        if best is None:
            return Decision(shares=shares)
        _, jid, nxt = best
        old = shares[jid]
        free -= nxt - old
        shares[jid] = nxt
        wake: dict[str, Any] = {}
        if free > 0:
            # The next add once this restart is over (one add at a time, §V.B).
            stop = charge(self.costs, "restart", old, nxt, gpus_per_node=gpn).stop_s
            wake["next_decision_at_s"] = view.now_s + max(1.0, stop)
        return Decision(shares=shares, memory=wake)

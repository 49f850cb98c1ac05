"""SideCar adaptive scheduling: reshape to minimise the predicted makespan (SideCar §III.C).

The SideCar framework (Wang et al., UCCS + Nokia Bell Labs) stops and restarts a job's
training process with a new GPU set, and its scheduler uses that to minimise makespan:

* **Incoming-job scheduling with reshaping down** (Algorithm 1): for an incoming job
  every optional GPU count ``N_opt`` is tried, from idle GPUs alone or from idle GPUs
  plus ``N_remove`` GPUs taken from **one** running job (whose new count must be one of
  its optional counts); the triple ``(N_opt, victim, N_remove)`` with the smallest
  predicted makespan wins.
* **Running-job scheduling with reshaping up** (Algorithm 2): when GPUs are idle and no
  job is incoming, the pair ``(job, N_add)`` with the smallest predicted makespan gets
  the idle GPUs.

Predictions (§III.C) include the reconfiguration costs: a new job finishes at
``c + W / S(N)`` and a reshaped running job at ``c + R / S(N')`` from now; an
unchanged job at ``R / S(N)``. ``S`` is the job's throughput curve, ``W``/``R`` its
remaining iterations, and ``c`` the equivalent stop that
:func:`shoal.sim.costs.charge` gives the change, the same function the simulator
charges it with: new-job init (``start_s``: K8s job + framework init), the restart of a
reshape (checkpoint + termination + init; ``restart_s``, per GPU ``restart_per_gpu_s``),
the cross-host restart when the job needs more hosts than it had (``cross_host_s``,
hosts counted as ``ceil(N / gpus_per_node)``), and with early initialisation
(``early_init``, §III.A) the victim's training on the GPUs it loses while the incoming
job initialises. The final checkpoint and termination, equal for every option, drop out
of the comparison. The costs are the simulator's (:meth:`SideCarAdaptive.bind_costs`:
``shoal simulate`` and :class:`shoal.sim.engine.Simulator` hand theirs over, and refuse a
different explicit ``costs``); outside a simulation, the ``measured`` costs of shoal's own
trainer unless ``costs`` names others.

Choices where the paper leaves room (NOTES §4.5), each a defensible reading:

* ``MS_predict`` = the latest predicted completion among the running jobs and the job
  being decided; jobs still queued do not count. Ties in makespan are broken by the sum
  of those predicted completions (the paper also reports average JCT), then by fewer
  GPUs taken from a victim, then by more GPUs for the incoming job.
* Algorithm 1 also weighs **waiting** (``consider_waiting``): the incoming job could
  instead start with its requested GPUs once enough running jobs have finished (by
  their predicted completions). An incoming job is reshaped down, or a victim shrunk,
  only when that beats waiting; otherwise it stays queued. With no option at all it
  stays queued too.
* Algorithm 2 is applied only when it strictly improves (makespan, sum) over leaving
  things as they are (NOTES: "Algorithm 2 never compares against no change": with
  restart costs an add can hurt), and is repeated while idle GPUs remain and some add
  improves.
* A job's optional GPU counts are its ``allowed_gpu_counts`` when it declares them.
  Otherwise (``default_options="pow2"``) they are the powers of two and its request
  among its feasible counts, as SideCar's jobs declare ``{1, 2, 4, 8}``; ``"all"`` takes
  every feasible count. A running job's present count is always one of its options.
* Incoming jobs are the jobs without GPUs whose smallest option fits the cluster, taken
  in arrival order; SideCar never preempts a running job to zero. A job started or
  reshaped in this decision is not a victim again in the same decision.
* SideCar is length-aware (it knows epochs, §III.C). A job with unknown remaining work
  is taken to need as much again as it has done (at least one iteration).
* GPU types and placement are not modelled (NOTES §4.5 item 2): the placer decides
  where. Hosts enter only through the cross-host cost above, counted from the GPU
  count (``ceil(N / gpus_per_node)``), not from where the job runs.

Memory: none is needed; the decision depends on the view alone.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts
from shoal.policies.common import view_arrival_order
from shoal.policies.tiresias import gang_size
from shoal.sim.costs import ReconfigCosts, charge, classify, get_costs, measured

_INF = float("inf")


def _rate(job: JobView, gpus: int) -> float:
    if gpus <= 0:
        return 0.0
    curve = job.throughput
    return curve[gpus] if gpus < len(curve) else curve[-1]


class _Rest(Sequence["_Job"]):
    """``items[start:]`` without the copy: the incoming jobs behind the one Algorithm 1
    decides. A slice per incoming job copied the rest of a long queue at each of them."""

    __slots__ = ("_items", "_start")

    def __init__(self, items: Sequence[_Job], start: int) -> None:
        self._items = items
        self._start = start

    def __len__(self) -> int:
        return max(0, len(self._items) - self._start)

    def __iter__(self) -> Iterator[_Job]:
        return itertools.islice(self._items, self._start, None)

    @overload
    def __getitem__(self, i: int) -> _Job: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[_Job]: ...
    def __getitem__(self, i: int | slice) -> _Job | Sequence[_Job]:
        return list(self)[i]


class _Job:
    """A job in one decision: what its view says (``counts``, ``current``, ``remaining``,
    the same for every decision that sees that view) and what the decision gives it
    (``share``, ``finish``)."""

    __slots__ = ("counts", "current", "finish", "fins", "gang", "job", "order", "remaining", "share", "taken")

    def __init__(self, job: JobView, order: int, counts: tuple[int, ...]) -> None:
        self.job = job
        self.order = order
        self.current = job.current_gpus if job.current_gpus in feasible_counts(job) else 0
        if self.current and self.current not in counts:
            counts = tuple(sorted((*counts, self.current)))  # a running job keeps its count
        self.counts = counts
        self.share = self.current
        remaining = job.remaining_iterations
        self.remaining = max(1.0, job.iterations_done) if remaining is None else remaining
        self.finish = 0.0
        self.fins: dict[int, float] = {}
        """GPU count -> predicted finish (:meth:`_Plan.finish`): a function of the view,
        the cluster's GPUs per node and the costs alone, so it is kept with the view."""
        self.gang = -1
        """:func:`~shoal.policies.tiresias.gang_size` of the view (-1: not yet asked)."""
        self.taken = 0
        """The decision that last took this job (:meth:`SideCarAdaptive._jobs`; 0: none)."""

    def again(self, order: int) -> None:
        """Make this job what a new decision that sees the same view starts from: the
        view's share, no prediction of the decision's own, at position ``order``; the
        view's predictions (``fins``) stay."""
        self.order = order
        self.share = self.current
        self.finish = 0.0


class SideCarAdaptive:
    """SideCar adaptive scheduling (Algorithms 1–2); see the module docstring."""

    name = "sidecar"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""

    def __init__(
        self,
        *,
        costs: ReconfigCosts | str | None = None,
        consider_waiting: bool = True,
        default_options: str = "pow2",
    ) -> None:
        """Configure the policy.

        Args:
            costs: Reconfiguration costs used in the predictions: a
                :class:`~shoal.sim.costs.ReconfigCosts` or a name/spec accepted by
                :func:`shoal.sim.costs.get_costs`; ``None``: the simulator's when one binds
                them (:meth:`bind_costs`), else ``measured``.
            consider_waiting: Let an incoming job wait for its request when that
                predicts better than starting now.
            default_options: Optional GPU counts of a job that declares no
                ``allowed_gpu_counts``: ``"pow2"`` (powers of two and its request, within
                its feasible counts) or ``"all"`` (every feasible count).

        Raises:
            ValueError: an unknown cost preset or spec, or an unknown ``default_options``.
        """
        if default_options not in ("pow2", "all"):
            raise ValueError(f"default_options is 'pow2' or 'all', got {default_options!r}")
        self._explicit = get_costs(costs) if isinstance(costs, str) else costs
        self.costs = self._explicit or measured()
        self.consider_waiting = consider_waiting
        self.default_options = default_options
        self._seen: dict[str, _Job] = {}
        """Job id -> the job as the last decision that saw its view had it, taken again
        (:meth:`_Job.again`) by a decision that sees the same view. A view is immutable,
        and the simulator hands a job's view over again while it is unchanged, so the same
        object has the same options and predictions (a waiting job's are asked for at
        every decision). Kept only while :attr:`_seen_for` (GPUs per node, costs)
        is unchanged, and cut back to the current jobs whenever it holds more than twice
        as many, plus 64. Decides nothing: a policy without it decides the same."""
        self._seen_for: tuple[int, ReconfigCosts] | None = None
        self._stamp = 0

    def options(self, job: JobView) -> tuple[int, ...]:
        """The job's optional GPU counts (SideCar jobs declare e.g. {1, 2, 4, 8})."""
        counts = feasible_counts(job)
        if job.allowed_gpu_counts or not job.elastic or self.default_options == "all":
            return counts
        return tuple(c for c in counts if c & (c - 1) == 0 or c == job.requested_gpus)

    def planning_costs(self) -> ReconfigCosts | None:
        """The costs named at construction, or ``None`` (the simulator's then)."""
        return self._explicit

    def bind_costs(self, costs: ReconfigCosts) -> None:
        """Plan with ``costs``, the simulator's.

        Raises:
            ValueError: other costs were named at construction.
        """
        if self._explicit is not None and self._explicit != costs:
            raise ValueError(
                f"SideCar plans with {self._explicit.name!r} costs but the simulator charges {costs.name!r}"
            )
        self.costs = costs

    # -- predictions -------------------------------------------------------------

    def cost(self, j: _Job, gpus: int, gpus_per_node: int = 0) -> float:
        """Equivalent stop (seconds) of changing ``j`` to ``gpus`` GPUs: :func:`shoal.sim.costs.charge`."""
        kind = classify(j.current, gpus, False)
        if kind is None:
            return 0.0
        return charge(
            self.costs,
            kind,
            j.current,
            gpus,
            rate_old=_rate(j.job, j.current),
            rate_new=_rate(j.job, gpus),
            resumed=j.job.iterations_done > 0,
            gpus_per_node=gpus_per_node,
        ).stop_s

    def _finish(self, j: _Job, gpus: int, gpus_per_node: int = 0) -> float:
        """Predicted completion (seconds from now) of ``j`` on ``gpus`` GPUs (§III.C)."""
        rate = _rate(j.job, gpus)
        if rate <= 0:
            return _INF
        return self.cost(j, gpus, gpus_per_node) + j.remaining / rate

    # -- the decision --------------------------------------------------------------

    plan_class: type[_Plan]
    """The plan Algorithms 1-2 run on (set below :class:`_Plan`; a variant may replace it)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Algorithm 1 for each incoming job, then Algorithm 2 if none is left waiting."""
        ordered = view_arrival_order(view)
        gpn = view.gpus_per_node
        jobs = self._jobs(ordered, gpn)
        running = [j for j in jobs if j.share]
        for j in running:
            j.finish = self._finish(j, j.share, gpn)
        idle = view.total_gpus - sum(j.share for j in running)
        if idle < 0:  # GPUs were lost: keep the oldest jobs that still fit.
            idle = view.total_gpus
            for j in running:
                if j.share <= idle:
                    idle -= j.share
                else:
                    j.share = 0
            running = [j for j in running if j.share]
        plan = self.plan_class(self, running, idle, gpn)
        # A job that could never fit is not "incoming" (it would block reshaping up).
        incoming = [j for j in jobs if not j.current and j.counts and j.counts[0] <= view.total_gpus]
        left: list[_Job] = []
        for k, j in enumerate(incoming):
            if not plan.incoming(
                j, consider_waiting=self.consider_waiting, queued=(left, _Rest(incoming, k + 1))
            ):
                left.append(j)
        if not left:
            plan.reshape_up()
        shares = {j.job.job_id: j.share for j in jobs if j.share}
        return Decision(shares=shares)

    def _jobs(self, ordered: Sequence[JobView], gpus_per_node: int) -> list[_Job]:
        """The decision's jobs, in ``ordered``'s order: a job whose view the last decision
        saw too is that decision's :class:`_Job`, reset (:meth:`_Job.again`) with its
        predictions kept; any other is built from its view."""
        key = (gpus_per_node, self.costs)
        seen = self._seen
        if self._seen_for != key:  # predictions made for other nodes or costs
            seen.clear()
            self._seen_for = key
        self._stamp = stamp = self._stamp + 1
        jobs: list[_Job] = []
        for i, jv in enumerate(ordered):
            j = seen.get(jv.job_id)
            if j is not None and j.job is jv and j.taken != stamp:  # (a view listed twice: a job each)
                j.again(i)
            else:
                j = seen[jv.job_id] = _Job(jv, i, self.options(jv))
            j.taken = stamp
            jobs.append(j)
        if len(seen) > 2 * len(jobs) + 64:  # forget the jobs that left
            self._seen = {j.job.job_id: j for j in jobs}
        return jobs


class _Table:
    """Victims' options for one ``N_remove``, sorted by their new predicted finish."""

    __slots__ = ("counts", "ds", "ds_list", "fs", "ids", "valid")

    def __init__(self, entries: list[tuple[float, float, int, str, int]]) -> None:
        entries.sort()
        self.fs = [e[0] for e in entries]
        self.ds_list = [e[1] for e in entries]
        self.ds = np.array(self.ds_list)
        self.ids = [e[3] for e in entries]
        self.counts = [e[4] for e in entries]
        self.valid = np.ones(len(entries), dtype=bool)

    def query(self, bound: float) -> tuple[float, float, int] | None:
        """Best valid entry for a makespan of at least ``bound``: ``(ms, Δsum, index)``.

        Among entries finishing by ``bound`` (makespan stays ``bound``) the smallest
        Δfinish; else the entry finishing first.
        """
        k = bisect.bisect_right(self.fs, bound)
        if k:
            if k <= 32:  # small prefix: a Python scan beats numpy's call overhead
                valid, ds = self.valid, self.ds_list
                best = -1
                for i in range(k):
                    if valid[i] and (best < 0 or ds[i] < ds[best]):
                        best = i
                if best >= 0:
                    return bound, ds[best], best
            else:
                sub = np.where(self.valid[:k], self.ds[:k], _INF)
                i = int(np.argmin(sub))
                if sub[i] < _INF:
                    return bound, self.ds_list[i], i
        rest = self.valid[k:]
        if rest.any():
            i = k + int(np.argmax(rest))
            return self.fs[i], self.ds_list[i], i
        return None


class _Plan:
    """The running set of one decision with the indexes Algorithms 1–2 query."""

    def __init__(
        self, policy: SideCarAdaptive, running: list[_Job], idle: int, gpus_per_node: int = 0
    ) -> None:
        self.policy = policy
        self.gpn = gpus_per_node
        self.running = {j.job.job_id: j for j in running}
        self.by_order = {j.order: j for j in running}
        self.idle = idle
        self.used: set[str] = set()
        self.total = sum(j.finish for j in running)
        # (finish, gpus, order) of running jobs, ascending: top-2 and the wait estimate.
        self.by_finish = sorted((j.finish, j.share, j.order) for j in running)
        self._tables: dict[int, _Table] | None = None
        self._where: dict[str, list[tuple[int, int]]] = {}
        self._found: dict[tuple[int, float], tuple[float, float, int] | None] = {}
        """``(N_remove, bound)`` -> :meth:`_Table.query`'s answer, while no victim is
        retired (a long queue asks the same of every waiting job that does not start)."""
        self._waits: dict[int, float] = {}
        """need -> :meth:`wait_time`, while the running set is unchanged."""

    def finish(self, j: _Job, gpus: int) -> float:
        """:meth:`SideCarAdaptive._finish` on this decision's cluster (kept in ``j.fins``:
        it reads only the job's view, the GPUs per node and the costs)."""
        f = j.fins.get(gpus)
        if f is None:
            f = j.fins[gpus] = self.policy._finish(j, gpus, self.gpn)
        return f

    # -- indexes ---------------------------------------------------------------------

    def top(self) -> tuple[float, float, int]:
        """(largest finish, second largest, order of the largest job; -1 if none)."""
        bf = self.by_finish
        if not bf:
            return 0.0, 0.0, -1
        return bf[-1][0], bf[-2][0] if len(bf) > 1 else 0.0, bf[-1][2]

    def wait_time(self, need: int) -> float:
        """When ``need`` more GPUs than idle become free as running jobs finish."""
        if need <= 0:
            return 0.0
        known = self._waits.get(need)
        if known is not None:
            return known
        freed = 0
        out = _INF
        for finish, gpus, _ in self.by_finish:
            freed += gpus
            if freed >= need:
                out = finish
                break
        self._waits[need] = out
        return out

    def tables(self) -> dict[int, _Table]:
        """Per ``N_remove``, the victims' options (built once per decision)."""
        if self._tables is None:
            raw: dict[int, list[tuple[float, float, int, str, int]]] = {}
            for j in self.running.values():
                if j.job.job_id in self.used or not j.job.elastic:
                    continue
                for c in j.counts:
                    if c >= j.share:
                        break
                    f = self.finish(j, c)
                    raw.setdefault(j.share - c, []).append((f, f - j.finish, j.order, j.job.job_id, c))
            self._tables = {nr: _Table(entries) for nr, entries in raw.items()}
            for nr, table in self._tables.items():
                for i, jid in enumerate(table.ids):
                    self._where.setdefault(jid, []).append((nr, i))
        return self._tables

    def _retire(self, jid: str) -> None:
        """``jid`` is no longer a victim in this decision."""
        self.used.add(jid)
        self._found.clear()
        if self._tables is not None:
            for nr, i in self._where.pop(jid, ()):
                self._tables[nr].valid[i] = False

    def _set(self, j: _Job, gpus: int) -> None:
        """Give ``j`` ``gpus`` GPUs and update every index."""
        jid = j.job.job_id
        self._waits.clear()
        if jid in self.running:
            old = (j.finish, j.share, j.order)
            del self.by_finish[bisect.bisect_left(self.by_finish, old)]
            self.total -= j.finish
            self.idle += j.share
        j.share = gpus
        j.finish = self.finish(j, gpus)
        self.running[jid] = j
        self.by_order[j.order] = j
        self.total += j.finish
        self.idle -= gpus
        bisect.insort(self.by_finish, (j.finish, j.share, j.order))

    # -- Algorithm 1 -------------------------------------------------------------------

    def incoming(
        self, j: _Job, *, consider_waiting: bool, queued: tuple[Sequence[_Job], Sequence[_Job]] = ((), ())
    ) -> bool:
        """Decide one incoming job; return whether it started. ``queued`` (the incoming
        jobs left waiting ahead of ``j``, those not yet decided behind it) is not read:
        ``MS_predict`` counts running jobs only (a subclass may read it)."""
        top1, top2, top_order = self.top()
        best: tuple[float, float, int, int, int] | None = None  # (ms, sum, waits, N_remove, -N)
        choice: tuple[int, _Job | None, int] = (0, None, 0)
        tables = None
        # Nothing below changes the plan before the job starts (self.start), so what every
        # count reads of it is read once.
        idle, total = self.idle, self.total
        top_job = self.by_order.get(top_order)
        if top_job is not None and (top_job.job.job_id in self.used or not top_job.job.elastic):
            top_job = None  # not a victim
        fins, found_of = j.fins, self._found
        for n in j.counts:
            f_new = fins.get(n)
            if f_new is None:
                f_new = self.finish(j, n)
            if f_new == _INF:
                continue
            if n <= idle:
                key = (max(top1, f_new), total + f_new, 0, 0, -n)
                if best is None or key < best:
                    best, choice = key, (n, None, 0)
                continue
            nr = n - idle
            if tables is None:
                tables = self.tables()
            table = tables.get(nr)
            if table is not None:
                bound = max(top1, f_new)
                if (nr, bound) in found_of:
                    found = found_of[nr, bound]
                else:
                    found = found_of[nr, bound] = table.query(bound)
                if found is not None:
                    ms, delta, i = found
                    key = (ms, total + f_new + delta, 0, nr, -n)
                    if best is None or key < best:
                        best, choice = key, (n, self.running[table.ids[i]], nr)
            if top_job is not None:
                # The job holding the makespan: without it the makespan is the runner-up's.
                c = top_job.share - nr
                if c in top_job.counts:
                    f_v = self.finish(top_job, c)
                    key = (max(top2, f_v, f_new), total - top_job.finish + f_v + f_new, 0, nr, -n)
                    if best is None or key < best:
                        best, choice = key, (n, top_job, nr)
        if consider_waiting and best is not None:
            gang = j.gang
            if gang < 0:
                gang = j.gang = gang_size(j.job)
            f_gang = fins.get(gang)
            if f_gang is None:
                f_gang = self.finish(j, gang)
            f_wait = self.wait_time(gang - idle) + f_gang
            key = (max(top1, f_wait), total + f_wait, 1, 0, -gang)
            if key < best:
                return False
        if best is None:
            return False
        self.start(j, *choice)
        return True

    def start(self, j: _Job, n: int, victim: _Job | None, n_remove: int) -> None:
        """Start incoming ``j`` on ``n`` GPUs, ``n_remove`` of them from ``victim``."""
        if victim is not None:
            self._set(victim, victim.share - n_remove)
            self._retire(victim.job.job_id)
        self._set(j, n)
        self._retire(j.job.job_id)

    # -- Algorithm 2 ----------------------------------------------------------------------

    def _best_add(self, j: _Job, bound: float) -> tuple[float, int] | None:
        """The add to ``j`` with the largest fall in its finish, keeping it ≤ ``bound``."""
        best: tuple[float, int] | None = None
        for c in j.counts:
            if c <= j.share:
                continue
            if c - j.share > self.idle:
                break
            f = self.finish(j, c)
            if f <= bound and f < j.finish and (best is None or f - j.finish < best[0]):
                best = (f - j.finish, c)
        return best

    def reshape_up(self) -> None:
        """Algorithm 2, repeated while it strictly improves (makespan, sum)."""
        heap: list[tuple[float, int, str, int]] = []
        top1, _, _ = self.top()
        for j in self.running.values():
            if j.job.elastic:
                b = self._best_add(j, top1)
                if b is not None:
                    heap.append((b[0], j.order, j.job.job_id, b[1]))
        heapq.heapify(heap)
        while self.idle > 0:
            top1, top2, top_order = self.top()
            best: tuple[float, float, int] | None = None
            pick: tuple[_Job, int] | None = None
            top_job = self.by_order.get(top_order)
            if top_job is not None and top_job.job.elastic:
                for c in top_job.counts:
                    if c <= top_job.share:
                        continue
                    if c - top_job.share > self.idle:
                        break
                    f = self.finish(top_job, c)
                    key = (max(top2, f), self.total - top_job.finish + f, c - top_job.share)
                    if best is None or key < best:
                        best, pick = key, (top_job, c)
            # Other jobs cannot lower the makespan; the best of them lowers the sum most.
            while heap:
                d, _, jid, c = heap[0]
                j = self.running[jid]
                fresh = self._best_add(j, top1) if j.order != top_order else None
                if fresh is not None and fresh == (d, c):
                    key = (top1, self.total + d, c - j.share)
                    if best is None or key < best:
                        best, pick = key, (j, c)
                    break
                heapq.heappop(heap)
                if fresh is not None:
                    heapq.heappush(heap, (fresh[0], j.order, jid, fresh[1]))
            if best is None or pick is None or best[:2] >= (top1, self.total):
                return
            j, c = pick
            self._set(j, c)
            b = self._best_add(j, max(top1, j.finish))
            if b is not None:
                heapq.heappush(heap, (b[0], j.order, j.job.job_id, b[1]))


SideCarAdaptive.plan_class = _Plan

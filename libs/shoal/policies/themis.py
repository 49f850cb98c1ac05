"""Themis: finish-time fairness with leases, a partial auction and leftover distribution.

Themis (Mahajan et al., NSDI'20) gives GPUs in leases. Its fairness metric is the
finish-time fairness ``ρ = T_sh / T_id`` of each job: ``T_sh`` is the finish time the
job expects in the shared cluster, ``T_id`` the finish time it would have running
independently on a ``1/N`` share of the cluster, ``N`` being the average contention
(number of active jobs) over its lifetime. Each lease round the arbiter offers the
available GPUs to the ``1 - f`` fraction of jobs with the worst ``ρ`` (``f`` is the
fairness knob), runs a partial auction among them, and hands what the auction leaves
over to the other jobs. This is the version AFS/CoDDL compares against (AFS §5.1, §6:
"partial auction algorithm and random distribution of leftover resources … a static
lease duration"; footnote 13: a job whose peak throughput is at ``m`` GPUs and that
runs with ``n - 1`` others on average is owed ``1/n`` of that peak).

What is computed here, and what is simplified (each stated once):

* ``T_id = N_avg · W / S(m)``: ``W`` the job's total work (iterations), ``S(m)`` its
  peak throughput over its feasible GPU counts, ``N_avg`` the time-average number of
  active jobs since the job arrived (AFS footnote 13). ``W`` and the remaining work
  come from ``total_iterations``/``remaining_iterations`` when the view has them (a
  Themis agent estimates its job's remaining work; a known length is the best such
  estimate). **Simplification:** a job of unknown length is taken to need as much
  again as it has done (at least one lease at one GPU). AFS §5.1 counts Themis among
  the job-length-unaware algorithms; ``themis-unaware``
  (:mod:`shoal.policies.unaware`) is this policy with every length hidden, as there.
* ``T_sh(g) = (now - arrival) + R / S(g)``, ``∞`` with no GPU; ``ρ(g) = T_sh(g)/T_id``.
  Jobs are ranked by ``ρ`` at their present allocation (ties among jobs without GPUs:
  larger ``ρ`` at peak throughput first, then earlier arrival).
* **Partial auction, simplified:** Themis' agents bid ``ρ`` for subsets of the offer and
  the arbiter runs the Partial Allocation mechanism, which maximises the product of the
  bidders' ``1/ρ`` and withholds part of each winner's share as a hidden payment. Here
  the product is maximised greedily (every participant first gets its smallest
  feasible count, in worst-``ρ`` order; then one step at a time, to the participant
  whose ``log ρ`` falls most per added GPU, while some step lowers it). PA's hidden
  payment is **approximated** (``hidden_payment=True``): winner ``i`` keeps the fraction
  ``c_i = Π_{j≠i} v_j(x*) / Π_{j≠i} v_j(x*_{-i})`` of its GPUs (``v = 1/ρ``), where
  ``x*_{-i}`` is not re-solved but estimated by handing ``i``'s GPUs to the other
  winners' best next steps at ``x*`` (one step each, best first: the greedy's own order),
  so ``c_i = exp(-Σ gains of those steps)``. It keeps the largest feasible count not
  above ``c_i · g_i``, and at least its smallest; the withheld GPUs join the leftover.
  ``hidden_payment=False`` keeps the greedy allocation whole.
* **Leftover:** GPUs the auction does not use go to the non-participants in a random
  order (AFS: "random distribution"), each pass giving every job in that order its
  next feasible count while it fits and raises the job's throughput. The order comes
  from ``random.Random(f"{seed}:{now}")``, so a replay draws the same order.
  GPUs still left then go round the bidders the same way, so no GPU idles while some
  job's throughput would rise with it.
* **Leases** (Themis, as AFS §6 describes it: "a static lease duration of assigned
  GPUs"): a job's GPUs are leased for ``lease_s`` (default 10 minutes, the lease we
  recall from the Themis paper, which is not in ``shared/papers``; AFS does not state
  its value). Until its lease ends a job keeps its GPUs; arrivals and completions only
  auction the free GPUs (a lease holder may bid for more). When a lease ends, its GPUs
  go back into the next auction, and the policy asks to be re-run then
  (``next_decision_at_s`` = the earliest lease end). A job whose allocation is granted
  or changed gets a fresh lease for the whole allocation (Themis leases per GPU).
  ``lease_grid=True`` instead ends every lease on the grid ``k · lease_s``
  (``tick_s = lease_s``), one auction of the whole cluster per round.
* The fairness knob defaults to ``f = 0.8`` (as recalled from Themis' evaluation; AFS
  does not state it), so the worst 20% of the jobs (at least one) take part in each
  auction. Both are constructor parameters.
* ``cap_at_request=False`` lets a job grow to ``max_gpus`` (Themis is elastic in AFS);
  ``True`` holds it to its request as a gang-size cap.

Cost of a decision in a long queue (:meth:`Themis.decide`; :meth:`Themis.decide_all`
is the plain form, which it must equal, and which a property test compares it with).
Every job bids, so ranking is a pass over the whole queue; it is done with array
operations over columns of what ``ρ`` needs of each job (:class:`_Rows`: arrival, work
left over peak throughput, total work, peak, first sight), which stay put while a job
waits and are redone only for new jobs and changed views (the simulator's view says
which views it rebuilt since the previous decision, so only those are compared). The
operations are those of the per-job record, in the same order, so the keys are the
same floats, and a stable sort on them keeps arrival order for ties. The jobs that may
hold GPUs (a running job's view is new at every decision) bring the same columns taken
afresh, with the throughput of what they hold, and are ranked in the same array
operations by ρ at their present allocation. Working records are then made only for the participants the auction
reaches before the GPUs run out and the lease holders among the participants; the
leftover round, when GPUs remain, makes them for everyone as before. The two forms
write the same decision in different orders: the column form the holders first, then the
jobs the auction reached, and the jobs memory as it was plus the new jobs; the plain form
every job by rank, each with a new memory entry. The event log records those bytes, and
it was recorded with the plain form below 256 active jobs. So there are three bands:
below ``ranks_from_jobs`` (128) the plain form runs (on a short queue the arrays cost
more than they save); up to ``columns_from_jobs`` (256) the columns rank and the auction
runs as above, and the decision is written in the plain form's order
(:meth:`Themis._written_as_decide_all`, a pass over every job but no record for each);
from 256 on, the column form's order. Most of a Themis simulation is decisions at lease
ends (a 10-minute lease per job), and each still takes the running jobs' columns in
Python.

Memory (msgpack-able): ``contention`` (∫ active jobs dt since the start), ``t`` and ``n``
(time and number of jobs of the last decision), ``jobs``: job id →
``[contention_at_first_sight, time_of_first_sight, lease_end]`` (``lease_end`` 0 without
GPUs), ``round`` (grid mode) and ``next_decision_at_s``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shoal.policies.base import ClusterView, Decision, JobView, feasible_counts, jobs_by_id
from shoal.policies.common import view_arrival_order
from shoal.policies.tiresias import _rebuilt_since, gang_size

_INF = float("inf")


def _rate(job: JobView, gpus: int) -> float:
    curve = job.throughput
    if gpus <= 0:
        return 0.0
    return curve[gpus] if gpus < len(curve) else curve[-1]


def _peak(job: JobView, counts: tuple[int, ...]) -> float:
    """Largest throughput over ``counts`` (a slice when they are contiguous)."""
    if not counts:
        return 0.0
    curve = job.throughput
    key = (id(curve), counts)
    hit = _PEAKS.get(key)
    if hit is not None and hit[0] is curve:
        return hit[1]
    lo, hi = counts[0], counts[-1]
    if hi - lo + 1 == len(counts) and hi < len(curve):
        peak = max(curve[lo : hi + 1])
    else:
        peak = max(_rate(job, c) for c in counts)
    if len(_PEAKS) >= 8192:
        _PEAKS.clear()
    _PEAKS[key] = (curve, peak)
    return peak


_PEAKS: dict[tuple[int, tuple[int, ...]], tuple[tuple[float, ...], float]] = {}
"""Memo of :func:`_peak` by curve object: a running job's view is new at every decision,
its curve is not. An entry holds its curve, so the id stays that curve's."""


def _work(
    job: JobView, counts: tuple[int, ...], lease_s: float, lengths: bool = True
) -> tuple[float, float, float]:
    """``(remaining work, total work, peak throughput)`` of a job, as ρ uses them.

    With ``lengths`` false the job's ``remaining_iterations`` and ``total_iterations``
    are not read, as if both were unknown (``themis-unaware``)."""
    remaining = job.remaining_iterations if lengths else None
    if remaining is None:
        # Unknown length: assume the future equals the past (module docstring).
        remaining = max(job.iterations_done, _rate(job, counts[0] if counts else 1) * lease_s)
    total = job.total_iterations if lengths else None
    if total is None:
        total = job.iterations_done + remaining
    return remaining, total, _peak(job, counts)


class _Bidder:
    """One job's view of its own finish-time fairness."""

    __slots__ = ("counts", "current", "elapsed", "gpus", "job", "remaining", "t_best", "t_id")

    def __init__(
        self,
        job: JobView,
        counts: tuple[int, ...],
        gpus: int,
        elapsed: float,
        n_avg: float,
        lease_s: float,
        lengths: bool = True,
    ):
        self.job = job
        self.counts = counts
        self.gpus = gpus
        self.current = gpus
        self.elapsed = elapsed
        remaining, total, peak = _work(job, counts, lease_s, lengths)
        self.remaining = remaining
        self.t_id = n_avg * total / peak if peak > 0 else _INF
        self.t_best = elapsed + remaining / peak if peak > 0 else _INF

    def t_sh(self, gpus: int) -> float:
        rate = _rate(self.job, gpus)
        return self.elapsed + self.remaining / rate if rate > 0 else _INF

    def rho(self, gpus: int) -> float:
        if self.t_id == _INF:
            return 0.0
        return self.t_sh(gpus) / self.t_id if self.t_id > 0 else _INF

    def rank_key(self) -> tuple[float, float, float, str]:
        """Sort key: worst ρ at the present allocation first; ties by ρ at peak, arrival, id."""
        lower = self.t_best / self.t_id if 0 < self.t_id < _INF else 0.0
        return (-self.rho(self.current), -lower, self.job.arrival_s, self.job.job_id)

    def next_step(self, free: int) -> int:
        """The next feasible count above ``gpus`` that fits in ``free`` more GPUs, or 0."""
        for c in self.counts:
            if c > self.gpus:
                return c if c - self.gpus <= free else 0
        return 0

    def gain(self, step: int) -> float:
        """Fall of ``log T_sh`` (= of ``log ρ``) per added GPU when moving to ``step``."""
        before, after = self.t_sh(self.gpus), self.t_sh(step)
        if after >= before:
            return 0.0
        if before == _INF:
            return _INF
        return (math.log(before) - math.log(after)) / (step - self.gpus)


_JOB_ID = operator.attrgetter("job_id")
_CURRENT = operator.attrgetter("current_gpus")
_ARRIVAL_KEY = operator.attrgetter("arrival_s", "job_id")
_ARRIVAL, _REMAINING_PER_PEAK, _TOTAL, _PEAK, _C0, _T0 = range(6)


def _rank_terms(
    arrival: np.ndarray,
    rp: np.ndarray,
    total: np.ndarray,
    peak: np.ndarray,
    c0: np.ndarray,
    t0: np.ndarray,
    contention: float,
    now: float,
    n_now: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(elapsed, T_id, -ρ at peak)`` of jobs as columns, by :class:`_Bidder`'s operations
    in its order (``rp``: remaining work over peak throughput), so the same floats."""
    elapsed = now - arrival
    elapsed = np.where(elapsed > 0.0, elapsed, 0.0)  # max(0.0, now - arrival)
    n_avg = np.where(now > t0, (contention - c0) / (now - t0), float(n_now))
    n_avg = np.where(n_avg < 1.0, 1.0, n_avg)  # max(n_avg, 1.0)
    has_peak = peak > 0
    t_id = np.where(has_peak, n_avg * total / peak, _INF)
    t_best = np.where(has_peak, elapsed + rp, _INF)
    neg_lower = -np.where((t_id > 0) & (t_id < _INF), t_best / t_id, 0.0)
    return elapsed, t_id, neg_lower


class _Rows:
    """What ρ needs of each job, as columns, for ranking every job with array operations.

    A row holds a job's arrival, remaining work over peak throughput, total work, peak
    throughput and its first sight (contention and time), all fixed while the job's view
    is the same object (the simulator keeps a waiting job's view until something about
    it changes). A :class:`Themis` keeps the rows of its last decision for the jobs memory
    it returned (:attr:`of`, compared by identity) and only redoes the rows of new jobs
    and changed views; memory from elsewhere (decoded from the log) is another object,
    and the rows are built afresh, so they never change a decision.
    """

    __slots__ = ("cols", "fresh", "ids", "idx", "leased", "obj", "of", "plain", "row", "serial", "size")

    def __init__(
        self,
        policy: Themis,
        jobs: Sequence[JobView],
        ids: Sequence[str],
        seen_prev: Mapping[str, Any],
        contention: float,
        now: float,
    ) -> None:
        self.of: Mapping[str, Any] | None = None
        self.leased: set[str] = set()
        """The jobs given GPUs at the decision that returned :attr:`of`."""
        self.plain = False
        """Whether that decision was written in :meth:`Themis.decide_all`'s order."""
        self.serial = 0
        """The serial of that decision's job sequence (:meth:`LiveJobs.rebuilt_since`; 0
        when it had none)."""
        self.row: dict[str, int] = {}
        self.obj: dict[str, JobView] = {}
        self.size = 0
        self.cols = np.empty((6, max(1024, 2 * len(jobs))))
        self.fresh = True
        for job in jobs:
            self._put(policy, job, seen_prev, contention, now)
        self.ids = ids
        self.idx = np.fromiter(map(self.row.__getitem__, ids), np.intp, len(ids))

    def _put(
        self, policy: Themis, job: JobView, seen_prev: Mapping[str, Any], contention: float, now: float
    ) -> None:
        jid = job.job_id
        r = self.row.get(jid)
        if r is None:
            r = self.row[jid] = self.size
            self.size += 1
            if r >= self.cols.shape[1]:
                self.cols = np.concatenate([self.cols, np.empty_like(self.cols)], axis=1)
        remaining, total, peak = _work(
            job, policy._counts(job), policy.lease_duration_s, policy.reads_lengths
        )
        first = seen_prev.get(jid)
        if first is not None and len(first) >= 2:
            c0, t0 = float(first[0]), float(first[1])
        else:
            c0, t0 = contention, now
        self.cols[:, r] = (job.arrival_s, remaining / peak if peak > 0 else _INF, total, peak, c0, t0)
        self.obj[jid] = job

    def update(
        self,
        policy: Themis,
        view: ClusterView,
        jobs: Sequence[JobView],
        ids: Sequence[str],
        seen_prev: Mapping[str, Any],
        contention: float,
        now: float,
    ) -> None:
        """Redo the rows of the jobs whose view is not the one their row was made of.

        A running job's view changes at every decision, and its rank comes from the
        columns the decision takes of it (``rank_order``'s ``held_cols``), so its row is
        redone only when it has none; its view will have changed again by the time it
        waits. When the simulator says which views it rebuilt since the decision these
        rows were last brought up to date at (:meth:`LiveJobs.rebuilt_since`), only those
        are looked at: any other job's view is the object it was then, and was compared
        then."""
        self.fresh = False
        row = self.row
        obj = self.obj
        rebuilt = _rebuilt_since(view.jobs, self.serial)
        if rebuilt is None:
            changed: Iterable[JobView] = itertools.compress(
                jobs, map(operator.is_not, map(obj.get, ids), jobs)
            )
        else:
            index = jobs_by_id(view)
            changed = (
                job for jid in rebuilt if (job := index.get(jid)) is not None and obj.get(jid) is not job
            )
        for job in changed:
            if not job.current_gpus or job.job_id not in row:
                self._put(policy, job, seen_prev, contention, now)
        if ids != self.ids:  # a job came or went (a kept job keeps its row)
            # A job that went may come back with the same view object; memory no longer
            # knows it then, so its first sight is the decision it comes back at, as
            # ``start`` says: forget the view its row was made of, so that row is redone.
            for jid in set(self.ids).difference(ids):
                self.obj.pop(jid, None)
            self.ids = ids
            self.idx = np.fromiter(map(self.row.__getitem__, ids), np.intp, len(ids))

    @staticmethod
    def positions(job_ids: Iterable[str], jobs: Sequence[JobView], view: ClusterView) -> Iterator[int]:
        """The positions in ``jobs`` (arrival order) of those of ``job_ids`` still active
        and holding no GPUs (the caller has the others)."""
        index = jobs_by_id(view)
        for jid in job_ids:
            job = index.get(jid)
            if job is not None and not job.current_gpus:
                yield bisect.bisect_left(jobs, _ARRIVAL_KEY(job), key=_ARRIVAL_KEY)

    def rank_order(
        self,
        holders: Sequence[int],
        held_cols: Sequence[float],
        contention: float,
        now: float,
        n_now: int,
    ) -> np.ndarray | None:
        """Positions in :meth:`_Bidder.rank_key` order, or None if a key is NaN.

        The array operations are those of :class:`_Bidder`, in the same order, so the
        keys are the same floats. The jobs at positions ``holders`` (those that may hold
        GPUs) bring their own columns, ``held_cols`` (seven floats per holder, one
        after the other): arrival, remaining work, total work, peak throughput, first
        sight (contention and time) and the throughput of what they hold now, taken at
        this decision (a running job's view changes at every decision, so its row would
        be stale)."""
        cols = self.cols[:, self.idx]  # a copy
        with np.errstate(all="ignore"):
            if holders:
                at = np.fromiter(holders, np.intp, len(holders))
                held = np.array(held_cols, np.float64).reshape(-1, 7).T
                remaining, peak, rate = held[1].copy(), held[3], held[6]
                held[1] = np.where(peak > 0, remaining / peak, _INF)  # what the rows hold
                cols[:, at] = held[:6]
            arrival, rp, total, peak, c0, t0 = cols
            elapsed, t_id, neg_lower = _rank_terms(arrival, rp, total, peak, c0, t0, contention, now, n_now)
            if holders:
                # ρ at the present allocation (_Bidder.rho) needs T_sh; without GPUs it is ∞.
                t_sh = np.full(n_now, _INF)
                t_sh[at] = np.where(rate > 0, elapsed[at] + remaining / rate, _INF)
                neg_rho = -np.where(t_id == _INF, 0.0, np.where(t_id > 0, t_sh / t_id, _INF))
            else:
                neg_rho = -np.where(t_id == _INF, 0.0, _INF)  # ρ without GPUs
        if np.isnan(neg_rho).any() or np.isnan(neg_lower).any():
            return None
        # Stable: ties keep arrival order (then job id), the rest of rank_key.
        return np.lexsort((neg_lower, neg_rho))

    def memory_out(
        self,
        seen_prev: Mapping[str, Any],
        jobs: Sequence[JobView],
        ids: Sequence[str],
        contention: float,
        now: float,
    ) -> dict[str, Any]:
        """The jobs memory of a job holding no GPUs now (``[c0, t0, 0]``) for every job; the
        caller writes the others'. Unchanged entries are the previous ones."""
        if self.fresh:
            out: dict[str, Any] = {}
            for job in jobs:
                first = seen_prev.get(job.job_id)
                if first is not None and len(first) >= 2:
                    out[job.job_id] = [float(first[0]), float(first[1]), 0.0]
                else:
                    out[job.job_id] = [contention, now, 0.0]
            return out
        out = dict(seen_prev)
        new = list(itertools.filterfalse(out.__contains__, ids))
        if len(out) + len(new) != len(ids):  # jobs left
            for jid in out.keys() - set(ids):
                del out[jid]
                self.obj.pop(jid, None)
        for jid in new:
            out[jid] = [contention, now, 0.0]
        return out

    def finish(
        self, view: ClusterView, out: Mapping[str, Any], shares: Mapping[str, int], plain: bool
    ) -> None:
        self.serial = getattr(view.jobs, "serial", 0) or 0
        self.of = out
        self.leased = set(shares)
        self.plain = plain


class Themis:
    """Themis (NSDI'20) as AFS/CoDDL simplified it; see the module docstring."""

    name = "themis"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    columns_from_jobs = 256
    """From this many active jobs a decision writes its shares and jobs memory in the
    column form's order (holders first, then the jobs the auction reached). Below it, the
    order of :meth:`decide_all` (every job, by rank), so the event log is the same bytes
    as when only :meth:`decide_all` ran there."""
    ranks_from_jobs = 128
    """Below this many active jobs a decision takes :meth:`decide_all` (same decision,
    same bytes): the column machinery costs more than it saves on a short queue."""

    def __init__(
        self,
        *,
        lease_s: float = 600.0,
        fairness_knob: float = 0.8,
        cap_at_request: bool = False,
        hidden_payment: bool = True,
        lease_grid: bool = False,
        seed: int = 0,
    ) -> None:
        """Configure the policy.

        Args:
            lease_s: Lease length in seconds (Themis default 10 min).
            fairness_knob: ``f`` in [0, 1): the worst ``1 - f`` of jobs bid each round.
            cap_at_request: Hold each job to its request (gang size) instead of ``max_gpus``.
            hidden_payment: Withhold PA's (approximate) payment from the winners.
            lease_grid: End all leases together on the grid ``k · lease_s``.
            seed: Seed of the leftover order.

        Raises:
            ValueError: a non-positive lease or a knob outside [0, 1).
        """
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        if not 0.0 <= fairness_knob < 1.0:
            raise ValueError(f"fairness_knob must be in [0, 1), got {fairness_knob}")
        # Not ``self.lease_s``: the simulator would take that for a re-run grid.
        self.lease_duration_s = float(lease_s)
        if lease_grid:
            self.tick_s = self.lease_duration_s
        self.lease_grid = lease_grid
        self.fairness_knob = fairness_knob
        self.cap_at_request = cap_at_request
        self.hidden_payment = hidden_payment
        self.seed = seed
        self.reads_lengths = True
        """Whether ρ uses the jobs' known lengths; ``themis-unaware``
        (:mod:`shoal.policies.unaware`) clears it, and every length counts as unknown."""
        self._rows: _Rows | None = None

    def _counts(self, job: JobView) -> tuple[int, ...]:
        counts = feasible_counts(job)
        if self.cap_at_request:
            cap = gang_size(job)
            counts = tuple(c for c in counts if c <= cap)
        return counts

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Auction the free GPUs (those of ended leases included), then the leftover.

        Decides as :meth:`decide_all`, with the cost of a long queue kept off the Python
        level (module docstring, "Cost of a decision in a long queue").
        """
        if len(view.jobs) < self.ranks_from_jobs:
            self._rows = None
            return self.decide_all(view, memory)
        plain = len(view.jobs) < self.columns_from_jobs  # written in decide_all's order
        now = view.now_s
        total = view.total_gpus
        lease = self.lease_duration_s
        round_no = math.floor(now / lease + 1e-9)
        same_round = memory.get("round") == round_no
        contention = float(memory.get("contention", 0.0))
        last_t = float(memory.get("t", now))
        contention += float(memory.get("n", 0)) * max(0.0, now - last_t)
        jobs = view_arrival_order(view)
        n_now = len(jobs)
        seen_prev: Mapping[str, Any] = memory.get("jobs", {})
        if not isinstance(seen_prev, Mapping):
            seen_prev = {}

        # Per-job columns (what ρ needs of a job that does not change while it waits),
        # kept between decisions for the jobs memory this policy returned (_Rows).
        rows, self._rows = self._rows, None
        ids = list(map(_JOB_ID, jobs))
        if (
            rows is None
            or rows.of is not seen_prev
            or rows.size > 2 * n_now + 1024
            or (rows.plain and not plain)  # the column order starts from fresh rows, as it always did
        ):
            rows = _Rows(self, jobs, ids, seen_prev, contention, now)
        else:
            rows.update(self, view, jobs, ids, seen_prev, contention, now)

        def start(job: JobView) -> tuple[float, float, float]:
            first = seen_prev.get(job.job_id)
            if first is not None and len(first) >= 2:
                return float(first[0]), float(first[1]), float(first[2]) if len(first) > 2 else 0.0
            return contention, now, 0.0

        lengths = self.reads_lengths
        kept: dict[str, int] = {}
        holding: set[int] = set()  # the holders' positions
        starts: dict[int, tuple[float, float, float]] = {}  # start() of each holder

        def bidder(job: JobView) -> _Bidder:
            """The job's working record, as decide_all makes it, holding its kept GPUs."""
            c0, t0, _ = start(job)
            n_avg = (contention - c0) / (now - t0) if now > t0 else float(n_now)
            n_avg = max(n_avg, 1.0)
            counts = self._counts(job)
            gpus = job.current_gpus if job.current_gpus in counts else 0
            b = _Bidder(job, counts, gpus, max(0.0, now - job.arrival_s), n_avg, lease, lengths)
            b.gpus = kept.get(job.job_id, 0)
            return b

        # The jobs that may hold GPUs: the running ones, and the ones given GPUs last time
        # (positions in ``jobs``, first met first). What ranks them (_Rows.rank_order's
        # holder columns) is taken here; a working record is made for one only when the
        # auction reaches it.
        holders: list[int] = []
        holder_ids: list[str] = []
        held_cols: list[float] = []  # seven per holder, flat
        kept_at: list[int] = []  # the positions of the holders that keep their GPUs
        get_first = seen_prev.get
        counts_of = self._counts
        grid = self.lease_grid
        running_until = now + 1e-9
        for i in itertools.chain(
            itertools.compress(range(n_now), map(_CURRENT, jobs)), rows.positions(rows.leased, jobs, view)
        ):
            if i in holding:
                continue
            holding.add(i)
            holders.append(i)
            job = jobs[i]
            jid = job.job_id
            holder_ids.append(jid)
            # start(job), _rate(job, gpus) inlined (a call each per holder per decision
            # was a measurable part of a long run): the same arithmetic.
            first = get_first(jid)
            if first is not None and len(first) >= 2:
                c0, t0 = float(first[0]), float(first[1])
                lease_end = float(first[2]) if len(first) > 2 else 0.0
            else:
                c0, t0, lease_end = contention, now, 0.0
            starts[i] = (c0, t0, lease_end)
            counts = counts_of(job)
            gpus = job.current_gpus
            if gpus not in counts:
                gpus = 0
            remaining, work, peak = _work(job, counts, lease, lengths)
            if gpus > 0:
                curve = job.throughput
                rate = curve[gpus] if gpus < len(curve) else curve[-1]
            else:
                rate = 0.0
            held_cols += (job.arrival_s, remaining, work, peak, c0, t0, rate)
            if gpus and (same_round if grid else lease_end > running_until):
                kept[jid] = gpus
                kept_at.append(i)
        if sum(kept.values()) > total:
            kept = {}  # GPUs were lost: every lease ends now.
            kept_at = []
        free = total - sum(kept.values())

        built: dict[int, _Bidder] = {}
        participants: dict[int, _Bidder] = {}  # rank -> bidder, for the ranks looked at
        order: np.ndarray | None = None
        if free > 0 and n_now:
            order = rows.rank_order(holders, held_cols, contention, now, n_now)
            if order is None:  # a NaN in ρ: sorting is not a total order, take the reference form
                self._rows = None
                return self.decide_all(view, memory)
            k = max(1, math.ceil((1.0 - self.fairness_knob) * n_now))

            def at(r: int) -> _Bidder:
                i = int(order[r])
                b = built.get(i)
                if b is None:
                    b = built[i] = bidder(jobs[i])
                return b

            # Step one of the auction takes the participants in rank order only while GPUs
            # are free; the lease holders among them take part in the rest.
            if kept_at:
                rank_of = np.empty(n_now, dtype=np.intp)
                rank_of[order] = np.arange(n_now)
                for r in rank_of[kept_at].tolist():
                    if r < k:
                        participants[r] = at(r)
            r = 0
            while r < k and free > 0:
                b = participants.get(r) or at(r)
                participants[r] = b
                if b.gpus == 0 and b.counts and b.counts[0] <= free and _rate(b.job, b.counts[0]) > 0:
                    b.gpus = b.counts[0]
                    free -= b.gpus
                r += 1
            ranked = sorted(participants)
            free = self._auction_growth([participants[r] for r in ranked], ranked, free)
            if self.hidden_payment:
                free += self._withhold([participants[r] for r in ranked])
            if free > 0:
                others = [at(r) for r in range(k, n_now)]
                random.Random(f"{self.seed}:{now!r}").shuffle(others)
                free = self._leftover(others, free)
                if free > 0:  # nobody else can use them: back to the bidders (work-conserving)
                    free = self._leftover([at(r) for r in range(k)], free)

        if plain:
            return self._written_as_decide_all(
                view, jobs, order, built, kept, seen_prev, rows, now, contention, round_no
            )

        # The shares and leases: the holders first, then the others in the order their
        # records were made.
        shares: dict[str, int] = {}
        wake = float("inf")
        out = rows.memory_out(seen_prev, jobs, ids, contention, now)
        get_old = out.get
        renewed = now + lease  # a granted or changed allocation's fresh lease
        get_built = built.get
        for i, jid in itertools.chain(
            zip(holders, holder_ids, strict=True),
            ((i, jobs[i].job_id) for i in itertools.filterfalse(holding.__contains__, built)),
        ):
            record = get_built(i)
            gpus = record.gpus if record is not None else kept.get(jid, 0)
            c0, t0, lease_end = starts.get(i) or start(jobs[i])
            if gpus:
                shares[jid] = gpus
                if kept.get(jid) != gpus:
                    lease_end = renewed
                if lease_end < wake:  # min(wake, lease_end)
                    wake = lease_end
            else:
                lease_end = 0.0
            old = get_old(jid)
            if old is None or old[0] != c0 or old[1] != t0 or old[2] != lease_end:
                out[jid] = [c0, t0, lease_end]
        rows.finish(view, out, shares, plain=False)
        self._rows = rows
        new_memory: dict[str, Any] = {"contention": contention, "t": now, "n": n_now, "jobs": out}
        if self.lease_grid:
            new_memory["round"] = round_no
        elif wake != float("inf"):
            new_memory["next_decision_at_s"] = wake
        return Decision(shares=shares, memory=new_memory)

    def _written_as_decide_all(
        self,
        view: ClusterView,
        jobs: Sequence[JobView],
        order: np.ndarray | None,
        built: Mapping[int, _Bidder],
        kept: Mapping[str, int],
        seen_prev: Mapping[str, Any],
        rows: _Rows,
        now: float,
        contention: float,
        round_no: int,
    ) -> Decision:
        """The decision :meth:`decide` reached, written as :meth:`decide_all` writes it:
        every job, by rank when there was a ranking (GPUs were free; the ranks are a total
        order, so the column ranking's is decide_all's), else in the view's order, each
        with a jobs memory entry of its own."""
        lease = self.lease_duration_s
        records = {jobs[i].job_id: b for i, b in built.items()}
        shares: dict[str, int] = {}
        out: dict[str, list[float]] = {}
        wake = float("inf")
        get_first = seen_prev.get
        for job in view.jobs if order is None else map(jobs.__getitem__, order.tolist()):
            jid = job.job_id
            b = records.get(jid)
            gpus = b.gpus if b is not None else kept.get(jid, 0)
            # start(job) inlined (a call per job per decision): the same values.
            first = get_first(jid)
            if first is not None and len(first) >= 2:
                c0, t0 = float(first[0]), float(first[1])
            else:
                c0, t0, first = contention, now, None
            if gpus:
                shares[jid] = gpus
                if kept.get(jid) != gpus:
                    lease_end = now + lease  # granted or changed: a fresh lease
                else:
                    lease_end = float(first[2]) if first is not None and len(first) > 2 else 0.0
                wake = min(wake, lease_end)
            else:
                lease_end = 0.0
            out[jid] = [c0, t0, lease_end]
        rows.finish(view, out, shares, plain=True)
        self._rows = rows
        new_memory: dict[str, Any] = {"contention": contention, "t": now, "n": len(jobs), "jobs": out}
        if self.lease_grid:
            new_memory["round"] = round_no
        elif wake != float("inf"):
            new_memory["next_decision_at_s"] = wake
        return Decision(shares=shares, memory=new_memory)

    def decide_all(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """:meth:`decide` with a working record for every job, all sorted (the reference
        form, which a property test compares with it)."""
        now = view.now_s
        total = view.total_gpus
        lease = self.lease_duration_s
        round_no = math.floor(now / lease + 1e-9)
        same_round = memory.get("round") == round_no

        # Contention integral for N_avg (AFS footnote 13).
        contention = float(memory.get("contention", 0.0))
        last_t = float(memory.get("t", now))
        contention += float(memory.get("n", 0)) * max(0.0, now - last_t)
        n_now = len(view.jobs)
        seen_prev = memory.get("jobs", {})
        if not isinstance(seen_prev, Mapping):
            seen_prev = {}
        lengths = self.reads_lengths

        kept: dict[str, int] = {}
        bidders: list[_Bidder] = []
        starts: dict[str, tuple[float, float, float]] = {}
        for job in view.jobs:
            first = seen_prev.get(job.job_id)
            if first is not None and len(first) >= 2:
                c0, t0 = float(first[0]), float(first[1])
                lease_end = float(first[2]) if len(first) > 2 else 0.0
            else:
                c0, t0, lease_end = contention, now, 0.0
            starts[job.job_id] = (c0, t0, lease_end)
            n_avg = (contention - c0) / (now - t0) if now > t0 else float(n_now)
            n_avg = max(n_avg, 1.0)
            counts = self._counts(job)
            gpus = job.current_gpus if job.current_gpus in counts else 0
            held = same_round if self.lease_grid else lease_end > now + 1e-9
            if gpus and held:
                kept[job.job_id] = gpus
            bidders.append(_Bidder(job, counts, gpus, max(0.0, now - job.arrival_s), n_avg, lease, lengths))
        if sum(kept.values()) > total:
            kept = {}  # GPUs were lost: every lease ends now.
        for b in bidders:
            b.gpus = kept.get(b.job.job_id, 0)
        free = total - sum(kept.values())

        if free > 0 and bidders:
            bidders.sort(key=_Bidder.rank_key)
            k = max(1, math.ceil((1.0 - self.fairness_knob) * len(bidders)))
            free = self._auction(bidders[:k], free)
            if self.hidden_payment:
                free += self._withhold(bidders[:k])
            others = bidders[k:]
            random.Random(f"{self.seed}:{now!r}").shuffle(others)
            free = self._leftover(others, free)
            if free > 0:  # nobody else can use them: back to the bidders (work-conserving)
                free = self._leftover(bidders[:k], free)

        shares: dict[str, int] = {}
        jobs: dict[str, list[float]] = {}
        wake = float("inf")
        for b in bidders:
            jid = b.job.job_id
            c0, t0, lease_end = starts[jid]
            if b.gpus:
                shares[jid] = b.gpus
                if kept.get(jid) != b.gpus:
                    lease_end = now + lease  # granted or changed: a fresh lease
                wake = min(wake, lease_end)
            else:
                lease_end = 0.0
            jobs[jid] = [c0, t0, lease_end]
        new_memory: dict[str, Any] = {"contention": contention, "t": now, "n": n_now, "jobs": jobs}
        if self.lease_grid:
            new_memory["round"] = round_no
        elif wake != float("inf"):
            new_memory["next_decision_at_s"] = wake
        return Decision(shares=shares, memory=new_memory)

    @classmethod
    def _auction(cls, participants: list[_Bidder], free: int) -> int:
        """Greedy maximisation of Π 1/ρ among the bidders (PA without payments)."""
        for b in participants:  # worst ρ first: everyone gets something before anyone grows
            if b.gpus == 0 and b.counts and b.counts[0] <= free and _rate(b.job, b.counts[0]) > 0:
                b.gpus = b.counts[0]
                free -= b.gpus
        return cls._auction_growth(participants, range(len(participants)), free)

    @staticmethod
    def _auction_growth(participants: Sequence[_Bidder], ranks: Sequence[int], free: int) -> int:
        """The auction after step one: one step at a time to the best ``log ρ`` fall per
        GPU (ties: the better rank, ``ranks[i]`` being ``participants[i]``'s)."""
        heap: list[tuple[float, int, int, int]] = []
        for i, b in enumerate(participants):
            if b.gpus:
                step = b.next_step(free)
                if step and (g := b.gain(step)) > 0:
                    heap.append((-g, ranks[i], i, step))
        heapq.heapify(heap)
        while heap and free > 0:
            _, r, i, step = heapq.heappop(heap)
            b = participants[i]
            if step - b.gpus > free:  # no longer fits: retry with what is free now
                step = b.next_step(free)
                if step and (g := b.gain(step)) > 0:
                    heapq.heappush(heap, (-g, r, i, step))
                continue
            free -= step - b.gpus
            b.gpus = step
            nxt = b.next_step(free)
            if nxt and (g := b.gain(nxt)) > 0:
                heapq.heappush(heap, (-g, r, i, nxt))
        return free

    @staticmethod
    def _withhold(participants: list[_Bidder]) -> int:
        """Approximate Partial Allocation payments; returns the GPUs withheld."""
        winners = [b for b in participants if b.gpus]
        steps = []  # (gain per GPU, GPUs, winner index) of each winner's next step at x*
        for i, b in enumerate(winners):
            step = b.next_step(1 << 30)
            if step and (g := b.gain(step)) > 0 and g != _INF:
                steps.append((g, step - b.gpus, i))
        steps.sort(key=lambda t: (-t[0], t[2]))
        withheld = 0
        for i, b in enumerate(winners):
            budget = b.gpus
            fall = 0.0  # Σ_{j≠i} (log v_j(x*_{-i}) - log v_j(x*))
            for g, size, j in steps:
                if j == i or size > budget:
                    continue
                budget -= size
                fall += g * size
                if budget == 0:
                    break
            keep_max = math.exp(-fall) * b.gpus
            fits = [c for c in b.counts if c <= keep_max + 1e-9]
            keep = fits[-1] if fits else b.counts[0]
            if keep < b.gpus:
                withheld += b.gpus - keep
                b.gpus = keep
        return withheld

    @staticmethod
    def _leftover(others: list[_Bidder], free: int) -> int:
        """Leftover GPUs to the other jobs, in the given (random) order, pass after pass."""
        active = others
        while free > 0 and active:
            still = []
            for b in active:
                if free <= 0:
                    break
                step = b.next_step(free)
                if step and _rate(b.job, step) > _rate(b.job, b.gpus):
                    free -= step - b.gpus
                    b.gpus = step
                    still.append(b)
            active = still
        return free

"""AFS-L and AFS-P: Apathetic Future Share (AFS/CoDDL, NSDI'21, §3), fast and naive forms.

**Eq. (3)** (AFS §3.2). For two jobs, ``j_a`` the one that finishes earlier at the
current shares and ``j_b`` the other, with ``p`` a job's throughput at its current
share and ``p'`` at one step more, ``j_b`` has priority for the extra GPU iff::

    (p'_b - p_b) / p'_b  >  (p'_a - p_a) / p_a                                   (3)

Derivation, checked here because the converted text may garble it: eq. (1) (case b1)
with the AFS assumption ``p'_{b,2} = p'_{b,1}`` is, divided by ``w_a``,
``1/p'_a - 1/p_a + (p'_b/p_a - p_b/p'_a) / (2 p'_b)``, which is positive iff
``2 p_a - p'_a - p_a p_b / p'_b > 0`` iff (3). Eq. (2) (case b2) with
``p'_{a,2} = p_{a,1}`` reduces to the same expression, so (3) covers both cases.
Writing ``f = p'/p`` (the fractional gain of appendix B), (3) reads
``1 - 1/f_b > f_a - 1``: ``j_b`` wins only when it is *clearly* more efficient; a job
with no share has ``p = 0`` (``f = ∞``, "its length is considered infinite").

**AFS-L** (Algorithm 1, §3.3), knowing job lengths, is two-stage (§3.3, REPRODUCTION.md):
stage one gives every job its smallest share in increasing order of its length at that
share (lines 5-7 of TOPPRIORITY); if some job is left without a share the cluster is
full and (apart from GPUs no waiting job fits in) allocation ends. Otherwise stage two
hands out the remaining GPUs one step at a time to TOPPRIORITY's pick, where a pair is
ordered by length at the current shares (line 9) and (3) decides (lines 11-12).

**AFS-P** (§3.3 "Handling unknown job lengths") knows no lengths. Its TOPPRIORITY
evaluates (3) both ways; if neither holds the paper breaks the tie at random. Here the
tie goes to the job with the larger ``f`` (appendix B: "``j_b`` is more likely to get the
extra GPU if its resource efficiency is relatively higher"), then the earlier arrival.
Since (3) true for ``j_b`` implies ``f_b > f_a``, the whole comparison is then "larger
``f`` first": a heap keyed on ``(-f, arrival rank)`` finds the pick in O(log n). When the
jobs do not all fit at their smallest share, AFS-P does processor sharing (§3.3, fn. 11):
every job has a counter of time units executed; jobs get their smallest share in
increasing counter order, non-preemptively, holding a *lease* of one unit
(``unit_s``); when a lease ends the counter grows by one, the job is evicted and the
scheduler runs again (``Decision.memory["next_decision_at_s"]``).

Choices where the paper is silent or inexact (documented, deterministic):

* **TOPPRIORITY is not transitive** in general, contrary to appendix C, whose proof
  covers only the chain "longer beats shorter, twice". Counter-example with lengths
  ``a < b < c`` and gains ``f_a = 1.3, f_b = 1.42, f_c = 1.6``: ``a`` beats ``b``,
  ``b`` beats ``c``, ``c`` beats ``a``. So the scan order of TOPPRIORITY ("``j*`` ← any
  job") matters. AFS-L scans jobs in **increasing length** at their current shares
  (ties: earlier arrival, then job id): ``j*`` starts as the SRTF choice and moves to a
  longer job only when (3) says so. The fast form follows exactly this scan: the pick
  is the end of the chain "next longer job with ``g > h`` of the current pick", found
  with vectorised searches over the jobs sorted by length (plain lists below 64
  candidates; ``g = (p'-p)/p'``, ``h = (p'-p)/p``, computed with the same float
  operations as the naive form, so both forms agree bit for bit).
* **AFS-P ties**: by ``f`` then arrival, see above (the paper: random). The naive form
  evaluates (3) both ways literally and uses this tie-break; it agrees with the heap
  unless (3) and ``f`` disagree through float rounding, which needs gains within about
  1e-7 of 1 (a test covers curves with realistic gains).
* **Feasible counts.** A "GPU" of Algorithm 1 is a step to the job's next feasible
  count (:class:`~shoal.policies.common.Ladder`), so ``p'`` is the throughput at that
  count; a step that does not fit in the GPUs left is not a candidate. A step that does
  not raise throughput is never taken (the paper considers ``1 < f``): GPUs that no job
  can use stay idle. Non-elastic jobs have one step, to their request.
* **Stage one with wide minimum shares**: jobs whose smallest share does not fit are
  skipped and later ones considered (backfill); GPUs left over that no waiting job fits
  in go to stage two among the jobs that run.
* **Unknown length in AFS-L** (``remaining_iterations is None``): infinite length.
* **AFS-P counters** count every unit a job is scheduled, also while every job fits
  (the leases then renew in phase, without eviction), so a long job that ran alone for
  days does not outrank a newcomer when contention starts; a job in the middle of a
  unit when contention starts keeps its GPU until the unit ends. Units are counted
  lazily from the lease start at the next decision, so the policy asks for a wake-up
  (``next_decision_at_s``) only while some job waits, and then for the first lease end
  that evicts (:func:`first_evicting_lease_end`): a lease end where the job would start
  again at once changes no share and nothing the next decision reads, so deciding
  there is skipped. A job that loses its share before its unit ends (the cluster
  shrank) loses the partial unit. ``unit_s`` defaults to the paper's 2 h, which
  REPRODUCTION.md keeps for the full-scale Philly traces.
* **Memory** (AFS-P only; msgpack-able): ``counters`` (job id -> units executed),
  ``leases`` (job id -> lease start, virtual seconds) and ``next_decision_at_s``
  (the first lease end that evicts; every lease end with
  ``wake_at_every_lease_end``). Finished jobs are dropped from it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from shoal.policies.base import ClusterView, Decision, JobView, jobs_by_id
from shoal.policies.common import Ladder, throughput_at, view_arrival_order

DEFAULT_UNIT_S = 7200.0
"""AFS-P's processor-sharing unit for full-scale traces (AFS §3.3, footnote 11)."""

_LEASE_EPS = 1e-6
_JOB_ID = operator.attrgetter("job_id")
_ARRIVAL_S = operator.attrgetter("arrival_s")


_LADDERS: dict[tuple[Any, ...], tuple[Ladder, int]] = {}
"""Memo: a job's ladder and smallest count depend only on the fields of the key, and a
long queue holds many jobs of a few shapes (a ladder is never mutated)."""


def _ladder(job: JobView) -> tuple[Ladder, int]:
    """``(Ladder(job), Ladder(job).first())``, shared between jobs of the same shape."""
    key = (job.elastic, job.requested_gpus, job.min_gpus, job.max_gpus, job.allowed_gpu_counts)
    try:
        hit = _LADDERS.get(key)
    except TypeError:  # a hand-built view with a list of allowed counts
        ladder = Ladder(job)
        return ladder, ladder.first()
    if hit is None:
        ladder = Ladder(job)
        hit = (ladder, ladder.first())
        if len(_LADDERS) < 4096:
            _LADDERS[key] = hit
    return hit


class _Entry:
    """One job's working record during a decision."""

    __slots__ = ("count", "first", "job", "ladder", "nxt", "p", "pn", "rank", "remaining")

    def __init__(self, job: JobView, rank: int, *, length_aware: bool) -> None:
        self.job = job
        self.rank = rank
        self.ladder, self.first = _ladder(job)
        self.remaining = job.remaining_iterations if length_aware else None
        # count 0 (not growable in stage two): p' is not needed until a share is set.
        self.count = 0
        self.p = 0.0
        self.nxt = self.first
        self.pn = 0.0

    def set_count(self, count: int) -> None:
        job = self.job
        self.count = count
        self.p = throughput_at(job, count)
        self.nxt = self.ladder.next_count(count)
        self.pn = throughput_at(job, self.nxt) if self.nxt else 0.0

    def growable(self) -> bool:
        """Stage two may give this running job one more step."""
        return self.count > 0 and self.nxt > 0 and self.pn > self.p

    def length(self, count: int | None = None) -> float:
        """Remaining time at ``count`` (default: the current share); AFS-L only."""
        p = self.p if count is None else throughput_at(self.job, count)
        if self.remaining is None or p <= 0.0:
            return math.inf
        return self.remaining / p

    def g(self) -> float:
        """Left side of eq. (3) for this job as ``j_b``: ``(p' - p) / p'``."""
        return (self.pn - self.p) / self.pn

    def h(self) -> float:
        """Right side of eq. (3) for this job as ``j_a``: ``(p' - p) / p``."""
        return (self.pn - self.p) / self.p if self.p > 0.0 else math.inf

    def f(self) -> float:
        """Fractional throughput gain ``p'/p`` of one more step (AFS appendix B)."""
        return self.pn / self.p if self.p > 0.0 else math.inf


def eq3(a: _Entry, b: _Entry) -> bool:
    """AFS eq. (3): does ``b`` (the later-finishing job) get the extra GPU before ``a``?"""
    return b.g() > a.h()


def _entries(view: ClusterView, *, length_aware: bool) -> list[_Entry]:
    return [_Entry(job, rank, length_aware=length_aware) for rank, job in enumerate(view_arrival_order(view))]


def _fill_smallest_shares(order: Sequence[_Entry], free: int) -> int:
    """Give each job in ``order`` its smallest share while it fits (skipping misfits),
    setting only the counts: stage one reads no throughput, and
    :func:`_ready_for_stage_two` fills it in when GPUs are left for stage two.

    Returns the GPUs left.
    """
    for e in order:
        first = e.first
        if not e.count and first and first <= free:
            e.count = first
            free -= first
    return free


def _ready_for_stage_two(entries: Sequence[_Entry]) -> None:
    """Throughput now and at the next step of every job stage one started."""
    for e in entries:
        if e.count:
            e.set_count(e.count)


def _shares(entries: Sequence[_Entry]) -> dict[str, int]:
    return {e.job.job_id: e.count for e in entries if e.count}


# ---------------------------------------------------------------------------
# AFS-L
# ---------------------------------------------------------------------------


def _length_key(e: _Entry) -> tuple[float, int]:
    return (e.length(), e.rank)


def afs_l_stage_two_naive(entries: Sequence[_Entry], free: int) -> int:
    """Algorithm 1 literally: ``free`` times, TOPPRIORITY over the jobs that can grow.

    The scan visits jobs in increasing (length, arrival rank), kept sorted with
    ``bisect`` so each GPU costs O(n): O(M·n) in all. Returns the GPUs left.
    """
    order = sorted((e for e in entries if e.growable()), key=_length_key)
    keys = [_length_key(e) for e in order]
    while free > 0 and order:
        star: _Entry | None = None
        for j in order:
            if j.nxt - j.count > free:
                continue
            if star is None:
                star = j
                continue
            # Lines 9-12: j_a is the job finishing earlier (ties: earlier arrival).
            a, b = (star, j) if _length_key(star) < _length_key(j) else (j, star)
            star = b if eq3(a, b) else a
        if star is None:
            break
        i = bisect.bisect_left(keys, _length_key(star))
        del keys[i], order[i]
        free -= star.nxt - star.count
        star.set_count(star.nxt)
        if star.growable():
            key = _length_key(star)
            i = bisect.bisect_left(keys, key)
            keys.insert(i, key)
            order.insert(i, star)
    return free


def afs_l_stage_two_fast(entries: Sequence[_Entry], free: int, *, vector_from: int = 64) -> int:
    """The same picks as :func:`afs_l_stage_two_naive`, found faster.

    With jobs sorted by (length, rank), the scan's pick is the end of the chain that
    starts at the first candidate and repeatedly jumps to the next candidate ``j`` with
    ``g_j > h`` of the current pick (every later job is the longer one, so (3) with
    ``j_a`` = the pick decides). ``g`` and ``h`` are computed once per step of a job.
    From ``vector_from`` growable jobs on, each jump is one numpy search and a pick
    moves in preallocated arrays (one memmove); below it plain lists are faster.
    Returns the GPUs left.
    """
    order = sorted((e for e in entries if e.growable()), key=_length_key)
    if len(order) < vector_from:
        return _afs_l_chain_lists(order, free)
    return _afs_l_chain_numpy(order, free)


def _afs_l_chain_lists(order: list[_Entry], free: int) -> int:
    keys = [_length_key(e) for e in order]
    g = [e.g() for e in order]
    h = [e.h() for e in order]
    cost = [e.nxt - e.count for e in order]
    while free > 0 and order:
        c = -1
        for j in range(len(order)):
            if cost[j] <= free and (c < 0 or g[j] > h[c]):
                c = j
        if c < 0:
            break
        star = order[c]
        del keys[c], order[c], g[c], h[c], cost[c]
        free -= star.nxt - star.count
        star.set_count(star.nxt)
        if star.growable():
            key = _length_key(star)
            i = bisect.bisect_left(keys, key)
            keys.insert(i, key)
            order.insert(i, star)
            g.insert(i, star.g())
            h.insert(i, star.h())
            cost.insert(i, star.nxt - star.count)
    return free


def _afs_l_chain_numpy(order: list[_Entry], free: int) -> int:
    keys = [_length_key(e) for e in order]
    n = len(order)
    g = np.array([e.g() for e in order], dtype=np.float64)
    h = np.array([e.h() for e in order], dtype=np.float64)
    cost = np.array([e.nxt - e.count for e in order], dtype=np.int64)
    while free > 0 and n:
        cv = cost[:n]
        if int(cv.max()) > free:
            fits = cv <= free
            c = int(fits.argmax())
            if not fits[c]:
                break
            while c + 1 < n:
                hit = (g[c + 1 : n] > h[c]) & fits[c + 1 :]
                k = int(hit.argmax())
                if not hit[k]:
                    break
                c += 1 + k
        else:
            c = 0
            while c + 1 < n:
                hit = g[c + 1 : n] > h[c]
                k = int(hit.argmax())
                if not hit[k]:
                    break
                c += 1 + k
        star = order[c]
        del keys[c], order[c]
        free -= star.nxt - star.count
        star.set_count(star.nxt)
        if star.growable():
            key = _length_key(star)
            i = bisect.bisect_left(keys, key)
            keys.insert(i, key)
            order.insert(i, star)
            for arr, value in ((g, star.g()), (h, star.h()), (cost, star.nxt - star.count)):
                if i <= c:
                    arr[i + 1 : c + 1] = arr[i:c]
                else:
                    arr[c:i] = arr[c + 1 : i + 1]
                arr[i] = value
        else:
            for arr in (g, h, cost):
                arr[c : n - 1] = arr[c + 1 : n]
            n -= 1
    return free


class AFSL:
    """AFS-L: Algorithm 1 with eq. (3), knowing job lengths (AFS §3.3); fast form."""

    name = "afs-l"
    _naive = False

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Stage one by length at the smallest share, then stage two by eq. (3)."""
        entries = _entries(view, length_aware=True)
        # Stage one (AFS §3.3): smallest shares in increasing order of job length
        # (TOPPRIORITY lines 5-7 with both shares zero).
        order = sorted(entries, key=lambda e: (e.length(e.first), e.rank))
        free = _fill_smallest_shares(order, view.total_gpus)
        if free > 0:
            _ready_for_stage_two(entries)
            stage_two = afs_l_stage_two_naive if self._naive else afs_l_stage_two_fast
            stage_two(entries, free)
        return Decision(shares=_shares(entries))


class AFSLNaive(AFSL):
    """AFS-L in the literal O(M·n) form of Algorithm 1 (for comparison and tests)."""

    name = "afs-l-naive"
    _naive = True


# ---------------------------------------------------------------------------
# AFS-P
# ---------------------------------------------------------------------------


def afs_p_top_priority_naive(candidates: Sequence[_Entry]) -> _Entry:
    """The modified TOPPRIORITY of AFS-P (§3.3), literally, in arrival order.

    (3) is evaluated both ways; when neither holds, the larger ``f`` wins, then the
    earlier arrival (the paper: at random).
    """
    star = candidates[0]
    for j in candidates[1:]:
        if eq3(star, j):
            star = j
        elif eq3(j, star):
            continue
        elif (j.f(), -j.rank) > (star.f(), -star.rank):
            star = j
    return star


def afs_p_stage_two_naive(entries: Sequence[_Entry], free: int) -> int:
    """Stage two of AFS-P, O(M·n): one TOPPRIORITY scan per step. Returns GPUs left."""
    while free > 0:
        candidates = [e for e in entries if e.growable() and e.nxt - e.count <= free]
        if not candidates:
            break
        star = afs_p_top_priority_naive(candidates)
        free -= star.nxt - star.count
        star.set_count(star.nxt)
    return free


def afs_p_stage_two_fast(entries: Sequence[_Entry], free: int) -> int:
    """Stage two of AFS-P with a heap keyed on ``(-f, rank)``: O(M log n)."""
    heap = [(-e.f(), e.rank, e) for e in entries if e.growable()]
    heapq.heapify(heap)
    while free > 0 and heap:
        _, _, e = heapq.heappop(heap)
        if e.nxt - e.count > free:
            continue  # free GPUs only decrease: never a candidate again
        free -= e.nxt - e.count
        e.set_count(e.nxt)
        if e.growable():
            heapq.heappush(heap, (-e.f(), e.rank, e))
    return free


class _ByCounter:
    """The waiting jobs' ranks in stage one's order ``(counter, rank)``, lease holders
    left out, taken front to back. A stable sort of the counters in C: the same order
    as a heap of ``(counter, rank)`` pairs, without making a pair per job of a long queue."""

    __slots__ = ("_end", "_order", "_pos")

    def __init__(self, counters: Sequence[int], held: Collection[int]) -> None:
        key = np.array(counters, dtype=np.int64)
        if held:
            key[list(held)] = _HELD  # after every waiting job
        self._order = np.argsort(key, kind="stable")
        self._pos = 0
        self._end = len(key) - len(held)

    def pop(self) -> int | None:
        """The next waiting job's rank, or None when none is left."""
        if self._pos >= self._end:
            return None
        r = int(self._order[self._pos])
        self._pos += 1
        return r


_HELD = np.iinfo(np.int64).max
"""Sort key of a lease holder in :class:`_ByCounter` (counters are far below it)."""


class _WaitingOrder:
    """The waiting jobs of an AFS-P decision in stage one's order ``(counter, rank)``,
    taken lazily: the jobs the pass looked at and did not start (``passed``, already in
    that order), then the rest of ``waiting``."""

    __slots__ = ("_counters", "_jobs", "_keys", "_min_first", "_passed", "_waiting")

    def __init__(
        self,
        jobs: Sequence[JobView],
        counters: Sequence[int],
        passed: Sequence[int],
        waiting: _ByCounter,
    ) -> None:
        self._jobs = jobs
        self._counters = counters
        self._passed = iter(passed)
        self._waiting = waiting
        self._keys: list[tuple[float, int]] = []
        self._min_first: list[float] = []
        """Prefix minimum of the smallest shares over ``_keys`` (``inf`` for a job that
        can never start)."""

    def _take(self) -> bool:
        r = next(self._passed, None)
        if r is None:
            r = self._waiting.pop()
            if r is None:
                return False
        first = _ladder(self._jobs[r])[1] or math.inf
        prev = self._min_first[-1] if self._min_first else math.inf
        self._keys.append((self._counters[r], r))
        self._min_first.append(min(prev, first))
        return True

    def any_starts_before(self, key: tuple[int, int], free: int) -> bool:
        """Is there a waiting job ahead of ``key`` whose smallest share fits in ``free``?"""
        keys = self._keys
        while (not keys or keys[-1] < key) and self._take():
            if keys[-1] < key and self._min_first[-1] <= free:
                return True
        i = bisect.bisect_left(keys, key)
        return i > 0 and self._min_first[i - 1] <= free


def first_evicting_lease_end(
    running: Sequence[_Entry],
    counters: Sequence[int],
    leases: Mapping[str, float],
    waiting: _WaitingOrder,
    total: int,
    unit: float,
) -> float:
    """The first lease end at which AFS-P would change shares, if nothing else happens.

    At the end of job ``j``'s lease (and no other), the decision there sees the same
    jobs, GPUs and curves: the other lease holders keep their smallest shares, ``j``
    waits with its counter one higher, and stage one offers the waiting jobs, in
    ``(counter, rank)`` order, ``F = L + first(j)`` GPUs (``L``: what stage one leaves
    now). If no waiting job ahead of ``j`` has a smallest share that fits in ``F``,
    ``j`` starts again at once (a new lease, in phase), the GPUs left are ``L`` again,
    which no waiting job fits (stage one just found so), and stage two repeats itself:
    the shares do not change, and neither does what the policy would remember at the
    next decision (units are counted from the lease start). So that lease end is
    skipped and the next one checked, with ``j``'s counter one higher. Two leases
    ending at one instant, or more steps than a few rounds of units, stop the search
    early: waking at a lease end is always correct, only slower.
    """
    free = total - sum(e.first for e in running)
    ends = [(leases[e.job.job_id] + unit, e.rank, e.first, counters[e.rank]) for e in running]
    heapq.heapify(ends)
    for _ in range(4 * len(ends) + 16):
        end, rank, first, counter = heapq.heappop(ends)
        if ends and ends[0][0] - end <= _LEASE_EPS:
            return end
        if waiting.any_starts_before((counter + 1, rank), free + first):
            return end
        heapq.heappush(ends, (end + unit, rank, first, counter + 1))
    return ends[0][0]


def _counters_out(
    old: Mapping[str, Any],
    bumped: Mapping[str, int],
    active: Mapping[str, Any],
    ids: Iterable[str],
    counters: Sequence[int],
) -> dict[str, Any]:
    """AFS-P's counters to remember: the positive ones of the active jobs.

    The same mapping as ``{j: c for j, c in zip(ids, counters) if c}`` (``ids``: the
    active jobs in rank order, ``active``: keyed by them); while no counted job finished
    (the usual case in a long queue) it is the previous one, or a copy with the lease
    holders' new counts, instead of a pass over every job.
    """
    if isinstance(old, dict) and active.keys() >= old.keys() and 0 not in old.values():
        changed = {j: c for j, c in bumped.items() if c != old.get(j, 0)}
        if not changed:
            return old
        out = dict(old)
        for j, c in changed.items():
            if c:
                out[j] = c
            else:
                out.pop(j, None)
        return out
    return {j: c for j, c in zip(ids, counters, strict=True) if c}


class AFSP:
    """AFS-P: length-unaware AFS with processor sharing in time units (AFS §3.3); fast form.

    Args:
        unit_s: processor-sharing unit (lease length) in seconds; the paper uses 2 h on
            the full-scale traces and says to scale it with the workload (fn. 11).
        wake_at_every_lease_end: ask to decide again at the earliest lease end even
            when it would change nothing (same shares, more decisions); for callers
            that change AFS-P's picks afterwards (:mod:`shoal.policies.afs_hetero`).
    """

    name = "afs-p"
    _naive = False

    def __init__(self, unit_s: float = DEFAULT_UNIT_S, *, wake_at_every_lease_end: bool = False) -> None:
        if not unit_s > 0 or math.isinf(unit_s):
            raise ValueError(f"unit_s must be a positive number of seconds, got {unit_s!r}")
        self.unit_s = float(unit_s)
        self.wake_at_every_lease_end = wake_at_every_lease_end

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Processor sharing by counters when jobs exceed GPUs, then eq. (3) by ``f``.

        A long queue mostly waits: per waiting job this does only a few C-level steps
        (its counter, a heap entry); the per-job working record (:class:`_Entry`) is
        made only for the jobs the passes actually look at.
        """
        now = view.now_s
        unit = self.unit_s
        jobs = view_arrival_order(view)
        index = jobs_by_id(view)

        ranks: dict[str, int] = {}

        def rank_of(job_id: str) -> int:
            # Position in ``jobs`` (in arrival order, ties by id): only the lease holders ask,
            # cheaper than a rank for every job of a long queue. Bisect on the arrival
            # time, then step over the jobs of the same instant with smaller ids.
            r = ranks.get(job_id)
            if r is None:
                r = bisect.bisect_left(jobs, index[job_id].arrival_s, key=_ARRIVAL_S)
                while jobs[r].job_id != job_id:
                    r += 1
                ranks[job_id] = r
            return r

        old_counters: Mapping[str, Any] = memory.get("counters") or {}
        old_leases: Mapping[str, Any] = memory.get("leases") or {}
        leases: dict[str, float] = {}
        bumped: dict[str, int] = {}
        for job_id, start in old_leases.items():
            if job_id not in index:
                continue  # finished
            start = float(start)
            # Every whole unit executed since the lease started adds one (§3.3); the
            # lease goes on in phase, so a unit in progress is not lost.
            units = max(0, int((now - start) / unit + _LEASE_EPS))  # clock skew: no negative
            bumped[job_id] = int(old_counters.get(job_id, 0)) + units
            start += units * unit
            if units == 0 or now - start > _LEASE_EPS:
                leases[job_id] = start  # mid-unit: held (non-preemptive)
            # else: the unit ended just now, the job is evicted.
        # Counters in memory are ints (this policy writes them).
        counters: list[int] = list(map(old_counters.get, map(_JOB_ID, jobs), itertools.repeat(0)))
        for job_id, counter in bumped.items():
            counters[rank_of(job_id)] = counter

        made: dict[int, _Entry] = {}

        def entry(rank: int) -> _Entry:
            e = made.get(rank)
            if e is None:
                e = made[rank] = _Entry(jobs[rank], rank, length_aware=False)
            return e

        total = view.total_gpus
        need = 0
        contended = False
        dropped = False
        passed: list[int] = []  # waiting jobs the pass looked at and did not start, in order
        waiting: _ByCounter | None = None
        for job in jobs:
            need += _ladder(job)[1]
            if need > total:
                contended = True
                break
        if not contended:
            # Every job fits at its smallest share: counters are ignored (§3.3).
            free = _fill_smallest_shares([entry(r) for r in range(len(jobs))], total)
        else:
            # Stage one, processor sharing: jobs holding a lease keep running
            # (non-preemptive); the rest by increasing counter (ties: arrival).
            held_ranks = sorted((counters[r], r) for r in map(rank_of, leases))
            free = _fill_smallest_shares([entry(r) for _, r in held_ranks], total)
            # A lease holder that no longer fits (the cluster shrank) waits now: the
            # exact wake-up below does not model that, so it falls back to every lease end.
            dropped = any(not made[r].count for _, r in held_ranks)
            # The same pass over the waiting jobs in (counter, rank) order, taken only
            # until the GPUs run out (a long queue mostly gets nothing).
            waiting = _ByCounter(counters, {r for _, r in held_ranks})
            while free > 0:
                r = waiting.pop()
                if r is None:
                    break
                e = entry(r)
                if not e.count and e.first and e.first <= free:
                    e.count = e.first
                    free -= e.first
                else:
                    passed.append(r)
        entries = [made[r] for r in sorted(made)]
        if free > 0:
            _ready_for_stage_two(entries)
            stage_two = afs_p_stage_two_naive if self._naive else afs_p_stage_two_fast
            stage_two(entries, free)

        new_leases: dict[str, float] = {}
        for e in entries:
            if e.count:
                job_id = e.job.job_id
                new_leases[job_id] = leases.get(job_id, float(now))
        memory_out: dict[str, Any] = {
            "counters": _counters_out(old_counters, bumped, index, map(_JOB_ID, jobs), counters),
            "leases": new_leases,
        }
        if contended and new_leases:
            # Only an eviction changes shares. While every job fits, units are counted at
            # the next decision instead.
            earliest = min(new_leases.values()) + unit
            if self.wake_at_every_lease_end or dropped:
                memory_out["next_decision_at_s"] = earliest
            else:
                memory_out["next_decision_at_s"] = first_evicting_lease_end(
                    [e for e in entries if e.count],
                    counters,
                    new_leases,
                    _WaitingOrder(jobs, counters, passed, waiting),  # type: ignore[arg-type]  # set when contended
                    total,
                    unit,
                )
        return Decision(shares=_shares(entries), memory=memory_out)


class AFSPNaive(AFSP):
    """AFS-P with the literal O(M·n) modified TOPPRIORITY (for comparison and tests)."""

    name = "afs-p-naive"
    _naive = True

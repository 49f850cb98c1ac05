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
* **Cost of a decision in a long queue** (AFS-P). Stage one takes the waiting jobs in
  ``(counter, arrival)`` order only as far as the GPUs go: the jobs that never ran
  (counter 0, most of a long queue) in arrival order, found by one C-level filter over
  the queue's ids, then the counted jobs in the order of their keys. An AFS-P instance
  remembers those keys for the counters mapping it returned; the next decision, given
  that very mapping back (the simulator passes it on), only moves the lease holders'
  keys. Memory decoded from the log is another object, so the keys are then sorted
  afresh: the memo never changes a decision (a property test compares both).
  Ranks are ``(arrival_s, job_id)``, the arrival order itself, not positions in it.
  The lease holders (every running job) are likewise carried over from the decision
  that returned the memory (:class:`_Holders`): only those whose lease ended, found as
  the smallest lease starts, and those whose view changed are looked at again.
* **Cost of a decision in a long queue** (AFS-L). Stage one needs every job's length at
  its smallest share, in order. A waiting job's does not change while its view does not,
  so from :attr:`AFSL.keep_keys_from` active jobs on an AFS-L instance keeps the waiting
  jobs' keys sorted between decisions (:class:`_WaitingByLength`), keys only the jobs
  whose view changed and the running ones, and walks the merge of both only until the
  GPUs run out. Views built afresh at each decision (the allocator service's) change
  every job, and the keys are then sorted afresh: the walk, and the decision, are the
  same as keying every job (a property test compares both, and the literal form).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView, jobs_by_id
from shoal.policies.common import Ladder, throughput_at, view_arrival_order

DEFAULT_UNIT_S = 7200.0
"""AFS-P's processor-sharing unit for full-scale traces (AFS §3.3, footnote 11)."""

_LEASE_EPS = 1e-6
_JOB_ID = operator.attrgetter("job_id")


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

    def __init__(self, job: JobView, rank: Any, *, length_aware: bool) -> None:
        self.job = job
        self.rank = rank
        """Any key in arrival order: the position there (AFS-L) or ``(arrival_s,
        job_id)`` (AFS-P, see :data:`_Rank`); it breaks ties."""
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

    def step(self) -> None:
        """``set_count(self.nxt)`` of a growable job: the throughput there is ``pn``,
        already computed (the same value, without computing it again)."""
        count = self.count = self.nxt
        self.p = self.pn
        nxt = self.nxt = self.ladder.next_count(count)
        self.pn = throughput_at(self.job, nxt) if nxt else 0.0

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


def _length_key(e: _Entry) -> tuple[float, Any]:
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
        if max(cost) <= free:
            # Every candidate fits (the usual case): the same scan without the fit test.
            c = 0
            hc = h[0]
            for j, gj in enumerate(g[1:], 1):
                if gj > hc:
                    c = j
                    hc = h[j]
        else:
            c = -1
            for j in range(len(order)):
                if cost[j] <= free and (c < 0 or g[j] > h[c]):
                    c = j
            if c < 0:
                break
        star = order[c]
        del keys[c], order[c], g[c], h[c], cost[c]
        free -= star.nxt - star.count
        star.step()
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
    import numpy as np  # only for long queues: spares short runs numpy's import

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
        star.step()
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


_LengthKey = tuple[Any, ...]
"""Stage one's key of an AFS-L job: ``(length at its smallest share, arrival_s, job_id,
smallest share)``, a float, a float, a str and an int. The last three order ties as
:func:`~shoal.policies.common.arrival_order` does, so sorting by it is sorting by
(length, position in arrival order). A kept key is recognised by identity
(:class:`_WaitingByLength`), so the type says no more than "a tuple": compiled by mypyc
(``shoal native build``), a tuple of four declared item types is unboxed and boxed
again as a new object, and every kept key would look stale."""


def _length_key_at_first(job: JobView) -> _LengthKey:
    """The job's :data:`_LengthKey`: :meth:`_Entry.length` at its smallest share, with
    the same arithmetic."""
    # _ladder(job)[1] (Ladder.first), inline for the two common shapes: this runs for
    # every running job at every decision.
    if not job.elastic:
        first = job.requested_gpus
        if first < 0:
            first = 0
    elif job.allowed_gpu_counts:
        first = _ladder(job)[1]
    else:
        first = job.min_gpus
        if first < 1:
            first = 1
        if first > job.max_gpus:
            first = 0
    remaining = job.remaining_iterations
    if remaining is None or first <= 0:
        return (math.inf, job.arrival_s, job.job_id, first)
    curve = job.throughput  # throughput_at(job, first), inline
    p = float(curve[first]) if first < len(curve) else float(curve[-1]) if len(curve) > 1 else 0.0
    return (math.inf if p <= 0.0 else remaining / p, job.arrival_s, job.job_id, first)


class _WaitingByLength:
    """The waiting jobs' stage-one keys (:data:`_LengthKey`), sorted, kept by an
    :class:`AFSL` from one decision to the next.

    A waiting job's key depends only on its view (remaining work, curve, shape), and the
    simulator keeps a waiting job's view object until something about it changes. So a
    decision finds the jobs whose view is not the one their key was made from with
    one pass over the queue, keys only those, and inserts them (``bisect``); the
    running jobs, whose remaining work changes all the time, are keyed afresh at every
    decision and never stored. A key is valid while it is the one recorded for its job,
    and the job is in the view with that very view object. A job's key goes when its
    view changes and when the policy starts it (:meth:`forget`); the key of a job that
    left while waiting stays until the list is rebuilt (when stale keys would make it
    more than twice the queue). Views built afresh at every decision (the allocator
    service's) change every job, and the list is then rebuilt and sorted; the walk, and
    so the decision, is the same either way (a NaN length, which has no order, takes
    :meth:`AFSL._decide_literal` instead).
    """

    __slots__ = ("key_of", "keys", "recheck", "synced", "views")

    def __init__(self) -> None:
        self.keys: list[_LengthKey] = []
        self.views: dict[str, JobView] = {}
        """job id -> the view its recorded key was made from."""
        self.key_of: dict[str, _LengthKey] = {}
        """job id -> its recorded key (the valid one of its keys in :attr:`keys`)."""
        self.synced = 0
        """The serial (:attr:`shoal.policies.base.LiveJobs.serial`) of the jobs of the
        decision these records were last brought up to date with; 0 when they were not
        simulator's jobs."""
        self.recheck: list[str] = []
        """The jobs of that decision that may hold no valid key with an unchanged view:
        those that ran (never keyed) and those it started (key forgotten)."""

    def changed(
        self, jobs: Sequence[JobView], index: Mapping[str, JobView]
    ) -> tuple[list[_LengthKey], list[str], list[JobView]]:
        """The jobs whose view is not the one their key was made from (``index``: job id
        -> job of ``jobs``), as ``(keys, ids, waiting)``: the running ones' keys
        (:func:`_length_key_at_first`, unsorted) and ids, in the same order, and the
        waiting ones.

        Every running job is among them: a key is made only of a waiting job's view
        (``current_gpus == 0``), and a view is frozen, so a job that runs has another.

        When the simulator says which views it rebuilt since the decision these records
        were last brought up to date with (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`),
        only those and :attr:`recheck` are looked at, in one pass that also splits and
        keys them: any other job has the view it had then, when it held a valid key with
        that view unless it was in :attr:`recheck`. The jobs are the same either way;
        only their order differs, which :meth:`AFSL.decide` does not read (keys are
        sorted, and unique by job id). Otherwise a tight pass over the queue. (A
        comprehension, not ``itertools.compress`` over ``attrgetter`` maps: on CPython
        3.11 the comprehension's specialised attribute reads of a ``msgspec.Struct`` took
        about half the time over a 15,000-job queue.)"""
        get = self.views.get
        since = getattr(jobs, "rebuilt_since", None)
        rebuilt = since(self.synced) if since is not None and self.synced else None
        self.synced = getattr(jobs, "serial", 0)
        if rebuilt is None:
            changed = [job for job in jobs if get(job.job_id) is not job]
            running = [job for job in changed if job.current_gpus]
            return (
                list(map(_length_key_at_first, running)),
                [job.job_id for job in running],
                [job for job in changed if not job.current_gpus],
            )
        look = set(rebuilt)
        look.update(self.recheck)
        keys: list[_LengthKey] = []
        ids: list[str] = []
        waiting: list[JobView] = []
        inf = math.inf
        for job_id in look:
            job = index.get(job_id)
            if job is None:
                continue
            if not job.current_gpus:
                if get(job_id) is not job:
                    waiting.append(job)
                continue
            # _length_key_at_first(job), inline: this runs for every running job at
            # every decision (the property tests compare it with the heap's keys).
            ids.append(job_id)
            if not job.elastic:
                first = job.requested_gpus
                if first < 0:
                    first = 0
            elif job.allowed_gpu_counts:
                first = _ladder(job)[1]
            else:
                first = job.min_gpus
                if first < 1:
                    first = 1
                if first > job.max_gpus:
                    first = 0
            remaining = job.remaining_iterations
            if remaining is None or first <= 0:
                keys.append((inf, job.arrival_s, job_id, first))
                continue
            curve = job.throughput
            p = float(curve[first]) if first < len(curve) else float(curve[-1]) if len(curve) > 1 else 0.0
            keys.append((inf if p <= 0.0 else remaining / p, job.arrival_s, job_id, first))
        return keys, ids, waiting

    def update(self, running: Sequence[str], changed: Sequence[JobView], jobs: Sequence[JobView]) -> bool:
        """Key the waiting jobs ``changed`` and drop the keys of those and of the
        ``running`` ones (ids; :meth:`changed` gives both); False if a key is NaN (then
        the order is not total and the caller decides without this list)."""
        views, key_of = self.views, self.key_of
        gone: list[_LengthKey] = []
        fresh: list[_LengthKey] = []
        # A running job's key, if it has one, goes (a job started by the policy has
        # none left: forget() dropped it).
        for job_id in key_of.keys() & running:
            del views[job_id]
            gone.append(key_of.pop(job_id))
        for job in changed:
            job_id = job.job_id
            old = key_of.pop(job_id, None)
            if old is not None:
                del views[job_id]
                gone.append(old)
            key = _length_key_at_first(job)
            if key[0] != key[0]:  # NaN
                return False
            views[job_id] = job
            key_of[job_id] = key
            fresh.append(key)
        keys = self.keys
        waiting = len(jobs) - len(running)
        if (
            8 * (len(fresh) + len(gone)) <= waiting + 64
            and len(keys) - len(gone) + len(fresh) <= 2 * waiting + 64
        ):
            for old in gone:
                i = bisect.bisect_left(keys, old)
                if i == len(keys) or keys[i] is not old:
                    break  # not where it should be: rebuild below
                del keys[i]
            else:
                for key in fresh:
                    bisect.insort(keys, key)
                return True
        self._rebuild(jobs)
        return True

    def forget(self, gone: Iterable[_LengthKey]) -> None:
        """Drop these recorded keys (in increasing order) and their jobs' records."""
        keys, views, key_of = self.keys, self.views, self.key_of
        lo = 0
        for old in gone:
            i = bisect.bisect_left(keys, old, lo)
            if i < len(keys) and keys[i] is old:
                del keys[i]
            lo = i
            del views[old[2]], key_of[old[2]]

    def _rebuild(self, jobs: Sequence[JobView]) -> None:
        # Mostly new (the first decision, views built afresh) or many keys of jobs that
        # left while waiting: rebuild.
        views, key_of = self.views, self.key_of
        live = {job.job_id for job in jobs if not job.current_gpus}
        for job_id in views.keys() - live:
            del views[job_id], key_of[job_id]
        self.keys = sorted(key_of.values())


class AFSL:
    """AFS-L: Algorithm 1 with eq. (3), knowing job lengths (AFS §3.3); fast form."""

    name = "afs-l"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    _naive = False
    keep_keys_from = 64
    """From this many active jobs on, a decision keeps the waiting jobs' keys for the next
    (:class:`_WaitingByLength`); below it, every job is keyed at every decision (a heap).
    Both take the same jobs in the same order. (On 6214e9, 64 rather than 256 took the
    7,400 decisions with 64 to 255 active jobs off the heap, about 1.2 s of 1.3 s.)"""

    fresh_views_retry = 64
    """While views come built afresh at every decision (the allocator service's), keeping
    keys only adds work (every job is keyed and sorted anyway): after two such decisions
    in a row, decisions take the heap and keep nothing, and every this many decisions
    keeping is tried again."""

    def __init__(self) -> None:
        self._waiting: _WaitingByLength | None = None
        self._afresh = 0
        """Consecutive decisions in which most waiting jobs' views were not the ones their
        keys were made of."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Stage one by length at the smallest share, then stage two by eq. (3).

        Only the jobs stage one starts get a working record (:class:`_Entry`): stage
        two, and the shares, read no other (a job without a share cannot grow). The
        jobs are taken in (length, arrival) order, only until the GPUs run out, as
        :func:`_fill_smallest_shares` over the sorted records would: the running jobs
        keyed afresh, merged with the waiting jobs' keys kept from the decision before
        (:class:`_WaitingByLength`).
        """
        if self._naive:
            return self._decide_literal(view)
        jobs = view.jobs
        if len(jobs) < self.keep_keys_from:
            self._waiting = None
            return self._decide_heap(view)
        waiting = self._waiting
        if waiting is None:
            waiting = self._waiting = _WaitingByLength()
        index = jobs_by_id(view)
        # Every running job is keyed afresh (_WaitingByLength.changed), in no particular
        # order: the merge below sorts them, unless it takes them all at once.
        run_keys, run_ids, changed = waiting.changed(jobs, index)
        # Views built afresh change most waiting jobs; the simulator's change the running
        # ones (keyed afresh either way) and a few waiting ones.
        self._afresh = self._afresh + 1 if 2 * len(changed) > len(jobs) - len(run_ids) else 0
        if self._afresh >= 2 and self._afresh % self.fresh_views_retry:
            self._waiting = None
            return self._decide_heap(view)
        # A NaN length makes the sum NaN. (So can lengths of inf and -inf together, in a
        # hand-built view with negative work: that false alarm only costs the literal
        # form's time.)
        lengths = sum(map(_FIRST, run_keys))
        if not waiting.update(run_ids, changed, jobs) or lengths != lengths:
            self._waiting = None  # a NaN length: the plain sort, without the kept keys
            return self._decide_literal(view)
        views, key_of, keys = waiting.views, waiting.key_of, waiting.keys
        free = view.total_gpus
        started: list[_LengthKey] = []
        # The merge of the two sorted lists, walked only until the GPUs run out. A
        # running job's key goes before every kept key it does not sort after; the
        # running jobs' keys up to the next kept key are taken together (in a long
        # queue the running jobs are mostly the shortest jobs, so usually all of them
        # at once), each when its smallest share fits, as one at a time would. A kept
        # key is taken only while it is its job's recorded key and the job is in the
        # view with the same view (else it is stale: the job changed, runs now, or
        # finished).
        j = 0
        n = len(keys)
        r = 0
        m = len(run_keys)
        starting: list[_LengthKey] = []  # kept keys of jobs started now
        if m and (not n or max(run_keys) <= keys[0]):
            # Every running job's key first, and all of them fit: their order does not
            # matter (the usual case in a long queue), so they are not sorted.
            firsts = list(map(_FOURTH, run_keys))
            need = sum(firsts)
            if need <= free and min(firsts) > 0:
                started += run_keys
                free -= need
                r = m
        if r < m:
            run_keys.sort()
        while free > 0:
            bound: _LengthKey | None = None
            if r < m:
                hi = bisect.bisect_right(run_keys, keys[j], r) if j < n else m
                if hi > r:
                    chunk = run_keys[r:hi]
                    r = hi
                    firsts = list(map(_FOURTH, chunk))
                    need = sum(firsts)
                    if need <= free and min(firsts) > 0:
                        started += chunk
                        free -= need
                    else:
                        for k in chunk:
                            first = k[3]
                            if first and first <= free:
                                started.append(k)
                                free -= first
                    continue
                bound = run_keys[r]  # keys[j] sorts before it
            elif j == n:
                break
            while j < n and free > 0:
                k = keys[j]
                if bound is not None and not k < bound:
                    break
                j += 1
                job_id = k[2]
                if (
                    key_of.get(job_id) is k
                    and (job := index.get(job_id)) is not None
                    and views[job_id] is job
                ):
                    first = k[3]
                    if first and first <= free:
                        started.append(k)
                        starting.append(k)
                        free -= first
        # A job started now runs (or has finished) by the next decision: its key goes
        # now, so that a short job that finishes before then leaves no stale key at the
        # front. (Should it still wait with the same view, it is keyed again.)
        waiting.forget(starting)
        run_ids += [k[2] for k in starting]
        waiting.recheck = run_ids
        # ``started`` is in stage one's order, not arrival order: the order of a
        # decision's shares is not part of it (decide_shares publishes them sorted by job
        # id), and stage two orders its jobs by (length, rank) itself.
        if free <= 0:  # no stage two: the smallest shares
            return Decision(shares={k[2]: k[3] for k in started})
        entries = []
        for k in started:
            e = _Entry(index[k[2]], (k[1], k[2]), length_aware=True)
            e.count = k[3]
            entries.append(e)
        _ready_for_stage_two(entries)
        afs_l_stage_two_fast(entries, free)
        return Decision(shares=_shares(entries))

    def _decide_heap(self, view: ClusterView) -> Decision:
        """:meth:`decide` with every job keyed afresh, taken from a heap (a NaN length,
        which has no order, takes :meth:`_decide_literal`)."""
        jobs = view_arrival_order(view)
        keyed: list[tuple[float, int, int]] = []
        for rank, job in enumerate(jobs):
            # _Entry.length at the smallest share, with the same arithmetic.
            length, _, _, first = _length_key_at_first(job)
            keyed.append((length, rank, first))
        lengths = sum(map(_FIRST, keyed))
        if lengths != lengths:
            return self._decide_literal(view)
        heapq.heapify(keyed)
        free = view.total_gpus
        started: list[tuple[int, int]] = []
        while free > 0 and keyed:
            _, rank, first = heapq.heappop(keyed)
            if first and first <= free:
                started.append((rank, first))
                free -= first
        started.sort()
        entries = []
        for rank, first in started:
            e = _Entry(jobs[rank], rank, length_aware=True)
            e.count = first
            entries.append(e)
        if free > 0:
            _ready_for_stage_two(entries)
            afs_l_stage_two_fast(entries, free)
        return Decision(shares=_shares(entries))

    def _decide_literal(self, view: ClusterView) -> Decision:
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
        else:
            fj, fs = j.f(), star.f()
            if fj > fs or (fj == fs and j.rank < star.rank):
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
        e.step()
        if e.growable():
            heapq.heappush(heap, (-e.f(), e.rank, e))
    return free


_Rank = tuple[float, str]
"""AFS-P's arrival rank of a job: ``(arrival_s, job_id)``, the order of
:func:`~shoal.policies.common.arrival_order` (so the same order as the job's position
in it, without finding that position in a long queue)."""

_Waiting = tuple[int, _Rank, JobView]
"""A waiting job in stage one's order: ``(counter, rank, job)``."""

_Held = tuple[_Rank, JobView, int, int]
"""A job stage one of an AFS-P decision started: ``(rank, job, smallest share, counter)``."""


def _rank(job: JobView) -> _Rank:
    # The loops over the whole queue (_counted_keys, _ByCounter, the lease holders of
    # AFSP.decide) build this tuple inline: a call per job there is measurable.
    return (job.arrival_s, job.job_id)


class _Counted:
    """The jobs with a positive counter, as ``(counter, rank)`` keys in increasing
    order, for one counters mapping (:attr:`of`, compared by identity).

    An :class:`AFSP` keeps the one of its last decision's output: the next decision
    usually gets that very mapping back as memory and then only moves the lease
    holders' keys (a few bisections) instead of sorting every counted job again. A
    mapping from elsewhere (memory decoded from the log) is simply not the same object,
    and the keys are built afresh: the result never depends on the memo. (A key holds
    the job's arrival time, which is its submission time and never changes.)
    """

    __slots__ = ("keys", "of", "rank_of")

    def __init__(
        self,
        of: Mapping[str, Any],
        keys: list[tuple[int, _Rank]],
        rank_of: dict[str, _Rank] | None = None,
    ) -> None:
        self.of = of
        self.keys = keys
        self.rank_of = rank_of
        # job id -> the rank in its key, for every key (None: not made yet). Made when a
        # counted job first finishes (_drop_finished) and kept up by _move_keys, so a
        # finished job's key is found by bisection: its job, and so its rank, is gone.


def _counted_keys(
    counters: Iterable[tuple[str, Any]], index: Mapping[str, JobView]
) -> list[tuple[int, _Rank]]:
    """Sorted ``(counter, rank)`` keys of the active jobs with a positive counter."""
    keys = []
    for job_id, counter in counters:
        if counter >= 1:
            job = index.get(job_id)
            if job is not None:
                keys.append((counter, (job.arrival_s, job_id)))
    keys.sort()
    return keys


def _move_keys(
    keys: list[tuple[int, _Rank]],
    old: Mapping[str, Any],
    bumped: Mapping[str, int],
    index: Mapping[str, JobView],
    rank_of: dict[str, _Rank] | None = None,
) -> bool:
    """Update ``keys`` (sorted, of ``old``'s positive counters) in place to the new
    counters of the lease holders in ``bumped``, and ``rank_of`` (when given: job id ->
    rank of each key) with the newly counted ones. False if a key was not where it
    should be (then neither is to be trusted)."""
    for job_id, counter in bumped.items():
        before = old.get(job_id, 0)
        if counter == before:
            continue
        rank = _rank(index[job_id])
        if before >= 1:
            key = (before, rank)
            i = bisect.bisect_left(keys, key)
            if i == len(keys) or keys[i] != key:
                return False
            del keys[i]
        if counter >= 1:
            bisect.insort(keys, (counter, rank))
            if rank_of is not None:
                rank_of[job_id] = rank
    return True


def _drop_finished(
    keys: list[tuple[int, _Rank]],
    rank_of: dict[str, _Rank] | None,
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    left: Collection[str] | None,
) -> tuple[list[tuple[int, _Rank]], dict[str, _Rank] | None]:
    """From ``keys`` (sorted: the keys of ``new``'s counters, and of the counted jobs that
    finished since ``old``, each of those at its counter in ``old``), the keys of
    ``new``'s counters alone, with the rank in each key by job (``rank_of``, made here
    if ``None``).

    ``left``, when given, names every job that left since ``old`` was made: the finished
    jobs' keys are then taken out by bisection (``keys`` is changed in place), not by a
    pass over every counted job. Otherwise, or if a key is not where it should be, the
    keys are filtered (a new list, and ranks ``None``).
    """
    if left is not None:
        if rank_of is None:
            rank_of = {rank[1]: rank for _, rank in keys}
        for job_id in left:
            if job_id in rank_of and job_id not in new:
                # Finished: not active, so not bumped; its key is at its counter in old.
                key = (old.get(job_id, 0), rank_of.pop(job_id))
                i = bisect.bisect_left(keys, key)
                if i == len(keys) or keys[i] != key:
                    break
                del keys[i]
        else:
            if len(keys) == len(new):
                return keys, rank_of
    return [k for k in keys if k[1][1] in new], None


class _Uncounted:
    """The ranks of the jobs without a positive counter, sorted (that is, in arrival
    order), kept by an :class:`AFSP` from one decision to the next, so that stage one
    finds the counter-0 jobs without walking past every counted job ahead of them.

    It may list more (jobs counted or finished since, and lease holders; they are
    dropped when a walk reaches them, :meth:`_ByCounter.pop`) but never fewer: at the end
    of a decision it holds every job of that decision without a positive counter in the
    counters it returned (:attr:`counters`) and without a lease in the leases it returned.
    A lease holder waits again only once its unit ended, with a positive counter, or when
    a decision drops it (the cluster shrank), and such a decision keeps no list; a job
    that left and came back is rebuilt, so :meth:`refresh` adds it again. Counters never
    fall, so the next decision, when it gets that very mapping back and the simulator
    names the jobs it rebuilt since (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`,
    where a job that arrived counts as rebuilt), adds only the new jobs among those
    (:meth:`refresh`). Otherwise it is dropped, and a contended decision over the
    simulator's jobs builds it again by a pass over the queue.
    """

    __slots__ = ("counters", "ids", "ranks", "serial")

    def __init__(self, jobs: Iterable[JobView], positive: Collection[str]) -> None:
        """``jobs`` in arrival order; ``positive``: the ids with a positive counter."""
        self.ranks: list[_Rank] = [(job.arrival_s, job.job_id) for job in jobs if job.job_id not in positive]
        self.ids: set[str] = {r[1] for r in self.ranks}
        self.counters: Mapping[str, Any] | None = None
        """The counters mapping it was kept with (compared by identity)."""
        self.serial = 0
        """The serial of that decision's jobs (:attr:`shoal.policies.base.LiveJobs.serial`)."""

    def refresh(
        self, jobs: Sequence[JobView], index: Mapping[str, JobView], counters: Mapping[str, Any]
    ) -> bool:
        """Bring it up to the decision of ``jobs`` whose counters in memory are
        ``counters`` (each at least 1); False when it cannot be (then it is dropped)."""
        if counters is not self.counters or len(self.ranks) > 2 * len(index) + 64:
            return False
        since = getattr(jobs, "rebuilt_since", None)
        rebuilt = since(self.serial) if since is not None and self.serial else None
        if rebuilt is None:
            return False
        ids, ranks = self.ids, self.ranks
        for job_id in rebuilt:
            if job_id not in ids and job_id not in counters:
                job = index.get(job_id)
                if job is not None:
                    ids.add(job_id)
                    bisect.insort(ranks, (job.arrival_s, job_id))
        return True


class _ByCounter:
    """The waiting jobs in stage one's order ``(counter, rank)``, lease holders left
    out, taken front to back and only as far as asked.

    A long queue is mostly jobs that never ran: counter 0, in arrival order, ahead of
    every job with a positive counter. So the counter-0 ones come first, in arrival
    order: from the kept list of them (:class:`_Uncounted`, given as ``uncounted``), or
    else by walking the jobs in arrival order past the counted ones. When those run
    out, the counted jobs follow in the order of their keys (:class:`_Counted`, sorted
    only if no decision before left them). Nothing is done per job of the queue beyond
    the ones taken and the counted jobs walked past (the earlier form built and sorted
    an array of every job's counter at each decision). A counter below 1 (only a
    hand-made memory holds one) counts as 0.
    """

    __slots__ = (
        "_bumped",
        "_clean",
        "_held",
        "_index",
        "_j",
        "_jobs",
        "_kept",
        "_old",
        "_u",
        "_uncounted",
        "keys",
    )

    def __init__(
        self,
        jobs: Sequence[JobView],
        index: Mapping[str, JobView],
        old: Mapping[str, Any],
        bumped: Mapping[str, int],
        held: Collection[str],
        keys: list[tuple[int, _Rank]] | None,
        clean: bool,
        uncounted: _Uncounted | None = None,
    ) -> None:
        self._clean = clean
        """Every counter in ``old`` is at least 1."""
        self._jobs = jobs
        self._index = index
        self._old = old
        self._bumped = bumped
        self._held = held
        self._uncounted: Iterator[str] | None = None
        self._kept = uncounted
        """The kept ranks of the jobs without a positive counter in ``old`` (and perhaps
        more), brought up to this decision; ``None``: walk ``jobs``."""
        self._u = 0
        self._j = 0
        self.keys = keys
        """The counted jobs' keys at the new counters (built when first needed)."""

    def pop(self) -> _Waiting | None:
        """The next waiting job, or None when none is left."""
        held, bumped = self._held, self._bumped
        kept = self._kept
        if kept is not None:
            # The kept ranks: a job counted or finished since goes from the list for good
            # (counters never fall), and so does a lease holder (see _Uncounted); a job
            # counted now is passed over.
            ranks, old, index = kept.ranks, self._old, self._index
            u = self._u
            while u < len(ranks):
                rank = ranks[u]
                job_id = rank[1]
                if job_id in held or job_id in old or index.get(job_id) is None:
                    del ranks[u]
                    kept.ids.discard(job_id)
                    continue
                job = index[job_id]
                u += 1
                counter = bumped.get(job_id)
                if counter is None or counter < 1:  # (an evicted lease holder is counted now)
                    self._u = u
                    return (0, rank, job)
            self._u = u
            return self._pop_counted()
        uncounted = self._uncounted
        if uncounted is None:
            # The ids of the jobs without a positive counter in memory, walked in C.
            old = self._old
            positive = old if self._clean else {j: c for j, c in old.items() if c >= 1}
            uncounted = self._uncounted = itertools.filterfalse(
                positive.__contains__, map(_JOB_ID, self._jobs)
            )
        for job_id in uncounted:
            if job_id in held:
                continue
            counter = bumped.get(job_id)
            if counter is None or counter < 1:  # (an evicted lease holder is counted now)
                job = self._index[job_id]
                return (0, (job.arrival_s, job_id), job)
        return self._pop_counted()

    def _pop_counted(self) -> _Waiting | None:
        """The next waiting job with a positive counter, or None."""
        held, bumped = self._held, self._bumped
        keys = self.keys
        if keys is None:
            old = self._old
            counters = itertools.chain(((j, c) for j, c in old.items() if j not in bumped), bumped.items())
            keys = self.keys = _counted_keys(counters, self._index)
        index = self._index
        j, m = self._j, len(keys)
        while j < m:
            counter, rank = keys[j]
            j += 1
            job_id = rank[1]
            if job_id not in held:
                counted = index.get(job_id)
                if counted is not None:  # else it finished
                    self._j = j
                    return (counter, rank, counted)
        self._j = j
        return None


_FIRST = operator.itemgetter(0)
_FOURTH = operator.itemgetter(3)
_WAITING_KEY = operator.itemgetter(0, 1)


class _WaitingOrder:
    """The waiting jobs of an AFS-P decision in stage one's order ``(counter, rank)``,
    taken lazily: the jobs the pass looked at and did not start (``passed``, already in
    that order), then the rest of ``waiting``."""

    __slots__ = ("_keys", "_min_first", "_passed", "_waiting")

    def __init__(self, passed: Sequence[_Waiting], waiting: _ByCounter) -> None:
        self._passed = iter(passed)
        self._waiting = waiting
        self._keys: list[tuple[int, _Rank]] = []
        self._min_first: list[float] = []
        """Prefix minimum of the smallest shares over ``_keys`` (``inf`` for a job that
        can never start)."""

    def _take(self) -> bool:
        w = next(self._passed, None)
        if w is None:
            w = self._waiting.pop()
            if w is None:
                return False
        counter, rank, job = w
        first = _ladder(job)[1] or math.inf
        prev = self._min_first[-1] if self._min_first else math.inf
        self._keys.append((counter, rank))
        self._min_first.append(min(prev, first))
        return True

    def any_starts_before(self, key: tuple[int, _Rank], free: int) -> bool:
        """Is there a waiting job ahead of ``key`` whose smallest share fits in ``free``?"""
        keys = self._keys
        while (not keys or keys[-1] < key) and self._take():
            if keys[-1] < key and self._min_first[-1] <= free:
                return True
        i = bisect.bisect_left(keys, key)
        return i > 0 and self._min_first[i - 1] <= free


def first_evicting_lease_end(
    running: Sequence[_Held],
    leases: Mapping[str, float],
    waiting: _WaitingOrder,
    left: int,
    unit: float,
    first_lease: _Held | None = None,
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

    ``running``: the jobs stage one started (:data:`_Held`); ``leases``: their lease
    starts (those jobs' and no other); ``left``: the GPUs stage one left (``L``);
    ``first_lease``, when given: the job of ``running`` whose lease starts first (else it
    is looked for in ``running``).
    """
    free = left
    # The first step of the search below without its heap (nearly every call ends
    # there): the smallest two lease starts give the first two ends (an end is a start
    # plus the unit, so the order is the same), and when the first is not within
    # _LEASE_EPS of the second it is one job's, the one the heap would pop first.
    # Should that job start again at once, the search runs in full from the start.
    starts = sorted(leases.values())
    if starts:
        end = starts[0] + unit
        if len(starts) > 1 and starts[1] + unit - end <= _LEASE_EPS:
            return end
        if first_lease is not None:
            rank, _, first, counter = first_lease
            if waiting.any_starts_before((counter + 1, rank), free + first):
                return end
        else:
            for rank, job, first, counter in running:
                if leases[job.job_id] == starts[0]:
                    if waiting.any_starts_before((counter + 1, rank), free + first):
                        return end
                    break
    return _lease_end_search(running, leases, waiting, left, unit)


def _lease_end_search(
    running: Sequence[_Held],
    leases: Mapping[str, float],
    waiting: _WaitingOrder,
    left: int,
    unit: float,
) -> float:
    """:func:`first_evicting_lease_end`'s search, lease end by lease end on a heap."""
    free = left
    ends = [(leases[job.job_id] + unit, rank, first, counter) for rank, job, first, counter in running]
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
    *,
    clean: bool = False,
    every: Callable[[], Mapping[str, int]] | None = None,
    left: Collection[str] | None = None,
) -> dict[str, Any]:
    """AFS-P's counters to remember: the positive ones of the active jobs (``active``:
    keyed by them), ``bumped`` over ``old``.

    While no counted job finished (the usual case in a long queue) it is the previous
    mapping, or a copy with the lease holders' new counts; otherwise it is rebuilt from
    the counted jobs alone (never a pass over every job of the queue). ``clean``: every
    counter of ``old`` is known to be at least 1. ``every``: when ``bumped`` lists only
    the changed counters, the mapping of every lease holder's (the rebuilt mapping lists
    them in its order). ``left``, when given: every job of ``old`` was active when
    ``old`` was made, and no job that left since is missing from ``left`` (so when none of
    them is counted, no counted job finished, told without a pass over the counted jobs;
    and when some of them are, the counted jobs that finished are those of them no longer
    active).
    """
    trim: Collection[str] | None = None
    if not isinstance(old, dict):
        finished = True  # the rebuild, from any mapping
    elif left is not None:
        # A counted job finished: one named in ``left`` and no longer active (a name
        # there may be of a job still here).
        finished = not old.keys().isdisjoint(left) and any(j in old and j not in active for j in left)
        if finished and clean:
            trim = left
    else:
        finished = not active.keys() >= old.keys()
    if not finished and isinstance(old, dict) and (clean or 0 not in old.values()):
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
    if every is not None:
        bumped = every()
    if trim is not None:
        # The rebuild below without its pass over every counted job: the same items in
        # the same order (old's, less the finished and the bumped ones, then the positive
        # bumped ones), by deletions from a copy. Every job of ``old`` that is not active
        # left since, so it is named in ``left``.
        out = dict(old)
        for j in trim:
            if j in out and j not in active:
                del out[j]
        for j in bumped:
            out.pop(j, None)
    else:
        out = {j: c for j, c in old.items() if c and j in active and j not in bumped}
    out.update((j, c) for j, c in bumped.items() if c)
    return out


class _Holders:
    """The lease holders of the leases mapping an :class:`AFSP` returned (:attr:`of`, with
    its counters :attr:`counters_of`), kept for the next decision, which takes them when
    its memory holds that very counters mapping and those leases (the same object, or
    one listing the same items in the same order: the simulator keeps the memory it had
    when a decision changes nothing and returns equal memory).

    The pass over the lease holders redid every holder's units, counter, lease and
    smallest share, though at most decisions one lease ended and the others are
    mid-unit: their counters, leases and shares are those of the decision before. A
    holder's units since its lease started never rise as the start is later, so the
    holders whose lease ended are the smallest starts of a heap (:meth:`advance`), and
    the others are carried over; held jobs whose view was rebuilt are read again. Memory
    decoded from the log holds another counters mapping and takes the full pass, so the
    memo never changes a decision (``test_afs_p_remembering_the_counted_order_``
    ``changes_no_decision`` runs both and compares decisions and memory, in order).
    """

    __slots__ = ("counters_of", "gone", "heap", "need", "of", "order", "rows", "serial", "shares")

    def __init__(
        self, leases: dict[str, float], counters: Mapping[str, Any], started: Sequence[_Held]
    ) -> None:
        self.of: Mapping[str, float] = leases
        self.counters_of = counters
        self.rows: dict[str, _Held] = {h[1].job_id: h for h in started}
        """job id -> the job as stage one started it, for every key of :attr:`of`."""
        self.order: list[_Held] = list(started)
        """The rows in rank order, which is the order of :attr:`of` (the decision lists
        its leases in the order of its shares, and those in rank order)."""
        self.heap = [(leases[job_id], h[0], job_id) for job_id, h in self.rows.items()]
        """``(lease start, rank, job id)``, a heap; an entry whose job left or whose start
        is no longer the job's in :attr:`of` is stale and skipped."""
        heapq.heapify(self.heap)
        self.need = sum(h[2] for h in started)
        """The sum of the rows' smallest shares."""
        self.serial = 0
        """The serial of the jobs of the decision these rows were carried to
        (:attr:`shoal.policies.base.LiveJobs.serial`; 0: not a simulator's)."""
        self.shares: dict[str, int] | None = None
        """The shares that decision returned when stage two had no GPUs: ``{job id:
        smallest share}`` of the rows, in the order of :attr:`of` (set by
        :meth:`AFSP.decide`, which copies them before it changes them; a caller does not
        change a decision's shares, as it does not change its memory, which :attr:`of`
        is). None once :meth:`advance` reads a row again with another smallest share; the
        rows it dropped are listed in :attr:`gone`."""
        self.gone: list[str] = []
        """The job ids of the rows the last :meth:`advance` dropped (finished or evicted)."""

    def advance(
        self,
        now: float,
        unit: float,
        index: Mapping[str, JobView],
        look: Iterable[str] | None = None,
    ) -> tuple[dict[str, float], dict[str, int], dict[str, int], list[_Held], int] | None:
        """What the pass over the lease holders of :attr:`of` computes at ``now``.

        Returns ``(leases, bumped, units, held, need)``: the leases still held (in the
        order of :attr:`of`), the new counters of the holders whose lease ended (the full
        pass lists every holder; the others' counters are unchanged), those holders'
        units, the held jobs in rank order (the order of :attr:`of`: :attr:`order` itself,
        edited in place, which the decision adds to and hands back) and the sum of their
        smallest shares. None when the full pass must run instead: a held job's arrival
        changed or its smallest share is 0 (or a row is not where :attr:`order` should
        have it). The memo is spent either way (the decision makes it the next one's with
        :meth:`carry`).

        ``look``, when given: the jobs whose view may have changed or that left since
        the decision of :attr:`serial` (:meth:`shoal.policies.base.LiveJobs.rebuilt_since`
        and ``left_since``); any other row's job has the view the row holds, so only
        these are looked at instead of every row.
        """
        old, counters, rows, order = self.of, self.counters_of, self.rows, self.order
        need = self.need
        gone: list[str] = []
        self.gone = gone
        get = index.get
        leases = dict(old)
        # Jobs that left, and held jobs whose view was rebuilt (read again). The order
        # they are met in does not matter: each is dropped or read again on its own,
        # and ``need`` is a sum of ints.
        if look is None:
            changed = [job_id for job_id, row in rows.items() if get(job_id) is not row[1]]
        else:
            changed = [
                job_id
                for job_id in set(look)
                if (row := rows.get(job_id)) is not None and get(job_id) is not row[1]
            ]
        for job_id in changed:
            row = rows[job_id]
            job = get(job_id)
            # Its place in the order, found by its rank (ranks are unique).
            i = bisect.bisect_left(order, row[0], key=_FIRST)
            if i == len(order) or order[i] is not row:
                return None
            if job is None:  # finished: the full pass skips it
                del rows[job_id], leases[job_id], order[i]
                need -= row[2]
                gone.append(job_id)
                continue
            rank = (job.arrival_s, job_id)
            first = _ladder(job)[1]
            if rank != row[0] or not first:
                return None
            if first != row[2]:
                self.shares = None
            need += first - row[2]
            rows[job_id] = order[i] = (rank, job, first, row[3])
        # Leases that ended: the smallest starts (see the class docstring).
        heap = self.heap
        ended: list[tuple[_Rank, str, float]] = []
        while heap:
            start, rank, job_id = heap[0]
            if job_id not in rows or old[job_id] != start:
                heapq.heappop(heap)  # stale
                continue
            if max(0, int((now - start) / unit + _LEASE_EPS)) == 0:
                break
            heapq.heappop(heap)
            ended.append((rank, job_id, start))
        bumped: dict[str, int] = {}
        units_of: dict[str, int] = {}
        ended.sort()  # rank order, the order of ``old``
        for rank, job_id, start in ended:
            # The full pass's arithmetic, for these holders only.
            units = units_of[job_id] = max(0, int((now - start) / unit + _LEASE_EPS))
            counter = bumped[job_id] = int(counters.get(job_id, 0)) + units
            start += units * unit
            row = rows[job_id]
            i = bisect.bisect_left(order, rank, key=_FIRST)
            if i == len(order) or order[i] is not row:
                return None
            if now - start > _LEASE_EPS:
                leases[job_id] = start  # a later unit, in progress: held
                rows[job_id] = order[i] = (rank, row[1], row[2], counter)
                heapq.heappush(heap, (start, rank, job_id))
            else:  # the unit ended just now: evicted
                del leases[job_id], rows[job_id], order[i]
                need -= row[2]
                gone.append(job_id)
        self.need = need
        return leases, bumped, units_of, order, need

    def first_lease(self) -> _Held:
        """The row whose lease in :attr:`of` starts first (the earliest by rank among
        equal starts): the heap's first entry that is not stale (those before it are
        dropped). :attr:`of` must not be empty."""
        heap, rows, of = self.heap, self.rows, self.of
        while True:
            start, _, job_id = heap[0]
            if job_id in rows and of[job_id] == start:
                return rows[job_id]
            heapq.heappop(heap)

    def carry(self, leases: dict[str, float], counters: Mapping[str, Any], started: Iterable[_Held]) -> None:
        """Become the memo of the decision that started the held jobs (every row
        :meth:`advance` left) and then ``started``, returning these leases and counters."""
        rows, heap = self.rows, self.heap
        for h in started:
            job_id = h[1].job_id
            rows[job_id] = h
            heapq.heappush(heap, (leases[job_id], h[0], job_id))
            self.need += h[2]
        if len(heap) > 2 * len(rows) + 64:  # mostly stale entries
            heap[:] = [(leases[job_id], h[0], job_id) for job_id, h in rows.items()]
            heapq.heapify(heap)
        self.of = leases
        self.counters_of = counters


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
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    reads_progress = False
    """Length-unaware: it reads curves, counts, arrival and its memory only
    (:func:`shoal.policies.base.policy_reads_progress`)."""
    _naive = False

    def __init__(self, unit_s: float = DEFAULT_UNIT_S, *, wake_at_every_lease_end: bool = False) -> None:
        if not unit_s > 0 or math.isinf(unit_s):
            raise ValueError(f"unit_s must be a positive number of seconds, got {unit_s!r}")
        self.unit_s = float(unit_s)
        self.wake_at_every_lease_end = wake_at_every_lease_end
        self._counted: _Counted | None = None
        self._holders: _Holders | None = None
        self._uncounted: _Uncounted | None = None
        self._clean_counters: Mapping[str, Any] | None = None
        """The counters this instance last returned, when each is at least 1."""
        self._counters_made: tuple[Mapping[str, Any], int] | None = None
        """The counters this instance last returned and the serial of that decision's
        jobs (:attr:`shoal.policies.base.LiveJobs.serial`)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Processor sharing by counters when jobs exceed GPUs, then eq. (3) by ``f``.

        A long queue mostly waits: the waiting jobs are walked only as far as stage one
        needs (see the module docstring), and the per-job working record
        (:class:`_Entry`) is made only when GPUs are left for stage two.
        """
        now = view.now_s
        unit = self.unit_s
        # In arrival order; the simulator's jobs already are (and are iterated here,
        # never indexed: a list of a long queue at every decision was measurable).
        jobs: Sequence[JobView] = view.jobs if view.arrival_ordered else view_arrival_order(view)
        index = jobs_by_id(view)

        # Counters in memory are ints (this policy writes them).
        old_counters: Mapping[str, Any] = memory.get("counters") or {}
        old_leases: Mapping[str, Any] = memory.get("leases") or {}
        total = view.total_gpus
        # The lease holders: carried over from the decision before when it returned this
        # very memory (_Holders), else a pass over every one.
        holders, self._holders = self._holders, None
        carried = None
        if (
            holders is not None
            and holders.counters_of is old_counters
            # The simulator keeps the memory it had when a decision changes nothing
            # (equal memory, shares unchanged): the same leases, listed alike, will do.
            and (
                holders.of is old_leases
                or (holders.of == old_leases and list(holders.of) == list(old_leases))
            )
        ):
            # The jobs whose view may differ from the one a row holds, when the
            # simulator says: those rebuilt and those that left since the decision
            # the rows were carried to.
            look: list[str] | None = None
            if holders.serial:
                rebuilt_since = getattr(view.jobs, "rebuilt_since", None)
                left_since = getattr(view.jobs, "left_since", None)
                if rebuilt_since is not None and left_since is not None:
                    rebuilt = rebuilt_since(holders.serial)
                    gone = left_since(holders.serial)
                    if rebuilt is not None and gone is not None:
                        look = [*rebuilt, *gone]
            carried = holders.advance(now, unit, index, look)
            if carried is not None and carried[4] > total:
                carried = None  # the held jobs no longer fit: the full pass sorts it out
        # held: the lease holders as (counter, rank, job, smallest share) for the full
        # pass; held_rows: as stage one starts them, in rank order, when carried over.
        held: list[tuple[int, _Rank, JobView, int]] = []
        held_rows: list[_Held] | None = None
        units_of: dict[str, int] | None = None  # carried over: the holders whose lease ended
        if carried is not None:
            leases, bumped, units_of, held_rows, need = carried
            held_need = need
        else:
            holders = None
            leases = {}
            bumped = {}
            for job_id, start in old_leases.items():
                job = index.get(job_id)
                if job is None:
                    continue  # finished
                start = float(start)
                # Every whole unit executed since the lease started adds one (§3.3); the
                # lease goes on in phase, so a unit in progress is not lost.
                units = max(0, int((now - start) / unit + _LEASE_EPS))  # clock skew: no negative
                counter = bumped[job_id] = int(old_counters.get(job_id, 0)) + units
                start += units * unit
                if units == 0 or now - start > _LEASE_EPS:
                    leases[job_id] = start  # mid-unit: held (non-preemptive)
                    held.append((counter, (job.arrival_s, job_id), job, _ladder(job)[1]))
                # else: the unit ended just now, the job is evicted.
            need = 0
            for h in held:
                need += h[3]

        # Every counter is at least 1 in memory this policy wrote (it drops zeros, and
        # counters never fall); a mapping from elsewhere is checked once.
        clean = old_counters is self._clean_counters or not old_counters or min(old_counters.values()) >= 1

        def every() -> dict[str, int]:
            """The full pass's bumped: every active lease holder's counter."""
            assert units_of is not None
            return {
                job_id: int(old_counters.get(job_id, 0)) + units_of.get(job_id, 0)
                for job_id in old_leases
                if job_id in index
            }

        # The jobs that left since the decision that returned old_counters, when the
        # simulator says (LiveJobs.left_since): every job of those counters was active then.
        left: Collection[str] | None = None
        serial = getattr(view.jobs, "serial", 0)
        made, self._counters_made = self._counters_made, None
        if made is not None and made[0] is old_counters:
            since = getattr(view.jobs, "left_since", None)
            left = since(made[1]) if since is not None else None

        def counters_out() -> dict[str, Any]:
            out = _counters_out(
                old_counters,
                bumped,
                index,
                clean=clean,
                every=every if units_of is not None else None,
                left=left,
            )
            self._counters_made = (out, serial) if serial else None
            return out

        # The memos of the counted jobs' order (see _Counted) and of the jobs without a
        # counter (_Uncounted), taken: each is handed back below only once it matches
        # this decision's counters.
        counted, self._counted = self._counted, None
        uncounted, self._uncounted = self._uncounted, None
        # Contention: the smallest shares of all jobs exceed the GPUs. Every smallest
        # share is >= 0, so the lease holders' (known already) are summed first and the
        # other jobs then only as far as needed: the same answer as any order's.
        contended = need > total
        if not contended:
            for job in jobs:
                if job.job_id in leases:
                    continue
                need += _ladder(job)[1]
                if need > total:
                    contended = True
                    break
        if not contended:
            # Every job fits at its smallest share: counters are ignored (§3.3). Ranks are
            # positions here (no lease holder or counted job to compare with).
            entries = [_Entry(job, r, length_aware=False) for r, job in enumerate(jobs)]
            free = _fill_smallest_shares(entries, total)
            if free > 0:
                self._stage_two(entries, free)
            shares = _shares(entries)
            new_counters = counters_out()
            self._clean_counters = (
                new_counters if clean or min(new_counters.values(), default=1) >= 1 else None
            )
            return Decision(
                shares=shares,
                memory={"counters": new_counters, "leases": {j: leases.get(j, float(now)) for j in shares}},
            )

        # Stage one, processor sharing: jobs holding a lease keep running
        # (non-preemptive); the rest by increasing counter (ties: arrival). A started job
        # is ``(rank, job, smallest share, counter)``: a working record (_Entry) is made
        # only when GPUs are left for stage two.
        # A lease holder that no longer fits (the cluster shrank) waits now: the exact
        # wake-up below does not model that, so it falls back to every lease end.
        dropped = False
        started: list[_Held]
        if held_rows is not None:  # carried over: every one fits (need <= total)
            started = held_rows
            free = total - held_need
        else:
            started = []
            free = total
            held.sort(key=_WAITING_KEY)
            for counter, rank, job, first in held:
                if first and first <= free:
                    started.append((rank, job, first, counter))
                    free -= first
                else:
                    dropped = True
        n_held = len(started)
        # The same pass over the waiting jobs in (counter, rank) order, taken only until
        # the GPUs run out (a long queue mostly gets nothing).
        keys = None
        rank_of = None
        if counted is not None and counted.of is old_counters:
            keys, rank_of = counted.keys, counted.rank_of
            if not _move_keys(keys, old_counters, bumped, index, rank_of):
                keys = rank_of = None
        if uncounted is not None and not (clean and uncounted.refresh(view.jobs, index, old_counters)):
            uncounted = None
        if uncounted is None and clean and getattr(view.jobs, "serial", 0):
            # The simulator's jobs, which name the views rebuilt between decisions: the
            # list is kept for the next (a pass over the queue, once).
            uncounted = _Uncounted(jobs, old_counters)
        waiting = _ByCounter(jobs, index, old_counters, bumped, leases, keys, clean, uncounted)
        passed: list[_Waiting] = []  # waiting jobs the pass looked at and did not start, in order
        while free > 0:
            w = waiting.pop()
            if w is None:
                break
            counter, rank, job = w
            first = _ladder(job)[1]
            if first and first <= free:
                started.append((rank, job, first, counter))
                free -= first
            else:
                passed.append(w)
        fresh = started[n_held:]  # the jobs started from the queue
        appended = True  # the fresh rows rank after every held one (the tail, in order)
        if held_rows is None:
            started.sort(key=_FIRST)
        elif fresh:
            # Held rows carried over are in rank order already: the fresh ones are put in
            # their places (ranks are unique, so this is the order the sort gives).
            del started[n_held:]
            for row in fresh:
                i = bisect.bisect_right(started, row[0], key=_FIRST)
                appended = appended and i == len(started)
                started.insert(i, row)
        # ``started`` is the held rows in the order of ``leases``, then the fresh ones.
        in_order = held_rows is not None and appended
        if free > 0:
            entries = []
            for rank, job, first, _ in started:
                e = _Entry(job, rank, length_aware=False)
                e.set_count(first)
                entries.append(e)
            self._stage_two(entries, free)
            shares = _shares(entries)
        elif in_order and holders is not None and holders.shares is not None:
            # The shares of the decision before (its held rows at their smallest shares, in
            # rank order: _Holders.shares), less the rows dropped since, then the jobs
            # started now, which rank after every held one: the rows of ``started``.
            shares = dict(holders.shares)
            for job_id in holders.gone:
                del shares[job_id]
            for rank, _, first, _ in fresh:
                shares[rank[1]] = first
        else:
            shares = {rank[1]: first for rank, _, first, _ in started}

        new_counters = counters_out()
        if in_order:
            # Every job started has a share, in the order of ``started``: the held jobs in
            # the order of ``leases``, then the jobs started now, with new leases.
            if fresh:
                new_leases = dict(leases)
                for rank, _, _, _ in fresh:
                    new_leases[rank[1]] = float(now)
            else:
                new_leases = leases
        elif list(shares) == list(leases):
            # Every job runs on under its lease, and none started (the usual case): the
            # same mapping, made by this decision.
            new_leases = leases
        elif not dropped:
            # Every lease holder is started, so has a share: the leases in the shares'
            # order, a new one for each job started now (keys met again keep their place).
            new_leases = dict.fromkeys(shares, float(now))
            new_leases.update(leases)
        else:
            new_leases = dict(zip(shares, map(leases.get, shares, itertools.repeat(float(now))), strict=True))
        memory_out: dict[str, Any] = {"counters": new_counters, "leases": new_leases}
        # Counters never fall, and zeros are dropped: clean memory stays clean.
        new_clean = clean or min(new_counters.values(), default=1) >= 1
        self._clean_counters = new_counters if new_clean else None
        if uncounted is not None and new_clean and not dropped:
            # It holds every job without a positive counter in new_counters that holds no
            # lease in new_leases (they are among those without one in old_counters, and
            # it dropped none of those but lease holders). Not when a lease holder was
            # dropped: it waits now, perhaps without a counter, and the list may lack it.
            uncounted.counters = new_counters
            uncounted.serial = getattr(view.jobs, "serial", 0)
            self._uncounted = uncounted
        if not dropped:
            # The lease holders of new_leases (every held job, then those started from
            # the queue), kept for the next decision.
            if holders is not None:
                holders.carry(new_leases, new_counters, fresh)
            else:
                holders = _Holders(new_leases, new_counters, started)
            holders.serial = serial
            holders.order = started  # in rank order: the order of new_leases
            # Stage two had no GPUs: each job its smallest share, in the order of new_leases.
            holders.shares = shares if free <= 0 else None
            self._holders = holders
        if started:
            # Only an eviction changes shares. While every job fits, units are counted at
            # the next decision instead.
            if self.wake_at_every_lease_end or dropped:
                memory_out["next_decision_at_s"] = min(new_leases.values()) + unit
            else:
                memory_out["next_decision_at_s"] = first_evicting_lease_end(
                    started,
                    new_leases,
                    _WaitingOrder(passed, waiting),
                    free,
                    unit,
                    holders.first_lease() if holders is not None else None,
                )
        if waiting.keys is not None and new_clean:
            # keys: every positive counter of new_counters, and the finished jobs'. Last:
            # _drop_finished changes the list in place, which the waiting order above
            # walks by position.
            if waiting.keys is not keys:  # made afresh by the pass: no ranks kept
                keys, rank_of = waiting.keys, None
            if len(keys) != len(new_counters):  # a counted job finished
                keys, rank_of = _drop_finished(keys, rank_of, old_counters, new_counters, left)
            self._counted = _Counted(new_counters, keys, rank_of)
        return Decision(shares=shares, memory=memory_out)

    def _stage_two(self, entries: Sequence[_Entry], free: int) -> None:
        _ready_for_stage_two(entries)
        (afs_p_stage_two_naive if self._naive else afs_p_stage_two_fast)(entries, free)


class AFSPNaive(AFSP):
    """AFS-P with the literal O(M·n) modified TOPPRIORITY (for comparison and tests)."""

    name = "afs-p-naive"
    _naive = True

"""Heterogeneity-aware AFS: AFS-P's eq. (3) per GPU generation, trading across generations.

AFS/CoDDL (NSDI'21) §3.3 allocates GPUs one at a time to the job that eq. (3)
ranks first. AFS-P does so without job lengths, with processor-sharing leases
when the jobs do not all fit. It treats GPUs as interchangeable. Gandiva_fair
(EuroSys'20) §3.4-3.5 shows that generations are not: a job's speedup on a V100
over a K80 ranges from 1.25× to 6×, and trading fast GPUs to the jobs with the
largest speedup raises everyone's progress. :class:`HeteroAFS` combines the two.
A job runs as a gang on *one* generation at a time. Each decision has four phases:

1. **Who runs (AFS-P §3.3).** :class:`shoal.policies.afs.AFSP` itself decides,
   generation-blind, with its own counters and leases kept in this policy's
   memory. So both policies share one processor-sharing rule, and on a
   homogeneous cluster they decide the same (a test checks it). If every job
   fits at its smallest share, all run. Otherwise jobs holding a lease keep
   running (non-preemptive) and the others follow in increasing counter order.
   A counter counts the ``unit_s`` leases the job has run (2 h, AFS footnote 11).
   AFS-P's stage-two shares are discarded: phases 3-4 recompute them per generation.
2. **Which generation (Gandiva_fair Algorithm 2 and §3.5 trading).** A running
   job keeps its generation while it fits there. The others, in stage-one order,
   take their smallest share on the free generation where their *normalised* rate
   is highest. A job's normalised rate on g with k GPUs is
   ``k · thr_g(k) / thr_slowest(k)``: the "normalised K80s" of Gandiva_fair
   Table 3. Then, for every (fast, slow) generation pair (fast newest first,
   slow oldest first, as :mod:`shoal.fairness.trader`), the job on the slow
   generation with the highest speedup ``thr_fast(k)/thr_slow(k)`` (the buyer)
   swaps places with the job on the fast generation with the lowest speedup (the
   seller). This repeats while ``s_buyer ≥ (1 + min_gain) · s_seller`` and the
   swap fits both generations.
3. **Spare GPUs (AFS-P eq. (3), per generation).** The GPUs of generation g that
   phase 2 left free go, one step at a time, to the jobs on g. The pick is
   AFS-P's modified TOPPRIORITY with the curves of g: eq. (3) both ways, and
   when neither holds, the larger fractional gain ``f = p'/p`` (AFS appendix B),
   then the earlier arrival. This is the heap of
   :func:`shoal.policies.afs.afs_p_stage_two_fast`. Eq. (3) compares relative
   gains, so within one generation it needs no cross-generation unit.
4. **Left-over generations (trading idle capacity).** If a generation still has
   GPUs that none of its jobs can use, the job elsewhere whose normalised rate
   gains most by moving there, by more than ``min_gain``, moves. It takes the count
   that runs fastest there. Its old GPUs go back to phase 3 on its old generation.
   This repeats until no move gains, with at most one move per job per decision.

Choices where neither paper speaks:

- Trading is between *jobs* of one scheduler that minimises JCT, not between
  users with private valuations. Gandiva_fair's second price is an incentive
  device, so it prices nothing here. What is kept is its allocation rule: the
  highest-speedup job gets fast GPUs from the lowest-speedup job, with
  hysteresis. A trade is a swap of places made at the jobs' smallest shares;
  phase 3 then re-divides each generation by eq. (3).
- Speedups compare equal gang sizes, because jobs scale differently per
  generation. Gavel's ResNet-50 is 7.1× faster on one V100 than on one K80, but
  3.9× on four.
- A generation the job has no curve for uses its default ``throughput`` (the
  simulator's rule). On a homogeneous cluster (``gpus_by_type`` empty) the policy is
  AFS-P (one generation ``""``, no trading) and ``gpu_types`` stays empty.
- ``Decision.memory``: AFS-P's memory (``counters``, ``leases``,
  ``next_decision_at_s``; a job AFS-P picked but no generation could hold gets
  no lease), plus ``gen`` (job -> generation of this decision), ``swaps`` and
  ``moves`` (what phases 2 and 4 did in this decision).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

from shoal.fairness.hetero import generation_order
from shoal.policies.afs import AFSP, DEFAULT_UNIT_S
from shoal.policies.base import ClusterView, Decision, JobView, jobs_by_id
from shoal.policies.common import Ladder, arrival_order


def eq3_prefers(p_b: float, p_b_next: float, p_a: float, p_a_next: float) -> bool:
    """AFS eq. (3): does job b have priority over job a for the next step?

    Args:
        p_b: Throughput of b at its current share.
        p_b_next: Throughput of b one step up.
        p_a: Throughput of a at its current share.
        p_a_next: Throughput of a one step up.

    Returns:
        ``(p'_b − p_b)/p'_b > (p'_a − p_a)/p_a``; a job with no throughput now
        (``p_a == 0``) is never beaten.
    """
    if p_a <= 0 or p_b_next <= 0:
        return False
    return (p_b_next - p_b) / p_b_next > (p_a_next - p_a) / p_a


class _Job:
    """One job's working record during a decision."""

    __slots__ = ("count", "gen", "job", "ladder", "rank")

    def __init__(self, job: JobView, rank: int, ladder: Ladder) -> None:
        self.job = job
        self.rank = rank
        self.ladder = ladder
        self.count = 0
        self.gen = ""

    def thr(self, gen: str, k: int) -> float:
        """Throughput on ``k`` GPUs of ``gen`` (past the curve's end: its last value)."""
        if k <= 0:
            return 0.0
        curve = self.job.throughput_by_type.get(gen, self.job.throughput) if gen else self.job.throughput
        if k < len(curve):
            return float(curve[k])
        return float(curve[-1]) if len(curve) > 1 else 0.0


class HeteroAFS:
    """Heterogeneity-aware AFS-P: eq. (3) per GPU generation, trading across generations.

    Args:
        unit_s: AFS-P's processor-sharing unit (lease length) in seconds.
        min_gain: Hysteresis of trades and moves. A job changes generation only
            when the speedup ratio (phase 2) or its normalised rate (phase 4)
            gains more than this fraction.
        generation_rank: Generation name -> rank (newer is higher); default
            :data:`shoal.fairness.hetero.GENERATION_RANK`.
    """

    name = "afs-het"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    reads_progress = False
    """Length-unaware, as AFS-P: it reads curves (per generation), counts, arrival and
    its memory only (:func:`shoal.policies.base.policy_reads_progress`)."""

    def __init__(
        self,
        unit_s: float = DEFAULT_UNIT_S,
        *,
        min_gain: float = 0.1,
        generation_rank: Mapping[str, int] | None = None,
    ) -> None:
        if not unit_s > 0 or math.isinf(unit_s):
            raise ValueError(f"unit_s must be a positive number of seconds, got {unit_s!r}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be non-negative, got {min_gain}")
        self.unit_s = float(unit_s)
        self.min_gain = min_gain
        self.generation_rank = generation_rank
        self._ladders: dict[str, tuple[JobView, Ladder]] = {}
        """The picked jobs of the last decision: job id -> (view, its :class:`Ladder`),
        taken again for the very same view (a ladder reads the view's counts only)."""
        self._afsp = AFSP(self.unit_s, wake_at_every_lease_end=True)
        """Phase 1's AFS-P, one instance for every decision: what it keeps between
        decisions (its lease holders, counted order and uncounted jobs) is taken only when
        the memory handed back is the very one it returned, and its decisions are a fresh
        instance's (``tests/policies/test_afs_hetero.py`` checks every decision of two
        Philly prefixes against a fresh instance)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Decide each job's GPU count and generation.

        Args:
            view: The cluster.
            memory: ``Decision.memory`` of the previous call (empty at first).

        Returns:
            Shares, generations (heterogeneous clusters) and the new memory.
        """
        typed = bool(view.gpus_by_type)
        capacity = {g: n for g, n in view.gpus_by_type.items() if n > 0} if typed else {"": view.total_gpus}
        gens = generation_order(capacity, self.generation_rank) if typed else ("",)

        # 1. Who runs: AFS-P itself decides, generation-blind, on the same memory
        # (its counters and leases), so both share one processor-sharing rule.
        # Generations can undo a pick, so wake at every lease end (see AFSP).
        base = self._afsp.decide(view, memory)
        counters: Mapping[str, Any] = base.memory.get("counters") or {}
        # Phases 2-4 touch only the jobs AFS-P picked (no other ever gets a count), so
        # only they get a working record, ranked in arrival order among themselves: a rank
        # is only ever compared with another's, and the picked jobs' relative order is
        # the same as in the whole queue (a long queue mostly waits).
        index = jobs_by_id(view)
        picked = [index[j] for j, n in base.shares.items() if n > 0]
        jobs: list[_Job] = []
        known, ladders = self._ladders, {}
        for rank, j in enumerate(arrival_order(picked)):
            kept = known.get(j.job_id)
            ladder = kept[1] if kept is not None and kept[0] is j else Ladder(j)
            ladders[j.job_id] = (j, ladder)
            jobs.append(_Job(j, rank, ladder))
        self._ladders = ladders
        order = sorted(jobs, key=lambda e: (int(counters.get(e.job.job_id, 0)), e.rank))

        # 2. Generation: keep it while it fits, else the best free one; then trades.
        free = dict(capacity)
        prev_gen: Mapping[str, str] = memory.get("gen") or {}
        for e in order:  # a job keeps its generation while it fits there
            g = prev_gen.get(e.job.job_id, "" if not typed else None)
            if g is not None and g in free:
                self._place(e, g, free)
        for e in order:
            if e.count == 0:
                for g in self._by_rate(e, gens):
                    if self._place(e, g, free):
                        break
        swaps = self._trade(jobs, gens, free)

        # 3-4. Spare GPUs by eq. (3) per generation, then idle generations are traded.
        for g in gens:
            self._spread([e for e in jobs if e.count and e.gen == g], g, free)
        moves = self._fill_idle(jobs, gens, free)

        mem: dict[str, Any] = dict(base.memory)
        running = {e.job.job_id for e in jobs if e.count}
        # A job AFS-P picked but no generation could hold does not run: no lease.
        base_leases: Mapping[str, Any] = base.memory.get("leases") or {}
        leases = {j: t for j, t in base_leases.items() if j in running}
        # AFS-P's own mapping when nothing was dropped (the same items, in order): AFS-P
        # then knows it as the one it returned.
        mem["leases"] = base_leases if len(leases) == len(base_leases) else leases
        mem.update(
            {
                "gen": {e.job.job_id: e.gen for e in jobs if e.count} if typed else {},
                "swaps": swaps,
                "moves": moves,
            }
        )
        return Decision(
            shares={e.job.job_id: e.count for e in jobs if e.count},
            gpu_types={e.job.job_id: e.gen for e in jobs if e.count} if typed else {},
            memory=mem,
        )

    # -- phases ------------------------------------------------------------------

    @staticmethod
    def _normalised(e: _Job, gen: str, k: int, gens: Sequence[str]) -> float:
        """``k · thr_gen(k) / thr_slowest(k)``: normalised slowest-generation GPUs."""
        base = e.thr(gens[-1], k)
        return k * e.thr(gen, k) / base if base > 0 else 0.0

    def _by_rate(self, e: _Job, gens: Sequence[str]) -> list[str]:
        """Generations by the job's normalised rate at its smallest share, best first."""
        first = e.ladder.first()
        if first == 0:
            return []
        rated = [(-self._normalised(e, g, first, gens), i, g) for i, g in enumerate(gens)]
        return [g for rate, _, g in sorted(rated) if rate < 0]

    @staticmethod
    def _place(e: _Job, gen: str, free: dict[str, int]) -> bool:
        """Give ``e`` its smallest share on ``gen`` if it fits."""
        first = e.ladder.first()
        if first == 0 or first > free[gen] or e.thr(gen, first) <= 0:
            return False
        e.count, e.gen = first, gen
        free[gen] -= first
        return True

    def _trade(self, jobs: Sequence[_Job], gens: Sequence[str], free: dict[str, int]) -> list[dict[str, Any]]:
        """Phase 2: swap high-speedup jobs on slow generations with low-speedup ones on fast."""
        swaps: list[dict[str, Any]] = []
        for i, fast in enumerate(gens):
            for slow in reversed(gens[i + 1 :]):

                def speedup(e: _Job, fast: str = fast, slow: str = slow) -> float:
                    lo, hi = e.thr(slow, e.count), e.thr(fast, e.count)
                    return hi / lo if lo > 0 and hi > 0 else 0.0

                buyers = sorted(
                    (e for e in jobs if e.count and e.gen == slow and speedup(e) > 0),
                    key=lambda e: (-speedup(e), e.rank),
                )
                sellers = sorted(
                    (e for e in jobs if e.count and e.gen == fast and speedup(e) > 0),
                    key=lambda e: (speedup(e), -e.rank),
                )
                b = s = 0
                while b < len(buyers) and s < len(sellers):
                    buyer, seller = buyers[b], sellers[s]
                    s_b, s_s = speedup(buyer), speedup(seller)
                    if s_b < (1.0 + self.min_gain) * s_s:
                        break  # both lists are ranked: no later pair gains enough
                    delta = buyer.count - seller.count
                    if delta > free[fast] or -delta > free[slow]:
                        s += 1  # this seller's gang does not make room for the buyer's
                        continue
                    buyer.gen, seller.gen = fast, slow
                    free[fast] -= delta
                    free[slow] += delta
                    swaps.append(
                        {
                            "buyer": buyer.job.job_id,
                            "seller": seller.job.job_id,
                            "fast_type": fast,
                            "slow_type": slow,
                            "buyer_speedup": s_b,
                            "seller_speedup": s_s,
                        }
                    )
                    b += 1
                    s += 1
        return swaps

    @staticmethod
    def _spread(here: Sequence[_Job], gen: str, free: dict[str, int]) -> None:
        """Phase 3: AFS-P stage two on ``gen``, a heap keyed on ``(-f, arrival rank)``."""
        if free[gen] <= 0:
            return  # nothing to hand out (under contention, the usual case)

        def step(e: _Job) -> tuple[int, float, float]:
            nxt = e.ladder.next_count(e.count)
            return nxt, e.thr(gen, e.count), e.thr(gen, nxt) if nxt else 0.0

        heap: list[tuple[float, int, _Job]] = []
        for e in here:
            nxt, p, pn = step(e)
            if nxt and pn > p > 0:
                heap.append((-pn / p, e.rank, e))
        heapq.heapify(heap)
        while free[gen] > 0 and heap:
            _, _, e = heapq.heappop(heap)
            nxt, p, pn = step(e)
            if nxt - e.count > free[gen]:
                continue  # free GPUs only decrease: never a candidate again
            free[gen] -= nxt - e.count
            e.count = nxt
            nxt, p, pn = step(e)
            if nxt and pn > p > 0:
                heapq.heappush(heap, (-pn / p, e.rank, e))

    def _fill_idle(
        self, jobs: Sequence[_Job], gens: Sequence[str], free: dict[str, int]
    ) -> list[dict[str, Any]]:
        """Phase 4: a generation with unusable spare GPUs takes the job that gains most there."""
        moves: list[dict[str, Any]] = []
        moved: set[str] = set()
        while len(gens) > 1:
            best: tuple[float, int, _Job, str, int] | None = None
            for g in gens:
                if free[g] <= 0:
                    continue
                for e in jobs:
                    if not e.count or e.gen == g or e.job.job_id in moved:
                        continue
                    fits, k = e.ladder.first(), 0
                    best_thr = 0.0
                    while 0 < fits <= free[g]:
                        if e.thr(g, fits) > best_thr:
                            k, best_thr = fits, e.thr(g, fits)
                        fits = e.ladder.next_count(fits)
                    if k == 0:
                        continue
                    before = self._normalised(e, e.gen, e.count, gens)
                    after = self._normalised(e, g, k, gens)
                    if before > 0 and after > (1.0 + self.min_gain) * before:
                        key = (after / before, -e.rank)
                        if best is None or key > (best[0], best[1]):
                            best = (after / before, -e.rank, e, g, k)
            if best is None:
                return moves
            gain, _, e, g, k = best
            src = e.gen
            free[src] += e.count
            free[g] -= k
            moves.append({"job_id": e.job.job_id, "source": src, "target": g, "gpus": k, "gain": gain})
            e.gen, e.count = g, k
            moved.add(e.job.job_id)
            self._spread([x for x in jobs if x.count and x.gen == src], src, free)
        return moves

"""Max-Min: elastic max-min fairness over GPU counts (AFS/CoDDL §2.2, §5.1).

"Max-Min distributes available resources across all jobs in max-min fairness"
(AFS §2.2); it knows no job lengths (it never reads ``remaining_iterations``) and may
give a job up to its ``max_gpus`` (the model's maximum in the AFS reproduction).

Water-filling over whole GPUs: repeatedly, the job holding the fewest GPUs takes its
next feasible count (:class:`~shoal.policies.common.Ladder`), until no job can take
another step. Choices:

* **What a job can use** caps its share: ``max_gpus``, and no step that does not raise
  its throughput (a flat or falling curve gains nothing from more GPUs).
* **Feasible counts.** A step may add several GPUs (``allowed_gpu_counts``,
  ``min_gpus`` or a non-elastic job's request); a step that no longer fits in the free
  GPUs ends that job's growth (free GPUs only decrease), and smaller jobs go on.
* **Ties** (equal shares) go to the earlier arrival, then the smaller job id.
* Cost O(k + M log k), ``k`` the jobs that get a share. Every job starts at 0 GPUs,
  and a job that took a step holds at least one, so the heap of (share, arrival rank)
  pops every job at 0 before any other: its first round is simply the jobs in arrival
  order, each given its smallest count while one fits. Only the jobs it reaches are
  looked at (a long queue mostly is not), and the heap holds only jobs with a share.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

from shoal.policies.base import ClusterView, Decision, JobView
from shoal.policies.common import Ladder, throughput_at, view_arrival_order


class MaxMin:
    """Elastic max-min fairness: water-filling of GPUs, each share capped by use."""

    name = "max-min"
    elastic = True
    """Shares may be regulated (network packing): :attr:`shoal.policies.base.Policy.elastic`."""
    reads_progress = False
    """It reads curves, counts and arrival only: :func:`shoal.policies.base.policy_reads_progress`."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Level GPU counts across jobs (the fewest GPUs first)."""
        # In arrival order; the simulator's jobs already are (iterated, never copied:
        # a long queue mostly gets nothing).
        jobs: dict[int, JobView] = {}  # rank -> job, for the jobs given a share
        free = view.total_gpus
        # Round one: every job at 0 GPUs, in arrival order (see the module docstring).
        ladders: dict[int, Ladder] = {}
        heap: list[tuple[int, int]] = []
        for rank, job in enumerate(view.jobs if view.arrival_ordered else view_arrival_order(view)):
            if free <= 0:
                break
            ladder = Ladder(job)
            first = ladder.next_count(0)
            if first == 0 or first > free:
                continue
            jobs[rank] = job
            ladders[rank] = ladder
            free -= first
            heap.append((first, rank))
        # Then water-filling among the jobs with a share: the fewest GPUs first.
        heapq.heapify(heap)
        counts = {rank: count for count, rank in heap}
        while heap and free > 0:
            count, rank = heapq.heappop(heap)
            job = jobs[rank]
            nxt = ladders[rank].next_count(count)
            if nxt == 0 or nxt - count > free:
                continue
            if throughput_at(job, nxt) <= throughput_at(job, count):
                continue
            counts[rank] = nxt
            free -= nxt - count
            heapq.heappush(heap, (nxt, rank))
        return Decision(shares={jobs[rank].job_id: c for rank, c in sorted(counts.items())})

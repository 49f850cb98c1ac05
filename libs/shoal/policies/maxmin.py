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
* Cost O((M + n) log n) with a heap keyed on (share, arrival rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

from shoal.policies.base import ClusterView, Decision
from shoal.policies.common import Ladder, throughput_at, view_arrival_order


class MaxMin:
    """Elastic max-min fairness: water-filling of GPUs, each share capped by use."""

    name = "max-min"

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Level GPU counts across jobs (the fewest GPUs first)."""
        jobs = view_arrival_order(view)
        ladders = [Ladder(j) for j in jobs]
        counts = [0] * len(jobs)
        heap = [(0, rank) for rank in range(len(jobs))]
        free = view.total_gpus
        while heap and free > 0:
            count, rank = heapq.heappop(heap)
            job = jobs[rank]
            nxt = ladders[rank].next_count(count)
            if nxt == 0 or nxt - count > free:
                continue
            if count > 0 and throughput_at(job, nxt) <= throughput_at(job, count):
                continue
            counts[rank] = nxt
            free -= nxt - count
            heapq.heappush(heap, (nxt, rank))
        return Decision(shares={j.job_id: c for j, c in zip(jobs, counts, strict=True) if c})

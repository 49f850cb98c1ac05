"""What a service reports about itself: the readiness rule and the metrics of its folded state.

Pure: no I/O here. The HTTP endpoints that serve this (``/healthz``, ``/readyz``,
``/metrics``) are in :mod:`shoal.probes`.

Readiness (:func:`judge_readiness`): a service is ready when

* its projection has caught up with the log as it was when it started (the replay is
  done), and has folded everything the stream held when the probe asked for its last
  sequence (it is not lagging behind the log's tail), and
* a leader-elected service knows its role (it has asked for the lease at least once
  and is ``leader`` or ``standby``).

Anything else is "not ready", with a reason per unmet condition.

Metrics from the folded state (:func:`state_gauges`): the allocation epoch, the
placement epoch, pending jobs (the queue), active jobs (not finished), AFS §2.2's QL,
CE and BI (:func:`queue_metrics`), GPUs of the nodes that are up, GPUs allocated (the
current shares) and their ratio. Every process that folds the log computes the same
values for the same ``now``; a scrape of any one service gives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from shoal import state as st
from shoal.models import Catalog
from shoal.policies.common import throughput_at
from shoal.view import build_view

Role = str
"""``"leader"`` or ``"standby"``."""


@dataclass(frozen=True)
class Readiness:
    """The verdict of :func:`judge_readiness`: ``ready`` and, when not, why."""

    ready: bool
    reasons: tuple[str, ...] = ()
    applied_seq: int = 0
    tail_seq: int | None = None
    role: Role | None = None
    details: dict[str, object] = field(default_factory=dict)

    def body(self) -> str:
        """The plain-text body of ``/readyz``: ``ready`` or ``not ready: <reasons>``,
        then the sequences and role."""
        head = "ready" if self.ready else "not ready: " + "; ".join(self.reasons)
        tail = "unknown" if self.tail_seq is None else str(self.tail_seq)
        lines = [head, f"applied_seq {self.applied_seq}", f"tail_seq {tail}"]
        if self.role is not None:
            lines.append(f"role {self.role}")
        return "\n".join(lines) + "\n"


def judge_readiness(
    *,
    replayed: bool,
    applied_seq: int,
    tail_seq: int | None,
    tail_error: str | None = None,
    leader_elected: bool = False,
    role: Role | None = None,
) -> Readiness:
    """Whether a service is ready (see the module docstring).

    Args:
        replayed: the projection caught up with the log as it was at start.
        applied_seq: the last stream sequence the projection has folded.
        tail_seq: the stream's last sequence as read for this probe (None: unknown).
        tail_error: why the tail could not be read (no server, timeout …).
        leader_elected: the service campaigns for a lease.
        role: ``"leader"``/``"standby"`` once known, else None.
    """
    reasons: list[str] = []
    if not replayed:
        reasons.append("replaying the log")
    if tail_seq is None:
        reasons.append(f"cannot read the log's tail ({tail_error or 'unknown'})")
    elif applied_seq < tail_seq:
        reasons.append(f"behind the log's tail by {tail_seq - applied_seq} messages")
    if leader_elected and role not in ("leader", "standby"):
        reasons.append("role unknown (lease not yet asked for)")
    return Readiness(
        ready=not reasons,
        reasons=tuple(reasons),
        applied_seq=applied_seq,
        tail_seq=tail_seq,
        role=role if leader_elected else None,
    )


def bus_lag(tail_seq: int | None, applied_seq: int) -> int | None:
    """Messages in the log the projection has not folded yet (None: tail unknown)."""
    if tail_seq is None:
        return None
    return max(0, tail_seq - applied_seq)


@dataclass(frozen=True)
class Gauge:
    """One gauge value computed from the state."""

    name: str
    help: str
    value: float


@dataclass(frozen=True)
class QueueMetrics:
    """AFS §2.2's queue length, cluster efficiency and blocking index at one instant."""

    ql: int
    """QL: active jobs that hold no GPU in the current shares (the set J_P)."""
    ce: float
    """CE: ``(1/M) · Σ_{j running} thr_j(current GPUs) / thr_j(1 GPU)``."""
    bi: float
    """BI: ``(1/|J_P|) · Σ_{j ∈ J_P} pending_time_j / remaining_time_j(1 GPU)`` over the
    pending jobs whose remaining work is known (0: none)."""
    bi_jobs: int
    """|J_P| as BI counts it: the pending jobs whose remaining work is known."""


def pending_time(job: st.JobState, now: float) -> float:
    """The time ``job`` (holding no GPU at ``now``) has spent without GPUs since its
    arrival, as far as the folded state tells it.

    The fold keeps ``submitted_at``, ``since`` (when the job's share last changed: for a
    job without GPUs, when it lost them, or its arrival) and the GPU-seconds it attained
    (``attained_service_gpu_s``, A), not the time it held GPUs. So:

    * A job that never held a GPU (A = 0) waited ``now − submitted_at``: exact.
    * Otherwise it held GPUs for at most ``A / max(1, spec.min_gpus)`` seconds (a share
      is a feasible count, :func:`shoal.policies.base.feasible_counts`, never below
      ``min_gpus``), so it waited at least ``now − submitted_at − A / max(1, min_gpus)``,
      and at least its current spell ``now − since``; the larger of the two is returned.
      That is exact when every share the job held had ``min_gpus`` GPUs (a non-elastic
      job, or an elastic one that only ever ran on its minimum) and a lower bound
      otherwise (a job that held more GPUs waited longer than this says).

    Durations are clipped at 0 (a ``now`` behind the events' stamps).
    """
    waited = max(0.0, now - job.submitted_at)
    service = job.attained_service_gpu_s
    if service <= 0.0:
        return waited
    spell = max(0.0, now - job.since)
    return min(waited, max(spell, waited - service / max(1, job.spec.min_gpus)))


def queue_metrics(state: st.ClusterState, now: float, catalog: Catalog | None = None) -> QueueMetrics:
    """QL, CE and BI of AFS §2.2 from the folded state at time ``now``.

    The definitions are those of :mod:`shoal.sim.metrics` (the simulator's series), read
    from what the state knows:

    * Running: an active job with a positive share in the newest ``SharesDecided``;
      pending (J_P): an active job without one. A job counts on its share also during
      its reconfiguration stop, as in the simulator.
    * ``thr_j(k)``: the throughput curve the allocator's policy sees for the job,
      :func:`shoal.view.build_view` with the same ``catalog`` (the job's newest
      ``ThroughputModelUpdated`` for its pinned/current/"" GPU type, else for any type,
      else the catalog's curve for ``spec.model``, else linear scaling, ``k``
      iterations/s at k GPUs). So a
      job with no model and no catalog curve counts ``k`` at k GPUs, the policy's
      own belief until the profiler measures it (AFS §4.5's overestimate; a live CE
      can therefore exceed what the jobs really achieve). A job whose curve is 0 at
      1 GPU adds nothing to CE, and a pending one adds 0 to BI's sum.
    * M: the healthy GPUs of the nodes that are up (the view's ``total_gpus``); CE is
      0 when there are none.
    * ``remaining_time_j(1 GPU) = remaining iterations / thr_j(1)``, remaining
      iterations as the view has them: ``total_iterations`` (or, for a job with only a
      convergence target, the profiler's ``estimated_total_iterations``) minus the last
      reported iteration. A pending job with neither (unknown length, no estimate yet)
      has no remaining time: it is left out of BI's sum and of its |J_P|
      (:attr:`QueueMetrics.bi_jobs`), though it counts in QL. A pending job with no
      work left adds 0 to the sum and counts in |J_P|, as in the simulator.
    * ``pending_time_j``: :func:`pending_time` (exact for a job that never held GPUs;
      see there for a job that did).
    """
    view = build_view(state, now=now, catalog=catalog)
    shares = state.shares
    ql = 0
    ce_sum = 0.0
    bi_sum = 0.0
    bi_jobs = 0
    for jv in view.jobs:
        gpus = shares.get(jv.job_id, 0)
        one = throughput_at(jv, 1)
        if gpus > 0:
            if one > 0.0:
                ce_sum += throughput_at(jv, gpus) / one
            continue
        ql += 1
        if jv.remaining_iterations is None:
            continue
        bi_jobs += 1
        if one > 0.0 and jv.remaining_iterations > 0.0:
            remaining_1gpu = jv.remaining_iterations / one
            bi_sum += pending_time(state.jobs[jv.job_id], now) / remaining_1gpu
    return QueueMetrics(
        ql=ql,
        ce=ce_sum / view.total_gpus if view.total_gpus else 0.0,
        bi=bi_sum / bi_jobs if bi_jobs else 0.0,
        bi_jobs=bi_jobs,
    )


def state_gauges(
    state: st.ClusterState, *, now: float | None = None, catalog: Catalog | None = None
) -> Iterator[Gauge]:
    """The gauges of the folded cluster state (names without the ``shoal_`` prefix).

    ``now`` is the time QL/CE/BI are computed at (:func:`queue_metrics`; default: the
    newest folded event's time, ``state.clock``), ``catalog`` their fallback curves."""
    pending = sum(1 for j in state.jobs.values() if j.status == st.PENDING)
    active = sum(1 for j in state.jobs.values() if j.status not in st.FINISHED_STATUSES)
    total = state.total_gpus()
    allocated = sum(state.shares.values())
    queue = queue_metrics(state, state.clock if now is None else now, catalog)
    yield Gauge("epoch", "Allocation epoch: the newest SharesDecided folded.", state.shares_epoch)
    yield Gauge("placement_epoch", "The newest PlacementDecided epoch folded.", state.placement_epoch)
    yield Gauge("jobs_pending", "Jobs submitted and not yet running (the queue).", pending)
    yield Gauge("jobs_active", "Jobs not finished (pending or running).", active)
    yield Gauge(
        "queue_length", "QL of AFS §2.2: active jobs that hold no GPU in the current shares.", queue.ql
    )
    yield Gauge(
        "cluster_efficiency",
        "CE of AFS §2.2: sum over running jobs of thr(share)/thr(1 GPU), over the healthy GPUs.",
        queue.ce,
    )
    yield Gauge(
        "blocking_index",
        "BI of AFS §2.2: mean over pending jobs of time without GPUs / remaining time on 1 GPU.",
        queue.bi,
    )
    utils = [
        g.utilization for n in state.nodes.values() if n.status == st.NODE_UP for g in n.gpus if g.healthy
    ]
    yield Gauge(
        "gpu_utilization",
        "Mean utilisation of the healthy GPUs of the nodes that are up, as their node daemons "
        "last logged it (GpuHealth, written when it changes by a step; 0 when there are none).",
        sum(utils) / len(utils) if utils else 0.0,
    )
    yield Gauge("gpus_total", "GPUs of the nodes that are up.", total)
    yield Gauge("gpus_allocated", "GPUs in the current shares.", allocated)
    yield Gauge(
        "gpu_allocation_ratio",
        "GPUs allocated / GPUs of the nodes that are up (0 when there are none).",
        allocated / total if total else 0.0,
    )

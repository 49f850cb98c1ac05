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
placement epoch, pending jobs (the queue), active jobs (not finished), GPUs of the
nodes that are up, GPUs allocated (the current shares) and their ratio. Every process
that folds the log computes the same values; a scrape of any one service gives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from shoal import state as st

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


def state_gauges(state: st.ClusterState) -> Iterator[Gauge]:
    """The gauges of the folded cluster state (names without the ``shoal_`` prefix)."""
    pending = sum(1 for j in state.jobs.values() if j.status == st.PENDING)
    active = sum(1 for j in state.jobs.values() if j.status not in st.FINISHED_STATUSES)
    total = state.total_gpus()
    allocated = sum(state.shares.values())
    yield Gauge("epoch", "Allocation epoch: the newest SharesDecided folded.", state.shares_epoch)
    yield Gauge("placement_epoch", "The newest PlacementDecided epoch folded.", state.placement_epoch)
    yield Gauge("jobs_pending", "Jobs submitted and not yet running (the queue).", pending)
    yield Gauge("jobs_active", "Jobs not finished (pending or running).", active)
    yield Gauge(
        "queue_length",
        "QL of AFS §2.2: active jobs that hold no GPU in the current shares.",
        sum(
            1
            for job_id, j in state.jobs.items()
            if j.status not in st.FINISHED_STATUSES and state.shares.get(job_id, 0) == 0
        ),
    )
    yield Gauge("gpus_total", "GPUs of the nodes that are up.", total)
    yield Gauge("gpus_allocated", "GPUs in the current shares.", allocated)
    yield Gauge(
        "gpu_allocation_ratio",
        "GPUs allocated / GPUs of the nodes that are up (0 when there are none).",
        allocated / total if total else 0.0,
    )

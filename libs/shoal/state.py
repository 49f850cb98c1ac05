"""The cluster state and the one fold that builds it from the log.

``apply(state, envelope) -> state`` is deterministic and does no I/O: it reads only
the state and the envelope (including the envelope's occurred-at time, never the
wall clock). For speed it updates ``state`` in place and returns it: whoever owns a
state folds into it, and anyone who needs a frozen view takes :func:`copy_state`.

An event the fold does not know is ignored (the reader counts it), never a crash.
Events that contradict the state (progress for an unknown job, a stale epoch) are
ignored too: the log is the truth, and the fold must accept any log a writer
produced, including one written by a newer version.

Attained service (GPU-seconds a job was allocated, as Tiresias and AFS-P count it)
is settled lazily: each job remembers its current share and since when, and the
fold adds ``gpus × (t − since)`` whenever the share changes or the job ends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from msgspec import Struct

from shoal import events as ev
from shoal.events import Envelope, GpuRef, JobSpec

# Job status values.
PENDING = "pending"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
REJECTED = "rejected"
FINISHED_STATUSES = frozenset({COMPLETED, FAILED, CANCELLED, REJECTED})

# Node status values.
NODE_UP = "up"
NODE_LOST = "lost"
NODE_DRAINED = "drained"


class UserState(Struct, kw_only=True):
    tickets: int = 100
    max_active_jobs: int = 0
    max_gpus: int = 0
    registered: bool = False


class ThroughputModel(Struct, kw_only=True):
    model_kind: str = "table"
    params: tuple[float, ...] = ()
    throughput: tuple[tuple[int, float], ...] = ()
    """(GPU count, iterations/s) pairs sorted by count; a tuple, not a dict, so
    the state stays canonical for :func:`digest`."""
    samples: int = 0
    overestimated: bool = False
    measured: tuple[int, ...] = ()
    """GPU counts whose value is a measurement (``ThroughputModelUpdated.measured``)."""


class Convergence(Struct, kw_only=True):
    beta0: float
    beta1: float
    beta2: float
    estimated_total_iterations: int
    samples: int = 0


class JobState(Struct, kw_only=True):
    spec: JobSpec
    status: str = PENDING
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    reason: str = ""
    gpus: int = 0
    """Current share (GPUs), from the newest SharesDecided."""
    gpu_type: str = ""
    since: float = 0.0
    """When the current share took effect (for service accounting)."""
    attained_service_gpu_s: float = 0.0
    placement: tuple[GpuRef, ...] = ()
    iteration: int = 0
    last_loss: float | None = None
    samples_per_s: float = 0.0
    last_progress_at: float | None = None
    reconf_epoch: int = 0
    """Newest reconfiguration epoch the job reported as completed."""
    world_size: int = 0
    reconfigurations: int = 0
    stop_time_s: float = 0.0
    """Total time all workers were stopped by reconfigurations."""
    throughput_models: dict[str, ThroughputModel] = {}
    convergence: Convergence | None = None


class GpuState(Struct, kw_only=True):
    gpu_type: str
    memory_mb: int = 0
    uuid: str = ""
    healthy: bool = True
    utilization: float = 0.0
    memory_used_mb: int = 0


class NodeState(Struct, kw_only=True):
    gpus: list[GpuState]
    hostname: str = ""
    emulated: bool = False
    status: str = NODE_UP
    registered_at: float = 0.0
    last_heartbeat_at: float = 0.0


class TradeState(Struct, kw_only=True):
    buyer: str
    seller: str
    fast_type: str
    slow_type: str
    fast_gpus: int
    slow_gpus: int
    price: float
    executed_at: float
    undone_at: float | None = None


class ClusterState(Struct, kw_only=True):
    """Everything a service needs to decide, rebuilt from the log."""

    users: dict[str, UserState] = {}
    jobs: dict[str, JobState] = {}
    nodes: dict[str, NodeState] = {}
    shares_epoch: int = 0
    shares: dict[str, int] = {}
    """Current non-zero shares of active jobs (an index: the fold touches only
    these and the new decision's jobs, never every job ever submitted)."""
    placement_epoch: int = 0
    placed: dict[str, int] = {}
    """Active jobs that currently have a placement -> number of GPUs placed."""
    policy: str = ""
    policy_memory: dict[str, Any] = {}
    trades: dict[str, TradeState] = {}
    clock: float = 0.0
    """Occurred-at of the newest applied event (max seen)."""

    # -- small read helpers (pure) -------------------------------------------------

    def active_jobs(self) -> list[str]:
        return [j for j, s in self.jobs.items() if s.status not in FINISHED_STATUSES]

    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes.values() if n.status == NODE_UP)

    def service_at(self, job_id: str, now: float) -> float:
        """Attained GPU-seconds of a job up to ``now`` (settles the open interval)."""
        job = self.jobs[job_id]
        if job.status in FINISHED_STATUSES or job.gpus == 0:
            return job.attained_service_gpu_s
        return job.attained_service_gpu_s + job.gpus * max(0.0, now - job.since)


# ---------------------------------------------------------------------------
# The fold
# ---------------------------------------------------------------------------


def _settle(job: JobState, at: float) -> None:
    if job.gpus:
        job.attained_service_gpu_s += job.gpus * max(0.0, at - job.since)
    job.since = at


def _finish(state: ClusterState, job_id: str, status: str, at: float, reason: str = "") -> None:
    job = state.jobs.get(job_id)
    if job is None or job.status in FINISHED_STATUSES:
        return
    _settle(job, at)
    job.status = status
    job.finished_at = at
    job.reason = reason
    state.shares.pop(job_id, None)
    state.placed.pop(job_id, None)
    job.gpus = 0
    job.placement = ()
    job.world_size = 0


def _user_registered(state: ClusterState, e: ev.UserRegistered, at: float) -> None:
    state.users[e.user] = UserState(
        tickets=e.tickets, max_active_jobs=e.max_active_jobs, max_gpus=e.max_gpus, registered=True
    )


def _tickets_set(state: ClusterState, e: ev.TicketsSet, at: float) -> None:
    user = state.users.get(e.user)
    if user is None:
        state.users[e.user] = UserState(tickets=e.tickets)
    else:
        user.tickets = e.tickets


def _job_submitted(state: ClusterState, e: ev.JobSubmitted, at: float) -> None:
    if e.job_id in state.jobs:
        return  # idempotent: the first submission wins
    job = state.jobs[e.job_id] = JobState(spec=e.spec, submitted_at=at, since=at)
    for gpu_type, table in sorted(e.spec.profile.items()):
        job.throughput_models[gpu_type] = ThroughputModel(
            model_kind="profile", throughput=tuple(sorted(table.items()))
        )
    if e.spec.user not in state.users:
        state.users[e.spec.user] = UserState()


def _job_rejected(state: ClusterState, e: ev.JobRejected, at: float) -> None:
    _finish(state, e.job_id, REJECTED, at, e.reason)


def _job_started(state: ClusterState, e: ev.JobStarted, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is not None and job.status == PENDING:
        job.status = RUNNING
        job.started_at = at


def _progress(state: ClusterState, e: ev.ProgressReported, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is None or job.status in FINISHED_STATUSES:
        return
    if e.iteration >= job.iteration:
        job.iteration = e.iteration
        job.last_loss = e.loss
        job.samples_per_s = e.samples_per_s
        job.last_progress_at = at
    if job.status == PENDING:
        job.status = RUNNING
        job.started_at = at


def _job_completed(state: ClusterState, e: ev.JobCompleted, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is not None and e.iterations > job.iteration:
        job.iteration = e.iterations
    _finish(state, e.job_id, COMPLETED, at)


def _job_failed(state: ClusterState, e: ev.JobFailed, at: float) -> None:
    _finish(state, e.job_id, FAILED, at, e.reason)


def _job_cancelled(state: ClusterState, e: ev.JobCancelled, at: float) -> None:
    _finish(state, e.job_id, CANCELLED, at, e.reason)


def _node_registered(state: ClusterState, e: ev.NodeRegistered, at: float) -> None:
    state.nodes[e.node_id] = NodeState(
        gpus=[GpuState(gpu_type=g.gpu_type, memory_mb=g.memory_mb, uuid=g.uuid) for g in e.gpus],
        hostname=e.hostname,
        emulated=e.emulated,
        registered_at=at,
        last_heartbeat_at=at,
    )


def _node_heartbeat(state: ClusterState, e: ev.NodeHeartbeat, at: float) -> None:
    node = state.nodes.get(e.node_id)
    if node is not None and at > node.last_heartbeat_at:
        node.last_heartbeat_at = at  # the newest stamp: one that arrives late changes nothing


def _gpu_health(state: ClusterState, e: ev.GpuHealth, at: float) -> None:
    node = state.nodes.get(e.node_id)
    if node is None or e.index >= len(node.gpus):
        return
    gpu = node.gpus[e.index]
    gpu.healthy = e.healthy
    gpu.utilization = e.utilization
    gpu.memory_used_mb = e.memory_used_mb


def _node_lost(state: ClusterState, e: ev.NodeLost, at: float) -> None:
    node = state.nodes.get(e.node_id)
    if node is not None:
        node.status = NODE_LOST


def _node_drained(state: ClusterState, e: ev.NodeDrained, at: float) -> None:
    node = state.nodes.get(e.node_id)
    if node is not None:
        node.status = NODE_DRAINED


def _shares_decided(state: ClusterState, e: ev.SharesDecided, at: float) -> None:
    if e.epoch <= state.shares_epoch and state.shares_epoch:
        return  # a stale or repeated decision changes nothing
    state.shares_epoch = e.epoch
    state.policy = e.policy
    state.policy_memory = e.policy_memory
    jobs = state.jobs
    types = e.gpu_types
    decided = e.shares
    for job_id in state.shares.keys() - decided.keys():
        job = jobs[job_id]
        _settle(job, at)
        job.gpus = 0
        job.gpu_type = ""
    # The positive shares of live jobs, in the event's order: a copy of the event's,
    # less the (rare) shares of unknown or finished jobs and zero shares.
    new_shares = dict(decided)
    for job_id, gpus in decided.items():
        maybe = jobs.get(job_id)
        if maybe is None or maybe.status in FINISHED_STATUSES:
            del new_shares[job_id]
            continue
        job = maybe
        gpu_type = types.get(job_id, "") if types else ""
        if gpus != job.gpus or gpu_type != job.gpu_type:
            _settle(job, at)
            job.gpus = gpus
            job.gpu_type = gpu_type
        if not gpus:
            del new_shares[job_id]
    state.shares = new_shares


def _placement_decided(state: ClusterState, e: ev.PlacementDecided, at: float) -> None:
    if e.epoch < state.placement_epoch:
        return
    state.placement_epoch = e.epoch
    jobs = state.jobs
    for job_id in state.placed.keys() - e.placements.keys():
        jobs[job_id].placement = ()
    placed: dict[str, int] = {}
    for job_id, gpus in e.placements.items():
        job = jobs.get(job_id)
        if job is None or job.status in FINISHED_STATUSES:
            continue
        job.placement = gpus
        if gpus:
            placed[job_id] = len(gpus)
    state.placed = placed


def _reconf_started(state: ClusterState, e: ev.ReconfigurationStarted, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is not None and job.status == PENDING and e.to_world > 0:
        job.status = RUNNING
        job.started_at = at


def _reconf_completed(state: ClusterState, e: ev.ReconfigurationCompleted, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is None or job.status in FINISHED_STATUSES or e.epoch < job.reconf_epoch:
        return
    job.reconf_epoch = e.epoch
    job.world_size = e.world_size
    job.reconfigurations += 1
    job.stop_time_s += e.stop_time_s
    if job.status == PENDING and e.world_size > 0:
        job.status = RUNNING
        job.started_at = at


def _throughput_model(state: ClusterState, e: ev.ThroughputModelUpdated, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is None:
        return
    job.throughput_models[e.gpu_type] = ThroughputModel(
        model_kind=e.model_kind,
        params=e.params,
        throughput=tuple(sorted(e.throughput.items())),
        samples=e.samples,
        overestimated=e.overestimated,
        measured=tuple(e.measured),
    )


def _convergence(state: ClusterState, e: ev.ConvergenceEstimated, at: float) -> None:
    job = state.jobs.get(e.job_id)
    if job is None:
        return
    job.convergence = Convergence(
        beta0=e.beta0,
        beta1=e.beta1,
        beta2=e.beta2,
        estimated_total_iterations=e.estimated_total_iterations,
        samples=e.samples,
    )


def _trade_executed(state: ClusterState, e: ev.TradeExecuted, at: float) -> None:
    state.trades[e.trade_id] = TradeState(
        buyer=e.buyer,
        seller=e.seller,
        fast_type=e.fast_type,
        slow_type=e.slow_type,
        fast_gpus=e.fast_gpus,
        slow_gpus=e.slow_gpus,
        price=e.price,
        executed_at=at,
    )


def _trade_undone(state: ClusterState, e: ev.TradeUndone, at: float) -> None:
    trade = state.trades.get(e.trade_id)
    if trade is not None and trade.undone_at is None:
        trade.undone_at = at


def _ignore(state: ClusterState, e: Any, at: float) -> None:
    return None


_HANDLERS: dict[type, Callable[[ClusterState, Any, float], None]] = {
    ev.UserRegistered: _user_registered,
    ev.TicketsSet: _tickets_set,
    ev.JobSubmitted: _job_submitted,
    ev.JobRejected: _job_rejected,
    ev.JobStarted: _job_started,
    ev.ProgressReported: _progress,
    ev.JobCompleted: _job_completed,
    ev.JobFailed: _job_failed,
    ev.JobCancelled: _job_cancelled,
    ev.NodeRegistered: _node_registered,
    ev.NodeHeartbeat: _node_heartbeat,
    ev.GpuHealth: _gpu_health,
    ev.NodeLost: _node_lost,
    ev.NodeDrained: _node_drained,
    ev.SharesDecided: _shares_decided,
    ev.PlacementDecided: _placement_decided,
    ev.ReconfigurationRequested: _ignore,
    ev.ReconfigurationStarted: _reconf_started,
    ev.ReconfigurationPhase: _ignore,
    ev.ReconfigurationCompleted: _reconf_completed,
    ev.ReconfigurationCancelled: _ignore,
    ev.ReconfigurationFailed: _ignore,
    ev.ThroughputModelUpdated: _throughput_model,
    ev.ConvergenceEstimated: _convergence,
    ev.TradeExecuted: _trade_executed,
    ev.TradeUndone: _trade_undone,
}
assert set(_HANDLERS) == set(ev.EVENT_TYPES), "every event type needs a fold handler"


def apply(state: ClusterState, envelope: Envelope) -> ClusterState:
    """Fold one event into the state and return the state.

    Args:
        state: the state to fold into (owned by the caller; updated in place).
        envelope: the event with its occurred-at time.

    Returns:
        The same ``state`` object, now including ``envelope``.
    """
    at = envelope.at
    if at > state.clock:
        state.clock = at
    handler = _HANDLERS.get(type(envelope.event))
    if handler is not None:
        handler(state, envelope.event, at)
    return state


def apply_event(state: ClusterState, event: ev.Event, at: float) -> ClusterState:
    """Fold a bare event at time ``at`` (the simulator's and the tests' shortcut)."""
    if at > state.clock:
        state.clock = at
    handler = _HANDLERS.get(type(event))
    if handler is not None:
        handler(state, event, at)
    return state


def fold(envelopes: Iterable[Envelope], state: ClusterState | None = None) -> ClusterState:
    """Fold a whole history, starting from ``state`` or an empty one."""
    state = ClusterState() if state is None else state
    for env in envelopes:
        apply(state, env)
    return state


_DIGEST_ENC = msgspec.msgpack.Encoder(order="deterministic")
_STATE_ENC = msgspec.msgpack.Encoder()
_STATE_DEC = msgspec.msgpack.Decoder(ClusterState)


def digest(state: ClusterState) -> str:
    """A stable SHA-256 of the state (dict keys sorted, so insertion order never matters)."""
    try:
        data = _DIGEST_ENC.encode(state)
    except TypeError:
        # msgpack sorts only str keys; a job spec's profile is keyed by GPU count.
        data = _DIGEST_ENC.encode(msgspec.to_builtins(state, str_keys=True))
    return hashlib.sha256(data).hexdigest()


def encode_state(state: ClusterState) -> bytes:
    return _STATE_ENC.encode(state)


def decode_state(data: bytes) -> ClusterState:
    return _STATE_DEC.decode(data)


def copy_state(state: ClusterState) -> ClusterState:
    """A deep, independent copy (through the codec, which is fast and exact)."""
    return decode_state(encode_state(state))

"""The event contract: every fact and command shoal puts on the bus.

Each type is a frozen ``msgspec.Struct`` with an explicit dotted tag, so renaming a
class never changes the wire. Facts are past tense and go to the JetStream event
stream; commands are imperative and travel by request/reply (or a work queue).

Wire format: an :class:`Envelope` (event id, type, schema version, occurred-at,
causation id, correlation id) whose ``event`` field holds the tagged payload,
encoded as msgpack. Readers decode in one pass; when that fails they decode the
envelope alone to tell an *unknown* type (skipped and counted: an older reader
survives a newer writer) from a *malformed* payload (a clear error, dead-lettered).

Evolution rules: add optional fields with defaults; never reuse or retype a field;
a breaking change is a new tag (plus an upcaster in :mod:`shoal.codec`). A reader
skips (counts and dead-letters) an envelope whose ``v`` is above its own ``version``
of the type, as it does an unknown type: raising ``version`` hides the events from
every older reader.

Subjects are per aggregate (``<prefix>.job.<job_id>.<name>``,
``<prefix>.node.<node_id>.<name>``, ``<prefix>.alloc.<name>`` …) so a writer can
append with ``Nats-Expected-Last-Subject-Sequence``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta, Struct

# ---------------------------------------------------------------------------
# Constrained scalars. The constraints are checked on decode (bus and admission)
# and appear in the exported JSON Schema.
# ---------------------------------------------------------------------------

# Patterns end in ``$(?!\n)``: msgspec matches with ``re.search``, where a bare ``$`` also
# matches before a trailing newline ("j1\n" would pass); ``(?!\n)`` closes that gap and
# is also valid in JSON Schema (ECMA-262) regexes, where ``\Z`` is not.


def whole(chars: str, times: str = "*") -> str:
    """A regex matching a whole string of ``chars`` repeated ``times`` (no trailing newline)."""
    return f"^[{chars}]{times}$(?!\\n)"


Id = Annotated[str, Meta(pattern=whole("A-Za-z0-9_-", "{1,128}"), description="token-safe id (no dots)")]
UserName = Annotated[str, Meta(pattern=whole("A-Za-z0-9_-", "{1,64}"))]
GpuCount = Annotated[int, Meta(ge=1, le=100_000)]
INT64_MAX = 2**63 - 1
"""Largest integer a field takes. msgpack carries 64-bit integers at most, so a larger
one (JSON allows it) is refused on decode instead of failing when the event is encoded."""
NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Epoch = Annotated[int, Meta(ge=0, le=INT64_MAX)]
GpuType = Annotated[str, Meta(pattern=whole("A-Za-z0-9_.-", "{1,32}"))]
ShortText = Annotated[str, Meta(max_length=4096)]
MAX_FINITE = 1e12
"""Upper bound of user-given floats (``convergence_target``, ``profile`` rates): it
refuses infinity, and ``gt``/``ge`` refuse NaN."""

#: Largest accepted encoded message, in bytes. Bigger messages are rejected at the bus.
MAX_MESSAGE_BYTES = 256 * 1024


# ---------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------


class JobSpec(Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """What a user asks for. Exactly one of ``total_iterations`` (known length) and
    ``convergence_target`` (unknown length; the profiler estimates it) must be set:
    admission rejects a submission with neither or both (``invalid_spec``).

    Unknown fields are ignored when an event is decoded (an older reader survives a
    newer writer); a *command* with an unknown field is rejected, see
    :func:`shoal.codec.decode_command`."""

    user: UserName
    name: Annotated[str, Meta(max_length=256)] = ""
    """Display name. Admission refuses control characters in it (and in ``model``); the
    type does not, so that an older log holding one still decodes."""
    model: Annotated[str, Meta(max_length=128)] = ""
    """Model or job-type tag; selects a throughput profile (e.g. ``resnet50``)."""
    min_gpus: GpuCount = 1
    max_gpus: GpuCount = 1
    requested_gpus: GpuCount = 1
    allowed_gpu_counts: tuple[GpuCount, ...] | None = None
    """The SideCar paper's "optional numbers of GPUs" (e.g. 1, 2, 4, 8)."""
    elastic: bool = True
    global_batch_size: NonNegInt = 0
    total_iterations: Annotated[int, Meta(ge=1, le=INT64_MAX)] | None = None
    convergence_target: Annotated[float, Meta(gt=0, le=MAX_FINITE)] | None = None
    """Target training loss at which the job is done (unknown length): a finite number > 0."""
    gpu_type: GpuType | None = None
    """Pin the job to one GPU generation."""
    priority: Int64 = 0
    entrypoint: tuple[Annotated[str, Meta(max_length=4096)], ...] = ()
    """Command for real mode (argv)."""
    profile: dict[str, dict[GpuCount, Annotated[float, Meta(ge=0, le=MAX_FINITE)]]] = {}
    """Throughput known ahead (an offline profile, or a trace's calibrated curve):
    GPU type ("" = any) -> GPU count -> iterations/s. Used until the profiler has
    measured the job; empty when unknown."""
    env: dict[str, str] = {}


class GpuInfo(Struct, frozen=True, kw_only=True):
    index: NonNegInt
    gpu_type: GpuType
    memory_mb: NonNegInt = 0
    uuid: str = ""


class GpuRef(Struct, frozen=True, array_like=True, order=True):
    """One GPU: node id and index on that node."""

    node_id: Id
    index: NonNegInt


# ---------------------------------------------------------------------------
# Events (facts)
# ---------------------------------------------------------------------------


class Event(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every fact. Subclasses set ``aggregate`` and ``key_field``."""

    aggregate: ClassVar[str] = ""
    key_field: ClassVar[str | None] = None
    version: ClassVar[int] = 1


def _tag(cls: type[Event]) -> str:
    return cls.__struct_config__.tag  # type: ignore[return-value]


# --- users and tickets -------------------------------------------------------


class UserRegistered(Event, frozen=True, tag="user.registered"):
    aggregate: ClassVar[str] = "user"
    key_field: ClassVar[str | None] = "user"
    user: UserName
    tickets: NonNegInt = 100
    max_active_jobs: NonNegInt = 0
    """0 means no limit."""
    max_gpus: NonNegInt = 0
    """0 means no limit."""


class TicketsSet(Event, frozen=True, tag="user.tickets_set"):
    aggregate: ClassVar[str] = "user"
    key_field: ClassVar[str | None] = "user"
    user: UserName
    tickets: NonNegInt


# --- job lifecycle ------------------------------------------------------------


class JobSubmitted(Event, frozen=True, tag="job.submitted"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    spec: JobSpec


class JobRejected(Event, frozen=True, tag="job.rejected"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    code: str
    reason: ShortText


class JobStarted(Event, frozen=True, tag="job.started"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch = 0


class ProgressReported(Event, frozen=True, tag="job.progress"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    iteration: NonNegInt
    """Iterations completed so far (cumulative)."""
    loss: float | None = None
    samples_per_s: NonNegFloat = 0.0
    num_gpus: NonNegInt = 0
    gpu_type: str = ""
    step_time_s: NonNegFloat = 0.0
    epoch: Epoch = 0
    """Allocation epoch the job was running under."""
    data_epoch: NonNegInt = 0


class JobCompleted(Event, frozen=True, tag="job.completed"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    iterations: NonNegInt = 0


class JobFailed(Event, frozen=True, tag="job.failed"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    reason: ShortText


class JobCancelled(Event, frozen=True, tag="job.cancelled"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    reason: ShortText = ""


# --- nodes and GPUs -----------------------------------------------------------


class NodeRegistered(Event, frozen=True, tag="node.registered"):
    aggregate: ClassVar[str] = "node"
    key_field: ClassVar[str | None] = "node_id"
    node_id: Id
    gpus: tuple[GpuInfo, ...]
    hostname: str = ""
    emulated: bool = False


class NodeHeartbeat(Event, frozen=True, tag="node.heartbeat"):
    aggregate: ClassVar[str] = "node"
    key_field: ClassVar[str | None] = "node_id"
    node_id: Id
    seq: NonNegInt = 0


class GpuHealth(Event, frozen=True, tag="node.gpu_health"):
    aggregate: ClassVar[str] = "node"
    key_field: ClassVar[str | None] = "node_id"
    node_id: Id
    index: NonNegInt
    healthy: bool = True
    utilization: Annotated[float, Meta(ge=0, le=1)] = 0.0
    memory_used_mb: NonNegInt = 0
    temperature_c: float = 0.0


class NodeLost(Event, frozen=True, tag="node.lost"):
    aggregate: ClassVar[str] = "node"
    key_field: ClassVar[str | None] = "node_id"
    node_id: Id
    reason: ShortText = ""


class NodeDrained(Event, frozen=True, tag="node.drained"):
    aggregate: ClassVar[str] = "node"
    key_field: ClassVar[str | None] = "node_id"
    node_id: Id
    reason: ShortText = ""


# --- allocation -----------------------------------------------------------------


class SharesDecided(Event, frozen=True, tag="alloc.shares_decided"):
    """The allocator's decision: GPUs per job at ``epoch`` (strictly increasing)."""

    aggregate: ClassVar[str] = "alloc"
    epoch: Epoch
    shares: dict[str, NonNegInt]
    """job id -> number of GPUs. Jobs absent from the map get 0."""
    gpu_types: dict[str, str] = {}
    """job id -> GPU generation it runs on (heterogeneous clusters only)."""
    policy: str = ""
    trigger: str = ""
    """What caused the decision: arrival, completion, model_update, node_change, trade, tick."""
    policy_memory: dict[str, Any] = {}
    """Policy state after this decision (stride passes, lease counters …), so that a
    replayed allocator decides exactly what the live one did."""


class PlacementDecided(Event, frozen=True, tag="alloc.placement_decided"):
    aggregate: ClassVar[str] = "alloc"
    epoch: Epoch
    placements: dict[str, tuple[GpuRef, ...]]
    """job id -> the concrete GPUs it runs on."""
    migrations: NonNegInt = 0
    decided_at: float = 0.0
    """Occurred-at of the ``SharesDecided`` this placement realises: the instant the
    new shares take effect (0 = unknown)."""


# --- reconfiguration --------------------------------------------------------------


class ReconfigurationRequested(Event, frozen=True, tag="reconf.requested"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch
    gpus: tuple[GpuRef, ...]


class ReconfigurationStarted(Event, frozen=True, tag="reconf.started"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch
    kind: str = ""
    """scale_out (stop-free), scale_in (graceful), restart (checkpoint-restart), start, stop."""
    from_world: NonNegInt = 0
    to_world: NonNegInt = 0


class ReconfigurationPhase(Event, frozen=True, tag="reconf.phase"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch
    phase: str
    duration_s: NonNegFloat = 0.0


class ReconfigurationCompleted(Event, frozen=True, tag="reconf.completed"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch
    world_size: NonNegInt
    gpus: tuple[GpuRef, ...] = ()
    stop_time_s: NonNegFloat = 0.0
    """How long all workers were stopped."""
    duration_s: NonNegFloat = 0.0


class ReconfigurationCancelled(Event, frozen=True, tag="reconf.cancelled"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch
    by_epoch: Epoch
    reason: ShortText = ""


class ReconfigurationFailed(Event, frozen=True, tag="reconf.failed"):
    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    epoch: Epoch
    reason: ShortText


# --- profiling ------------------------------------------------------------------------


class ThroughputModelUpdated(Event, frozen=True, tag="profile.throughput_model_updated"):
    """A fitted speed function for one job on one GPU generation.

    ``params`` are the model's coefficients (for ``optimus-allreduce``: θ0..θ3 of
    f(w) = (θ0·M/w + θ1 + θ2·(w−1)/w + θ3·w)⁻¹); ``throughput`` caches the
    predicted iterations/s at each GPU count that matters.
    """

    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    gpu_type: str
    model_kind: str = "table"
    params: tuple[float, ...] = ()
    throughput: dict[int, NonNegFloat] = {}
    samples: NonNegInt = 0
    overestimated: bool = False
    """True while some count up to the job's ``max_gpus`` is AFS §4.5's optimistic
    estimate rather than a measurement."""
    measured: tuple[int, ...] = ()
    """The GPU counts whose ``throughput`` is a measurement, increasing (empty: not
    said, e.g. a profile or a trace's table). The allocator reads it to take a job
    on the §4.5 estimate through its smaller allocatable units
    (:func:`shoal.profiling.overestimate.probe_shares`)."""


class ConvergenceEstimated(Event, frozen=True, tag="profile.convergence_estimated"):
    """Optimus §3.1 fit l = 1/(β0·k+β1)+β2 and the iterations it predicts."""

    aggregate: ClassVar[str] = "job"
    key_field: ClassVar[str | None] = "job_id"
    job_id: Id
    beta0: float
    beta1: float
    beta2: float
    estimated_total_iterations: NonNegInt
    samples: NonNegInt = 0


# --- trading -------------------------------------------------------------------------


class TradeExecuted(Event, frozen=True, tag="trade.executed"):
    """Gandiva_fair §3.4: ``buyer`` gets ``fast_gpus`` of ``fast_type`` from ``seller``
    and pays ``slow_gpus`` of ``slow_type``; ``price`` is slow GPUs per fast GPU."""

    aggregate: ClassVar[str] = "trade"
    trade_id: Id
    buyer: UserName
    seller: UserName
    fast_type: str
    slow_type: str
    fast_gpus: NonNegInt
    slow_gpus: NonNegInt
    price: NonNegFloat


class TradeUndone(Event, frozen=True, tag="trade.undone"):
    aggregate: ClassVar[str] = "trade"
    trade_id: Id
    reason: ShortText = ""


EVENT_TYPES: tuple[type[Event], ...] = (
    UserRegistered,
    TicketsSet,
    JobSubmitted,
    JobRejected,
    JobStarted,
    ProgressReported,
    JobCompleted,
    JobFailed,
    JobCancelled,
    NodeRegistered,
    NodeHeartbeat,
    GpuHealth,
    NodeLost,
    NodeDrained,
    SharesDecided,
    PlacementDecided,
    ReconfigurationRequested,
    ReconfigurationStarted,
    ReconfigurationPhase,
    ReconfigurationCompleted,
    ReconfigurationCancelled,
    ReconfigurationFailed,
    ThroughputModelUpdated,
    ConvergenceEstimated,
    TradeExecuted,
    TradeUndone,
)

AnyEvent = (
    UserRegistered
    | TicketsSet
    | JobSubmitted
    | JobRejected
    | JobStarted
    | ProgressReported
    | JobCompleted
    | JobFailed
    | JobCancelled
    | NodeRegistered
    | NodeHeartbeat
    | GpuHealth
    | NodeLost
    | NodeDrained
    | SharesDecided
    | PlacementDecided
    | ReconfigurationRequested
    | ReconfigurationStarted
    | ReconfigurationPhase
    | ReconfigurationCompleted
    | ReconfigurationCancelled
    | ReconfigurationFailed
    | ThroughputModelUpdated
    | ConvergenceEstimated
    | TradeExecuted
    | TradeUndone
)

EVENT_BY_TAG: dict[str, type[Event]] = {_tag(cls): cls for cls in EVENT_TYPES}


# ---------------------------------------------------------------------------
# Commands (imperative; request/reply)
# ---------------------------------------------------------------------------


class Command(Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every command."""

    name: ClassVar[str] = ""


class SubmitJob(Command, frozen=True, tag="cmd.submit_job"):
    name: ClassVar[str] = "submit_job"
    spec: JobSpec
    job_id: Id | None = None
    """Client-supplied id; makes submission idempotent."""
    submitted_at: float | None = None
    """Trace replay only: the arrival instant to record (virtual seconds). Admission
    rejects it unless the installation replays traces (``accept_submitted_at``)."""


class CancelJob(Command, frozen=True, tag="cmd.cancel_job"):
    name: ClassVar[str] = "cancel_job"
    job_id: Id
    reason: ShortText = ""


class SetTickets(Command, frozen=True, tag="cmd.set_tickets"):
    name: ClassVar[str] = "set_tickets"
    user: UserName
    tickets: NonNegInt


class Reconfigure(Command, frozen=True, tag="cmd.reconfigure"):
    """Node-daemon -> sidecar: run ``job_id`` on ``gpus`` from ``epoch`` on.
    A newer epoch cancels any older in-flight one (CoDDL §4.3)."""

    name: ClassVar[str] = "reconfigure"
    job_id: Id
    epoch: Epoch
    gpus: tuple[GpuRef, ...]
    effective_at: float | None = None
    """When the allocator decided it (virtual seconds). An emulated trainer applies
    the order as of this instant, so that emulation at a high time scale does not
    inflate control-plane latency by the scale factor."""


class CommandAccepted(Struct, frozen=True, kw_only=True, tag_field="type", tag="reply.accepted"):
    """Reply to a command that changed (or, when idempotent, had already changed) the log."""

    id: str = ""
    """The id of what the command created or addressed (e.g. the job id)."""
    event_id: str = ""
    duplicate: bool = False


class CommandRejected(Struct, frozen=True, kw_only=True, tag_field="type", tag="reply.rejected"):
    """Reply to a command that changed nothing, with a machine-readable code."""

    code: str
    message: str
    errors: tuple[str, ...] = ()


COMMAND_TYPES: tuple[type[Command], ...] = (SubmitJob, CancelJob, SetTickets, Reconfigure)
AnyCommand = SubmitJob | CancelJob | SetTickets | Reconfigure
AnyReply = CommandAccepted | CommandRejected


# ---------------------------------------------------------------------------
# Envelope
# ---------------------------------------------------------------------------


class Envelope(Struct, frozen=True, kw_only=True):
    """Metadata around one event. ``id`` doubles as the ``Nats-Msg-Id``."""

    id: str
    type: str
    v: int = 1
    """Schema version of the payload type."""
    at: float
    """Occurred-at, Unix seconds (virtual seconds in the simulator)."""
    causation_id: str | None = None
    correlation_id: str | None = None
    event: AnyEvent


class RawEnvelope(Struct, frozen=True, kw_only=True):
    """The envelope with its payload left undecoded; used to classify failures."""

    id: str
    type: str
    v: int = 1
    at: float
    causation_id: str | None = None
    correlation_id: str | None = None
    event: msgspec.Raw


def event_tag(event: Event) -> str:
    """The dotted tag of an event instance."""
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def subject_for(event: Event, prefix: str = "shoal") -> str:
    """The per-aggregate subject an event is published on.

    ``job.submitted`` for job ``j1`` -> ``shoal.job.j1.submitted``;
    ``reconf.started`` for job ``j1`` -> ``shoal.job.j1.reconf.started``;
    ``alloc.shares_decided`` -> ``shoal.alloc.shares_decided``.
    """
    cls = type(event)
    tag = event_tag(event)
    if cls.key_field is None:
        return f"{prefix}.{tag}"
    key = getattr(event, cls.key_field)
    head, _, tail = tag.partition(".")
    name = tail if head == cls.aggregate else tag
    return f"{prefix}.{cls.aggregate}.{key}.{name}"

"""Reading the log for people: why a job got its GPUs, and the cluster at any past moment.

Everything here is pure: it takes ``(stream_seq, envelope)`` pairs (or a folded
:class:`~shoal.state.ClusterState`) and returns plain data or text. The CLI
(``shoal explain``, ``shoal replay``, ``shoal jobs``, ``shoal top``) reads the log
and calls these functions; tests call them on literal logs.

* :func:`explain_job` folds the log with :func:`shoal.state.apply`, and at every
  ``SharesDecided`` / ``PlacementDecided`` / ``Reconfiguration*`` that changed the job
  records the old and new GPUs (and nodes), the event that triggered the decision,
  and the policy's inputs *at that moment*: the log before the decision folded as of
  the decision's instant (events stamped later wait, as they do in the allocator),
  giving attained service, progress and remaining work, throughput curve, active
  jobs, free GPUs and the user's tickets, plus the policy's name and the part of
  its memory that concerns the job or its user.
* The trigger is the envelope named by the decision's ``causation_id`` when the
  writer set one. Otherwise it is inferred from the decision's ``trigger`` label
  (``arrival``, ``completion`` …): the first event of that kind since the previous
  decision (the allocator coalesces a burst and labels it by its first event), with
  the number of others in the burst; it is then marked ``inferred``. ``tick`` and
  ``takeover`` have no triggering event.
* :func:`fold_until` / :func:`summarize` rebuild the state as of a past moment: the
  longest prefix of the log (in stream order) whose events happened at or before
  the given time, or up to a stream sequence. Stream order is the order every
  service folded in, so the result is a state the cluster really was in.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from shoal import events as ev
from shoal import state as st
from shoal.events import Envelope
from shoal.state import ClusterState, JobState

if TYPE_CHECKING:
    from shoal.models import Catalog

# Same labels as the allocator's triggers (services/allocator/service.py).
TRIGGER_EVENTS: dict[str, tuple[type[ev.Event], ...]] = {
    "arrival": (ev.JobSubmitted,),
    "completion": (ev.JobCompleted, ev.JobFailed, ev.JobCancelled, ev.JobRejected),
    "model_update": (ev.ThroughputModelUpdated, ev.ConvergenceEstimated),
    "node_change": (ev.NodeRegistered, ev.NodeLost, ev.NodeDrained),
    "trade": (ev.TradeExecuted, ev.TradeUndone),
    "tickets": (ev.TicketsSet,),
}
_TRIGGER_TYPES: tuple[type[ev.Event], ...] = tuple(t for ts in TRIGGER_EVENTS.values() for t in ts)
_RECONF = (
    ev.ReconfigurationStarted,
    ev.ReconfigurationCompleted,
    ev.ReconfigurationCancelled,
    ev.ReconfigurationFailed,
)
_LIFECYCLE = (ev.JobStarted, ev.JobCompleted, ev.JobFailed, ev.JobCancelled, ev.JobRejected)

MEMORY_EXCERPT_ENTRIES = 12


# ---------------------------------------------------------------------------
# Small formatting helpers
# ---------------------------------------------------------------------------


def iso(at: float | None) -> str:
    """Unix seconds as ``YYYY-MM-DDTHH:MM:SS.mmmZ`` (UTC); ``-`` for None."""
    if at is None or not math.isfinite(at):
        return "-"
    try:
        return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"{at:.3f}"


def short_time(at: float | None) -> str:
    """Unix seconds as ``YYYY-MM-DD HH:MM:SS`` (UTC) for tables."""
    if at is None or not math.isfinite(at):
        return "-"
    try:
        return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"{at:.0f}"


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table: ``columns`` are ``(key, header)``; numbers are right-aligned."""
    cells = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    numeric = [
        bool(rows) and all(isinstance(r.get(k), int | float) or r.get(k) is None for r in rows)
        for k, _ in columns
    ]

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(out).rstrip()

    return "\n".join([line(heads), *(line(c) for c in cells)])


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def printable(text: str) -> str:
    """``text`` with each C0/C1 control character (newline, ESC, …) and each invisible
    or direction-changing format character (zero-width space and joiners, the bidi
    embeddings, overrides and isolates, line and paragraph separators, the byte-order
    mark) written as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``), so text
    from the log cannot move the cursor, clear the screen, add lines to a table, or show
    a name other than the one stored (a right-to-left override reverses what follows)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) < 1e6 else f"{value:.3g}"
    return printable(str(value))


def _gpu_text(gpus: int, gpu_type: str) -> str:
    return f"{gpus} GPU{'s' if gpus != 1 else ''}" + (f" {gpu_type}" if gpu_type and gpus else "")


def placement_text(placement: Sequence[ev.GpuRef]) -> str:
    """``node0[0,1] node1[3]``; ``-`` when empty."""
    if not placement:
        return "-"
    by_node: dict[str, list[int]] = {}
    for ref in placement:
        by_node.setdefault(ref.node_id, []).append(ref.index)
    return " ".join(f"{n}[{','.join(str(i) for i in sorted(ix))}]" for n, ix in sorted(by_node.items()))


# ---------------------------------------------------------------------------
# Rows for jobs and nodes (shared by `shoal jobs`, `status`, `nodes`, `top`, `replay`)
# ---------------------------------------------------------------------------


def total_work(job: JobState) -> int | None:
    """Known or estimated total iterations of a job, else None."""
    if job.spec.total_iterations is not None:
        return job.spec.total_iterations
    if job.convergence is not None:
        return job.convergence.estimated_total_iterations
    return None


def progress(job: JobState) -> float | None:
    """Fraction of the job's work done (0..1), None when its length is unknown."""
    total = total_work(job)
    if not total:
        return 1.0 if job.status == st.COMPLETED else None
    return min(1.0, job.iteration / total)


def job_row(job_id: str, job: JobState, now: float) -> dict[str, Any]:
    """One job as plain data."""
    frac = progress(job)
    return {
        "job_id": job_id,
        "user": job.spec.user,
        "name": job.spec.name,
        "model": job.spec.model,
        "status": job.status,
        "gpus": job.gpus,
        "gpu_type": job.gpu_type,
        "min_gpus": job.spec.min_gpus,
        "max_gpus": job.spec.max_gpus,
        "requested_gpus": job.spec.requested_gpus,
        "placement": placement_text(job.placement),
        "iteration": job.iteration,
        "total_iterations": total_work(job),
        "progress": None if frac is None else round(frac, 4),
        "attained_service_gpu_s": round(_service(job, now), 3),
        "reconfigurations": job.reconfigurations,
        "submitted_at": job.submitted_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "reason": job.reason,
    }


def _service(job: JobState, now: float) -> float:
    if job.status in st.FINISHED_STATUSES or job.gpus == 0:
        return job.attained_service_gpu_s
    return job.attained_service_gpu_s + job.gpus * max(0.0, now - job.since)


JOB_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job_id", "JOB"),
    ("user", "USER"),
    ("status", "STATE"),
    ("gpus_text", "GPUS"),
    ("progress_text", "PROGRESS"),
    ("submitted", "SUBMITTED (UTC)"),
    ("name", "NAME"),
)


def job_table(state: ClusterState, job_ids: Iterable[str] | None = None) -> str:
    """The ``shoal jobs`` table."""
    rows = []
    for job_id in state.jobs if job_ids is None else job_ids:
        row = job_row(job_id, state.jobs[job_id], state.clock)
        row["gpus_text"] = f"{row['gpus']}{' ' + row['gpu_type'] if row['gpu_type'] else ''}"
        row["progress_text"] = progress_text(state.jobs[job_id])
        row["submitted"] = short_time(row["submitted_at"])
        rows.append(row)
    return table(rows, JOB_COLUMNS)


def progress_text(job: JobState) -> str:
    total = total_work(job)
    frac = progress(job)
    if total and frac is not None:
        return f"{job.iteration}/{total} {frac * 100:.0f}%"
    return f"{job.iteration} it" if job.iteration else "-"


def node_row(node_id: str, node: st.NodeState, state: ClusterState) -> dict[str, Any]:
    """One node as plain data (GPU use from placements, utilisation from GPU health)."""
    used: dict[int, str] = {}
    for job_id in state.placed:
        for ref in state.jobs[job_id].placement:
            if ref.node_id == node_id:
                used[ref.index] = job_id
    types = sorted({g.gpu_type for g in node.gpus})
    utils = [g.utilization for g in node.gpus]
    return {
        "node_id": node_id,
        "hostname": node.hostname,
        "status": node.status,
        "gpus": len(node.gpus),
        "gpu_types": types,
        "healthy": sum(g.healthy for g in node.gpus),
        "allocated": len(used),
        "jobs": sorted(set(used.values())),
        "utilization": round(sum(utils) / len(utils), 4) if utils else 0.0,
        "gpu_utilization": [round(u, 4) for u in utils],
        "gpu_jobs": [used.get(i, "") for i in range(len(node.gpus))],
        "emulated": node.emulated,
        "last_heartbeat_at": node.last_heartbeat_at,
    }


def node_table(state: ClusterState) -> str:
    rows = []
    for node_id, node in sorted(state.nodes.items()):
        row = node_row(node_id, node, state)
        row["types"] = ",".join(row["gpu_types"]) or "-"
        row["use"] = f"{row['allocated']}/{row['gpus']}"
        row["util"] = f"{row['utilization'] * 100:.0f}%"
        row["jobs_text"] = ",".join(row["jobs"]) or "-"
        row["heartbeat"] = short_time(row["last_heartbeat_at"])
        rows.append(row)
    return table(
        rows,
        (
            ("node_id", "NODE"),
            ("status", "STATE"),
            ("types", "TYPE"),
            ("use", "ALLOCATED"),
            ("util", "UTIL"),
            ("jobs_text", "JOBS"),
            ("heartbeat", "LAST HEARTBEAT (UTC)"),
        ),
    )


def user_rows(state: ClusterState) -> list[dict[str, Any]]:
    """Every user with tickets, limits or an active job, as plain data: its tickets, its
    own limits (0: the installation's default applies, ``SHOAL_MAX_*_PER_USER``), its
    active jobs, the GPUs they ask for as admission counts them (sum of ``min_gpus``)
    and the GPUs they hold now."""
    active_of: dict[str, list[JobState]] = {}
    for job in state.jobs.values():
        if job.status not in st.FINISHED_STATUSES:
            active_of.setdefault(job.spec.user, []).append(job)
    names = set(state.users) | set(active_of)
    rows = []
    for name in sorted(names):
        user = state.users.get(name) or st.UserState()
        active = active_of.get(name, [])
        rows.append(
            {
                "user": name,
                "tickets": user.tickets,
                "registered": user.registered,
                "max_active_jobs": user.max_active_jobs,
                "max_gpus": user.max_gpus,
                "active_jobs": len(active),
                "guaranteed_gpus": sum(j.spec.min_gpus for j in active),
                "gpus": sum(j.gpus for j in active),
            }
        )
    return rows


def user_table(state: ClusterState) -> str:
    """The ``shoal users`` table."""
    rows = user_rows(state)
    for row in rows:
        row["jobs_text"] = f"{row['active_jobs']}/{row['max_active_jobs'] or '-'}"
        row["gpus_text"] = f"{row['guaranteed_gpus']}/{row['max_gpus'] or '-'}"
    return table(
        rows,
        (
            ("user", "USER"),
            ("tickets", "TICKETS"),
            ("jobs_text", "ACTIVE JOBS/LIMIT"),
            ("gpus_text", "MIN GPUS/LIMIT"),
            ("gpus", "GPUS HELD"),
        ),
    )


# ---------------------------------------------------------------------------
# Describing events
# ---------------------------------------------------------------------------


def describe_event(env: Envelope) -> str:
    """A short human description of an event: its type and key fields."""
    e = env.event
    key = type(e).key_field
    text = env.type + (f" {getattr(e, key)}" if key else "")
    match e:
        case ev.JobSubmitted():
            text += f" ({e.spec.user}, {e.spec.min_gpus}..{e.spec.max_gpus} GPUs)"
        case ev.JobRejected() | ev.JobFailed():
            text += f": {e.reason}"
        case ev.TicketsSet():
            text += f" = {e.tickets}"
        case ev.UserRegistered():
            text += f" (tickets {e.tickets}, max {e.max_active_jobs or '-'} jobs, {e.max_gpus or '-'} GPUs)"
        case ev.NodeRegistered():
            types = sorted({g.gpu_type for g in e.gpus})
            text += f" ({len(e.gpus)}×{'/'.join(types) or '?'})"
        case ev.ThroughputModelUpdated():
            text += f" ({e.gpu_type or 'untyped'}, {e.samples} samples)"
        case ev.ConvergenceEstimated():
            text += f" (≈{e.estimated_total_iterations} iterations)"
        case ev.TradeExecuted():
            text += f" {e.trade_id}: {e.buyer} buys {e.fast_gpus} {e.fast_type} from {e.seller}"
        case ev.TradeUndone():
            text += f" {e.trade_id}"
        case ev.SharesDecided():
            text += f" epoch {e.epoch} ({e.trigger or '?'})"
        case ev.PlacementDecided():
            text += f" epoch {e.epoch}"
        case _:
            pass
    return text


# ---------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------


class Trigger(Struct, kw_only=True):
    """The event that caused a decision."""

    label: str
    """The decision's own trigger label (``arrival``, ``tick`` …)."""
    event_id: str | None = None
    seq: int | None = None
    type: str | None = None
    description: str = ""
    inferred: bool = False
    """True when found from the label and the log rather than a causation id."""
    coalesced: int = 0
    """Other triggering events in the same burst, decided together."""


class TimelineEntry(Struct, kw_only=True):
    seq: int
    at: float
    kind: str
    """submitted, share, placement, reconf.started, reconf.completed, … or a job lifecycle tag."""
    epoch: int | None = None
    summary: str = ""
    old_gpus: int | None = None
    new_gpus: int | None = None
    old_gpu_type: str | None = None
    new_gpu_type: str | None = None
    old_nodes: str | None = None
    new_nodes: str | None = None
    trigger: Trigger | None = None
    inputs: dict[str, Any] | None = None
    others: list[str] = []
    """The other jobs the same decision changed, as ``"<job> <old>→<new>"``."""


class Explanation(Struct, kw_only=True):
    job_id: str
    found: bool
    user: str = ""
    spec: ev.JobSpec | None = None
    status: str = ""
    entries: list[TimelineEntry] = []
    share_changes: int = 0
    last_seq: int = 0


def memory_excerpt(memory: Mapping[str, Any], job_id: str, user: str = "") -> dict[str, Any]:
    """The entries of a policy's memory about this job or user, plus top-level scalars.

    Nested mappings are flattened to dotted paths; at most
    :data:`MEMORY_EXCERPT_ENTRIES` entries, the job's and user's first.
    """
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any, depth: int) -> None:
        if isinstance(value, Mapping) and depth < 4:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v, depth + 1)
        else:
            flat.append((prefix, value))

    walk("", memory, 0)
    tokens = {job_id} | ({user} if user else set())

    def about(path: str) -> bool:
        return any(part in tokens for part in path.split("."))

    mine = [(p, v) for p, v in flat if about(p)]
    scalars = [(p, v) for p, v in flat if "." not in p and not about(p) and _is_scalar(v)]
    out: dict[str, Any] = {}
    for path, value in [*mine, *scalars][:MEMORY_EXCERPT_ENTRIES]:
        out[path] = _short(value)
    return out


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _short(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if _is_scalar(value):
        return value if not isinstance(value, str) or len(value) <= 80 else value[:77] + "..."
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def policy_inputs(
    state: ClusterState,
    job_id: str,
    decision: ev.SharesDecided,
    at: float,
    catalog: Catalog | None = None,
) -> dict[str, Any]:
    """What the policy knew about ``job_id`` when it made ``decision`` (state before it)."""
    from shoal.view import cluster_gpus, job_curve, job_view

    job = state.jobs[job_id]
    curve = job_curve(job, catalog)
    view = job_view(job_id, job, now=at, curve=curve)
    total, by_type = cluster_gpus(state)
    allocated = sum(state.shares.values())
    if job.throughput_models:
        source = "measured: " + ", ".join(
            f"{t or 'untyped'}{' (overestimate)' if m.overestimated else ''}"
            for t, m in sorted(job.throughput_models.items())
        )
    elif catalog is not None and job.spec.model in catalog.curves:
        source = f"catalog {catalog.name}: {job.spec.model}"
    else:
        source = "none in the log: linear scaling shown (pass the allocator's catalog to see its curve)"
    user = state.users.get(job.spec.user)
    return {
        "policy": decision.policy,
        "trigger": decision.trigger,
        "status": job.status,
        "attained_service_gpu_s": round(view.attained_service_gpu_s, 3),
        "iterations_done": job.iteration,
        "total_iterations": view.total_iterations,
        "remaining_iterations": view.remaining_iterations,
        "throughput": {str(k): round(v, 4) for k, v in enumerate(curve) if k},
        "throughput_source": source,
        "min_gpus": job.spec.min_gpus,
        "max_gpus": job.spec.max_gpus,
        "requested_gpus": job.spec.requested_gpus,
        "active_jobs": len(state.active_jobs()),
        "total_gpus": total,
        "gpus_by_type": by_type,
        "free_gpus": max(0, total - allocated),
        "user": job.spec.user,
        "user_tickets": user.tickets if user is not None else None,
        "policy_memory": memory_excerpt(decision.policy_memory, job_id, job.spec.user),
    }


def explain_job(
    job_id: str, items: Iterable[tuple[int, Envelope]], *, catalog: Catalog | None = None
) -> Explanation:
    """Every share change of ``job_id`` with its trigger and the policy inputs (see the
    module docstring).

    Args:
        job_id: the job.
        items: the log as ``(stream_seq, envelope)`` in stream order (the whole log:
            the inputs need everything before each decision).
        catalog: the throughput catalog the allocator used, if any, for jobs without a
            measured throughput model.
    """
    state = ClusterState()
    asof = _AsOf()
    out = Explanation(job_id=job_id, found=False)
    by_id: dict[str, tuple[int, Envelope]] = {}
    burst: list[tuple[int, Envelope]] = []
    shares_by_epoch: dict[int, tuple[int, Envelope]] = {}
    last_seq = 0
    for seq, env in items:
        last_seq = seq
        e = env.event
        if isinstance(e, _TRIGGER_TYPES):
            by_id[env.id] = (seq, env)
            burst.append((seq, env))
        job = state.jobs.get(job_id)
        active = job is not None and job.status not in st.FINISHED_STATUSES
        if isinstance(e, ev.SharesDecided):
            by_id[env.id] = (seq, env)
            fresh = not (e.epoch <= state.shares_epoch and state.shares_epoch)
            if fresh:
                shares_by_epoch[e.epoch] = (seq, env)
            if fresh and active and job is not None:
                old = (job.gpus, job.gpu_type)
                new = (e.shares.get(job_id, 0), e.gpu_types.get(job_id, ""))
                if old != new:
                    out.entries.append(
                        TimelineEntry(
                            seq=seq,
                            at=env.at,
                            kind="share",
                            epoch=e.epoch,
                            summary=f"share {_gpu_text(*old)} → {_gpu_text(*new)}",
                            old_gpus=old[0],
                            new_gpus=new[0],
                            old_gpu_type=old[1],
                            new_gpu_type=new[1],
                            trigger=_trigger(env, by_id, burst),
                            inputs=policy_inputs(asof.at(env.at), job_id, e, env.at, catalog),
                            others=_other_changes(state, e, job_id),
                        )
                    )
                    out.share_changes += 1
            if fresh:
                burst = []
        elif isinstance(e, ev.PlacementDecided) and active and job is not None:
            if e.epoch >= state.placement_epoch:
                old_nodes = placement_text(job.placement)
                new_nodes = placement_text(e.placements.get(job_id, ()))
                if old_nodes != new_nodes:
                    cause = shares_by_epoch.get(e.epoch)
                    trig = None
                    if cause is not None:
                        trig = Trigger(
                            label="shares",
                            event_id=cause[1].id,
                            seq=cause[0],
                            type=cause[1].type,
                            description=describe_event(cause[1]),
                        )
                    moved = e.migrations
                    out.entries.append(
                        TimelineEntry(
                            seq=seq,
                            at=env.at,
                            kind="placement",
                            epoch=e.epoch,
                            summary=f"placed {old_nodes} → {new_nodes}"
                            + (
                                f" ({moved} migration{'s' if moved != 1 else ''} in the cluster)"
                                if moved
                                else ""
                            ),
                            old_nodes=old_nodes,
                            new_nodes=new_nodes,
                            trigger=trig,
                        )
                    )
        elif isinstance(e, ev.JobSubmitted) and e.job_id == job_id and job is None:
            out.found = True
            out.user = e.spec.user
            out.spec = e.spec
            out.entries.append(
                TimelineEntry(seq=seq, at=env.at, kind="submitted", summary=describe_event(env))
            )
        elif isinstance(e, _RECONF) and e.job_id == job_id and job is not None:
            out.entries.append(
                TimelineEntry(seq=seq, at=env.at, kind=env.type, epoch=e.epoch, summary=_reconf_text(e))
            )
        elif isinstance(e, _LIFECYCLE) and e.job_id == job_id and active:
            out.entries.append(TimelineEntry(seq=seq, at=env.at, kind=env.type, summary=describe_event(env)))
        st.apply(state, env)
        asof.add(env)
    final = state.jobs.get(job_id)
    out.status = final.status if final is not None else ""
    out.last_seq = last_seq
    return out


class _AsOf:
    """The log folded as of an instant: every event seen so far stamped at or before it,
    in stream order. Events stamped later (a report that reached the log before a
    decision made as of an earlier instant) wait until a decision's instant covers
    them — the allocator decides on exactly this state."""

    def __init__(self) -> None:
        self.state = ClusterState()
        self.waiting: list[Envelope] = []

    def add(self, env: Envelope) -> None:
        self.waiting.append(env)

    def at(self, instant: float) -> ClusterState:
        if self.waiting:
            later = []
            for env in self.waiting:
                if env.at <= instant:
                    st.apply(self.state, env)
                else:
                    later.append(env)
            self.waiting = later
        return self.state


def _other_changes(state: ClusterState, e: ev.SharesDecided, job_id: str) -> list[str]:
    out = []
    for other in sorted(state.shares.keys() | e.shares.keys()):
        job = state.jobs.get(other)
        if other == job_id or job is None or job.status in st.FINISHED_STATUSES:
            continue
        new = e.shares.get(other, 0)
        if new != job.gpus:
            out.append(f"{other} {job.gpus}→{new}")
    return out


def _trigger(
    decision: Envelope, by_id: Mapping[str, tuple[int, Envelope]], burst: Sequence[tuple[int, Envelope]]
) -> Trigger:
    e = decision.event
    assert isinstance(e, ev.SharesDecided)
    label = e.trigger
    if decision.causation_id and decision.causation_id in by_id:
        seq, cause = by_id[decision.causation_id]
        return Trigger(
            label=label, event_id=cause.id, seq=seq, type=cause.type, description=describe_event(cause)
        )
    kinds = TRIGGER_EVENTS.get(label)
    if kinds:
        matching = [(s, x) for s, x in burst if isinstance(x.event, kinds)]
        if matching:
            seq, cause = matching[0]
            return Trigger(
                label=label,
                event_id=cause.id,
                seq=seq,
                type=cause.type,
                description=describe_event(cause),
                inferred=True,
                coalesced=len(burst) - 1,
            )
    text = {"tick": "the policy's quantum tick", "takeover": "a new allocator leader took over"}.get(
        label, f"{label or 'unlabelled'} (no triggering event found in the log)"
    )
    return Trigger(label=label, description=text, inferred=True, coalesced=max(0, len(burst)))


def _reconf_text(e: ev.Event) -> str:
    match e:
        case ev.ReconfigurationStarted():
            return f"reconfiguration {e.kind or '?'} started: {e.from_world} → {e.to_world} workers"
        case ev.ReconfigurationCompleted():
            return (
                f"reconfiguration done: {e.world_size} workers on {placement_text(e.gpus)}, "
                f"took {e.duration_s:.2f}s, all workers stopped {e.stop_time_s:.2f}s"
            )
        case ev.ReconfigurationCancelled():
            return f"reconfiguration cancelled by epoch {e.by_epoch}" + (f": {e.reason}" if e.reason else "")
        case ev.ReconfigurationFailed():
            return f"reconfiguration failed: {e.reason}"
    return type(e).__name__


def render_explanation(x: Explanation) -> str:
    """The text timeline of ``shoal explain``."""
    if not x.found:
        return f"no job {x.job_id!r} in the log (read up to seq {x.last_seq})"
    spec = x.spec
    assert spec is not None
    length = (
        f"{spec.total_iterations} iterations"
        if spec.total_iterations is not None
        else (
            f"until loss {spec.convergence_target}" if spec.convergence_target is not None else "open-ended"
        )
    )
    head = (
        f"job {x.job_id}: user {spec.user}"
        + (f", {spec.name}" if spec.name else "")
        + (f", model {spec.model}" if spec.model else "")
        + f", {spec.min_gpus}..{spec.max_gpus} GPUs (requested {spec.requested_gpus})"
        + ("" if spec.elastic else ", rigid")
        + (f", pinned to {spec.gpu_type}" if spec.gpu_type else "")
        + f", {length} — {x.status}; {x.share_changes} share change{'s' if x.share_changes != 1 else ''}"
    )
    lines = [head]
    for entry in x.entries:
        epoch = f"epoch {entry.epoch}" if entry.epoch is not None else ""
        lines.append(f"{iso(entry.at)}  seq {entry.seq:<6} {epoch:<9} {entry.summary}")
        if entry.trigger is not None:
            t = entry.trigger
            where = f" [seq {t.seq}]" if t.seq is not None else ""
            extra = f", +{t.coalesced} more in the same burst" if t.coalesced and t.seq is not None else ""
            how = " (inferred from the label)" if t.inferred and t.seq is not None else ""
            lines.append(f"    because: {t.description}{where}{how}{extra}")
        if entry.others:
            lines.append(f"    same decision: {', '.join(entry.others)}")
        if entry.inputs is not None:
            lines += ["    " + line for line in _inputs_text(entry.inputs)]
    # Names, reasons and ids come from the log: their control characters are escaped
    # line by line, so none can move the cursor or add a line.
    return "\n".join(printable(line) for line in lines)


def _inputs_text(inputs: Mapping[str, Any]) -> list[str]:
    done = inputs["iterations_done"]
    total = inputs["total_iterations"]
    work = f"{done}/{total:.0f} iterations done" if total is not None else f"{done} iterations done"
    if inputs["remaining_iterations"] is not None:
        work += f", {inputs['remaining_iterations']:.0f} remaining"
    curve = " ".join(f"{k}:{v:g}" for k, v in inputs["throughput"].items())
    lines = [
        f"policy {inputs['policy'] or '?'} ({inputs['trigger'] or '?'}); job was {inputs['status']}, "
        f"attained {inputs['attained_service_gpu_s']:.1f} GPU·s, {work}",
        f"throughput by GPUs (it/s) {curve} — {inputs['throughput_source']}",
        f"cluster: {inputs['active_jobs']} active jobs, {inputs['free_gpus']}/{inputs['total_gpus']} GPUs "
        f"unallocated before the decision; user {inputs['user']} has "
        f"{inputs['user_tickets'] if inputs['user_tickets'] is not None else '?'} tickets",
    ]
    memory = inputs.get("policy_memory") or {}
    if memory:
        lines.append("policy memory: " + ", ".join(f"{k}={v}" for k, v in memory.items()))
    return lines


# ---------------------------------------------------------------------------
# replay --until
# ---------------------------------------------------------------------------


class Until(Struct, frozen=True, kw_only=True):
    """A past moment: a time (Unix seconds) or a stream sequence."""

    at: float | None = None
    seq: int | None = None

    def includes(self, seq: int, env: Envelope) -> bool:
        if self.seq is not None:
            return seq <= self.seq
        assert self.at is not None
        return env.at <= self.at

    def describe(self) -> str:
        return f"seq {self.seq}" if self.seq is not None else iso(self.at)


_REL = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_until(text: str, now: float) -> Until:
    """Parse ``--until``: ``seq:<n>``, a relative time (``-5m``, ``-1h30m``, ``-90s``),
    an ISO 8601 time (UTC when it has no offset) or ``@<unix seconds>``.

    Raises:
        ValueError: with what was wrong and the accepted forms.
    """
    raw = text.strip()
    forms = "use seq:<n>, a relative time like -5m or -1h30m, an ISO time like 2026-11-23T01:30:00Z, or @<unix seconds>"
    if raw.lower().startswith("seq:"):
        number = raw[4:].strip()
        if not number.isdigit():
            raise ValueError(f"invalid --until {text!r}: seq needs a non-negative integer; {forms}")
        return Until(seq=int(number))
    if raw.startswith("-"):
        rest = raw[1:].replace(" ", "")
        pos = 0
        seconds = 0.0
        for m in _REL.finditer(rest):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _UNIT_S[m.group(2)]
            pos = m.end()
        if pos != len(rest) or not rest:
            raise ValueError(f"invalid --until {text!r}: {forms}")
        return Until(at=now - seconds)
    if raw.startswith("@"):
        try:
            return Until(at=float(raw[1:]))
        except ValueError:
            raise ValueError(f"invalid --until {text!r}: {forms}") from None
    try:
        when = dt.datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"invalid --until {text!r}: {forms}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return Until(at=when.timestamp())


class Replayed(Struct, kw_only=True):
    state: ClusterState
    seq: int = 0
    """Stream sequence of the last event folded (0: none)."""
    at: float | None = None
    """Occurred-at of the last event folded."""
    events: int = 0
    beyond: bool = False
    """True when the log has events after the moment (the fold stopped early)."""


class Replayer:
    """Folds a log incrementally up to a moment; :meth:`feed` says when to stop reading."""

    def __init__(self, until: Until | None) -> None:
        self.until = until
        self.result = Replayed(state=ClusterState())

    def feed(self, seq: int, env: Envelope) -> bool:
        """Fold one event if it lies within the moment; False (and nothing folded) once past it."""
        out = self.result
        if self.until is not None and not self.until.includes(seq, env):
            out.beyond = True
            return False
        st.apply(out.state, env)
        out.seq = seq
        out.at = env.at
        out.events += 1
        return True


def fold_until(items: Iterable[tuple[int, Envelope]], until: Until | None) -> Replayed:
    """Fold the longest prefix of ``items`` that lies within ``until`` (all when None)."""
    replayer = Replayer(until)
    for seq, env in items:
        if not replayer.feed(seq, env):
            break
    return replayer.result


def summarize(replayed: Replayed, until: Until | None = None) -> dict[str, Any]:
    """The cluster as of a replayed moment, as plain data (``shoal replay --json``)."""
    state = replayed.state
    now = replayed.at if replayed.at is not None else 0.0
    jobs_by_status: dict[str, list[dict[str, Any]]] = {}
    for job_id, job in state.jobs.items():
        row = job_row(job_id, job, now)
        keep = (
            "job_id",
            "user",
            "name",
            "gpus",
            "gpu_type",
            "placement",
            "iteration",
            "total_iterations",
            "progress",
            "attained_service_gpu_s",
        )
        jobs_by_status.setdefault(job.status, []).append({k: row[k] for k in keep})
    total = state.total_gpus()
    allocated = sum(state.shares.values())
    return {
        "until": None if until is None else until.describe(),
        "seq": replayed.seq,
        "at": replayed.at,
        "at_iso": iso(replayed.at),
        "events": replayed.events,
        "more_events_after": replayed.beyond,
        "epoch": state.shares_epoch,
        "placement_epoch": state.placement_epoch,
        "policy": state.policy,
        "shares": dict(sorted(state.shares.items())),
        "gpus": {"total": total, "allocated": allocated, "free": max(0, total - allocated)},
        "jobs": {s: jobs_by_status[s] for s in sorted(jobs_by_status)},
        "job_counts": {s: len(v) for s, v in sorted(jobs_by_status.items())},
        "nodes": [node_row(n, node, state) for n, node in sorted(state.nodes.items())],
        "users": {u: s.tickets for u, s in sorted(state.users.items())},
        "digest": st.digest(state),
    }


def render_summary(summary: Mapping[str, Any]) -> str:
    """The text of ``shoal replay``."""
    g = summary["gpus"]
    if summary["seq"] == 0:
        when = f" at or before {summary['until']}" if summary["until"] else ""
        head = f"no events{when}: the cluster was empty" + (
            " (the log starts later)" if summary["more_events_after"] else ""
        )
    else:
        head = (
            f"cluster as of {summary['at_iso']} (seq {summary['seq']}, {summary['events']} events"
            + (", later events not applied" if summary["more_events_after"] else ", the whole log")
            + ")"
        )
    lines = [
        head,
        f"shares epoch {summary['epoch']} (policy {summary['policy'] or '-'}), placement epoch "
        f"{summary['placement_epoch']}; GPUs {g['allocated']}/{g['total']} allocated, {g['free']} free",
        "jobs: " + (", ".join(f"{n} {s}" for s, n in summary["job_counts"].items()) or "none"),
    ]
    order = ["running", "pending", "completed", "failed", "cancelled", "rejected"]
    for status in sorted(summary["jobs"], key=lambda s: (order.index(s) if s in order else 99, s)):
        rows = summary["jobs"][status]
        lines.append("")
        lines.append(f"{status} ({len(rows)})")
        table_rows = [
            {
                **r,
                "gpus_text": f"{r['gpus']}{' ' + r['gpu_type'] if r['gpu_type'] else ''}",
                "progress_text": "-" if r["progress"] is None else f"{r['progress'] * 100:.0f}%",
            }
            for r in rows
        ]
        lines.append(
            _indent(
                table(
                    table_rows,
                    (
                        ("job_id", "JOB"),
                        ("user", "USER"),
                        ("gpus_text", "GPUS"),
                        ("placement", "PLACEMENT"),
                        ("progress_text", "PROGRESS"),
                        ("attained_service_gpu_s", "GPU·S"),
                    ),
                )
            )
        )
    if summary["nodes"]:
        lines.append("")
        lines.append("nodes")
        node_rows = [
            {
                **n,
                "types": ",".join(n["gpu_types"]) or "-",
                "use": f"{n['allocated']}/{n['gpus']}",
                "util": f"{n['utilization'] * 100:.0f}%",
                "jobs_text": ",".join(n["jobs"]) or "-",
            }
            for n in summary["nodes"]
        ]
        lines.append(
            _indent(
                table(
                    node_rows,
                    (
                        ("node_id", "NODE"),
                        ("status", "STATE"),
                        ("types", "TYPE"),
                        ("use", "ALLOCATED"),
                        ("util", "UTIL"),
                        ("jobs_text", "JOBS"),
                    ),
                )
            )
        )
    lines.append("")
    lines.append(f"digest {summary['digest']}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())

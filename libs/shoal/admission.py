"""Admission decisions (pure): is a command acceptable, and which event does it become?

The admission service decodes a command, calls these functions with the folded
cluster state and its limits, and either publishes the returned event or replies
with the returned rejection. Nothing here does I/O, so a rejected command changes
nothing by construction.

Choices where the issue is silent (what a production scheduler user expects):

* ``requested_gpus`` must lie in ``[min_gpus, max_gpus]``; a non-elastic job must
  have ``min_gpus == max_gpus == requested_gpus``.
* ``allowed_gpu_counts`` must be non-empty and each count in ``[min_gpus, max_gpus]``.
* Exactly one of ``total_iterations`` (known length) and ``convergence_target``
  (unknown length) must be set, as ``schemas/JobSpec.json`` says: with neither, an
  emulated job could never finish and no policy could estimate its length. (A
  real-mode script that decides itself when to stop still ends the job when it
  exits; ``total_iterations`` is then its expected length.)
* A job larger than the whole cluster (when the cluster size is known) is rejected:
  it could never run.
* Per-user limits (``max_active_jobs``, ``max_gpus`` = sum of ``min_gpus`` over the
  user's active jobs) come from the user's ``UserRegistered`` event, else from the
  service defaults; 0 means no limit.
* Re-submitting an existing job id with the same spec is accepted as a duplicate
  (idempotent); with a different spec it is rejected (``job_exists``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection

from msgspec import Struct

from shoal import events as ev
from shoal.admin_commands import SetUserLimits
from shoal.state import FINISHED_STATUSES, ClusterState

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class Limits(Struct, frozen=True, kw_only=True):
    """Service-wide admission limits; 0 means no limit."""

    max_active_jobs_per_user: int = 0
    max_gpus_per_user: int = 0
    enforce_users: bool = False
    """Reject users that have no ``UserRegistered`` event."""
    entrypoints: tuple[tuple[str, ...], ...] = ()
    """The commands an operator allows real-mode jobs to run: a job's ``entrypoint`` must
    begin with one of these argv prefixes (e.g. ``("python", "/opt/jobs/train.py")``;
    its further arguments are the job's). Empty: no job may name an entrypoint, which
    is right for an emulated installation and the safe default for a real one."""
    job_env: tuple[str, ...] = ()
    """Names of ``spec.env`` variables a job may set besides ``SHOAL_TRAIN_*`` (the
    training options): without a limit, ``LD_PRELOAD`` or ``PYTHONPATH`` would run
    code of the submitter's choosing inside an allowed command."""


class Accepted(Struct, frozen=True):
    event: ev.Event | None
    """The event to publish; None when the command was already applied (duplicate)."""
    id: str
    duplicate: bool = False


class Rejected(Struct, frozen=True):
    code: str
    message: str
    errors: tuple[str, ...] = ()

    def reply(self) -> ev.CommandRejected:
        """The reply; ``errors`` always lists at least one problem (the message)."""
        return ev.CommandRejected(code=self.code, message=self.message, errors=self.errors or (self.message,))


def validate_spec(
    spec: ev.JobSpec, *, known_gpu_types: Collection[str] = (), cluster_gpus: int = 0
) -> list[str]:
    """Cross-field checks the schema cannot express. Returns one message per problem.

    Args:
        spec: the decoded spec (field types and ranges are already checked by the decoder).
        known_gpu_types: GPU generations in the cluster; when non-empty, a pinned
            ``gpu_type`` must be one of them.
        cluster_gpus: GPUs in the cluster (0 = unknown, skip the size check).
    """
    errors: list[str] = []
    if spec.min_gpus > spec.max_gpus:
        errors.append(f"min_gpus ({spec.min_gpus}) is greater than max_gpus ({spec.max_gpus})")
    if not spec.min_gpus <= spec.requested_gpus <= spec.max_gpus:
        errors.append(
            f"requested_gpus ({spec.requested_gpus}) is outside [min_gpus, max_gpus] = "
            f"[{spec.min_gpus}, {spec.max_gpus}]"
        )
    if not spec.elastic and not spec.min_gpus == spec.max_gpus == spec.requested_gpus:
        errors.append("a non-elastic job needs min_gpus == max_gpus == requested_gpus")
    if spec.allowed_gpu_counts is not None:
        if not spec.allowed_gpu_counts:
            errors.append("allowed_gpu_counts is empty")
        bad = [c for c in spec.allowed_gpu_counts if not spec.min_gpus <= c <= spec.max_gpus]
        if bad:
            errors.append(f"allowed_gpu_counts {bad} fall outside [min_gpus, max_gpus]")
        if spec.requested_gpus not in spec.allowed_gpu_counts:
            errors.append(f"requested_gpus ({spec.requested_gpus}) is not in allowed_gpu_counts")
    if spec.total_iterations is not None and spec.convergence_target is not None:
        errors.append("set total_iterations (known length) or convergence_target (unknown length), not both")
    if spec.total_iterations is None and spec.convergence_target is None:
        errors.append(
            "set total_iterations (known length) or convergence_target (unknown length): "
            "a job with neither can never finish"
        )
    if spec.convergence_target is not None and not (
        math.isfinite(spec.convergence_target) and spec.convergence_target > 0
    ):
        errors.append(f"convergence_target must be a finite number > 0, not {spec.convergence_target}")
    for field in ("name", "model"):
        if _CONTROL.search(getattr(spec, field)):
            errors.append(f"{field} must not contain control characters (newline, escape sequences)")
    if spec.gpu_type is not None and known_gpu_types and spec.gpu_type not in known_gpu_types:
        errors.append(f"unknown gpu_type {spec.gpu_type!r}; the cluster has {sorted(known_gpu_types)}")
    if cluster_gpus and spec.min_gpus > cluster_gpus:
        errors.append(f"min_gpus ({spec.min_gpus}) exceeds the cluster's {cluster_gpus} GPUs")
    return errors


def known_gpu_types(state: ClusterState) -> set[str]:
    return {g.gpu_type for n in state.nodes.values() for g in n.gpus}


def check_command(spec: ev.JobSpec, limits: Limits) -> Rejected | None:
    """Refuse a job whose ``entrypoint`` no operator allowed (``entrypoint_not_allowed``)
    or whose ``env`` sets a variable outside ``SHOAL_TRAIN_*`` and ``limits.job_env``
    (``env_not_allowed``): what a node runs comes from the operator, never from an
    arbitrary string in a submission (:class:`Limits`)."""
    if spec.entrypoint and not any(
        prefix and spec.entrypoint[: len(prefix)] == prefix for prefix in limits.entrypoints
    ):
        allowed = ", ".join(" ".join(p) for p in limits.entrypoints) or "none configured"
        message = (
            f"entrypoint {' '.join(spec.entrypoint)[:200]!r} is not allowed here; "
            f"it must begin with one of the operator's entrypoints ({allowed})"
        )
        return Rejected("entrypoint_not_allowed", message)
    bad = sorted(k for k in spec.env if not k.startswith("SHOAL_TRAIN_") and k not in limits.job_env)
    if bad:
        errors = tuple(f"job env variable {k[:64]!r} is not allowed" for k in bad)
        return Rejected("env_not_allowed", "; ".join(errors), errors)
    return None


def user_limits(state: ClusterState, user: str, limits: Limits) -> tuple[int, int]:
    """``(max_active_jobs, max_gpus)`` for ``user``: from its ``UserRegistered`` event,
    else the service defaults; 0 means no limit. A submission's decision depends on the
    user's other jobs exactly when one of them is non-zero."""
    registered = state.users.get(user)
    max_jobs = (
        registered.max_active_jobs if registered and registered.max_active_jobs else 0
    ) or limits.max_active_jobs_per_user
    max_gpus = (registered.max_gpus if registered and registered.max_gpus else 0) or limits.max_gpus_per_user
    return max_jobs, max_gpus


DEADLINE_HEADER = "Shoal-Deadline"
"""Request header: the instant (Unix time in seconds, a decimal number) after which the
requester no longer waits for the answer, so admission must not start a write."""


def deadline_of(header: str | None, received: float, default_s: float) -> float | Rejected:
    """The deadline of a request received at ``received`` (Unix seconds): the
    :data:`DEADLINE_HEADER` value when there is one, else ``received + default_s``; a
    value that is not a finite number is refused (``invalid_deadline``)."""
    if header is None:
        return received + default_s
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        return Rejected(
            "invalid_deadline", f"{DEADLINE_HEADER} {header[:64]!r} is not a Unix time in seconds"
        )
    return value


def decide_submit(state: ClusterState, cmd: ev.SubmitJob, job_id: str, limits: Limits) -> Accepted | Rejected:
    """Accept a submission as a ``JobSubmitted`` event, or reject it with a reason.

    Args:
        state: the folded cluster state the decision reads.
        cmd: the decoded command.
        job_id: ``cmd.job_id`` or one the service generated.
        limits: service-wide limits.
    """
    spec = cmd.spec
    existing = state.jobs.get(job_id)
    if existing is not None:
        if existing.spec == spec:
            return Accepted(None, job_id, duplicate=True)
        return Rejected("job_exists", f"job {job_id!r} already exists with a different spec")
    errors = validate_spec(spec, known_gpu_types=known_gpu_types(state), cluster_gpus=state.total_gpus())
    if errors:
        return Rejected("invalid_spec", "; ".join(errors), tuple(errors))
    refusal = check_command(spec, limits)
    if refusal is not None:
        return refusal
    user = state.users.get(spec.user)
    if limits.enforce_users and (user is None or not user.registered):
        message = (
            f"user {spec.user!r} is not registered (an admin registers it with `shoal limits {spec.user}`)"
        )
        return Rejected("unknown_user", message, (message,))
    max_jobs, max_gpus = user_limits(state, spec.user, limits)
    if max_jobs or max_gpus:
        active = [
            j for j in state.jobs.values() if j.spec.user == spec.user and j.status not in FINISHED_STATUSES
        ]
        if max_jobs and len(active) >= max_jobs:
            return Rejected(
                "limit_exceeded",
                f"user {spec.user!r} already has {len(active)} active jobs (limit {max_jobs})",
            )
        used = sum(j.spec.min_gpus for j in active)
        if max_gpus and used + spec.min_gpus > max_gpus:
            return Rejected(
                "limit_exceeded",
                f"user {spec.user!r} would hold {used + spec.min_gpus} guaranteed GPUs (limit {max_gpus})",
            )
    return Accepted(ev.JobSubmitted(job_id=job_id, spec=spec), job_id)


def decide_cancel(state: ClusterState, cmd: ev.CancelJob) -> Accepted | Rejected:
    job = state.jobs.get(cmd.job_id)
    if job is None:
        return Rejected("unknown_job", f"no job {cmd.job_id!r}")
    if job.status in FINISHED_STATUSES:
        return Accepted(None, cmd.job_id, duplicate=True)
    return Accepted(ev.JobCancelled(job_id=cmd.job_id, reason=cmd.reason or "cancelled by user"), cmd.job_id)


def decide_set_user_limits(state: ClusterState, cmd: SetUserLimits) -> Accepted | Rejected:
    """A user's quota becomes its ``UserRegistered`` event: the limits given, the
    current ones where the command leaves a field out, and the user's tickets as they
    are (the event's default for a user never seen). Jobs already admitted are not
    touched by a lower limit; it applies to the next submission (as a quota that
    shrinks under running work does in Kueue, which preempts nothing for it either)."""
    if cmd.max_active_jobs is None and cmd.max_gpus is None:
        message = "set max_active_jobs, max_gpus or both (0: the installation's default)"
        return Rejected("invalid_command", message, (message,))
    user = state.users.get(cmd.user)
    max_jobs = (
        cmd.max_active_jobs if cmd.max_active_jobs is not None else (user.max_active_jobs if user else 0)
    )
    max_gpus = cmd.max_gpus if cmd.max_gpus is not None else (user.max_gpus if user else 0)
    if user is not None and user.registered and (user.max_active_jobs, user.max_gpus) == (max_jobs, max_gpus):
        return Accepted(None, cmd.user, duplicate=True)
    tickets = user.tickets if user is not None else ev.UserRegistered(user=cmd.user).tickets
    event = ev.UserRegistered(user=cmd.user, tickets=tickets, max_active_jobs=max_jobs, max_gpus=max_gpus)
    return Accepted(event, cmd.user)


def decide_set_tickets(state: ClusterState, cmd: ev.SetTickets) -> Accepted | Rejected:
    user = state.users.get(cmd.user)
    if user is not None and user.tickets == cmd.tickets:
        return Accepted(None, cmd.user, duplicate=True)
    return Accepted(ev.TicketsSet(user=cmd.user, tickets=cmd.tickets), cmd.user)

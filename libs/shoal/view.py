"""From folded cluster state to the frozen view a policy decides on.

:func:`build_view` depends only on a :class:`~shoal.state.ClusterState` and plain
inputs, so the simulator and the allocator service build identical views from
identical logs.

Choices:

* Throughput curve of a job, first found wins: ``curves[job_id]`` (plain input, e.g.
  the simulator's cache or the allocator's memo), the job's newest
  ``ThroughputModelUpdated`` for its pinned/current/"" GPU type in the state (missing
  counts are linearly interpolated, see :func:`shoal.models.interpolate`), the catalog
  curve of ``spec.model``, else linear scaling (``k`` iterations/s at k GPUs).
* Progress: ``progress[job_id]`` when given (the simulator's exact continuous progress,
  or an allocator's extrapolation of the last report), else the state's last reported
  iteration.
* Remaining work: ``total_iterations`` (known length) or the profiler's
  ``estimated_total_iterations`` (Optimus §3.1) minus progress; ``None`` otherwise.
  Length-unaware policies must not read it (see :class:`~shoal.policies.base.JobView`).
* Attained service: GPU-seconds since submission, settled to ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from shoal.models import Catalog, interpolate
from shoal.policies.base import ClusterView, JobView
from shoal.state import FINISHED_STATUSES, NODE_UP, ClusterState, JobState


def cluster_gpus(state: ClusterState) -> tuple[int, dict[str, int]]:
    """Healthy GPUs on nodes that are up: total and by generation."""
    by_type: dict[str, int] = {}
    total = 0
    for node in state.nodes.values():
        if node.status != NODE_UP:
            continue
        for gpu in node.gpus:
            if gpu.healthy:
                total += 1
                by_type[gpu.gpu_type] = by_type.get(gpu.gpu_type, 0) + 1
    return total, by_type


def job_curve(
    job: JobState, catalog: Catalog | None = None, gpu_type: str | None = None
) -> tuple[float, ...]:
    """The throughput curve of one job from its state (see the module docstring).

    The result has length at least ``spec.max_gpus + 1``; points past the last known
    count repeat the last value (no further speedup).
    """
    spec = job.spec
    want = spec.max_gpus
    types = [t for t in (gpu_type, spec.gpu_type, job.gpu_type, "") if t is not None]
    models = job.throughput_models
    for t in types:
        model = models.get(t)
        if model is not None and model.throughput:
            return _extend(interpolate(dict(model.throughput)), want)
    if models:
        model = models[sorted(models)[0]]
        if model.throughput:
            return _extend(interpolate(dict(model.throughput)), want)
    if catalog is not None and spec.model in catalog.curves:
        by_type = catalog.curves[spec.model]
        for t in types:
            if t in by_type:
                return _extend(by_type[t].throughput, want)
        return _extend(by_type[sorted(by_type)[0]].throughput, want)
    return tuple(float(k) for k in range(want + 1))


def estimated_jobs(
    state: ClusterState, job_ids: Iterable[str], catalog: Catalog | None = None
) -> dict[str, frozenset[int]]:
    """The jobs whose curve is AFS §4.5's estimate, with the GPU counts measured so far.

    A job is on the estimate when the model :func:`job_curve` reads for it (same order:
    its pinned/current/"" GPU type, else any) is ``overestimated``, or when it has no
    model and no catalog curve (a new job, nothing measured: ``frozenset()``). A known
    profile, a catalog curve, a trace's table or a trusted fit is no estimate. This is
    the ``estimates`` argument of
    :func:`shoal.profiling.overestimate.decide_overestimate_first`.
    """
    out: dict[str, frozenset[int]] = {}
    jobs = state.jobs
    for job_id in job_ids:
        job = jobs.get(job_id)
        if job is None or job.status in FINISHED_STATUSES:
            continue
        spec = job.spec
        models = job.throughput_models
        model = None
        for t in (spec.gpu_type, job.gpu_type, ""):
            if t is not None and (m := models.get(t)) is not None and m.throughput:
                model = m
                break
        if model is None and models:
            first = models[sorted(models)[0]]
            model = first if first.throughput else None
        if model is not None:
            if model.overestimated:
                out[job_id] = frozenset(model.measured)
        elif catalog is None or spec.model not in catalog.curves:
            out[job_id] = frozenset()
    return out


def _extend(curve: tuple[float, ...], upto: int) -> tuple[float, ...]:
    if len(curve) > upto:
        return curve
    return curve + (curve[-1],) * (upto + 1 - len(curve))


def job_view(
    job_id: str,
    job: JobState,
    *,
    now: float,
    curve: tuple[float, ...],
    curves_by_type: Mapping[str, tuple[float, ...]] | None = None,
    iterations_done: float | None = None,
) -> JobView:
    """The policy's view of one active job."""
    spec = job.spec
    done = float(job.iteration) if iterations_done is None else iterations_done
    total: float | None = None
    if spec.total_iterations is not None:
        total = float(spec.total_iterations)
    elif job.convergence is not None:
        total = float(job.convergence.estimated_total_iterations)
    service = job.attained_service_gpu_s
    if job.gpus and job.status not in FINISHED_STATUSES:
        service += job.gpus * max(0.0, now - job.since)
    return JobView(
        job_id=job_id,
        user=spec.user,
        arrival_s=job.submitted_at,
        min_gpus=spec.min_gpus,
        max_gpus=spec.max_gpus,
        requested_gpus=spec.requested_gpus,
        elastic=spec.elastic,
        allowed_gpu_counts=spec.allowed_gpu_counts,
        throughput=curve,
        throughput_by_type=dict(curves_by_type or {}),
        remaining_iterations=None if total is None else max(0.0, total - done),
        total_iterations=total,
        iterations_done=done,
        attained_service_gpu_s=service,
        current_gpus=job.gpus,
        current_gpu_type=job.gpu_type,
        pinned_gpu_type=spec.gpu_type,
        priority=spec.priority,
    )


def job_view_at(view: JobView, job: JobState, *, now: float, iterations_done: float) -> JobView:
    """:func:`job_view` of the same job later, when only time has passed since ``view``
    was built (no event about the job was folded in between): the fields that move
    with time are recomputed with the same arithmetic, the rest are kept
    (:func:`views_at` for one job)."""
    job_id = view.job_id
    table = {job_id: view}
    views_at(table, {job_id: job}, ((job_id, iterations_done),), now=now)
    return table[job_id]


def views_at(
    views: dict[str, JobView],
    jobs: Mapping[str, JobState],
    progress: Iterable[tuple[str, float]],
    *,
    now: float,
) -> None:
    """:func:`job_view_at` of each ``(job id, iterations done at now)`` in ``progress``,
    in place in ``views`` (job id -> view): one call for all the running jobs of a
    decision (a call per job was a measurable part of the simulator's decisions)."""
    replace = msgspec.structs.replace
    finished = FINISHED_STATUSES
    for job_id, iterations_done in progress:
        view = views[job_id]
        job = jobs[job_id]
        total = view.total_iterations
        service = job.attained_service_gpu_s
        gpus = job.gpus
        if gpus and job.status not in finished:
            since = now - job.since
            service += gpus * (since if since > 0.0 else 0.0)
        views[job_id] = replace(
            view,
            remaining_iterations=None if total is None else max(0.0, total - iterations_done),
            iterations_done=iterations_done,
            attained_service_gpu_s=service,
        )


def build_view(
    state: ClusterState,
    *,
    now: float,
    gpus_per_node: int = 0,
    total_gpus: int | None = None,
    curves: Mapping[str, tuple[float, ...]] | None = None,
    curves_by_type: Mapping[str, Mapping[str, tuple[float, ...]]] | None = None,
    progress: Mapping[str, float] | None = None,
    job_ids: Iterable[str] | None = None,
    catalog: Catalog | None = None,
) -> ClusterView:
    """Turn the folded state into the policy's :class:`ClusterView`.

    Args:
        state: the folded cluster state.
        now: decision time (virtual seconds in the simulator).
        gpus_per_node: servers' size for network packing; 0 for a flat pool.
        total_gpus: override of the GPU count (default: healthy GPUs on up nodes).
        curves: job id -> throughput curve, taking precedence over the state.
        curves_by_type: job id -> GPU type -> curve (heterogeneous clusters).
        progress: job id -> iterations done at ``now``, taking precedence over the
            last reported iteration.
        job_ids: the active jobs, in the order the policy should see them (default:
            every unfinished job of the state in submission order). Passing it spares
            a scan of finished jobs in long runs.
        catalog: fallback curves by ``spec.model``.

    Returns:
        A frozen view with the jobs in ``job_ids`` order.
    """
    total, by_type = cluster_gpus(state)
    if total_gpus is not None:
        total = total_gpus
    ids = state.active_jobs() if job_ids is None else job_ids
    jobs = state.jobs
    views = []
    for job_id in ids:
        job = jobs[job_id]
        if job.status in FINISHED_STATUSES:
            continue
        curve = curves.get(job_id) if curves is not None else None
        if curve is None:
            curve = job_curve(job, catalog)
        views.append(
            job_view(
                job_id,
                job,
                now=now,
                curve=curve,
                curves_by_type=curves_by_type.get(job_id) if curves_by_type is not None else None,
                iterations_done=progress.get(job_id) if progress is not None else None,
            )
        )
    tickets = {u: float(s.tickets) for u, s in state.users.items()}
    return ClusterView(
        now_s=now,
        total_gpus=total,
        jobs=tuple(views),
        gpus_by_type=by_type if len(by_type) > 1 else {},
        gpus_per_node=gpus_per_node,
        user_tickets=tickets,
    )


def with_current_shares(
    view: ClusterView, shares: Mapping[str, int], gpu_types: Mapping[str, str]
) -> ClusterView:
    """``view`` with every job's current share (``current_gpus``/``current_gpu_type``)
    taken from ``shares``/``gpu_types`` (absent: 0 GPUs) instead of the state's.

    The allocator uses it to decide again at an instant it already decided at: the
    decision made at that instant was in force for no time, so the new one starts
    from the shares before it, as the simulator's single decision per instant does.
    """
    jobs = tuple(
        j
        if j.current_gpus == shares.get(j.job_id, 0) and j.current_gpu_type == gpu_types.get(j.job_id, "")
        else msgspec.structs.replace(
            j, current_gpus=shares.get(j.job_id, 0), current_gpu_type=gpu_types.get(j.job_id, "")
        )
        for j in view.jobs
    )
    return msgspec.structs.replace(view, jobs=jobs)

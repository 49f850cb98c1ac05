"""Workloads: job lists for the simulator (and for replaying a trace into a live cluster).

A workload is a tuple of :class:`TraceJob` in submission order. Each carries the
:class:`~shoal.events.JobSpec` that is submitted, its arrival time, the trace run time
it was calibrated against, and its throughput curve (iterations/s by GPU count).

Sources (``load_workload(spec)``):

* ``philly:<vc>[:<n>]`` — the Microsoft Philly VCs that AFS uses (AFS/CoDDL §5.1,
  Table 3), rows with ``in_afs_pcs_trace == 1``; ``<n>`` keeps the first n jobs.
* ``pollux:<workload_set>:<id>`` — the Pollux (OSDI'21) testbed workloads.
* ``poisson:n=<jobs>,rate=<per hour>[,mean_duration_s=..][,users=<k>][,catalog=gavel]
  [,reference=v100]`` — synthetic arrivals; ``users=k`` spreads jobs over users
  ``user-0 … user-<k-1>`` (uniformly at random, seeded); ``catalog=gavel`` draws Gavel
  job types with their per-generation curves (K80/P100/V100) for heterogeneous clusters.

Modelling choices (REPRODUCTION.md, "AFS / CoDDL"):

* Model assignment: each job draws one model, uniformly, in submission order, from the
  nine Table 4 models whose maximum GPU count is at least the request, with a
  ``random.Random(seed)``. A request larger than every model's maximum raises (the
  rows with ``in_afs_pcs_trace == 1`` request at most 48 GPUs; Inception-v4 goes to 52).
* Job length: ``total_iterations = ceil(duration × curve[requested])`` and the job's
  curve is scaled by ``total_iterations / (duration × curve[requested])`` (a factor in
  [1, 1 + 1/(duration × rate))), so that the job alone on its requested GPUs runs for
  exactly its trace duration while ``total_iterations`` stays an integer as the event
  contract requires. Speedups, and hence every policy decision, are unchanged.
* Caps: ``min_gpus = 1``, ``max_gpus`` = the model's maximum (elastic policies may go
  that high; AFS-L, AFS-P and Max-Min need give no minimum), ``requested_gpus`` = the
  trace request. Non-elastic baselines read ``requested_gpus``. ``cap_at_request=True``
  sets ``max_gpus = requested`` (the "capped" variant REPRODUCTION.md warns about).
* Times: arrivals and durations are whole seconds in the trace; fractional synthetic
  values are rounded up.
* Heterogeneous curves (``catalog=gavel``): a job's length is calibrated on its
  ``reference`` generation (default ``v100``, Gavel's reference worker type when it turns
  a trace duration into steps), and every generation's curve is scaled by the same
  factor, so the ratios between generations are Gavel's measurements. ``max_gpus`` is
  the reference curve's maximum; a generation whose measured curve is shorter repeats
  its last value beyond (no further speedup, as :func:`shoal.view.job_curve` does).
* Pollux workloads carry no run time. The run time of each job at its requested
  replicas is an explicit parameter (``durations_s`` per application, or one
  ``duration_s`` for all); there is no default pretending to be data.
"""

from __future__ import annotations

import csv
import gzip
import itertools
import math
import random
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from functools import cache
from importlib import resources

from msgspec import Struct

from shoal.events import JobSpec
from shoal.models import (
    AFS_TABLE4_MODELS,
    Catalog,
    ThroughputCurve,
    afs_catalog,
    get_catalog,
    read_rows,
)

#: The 11 Philly VCs of AFS Table 3, in the paper's order.
PHILLY_VCS: tuple[str, ...] = (
    "0e4a51",
    "6c71a0",
    "b436b2",
    "e13805",
    "6214e9",
    "7f04ca",
    "103959",
    "ee9e8c",
    "2869ce",
    "11cb48",
    "ed69ec",
)


class TraceJob(Struct, frozen=True, kw_only=True):
    """One job of a workload."""

    job_id: str
    spec: JobSpec
    submit_time_s: float
    """Arrival, seconds from the workload start (whole seconds)."""
    duration_s: float
    """Trace run time at ``spec.requested_gpus`` (what the length was calibrated to)."""
    throughput: tuple[float, ...]
    """Iterations/s by GPU count (index 0 = 0.0), on the default GPU type."""
    throughput_by_type: dict[str, tuple[float, ...]] = {}
    """Per-GPU-generation curves (heterogeneous catalogs)."""


class PhillyRow(Struct, frozen=True, kw_only=True):
    job_id: str
    vc: str
    submit_time_s: int
    submit_time_local: str
    duration_s: int
    num_gpus: int
    in_afs_pcs_trace: bool
    in_pollux_subset: bool


# ---------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------


def calibrate(
    curve: Sequence[float], requested_gpus: int, duration_s: float
) -> tuple[int, tuple[float, ...]]:
    """Integer iterations and a scaled curve so that the job runs ``duration_s`` at its request.

    Args:
        curve: base throughput by GPU count.
        requested_gpus: the trace's GPU request (an index into ``curve``).
        duration_s: the trace run time (> 0).

    Returns:
        ``(total_iterations, scaled_curve)`` with
        ``total_iterations / scaled_curve[requested_gpus] == duration_s`` up to rounding.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    rate = curve[requested_gpus]
    if rate <= 0:
        raise ValueError(f"curve has no throughput at {requested_gpus} GPUs")
    work = rate * duration_s
    total = max(1, math.ceil(work - 1e-9))
    factor = total / work
    return total, tuple(v * factor for v in curve)


def eligible_models(requested_gpus: int, curves: Sequence[ThroughputCurve]) -> list[ThroughputCurve]:
    """Table 4 models whose maximum GPU count is at least the request (AFS §5.1)."""
    return [c for c in curves if c.max_gpus >= requested_gpus]


def make_job(
    job_id: str,
    submit_time_s: float,
    duration_s: float,
    requested_gpus: int,
    curve: ThroughputCurve,
    *,
    user: str = "default",
    cap_at_request: bool = False,
    elastic: bool = True,
    by_type: Mapping[str, ThroughputCurve] | None = None,
) -> TraceJob:
    """A calibrated :class:`TraceJob` for one trace row."""
    total, scaled = calibrate(curve.throughput, requested_gpus, duration_s)
    factor = scaled[requested_gpus] / curve.throughput[requested_gpus]
    max_gpus = requested_gpus if cap_at_request else curve.max_gpus
    spec = JobSpec(
        user=user,
        name=job_id,
        model=curve.model,
        min_gpus=1,
        max_gpus=max_gpus,
        requested_gpus=requested_gpus,
        elastic=elastic,
        global_batch_size=curve.batch_size,
        total_iterations=total,
    )
    types = {t: tuple(v * factor for v in c.throughput) for t, c in (by_type or {}).items()}
    return TraceJob(
        job_id=job_id,
        spec=spec,
        submit_time_s=float(math.ceil(submit_time_s)),
        duration_s=float(duration_s),
        throughput=scaled,
        throughput_by_type=types,
    )


def assign_models(
    requests: Sequence[int], seed: int, curves: Sequence[ThroughputCurve] | None = None
) -> list[ThroughputCurve]:
    """Draw one model per job, uniformly, in submission order (REPRODUCTION.md "Models").

    Raises:
        ValueError: a request exceeds every model's maximum.
    """
    pool = list(curves) if curves is not None else [afs_catalog().curve(m, "") for m in AFS_TABLE4_MODELS]
    rng = random.Random(seed)
    out = []
    for i, req in enumerate(requests):
        choices = eligible_models(req, pool)
        if not choices:
            raise ValueError(
                f"job #{i} requests {req} GPUs; no model scales that far (max {max(c.max_gpus for c in pool)})"
            )
        out.append(rng.choice(choices))
    return out


# ---------------------------------------------------------------------------
# Philly
# ---------------------------------------------------------------------------


def _philly_row(r: Mapping[str, str]) -> PhillyRow:
    return PhillyRow(
        job_id=r["job_id"],
        vc=r["vc"],
        submit_time_s=int(r["submit_time_s"]),
        submit_time_local=r["submit_time_local"],
        duration_s=int(r["duration_s"]),
        num_gpus=int(r["num_gpus"]),
        in_afs_pcs_trace=r["in_afs_pcs_trace"] == "1",
        in_pollux_subset=r["in_pollux_subset"] == "1",
    )


def _philly_vc_lines(vc: str) -> Generator[list[str], None, None]:
    """The header, then the raw fields of one VC's rows (both trace flags), read lazily.

    Each VC is its own file, ``data/philly/<vc>.csv.gz``, its rows in submission order
    (``submit_time_s``, then ``job_id``, as :func:`philly_vc_rows` orders them; a test
    checks every file is), so a caller that wants the first rows stops reading early.
    """
    raw = resources.files("shoal").joinpath("data", "philly", f"{vc}.csv.gz")
    with raw.open("rb") as f, gzip.open(f, "rt", encoding="utf-8", newline="") as text:
        yield from csv.reader(text)


@cache
def philly_rows() -> tuple[PhillyRow, ...]:
    """Every row of the shipped Philly files (all 11 VCs, both trace flags), VC by VC in
    :data:`PHILLY_VCS` order, each in submission order."""
    out: list[PhillyRow] = []
    for vc in PHILLY_VCS:
        lines = _philly_vc_lines(vc)
        names = next(lines)
        out += (_philly_row(dict(zip(names, r, strict=True))) for r in lines)
    return tuple(out)


def philly_summary() -> dict[str, dict[str, str]]:
    """The shipped per-VC summary (AFS Table 3 comparison), keyed by VC."""
    return {r["vc"]: r for r in read_rows("philly_afs_11vc_summary.csv")}


@cache
def _philly_vc_fields(vc: str) -> tuple[list[str], tuple[list[str], ...]]:
    """The header and the raw fields of every row of one VC (both trace flags)."""
    lines = _philly_vc_lines(vc)
    header = next(lines)
    return header, tuple(lines)


def _philly_afs_rows(
    header: list[str], fields: Iterable[list[str]], afs_only: bool, limit: int | None
) -> list[list[str]]:
    i_afs = header.index("in_afs_pcs_trace")
    return list(itertools.islice((r for r in fields if r[i_afs] == "1" or not afs_only), limit))


def philly_vc_rows(vc: str, *, afs_only: bool = True, limit: int | None = None) -> list[PhillyRow]:
    """Rows of one VC in submission order (ties by job id); ``limit``: the first ``limit``.

    With a ``limit`` the file is read only as far as those rows (it is stored in this
    order); without one, every row of the VC is parsed once per process and kept.
    """
    if vc not in PHILLY_VCS:
        raise ValueError(f"unknown Philly VC {vc!r}; choose one of {', '.join(PHILLY_VCS)}")
    if limit is not None:
        lines = _philly_vc_lines(vc)
        header = next(lines)
        keep = _philly_afs_rows(header, lines, afs_only, limit)
        lines.close()  # read only as far as the first ``limit`` rows
    else:
        header, fields = _philly_vc_fields(vc)
        keep = _philly_afs_rows(header, fields, afs_only, None)
    col = {name: i for i, name in enumerate(header)}
    i_submit, i_id, i_vc = col["submit_time_s"], col["job_id"], col["vc"]
    if any(r[i_vc] != vc for r in keep):
        raise ValueError(f"the shipped file of Philly VC {vc} holds rows of another VC")
    keep.sort(key=lambda r: (int(r[i_submit]), r[i_id]))
    return [_philly_row(dict(zip(header, r, strict=True))) for r in keep]


def load_philly(
    vc: str,
    *,
    seed: int = 0,
    limit: int | None = None,
    cap_at_request: bool = False,
    curves: Sequence[ThroughputCurve] | None = None,
) -> tuple[TraceJob, ...]:
    """One Philly VC as calibrated jobs (AFS/CoDDL §5.1 and Appendix F).

    Args:
        vc: VC hash, one of :data:`PHILLY_VCS`.
        seed: seed of the model draw.
        limit: keep only the first ``limit`` jobs (arrival times unchanged).
        cap_at_request: hold every job to its request (``max_gpus = requested``).
        curves: model pool; default the nine Table 4 models.
    """
    rows = philly_vc_rows(vc, limit=limit)
    models = assign_models([r.num_gpus for r in rows], seed, curves)
    return tuple(
        make_job(r.job_id, r.submit_time_s, r.duration_s, r.num_gpus, m, cap_at_request=cap_at_request)
        for r, m in zip(rows, models, strict=True)
    )


# ---------------------------------------------------------------------------
# Pollux
# ---------------------------------------------------------------------------


def load_pollux(
    workload_set: str,
    workload_id: int,
    *,
    durations_s: Mapping[str, float] | None = None,
    duration_s: float | None = None,
    catalog: Catalog | None = None,
    gpu_type: str = "T4",
) -> tuple[TraceJob, ...]:
    """A Pollux testbed workload, with run times supplied by the caller.

    Args:
        workload_set: ``workloads`` or ``workloads-realistic``.
        workload_id: 1..8.
        durations_s: run time per application at the job's requested replicas.
        duration_s: one run time for every job (used when ``durations_s`` lacks the app).
        catalog: throughput catalog (default ``pollux-sia``).
        gpu_type: the default GPU generation (``T4`` is Pollux's testbed).

    Raises:
        ValueError: no run time given for an application, or an unknown workload.
    """
    catalog = catalog or get_catalog("pollux-sia")
    rows = [
        r
        for r in read_rows("pollux_workloads.csv")
        if r["workload_set"] == workload_set and int(r["workload_id"]) == workload_id
    ]
    if not rows:
        raise ValueError(f"no Pollux workload {workload_set}/{workload_id}")
    rows.sort(key=lambda r: (int(r["submit_time_s"]), r["job_name"]))
    jobs = []
    for r in rows:
        app = r["application"]
        d = (durations_s or {}).get(app, duration_s)
        if d is None:
            raise ValueError(f"no run time for Pollux application {app!r}: pass durations_s or duration_s")
        curve = catalog.curve(app, gpu_type)
        by_type = catalog.curves[app]
        req = min(int(r["num_replicas"]), curve.max_gpus)
        jobs.append(
            make_job(
                r["job_name"],
                float(r["submit_time_s"]),
                d,
                req,
                curve,
                by_type=by_type if len(by_type) > 1 else None,
            )
        )
    return tuple(jobs)


# ---------------------------------------------------------------------------
# Synthetic
# ---------------------------------------------------------------------------


def poisson_workload(
    n_jobs: int,
    rate_per_hour: float,
    *,
    seed: int = 0,
    mean_duration_s: float = 3600.0,
    gpu_choices: Sequence[int] = (1, 1, 1, 1, 2, 4, 8),
    curves: Sequence[ThroughputCurve] | None = None,
    users: int | Sequence[str] = 1,
    catalog: Catalog | None = None,
    reference_type: str = "v100",
) -> tuple[TraceJob, ...]:
    """Poisson arrivals, exponential run times, requests drawn from ``gpu_choices``.

    Run times are at least one second; arrivals are rounded up to whole seconds.

    Args:
        n_jobs: number of jobs.
        rate_per_hour: mean arrivals per hour.
        seed: seed of every draw (arrivals, run times, requests, users; models use seed + 1).
        mean_duration_s: mean run time at the request.
        gpu_choices: requests are drawn uniformly from this list.
        curves: model pool (default the nine AFS Table 4 models).
        users: how many users (named ``user-<i>``) or their names; each job's user is
            drawn uniformly (one user: ``default``).
        catalog: a heterogeneous catalog (e.g. Gavel); models are drawn from its curves
            on ``reference_type`` and jobs carry every generation's curve.
        reference_type: the generation the run time is calibrated on.
    """
    if n_jobs < 0 or rate_per_hour <= 0 or mean_duration_s <= 0:
        raise ValueError("poisson workload needs n >= 0, rate > 0 and mean_duration_s > 0")
    names = [f"user-{i}" for i in range(users)] if isinstance(users, int) else list(users)
    if not names:
        raise ValueError("poisson workload needs at least one user")
    rng = random.Random(seed)
    t = 0.0
    arrivals, durations, requests, owners = [], [], [], []
    for _ in range(n_jobs):
        arrivals.append(math.ceil(t))
        durations.append(max(1, math.ceil(rng.expovariate(1.0 / mean_duration_s))))
        requests.append(rng.choice(list(gpu_choices)))
        t += rng.expovariate(rate_per_hour / 3600.0)
    if len(names) > 1:
        owners = [rng.choice(names) for _ in range(n_jobs)]
    else:
        owners = ["default" if users == 1 else names[0]] * n_jobs
    by_type: dict[str, Mapping[str, ThroughputCurve]] = {}
    if catalog is not None:
        pool = []
        for model in catalog.models():
            types = catalog.curves[model]
            if reference_type not in types:
                raise ValueError(
                    f"catalog {catalog.name!r} has no {reference_type!r} curve for {model!r}; "
                    f"generations: {sorted(types)}"
                )
            pool.append(types[reference_type])
            by_type[model] = types
        curves = pool
    models = assign_models(requests, seed + 1, curves)
    return tuple(
        make_job(f"poisson-{i:06d}", a, d, g, m, user=u, by_type=by_type.get(m.model))
        for i, (a, d, g, m, u) in enumerate(zip(arrivals, durations, requests, models, owners, strict=True))
    )


# ---------------------------------------------------------------------------
# Dispatch by name
# ---------------------------------------------------------------------------


def _parse_kv(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {part!r}")
        out[key.strip()] = value.strip()
    return out


def load_workload(
    spec: str, *, seed: int = 0, cap_at_request: bool = False, limit: int | None = None
) -> tuple[TraceJob, ...]:
    """Load a workload by its spec string (see the module docstring).

    Examples: ``philly:2869ce``, ``philly:2869ce:200``, ``pollux:workloads:6:duration_s=3600``,
    ``poisson:n=100,rate=20,mean_duration_s=1800``.

    ``limit`` keeps the first ``limit`` jobs; a Philly VC then builds only those (the
    same jobs: models are drawn in submission order).

    Raises:
        ValueError: malformed spec, with what was expected.
    """
    kind, _, rest = spec.partition(":")
    loaders: dict[str, Callable[[], tuple[TraceJob, ...]]] = {}
    if kind == "philly":
        vc, _, first = rest.partition(":")
        keep = [k for k in (int(first) if first else None, limit) if k is not None]
        loaders[kind] = lambda: load_philly(
            vc, seed=seed, limit=min(keep) if keep else None, cap_at_request=cap_at_request
        )
    elif kind == "pollux":
        parts = rest.split(":")
        if len(parts) < 2:
            raise ValueError("pollux workload spec is pollux:<set>:<id>[:duration_s=<s>|<app>=<s>,...]")
        kv = _parse_kv(parts[2]) if len(parts) > 2 else {}
        one = float(kv.pop("duration_s")) if "duration_s" in kv else None
        per_app = {k: float(v) for k, v in kv.items()}
        loaders[kind] = lambda: load_pollux(parts[0], int(parts[1]), durations_s=per_app, duration_s=one)
    elif kind == "poisson":
        kv = _parse_kv(rest)
        try:
            n = int(kv.pop("n"))
            rate = float(kv.pop("rate"))
        except KeyError as exc:
            raise ValueError(f"poisson workload needs n= and rate=; missing {exc}") from None
        mean = float(kv.pop("mean_duration_s", "3600"))
        n_users = int(kv.pop("users", "1"))
        cat = get_catalog(kv.pop("catalog")) if "catalog" in kv else None
        reference = kv.pop("reference", "v100")
        if kv:
            raise ValueError(f"unknown poisson parameters: {sorted(kv)}")
        loaders[kind] = lambda: poisson_workload(
            n, rate, seed=seed, mean_duration_s=mean, users=n_users, catalog=cat, reference_type=reference
        )
    else:
        raise ValueError(
            f"unknown workload kind {kind!r} in {spec!r}; use philly:<vc>, pollux:<set>:<id> or poisson:n=..,rate=.."
        )
    jobs = loaders[kind]()
    return jobs if limit is None else jobs[:limit]

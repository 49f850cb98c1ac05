"""When the profiler publishes: at a bounded rate, and only on material change — pure.

A model update makes the allocator re-decide (``trigger = model_update``), and a
re-decision can move GPUs, so noise in the measurements must not turn into churn.
The rule, per (job, GPU type) for throughput models and per job for convergence
estimates:

1. The first model is published at once (AFS §4.5: the allocator needs the
   optimistic curve as soon as there is a measurement).
2. Later ones wait at least ``min_interval_s`` of the injected clock since the
   previous publication (its occurred-at, read back from the log, so a restarted
   profiler keeps the same pace), and
3. are published only when they changed *materially*: the ``overestimated``
   flag or the model kind changed, an estimate gained a measured count (the
   allocator's next §4.5 step waits for it), a GPU count appeared or disappeared,
   or some count's value moved by more than ``material_change`` (relative,
   default 5 %).

The profiler service passes ``min_interval_s=0`` for an update that gains a measured
count: that count waited out its own measurement window (AFS §4.5; see
``services/profiler/service.py``).

``min_interval_s`` (:data:`MIN_INTERVAL_S` unless ``SHOAL_PROFILER_MIN_INTERVAL_S``
says otherwise) is therefore the least time a job spends on each GPU count the
allocator takes it through for measurement (AFS §4.5); the simulator's
``SimConfig.measure_s`` defaults to it.

A due-but-too-soon update is kept and re-examined at :func:`next_due`. A model
that someone else put in the log for the same (job, GPU type) — e.g. a trace
replay's calibrated curve — counts as the previous publication: the profiler
replaces it only under the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

MIN_INTERVAL_S = 30.0
"""Default least time (virtual seconds) between two publications of one model."""

FIRST = "first"
MATERIAL = "material"
FLAG = "flag"
TOO_SOON = "too_soon"
UNCHANGED = "unchanged"


def relative_change(old: Mapping[int, float], new: Mapping[int, float]) -> float:
    """Largest relative change of a value between two curves (``inf`` if the counts differ).

    Args:
        old: GPU count (or any key) -> value.
        new: The same for the candidate.

    Returns:
        ``max |new − old| / |old|`` over the keys (0 for two empty curves).
    """
    if old.keys() != new.keys():
        return math.inf
    worst = 0.0
    for k, v in new.items():
        o = old[k]
        if o == v:
            continue
        if o == 0 or not math.isfinite(o) or not math.isfinite(v):
            return math.inf
        worst = max(worst, abs(v - o) / abs(o))
    return worst


def publish_decision(
    *,
    now: float,
    last_at: float | None,
    change: float,
    flag_changed: bool,
    min_interval_s: float,
    material_change: float,
) -> str:
    """Whether to publish a candidate update now.

    Args:
        now: The injected clock's time.
        last_at: Occurred-at of the previous publication (``None``: never published).
        change: :func:`relative_change` between the published and the candidate model.
        flag_changed: The ``overestimated`` flag or the model kind changed.
        min_interval_s: Least time between two publications.
        material_change: Least relative change worth publishing.

    Returns:
        :data:`FIRST`, :data:`FLAG` or :data:`MATERIAL` (publish), or
        :data:`TOO_SOON` / :data:`UNCHANGED` (do not).
    """
    if last_at is None:
        return FIRST
    if not flag_changed and change <= material_change:
        return UNCHANGED
    if now - last_at < min_interval_s:
        return TOO_SOON
    return FLAG if flag_changed else MATERIAL


def is_publish(decision: str) -> bool:
    """True for the decisions that publish."""
    return decision in (FIRST, FLAG, MATERIAL)


def next_due(last_ats: Iterable[float], min_interval_s: float) -> float | None:
    """The earliest time a held-back update may be published (``None`` if none is held)."""
    times = [t + min_interval_s for t in last_ats]
    return min(times) if times else None

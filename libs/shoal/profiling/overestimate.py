"""AFS/CoDDL §4.5: *overestimate first, re-adjust later* — pure.

The paper (CoDDL §4.5, "Throughput Measurement"): a new job's initial share is
chosen "by assuming the linear throughput scalability" (within its fair share
1/n). Once it runs, "it takes the throughput measurement with all allocatable
units that are smaller than the given share" (shrinking costs milliseconds, and
the measuring iterations are training iterations), and "in a rare case where a
job needs to predict the throughput beyond the currently allocated share, it
assumes the linear scalability from the last allocatable unit. Then, the
re-adjustment is made again when the real throughputs are reported".

The exact rule of :func:`estimate_curve` (iterations/s at index ``k = 0..max_gpus``):

1. ``k = 0`` is ``0.0``.
2. A measured count keeps its measured value (measurement always wins).
3. An unmeasured count ``k`` assumes linear scalability from an *anchor* ``a``:
   ``T(k) = T(a) · k / a``, where ``a`` is the largest measured count below ``k``
   (§4.5's "last allocatable unit"), or, when no count below ``k`` was measured,
   the smallest measured count (linear through the origin, the same assumption a
   new job starts with).
4. Non-decreasing cap: an unmeasured ``k`` is never given more than a measured
   ``T(b)`` at a larger count ``b > k``. Otherwise a gap between two
   measurements (``T(1)=1, T(4)=2`` → linear ``T(3)=3``) would claim that three
   GPUs beat a measured four; with the cap the estimate stays optimistic about
   every count that can still be measured, never about one that was.
5. No measurement at all: linear scaling in *relative* units, ``T(k) = k``
   (what the allocator must assume for a job that has not run yet; it is not a
   measurement, so the profiler never publishes it as a model).

Why this is an *over*-estimate: data-parallel jobs with a fixed global batch have
non-increasing per-GPU throughput, so linear scaling from the nearest measured
count below ``k`` is the tightest linear upper bound the measurements allow. It
over-states the marginal gain of unmeasured GPUs, so the allocator errs towards
giving GPUs (cheap to take back, §4.3) and measures; under-stating would never
be corrected because the job would never be given the GPUs to measure them.
Below the smallest measured count ``m``, ``T(m)·k/m`` under-states ``T(k)`` but
over-states the gain ``T(m) − T(k)`` of the GPUs between ``k`` and ``m`` — the
quantity a share decision compares (AFS eq. (3)) — so the job keeps its GPUs
until §4.5 measures those smaller counts, which it does next.

:func:`measurement_plan` is what to measure next: the allocatable units not
larger than the current share that have no measurement yet, largest first (the
job first runs with its share, then shrinks through the smaller units).
:func:`allocatable_units` lists the counts network packing allows (AFS appendix
E: 1, 2, 4 … up to a node, then whole nodes).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence


def _clean(measured: Mapping[int, float]) -> dict[int, float]:
    """Positive, finite measurements at positive counts only."""
    return {
        int(k): float(v)
        for k, v in measured.items()
        if int(k) > 0 and isinstance(v, int | float) and math.isfinite(v) and v > 0
    }


def estimate_curve(measured: Mapping[int, float], max_gpus: int) -> tuple[float, ...]:
    """The optimistic throughput curve of §4.5 (see the module docstring for the rule).

    Args:
        measured: GPU count -> measured iterations/s. Non-positive, NaN or
            infinite values and non-positive counts are ignored (not measured).
            Counts above ``max_gpus`` still anchor the estimate.
        max_gpus: Last index of the curve (the job's largest GPU count).

    Returns:
        Iterations/s at index ``k = 0..max_gpus``; index 0 is ``0.0``.

    Raises:
        ValueError: ``max_gpus`` is negative.
    """
    if max_gpus < 0:
        raise ValueError(f"max_gpus must be >= 0, got {max_gpus}")
    points = _clean(measured)
    if not points:
        return tuple(float(k) for k in range(max_gpus + 1))
    counts = sorted(points)
    # suffix_min[i] = smallest measured value at counts[i:], for the non-decreasing cap.
    suffix_min = [math.inf] * (len(counts) + 1)
    for i in range(len(counts) - 1, -1, -1):
        suffix_min[i] = min(points[counts[i]], suffix_min[i + 1])
    out = [0.0] * (max_gpus + 1)
    for k in range(1, max_gpus + 1):
        if k in points:
            out[k] = points[k]
            continue
        i = bisect.bisect_right(counts, k)  # counts[:i] <= k < counts[i:]
        a = counts[i - 1] if i > 0 else counts[0]
        out[k] = min(points[a] * k / a, suffix_min[i])
    return tuple(out)


def calibrate_reference(
    measured: Mapping[int, float], reference: Sequence[float], max_gpus: int
) -> tuple[float, ...]:
    """A known curve's *shape*, re-adjusted to the measurements (§4.5's re-adjust step).

    When the job comes with a reference curve (an offline profile, a trace's
    calibrated curve), its shape is better information than linear scaling. Each
    unmeasured count ``k`` takes ``reference[k] · T(a) / reference[a]`` with the
    same anchor ``a`` as :func:`estimate_curve`; measured counts keep their value.

    Args:
        measured: GPU count -> measured iterations/s (nonsense ignored).
        reference: Iterations/s at index ``0..`` (index 0 unused); its last value
            repeats beyond its end.
        max_gpus: Last index of the result.

    Returns:
        Iterations/s at index ``0..max_gpus``; :func:`estimate_curve` when there is
        no usable reference value at an anchor.
    """
    points = _clean(measured)
    ref = [float(v) for v in reference]
    if not points or len(ref) < 2:
        return estimate_curve(measured, max_gpus)

    def at(k: int) -> float:
        return ref[min(k, len(ref) - 1)]

    counts = sorted(points)
    if any(not (math.isfinite(at(c)) and at(c) > 0) for c in counts):
        return estimate_curve(measured, max_gpus)
    out = [0.0] * (max_gpus + 1)
    for k in range(1, max_gpus + 1):
        if k in points:
            out[k] = points[k]
            continue
        i = bisect.bisect_right(counts, k)
        a = counts[i - 1] if i > 0 else counts[0]
        value = at(k) * points[a] / at(a)
        out[k] = value if math.isfinite(value) and value > 0 else points[a] * k / a
    return tuple(out)


def is_overestimated(
    measured: Mapping[int, float], max_gpus: int, units: Iterable[int] | None = None
) -> bool:
    """True while some count the job may be given has no measurement yet.

    Args:
        measured: GPU count -> measured iterations/s.
        max_gpus: The job's largest GPU count.
        units: The counts that matter (default: every count ``1..max_gpus``).

    Returns:
        Whether any of those counts is estimated rather than measured.
    """
    points = _clean(measured)
    wanted = range(1, max_gpus + 1) if units is None else (u for u in units if 0 < u <= max_gpus)
    return any(u not in points for u in wanted)


def allocatable_units(max_gpus: int, gpus_per_node: int = 0) -> tuple[int, ...]:
    """GPU counts a network-packed share can take (AFS appendix E).

    Powers of two up to a node's size, then multiples of the node size; with
    ``gpus_per_node == 0`` (a flat pool) powers of two. ``max_gpus`` itself is
    always included (a job's largest share).

    Args:
        max_gpus: The job's largest GPU count.
        gpus_per_node: GPUs per server, 0 for a flat pool.

    Returns:
        Increasing counts, all in ``1..max_gpus``.
    """
    if max_gpus <= 0:
        return ()
    units: set[int] = set()
    p = 1
    limit = gpus_per_node if gpus_per_node > 0 else max_gpus
    while p <= min(limit, max_gpus):
        units.add(p)
        p *= 2
    if gpus_per_node > 0:
        units.update(range(gpus_per_node, max_gpus + 1, gpus_per_node))
    units.add(max_gpus)
    return tuple(sorted(units))


def measurement_plan(measured: Mapping[int, float], share: int, units: Iterable[int]) -> tuple[int, ...]:
    """§4.5: the allocatable units not above ``share`` still to be measured.

    Args:
        measured: GPU count -> measured iterations/s.
        share: The job's current share (GPUs).
        units: Allocatable counts (see :func:`allocatable_units`).

    Returns:
        Unmeasured units ``≤ share``, largest first: the job runs with its share,
        then shrinks through the smaller units (each shrink costs milliseconds).
    """
    points = _clean(measured)
    return tuple(sorted({u for u in units if 0 < u <= share and u not in points}, reverse=True))

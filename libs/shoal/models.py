"""Throughput catalogs: how fast a model trains on k GPUs.

A *curve* is a tuple indexed by GPU count: ``curve[k]`` is the throughput with k GPUs,
``curve[0] == 0.0``, and ``len(curve) == max_gpus + 1``. Only ratios between points of
one curve matter to the policies (speedups, marginal gains, remaining time in the
job's own unit), so a catalog is free to use iterations/s or samples/s, and says which.

Three catalogs ship with shoal (data in :mod:`shoal.data`, see ``PROVENANCE.md``):

* ``afs``: the AFS simulator's profiles (AFS/CoDDL Table 4, ``afs_model_speedups.csv``),
  iterations/s at 1..max GPUs. The nine models REPRODUCTION.md names form
  :data:`AFS_TABLE4_MODELS`; the Autoencoder and the batch-4096 Transformer are in the
  file but not in Table 4, and are reachable by name only. GPU type: untyped (``""``).
* ``gavel``: Gavel's isolated throughputs (steps/s) on K80, P100 and V100 at 1, 2, 4, 8
  GPUs. Points between measured counts are linear interpolations (choice: Gavel only
  measures powers of two); a count whose measurement is 0 (ResNet-50/128 on 2+ K80s
  did not fit) ends the curve there. ``consolidated`` selects Gavel's packed worker type
  (default) or the ``_unconsolidated`` one.
* ``pollux-sia``: Pollux/Sia step-time tables, as samples/s. For each (model, GPU type,
  GPU count) repeated measurements are averaged, then the most consolidated placement
  (fewest nodes) is kept and, among its per-GPU batch sizes, the best samples/s
  (choice: the catalog stands for a job that uses the batch size that scales best;
  statistical efficiency, which Pollux trades against it, is not modelled). Counts
  between measured ones are linearly interpolated.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from importlib import resources

from msgspec import Struct

#: The nine models of AFS Table 4 that jobs are drawn from (REPRODUCTION.md, "Models").
AFS_TABLE4_MODELS: tuple[str, ...] = (
    "VggnetModel256",
    "GooglenetModel128",
    "Inception4Model256",
    "Resnet50Model128",
    "DcganModel256",
    "VideopredictionModel64",
    "ChatbotModel256",
    "DeepspeechModel64",
    "TransformerModel256",
)

CATALOG_NAMES: tuple[str, ...] = ("afs", "gavel", "gavel-unconsolidated", "pollux-sia")


class ThroughputCurve(Struct, frozen=True, kw_only=True):
    """One model's throughput by GPU count on one GPU generation."""

    model: str
    """Catalog key of the model (e.g. ``Resnet50Model128``)."""
    gpu_type: str = ""
    """GPU generation; ``""`` when the source does not say."""
    throughput: tuple[float, ...]
    """``throughput[k]`` at k GPUs; index 0 is 0.0; length ``max_gpus + 1``."""
    unit: str = "iterations/s"
    display_name: str = ""
    batch_size: int = 0

    @property
    def max_gpus(self) -> int:
        """Largest GPU count the curve covers."""
        return len(self.throughput) - 1

    def speedup(self, k: int) -> float:
        """Throughput at k GPUs relative to 1 GPU."""
        return self.throughput[k] / self.throughput[1]


class Catalog(Struct, frozen=True, kw_only=True):
    """A named set of curves keyed by (model, GPU type)."""

    name: str
    curves: dict[str, dict[str, ThroughputCurve]]
    """model -> GPU type -> curve."""

    def models(self) -> tuple[str, ...]:
        return tuple(self.curves)

    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted({t for by_type in self.curves.values() for t in by_type}))

    def curve(self, model: str, gpu_type: str | None = None) -> ThroughputCurve:
        """The curve of ``model`` on ``gpu_type`` (or its only/first type when ``None``).

        Raises:
            KeyError: unknown model or type, with the known names in the message.
        """
        by_type = self.curves.get(model)
        if by_type is None:
            raise KeyError(f"model {model!r} not in catalog {self.name!r}; known: {sorted(self.curves)}")
        if gpu_type is None:
            return by_type[sorted(by_type)[0]]
        try:
            return by_type[gpu_type]
        except KeyError:
            raise KeyError(
                f"model {model!r} has no curve for GPU type {gpu_type!r}; known: {sorted(by_type)}"
            ) from None


# ---------------------------------------------------------------------------
# Data access
# ---------------------------------------------------------------------------


def open_data(name: str) -> io.TextIOBase:
    """Open a shipped CSV (``name`` without ``.gz``) as text."""
    raw = resources.files("shoal").joinpath("data", name + ".gz").read_bytes()
    return io.StringIO(gzip.decompress(raw).decode("utf-8"))


def read_rows(name: str) -> Iterator[dict[str, str]]:
    """Rows of a shipped CSV as dicts."""
    with open_data(name) as f:
        yield from csv.DictReader(f)


def interpolate(points: Mapping[int, float], upto: int | None = None) -> tuple[float, ...]:
    """Curve from measured points: linear in between, index 0 = 0.0.

    Args:
        points: GPU count -> throughput (positive counts).
        upto: last index; defaults to the largest measured count.
    """
    counts = sorted(k for k, v in points.items() if k > 0 and v > 0)
    if not counts:
        raise ValueError("no positive measurement")
    upto = counts[-1] if upto is None else upto
    out = [0.0] * (upto + 1)
    for k in range(1, upto + 1):
        if k in points and points[k] > 0:
            out[k] = float(points[k])
            continue
        lo = max((c for c in counts if c < k), default=None)
        hi = min((c for c in counts if c > k), default=None)
        if lo is None:
            # Below the first measurement: scale linearly from the origin.
            out[k] = points[counts[0]] * k / counts[0]
        elif hi is None:
            out[k] = float(points[lo])
        else:
            w = (k - lo) / (hi - lo)
            out[k] = points[lo] * (1 - w) + points[hi] * w
    return tuple(out)


# ---------------------------------------------------------------------------
# Catalogs
# ---------------------------------------------------------------------------


@cache
def afs_catalog() -> Catalog:
    """AFS/CoDDL Table 4 profiles (iterations/s), untyped GPUs."""
    points: dict[str, dict[int, float]] = defaultdict(dict)
    meta: dict[str, tuple[str, int]] = {}
    for row in read_rows("afs_model_speedups.csv"):
        key = row["afs_model_class"]
        points[key][int(row["num_gpus"])] = float(row["throughput_iters_per_s"])
        meta[key] = (row["model"], int(row["batch_size"]))
    curves = {
        key: {
            "": ThroughputCurve(
                model=key,
                throughput=interpolate(pts),
                unit="iterations/s",
                display_name=meta[key][0],
                batch_size=meta[key][1],
            )
        }
        for key, pts in points.items()
    }
    return Catalog(name="afs", curves=curves)


@cache
def gavel_catalog(consolidated: bool = True) -> Catalog:
    """Gavel isolated throughputs (steps/s) per job type on k80/p100/v100."""
    points: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for row in read_rows("gavel_throughputs.csv"):
        if int(row["consolidated"]) != int(consolidated):
            continue
        points[(row["job_type"], row["gpu_type"])][int(row["num_gpus"])] = float(
            row["throughput_steps_per_s"]
        )
    curves: dict[str, dict[str, ThroughputCurve]] = defaultdict(dict)
    for (job_type, gpu_type), pts in sorted(points.items()):
        # A zero measurement (did not fit) ends the curve before it.
        usable: dict[int, float] = {}
        for k in sorted(pts):
            if pts[k] <= 0:
                break
            usable[k] = pts[k]
        if not usable:
            continue
        curves[job_type][gpu_type] = ThroughputCurve(
            model=job_type,
            gpu_type=gpu_type,
            throughput=interpolate(usable),
            unit="steps/s",
            display_name=job_type,
        )
    return Catalog(name="gavel" if consolidated else "gavel-unconsolidated", curves=dict(curves))


@cache
def pollux_sia_catalog() -> Catalog:
    """Pollux/Sia measured throughputs (samples/s) per application and GPU type."""
    # (model, type, gpus, nodes, local_bsz) -> list of samples/s (repeats are averaged)
    samples: dict[tuple[str, str, int, int, int], list[float]] = defaultdict(list)
    for row in read_rows("pollux_sia_throughputs.csv"):
        key = (
            row["model"],
            row["gpu_type"],
            int(row["num_gpus"]),
            int(row["num_nodes"]),
            int(row["local_bsz"]),
        )
        samples[key].append(float(row["throughput_samples_per_s"]))
    best: dict[tuple[str, str, int], tuple[int, float]] = {}
    for (model, gpu_type, gpus, nodes, _bsz), vals in samples.items():
        mean = sum(vals) / len(vals)
        best_key = (model, gpu_type, gpus)
        prev = best.get(best_key)
        # Fewest nodes first, then best samples/s.
        if prev is None or nodes < prev[0] or (nodes == prev[0] and mean > prev[1]):
            best[best_key] = (nodes, mean)
    points: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for (model, gpu_type, gpus), (_nodes, value) in best.items():
        points[(model, gpu_type)][gpus] = value
    curves: dict[str, dict[str, ThroughputCurve]] = defaultdict(dict)
    for (model, gpu_type), pts in sorted(points.items()):
        curves[model][gpu_type] = ThroughputCurve(
            model=model, gpu_type=gpu_type, throughput=interpolate(pts), unit="samples/s", display_name=model
        )
    return Catalog(name="pollux-sia", curves=dict(curves))


def get_catalog(name: str) -> Catalog:
    """A catalog by name (one of :data:`CATALOG_NAMES`).

    Raises:
        ValueError: unknown name.
    """
    if name == "afs":
        return afs_catalog()
    if name == "gavel":
        return gavel_catalog(True)
    if name == "gavel-unconsolidated":
        return gavel_catalog(False)
    if name == "pollux-sia":
        return pollux_sia_catalog()
    raise ValueError(f"unknown catalog {name!r}; choose one of {', '.join(CATALOG_NAMES)}")


def afs_table4() -> tuple[ThroughputCurve, ...]:
    """The nine Table 4 curves, in :data:`AFS_TABLE4_MODELS` order."""
    cat = afs_catalog()
    return tuple(cat.curve(m, "") for m in AFS_TABLE4_MODELS)


def scaled(curve: Iterable[float], factor: float) -> tuple[float, ...]:
    """A curve multiplied by ``factor`` (speedups unchanged)."""
    return tuple(v * factor for v in curve)

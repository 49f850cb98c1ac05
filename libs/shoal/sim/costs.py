"""Reconfiguration cost model: what a change of a job's GPUs costs it, in one place.

The simulator (:mod:`shoal.sim.engine`), SideCar's predictions
(:mod:`shoal.policies.sidecar`) and the reports all charge a change through
:func:`charge`, so a planner and ``shoal simulate`` given the same
:class:`ReconfigCosts` agree by construction. Which :class:`ReconfigCosts` a run uses
is the caller's: the presets below, or another instance (Gandiva_fair's own
suspend/resume costs, :data:`shoal.fairness.policy.SUSPEND_RESUME`, its default and
what its two reports use).

Kinds (``classify``; the vocabulary of ``train/controller.py``'s ``_classify``):

* ``start``: a pending job gets GPUs (0 → k). A job that already made progress
  (resumed after a preemption) is charged a checkpoint-restart when
  ``resume_restart`` is set.
* ``stop``: a running job is preempted (k → 0); it keeps its progress and holds no
  GPUs afterwards, so nothing is charged to GPUs.
* ``scale_out``: k → k' > k in place: stop-free scale-out (EDL §4.2, CoDDL §4.3). The new
  workers *prepare* (start, load, join the rendezvous) while the old ones keep training,
  then every worker stops ``scale_out_s`` for the switch.
* ``scale_in``: k → k' < k in place: graceful exit of the removed workers.
* ``migrate``: the GPU set changed, partly overlapping; the controller adds the new
  workers as in a scale-out (prepare, then the switch).
* ``restart``: checkpoint-restart; the controller runs a move to **disjoint** GPUs so
  (``disjoint=True``), and every resize when ``in_place`` is false (SideCar's mechanism).

:func:`charge` turns a change into a :class:`Charge`: ``stop_s``, the *equivalent* stop
(the job makes no progress for ``stop_s`` and then runs at the new rate; for a scale-out
the prepare phase on the old rate is folded in exactly: the job runs ``P`` seconds at
``r_old`` and stops ``s``, which reaches every later instant with the same progress as
a stop of ``P·(1 − r_old/r_new) + s``), and ``lost_gpu_s``, the GPU-time allocated and
not training (``new × stop`` plus ``added × P`` for the new workers' prepare phase,
as ``benchmarks/bench_reconfig.py`` counts it).

Presets:

* ``free``: every change costs nothing (the AFS simulator's flat setting).
* ``coddl``: AFS §4.3's milliseconds: 0.05 s for scale-out, scale-in, migration and
  restart, no prepare phase.
* ``restart``: checkpoint-restart of every change, 30 s ("tens of seconds", AFS
  Figure 1).
* ``measured``: shoal's own trainer, calibrated from ``benchmarks/bench_reconfig.py``
  (:func:`measured`; the data file ``shoal/data/reconfig_costs.json`` is written by
  ``python benchmarks/calibrate_costs.py`` from the benchmark's report). The default on
  a topology. A trace's run time already includes its first start (AFS), so a first
  start is free; a resume after a preemption is a checkpoint-restart.
* ``sidecar-paper`` / ``termination-paper``: the SideCar paper's case study (§II.C,
  Table I, Figs. 3–4): see :data:`SIDECAR_PAPER` and :data:`TERMINATION_PAPER`.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any, NamedTuple

from msgspec import Struct

KINDS: tuple[str, ...] = ("start", "stop", "scale_out", "scale_in", "migrate", "restart")
_FIELDS = (
    "start_s",
    "stop_s",
    "scale_out_s",
    "scale_in_s",
    "migrate_s",
    "restart_s",
    "restart_per_gpu_s",
    "prepare_s",
    "prepare_per_gpu_s",
    "cross_host_s",
)


class ReconfigCosts(Struct, frozen=True, kw_only=True):
    """Seconds per reconfiguration kind, and how the mechanisms behave."""

    name: str = "custom"
    start_s: float = 0.0
    """A new job's initialisation (SideCar: K8s job init + framework init)."""
    stop_s: float = 0.0
    scale_out_s: float = 0.0
    """Stop of every worker at the switch of an in-place scale-out."""
    scale_in_s: float = 0.0
    migrate_s: float = 0.0
    restart_s: float = 0.0
    """Checkpoint-restart stop: ``restart_s + restart_per_gpu_s × new GPUs``."""
    restart_per_gpu_s: float = 0.0
    prepare_s: float = 0.0
    """New workers' prepare phase, order → switch: ``prepare_s + prepare_per_gpu_s × new GPUs``."""
    prepare_per_gpu_s: float = 0.0
    cross_host_s: float = 0.0
    """Extra stop when a running job needs more hosts than it had (SideCar: GPUs on another
    host cannot join the container; the job is terminated and restarted through K8s)."""
    in_place: bool = True
    """False: every resize of a running job is a checkpoint-restart (SideCar)."""
    resume_restart: bool = False
    """A job with progress that gets GPUs again pays a checkpoint-restart, not ``start_s``."""
    early_init: bool = False
    """SideCar's early initialisation (§I, §III.A): a shrunk job keeps training on the GPUs it
    loses while the incoming job initialises (``start_s``), and only then restarts."""

    def stop_time(self, kind: str) -> float:
        """Base stop seconds of a change of ``kind`` (no prepare phase, no per-GPU term)."""
        if kind == "restart":
            return self.restart_s
        if not self.in_place and kind in ("scale_out", "scale_in", "migrate"):
            return self.restart_s
        return float(getattr(self, f"{kind}_s"))

    def restart_time(self, new_gpus: int) -> float:
        """Stop seconds of a checkpoint-restart onto ``new_gpus`` GPUs."""
        return self.restart_s + self.restart_per_gpu_s * new_gpus

    def prepare_time(self, new_gpus: int) -> float:
        """Seconds from the order to the switch of an in-place scale-out to ``new_gpus``."""
        if not (self.prepare_s or self.prepare_per_gpu_s):
            return 0.0
        return self.prepare_s + self.prepare_per_gpu_s * new_gpus


class Charge(NamedTuple):
    """What one change costs the job (see the module docstring)."""

    kind: str
    stop_s: float
    """Equivalent stop: no progress for this long, then the new rate."""
    lost_gpu_s: float
    """GPU-seconds allocated and not training."""


def _hosts(gpus: int, gpus_per_node: int) -> int:
    return math.ceil(gpus / gpus_per_node) if gpus_per_node > 0 else (1 if gpus else 0)


def charge(
    costs: ReconfigCosts,
    kind: str,
    old: int,
    new: int,
    *,
    rate_old: float = 0.0,
    rate_new: float = 0.0,
    added: int | None = None,
    resumed: bool = False,
    gpus_per_node: int = 0,
) -> Charge:
    """The cost of a change of ``kind`` from ``old`` to ``new`` GPUs.

    Args:
        costs: the cost model.
        kind: from :func:`classify`.
        old: GPUs before.
        new: GPUs after.
        rate_old: iterations/s before (for the prepare phase and early initialisation).
        rate_new: iterations/s after.
        added: GPUs in the new set that were not in the old one (default ``new − old``).
        resumed: a ``start`` of a job that already made progress.
        gpus_per_node: server size for the cross-host charge (0: none); hosts are counted
            as ``ceil(gpus / gpus_per_node)``, as a planner that does not see placement can.
    """
    if kind == "stop" or new <= 0:
        return Charge(kind, 0.0, 0.0)
    if kind == "start":
        if resumed and costs.resume_restart:
            stop = costs.restart_time(new)
            return Charge("restart", stop, stop * new)
        return Charge(kind, costs.start_s, costs.start_s * new)
    extra = costs.cross_host_s if _hosts(new, gpus_per_node) > _hosts(old, gpus_per_node) else 0.0
    if kind == "restart" or not costs.in_place:
        stop = costs.restart_time(new) + extra
        if costs.early_init and new < old:
            stop = _early(costs, stop, rate_old, rate_new)
        return Charge("restart", stop, stop * new)
    gained = max(0, new - old) if added is None else added
    if kind == "scale_in":
        stop = costs.scale_in_s + extra
        if costs.early_init:
            stop = _early(costs, stop, rate_old, rate_new)
        return Charge(kind, stop, stop * new)
    switch = (costs.scale_out_s if kind == "scale_out" else costs.migrate_s) + extra
    prepare = costs.prepare_time(new) if gained else 0.0
    if prepare and rate_new > 0:
        stop = prepare * max(0.0, 1.0 - rate_old / rate_new) + switch
    else:
        stop = switch
    return Charge(kind, stop, switch * new + prepare * gained)


def _early(costs: ReconfigCosts, stop: float, rate_old: float, rate_new: float) -> float:
    """A shrink with early initialisation: the job trains ``o = max(0, start_s − stop)``
    more seconds on the old rate, then stops ``stop``, so its GPUs are free when the
    incoming job is initialised. Equivalent stop ``o·(1 − r_old/r_new) + stop``, at least
    0 (at 0 the rest of its gain while it kept its GPUs is not credited)."""
    overlap = max(0.0, costs.start_s - stop)
    if rate_new <= 0 or not overlap:
        return stop
    return max(0.0, overlap * (1.0 - rate_old / rate_new) + stop)


def load_calibration() -> dict[str, Any]:
    """The calibration data written by ``benchmarks/calibrate_costs.py``."""
    text = resources.files("shoal").joinpath("data/reconfig_costs.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def measured() -> ReconfigCosts:
    """shoal's trainer as ``benchmarks/bench_reconfig.py`` measured it (see the data file)."""
    model = load_calibration()["model"]
    return ReconfigCosts(
        name="measured",
        scale_out_s=model["scale_out_s"],
        scale_in_s=model["scale_in_s"],
        migrate_s=model["scale_out_s"],
        restart_s=model["restart_s"],
        restart_per_gpu_s=model["restart_per_gpu_s"],
        prepare_s=model["prepare_s"],
        prepare_per_gpu_s=model["prepare_per_gpu_s"],
        resume_restart=True,
    )


SIDECAR_PAPER = ReconfigCosts(
    name="sidecar-paper",
    start_s=110.0,
    restart_s=32.0,
    cross_host_s=191.0,
    in_place=False,
    early_init=True,
)
"""The SideCar framework's costs, read off the paper's case study (§II.C, Table I, Figs. 3–4):
a new job starts 110 s after its decision (180 → 290 s, early initialisation included);
a reshape restarts the process inside its container: 27 s down, 37 s up, taken as their
mean 32 s; GPUs on another host need a K8s terminate and restart (the termination
approach's 204/242 s, mean 223 s: 191 s on top of the in-container restart). With early
initialisation the shrunk job keeps training for 110 − 32 = 78 s of the new job's
initialisation and then restarts, so its GPUs are free when the new job is ready."""

TERMINATION_PAPER = ReconfigCosts(name="termination-paper", start_s=110.0, restart_s=223.0, in_place=False)
"""The termination approach of the SideCar paper: every reshape terminates and restarts the
K8s job, 204 s down and 242 s up (case study), taken as their mean 223 s; no early
initialisation."""

PRESETS: dict[str, ReconfigCosts] = {
    "free": ReconfigCosts(name="free"),
    "coddl": ReconfigCosts(name="coddl", scale_out_s=0.05, scale_in_s=0.05, migrate_s=0.05, restart_s=0.05),
    "restart": ReconfigCosts(name="restart", restart_s=30.0, in_place=False),
    "sidecar-paper": SIDECAR_PAPER,
    "termination-paper": TERMINATION_PAPER,
}


def classify(old_gpus: int, new_gpus: int, moved: bool, disjoint: bool = False) -> str | None:
    """The kind of a change, or ``None`` when nothing changed.

    Args:
        old_gpus: GPUs before.
        new_gpus: GPUs after.
        moved: the GPU set changed although the count did not.
        disjoint: the old and new GPU sets share no GPU (a checkpoint-restart).
    """
    if old_gpus == new_gpus and not moved:
        return None
    if old_gpus == 0:
        return "start" if new_gpus else None
    if new_gpus == 0:
        return "stop"
    if disjoint:
        return "restart"
    if old_gpus == new_gpus:
        return "migrate"
    return "scale_out" if new_gpus > old_gpus else "scale_in"


def get_costs(name: str) -> ReconfigCosts:
    """A preset by name (``measured`` too), or ``field=seconds,...`` (e.g. ``scale_out=0.5,migrate=20``;
    a field is a kind or one of ``restart_per_gpu``, ``prepare``, ``prepare_per_gpu``, ``cross_host``).

    Raises:
        ValueError: unknown preset or field.
    """
    if name == "measured":
        return measured()
    if name in PRESETS:
        return PRESETS[name]
    values: dict[str, Any] = {}
    for part in filter(None, name.split(",")):
        kind, sep, secs = part.partition("=")
        if not sep or f"{kind}_s" not in _FIELDS:
            raise ValueError(
                f"cost model is one of {', '.join([*PRESETS, 'measured'])} or field=seconds with field in "
                f"{', '.join(f.removesuffix('_s') for f in _FIELDS)}; got {name!r}"
            )
        values[f"{kind}_s"] = float(secs)
    return ReconfigCosts(name=name, **values)

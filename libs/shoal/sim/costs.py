"""Reconfiguration cost model: how long a job's workers stop when its GPUs change.

Kinds (the ``ReconfigurationStarted.kind`` vocabulary):

* ``start``: a pending job gets GPUs (0 → k).
* ``stop``: a running job is preempted (k → 0); it keeps its progress.
* ``scale_out``: k → k' > k; CoDDL/EDL add workers without stopping (§4.3, EDL §4.2).
* ``scale_in``: k → k' < k; graceful exit of the removed workers (CoDDL §4.3).
* ``migrate``: same count, different GPUs (placement moved the job).

Presets (REPRODUCTION.md, "Reconfiguration costs"):

* ``free``: every change costs nothing — the AFS simulator's flat setting (default
  with ``--flat``).
* ``coddl``: shrink and the switch after concurrent expansion take milliseconds (AFS
  §4.3); taken as 0.05 s for scale-out, scale-in and migration. Start and stop free.
  Default on a topology.
* ``restart``: checkpoint-restart of every running job that changes, 30 s ("tens of
  seconds", AFS Figure 1); start and stop free because a trace's run time already
  includes its start-up.

While stopped the job holds its new GPUs and makes no progress; the GPU-time lost is
``stop_time × new GPU count``.
"""

from __future__ import annotations

from msgspec import Struct

KINDS: tuple[str, ...] = ("start", "stop", "scale_out", "scale_in", "migrate")


class ReconfigCosts(Struct, frozen=True, kw_only=True):
    """Stop time in seconds per reconfiguration kind."""

    name: str = "custom"
    start_s: float = 0.0
    stop_s: float = 0.0
    scale_out_s: float = 0.0
    scale_in_s: float = 0.0
    migrate_s: float = 0.0

    def stop_time(self, kind: str) -> float:
        """Seconds the job's workers are stopped by a change of ``kind``."""
        return float(getattr(self, f"{kind}_s"))


PRESETS: dict[str, ReconfigCosts] = {
    "free": ReconfigCosts(name="free"),
    "coddl": ReconfigCosts(name="coddl", scale_out_s=0.05, scale_in_s=0.05, migrate_s=0.05),
    "restart": ReconfigCosts(name="restart", scale_out_s=30.0, scale_in_s=30.0, migrate_s=30.0),
}


def classify(old_gpus: int, new_gpus: int, moved: bool) -> str | None:
    """The kind of a change, or ``None`` when nothing changed.

    Args:
        old_gpus: GPUs before.
        new_gpus: GPUs after.
        moved: the GPU set changed although the count did not.
    """
    if old_gpus == new_gpus:
        return "migrate" if moved and new_gpus else None
    if old_gpus == 0:
        return "start"
    if new_gpus == 0:
        return "stop"
    return "scale_out" if new_gpus > old_gpus else "scale_in"


def get_costs(name: str) -> ReconfigCosts:
    """A preset by name, or ``kind=seconds,...`` (e.g. ``scale_out=0.5,migrate=20``).

    Raises:
        ValueError: unknown preset or kind.
    """
    if name in PRESETS:
        return PRESETS[name]
    values: dict[str, float] = {}
    for part in filter(None, name.split(",")):
        kind, sep, secs = part.partition("=")
        if not sep or kind not in KINDS:
            raise ValueError(
                f"cost model is one of {', '.join(PRESETS)} or kind=seconds with kind in {', '.join(KINDS)}; got {name!r}"
            )
        values[f"{kind}_s"] = float(secs)
    return ReconfigCosts(name=name, **values)

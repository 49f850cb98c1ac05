"""Administrator commands added after the first four: per-user quotas.

``SetUserLimits`` is a :class:`shoal.events.Command` like the others and travels the
same way (``<prefix>.cmd.set_user_limits.<sender>``, msgpack or JSON, answered by
admission). :data:`ANY_COMMAND` is the union the decoders use (:mod:`shoal.codec`).

Why not in :mod:`shoal.events`: that module is part of the fingerprint of every stored
reproduction cell (``benchmarks/afs_reproduction.py`` hashes its code, because events
and their defaults decide what the simulator logs and folds). A command is never seen
by the simulator, so a new one is kept out of it: adding a command then does not mark
results stale that it cannot change.
"""

from __future__ import annotations

from typing import ClassVar

from shoal.events import AnyCommand, Command, NonNegInt, UserName


class SetUserLimits(Command, frozen=True, tag="cmd.set_user_limits"):
    """Admin: a user's quota, as a production scheduler's per-user quota (Kueue's
    ``ClusterQueue`` quota, a Slurm association's ``MaxJobs``/``GrpTRES``). Admission
    records it as the user's ``UserRegistered`` (tickets unchanged) and refuses a
    submission that would go over it (``limit_exceeded``)."""

    name: ClassVar[str] = "set_user_limits"
    user: UserName
    max_active_jobs: NonNegInt | None = None
    """Most pending + running jobs; 0: the installation's default
    (``SHOAL_MAX_ACTIVE_JOBS_PER_USER``, no limit unless set); None: keep the current value."""
    max_gpus: NonNegInt | None = None
    """Most GPUs the user's active jobs may ask for, counted as the sum of their
    ``min_gpus``; 0: the installation's default (``SHOAL_MAX_GPUS_PER_USER``, no limit
    unless set); None: keep the current value."""


ADMIN_COMMAND_TYPES: tuple[type[Command], ...] = (SetUserLimits,)
ANY_COMMAND = AnyCommand | SetUserLimits
"""Every command admission and the sidecars decode."""

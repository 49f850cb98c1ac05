"""The worker's configuration: one typed struct read from ``SHOAL_TRAIN_*`` variables."""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

ENV_PREFIX = "SHOAL_TRAIN_"
RECOVERY_MODES = ("consistent", "approximate")


class TrainConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a worker process learns from its environment (set by the trainer sidecar).

    Without ``control`` the job is not run by shoal: it runs under torchrun (when
    ``WORLD_SIZE`` is set) or as a single process, unchanged.
    """

    control: str = ""
    """``host:port`` of the sidecar's control server; empty outside shoal."""
    worker: int = -1
    job: str = ""
    leader: str = ""
    """Id of the leader whose control server ``control`` is. When that connection closes
    (the leader handed over, EDL §4.2), the worker looks in ``<checkpoint_dir>/leader.json``
    for a leader with another id, for up to ``rendezvous_timeout_s``, and reconnects to it;
    meanwhile it keeps training in its current process group."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL; ``CUDA_VISIBLE_DEVICES`` holds this worker's GPU)."""
    checkpoint_dir: str = ""
    checkpoint_every: int = 200
    """Steps between the leader's periodic checkpoints (consistent recovery, EDL §4.2); 0 = never."""
    collective_timeout_s: float = 30.0
    """How long one collective waits for its peers: a hung or dead peer is noticed within
    it. The all-reduce retried after an approximate regroup waits twice this, so that a
    survivor that noticed at once waits for one that notices only by this timeout."""
    rendezvous_timeout_s: float = 120.0
    recovery: str = "consistent"
    """When a worker dies: ``consistent`` restarts the survivors from the last checkpoint;
    ``approximate`` re-forms the group of survivors at once and completes the current
    step with their gradients (the dead worker's share of that batch is lost; EDL §4.2)."""
    max_restarts: int = 3
    """How many times the job may be started again after its workers stopped against its
    will: a worker death (either recovery mode), or a start or restart that failed with
    no worker left running (retried at once). One more and the job fails (the sidecar
    publishes ``JobFailed``), as TorchElastic's ``--max-restarts`` ends a job."""
    trace_dir: str = ""
    """Debug/test aid: every worker appends what it consumed at each step here."""
    trace_params_every: int = 0
    """With ``trace_dir``: rank 0 also records the parameters every this many steps (0 = never)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"SHOAL_TRAIN_DEVICE must be 'cpu' or 'cuda', got {self.device!r}")
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"SHOAL_TRAIN_RECOVERY must be one of {RECOVERY_MODES}, got {self.recovery!r}")
        if self.collective_timeout_s <= 0 or self.rendezvous_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_restarts < 0:
            raise ValueError(f"SHOAL_TRAIN_MAX_RESTARTS must be >= 0, got {self.max_restarts}")
        if self.control and ":" not in self.control:
            raise ValueError(f"SHOAL_TRAIN_CONTROL must be host:port, got {self.control!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainConfig:
        """Read ``SHOAL_TRAIN_<FIELD>`` variables.

        Raises:
            ValueError: a variable has a value of the wrong type or outside its range.
        """
        env = os.environ if environ is None else environ
        raw = {
            name: env[ENV_PREFIX + name.upper()]
            for name in cls.__struct_fields__
            if ENV_PREFIX + name.upper() in env
        }
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad {ENV_PREFIX}* setting: {exc}") from None

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this config in a child process."""
        return {ENV_PREFIX + k.upper(): str(v) for k, v in msgspec.structs.asdict(self).items()}

"""The elastic data pipeline: each sample exactly once per data epoch, whatever the resizes.

EDL §4.3 hands out logical partitions of a random permutation on demand from the
leader. shoal keeps the same guarantee with the coordination moved off the hot
path: the permutation of a data epoch is a pure function of ``(seed, data_epoch)``
and the position in it (``cursor``) is part of the job's synchronised state, so
every worker of a generation computes the same global batch at every step and
takes its own contiguous slice of it. A resize only changes how the next global
batch is split; the cursor moves on by the global batch whatever the world size,
so no sample is repeated or skipped. The cursor travels with the model in the
state broadcast to new workers and in checkpoints (EDL's "partition permutation
and worker progress").

Pure Python and NumPy: no torch here, so it is unit-tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCALING_MODES = ("strong", "weak")


@dataclass(frozen=True)
class Scaling:
    """How the global batch follows the world size.

    * ``strong`` (EDL's default): the global batch stays ``global_batch_size``;
      the per-worker batch is ``global / world`` (the remainder goes to the lowest ranks).
    * ``weak``: each worker takes ``per_worker_batch`` samples while the world size is
      within ``[weak_min, weak_max]``; outside the range the global batch is clamped
      to ``per_worker_batch * weak_min`` or ``per_worker_batch * weak_max``.
    """

    mode: str = "strong"
    global_batch_size: int = 64
    per_worker_batch: int = 0
    weak_min: int = 1
    weak_max: int = 1 << 30

    def __post_init__(self) -> None:
        if self.mode not in SCALING_MODES:
            raise ValueError(f"scaling mode must be one of {SCALING_MODES}, got {self.mode!r}")
        if self.mode == "strong" and self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.mode == "weak":
            if self.per_worker_batch < 1:
                raise ValueError(f"weak scaling needs per_worker_batch >= 1, got {self.per_worker_batch}")
            if not 1 <= self.weak_min <= self.weak_max:
                raise ValueError(
                    f"weak range must satisfy 1 <= min <= max, got [{self.weak_min}, {self.weak_max}]"
                )

    def global_batch(self, world: int) -> int:
        """Global batch size at ``world`` workers."""
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        if self.mode == "strong":
            return self.global_batch_size
        return self.per_worker_batch * min(max(world, self.weak_min), self.weak_max)


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous share of ``n`` items over ``world`` ranks."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class ElasticSampler:
    """Hands each worker its slice of the next global batch; see the module docstring.

    The state that must travel between workers is ``(data_epoch, cursor)``; the
    permutation is recomputed from ``seed``.
    """

    def __init__(self, dataset_size: int, scaling: Scaling, *, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {dataset_size}")
        self.dataset_size = dataset_size
        self.scaling = scaling
        self.seed = seed
        self.shuffle = shuffle
        self.data_epoch = 0
        self.cursor = 0
        self._perm_epoch = -1
        self._perm = np.arange(dataset_size)

    def permutation(self, data_epoch: int) -> np.ndarray:
        """The sample order of one data epoch (a pure function of seed and epoch)."""
        if data_epoch != self._perm_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, data_epoch])
                self._perm = rng.permutation(self.dataset_size)
            else:
                self._perm = np.arange(self.dataset_size)
            self._perm_epoch = data_epoch
        return self._perm

    def global_indices(self, world: int) -> np.ndarray:
        """The global batch of the next step at ``world`` workers (the epoch's tail may be short)."""
        size = min(self.scaling.global_batch(world), self.dataset_size - self.cursor)
        return self.permutation(self.data_epoch)[self.cursor : self.cursor + size]

    def local_indices(self, world: int, rank: int) -> np.ndarray:
        """This rank's share of the next global batch (possibly empty at an epoch's tail)."""
        batch = self.global_indices(world)
        start, stop = split(len(batch), world, rank)
        return batch[start:stop]

    def advance(self, global_size: int) -> None:
        """Move past a global batch of ``global_size`` samples; roll over at the epoch's end."""
        if not 0 < global_size <= self.dataset_size - self.cursor:
            raise ValueError(
                f"cannot advance by {global_size} at cursor {self.cursor} of {self.dataset_size}"
            )
        self.cursor += global_size
        if self.cursor == self.dataset_size:
            self.data_epoch += 1
            self.cursor = 0

    def state(self) -> dict[str, int]:
        return {"data_epoch": self.data_epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"sampler seed {self.seed} does not match the saved seed {state['seed']}")
        cursor = int(state["cursor"])
        if not 0 <= cursor < self.dataset_size:
            raise ValueError(f"saved cursor {cursor} outside a dataset of {self.dataset_size}")
        self.data_epoch = int(state["data_epoch"])
        self.cursor = cursor

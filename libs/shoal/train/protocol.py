"""Control messages between a trainer sidecar and its workers (JSON lines over TCP).

No torch here: the sidecar side of the protocol runs in the asyncio sidecar.

Worker -> sidecar: :class:`Hello`, :class:`Ready`, :class:`Progress`, :class:`Switched`,
:class:`Aborted`, :class:`Left`, :class:`Stopped`, :class:`Done`, :class:`WorkerFailed`.
Sidecar -> worker: :class:`Plan`, :class:`Commit`, :class:`Abort`.

Environment a worker is started with (see :mod:`shoal.train` for the whole design):
``SHOAL_TRAIN_CONTROL`` (``host:port`` of the sidecar's control server),
``SHOAL_TRAIN_WORKER`` (this worker's id), ``SHOAL_TRAIN_JOB``,
``SHOAL_TRAIN_CHECKPOINT_DIR``, ``SHOAL_TRAIN_DEVICE`` (``cpu`` or ``cuda``) and the
timeouts of :class:`shoal.train.config.TrainConfig`.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec


class Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of every control message."""


# --- worker -> sidecar ------------------------------------------------------------


class Hello(Msg, frozen=True, tag="hello"):
    """First line on every control connection; a worker that reconnects to a new leader
    after a handover also says which generation it is in and its step."""

    worker: int
    pid: int
    gen: int = -1
    step: int = -1


class Ready(Msg, frozen=True, tag="ready"):
    """The worker holds a connected process group for ``gen`` (or, leaving, needs none)."""

    worker: int
    gen: int
    restored_step: int = -1
    """Cold generations: the step the worker's checkpoint restores (-1: none)."""


class Progress(Msg, frozen=True, tag="progress"):
    """Rank 0 after every step."""

    worker: int
    gen: int
    step: int
    data_epoch: int
    cursor: int
    loss: float
    samples: int
    step_time_s: float
    world: int


class Switched(Msg, frozen=True, tag="switched"):
    """The new rank 0 after a switch to ``gen``: how long every worker was stopped."""

    worker: int
    gen: int
    step: int
    stop_time_s: float
    broadcast_s: float = 0.0
    restore_s: float = 0.0


class Aborted(Msg, frozen=True, tag="aborted"):
    """Rank 0 dropped the commit of ``gen`` before announcing it."""

    worker: int
    gen: int


class Left(Msg, frozen=True, tag="left"):
    """A worker leaves at the switch to ``gen`` (graceful scale-in)."""

    worker: int
    gen: int
    step: int


class Stopped(Msg, frozen=True, tag="stopped"):
    """Rank 0 after a checkpoint-and-stop (the SideCar path)."""

    worker: int
    step: int
    checkpoint: str
    checkpoint_s: float = 0.0


class Done(Msg, frozen=True, tag="done"):
    """Training reached its end (rank 0)."""

    worker: int
    step: int


class WorkerFailed(Msg, frozen=True, tag="failed"):
    worker: int
    gen: int
    step: int
    reason: str


# --- sidecar -> worker ------------------------------------------------------------


class Plan(Msg, frozen=True, tag="plan"):
    """Membership of generation ``gen``; ``members`` are worker ids in rank order.

    ``src`` is the rank in ``gen`` that broadcasts the state (an old member for a
    warm switch; rank 0 of a cold generation, which restores from the checkpoint).
    ``broadcast`` is false for a pure scale-in: every member already has the state.
    """

    gen: int
    members: tuple[int, ...]
    src: int = 0
    cold: bool = False
    broadcast: bool = True
    store_host: str = "127.0.0.1"
    store_port: int = 0


class Commit(Msg, frozen=True, tag="commit"):
    """Switch to ``gen`` at the end of step ``at_step`` (EDL's future timestamp)."""

    gen: int
    at_step: int


class Abort(Msg, frozen=True, tag="abort"):
    """Cancel the pending generation ``gen`` (CoDDL §4.3)."""

    gen: int


ToSidecar = Hello | Ready | Progress | Switched | Aborted | Left | Stopped | Done | WorkerFailed
ToWorker = Plan | Commit | Abort

# --- leader handover (EDL §4.1-§4.2) -------------------------------------------------

LEADER_FILE = "leader.json"
"""In the job's checkpoint directory: where the current leader's control server is."""


class LeaderAddress(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker whose control connection closed reads to find the new leader."""

    control: str
    """``host:port`` of the new leader's control server."""
    leader: str
    """The new leader's id (``SHOAL_TRAIN_LEADER`` of the workers it starts)."""


class Handover(msgspec.Struct, frozen=True, kw_only=True):
    """A leader's running generation, handed to the next leader so that it adopts the
    workers in place instead of restarting them (EDL §4.2, scale-in of the leader).

    Written by :meth:`shoal.train.controller.Controller.detach`, read by
    :meth:`~shoal.train.controller.Controller.adopt`.
    """

    leader: str
    """Id of the leader that handed over (its workers know it as ``SHOAL_TRAIN_LEADER``)."""
    gen: int
    members: tuple[int, ...]
    """Worker ids in rank order."""
    gpus: tuple[tuple[str, int], ...]
    """``(node_id, index)`` of each member, in the same order."""
    next_worker: int
    """The next free worker id: the new leader numbers its workers from here."""
    epoch: int
    step: int = 0


def write_leader_file(directory: str | Path, address: LeaderAddress) -> Path:
    """Atomically write ``address`` to ``directory / LEADER_FILE``; returns the path."""
    path = Path(directory) / LEADER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(msgspec.json.encode(address))
    os.replace(tmp, path)
    return path


def read_leader_file(directory: str | Path) -> LeaderAddress | None:
    """The address in ``directory / LEADER_FILE``; ``None`` when missing or malformed."""
    try:
        return msgspec.json.decode((Path(directory) / LEADER_FILE).read_bytes(), type=LeaderAddress)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


_enc = msgspec.json.Encoder()
_dec_sidecar = msgspec.json.Decoder(ToSidecar)
_dec_worker = msgspec.json.Decoder(ToWorker)


def encode(msg: Msg) -> bytes:
    return _enc.encode(msg) + b"\n"


def decode_to_sidecar(line: bytes) -> ToSidecar:
    return _dec_sidecar.decode(line)


def decode_to_worker(line: bytes) -> ToWorker:
    return _dec_worker.decode(line)

"""Clocks, injected wherever time is read, so emulation can run faster than real time.

Every process of one emulated installation shares the same ``origin`` and ``scale``:
virtual now = origin + (wall now − origin) × scale. Events are stamped with the
virtual time, so the log, the fold (attained service) and the policies all live in
the same (virtual) seconds as the simulator's.

:class:`SharedClock` is the synchronized variant for emulation: the same scaled time,
but it stands still while the control plane works on an event and never passes an
event that is known to be due (its docstring has the protocol). ``fcntl`` makes it
POSIX-only, like the node daemon's process handling.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import structlog

from shoal.runtime import pid_alive

log = structlog.get_logger("shoal.clock")


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, virtual_s: float) -> None: ...


class WallClock:
    """Real time."""

    scale = 1.0

    def now(self) -> float:
        return time.time()

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(max(0.0, virtual_s))


class ScaledClock:
    """Virtual time running ``scale`` times faster than the wall clock since ``origin``."""

    def __init__(self, scale: float, origin: float | None = None) -> None:
        if scale <= 0:
            raise ValueError(f"time scale must be positive, got {scale}")
        self.scale = scale
        self.origin = time.time() if origin is None else origin

    def now(self) -> float:
        return self.origin + (time.time() - self.origin) * self.scale

    def to_wall(self, virtual_s: float) -> float:
        """A virtual duration in wall seconds."""
        return virtual_s / self.scale

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(max(0.0, virtual_s / self.scale))


def make_clock(scale: float = 1.0, origin: float | None = None) -> WallClock | ScaledClock:
    return WallClock() if scale == 1.0 and origin is None else ScaledClock(scale, origin)


# -- the synchronized clock of an emulated installation ------------------------

HOLD_TTL_S = 10.0
"""Wall seconds a hand-over hold lives when nobody releases it (a lost message, a
consumer that died): after that the clock runs on, with a warning."""


class _Barrier(msgspec.Struct, array_like=True):
    at: float
    """Virtual instant the clock may not pass."""
    owner: int
    """Process that holds it (0: a hand-over hold, not tied to a process)."""
    expires: float
    """Monotonic wall second it lapses at (0: never)."""


class _State(msgspec.Struct):
    scale: float
    v0: float
    """Virtual instant at wall (monotonic) second ``w0``; virtual time runs at
    ``scale`` from there, up to the lowest live barrier."""
    w0: float
    barriers: dict[str, _Barrier] = {}
    ttl_factor: float = 1.0
    """Every hand-over hold's lifetime is its ``ttl_s`` times this (set at creation)."""


_decode_state = msgspec.json.Decoder(_State).decode
_encode = msgspec.json.Encoder().encode


def _alive(pid: int) -> bool:
    """Whether a barrier's owner lives (0: a hand-over hold, owned by no process)."""
    return pid == 0 or pid == os.getpid() or pid_alive(pid)


class SharedClock:
    """Scaled virtual time that stops at barriers, shared by every process of one
    emulated installation through a small file (``path``) and a lock file beside it.

    Why: at 1000× a 20 ms control-plane path is 20 virtual seconds in which jobs keep
    running under shares the allocator has already changed. Stamping events with
    their decision instant (see the allocator and the emulated trainer) repairs
    progress after the fact, but not what happened in between: a job that completed
    under its old share, two completions that reached the allocator as one burst, a
    decision the placer skipped. With this clock, virtual time stops instead:

    * whoever knows of a future event holds a *barrier* at its instant (the trace
      replay at the next arrival, a job's leading trainer at its finish instant, the
      allocator at its next periodic decision), so the clock cannot pass an event
      before it has happened;
    * an event that starts control-plane work is published under a *hold* (a barrier
      at the current instant) that its consumer releases once it has published its
      own outcome under holds of its own: arrival or completion → allocator
      (``SharesDecided``) → placer (per node) → node daemon (per order) → trainer,
      which releases the last hold once the order is applied and its new finish
      instant is a barrier.

    So the clock stands still while the control plane works, and the emulated run
    sees the simulator's sequence of instants whatever the machine's latency — the
    conformance test's decision sequences agree one for one. Conservative
    (Chandy–Misra style) synchronisation, with the file as the only shared state.

    A barrier owned by a process that died is dropped, and a hand-over hold nobody
    released lapses after ``HOLD_TTL_S`` wall seconds (logged): a lost message slows
    the run down, it does not stop it. Virtual time stays continuous: every change
    of the file first re-bases the clock at the instant it showed.

    Keys name what a hold waits for (see :func:`hold_key`): ``submit:<job>``,
    ``done:<job>``, ``epoch:<n>``, ``place:<n>:<node>``, ``order:<n>:<node>:<job>``,
    ``measure:<job>`` and ``model:<job>:<gpu type>`` (AFS §4.5's measurements).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock_path = self.path + ".lock"
        state = self._read()
        self.scale = state.scale
        self.origin = state.v0
        self.ttl_factor = state.ttl_factor
        """Hand-over holds live ``ttl_s`` times this (see :meth:`create`)."""

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        scale: float,
        origin: float | None = None,
        *,
        hold_ttl_s: float = HOLD_TTL_S,
    ) -> SharedClock:
        """A new clock file at ``path``. ``hold_ttl_s``: how long a hand-over hold nobody
        releases lives (wall seconds; the longer holds some services place, and the
        waits tied to them, are stretched by the same factor); a consumer slower than
        that on a loaded machine is taken for a lost message and the clock runs on."""
        if scale <= 0:
            raise ValueError(f"time scale must be positive, got {scale}")
        if not hold_ttl_s > 0:
            raise ValueError(f"hold_ttl_s must be positive, got {hold_ttl_s}")
        p = os.fspath(path)
        state = _State(
            scale=scale,
            v0=time.time() if origin is None else origin,
            w0=time.monotonic(),
            ttl_factor=hold_ttl_s / HOLD_TTL_S,
        )
        _write_atomic(p, _encode(state))
        with open(p + ".lock", "ab"):
            pass
        return cls(p)

    def _read(self) -> _State:
        with open(self.path, "rb") as f:
            return _decode_state(f.read())

    @staticmethod
    def _view(state: _State, wall: float) -> tuple[float, str | None]:
        """(the virtual now, the key of a dead or lapsed barrier it stops at, if any)."""
        free = state.v0 + (wall - state.w0) * state.scale
        now, invalid = free, None
        for key, b in state.barriers.items():
            if b.at < now:
                now = b.at
                invalid = key if (b.expires and wall > b.expires) or not _alive(b.owner) else None
        return now, invalid

    def now(self) -> float:
        state = self._read()
        now, invalid = self._view(state, time.monotonic())
        if invalid is None:
            return now
        self._update(lambda s, at: None)  # drops it, re-based where it stood
        return self.now()

    def to_wall(self, virtual_s: float) -> float:
        """A virtual duration in wall seconds (when nothing holds the clock)."""
        return virtual_s / self.scale

    async def sleep(self, virtual_s: float) -> None:
        target = self.now() + virtual_s
        while (left := target - self.now()) > 0:
            await asyncio.sleep(max(left / self.scale, 0.002))

    def _update(self, change: Callable[[_State, float], None]) -> None:
        """Apply ``change(state, now)`` under the lock, after re-basing the clock at
        the instant it shows (so virtual time never jumps) and dropping dead barriers."""
        with open(self._lock_path, "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self._read()
                wall = time.monotonic()
                now, _ = self._view(state, wall)
                state.v0, state.w0 = now, wall
                for key, b in list(state.barriers.items()):
                    if (b.expires and wall > b.expires) or not _alive(b.owner):
                        del state.barriers[key]
                        if b.owner == 0:
                            log.warning("clock_hold_lapsed", key=key, at=b.at)
                change(state, now)
                _write_atomic(self.path, _encode(state))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def hold(self, key: str, at: float | None = None, *, ttl_s: float | None = HOLD_TTL_S) -> None:
        """Hold the clock at ``at`` (default: now; never before now) under ``key``,
        replacing an earlier barrier of that key. ``ttl_s=None``: the barrier belongs
        to this process and lasts while it lives; otherwise it is a hand-over hold
        that lapses after ``ttl_s`` wall seconds times the clock's ``ttl_factor``."""
        owner = os.getpid() if ttl_s is None else 0

        def change(state: _State, now: float) -> None:
            expires = 0.0 if ttl_s is None else time.monotonic() + ttl_s * state.ttl_factor
            state.barriers[key] = _Barrier(max(now, now if at is None else at), owner, expires)

        self._update(change)

    def release(self, *keys: str) -> None:
        """Drop the barriers of ``keys`` (those that exist)."""
        if not any(k in self._read().barriers for k in keys):
            return

        def change(state: _State, now: float) -> None:
            for k in keys:
                state.barriers.pop(k, None)

        self._update(change)

    def barriers(self) -> dict[str, float]:
        """key -> instant of every barrier now in the file (for tools and tests)."""
        return {k: b.at for k, b in self._read().barriers.items()}


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def hold(clock: object, key: str, at: float | None = None, *, ttl_s: float | None = HOLD_TTL_S) -> None:
    """:meth:`SharedClock.hold` when ``clock`` is one; nothing otherwise."""
    if isinstance(clock, SharedClock):
        clock.hold(key, at, ttl_s=ttl_s)


def release(clock: object, *keys: str) -> None:
    """:meth:`SharedClock.release` when ``clock`` is one; nothing otherwise."""
    if isinstance(clock, SharedClock) and keys:
        clock.release(*keys)


def submit_key(job_id: str) -> str:
    """The hold an arrival is submitted under (released by the allocator)."""
    return f"submit:{job_id}"


def done_key(job_id: str) -> str:
    """The hold a completion is published under (released by the allocator)."""
    return f"done:{job_id}"


def measure_key(job_id: str) -> str:
    """The hold at the end of a job's measurement window (AFS §4.5; the allocator
    takes it at a decision that gives the job an unmeasured GPU count, the profiler
    moves it to the window's end and releases it once it has published the count)."""
    return f"measure:{job_id}"


def model_key(job_id: str, gpu_type: str) -> str:
    """The hold a throughput model is published under (released by the allocator)."""
    return f"model:{job_id}:{gpu_type}"


def hold_key(event: object) -> str | None:
    """The key of the hold a triggering event was published under (an arrival, a
    job's end or a throughput model; the allocator releases it once it has decided on
    it), or ``None``."""
    from shoal import events as ev

    if isinstance(event, ev.JobSubmitted):
        return submit_key(event.job_id)
    if isinstance(event, ev.JobCompleted | ev.JobFailed | ev.JobCancelled):
        return done_key(event.job_id)
    if isinstance(event, ev.ThroughputModelUpdated):
        return model_key(event.job_id, event.gpu_type)
    return None

"""A service's view of the log: snapshot + replay + live tail, folded into ClusterState.

Every service that needs state holds one :class:`Projection`. It starts from the
newest snapshot (if a name is given and a valid one exists), replays the rest of the
log, and keeps following the live tail on the same consumer, so there is never a gap
or a duplicate.

Snapshots: every service reads :data:`CLUSTER_SNAPSHOT` (the leading allocator
writes it, see ``services/allocator/service.py``), since they all fold the same log
into the same :class:`~shoal.state.ClusterState`. A snapshot is used only when it
passes :func:`check_snapshot` (schema not newer than :data:`SNAPSHOT_SCHEMA`, the
decoded state has the stored digest, its sequence is not past the stream's end);
otherwise it is ignored with a warning (``snapshot_ignored``) and the whole log is
replayed. A service whose own listeners fold more than the cluster state (the
profiler's measurements) passes ``restore`` instead: its own loader and checks, which
give the state and sequence to start from (``snapshot`` in the log line is then that
snapshot's name). Once caught up, the projection logs ``projection_ready`` with the
snapshot's sequence, how many messages it replayed (``replayed``) and the state's
digest. The follower is a :func:`shoal.tasks.critical` task: if it dies, the
process fails (exit 1) rather than go on with a state that no longer moves. ``ready`` is set once the projection has caught up with the log as it
was at start; ``wait_for(seq)`` gives read-your-writes after a publish.

Services of one process may share a projection (the emulated stack of the
conformance test runs admission, placer and node daemons in one event loop): each adds its listener
(:meth:`Projection.add_listener`, before the projection starts, so that none misses
an event) and calls ``start``/``stop`` as if it were its own; the log is followed
once while any of them runs. Every event then costs one message and one decode
instead of one per service, which is most of what the event loop does in a busy
emulation. Sharers only read the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from shoal import state as st
from shoal.bus import Bus, SkippedMessage, Snapshot
from shoal.events import Envelope
from shoal.tasks import critical

log = structlog.get_logger("shoal.projection")

Listener = Callable[[int, Envelope, st.ClusterState], None]
SkipListener = Callable[[SkippedMessage], None]
Restore = Callable[[], Awaitable[tuple[str, st.ClusterState, int] | None]]
"""A service's own snapshot loader: (snapshot name, state, its sequence), or None to replay."""

CLUSTER_SNAPSHOT = "cluster"
"""Name of the snapshot of the folded cluster state that every service starts from."""

SNAPSHOT_SCHEMA = 1
"""Version of the encoded :class:`~shoal.state.ClusterState` in a snapshot. Raise it
when a change to the state makes older encodings decode to a wrong state; a reader
ignores a snapshot of a newer schema than its own (and replays the log)."""


def check_snapshot(snap: Snapshot, *, stream_last_seq: int) -> tuple[st.ClusterState | None, str]:
    """The state of ``snap`` if it can be used, else None and why not (pure).

    Usable: schema at most :data:`SNAPSHOT_SCHEMA`, a digest that the decoded state
    reproduces, and a sequence not past ``stream_last_seq`` (a snapshot of a log that
    was since deleted and started again describes another log).
    """
    if snap.schema > SNAPSHOT_SCHEMA:
        return None, f"schema {snap.schema} is newer than this reader's {SNAPSHOT_SCHEMA}"
    if snap.seq > stream_last_seq:
        return None, f"sequence {snap.seq} is past the stream's last sequence {stream_last_seq}"
    if not snap.digest:
        return None, "no digest"
    try:
        state = st.decode_state(snap.state)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return None, f"state does not decode: {exc}"
    actual = st.digest(state)
    if actual != snap.digest:
        return None, f"digest mismatch (stored {snap.digest[:12]}, state {actual[:12]})"
    return state, ""


def snapshot_due(folded: int, since_s: float, every: int, interval_s: float) -> bool:
    """Whether a service's snapshot writer should write now: something was folded since its
    last snapshot, and either ``every`` events were or ``interval_s`` seconds passed."""
    return folded > 0 and (folded >= every or since_s >= interval_s)


class Projection:
    """The folded cluster state of one process, kept current from the log.

    Args:
        bus: a connected bus.
        snapshot_name: load/save snapshots under this name (None: always replay all).
        listeners: called after each event is applied, with (seq, envelope, state);
            a listener must not block (it may set flags or put work on a queue).
        skip_listeners: called, in log order with the events, for each message the
            replay skipped (it does not decode here; it is counted and dead-lettered,
            see :mod:`shoal.bus`). A writer that appends with an expected sequence
            moves its cursor on these too.
        restore: instead of the cluster snapshot, a service's own snapshot (the
            profiler's): awaited at start, before the stream's end is read; it returns
            a checked state and its sequence (the service restores its listeners' data
            itself), or None to replay the whole log.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        snapshot_name: str | None = None,
        listeners: list[Listener] | None = None,
        skip_listeners: list[SkipListener] | None = None,
        restore: Restore | None = None,
    ):
        self.bus = bus
        self.snapshot_name = snapshot_name
        self.restore = restore
        self.listeners = list(listeners or [])
        self.skip_listeners = list(skip_listeners or [])
        self.state = st.ClusterState()
        self.last_seq = 0
        self.ready = asyncio.Event()
        self._advanced = asyncio.Condition()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._users = 0
        self.restored_from_snapshot = False
        self.snapshot_label = snapshot_name
        """Name of the snapshot started from (the ``projection_ready`` line's ``snapshot``)."""
        self.snapshot_seq = 0
        """Sequence of the snapshot this projection started from (0: none)."""
        self.replayed = 0
        """Messages (events and skipped ones) read from the log since start."""
        self.replayed_to_ready: int | None = None
        """``replayed`` at the moment the projection caught up (None before)."""
        self._started_at = 0.0

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` after each event from now on (add it before :meth:`start`)."""
        self.listeners.append(listener)

    def add_skip_listener(self, listener: SkipListener) -> None:
        """Call ``listener`` for each skipped message from now on (add it before :meth:`start`)."""
        self.skip_listeners.append(listener)

    async def start(self) -> None:
        """Restore the snapshot (if any) and start following the log. Further calls
        (another service sharing this projection) only count one more user."""
        self._users += 1
        if self._users > 1:
            return
        self._started_at = time.monotonic()
        snap = await self._load() if self.snapshot_name else None
        own = await self.restore() if self.restore is not None else None
        # Read after the snapshot: its sequence was in the stream when it was written.
        target = await self.bus.wait_for_stream()
        if snap is not None:
            self._restore(snap, target)
        elif own is not None:
            self.snapshot_label, self.state, self.last_seq = own
            self.snapshot_seq = self.last_seq
            self.restored_from_snapshot = True
        if self.last_seq >= target:
            self._set_ready()
        # A follower that dies must not leave the service deciding on a frozen state.
        self._task = critical(asyncio.create_task(self._follow(target), name="projection"))

    async def _load(self) -> Snapshot | None:
        name = self.snapshot_name
        assert name is not None
        try:
            return await self.bus.load_snapshot(name)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            log.warning("snapshot_ignored", snapshot=name, reason=f"unreadable: {exc}")
            return None
        except Exception as exc:  # cannot read it (permissions, store unavailable): replay
            log.warning("snapshot_ignored", snapshot=name, reason=f"cannot be read: {exc!r}")
            return None

    def _restore(self, snap: Snapshot, stream_last_seq: int) -> None:
        state, reason = check_snapshot(snap, stream_last_seq=stream_last_seq)
        if state is None:
            log.warning("snapshot_ignored", snapshot=self.snapshot_name, seq=snap.seq, reason=reason)
            return
        self.state = state
        self.last_seq = self.snapshot_seq = snap.seq
        self.restored_from_snapshot = True

    def _set_ready(self) -> None:
        if self.ready.is_set():
            return
        self.replayed_to_ready = self.replayed
        self.ready.set()
        log.info(
            "projection_ready",
            snapshot=self.snapshot_label,
            snapshot_seq=self.snapshot_seq,
            replayed=self.replayed,
            last_seq=self.last_seq,
            digest=st.digest(self.state),
            elapsed_s=round(time.monotonic() - self._started_at, 3),
        )

    async def _follow(self, target: int) -> None:
        try:
            async for batch in self.bus.replay_batches(
                start_seq=self.last_seq + 1,
                follow=True,
                stop=self._stop,
                idle_expires_s=0.5,
                dead_letter=True,
            ):
                state = self.state
                skipped = batch.skipped
                i = 0
                for seq, env in batch:
                    while i < len(skipped) and skipped[i].seq < seq:
                        self._skipped(skipped[i])
                        i += 1
                    st.apply(state, env)
                    for listener in self.listeners:
                        listener(seq, env, state)
                for rest in skipped[i:]:
                    self._skipped(rest)
                self.replayed += len(batch) + len(skipped)
                self.last_seq = max(self.last_seq, batch.last_seq)
                if self.last_seq >= target:
                    self._set_ready()
                async with self._advanced:
                    self._advanced.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("projection_failed")
            raise

    def _skipped(self, skipped: SkippedMessage) -> None:
        for listener in self.skip_listeners:
            listener(skipped)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Return once the replay has caught up with the log.

        Raises:
            TimeoutError: the replay folded nothing for ``timeout_s`` (stuck). A replay that
                keeps folding is waited for however long it takes: a service without a
                usable snapshot on a long log (10^6 events took about a minute on a loaded
                2-core machine) would otherwise be ended at every start and never come up.
        """
        while True:
            seq = self.last_seq
            try:
                await asyncio.wait_for(self.ready.wait(), timeout_s)
                return
            except TimeoutError:
                if self.last_seq == seq:
                    raise
                log.info("replay_still_running", folded_seq=self.last_seq, since_seq=seq)

    async def wait_for(self, seq: int, timeout_s: float = 10.0) -> None:
        """Return once every event up to ``seq`` is folded (read-your-writes)."""

        async def _wait() -> None:
            async with self._advanced:
                await self._advanced.wait_for(lambda: self.last_seq >= seq)

        if self.last_seq < seq:
            await asyncio.wait_for(_wait(), timeout_s)

    async def save_snapshot(self) -> int:
        """Store the current state and its sequence; returns the sequence."""
        if not self.snapshot_name:
            raise ValueError("this projection has no snapshot name")
        seq = self.last_seq
        await self.bus.save_snapshot(
            self.snapshot_name,
            seq,
            st.encode_state(self.state),
            digest=st.digest(self.state),
            schema=SNAPSHOT_SCHEMA,
        )
        return seq

    async def stop(self) -> None:
        """Stop following the log once its last user stops."""
        self._users = max(0, self._users - 1)
        if self._users:
            return
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

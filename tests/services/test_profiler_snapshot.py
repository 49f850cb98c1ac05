"""The profiler's own snapshot (issue 21: start-up independent of log length).

The checks are pure (first tests). Against a real nats-server: a profiler restored from
the snapshot plus the tail holds the book a full replay holds and proposes the same
updates; ``shoal run profiler`` writes the snapshot as leader, a second ``shoal run
profiler`` folds only the tail after it and ends with the book (payload bytes) of a full
replay; a corrupt snapshot is ignored with one line and the log replayed; the profiler's
identity writes its own snapshot bucket and nothing else's, and no one else writes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.auth import CredentialStore
from shoal.bus import Bus, Snapshot
from shoal.clock import WallClock
from shoal.nats_server import EmbeddedNats
from shoal.profiling import ProfileBook, ProfileParams
from shoal.profiling.snapshot import (
    PROFILER_SNAPSHOT,
    PROFILER_SNAPSHOT_SCHEMA,
    check_profiler_snapshot,
    encode_profiler_snapshot,
)
from shoal.projection import CLUSTER_SNAPSHOT
from shoal_services.profiler.service import ProfilerService

from tests.services.test_faults import Children, service_env
from tests.services.test_snapshot_start import _logged

pytestmark = pytest.mark.integration

# -- a log with measurements ------------------------------------------------------------


def _jobs(n: int, at: float) -> list[ev.Envelope]:
    out = [codec.wrap(ev.UserRegistered(user="u", tickets=100), at=at)]
    out += [
        codec.wrap(
            ev.JobSubmitted(
                job_id=f"j{i}",
                spec=ev.JobSpec(user="u", model="resnet50", max_gpus=8, convergence_target=0.5),
            ),
            at=at,
        )
        for i in range(n)
    ]
    return out


def _reports(jobs: int, n: int, at: float, start: int = 0) -> list[ev.Envelope]:
    """``n`` progress reports round-robin over the jobs, at 1, 2 and 4 GPUs, with a loss."""
    out = []
    for k in range(start, start + n):
        gpus = (1, 2, 4)[k % 3]
        out.append(
            codec.wrap(
                ev.ProgressReported(
                    job_id=f"j{k % jobs}",
                    iteration=10 * k + 10,
                    num_gpus=gpus,
                    samples_per_s=1.0 / (0.4 / gpus + 0.05 + 0.02 * gpus) * (1 + 0.01 * (k % 5)),
                    loss=1.0 / (0.01 * (k + 1) + 1.0) + 0.1,
                    gpu_type="V100",
                    epoch=0,
                    data_epoch=k // 20,
                ),
                at=at + k * 0.01,
            )
        )
    return out


def _fold(envs: list[ev.Envelope], book: ProfileBook | None = None) -> tuple[st.ClusterState, ProfileBook]:
    """The pure fold the profiler does (state + book), without a bus."""
    state = st.ClusterState()
    book = book or ProfileBook()
    for seq, env in enumerate(envs, start=1):
        st.apply(state, env)
        e = env.event
        if isinstance(e, ev.ProgressReported):
            book.observe(seq, e, env.at, state.jobs.get(e.job_id))
        elif isinstance(e, ev.JobCompleted):
            book.forget(e.job_id)
    return state, book


def _encode(state: st.ClusterState, book: ProfileBook, seq: int) -> Snapshot:
    return encode_profiler_snapshot(
        seq=seq,
        state=state,
        book=book,
        model_at={("j0", "V100"): 1.5},
        convergence_at={"j0": 2.5},
        subject_seq={"t.job.j0.profile.convergence_estimated": 7},
    )


def test_snapshot_is_deterministic_and_restores_what_a_fold_holds() -> None:
    envs = _jobs(3, 100.0) + _reports(3, 60, 100.0)
    state, book = _fold(envs)
    snap = _encode(state, book, len(envs))
    again = _fold(envs)
    assert _encode(*again, len(envs)) == snap, "the same log encodes to the same bytes"
    # A leader's plan clears the dirty sets: the snapshot does not depend on it.
    book.dirty_models.clear()
    book.dirty_convergence.clear()
    assert _encode(state, book, len(envs)) == snap
    got, reason = check_profiler_snapshot(snap, stream_last_seq=len(envs), params=ProfileParams())
    assert got is not None, reason
    fresh = again[1]
    assert got.book.rates == fresh.rates and got.book.losses == fresh.losses
    assert got.book.basis == fresh.basis and got.book.loss_basis == fresh.loss_basis
    assert got.book.last == fresh.last and got.book.epoch_starts == fresh.epoch_starts
    assert got.book.dirty_models == fresh.dirty_models and fresh.dirty_models
    assert got.book.dirty_convergence == fresh.dirty_convergence and fresh.dirty_convergence
    assert st.digest(got.state) == st.digest(state)
    assert got.model_at == {("j0", "V100"): 1.5} and got.convergence_at == {"j0": 2.5}
    assert got.subject_seq == {"t.job.j0.profile.convergence_estimated": 7}
    # Re-encoded after restore: the same bytes (insertion order is kept).
    assert _encode(got.state, got.book, got.seq) == snap


def test_check_accepts_only_a_sound_snapshot() -> None:
    envs = _jobs(2, 100.0) + _reports(2, 10, 100.0)
    snap = _encode(*_fold(envs), len(envs))
    replace = msgspec.structs.replace
    junk = b"\xc1junk"
    bad = [
        (replace(snap, schema=PROFILER_SNAPSHOT_SCHEMA + 1), {}, "schema"),
        (replace(snap, schema=0), {}, "schema"),
        (replace(snap, seq=len(envs) + 1), {}, "past the stream"),
        (replace(snap, digest=""), {}, "no digest"),
        (replace(snap, state=snap.state[:-1] + b"\x00"), {}, "digest mismatch"),
        (replace(snap, state=junk, digest=hashlib.sha256(junk).hexdigest()), {}, "does not decode"),
        (snap, {"params": ProfileParams(window=7)}, "other parameters"),
    ]
    for s, kw, why in bad:
        got, reason = check_profiler_snapshot(
            s, stream_last_seq=len(envs), params=kw.get("params", ProfileParams())
        )
        assert got is None and why in reason, (why, reason)


# -- against a real server ----------------------------------------------------------------


class FixedClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    async def sleep(self, virtual_s: float) -> None:
        await asyncio.sleep(0)


async def _full_fold(bus: Bus, upto: int) -> ProfilerService:
    """A profiler's fold of the whole log up to ``upto``, done here (not started)."""
    svc = ProfilerService(bus, holder="reference", clock=FixedClock(0.0))
    state = svc.projection.state
    async for batch in bus.replay_batches(start_seq=1, dead_letter=False):
        skipped = list(batch.skipped)
        for seq, env in batch:
            while skipped and skipped[0].seq < seq:
                svc._on_skipped(skipped.pop(0))
            if seq > upto:
                break
            st.apply(state, env)
            svc._on_event(seq, env, state)
        for rest in skipped:
            if rest.seq <= upto:
                svc._on_skipped(rest)
        if batch.last_seq >= upto:
            break
    svc.projection.last_seq = upto
    return svc


async def test_restored_profiler_holds_and_proposes_what_a_full_replay_does(bus: Bus) -> None:
    at = time.time()
    await bus.publish_many(_jobs(4, at) + _reports(4, 120, at))
    full = ProfilerService(bus, holder="full", clock=FixedClock(at + 10))
    await full.projection.start()
    try:
        await full.projection.wait_ready()
        assert not full.projection.restored_from_snapshot
        full.snapshot_every = 1
        await full._maybe_snapshot()
        assert full.snapshots == 1
        # The tail: more reports, a new job, a finished one.
        await bus.publish_many(
            _reports(4, 30, at + 5, start=120)
            + _jobs(5, at + 6)[5:]
            + _reports(5, 10, at + 7, start=150)
            + [codec.wrap(ev.JobCompleted(job_id="j1", iterations=100), at=at + 8)]
        )
        last = await bus.last_seq()
        restored = ProfilerService(bus, holder="restored", clock=FixedClock(at + 10))
        await restored.projection.start()
        try:
            await restored.projection.wait_ready()
            await full.projection.wait_for(last)
            assert restored.projection.restored_from_snapshot
            assert restored.projection.snapshot_seq == full._snapshot_seq
            assert restored.projection.replayed == last - full._snapshot_seq
            assert restored.snapshot() == full.snapshot(), "same book, state and cursors"
            assert restored.book.dirty_models == full.book.dirty_models
            assert restored.book.dirty_convergence == full.book.dirty_convergence
            plan_r = [(e.id, e.event) for e in restored.plan(at + 10)]
            plan_f = [(e.id, e.event) for e in full.plan(at + 10)]
            assert plan_r == plan_f and plan_r, "the same updates, with the same ids"
        finally:
            await restored.projection.stop()
    finally:
        await full.projection.stop()


@pytest.fixture
def kids(tmp_path: Path) -> Iterator[Children]:
    k = Children(tmp_path)
    try:
        yield k
    finally:
        k.stop_all()


async def _profiler_snapshot(bus: Bus) -> Snapshot | None:
    return await bus.load_snapshot(PROFILER_SNAPSHOT, bucket=bus.names.profiler_snapshot_bucket)


async def _snapshot_at_least(bus: Bus, kids: Children, name: str, seq: int) -> Snapshot:
    deadline = time.monotonic() + 40
    while (snap := await _profiler_snapshot(bus)) is None or snap.seq < seq:
        assert kids.procs[name].poll() is None, kids.log(name)
        assert time.monotonic() < deadline, kids.log(name)
        await asyncio.sleep(0.1)
    return snap


async def test_shoal_run_profiler_starts_from_its_snapshot_and_folds_only_the_tail(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, kids: Children
) -> None:
    env = service_env(nats_url, prefix, WallClock(), tmp_path, snapshot_every="1")
    at = time.time()
    await bus.publish_many(_jobs(4, at) + _reports(4, 400, at))
    history = await bus.last_seq()
    kids.start("writer", "profiler", env)
    first = await _snapshot_at_least(bus, kids, "writer", history)
    kids.procs["writer"].terminate()
    kids.procs["writer"].wait(20)
    tail = _reports(4, 30, at + 5, start=400)
    await bus.publish_many(tail)
    kids.start("profiler", "profiler", env)
    ready = await _logged(kids, "profiler", "projection_ready")
    assert ready["snapshot"] == PROFILER_SNAPSHOT and ready["snapshot_seq"] >= first.seq, ready
    assert ready["replayed"] == ready["last_seq"] - ready["snapshot_seq"], ready
    assert ready["replayed"] < len(tail) + 50, ready
    # As leader it writes its own snapshot after the tail: the book a full replay builds.
    newer = await _snapshot_at_least(bus, kids, "profiler", ready["last_seq"])
    reference = (await _full_fold(bus, newer.seq)).snapshot()
    assert newer.seq == reference.seq and newer.digest == reference.digest
    assert newer.state == reference.state


async def test_a_corrupt_profiler_snapshot_means_a_full_replay(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, kids: Children
) -> None:
    env = service_env(nats_url, prefix, WallClock(), tmp_path)
    at = time.time()
    await bus.publish_many(_jobs(2, at) + _reports(2, 100, at))
    last = await bus.last_seq()
    good = (await _full_fold(bus, last)).snapshot()
    bucket = bus.names.profiler_snapshot_bucket
    store = await bus._snapshot_store(bucket)
    flipped = msgspec.structs.replace(good, state=good.state[:-1] + bytes([good.state[-1] ^ 1]))
    await store.put(PROFILER_SNAPSHOT, msgspec.msgpack.encode(flipped))
    kids.start("p1", "profiler", env)
    ignored = await _logged(kids, "p1", "snapshot_ignored")
    assert "digest mismatch" in ignored["reason"], ignored
    ready = await _logged(kids, "p1", "projection_ready")
    assert ready["snapshot_seq"] == 0 and ready["replayed"] == ready["last_seq"] >= last, ready
    kids.procs["p1"].terminate()
    kids.procs["p1"].wait(20)
    await store.put(PROFILER_SNAPSHOT, b"\x00garbage")
    kids.start("p2", "profiler", env)
    ignored = await _logged(kids, "p2", "snapshot_ignored")
    assert "unreadable" in ignored["reason"], ignored
    ready = await _logged(kids, "p2", "projection_ready")
    assert ready["snapshot_seq"] == 0 and ready["replayed"] == ready["last_seq"], ready
    lines = [r for r in (kids.log_dir / "p2.log").read_text().splitlines() if "snapshot_ignored" in r]
    assert len(lines) == 1, lines


async def _refused(bus: Bus, write: Coroutine[Any, Any, None], subjects: str) -> None:
    """``write`` is refused by the server: a permissions violation on a subject starting
    with ``subjects`` (lower case, as the client reports it), and the write never completes."""
    task = asyncio.create_task(write)
    deadline = time.monotonic() + 10
    try:
        while not any(s.startswith(subjects) for s in bus.permission_errors):
            assert not task.done() or task.exception() is not None, "the write went through"
            assert time.monotonic() < deadline, list(bus.permission_errors)
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def test_only_the_profiler_writes_its_snapshot_and_nothing_else(tmp_path: Path) -> None:
    """Real permissions (a server of its own: the shared one's ``*`` prefix is no bucket
    token): the profiler's identity writes and reads its own bucket; it cannot write the
    cluster snapshot, and the placer cannot write the profiler's."""
    creds = CredentialStore(tmp_path / "creds")
    admin = str(creds.ensure("admin"))
    profiler = str(creds.ensure("profiler"))
    placer = str(creds.ensure("placer"))
    prefix = "psnap"
    with EmbeddedNats(store_dir=tmp_path / "js", creds_dir=creds.directory, prefix=prefix) as srv:
        buses = {
            who: await Bus.connect(srv.url, prefix=prefix, creds=seed)
            for who, seed in (("admin", admin), ("profiler", profiler), ("placer", placer))
        }
        try:
            snap = _encode(*_fold(_jobs(1, 1.0)), 0)
            mine = buses["profiler"].names.profiler_snapshot_bucket
            await buses["profiler"].save_snapshot(
                PROFILER_SNAPSHOT, 0, snap.state, digest=snap.digest, schema=snap.schema, bucket=mine
            )
            # A second write replaces the first (the old chunks are purged).
            await buses["profiler"].save_snapshot(
                PROFILER_SNAPSHOT, 0, snap.state, digest=snap.digest, schema=snap.schema, bucket=mine
            )
            got = await buses["placer"].load_snapshot(PROFILER_SNAPSHOT, bucket=mine)
            assert got == snap
            await _refused(
                buses["placer"],
                buses["placer"].save_snapshot(
                    PROFILER_SNAPSHOT, 9, b"forged", digest="x", schema=1, bucket=mine
                ),
                f"$o.{mine.lower()}.",
            )
            # The admin creates the cluster bucket; the profiler may not write into it.
            await buses["admin"].save_snapshot(CLUSTER_SNAPSHOT, 0, b"", digest="", schema=1)
            cluster_bucket = buses["profiler"].names.snapshot_bucket
            await _refused(
                buses["profiler"],
                buses["profiler"].save_snapshot(CLUSTER_SNAPSHOT, 9, b"forged", digest="x", schema=1),
                f"$o.{cluster_bucket.lower()}.",
            )
            assert await buses["admin"].load_snapshot(PROFILER_SNAPSHOT, bucket=mine) == snap
            cluster = await buses["admin"].load_snapshot(CLUSTER_SNAPSHOT)
            assert cluster is not None and cluster.seq == 0
        finally:
            for b in buses.values():
                await b.close()


async def test_a_snapshot_of_many_chunks_reads_whole(bus: Bus) -> None:
    """The profiler's snapshot is megabytes (6.5 MB at 10^6 events): read back whole, in
    order and checked against the object's SHA-256, through the batched read."""
    import os

    blob = os.urandom(3_000_000)
    bucket = bus.names.profiler_snapshot_bucket
    await bus.save_snapshot(PROFILER_SNAPSHOT, 1, blob, digest="d", schema=1, bucket=bucket)
    store = await bus.js.object_store(bucket)
    assert (await store.get_info(PROFILER_SNAPSHOT)).chunks > 10
    snap = await bus.load_snapshot(PROFILER_SNAPSHOT, bucket=bucket)
    assert snap is not None and snap.state == blob and snap.seq == 1

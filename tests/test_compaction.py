"""``shoal compact``: progress reports no fold needs go, and no fold of the log changes.

The pure half (:mod:`shoal.compaction`) on hand-made logs, then the command as an
operator runs it against a real nats-server, as the admin and as an outsider.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as hs
from shoal import codec, state
from shoal import events as ev
from shoal.auth import CredentialStore
from shoal.bus import Bus
from shoal.compaction import ProgressLedger, compacted_fold, kept
from shoal.events import Envelope
from shoal.nats_server import EmbeddedNats
from shoal.projection import CLUSTER_SNAPSHOT

from tests.test_backup import _cli


def _spec() -> ev.JobSpec:
    return ev.JobSpec(user="alice", total_iterations=1000)


def _history() -> list[tuple[ev.Event, float]]:
    """Jobs a (finished, three reports), b (running), c (started by its first report,
    finished), d (restarted from a checkpoint: 10, 20, 15, 25; finished)."""
    h: list[tuple[ev.Event, float]] = []
    for j in "abcd":
        h.append((ev.JobSubmitted(job_id=j, spec=_spec()), 1.0))
    for j in "abd":
        h.append((ev.ReconfigurationStarted(job_id=j, epoch=1, kind="start", to_world=1), 2.0))
    for i, it in enumerate((10, 20, 30)):
        h.append((ev.ProgressReported(job_id="a", iteration=it, num_gpus=1, loss=1.0 / it), 3.0 + i))
        h.append((ev.ProgressReported(job_id="b", iteration=it, num_gpus=1), 3.0 + i))
        h.append((ev.ProgressReported(job_id="c", iteration=it, num_gpus=1), 3.0 + i))
    for i, it in enumerate((10, 20, 15, 25)):
        h.append((ev.ProgressReported(job_id="d", iteration=it, num_gpus=1), 3.0 + i))
    for j in "acd":
        h.append((ev.JobCompleted(job_id=j, iterations=1000), 8.0))
    return h


def _log() -> list[tuple[int, Envelope]]:
    return [(seq, codec.wrap(e, at=at)) for seq, (e, at) in enumerate(_history(), start=1)]


def _seq(items: list[tuple[int, Envelope]], job: str, iteration: int) -> int:
    return next(
        s
        for s, env in items
        if isinstance(env.event, ev.ProgressReported)
        and env.event.job_id == job
        and env.event.iteration == iteration
    )


def _ledger(items: list[tuple[int, Envelope]], **kw: float) -> ProgressLedger:
    ledger = ProgressLedger(**kw)
    for seq, env in items:
        ledger.apply(seq, env)
    return ledger


def test_reports_before_the_kept_one_go_and_the_fold_is_unchanged() -> None:
    items = _log()
    ledger = _ledger(items)
    points = ledger.purge_points()
    # a and b (running) keep their last report; d keeps 25 (10, 20 and the restart's 15
    # go); c's first report started it, so removing it would change started_at.
    assert points == {"a": _seq(items, "a", 30), "b": _seq(items, "b", 30), "d": _seq(items, "d", 25)}
    assert ledger.removable(points) == 2 + 2 + 3
    full = ledger.state
    assert state.digest(compacted_fold(items, points)) == state.digest(full)
    assert full.jobs["a"].last_loss == 1.0 / 30
    # The check a compaction makes can fail: removing c's first report would change
    # when c started.
    assert state.digest(compacted_fold(items, {"c": _seq(items, "c", 30)})) != state.digest(full)


def test_reports_past_the_newest_snapshot_stay() -> None:
    items = _log()
    # Services start from a snapshot covering everything before a's last report.
    ledger = _ledger(items, horizon=_seq(items, "a", 30))
    # a and b keep their 20 (their 30 is past the horizon, so nothing below it goes);
    # every report of d is past it.
    assert ledger.purge_points() == {"a": _seq(items, "a", 20), "b": _seq(items, "b", 20)}
    points = ledger.purge_points()
    assert state.digest(compacted_fold(items, points)) == state.digest(ledger.state)


def test_recent_reports_and_a_job_with_an_unreadable_one_stay() -> None:
    items = _log()
    # Only reports stamped at or before 4.0 may go: the 20s stay (the newest old one),
    # and the later ones.
    ledger = _ledger(items, cutoff=4.0)
    assert ledger.purge_points() == {
        "a": _seq(items, "a", 20),
        "b": _seq(items, "b", 20),
        "d": _seq(items, "d", 20),
    }
    assert ledger.removable(ledger.purge_points()) == 3
    # A message on d's progress subject that the replay could not decode.
    ledger.skipped("d")
    assert set(ledger.purge_points()) == {"a", "b"}


def test_a_report_later_than_the_jobs_end_is_not_removed() -> None:
    # The fold's clock is the newest instant seen: a report stamped after the job's end
    # (a sidecar's clock ahead) would move it, so that job is left whole.
    h = [
        (ev.JobSubmitted(job_id="a", spec=_spec()), 1.0),
        (ev.ReconfigurationStarted(job_id="a", epoch=1, kind="start", to_world=1), 2.0),
        (ev.ProgressReported(job_id="a", iteration=10, num_gpus=1), 50.0),
        (ev.ProgressReported(job_id="a", iteration=20, num_gpus=1), 4.0),
        (ev.JobCompleted(job_id="a", iterations=20), 5.0),
    ]
    ledger = ProgressLedger()
    for seq, (e, at) in enumerate(h, start=1):
        ledger.apply(seq, codec.wrap(e, at=at))
    assert ledger.purge_points() == {}


async def _fold(url: str, creds: str) -> tuple[int, str]:
    bus = await Bus.connect(url, "shoal", creds=creds, declare=False)
    try:
        s = state.ClusterState()
        n = 0
        async for _, env in bus.replay():
            state.apply(s, env)
            n += 1
        return n, state.digest(s)
    finally:
        await bus.close()


async def test_shoal_compact_removes_them_from_the_stream_and_only_for_the_admin(tmp_path: Path) -> None:
    creds = CredentialStore(tmp_path / "creds")
    admin = str(creds.ensure("admin"))
    allocator = str(creds.ensure("allocator"))
    with EmbeddedNats(store_dir=tmp_path / "js", creds_dir=creds.directory) as server:
        bus = await Bus.connect(server.url, "shoal", creds=admin)
        try:
            for e, at in _history():
                await bus.publish(codec.wrap(e, at=at))
            # The newest cluster snapshot covers the log so far; e ends after it.
            covered = await bus.last_seq()
            await bus.save_snapshot(CLUSTER_SNAPSHOT, covered, b"")
            await bus.publish(codec.wrap(ev.JobSubmitted(job_id="e", spec=_spec()), at=9.0))
            await bus.publish(
                codec.wrap(ev.ReconfigurationStarted(job_id="e", epoch=1, kind="start", to_world=1), at=9.0)
            )
            for it in (10, 20):
                await bus.publish(codec.wrap(ev.ProgressReported(job_id="e", iteration=it), at=10.0))
            await bus.publish(codec.wrap(ev.JobCompleted(job_id="e", iterations=20), at=11.0))
        finally:
            await bus.close()
        before, digest = await _fold(server.url, admin)

        refused = _cli("compact", "--older-than", "0", "--timeout", "2", url=server.url, creds=allocator)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "only the admin identity" in refused.stderr
        assert await _fold(server.url, admin) == (before, digest)

        # By default only jobs that ended a week before the log's newest event go.
        recent = _cli("compact", url=server.url, creds=admin)
        assert recent.returncode == 0 and "removed 0 progress reports" in recent.stdout, recent.stderr
        dry = _cli("compact", "--dry-run", "--older-than", "0", url=server.url, creds=admin)
        assert dry.returncode == 0, dry.stderr
        assert "would remove 7 progress reports of 3 jobs" in dry.stdout
        assert await _fold(server.url, admin) == (before, digest)

        done = _cli("compact", "--older-than", "0", url=server.url, creds=admin)
        assert done.returncode == 0, done.stderr
        assert "removed 7 progress reports of 3 jobs" in done.stdout
        assert f"messages {before} -> {before - 7}" in done.stdout
        # A fresh fold of what is left is the fold of the whole log before.
        assert await _fold(server.url, admin) == (before - 7, digest)
        # Nothing more to remove until e is under a snapshot.
        again = _cli("compact", "--older-than", "0", url=server.url, creds=admin)
        assert again.returncode == 0 and "removed 0 progress reports of 0" in again.stdout, again.stderr


_EVENTS = hs.sampled_from(
    (
        "submit",
        "report",
        "start",
        "report",
        "job_started",
        "report",
        "completed_reconf",
        "report",
        "decision",
        "end",
    )
)
"""Event kinds, reports four times as likely as any other."""


@hs.composite
def _histories(draw: hs.DrawFn) -> list[tuple[int, Envelope]]:
    """Random logs of two jobs: submissions, starts, reconfigurations, reports with
    iterations and instants out of order, decisions and every kind of end."""
    out = []
    for seq in range(1, draw(hs.integers(5, 30)) + 1):
        j = draw(hs.sampled_from("ab"))
        # Instants out of order and distinct (equal ones would hide a moved clock).
        at = draw(hs.integers(0, 100)) + seq / 1000
        kind = draw(_EVENTS)
        e: ev.Event
        if kind == "submit":
            e = ev.JobSubmitted(job_id=j, spec=_spec())
        elif kind == "start":
            e = ev.ReconfigurationStarted(
                job_id=j, epoch=1, kind="start", to_world=draw(hs.sampled_from((0, 1)))
            )
        elif kind == "job_started":
            e = ev.JobStarted(job_id=j)
        elif kind == "completed_reconf":
            e = ev.ReconfigurationCompleted(job_id=j, epoch=draw(hs.integers(1, 3)), world_size=1)
        elif kind == "report":
            e = ev.ProgressReported(job_id=j, iteration=draw(hs.integers(0, 50)), num_gpus=1, loss=at / 100)
        elif kind == "decision":
            e = ev.SharesDecided(epoch=draw(hs.integers(1, 20)), shares={j: 1})
        else:
            e = draw(
                hs.sampled_from(
                    (
                        ev.JobCompleted(job_id=j, iterations=60),
                        ev.JobFailed(job_id=j, reason="x"),
                        ev.JobCancelled(job_id=j, reason="x"),
                    )
                )
            )
        out.append((seq, codec.wrap(e, at=at)))
    return out


@settings(max_examples=500, deadline=None)
@given(items=_histories(), data=hs.data())
def test_a_fold_from_any_point_to_the_end_is_unchanged(
    items: list[tuple[int, Envelope]], data: hs.DataObject
) -> None:
    """Whatever the horizon and the cutoff, folding the log whole up to any point (a
    snapshot there) and the compacted log after it gives the whole log's fold."""
    horizon = data.draw(hs.integers(1, len(items) + 1))
    cutoff = data.draw(hs.one_of(hs.just(float("inf")), hs.floats(0, 101)))
    ledger = _ledger(items, horizon=horizon, cutoff=cutoff)
    points = ledger.purge_points()
    full = state.digest(ledger.state)
    for cut in range(len(items) + 1):
        s = state.ClusterState()
        for seq, env in items:
            if seq <= cut or kept(seq, env, points):
                state.apply(s, env)
        assert state.digest(s) == full, (cut, points)
    # Nothing at or past the horizon, and nothing stamped after the cutoff, goes.
    for seq, env in items:
        if not kept(seq, env, points):
            assert seq < horizon and env.at <= cutoff

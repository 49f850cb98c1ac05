"""shoal explain / replay as pure functions over a literal log."""

from __future__ import annotations

import datetime as dt

import pytest
from shoal import explain
from shoal import state as st

from tests.clients.story import T0, items, story


def test_every_share_change_with_its_trigger_and_inputs() -> None:
    x = explain.explain_job("j1", items())
    assert x.found and x.status == "completed" and x.share_changes == 3
    assert [(e.seq, e.kind) for e in x.entries] == [
        (3, "submitted"),
        (4, "share"),
        (5, "placement"),
        (6, "reconf.started"),
        (7, "reconf.completed"),
        (11, "share"),
        (12, "placement"),
        (15, "share"),
        (17, "job.completed"),
    ]
    first, second, third = (e for e in x.entries if e.kind == "share")
    # 1: caused (by causation id) by j1's own arrival, on an empty cluster.
    assert (first.old_gpus, first.new_gpus, first.epoch) == (0, 4, 1)
    assert first.trigger is not None
    assert (first.trigger.type, first.trigger.seq, first.trigger.inferred) == ("job.submitted", 3, False)
    inputs = first.inputs
    assert inputs is not None
    assert inputs["active_jobs"] == 1 and inputs["free_gpus"] == 4 and inputs["total_gpus"] == 4
    assert inputs["attained_service_gpu_s"] == 0.0 and inputs["remaining_iterations"] == 1000
    assert inputs["throughput_source"].startswith("none in the log")
    assert inputs["policy"] == "afs-l" and inputs["user_tickets"] == 200
    assert inputs["policy_memory"] == {"credits.j1": 1.5, "round": 3}
    # 2: no causation id: inferred from the "arrival" label as j2's submission.
    assert (second.old_gpus, second.new_gpus) == (4, 2)
    assert second.others == ["j2 0→2"] and first.others == [] and third.others == []
    assert second.trigger is not None
    assert (second.trigger.seq, second.trigger.inferred) == (10, True)
    assert second.trigger.description == "job.submitted j2 (bob, 1..4 GPUs)"
    inputs = second.inputs
    assert inputs is not None
    assert inputs["attained_service_gpu_s"] == pytest.approx(4 * 19.0)  # 4 GPUs from t=1 to t=20
    assert (inputs["iterations_done"], inputs["remaining_iterations"]) == (200, 800)
    assert (
        inputs["throughput"]["1"] == 1.0
        and inputs["throughput"]["2"] == 1.8
        and inputs["throughput"]["4"] == 3.0
    )
    assert inputs["throughput_source"] == "measured: untyped"
    assert (inputs["active_jobs"], inputs["free_gpus"]) == (2, 0)
    # 3: j2's completion (causation id); the stale epoch-2 repeat and the no-op tick are not changes.
    assert (third.old_gpus, third.new_gpus, third.epoch) == (2, 4, 3)
    assert third.trigger is not None and third.trigger.description == "job.completed j2"
    placements = [e for e in x.entries if e.kind == "placement"]
    assert [(p.old_nodes, p.new_nodes) for p in placements] == [
        ("-", "n0[0,1,2,3]"),
        ("n0[0,1,2,3]", "n0[0,1]"),
    ]
    assert placements[1].trigger is not None and placements[1].trigger.seq == 11

    text = explain.render_explanation(x)
    assert text.splitlines()[0].startswith("job j1: user alice, model resnet50, 1..4 GPUs (requested 2)")
    assert "share 4 GPUs → 2 GPUs" in text
    assert "because: job.submitted j2 (bob, 1..4 GPUs) [seq 10] (inferred from the label)" in text
    assert "because: job.completed j2 [seq 14]" in text
    assert "    same decision: j2 0→2" in text
    assert "policy memory: credits.j1=1.5, round=3" in text


def test_explain_other_jobs_and_unknown() -> None:
    j2 = explain.explain_job("j2", items())
    assert [e.kind for e in j2.entries] == ["submitted", "share", "placement", "job.completed"]
    assert j2.entries[1].inputs is not None and j2.entries[1].inputs["user_tickets"] == 100
    ghost = explain.explain_job("ghost", items())
    assert not ghost.found and ghost.entries == []
    assert explain.render_explanation(ghost) == "no job 'ghost' in the log (read up to seq 17)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("seq:12", explain.Until(seq=12)),
        ("-5m", explain.Until(at=T0 + 100 - 300)),
        ("-1h30m", explain.Until(at=T0 + 100 - 5400)),
        ("-90s", explain.Until(at=T0 + 10)),
        ("@1800000030", explain.Until(at=T0 + 30)),
        (
            "2027-01-15T08:00:30Z",
            explain.Until(at=dt.datetime(2027, 1, 15, 8, 0, 30, tzinfo=dt.UTC).timestamp()),
        ),
        (
            "2027-01-15T09:00:30+01:00",
            explain.Until(at=dt.datetime(2027, 1, 15, 8, 0, 30, tzinfo=dt.UTC).timestamp()),
        ),
        (
            "2027-01-15 08:00:30",
            explain.Until(at=dt.datetime(2027, 1, 15, 8, 0, 30, tzinfo=dt.UTC).timestamp()),
        ),
    ],
)
def test_parse_until(text: str, expected: explain.Until) -> None:
    assert explain.parse_until(text, now=T0 + 100) == expected


@pytest.mark.parametrize("text", ["yesterday", "seq:", "seq:-3", "-5x", "-", "-5m3", "@soon", "2027-13-01"])
def test_parse_until_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="invalid --until"):
        explain.parse_until(text, now=T0)


def test_replay_until_equals_the_fold_of_that_prefix() -> None:
    envs = story()
    for n in (0, 5, 12, 14, 17):
        replayed = explain.fold_until(items(), explain.Until(seq=n))
        assert st.digest(replayed.state) == st.digest(st.fold(envs[:n]))
        assert (replayed.seq, replayed.events, replayed.beyond) == (n, n, n < 17)
    # By time: t0+30 lies between j2's placement (t0+21 stale share) and j2's completion (t0+50).
    at30 = explain.fold_until(items(), explain.Until(at=T0 + 30))
    assert at30.seq == 13
    summary = explain.summarize(at30, explain.Until(at=T0 + 30))
    assert summary["epoch"] == 2 and summary["shares"] == {"j1": 2, "j2": 2}
    assert summary["gpus"] == {"total": 4, "allocated": 4, "free": 0}
    assert [j["job_id"] for j in summary["jobs"]["running"]] == ["j1"]
    assert summary["jobs"]["pending"][0]["placement"] == "n0[2,3]"  # j2 placed, no progress reported yet
    assert summary["digest"] == st.digest(st.fold(story()[:13]))
    text = explain.render_summary(summary)
    assert "shares epoch 2 (policy afs-l)" in text and "GPUs 4/4 allocated, 0 free" in text
    before = explain.summarize(
        explain.fold_until(items(), explain.Until(at=T0 - 1)), explain.Until(at=T0 - 1)
    )
    assert explain.render_summary(before).startswith("no events at or before")


def test_top_frame_shows_shares_placement_and_decisions() -> None:
    from shoal.commands.top import TopModel, render

    model = TopModel()
    for seq, env in items()[:12]:
        model.apply(seq, env)
    frame = render(model, prefix="p", width=200, height=40)
    lines = frame.splitlines()
    assert lines[0].startswith("shoal top · p · log time ") and lines[0].endswith(
        "· seq 12 · epoch 2 (afs-l)"
    )
    assert lines[1] == "GPUs 4/4 allocated, 0 free · utilisation 0% · jobs 1 running, 1 pending, 0 finished"
    j1 = next(line for line in lines if " j1 " in line)
    j2 = next(line for line in lines if " j2 " in line)
    assert (
        j1.split()[:5] == ["A", "j1", "alice", "running", "2"] and "200/1000" in j1 and j1.endswith("n0[0,1]")
    )
    assert j2.split()[:5] == ["B", "j2", "bob", "pending", "2"] and j2.endswith("n0[2,3]")
    node = next(line for line in lines if line.startswith("  n0 "))
    assert node.split()[:4] == ["n0", "up", "V100", "AABB"]
    decisions = lines[lines.index("  recent share decisions") + 1 :]
    assert [d.split()[1:4] for d in decisions] == [["epoch", "2", "arrival"], ["epoch", "1", "arrival"]]
    assert decisions[0].endswith("j1 4→2, j2 0→2") and decisions[1].endswith("j1 0→4")
    # Colour is ANSI only, and only when asked for.
    assert "\x1b[" not in frame and "\x1b[32m" in render(model, color=True)


def test_inputs_are_as_of_the_decision_instant() -> None:
    from shoal import codec
    from shoal import events as ev

    log = [
        codec.wrap(ev.NodeRegistered(node_id="n0", gpus=(ev.GpuInfo(index=0, gpu_type="V100"),)), at=T0),
        codec.wrap(ev.JobSubmitted(job_id="a", spec=ev.JobSpec(user="u", total_iterations=1000)), at=T0 + 1),
        codec.wrap(ev.SharesDecided(epoch=1, shares={"a": 1}, trigger="arrival"), at=T0 + 1),
        # Reached the log before the next decision, but happened after its instant.
        codec.wrap(ev.ProgressReported(job_id="a", iteration=500), at=T0 + 30),
        codec.wrap(ev.SharesDecided(epoch=2, shares={}, trigger="tick"), at=T0 + 20),
        codec.wrap(ev.SharesDecided(epoch=3, shares={"a": 1}, trigger="tick"), at=T0 + 40),
    ]
    x = explain.explain_job("a", list(enumerate(log, start=1)))
    shares = [e for e in x.entries if e.kind == "share"]
    assert [(e.old_gpus, e.new_gpus) for e in shares] == [(0, 1), (1, 0), (0, 1)]
    assert shares[1].inputs is not None and shares[2].inputs is not None
    assert shares[1].inputs["iterations_done"] == 0  # the report at t0+30 was not known at t0+20
    assert shares[1].inputs["attained_service_gpu_s"] == pytest.approx(19.0)
    assert shares[2].inputs["iterations_done"] == 500
    assert shares[1].trigger is not None and shares[1].trigger.description == "the policy's quantum tick"


def test_text_from_the_log_cannot_move_the_cursor_or_add_lines() -> None:
    """A job name and a failure reason are whatever their senders wrote into the log
    (a name admission accepted before its checks, a sidecar's reason): `shoal explain`
    prints their control characters escaped, one line per entry."""
    from shoal import codec
    from shoal import events as ev

    name = "ok\x1b[2J\nfake row"
    log = [
        codec.wrap(
            ev.JobSubmitted(job_id="jx", spec=ev.JobSpec(user="u", name=name, total_iterations=10)), at=T0
        ),
        codec.wrap(ev.JobFailed(job_id="jx", reason="boom\x1b]0;title\x07\r\nsecond"), at=T0 + 1),
    ]
    text = explain.render_explanation(explain.explain_job("jx", list(enumerate(log, start=1))))
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert len(text.splitlines()) == 1 + 2  # the head and one line per entry
    assert "ok\\x1b[2J\\nfake row" in text and "boom\\x1b]0;title\\x07\\r\\nsecond" in text

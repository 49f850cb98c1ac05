"""A small literal log (two jobs on one 4-GPU node) shared by the explain/replay/top tests."""

from __future__ import annotations

from shoal import codec
from shoal import events as ev
from shoal.events import Envelope, GpuRef

T0 = 1_800_000_000.0


def story() -> list[Envelope]:
    """The log, in stream order (sequence = index + 1)."""
    out: list[Envelope] = []

    def add(event: ev.Event, dt: float, cause: Envelope | None = None) -> Envelope:
        env = codec.wrap(event, at=T0 + dt, causation_id=cause.id if cause is not None else None)
        out.append(env)
        return env

    n0 = [GpuRef("n0", i) for i in range(4)]
    add(
        ev.NodeRegistered(node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(4))), 0
    )  # 1
    add(ev.UserRegistered(user="alice", tickets=200), 0)  # 2
    sub1 = add(
        ev.JobSubmitted(
            job_id="j1",
            spec=ev.JobSpec(
                user="alice", model="resnet50", max_gpus=4, requested_gpus=2, total_iterations=1000
            ),
        ),
        1,
    )  # 3
    add(
        ev.SharesDecided(
            epoch=1,
            shares={"j1": 4},
            policy="afs-l",
            trigger="arrival",
            policy_memory={"credits": {"j1": 1.5}, "round": 3},
        ),
        1,
        sub1,
    )  # 4
    add(ev.PlacementDecided(epoch=1, placements={"j1": tuple(n0)}), 1.1)  # 5
    add(ev.ReconfigurationStarted(job_id="j1", epoch=1, kind="start", from_world=0, to_world=4), 1.2)  # 6
    add(
        ev.ReconfigurationCompleted(job_id="j1", epoch=1, world_size=4, gpus=tuple(n0), duration_s=0.5), 1.7
    )  # 7
    add(
        ev.ThroughputModelUpdated(job_id="j1", gpu_type="", throughput={1: 1.0, 2: 1.8, 4: 3.0}, samples=3), 5
    )  # 8
    add(ev.ProgressReported(job_id="j1", iteration=200), 10)  # 9
    add(
        ev.JobSubmitted(
            job_id="j2", spec=ev.JobSpec(user="bob", max_gpus=4, requested_gpus=2, total_iterations=90)
        ),
        20,
    )  # 10
    # No causation id on this one: explain infers the trigger from the label.
    add(ev.SharesDecided(epoch=2, shares={"j1": 2, "j2": 2}, policy="afs-l", trigger="arrival"), 20)  # 11
    add(ev.PlacementDecided(epoch=2, placements={"j1": tuple(n0[:2]), "j2": tuple(n0[2:])}), 20.1)  # 12
    add(
        ev.SharesDecided(epoch=2, shares={"j1": 4}, policy="afs-l", trigger="arrival"), 21
    )  # 13: stale, ignored
    done2 = add(ev.JobCompleted(job_id="j2", iterations=90), 50)  # 14
    add(ev.SharesDecided(epoch=3, shares={"j1": 4}, policy="afs-l", trigger="completion"), 50, done2)  # 15
    add(
        ev.SharesDecided(epoch=4, shares={"j1": 4}, policy="afs-l", trigger="tick"), 60
    )  # 16: no change for j1
    add(ev.JobCompleted(job_id="j1", iterations=1000), 100)  # 17
    return out


def items() -> list[tuple[int, Envelope]]:
    return list(enumerate(story(), start=1))

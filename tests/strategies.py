"""Hypothesis strategies for plausible event histories.

Ids come from small alphabets so that events refer to jobs, nodes and users that
exist often enough to exercise every branch of the fold (and sometimes to ones
that do not, which the fold must tolerate).
"""

from __future__ import annotations

from hypothesis import strategies as hs
from shoal import codec
from shoal import events as ev
from shoal.events import Envelope

job_ids = hs.sampled_from([f"j{i}" for i in range(8)])
node_ids = hs.sampled_from([f"n{i}" for i in range(3)])
users = hs.sampled_from(["alice", "bob", "carol"])
gpu_types = hs.sampled_from(["V100", "K80"])
small = hs.integers(min_value=0, max_value=8)
floats = hs.floats(min_value=0, max_value=1e4, allow_nan=False, allow_infinity=False)

specs = hs.builds(
    ev.JobSpec,
    user=users,
    min_gpus=hs.integers(1, 2),
    max_gpus=hs.integers(2, 8),
    requested_gpus=hs.integers(1, 4),
    total_iterations=hs.integers(1, 10_000),
)
gpu_refs = hs.builds(ev.GpuRef, node_ids, hs.integers(0, 3))

events = hs.one_of(
    hs.builds(ev.UserRegistered, user=users, tickets=hs.integers(0, 1000)),
    hs.builds(ev.TicketsSet, user=users, tickets=hs.integers(0, 1000)),
    hs.builds(ev.JobSubmitted, job_id=job_ids, spec=specs),
    hs.builds(ev.JobStarted, job_id=job_ids),
    hs.builds(
        ev.ProgressReported,
        job_id=job_ids,
        iteration=hs.integers(0, 10_000),
        loss=hs.none() | floats,
        samples_per_s=floats,
    ),
    hs.builds(ev.JobCompleted, job_id=job_ids, iterations=hs.integers(0, 10_000)),
    hs.builds(ev.JobFailed, job_id=job_ids, reason=hs.just("oom")),
    hs.builds(ev.JobCancelled, job_id=job_ids),
    hs.builds(
        ev.NodeRegistered,
        node_id=node_ids,
        gpus=hs.lists(hs.builds(ev.GpuInfo, index=small, gpu_type=gpu_types), max_size=4).map(tuple),
    ),
    hs.builds(ev.NodeHeartbeat, node_id=node_ids),
    hs.builds(ev.GpuHealth, node_id=node_ids, index=small, healthy=hs.booleans()),
    hs.builds(ev.NodeLost, node_id=node_ids),
    hs.builds(ev.NodeDrained, node_id=node_ids),
    hs.builds(
        ev.SharesDecided,
        epoch=hs.integers(0, 50),
        shares=hs.dictionaries(job_ids, small, max_size=8),
        policy=hs.just("afs-p"),
        policy_memory=hs.dictionaries(hs.sampled_from(["lease", "seed"]), hs.integers(0, 9), max_size=2),
    ),
    hs.builds(
        ev.PlacementDecided,
        epoch=hs.integers(0, 50),
        placements=hs.dictionaries(job_ids, hs.lists(gpu_refs, max_size=4).map(tuple), max_size=8),
    ),
    hs.builds(ev.ReconfigurationStarted, job_id=job_ids, epoch=small, to_world=small),
    hs.builds(ev.ReconfigurationCompleted, job_id=job_ids, epoch=small, world_size=small, stop_time_s=floats),
    hs.builds(
        ev.ThroughputModelUpdated,
        job_id=job_ids,
        gpu_type=gpu_types,
        throughput=hs.dictionaries(hs.integers(1, 8), floats, max_size=4),
    ),
    hs.builds(
        ev.ConvergenceEstimated,
        job_id=job_ids,
        beta0=floats,
        beta1=floats,
        beta2=floats,
        estimated_total_iterations=hs.integers(0, 10_000),
    ),
    hs.builds(
        ev.TradeExecuted,
        trade_id=hs.sampled_from(["t1", "t2"]),
        buyer=users,
        seller=users,
        fast_type=hs.just("V100"),
        slow_type=hs.just("K80"),
        fast_gpus=small,
        slow_gpus=small,
        price=floats,
    ),
    hs.builds(ev.TradeUndone, trade_id=hs.sampled_from(["t1", "t2"])),
)


@hs.composite
def histories(draw: hs.DrawFn, min_size: int = 0, max_size: int = 200) -> list[Envelope]:
    """A time-ordered list of envelopes (occurred-at never decreases)."""
    evs = draw(hs.lists(events, min_size=min_size, max_size=max_size))
    gaps = draw(hs.lists(hs.floats(0, 100, allow_nan=False), min_size=len(evs), max_size=len(evs)))
    t = 1_700_000_000.0
    out = []
    for e, gap in zip(evs, gaps, strict=True):
        t += gap
        out.append(codec.wrap(e, at=t))
    return out

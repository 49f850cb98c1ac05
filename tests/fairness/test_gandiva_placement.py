"""Gandiva_fair's placement is real (issue 23, point 3): the servers it chooses, its
ticket-load balancing and its migrations are what the shared placement step
(:func:`shoal.allocation.place`, used by the simulator and the placer service) does."""

from __future__ import annotations

from typing import Any

from shoal import events as ev
from shoal.allocation import place
from shoal.fairness.policy import GandivaFairPolicy
from shoal.models import ThroughputCurve
from shoal.placement import Topology
from shoal.placement.hinted import NODE_HINTS, place_hinted, resolve_hint
from shoal.sim import SimConfig, Simulator
from shoal.workloads import make_job


def _sim_log() -> tuple[Topology, list[Any]]:
    curve = ThroughputCurve(model="m", gpu_type="gpu", throughput=tuple(float(k) for k in range(9)))
    sizes = (2, 1, 1, 2, 1, 4, 1, 2, 1, 1)
    jobs = [
        make_job(f"j{i}", 30.0 * i, 900.0 + 120.0 * i, s, curve, user=f"u{i % 3}", elastic=False)
        for i, s in enumerate(sizes)
    ]
    cfg = SimConfig(total_gpus=8, gpus_per_node=4, users={"u0": 100, "u1": 200, "u2": 400})
    sim = Simulator(jobs, GandivaFairPolicy(), cfg)
    sim.run()
    topology = Topology.homogeneous(2, 4, gpu_type="gpu")
    return topology, [e.event for e in sim.log.envelopes]


def test_the_simulator_runs_every_gang_on_the_servers_gandiva_fair_chose() -> None:
    topology, events = _sim_log()
    memory: dict[str, Any] = {}
    checked = moves = 0
    last_nodes: dict[str, set[str]] = {}
    reported: set[str] = set()
    for e in events:
        if isinstance(e, ev.SharesDecided):
            memory = e.policy_memory
            reported |= {m["job_id"] for m in memory.get("migrations", [])}
        elif isinstance(e, ev.PlacementDecided):
            for job, gpus in e.placements.items():
                chosen = resolve_hint(topology, memory["placement"][job])
                assert chosen is not None
                nodes = {g.node_id for g in gpus}
                assert nodes <= {n.node_id for n in chosen}, (job, nodes, memory["placement"][job])
                # A gang resumes on its servers unless Gandiva_fair moved it.
                if job in last_nodes and nodes != last_nodes[job]:
                    assert job in reported, job
                    moves += 1
                last_nodes[job] = nodes
                checked += 1
    assert checked > 20


def test_a_job_keeps_its_gpus_and_a_resumed_gang_its_servers() -> None:
    topology = Topology.homogeneous(2, 4, gpu_type="gpu")
    prev = {"a": (ev.GpuRef(node_id="n1", index=2), ev.GpuRef(node_id="n1", index=3))}
    got = place_hinted(
        topology, {"a": 2, "b": 4, "c": 1}, prev, {"a": ["gpu#1"], "b": ["gpu#0"], "c": ["gpu#1"]}
    )
    assert got.placements["a"] == prev["a"]
    assert {g.node_id for g in got.placements["b"]} == {"n0"}
    assert {g.node_id for g in got.placements["c"]} == {"n1"}
    assert got.migrations == 0 and not got.unplaced
    # A hint the topology cannot honour (a drained GPU) falls back to min-migration, whole.
    drained = Topology(nodes=(topology.nodes[0], msgspec_slots("n1", (0, 1, 2), "gpu")))
    got = place_hinted(drained, {"a": 4}, {}, {"a": ["gpu#1"]})
    assert {g.node_id for g in got.placements["a"]} == {"n0"}


def msgspec_slots(node: str, idx: tuple[int, ...], gpu_type: str) -> Any:
    from shoal.placement import NodeSlots

    return NodeSlots(node_id=node, gpu_indices=idx, gpu_type=gpu_type)


def test_place_honours_the_hints_whatever_the_placer() -> None:
    topology = Topology.homogeneous(2, 4, gpu_type="gpu")
    shares = ev.SharesDecided(epoch=1, shares={"a": 1}, policy_memory={NODE_HINTS: {"a": ["gpu#1"]}})
    for placer in ("min-migration", "consolidated"):
        placed, _ = place(topology, shares, {}, placer=placer)
        assert placed.placements["a"][0].node_id == "n1"


def test_a_resumed_gang_returns_to_its_gpus_when_they_are_free() -> None:
    _, events = _sim_log()
    memory: dict[str, Any] = {}
    last: dict[str, tuple[ev.GpuRef, ...]] = {}
    running: set[str] = set()
    resumed = same = 0
    for e in events:
        if isinstance(e, ev.SharesDecided):
            memory = e.policy_memory
        elif isinstance(e, ev.PlacementDecided):
            moved = {m["job_id"] for m in memory.get("migrations", [])}
            for job, gpus in e.placements.items():
                if job in running or job not in last or job in moved:
                    continue
                others = {g for j, gs in e.placements.items() if j != job for g in gs}
                if not others & set(last[job]):
                    resumed += 1
                    same += gpus == last[job]
                    assert gpus == last[job], (job, last[job], gpus)
            running = set(e.placements)
            last.update(e.placements)
    assert resumed > 5 and same == resumed

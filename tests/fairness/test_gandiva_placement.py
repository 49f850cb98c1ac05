"""Gandiva_fair's placement is real (issue 23, point 3): the servers it chooses, its
ticket-load balancing and its migrations are what the shared placement step
(:func:`shoal.allocation.place`, used by the simulator and the placer service) does."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from shoal import events as ev
from shoal.allocation import place
from shoal.fairness.policy import SUSPEND_RESUME, GandivaFairPolicy
from shoal.models import ThroughputCurve
from shoal.placement import Topology
from shoal.placement.hinted import NODE_HINTS, place_hinted, resolve_hint
from shoal.sim import SimConfig, SimResult, Simulator
from shoal.sim.costs import measured
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
    just_reported: set[str] = set()
    made = 0
    for e in events:
        if isinstance(e, ev.SharesDecided):
            memory = e.policy_memory
            just_reported = {m["job_id"] for m in memory.get("migrations", [])}
            reported |= just_reported
        elif isinstance(e, ev.PlacementDecided):
            for job, gpus in e.placements.items():
                # And the other way: a move the decision reports is made by its placement.
                if job in just_reported and job in last_nodes:
                    assert {g.node_id for g in gpus} != last_nodes[job], (job, "reported but not moved")
                    made += 1
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
    # The run moved gangs, so the check above (every move made was one reported) saw some.
    assert moves > 0, "no gang moved: the check of reported moves saw nothing"
    assert made > 0, "no reported move of a placed gang: the check of moves made saw nothing"


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


def _two_time_sliced_gangs(policy: GandivaFairPolicy, max_time_s: float | None = None) -> SimResult:
    curve = ThroughputCurve(model="m", gpu_type="gpu", throughput=tuple(float(k) for k in range(21)))
    jobs = [make_job(f"j{i}", 0.0, 600.0, 20, curve, user=f"u{i}", elastic=False) for i in range(2)]
    cfg = SimConfig(total_gpus=24, gpus_per_node=4, max_time_s=max_time_s)
    return Simulator(jobs, policy, cfg).run()


def test_time_sliced_gangs_pay_gandiva_fairs_suspend_resume_by_default() -> None:
    # Two 20-GPU gangs on 24 GPUs take turns, one quantum each. Before, the simulator
    # charged each resume as shoal's checkpoint-restart (1.4 + 3.6 x 20 = about 73.7 s, more
    # than the 60 s quantum), so after its first quantum neither job made progress and
    # the run never ended. Gandiva_fair's suspend/resume costs 0.25 s (§4).
    assert GandivaFairPolicy().planning_costs() == SUSPEND_RESUME
    result = _two_time_sliced_gangs(GandivaFairPolicy(), max_time_s=7200.0)
    assert result.summary["completed"] == 2
    jct = sorted(o.jct_s or 0.0 for o in result.jobs)
    # Alternate quanta; each (re)start costs 0.25 s, so ten quanta give 597.5 of the
    # 600 s and an eleventh finishes the job: j0's starts at 1,200 s, j1's when j0 ends.
    assert jct == pytest.approx([1200.0 + 2.75, 1200.0 + 2.75 + 2.75], abs=0.5)


def test_shoals_checkpoint_restart_starves_a_gang_bigger_than_the_quantum_allows() -> None:
    # What the SUSPEND_RESUME docstring warns of, with costs="measured".
    result = _two_time_sliced_gangs(GandivaFairPolicy(costs="measured"), max_time_s=7200.0)
    assert result.summary["completed"] == 0
    with pytest.raises(ValueError, match="plans with 'suspend-resume' costs"):
        Simulator([], GandivaFairPolicy(), SimConfig(total_gpus=4, gpus_per_node=4, costs=measured()))


@hs.composite
def _workloads(draw: hs.DrawFn) -> tuple[list[Any], SimConfig]:
    per_node = draw(hs.sampled_from((2, 4, 8)))
    nodes = draw(hs.integers(1, 3))
    total = per_node * nodes
    curve = ThroughputCurve(
        model="m", gpu_type="gpu", throughput=tuple(float(k) ** 0.9 for k in range(total + 1))
    )
    users = {f"u{i}": draw(hs.sampled_from((100, 200, 400))) for i in range(draw(hs.integers(1, 3)))}
    jobs = [
        make_job(
            f"j{i}",
            float(draw(hs.integers(0, 600))),
            float(draw(hs.integers(60, 1800))),
            draw(hs.integers(1, total)),
            curve,
            user=draw(hs.sampled_from(sorted(users))),
            elastic=False,
        )
        for i in range(draw(hs.integers(1, 8)))
    ]
    return jobs, SimConfig(total_gpus=total, gpus_per_node=per_node, users=users)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=_workloads())
def test_every_gang_gandiva_fair_schedules_runs_whole(workload: tuple[list[Any], SimConfig]) -> None:
    """What to build, packing: "a gang it schedules is a gang that runs". Every job with
    a share in a decision is placed, whole, by the placement of that decision: gangs of
    any size on servers of 2, 4 and 8 GPUs, time-sliced, suspended and resumed."""
    jobs, cfg = workload
    sim = Simulator(jobs, GandivaFairPolicy(), cfg)
    result = sim.run()
    assert result.summary["completed"] == len(jobs)
    # The engine emits a placement only when it changes: a decision without one keeps
    # the placement in force.
    in_force: dict[str, int] = {}
    pending: tuple[int, dict[str, int]] | None = None
    checked = 0

    sizes = {j.job_id: j.spec.requested_gpus for j in jobs}

    def check(scheduled: dict[str, int]) -> None:
        nonlocal checked
        assert {j: sizes[j] for j in scheduled} == scheduled, "a gang scheduled at another size"
        assert {j: in_force.get(j, 0) for j in scheduled} == scheduled, (scheduled, in_force)
        checked += 1

    for e in (env.event for env in sim.log.envelopes):
        if isinstance(e, ev.SharesDecided):
            if pending is not None:
                check(pending[1])
            pending = (e.epoch, {j: s for j, s in e.shares.items() if s > 0})
        elif isinstance(e, ev.PlacementDecided):
            in_force = {j: len(g) for j, g in e.placements.items()}
            assert pending is not None and e.epoch == pending[0]
            assert set(in_force) == set(pending[1]), (in_force, pending)
            check(pending[1])
            pending = None
    if pending is not None:
        check(pending[1])
    assert checked > 0
    assert sim.unplaced_decisions == 0


def test_every_hint_spelling_names_the_node_resolve_hint_names() -> None:
    """place_hinted looks canonical names up in an index of the topology and sends any
    other spelling to resolve_hint; both name the same node, and a name that resolves to
    nothing sends the job to the fallback, as before the index."""
    from shoal.placement.hinted import _hint_index

    topology = Topology(
        nodes=(
            msgspec_slots("a0", (0, 1), "V100"),
            msgspec_slots("b0", (0, 1), "K80"),
            msgspec_slots("a1", (0, 1), "V100"),
            msgspec_slots("c0", (0, 1), ""),
        )
    )
    index = _hint_index(topology)
    for name, node in index.items():
        assert resolve_hint(topology, [name]) == [node], name
    assert set(index) == {"#0", "#1", "#2", "#3", "V100#0", "V100#1", "K80#0"}
    # Spellings only resolve_hint knows: a case-insensitive type, a zero-padded index.
    for name, node_id in (("v100#1", "a1"), ("V100#01", "a1"), ("#03", "c0")):
        got = place_hinted(topology, {"j": 2}, {}, {"j": [name]})
        assert {g.node_id for g in got.placements["j"]} == {node_id}, name
    # A name that names no node: the fallback places the gang whole, somewhere.
    got = place_hinted(topology, {"j": 2}, {}, {"j": ["V100#2"]})
    assert sum(len(g) for g in got.placements.values()) == 2
    # Another topology gets its own index.
    other = Topology(nodes=(msgspec_slots("z", (0,), "K80"),))
    assert _hint_index(other) == {"#0": other.nodes[0], "K80#0": other.nodes[0]}

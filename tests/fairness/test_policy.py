"""GandivaFairPolicy: the paper's experiments driven through the Policy protocol."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.fairness.policy import GandivaFairPolicy, gang_size
from shoal.policies.base import ClusterView, Decision, JobView, check_decision


def job(job_id: str, user: str, size: int, **kw: Any) -> JobView:
    return JobView(
        job_id=job_id, user=user, requested_gpus=size, min_gpus=size, max_gpus=size, elastic=False, **kw
    )


def run(
    policy: GandivaFairPolicy, view: ClusterView, quanta: int, quantum_s: float = 60.0
) -> tuple[list[Decision], dict[str, Any]]:
    memory: dict[str, Any] = {}
    decisions = []
    for q in range(quanta):
        v = msgspec.structs.replace(view, now_s=q * quantum_s)
        d = policy.decide(v, memory)
        check_decision(v, d)
        # The allocator stores memory in the log as msgpack: replay from that.
        memory = msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
        decisions.append(d)
    return decisions, memory


def run_measured(
    policy: GandivaFairPolicy,
    view: ClusterView,
    quanta: int,
    speed: dict[str, dict[str, float]],
    quantum_s: float = 60.0,
    memory: dict[str, Any] | None = None,
    start: int = 0,
) -> tuple[list[Decision], dict[str, Any]]:
    """:func:`run` with jobs that progress: a scheduled 1-GPU job of user ``u`` does
    ``speed[u][generation]`` iterations a second, so the policy measures its profiles."""
    memory = dict(memory or {})
    done = {j.job_id: j.iterations_done for j in view.jobs}
    user = {j.job_id: j.user for j in view.jobs}
    decisions = []
    for q in range(start, start + quanta):
        jobs = tuple(msgspec.structs.replace(j, iterations_done=done[j.job_id]) for j in view.jobs)
        v = msgspec.structs.replace(view, now_s=q * quantum_s, jobs=jobs)
        d = policy.decide(v, memory)
        check_decision(v, d)
        memory = msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
        decisions.append(d)
        for j, n in d.shares.items():
            done[j] += speed[user[j]][d.gpu_types[j]] * n * quantum_s
    return decisions, memory


def gpu_quanta(decisions: list[Decision], by: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in decisions:
        for j, n in d.shares.items():
            out[by(j)] = out.get(by(j), 0.0) + n
    return {k: v / len(decisions) for k, v in out.items()}


def test_table2_through_the_policy() -> None:
    jobs = tuple(job(f"{u}{k}", u, s) for u, s in (("A", 1), ("B", 2), ("C", 4)) for k in (1, 2))
    view = ClusterView(now_s=0.0, total_gpus=4, jobs=jobs, gpus_per_node=4)
    decisions, _ = run(GandivaFairPolicy(), view, 6)
    ran = {j.job_id: sum(1 for d in decisions if j.job_id in d.shares) for j in jobs}
    assert ran == {"A1": 4, "A2": 4, "B1": 2, "B2": 2, "C1": 1, "C2": 1}
    assert all(sum(d.shares.values()) == 4 for d in decisions)


def test_section_5_1_through_the_policy() -> None:
    """One 4-V100 server; U1: 4 × 1-GPU, U2: 4 × 2-GPU, U3: 4 × 4-GPU jobs, 100 tickets each."""
    jobs = tuple(job(f"u{u}-{k}", f"U{u}", s) for u, s in ((1, 1), (2, 2), (3, 4)) for k in range(4))
    view = ClusterView(now_s=0.0, total_gpus=4, jobs=jobs, gpus_per_node=4)
    decisions, _ = run(GandivaFairPolicy(), view, 12)
    per_user = gpu_quanta(decisions, lambda j: j.split("-")[0])
    assert per_user == pytest.approx({"u1": 4 / 3, "u2": 4 / 3, "u3": 4 / 3}, rel=1e-12)
    assert all(sum(d.shares.values()) == 4 for d in decisions)
    # U1 and U3 finish (§5.1, about four hours in): U2 gets the whole server.
    only_u2 = msgspec.structs.replace(view, jobs=tuple(j for j in jobs if j.user == "U2"))
    decisions, _ = run(GandivaFairPolicy(), only_u2, 4)
    assert gpu_quanta(decisions, lambda j: j.split("-")[0]) == {"u2": 4.0}


def test_section_5_2_split_stride_through_the_policy() -> None:
    jobs = (
        job("u1-big", "U1", 8),
        *(job(f"u2-{k}", "U2", 2) for k in range(2)),
        *(job(f"u3-{k}", "U3", 1) for k in range(4)),
    )
    view = ClusterView(now_s=0.0, total_gpus=8, jobs=jobs, gpus_per_node=4)
    decisions, memory = run(GandivaFairPolicy(), view, 30)
    per_user = gpu_quanta(decisions, lambda j: j.split("-")[0])
    assert per_user == pytest.approx({"u1": 8 / 3, "u2": 8 / 3, "u3": 8 / 3}, rel=1e-12)
    assert memory["placement"]["u1-big"] == ["#0", "#1"]
    assert memory["migrations"] == []


def test_calls_within_a_quantum_do_not_charge_it_twice() -> None:
    jobs = tuple(job(f"{u}{k}", u, s) for u, s in (("A", 1), ("B", 2), ("C", 4)) for k in (1, 2))
    view = ClusterView(now_s=0.0, total_gpus=4, jobs=jobs, gpus_per_node=4)
    policy = GandivaFairPolicy(quantum_s=60.0)
    first = policy.decide(view, {})
    again = policy.decide(msgspec.structs.replace(view, now_s=30.0), first.memory)
    assert again.shares == first.shares
    assert again.memory["local"] == first.memory["local"]
    nxt = policy.decide(msgspec.structs.replace(view, now_s=60.0), again.memory)
    assert nxt.memory["local"] != first.memory["local"]


def test_replay_from_memory_decides_the_same() -> None:
    jobs = tuple(job(f"j{k}", f"u{k % 3}", (1, 2, 4)[k % 3]) for k in range(12))
    view = ClusterView(now_s=0.0, total_gpus=8, jobs=jobs, gpus_per_node=4)
    policy = GandivaFairPolicy(quantum_s=0.0)
    decisions, _ = run(policy, view, 5, quantum_s=1.0)
    replayed, _ = run(GandivaFairPolicy(quantum_s=0.0), view, 5, quantum_s=1.0)
    assert [d.shares for d in decisions] == [d.shares for d in replayed]


def table3_view(jobs_per_user: int = 50) -> ClusterView:
    speedup = {"A": 1.25, "B": 5.0, "C": 6.25}
    jobs = tuple(
        job(
            f"{u}-{k}",
            u,
            1,
            arrival_s=float(k),
            throughput_by_type={"k80": (0.0, 1.0), "v100": (0.0, s)},
        )
        for u, s in speedup.items()
        for k in range(jobs_per_user)
    )
    return ClusterView(
        now_s=0.0, total_gpus=72, jobs=jobs, gpus_per_node=4, gpus_by_type={"v100": 12, "k80": 60}
    )


TABLE3_SPEED = {
    "A": {"k80": 1.0, "v100": 1.25},
    "B": {"k80": 1.0, "v100": 5.0},
    "C": {"k80": 1.0, "v100": 6.25},
}


def test_table3_trading_through_the_policy() -> None:
    view = table3_view()
    decisions, memory = run_measured(GandivaFairPolicy(), view, 60, TABLE3_SPEED)
    executed = [t for d in decisions for t in d.memory["trades_executed"]]
    # No trade before the first profiles (quantum 0 only measures); then one trade per
    # generation pair per quantum: the four trades take four quanta.
    assert [len(d.memory["trades_executed"]) for d in decisions[:6]] == [0, 1, 1, 1, 1, 0]
    assert len(executed) == 4
    assert {(t["buyer"], t["seller"], t["price"]) for t in executed} == {("C", "A", 5.0)}
    held = memory["entitlements"]
    assert held["A"] == pytest.approx({"v100": 0.0, "k80": 40.0})
    assert held["B"] == pytest.approx({"v100": 4.0, "k80": 20.0})
    assert held["C"] == pytest.approx({"v100": 8.0, "k80": 0.0})
    last = decisions[-1]
    assert set(last.gpu_types) == set(last.shares)
    for gen, n in (("v100", 12), ("k80", 60)):
        assert sum(last.shares[j] for j, g in last.gpu_types.items() if g == gen) == n
    # Progress in K80 units once trades settle and jobs have followed the traded
    # GPUs: A 40, B 40, C 50 per quantum (Table 3), averaged over 50 quanta.
    speed = TABLE3_SPEED
    window = decisions[10:]
    progress = {
        u: sum(speed[u][d.gpu_types[j]] for d in window for j in d.shares if j.startswith(u)) / len(window)
        for u in speed
    }
    assert progress == pytest.approx({"A": 40.0, "B": 40.0, "C": 50.0}, abs=0.5)


def test_user_arrival_undoes_trades() -> None:
    view = table3_view()
    policy = GandivaFairPolicy()
    _, memory = run_measured(policy, view, 6, TABLE3_SPEED)
    assert len(memory["trades"]) == 4
    newcomer = tuple(
        job(f"D-{k}", "D", 1, throughput_by_type={"k80": (0.0, 1.0), "v100": (0.0, 3.0)}) for k in range(50)
    )
    bigger = msgspec.structs.replace(view, jobs=view.jobs + newcomer, now_s=10_000.0)
    d = policy.decide(bigger, memory)
    check_decision(bigger, d)
    assert d.memory["trades_undone"] and "v100" in d.memory["trades_undone"][0]["reason"]


def test_pinned_job_stays_on_its_generation() -> None:
    view = table3_view(10)
    pinned = job("P-0", "P", 1, pinned_gpu_type="k80")
    view = msgspec.structs.replace(view, jobs=(*view.jobs, pinned))
    decisions, memory = run(GandivaFairPolicy(), view, 4)
    assert memory["placement"]["P-0"][0].startswith("k80#")
    assert all(d.gpu_types.get("P-0", "k80") == "k80" for d in decisions)
    assert not any("P" in (t["buyer"], t["seller"]) for t in memory["trades"])


def test_gang_size_respects_feasible_counts() -> None:
    assert (
        gang_size(JobView(job_id="a", requested_gpus=3, min_gpus=1, max_gpus=4, allowed_gpu_counts=(1, 2, 4)))
        == 2
    )
    assert gang_size(JobView(job_id="b", requested_gpus=1, min_gpus=2, max_gpus=4)) == 2
    assert gang_size(job("c", "u", 4)) == 4


def test_unprofiled_jobs_are_profiled_opportunistically_and_then_traded() -> None:
    """No declared throughput: jobs start on the newest GPUs, progress reports build
    the per-generation profiles, and the Table 3 trades follow from them."""
    speed = {"A": {"k80": 1.0, "v100": 1.25}, "B": {"k80": 1.0, "v100": 5.0}, "C": {"k80": 1.0, "v100": 6.25}}
    done = {f"{u}-{k}": 0.0 for u in speed for k in range(50)}
    policy = GandivaFairPolicy()
    memory: dict[str, Any] = {}
    first: Decision | None = None
    for q in range(40):
        jobs = tuple(
            job(j, j[0], 1, arrival_s=float(j.split("-")[1]), iterations_done=n) for j, n in done.items()
        )
        view = ClusterView(
            now_s=60.0 * q, total_gpus=72, jobs=jobs, gpus_per_node=4, gpus_by_type={"v100": 12, "k80": 60}
        )
        d = policy.decide(view, memory)
        check_decision(view, d)
        first = first or d
        memory = msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
        for j in d.shares:  # the emulated trainers advance at their true speed
            done[j] += speed[j[0]][d.gpu_types[j]] * 60.0
    assert first is not None
    # Algorithm 2: with no profile, each user's first jobs go to the newest generation.
    assert {first.memory["placement"][f"{u}-0"][0].split("#")[0] for u in speed} == {"v100"}
    for u in speed:
        for gen, rate in speed[u].items():
            assert memory["profiles"][u][gen][-1] == pytest.approx(rate)
    held = memory["entitlements"]
    assert held["A"] == pytest.approx({"v100": 0.0, "k80": 40.0})
    assert held["C"] == pytest.approx({"v100": 8.0, "k80": 0.0})


def test_section_5_4_shares_and_departure_through_the_policy() -> None:
    """64 K80 + 24 P100 + 12 V100, four users of 1-, 2-, 4- and 1-GPU jobs, no trading."""
    sizes = {"U1": 1, "U2": 2, "U3": 4, "U4": 1}
    gpus = {"k80": 64, "p100": 24, "v100": 12}

    def view(users: tuple[str, ...]) -> ClusterView:
        jobs = tuple(job(f"{u}-{k}", u, sizes[u], arrival_s=float(k)) for u in users for k in range(40))
        return ClusterView(now_s=0.0, total_gpus=100, jobs=jobs, gpus_per_node=4, gpus_by_type=gpus)

    for users, per_gen in (
        (("U1", "U2", "U3", "U4"), {"v100": 3.0, "p100": 6.0, "k80": 16.0}),
        # U1 leaves: about 4 V100 + 8 P100 + 21.3 K80 each.
        (("U2", "U3", "U4"), {"v100": 4.0, "p100": 8.0, "k80": 64 / 3}),
    ):
        decisions, memory = run(GandivaFairPolicy(trading=False), view(users), 40)
        for u in users:
            assert memory["entitlements"][u] == pytest.approx(per_gen)
        # Measured over quanta 10-39: nearly work conserving (packing, §3.3), and
        # every user, whatever its gang size, within 6 % of its share of the cluster.
        window = decisions[10:]
        assert sum(sum(d.shares.values()) for d in window) / len(window) >= 97.0
        per_user = gpu_quanta(window, lambda j: j.split("-")[0])
        assert per_user == pytest.approx(dict.fromkeys(users, 100 / len(users)), rel=0.06)


def test_arrival_within_a_quantum_undoes_trades_at_once() -> None:
    view = table3_view()
    policy = GandivaFairPolicy(quantum_s=60.0)
    _, memory = run_measured(policy, view, 6, TABLE3_SPEED)
    newcomer = tuple(
        job(f"D-{k}", "D", 1, throughput_by_type={"k80": (0.0, 1.0), "v100": (0.0, 3.0)}) for k in range(50)
    )
    # The last quantum started at t=300; D arrives 10 s into it.
    mid = msgspec.structs.replace(view, jobs=view.jobs + newcomer, now_s=310.0)
    d = policy.decide(mid, memory)
    check_decision(mid, d)
    assert d.memory["trades_undone"] and d.memory["trades_executed"] == []
    assert len(d.memory["trades"]) == 4 - len(d.memory["trades_undone"])
    assert all(v >= 0 for h in d.memory["entitlements"].values() for v in h.values())


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c", "d"]),
            st.sampled_from([1, 1, 1, 2, 4, 8]),
            st.sampled_from([None, None, None, "k80", "v100"]),
        ),
        min_size=1,
        max_size=30,
    ),
    st.booleans(),
    st.integers(0, 3),
)
def test_any_cluster_gets_valid_deterministic_decisions(
    spec: list[tuple[str, int, str | None]], hetero: bool, extra_nodes: int
) -> None:
    speed = {"a": 1.2, "b": 3.0, "c": 6.0, "d": 2.0}
    jobs = tuple(
        job(
            f"j{k}",
            user,
            size,
            arrival_s=float(k),
            pinned_gpu_type=pin if hetero else None,
            throughput_by_type={"k80": (0.0,) + (1.0,) * 8, "v100": (0.0,) + (speed[user],) * 8},
        )
        for k, (user, size, pin) in enumerate(spec)
    )
    by_type = {"v100": 4 * (1 + extra_nodes), "k80": 8} if hetero else {}
    total = sum(by_type.values()) if hetero else 4 * (2 + extra_nodes)
    view = ClusterView(now_s=0.0, total_gpus=total, jobs=jobs, gpus_per_node=4, gpus_by_type=by_type)
    decisions, _ = run(GandivaFairPolicy(), view, 4)  # run() checks every decision
    again, _ = run(GandivaFairPolicy(), view, 4)
    assert [(d.shares, d.gpu_types) for d in decisions] == [(d.shares, d.gpu_types) for d in again]
    for d in decisions:
        assert all(d.shares[j.job_id] == gang_size(j) for j in jobs if j.job_id in d.shares)
        if hetero:
            assert set(d.gpu_types) == set(d.shares)
            for j in jobs:
                if j.job_id in d.shares and j.pinned_gpu_type is not None:
                    assert d.gpu_types[j.job_id] == j.pinned_gpu_type


def test_gang_that_fits_no_generation_share_whole_runs_on_spilled_capacity() -> None:
    """A 4-GPU gang entitled to 2 V100 + 2 K80 could only time-slice; the idle K80s
    that newest-first filling left over (§3.2 bonus, per generation) let it run whole."""
    jobs = (
        job("a-0", "a", 4, throughput_by_type={"k80": (0.0, 1, 2, 3, 4), "v100": (0.0, 1.5, 3, 4.5, 6)}),
        *(
            job(
                f"b-{k}",
                "b",
                1,
                arrival_s=1.0 + k,
                throughput_by_type={"k80": (0.0, 1.0), "v100": (0.0, 5.0)},
            )
            for k in range(2)
        ),
    )
    view = ClusterView(
        now_s=0.0, total_gpus=12, jobs=jobs, gpus_per_node=4, gpus_by_type={"v100": 4, "k80": 8}
    )
    spilled, _ = run(GandivaFairPolicy(spill=True), view, 10)
    plain, _ = run(GandivaFairPolicy(), view, 10)
    a_spilled = gpu_quanta(spilled, lambda j: j.split("-")[0])["a"]
    a_plain = gpu_quanta(plain, lambda j: j.split("-")[0])["a"]
    assert a_spilled == pytest.approx(4.0)  # every quantum, on the K80s
    assert all(d.gpu_types.get("a-0") == "k80" for d in spilled)
    assert a_plain < 3.0  # time-sliced on the V100s


def test_decide_never_modifies_the_memory_it_is_given() -> None:
    """The policy copies only what it changes (no deep copy): the memory it was given,
    held by the log and by a replay, stays as it was through profiling and trading, and
    passing it directly decides as a msgpack round trip does."""
    view = table3_view()
    done = {j.job_id: 0.0 for j in view.jobs}
    policy = GandivaFairPolicy()
    memory: dict[str, Any] = {}
    decoded: dict[str, Any] = {}
    traded = profiled = 0
    for q in range(8):
        jobs = tuple(msgspec.structs.replace(j, iterations_done=done[j.job_id]) for j in view.jobs)
        v = msgspec.structs.replace(view, now_s=q * 60.0 + (30.0 if q == 5 else 0.0), jobs=jobs)
        before = msgspec.msgpack.encode(memory)
        d = policy.decide(v, memory)
        assert msgspec.msgpack.encode(memory) == before, q
        assert d.shares == policy.decide(v, decoded).shares
        memory, decoded = d.memory, msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
        traded += len(d.memory["trades_executed"])
        profiled += sum(len(p) for p in d.memory["profiles"].values())
        for j, n in d.shares.items():
            done[j] += TABLE3_SPEED[j[0]][d.gpu_types[j]] * n * 60.0
    assert traded and profiled


@pytest.mark.parametrize("pack", [False, True])
def test_pack_on_placement_sends_a_new_small_job_where_it_raises_no_idle_risk(pack: bool) -> None:
    """§3.3 packing on new placements (``pack_on_placement``): the sizes of the gangs the
    policy keeps on each node decide where a new 1-GPU job goes. Node #0 holds a 4- and a
    2-GPU gang, node #1 a 4-GPU gang; #1 is less loaded (the paper's rule, the default),
    but a 1-GPU job there could leave 3 GPUs idle in some quantum, on #0 none more."""
    from shoal.fairness.balance import idle_risk

    first = (
        job("A0", "A", 4, arrival_s=0.0),
        job("A1", "A", 4, arrival_s=1.0),
        job("B2", "B", 2, arrival_s=2.0),
    )
    view = ClusterView(now_s=0.0, total_gpus=8, jobs=first, gpus_per_node=4)
    policy = GandivaFairPolicy(pack_on_placement=pack)
    d = policy.decide(view, {})
    assert d.memory["placement"] == {"A0": ["#0"], "A1": ["#1"], "B2": ["#0"]}
    memory = msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
    later = msgspec.structs.replace(view, now_s=10.0, jobs=(*first, job("C", "C", 1, arrival_s=9.0)))
    placed = policy.decide(later, memory).memory["placement"]
    assert {j: placed[j] for j in ("A0", "A1", "B2")} == memory["placement"]  # kept where they were
    assert idle_risk(4, [4, 1]) > idle_risk(4, [4]) and idle_risk(4, [4, 2, 1]) <= idle_risk(4, [4, 2])
    assert placed["C"] == (["#0"] if pack else ["#1"])


def _resized(jobs: list[JobView], job_id: str, size: int) -> list[JobView]:
    return [job(j.job_id, j.user, size, arrival_s=j.arrival_s) if j.job_id == job_id else j for j in jobs]


def _departed(jobs: list[JobView], memory: dict[str, Any]) -> list[JobView]:
    # The 1-GPU jobs of user A on the second server leave.
    gone = {j for j, n in memory["placement"].items() if j.startswith("a-") and n == ["#1"]}
    return [j for j in jobs if j.job_id not in gone]


@pytest.mark.parametrize(
    "events",
    [
        # A kept job grows on its server: balance moves another job, the jobs and their order unchanged.
        {3: lambda jobs, memory: _resized(jobs, "a-0", 3)},
        # The last job's gang outgrows its server: it is placed anew, still last.
        {2: lambda jobs, memory: _resized(jobs, "z-0", 8)},
        # One user's jobs on the second server leave, then a job arrives.
        {4: _departed, 7: lambda jobs, memory: [*jobs, job("c-0", "C", 2, arrival_s=400.0)]},
    ],
    ids=["grown", "regang", "departed-arrived"],
)
def test_a_quantum_in_which_no_job_moves_hands_the_placement_on_as_it_was(events: dict[int, Any]) -> None:
    """On one generation, a quantum in which every job keeps its nodes returns the previous
    placement itself; a quantum with a move, a job placed anew, a departure or an arrival
    writes a new one that shows it. Either way the decision and its memory bytes are those
    of a replay from the log (memory decoded from msgpack), and the memory given is left
    as it was."""
    jobs = [job(f"a-{k}", "A", 1, arrival_s=float(k)) for k in range(4)]
    jobs += [job(f"b-{k}", "B", 1, arrival_s=10.0 + k) for k in range(4)]
    jobs += [job("z-0", "Z", 1, arrival_s=50.0)]
    direct, replay = GandivaFairPolicy(), GandivaFairPolicy()
    memory: dict[str, Any] = {}
    decoded: dict[str, Any] = {}
    kept = 0
    for q in range(10):
        if q in events:
            jobs = events[q](jobs, memory)
        view = ClusterView(now_s=q * 60.0, total_gpus=8, jobs=tuple(jobs), gpus_per_node=4)
        before = msgspec.msgpack.encode(memory)
        d = direct.decide(view, memory)
        check_decision(view, d)
        assert msgspec.msgpack.encode(memory) == before, q
        r = replay.decide(view, decoded)
        assert d.shares == r.shares, q
        assert msgspec.msgpack.encode(d.memory) == msgspec.msgpack.encode(r.memory), q
        placement = d.memory["placement"]
        assert set(placement) == {j.job_id for j in jobs}, q
        for j in jobs:  # each gang's servers (4 GPUs each) hold it
            assert 4 * len(placement[j.job_id]) >= j.requested_gpus, (q, j.job_id)
        for m in d.memory["migrations"]:
            assert placement[m["job_id"]] == [m["target"]], q
        if placement is memory.get("placement"):
            kept += 1
            assert q not in events and not d.memory["migrations"], q
        memory, decoded = d.memory, msgspec.msgpack.decode(msgspec.msgpack.encode(d.memory))
    assert kept >= 5, kept

"""Split stride (§3.1, Figure 3) with ticket-load placement (§3.2): §5.1 and §5.2."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.fairness.balance import job_tickets, place_job, ticket_load_per_gpu, tickets_per_gpu
from shoal.fairness.split_stride import PlacedJob, naive_split_stride_quantum, split_stride_quantum


def build(
    server_gpus: dict[str, int], jobs_by_user: dict[str, list[int]], tickets: float = 100.0
) -> list[PlacedJob]:
    """Place every job on the least ticket-loaded server(s), in submission order."""
    tpg = tickets_per_gpu(dict.fromkeys(jobs_by_user, tickets), jobs_by_user)
    placement: dict[str, tuple[str, ...]] = {}
    size: dict[str, int] = {}
    owner: dict[str, str] = {}
    pending = [(f"{u}-{k}", u, s) for u, sizes in jobs_by_user.items() for k, s in enumerate(sizes)]
    for job, user, s in pending:
        loads = ticket_load_per_gpu(server_gpus, placement, size, {j: tpg[owner[j]] for j in placement})
        placement[job] = place_job(s, server_gpus, loads)
        size[job], owner[job] = s, user
    return [
        PlacedJob(
            job_id=j, size=size[j], job_tickets=job_tickets(tpg[owner[j]], size[j]), servers=placement[j]
        )
        for j in placement
    ]


def gpus_per_user(
    server_gpus: dict[str, int], jobs: list[PlacedJob], quanta: int
) -> tuple[dict[str, float], int]:
    central: dict[str, float] = {}
    local: dict[str, float] = {}
    gpu_quanta: dict[str, int] = {}
    idle = 0
    sizes = {j.job_id: j.size for j in jobs}
    for _ in range(quanta):
        res = split_stride_quantum(server_gpus, jobs, central, local)
        central, local = res.central_passes, res.local_passes
        idle += res.idle_gpus
        for job in res.scheduled:
            user = job.split("-")[0]
            gpu_quanta[user] = gpu_quanta.get(user, 0) + sizes[job]
    return {u: n / quanta for u, n in gpu_quanta.items()}, idle


def test_section_5_1_single_server_gives_each_user_1_33_gpus() -> None:
    servers = {"s0": 4}
    jobs = build(servers, {"U1": [1] * 4, "U2": [2] * 4, "U3": [4] * 4})
    # Exact from the first full period of 12 quanta on (and every multiple of it).
    for quanta in (12, 120):
        shares, idle = gpus_per_user(servers, jobs, quanta)
        assert shares == pytest.approx(dict.fromkeys(("U1", "U2", "U3"), 4 / 3), rel=1e-12)
        assert idle == 0


def test_section_5_2_split_stride_gives_each_user_2_66_gpus() -> None:
    servers = {"s0": 4, "s1": 4}
    jobs = build(servers, {"U1": [8], "U2": [2, 2], "U3": [1, 1, 1, 1]})
    assert next(j for j in jobs if j.job_id == "U1-0").servers == ("s0", "s1")
    # Ticket load is balanced: each server holds one 2-GPU and two 1-GPU jobs.
    assert sorted(j.servers[0] for j in jobs if j.size < 8) == ["s0", "s0", "s0", "s1", "s1", "s1"]
    # Exact from the first period of 3 quanta on.
    for quanta in (3, 30):
        shares, idle = gpus_per_user(servers, jobs, quanta)
        assert shares == pytest.approx(dict.fromkeys(("U1", "U2", "U3"), 8 / 3), rel=1e-12)
        assert idle == 0
    # After U1's 8-GPU job completes, U2 and U3 get 4 GPUs each.
    rest = [j for j in jobs if not j.job_id.startswith("U1")]
    shares, _ = gpus_per_user(servers, rest, 30)
    assert shares == pytest.approx({"U2": 4.0, "U3": 4.0})


def test_large_job_leftover_gpus_are_backfilled() -> None:
    servers = {"s0": 4, "s1": 4}
    jobs = [
        PlacedJob(job_id="big", size=6, job_tickets=100.0, servers=("s0", "s1")),
        PlacedJob(job_id="small", size=1, job_tickets=1.0, servers=("s1",)),
    ]
    res = split_stride_quantum(servers, jobs, {"job:big": 0.0, "s1": 10.0}, {})
    assert res.scheduled == ("big", "small")
    assert res.central_passes["s1"] == 10.0  # backfill does not advance the aggregate
    assert res.idle_gpus == 1


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([1, 1, 1, 2, 4, 8]), st.integers(1, 300), st.integers(0, 5)), max_size=25
    ),
    st.integers(0, 3),
)
def test_naive_and_fast_split_stride_agree(spec: list[tuple[int, int, int]], warmup: int) -> None:
    servers = {f"s{i}": 4 for i in range(6)}
    jobs = []
    for k, (size, tickets, first) in enumerate(spec):
        names = list(servers)
        span = max(1, size // 4)
        chosen = tuple(names[(first + i) % len(names)] for i in range(span))
        jobs.append(PlacedJob(job_id=f"j{k}", size=size, job_tickets=float(tickets), servers=chosen))
    central: dict[str, float] = {}
    local: dict[str, float] = {}
    for _ in range(warmup + 1):
        fast = split_stride_quantum(servers, jobs, central, local)
        slow = naive_split_stride_quantum(servers, jobs, central, local)
        assert fast == slow
        central, local = fast.central_passes, fast.local_passes
        used = sum(j.size for j in jobs if j.job_id in fast.scheduled)
        assert used + fast.idle_gpus == sum(servers.values())

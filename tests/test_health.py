"""The readiness rule and the state gauges (pure), and the probe endpoints' HTTP
handling on a real socket (no NATS needed: a process whose service has not
connected to the log yet is alive and not ready)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from shoal import events as ev
from shoal import state as st
from shoal.health import QueueMetrics, bus_lag, judge_readiness, pending_time, queue_metrics, state_gauges
from shoal.probes import Health, ProbeServer, probe_url
from shoal.settings import Settings, SettingsError


def test_ready_when_replayed_caught_up_and_role_known() -> None:
    r = judge_readiness(replayed=True, applied_seq=9, tail_seq=9, leader_elected=True, role="standby")
    assert r.ready and r.reasons == ()
    assert "role standby" in r.body() and r.body().startswith("ready\n")


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"replayed": False, "applied_seq": 3, "tail_seq": 3}, "replaying the log"),
        ({"replayed": True, "applied_seq": 3, "tail_seq": 5}, "behind the log's tail by 2 messages"),
        (
            {"replayed": True, "applied_seq": 3, "tail_seq": None, "tail_error": "TimeoutError"},
            "cannot read the log's tail (TimeoutError)",
        ),
        (
            {"replayed": True, "applied_seq": 3, "tail_seq": 3, "leader_elected": True, "role": None},
            "role unknown",
        ),
    ],
)
def test_not_ready(kwargs: dict[str, object], reason: str) -> None:
    r = judge_readiness(**kwargs)  # type: ignore[arg-type]
    assert not r.ready
    assert any(reason in x for x in r.reasons), r.reasons
    assert r.body().startswith("not ready: ")


def test_bus_lag() -> None:
    assert bus_lag(None, 4) is None
    assert bus_lag(10, 4) == 6
    assert bus_lag(4, 10) == 0


def test_state_gauges() -> None:
    s = st.ClusterState()
    s.nodes["n0"] = st.NodeState(gpus=[st.GpuState(gpu_type="V100") for _ in range(4)])
    s.nodes["n1"] = st.NodeState(gpus=[st.GpuState(gpu_type="V100")], status="lost")
    spec = ev.JobSpec(user="u", max_gpus=2, total_iterations=10)
    s.jobs["a"] = st.JobState(spec=spec, status=st.RUNNING, gpus=3)
    s.jobs["b"] = st.JobState(spec=spec)
    s.jobs["c"] = st.JobState(spec=spec, status="completed")
    s.shares = {"a": 3}
    s.shares_epoch = 7
    g = {x.name: x.value for x in state_gauges(s)}
    assert g["epoch"] == 7
    assert g["jobs_pending"] == 1
    assert g["jobs_active"] == 2
    assert g["queue_length"] == 1  # b: active without a GPU
    assert g["gpus_total"] == 4  # the lost node's GPU does not count
    assert g["gpus_allocated"] == 3
    assert g["gpu_allocation_ratio"] == 0.75
    assert g["gpu_utilization"] == 0.0
    # Measured utilisation: the mean over the healthy GPUs of the nodes that are up.
    n0 = s.nodes["n0"].gpus
    n0[0].utilization, n0[1].utilization, n0[2].utilization = 1.0, 0.5, 0.9
    n0[2].healthy = False
    s.nodes["n1"].gpus[0].utilization = 1.0  # lost: not counted
    g = {x.name: x.value for x in state_gauges(s)}
    assert g["gpu_utilization"] == (1.0 + 0.5 + 0.0) / 3


def test_settings() -> None:
    s = Settings.load({"SHOAL_METRICS_PORT": "0"})
    assert s.metrics_port == 0 and s.metrics_host == "127.0.0.1"
    assert Settings.load({}).metrics_port is None
    with pytest.raises(SettingsError, match="SHOAL_METRICS_PORT"):
        Settings.load({"SHOAL_METRICS_PORT": "70000"})
    assert probe_url("0.0.0.0", 9) == "http://127.0.0.1:9"
    assert probe_url("::", 9) == "http://[::1]:9"


async def _request(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_endpoints_before_the_service_connects() -> None:
    server = ProbeServer(Health("admission"), "127.0.0.1", 0)
    await server.start()
    try:
        port = server.port
        assert port > 0
        assert await _request(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"ok\n")
        status, body = await _request(port, b"GET /readyz HTTP/1.1\r\n\r\n")
        assert status == 503 and body.startswith(b"not ready: starting"), body
        status, body = await _request(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status == 200
        assert b'shoal_service_info{service="admission"} 1.0' in body
        assert b"shoal_ready 0.0" in body
        assert (await _request(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")) == (200, b"")
        # read-only: nothing but GET/HEAD of the three paths
        assert (await _request(port, b"POST /readyz HTTP/1.1\r\nContent-Length: 0\r\n\r\n"))[0] == 405
        assert (await _request(port, b"GET /admin HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await _request(port, b"nonsense\r\n\r\n"))[0] == 400
        assert (await _request(port, b"GET /healthz HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n"))[0] == 400
    finally:
        await server.stop()


def test_reconfiguration_histograms_from_folded_events() -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from shoal import codec

    health = Health("placer")
    s = st.ClusterState()
    events = [
        ev.ReconfigurationPhase(job_id="j", epoch=1, phase="checkpoint", duration_s=0.3),
        ev.ReconfigurationPhase(job_id="j", epoch=1, phase="restore", duration_s=2.0),
        ev.ReconfigurationCompleted(job_id="j", epoch=1, world_size=2, duration_s=2.5, stop_time_s=2.3),
    ]
    for seq, e in enumerate(events, 1):
        health._on_event(seq, codec.wrap(e, at=float(seq)), s)
    got = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(asyncio.run(health.metrics()).decode())
        for x in f.samples
    }
    assert got[("shoal_reconfiguration_phase_seconds_count", (("phase", "checkpoint"),))] == 1
    assert got[("shoal_reconfiguration_phase_seconds_sum", (("phase", "restore"),))] == 2.0
    assert got[("shoal_reconfiguration_seconds_sum", ())] == 2.5
    assert got[("shoal_reconfiguration_stop_seconds_sum", ())] == 2.3


def test_state_digest_metric_is_the_folded_state_at_its_sequence() -> None:
    from types import SimpleNamespace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from shoal import codec

    s = st.ClusterState()
    st.apply(s, codec.wrap(ev.NodeRegistered(node_id="n0", gpus=[]), at=1.0))
    health = Health("admission")
    health.projection = SimpleNamespace(state=s, last_seq=7)  # type: ignore[assignment]
    health.bus = SimpleNamespace(stats=SimpleNamespace(dead_lettered=0))  # type: ignore[assignment]
    samples = [
        x
        for f in text_string_to_metric_families(generate_latest(health.registry).decode())
        for x in f.samples
        if x.name == "shoal_state_digest"
    ]
    assert [x.labels for x in samples] == [{"digest": st.digest(s), "seq": "7"}]
    assert st.digest(s) != st.digest(st.ClusterState())


def test_job_share_metric_gives_each_active_jobs_gpus() -> None:
    from types import SimpleNamespace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    s = st.ClusterState()
    s.shares = {"a": 3, "b": 1}
    health = Health("allocator")
    health.projection = SimpleNamespace(state=s, last_seq=1)  # type: ignore[assignment]
    health.bus = SimpleNamespace(stats=SimpleNamespace(dead_lettered=0))  # type: ignore[assignment]
    samples = {
        x.labels["job_id"]: x.value
        for f in text_string_to_metric_families(generate_latest(health.registry).decode())
        for x in f.samples
        if x.name == "shoal_job_share"
    }
    assert samples == {"a": 3, "b": 1}


# -- AFS §2.2's QL, CE and BI from the folded state --------------------------------


def _fold(*timed: tuple[float, ev.Event]) -> st.ClusterState:
    s = st.ClusterState()
    for at, e in timed:
        st.apply_event(s, e, at)
    return s


def _queue_state() -> st.ClusterState:
    """4 healthy GPUs (a lost node's one does not count), two running and three pending jobs."""
    gpus = tuple(ev.GpuInfo(index=i, gpu_type="v100") for i in range(4))
    rigid = ev.JobSpec(
        user="u", min_gpus=2, max_gpus=2, requested_gpus=2, elastic=False, total_iterations=100
    )
    return _fold(
        (0.0, ev.NodeRegistered(node_id="n0", gpus=gpus)),
        (0.0, ev.NodeRegistered(node_id="n1", gpus=(ev.GpuInfo(index=0, gpu_type="v100"),))),
        (1.0, ev.NodeLost(node_id="n1")),
        (0.0, ev.JobSubmitted(job_id="f", spec=ev.JobSpec(user="u", total_iterations=5))),
        (10.0, ev.JobCompleted(job_id="f", iterations=5)),
        # d: waits 0..100, runs on 2 GPUs 100..150, preempted at 150 (40 of 100 iterations done).
        (0.0, ev.JobSubmitted(job_id="d", spec=rigid)),
        (100.0, ev.SharesDecided(epoch=1, shares={"d": 2})),
        (150.0, ev.ProgressReported(job_id="d", iteration=40)),
        (150.0, ev.SharesDecided(epoch=2, shares={})),
        # c: never ran; 800 iterations at 4/s on one GPU.
        (100.0, ev.JobSubmitted(job_id="c", spec=ev.JobSpec(user="u", total_iterations=800))),
        (100.0, ev.ThroughputModelUpdated(job_id="c", gpu_type="", throughput={1: 4.0})),
        # a: 2 GPUs at 16/s, 10/s on one; b: 1 GPU, no model (linear).
        (200.0, ev.JobSubmitted(job_id="a", spec=ev.JobSpec(user="u", max_gpus=2, total_iterations=1000))),
        (200.0, ev.ThroughputModelUpdated(job_id="a", gpu_type="", throughput={1: 10.0, 2: 16.0})),
        (200.0, ev.JobSubmitted(job_id="b", spec=ev.JobSpec(user="u", total_iterations=10))),
        (200.0, ev.SharesDecided(epoch=3, shares={"a": 2, "b": 1})),
        # e: unknown length, no estimate yet.
        (250.0, ev.JobSubmitted(job_id="e", spec=ev.JobSpec(user="u", convergence_target=0.5))),
    )


def test_queue_metrics_by_hand() -> None:
    s = _queue_state()
    q = queue_metrics(s, now=300.0)
    assert q.ql == 3  # c, d, e
    assert q.ce == pytest.approx((16.0 / 10.0 + 1.0) / 4)  # a: 1.6, b (linear): 1.0, over M = 4
    # d waited 100 + 150 = 250 s (exact: it only ever held its minimum, 2 GPUs), remaining
    # 60 iterations at 1/s; c waited 200 s, remaining 800 / 4 = 200 s; e has no length.
    assert pending_time(s.jobs["d"], 300.0) == pytest.approx(250.0)
    assert q.bi_jobs == 2
    assert q.bi == pytest.approx((250.0 / 60.0 + 200.0 / 200.0) / 2)
    # BI grows while the queue waits; QL and CE do not move with time.
    later = queue_metrics(s, now=360.0)
    assert later.bi == pytest.approx((310.0 / 60.0 + 260.0 / 200.0) / 2)
    assert (later.ql, later.ce) == (q.ql, q.ce)
    # e's estimate arrives: it joins BI (convergence-target length, Optimus §3.1).
    st.apply_event(
        s,
        ev.ConvergenceEstimated(job_id="e", beta0=1, beta1=1, beta2=0, estimated_total_iterations=50),
        300.0,
    )
    q = queue_metrics(s, now=300.0)
    assert q.bi_jobs == 3 and q.bi == pytest.approx((250.0 / 60.0 + 1.0 + 50.0 / 50.0) / 3)
    g = {x.name: x.value for x in state_gauges(s, now=300.0)}
    assert (g["queue_length"], g["cluster_efficiency"], g["blocking_index"]) == (q.ql, q.ce, q.bi)
    # Without a ``now`` the gauges are at the newest folded event's time.
    g = {x.name: x.value for x in state_gauges(s)}
    assert s.clock == 300.0 and g["blocking_index"] == pytest.approx(q.bi)
    assert queue_metrics(st.ClusterState(), now=5.0) == QueueMetrics(ql=0, ce=0.0, bi=0.0, bi_jobs=0)


def test_pending_time_of_a_job_that_held_more_than_its_minimum_is_a_lower_bound() -> None:
    # Elastic (min 1): waited 0..400, held 4 GPUs 400..450, preempted; at 500 it has really
    # waited 450 s. The fold keeps 200 GPU-s, which 1 GPU would have taken 200 s to attain.
    s = _fold(
        (0.0, ev.JobSubmitted(job_id="j", spec=ev.JobSpec(user="u", max_gpus=4, total_iterations=9))),
        (400.0, ev.SharesDecided(epoch=1, shares={"j": 4})),
        (450.0, ev.SharesDecided(epoch=2, shares={})),
    )
    job = s.jobs["j"]
    assert pending_time(job, 500.0) == pytest.approx(500.0 - 200.0 / 1)  # < 450: a lower bound
    # Never less than the current spell (preempted at 450), never a negative time.
    assert pending_time(job, 700.0) == pytest.approx(500.0)
    s.jobs["j"].attained_service_gpu_s = 1000.0
    assert pending_time(job, 500.0) == pytest.approx(50.0)
    assert pending_time(job, 440.0) == 0.0


def test_cluster_efficiency_uses_the_catalog_curve_as_the_allocator_does() -> None:
    from shoal.models import AFS_TABLE4_MODELS, get_catalog

    catalog = get_catalog("afs")
    model = AFS_TABLE4_MODELS[0]
    curve = catalog.curve(model, "").throughput
    s = _fold(
        (
            0.0,
            ev.NodeRegistered(node_id="n0", gpus=tuple(ev.GpuInfo(index=i, gpu_type="x") for i in range(4))),
        ),
        (
            0.0,
            ev.JobSubmitted(
                job_id="j", spec=ev.JobSpec(user="u", model=model, max_gpus=4, total_iterations=9)
            ),
        ),
        (0.0, ev.SharesDecided(epoch=1, shares={"j": 4})),
    )
    assert queue_metrics(s, 1.0, catalog).ce == pytest.approx(curve[4] / curve[1] / 4)
    assert curve[4] / curve[1] != 4.0
    assert queue_metrics(s, 1.0).ce == 1.0  # no catalog: linear scaling, 4/1 on 4 GPUs


@pytest.mark.parametrize("policy", ["toy-fifo", "afs-p"])
def test_live_metrics_equal_the_simulators_on_its_folded_log(policy: str) -> None:
    """At every decision of a simulation, QL/CE/BI from the simulator's folded state (what
    a service exports) against the simulator's own :meth:`recompute_metrics`. BI is equal
    while every pending job either never ran or ran on its minimum; a job preempted from
    more GPUs makes the live BI a lower bound (:func:`shoal.health.pending_time`)."""
    from shoal.sim.engine import SimConfig, Simulator
    from shoal.workloads import load_workload

    from tests.sim.toy_policies import ToyFifo

    class Compared(Simulator):
        exact = bounded = 0

        def _sample(self, now: float) -> None:
            super()._sample(now)
            ql, ce, bi, _, _ = self.recompute_metrics(now)
            live = queue_metrics(self.log.state, now)
            assert live.ql == ql and live.bi_jobs == ql, now
            assert live.ce == pytest.approx(ce, rel=1e-9), now
            state = self.log.state
            jobs = [state.jobs[j] for j in state.active_jobs() if not state.shares.get(j)]
            for sim_job in self.active.values():
                if not sim_job.gpus:  # pending: its whole wait as the simulator keeps it
                    waited = sim_job.wait + (
                        now - sim_job.pending_since if sim_job.pending_since is not None else 0.0
                    )
                    got = pending_time(state.jobs[sim_job.id], now)
                    assert got <= waited + 1e-6, (now, sim_job.id)
                    if state.jobs[sim_job.id].attained_service_gpu_s == 0:
                        assert got == pytest.approx(waited), (now, sim_job.id)
            # The log holds int(done) of a preempted job: remaining time differs by < 1 iteration.
            if all(j.attained_service_gpu_s == 0 or j.spec.min_gpus == j.spec.max_gpus for j in jobs):
                assert live.bi == pytest.approx(bi, rel=1e-3, abs=1e-9), now
                self.exact += ql > 0
            else:
                assert live.bi <= bi * (1 + 1e-3), now
                self.bounded += 1

    if policy == "afs-p":
        from shoal.policies.afs import AFSP

        chosen: Any = AFSP(unit_s=900.0)
    else:
        chosen = ToyFifo()
    jobs = [j for j in load_workload("philly:2869ce:40", seed=0) if j.spec.requested_gpus <= 8]
    sim = Compared(jobs, chosen, SimConfig(total_gpus=8, flat=True))
    sim.run()
    assert sim.exact > 5, (sim.exact, sim.bounded)
    if policy == "afs-p":
        assert sim.bounded > 0  # AFS-P preempts and shrinks jobs: the bound was exercised

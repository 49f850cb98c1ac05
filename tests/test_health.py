"""The readiness rule and the state gauges (pure), and the probe endpoints' HTTP
handling on a real socket (no NATS needed: a process whose service has not
connected to the log yet is alive and not ready)."""

from __future__ import annotations

import asyncio

import pytest
from shoal import events as ev
from shoal import state as st
from shoal.health import bus_lag, judge_readiness, state_gauges
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

"""One reconfiguration is one OpenTelemetry trace across processes.

The allocator and the placer run in this process with an in-memory exporter; the
node daemon runs as a real ``shoal run node-daemon`` subprocess and starts the job's
emulated sidecar as its own subprocess. Both write their spans to a JSON-lines file
(``SHOAL_TRACE_JSONL``, which the daemon exports to its sidecars). One job is
submitted; once its first reconfiguration has completed, the spans of all three
processes are merged and the whole chain is checked: allocator decision -> placer
-> node daemon -> sidecar, one trace id, every parent link, three process ids. The
logs of the daemon and the sidecar carry the job id, epoch and trace id.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.clock import ScaledClock
from shoal.telemetry import make_tracer_provider, span_record, stored_context, trace_fields, with_trace_fields
from shoal_services.allocator.service import AllocatorService
from shoal_services.placer.service import PlacerService
from shoal_services.trainer_sidecar.emulated import parse_order, parse_traced_order

from tests.services.test_allocator_placer import GreedyRequested, wait_until

SCALE = 100.0
JOB = "traced-job"
NODE = "n0"


def test_order_line_carries_the_trace_context_and_stays_compatible() -> None:
    """The node daemon's order line gains ``traceparent``; old and new readers both take it."""
    memory = InMemorySpanExporter()
    tracer = make_tracer_provider("t", exporters=[memory]).get_tracer("t")
    order = ev.Reconfigure(job_id="j", epoch=3, gpus=(ev.GpuRef(node_id="n", index=0),), effective_at=1.5)
    plain = codec.to_json(order)
    assert with_trace_fields(plain) == plain  # no span, nothing added
    with tracer.start_as_current_span("send") as span:
        line = with_trace_fields(plain)
    want = format(span.get_span_context().trace_id, "032x")
    parsed, context = parse_traced_order(line + b"\n")
    assert parsed == order and context["traceparent"].split("-")[1] == want
    assert parse_order(line) == order  # a reader that knows nothing of tracing ignores the field
    assert parse_traced_order(plain) == (order, {})  # an order without it
    with pytest.raises(msgspec.ValidationError):  # the order itself is decoded as strictly as before
        parse_traced_order(b'{"type":"cmd.reconfigure","job_id":"j","traceparent":"00-x"}')
    assert trace_fields(b"[1]") == {} and trace_fields(b'{"traceparent":5}') == {}
    assert trace_fields(b"not json") == {}


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def spawn_node_daemon(nats_url: str, prefix: str, clock: ScaledClock, tmp: Path) -> subprocess.Popen[bytes]:
    """``shoal run node-daemon`` as ``shoal up`` starts it: settings in ``SHOAL_*``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    env.update(
        {
            "SHOAL_NATS_URL": nats_url,
            "SHOAL_PREFIX": prefix,
            "SHOAL_NODE_ID": NODE,
            "SHOAL_FAKE_GPUS": "2",
            "SHOAL_TIME_SCALE": repr(clock.scale),
            "SHOAL_CLOCK_ORIGIN": repr(clock.origin),
            "SHOAL_HEARTBEAT_S": "0.2",
            "SHOAL_REPORT_EVERY_S": "0.1",
            "SHOAL_TRACE_JSONL": str(tmp / "spans.jsonl"),
            "SHOAL_LOG_FORMAT": "json",
            "SHOAL_STATE_DIR": str(tmp / "state"),
        }
    )
    stderr = (tmp / "node-daemon.log").open("wb")  # the sidecar inherits it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "run", "node-daemon"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    finally:
        stderr.close()


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chain_to_root(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[str]:
    names = [span["name"]]
    while span["parent_span_id"] is not None:
        span = by_id[span["parent_span_id"]]
        names.append(span["name"])
    return names


@pytest.mark.integration
async def test_one_reconfiguration_is_one_trace_across_three_processes(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    memory = InMemorySpanExporter()
    provider = make_tracer_provider("control-plane", exporters=[memory])
    tracer = provider.get_tracer("test")
    clock = ScaledClock(SCALE)
    stop = asyncio.Event()
    allocator = AllocatorService(
        bus, GreedyRequested(), holder="a", clock=clock, node_timeout_s=None, tracer=tracer
    )
    placer = PlacerService(bus, holder="p", clock=clock, tracer=tracer)
    tasks = [asyncio.create_task(s.run(stop)) for s in (allocator, placer)]
    jsonl = tmp_path / "spans.jsonl"
    daemon = spawn_node_daemon(nats_url, prefix, clock, tmp_path)
    try:
        await wait_until(lambda: NODE in allocator.projection.state.nodes, timeout=20)
        spec = ev.JobSpec(user="u", min_gpus=1, max_gpus=2, requested_gpus=2, total_iterations=10**6)
        await bus.publish(codec.wrap(ev.JobSubmitted(job_id=JOB, spec=spec), at=clock.now()))

        # The sidecar's reconfigure span ends once ReconfigurationCompleted is published.
        def reconfigured() -> bool:
            return any(
                s["name"] == "sidecar.reconfigure" and s["attributes"].get("shoal.outcome") == "completed"
                for s in read_spans(jsonl)
            )

        await wait_until(reconfigured, timeout=20)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        await asyncio.to_thread(stop_process, daemon)
    log_text = (tmp_path / "node-daemon.log").read_text()
    assert daemon.returncode == 0, log_text[-3000:]

    local = [span_record(s, "control-plane") for s in memory.get_finished_spans()]
    spans = local + read_spans(jsonl)
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "span ids are unique"

    # The trace: rooted at the decision that gave the job its GPUs.
    completed = [
        (seq, env)
        async for seq, env in bus.replay()
        if isinstance(env.event, ev.ReconfigurationCompleted) and env.event.job_id == JOB
    ]
    assert completed, "the job's reconfiguration completed"
    seq, done = completed[0]
    epoch = done.event.epoch
    roots = [s for s in spans if s["name"] == "allocator.decide" and s["attributes"]["shoal.epoch"] == epoch]
    assert len(roots) == 1, [s["name"] for s in spans]
    root = roots[0]
    assert root["parent_span_id"] is None
    assert root["attributes"]["shoal.trigger"] == "arrival"
    trace_id = root["trace_id"]
    in_trace = [s for s in spans if s["trace_id"] == trace_id]
    one = {s["name"]: s for s in in_trace}

    # Every phase of every hop is in the trace, and the tree is connected.
    expected = {
        "allocator.decide",
        "allocator.view",
        "allocator.policy",
        "allocator.publish",
        "placer.place",
        "placer.compute",
        "placer.publish",
        "node_daemon.reconcile",
        "node_daemon.spawn",
        "node_daemon.reconfigure",
        "sidecar.reconfigure",
        "sidecar.stop",
        "sidecar.switch",
        "sidecar.resume",
    }
    assert expected <= set(one), sorted(set(one))
    for s in in_trace:
        assert s is root or s["parent_span_id"] in by_id, f"{s['name']} has a parent outside the trace"
        assert s is root or by_id[s["parent_span_id"]]["trace_id"] == trace_id

    # Parent/child links, hop by hop (producer -> consumer across processes).
    def parent(name: str) -> str:
        return by_id[one[name]["parent_span_id"]]["name"]

    assert parent("allocator.view") == parent("allocator.policy") == "allocator.decide"
    assert parent("allocator.publish") == "allocator.decide"
    assert parent("placer.place") == "allocator.publish"
    assert parent("placer.compute") == parent("placer.publish") == "placer.place"
    assert parent("node_daemon.reconcile") == "placer.publish"
    assert parent("node_daemon.spawn") == parent("node_daemon.reconfigure") == "node_daemon.reconcile"
    assert parent("sidecar.reconfigure") == "node_daemon.reconfigure"
    assert (
        parent("sidecar.stop")
        == parent("sidecar.switch")
        == parent("sidecar.resume")
        == "sidecar.reconfigure"
    )
    assert chain_to_root(one["sidecar.resume"], by_id) == [
        "sidecar.resume",
        "sidecar.reconfigure",
        "node_daemon.reconfigure",
        "node_daemon.reconcile",
        "placer.publish",
        "placer.place",
        "allocator.publish",
        "allocator.decide",
    ]
    assert [one[n]["kind"] for n in ("allocator.publish", "placer.place", "placer.publish")] == [
        "producer",
        "consumer",
        "producer",
    ]
    assert one["node_daemon.reconcile"]["kind"] == "consumer"
    assert one["sidecar.reconfigure"]["kind"] == "consumer"
    for name in ("placer.place", "node_daemon.reconfigure", "sidecar.reconfigure"):
        assert one[name]["attributes"]["shoal.epoch"] == epoch
    assert one["sidecar.reconfigure"]["attributes"]["shoal.job_id"] == JOB
    assert one["sidecar.reconfigure"]["attributes"]["shoal.kind"] == "start"

    # Three processes: this one (allocator, placer), the node daemon, its sidecar.
    sidecar_pid = one["node_daemon.reconfigure"]["attributes"]["shoal.sidecar_pid"]
    assert {one[n]["pid"] for n in ("allocator.decide", "placer.place")} == {os.getpid()}
    assert {one[n]["pid"] for n in ("node_daemon.reconcile", "node_daemon.reconfigure")} == {daemon.pid}
    assert {one[n]["pid"] for n in ("sidecar.reconfigure", "sidecar.resume")} == {sidecar_pid}
    assert len({s["pid"] for s in in_trace}) >= 3
    assert {one["node_daemon.reconcile"]["service"], one["sidecar.reconfigure"]["service"]} == {
        "node-daemon",
        "trainer-sidecar",
    }

    # The sidecar's events carry the trace on in their headers.
    ctx = await stored_context(bus.js, bus.names.events_stream, seq)
    from opentelemetry import trace

    assert format(trace.get_current_span(ctx).get_span_context().trace_id, "032x") == trace_id

    # Logs of the daemon and of the sidecar have the job id, epoch and trace id bound.
    lines = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    bound = [
        (r.get("service"), r["event"])
        for r in lines
        if r.get("job_id") == JOB and r.get("epoch") == epoch and r.get("trace_id") == trace_id
    ]
    assert ("node-daemon", "order_sent") in bound, bound
    assert any(service == "trainer-sidecar" for service, _ in bound), bound

    # Only a bound on a hang (two processes start here; 9 s on a loaded 2-core machine).
    assert time.monotonic() - started < 120

"""Process basics: run_service's signal handling and draining (real subprocesses on a
real nats-server), logging configuration, and trace context across processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from shoal import events as ev
from shoal.bus import Bus
from shoal.log import bind_job, configure_logging, reset_logging
from shoal.settings import Settings
from shoal.telemetry import (
    JsonlSpanExporter,
    consumer_span,
    extract,
    inject,
    make_tracer_provider,
    producer_span,
    setup_tracing,
)

SERVICE = textwrap.dedent(
    """
    import asyncio, os, sys
    from shoal import codec
    from shoal import events as ev
    from shoal.runtime import connect_bus, run_service
    from shoal.settings import Settings
    from shoal.telemetry import consumer_span, producer_span

    MODE = sys.argv[1]

    def say(text):
        print(text, flush=True)

    async def drain(settings, stop):
        bus = await connect_bus(settings, "test-drain")
        await bus.ensure_consumer("worker", max_deliver=1)

        async def handler(env, msg):
            with consumer_span("handle", msg.headers):
                say("handling " + env.event.job_id)
                await asyncio.sleep(1.5)  # the in-flight work the signal must not cut short
                await bus.publish(ev.JobStarted(job_id=env.event.job_id))
                say("handled " + env.event.job_id)

        say("ready")
        try:
            await bus.consume("worker", handler, stop=stop, fetch_timeout_s=0.2)
        finally:
            await bus.close()
        say("drained")

    async def produce(settings, stop):
        bus = await connect_bus(settings, "test-produce")
        with producer_span("submit"):
            await bus.publish(ev.JobCancelled(job_id="traced"))
        await bus.close()

    async def stubborn(settings, stop):
        say("ready")
        while True:  # ignores stop
            await asyncio.sleep(0.1)

    async def fail(settings, stop):
        raise RuntimeError("boom")

    async def cut(settings, stop):
        bus = await connect_bus(settings, "test-cut", declare=False)
        say("ready")
        # A protocol error: the server answers -ERR and ends the connection, and nats-py
        # closes its client for good, as it does on most -ERR messages.
        bus.nc._transport.write(b"BOGUS\\r\\n")
        await stop.wait()
        say("stopped")

    sys.exit(run_service(globals()[MODE], Settings.load(), service_name=MODE))
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "service.py"
    path.write_text(SERVICE)
    return path


def spawn(script: Path, mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    return subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**base, "SHOAL_LOG_FORMAT": "json", **env},
    )


def read_until(proc: subprocess.Popen[str], text: str, timeout_s: float = 30) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(text):
            return lines
    stderr = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
    raise AssertionError(f"never saw {text!r}; stdout {lines}; stderr {stderr[-2000:]}")


@pytest.mark.integration
async def test_sigterm_drains_the_handler_in_flight_then_exits_0(
    bus: Bus, nats_url: str, prefix: str, script: Path, tmp_path: Path
) -> None:
    trace_file = tmp_path / "spans.jsonl"
    env = {"SHOAL_NATS_URL": nats_url, "SHOAL_PREFIX": prefix, "SHOAL_TRACE_JSONL": str(trace_file)}
    consumer = spawn(script, "drain", env)
    try:
        read_until(consumer, "ready")
        producer = spawn(script, "produce", env)
        assert producer.wait(30) == 0, producer.stderr.read() if producer.stderr else ""
        read_until(consumer, "handling traced")
        consumer.send_signal(signal.SIGTERM)  # while the handler sleeps
        out, err = consumer.communicate(timeout=30)
    finally:
        if consumer.poll() is None:
            consumer.kill()
    assert consumer.returncode == 0, err
    assert out.split() == ["handled", "traced", "drained"]
    # The handler's work reached the log and its message was acked, not left for redelivery.
    started = [e async for _, e in bus.replay() if isinstance(e.event, ev.JobStarted)]
    assert [e.event.job_id for e in started] == ["traced"]
    info = await bus.js.consumer_info(bus.names.events_stream, "worker")
    assert info.num_ack_pending == 0 and info.ack_floor is not None and info.ack_floor.stream_seq == 1
    assert info.num_pending == 1  # only the JobStarted the handler itself appended
    # One trace across the two processes: the consumer's span is a child of the producer's.
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    by_name = {s["name"]: s for s in spans}
    submit, handle = by_name["submit"], by_name["handle"]
    assert submit["service"] == "produce" and handle["service"] == "drain"
    assert handle["trace_id"] == submit["trace_id"]
    assert handle["parent_span_id"] == submit["span_id"]
    assert submit["parent_span_id"] is None
    assert handle["kind"] == "consumer" and submit["kind"] == "producer"
    assert handle["start"] >= submit["start"] and handle["end"] > handle["start"]


@pytest.mark.integration
def test_second_signal_forces_exit_and_drain_timeout_fails(script: Path) -> None:
    proc = spawn(script, "stubborn", {"SHOAL_DRAIN_TIMEOUT_S": "60"})
    read_until(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None  # still draining (it ignores stop)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 128 + signal.SIGINT
    proc = spawn(script, "stubborn", {"SHOAL_DRAIN_TIMEOUT_S": "0.5"})
    read_until(proc, "ready")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 5
    assert "drain_timeout" in err


@pytest.mark.integration
def test_failures_and_startup_errors_have_distinct_exit_codes(script: Path, tmp_path: Path) -> None:
    proc = spawn(script, "fail", {})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "service_failed" in err and "boom" in err
    proc = spawn(script, "drain", {"SHOAL_STATE_DIR": str(tmp_path / "nothing-running")})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "no NATS server: set NATS_URL or run `shoal up`" in err


@pytest.mark.integration
def test_a_connection_closed_for_good_fails_the_service(nats_url: str, prefix: str, script: Path) -> None:
    """nats-py does not reconnect after most of the server's -ERR messages: the service
    would wait for ever on a dead connection. The bus fails the process instead, so it
    drains and exits 1 and its supervisor starts it again with a new connection."""
    proc = spawn(script, "cut", {"SHOAL_NATS_URL": nats_url, "SHOAL_PREFIX": prefix})
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert out.split() == ["ready", "stopped"]
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    closed = [e for e in events if e.get("event") == "nats_connection_closed"]
    assert closed and "unknown protocol operation" in closed[0]["error"].lower(), err
    assert any(e.get("event") == "stopped_after_task_died" for e in events), err


# -- logging --------------------------------------------------------------------------


@pytest.fixture
def clean_logging() -> object:
    yield
    reset_logging()
    structlog.contextvars.clear_contextvars()


def test_json_lines_with_bound_context(clean_logging: object) -> None:
    buf = io.StringIO()
    configure_logging(Settings.load({"SHOAL_LOG_FORMAT": "json", "SHOAL_LOG_LEVEL": "info"}), stream=buf)
    configure_logging(Settings.load({"SHOAL_LOG_FORMAT": "json", "SHOAL_LOG_LEVEL": "info"}), stream=buf)
    bind_job(job_id="j1", epoch=4, trace_id="abc")
    log = structlog.get_logger("t")
    log.info("decided", gpus=2)
    log.debug("hidden")
    import logging

    logging.getLogger("nats.aio.client").warning("from stdlib")
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(lines) == 2  # idempotent configuration: one handler, and debug filtered
    first = lines[0]
    assert first["event"] == "decided" and first["gpus"] == 2 and first["level"] == "info"
    assert (first["job_id"], first["epoch"], first["trace_id"]) == ("j1", 4, "abc")
    assert "timestamp" in first
    assert lines[1]["event"] == "from stdlib" and lines[1]["level"] == "warning"


def test_pretty_on_request_and_trace_id_from_the_current_span(clean_logging: object) -> None:
    buf = io.StringIO()
    configure_logging(Settings.load({"SHOAL_LOG_FORMAT": "pretty"}), stream=buf)
    provider = make_tracer_provider("t", exporters=[InMemorySpanExporter()])
    with provider.get_tracer("t").start_as_current_span("work") as span:
        structlog.get_logger("t").info("inside")
        trace_id = format(span.get_span_context().trace_id, "032x")
    text = buf.getvalue()
    assert "inside" in text and not text.lstrip().startswith("{")
    assert trace_id in text


# -- tracing ----------------------------------------------------------------------------


def test_tracing_is_off_by_default_and_otlp_without_exporter_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not setup_tracing("svc", env={}).enabled
    # Whether or not the otlp extra is installed here, show the path where it is not:
    # a None entry in sys.modules makes the import fail.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with structlog.testing.capture_logs() as logs:
        tracing = setup_tracing("svc", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert not tracing.enabled
    assert any(e["event"] == "otlp_exporter_missing" for e in logs)


def test_inject_extract_carry_the_parent_through_headers(tmp_path: Path) -> None:
    memory = InMemorySpanExporter()
    jsonl = tmp_path / "spans.jsonl"
    provider = make_tracer_provider("svc", exporters=[memory, JsonlSpanExporter(jsonl, "svc")])
    tracer = provider.get_tracer("t")
    assert inject({}) == {}  # no span, nothing injected
    with producer_span("publish", tracer=tracer, attributes={"subject": "p.job.j1.submitted"}):
        headers = inject({"Nats-Msg-Id": "x"})
    assert headers["traceparent"].startswith("00-") and headers["Nats-Msg-Id"] == "x"
    with consumer_span("handle", headers, tracer=tracer):
        pass
    with consumer_span("orphan", {}, tracer=tracer):
        pass
    provider.shutdown()
    spans = {s.name: s for s in memory.get_finished_spans()}
    pub, handle, orphan = spans["publish"], spans["handle"], spans["orphan"]
    assert handle.context.trace_id == pub.context.trace_id
    assert handle.parent is not None and handle.parent.span_id == pub.context.span_id
    assert orphan.parent is None and orphan.context.trace_id != pub.context.trace_id
    ctx = extract(headers)
    from opentelemetry import trace

    assert trace.get_current_span(ctx).get_span_context().span_id == pub.context.span_id
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["name"] for r in records] == ["publish", "handle", "orphan"]
    assert records[0]["attributes"] == {"subject": "p.job.j1.submitted"}
    assert records[1]["parent_span_id"] == records[0]["span_id"]
    assert set(records[0]) >= {
        "trace_id",
        "span_id",
        "parent_span_id",
        "name",
        "service",
        "start",
        "end",
        "attributes",
    }

"""OTLP/HTTP export: ``setup_tracing`` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` sends spans.

A stdlib HTTP server on 127.0.0.1 stands in for the collector and records every
POST. ``setup_tracing`` installs the process-wide tracer provider, so the traced
program runs in a subprocess (the test process's provider stays untouched). Needs
the ``otlp`` extra (``opentelemetry-exporter-otlp-proto-http``, also in ``dev``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

SPAN_NAME = "otlp-export-probe"
SERVICE = "otlp-test-svc"

PROGRAM = f"""
from opentelemetry import trace
from shoal.telemetry import setup_tracing

tracing = setup_tracing({SERVICE!r})
assert tracing.enabled, "OTLP exporter not installed by setup_tracing"
with trace.get_tracer("test").start_as_current_span({SPAN_NAME!r}) as span:
    span.set_attribute("probe.answer", 42)
tracing.shutdown()  # flushes the batch processor
print("done")
"""


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]]  # set on the subclass per server

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.received.append((self.path, self.headers.get("Content-Type", ""), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: list[tuple[str, str, bytes]] = []
    handler = type("Collector", (_Collector,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_setup_tracing_exports_spans_over_otlp_http(
    collector: tuple[str, list[tuple[str, str, bytes]]],
) -> None:
    endpoint, received = collector
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "SHOAL_TRACE")) and k.lower() not in ("http_proxy", "https_proxy")
    }
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout

    traces = [(path, ctype, body) for path, ctype, body in received if path == "/v1/traces"]
    assert traces, f"no POST to /v1/traces; got {[(p, c) for p, c, _ in received]}"
    assert all(ctype == "application/x-protobuf" for _, ctype, _ in traces)
    assert any(SPAN_NAME.encode() in body for _, _, body in traces)

    spans = []
    for _, _, body in traces:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for rs in request.resource_spans:
            resource = {a.key: a.value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    spans.append((resource, span))
    probes = [(resource, span) for resource, span in spans if span.name == SPAN_NAME]
    assert len(probes) == 1
    resource, span = probes[0]
    assert resource["service.name"].string_value == SERVICE
    assert resource["process.pid"].int_value > 0
    assert {a.key: a.value.int_value for a in span.attributes} == {"probe.answer": 42}
    assert len(span.trace_id) == 16 and len(span.span_id) == 8
    assert span.end_time_unix_nano >= span.start_time_unix_nano > 0

"""A stand-in for the OpenTelemetry collector in the container test: it is NOT the
collector. Where the collector's and Jaeger's images cannot be pulled, the test runs this
file in a container of the shoal image (which has opentelemetry-proto) under the name the
services export to. It accepts OTLP/HTTP protobuf on ``POST /v1/traces``, as the collector's
``otlp`` receiver does, keeps every span in memory and answers ``GET /traces`` with them as
JSON lines: trace id, span id, parent span id, name, service name and attributes.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_SPANS: list[dict[str, Any]] = []
_LOCK = threading.Lock()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else str(v)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        {
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "name": s.name,
                            "service": resource.get("service.name", ""),
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                        }
                    )
        with _LOCK:
            _SPANS.extend(spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        with _LOCK:
            body = "".join(json.dumps(s) + "\n" for s in _SPANS).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", 4318), Handler).serve_forever()

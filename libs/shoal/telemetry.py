"""Tracing: OpenTelemetry set up once per process, and W3C trace context in NATS headers.

By default tracing is a no-op: no tracer provider is installed, spans are
non-recording and cost next to nothing. Two switches turn it on:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the standard OpenTelemetry variable): spans are
  exported over OTLP/HTTP. The exporter is the optional extra ``otlp``
  (``pip install 'shoal[otlp]'``); without it a warning says so and tracing stays
  off rather than failing the service.
* ``SHOAL_TRACE_JSONL=<path>`` (:attr:`shoal.settings.Settings.trace_jsonl`): every
  finished span is appended to that file as one JSON object per line
  (``trace_id, span_id, parent_span_id, name, service, kind, start, end,
  attributes, status``), written with one ``O_APPEND`` write per span so that
  several processes can share the file. This is how tests check that a trace crosses
  processes.

Trace context travels in NATS message headers as W3C ``traceparent``/``tracestate``:
:func:`inject` on publish, :func:`extract` on consume; :func:`consumer_span` opens a
span that continues the sender's trace. Services that read the log through a
projection (no message in hand) get a stored event's headers back with
:func:`stored_context`; the node daemon hands the context on to its sidecars on their
order lines (:func:`with_trace_fields` / :func:`trace_fields`).

Every span records the process it came from: ``process.pid`` in the resource (and
``pid`` in the JSON-lines record), so a test can tell processes apart.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import msgspec
import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

log = structlog.get_logger("shoal.telemetry")

OTLP_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_ENDPOINT"
SERVICE_NAME_VAR = "OTEL_SERVICE_NAME"
NODE_ATTRIBUTE = "shoal.node_id"
"""Resource attribute naming the node a node daemon or sidecar runs on (also ``host.name``)."""


def _hex_trace(trace_id: int) -> str:
    return format(trace_id, "032x")


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def span_record(span: ReadableSpan, service: str) -> dict[str, Any]:
    """The JSON-lines form of one finished span."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": _hex_trace(ctx.trace_id) if ctx else None,
        "span_id": _hex_span(ctx.span_id) if ctx else None,
        "parent_span_id": _hex_span(parent.span_id) if parent is not None else None,
        "name": span.name,
        "service": service,
        "kind": span.kind.name.lower(),
        "start": (span.start_time or 0) / 1e9,
        "end": (span.end_time or 0) / 1e9,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name.lower(),
        "pid": span.resource.attributes.get("process.pid"),
        "node": span.resource.attributes.get(NODE_ATTRIBUTE),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return list(value)


class JsonlSpanExporter(SpanExporter):
    """Append finished spans to a file, one JSON object per line (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], service: str) -> None:
        self.path = os.fspath(path)
        self.service = service
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._fd is None:
            return SpanExportResult.FAILURE
        for span in spans:
            line = json.dumps(span_record(span, self.service), sort_keys=True, default=str) + "\n"
            os.write(self._fd, line.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def make_tracer_provider(
    service_name: str,
    *,
    exporters: Sequence[SpanExporter] = (),
    batch_exporters: Sequence[SpanExporter] = (),
    node_id: str | None = None,
) -> TracerProvider:
    """A tracer provider for ``service_name`` that sends spans to the given exporters.

    ``exporters`` get each span as it ends (simple processor); ``batch_exporters`` in
    batches from a background thread (for network exporters). ``node_id`` names the
    node in the resource (``shoal.node_id`` and ``host.name``); ``OTEL_RESOURCE_ATTRIBUTES``
    adds to the resource, as OpenTelemetry defines.
    """
    attributes: dict[str, Any] = {"service.name": service_name, "process.pid": os.getpid()}
    if node_id:
        attributes |= {NODE_ATTRIBUTE: node_id, "host.name": node_id}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    for exporter in batch_exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class Tracing:
    """What :func:`setup_tracing` installed; :meth:`shutdown` flushes and closes it."""

    def __init__(self, service_name: str, provider: TracerProvider | None) -> None:
        self.service_name = service_name
        self.provider = provider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        if self.provider is not None:
            with contextlib.suppress(Exception):
                self.provider.force_flush()
            self.provider.shutdown()


def setup_tracing(
    service_name: str,
    *,
    trace_jsonl: str | None = None,
    env: Mapping[str, str] | None = None,
    node_id: str | None = None,
) -> Tracing:
    """Install the process's tracer provider, or nothing (the default).

    Args:
        service_name: the ``service.name`` resource attribute and the ``service`` of
            JSON-lines records.
        trace_jsonl: append spans to this file (``Settings.trace_jsonl``).
        env: where to look for ``OTEL_EXPORTER_OTLP_ENDPOINT`` and ``OTEL_SERVICE_NAME``
            (which, when set, names the service instead of ``service_name``); default
            ``os.environ``.
        node_id: the node a node daemon or sidecar runs on (see :func:`make_tracer_provider`).

    Returns:
        A handle whose ``shutdown()`` flushes pending spans (call it before exit).
    """
    env = os.environ if env is None else env
    service_name = env.get(SERVICE_NAME_VAR, "").strip() or service_name
    exporters: list[SpanExporter] = []
    batch: list[SpanExporter] = []
    if trace_jsonl:
        exporters.append(JsonlSpanExporter(trace_jsonl, service_name))
    endpoint = env.get(OTLP_ENDPOINT_VAR, "").strip()
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        except ImportError:
            log.warning(
                "otlp_exporter_missing",
                endpoint=endpoint,
                hint="install the extra: pip install 'shoal[otlp]'; OTLP export is off",
            )
        else:
            batch.append(OTLPSpanExporter())  # reads the endpoint and headers from OTEL_* variables
    if not exporters and not batch:
        return Tracing(service_name, None)
    provider = make_tracer_provider(service_name, exporters=exporters, batch_exporters=batch, node_id=node_id)
    trace.set_tracer_provider(provider)
    log.info("tracing_enabled", service=service_name, jsonl=trace_jsonl or None, otlp=endpoint or None)
    return Tracing(service_name, provider)


# ---------------------------------------------------------------------------
# Trace context in NATS headers
# ---------------------------------------------------------------------------


def inject(headers: MutableMapping[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """Write the W3C trace context of ``context`` (default: the current one) into
    ``headers`` and return them. Nothing is written when there is no valid span."""
    carrier: dict[str, str] = {} if headers is None else headers  # type: ignore[assignment]
    propagate.inject(carrier, context=context)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by NATS ``headers`` (an empty context when none)."""
    return propagate.extract(dict(headers or {}))


@contextlib.contextmanager
def consumer_span(
    name: str,
    headers: Mapping[str, str] | None,
    *,
    tracer: trace.Tracer | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[trace.Span]:
    """A CONSUMER span that continues the trace in ``headers``, current while inside."""
    tracer = tracer or trace.get_tracer("shoal")
    parent = extract(headers)
    token = otel_context.attach(parent)
    try:
        with tracer.start_as_current_span(
            name, kind=trace.SpanKind.CONSUMER, attributes=dict(attributes or {})
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


@contextlib.contextmanager
def producer_span(
    name: str, *, tracer: trace.Tracer | None = None, attributes: Mapping[str, Any] | None = None
) -> Iterator[trace.Span]:
    """A PRODUCER span around a publish; :func:`inject` inside it carries it onward."""
    tracer = tracer or trace.get_tracer("shoal")
    with tracer.start_as_current_span(
        name, kind=trace.SpanKind.PRODUCER, attributes=dict(attributes or {})
    ) as span:
        yield span


def current_trace_id() -> str | None:
    """Hex trace id of the current span, or None."""
    ctx = trace.get_current_span().get_span_context()
    return _hex_trace(ctx.trace_id) if ctx.is_valid else None


def tracing_enabled(tracer: trace.Tracer | None = None) -> bool:
    """Whether spans of ``tracer`` (default: the process's) are recorded.

    Lets a service skip work that only tracing needs (fetching a stored message's
    headers) when tracing is off."""
    if tracer is None or isinstance(tracer, trace.ProxyTracer):
        return isinstance(trace.get_tracer_provider(), TracerProvider)
    return isinstance(tracer, SdkTracer)


async def stored_context(js: Any, stream: str, seq: int) -> Context:
    """The trace context in the headers of message ``seq`` of ``stream``, as stored by
    JetStream (an empty context when it has none or cannot be read).

    For services that follow the log through a projection and so never hold the
    message itself: one request, made only when tracing is on."""
    if seq <= 0:
        return Context()
    try:
        raw = await js.get_msg(stream, seq)
    except Exception as exc:  # tracing must never fail the service
        log.debug("stored_context_unreadable", stream=stream, seq=seq, error=str(exc))
        return Context()
    return extract(raw.headers)


TRACE_FIELDS = ("traceparent", "tracestate")
"""The W3C fields carried on a JSON order line (same names as the NATS headers)."""


class _TraceFields(msgspec.Struct):
    traceparent: str | None = None
    tracestate: str | None = None


_TRACE_FIELDS_DEC = msgspec.json.Decoder(_TraceFields)


def with_trace_fields(line: bytes, context: Context | None = None) -> bytes:
    """Add the W3C fields of ``context`` (default: the current one) to the JSON object
    ``line`` (e.g. ``{"type":"cmd.reconfigure",...,"traceparent":"00-..."}``).

    Returns the line without trailing whitespace; without a valid span, unchanged
    otherwise. Readers that do not know the fields ignore them (the order decoder
    skips unknown fields)."""
    carrier = inject({}, context)
    fields = {k: carrier[k] for k in TRACE_FIELDS if carrier.get(k)}
    body = line.rstrip()
    if not fields or not body.endswith(b"}") or body == b"{}":
        return body
    return body[:-1] + b"," + msgspec.json.encode(fields)[1:]


def trace_fields(line: bytes) -> dict[str, str]:
    """The W3C fields of a JSON order line (see :func:`with_trace_fields`); empty when
    there are none or the line is not a JSON object."""
    try:
        got = _TRACE_FIELDS_DEC.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError):  # UnicodeDecodeError: a string not UTF-8
        return {}
    return {k: v for k in TRACE_FIELDS if (v := getattr(got, k))}

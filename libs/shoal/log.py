"""Logging: structlog configured once per process.

* JSON lines on stderr when stderr is not a terminal (collectors, ``shoal up``
  children, CI), a pretty console renderer on a terminal; ``log_format`` forces
  either. stdout is left to commands' own output (tables, progress lines).
* ``structlog.contextvars`` are merged first, so what a handler binds
  (:func:`bind_job`) appears on every line it logs; the current OpenTelemetry span's
  ``trace_id``/``span_id`` are added too, which joins logs to traces.
* Exceptions are rendered as structured ``exception`` fields in JSON
  (``dict_tracebacks`` without local variables), as a normal traceback on the console.
* Records of the standard ``logging`` module (nats-py, asyncio) go through the same
  renderer, at the same level.

:func:`configure_logging` is idempotent: calling it again with the same level and
format does nothing, a different one reconfigures.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import msgspec
import structlog
import structlog.tracebacks
from structlog.typing import EventDict, Processor, WrappedLogger

from shoal.settings import Settings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_state: dict[str, Any] = {}
"""The key of the current configuration (module-private; the process has one logging setup)."""


def _json_default(obj: Any) -> Any:
    try:
        return msgspec.to_builtins(obj)
    except TypeError:
        return repr(obj)


_JSON = msgspec.json.Encoder(enc_hook=_json_default)


def _msgspec_dumps(obj: Any, **_: Any) -> str:
    return _JSON.encode(obj).decode()


def add_trace_context(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Add the current span's ``trace_id`` and ``span_id`` (hex) when there is one."""
    if "trace_id" in event_dict:
        return event_dict
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


def use_json(log_format: str, stream: TextIO) -> bool:
    """Whether ``log_format`` means JSON lines on ``stream``."""
    if log_format == "json":
        return True
    if log_format == "pretty":
        return False
    isatty = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


def configure_logging(settings: Settings, *, stream: TextIO | None = None) -> None:
    """Configure structlog and the standard ``logging`` module for this process.

    Args:
        settings: uses ``log_level`` and ``log_format``.
        stream: where log lines go; default ``sys.stderr``.
    """
    stream = sys.stderr if stream is None else stream
    as_json = use_json(settings.log_format, stream)
    key = (settings.log_level, as_json, id(stream))
    if _state.get("key") == key:
        return
    level = _LEVELS[settings.log_level]
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_context,
    ]
    renderer: Processor
    if as_json:
        renderer = structlog.processors.JSONRenderer(serializer=_msgspec_dumps)
        tail: list[Processor] = [
            structlog.processors.StackInfoRenderer(),
            # Without local variables: a failed start's record was ~20 KB of repeated
            # Settings reprs, and locals may hold what a log must not carry.
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
        ]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=bool(getattr(stream, "isatty", lambda: False)()))
        tail = [structlog.processors.StackInfoRenderer()]
    structlog.configure(
        processors=[*shared, *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (PrintLogger writes the newline separately), so the lines of
        # processes sharing one stderr pipe never interleave.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_shoal", False):
            root.removeHandler(old)
    handler._shoal = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    _state["key"] = key


def reset_logging() -> None:
    """Undo :func:`configure_logging` (structlog defaults, our handler removed)."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_shoal", False):
            root.removeHandler(old)
    _state.clear()


def _job_values(
    job_id: str | None, epoch: int | None, trace_id: str | None, more: dict[str, Any]
) -> dict[str, Any]:
    if trace_id is None:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            trace_id = format(ctx.trace_id, "032x")
    values = {"job_id": job_id, "epoch": epoch, "trace_id": trace_id, **more}
    return {k: v for k, v in values.items() if v is not None}


def bind_job(
    job_id: str | None = None, epoch: int | None = None, trace_id: str | None = None, **more: Any
) -> None:
    """Bind the usual per-message context (``job_id``, ``epoch``, ``trace_id`` …) for
    every log line of the current task; ``None`` values are left out.

    ``trace_id`` defaults to the current span's (if any)."""
    structlog.contextvars.bind_contextvars(**_job_values(job_id, epoch, trace_id, more))


@contextlib.contextmanager
def bound_job(
    job_id: str | None = None, epoch: int | None = None, trace_id: str | None = None, **more: Any
) -> Iterator[None]:
    """:func:`bind_job` for the ``with`` block only: what was bound before comes back
    after it (for long-lived tasks that handle one decision or order after another)."""
    with structlog.contextvars.bound_contextvars(**_job_values(job_id, epoch, trace_id, more)):
        yield


def clear_context() -> None:
    """Forget what was bound for the previous message."""
    structlog.contextvars.clear_contextvars()

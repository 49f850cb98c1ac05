"""Long-lived asyncio tasks that cannot die silently.

A task that raises is, by default, only reported when it is garbage-collected, if
ever: a node daemon whose heartbeat task died during a NATS outage kept running
without heartbeats. Every long-lived task of a service goes through one of two
helpers here:

* :func:`critical` watches a task whose death the process cannot survive (a
  projection follower: the service would go on deciding on a frozen state). When it
  ends with an exception, ``task_died`` is logged at error and the process is
  failed: :func:`shoal.runtime.run_service` stops the service (drain) and exits 1,
  so that its supervisor restarts it. Outside ``run_service`` (tests, the in-process
  stack) the death is logged and the registered fail hooks, if any, run.
* :func:`fail` fails the process the same way for what is no task: a bus whose
  connection nats-py closed for good (:class:`shoal.bus.Bus`; nats-py ends a
  connection on most of the server's ``-ERR`` messages instead of reconnecting), on
  which the service would otherwise wait for ever.
* :func:`keep_running` runs a loop that must outlive transient failures (a node
  daemon's heartbeats): when the loop raises it is started again after a backoff
  (0.5 s doubling to 5 s, back to 0.5 s once a run lasted 30 s), with one warning per
  episode of failures (an episode ends when a run lasted 30 s).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

log = structlog.get_logger("shoal.tasks")

_fail_hooks: list[Callable[[str, BaseException], None]] = []
died: list[str] = []
"""Names of the :func:`critical` tasks of this process that died with an exception."""


def add_fail_hook(hook: Callable[[str, BaseException], None]) -> Callable[[], None]:
    """Call ``hook(task name, exception)`` when a :func:`critical` task dies; returns
    a function that removes the hook."""
    _fail_hooks.append(hook)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _fail_hooks.remove(hook)

    return remove


def _on_done(task: asyncio.Task[Any]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is None:
        return
    name = task.get_name()
    died.append(name)
    log.error("task_died", task=name, error=repr(exc), exc_info=exc)
    for hook in list(_fail_hooks):
        hook(name, exc)


def fail(name: str, exc: BaseException) -> None:
    """Fail the process as a :func:`critical` task's death does, for a loss that is no
    task's (a NATS connection that nats-py closed for good, :class:`shoal.bus.Bus`)."""
    died.append(name)
    for hook in list(_fail_hooks):
        hook(name, exc)


def critical(task: asyncio.Task[Any]) -> asyncio.Task[Any]:
    """Watch ``task`` (see the module docstring); returns it."""
    task.add_done_callback(_on_done)
    return task


async def keep_running(
    factory: Callable[[], Coroutine[Any, Any, None]],
    *,
    name: str,
    stop: asyncio.Event | None = None,
    first_delay_s: float = 0.5,
    max_delay_s: float = 5.0,
    healthy_after_s: float = 30.0,
) -> None:
    """Run ``factory()`` until it returns or ``stop`` is set, starting it again after
    a backoff whenever it raises (see the module docstring). Cancellation ends it."""
    loop = asyncio.get_running_loop()
    delay = first_delay_s
    failing = False
    while stop is None or not stop.is_set():
        started = loop.time()
        try:
            await factory()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if loop.time() - started >= healthy_after_s:
                delay, failing = first_delay_s, False
            if not failing:
                log.warning("task_failed_restarting", task=name, error=repr(exc), delay_s=delay)
                failing = True
        if stop is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        else:
            await asyncio.sleep(delay)
        delay = min(max_delay_s, delay * 2)

"""Small helpers for reading a simulation's log in tests."""

from __future__ import annotations

from typing import TypeVar

from shoal.sim.log import InMemoryLog

E = TypeVar("E")


def events_of(log: InMemoryLog, kind: type[E]) -> list[tuple[float, E]]:
    """``(occurred-at, event)`` for every event of ``kind`` in the log, in order."""
    return [(env.at, env.event) for env in log.envelopes if isinstance(env.event, kind)]

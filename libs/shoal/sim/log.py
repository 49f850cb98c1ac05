"""The simulator's in-memory event log and virtual clock.

Every state change of a simulation is an event appended here and folded with
:func:`shoal.state.apply`, exactly as the services fold the JetStream stream. The log
can keep its envelopes (tests replay them through :func:`shoal.state.fold`) or only
count them (``retain=False``, for traces with tens of thousands of jobs).

Envelope ids are ``sim-<seq>`` (deterministic, so two runs with one seed produce
byte-identical logs); ``at`` is virtual seconds.
"""

from __future__ import annotations

from collections import Counter

from shoal.codec import wrap
from shoal.events import Envelope, Event
from shoal.state import ClusterState, apply, apply_event


class VirtualClock:
    """A clock the simulator moves; services use wall-clock time instead."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, to: float) -> None:
        """Move forward to ``to``.

        Raises:
            ValueError: ``to`` is in the past.
        """
        if to < self.now:
            raise ValueError(f"virtual time cannot go back from {self.now} to {to}")
        self.now = to


class InMemoryLog:
    """Append-only event log that folds each event into a state as it is appended.

    With ``retain=False`` nothing reads an envelope, so none is made: the event is
    folded with :func:`shoal.state.apply_event` at the same time (what
    :func:`shoal.state.apply` does with an envelope's ``at``) and only counted.
    """

    def __init__(self, state: ClusterState | None = None, *, retain: bool = True) -> None:
        self.state = ClusterState() if state is None else state
        self.retain = retain
        self.envelopes: list[Envelope] = []
        self._counts: dict[type, int] = {}
        self.seq = 0

    @property
    def counts(self) -> Counter[str]:
        """Events appended so far, by tag (in order of each tag's first event)."""
        return Counter({type_tag(t): n for t, n in self._counts.items()})

    def append(self, event: Event, at: float, *, causation_id: str | None = None) -> Envelope | None:
        """Fold, count and (when retaining) wrap and keep one event.

        Args:
            event: the fact.
            at: virtual occurred-at time.
            causation_id: id of the envelope that caused it.

        Returns:
            The envelope, or ``None`` when the log does not retain envelopes.
        """
        self.seq += 1
        counts = self._counts
        cls = type(event)
        counts[cls] = counts.get(cls, 0) + 1
        if not self.retain:
            apply_event(self.state, event, at)
            return None
        env = wrap(event, at=at, event_id=f"sim-{self.seq:010d}", causation_id=causation_id)
        apply(self.state, env)
        self.envelopes.append(env)
        return env

    def __len__(self) -> int:
        return self.seq


def type_tag(cls: type) -> str:
    """The dotted tag of an event class."""
    return cls.__struct_config__.tag  # type: ignore[attr-defined,no-any-return]

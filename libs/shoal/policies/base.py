"""The policy interface: a pure function from a cluster view to a decision.

A policy never touches the bus, the clock or shared state. It receives a frozen
:class:`ClusterView` plus the ``memory`` it returned last time (stride passes,
lease counters, queues …) and returns a :class:`Decision`. The allocator records
``Decision.memory`` in ``SharesDecided.policy_memory``, so a replayed allocator
(or the simulator, which uses the same log) decides exactly what the live one did.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Protocol, overload

from msgspec import Struct


class JobView(Struct, frozen=True, kw_only=True):
    """What a policy may know about one active job."""

    job_id: str
    user: str = ""
    arrival_s: float = 0.0
    min_gpus: int = 1
    max_gpus: int = 1
    requested_gpus: int = 1
    elastic: bool = True
    allowed_gpu_counts: tuple[int, ...] | None = None
    throughput: tuple[float, ...] = (0.0, 1.0)
    """Iterations/s with k GPUs at index k (index 0 is 0.0); its length is at least
    ``max_gpus + 1``. On a heterogeneous cluster, the curve of the default type."""
    throughput_by_type: dict[str, tuple[float, ...]] = {}
    """Per-GPU-generation curves (heterogeneous clusters)."""
    remaining_iterations: float | None = None
    """Known remaining work; ``None`` when the length is unknown. Length-unaware
    policies (AFS-P, Tiresias, Max-Min, Gandiva_fair) must not read it."""
    total_iterations: float | None = None
    iterations_done: float = 0.0
    attained_service_gpu_s: float = 0.0
    """GPU-seconds allocated so far (since the job's last restart for Tiresias)."""
    current_gpus: int = 0
    current_gpu_type: str = ""
    pinned_gpu_type: str | None = None
    priority: int = 0


class LiveJobs(Sequence[JobView]):
    """The jobs of a simulator's :class:`ClusterView`: a read-only sequence over the
    simulator's own table of job views (job id -> view, in the view's order) instead of
    a tuple copied from it at every decision. In a long queue that copy, and freeing the
    previous one, grew with the queue at every decision, and was most of the engine's
    cost of a decision when the policy itself looks at few jobs.

    It is valid while the table is unchanged: the simulator calls :meth:`expire` before
    it next changes the table (its next event or decision), after which any use raises
    ``RuntimeError`` rather than show later jobs. ``tuple(view.jobs)`` keeps a copy.
    Iteration and ``len`` read the table directly; indexing builds a tuple once.

    The simulator may also say which entries it rebuilt since the sequence before
    (:meth:`rebuilt_since`), and which jobs left the table since then
    (:meth:`left_since`), so that a policy that keeps something per job from one
    decision to the next finds the changed ones without a pass over a long queue.
    """

    __slots__ = ("_after", "_left", "_live", "_rebuilt", "_table", "_tuple", "serial")

    def __init__(
        self,
        table: Mapping[str, JobView],
        *,
        serial: int = 0,
        after: int = 0,
        rebuilt: Collection[str] | None = None,
        left: Collection[str] | None = None,
    ) -> None:
        self._table = table
        self._live = True
        self._tuple: tuple[JobView, ...] | None = None
        self.serial = serial
        """Names this sequence for :meth:`rebuilt_since` (0: unnamed; the simulator
        numbers its sequences from a counter shared by every simulator in the process)."""
        self._after = after
        self._rebuilt = rebuilt
        self._left = left

    def rebuilt_since(self, serial: int) -> Collection[str] | None:
        """The ids of this sequence's jobs whose view may not be the very object it was
        in the sequence numbered ``serial`` (a job that was not in it counts as rebuilt),
        when that is the sequence immediately before this one over the same table and
        the simulator recorded them; ``None`` when unknown (then any job may differ).
        The ids may include jobs no longer in the table. Valid while this sequence is."""
        self._check()
        if serial and serial == self._after:
            return self._rebuilt
        return None

    def left_since(self, serial: int) -> Collection[str] | None:
        """The ids of the jobs removed from the table since the sequence numbered
        ``serial`` (a job of that sequence not among them is still in this one), when
        that is the sequence immediately before this one over the same table and the
        simulator recorded them; ``None`` when unknown. Valid while this sequence is."""
        self._check()
        if serial and serial == self._after:
            return self._left
        return None

    def expire(self) -> None:
        """The table is about to change: this sequence may no longer be read."""
        self._live = False
        self._tuple = None

    def _check(self) -> None:
        if not self._live:
            raise RuntimeError(
                "a simulator's view was used after the simulator moved on; copy view.jobs to keep it"
            )

    def __iter__(self) -> Iterator[JobView]:
        if not self._live:
            self._check()
        return iter(self._table.values())

    def __reversed__(self) -> Iterator[JobView]:
        self._check()
        return reversed(self._table.values())  # type: ignore[call-overload]  # dict values are reversible

    def __len__(self) -> int:
        if not self._live:
            self._check()
        return len(self._table)

    @overload
    def __getitem__(self, i: int) -> JobView: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[JobView, ...]: ...
    def __getitem__(self, i: int | slice) -> JobView | tuple[JobView, ...]:
        self._check()
        if self._tuple is None:
            self._tuple = tuple(self._table.values())
        return self._tuple[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LiveJobs | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable table: not hashable

    def __repr__(self) -> str:
        return f"LiveJobs({tuple(self)!r})" if self._live else "LiveJobs(<expired>)"


class ClusterView(Struct, frozen=True, kw_only=True):
    """The cluster as a policy sees it."""

    now_s: float
    total_gpus: int
    jobs: Sequence[JobView]
    """The active jobs: a tuple, or in the simulator a :class:`LiveJobs` (valid for the
    decision it was built for). Read it as a sequence; copy it to keep it."""
    gpus_by_type: dict[str, int] = {}
    """Free-of-placement GPU inventory per generation (empty on a homogeneous cluster)."""
    gpus_per_node: int = 0
    """0 when the cluster is a flat pool."""
    user_tickets: dict[str, float] = {}
    arrival_ordered: bool = False
    """``jobs`` is already in arrival order (earlier ``arrival_s``, then smaller
    ``job_id``), so policies need not sort it (the simulator keeps its view so; a long
    queue made that sort a large part of each decision). Set it only when it holds."""


class Decision(Struct, frozen=True, kw_only=True):
    """GPUs per job. Jobs absent from ``shares`` get 0."""

    shares: dict[str, int]
    gpu_types: dict[str, str] = {}
    memory: dict[str, Any] = {}


class Policy(Protocol):
    """Every allocation policy has a name, says whether it is elastic, and has a pure ``decide``."""

    name: str
    elastic: bool
    """Whether the policy's shares may be regulated (network packing, AFS appendix E):
    True for the elastic policies, whose jobs run at whatever feasible count they are
    given; False for the rigid ones (the all-or-nothing baselines and Gandiva_fair's
    gangs), whose every share is a job's whole request or nothing and is published
    unchanged. :func:`policy_is_elastic` reads it (absent: False)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision: ...


def policy_is_elastic(policy: object) -> bool:
    """``policy.elastic`` when it is a bool, else False: a policy that does not say it
    is elastic keeps its sizes (see :attr:`Policy.elastic`)."""
    value = getattr(policy, "elastic", False)
    return value if isinstance(value, bool) else False


def policy_reads_progress(policy: object) -> bool:
    """``policy.reads_progress`` when it is a bool, else True.

    A policy may set ``reads_progress = False`` when its ``decide`` never reads the
    fields of a :class:`JobView` that move with time alone (``iterations_done``,
    ``remaining_iterations``, ``attained_service_gpu_s``): the simulator then leaves a
    running job's view as it was built at the newest event about the job instead of
    carrying it to every decision's instant. A test
    (``tests/sim/test_engine.py::test_a_policy_that_reads_no_progress_decides_the_same_given_it``)
    runs every policy that declares False both ways and requires the same result.
    """
    value = getattr(policy, "reads_progress", True)
    return value if isinstance(value, bool) else True


def feasible_counts(job: JobView) -> tuple[int, ...]:
    """The positive GPU counts this job may be given, in increasing order.

    Non-elastic jobs get exactly ``requested_gpus``; elastic jobs anything in
    ``[min_gpus, max_gpus]`` that ``allowed_gpu_counts`` (when set) permits.
    """
    allowed = job.allowed_gpu_counts
    if allowed is not None and not isinstance(allowed, tuple):
        allowed = tuple(allowed)  # a hand-built view may pass a list
    return _feasible_counts(job.elastic, job.requested_gpus, job.min_gpus, job.max_gpus, allowed)


def share_is_feasible(job: JobView, gpus: int) -> bool:
    """Whether the positive share ``gpus`` is one of :func:`feasible_counts` of ``job``,
    decided without building the counts in the two common shapes."""
    if not job.elastic:
        return gpus == job.requested_gpus
    if not job.allowed_gpu_counts:
        return job.min_gpus <= gpus <= job.max_gpus
    return gpus in feasible_counts(job)


@functools.lru_cache(maxsize=4096)
def _feasible_counts(
    elastic: bool, requested: int, min_gpus: int, max_gpus: int, allowed_gpu_counts: tuple[int, ...] | None
) -> tuple[int, ...]:
    """:func:`feasible_counts` of the fields it reads (memoised: a decision asks for
    every job's counts several times, and most jobs share a few shapes)."""
    if not elastic:
        return (requested,)
    counts = range(min_gpus, max_gpus + 1)
    if allowed_gpu_counts:
        allowed = set(allowed_gpu_counts)
        return tuple(c for c in counts if c in allowed)
    return tuple(counts)


_last_index: tuple[ClusterView, dict[str, JobView]] | None = None
_JOB_ID = operator.attrgetter("job_id")


def prime_jobs_by_id(view: ClusterView, index: dict[str, JobView]) -> None:
    """Give :func:`jobs_by_id` the index of ``view`` that the caller already holds.

    ``index`` must map every job of ``view`` to it, in order, and must not change while
    ``view`` is in use (the simulator primes its own index at each decision)."""
    global _last_index
    _last_index = (view, index)


def jobs_by_id(view: ClusterView) -> dict[str, JobView]:
    """job id -> job of ``view`` (the last view's index is reused: the allocator checks
    and packs each decision against the same view several times). Do not mutate it."""
    global _last_index
    last = _last_index
    if last is not None and last[0] is view:
        return last[1]
    index = dict(zip(map(_JOB_ID, view.jobs), view.jobs, strict=True))
    _last_index = (view, index)
    return index


class DecisionError(ValueError):
    """A decision that breaks an invariant (a policy bug, never user input)."""


def check_decision(view: ClusterView, decision: Decision) -> None:
    """Raise :class:`DecisionError` unless the decision respects every job's
    feasible counts and gives out no more GPUs than exist."""
    jobs = jobs_by_id(view)
    total = 0
    for job_id, gpus in decision.shares.items():
        job = jobs.get(job_id)
        if job is None:
            raise DecisionError(f"share for unknown job {job_id!r}")
        if gpus > 0:
            # share_is_feasible, inlined (a call per share per decision was a measurable
            # part of a long run): the same tests.
            if not job.elastic:
                feasible = gpus == job.requested_gpus
            elif not job.allowed_gpu_counts:
                feasible = job.min_gpus <= gpus <= job.max_gpus
            else:
                feasible = gpus in feasible_counts(job)
            if not feasible:
                raise DecisionError(f"{job_id!r} given {gpus} GPUs, feasible {feasible_counts(job)}")
            total += gpus
        elif gpus < 0:
            raise DecisionError(f"negative share {gpus} for {job_id!r}")
    if total > view.total_gpus:
        raise DecisionError(f"gave out {total} GPUs of {view.total_gpus}")
    if view.gpus_by_type and decision.gpu_types:
        used: dict[str, int] = {}
        for job_id, gpus in decision.shares.items():
            if gpus:
                t = decision.gpu_types.get(job_id, "")
                used[t] = used.get(t, 0) + gpus
        for t, n in used.items():
            if n > view.gpus_by_type.get(t, 0):
                raise DecisionError(f"gave out {n} {t or '<untyped>'} GPUs of {view.gpus_by_type.get(t, 0)}")

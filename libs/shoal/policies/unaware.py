"""Length-unaware variants of length-aware policies, for experiments.

AFS §5.1 counts Themis among the job-length-unaware algorithms (with Tiresias-L,
Max-Min and AFS-P), but finish-time fairness needs each job's remaining work, and
``themis`` uses the job's length when the view has one. Told exact lengths, it is ahead
of AFS-P on the heavily loaded Philly VCs (0e4a51, 6c71a0, b436b2, 6214e9, 7f04ca,
ee9e8c: six of the eleven), outside the paper's range. A variant that is the same
policy shown no lengths is Themis as §5.1 classifies it, and answers whether length
knowledge is why, without touching the policy itself.

:class:`LengthUnaware` wraps a policy and hides every job's ``remaining_iterations``
and ``total_iterations`` (both ``None``, "unknown") from it; everything else in the
view, the memory and the decision passes through unchanged. What the wrapped policy
does with unknown lengths is its own documented rule: Themis takes a job of unknown
length to need as much again as it has done (at least one lease at one GPU), see
:mod:`shoal.policies.themis`.

Registered variant: ``themis-unaware`` (:class:`ThemisLengthUnaware`), with the same
parameters as ``themis``. It does not wrap Themis in :class:`LengthUnaware`: it clears
Themis' ``reads_lengths``, so Themis never reads the lengths the view has, and decides
as Themis shown the blind view would (the same rule for every length) without copying
each changed job's view at every decision, which was a fifth of a decision's cost in a
long queue.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import msgspec

from shoal.policies.base import ClusterView, Decision, JobView, Policy, policy_is_elastic
from shoal.policies.themis import Themis


class LengthUnaware:
    """``inner`` shown views without job lengths (see the module docstring)."""

    def __init__(self, inner: Policy, name: str) -> None:
        self.inner = inner
        self.name = name
        self.elastic = policy_is_elastic(inner)
        tick = getattr(inner, "tick_s", None)
        if tick is not None:
            self.tick_s = tick  # a re-run grid (Themis' lease_grid) is the inner policy's
        self._blind: dict[str, tuple[JobView, JobView]] = {}
        """job id -> (its last view, that view without lengths): a job whose view did
        not change is shown the same object again (the inner policy may keep per-job
        work by view identity, as Themis does)."""

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """The inner policy's decision on ``view`` with every length unknown."""
        before, blind = self._blind, {}
        jobs = []
        for job in view.jobs:
            hit = before.get(job.job_id)
            if hit is None or hit[0] is not job:
                shown = job
                if job.remaining_iterations is not None or job.total_iterations is not None:
                    shown = msgspec.structs.replace(job, remaining_iterations=None, total_iterations=None)
                hit = (job, shown)
            blind[job.job_id] = hit
            jobs.append(hit[1])
        self._blind = blind
        return self.inner.decide(msgspec.structs.replace(view, jobs=tuple(jobs)), memory)


class ThemisLengthUnaware:
    """Themis (:class:`~shoal.policies.themis.Themis`, same parameters) without lengths:
    its ``reads_lengths`` cleared (module docstring)."""

    __signature__ = inspect.signature(Themis)  # the registry checks parameters against it
    name = "themis-unaware"

    def __init__(self, **params: Any) -> None:
        self.inner = Themis(**params)
        self.inner.reads_lengths = False
        self.elastic = policy_is_elastic(self.inner)
        tick = getattr(self.inner, "tick_s", None)
        if tick is not None:
            self.tick_s = tick  # a re-run grid (Themis' lease_grid) is the inner policy's

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Themis' decision on ``view``, every length taken as unknown."""
        return self.inner.decide(view, memory)

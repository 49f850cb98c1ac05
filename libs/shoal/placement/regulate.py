"""Network packing: regulate GPU shares so they always pack onto nodes.

AFS/CoDDL §4.4 and appendix E. With ``G`` GPUs per node, a share is *regulated* when
it is 0, a power of two below ``G`` that divides ``G``, or a multiple of ``G``.
Proposition 1: any multiset of regulated shares whose sum fits ``m`` nodes of ``G``
GPUs packs with every sub-node share on one node and every multi-node share on
whole nodes (sizes form a divisibility chain, so first-fit-decreasing is exact).
Proposition 2: rounding each share ``s_i`` down to ``x_i`` (the largest regulated
size ``<= s_i``) and handing the freed GPUs back one regulated step at a time gives
the same total when ``sum(s_i) = m·G``, with ``r_i >= x_i`` for every job.

Choices where the paper is silent (documented here, tested in tests/placement):

* ``G`` that is not a power of two (e.g. 6): the sub-node sizes are the powers of
  two that divide ``G`` (1, 2 for ``G = 6``), which keeps the divisibility chain and
  with it Proposition 1. Proposition 2's exact total then no longer holds.
  ``G <= 1`` (a flat pool, ``ClusterView.gpus_per_node == 0``) regulates nothing.
* Feasible counts: a job's regulated share must also be one of its ``feasible``
  counts. It is rounded down to the largest size that is both regulated and
  feasible; if there is none at or below its share it gets **0** (for example a
  non-elastic 3-GPU job on 4-GPU nodes), unless ``keep_unregulable=True``, which lets
  such a job keep its largest feasible count up to its share (unregulated). The
  allocator (:func:`shoal.allocation.pack_shares`) passes ``keep_unregulable=True``,
  so a rigid gang under an elastic policy is not starved for ever; rigid policies are
  not regulated at all (:attr:`shoal.policies.base.Policy.elastic`). A job missing
  from ``feasible`` may take any count.
* ``total_gpus``: if the rounded shares still exceed it (the caller gave out more
  than exists), the largest share steps down one regulated-feasible size at a time
  (ties: smaller job id first) until they fit.
* Redistribution (Prop. 2's proof, made deterministic): the freed GPUs
  ``d = min(sum(s), total_gpus) - sum(r)`` go, one regulated step at a time, to the
  job furthest below its planned share (largest ``s_i - r_i``; ties: the smaller
  step, then job id), among jobs whose next regulated-feasible size fits in ``d``.
  A step is ``2^l -> 2^(l+1)`` below a node, ``+G`` at or above one, or the next
  regulated size the job's feasible counts allow. A job may end above its planned
  share, as Proposition 2 allows; a job planned at 0 never gets GPUs.
* Heterogeneous clusters: call once per GPU type with that type's node size and
  GPU count.
"""

from __future__ import annotations

import functools
import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping


def sub_node_sizes(gpus_per_node: int) -> tuple[int, ...]:
    """The regulated sizes below one node: powers of two dividing ``gpus_per_node``.

    Args:
        gpus_per_node: GPUs per node ``G``.

    Returns:
        ``(1, 2, 4, …)`` below ``G``, increasing; ``()`` when ``G <= 1``.
    """
    sizes: list[int] = []
    p = 1
    while p < gpus_per_node and gpus_per_node % p == 0:
        sizes.append(p)
        p *= 2
    return tuple(sizes)


def is_regulated(size: int, gpus_per_node: int) -> bool:
    """Whether ``size`` obeys network packing on nodes of ``gpus_per_node`` GPUs.

    Args:
        size: A GPU share.
        gpus_per_node: GPUs per node ``G``; ``<= 1`` means no regulation.

    Returns:
        True for 0, a sub-node size of :func:`sub_node_sizes`, or a multiple of ``G``.
    """
    if size < 0:
        return False
    if size == 0 or gpus_per_node <= 1:
        return True
    return size % gpus_per_node == 0 or size in sub_node_sizes(gpus_per_node)


def regulated_floor(share: int, gpus_per_node: int) -> int:
    """Appendix E's ``x_i``: the largest regulated size not above ``share``.

    Args:
        share: The planned share ``s_i >= 0``.
        gpus_per_node: GPUs per node ``G``.

    Returns:
        ``floor(s/G)·G`` when ``s >= G``, else the largest sub-node size ``<= s`` (0 for 0).
    """
    if share <= 0:
        return 0
    if gpus_per_node <= 1:
        return share
    if share >= gpus_per_node:
        return share // gpus_per_node * gpus_per_node
    return max((p for p in sub_node_sizes(gpus_per_node) if p <= share), default=0)


class _Feasible:
    """Membership in a job's feasible counts without building a set per job."""

    __slots__ = ("counts", "hi", "lo", "span")

    def __init__(self, counts: tuple[int, ...] | None, limit: int) -> None:
        if counts is None:
            self.counts: tuple[int, ...] = ()
            self.lo, self.hi, self.span = 1, limit, True
            return
        c = tuple(sorted({x for x in counts if 0 < x <= limit}))
        self.counts = c
        self.lo, self.hi = (c[0], c[-1]) if c else (1, 0)
        self.span = bool(c) and c[-1] - c[0] + 1 == len(c)

    def __contains__(self, x: int) -> bool:
        if x < self.lo or x > self.hi:
            return False
        if self.span:
            return True
        i = bisect_left(self.counts, x)
        return i < len(self.counts) and self.counts[i] == x

    def has_between(self, lo: int, hi: int) -> bool:
        """Whether any feasible count lies in ``[lo, hi]``."""
        lo, hi = max(lo, self.lo), min(hi, self.hi)
        if lo > hi:
            return False
        if self.span:
            return True
        return bisect_right(self.counts, hi) > bisect_left(self.counts, lo)


@functools.lru_cache(maxsize=4096)
def _feasible_cached(counts: tuple[int, ...] | None, limit: int) -> _Feasible:
    return _Feasible(counts, limit)


def _feasible_of(counts: tuple[int, ...] | None, limit: int) -> _Feasible:
    """A (shared, never mutated) :class:`_Feasible`: most jobs have one of a few shapes,
    so regulating every decision would otherwise rebuild the same ones."""
    try:
        return _feasible_cached(counts, limit)
    except TypeError:  # unhashable counts (a list): build it
        return _Feasible(counts, limit)


def _sizes_down(start: int, g: int, subs: tuple[int, ...]) -> Iterator[int]:
    """Regulated sizes ``<= start``, decreasing (``g <= 1``: every size)."""
    if g <= 1:
        yield from range(start, 0, -1)
        return
    k = start // g
    while k >= 1:
        yield k * g
        k -= 1
    for p in reversed(subs):
        if p <= start:
            yield p


def _sizes_up(after: int, g: int, subs: tuple[int, ...], limit: int) -> Iterator[int]:
    """Regulated sizes ``> after`` and ``<= limit``, increasing."""
    if g <= 1:
        yield from range(after + 1, limit + 1)
        return
    for p in subs:
        if after < p <= limit:
            yield p
    k = max(after // g + 1, 1)
    while k * g <= limit:
        yield k * g
        k += 1


def _next_down(r: int, feas: _Feasible, g: int, subs: tuple[int, ...]) -> int:
    for x in _sizes_down(r - 1, g, subs):
        if x in feas:
            return x
    return 0


def _next_up(r: int, feas: _Feasible, g: int, subs: tuple[int, ...], limit: int) -> int | None:
    limit = min(limit, feas.hi)
    for x in _sizes_up(r, g, subs, limit):
        if x in feas:
            return x
    return None


def regulate_shares(
    shares: Mapping[str, int],
    feasible: Mapping[str, tuple[int, ...]],
    gpus_per_node: int,
    total_gpus: int,
    *,
    keep_unregulable: bool = False,
) -> dict[str, int]:
    """Apply AFS network packing (appendix E) to planned shares.

    Args:
        shares: job id -> planned GPUs ``s_i`` (from the allocation policy).
        feasible: job id -> allowed positive GPU counts; a job not listed may take any.
        gpus_per_node: GPUs per node ``G`` (``<= 1``: flat pool, no regulation).
        total_gpus: GPUs that exist; the result never sums above it.
        keep_unregulable: A job none of whose feasible counts up to its share is
            regulated (a rigid 3-GPU job on 4-GPU nodes) keeps the largest feasible
            count up to its share instead of 0. Such a job escapes Proposition 1: the
            placer packs it when it can and splits it otherwise. Default off (the paper);
            the allocator turns it on (:func:`shoal.allocation.pack_shares`).

    Returns:
        job id -> regulated share ``r_i`` (every job of ``shares``, possibly 0).

    Raises:
        ValueError: On a negative share or negative ``total_gpus``.
    """
    if total_gpus < 0:
        raise ValueError(f"negative total_gpus {total_gpus}")
    g = gpus_per_node
    subs = sub_node_sizes(g)
    sub_set = frozenset(subs)
    feas: dict[str, _Feasible] = {}
    regulated: dict[str, int] = {}
    planned = 0
    for job, s in shares.items():
        if s < 0:
            raise ValueError(f"negative share {s} for {job!r}")
        planned += s
        f = feas[job] = _feasible_of(feasible.get(job), total_gpus)
        r = 0
        if 0 < s <= total_gpus and (g <= 1 or s in sub_set or s % g == 0) and s in f:
            r = s  # already regulated and feasible: the first size the loop below tries
        elif s > 0:
            # AFS appendix E, Proposition 2: x_i, restricted to the job's feasible counts.
            for x in _sizes_down(min(s, total_gpus), g, subs):
                if x in f:
                    r = x
                    break
            if r == 0 and keep_unregulable:
                r = next((x for x in range(min(s, total_gpus), 0, -1) if x in f), 0)
        regulated[job] = r

    used = sum(regulated.values())
    if used > total_gpus:
        # Over-subscribed input: shave the largest shares first.
        over = [(-r, job) for job, r in regulated.items() if r > 0]
        heapq.heapify(over)
        while used > total_gpus and over:
            _, job = heapq.heappop(over)
            r = regulated[job]
            lower = _next_down(r, feas[job], g, subs)
            regulated[job] = lower
            used -= r - lower
            if lower > 0:
                heapq.heappush(over, (-lower, job))

    # AFS appendix E, proof of Proposition 2: hand the freed GPUs back in regulated steps.
    spare = min(planned, total_gpus) - used
    if spare <= 0:
        return regulated
    heap: list[tuple[int, int, str]] = []
    for job, s in shares.items():
        if s > 0:
            _push_step(heap, job, s, regulated[job], feas[job], g, subs, regulated[job] + spare)
    while heap and spare > 0:
        _, step, job = heapq.heappop(heap)
        if step > spare:
            continue  # spare only shrinks, so this step never fits again
        regulated[job] += step
        spare -= step
        _push_step(heap, job, shares[job], regulated[job], feas[job], g, subs, regulated[job] + spare)
    return regulated


def _push_step(
    heap: list[tuple[int, int, str]],
    job: str,
    planned: int,
    r: int,
    feas: _Feasible,
    g: int,
    subs: tuple[int, ...],
    limit: int,
) -> None:
    nxt = _next_up(r, feas, g, subs, limit)
    if nxt is not None:
        # Most under-served first (largest s_i - r_i), then the smaller step, then job id.
        heapq.heappush(heap, (-(planned - r), nxt - r, job))

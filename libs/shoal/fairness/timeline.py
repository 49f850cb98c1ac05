"""Per-user allocation timelines from a simulation's event log, and fairness metrics.

The simulator's log (:class:`shoal.sim.log.InMemoryLog` with ``retain=True``) is
read back event by event: ``NodeRegistered`` gives each GPU's generation,
``UserRegistered``/``TicketsSet`` the tickets, ``JobSubmitted``/``JobCompleted``
the active jobs, and ``SharesDecided``/``PlacementDecided`` what each job
holds. The result is a piecewise-constant timeline per user.

Definitions (choices; the papers plot these quantities but do not define them as metrics):

- **Held GPUs.** With placements (a simulated topology), a job holds the GPUs
  of its newest ``PlacementDecided``. A job the placer could not place holds
  none. On a flat pool it holds its ``SharesDecided`` share. Its generation is
  ``SharesDecided.gpu_types`` when the policy chose one, else the generation of
  its placed GPUs. If these span generations, the slowest one counts, because
  a synchronous gang runs at the pace of its slowest GPU.
- **Normalised rate** (Gandiva_fair Table 3, Figure 8): a job on k GPUs of
  generation g progresses at ``k · thr_g(k) / thr_k80(k)`` normalised K80s
  (:func:`shoal.fairness.workloads.normalised_k80`); the slowest generation
  stands in for ``k80`` when the cluster has none. Reconfiguration stops
  (at most 0.25 s each here) are not subtracted.
- **Fair share** (Gandiva_fair §2.1, §3.2): the ticket-weighted water-filling of
  the cluster's GPUs over the active users, each capped by its demand, the sum of
  its active jobs' requested GPUs (:func:`shoal.fairness.shares.fair_shares`).
  The per-generation *entitlement* fills generations newest first
  (:func:`shoal.fairness.shares.fair_shares_newest_first`, §3.4). The
  *entitled rate* is that entitlement times the user's per-GPU normalised speed
  on each generation, averaged over its active jobs weighted by GPUs.
- **Share deviation**: ``|held GPUs − fair share| / cluster GPUs``, averaged
  over the time the user is active (on window means, see :func:`user_fairness`).
  **Shortfall** counts only the part below the fair share: holding more than
  the fair share while nobody else wants the GPUs is not unfair.
  ``progress_ratio`` is the received normalised progress divided by the
  entitled one, over the same time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from shoal import events as ev
from shoal.fairness.hetero import generation_order
from shoal.fairness.shares import fair_shares, fair_shares_newest_first
from shoal.fairness.workloads import normalised_k80

DEFAULT_TICKETS = 100.0


class Timeline(Struct, kw_only=True):
    """Piecewise-constant per-user quantities; segment i spans ``[t[i], t[i+1])``."""

    t: list[float]
    end: float
    users: list[str]
    gens: list[str]
    """Generations, newest first (``[""]`` on an untyped cluster)."""
    total_gpus: int
    held: dict[str, list[float]]
    held_by_gen: dict[str, dict[str, list[float]]]
    rate: dict[str, list[float]]
    fair: dict[str, list[float]]
    entitled: dict[str, dict[str, list[float]]]
    entitled_rate: dict[str, list[float]]
    active: dict[str, list[bool]]

    def durations(self) -> list[float]:
        """Length of each segment."""
        return [(self.t[i + 1] if i + 1 < len(self.t) else self.end) - t0 for i, t0 in enumerate(self.t)]

    def integral(self, series: Sequence[float], start: float = 0.0, stop: float | None = None) -> float:
        """∫ series dt over ``[start, stop]`` (default: the whole timeline)."""
        stop = self.end if stop is None else stop
        total = 0.0
        for i, t0 in enumerate(self.t):
            t1 = self.t[i + 1] if i + 1 < len(self.t) else self.end
            lo, hi = max(t0, start), min(t1, stop)
            if hi > lo:
                total += series[i] * (hi - lo)
        return total

    def at(self, series: Sequence[float], times: Iterable[float]) -> list[float]:
        """The value in force at each of ``times`` (for plots)."""
        out = []
        i = 0
        for t in times:
            while i + 1 < len(self.t) and self.t[i + 1] <= t:
                i += 1
            out.append(series[i] if self.t and self.t[0] <= t else 0.0)
        return out


def _job_gen(
    job: str,
    gpu_types: Mapping[str, str],
    placed: Sequence[ev.GpuRef] | None,
    gpu_gen: Mapping[tuple[str, int], str],
    gens: Sequence[str],
) -> str:
    if gpu_types.get(job):
        return gpu_types[job]
    if placed:
        kinds = {gpu_gen.get((g.node_id, g.index), gens[-1]) for g in placed}
        return max(kinds, key=gens.index)  # slowest generation paces the gang
    return gens[-1] if len(gens) == 1 else ""


def build_timeline(
    envelopes: Iterable[ev.Envelope],
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    end: float | None = None,
    default_tickets: float = DEFAULT_TICKETS,
) -> Timeline:
    """Read a simulation log into a per-user :class:`Timeline`.

    Args:
        envelopes: The log, in order.
        curves: Job id -> generation -> throughput curve (the workload's
            ``throughput_by_type``; ``{"": throughput}`` on an untyped cluster).
        end: End of the last segment (default: the last event's time).
        default_tickets: Tickets of users never registered.

    Returns:
        The timeline.
    """
    gpu_gen: dict[tuple[str, int], str] = {}
    tickets: dict[str, float] = {}
    owner: dict[str, str] = {}
    size: dict[str, int] = {}
    active: dict[str, None] = {}
    shares: dict[str, int] = {}
    gpu_types: dict[str, str] = {}
    placements: dict[str, tuple[ev.GpuRef, ...]] | None = None
    snapshots: list[tuple[float, dict[str, dict[str, float]], dict[str, float], dict[str, list[str]]]] = []
    gens: list[str] = [""]
    last_t: float | None = None

    def snapshot(t: float) -> None:
        held: dict[str, dict[str, float]] = {}
        rate: dict[str, float] = {}
        jobs_of: dict[str, list[str]] = {}
        for j in active:
            jobs_of.setdefault(owner[j], []).append(j)
            if placements is not None:
                refs = placements.get(j, ())
                k = len(refs)
                gen = _job_gen(j, gpu_types, refs, gpu_gen, gens)
            else:
                k = shares.get(j, 0)
                gen = _job_gen(j, gpu_types, None, gpu_gen, gens)
            if k <= 0:
                continue
            u = owner[j]
            held.setdefault(u, {})
            held[u][gen] = held[u].get(gen, 0.0) + k
            rate[u] = rate.get(u, 0.0) + _normalised(curves.get(j, {}), gen, k, gens)
        if snapshots and snapshots[-1][0] == t:
            snapshots[-1] = (t, held, rate, jobs_of)
        else:
            snapshots.append((t, held, rate, jobs_of))

    for env in envelopes:
        if last_t is not None and env.at > last_t:
            snapshot(last_t)
        last_t = env.at
        e = env.event
        if isinstance(e, ev.NodeRegistered):
            for info in e.gpus:
                gpu_gen[(e.node_id, info.index)] = info.gpu_type
            gens = list(generation_order(set(gpu_gen.values())))
        elif isinstance(e, ev.UserRegistered | ev.TicketsSet):
            tickets[e.user] = float(e.tickets)
        elif isinstance(e, ev.JobSubmitted):
            owner[e.job_id] = e.spec.user
            size[e.job_id] = e.spec.requested_gpus
            active[e.job_id] = None
        elif isinstance(e, ev.JobCompleted | ev.JobCancelled | ev.JobFailed):
            active.pop(e.job_id, None)
        elif isinstance(e, ev.SharesDecided):
            shares = dict(e.shares)
            gpu_types = dict(e.gpu_types)
        elif isinstance(e, ev.PlacementDecided):
            placements = dict(e.placements)
    if last_t is not None:
        snapshot(last_t)
    stop = end if end is not None else (last_t or 0.0)

    capacity: dict[str, float] = {}
    for g in gpu_gen.values():
        capacity[g] = capacity.get(g, 0.0) + 1.0
    total = int(sum(capacity.values()))
    users = sorted(set(owner.values()))
    tl = Timeline(
        t=[],
        end=stop,
        users=users,
        gens=gens,
        total_gpus=total,
        held={u: [] for u in users},
        held_by_gen={u: {g: [] for g in gens} for u in users},
        rate={u: [] for u in users},
        fair={u: [] for u in users},
        entitled={u: {g: [] for g in gens} for u in users},
        entitled_rate={u: [] for u in users},
        active={u: [] for u in users},
    )
    for t, held, rate, jobs_of in snapshots:
        demand = {u: float(sum(size[j] for j in js)) for u, js in jobs_of.items()}
        tix = {u: tickets.get(u, default_tickets) for u in demand}
        fair = fair_shares(tix, demand, total)
        ent = fair_shares_newest_first(tix, demand, capacity, gens)
        tl.t.append(t)
        for u in users:
            h = held.get(u, {})
            tl.held[u].append(sum(h.values()))
            for g in gens:
                tl.held_by_gen[u][g].append(h.get(g, 0.0))
                tl.entitled[u][g].append(ent.get(u, {}).get(g, 0.0))
            tl.rate[u].append(rate.get(u, 0.0))
            tl.fair[u].append(fair.get(u, 0.0))
            tl.active[u].append(u in jobs_of)
            speed = _per_gpu_speed(jobs_of.get(u, []), size, curves, gens)
            tl.entitled_rate[u].append(sum(ent.get(u, {}).get(g, 0.0) * speed.get(g, 0.0) for g in gens))
    return tl


def _normalised(curves: Mapping[str, Sequence[float]], gen: str, k: int, gens: Sequence[str]) -> float:
    if "k80" in curves or gens[-1] == "k80":
        return normalised_k80(curves, gen, k)
    slow = gens[-1]
    base, here = curves.get(slow, ()), curves.get(gen, ())
    if k <= 0 or k >= len(base) or k >= len(here) or base[k] <= 0:
        return 0.0
    return k * here[k] / base[k]


def _per_gpu_speed(
    jobs: Sequence[str],
    size: Mapping[str, int],
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    gens: Sequence[str],
) -> dict[str, float]:
    """GPU-weighted mean per-GPU normalised speed of ``jobs`` on each generation."""
    gpus = sum(size[j] for j in jobs)
    if gpus <= 0:
        return {}
    return {g: sum(_normalised(curves.get(j, {}), g, size[j], gens) for j in jobs) / gpus for g in gens}


class UserFairness(Struct, frozen=True, kw_only=True):
    """One user's fairness over its active time."""

    user: str
    active_s: float
    share_deviation: float
    """Time-averaged ``|held − fair| / cluster GPUs`` (window means) while active."""
    shortfall: float
    """Time-averaged ``max(0, fair − held) / cluster GPUs`` (window means) while active."""
    mean_share: float
    """Time-averaged held GPUs / fair share while active (1.0 = exactly fair)."""
    progress_k80_h: float
    """Received normalised progress, K80-hours."""
    entitled_k80_h: float
    """Progress at the untraded entitlement, K80-hours."""

    @property
    def progress_ratio(self) -> float:
        """Received / entitled normalised progress."""
        return self.progress_k80_h / self.entitled_k80_h if self.entitled_k80_h > 0 else 0.0


def windows(
    tl: Timeline, user: str, start: float = 0.0, stop: float | None = None, window_s: float = 600.0
) -> dict[int, tuple[float, float, float]]:
    """Window index -> (active seconds, ∫ held dt, ∫ fair dt) over the user's active time.

    Windows are ``[start + k·window_s, start + (k+1)·window_s)``; ``window_s = 0``
    makes every timeline segment its own window.
    """
    dur = tl.durations()
    stop = tl.end if stop is None else stop
    out: dict[int, list[float]] = {}
    for i, t0 in enumerate(tl.t):
        lo, hi = max(t0, start), min(t0 + dur[i], stop)
        if hi <= lo or not tl.active[user][i]:
            continue
        while lo < hi:
            w = int((lo - start) // window_s) if window_s > 0 else i
            edge = min(hi, start + (w + 1) * window_s) if window_s > 0 else hi
            span = edge - lo
            b = out.setdefault(w, [0.0, 0.0, 0.0])
            b[0] += span
            b[1] += tl.held[user][i] * span
            b[2] += tl.fair[user][i] * span
            lo = edge
    return {w: (b[0], b[1], b[2]) for w, b in sorted(out.items())}


def user_fairness(
    tl: Timeline, start: float = 0.0, stop: float | None = None, *, window_s: float = 600.0
) -> list[UserFairness]:
    """Per-user fairness metrics over ``[start, stop]`` (see the module docstring).

    A time-slicing scheduler gives a user all or nothing of a GPU in each quantum,
    so deviation and shortfall compare *window averages*: within each ``window_s``
    window the user's held GPUs and fair share are averaged over the time it is
    active, and ``|mean held − mean fair| / cluster GPUs`` (for the shortfall,
    ``max(0, mean fair − mean held) / cluster GPUs``) is weighted by that time.
    Gandiva_fair's figures plot shares averaged over minutes in the same way.
    ``window_s = 0`` compares instant by instant.
    """
    dur = tl.durations()
    stop = tl.end if stop is None else stop
    out = []
    for u in tl.users:
        per_window = windows(tl, u, start, stop, window_s)
        active_s = sum(b[0] for b in per_window.values())
        dev = sum(abs(b[1] - b[2]) for b in per_window.values()) / tl.total_gpus
        short = sum(max(0.0, b[2] - b[1]) for b in per_window.values()) / tl.total_gpus
        share = 0.0
        for i, t0 in enumerate(tl.t):
            lo, hi = max(t0, start), min(t0 + dur[i], stop)
            if hi > lo and tl.active[u][i] and tl.fair[u][i] > 0:
                share += tl.held[u][i] / tl.fair[u][i] * (hi - lo)
        out.append(
            UserFairness(
                user=u,
                active_s=active_s,
                share_deviation=dev / active_s if active_s else 0.0,
                shortfall=short / active_s if active_s else 0.0,
                mean_share=share / active_s if active_s else 0.0,
                progress_k80_h=tl.integral(tl.rate[u], start, stop) / 3600.0,
                entitled_k80_h=tl.integral(tl.entitled_rate[u], start, stop) / 3600.0,
            )
        )
    return out

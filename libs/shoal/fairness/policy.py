"""``GandivaFairPolicy``: Gandiva_fair behind the :class:`~shoal.policies.base.Policy` protocol.

One call to :meth:`GandivaFairPolicy.decide` decides who runs in the current time
quantum (§3.5: one/two minutes, default 60 s). Gandiva_fair time-slices whole
gangs: a job runs with exactly its size or not at all. Each quantum:

1. **Profiling** (§3.5): every job that ran since the last call and made progress
   gives a per-GPU rate sample for (user, generation); see :mod:`.hetero`.
2. **Entitlements** (§3.2, §3.4): per-generation fair shares by ticket-weighted
   water-filling, newest generation first, pinned demand on its own generation
   (:func:`.shares.fair_shares_newest_first`). Bonus shares are included. With
   ``spill=True`` the capacity that newest-first filling leaves unallocated also
   goes, per generation, to the users who could run jobs there
   (:func:`.shares.spill_leftover`), so gangs that cannot use fractions of several
   generations need not leave GPUs idle.
3. **Trading** (§3.4-3.5, heterogeneous clusters): on every call, trades no
   longer affordable or beneficial are undone; at quantum starts one
   second-price round runs (:mod:`.trader`).
   Holdings = entitlements + trades. Speedups come only from the policy's own
   measured profiles (step 1), never from the declared curves
   (``throughput_by_type``), so no user trades before it has been profiled on two
   generations. Only homogeneous users trade (§3.4: the paper limits trading to a
   user whose jobs are one job copied, a hyper-parameter sweep): one gang size, and
   the last measured per-GPU rates of its jobs within ``homogeneity_tolerance``
   (10 %) of each other on each generation
   (:func:`.trader.homogeneous_user`); ``homogeneous_only=False`` relaxes this and
   ranks any user by the mean of its jobs' samples. Users with a pinned job do not
   trade. A trade whose seller loses under the current profiles is undone.
4. **Generation** (Algorithm 2): jobs keep their generation while they fit the
   user's holding there; new jobs and jobs pushed out by a trade or a shrunken
   share are placed again (jobs follow traded GPUs); then at most one more job
   per quantum moves between generations when that gains (§3.5 "Migration").
5. **Placement** (§3.2-3.3): new (or moved) jobs go to the least ticket-loaded
   node(s) of their generation; then, at quantum starts, at most one balance move
   (eq. (2) ticket load per GPU) and a batch of up to node-size 1-GPU packing moves
   per generation (:func:`.balance.packing_migrations`). The nodes are real: the
   nodes of every scheduled job go out in ``node_hints`` (job -> ``<generation>#<i>``,
   the ``i``-th server of that generation), and the one placement step of the
   simulator and the placer service (:func:`shoal.allocation.place`) puts the job on
   those servers (:mod:`shoal.placement.hinted`), keeping the GPUs it holds there.
   A job on part of one server also has a slot there (``gpu_slots``: the position
   of its first GPU; it keeps it while it stays on the server, a new one overlaps
   the fewest other slots), and the placer gives it those GPUs when they are free.
   A suspended gang keeps its nodes and slot, so it resumes on the same servers, and
   on the same GPUs when they are free. A reported migration
   of a running job is a move to other servers; one of a suspended job takes effect
   when it next runs.
6. **Split stride** (§3.1) per generation (:mod:`.split_stride`), with
   ``tickets_per_gpu`` of a user on a generation = its holding there divided by
   the GPUs its jobs there need (eq. (1) on effective, post-trade tickets), and
   ``job_tickets`` by eq. (3).

Choices where the paper or the interface leave room:

- A job's size is ``requested_gpus`` when feasible, else the largest feasible
  count not above it, else the smallest feasible count.
- Users missing from ``ClusterView.user_tickets`` hold ``default_tickets`` (100,
  as ``UserRegistered``).
- Calls within one quantum (arrivals, completions) re-decide from the passes of
  the quantum's start, so churn never charges a quantum twice; profiling, new
  trades and migrations happen only at quantum starts (undoing trades does not
  wait).
- In the simulator a gang's suspend, resume and move cost what §4 measures for
  Gandiva_fair's own mechanism (:data:`SUSPEND_RESUME`, 0.25 s), not shoal's
  checkpoint-restart, unless the policy is given other ``costs``.
- A homogeneous cluster is one generation named ``""`` and ``gpu_types`` stays
  empty. ``gpus_per_node == 0`` makes each generation one node.
- Large-cluster cost: placing *n* new jobs is O(n × nodes).

``Decision.memory`` is plain msgpack-able data (str keys, floats, lists), so a
replay reproduces every decision: ``placement`` (job -> nodes named
``<generation>#<index>``, which also gives each job's generation), ``central``
and ``local`` passes (and their ``base_*`` copies from the quantum's start),
``profiles``, ``job_rates`` (each job's last measured per-GPU rate per generation),
``ran``/``ran_at`` (progress when last scheduled), ``slots`` (each single-node job's
GPU slot), ``trades``, ``trade_seq`` and ``entitlements`` (per-user holdings after
trades). It grows by about 70 bytes per job (4,000 1-, 2- and 4-GPU jobs of 20 users
on 1,024 GPUs after three quanta: about 310 KB of msgpack). Besides the state, it
carries what happened in this decision for the caller to publish: ``node_hints`` and
``gpu_slots`` of the scheduled jobs (above), ``trades_executed`` (fields of
:class:`~shoal.events.TradeExecuted`), ``trades_undone`` (``trade_id``,
``reason``) and ``migrations`` (``job_id``, ``source``, ``target``, ``reason``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import msgspec

from shoal.fairness.balance import Migration, packing_migrations, place_job, rebalance
from shoal.fairness.hetero import (
    best_generation_move,
    choose_generation,
    generation_order,
    profiled_rate,
    record_sample,
)
from shoal.fairness.shares import fair_shares_newest_first, spill_leftover
from shoal.fairness.split_stride import LargeEntry, PlacedJob, split_stride_entries
from shoal.fairness.stride import STRIDE1
from shoal.fairness.trader import Trade, holdings, homogeneous_user, trading_round, undo_trades
from shoal.placement.hinted import NODE_HINTS, NODE_SLOTS
from shoal.policies.base import ClusterView, Decision, JobView
from shoal.policies.tiresias import gang_size_by_shape
from shoal.sim.costs import ReconfigCosts, get_costs

MEMORY_VERSION = 1

SUSPEND_RESUME = ReconfigCosts(
    name="suspend-resume",
    start_s=0.25,
    scale_out_s=0.05,
    scale_in_s=0.05,
    migrate_s=0.25,
    restart_s=0.25,
)
"""Gandiva_fair's own mechanism (§4, "Implementation"): a gang is suspended at a
mini-batch boundary (about 100 ms) and resumed in place (about 100 ms), 100-250 ms in
all, so a (re)start costs 0.25 s, the top of that range. A move to other servers is a
CRIU checkpoint whose GPU-context set-up (about 5 s) the *preload* phase hides while
other jobs use the GPUs, so it too costs the job its suspend and resume, 0.25 s
(``migrate_s`` and ``restart_s``, the latter the kind of a move to disjoint GPUs).
Gandiva_fair never resizes a gang; the resize kinds keep CoDDL's milliseconds (§4.3).

The simulator charges these by default when it runs Gandiva_fair (the policy names them
through ``planning_costs``). shoal's own trainer has no in-place suspend: a preempted job
stops, and its resume is a checkpoint-restart (``measured``: 1.4 s + 3.6 s per GPU),
which at a 60 s quantum leaves a gang of 16 GPUs under 1 s of training per quantum and
one of 17 or more none at all. Give ``costs="measured"`` to simulate that."""


gang_size = gang_size_by_shape
"""The GPUs a job runs with under Gandiva_fair (it is not resized): its gang size,
:func:`shoal.policies.tiresias.gang_size` (its request when feasible), memoised by shape."""


@functools.lru_cache(maxsize=256)
def _node_gpus(gen: str, gpus: int, per_node: int) -> dict[str, int]:
    """The servers of a generation and their GPUs (memoised: every decision asks; callers
    only read it)."""
    per = per_node if per_node > 0 else gpus
    nodes: dict[str, int] = {}
    full, rest = divmod(gpus, per) if per > 0 else (0, 0)
    for i in range(full):
        nodes[f"{gen}#{i}"] = per
    if rest:
        nodes[f"{gen}#{full}"] = rest
    return nodes


@functools.lru_cache(maxsize=16384)
def _span(
    gen: str, gpus: int, per_node: int, nodes: tuple[str, ...], size: int
) -> tuple[tuple[tuple[str, int], ...], bool] | None:
    """Whether a gang of ``size`` GPUs still fits its ``nodes`` (several) of the generation's
    servers (:func:`_node_gpus`), and if so the GPUs it takes on each node, in order (the
    first nodes filled first, a node past the gang taking 0), and whether the nodes are
    distinct. ``None``: a node is gone or they hold fewer GPUs than the gang. Memoised: a
    gang that stays placed asks the same at every quantum."""
    node_gpus = _node_gpus(gen, gpus, per_node)
    got = [node_gpus.get(node, -1) for node in nodes]
    if -1 in got or sum(got) < size:
        return None
    takes: list[tuple[str, int]] = []
    rest = size
    for node, free in zip(nodes, got, strict=True):
        take = rest if rest < free else free  # min(free, rest)
        takes.append((node, take))
        rest -= take
    return tuple(takes), len(set(nodes)) == len(nodes)


@functools.lru_cache(maxsize=4096)
def _generation_of_node(node: str) -> str:
    """The generation of a node named ``<generation>#<index>``."""
    return node.rsplit("#", 1)[0]


class GandivaFairPolicy:
    """Gandiva_fair (EuroSys'20): tickets, split gang-aware stride, balancing, trading."""

    name = "gandiva-fair"
    elastic = False
    """Gangs run whole (time-sliced, never resized), so shares are never regulated (:attr:`shoal.policies.base.Policy.elastic`)."""

    def __init__(
        self,
        *,
        quantum_s: float = 60.0,
        stride1: float = STRIDE1,
        default_tickets: float = 100.0,
        trading: bool = True,
        min_trade_gain: float = 0.1,
        max_trades_per_pair: int | None = 1,
        undo_tolerance: float = 0.05,
        balance_threshold: float = 0.25,
        generation_move_threshold: float = 0.05,
        profile_window: int = 5,
        generation_rank: Mapping[str, int] | None = None,
        pack_on_placement: bool = False,
        spill: bool = False,
        homogeneous_only: bool = True,
        homogeneity_tolerance: float = 0.1,
        costs: ReconfigCosts | str | None = None,
    ) -> None:
        """Configure the policy.

        Args:
            quantum_s: Length of a time quantum (§3.5).
            stride1: Stride constant.
            default_tickets: Tickets of users absent from ``user_tickets``.
            trading: Enable GPU trading on heterogeneous clusters.
            min_trade_gain: Least relative speedup gap for a trade (hysteresis).
            max_trades_per_pair: Trades per generation pair per quantum.
            undo_tolerance: Tolerated loss before a trade is undone.
            balance_threshold: Relative ticket-load imbalance that triggers migration.
            generation_move_threshold: Least relative gain to move a job across generations.
            profile_window: Samples averaged per (user, generation) profile.
            generation_rank: Generation name -> rank (newer is higher).
            pack_on_placement: New small jobs avoid nodes whose idle risk they
                would raise before looking at load (off: the paper's least-loaded rule).
            spill: Hand out per-generation capacity that newest-first filling left
                unallocated (:func:`.shares.spill_leftover`). Off by default: on the
                Philly runs of ``benchmarks/fairness_heterogeneity.py`` it lowers the
                users' shortfall a little but raises the average JCT (see the report).
            homogeneous_only: Trade only for users whose jobs are homogeneous (§3.4);
                False relaxes the paper's condition (see the module docstring).
            homogeneity_tolerance: Spread of measured per-GPU rates among a user's
                jobs still taken as one job type.
            costs: The reconfiguration costs of the mechanism the schedule runs on, which
                the simulator charges (a preset name or :class:`~shoal.sim.costs.ReconfigCosts`;
                ``None``: :data:`SUSPEND_RESUME`, the paper's). The policy does not plan
                with them.

        Raises:
            ValueError: ``costs`` names no preset.
        """
        self.quantum_s = quantum_s
        self.stride1 = stride1
        self.default_tickets = default_tickets
        self.trading = trading
        self.min_trade_gain = min_trade_gain
        self.max_trades_per_pair = max_trades_per_pair
        self.undo_tolerance = undo_tolerance
        self.balance_threshold = balance_threshold
        self.generation_move_threshold = generation_move_threshold
        self.profile_window = profile_window
        self.generation_rank = generation_rank
        self.pack_on_placement = pack_on_placement
        self.spill = spill
        self.homogeneous_only = homogeneous_only
        self.homogeneity_tolerance = homogeneity_tolerance
        self.costs = get_costs(costs) if isinstance(costs, str) else (costs or SUSPEND_RESUME)
        self._gang_sizes: dict[str, tuple[JobView, int]] = {}
        """Job -> (the view last sized, its :func:`gang_size`): a view is immutable, and the
        simulator and the allocator hand an unchanged job's view over again, so the same
        object has the same size. Cut back to the jobs of the current view whenever it holds
        more than twice as many, plus 64. Decides nothing: a policy without it decides the
        same."""

    def planning_costs(self) -> ReconfigCosts:
        """The costs the simulator charges this schedule: :attr:`costs` (see :data:`SUSPEND_RESUME`).

        A simulator configured with other costs refuses the policy; name them here instead
        (``--policy-param costs=measured``).
        """
        return self.costs

    def decide(self, view: ClusterView, memory: Mapping[str, Any]) -> Decision:
        """Decide which jobs run this quantum, on which generation.

        Args:
            view: The cluster.
            memory: ``Decision.memory`` of the previous call (empty at first).

        Returns:
            Shares (each job's gang size or nothing), generations, and the new memory.
        """
        # The previous memory is never modified (a replay or the caller may hold it): the
        # top level is copied here, and every nested value this call changes is replaced
        # by a new one (``profiles`` and ``job_rates`` copy the per-user and per-job
        # dicts they update; the rest is rebuilt below), so no deep copy is needed.
        mem: dict[str, Any] = dict(memory) if memory.get("v") == MEMORY_VERSION else {}
        now = view.now_s
        new_quantum = "quantum_start" not in mem or now >= mem["quantum_start"] + self.quantum_s
        if new_quantum:
            mem["quantum_start"] = now
            mem["base_central"] = mem.get("central", {})
            mem["base_local"] = mem.get("local", {})
        migrations: list[Migration] = []

        gens = (
            {g: n for g, n in view.gpus_by_type.items() if n > 0}
            if view.gpus_by_type
            else {"": view.total_gpus}
        )
        order = generation_order(gens, self.generation_rank)
        cap = dict(gens)
        largest = max(cap.values(), default=0)
        size: dict[str, int] = {}
        jobs: dict[str, JobView] = {}
        # The jobs in priority order (the key stops at the id: the view, its size after it).
        ranked: list[tuple[int, float, str, str, JobView, int]] = []
        sized = self._gang_sizes
        for jv in view.jobs:
            jid = jv.job_id
            hit = sized.get(jid)
            if hit is not None and hit[0] is jv:
                n = hit[1]
            else:
                n = gang_size(jv)
                sized[jid] = (jv, n)
            if n > 0:
                size[jid] = n
                jobs[jid] = jv
                ranked.append((-jv.priority, jv.arrival_s, jid, jv.user, jv, n))
        if len(sized) > 2 * len(view.jobs) + 64:  # forget the jobs that left
            self._gang_sizes = {j.job_id: sized[j.job_id] for j in view.jobs}
        if len(ranked) != len(jobs):  # an id twice in the view: the last one counts, as in ``jobs``
            ranked = [(-j.priority, j.arrival_s, k, j.user, j, size[k]) for k, j in jobs.items()]
        ranked.sort()
        # Each user's jobs in priority order, and (step 2 below) the GPUs of its jobs that may
        # run on any generation, and of those pinned to one, summed in that order.
        by_user: dict[str, list[str]] = {}
        flexible_of: dict[str, float] = {}
        pinned_of: dict[str, dict[str, float]] = {}
        for _, _, jid, user, jv, n in ranked:
            by_user.setdefault(user, []).append(jid)
            pin = jv.pinned_gpu_type
            if pin is not None:
                if cap.get(pin, 0) >= n:
                    pinned_of.setdefault(user, {})[pin] = pinned_of.get(user, {}).get(pin, 0.0) + n
            elif largest >= n:  # some generation can hold the gang
                flexible_of[user] = flexible_of.get(user, 0.0) + n
        # Each job's nodes at the previous decision; its generation is read from their
        # names (``<generation>#<index>``) where the job is looked at.
        placement_mem: dict[str, list[str]] = mem.get("placement", {})

        # 1. Opportunistic profiling (§3.5). The per-user and per-job dicts of the old
        # memory are shared, and copied before one is changed.
        profiles: dict[str, dict[str, list[float]]] = {
            u: p for u, p in mem.get("profiles", {}).items() if u in by_user
        }
        job_rates: dict[str, dict[str, float]] = {
            j: r for j, r in mem.get("job_rates", {}).items() if j in jobs
        }
        if new_quantum:
            t0 = float(mem.get("ran_at", now))
            copied: set[str] = set()
            for jid, it0 in sorted(mem.get("ran", {}).items()):
                job = jobs.get(jid)
                was = placement_mem.get(jid)
                gen = _generation_of_node(was[0]) if was else None
                if job is None or gen is None or now <= t0 or job.iterations_done <= it0:
                    continue
                sample = (job.iterations_done - it0) / (now - t0) / size[jid]
                if job.user not in copied:
                    copied.add(job.user)
                    profiles[job.user] = dict(profiles.get(job.user, {}))
                per_user = profiles[job.user]
                per_user[gen] = record_sample(per_user.get(gen, []), sample, window=self.profile_window)
                rates_j = dict(job_rates.get(jid, {}))
                rates_j[gen] = sample
                job_rates[jid] = rates_j
        rates_of: dict[str, dict[str, float]] = {}

        def rates(user: str) -> dict[str, float]:
            # The generation choice's rates, per user, computed when first needed.
            if user not in rates_of:
                rates_of[user] = self._rates(user, by_user[user], jobs, size, profiles, gens)
            return rates_of[user]

        # 2. Entitlements: newest generation first, pinned demand on its generation. The
        # users in the order of ``by_user`` (of their first job), as the shares are.
        flexible = {u: flexible_of[u] for u in by_user if u in flexible_of}
        pinned = {u: pinned_of[u] for u in by_user if u in pinned_of} if pinned_of else {}
        tickets = {u: float(view.user_tickets.get(u, self.default_tickets)) for u in by_user}
        entitled = fair_shares_newest_first(tickets, flexible, gens, order, pinned)
        # Gangs cannot use fractions spread over generations: hand out what
        # newest-first filling left idle (§3.2 bonus share, per generation).
        if self.spill:
            usable = {
                u: {g: flexible.get(u, 0.0) + pinned.get(u, {}).get(g, 0.0) for g in gens} for u in by_user
            }
            entitled = spill_leftover(entitled, tickets, usable, gens)

        # 3. Trading on heterogeneous clusters (§3.4-3.5).
        active = [Trade(**t) for t in mem.get("trades", [])]
        executed: list[Trade] = []
        undone_out: list[dict[str, str]] = []
        if len(gens) > 1 and self.trading:
            # Trading reads measured profiles only (§3.5 "Profiling"), never declared curves.
            measured = {
                u: {g: r for g in gens if (r := profiled_rate(profiles.get(u, {}).get(g, []))) is not None}
                for u in by_user
            }
            traders = {
                u: r
                for u, r in measured.items()
                if u not in pinned
                and sum(1 for g in gens if r.get(g, 0.0) > 0) >= 2
                and (
                    not self.homogeneous_only
                    or homogeneous_user(
                        [size[j] for j in by_user[u] if jobs[j].pinned_gpu_type is None],
                        [job_rates[j] for j in by_user[u] if j in job_rates],
                        tolerance=self.homogeneity_tolerance,
                    )
                )
            }
            # The undo check runs on every call (arrivals and departures, §3.5);
            # new trades only at quantum starts.
            active, undone = undo_trades(entitled, active, traders, undo_tolerance=self.undo_tolerance)
            undone_out = [{"trade_id": u.trade_id, "reason": u.reason} for u in undone]
            if new_quantum:
                seq = int(mem.get("trade_seq", 0))
                executed = trading_round(
                    entitled,
                    traders,
                    order,
                    active,
                    demand={u: flexible.get(u, 0.0) for u in entitled},
                    min_gain=self.min_trade_gain,
                    max_trades_per_pair=self.max_trades_per_pair,
                    first_id=seq,
                )
                mem["trade_seq"] = seq + len(executed)
                active = active + executed
        else:
            undone_out = [{"trade_id": t.trade_id, "reason": "trading off"} for t in active]
            active = []
        held = holdings(entitled, active)
        held = {u: {g: max(0.0, held.get(u, {}).get(g, 0.0)) for g in gens} for u in by_user}

        # 4. Generation of each job (Algorithm 2) and one cross-generation move (§3.5).
        gen_of: dict[str, str] = {}
        load: dict[str, dict[str, float]] = {u: {} for u in by_user}
        only = order[0] if len(order) == 1 else None
        for user, jids in by_user.items():
            # Jobs stay where they are while they fit the user's holding there; the
            # rest (new jobs, jobs whose holding shrank after a trade) are chosen
            # again, so jobs follow traded GPUs (§3.5 "Trading").
            rest: list[str] = []
            load_u, held_u = load[user], held[user]
            for jid in jids:
                job, was = jobs[jid], placement_mem.get(jid)
                prev = _generation_of_node(was[0]) if was else None
                if job.pinned_gpu_type is not None:
                    g = choose_generation(size[jid], order, {}, {}, pinned=job.pinned_gpu_type, capacity=cap)
                elif prev in gens and load_u.get(prev, 0.0) + size[jid] <= held_u[prev] + 1e-9:
                    g = prev
                else:
                    rest.append(jid)
                    continue
                if g is not None:
                    gen_of[jid] = g
                    load_u[g] = load_u.get(g, 0.0) + size[jid]
            for jid in rest:
                if only is not None:  # choose_generation's answer with one generation
                    g = only if cap[only] >= size[jid] else None
                else:
                    g = choose_generation(
                        size[jid],
                        order,
                        held_u,
                        load_u,
                        rates(user) or None,
                        capacity=cap,
                        previous=_generation_of_node(was[0]) if (was := placement_mem.get(jid)) else None,
                    )
                if g is not None:
                    gen_of[jid] = g
                    load_u[g] = load_u.get(g, 0.0) + size[jid]
        if len(gens) > 1 and new_quantum:
            movable: dict[str, dict[str, list[int]]] = {}
            for jid, g in gen_of.items():
                if jobs[jid].pinned_gpu_type is None:
                    movable.setdefault(jobs[jid].user, {}).setdefault(g, []).append(size[jid])
            move = best_generation_move(
                {u: (held[u], load[u], rates(u) or None) for u in by_user},
                movable,
                order,
                threshold=self.generation_move_threshold,
            )
            if move is not None and cap[move.target] >= move.size:
                # The user's least urgent job of that size moves (latest in priority order).
                jid = next(
                    j
                    for j in reversed(by_user[move.user])
                    if gen_of.get(j) == move.source
                    and size[j] == move.size
                    and jobs[j].pinned_gpu_type is None
                )
                gen_of[jid] = move.target
                load[move.user][move.source] -= move.size
                load[move.user][move.target] = load[move.user].get(move.target, 0.0) + move.size
                migrations.append(
                    Migration(job_id=jid, source=move.source, target=move.target, reason="generation")
                )

        # 5-6. Placement, balance and split stride, per generation.
        central_all: dict[str, dict[str, float]] = {}
        local_all: dict[str, float] = {}
        base_central: dict[str, dict[str, float]] = mem.get("base_central", {})
        base_local: dict[str, float] = dict(mem.get("base_local", {}))
        shares: dict[str, int] = {}
        gpu_types: dict[str, str] = {}
        new_placement: dict[str, list[str]] = {}
        slots_mem: dict[str, int] = mem.get("slots", {})
        new_slots: dict[str, int] = {}
        for gen in order:
            gen_gpus, per_node = gens[gen], view.gpus_per_node
            node_gpus = _node_gpus(gen, gen_gpus, per_node)
            here = list(gen_of) if only is not None else [j for j in gen_of if gen_of[j] == gen]
            # Eq. (1) on effective tickets: the user's holding here over the GPUs its
            # jobs here need, once per user (in the loop below).
            tpg: dict[str, float] = {}
            tpg_of_user: dict[str, float] = {}
            placed: dict[str, tuple[str, ...]] = {}
            fresh: list[str] = []
            # A job stays where it was while its nodes are still there and hold its
            # gang; its eq. (2) load is added as it is kept (the order of `placed`).
            node_load = dict.fromkeys(node_gpus, 0.0)
            # The gang sizes on each node: read only by pack_on_placement's rule (place_job).
            node_sizes: dict[str, list[int]] | None = (
                {n: [] for n in node_gpus} if self.pack_on_placement else None
            )
            # Whether every gang is on distinct nodes (always, as the policy places
            # them): node_load is then eq. (2) exactly as rebalance computes it.
            distinct = True
            for j in here:
                user = jobs[j].user
                t = tpg_of_user.get(user)
                if t is None:
                    load_u = load[user]
                    t = tpg_of_user[user] = held[user][gen] / load_u[gen] if load_u.get(gen, 0) > 0 else 0.0
                tpg[j] = t
                prev_nodes = placement_mem.get(j)
                if not prev_nodes:
                    fresh.append(j)
                elif len(prev_nodes) == 1:
                    node = prev_nodes[0]
                    gpus = node_gpus.get(node)
                    s_j = size[j]
                    if gpus is not None and gpus >= s_j:
                        placed[j] = (node,)
                        # _add_load of a gang on one node, inline (most gangs): it takes s_j GPUs.
                        node_load[node] += s_j * t
                        if node_sizes is not None:
                            node_sizes[node].append(s_j)
                    else:
                        fresh.append(j)
                else:
                    # A gang on several nodes: _add_load of what _span says it takes there.
                    key = tuple(prev_nodes)
                    span = _span(gen, gen_gpus, per_node, key, size[j])
                    if span is not None:
                        placed[j] = key
                        takes, apart = span
                        if distinct and not apart:
                            distinct = False
                        for node, take in takes:
                            node_load[node] += take * t
                    else:
                        fresh.append(j)
            for j in sorted(fresh, key=lambda k: (jobs[k].arrival_s, k)):
                loads = {n: v / node_gpus[n] for n, v in node_load.items()}
                nodes = place_job(size[j], node_gpus, loads, node_sizes)
                if nodes:
                    placed[j] = nodes
                    self._add_load(node_load, node_gpus, nodes, size[j], tpg[j])
                    if node_sizes is not None and len(nodes) == 1:
                        node_sizes[nodes[0]].append(size[j])
                    base_local.pop(j, None)
            moved = False
            if new_quantum:
                # Balance and packing read the sizes of the jobs of `placed` only: `size`
                # (every job's) serves as it is.
                moves = rebalance(
                    node_gpus,
                    placed,
                    size,
                    tpg,
                    threshold=self.balance_threshold,
                    max_migrations=1,
                    # node_load sums eq. (2)'s terms of `placed` in its order, as
                    # ticket_load_per_gpu does for gangs on distinct nodes.
                    loads=(
                        {n: (node_load[n] / g if g > 0 else math.inf) for n, g in node_gpus.items()}
                        if distinct
                        else None
                    ),
                )
                for m in moves:
                    placed[m.job_id] = (m.target,)
                moves_pack = packing_migrations(
                    node_gpus, placed, size, max_migrations=max(node_gpus.values(), default=1)
                )
                for m in moves_pack:
                    placed[m.job_id] = (m.target,)
                for m in moves + moves_pack:
                    base_local.pop(m.job_id, None)
                migrations.extend(moves + moves_pack)
                moved = bool(moves or moves_pack)
            # split_stride_quantum's two levels, built here in job-id order: a small job
            # as a PlacedJob on its server, a large job as its central entry.
            small_by_server: dict[str, list[PlacedJob]] = {n: [] for n in node_gpus}
            large: list[LargeEntry] = []
            for j in sorted(placed):
                servers, s_j = placed[j], size[j]
                if len(servers) == 1:
                    small_by_server[servers[0]].append(
                        PlacedJob(
                            job_id=j,
                            size=s_j,
                            job_tickets=tpg[j] * s_j,
                            servers=servers,
                            arrival_s=jobs[j].arrival_s,
                        )
                    )
                else:
                    large.append((f"job:{j}", s_j, True, tpg[j] * s_j, servers))
            result = split_stride_entries(
                node_gpus, small_by_server, large, base_central.get(gen, {}), base_local, self.stride1
            )
            central_all[gen] = result.central_passes
            local_all.update(result.local_passes)
            for j in result.scheduled:
                shares[j] = size[j]
                if view.gpus_by_type:
                    gpu_types[j] = gen
            if only is not None and not fresh and not moved and list(placed) == list(placement_mem):
                # Every job kept the nodes it had, and the jobs are those of the previous
                # placement in its order: that placement as it is (a long queue's jobs
                # mostly wait where they are), not a copy of it.
                new_placement = placement_mem
            else:
                new_placement.update({j: list(n) for j, n in placed.items()})
            new_slots.update(self._slots(node_gpus, placed, size, placement_mem, slots_mem, jobs))

        scheduled = sorted(shares)
        mem.update(
            {
                "v": MEMORY_VERSION,
                "placement": new_placement,
                NODE_HINTS: {j: new_placement[j] for j in scheduled},
                "slots": new_slots,
                NODE_SLOTS: {j: new_slots[j] for j in scheduled if j in new_slots},
                "central": central_all,
                "local": local_all,
                "profiles": profiles,
                "job_rates": job_rates,
                "ran": {j: jobs[j].iterations_done for j in scheduled},
                "ran_at": now,
                "trades": [msgspec.structs.asdict(t) for t in active],
                "trades_executed": [msgspec.structs.asdict(t) for t in executed],
                "trades_undone": undone_out,
                "migrations": [msgspec.structs.asdict(m) for m in migrations],
                "entitlements": held,
            }
        )
        return Decision(shares=shares, gpu_types=gpu_types, memory=mem)

    @staticmethod
    def _slots(
        node_gpus: Mapping[str, int],
        placed: Mapping[str, tuple[str, ...]],
        size: Mapping[str, int],
        old_nodes: Mapping[str, list[str]],
        old_slots: Mapping[str, int],
        jobs: Mapping[str, JobView],
    ) -> dict[str, int]:
        """Each single-node job's GPU slot on its node: the position of its first GPU.

        A job that stays on its node keeps its slot; others take the aligned slot that
        overlaps the fewest slots of the node's other jobs (then the lowest). The placer
        gives a job its slot's GPUs when they are free, so a gang resumed after a
        suspension returns to the GPUs it ran on (``gpu_slots``, see the module docstring).
        """
        out: dict[str, int] = {}
        rest = []
        for j, nodes in placed.items():
            if len(nodes) != 1:
                continue
            n, s = nodes[0], size[j]
            if s >= node_gpus[n]:
                continue
            k = old_slots.get(j)
            was = old_nodes.get(j)
            if (
                k is not None
                and 0 <= k <= node_gpus[n] - s
                and was is not None
                and len(was) == 1
                and was[0] == n
            ):
                out[j] = k
            else:
                rest.append(j)
        if not rest:
            return out
        # node -> its jobs that keep their slot (in ``placed`` order), and the occupancy
        # of a node's GPUs: needed only where a job takes a new slot.
        kept: dict[str, list[str]] = {}
        for j in out:
            kept.setdefault(placed[j][0], []).append(j)
        used: dict[str, list[int]] = {}
        for j in sorted(rest, key=lambda k: (jobs[k].arrival_s, k)):
            n, s = placed[j][0], size[j]
            here = used.get(n)
            if here is None:
                here = used[n] = [0] * node_gpus[n]
                for other in kept.get(n, ()):
                    for g in range(out[other], out[other] + size[other]):
                        here[g] += 1
            k = min(range(0, node_gpus[n] - s + 1, s), key=lambda o: (sum(here[o : o + s]), o))
            out[j] = k
            for i in range(k, k + s):
                here[i] += 1
        return out

    @staticmethod
    def _add_load(
        node_load: dict[str, float],
        node_gpus: Mapping[str, int],
        nodes: tuple[str, ...],
        size: int,
        tpg: float,
    ) -> None:
        rest = size
        for n in nodes:
            take = min(node_gpus[n], rest)
            node_load[n] += take * tpg
            rest -= take

    @staticmethod
    def _rates(
        user: str,
        jids: list[str],
        jobs: Mapping[str, JobView],
        size: Mapping[str, int],
        profiles: Mapping[str, Mapping[str, list[float]]],
        gens: Mapping[str, int],
    ) -> dict[str, float]:
        """Per-GPU rate of the user's jobs on each generation: profile, else declared curves.

        For the generation choice (Algorithm 2) only; trading reads measured profiles alone.
        """
        out: dict[str, float] = {}
        for g in gens:
            r = profiled_rate(profiles.get(user, {}).get(g, []))
            if r is None:
                declared = [
                    jobs[j].throughput_by_type[g][size[j]] / size[j]
                    for j in jids
                    if g in jobs[j].throughput_by_type
                    and len(jobs[j].throughput_by_type[g]) > size[j]
                    and jobs[j].throughput_by_type[g][size[j]] > 0
                ]
                r = sum(declared) / len(declared) if declared else None
            if r is not None:
                out[g] = r
        return out

"""trader: Gandiva_fair GPU trading between users on heterogeneous clusters.

Consumes: the whole event log through a :class:`~shoal.projection.Projection`.

Decides, with the pure functions of :mod:`shoal.fairness.trader` (Gandiva_fair
§3.4–3.5), on a market read from the folded state by :func:`market` (pure):

- **entitlements**: each active user's per-generation fair share, by tickets,
  newest generation first, pinned demand on its own generation
  (:func:`shoal.fairness.shares.fair_shares_newest_first`, as
  :class:`~shoal.fairness.policy.GandivaFairPolicy` computes them);
- **rates**: a user's progress per GPU on a generation = the mean, over the
  user's active jobs that have a *measured* model on that generation
  (``ThroughputModelUpdated`` with ``samples > 0`` — the profiler's per-generation
  profiling, §3.5), of iterations/s at the job's gang size divided by that size.
  Speedups are ratios of one user's rates, so only a user whose jobs are
  homogeneous trades (a multi-job, §3.4, the paper's own restriction, enforced by
  :func:`~shoal.fairness.trader.homogeneous_user`: one gang size, measured rates
  within 10 % of each other on every generation). Users with a pinned job, with
  heterogeneous jobs, or with measured rates on fewer than two generations, do not trade;
- **demand**: GPUs of the user's unpinned jobs (a trade never leaves a user
  with GPUs it cannot keep busy);
- **active trades**: ``TradeExecuted`` not yet ``TradeUndone``, in log order.

Every ``quantum_s`` of the injected clock (the first round of a new leader one
quantum after the newest trade in the log, at once if there is none) it runs the undo check
(:func:`~shoal.fairness.trader.undo_trades`) and one second-price round
(:func:`~shoal.fairness.trader.trading_round`); on churn between quanta
(arrivals, departures, node changes, tickets, model updates) it runs only the
undo check, since §3.5 re-checks trades "on every job arrival or departure".
A homogeneous cluster (one generation) has nothing to trade: no round runs, and
trades left from a time with more generations are undone by the check (their
GPUs are gone from the entitlements).

Publishes: ``TradeUndone`` then ``TradeExecuted`` on ``<prefix>.trade.*``, each
with a deterministic event id (``trade-undone-<trade id>``,
``trade-executed-<trade id>``, trade ids ``tx-<n>`` numbered by the count of
trades already in the log) for ``Nats-Msg-Id`` deduplication, and with
``Nats-Expected-Last-Subject-Sequence`` so a deposed leader cannot append on a
stale view. One trader acts at a time (leader lease ``trader``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import msgspec
import structlog
from msgspec import Struct
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus, Campaign, ConcurrencyConflict, SkippedMessage
from shoal.clock import Clock
from shoal.events import Envelope
from shoal.fairness.hetero import generation_order
from shoal.fairness.policy import gang_size
from shoal.fairness.shares import fair_shares_newest_first
from shoal.fairness.trader import Trade, Undo, homogeneous_user, trading_round, undo_trades
from shoal.models import interpolate
from shoal.projection import CLUSTER_SNAPSHOT, Projection
from shoal.state import ClusterState, JobState
from shoal.view import build_view, cluster_gpus

log = structlog.get_logger("shoal.trader")

_CHURN = (
    ev.JobSubmitted,
    ev.JobCompleted,
    ev.JobFailed,
    ev.JobCancelled,
    ev.JobRejected,
    ev.NodeRegistered,
    ev.NodeLost,
    ev.NodeDrained,
    ev.TicketsSet,
    ev.UserRegistered,
    ev.ThroughputModelUpdated,
)


class Market(Struct, frozen=True, kw_only=True):
    """What one trading decision reads (plain data)."""

    order: tuple[str, ...]
    """Generations, newest first."""
    entitlements: dict[str, dict[str, float]]
    rates: dict[str, dict[str, float]]
    """Traders only: user -> generation -> progress per GPU."""
    demand: dict[str, float]
    active: tuple[Trade, ...]
    trades_so_far: int
    """TradeExecuted events in the log (numbers new trade ids)."""


def _measured_rate(job: JobState, gen: str, size: int) -> float | None:
    model = job.throughput_models.get(gen)
    if model is None or model.samples <= 0 or not model.throughput:
        return None
    try:
        curve = interpolate(dict(model.throughput), upto=max(size, max(k for k, _ in model.throughput)))
    except ValueError:
        return None
    rate = curve[size] / size
    return rate if rate > 0 else None


def market(
    state: ClusterState,
    *,
    now: float,
    default_tickets: float = 100.0,
    rank: Mapping[str, int] | None = None,
    homogeneity_tolerance: float = 0.1,
) -> Market:
    """Read the trading inputs from the folded state (see the module docstring).

    Args:
        state: The folded cluster state.
        now: Current time (for the view).
        default_tickets: Tickets of a user the log never gave any.
        rank: Generation name -> rank (newer is higher); default
            :data:`shoal.fairness.hetero.GENERATION_RANK`.
        homogeneity_tolerance: Spread of measured per-GPU rates among a user's jobs
            still taken as one job type (:func:`shoal.fairness.trader.homogeneous_user`).

    Returns:
        The market.
    """
    _, gens = cluster_gpus(state)
    gens = {g: n for g, n in gens.items() if n > 0}
    order = generation_order(gens, rank)
    view = build_view(state, now=now)
    flexible: dict[str, float] = {}
    pinned: dict[str, dict[str, float]] = {}
    sizes: dict[str, list[tuple[str, int]]] = {}
    for job in view.jobs:
        size = gang_size(job)
        if size <= 0:
            continue
        if job.pinned_gpu_type is not None:
            per = pinned.setdefault(job.user, {})
            per[job.pinned_gpu_type] = per.get(job.pinned_gpu_type, 0.0) + size
        elif any(n >= size for n in gens.values()):
            flexible[job.user] = flexible.get(job.user, 0.0) + size
            sizes.setdefault(job.user, []).append((job.job_id, size))
    tickets = {
        u: float(state.users[u].tickets) if u in state.users else default_tickets
        for u in set(flexible) | set(pinned)
    }
    entitled = fair_shares_newest_first(tickets, flexible, gens, order, pinned) if gens else {}
    rates: dict[str, dict[str, float]] = {}
    for user, jobs in sizes.items():
        if user in pinned:
            continue  # §3.4: pinned jobs are exempt from trading
        per_job = [
            {g: r for g in order if (r := _measured_rate(state.jobs[j], g, s)) is not None} for j, s in jobs
        ]
        if not homogeneous_user([s for _, s in jobs], per_job, tolerance=homogeneity_tolerance):
            continue  # §3.4: only a user whose jobs are one job copied trades
        per_gen: dict[str, float] = {}
        for gen in order:
            samples = [r[gen] for r in per_job if gen in r]
            if samples:
                per_gen[gen] = sum(samples) / len(samples)
        if len(per_gen) >= 2:
            rates[user] = per_gen
    active = tuple(
        Trade(
            trade_id=tid,
            buyer=t.buyer,
            seller=t.seller,
            fast_type=t.fast_type,
            slow_type=t.slow_type,
            fast_gpus=t.fast_gpus,
            slow_gpus=t.slow_gpus,
            price=t.price,
        )
        for tid, t in state.trades.items()
        if t.undone_at is None
    )
    return Market(
        order=order,
        entitlements=entitled,
        rates=rates,
        demand={u: flexible.get(u, 0.0) for u in entitled},
        active=active,
        trades_so_far=len(state.trades),
    )


class TradeParams(Struct, frozen=True, kw_only=True):
    """Trading knobs (:func:`shoal.fairness.trader.trading_round`)."""

    min_gain: float = 0.1
    max_trades_per_pair: int | None = 1
    max_fast_per_trade: int = 8
    price_tolerance: float = 0.05
    undo_tolerance: float = 0.05


def decide_trades(m: Market, params: TradeParams, *, full_round: bool) -> tuple[list[Undo], list[Trade]]:
    """Undo check always; a trading round when ``full_round`` and there are ≥ 2 generations.

    Returns:
        (trades to undo, new trades).
    """
    if not m.active and len(m.order) < 2:
        return [], []
    kept, undone = undo_trades(m.entitlements, list(m.active), m.rates, undo_tolerance=params.undo_tolerance)
    new: list[Trade] = []
    if full_round and len(m.order) >= 2 and len(m.rates) >= 2:
        new = trading_round(
            m.entitlements,
            m.rates,
            m.order,
            kept,
            demand=m.demand,
            min_gain=params.min_gain,
            max_trades_per_pair=params.max_trades_per_pair,
            max_fast_per_trade=params.max_fast_per_trade,
            price_tolerance=params.price_tolerance,
            first_id=m.trades_so_far,
        )
        # Trade ids numbered by the trades already in the log: deterministic on replay.
        new = [msgspec.structs.replace(t, trade_id=f"tx-{m.trades_so_far + i}") for i, t in enumerate(new)]
    return undone, new


async def _wait_any(a: asyncio.Event, b: asyncio.Event, timeout: float) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class TraderService:
    """Leader-elected trader. See the module docstring."""

    def __init__(
        self,
        bus: Bus,
        *,
        holder: str,
        clock: Clock,
        quantum_s: float = 60.0,
        params: TradeParams | None = None,
        default_tickets: float = 100.0,
        generation_rank: Mapping[str, int] | None = None,
        lease_ttl_s: float = 3.0,
        coalesce_s: float = 0.02,
    ) -> None:
        self.bus = bus
        self.holder = holder
        self.clock = clock
        self.quantum_s = quantum_s
        self.params = params or TradeParams()
        self.default_tickets = default_tickets
        self.generation_rank = generation_rank
        self.lease_ttl_s = lease_ttl_s
        self.coalesce_s = coalesce_s
        self.projection = Projection(
            bus, snapshot_name=CLUSTER_SNAPSHOT, listeners=[self._on_event], skip_listeners=[self._on_skipped]
        )
        self.dirty = asyncio.Event()
        self.is_leader = False
        self.role: str | None = None
        """``"leader"`` or ``"standby"`` once the lease was asked for (the probes' readiness)."""
        self.subject_seq: dict[str, int] = {}
        """Subject -> stream sequence of the newest message on it, whatever it holds (a
        message there that does not decode counts: the expected-sequence append compares
        with it)."""
        self._subjects = {f"{bus.names.prefix}.{tag}" for tag in ("trade.executed", "trade.undone")}
        self.last_round: float | None = None
        self.last_trade_at: float | None = None
        """Occurred-at of the newest TradeExecuted in the log (a new leader keeps the pace)."""
        self.rounds = 0
        self.checks = 0
        self.executed = 0
        self.undone = 0

    def _on_event(self, seq: int, env: Envelope, state: ClusterState) -> None:
        e = env.event
        if isinstance(e, ev.TradeExecuted | ev.TradeUndone):
            self.subject_seq[self.bus.names.subject(e)] = seq
            if isinstance(e, ev.TradeExecuted):
                self.last_trade_at = max(self.last_trade_at or env.at, env.at)
        elif isinstance(e, _CHURN):
            self.dirty.set()

    def _on_skipped(self, skipped: SkippedMessage) -> None:
        if skipped.subject in self._subjects:
            self.subject_seq[skipped.subject] = max(self.subject_seq.get(skipped.subject, 0), skipped.seq)

    async def _restore_cursors(self) -> None:
        """After a snapshot the listener saw only the tail: the expected-sequence cursors
        of the trade subjects and the newest trade's instant (from the state)."""
        for subject in self._subjects:
            last, _ = await self.bus.last_valid_on_subject(subject)
            self.subject_seq[subject] = max(self.subject_seq.get(subject, 0), last)
        trades = self.projection.state.trades.values()
        newest = max((t.executed_at for t in trades), default=None)
        if newest is not None:
            self.last_trade_at = max(self.last_trade_at or newest, newest)

    def market(self) -> Market:
        return market(
            self.projection.state,
            now=self.clock.now(),
            default_tickets=self.default_tickets,
            rank=self.generation_rank,
        )

    async def _append(self, env: Envelope) -> bool:
        expected = self.subject_seq.get(self.bus.names.subject(env.event), 0)
        try:
            result = await self.bus.publish(env, expected_last_subject_seq=expected)
        except ConcurrencyConflict:
            log.warning("trade_conflict", event_id=env.id, note="another trader appended; re-reading")
            await self.projection.wait_for(await self.bus.last_seq())
            return False
        await self.projection.wait_for(result.seq)
        log.info("trade_published", event_type=env.type, event_id=env.id, stream_seq=result.seq)
        return True

    async def decide_once(self, *, full_round: bool) -> tuple[int, int]:
        """Run the undo check (and a round when ``full_round``); publish. Returns (undone, executed)."""
        now = self.clock.now()
        undone, new = decide_trades(self.market(), self.params, full_round=full_round)
        n_undone = n_new = 0
        for u in undone:
            env = codec.wrap(
                ev.TradeUndone(trade_id=u.trade_id, reason=u.reason[:4096]),
                at=now,
                event_id=f"trade-undone-{u.trade_id}",
            )
            if not await self._append(env):
                self.dirty.set()
                return n_undone, n_new
            n_undone += 1
        for t in new:
            env = codec.wrap(
                ev.TradeExecuted(
                    trade_id=t.trade_id,
                    buyer=t.buyer,
                    seller=t.seller,
                    fast_type=t.fast_type,
                    slow_type=t.slow_type,
                    fast_gpus=t.fast_gpus,
                    slow_gpus=t.slow_gpus,
                    price=t.price,
                ),
                at=now,
                event_id=f"trade-executed-{t.trade_id}",
            )
            if not await self._append(env):
                self.dirty.set()
                break
            n_new += 1
        self.undone += n_undone
        self.executed += n_new
        if full_round:
            self.rounds += 1
        self.checks += 1
        return n_undone, n_new

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log; while holding the lease, trade every quantum. Returns when ``stop`` is set."""
        await self.projection.start()
        await self.projection.wait_ready()
        if self.projection.restored_from_snapshot:
            await self._restore_cursors()
        campaign = Campaign(await self.bus.lease("trader", self.holder, ttl_s=self.lease_ttl_s))
        scale = float(getattr(self.clock, "scale", 1.0))
        try:
            while not stop.is_set():
                flip = await campaign.poll()
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if flip == "elected":
                    await self.projection.wait_for(await self.bus.last_seq())
                    # The next round is one quantum after the last trade in the log.
                    self.last_round = self.last_trade_at
                    self.dirty.set()
                wait = campaign.until_due()
                if self.is_leader and self.last_round is not None:
                    due_in = (self.last_round + self.quantum_s - self.clock.now()) / scale
                    wait = min(wait, max(0.0, due_in))
                elif self.is_leader:
                    wait = 0.0
                await _wait_any(self.dirty, stop, wait)
                # After the wait (a pause may have outlived the lease): lead only if still valid.
                self.is_leader = campaign.is_leader
                self.role = "leader" if self.is_leader else "standby"
                if not self.is_leader or stop.is_set():
                    self.dirty.clear()  # a standby only folds; taking over re-checks
                    continue
                now = self.clock.now()
                quantum_due = self.last_round is None or now >= self.last_round + self.quantum_s
                if quantum_due or self.dirty.is_set():
                    await asyncio.sleep(self.coalesce_s)  # let a burst land first
                    self.dirty.clear()
                    if quantum_due:
                        self.last_round = now
                    await self.decide_once(full_round=quantum_due)
        finally:
            await campaign.release()
            await self.projection.stop()

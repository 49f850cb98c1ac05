"""Automated second-price GPU trading between users (Gandiva_fair §3.4-3.5).

A user's tickets entitle it to a share of *every* GPU generation. Every
quantum, for each (fast, slow) generation pair, the user with the highest
speedup (rate on fast / rate on slow) buys fast GPUs from the user with the
lowest, paying in slow GPUs at the *second-highest* speedup (Vickrey price); with
no third user the surplus is split equally, ``price = (s_buyer + s_seller) / 2``.
On arrivals and departures (new entitlements) and when speedups drift, trades
that are no longer affordable or no longer beneficial are undone.

Naming follows the event contract (:class:`shoal.events.TradeExecuted`): the
*buyer* gets ``fast_gpus`` fast GPUs and pays ``slow_gpus`` slow GPUs to the
*seller*. (The paper's §3.5 calls the high-speedup user the "seller" of slow
GPUs; Table 3's user C is our buyer, user A our seller.)

Choices where the paper is silent (NOTES §1.1.G, §1.5.6):

- Units. ``rates[user][gen]`` is the user's progress per GPU on ``gen`` (any unit:
  speedups are ratios). Holdings are entitlement plus net trades and may be
  fractional; only whole GPUs change hands.
- Granularity and fractional prices. A trade moves ``n`` fast GPUs for ``m`` slow
  GPUs, with the smallest ``n ≤ max_fast_per_trade`` such that ``m = round(n·price)``
  is within ``price_tolerance`` of the price and ``s_seller ≤ m/n ≤ s_buyer`` (both
  parties weakly gain); the recorded price is ``m/n``. 5 K80 per V100 is one V100
  for five K80s; 1.71 becomes 5 for 3 (1.667).
- Bidders. The auction for a pair is among users with a positive rate on both
  generations. The buyer is the highest bidder still able to pay; the price is the
  next bidder below it (not the seller), else the equal split. Pinned jobs are
  excluded by the caller (give such users no rates).
- Pairs are visited fast generation newest first, then slow generation oldest
  first (V100/K80, V100/P100, P100/K80 for ``order = (v100, p100, k80)``).
- Hysteresis: a trade needs ``s_buyer ≥ (1 + min_gain) · s_seller`` (default 10 %);
  a trade is undone when its *seller* loses anything under current rates, or when
  its buyer loses more than ``undo_tolerance`` of the value it paid (the buyer chose
  the price; the seller only accepted it). ``max_trades_per_pair`` bounds trades
  per pair per round (``None``: trade until no pair gains).
- Fairness guard. A new trade's price lies between the two speedups, so it is weakly
  beneficial to both parties under the rates it was made on; a kept trade never
  leaves its seller worse off under the current rates (above). Holdings never go
  negative: when entitlements shrink, the newest trades that gave away the missing
  GPUs are undone first.
- Who trades (the caller decides, with :func:`homogeneous_user`): the paper limits
  trading to users whose jobs are homogeneous, a hyper-parameter sweep of one job
  (§3.4, NOTES §1.1.G), because a user's speedup is one number for all its jobs.
  Rates must be measured (profiles), never a model table.
- Bonus tickets and trades: trades are applied on top of the post-water-filling
  entitlements (bonus shares included); they are recomputed every round, so a
  trade never survives a loss of the GPUs it traded.
- A ``demand`` cap (GPUs a user can keep busy) may be given: a trade never leaves
  a user holding more GPUs than its demand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from msgspec import Struct


class Trade(Struct, frozen=True, kw_only=True):
    """One executed trade; the lead turns it into a :class:`~shoal.events.TradeExecuted`."""

    trade_id: str
    buyer: str
    seller: str
    fast_type: str
    slow_type: str
    fast_gpus: int
    slow_gpus: int
    price: float
    """Slow GPUs per fast GPU actually paid (``slow_gpus / fast_gpus``)."""


class Undo(Struct, frozen=True, kw_only=True):
    """A trade to undo; becomes a :class:`~shoal.events.TradeUndone`."""

    trade_id: str
    reason: str


def holdings(
    entitlements: Mapping[str, Mapping[str, float]],
    trades: Sequence[Trade],
) -> dict[str, dict[str, float]]:
    """Each user's GPUs per generation: entitlement plus net trades.

    Args:
        entitlements: User -> generation -> fair share (untraded).
        trades: Active trades.

    Returns:
        User -> generation -> GPUs held.
    """
    out = {u: dict(e) for u, e in entitlements.items()}
    for t in trades:
        b = out.setdefault(t.buyer, {})
        s = out.setdefault(t.seller, {})
        b[t.fast_type] = b.get(t.fast_type, 0.0) + t.fast_gpus
        b[t.slow_type] = b.get(t.slow_type, 0.0) - t.slow_gpus
        s[t.fast_type] = s.get(t.fast_type, 0.0) - t.fast_gpus
        s[t.slow_type] = s.get(t.slow_type, 0.0) + t.slow_gpus
    return out


def progress_rate(held: Mapping[str, float], rates: Mapping[str, float]) -> float:
    """A user's aggregate progress: GPUs held on each generation times its rate there."""
    return sum(n * rates.get(g, 0.0) for g, n in held.items())


def trade_gains(trade: Trade, rates: Mapping[str, Mapping[str, float]]) -> tuple[float, float]:
    """(buyer gain, seller gain) of a trade under ``rates``, in progress units."""
    rb = rates.get(trade.buyer, {})
    rs = rates.get(trade.seller, {})
    buyer = trade.fast_gpus * rb.get(trade.fast_type, 0.0) - trade.slow_gpus * rb.get(trade.slow_type, 0.0)
    seller = trade.slow_gpus * rs.get(trade.slow_type, 0.0) - trade.fast_gpus * rs.get(trade.fast_type, 0.0)
    return buyer, seller


def homogeneous_user(
    sizes: Sequence[int],
    job_rates: Sequence[Mapping[str, float]],
    *,
    tolerance: float = 0.1,
) -> bool:
    """Whether a user's jobs are homogeneous enough to trade (Gandiva_fair §3.4).

    The paper trades only for users whose jobs are one job copied (a sweep). Rule
    (the paper gives none): every job has the same gang size, and on each generation
    the measured per-GPU rates of the user's jobs that have one lie within a factor
    ``1 + tolerance`` of each other (largest ≤ (1 + tolerance) × smallest).

    Args:
        sizes: Gang size of each of the user's (unpinned) jobs.
        job_rates: Per job, generation -> its measured per-GPU rate there.
        tolerance: Relative spread of measured rates still counted as one job type.

    Returns:
        True when the user may trade (False for a user with no job).
    """
    if not sizes or len(set(sizes)) > 1:
        return False
    gens = {g for r in job_rates for g in r}
    for g in gens:
        values = [r[g] for r in job_rates if g in r]
        if min(values) <= 0 or max(values) > (1.0 + tolerance) * min(values) + 1e-12:
            return False
    return True


def undo_trades(
    entitlements: Mapping[str, Mapping[str, float]],
    trades: Sequence[Trade],
    rates: Mapping[str, Mapping[str, float]],
    *,
    undo_tolerance: float = 0.05,
) -> tuple[list[Trade], list[Undo]]:
    """Decide which trades must be undone (§3.5: on arrivals, departures, drift).

    Args:
        entitlements: User -> generation -> untraded fair share, for active users.
        trades: Active trades, oldest first.
        rates: User -> generation -> progress per GPU (current profile).
        undo_tolerance: A trade is kept while its buyer's loss under current rates
            is at most this fraction of the value it paid; a seller's loss of any
            size undoes it (no trade leaves its seller worse off).

    Returns:
        (trades kept, oldest first; trades undone, with reasons).
    """
    kept: list[Trade] = []
    undone: list[Undo] = []
    for t in trades:
        if t.buyer not in entitlements or t.seller not in entitlements:
            undone.append(Undo(trade_id=t.trade_id, reason="user departed"))
            continue
        gb, gs = trade_gains(t, rates)
        rb, rs = rates.get(t.buyer, {}), rates.get(t.seller, {})
        paid_b = t.slow_gpus * rb.get(t.slow_type, 0.0)
        paid_s = t.fast_gpus * rs.get(t.fast_type, 0.0)
        if not rb or not rs or gb < -undo_tolerance * paid_b or gs < -1e-9 * max(paid_s, 1.0):
            undone.append(Undo(trade_id=t.trade_id, reason="no longer beneficial"))
            continue
        kept.append(t)
    # Entitlements shrank (arrival, departure): the newest trades giving away GPUs
    # a user no longer has are undone first.
    while True:
        held = holdings(entitlements, kept)
        short = next(
            ((u, g) for u in sorted(held) for g in sorted(held[u]) if held[u][g] < -1e-9),
            None,
        )
        if short is None:
            break
        user, gen = short
        for i in range(len(kept) - 1, -1, -1):
            t = kept[i]
            if (t.seller == user and t.fast_type == gen) or (t.buyer == user and t.slow_type == gen):
                undone.append(Undo(trade_id=t.trade_id, reason=f"{user} needs its {gen} GPUs back"))
                del kept[i]
                break
        else:  # pragma: no cover - a negative holding always comes from a trade
            break
    return kept, undone


def _price_terms(
    price: float,
    s_buyer: float,
    s_seller: float,
    max_fast: int,
    max_slow: int,
    seller_room: float,
    max_fast_per_trade: int,
    tol: float,
) -> tuple[int, int] | None:
    """Smallest whole-GPU terms (n fast, m slow) close to ``price`` that both accept."""
    for n in range(1, min(max_fast, max_fast_per_trade) + 1):
        m = round(n * price)
        if m < 1 or m > max_slow or m - n > seller_room + 1e-9:
            continue
        realised = m / n
        if abs(realised - price) <= tol * price and s_seller <= realised <= s_buyer:
            return n, m
    return None


def _pair_order(order: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for i, fast in enumerate(order):
        for slow in reversed(order[i + 1 :]):
            pairs.append((fast, slow))
    return pairs


def trading_round(
    entitlements: Mapping[str, Mapping[str, float]],
    rates: Mapping[str, Mapping[str, float]],
    order: Sequence[str],
    trades: Sequence[Trade] = (),
    *,
    demand: Mapping[str, float] | None = None,
    min_gain: float = 0.1,
    max_trades_per_pair: int | None = None,
    max_fast_per_trade: int = 8,
    price_tolerance: float = 0.05,
    first_id: int = 0,
    _resort: bool = False,
) -> list[Trade]:
    """One round of second-price trading over every generation pair (§3.4-3.5).

    Args:
        entitlements: User -> generation -> untraded fair share.
        rates: User -> generation -> progress per GPU.
        order: Generations, newest (fastest) first.
        trades: Trades already in force (kept by :func:`undo_trades`).
        demand: User -> most GPUs the user can keep busy (no cap when absent).
        min_gain: Trade only when ``s_buyer ≥ (1 + min_gain) · s_seller``.
        max_trades_per_pair: Most trades per pair this round; ``None`` for no limit.
        max_fast_per_trade: Most fast GPUs in one trade.
        price_tolerance: Largest relative rounding of the price to whole GPUs.
        first_id: Trades are named ``trade-<first_id>``, ``trade-<first_id+1>`` …
        _resort: Re-rank bidders before every trade (the naive baseline).

    Returns:
        The new trades, in execution order.
    """
    held = holdings(entitlements, trades)
    total = {u: sum(max(v, 0.0) for v in h.values()) for u, h in held.items()}
    new: list[Trade] = []
    next_id = first_id
    for fast, slow in _pair_order(order):
        bidders = [
            (rates[u][fast] / rates[u][slow], u)
            for u in sorted(entitlements)
            if rates.get(u, {}).get(fast, 0.0) > 0 and rates[u].get(slow, 0.0) > 0
        ]
        ranked = sorted(bidders, key=lambda x: (-x[0], x[1]))
        b, s = 0, len(ranked) - 1
        made = 0
        while b < s and (max_trades_per_pair is None or made < max_trades_per_pair):
            if _resort:  # what a straightforward implementation does per trade
                ranked = sorted(
                    ((rates[u][fast] / rates[u][slow], u) for _, u in bidders), key=lambda x: (-x[0], x[1])
                )
            s_buyer, buyer = ranked[b]
            s_seller, seller = ranked[s]
            if s_buyer < (1.0 + min_gain) * s_seller:
                break  # ranked: no remaining pair gains enough
            seller_fast = int(held[seller].get(fast, 0.0) + 1e-9)
            if seller_fast < 1:
                s -= 1
                continue
            price = ranked[b + 1][0] if b + 1 < s else (s_buyer + s_seller) / 2.0
            price = min(max(price, s_seller), s_buyer)
            buyer_slow = int(held[buyer].get(slow, 0.0) + 1e-9)
            # The seller gets m slow GPUs for n fast ones; it must keep them all busy.
            room = demand[seller] - total[seller] if demand is not None and seller in demand else float("inf")
            terms = _price_terms(
                price, s_buyer, s_seller, seller_fast, buyer_slow, room, max_fast_per_trade, price_tolerance
            )
            if terms is None:
                # Blame the side that cannot trade: with an unlimited seller, could
                # this buyer pay this price in whole GPUs?
                relaxed = _price_terms(
                    price,
                    s_buyer,
                    0.0,
                    max_fast_per_trade,
                    buyer_slow,
                    float("inf"),
                    max_fast_per_trade,
                    price_tolerance,
                )
                if relaxed is None:
                    b += 1  # this buyer cannot pay at this price
                else:
                    s -= 1  # this seller cannot sell on these terms
                continue
            n, m = terms
            trade = Trade(
                trade_id=f"trade-{next_id}",
                buyer=buyer,
                seller=seller,
                fast_type=fast,
                slow_type=slow,
                fast_gpus=n,
                slow_gpus=m,
                price=m / n,
            )
            next_id += 1
            new.append(trade)
            made += 1
            held[buyer][fast] = held[buyer].get(fast, 0.0) + n
            held[buyer][slow] = held[buyer][slow] - m
            held[seller][fast] = held[seller][fast] - n
            held[seller][slow] = held[seller].get(slow, 0.0) + m
            total[buyer] += n - m
            total[seller] += m - n
    return new


def naive_trading_round(
    entitlements: Mapping[str, Mapping[str, float]],
    rates: Mapping[str, Mapping[str, float]],
    order: Sequence[str],
    trades: Sequence[Trade] = (),
    **kwargs: object,
) -> list[Trade]:
    """:func:`trading_round` re-ranking every bidder before each trade (benchmark baseline).

    Args:
        entitlements: As for :func:`trading_round`.
        rates: As for :func:`trading_round`.
        order: As for :func:`trading_round`.
        trades: As for :func:`trading_round`.
        **kwargs: Keyword options of :func:`trading_round`.

    Returns:
        The same trades as :func:`trading_round`.
    """
    return trading_round(entitlements, rates, order, trades, _resort=True, **kwargs)  # type: ignore[arg-type]

"""``shoal run trader``: the leader-elected trader as its own process.

Thin wiring: settings -> bus, clock and parameters -> :class:`TraderService`.
Trader-specific settings are read with defaults (``trader_quantum_s``, default
60 s as Gandiva_fair's quantum; ``trader_min_gain``; ``trader_max_trades_per_pair``;
``trader_undo_tolerance``) so this module works whether or not the settings
struct carries them yet. On ``stop`` the pass in progress is finished, then the
lease is released.
"""

from __future__ import annotations

import asyncio
import contextlib

from shoal import probes
from shoal.runtime import connect_bus, holder_id, make_clock
from shoal.settings import Settings
from shoal_services.trader.service import TradeParams, TraderService


def params_from(settings: Settings) -> TradeParams:
    """The trading parameters in ``settings`` (defaults for those it lacks)."""
    d = TradeParams()
    return TradeParams(
        min_gain=float(getattr(settings, "trader_min_gain", d.min_gain)),
        max_trades_per_pair=getattr(settings, "trader_max_trades_per_pair", d.max_trades_per_pair),
        max_fast_per_trade=int(getattr(settings, "trader_max_fast_per_trade", d.max_fast_per_trade)),
        price_tolerance=float(getattr(settings, "trader_price_tolerance", d.price_tolerance)),
        undo_tolerance=float(getattr(settings, "trader_undo_tolerance", d.undo_tolerance)),
    )


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the trader until ``stop`` is set."""
    clock = make_clock(settings)
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, "trader")
        resources.push_async_callback(bus.close)
        service = TraderService(
            bus,
            holder=holder_id("trader"),
            clock=clock,
            quantum_s=float(getattr(settings, "trader_quantum_s", 60.0)),
            params=params_from(settings),
            lease_ttl_s=settings.lease_ttl_s,
        )
        probes.watch(bus=bus, projection=service.projection, role=lambda: service.role)
        await service.run(stop)

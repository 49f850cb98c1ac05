"""``shoal run allocator``: the leader-elected allocator as its own process.

The policy is ``settings.policy`` with ``settings.policy_params``, built through
:func:`shoal.policies.registry.get_policy`; an unknown name, a policy whose module is
missing, or parameters it does not accept stop the process at start with a clear
message. Several allocators may run: one holds the lease and decides, the others
follow the log and take over when it lapses. On ``stop`` the current decision is
finished and published, then the lease is released so a standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from shoal import probes
from shoal.runtime import StartupError, connect_bus, holder_id, make_clock
from shoal.settings import Settings
from shoal_services.allocator.service import AllocatorService


def load_policy(settings: Settings) -> Any:
    """The configured policy instance.

    Raises:
        StartupError: the registry or the policy cannot be loaded, or rejects the parameters.
    """
    try:
        from shoal.policies.registry import get_policy
    except Exception as exc:  # the registry itself is broken or missing
        raise StartupError(f"the policy registry cannot be imported: {exc!r}") from None
    try:
        return get_policy(settings.policy, **settings.policy_params)
    except (ValueError, TypeError, ImportError) as exc:
        raise StartupError(f"policy {settings.policy!r}: {exc}") from None


def load_catalog(settings: Settings) -> Any:
    """The throughput-model catalog, or None when ``settings.catalog`` is empty.

    Raises:
        StartupError: unknown catalog name.
    """
    if not settings.catalog:
        return None
    from shoal.models import get_catalog

    try:
        return get_catalog(settings.catalog)
    except (KeyError, ValueError) as exc:
        raise StartupError(f"catalog {settings.catalog!r}: {exc}") from None


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run the allocator until ``stop`` is set."""
    policy = load_policy(settings)
    catalog = load_catalog(settings)
    clock = make_clock(settings)
    async with contextlib.AsyncExitStack() as resources:
        bus = await connect_bus(settings, "allocator")
        resources.push_async_callback(bus.close)
        service = AllocatorService(
            bus,
            policy,
            holder=holder_id("allocator"),
            clock=clock,
            lease_ttl_s=settings.lease_ttl_s,
            catalog=catalog,
            network_packing=settings.network_packing,
            node_timeout_s=settings.node_timeout_s,
            heartbeat_s=settings.heartbeat_s,
            tick_origin=settings.clock_origin or 0.0,
            snapshot_every=settings.snapshot_every,
            snapshot_interval_s=settings.snapshot_interval_s,
        )
        probes.watch(bus=bus, projection=service.projection, role=lambda: service.role)
        await service.run(stop)

"""shoal: an elastic, fair, heterogeneity-aware scheduler for deep-learning training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from shoal.client import Client, CommandError
    from shoal.events import JobSpec

__all__ = ["Client", "CommandError", "JobSpec"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import shoal` stays free of the NATS client until the SDK is used.
    if name in ("Client", "CommandError"):
        from shoal import client

        return getattr(client, name)
    if name == "JobSpec":
        from shoal.events import JobSpec

        return JobSpec
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")

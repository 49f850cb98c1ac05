"""shoal: an elastic, fair, heterogeneity-aware scheduler for deep-learning training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def _use_native_build() -> None:
    """A compiled build of the hot modules, when one was made from these very sources
    (``shoal native build``; :mod:`shoal.native`). Only a file check without one."""
    import os

    where = os.environ.get("SHOAL_NATIVE_DIR") or os.path.join(os.path.dirname(__file__), "_native")
    if os.environ.get("SHOAL_NATIVE", "1") != "0" and os.path.isfile(os.path.join(where, "manifest.json")):
        from shoal.native import activate

        activate()


_use_native_build()

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

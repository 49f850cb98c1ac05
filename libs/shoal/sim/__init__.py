"""Discrete-event simulator: the shared fold and policies driven in virtual time.

See :mod:`shoal.sim.engine` for the modelling choices, :mod:`shoal.sim.costs` for the
reconfiguration cost model and :mod:`shoal.sim.metrics` for the metrics.
"""

from shoal.sim.costs import PRESETS, ReconfigCosts, get_costs
from shoal.sim.engine import (
    JobOutcome,
    SimConfig,
    SimResult,
    SimulationStalled,
    Simulator,
    make_policy,
    simulate,
)
from shoal.sim.log import InMemoryLog, VirtualClock

__all__ = [
    "PRESETS",
    "InMemoryLog",
    "JobOutcome",
    "ReconfigCosts",
    "SimConfig",
    "SimResult",
    "SimulationStalled",
    "Simulator",
    "VirtualClock",
    "get_costs",
    "make_policy",
    "simulate",
]

"""Discrete-event simulator: the shared fold and policies driven in virtual time.

See :mod:`shoal.sim.engine` for the modelling choices, :mod:`shoal.sim.costs` for the
reconfiguration cost model, :mod:`shoal.sim.metrics` for the metrics,
:mod:`shoal.sim.report` for ``results.json``, :mod:`shoal.sim.matrix` and
:mod:`shoal.sim.compare` for policy × trace matrices, :mod:`shoal.sim.plots` for the
figures.
"""

from shoal.sim.costs import PRESETS, ReconfigCosts, get_costs
from shoal.sim.engine import (
    PROFILING_MODES,
    JobOutcome,
    SimConfig,
    SimResult,
    SimulationStalled,
    Simulator,
    make_policy,
    parse_cluster,
    simulate,
)
from shoal.sim.log import InMemoryLog, VirtualClock
from shoal.sim.metrics import Series, UserShares

__all__ = [
    "PRESETS",
    "PROFILING_MODES",
    "InMemoryLog",
    "JobOutcome",
    "ReconfigCosts",
    "Series",
    "SimConfig",
    "SimResult",
    "SimulationStalled",
    "Simulator",
    "UserShares",
    "VirtualClock",
    "get_costs",
    "make_policy",
    "parse_cluster",
    "simulate",
]

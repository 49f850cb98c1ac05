"""Gandiva_fair (EuroSys'20) as pure library code.

Modules: :mod:`.shares` (ticket-weighted water-filling, bonus tickets),
:mod:`.stride` (gang-aware stride, Algorithm 1, and lottery with backfilling),
:mod:`.split_stride` (central + per-server schedulers, §3.1 Figure 3),
:mod:`.balance` (eqs. (1)-(3), placement, migration, packing, §3.2-3.3),
:mod:`.hetero` (Algorithm 2, per-generation profiling, §3.4-3.5),
:mod:`.trader` (second-price GPU trading, §3.4-3.5),
:mod:`.policy` (the :class:`~shoal.policies.base.Policy` adapter),
:mod:`.workloads` (the §5.4-5.5 users and a Philly slice with synthetic users) and
:mod:`.timeline` (per-user shares, fair shares and normalised progress read back
from a simulation log). The heterogeneity-aware AFS built on these ideas is
:class:`shoal.policies.afs_hetero.HeteroAFS`.
"""

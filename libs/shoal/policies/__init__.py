"""Allocation policies (pure). See :mod:`shoal.policies.base` for the interface."""

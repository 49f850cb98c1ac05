"""Tests of the allocation policies."""

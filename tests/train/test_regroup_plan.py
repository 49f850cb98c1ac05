"""Which plan a survivor regroups into after a peer died (approximate recovery, EDL §4.2).

The race this pins down came from CI: rank 0 of the survivors switched, the allocator's
give-back scale-out (a plan with a joiner) reached the slower survivor while it still
waited for its regrouping plan, and it adopted the scale-out instead. The two survivors
then all-reduced in different groups and both failed.
"""

from __future__ import annotations

from shoal.train import protocol as pr
from shoal.train.runtime import _Pending, _regroup_plan


def _plan(gen: int, members: tuple[int, ...], *, built: bool = True, cold: bool = False) -> _Pending:
    p = _Pending(pr.Plan(gen=gen, members=members, cold=cold, store_host="127.0.0.1", store_port=1))
    if built:
        p.built.set()
    return p


def test_the_regrouping_plan_is_taken_even_when_a_scale_out_came_after_it() -> None:
    pending = {2: _plan(2, (0, 1)), 3: _plan(3, (0, 1, 3))}
    chosen = _regroup_plan(pending, gen=1, members=(0, 1, 2), worker=1)
    assert chosen is pending[2]


def test_a_built_scale_out_is_not_adopted_while_the_regrouping_plan_builds() -> None:
    pending = {2: _plan(2, (0, 1), built=False), 3: _plan(3, (0, 1, 3))}
    assert _regroup_plan(pending, gen=1, members=(0, 1, 2), worker=1) is None
    pending[2].built.set()
    assert _regroup_plan(pending, gen=1, members=(0, 1, 2), worker=1) is pending[2]


def test_aborted_cold_older_and_foreign_plans_are_passed_over() -> None:
    aborted = _plan(2, (0, 1))
    aborted.aborted = True
    pending = {
        1: _plan(1, (0, 1)),  # not newer than the generation the worker is in
        2: aborted,
        3: _plan(3, (0, 1), cold=True),
        4: _plan(4, (0, 2)),  # without this worker
        5: _plan(5, (0, 1)),
    }
    assert _regroup_plan(pending, gen=1, members=(0, 1, 2), worker=1) is pending[5]


def test_nothing_yet_means_wait() -> None:
    assert _regroup_plan({}, gen=1, members=(0, 1, 2), worker=1) is None

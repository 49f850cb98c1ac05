"""Fair shares by water-filling: the paper's §2.1, §5.1, §5.2 and §5.4 numbers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from shoal.fairness.shares import (
    effective_tickets,
    fair_shares,
    fair_shares_by_generation,
    fair_shares_newest_first,
    spill_leftover,
)

EQUAL = {"U1": 100.0, "U2": 100.0, "U3": 100.0, "U4": 100.0}


def test_section_2_1_user_with_small_demand_gives_bonus_to_others() -> None:
    # Two 4-GPU servers; A and B have two 2-GPU jobs each, C one 2-GPU job.
    shares = fair_shares({"A": 1, "B": 1, "C": 1}, {"A": 4, "B": 4, "C": 2}, 8)
    assert shares == pytest.approx({"A": 3.0, "B": 3.0, "C": 2.0})


def test_section_5_1_three_users_on_four_v100() -> None:
    # U1: 4 x 1-GPU, U2: 4 x 2-GPU, U3: 4 x 4-GPU, 100 tickets each.
    shares = fair_shares({u: 100.0 for u in ("U1", "U2", "U3")}, {"U1": 4, "U2": 8, "U3": 16}, 4)
    assert shares == pytest.approx({"U1": 4 / 3, "U2": 4 / 3, "U3": 4 / 3})
    assert round(shares["U1"], 2) == 1.33


def test_section_5_2_three_users_on_eight_p100() -> None:
    # U1: one 8-GPU job, U2: 2 x 2-GPU, U3: 4 x 1-GPU.
    shares = fair_shares({u: 100.0 for u in ("U1", "U2", "U3")}, {"U1": 8, "U2": 4, "U3": 4}, 8)
    assert shares == pytest.approx({u: 8 / 3 for u in ("U1", "U2", "U3")})
    # After U1's job finishes, U2 and U3 get 4 each.
    assert fair_shares(EQUAL, {"U2": 4, "U3": 4}, 8) == pytest.approx({"U2": 4.0, "U3": 4.0})


def test_section_5_4_heterogeneous_shares_and_departure() -> None:
    gpus = {"v100": 12, "p100": 24, "k80": 64}
    # Four users x 150 jobs of 1, 2, 4 and 1 GPUs: demand exceeds every generation.
    demand = {"U1": 150, "U2": 300, "U3": 600, "U4": 150}
    per_gen = fair_shares_by_generation(EQUAL, {u: dict.fromkeys(gpus, d) for u, d in demand.items()}, gpus)
    for user in demand:
        assert per_gen[user] == pytest.approx({"v100": 3.0, "p100": 6.0, "k80": 16.0})
    newest = fair_shares_newest_first(EQUAL, demand, gpus, ("v100", "p100", "k80"))
    for user in demand:
        assert newest[user] == pytest.approx(per_gen[user])
    # U1 leaves: about 4 + 8 + 21.3 each.
    del demand["U1"]
    after = fair_shares_newest_first(EQUAL, demand, gpus, ("v100", "p100", "k80"))
    for user in demand:
        assert after[user] == pytest.approx({"v100": 4.0, "p100": 8.0, "k80": 64 / 3})
        assert round(after[user]["k80"], 1) == 21.3


def test_newest_first_serves_small_user_on_newest_generation() -> None:
    gpus = {"v100": 8, "k80": 8}
    shares = fair_shares_newest_first({"a": 1, "b": 1}, {"a": 2, "b": 100}, gpus, ("v100", "k80"))
    assert shares["a"] == pytest.approx({"v100": 2.0, "k80": 0.0})
    assert shares["b"] == pytest.approx({"v100": 6.0, "k80": 8.0})


def test_tickets_weight_the_shares_and_zero_tickets_get_nothing() -> None:
    shares = fair_shares({"a": 300, "b": 100, "c": 0}, {"a": 10, "b": 10, "c": 10}, 8)
    assert shares == pytest.approx({"a": 6.0, "b": 2.0, "c": 0.0})


def test_effective_tickets_reproduce_the_shares() -> None:
    tickets = {"A": 100.0, "B": 100.0, "C": 100.0}
    demand = {"A": 4.0, "B": 4.0, "C": 2.0}
    eff = effective_tickets(tickets, demand, 8)
    # C's unused tickets become bonus tickets of A and B.
    assert eff["A"] == pytest.approx(112.5)
    assert eff["C"] == pytest.approx(75.0)
    total = sum(eff.values())
    assert {u: 8 * t / total for u, t in eff.items()} == pytest.approx(fair_shares(tickets, demand, 8))


@given(
    st.dictionaries(
        st.text("abcdef", min_size=1, max_size=3),
        st.tuples(st.integers(0, 500), st.integers(0, 40)),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 100),
)
def test_water_filling_properties(users: dict[str, tuple[int, int]], capacity: int) -> None:
    tickets = {u: float(t) for u, (t, _) in users.items()}
    demand = {u: float(d) for u, (_, d) in users.items()}
    shares = fair_shares(tickets, demand, capacity)
    eligible = [u for u in users if tickets[u] > 0 and demand[u] > 0]
    assert sum(shares.values()) <= capacity + 1e-9
    for u in users:
        assert -1e-9 <= shares[u] <= demand[u] + 1e-9
    # Work conserving: either everyone eligible is satisfied or the capacity is used up.
    if any(shares[u] < demand[u] - 1e-9 for u in eligible):
        assert sum(shares.values()) == pytest.approx(capacity)
    # Max-min by tickets: an unsatisfied user's share per ticket is the largest.
    for u in eligible:
        if shares[u] < demand[u] - 1e-9:
            for v in eligible:
                assert shares[v] / tickets[v] <= shares[u] / tickets[u] + 1e-9


def test_pinned_demand_counts_only_on_its_generation() -> None:
    gpus = {"v100": 4, "k80": 8}
    shares = fair_shares_newest_first(
        {"a": 1, "b": 1}, {"a": 0, "b": 100}, gpus, ("v100", "k80"), pinned={"a": {"k80": 6}}
    )
    assert shares["a"] == pytest.approx({"v100": 0.0, "k80": 4.0})
    assert shares["b"] == pytest.approx({"v100": 4.0, "k80": 4.0})


def test_spill_hands_out_what_newest_first_left_idle() -> None:
    gpus = {"v100": 4, "k80": 8}
    tickets = {"a": 100.0, "b": 100.0}
    # a: one 4-GPU gang; b: two 1-GPU jobs. Newest first: 2 + 2 V100, then a 2 K80.
    newest = fair_shares_newest_first(tickets, {"a": 4, "b": 2}, gpus, ("v100", "k80"))
    assert newest == {"a": {"v100": 2.0, "k80": 2.0}, "b": {"v100": 2.0, "k80": 0.0}}
    usable = {"a": dict.fromkeys(gpus, 4.0), "b": dict.fromkeys(gpus, 2.0)}
    spilled = spill_leftover(newest, tickets, usable, gpus)
    # 6 idle K80s: a may take 2 more (its gang fits there whole), b 2.
    assert spilled == {"a": {"v100": 2.0, "k80": 4.0}, "b": {"v100": 2.0, "k80": 2.0}}
    # Nothing is left over when demand exceeds every generation (§5.4): unchanged.
    demand = {u: 150.0 for u in EQUAL}
    full = fair_shares_newest_first(EQUAL, demand, {"v100": 12, "k80": 64}, ("v100", "k80"))
    usable_full = {u: {"v100": 150.0, "k80": 150.0} for u in EQUAL}
    assert spill_leftover(full, EQUAL, usable_full, {"v100": 12, "k80": 64}) == full

"""Algorithm 2 generation choice, opportunistic profiling, pinning (§3.4-3.5)."""

from __future__ import annotations

import pytest
from shoal.fairness.hetero import (
    best_generation_move,
    choose_generation,
    generation_order,
    profiled_rate,
    record_sample,
    user_progress,
)

ORDER = ("v100", "k80")


def test_generation_order_is_newest_first() -> None:
    assert generation_order(["k80", "V100", "p100"]) == ("V100", "p100", "k80")
    assert generation_order(["x", "k80", "a"]) == ("k80", "a", "x")
    assert generation_order(["old", "new"], rank={"old": 1, "new": 2}) == ("new", "old")


def test_unprofiled_jobs_start_on_newest_generation_until_share_is_used() -> None:
    ent = {"v100": 4.0, "k80": 4.0}
    load: dict[str, float] = {}
    chosen = []
    for _ in range(6):
        g = choose_generation(1, ORDER, ent, load)
        assert g is not None
        chosen.append(g)
        load[g] = load.get(g, 0.0) + 1
    assert chosen == ["v100"] * 4 + ["k80"] * 2


def assign(rates: dict[str, float], jobs: int) -> dict[str, int]:
    ent = {"v100": 4.0, "k80": 4.0}
    load: dict[str, float] = {}
    for _ in range(jobs):
        g = choose_generation(1, ORDER, ent, load, rates)
        assert g is not None
        load[g] = load.get(g, 0.0) + 1
    return {g: int(n) for g, n in load.items()}


def test_section_3_4_vae_example_splits_jobs_between_generations() -> None:
    # Share 4 V100 + 4 K80, 8 jobs, VAE 1.25x on V100: 4 run on V100, 4 on K80.
    assert assign({"v100": 1.25, "k80": 1.0}, 8) == {"v100": 4, "k80": 4}
    # More jobs than the share: extras time-share where a job progresses fastest.
    assert assign({"v100": 5.0, "k80": 1.0}, 12) == {"v100": 8, "k80": 4}


def test_pinned_job_goes_to_its_generation_only() -> None:
    ent = {"v100": 4.0, "k80": 4.0}
    assert choose_generation(1, ORDER, ent, {}, pinned="k80") == "k80"
    assert choose_generation(8, ORDER, ent, {}, pinned="k80", capacity={"k80": 4, "v100": 8}) is None
    assert choose_generation(8, ORDER, ent, {}, capacity={"k80": 4, "v100": 8}) == "v100"


def test_profile_averages_recent_samples_and_adapts_to_behaviour_change() -> None:
    samples: list[float] = []
    for v in (10.0, 11.0, 9.0, 10.0, 10.0, 10.0, 10.0):
        samples = record_sample(samples, v, window=5)
    assert len(samples) == 5
    assert profiled_rate(samples) == pytest.approx((9.0 + 10.0 * 4) / 5)  # the last five only
    # One outlier is absorbed by the average …
    once = record_sample(samples, 20.0, window=5)
    assert len(once) == 5
    # … two in a row on the same side mean the job changed: the profile follows.
    twice = record_sample(once, 20.0, window=5)
    assert twice == [20.0, 20.0]
    assert profiled_rate(twice) == pytest.approx(20.0)
    assert profiled_rate([]) is None


def test_record_sample_default_confirm_agrees_with_the_general_rule() -> None:
    """The default ``confirm=2`` has a path of its own: it returns what the general rule
    (the mean of the older samples; reset when every confirming sample is past it on one
    side) returns, float for float, on edge values too."""
    import math
    import random

    def general(samples: list[float], value: float, window: int) -> list[float]:
        out = [*samples, value][-window:]
        if len(out) > 2:
            old, recent = out[:-2], out[-2:]
            mean = sum(old) / len(old)
            if mean > 0:
                high, low = mean * 1.25, mean * 0.75
                if all(r > high for r in recent) or all(r < low for r in recent):
                    return recent
        return out

    rng = random.Random(7)
    edges = [0.0, -1.0, math.nan, math.inf, 1.0, 1.25, 0.75]
    resets = 0
    for _ in range(20_000):
        window = rng.choice([1, 2, 3, 5, 8])
        samples = [
            rng.choice(edges) if rng.random() < 0.3 else rng.uniform(0, 3) for _ in range(rng.randint(0, 7))
        ]
        value = rng.choice(edges) if rng.random() < 0.3 else rng.uniform(0, 3)
        want = general(samples, value, window)
        got = record_sample(samples, value, window=window)
        assert repr(got) == repr(want), (samples, value, window)
        resets += len(want) == 2 < min(window, len(samples) + 1)
    assert resets > 0  # the reset branch was taken


def test_migration_picks_largest_gain_and_profiles_unknown_generation() -> None:
    users = {
        # 8 VAE jobs all time-sharing 4 V100s while 4 K80s of share sit unused.
        "vae": ({"v100": 4.0, "k80": 4.0}, {"v100": 8.0}, {"v100": 1.25, "k80": 1.0}),
        "dcgan": ({"v100": 4.0, "k80": 4.0}, {"v100": 4.0, "k80": 4.0}, {"v100": 5.0, "k80": 1.0}),
    }
    movable = {"vae": {"v100": [1] * 8}, "dcgan": {"v100": [1] * 4, "k80": [1] * 4}}
    move = best_generation_move(users, movable, ORDER)
    assert move is not None and (move.user, move.source, move.target) == ("vae", "v100", "k80")
    ent, load, rates = users["vae"]
    assert move.gain == pytest.approx(
        (user_progress(ent, {"v100": 7.0, "k80": 1.0}, rates) - user_progress(ent, load, rates))
        / user_progress(ent, load, rates)
    )
    # Unprofiled on K80 and time-shared on V100: move one job to profile it.
    unprofiled = {"new": ({"v100": 4.0, "k80": 4.0}, {"v100": 8.0}, {"v100": 2.0})}
    move = best_generation_move(unprofiled, {"new": {"v100": [1] * 8}}, ORDER)
    assert move is not None and move.target == "k80" and move.gain == float("inf")
    # Balanced users: nothing to do.
    assert best_generation_move({"dcgan": users["dcgan"]}, {"dcgan": movable["dcgan"]}, ORDER) is None

"""The elastic sampler: each sample exactly once per data epoch under any sequence of resizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.train.config import TrainConfig
from shoal.train.data import ElasticSampler, Scaling, split


@given(
    size=st.integers(1, 300),
    batch=st.integers(1, 64),
    worlds=st.lists(st.integers(1, 8), min_size=1, max_size=60),
    seed=st.integers(0, 3),
)
@settings(max_examples=150, deadline=None)
def test_each_sample_once_per_epoch_whatever_the_resizes(size, batch, worlds, seed) -> None:
    sampler = ElasticSampler(size, Scaling(global_batch_size=batch), seed=seed)
    seen: dict[int, list[int]] = {}
    steps = 0
    while sampler.data_epoch < 2:
        world = worlds[steps % len(worlds)]
        parts = [sampler.local_indices(world, r) for r in range(world)]
        glob = sampler.global_indices(world)
        assert np.array_equal(np.concatenate(parts), glob)
        assert len(glob) == min(batch, size - sampler.cursor)
        seen.setdefault(sampler.data_epoch, []).extend(glob.tolist())
        sampler.advance(len(glob))
        steps += 1
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(size))


def test_strong_scaling_keeps_the_global_batch_and_splits_it() -> None:
    s = Scaling(global_batch_size=64)
    assert [s.global_batch(w) for w in (1, 2, 3, 4)] == [64, 64, 64, 64]
    assert [split(64, 3, r) for r in range(3)] == [(0, 22), (22, 43), (43, 64)]
    assert split(2, 4, 3) == (2, 2)  # a rank can get nothing at an epoch's tail


def test_weak_scaling_within_a_range() -> None:
    s = Scaling(mode="weak", per_worker_batch=16, weak_min=2, weak_max=4)
    assert [s.global_batch(w) for w in (1, 2, 3, 4, 8)] == [32, 32, 48, 64, 64]


def test_state_round_trip_and_bad_input() -> None:
    a = ElasticSampler(100, Scaling(global_batch_size=30), seed=3)
    a.advance(30)
    b = ElasticSampler(100, Scaling(global_batch_size=30), seed=3)
    b.load_state(a.state())
    assert np.array_equal(a.global_indices(2), b.global_indices(2))
    with pytest.raises(ValueError, match="seed 4 does not match"):
        ElasticSampler(100, Scaling(global_batch_size=30), seed=4).load_state(a.state())
    with pytest.raises(ValueError, match="cannot advance by 80"):
        a.advance(80)
    with pytest.raises(ValueError, match="scaling mode"):
        Scaling(mode="linear")
    with pytest.raises(ValueError, match="per_worker_batch"):
        Scaling(mode="weak")
    with pytest.raises(ValueError, match="dataset_size"):
        ElasticSampler(0, Scaling())
    with pytest.raises(ValueError, match="rank 4 outside world of 4"):
        split(10, 4, 4)


def test_config_from_env_and_errors() -> None:
    cfg = TrainConfig.from_env({"SHOAL_TRAIN_CONTROL": "h:1", "SHOAL_TRAIN_WORKER": "3", "OTHER": "x"})
    assert (cfg.control, cfg.worker) == ("h:1", 3)
    assert TrainConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ValueError, match="SHOAL_TRAIN_"):
        TrainConfig.from_env({"SHOAL_TRAIN_WORKER": "three"})
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        TrainConfig.from_env({"SHOAL_TRAIN_DEVICE": "tpu"})
    with pytest.raises(ValueError, match="host:port"):
        TrainConfig.from_env({"SHOAL_TRAIN_CONTROL": "nohost"})

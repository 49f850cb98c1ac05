"""The per-user share series: sparse sampling gives the dense series it stands for."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from shoal.sim.metrics import UserShares

_KEYS = [(u, g) for u in ("a", "b", "c") for g in ("k80", "v100")]


@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # time step (0: the same instant as the previous sample)
            st.dictionaries(st.sampled_from(_KEYS), st.integers(1, 8), max_size=4),
        ),
        max_size=25,
    )
)
@settings(max_examples=300, deadline=None)
def test_sparse_samples_pad_to_the_dense_series(samples) -> None:  # type: ignore[no-untyped-def]
    shares = UserShares()
    t = 0.0
    times: list[float] = []
    dense: list[dict[tuple[str, str], int]] = []
    for step, held in samples:
        t += step
        shares.add(t, held)
        if times and times[-1] == t:
            dense[-1] = dict(held)
        else:
            times.append(t)
            dense.append(dict(held))
    shares.pad()
    assert shares.t == times
    seen = {key for _, held in samples for key in held}  # even if a later sample at its instant replaced it
    expected: dict[str, dict[str, list[int]]] = {}
    for user, gpu_type in sorted(seen):
        expected.setdefault(user, {})[gpu_type] = [held.get((user, gpu_type), 0) for held in dense]
    assert shares.gpus == expected

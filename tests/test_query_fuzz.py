"""Fuzz admission's read endpoint's parsing and slicing (:mod:`shoal.queries`): whatever
a reader sends, the request either decodes to a :class:`~shoal.queries.Query` or raises
the msgspec errors admission answers with ``bad_query``; and every query that decodes,
for every kind of read, slices a real folded state and encodes its reply. So no request
a reader can send ends in admission's catch-all ``internal`` answer."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from shoal import codec, queries
from shoal import events as ev
from shoal import state as st

_SCALARS = (
    hs.none()
    | hs.booleans()
    | hs.integers(min_value=-(2**70), max_value=2**70)
    | hs.floats(allow_nan=True, allow_infinity=True)
    | hs.text(max_size=20)
)
_VALUES = hs.recursive(_SCALARS, lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(hs.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip
_FIELDS = ("min_seq", "wait_s", "job_id", "user", "statuses", "active")
_QUERY_LIKE = hs.dictionaries(hs.sampled_from(_FIELDS) | hs.text(max_size=8), _VALUES, max_size=6)


@cache
def _state() -> st.ClusterState:
    """A small real history: a node, three jobs of two users (one running, one done,
    one cancelled), a decision and its placement."""
    gpus = tuple(ev.GpuInfo(index=i, gpu_type="V100") for i in range(4))
    spec = ev.JobSpec(user="alice", min_gpus=1, max_gpus=2, requested_gpus=2, total_iterations=100)
    events: list[ev.Event] = [
        ev.NodeRegistered(node_id="n1", gpus=gpus),
        ev.JobSubmitted(job_id="j1", spec=spec),
        ev.JobSubmitted(job_id="j2", spec=spec),
        ev.JobSubmitted(job_id="j3", spec=ev.JobSpec(user="bob", total_iterations=5)),
        ev.SharesDecided(epoch=1, shares={"j1": 2, "j2": 1}),
        ev.PlacementDecided(
            epoch=1, placements={"j1": (ev.GpuRef("n1", 0), ev.GpuRef("n1", 1)), "j2": (ev.GpuRef("n1", 2),)}
        ),
        ev.JobCompleted(job_id="j2", iterations=100),
        ev.JobCancelled(job_id="j3", reason="no"),
    ]
    return st.fold([codec.wrap(e, at=1000.0 + i) for i, e in enumerate(events)])


def _answer_or_bad_query(data: bytes, *, as_json: bool) -> None:
    try:
        query = queries.decode_query(data, json=as_json)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # admission answers bad_query
    assert isinstance(query, queries.Query)
    for what in queries.WHATS:
        reply = queries.ViewReply(seq=8, state=queries.slice_state(_state(), what, query))
        back = queries.decode_reply(queries.encode_reply(reply, json=as_json), json=as_json)
        assert back.seq == 8 and back.state is not None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hs.binary(max_size=200))
def test_any_bytes_decode_to_a_query_or_a_bad_query(data: bytes) -> None:
    _answer_or_bad_query(data, as_json=False)
    _answer_or_bad_query(data, as_json=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_QUERY_LIKE)
def test_query_shaped_json_and_msgpack_answer_or_are_bad_queries(body: dict[str, Any]) -> None:
    _answer_or_bad_query(json.dumps(body, allow_nan=True).encode(), as_json=True)
    try:
        packed = msgspec.msgpack.encode(body)
    except OverflowError:  # msgpack has no integer past 64 bits: a reader cannot send one
        return
    _answer_or_bad_query(packed, as_json=False)


def test_the_fuzz_reaches_every_filter() -> None:
    """The filters the fuzz drives do select: a query for alice's active jobs answers j1 only."""
    query = queries.decode_query(b'{"user": "alice", "active": true}', json=True)
    assert list(queries.slice_state(_state(), "jobs", query).jobs) == ["j1"]

"""Reads from a materialised view: the contract of the query endpoint (pure).

``shoal jobs``, ``status`` and ``nodes`` (and the SDK's ``jobs()``, ``status()``,
``nodes()``, ``state()``) ask the admission service for a slice of the cluster state
it already keeps folded (its :class:`~shoal.projection.Projection`), instead of
replaying the whole event log in every client: a replay costs time in proportion to
the log (seconds at 10^5 events), a query costs time in proportion to the answer.

Why a query endpoint and not a KV projection: admission already holds the whole
folded state in memory, current to the last event, so answering from it writes
nothing and adds no second copy of the state that could drift from the log; a KV
projection would need a writer that rewrites keys on every event (progress reports
arrive many times a second) and a reader would still have to assemble jobs, nodes
and placements from many keys read at different sequences. A request also carries
what the reader needs to be consistent: "at least sequence N".

Protocol (NATS request/reply, queue group ``query`` so admission replicas share it):

* subject ``<prefix>.query.<what>.<sender>``, ``<what>`` one of :data:`WHATS`,
  ``<sender>`` the user the client authenticated as (``@admin`` for the admin); the
  server lets a client publish only with its own user there (:mod:`shoal.auth`);
* request: msgpack :class:`Query` (JSON when the request has the header
  ``Content-Type: application/json``; the reply is then JSON too);
* reply: :class:`ViewReply`, encoded, then cut into parts of at most the server's
  message size: each part is one message to the request's reply subject with the
  headers ``Shoal-Part`` (0-based index) and ``Shoal-Parts`` (count); the reader
  joins them in index order. One message suffices for small answers; the whole state
  of a long-running cluster is over the server's 1 MiB message limit.

``ViewReply.seq`` is the stream sequence the answer reflects: every event up to it is
folded in, none after it. With ``Query.min_seq`` the service first waits (at most
``Query.wait_s``, capped by :data:`MAX_WAIT_S`) until its projection reached that
sequence; the SDK asks for the event stream's last sequence at the time of the call,
so an answer reflects at least what a replay started at that moment would (read your
writes after a submit included). A service that cannot get there in time answers
``error="behind"``.

Who sees what: every identity may already read the whole event log (every job of
every user) through JetStream, so the view answers any identity with any job; it
reveals nothing the log does not.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shoal import state as st
from shoal.auth import QUERY_REPLY_PARTS

What = Literal["state", "jobs", "job", "nodes", "users"]
WHATS: tuple[str, ...] = ("state", "jobs", "job", "nodes", "users")

MAX_WAIT_S = 10.0
"""Longest a query waits for the projection to reach ``min_seq``."""

MAX_PARTS = QUERY_REPLY_PARTS
"""Most reply parts a query may take (64 parts of up to 1 MiB by default): the admission
identity's ``allow_responses`` permission allows this many messages per request."""

PART_HEADER = "Shoal-Part"
PARTS_HEADER = "Shoal-Parts"
QUEUE = "query"


class Query(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A read request."""

    min_seq: int = 0
    """Answer only once every event up to this stream sequence is folded in."""
    wait_s: float = 5.0
    """How long to wait for ``min_seq`` (capped by :data:`MAX_WAIT_S`)."""
    job_id: str = ""
    """``job``: the job."""
    user: str = ""
    """``jobs``: only this user's jobs (empty: every user's)."""
    statuses: tuple[str, ...] = ()
    """``jobs``: only jobs in one of these states (empty: any)."""
    active: bool = False
    """``jobs``: only jobs that have not finished."""


class ViewReply(msgspec.Struct, kw_only=True):
    """The answer: a slice of the folded state and the sequence it reflects."""

    seq: int = 0
    state: st.ClusterState | None = None
    """The slice (:func:`slice_state`); None with an error."""
    error: str = ""
    """Empty, or ``behind``, ``bad_query``, ``too_large``, ``internal``."""
    message: str = ""


_MSGPACK_ENC = msgspec.msgpack.Encoder()
_JSON_ENC = msgspec.json.Encoder()
_REPLY_MSGPACK = msgspec.msgpack.Decoder(ViewReply)
_REPLY_JSON = msgspec.json.Decoder(ViewReply)
_QUERY_MSGPACK = msgspec.msgpack.Decoder(Query)
_QUERY_JSON = msgspec.json.Decoder(Query)


def subject(prefix: str, what: str, sender: str) -> str:
    """``<prefix>.query.<what>.<sender>``."""
    return f"{prefix}.query.{what}.{sender}"


def encode_query(query: Query, *, json: bool = False) -> bytes:
    return (_JSON_ENC if json else _MSGPACK_ENC).encode(query)


def decode_query(data: bytes, *, json: bool = False) -> Query:
    """An empty request is the default query.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: not a query.
    """
    if not data:
        return Query()
    try:
        return (_QUERY_JSON if json else _QUERY_MSGPACK).decode(data)
    except UnicodeDecodeError as exc:  # msgpack: a string that is not UTF-8
        raise msgspec.DecodeError(f"a string is not valid UTF-8: {exc.reason}") from None


def encode_reply(reply: ViewReply, *, json: bool = False) -> bytes:
    return (_JSON_ENC if json else _MSGPACK_ENC).encode(reply)


def decode_reply(data: bytes, *, json: bool = False) -> ViewReply:
    return (_REPLY_JSON if json else _REPLY_MSGPACK).decode(data)


def split(data: bytes, part_size: int) -> list[bytes]:
    """``data`` in parts of at most ``part_size`` bytes (at least one part)."""
    if part_size <= 0:
        raise ValueError("part_size must be positive")
    return [data[i : i + part_size] for i in range(0, len(data), part_size)] or [b""]


def slice_state(state: st.ClusterState, what: str, query: Query) -> st.ClusterState:
    """The part of ``state`` that answers ``what`` (it shares objects with ``state``:
    encode it before ``state`` changes).

    * ``state``: all of it;
    * ``jobs``: the jobs that pass the query's filters (in submission order) and the clock;
    * ``job``: that one job (none when unknown) and the clock;
    * ``nodes``: the nodes, the placed jobs and their placements (what
      :func:`shoal.explain.node_row` reads) and the clock;
    * ``users``: the users (tickets, limits), the active jobs (what
      :func:`shoal.explain.user_rows` counts against the limits) and the clock.

    Raises:
        ValueError: an unknown ``what``.
    """
    if what == "state":
        return state
    if what == "jobs":
        statuses = set(query.statuses)
        jobs = {
            j: job
            for j, job in state.jobs.items()
            if (not query.user or job.spec.user == query.user)
            and (not statuses or job.status in statuses)
            and (not query.active or job.status not in st.FINISHED_STATUSES)
        }
        return st.ClusterState(jobs=jobs, clock=state.clock)
    if what == "job":
        job = state.jobs.get(query.job_id)
        return st.ClusterState(jobs={query.job_id: job} if job is not None else {}, clock=state.clock)
    if what == "nodes":
        return st.ClusterState(
            nodes=state.nodes,
            placed=state.placed,
            jobs={j: state.jobs[j] for j in state.placed if j in state.jobs},
            placement_epoch=state.placement_epoch,
            clock=state.clock,
        )
    if what == "users":
        return st.ClusterState(
            users=state.users,
            jobs={j: job for j, job in state.jobs.items() if job.status not in st.FINISHED_STATUSES},
            clock=state.clock,
        )
    raise ValueError(f"unknown query {what!r}; known: {', '.join(WHATS)}")

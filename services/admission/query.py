"""admission's read endpoint: slices of its folded state, answered on request.

Consumes: request/reply queries on ``<prefix>.query.<what>.<sender>`` (queue group
``query``; the protocol, the reply format and why a query endpoint rather than a KV
projection are in :mod:`shoal.queries`). Publishes nothing to the log.

Answers from the :class:`~shoal.projection.Projection` admission already keeps for
its commands, after waiting (bounded) until it reached the query's ``min_seq``. The
slice is encoded in one go, with no ``await`` between the wait and the encoding, so
an answer is the state at exactly the sequence it names.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg
from shoal import queries
from shoal.bus import Bus, Header
from shoal.projection import Projection

log = structlog.get_logger("shoal.admission.query")

JSON = "application/json"
_HEADROOM = 4096
"""Bytes of a part's message left for its subject and headers."""


class QueryService:
    """Answers :mod:`shoal.queries` requests from ``projection``'s state."""

    def __init__(self, bus: Bus, projection: Projection) -> None:
        self.bus = bus
        self.projection = projection
        self._sub: Any = None
        self.answered = 0

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(
            queries.subject(self.bus.names.prefix, "*", "*"), queue=queries.QUEUE, cb=self._on_request
        )

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.drain()
            self._sub = None

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        as_json = (msg.headers or {}).get(Header.CONTENT_TYPE.value, "").startswith(JSON)
        try:
            data = await self.answer(msg.subject.split(".")[-2], msg.data, as_json=as_json)
        except Exception as exc:  # never leave a reader hanging
            log.exception("query_failed", subject=msg.subject)
            data = queries.encode_reply(
                queries.ViewReply(error="internal", message=f"query failed: {exc}"), json=as_json
            )
        part_size = max(1, self.bus.nc.max_payload - _HEADROOM)
        parts = queries.split(data, part_size)
        if len(parts) > queries.MAX_PARTS:
            data = queries.encode_reply(
                queries.ViewReply(
                    error="too_large",
                    message=f"the answer has {len(data)} bytes, over {queries.MAX_PARTS} messages",
                ),
                json=as_json,
            )
            parts = [data]
        for i, part in enumerate(parts):
            headers = {queries.PART_HEADER: str(i), queries.PARTS_HEADER: str(len(parts))}
            if as_json:
                headers[Header.CONTENT_TYPE.value] = JSON
            await self.bus.nc.publish(msg.reply, part, headers=headers)
        self.answered += 1

    async def answer(self, what: str, data: bytes, *, as_json: bool = False) -> bytes:
        """The encoded :class:`~shoal.queries.ViewReply` to one query."""
        try:
            query = queries.decode_query(data, json=as_json)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return queries.encode_reply(queries.ViewReply(error="bad_query", message=str(exc)), json=as_json)
        if what not in queries.WHATS:
            return queries.encode_reply(
                queries.ViewReply(
                    error="bad_query", message=f"unknown query {what!r}; known: {', '.join(queries.WHATS)}"
                ),
                json=as_json,
            )
        projection = self.projection
        if query.min_seq > projection.last_seq:
            wait = min(max(0.0, query.wait_s), queries.MAX_WAIT_S)
            try:
                await projection.wait_for(query.min_seq, timeout_s=wait)
            except TimeoutError:
                return queries.encode_reply(
                    queries.ViewReply(
                        seq=projection.last_seq,
                        error="behind",
                        message=f"the view is at sequence {projection.last_seq}, not yet at "
                        f"{query.min_seq} after {wait:g}s",
                    ),
                    json=as_json,
                )
        # No await from here on: the slice is the state at exactly this sequence.
        reply = queries.ViewReply(
            seq=projection.last_seq, state=queries.slice_state(projection.state, what, query)
        )
        return queries.encode_reply(reply, json=as_json)

"""The Python SDK: submit and follow jobs.

    from shoal import Client, JobSpec

    async with await Client.connect("nats://127.0.0.1:4222") as client:
        job_id = await client.submit({"user": "alice", "model": "resnet50", "max_gpus": 4,
                                      "requested_gpus": 2, "total_iterations": 10_000})
        async for env in client.job_events(job_id):
            print(env.type)

Commands (``submit``, ``cancel``, ``set_tickets``, ``set_user_limits``) go to the admission service by
request/reply, which validates them and answers with the job id or a rejection;
:class:`CommandError` carries the rejection's ``code`` and one message per problem,
and a rejected command changed nothing. Reads (``jobs``, ``status``, ``nodes``,
``state``) ask admission's materialised view of the log (:mod:`shoal.queries`) for the
state as of at least the log's last event, and fold the log themselves when no view
answers (see :meth:`Client.view`).
``job_events`` replays a job's history and then follows it live.

A spec may be a :class:`~shoal.events.JobSpec` or a plain mapping of its fields (what
a YAML or JSON job file holds). A mapping with a field name that ``JobSpec`` does
not have is refused here, before anything is sent: a typo such as ``max_gpu: 8``
must not silently become the default. Everything else (types, ranges, cross-field
rules, users, limits) is checked by admission, the one place that decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from typing import Any, cast

import msgspec
import nats.errors
import nats.js.errors

from shoal import codec, queries
from shoal import events as ev
from shoal import state as st
from shoal.admin_commands import SetUserLimits
from shoal.admission import DEADLINE_HEADER
from shoal.auth import ADMIN_TOKEN, user_of_creds
from shoal.bus import Batch, Bus, Header
from shoal.ids import new_ulid

#: The fields a job spec may have (a mapping with any other key is refused).
SPEC_FIELDS: frozenset[str] = frozenset(ev.JobSpec.__struct_fields__)

_ID = re.compile(ev.whole("A-Za-z0-9_-", "{1,128}"))

_FINAL = (ev.JobCompleted, ev.JobFailed, ev.JobCancelled, ev.JobRejected)


class ReadInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Where the newest read of a :class:`Client` came from."""

    source: str
    """``view`` (admission's materialised view) or ``replay`` (folded from the log)."""
    seq: int = 0
    """The stream sequence the answer reflects."""
    reason: str = ""
    """Why it was a replay."""


class CommandError(Exception):
    """The service rejected a command (nothing changed); ``code`` says why and
    ``errors`` lists each problem."""

    def __init__(self, reply: ev.CommandRejected) -> None:
        super().__init__(f"{reply.code}: {reply.message}")
        self.code = reply.code
        self.message = reply.message
        self.errors: tuple[str, ...] = reply.errors or (reply.message,)
        """Each problem (at least one: the message when the reply listed none)."""
        self.reply = reply


class ClientError(Exception):
    """The client could not get an answer (as opposed to a rejection)."""


class NoAdmissionError(ClientError, TimeoutError):
    """No admission service answered the command."""

    job_id: str | None = None
    """For a submission: the id every attempt carried. The job may have been written
    under it; submitting again with this ``job_id`` writes it at most once."""


class NoEventLogError(ClientError):
    """The server has no event log for this prefix (nothing installed there)."""


class UnknownJobError(ClientError, KeyError):
    """No job with this id in the log."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown job"


def _rejected(code: str, message: str, errors: Iterable[str] = ()) -> CommandError:
    return CommandError(ev.CommandRejected(code=code, message=message, errors=tuple(errors) or (message,)))


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a valid id, else raise :class:`CommandError` (``invalid_job_id``)."""
    if not isinstance(job_id, str) or not _ID.match(job_id):
        raise _rejected("invalid_job_id", f"invalid job id {job_id!r}: use 1-128 letters, digits, '_' or '-'")
    return job_id


def spec_to_wire(spec: ev.JobSpec | Mapping[str, Any]) -> dict[str, Any]:
    """A spec as plain data for the wire; a mapping is checked for unknown field names.

    Raises:
        CommandError: ``invalid_spec`` for a non-mapping or an unknown field.
    """
    if isinstance(spec, ev.JobSpec):
        return msgspec.to_builtins(spec)  # type: ignore[no-any-return]
    if not isinstance(spec, Mapping):
        raise _rejected("invalid_spec", f"a job spec must be a mapping of fields, not {type(spec).__name__}")
    unknown = sorted(str(k) for k in spec if k not in SPEC_FIELDS)
    if unknown:
        errors = [f"unknown field {k!r} in job spec" for k in unknown]
        message = f"{'; '.join(errors)}; known fields: {', '.join(sorted(SPEC_FIELDS))}"
        raise _rejected("invalid_spec", message, errors)
    return dict(spec)


async def _probe(url: str, timeout_s: float) -> None:
    """Fail fast when nothing listens at ``url`` (one URL or a comma-separated seed list:
    any one server listening will do): nats-py keeps retrying a refused first connect
    (right for a service, not for a person waiting at a prompt)."""
    from urllib.parse import urlsplit

    from shoal.bus import NoServerError, server_list

    reasons = []
    for server in server_list(url) or [url]:
        parts = urlsplit(server)
        try:
            host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        except ValueError as exc:
            raise NoServerError(f"invalid NATS URL {server!r}: {exc}") from None
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except (OSError, TimeoutError) as exc:
            reasons.append(
                exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or "timed out"
            )
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    raise NoServerError(f"no NATS server reachable at {url}: {'; '.join(reasons)}")


class Client:
    """A connection to one shoal installation (a NATS server and a subject prefix)."""

    def __init__(self, bus: Bus, *, timeout_s: float = 10.0, retries: int = 2) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        """How long one attempt of a command waits for admission's answer; also the
        deadline it sends (admission starts no write after it)."""
        self.retries = retries
        """How many times an idempotent command is sent again after no answer."""
        self.user = user_of_creds(bus.identity) if bus.identity else None
        """The user this client authenticated as; None for the admin (or no credentials),
        who sends commands as ``@admin`` and may act for any user."""
        self.last_read: ReadInfo | None = None
        """Where the newest :meth:`view` (``state``, ``jobs``, ``status``, ``nodes``) came from."""

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        prefix: str | None = None,
        *,
        timeout_s: float = 10.0,
        creds: str | None = None,
        tls_ca: str | None = None,
    ) -> Client:
        """Connect to NATS. Without ``url``/``prefix``/``creds`` they are found the way
        the CLI finds them (``NATS_URL``, ``SHOAL_PREFIX``, ``NATS_CREDS``, the server and
        admin credentials of the ``shoal up`` running for the state directory). ``tls_ca``
        (default ``NATS_CA``/``SHOAL_TLS_CA``) verifies a TLS server.

        Raises:
            shoal.bus.NoServerError: nothing answers at the URL.
            shoal.bus.AuthFailed: the server refused the credentials (or wants some).
        """
        if url is None or prefix is None or creds is None:
            from shoal.bus import NoServerError
            from shoal.cli import CommandError as CliError
            from shoal.commands import _connect

            try:
                creds = creds or _connect.resolve_creds(url_given=url is not None)
                url = url or _connect.resolve_url()
                prefix = prefix or _connect.resolve_prefix()
            except CliError as exc:
                raise NoServerError(str(exc)) from None
        await _probe(url, timeout_s=min(timeout_s, 5.0))
        if tls_ca is None:
            import os

            tls_ca = os.environ.get("NATS_CA") or os.environ.get("SHOAL_TLS_CA") or None
        bus = await Bus.connect(
            url, prefix=prefix, name="shoal-client", declare=False, creds=creds, tls_ca=tls_ca
        )
        return cls(bus, timeout_s=timeout_s)

    @property
    def sender(self) -> str:
        """The command-subject token this client sends as (:func:`shoal.auth.command_subject`)."""
        return self.user or ADMIN_TOKEN

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- commands ------------------------------------------------------------------

    async def _request(self, name: str, payload: bytes) -> ev.CommandAccepted:
        subject = self.bus.names.cmd(name, self.sender)
        # Admission starts no write once this client has stopped waiting (services/admission).
        deadline = {DEADLINE_HEADER: f"{time.time() + self.timeout_s:.3f}"}
        from shoal.telemetry import inject, producer_span

        try:
            # The trace of a command begins here: admission, the decision it causes, the
            # placement and the reconfiguration continue it (docs/operations.md).
            with producer_span(f"client.{name}", attributes={"shoal.sender": self.sender}):
                msg = await self.bus.nc.request(
                    subject, payload, timeout=self.timeout_s, headers={**(inject() or {}), **deadline}
                )
        except nats.errors.MaxPayloadError:
            raise _rejected(
                "too_large",
                f"command of {len(payload)} bytes exceeds the server's "
                f"{self.bus.nc.max_payload}-byte message limit",
            ) from None
        except nats.errors.NoRespondersError as exc:
            raise NoAdmissionError(f"no admission service answered on {subject}: none is running") from exc
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise NoAdmissionError(
                f"no admission service answered on {subject} within {self.timeout_s:g}s"
            ) from exc
        reply = codec.decode_reply(msg.data)
        if isinstance(reply, ev.CommandRejected):
            raise CommandError(reply)
        return reply  # type: ignore[no-any-return]

    async def _send(self, name: str, payload: bytes, *, retry: bool) -> tuple[ev.CommandAccepted, int]:
        """:meth:`_request`, sent again (the same bytes) up to ``retries`` times when no
        answer came or admission could not confirm its write (``unconfirmed``), if
        ``retry``: only for a command that applying twice changes nothing more than
        applying once. Returns the acceptance and the attempt (1 for the first) it answered."""
        attempt = 1
        while True:
            try:
                return await self._request(name, payload), attempt
            except NoAdmissionError as exc:
                if not retry or attempt > self.retries:
                    raise
                if isinstance(exc.__cause__, nats.errors.NoRespondersError):
                    await asyncio.sleep(min(0.1 * 2**attempt, 2.0))  # none listening yet: back off
            except CommandError as exc:
                if exc.code != "unconfirmed" or not retry or attempt > self.retries:
                    raise
            attempt += 1

    async def command(self, cmd: Any) -> ev.CommandAccepted:
        """Send a command to admission and return its acceptance. An idempotent command
        (a submission with a ``job_id``, a cancellation, tickets) is sent again, up to
        ``retries`` times, when no answer comes.

        Raises:
            CommandError: the command was rejected (nothing changed).
            NoAdmissionError: no admission service answered in time (a ``TimeoutError``).
        """
        idempotent = not isinstance(cmd, ev.SubmitJob) or cmd.job_id is not None
        return (await self._send(cmd.name, codec.encode_command(cmd), retry=idempotent))[0]

    async def submit_command(
        self, spec: ev.JobSpec | Mapping[str, Any], job_id: str | None = None
    ) -> ev.CommandAccepted:
        """Like :meth:`submit`, returning the whole acceptance (``duplicate`` tells a
        re-submission of the same job id apart; a retry of this call that finds its own
        earlier attempt written is not a duplicate)."""
        wire = spec_to_wire(spec)
        if self.user is not None and not wire.get("user"):
            wire["user"] = self.user  # a user's job is its own unless it says otherwise
        # The id is the call's idempotency key: every attempt of this call carries it, so
        # admission writes the job once however many attempts reach it.
        generated = job_id is None
        body: dict[str, Any] = {"type": "cmd.submit_job", "spec": wire}
        body["job_id"] = new_ulid() if job_id is None else check_job_id(job_id)
        try:
            payload = msgspec.msgpack.encode(body)
        except (TypeError, msgspec.EncodeError) as exc:
            raise _rejected("invalid_spec", f"job spec cannot be encoded: {exc}") from None
        try:
            reply, attempt = await self._send(ev.SubmitJob.name, payload, retry=True)
        except NoAdmissionError as exc:
            # The attempts may have been written: without the id a second call would make
            # another job, so the error says which id to submit again with.
            again = NoAdmissionError(
                f"{exc}; the job may have been written as {body['job_id']}: submit again with "
                f"job id {body['job_id']} (shoal submit --job-id) to have it at most once"
            )
            again.job_id = body["job_id"]
            raise again from exc
        except CommandError as exc:
            if exc.code == "unconfirmed" and generated:
                exc.message = (
                    f"{exc.message}; submit again with job id {body['job_id']} "
                    "(shoal submit --job-id) to have it at most once"
                )
            raise
        if generated and attempt > 1 and reply.duplicate:
            # Nobody else knows the id this call made up: an earlier attempt wrote the job.
            reply = msgspec.structs.replace(reply, duplicate=False)
        return reply

    async def submit(self, spec: ev.JobSpec | Mapping[str, Any], job_id: str | None = None) -> str:
        """Submit a job; returns its id.

        Without ``job_id`` the call makes one up (a ULID) and sends it. When no answer
        comes within ``timeout_s`` (or admission could not confirm its write), the call
        sends the same submission again, up to ``retries`` times: admission writes a
        job id once, so the log holds one job whichever attempts reached it, and the
        call returns its id. Idempotent across calls when ``job_id`` is given:
        submitting the same spec under the same id again returns the same id and adds
        nothing to the log; a different spec under an existing id is rejected
        (``job_exists``).

        Raises:
            CommandError: the spec was rejected (e.g. ``invalid_command`` for a wrong
                type or range, ``invalid_spec``, ``unknown_user``, ``limit_exceeded``,
                ``too_large``); nothing was written.
            NoAdmissionError: no admission service answered any attempt (the job may
                still be in the log if an attempt was written after all: submit again
                with the same ``job_id`` to learn it, which writes nothing new).
        """
        return (await self.submit_command(spec, job_id)).id

    async def cancel(self, job_id: str, reason: str = "") -> ev.CommandAccepted:
        """Cancel a job (a job that already finished is a duplicate, not an error).

        Raises:
            CommandError: ``unknown_job`` when there is no such job.
        """
        return await self.command(ev.CancelJob(job_id=check_job_id(job_id), reason=reason))

    async def set_tickets(self, user: str, tickets: int) -> ev.CommandAccepted:
        """Set a user's tickets (their weight in fair sharing)."""
        return await self.command(ev.SetTickets(user=user, tickets=tickets))

    async def set_user_limits(
        self, user: str, *, max_active_jobs: int | None = None, max_gpus: int | None = None
    ) -> ev.CommandAccepted:
        """Set a user's quota (admin only): the most active jobs and the most GPUs
        (sum of ``min_gpus``) its active jobs may ask for; 0 means the installation's
        default, None keeps the current value. This registers the user.

        Raises:
            CommandError: ``forbidden`` unless sent as the admin; ``invalid_command``
                when neither limit is given.
        """
        return await self.command(
            SetUserLimits(user=user, max_active_jobs=max_active_jobs, max_gpus=max_gpus)
        )

    # -- reads -------------------------------------------------------------------------

    async def history(
        self, *, start_seq: int = 1, filter_subjects: list[str] | None = None
    ) -> AsyncIterator[Batch]:
        """The log as it is now, in batches of ``(stream_seq, envelope)``.

        Raises:
            NoEventLogError: there is no event log for this prefix on the server.
        """
        stream = cast(
            AsyncGenerator[Batch, None],
            self.bus.replay_batches(start_seq=start_seq, filter_subjects=filter_subjects),
        )
        async with contextlib.aclosing(stream):
            try:
                async for batch in stream:
                    yield batch
            except nats.js.errors.NotFoundError:
                raise self._no_log() from None

    def _no_log(self) -> NoEventLogError:
        return NoEventLogError(
            f"no shoal event log (stream {self.bus.names.events_stream}) for prefix "
            f"{self.bus.names.prefix!r} on this server; is `shoal up` running with this prefix?"
        )

    async def last_event(self) -> tuple[int, ev.Envelope | None]:
        """The stream sequence and envelope of the newest event (``(0, None)`` for an empty log).

        Raises:
            NoEventLogError: there is no event log for this prefix on the server.
        """
        stream = self.bus.names.events_stream
        try:
            seq = await self.bus.last_seq()
        except nats.js.errors.NotFoundError:
            raise self._no_log() from None
        while seq > 0:
            try:
                raw = await self.bus.js.get_msg(stream, seq)
                return seq, codec.decode(raw.data or b"")
            except (nats.js.errors.NotFoundError, codec.DecodeFailure):
                seq -= 1  # deleted or unreadable: the one before
        return 0, None

    async def view(
        self,
        what: str = "state",
        *,
        job_id: str = "",
        user: str = "",
        statuses: Iterable[str] = (),
        active: bool = False,
        replay: bool = False,
    ) -> st.ClusterState:
        """The slice of the cluster state that ``what`` names (``state``, ``jobs``,
        ``job``, ``nodes``; :func:`shoal.queries.slice_state`), reflecting at least
        every event in the log when the call began.

        Asked of admission's materialised view (:mod:`shoal.queries`), which waits
        until it has folded the log's last sequence as of now (so a job this client
        just submitted is in the answer). Folded from a replay of the whole log
        instead when ``replay`` is set, or when no view answers: nobody listens (an
        installation older than the query endpoint, or admission is down), the view
        is behind or refuses, or no answer comes within the client's timeout (capped
        at 5 s). :attr:`last_read` says which it was.

        Raises:
            NoEventLogError: there is no event log for this prefix on the server.
            CommandError: ``invalid_job_id`` for a malformed ``job_id``.
        """
        if what == "job":
            check_job_id(job_id)
        query = queries.Query(job_id=job_id, user=user or "", statuses=tuple(statuses), active=active)
        reason = "asked for a replay"
        if not replay:
            try:
                query.min_seq = await self.bus.last_seq()
            except nats.js.errors.NotFoundError:
                raise self._no_log() from None
            query.wait_s = min(self.timeout_s, 5.0)
            reply, reason = await self._query(what, query)
            if reply is not None:
                assert reply.state is not None
                self.last_read = ReadInfo(source="view", seq=reply.seq)
                return await self._with_beats(reply.state)
        state = st.ClusterState()
        seq = 0
        async for batch in self.history():
            for _, env in batch:
                st.apply(state, env)
            seq = max(seq, batch.last_seq)
        self.last_read = ReadInfo(source="replay", seq=seq, reason=reason)
        return await self._with_beats(queries.slice_state(state, what, query))

    async def _with_beats(self, state: st.ClusterState) -> st.ClusterState:
        """``state`` with each node's ``last_heartbeat_at`` moved up to its newest heartbeat
        in the beats stream (heartbeats are not in the log, so the fold has only the
        registration's stamp); unchanged when the stream cannot be read."""
        if not state.nodes:
            return state
        try:
            beats = await self.bus.latest_beats(state.nodes)
        except (nats.errors.Error, TimeoutError):  # no beats stream (an older installation), or no answer
            return state
        for node_id, at in beats.items():
            node = state.nodes[node_id]
            node.last_heartbeat_at = max(node.last_heartbeat_at, at)
        return state

    async def _query(self, what: str, query: queries.Query) -> tuple[queries.ViewReply | None, str]:
        """Admission's answer to ``query`` (joined from its parts), or None and why not."""
        nc = self.bus.nc
        subject = queries.subject(self.bus.names.prefix, what, self.sender)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + query.wait_s + 2.0
        try:
            await nc.publish(subject, queries.encode_query(query), reply=inbox)
            parts: dict[int, bytes] = {}
            count = 1
            while len(parts) < count:
                try:
                    msg = await sub.next_msg(timeout=max(0.01, deadline - loop.time()))
                except (nats.errors.TimeoutError, TimeoutError):
                    return None, f"no answer on {subject} within {query.wait_s + 2.0:g}s"
                headers = msg.headers or {}
                if headers.get(Header.STATUS.value) == "503":
                    return None, f"no view answers on {subject} (admission is not running or is older)"
                try:
                    index = int(headers.get(queries.PART_HEADER, "0"))
                    count = int(headers.get(queries.PARTS_HEADER, "1"))
                except ValueError:
                    return None, "an unreadable answer"
                parts[index] = msg.data
            try:
                reply = queries.decode_reply(b"".join(parts[i] for i in range(count)))
            except (msgspec.DecodeError, UnicodeDecodeError, KeyError) as exc:
                return None, f"an unreadable answer: {exc}"
            if reply.error or reply.state is None:
                return None, f"the view answered {reply.error or 'nothing'}: {reply.message}"
            return reply, ""
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def state(self) -> st.ClusterState:
        """The whole cluster state now (:meth:`view`)."""
        return await self.view("state")

    async def jobs(self) -> dict[str, st.JobState]:
        """Every job in the log (finished ones included), by id, in submission order
        (:meth:`view`)."""
        return (await self.view("jobs")).jobs

    async def status(self, job_id: str) -> st.JobState:
        """One job's folded state (:meth:`view`).

        Raises:
            UnknownJobError: no such job (a ``KeyError``).
        """
        jobs = (await self.view("job", job_id=check_job_id(job_id))).jobs
        if job_id not in jobs:
            raise UnknownJobError(f"no job {job_id!r}")
        return jobs[job_id]

    async def nodes(self) -> dict[str, st.NodeState]:
        """Every node by id (:meth:`view`)."""
        return (await self.view("nodes")).nodes

    async def job_events(
        self,
        job_id: str,
        *,
        follow: bool = True,
        follow_forever: bool = False,
        include_shares: bool = False,
    ) -> AsyncIterator[ev.Envelope]:
        """A job's events: its history, then (with ``follow``) live ones as they happen.

        A job id not in the log yet is waited for (it may be about to be submitted);
        check with :meth:`status` first to fail fast on a typo.

        Args:
            job_id: the job.
            follow: keep following after the history; without it, end once caught up.
            follow_forever: do not end when the job finishes (completed, failed,
                cancelled, rejected); the caller breaks out.
            include_shares: also yield the ``SharesDecided`` / ``PlacementDecided``
                events that changed this job's GPUs or placement.
        """
        check_job_id(job_id)
        prefix = self.bus.names.prefix
        subjects = [f"{prefix}.job.{job_id}.>"]
        if include_shares:
            subjects += [f"{prefix}.alloc.shares_decided", f"{prefix}.alloc.placement_decided"]
        stop = asyncio.Event()
        share: tuple[int, str] = (0, "")
        placement: tuple[ev.GpuRef, ...] = ()
        stream = cast(
            AsyncGenerator[Batch, None],
            self.bus.replay_batches(follow=follow, filter_subjects=subjects, stop=stop),
        )
        async with contextlib.aclosing(stream):
            try:
                async for batch in stream:
                    for _, env in batch:
                        e = env.event
                        if isinstance(e, ev.SharesDecided):
                            new = (e.shares.get(job_id, 0), e.gpu_types.get(job_id, ""))
                            if new == share:
                                continue
                            share = new
                        elif isinstance(e, ev.PlacementDecided):
                            where = tuple(e.placements.get(job_id, ()))
                            if where == placement:
                                continue
                            placement = where
                        yield env
                        if isinstance(e, _FINAL) and not follow_forever:
                            return
            except nats.js.errors.NotFoundError:
                raise self._no_log() from None

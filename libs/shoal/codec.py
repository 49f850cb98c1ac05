"""Encoding and decoding of envelopes, with failures sorted into unknown vs malformed.

Encoders and decoders are built once at import (they hold no I/O and no config).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from shoal.admin_commands import ANY_COMMAND
from shoal.events import (
    EVENT_BY_TAG,
    MAX_MESSAGE_BYTES,
    AnyReply,
    Envelope,
    Event,
    RawEnvelope,
    event_tag,
)
from shoal.ids import new_ulid


class DecodeFailure(Exception):
    """Base of the two ways a message can fail to decode."""

    code = "decode_failure"


class MalformedMessage(DecodeFailure):
    """Garbage bytes, a broken envelope, or a known type whose payload is invalid."""

    code = "malformed"


class UnknownEventType(DecodeFailure):
    """A well-formed envelope whose type this reader does not know (skip and count)."""

    code = "unknown_type"

    def __init__(self, type_: str, envelope: RawEnvelope) -> None:
        super().__init__(f"unknown event type {type_!r}")
        self.type = type_
        self.envelope = envelope


class FutureVersion(UnknownEventType):
    """A known type whose envelope ``v`` is above this reader's version of it.

    Treated as an unknown type (skipped and counted): this reader cannot know what
    the newer version means, so it must not fold it as if it were its own.
    """

    code = "future_version"

    def __init__(self, type_: str, version: int, known: int, envelope: RawEnvelope) -> None:
        DecodeFailure.__init__(
            self, f"{type_} schema version {version} is newer than this reader's version {known}"
        )
        self.type = type_
        self.version = version
        self.envelope = envelope


class MessageTooLarge(DecodeFailure):
    code = "too_large"


class WrongSubject(DecodeFailure):
    """A valid event on a subject of the log that is not its own
    (:func:`shoal.events.subject_for`): the server checks who may publish on a subject,
    not what the message says, so an identity allowed one subject (a node's
    registration, a sidecar's job) could otherwise append any event there: a
    ``SharesDecided``, another node's registration, another job's completion.
    Readers of the log skip it like any message that does not decode."""

    code = "wrong_subject"


_ENC = msgspec.msgpack.Encoder()
_DEC_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_DEC_RAW = msgspec.msgpack.Decoder(RawEnvelope)
_DEC_COMMAND = msgspec.msgpack.Decoder(ANY_COMMAND)
_DEC_REPLY = msgspec.msgpack.Decoder(AnyReply)
_JSON_ENC = msgspec.json.Encoder()
_JSON_DEC_ENVELOPE = msgspec.json.Decoder(Envelope)
_JSON_DEC_COMMAND = msgspec.json.Decoder(ANY_COMMAND)
_JSON_DEC_REPLY = msgspec.json.Decoder(AnyReply)


def wrap(
    event: Event,
    *,
    at: float | None = None,
    causation_id: str | None = None,
    correlation_id: str | None = None,
    event_id: str | None = None,
) -> Envelope:
    """Put an event in an envelope with a fresh ULID and the current time (or ``at``)."""
    now = time.time() if at is None else at
    return Envelope(
        id=event_id or new_ulid(now if at is None else None),
        type=event_tag(event),
        v=type(event).version,
        at=now,
        causation_id=causation_id,
        correlation_id=correlation_id,
        event=event,  # type: ignore[arg-type]
    )


def encode(envelope: Envelope) -> bytes:
    """Envelope -> msgpack bytes."""
    return _ENC.encode(envelope)


def _not_utf8(exc: UnicodeDecodeError) -> str:
    """The reason for a message holding a string that is not UTF-8. msgspec before 0.23
    raises :class:`UnicodeDecodeError` there, which is neither of its own errors: every
    decoder here turns it into a :class:`MalformedMessage` (else one such message on
    the log would stop every reader, and one such request would get an internal error).
    msgspec 0.23 raises its own ``DecodeError`` ("Invalid UTF-8 encoded string"), which
    the decoders' other branch already turns into one."""
    return f"a string is not valid UTF-8 (byte {exc.start} of it: {exc.reason})"


def decode(data: bytes) -> Envelope:
    """msgpack bytes -> Envelope.

    Raises:
        MessageTooLarge: over :data:`MAX_MESSAGE_BYTES`.
        UnknownEventType: the envelope is fine but its type is not known here.
        FutureVersion: (an :class:`UnknownEventType`) the type is known but the
            envelope's ``v`` is above the version this reader has.
        MalformedMessage: anything else that is wrong, with the decoder's reason.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        env = _DEC_ENVELOPE.decode(data)
    except msgspec.ValidationError as exc:
        first_error = exc
    except msgspec.DecodeError as exc:
        raise MalformedMessage(f"not a msgpack envelope: {exc}") from None
    except UnicodeDecodeError as exc:
        raise MalformedMessage(_not_utf8(exc)) from None
    else:
        known = type(env.event).version
        if env.v > known:
            raise FutureVersion(env.type, env.v, known, _DEC_RAW.decode(data))
        return env
    try:
        raw = _DEC_RAW.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedMessage(f"invalid envelope: {exc}") from None
    except UnicodeDecodeError as exc:
        raise MalformedMessage(_not_utf8(exc)) from None
    if raw.type not in EVENT_BY_TAG:
        raise UnknownEventType(raw.type, raw)
    if raw.v > EVENT_BY_TAG[raw.type].version:
        raise FutureVersion(raw.type, raw.v, EVENT_BY_TAG[raw.type].version, raw)
    raise MalformedMessage(f"invalid {raw.type} payload: {first_error}")


def decode_json(data: bytes | str) -> Envelope:
    """JSON export -> Envelope (same rules as :func:`decode`, no unknown-type split)."""
    try:
        return _JSON_DEC_ENVELOPE.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedMessage(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise MalformedMessage(_not_utf8(exc)) from None


def to_json(obj: Any) -> bytes:
    """Any contract object -> JSON bytes (for export, CLI output and JSON clients)."""
    return _JSON_ENC.encode(obj)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def encode_command(cmd: Any) -> bytes:
    return _ENC.encode(cmd)


class UnknownFields(MalformedMessage):
    """A command naming fields its type does not have (a typo such as ``max_gpu`` must
    not silently fall back to the default)."""

    def __init__(self, errors: list[str], *, in_spec: bool) -> None:
        super().__init__("; ".join(errors))
        self.errors = tuple(errors)
        self.in_spec = in_spec
        """True when every unknown field is inside ``spec`` (admission answers ``invalid_spec``,
        as the SDK and the MQTT bridge do for the same mistake)."""


def _unknown_fields(cmd: Any, data: bytes, json: bool) -> None:
    """Raise :class:`UnknownFields` when the command or its ``spec`` names unknown fields.

    Events are decoded leniently (an older reader survives a newer writer), so the
    contract types ignore unknown fields; a command is checked here instead, on the
    same bytes decoded as plain data (the typed decode already succeeded, so this
    cannot fail on the shape).
    """
    raw = (msgspec.json.decode if json else msgspec.msgpack.decode)(data)
    if not isinstance(raw, dict):
        return
    cls = type(cmd)
    known = set(cls.__struct_fields__) | {cls.__struct_config__.tag_field}
    errors = [f"unknown field {k!r} in {cls.__struct_config__.tag}" for k in raw if k not in known]
    in_spec = not errors
    spec = raw.get("spec") if "spec" in known else None
    if isinstance(spec, dict):
        fields = set(type(cmd.spec).__struct_fields__)
        errors += [f"unknown field {k!r} in job spec" for k in spec if k not in fields]
    if errors:
        raise UnknownFields(errors, in_spec=in_spec)


def decode_command(data: bytes, *, json: bool = False) -> Any:
    """Decode a command (msgpack, or JSON for language-neutral clients).

    Raises:
        MessageTooLarge: over :data:`MAX_MESSAGE_BYTES`.
        UnknownFields: (a :class:`MalformedMessage`) a field name the command or its
            ``spec`` does not have.
        MalformedMessage: with the decoder's field-level reason.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(f"command of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        cmd = (_JSON_DEC_COMMAND if json else _DEC_COMMAND).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedMessage(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise MalformedMessage(_not_utf8(exc)) from None
    _unknown_fields(cmd, data, json)
    return cmd


def encode_reply(reply: Any, *, json: bool = False) -> bytes:
    return (_JSON_ENC if json else _ENC).encode(reply)


def decode_reply(data: bytes, *, json: bool = False) -> Any:
    try:
        return (_JSON_DEC_REPLY if json else _DEC_REPLY).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedMessage(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise MalformedMessage(_not_utf8(exc)) from None

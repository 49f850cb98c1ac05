"""The contract: encoding round trips, subjects, and how failures are classified."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from shoal import codec
from shoal import events as ev

from tests.strategies import events


@given(events)
def test_every_event_round_trips_in_msgpack_and_json(event: ev.Event) -> None:
    env = codec.wrap(event, at=12.5, causation_id="c1", correlation_id="r1")
    assert codec.decode(codec.encode(env)) == env
    assert codec.decode_json(codec.to_json(env)) == env
    assert env.type == ev.event_tag(event) and env.v == type(event).version


def test_every_event_type_has_a_unique_tag_and_is_in_the_union() -> None:
    tags = [t.__struct_config__.tag for t in ev.EVENT_TYPES]
    assert len(set(tags)) == len(tags) == len(ev.EVENT_BY_TAG)
    assert set(ev.AnyEvent.__args__) == set(ev.EVENT_TYPES)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("event", "subject"),
    [
        (ev.JobSubmitted(job_id="j1", spec=ev.JobSpec(user="u")), "shoal.job.j1.submitted"),
        (ev.ReconfigurationCompleted(job_id="j1", epoch=3, world_size=2), "shoal.job.j1.reconf.completed"),
        (
            ev.ThroughputModelUpdated(job_id="j1", gpu_type="V100"),
            "shoal.job.j1.profile.throughput_model_updated",
        ),
        (ev.NodeLost(node_id="n7"), "shoal.node.n7.lost"),
        (ev.TicketsSet(user="bob", tickets=5), "shoal.user.bob.tickets_set"),
        (ev.SharesDecided(epoch=1, shares={}), "shoal.alloc.shares_decided"),
        (ev.TradeUndone(trade_id="t1"), "shoal.trade.undone"),
    ],
)
def test_subjects_are_per_aggregate(event: ev.Event, subject: str) -> None:
    assert ev.subject_for(event) == subject


def test_garbage_is_malformed() -> None:
    with pytest.raises(codec.MalformedMessage):
        codec.decode(b"\xc1\xc1\xc1")
    with pytest.raises(codec.MalformedMessage, match="invalid envelope"):
        codec.decode(msgspec.msgpack.encode({"no": "envelope"}))


def test_unknown_type_is_told_apart_from_invalid_payload() -> None:
    unknown = msgspec.msgpack.encode(
        {"id": "x", "type": "job.new_thing", "at": 1.0, "event": {"type": "job.new_thing"}}
    )
    with pytest.raises(codec.UnknownEventType) as info:
        codec.decode(unknown)
    assert info.value.type == "job.new_thing"
    invalid = msgspec.msgpack.encode(
        {
            "id": "x",
            "type": "job.submitted",
            "at": 1.0,
            "event": {"type": "job.submitted", "job_id": "has.dot", "spec": {"user": "u"}},
        }
    )
    with pytest.raises(codec.MalformedMessage, match=r"\$.event.job_id"):
        codec.decode(invalid)


def test_oversized_is_refused_before_decoding() -> None:
    with pytest.raises(codec.MessageTooLarge):
        codec.decode(b"\x00" * (ev.MAX_MESSAGE_BYTES + 1))


def test_commands_decode_from_json_for_language_neutral_clients() -> None:
    cmd = codec.decode_command(
        b'{"type":"cmd.submit_job","job_id":"abc","spec":{"user":"alice","min_gpus":1,"max_gpus":4}}',
        json=True,
    )
    assert isinstance(cmd, ev.SubmitJob) and cmd.spec.max_gpus == 4
    with pytest.raises(codec.MalformedMessage, match="min_gpus"):
        codec.decode_command(b'{"type":"cmd.submit_job","spec":{"user":"alice","min_gpus":0}}', json=True)


def test_strings_that_are_not_utf8_are_malformed_messages_for_every_decoder() -> None:
    """msgspec before 0.23 raises UnicodeDecodeError (neither of its own errors) for a
    msgpack string that is not UTF-8, and 0.23 its own DecodeError; under either, every
    decoder answers MalformedMessage naming UTF-8, as readers and admission expect.
    Before, one such event on the log stopped every reader (tests/test_poison.py)."""
    event = codec.encode(codec.wrap(ev.JobCancelled(job_id="j1", reason="REASON")))
    command = codec.encode_command(ev.CancelJob(job_id="j1", reason="REASON"))
    reply = codec.encode_reply(ev.CommandAccepted(id="REASON"))
    for decoder, data in (
        (codec.decode, event),
        (codec.decode_command, command),
        (codec.decode_reply, reply),
    ):
        bad = data.replace(b"REASON", b"RE\xff\xfeON")
        with pytest.raises(codec.MalformedMessage, match="UTF-8"):
            decoder(bad)
    with pytest.raises(codec.MalformedMessage):
        codec.decode_json(b'{"id": "\xff"}')

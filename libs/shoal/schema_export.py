"""JSON Schema of the event contract, generated from the code into ``schemas/``.

What is written (all deterministic: sorted keys, two-space indent, trailing newline):

* ``schemas/<Type>.json`` — one self-contained JSON Schema (draft 2020-12) per type:
  every event, every command, both replies, ``Envelope``, ``JobSpec`` and the value
  types they use, plus the unions ``AnyEvent``, ``AnyCommand`` and ``AnyReply``.
  Tagged types carry their wire tag in the ``type`` property (``{"enum": [tag]}``).
* ``schemas/index.json`` — every type with its file, kind (event, command, reply,
  envelope, union, value), wire tag and, for events, the subject it is published on.
* ``schemas/SUBJECTS.md`` — the NATS subjects, streams and buckets of an
  installation, and the JSON request/reply a raw client uses to submit a job.

The JSON Schema describes the JSON form of each type (``shoal.codec.to_json``); on
the bus the same structure travels as msgpack. :func:`stale_files` compares the
directory with what the code generates now; the drift test fails on any difference.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from shoal import codec
from shoal import events as ev
from shoal.admin_commands import ADMIN_COMMAND_TYPES, ANY_COMMAND, SetUserLimits
from shoal.bus import Names

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
INDEX = "index.json"
SUBJECTS = "SUBJECTS.md"

#: Value types exported on their own (they appear inside events and commands).
VALUE_TYPES: tuple[type[Any], ...] = (ev.JobSpec, ev.GpuInfo, ev.GpuRef)
REPLY_TYPES: tuple[type[Any], ...] = (ev.CommandAccepted, ev.CommandRejected)
UNIONS: dict[str, Any] = {"AnyEvent": ev.AnyEvent, "AnyCommand": ANY_COMMAND, "AnyReply": ev.AnyReply}


def _dump(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _tag(cls: type[Any]) -> str | None:
    tag = cls.__struct_config__.tag
    return tag if isinstance(tag, str) else None


def subject_pattern(cls: type[ev.Event], prefix: str = "shoal") -> str:
    """The subject an event type is published on, with ``<key>`` placeholders
    (the same rule as :func:`shoal.events.subject_for`)."""
    tag = _tag(cls) or ""
    if cls.key_field is None:
        return f"{prefix}.{tag}"
    head, _, tail = tag.partition(".")
    name = tail if head == cls.aggregate else tag
    return f"{prefix}.{cls.aggregate}.<{cls.key_field}>.{name}"


JOB_LENGTH_RULE: dict[str, Any] = {
    "$comment": "Exactly one of total_iterations (known length) and convergence_target "
    "(unknown length); admission answers invalid_spec otherwise (shoal.admission.validate_spec).",
    "oneOf": [
        {"required": ["total_iterations"], "properties": {"total_iterations": {"type": "integer"}}},
        {"required": ["convergence_target"], "properties": {"convergence_target": {"type": "number"}}},
    ],
}
"""Added to every ``JobSpec`` definition: a rule msgspec's generated schema cannot state."""


NO_CONTROL_CHARACTERS = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"
"""The pattern of a ``JobSpec``'s ``name`` and ``model`` in what a client sends:
admission refuses control characters there (:func:`shoal.admission.validate_spec`)."""


def _clean_descriptions(node: Any) -> Any:
    """``node`` with every ``description`` (a class's docstring) indented as
    :func:`inspect.cleandoc` leaves it. msgspec 0.23 began cleaning docstrings so and
    earlier versions kept their indentation: without this, the committed schemas would be
    stale under whichever version did not write them."""
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean_descriptions(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def _standalone(name: str, tp: Any, kind: str = "") -> dict[str, Any]:
    """The schema of ``tp`` as its own file. What a client sends (a command, the command
    union, a ``JobSpec``) is strict as admission is: no field it does not know
    (``additionalProperties: false``) and no control character in a job's name or model.
    Events and envelopes stay open: a reader ignores the fields of a newer writer."""
    schema = _clean_descriptions(msgspec.json.schema(tp))
    defs = schema.get("$defs", {})
    job_spec = defs.get("JobSpec")
    if job_spec is not None:
        job_spec.update(JOB_LENGTH_RULE)
    if kind == "command" or name in ("AnyCommand", "JobSpec"):
        for definition in defs.values():
            if definition.get("type") == "object" and "properties" in definition:
                definition["additionalProperties"] = False
        if job_spec is not None:
            for field in ("name", "model"):
                job_spec["properties"][field]["pattern"] = NO_CONTROL_CHARACTERS
    out: dict[str, Any] = {"$schema": SCHEMA_DIALECT, "$id": f"{name}.json", "title": name}
    out.update(schema)
    return out


def _types() -> list[tuple[str, str, Any]]:
    """(name, kind, type) of everything exported, in index order."""
    out: list[tuple[str, str, Any]] = [("Envelope", "envelope", ev.Envelope)]
    out += [(t.__name__, "value", t) for t in VALUE_TYPES]
    out += [(t.__name__, "event", t) for t in ev.EVENT_TYPES]
    out += [(t.__name__, "command", t) for t in (*ev.COMMAND_TYPES, *ADMIN_COMMAND_TYPES)]
    out += [(t.__name__, "reply", t) for t in REPLY_TYPES]
    out += [(n, "union", t) for n, t in UNIONS.items()]
    return out


def generate(prefix: str = "shoal") -> dict[str, str]:
    """File name -> content of everything ``schemas/`` should hold."""
    files: dict[str, str] = {}
    index: dict[str, Any] = {}
    for name, kind, tp in _types():
        file = f"{name}.json"
        files[file] = _dump(_standalone(name, tp, kind))
        entry: dict[str, Any] = {"file": file, "kind": kind}
        if kind != "union":
            tag = _tag(tp)
            if tag is not None:
                entry["tag"] = tag
        if kind == "event":
            entry["subject"] = subject_pattern(tp, prefix)
            entry["version"] = tp.version
        if kind == "command":
            entry["subject"] = Names(prefix).cmd(tp.name)
        index[name] = entry
    files[INDEX] = _dump(
        {
            "$comment": "Generated by `shoal schemas export`; do not edit.",
            "dialect": SCHEMA_DIALECT,
            "types": index,
        }
    )
    files[SUBJECTS] = subjects_markdown(prefix)
    return files


def export(directory: str | Path) -> list[str]:
    """Write the schemas into ``directory`` (removing stale ``*.json`` files there).

    Returns:
        The names of the files that changed (written or removed).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    want = generate()
    changed = []
    for name, content in sorted(want.items()):
        path = d / name
        if not path.exists() or path.read_text(encoding="utf-8") != content:
            tmp = d / f".{name}.tmp"
            tmp.write_text(content, encoding="utf-8")
            tmp.replace(path)
            changed.append(name)
    for path in sorted(d.glob("*.json")):
        if path.name not in want:
            path.unlink()
            changed.append(path.name)
    return changed


def stale_files(directory: str | Path) -> list[str]:
    """Files of ``directory`` that differ from what the code generates: changed,
    missing or no longer generated (sorted)."""
    d = Path(directory)
    want = generate()
    stale = []
    for name, content in want.items():
        path = d / name
        try:
            if path.read_text(encoding="utf-8") != content:
                stale.append(name)
        except FileNotFoundError:
            stale.append(name)
    if d.is_dir():
        stale += [p.name for p in d.glob("*.json") if p.name not in want]
    return sorted(stale)


def _example_submit() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    request = msgspec.to_builtins(
        ev.SubmitJob(
            job_id="resnet-alice-001",
            spec=ev.JobSpec(
                user="alice",
                model="resnet50",
                min_gpus=1,
                max_gpus=8,
                requested_gpus=4,
                total_iterations=20_000,
            ),
        )
    )
    # The example a person would write: only the fields they set.
    request = {
        "type": request["type"],
        "job_id": request["job_id"],
        "spec": _nondefault_spec(request["spec"]),
    }
    accepted = msgspec.to_builtins(
        ev.CommandAccepted(
            id="resnet-alice-001", event_id="<ULID of the JobSubmitted event>", duplicate=False
        )
    )
    # What admission answers to a spec asking for zero GPUs: the decoder's own message.
    bad = {**request, "spec": {**request["spec"], "max_gpus": 0}}
    try:
        codec.decode_command(json.dumps(bad).encode(), json=True)
    except codec.MalformedMessage as exc:
        reason = str(exc)
    else:  # pragma: no cover - the contract forbids max_gpus < 1
        raise AssertionError("a JobSpec with max_gpus=0 decoded")
    rejected = msgspec.to_builtins(
        ev.CommandRejected(code="invalid_command", message=reason, errors=(reason,))
    )
    return request, accepted, rejected


def _nondefault_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    default = msgspec.to_builtins(ev.JobSpec(user="x"))
    return {k: v for k, v in spec.items() if k == "user" or default.get(k) != v}


def subjects_markdown(prefix: str = "shoal") -> str:
    """``SUBJECTS.md``: subjects, streams, buckets and the raw JSON submit protocol."""
    n = Names(prefix)
    lines = [
        "# NATS subjects of a shoal installation",
        "",
        "<!-- Generated by `shoal schemas export` from libs/shoal/bus.py and libs/shoal/events.py; do not edit. -->",
        "",
        f"Everything lives under one subject prefix (default `{prefix}`, setting `SHOAL_PREFIX`); "
        f"stream and bucket names use the prefix in upper case. Shown for prefix `{prefix}`.",
        "",
        "## Streams and buckets",
        "",
        "| name | kind | subjects | holds |",
        "|---|---|---|---|",
        f"| `{n.events_stream}` | JetStream stream (file, limits) | {', '.join(f'`{s}`' for s in n.event_subjects)} "
        "| the event log: every fact, in order (source of truth) |",
        f"| `{n.ctl_stream}` | JetStream stream (file, 24 h) | {', '.join(f'`{s}`' for s in n.ctl_subjects)} "
        "| durable commands to node daemons and sidecars |",
        f"| `{n.dlq_stream}` | JetStream stream (file) | {', '.join(f'`{s}`' for s in n.dlq_subjects)} "
        "| dead letters, with `Shoal-Dlq-Code`/`-Reason`/`-Subject`/`-Stream-Seq`/`-Consumer` headers |",
        f"| `{n.lease_bucket}` | KV bucket | | leader leases (`allocator`, `placer`, `profiler`, `trader`, "
        "and `train.<job>` of real-mode jobs); its TTL is the lease (`SHOAL_LEASE_TTL_S`, one per installation) |",
        f"| `{n.snapshot_bucket}` | object store | | state snapshots (state + last applied stream sequence) |",
        f"| `{n.profiler_snapshot_bucket}` | object store | | the profiler's snapshot (its measurements, "
        "the state it folds, the last applied stream sequence) |",
        "| (no stream) | core request/reply | " + f"`{n.cmd('<command>')}` | commands to admission |",
        "",
        "Messages on the event log are msgpack `Envelope`s (see `Envelope.json`) carrying one event;",
        "each is published with its envelope id as `Nats-Msg-Id` (a re-publish is deduplicated) and, when",
        "tracing is on, W3C `traceparent` in the headers.",
        "",
        "## Event subjects",
        "",
        "| event | tag | subject | schema |",
        "|---|---|---|---|",
    ]
    for cls in ev.EVENT_TYPES:
        lines.append(
            f"| `{cls.__name__}` | `{_tag(cls)}` | `{subject_pattern(cls, prefix)}` | `{cls.__name__}.json` |"
        )
    lines += [
        "",
        "`<job_id>`, `<node_id>`, `<user>` are the event's own fields (ids are `[A-Za-z0-9_-]`, never dots).",
        "",
        "## Commands (request/reply, served by admission)",
        "",
        "| command | tag | subject | schema |",
        "|---|---|---|---|",
    ]
    for cmd in (ev.SubmitJob, ev.CancelJob, ev.SetTickets, SetUserLimits):
        lines.append(f"| `{cmd.__name__}` | `{_tag(cmd)}` | `{n.cmd(cmd.name)}` | `{cmd.__name__}.json` |")
    request, accepted, rejected = _example_submit()
    lines += [
        "",
        "Admission listens in the queue group `admission` (replicas share the load). A request body is",
        "msgpack by default; a client without msgpack sends JSON and sets the header",
        "`Content-Type: application/json`, and then the reply is JSON too. The body is the command",
        "with its tag in `type`; it must be sent to the subject of that command (else `wrong_subject`).",
        "`Reconfigure` is not an admission command: node daemons give it to their sidecars.",
        "",
        "### Submitting a job from any language",
        "",
        f"Request on `{n.cmd('submit_job')}` with header `Content-Type: application/json`:",
        "",
        "```json",
        json.dumps(request, indent=2, sort_keys=False),
        "```",
        "",
        "`job_id` is optional: without it admission picks a ULID; with it the submission is idempotent",
        "(sending it again answers `duplicate: true` and appends nothing). `spec` is a `JobSpec`",
        "(`JobSpec.json`): `user` is required, and exactly one of `total_iterations` and `convergence_target`.",
        "",
        "Reply when accepted (`CommandAccepted.json`; `id` is the job id):",
        "",
        "```json",
        json.dumps(accepted, indent=2, sort_keys=False),
        "```",
        "",
        "Reply when rejected (`CommandRejected.json`; nothing was appended to the log):",
        "",
        "```json",
        json.dumps(rejected, indent=2, sort_keys=False),
        "```",
        "",
        "With the `nats` CLI:",
        "",
        "```sh",
        f"nats req {n.cmd('submit_job')} -H 'Content-Type:application/json' \\",
        "  '" + json.dumps(request, separators=(",", ":")) + "'",
        "```",
        "",
        "Then follow the job on its subjects, e.g. a JetStream consumer on "
        f"`{prefix}.job.resnet-alice-001.>` of `{n.events_stream}`",
        "(`job.submitted`, `reconf.*`, `job.progress`, … until `job.completed`/`failed`/`cancelled`/`rejected`).",
        "",
    ]
    return "\n".join(lines)

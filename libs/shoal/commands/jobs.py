"""``shoal submit | jobs | status | cancel | tickets | limits | users | nodes``: the everyday verbs.

``submit`` takes a YAML or JSON job file (the :class:`~shoal.events.JobSpec` fields,
optionally ``job_id``; ``-`` reads stdin) and/or flags (flags override the file).
It prints the job id, or ``rejected (<code>): <each problem>`` and exits 1; nothing
was written then. Read verbs ask admission's materialised view for the state as of
at least the log's last event (:meth:`shoal.client.Client.view`); with ``--replay``,
or when no view answers (then with a note on stderr), they fold the event log
themselves. ``--json`` prints plain data for scripts. Connection flags: see :mod:`shoal.commands._connect`.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import TYPE_CHECKING, Any

from shoal.cli import CommandError
from shoal.commands import _connect

if TYPE_CHECKING:
    from shoal.client import Client

# flag dest -> JobSpec field
_SPEC_FLAGS = {
    "user": "user",
    "name": "name",
    "model": "model",
    "min_gpus": "min_gpus",
    "max_gpus": "max_gpus",
    "requested_gpus": "requested_gpus",
    "elastic": "elastic",
    "iterations": "total_iterations",
    "convergence_target": "convergence_target",
    "gpu_type": "gpu_type",
    "priority": "priority",
    "batch_size": "global_batch_size",
}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "submit",
        help="submit a job (YAML/JSON file and/or flags); prints its id",
        description="Submit a job. The file holds JobSpec fields (and optionally job_id); "
        "flags override it. A re-submission with the same --job-id and spec is a no-op.",
    )
    p.add_argument("file", nargs="?", help="job file (YAML or JSON; '-' for stdin)")
    p.add_argument(
        "--user",
        help="owner (default: the file's, else the user your credentials are, else $SHOAL_USER, "
        "else your login name)",
    )
    p.add_argument("--name")
    p.add_argument("--model", help="model tag, selects a throughput profile")
    p.add_argument("--min-gpus", type=int)
    p.add_argument("--max-gpus", type=int)
    p.add_argument("--requested-gpus", type=int)
    p.add_argument("--elastic", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--iterations", type=int, help="total iterations (known length)")
    p.add_argument("--convergence-target", type=float, help="target loss (unknown length)")
    p.add_argument("--gpu-type", help="pin to one GPU generation")
    p.add_argument("--priority", type=int)
    p.add_argument("--batch-size", type=int, help="global batch size")
    p.add_argument("--job-id", help="client-chosen id: makes the submission idempotent")
    p.add_argument("--json", action="store_true", help="print the reply as JSON")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_submit)

    p = subparsers.add_parser("jobs", help="list jobs")
    p.add_argument("--user", help="only this user's jobs")
    p.add_argument(
        "--state",
        action="append",
        choices=("pending", "running", "completed", "failed", "cancelled", "rejected"),
        help="only jobs in this state (repeatable)",
    )
    p.add_argument("--active", action="store_true", help="only pending and running jobs")
    p.add_argument("--json", action="store_true")
    _add_replay_arg(p)
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_jobs)

    p = subparsers.add_parser("status", help="one job's state; --watch follows its events")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")
    _add_replay_arg(p)
    p.add_argument("--watch", action="store_true", help="print the job's events live until it ends")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("cancel", help="cancel a job")
    p.add_argument("job")
    p.add_argument("--reason", default="")
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser("tickets", help="set a user's tickets (fair-share weight)")
    p.add_argument("user")
    p.add_argument("tickets", type=int)
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_tickets)

    p = subparsers.add_parser(
        "limits",
        help="set a user's quota: most active jobs and GPUs (admin)",
        description="Set a user's quota (admin only). Admission refuses a submission that would go over "
        "it (limit_exceeded); jobs already admitted are not touched. 0 means the installation's default "
        "(SHOAL_MAX_ACTIVE_JOBS_PER_USER / SHOAL_MAX_GPUS_PER_USER, no limit unless set); a limit not "
        "given keeps its value. This registers the user (SHOAL_REGISTERED_USERS_ONLY).",
    )
    p.add_argument("user")
    p.add_argument("--max-jobs", type=_non_negative, help="most pending + running jobs")
    p.add_argument(
        "--max-gpus", type=_non_negative, help="most GPUs its active jobs ask for (sum of min_gpus)"
    )
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_limits)

    p = subparsers.add_parser("users", help="list users: tickets, quota and what they use of it")
    p.add_argument("--json", action="store_true")
    _add_replay_arg(p)
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_users)

    p = subparsers.add_parser("nodes", help="list nodes, their GPUs and utilisation")
    p.add_argument("--json", action="store_true")
    _add_replay_arg(p)
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_nodes)


# -- submit ----------------------------------------------------------------------------


MAX_JOB_FILE_BYTES = 1024 * 1024
"""A job file over 1 MiB is refused before parsing (a command is at most 256 KiB anyway)."""
MAX_JOB_FILE_DEPTH = 32
"""Deepest nesting of mappings and lists a job file may have."""


def _safe_loader(text: str) -> Any:
    """A ``yaml.SafeLoader`` for one job file that also refuses anchors and aliases
    (``&a``/``*a``: a few hundred bytes of nested aliases expand to gigabytes, the
    "billion laughs") and nesting deeper than :data:`MAX_JOB_FILE_DEPTH`."""
    import yaml
    from yaml.composer import ComposerError

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            mark: Any = event.start_mark
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise ComposerError(None, None, "anchors and aliases (&name, *name) are not allowed", mark)
            if not isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                return super().compose_node(parent, index)
            self.depth += 1
            if self.depth > MAX_JOB_FILE_DEPTH:
                raise ComposerError(None, None, f"nested more than {MAX_JOB_FILE_DEPTH} levels deep", mark)
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader(text)


def _out_of_range(value: Any, where: str = "") -> str | None:
    """The place of the first integer that no 64-bit field takes, or None."""
    from shoal.events import INT64_MAX

    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -INT64_MAX - 1 <= value <= INT64_MAX else (where or "the top level")
    items: Any = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        found = _out_of_range(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def check_spec_values(spec: dict[str, Any], source: str) -> None:
    """Refuse an integer beyond 64 bits before anything is sent (no field takes one,
    and the encoder cannot carry it).

    Raises:
        CommandError: exit status 2, naming the field.
    """
    where = _out_of_range(spec)
    if where:
        raise CommandError(
            f"{source}: the integer at {where!r} is out of range (fields take 64 bits at most)"
        )


def read_job_file(path: str) -> tuple[dict[str, Any], str | None]:
    """The spec fields and the optional ``job_id`` of a YAML/JSON job file.

    A file in the shape of the raw command (``{"spec": {...}, "job_id": ...}``) is
    accepted too. The file is loaded safely: at most :data:`MAX_JOB_FILE_BYTES`, no
    anchors or aliases, at most :data:`MAX_JOB_FILE_DEPTH` levels of nesting, no
    integer beyond 64 bits.

    Raises:
        CommandError: (exit status 2) unreadable, too large, invalid or unsafe
            YAML/JSON, or not a mapping.
    """
    import yaml

    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_JOB_FILE_BYTES + 1)
        else:
            with open(path, "rb") as f:
                raw = f.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as exc:
        raise CommandError(f"cannot read job file {path!r}: {exc.strerror or exc}") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise CommandError(f"job file {path!r} is larger than {MAX_JOB_FILE_BYTES} bytes")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise CommandError(f"job file {path!r} is not UTF-8 text") from None
    loader = None
    try:
        # Inside the try: the loader's reader refuses a control character (a NUL byte)
        # as soon as it is made.
        loader = _safe_loader(text)
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise CommandError(f"job file {path!r} is not valid YAML or JSON: {problem}{where}") from None
    except (ValueError, RecursionError, OverflowError) as exc:
        # e.g. an integer of more than 4300 digits (Python's int conversion limit)
        problem = str(exc).split(";")[0] or type(exc).__name__
        raise CommandError(f"job file {path!r} holds a value that cannot be read: {problem}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        raise CommandError(f"job file {path!r} is empty")
    if not isinstance(data, dict):
        raise CommandError(
            f"job file {path!r} must hold a mapping of job spec fields, not {type(data).__name__}"
        )
    job_id = data.pop("job_id", None)
    if isinstance(data.get("spec"), dict) and set(data) <= {"spec", "type"}:
        data = dict(data["spec"])
    if job_id is not None and not isinstance(job_id, str):
        raise CommandError(f"job_id in {path!r} must be a string, not {type(job_id).__name__}")
    check_spec_values(data, f"job file {path!r}")
    return data, job_id


def build_spec(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """The spec fields and job id from ``submit``'s file and flags (flags win)."""
    spec: dict[str, Any] = {}
    job_id: str | None = None
    if args.file:
        spec, job_id = read_job_file(args.file)
    for dest, field in _SPEC_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            spec[field] = value
    if args.job_id:
        job_id = args.job_id
    if not args.file and len(spec) == 0:
        raise CommandError("nothing to submit: give a job file or flags such as --max-gpus and --iterations")
    check_spec_values(spec, "job spec")
    return spec, job_id


def default_user(client: Client | None) -> str:
    """The owner of a job whose file and flags name none: the user the client
    authenticated as (a user's identity may submit only as itself), else, for the
    admin, ``$SHOAL_USER``, else the login name."""
    if client is not None and client.user is not None:
        return client.user
    return os.environ.get("SHOAL_USER") or getpass.getuser()


def cmd_submit(args: argparse.Namespace) -> int:
    spec, job_id = build_spec(args)

    async def body(client: Client) -> int:
        if "user" not in spec:
            spec["user"] = default_user(client)
        reply = await client.submit_command(spec, job_id)
        if args.json:
            _connect.print_json(reply)
        else:
            print(reply.id)
            if reply.duplicate:
                print(
                    f"job {reply.id} was already submitted with this spec; nothing changed", file=sys.stderr
                )
        return 0

    return _connect.run(args, body)


# -- reads -------------------------------------------------------------------------------


def _add_replay_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--replay",
        action="store_true",
        help="fold the whole event log here instead of asking admission's view (slow on a long log)",
    )


async def _read(client: Client, args: argparse.Namespace, what: str, **query: Any) -> Any:
    """:meth:`shoal.client.Client.view`; a note on stderr when it had to replay the log."""
    state = await client.view(what, replay=args.replay, **query)
    read = client.last_read
    if read is not None and read.source == "replay" and not args.replay:
        print(f"note: replayed the event log ({read.reason})", file=sys.stderr)
    return state


def cmd_jobs(args: argparse.Namespace) -> int:
    from shoal import explain

    async def body(client: Client) -> int:
        state = await _read(
            client, args, "jobs", user=args.user or "", statuses=args.state or (), active=args.active
        )
        ids = list(state.jobs)
        if args.json:
            _connect.print_json([explain.job_row(j, state.jobs[j], state.clock) for j in ids])
        elif not ids:
            filtered = bool(args.user or args.state or args.active)
            print("no jobs" + (" match" if filtered else ""))
        else:
            print(explain.job_table(state, ids))
        return 0

    return _connect.run(args, body)


def cmd_status(args: argparse.Namespace) -> int:
    from shoal import client as sdk
    from shoal import explain

    async def body(client: Client) -> int:
        state = await _read(client, args, "job", job_id=sdk.check_job_id(args.job))
        job = state.jobs.get(args.job)
        if job is None:
            raise sdk.UnknownJobError(f"no job {args.job!r}")
        row = explain.job_row(args.job, job, state.clock)
        if args.json and not args.watch:
            _connect.print_json({**row, "spec": job.spec})
            return 0
        if not args.json:
            print(_status_text(row, job))
        if args.watch:
            async for env in client.job_events(args.job, include_shares=True):
                if args.json:
                    sys.stdout.write(_json_line(env))
                else:
                    print(
                        f"{explain.iso(env.at)}  {explain.printable(explain.describe_event(env))}", flush=True
                    )
        return 0

    return _connect.run(args, body)


def _json_line(obj: Any) -> str:
    from shoal import codec

    return codec.to_json(obj).decode() + "\n"


def _status_text(row: dict[str, Any], job: Any) -> str:
    from shoal import explain

    spec = job.spec
    row = {k: explain.printable(v) if isinstance(v, str) else v for k, v in row.items()}
    lines = [
        f"job       {row['job_id']}" + (f" ({row['name']})" if row["name"] else ""),
        f"user      {row['user']}",
        f"state     {row['status']}" + (f": {row['reason']}" if row["reason"] else ""),
        f"gpus      {row['gpus']}{' ' + row['gpu_type'] if row['gpu_type'] else ''} "
        f"(min {spec.min_gpus}, max {spec.max_gpus}, requested {spec.requested_gpus}"
        f"{', rigid' if not spec.elastic else ''}{', pinned ' + spec.gpu_type if spec.gpu_type else ''})",
        f"placement {row['placement']}",
        f"progress  {explain.progress_text(job)}",
        f"service   {row['attained_service_gpu_s']:.1f} GPU·s, {row['reconfigurations']} reconfigurations",
        f"submitted {explain.iso(row['submitted_at'])}",
    ]
    if row["started_at"] is not None:
        lines.append(f"started   {explain.iso(row['started_at'])}")
    if row["finished_at"] is not None:
        lines.append(f"finished  {explain.iso(row['finished_at'])}")
    if spec.model:
        lines.insert(2, f"model     {explain.printable(spec.model)}")
    return "\n".join(lines)


def cmd_nodes(args: argparse.Namespace) -> int:
    from shoal import explain

    async def body(client: Client) -> int:
        state = await _read(client, args, "nodes")
        if args.json:
            _connect.print_json([explain.node_row(n, node, state) for n, node in sorted(state.nodes.items())])
        elif not state.nodes:
            print("no nodes")
        else:
            print(explain.node_table(state))
        return 0

    return _connect.run(args, body)


# -- commands ---------------------------------------------------------------------------


def _print_reply(args: argparse.Namespace, reply: Any, *, duplicate: str, done: str) -> int:
    """A command's answer: the reply as JSON with ``--json``, else one line."""
    if args.json:
        _connect.print_json(reply)
    else:
        print(duplicate if reply.duplicate else done)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    async def body(client: Client) -> int:
        reply = await client.cancel(args.job, args.reason)
        return _print_reply(
            args,
            reply,
            duplicate=f"job {reply.id} had already finished; nothing changed",
            done=f"cancelled {reply.id}",
        )

    return _connect.run(args, body)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def cmd_limits(args: argparse.Namespace) -> int:
    if args.max_jobs is None and args.max_gpus is None:
        raise CommandError("give --max-jobs, --max-gpus or both (0: the installation's default)")

    async def body(client: Client) -> int:
        reply = await client.set_user_limits(args.user, max_active_jobs=args.max_jobs, max_gpus=args.max_gpus)
        return _print_reply(
            args,
            reply,
            duplicate=f"user {args.user} already has these limits; nothing changed",
            done=f"user {args.user}: limits set",
        )

    return _connect.run(args, body)


def cmd_users(args: argparse.Namespace) -> int:
    from shoal import explain

    async def body(client: Client) -> int:
        state = await _read(client, args, "users")
        if args.json:
            _connect.print_json(explain.user_rows(state))
        elif not state.users and not state.jobs:
            print("no users")
        else:
            print(explain.user_table(state))
        return 0

    return _connect.run(args, body)


def cmd_tickets(args: argparse.Namespace) -> int:
    async def body(client: Client) -> int:
        reply = await client.set_tickets(args.user, args.tickets)
        return _print_reply(
            args,
            reply,
            duplicate=f"user {args.user} already has {args.tickets} tickets; nothing changed",
            done=f"user {args.user} now has {args.tickets} tickets",
        )

    return _connect.run(args, body)

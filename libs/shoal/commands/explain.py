"""``shoal explain <job>``: every share change of a job, why it happened, and what the
policy knew at that moment — read from the log (see :mod:`shoal.explain`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from shoal.cli import CommandError
from shoal.commands import _connect

if TYPE_CHECKING:
    from shoal.client import Client
    from shoal.events import Envelope


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "explain",
        help="why a job got the GPUs it got: its share changes, their triggers and the policy inputs",
        description="Replays the log and shows every share, placement and reconfiguration change of "
        "a job with the event that triggered it and the policy inputs at that moment.",
    )
    p.add_argument("job")
    p.add_argument("--json", action="store_true", help="print the timeline as JSON")
    p.add_argument(
        "--catalog",
        help="throughput catalog the allocator used (afs, gavel, pollux-sia …), for jobs without a measured model",
    )
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    from shoal import client as sdk
    from shoal import explain

    job_id = args.job
    try:
        sdk.check_job_id(job_id)
    except sdk.CommandError as exc:
        raise CommandError(exc.message) from None
    catalog = None
    if args.catalog:
        from shoal.models import get_catalog

        try:
            catalog = get_catalog(args.catalog)
        except (KeyError, ValueError) as exc:
            raise CommandError(str(exc).strip("'")) from None

    async def body(client: Client) -> int:
        items: list[tuple[int, Envelope]] = []
        async for batch in client.history():
            items.extend(batch)
        result = explain.explain_job(job_id, items, catalog=catalog)
        if not result.found:
            raise CommandError(f"no job {job_id!r} in the log", code=1)
        if args.json:
            _connect.print_json(result)
        else:
            print(explain.render_explanation(result))
        return 0

    return _connect.run(args, body)

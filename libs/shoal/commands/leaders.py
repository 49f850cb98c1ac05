"""``shoal leaders``: who holds each leader lease now.

The leader-elected services (allocator, placer, profiler, trader) and each real-mode
job's leading sidecar (``train.<job>``) hold a lease in the installation's lease bucket
(:meth:`shoal.bus.Bus.leases`). A holder is named ``<service>-<host>-<pid>``, so this
says which process on which machine decides, as ``kubectl get leases`` does for a
Kubernetes controller. Any identity may run it. A lease whose holder stopped renewing
disappears after ``SHOAL_LEASE_TTL_S``; no row for a service means nobody leads it now.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from shoal.commands import _connect

if TYPE_CHECKING:
    from shoal.client import Client


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("leaders", help="who holds each leader lease now")
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_leaders)


def cmd_leaders(args: argparse.Namespace) -> int:
    from shoal.explain import printable, table

    async def body(client: Client) -> int:
        held = await client.bus.leases()
        if args.json:
            _connect.print_json([{"lease": k, "holder": v} for k, v in held.items()])
        elif not held:
            print("no lease is held")
        else:
            rows = [{"lease": printable(k), "holder": printable(v)} for k, v in held.items()]
            print(table(rows, (("lease", "LEASE"), ("holder", "HOLDER"))))
        return 0

    return _connect.run(args, body)

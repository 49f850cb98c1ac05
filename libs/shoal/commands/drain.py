"""``shoal drain NODE`` and ``shoal undrain NODE``: take a node out of scheduling for
maintenance and bring it back (admin only), as ``kubectl drain`` / ``uncordon`` or
Slurm's ``scontrol update state=drain|resume`` do.

``drain`` appends :class:`~shoal.events.NodeDrained` to the log. The fold marks the
node ``drained``, and what the policies and placement see leaves it out: only ``up``
nodes count (:func:`shoal.view.cluster_gpus`, :func:`shoal.cluster.topology_from_state`). So the allocator's next
decision shares the GPUs that remain, the placer moves the node's jobs elsewhere, and
its node daemon stops their workers: an elastic job shrinks or moves (checkpoint and
restart) instead of being killed. ``drain`` then waits until no job holds a GPU on the
node (``--wait SECONDS``; ``--no-wait`` returns at once). A drained node stays out while its
node daemon keeps heartbeating: the daemon registers again on its own only when its
node is *lost* (:mod:`services.node_daemon.service`), never when it is drained.

``undrain`` brings it back. Choice (nothing in the papers covers maintenance): no new
event type, because :mod:`shoal.events` and the fold are part of every stored
reproduction cell's fingerprint. ``undrain`` appends the node's registration again,
as its node daemon would, with the GPUs the log knows (:class:`~shoal.events.NodeRegistered`
makes it ``up``), followed by each GPU's last health reading
(:class:`~shoal.events.GpuHealth`), because a registration resets the readings in the
fold and the daemon sends one only when it changes. A GPU known to be unhealthy stays
so. If the node daemon has gone meanwhile, the allocator finds the node lost after
``SHOAL_NODE_TIMEOUT_S`` as for any silent node.

Only the admin may append ``NodeDrained`` (:data:`shoal.auth.EVENT_OWNERS`), and
only the admin may append another identity's events. Both verbs refuse any other
identity before sending anything, and refuse an unknown node (exit 2). Draining a
drained node, or undraining one that is not drained, changes nothing and says so (exit 0).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import TYPE_CHECKING, Any

from shoal.cli import CommandError
from shoal.commands import _connect

if TYPE_CHECKING:
    from shoal import state as st
    from shoal.client import Client

DEFAULT_WAIT_S = 300.0
"""How long ``drain`` waits for the node's jobs to move off it (``--wait``)."""
POLL_S = 0.5


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "drain",
        help="admin: take a node out of scheduling; its jobs move to other nodes",
        description="Mark NODE drained: the next decisions leave it out and its jobs move "
        "to other nodes. Waits until no job holds a GPU on it (see --wait, --no-wait).",
    )
    p.add_argument("node", metavar="NODE")
    p.add_argument("--reason", default="", help="why (kept in the log; shown by `shoal explain`)")
    p.add_argument(
        "--wait",
        type=_positive,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for its jobs to move (default {DEFAULT_WAIT_S:g}); exit 1 past it",
    )
    p.add_argument("--no-wait", action="store_true", help="return once the drain is in the log")
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_drain)

    p = subparsers.add_parser(
        "undrain",
        help="admin: bring a drained node back into scheduling",
        description="Register drained NODE again with the GPUs and health readings the log "
        "knows, so that the next decisions use it.",
    )
    p.add_argument("node", metavar="NODE")
    p.add_argument("--json", action="store_true")
    _connect.add_connection_args(p)
    p.set_defaults(func=cmd_undrain)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def _require_admin(client: Client, verb: str) -> None:
    identity = client.bus.identity
    if identity not in (None, "admin"):
        raise CommandError(
            f"shoal {verb} needs the admin's credentials (it appends node events to the log); "
            f"this connection is {identity!r}"
        )


def _node(state: st.ClusterState, node_id: str) -> st.NodeState:
    from shoal.explain import printable

    node = state.nodes.get(node_id)
    if node is None:
        known = ", ".join(sorted(state.nodes)) or "none"
        raise CommandError(f"unknown node {printable(node_id)!r}; nodes: {known}")
    return node


def holding(state: st.ClusterState, node_id: str) -> list[str]:
    """The unfinished jobs placed on a GPU of ``node_id``, sorted."""
    from shoal.state import FINISHED_STATUSES

    return sorted(
        job_id
        for job_id in state.placed
        if state.jobs[job_id].status not in FINISHED_STATUSES
        and any(ref.node_id == node_id for ref in state.jobs[job_id].placement)
    )


async def _stamp(client: Client) -> float:
    """The instant to stamp the node events with: now, or the log's newest event's
    instant when that is later. An emulated installation's clock runs ahead of the wall
    clock (``--time-scale``); its services must not see these events in their past."""
    _, last = await client.last_event()
    return max(time.time(), last.at if last is not None else 0.0)


def _result(args: argparse.Namespace, text: str, **fields: Any) -> None:
    if args.json:
        _connect.print_json({"node_id": args.node, **fields})
    else:
        print(text)


def cmd_drain(args: argparse.Namespace) -> int:
    from shoal import codec
    from shoal import events as ev
    from shoal.state import NODE_DRAINED

    async def body(client: Client) -> int:
        _require_admin(client, "drain")
        node = _node(await client.view("state"), args.node)
        changed = node.status != NODE_DRAINED
        if changed:
            drained = ev.NodeDrained(node_id=args.node, reason=args.reason)
            await client.bus.publish(codec.wrap(drained, at=await _stamp(client)))
        if args.no_wait:
            jobs = holding(await client.view("state"), args.node)
            _result(
                args,
                f"node {args.node} drained"
                if changed
                else f"node {args.node} was already drained; nothing changed",
                status=NODE_DRAINED,
                changed=changed,
                jobs=jobs,
            )
            return 0
        deadline = time.monotonic() + args.wait
        while True:
            state = await client.view("state")
            if _node(state, args.node).status != NODE_DRAINED:
                raise CommandError(
                    f"node {args.node} is {state.nodes[args.node].status} again: something registered "
                    "it after the drain (its node daemon, or `shoal undrain`)",
                    code=1,
                )
            jobs = holding(state, args.node)
            if not jobs:
                break
            if time.monotonic() >= deadline:
                raise CommandError(
                    f"node {args.node} is drained, but after {args.wait:g} s these jobs still hold "
                    f"GPUs on it: {', '.join(jobs)} (see `shoal explain <job>`)",
                    code=1,
                )
            await asyncio.sleep(POLL_S)
        _result(
            args,
            f"node {args.node} drained; no job holds a GPU on it"
            if changed
            else f"node {args.node} was already drained; no job holds a GPU on it",
            status=NODE_DRAINED,
            changed=changed,
            jobs=[],
        )
        return 0

    return _connect.run(args, body)


def cmd_undrain(args: argparse.Namespace) -> int:
    from shoal import codec
    from shoal import events as ev
    from shoal.state import NODE_DRAINED

    async def body(client: Client) -> int:
        _require_admin(client, "undrain")
        node = _node(await client.view("state"), args.node)
        if node.status != NODE_DRAINED:
            _result(
                args,
                f"node {args.node} is {node.status}, not drained; nothing changed",
                status=node.status,
                changed=False,
            )
            return 0
        registration = ev.NodeRegistered(
            node_id=args.node,
            gpus=tuple(
                ev.GpuInfo(index=i, gpu_type=g.gpu_type, memory_mb=g.memory_mb, uuid=g.uuid)
                for i, g in enumerate(node.gpus)
            ),
            hostname=node.hostname,
            emulated=node.emulated,
        )
        readings = [
            ev.GpuHealth(
                node_id=args.node,
                index=i,
                healthy=g.healthy,
                utilization=g.utilization,
                memory_used_mb=g.memory_used_mb,
            )
            for i, g in enumerate(node.gpus)
        ]
        at = await _stamp(client)
        await client.bus.publish_many([codec.wrap(e, at=at) for e in (registration, *readings)])
        _result(args, f"node {args.node} is up again", status="up", changed=True)
        return 0

    return _connect.run(args, body)

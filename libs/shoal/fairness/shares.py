"""Per-user, per-generation fair shares by ticket-weighted water-filling.

Gandiva_fair §2.1 and §3.2: every active user gets GPUs in proportion to their
tickets; a user who cannot use their share (too few jobs) is given what they can
use, removed, and the rest is re-divided among the others, who thereby get a
*bonus* share. The paper implements the iteration with Chandra & Shenoy's weight
readjustment, which yields each user's *effective tickets*; here the same fixed
point is computed directly in O(U log U) by visiting users in increasing
demand/tickets order (classic weighted max-min water-filling).

Choices where the paper is silent:

- A user's cap is their GPU demand, the sum of the sizes of their active jobs
  (Chandra & Shenoy cap a thread at one CPU; here the cap is the demand).
- Users with zero (or negative) tickets, or zero demand, get nothing, even when
  GPUs are left over: tickets are the only entitlement.
- On a heterogeneous cluster each generation is divided on its own
  (:func:`fair_shares_by_generation`), so a user's tickets map to a proportional
  share of *every* generation (§3.4). When a user's jobs may run on any
  generation, :func:`fair_shares_newest_first` fills generations from the newest
  down, spending the user's remaining demand, which is Algorithm 2's "first jobs
  on the fastest GPU until the user's entitlement there is used up".
- Shares are real numbers (time-sliced GPUs): 8 GPUs among 3 users is 2.667 each.
- Gangs do not split across generations, so a user whose demand is "met" by
  fractions of several generations may be unable to use them, while the capacity
  that newest-first filling left over on an older generation stays idle.
  :func:`spill_leftover` hands that leftover out again (§3.2's bonus share, per
  generation), capped by what each user could run there. Without it, the policy
  is not work-conserving on heterogeneous clusters with multi-GPU gangs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def fair_shares(
    tickets: Mapping[str, float],
    demand: Mapping[str, float],
    capacity: float,
) -> dict[str, float]:
    """Divide ``capacity`` GPUs among users in proportion to tickets, capped by demand.

    Gandiva_fair §2.1 (recursive fair-share definition) and §3.2 (bonus shares).

    Args:
        tickets: User -> tickets. Users missing here have no tickets.
        demand: User -> GPUs the user can use (sum of its jobs' sizes).
        capacity: GPUs to divide.

    Returns:
        User -> share (GPUs, fractional), for every user in ``demand``. Shares sum
        to at most ``capacity`` and no share exceeds the user's demand.
    """
    shares = {user: 0.0 for user in demand}
    active = [(d / tickets[u], u) for u, d in demand.items() if d > 0 and tickets.get(u, 0.0) > 0]
    # Users who saturate first (smallest demand per ticket) are satisfied first;
    # ties by name keep the float sums deterministic.
    active.sort()
    remaining = float(max(capacity, 0.0))
    total_tickets = sum(tickets[u] for _, u in active)
    for i, (_, user) in enumerate(active):
        t = tickets[user]
        offer = remaining * t / total_tickets
        if demand[user] <= offer:
            shares[user] = float(demand[user])
            remaining -= demand[user]
            total_tickets -= t
            continue
        # Nobody after this one saturates either (sorted by demand/ticket).
        for _, rest in active[i:]:
            shares[rest] = remaining * tickets[rest] / total_tickets
        break
    return shares


def effective_tickets(
    tickets: Mapping[str, float],
    demand: Mapping[str, float],
    capacity: float,
) -> dict[str, float]:
    """Each user's effective tickets after weight readjustment (§3.2, Chandra & Shenoy).

    Effective tickets are scaled so that dividing ``capacity`` in proportion to them
    gives exactly :func:`fair_shares`; they sum to the active users' total tickets.

    Args:
        tickets: User -> tickets.
        demand: User -> GPUs the user can use.
        capacity: GPUs to divide.

    Returns:
        User -> effective tickets (0 for users with no share).
    """
    shares = fair_shares(tickets, demand, capacity)
    given = sum(shares.values())
    total = sum(tickets.get(u, 0.0) for u, s in shares.items() if s > 0)
    if given <= 0:
        return {u: 0.0 for u in shares}
    return {u: s / given * total for u, s in shares.items()}


def fair_shares_by_generation(
    tickets: Mapping[str, float],
    demand_by_generation: Mapping[str, Mapping[str, float]],
    gpus_by_generation: Mapping[str, float],
) -> dict[str, dict[str, float]]:
    """Water-fill every GPU generation on its own (§3.4: a proportional share of each).

    Args:
        tickets: User -> tickets.
        demand_by_generation: User -> generation -> GPUs the user can use there.
        gpus_by_generation: Generation -> GPUs of that generation.

    Returns:
        User -> generation -> share, for every user and every generation.
    """
    out: dict[str, dict[str, float]] = {u: {} for u in demand_by_generation}
    for gen, capacity in gpus_by_generation.items():
        per_gen = {u: d.get(gen, 0.0) for u, d in demand_by_generation.items()}
        for user, share in fair_shares(tickets, per_gen, capacity).items():
            out[user][gen] = share
    return out


def fair_shares_newest_first(
    tickets: Mapping[str, float],
    demand: Mapping[str, float],
    gpus_by_generation: Mapping[str, float],
    order: Sequence[str],
    pinned: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, dict[str, float]]:
    """Per-generation shares for users whose jobs may run on any generation.

    Generations are filled newest first (``order`` is newest first); each user's
    demand left after the newer generations caps their share of the next one.
    Users with large demand get the same proportional share of every generation;
    a user with little demand is served on the newest GPUs (Algorithm 2, §3.5).
    Pinned demand counts only on its generation, and a share there serves the
    pinned jobs before the flexible ones.

    Args:
        tickets: User -> tickets.
        demand: User -> GPUs of jobs that may run on any generation.
        gpus_by_generation: Generation -> GPUs.
        order: Generations, newest first; must list every key of ``gpus_by_generation``.
        pinned: User -> generation -> GPUs of jobs pinned there (§3.4 pinning).

    Returns:
        User -> generation -> share.
    """
    pinned = pinned or {}
    users = set(demand) | set(pinned)
    left = {u: float(demand.get(u, 0.0)) for u in users}
    out: dict[str, dict[str, float]] = {u: {} for u in sorted(users)}
    for gen in order:
        pinned_here = {u: float(pinned.get(u, {}).get(gen, 0.0)) for u in users}
        want = {u: left[u] + pinned_here[u] for u in users}
        shares = fair_shares(tickets, want, gpus_by_generation.get(gen, 0.0))
        for user, share in shares.items():
            out[user][gen] = share
            left[user] = max(0.0, left[user] - max(0.0, share - pinned_here[user]))
    return out


def spill_leftover(
    shares: Mapping[str, Mapping[str, float]],
    tickets: Mapping[str, float],
    demand: Mapping[str, Mapping[str, float]],
    gpus_by_generation: Mapping[str, float],
) -> dict[str, dict[str, float]]:
    """Give each generation's unallocated GPUs to the users who could run jobs there.

    The bonus share of §3.2, applied per generation after newest-first filling: the
    leftover of generation g is water-filled by tickets, each user capped by the GPUs
    its jobs could use on g beyond its share there.

    Args:
        shares: User -> generation -> share (e.g. from :func:`fair_shares_newest_first`).
        tickets: User -> tickets.
        demand: User -> generation -> GPUs of the user's jobs that may run there
            (flexible jobs count on every generation, pinned ones on theirs).
        gpus_by_generation: Generation -> GPUs.

    Returns:
        User -> generation -> share, with every generation's leftover handed out
        as far as the caps allow.
    """
    out = {u: dict(s) for u, s in shares.items()}
    for gen, capacity in gpus_by_generation.items():
        leftover = capacity - sum(s.get(gen, 0.0) for s in out.values())
        if leftover <= 1e-9:
            continue
        room = {u: max(0.0, demand.get(u, {}).get(gen, 0.0) - s.get(gen, 0.0)) for u, s in out.items()}
        for user, extra in fair_shares(tickets, room, leftover).items():
            if extra > 0:
                out[user][gen] = out[user].get(gen, 0.0) + extra
    return out

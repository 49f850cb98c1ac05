"""Min-migration placement with network packing (CoDDL §4.4, AFS appendix E).

Goal, in order (CoDDL §4.4): maximise the number of jobs that keep at least one of
the GPUs they hold, then the total GPUs kept; move a job only as a last resort.
Shape (network packing): a share below the node size sits on one node, a multiple of
the node size on whole nodes.

The exact problem is a bin-packing variant, so this is a greedy with the guarantee
that matters, chosen here because the paper gives no algorithm:

1. Jobs go largest share first (ties: jobs that held GPUs before, then the job that
   can keep the most GPUs on one node, then job id). With
   regulated shares this is first-fit-decreasing over a divisibility chain, so every
   job is placed whenever the shares fit the nodes (Proposition 1), whichever node
   each job picks below.
2. A job of ``w`` whole nodes (``w = share // G``, ``G`` the largest node of its GPU
   type) first keeps the free whole nodes it has GPUs on, most of its GPUs first. It
   keeps the first one unless leaving it to the jobs not yet placed that hold GPUs
   there would let more of them stay (or as many, keeping more GPUs); a further kept
   node must displace nobody. The rest are fresh whole nodes, cheapest first: fewest
   jobs left with nowhere to stay, then fewest GPUs lost to them, then fewest holders,
   then node order.
3. A sub-node share (or the remainder of an unregulated share) keeps the node where
   it has the most GPUs still free, if the share fits there; otherwise it goes to the
   node with the least room that fits it after the room reserved for jobs still to
   come that hold GPUs there (best fit, "slack"), else to the best fit ignoring those
   reservations (that job will then move).
4. Within a node a job keeps its own GPUs first (the lowest indices on a shrink), then
   takes the GPUs whose loss hurts the jobs still to be placed least (free ones, or
   ones a shrinking holder has to spare), nearest its kept ones.
5. If the packed shape cannot be found (unregulated shares, drained GPUs, mixed node
   sizes) and ``allow_split`` is set, the job spreads over the fewest nodes with free
   GPUs; otherwise, or if not enough GPUs of its type are free, it is unplaced.

``migrations`` counts placed jobs that held GPUs before and keep none; an unplaced job
(paused, not moved) is not a migration. Jobs in ``previous`` with a zero share are
simply dropped.

**Shortcut** (same result, less work): a congested cluster of sub-node shares changes
a few jobs per decision; the rest keep their share and their GPUs. When every share is
below its node size, every job that held GPUs keeps its share on exactly the GPUs it
held (one node, usable, nobody else's), and the others held none,
:func:`_place_kept_and_new` returns what the steps above return without building their
indexes. Why it is the same: a kept job, whenever its turn comes, finds its own GPUs
free (step 3 keeps them; nobody before it took them, see next). A new job's best fit
after reservations (step 3) looks at the *slack* of each node, its free GPUs less those
reserved for the jobs still to come that call it home; placing a kept job takes its
GPUs and ends its reservation, which leaves every slack as it was. So each new job,
taken in step 1's order, goes to the node with the least slack that fits it (lowest
ordinal), onto GPUs nobody holds (step 4: no harm, nearest first), whatever the kept
jobs around it do. When no node has the slack, the new job would displace a kept one
and the shortcut gives way to the full steps. ``tests/placement`` compares both on
random cases.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from shoal.events import GpuRef
from shoal.placement._cluster import Cluster, _topology_index
from shoal.placement.topology import Placement, Topology


class _MinMigration(Cluster):
    """Cluster scratch plus the indexes min-migration needs (displacement and slack)."""

    def __init__(
        self,
        topology: Topology,
        shares: Mapping[str, int],
        previous: Mapping[str, tuple[GpuRef, ...]],
        gpu_types: Mapping[str, str] | None,
        *,
        always_track_costs: bool = False,
    ) -> None:
        super().__init__(topology, shares, previous, gpu_types)
        m = len(self.cap)
        # The displacement costs, the holders and the heaps of whole free nodes below are
        # read only when a job takes whole nodes (step 2). Without a multi-node share
        # (e.g. a congested cluster of 1-GPU shares, most of a long trace) they are not
        # kept: the same placement for less work (``always_track_costs`` keeps them anyway;
        # the tests compare both).
        gpn, family = self.gpn, self.family
        track_costs = always_track_costs or any(
            s >= gpn.get(family[j], 0) > 0 for j, s in self.shares.items()
        )
        self.track_costs = track_costs
        # want/want_gpus: jobs not yet placed holding GPUs on a node, and how many GPUs.
        self.want = [0] * m
        self.want_gpus = [0] * m
        # holders[o]: every job with previous GPUs on node o (placed or not).
        self.holders: list[list[str]] = [[] for _ in range(m)]
        self.keepable: dict[tuple[str, int], int] = {}
        # keeps[job]: the most GPUs the job could keep on one node (the order of step 1).
        self.keeps: dict[str, int] = {}
        for job, by_node in self.prev.items():
            multi = self.is_multi_node(job)
            share = self.shares[job]
            most = 0
            for o, idxs in by_node.items():
                # GPUs the job could keep here: all of a whole node, at most its share below one.
                k = len(idxs) if multi else min(len(idxs), share)
                self.keepable[(job, o)] = k
                if k > most:
                    most = k
                if track_costs:
                    self.holders[o].append(job)
                    self.want[o] += 1
                    self.want_gpus[o] += k
            self.keeps[job] = most
        # cost/cost_gpus: what taking a node away costs the jobs not yet placed: holders with
        # no other node to keep (they must move), and GPUs they keep here beyond their best
        # other node.
        self.cost = [0] * m
        self.cost_gpus = [0] * m
        self.node_cost: dict[tuple[str, int], tuple[int, int]] = {}
        # whole[(family, capacity)]: heap of (cost, cost_gpus, want, want_gpus, ordinal) of
        # fully free nodes.
        self.whole: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = {}
        self.options: dict[str, set[int]] = {}
        self._indexed = False  # nodes enter the heaps once, after the costs are summed
        if track_costs:
            self.options = {job: set(by_node) for job, by_node in self.prev.items()}
            for job in self.prev:
                self._add_costs(job, +1)
        # pending: GPUs reserved on a node for sub-node jobs still to come that call it home.
        self.pending = [0] * m
        self.home: dict[str, int] = {}
        for job, s in self.shares.items():
            by_node = self.prev[job]
            if by_node and s < self.gpn.get(self.family[job], 0):
                if len(by_node) == 1:
                    home = next(iter(by_node))
                else:
                    home = min(by_node, key=lambda o: (-len(by_node[o]), o))
                self.home[job] = home
                self.pending[home] += s
        self.slack = [self.free[o] - self.pending[o] for o in range(m)]
        self.slack_buckets: dict[str, list[list[int]]] = {
            f: [[] for _ in range(self.max_cap + 1)] for f in self.members
        }
        self._indexed = True
        for o in range(m):
            self._push_slack(o)
            if track_costs:
                self._push_whole(o)

    def _push_slack(self, o: int) -> None:
        s = self.slack[o]
        if s >= 1:
            for f in self.node_families[o]:
                heapq.heappush(self.slack_buckets[f][s], o)

    def _push_whole(self, o: int) -> None:
        if self.free[o] == self.cap[o] and self.cap[o] > 0:
            for f in self.node_families[o]:
                heapq.heappush(self.whole.setdefault((f, self.cap[o]), []), self._whole_key(o))

    def _add_costs(self, job: str, sign: int) -> None:
        """Add (``sign=+1``) or remove (``-1``) ``job``'s share of every node's cost."""
        opts = self.options[job]
        for o in opts:
            if sign > 0:
                here = self.keepable[(job, o)]
                elsewhere = max((self.keepable[(job, p)] for p in opts if p != o), default=0)
                self.node_cost[(job, o)] = (1 if len(opts) == 1 else 0, max(0, here - elsewhere))
            c = self.node_cost[(job, o)]
            self.cost[o] += sign * c[0]
            self.cost_gpus[o] += sign * c[1]
            if sign > 0 and self._indexed:
                self._push_whole(o)

    def node_taken(self, o: int) -> None:
        """Node ``o`` went whole to a job: its other holders can no longer stay there, which
        makes their remaining nodes dearer to take."""
        for u in self.holders[o]:
            if u in self.processed or o not in self.options[u]:
                continue
            self._add_costs(u, -1)
            self.options[u].discard(o)
            self._add_costs(u, +1)

    def _whole_key(self, o: int) -> tuple[int, int, int, int, int]:
        return (self.cost[o], self.cost_gpus[o], self.want[o], self.want_gpus[o], o)

    def on_free_changed(self, o: int) -> None:
        self.slack[o] = self.free[o] - self.pending[o]
        self._push_slack(o)
        if self.track_costs:
            self._push_whole(o)

    def start(self, job: str) -> None:
        """Mark ``job`` as being placed: it no longer reserves or displaces anything."""
        self.processed.add(job)
        if self.track_costs:
            self._add_costs(job, -1)
            for o in self.prev[job]:
                self.want[o] -= 1
                self.want_gpus[o] -= self.keepable[(job, o)]
                self._push_whole(o)
        home = self.home.get(job)
        if home is not None:
            self.pending[home] -= self.shares[job]
            self.slack[home] = self.free[home] - self.pending[home]
            self._push_slack(home)

    def _worth_keeping(self, o: int, fam: str, g: int, mine: int, whole: int) -> bool:
        """Whether the job being placed should keep whole node ``o`` (holding ``mine`` GPUs there).

        Keeping saves the job (1 job, ``mine`` GPUs) and evicts the other holders
        (:meth:`_yield_value`); yielding needs one more fresh node instead, the
        ``whole``-th cheapest other one, and evicts its holders.
        """
        alt = self.peek_whole(fam, g, skip=o, rank=whole)
        if alt is None:
            return True
        gain = (1 + self.cost[alt], mine + self.cost_gpus[alt])
        return gain >= self._yield_value(o)

    def _yield_value(self, o: int) -> tuple[int, int]:
        """(jobs, GPUs) that could stay on node ``o`` if the job being placed left it to them.

        Either every sub-node holder stays (they fit: they shared the node before), or the
        multi-node holder keeping the most GPUs takes the whole node.
        """
        subs = (0, 0)
        multi = (0, 0)
        for u in self.holders[o]:
            if u in self.processed:
                continue
            k = self.keepable[(u, o)]
            if self.is_multi_node(u):
                multi = max(multi, (1, k))
            else:
                subs = (subs[0] + 1, subs[1] + k)
        return max(subs, multi)

    def peek_whole(self, fam: str, cap: int, skip: int = -1, rank: int = 1) -> int | None:
        """The ``rank``-th cheapest fully free node of ``fam`` and size ``cap`` (see ``cost``),
        not counting ``skip``; None if there are fewer."""
        heap = self.whole.get((fam, cap))
        held: list[tuple[int, int, int, int, int]] = []
        found = None
        seen: set[int] = set()
        count = 0
        while heap:
            top = heap[0]
            o = top[-1]
            if self.free[o] != self.cap[o] or top != self._whole_key(o) or o in seen:
                heapq.heappop(heap)  # stale, or a duplicate of a live entry already held
                continue
            seen.add(o)
            if o != skip:
                count += 1
                if count == rank:
                    found = o
                    break
            held.append(heapq.heappop(heap))
        for entry in held:
            heapq.heappush(heap, entry)  # type: ignore[arg-type]
        return found

    def fresh_fit(self, fam: str, need: int) -> int | None:
        """Best fit for ``need`` GPUs after reservations; else best fit on free GPUs alone."""
        buckets = self.slack_buckets[fam]
        for k in range(need, self.max_cap + 1):
            heap = buckets[k]
            while heap and self.slack[heap[0]] != k:
                heapq.heappop(heap)
            if heap:
                return heap[0]
        return self.best_fit(fam, need)

    def keep_fit(self, job: str, need: int) -> tuple[int, list[int]] | None:
        """The node where ``job`` keeps the most of its GPUs and ``need`` GPUs fit (lowest
        ordinal among ties), with the job's free GPUs there in index order; or None."""
        best: tuple[int, list[int]] | None = None
        free_idx = self.free_idx
        free = self.free
        for o, idxs in self.prev[job].items():
            if free[o] < need:
                continue
            mine = set(idxs)
            own = [i for i in free_idx[o] if i in mine]
            if own and (best is None or (-len(own), o) < (-len(best[1]), best[0])):
                best = (o, own)
        return best

    def place_job(self, job: str, share: int, allow_split: bool) -> None:
        """Place one job (CoDDL §4.4 order of preference); leave it unassigned if impossible."""
        self.start(job)
        fam = self.family[job]
        g = self.gpn.get(fam, 0)
        if g == 0 or self.total_free.get(fam, 0) < share:
            return
        whole, rest = divmod(share, g)
        if self._place_packed(job, fam, g, whole, rest):
            return
        # Rolling back frees the GPUs; the displacement costs of nodes it had taken stay
        # raised (only a tie-break heuristic, never validity).
        self.release(job)
        if allow_split:
            self.place_split(job, share)

    def _place_packed(self, job: str, fam: str, g: int, whole: int, rest: int) -> bool:
        if whole:
            chosen = 0
            mine = self.prev[job]
            for o in sorted(mine, key=lambda o: (-len(mine[o]), o)):
                if chosen == whole:
                    break
                if self.cap[o] != g or self.free[o] != g:
                    continue
                # AFS appendix E: a multi-node share owns its nodes, so keeping one evicts
                # every other job there. The first kept node saves this job from moving, so
                # keep it unless yielding it lets more jobs (then more GPUs) stay; a further
                # node only adds kept GPUs, so it must evict nobody.
                if self.want[o] == 0 or (chosen == 0 and self._worth_keeping(o, fam, g, len(mine[o]), whole)):
                    self.claim(o, job, list(self.free_idx[o]))
                    self.node_taken(o)
                    chosen += 1
            while chosen < whole:
                fresh = self.peek_whole(fam, g)
                if fresh is None:
                    return False
                self.claim(fresh, job, list(self.free_idx[fresh]))
                self.node_taken(fresh)
                chosen += 1
        if rest:
            kept = self.keep_fit(job, rest)
            if kept is not None and len(kept[1]) >= rest:
                # Its own GPUs suffice: what choose_indices picks first (lowest indices).
                self.claim(kept[0], job, kept[1][:rest])
                return True
            at = self.fresh_fit(fam, rest) if kept is None else kept[0]
            if at is None:
                return False
            self.claim(at, job, self.choose_indices(at, job, rest))
        return True


def place_min_migration(
    topology: Topology,
    shares: Mapping[str, int],
    previous: Mapping[str, tuple[GpuRef, ...]],
    gpu_types: Mapping[str, str] | None = None,
    *,
    allow_split: bool = True,
) -> Placement:
    """Place shares on concrete GPUs, moving as few jobs as possible (CoDDL §4.4).

    Args:
        topology: Usable GPUs per node.
        shares: job id -> GPUs (ideally regulated by :func:`regulate_shares`).
        previous: job id -> GPUs it holds now.
        gpu_types: job id -> GPU type it must run on (absent or ``""``: any node).
        allow_split: Spread a job that cannot be packed over several nodes rather than
            leave it unplaced.

    Returns:
        The placement; jobs that could not be placed are in ``unplaced``.

    Raises:
        PlacementError: On a negative share.
    """
    quick = _place_kept_and_new(topology, shares, previous, gpu_types)
    if quick is not None:
        return quick
    return _place_all(_MinMigration(topology, shares, previous, gpu_types), allow_split)


def _place_kept_and_new(
    topology: Topology,
    shares: Mapping[str, int],
    previous: Mapping[str, tuple[GpuRef, ...]],
    gpu_types: Mapping[str, str] | None,
) -> Placement | None:
    """The shortcut of the module docstring: the placement when every job keeps its GPUs
    or held none, all shares below a node; None when that does not hold (then the full
    steps decide)."""
    ti = _topology_index(topology)
    types = gpu_types or {}
    gpn, ord_of, usable, node_families = ti.gpn, ti.ord_of, ti.usable, ti.node_families
    slack = list(ti.cap)  # per node: GPUs that no job keeps
    held: set[tuple[int, int]] = set()
    placements: dict[str, tuple[GpuRef, ...]] = {}
    new: list[tuple[int, str, str]] = []
    for job, share in shares.items():
        if share <= 0:
            if share < 0:
                return None  # the full steps raise the error
            continue
        fam = types.get(job, "") or ""
        if share >= gpn.get(fam, 0):
            return None  # whole nodes (or no node of the job's type)
        before = previous.get(job)
        if not before:
            new.append((-share, job, fam))
            continue
        if len(before) != share:
            return None
        o = ord_of.get(before[0].node_id)
        if o is None or fam not in node_families[o]:
            return None
        for g in before:
            key = (o, g.index)
            if g.node_id != before[0].node_id or g.index not in usable[o] or key in held:
                return None
            held.add(key)
        slack[o] -= share
        placements[job] = tuple(before) if share == 1 else tuple(sorted(before))
    if new:
        new.sort()  # step 1 among jobs that held nothing: largest share, then job id
        ref, max_cap = ti.ref, ti.max_cap
        free: dict[int, list[int]] = {}
        # by_slack[fam][s]: heap of the family's nodes whose slack was s when pushed (slack
        # only falls here, so an entry is stale exactly when the node's slack moved on).
        by_slack: dict[str, list[list[int]]] = {}
        for neg_share, job, fam in new:
            share = -neg_share
            buckets = by_slack.get(fam)
            if buckets is None:
                buckets = by_slack[fam] = [[] for _ in range(max_cap + 1)]
                for o in ti.members[fam]:
                    buckets[slack[o]].append(o)  # ordinals ascending: already a heap
            at = None
            for k in range(share, max_cap + 1):
                heap = buckets[k]
                while heap and slack[heap[0]] != k:
                    heapq.heappop(heap)
                if heap:
                    at = heap[0]
                    break
            if at is None:
                return None  # it would displace a kept job
            avail = free.get(at)
            if avail is None:
                avail = free[at] = [i for i in ti.sorted_idx[at] if (at, i) not in held]
            chosen = _nearest_first(avail, share)
            for i in chosen:
                avail.remove(i)
            slack[at] -= share
            for f in node_families[at]:
                fam_buckets = by_slack.get(f)
                if fam_buckets is not None:
                    heapq.heappush(fam_buckets[slack[at]], at)
            placements[job] = tuple(ref[at][i][1] for i in sorted(chosen))
    return Placement(placements=placements, migrations=0, unplaced={})


def _nearest_first(avail: list[int], n: int) -> list[int]:
    """``n`` of the free GPU indices ``avail`` (sorted) as step 4 picks them for a job that
    keeps none here and harms nobody: the lowest first, then each nearest those chosen
    (ties: lowest index)."""
    chosen = [avail[0]]
    while len(chosen) < n:
        chosen.append(
            min((i for i in avail if i not in chosen), key=lambda i: (min(abs(i - k) for k in chosen), i))
        )
    return chosen


def _place_all(cluster: _MinMigration, allow_split: bool) -> Placement:
    """Step 1: place every job of ``cluster`` in order (see the module docstring)."""

    shares, had_previous, keeps = cluster.shares, cluster.had_previous, cluster.keeps
    order = sorted(shares, key=lambda j: (-shares[j], j not in had_previous, -keeps.get(j, 0), j))
    for job in order:
        cluster.place_job(job, cluster.shares[job], allow_split)
    return cluster.result()

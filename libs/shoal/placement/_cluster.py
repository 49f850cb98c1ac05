"""Scratch state shared by the placers: free GPUs per node, indexed for fast choice.

One :class:`Cluster` lives for one placement call and never escapes it, so the
placers stay pure functions of their arguments; what depends on the topology alone
(node ids, capacities, families) is computed once per topology object and shared,
read only, between calls. Nodes are addressed by their
ordinal in ``Topology.nodes``. A *family* is the set of nodes a job may use: ``""``
(every node) for an untyped job, or a GPU type.

Lookups are bucketed by free-GPU count (a node has few GPUs), with lazily deleted
heap entries, so a placement costs O((jobs + GPUs) · log nodes) rather than
jobs × nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from shoal.events import GpuRef
from shoal.placement.topology import Placement, PlacementError, Topology


class _TopologyIndex:
    """What a :class:`Cluster` derives from the topology alone (nothing here is mutated)."""

    def __init__(self, topology: Topology) -> None:
        nodes = topology.nodes
        self.node_ids = [n.node_id for n in nodes]
        self.cap = [len(n.gpu_indices) for n in nodes]
        self.sorted_idx = [tuple(sorted(n.gpu_indices)) for n in nodes]
        self.ord_of = {n.node_id: o for o, n in enumerate(nodes)}
        self.usable = [frozenset(n.gpu_indices) for n in nodes]
        # Families: "" holds every node, a type holds the nodes of that type.
        self.node_families: list[tuple[str, ...]] = [("", n.gpu_type) if n.gpu_type else ("",) for n in nodes]
        self.members: dict[str, list[int]] = {}
        for o, fams in enumerate(self.node_families):
            for f in fams:
                self.members.setdefault(f, []).append(o)
        self.total_free = {f: sum(self.cap[o] for o in ms) for f, ms in self.members.items()}
        self.gpn = {f: max(self.cap[o] for o in ms) for f, ms in self.members.items()}
        self.max_cap = max(self.cap, default=0)
        self.free_buckets: dict[str, list[list[int]]] = {
            f: [[] for _ in range(self.max_cap + 1)] for f in self.members
        }
        for f, ms in self.members.items():
            for o in ms:
                self.free_buckets[f][self.cap[o]].append(o)  # ordinals ascending: already a heap
        # ref[o][i]: (rank in GpuRef order, GpuRef) of usable GPU i of node o, made once.
        self.ref: list[dict[int, tuple[int, GpuRef]]] = [{} for _ in nodes]
        for k, r in enumerate(sorted(GpuRef(n.node_id, i) for n in nodes for i in n.gpu_indices)):
            self.ref[self.ord_of[r.node_id]][r.index] = (k, r)


_last_topology: tuple[Topology, _TopologyIndex] | None = None


def _topology_index(topology: Topology) -> _TopologyIndex:
    """The index of ``topology``, reused while callers pass the same (frozen) object:
    the simulator and the placer service place on one topology many times."""
    global _last_topology
    last = _last_topology
    if last is not None and last[0] is topology:
        return last[1]
    index = _TopologyIndex(topology)
    _last_topology = (topology, index)
    return index


class Cluster:
    """Mutable free-GPU bookkeeping for one placement call."""

    def __init__(
        self,
        topology: Topology,
        shares: Mapping[str, int],
        previous: Mapping[str, tuple[GpuRef, ...]],
        gpu_types: Mapping[str, str] | None,
    ) -> None:
        ti = _topology_index(topology)
        # Shared with other calls on the same topology, read only: node_ids, cap,
        # node_families, members, gpn.
        self.node_ids = ti.node_ids
        self._ref = ti.ref
        self.cap = ti.cap
        self.free = list(ti.cap)
        self.free_idx: list[list[int]] = [list(idx) for idx in ti.sorted_idx]
        ord_of = ti.ord_of
        usable = ti.usable
        types = gpu_types or {}

        self.shares: dict[str, int] = {}
        for job, s in shares.items():
            if s < 0:
                raise PlacementError(f"negative share {s} for {job!r}")
            if s > 0:
                self.shares[job] = s
        self.family: dict[str, str] = {j: types.get(j, "") or "" for j in self.shares}

        # Families: "" holds every node, a type holds the nodes of that type.
        self.node_families: list[tuple[str, ...]] = ti.node_families
        self.members: dict[str, list[int]] = ti.members
        self.total_free: dict[str, int] = dict(ti.total_free)
        self.gpn: dict[str, int] = ti.gpn
        self.max_cap = ti.max_cap
        # free_buckets[family][k]: heap of node ordinals whose free count was k when pushed.
        self.free_buckets: dict[str, list[list[int]]] = {
            f: [list(b) for b in buckets] for f, buckets in ti.free_buckets.items()
        }

        # Previous GPUs still usable, on nodes the job may use: job -> node -> sorted indices.
        self.prev: dict[str, dict[int, list[int]]] = {}
        self.prev_owner: dict[tuple[int, int], str] = {}
        # Sorted, so that when two jobs claim the same previous GPU (a stale or inconsistent
        # history) the smaller job id owns it, whatever the order of the mappings.
        for job in sorted(self.shares):
            fam = self.family[job]
            by_node: dict[int, list[int]] = {}
            for g in previous.get(job, ()):
                at = ord_of.get(g.node_id)
                if at is None or g.index not in usable[at] or fam not in self.node_families[at]:
                    continue
                by_node.setdefault(at, []).append(g.index)
            for o, idxs in by_node.items():
                by_node[o] = sorted(set(idxs))
                for i in by_node[o]:
                    self.prev_owner.setdefault((o, i), job)
            self.prev[job] = by_node
        self.had_previous = {j for j in self.shares if previous.get(j)}
        self.processed: set[str] = set()
        self.assigned: dict[str, list[tuple[int, int]]] = {}

    # -- queries -------------------------------------------------------------------

    def eligible(self, o: int, fam: str) -> bool:
        """Whether node ``o`` belongs to family ``fam``."""
        return fam in self.node_families[o]

    def peek_free(self, fam: str, k: int) -> int | None:
        """The lowest-ordinal node of ``fam`` with exactly ``k`` free GPUs, or None."""
        heap = self.free_buckets[fam][k]
        free = self.free
        while heap and free[heap[0]] != k:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def best_fit(self, fam: str, need: int) -> int | None:
        """The node of ``fam`` with the fewest free GPUs that still holds ``need`` (lowest ordinal)."""
        for k in range(max(need, 1), self.max_cap + 1):
            o = self.peek_free(fam, k)
            if o is not None:
                return o
        return None

    def most_free(self, fam: str) -> int | None:
        """The node of ``fam`` with the most free GPUs (lowest ordinal among ties), or None."""
        for k in range(self.max_cap, 0, -1):
            o = self.peek_free(fam, k)
            if o is not None:
                return o
        return None

    def is_multi_node(self, job: str) -> bool:
        """Whether ``job``'s share needs at least one whole node of its type."""
        return self.shares[job] >= self.gpn.get(self.family[job], 0) > 0

    def choose_indices(self, o: int, job: str, n: int) -> list[int]:
        """``n`` free GPU indices on node ``o`` for ``job``.

        The job's own previous GPUs come first (CoDDL §4.4: a job that keeps a GPU need
        not migrate), lowest index first. The rest are chosen one at a time by the harm
        done to jobs not placed yet that hold them: none for a free GPU or one its holder
        has to spare (it held more here than its new share), more for one the holder
        would have kept, most for a holder's last GPU here or one that breaks a whole node
        a multi-node holder could keep; then nearest the job's kept GPUs, then lowest index.
        """
        avail = self.free_idx[o]
        mine = set(self.prev.get(job, {}).get(o, ()))
        kept = [i for i in avail if i in mine][:n]
        if len(kept) == n:
            return kept
        kept_set = set(kept)
        rest = [i for i in avail if i not in kept_set]
        owner_of: dict[int, str] = {}
        held: dict[str, int] = {}
        for i in rest:
            u = self.prev_owner.get((o, i))
            if u is not None and u != job and u not in self.processed:
                owner_of[i] = u
                held[u] = held.get(u, 0) + 1
        chosen = list(kept)

        def near(i: int) -> int:
            return min(abs(i - k) for k in chosen) if chosen else 0

        while len(chosen) < n:
            best: tuple[int, int, int] | None = None
            for i in rest:
                u = owner_of.get(i)
                if u is None:
                    harm = 0
                elif self.is_multi_node(u) or held[u] == 1:
                    harm = 2
                else:
                    harm = 0 if held[u] > self.shares[u] else 1
                key = (harm, near(i), i)
                if best is None or key < best:
                    best = key
            assert best is not None  # callers ask for at most the free GPUs
            i = best[2]
            rest.remove(i)
            chosen.append(i)
            u = owner_of.get(i)
            if u is not None:
                held[u] -= 1
        return chosen

    # -- updates -------------------------------------------------------------------

    def on_free_changed(self, o: int) -> None:
        """Hook for placers that index nodes by more than their free count."""

    def claim(self, o: int, job: str, idxs: list[int]) -> None:
        """Give GPUs ``idxs`` of node ``o`` to ``job``."""
        if len(idxs) == 1:
            left = list(self.free_idx[o])
            left.remove(idxs[0])
        else:
            taken = set(idxs)
            left = [i for i in self.free_idx[o] if i not in taken]
        self.free_idx[o] = left
        self._set_free(o, len(left))
        got = self.assigned.get(job)
        if got is None:
            self.assigned[job] = [(o, i) for i in idxs]
        else:
            got.extend((o, i) for i in idxs)

    def release(self, job: str) -> None:
        """Undo every claim of ``job`` (a rolled-back attempt)."""
        by_node: dict[int, list[int]] = {}
        for o, i in self.assigned.pop(job, []):
            by_node.setdefault(o, []).append(i)
        for o, idxs in by_node.items():
            self.free_idx[o] = sorted(self.free_idx[o] + idxs)
            self._set_free(o, len(self.free_idx[o]))

    def _set_free(self, o: int, value: int) -> None:
        delta = value - self.free[o]
        self.free[o] = value
        for f in self.node_families[o]:
            self.total_free[f] += delta
            heapq.heappush(self.free_buckets[f][value], o)
        self.on_free_changed(o)

    def place_split(self, job: str, share: int) -> bool:
        """Last resort: ``share`` GPUs over the fewest nodes (most free first).

        Returns:
            Whether the job was placed.
        """
        fam = self.family[job]
        if self.total_free.get(fam, 0) < share:
            return False
        need = share
        while need > 0:
            o = self.most_free(fam)
            if o is None:  # pragma: no cover - total_free guarantees a node
                self.release(job)
                return False
            take = min(need, self.free[o])
            self.claim(o, job, self.choose_indices(o, job, take))
            need -= take
        return True

    def result(self) -> Placement:
        """The placement built so far: placed jobs, migrations, and the rest as unplaced."""
        placements: dict[str, tuple[GpuRef, ...]] = {}
        migrations = 0
        ref = self._ref
        for job, gpus in self.assigned.items():
            if len(gpus) == 1:
                o, i = gpus[0]
                placements[job] = (ref[o][i][1],)
            else:
                placements[job] = tuple(r for _, r in sorted([ref[o][i] for o, i in gpus]))
            if job in self.had_previous:
                mine = self.prev.get(job, {})
                if not any(i in mine.get(o, ()) for o, i in gpus):
                    migrations += 1
        unplaced = {j: s for j, s in self.shares.items() if j not in placements}
        return Placement(placements=placements, migrations=migrations, unplaced=unplaced)

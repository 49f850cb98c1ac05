"""The profiler's snapshot: its :class:`~shoal.profiling.ProfileBook` and what it needs to resume.

A cluster-state snapshot (:data:`shoal.projection.CLUSTER_SNAPSHOT`) does not hold the
progress measurements the profiler folds, so the profiler keeps a snapshot of its own
(object :data:`PROFILER_SNAPSHOT` in the object store
``Names.profiler_snapshot_bucket``). It holds, as of one stream sequence:

- the folded :class:`~shoal.state.ClusterState` (encoded as in the cluster snapshot,
  with its digest);
- the book's folded measurements: samples per (job, GPU type, GPU count), loss points,
  data-epoch starts, the sequences of the newest sample and loss point (the
  deterministic event ids), each job's last report;
- the :class:`~shoal.profiling.ProfileParams` the book was folded with;
- the profiler's cursors: when each (job, GPU type) model and each convergence estimate
  in the log occurred, and the newest sequence on each profiler subject.

Everything in it is a function of the log up to its sequence: what a leader has
already planned (the book's dirty sets) and the count of rejected reports are left out.
On restore the dirty sets are rebuilt as a fresh fold leaves them (every (job, GPU type)
with a sample, every job with a loss point), so a profiler restored from a snapshot
plus the tail holds what a full replay holds and re-examines the same jobs on taking
the lease. ``rejected`` then counts only what this process folded itself.

Encoding: msgpack through msgspec (no pickle), maps in the fold's insertion order (the
order a restored fold continues in); the same book at the same sequence encodes to the
same bytes. The stored digest is the SHA-256 of the encoded payload;
:func:`check_profiler_snapshot` checks the bytes against it, then that the payload
decodes, that its cluster state reproduces its own digest, the schema, the parameters,
and the sequence against the stream's end. This module is pure (no I/O).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from shoal import state as st
from shoal.bus import Snapshot
from shoal.profiling import ProfileBook, ProfileParams, _Last

PROFILER_SNAPSHOT = "profiler"
"""Object name of the profiler's snapshot."""

PROFILER_SNAPSHOT_SCHEMA = 1
"""Version of :class:`ProfilerPayload`. A snapshot of any other schema is ignored (and the
log replayed): there is no migration between versions."""


class LastReport(msgspec.Struct, array_like=True):
    iteration: int
    at: float
    epoch: int
    num_gpus: int
    gpu_type: str


class BookPayload(msgspec.Struct, kw_only=True):
    """The folded part of a :class:`~shoal.profiling.ProfileBook` (tuple keys as rows)."""

    rates: dict[str, dict[str, dict[int, list[float]]]]
    losses: dict[str, list[tuple[int, float]]]
    epoch_starts: dict[str, dict[int, int]]
    basis: list[tuple[str, str, int]]
    loss_basis: dict[str, int]
    last: dict[str, LastReport]


class ProfilerPayload(msgspec.Struct, kw_only=True):
    """What :attr:`Snapshot.state` holds for :data:`PROFILER_SNAPSHOT`."""

    cluster: bytes
    """:func:`shoal.state.encode_state` of the folded cluster state."""
    cluster_digest: str
    params: ProfileParams
    book: BookPayload
    model_at: list[tuple[str, str, float]]
    convergence_at: dict[str, float]
    subject_seq: dict[str, int]


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(ProfilerPayload)


@dataclass
class Restored:
    """A checked profiler snapshot, decoded (the caller owns every object in it)."""

    seq: int
    state: st.ClusterState
    book: ProfileBook
    model_at: dict[tuple[str, str], float]
    convergence_at: dict[str, float]
    subject_seq: dict[str, int]


def book_payload(book: ProfileBook) -> BookPayload:
    """The folded measurements of ``book`` (no dirty sets, no rejection counts)."""
    return BookPayload(
        rates=book.rates,
        losses=book.losses,
        epoch_starts=book.epoch_starts,
        basis=[(job, gpu_type, seq) for (job, gpu_type), seq in book.basis.items()],
        loss_basis=book.loss_basis,
        last={
            job: LastReport(last.iteration, last.at, last.epoch, last.num_gpus, last.gpu_type)
            for job, last in book.last.items()
        },
    )


def book_from(payload: BookPayload, params: ProfileParams) -> ProfileBook:
    """A book holding ``payload``, its dirty sets as a fresh fold of the same log leaves them."""
    book = ProfileBook(params)
    book.rates = payload.rates
    book.losses = payload.losses
    book.epoch_starts = payload.epoch_starts
    book.basis = {(job, gpu_type): seq for job, gpu_type, seq in payload.basis}
    book.loss_basis = payload.loss_basis
    book.last = {
        job: _Last(iteration=r.iteration, at=r.at, epoch=r.epoch, num_gpus=r.num_gpus, gpu_type=r.gpu_type)
        for job, r in payload.last.items()
    }
    # A full replay marks every sample and loss point dirty and nothing clears them
    # before the first plan; ``forget`` drops a job from both at once.
    book.dirty_models = set(book.basis)
    book.dirty_convergence = set(book.loss_basis)
    return book


def encode_profiler_snapshot(
    *,
    seq: int,
    state: st.ClusterState,
    book: ProfileBook,
    model_at: Mapping[tuple[str, str], float],
    convergence_at: Mapping[str, float],
    subject_seq: Mapping[str, int],
) -> Snapshot:
    """The snapshot of a profiler that has folded the log up to ``seq`` (call it with no
    await between the fold and this, so every part is as of ``seq``)."""
    payload = ProfilerPayload(
        cluster=st.encode_state(state),
        cluster_digest=st.digest(state),
        params=book.params,
        book=book_payload(book),
        model_at=[(job, gpu_type, at) for (job, gpu_type), at in model_at.items()],
        convergence_at=dict(convergence_at),
        subject_seq=dict(subject_seq),
    )
    data = _ENC.encode(payload)
    return Snapshot(
        name=PROFILER_SNAPSHOT,
        seq=seq,
        digest=hashlib.sha256(data).hexdigest(),
        state=data,
        schema=PROFILER_SNAPSHOT_SCHEMA,
    )


def check_profiler_snapshot(
    snap: Snapshot, *, stream_last_seq: int, params: ProfileParams
) -> tuple[Restored | None, str]:
    """The decoded snapshot if it can be used, else None and why not (pure).

    Usable: schema :data:`PROFILER_SNAPSHOT_SCHEMA`; a sequence not past
    ``stream_last_seq`` (a snapshot of a log since deleted describes another log); a
    payload whose SHA-256 is the stored digest and that decodes; a cluster state that
    reproduces its own digest; folded with ``params`` (other parameters fold other
    averages: the book would not be what a replay builds).
    """
    if snap.schema != PROFILER_SNAPSHOT_SCHEMA:
        return None, f"schema {snap.schema} is not this reader's {PROFILER_SNAPSHOT_SCHEMA}"
    if snap.seq > stream_last_seq:
        return None, f"sequence {snap.seq} is past the stream's last sequence {stream_last_seq}"
    if not snap.digest:
        return None, "no digest"
    actual = hashlib.sha256(snap.state).hexdigest()
    if actual != snap.digest:
        return None, f"digest mismatch (stored {snap.digest[:12]}, payload {actual[:12]})"
    try:
        payload = _DEC.decode(snap.state)
        state = st.decode_state(payload.cluster)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return None, f"payload does not decode: {exc}"
    if st.digest(state) != payload.cluster_digest:
        return None, "cluster state digest mismatch"
    if payload.params != params:
        return None, f"folded with other parameters ({payload.params} here: {params})"
    return (
        Restored(
            seq=snap.seq,
            state=state,
            book=book_from(payload.book, params),
            model_at={(job, gpu_type): at for job, gpu_type, at in payload.model_at},
            convergence_at=payload.convergence_at,
            subject_seq=payload.subject_seq,
        ),
        "",
    )

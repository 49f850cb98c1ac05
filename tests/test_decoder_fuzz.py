"""Issue 20: hypothesis fuzzing of the decoders that the log's codec and admission's
fuzz tests (``tests/test_codec.py``, ``tests/clients/test_fuzz_admission.py``,
``tests/test_query_fuzz.py``) do not cover. Each takes bytes from outside the process:

* a job file (``shoal submit job.yaml``): :func:`shoal.commands.jobs.read_job_file`
  gives a mapping or a :class:`~shoal.cli.CommandError` (exit 2), never a traceback;
* a snapshot object from the object store: what :meth:`shoal.bus.Bus.load_snapshot`
  decodes raises only what :class:`shoal.projection.Projection` catches, and the checks
  of a decoded snapshot (cluster and profiler) answer "unusable" instead of raising;
* the sidecar/worker control protocol (real mode, a TCP line protocol on localhost):
  each decoder returns a message or raises ``ValueError``, which its reader catches;
* the node daemon's orders to an emulated sidecar (JSON lines on its stdin):
  :func:`parse_traced_order` returns an order or raises what the sidecar's loop catches.

Inputs: arbitrary bytes, and valid encodings with bytes flipped, cut or inserted (which
reach further into each decoder than random bytes do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from shoal import events as ev
from shoal import state as st
from shoal.bus import Snapshot
from shoal.cli import CommandError
from shoal.commands.jobs import read_job_file
from shoal.profiling.snapshot import check_profiler_snapshot
from shoal.projection import check_snapshot
from shoal.train import protocol as pr
from shoal_services.trainer_sidecar.emulated import parse_traced_order

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

JOB_FILE = b"""\
user: alice
model: resnet50
min_gpus: 1
max_gpus: 4
total_iterations: 1000
env: {OMP_NUM_THREADS: "4"}
"""


def _state_bytes() -> bytes:
    state = st.ClusterState()
    st.apply_event(state, ev.NodeRegistered(node_id="n0", gpus=(ev.GpuInfo(index=0, gpu_type="V100"),)), 1.0)
    st.apply_event(
        state, ev.JobSubmitted(job_id="j1", spec=ev.JobSpec(user="alice", total_iterations=10)), 2.0
    )
    return st.encode_state(state)


STATE = _state_bytes()
SNAPSHOT = msgspec.msgpack.encode(
    Snapshot(name="cluster", seq=2, digest=st.digest(st.decode_state(STATE)), state=STATE, schema=1)
)
ORDER = msgspec.json.encode(
    {
        "type": "cmd.reconfigure",
        "job_id": "j1",
        "epoch": 3,
        "gpus": [["n0", 0], ["n0", 1]],
        "effective_at": 12.5,
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
)
TO_SIDECAR = pr.encode(pr.Hello(worker=0, pid=123, gen=2, step=40))
TO_WORKER = pr.encode(pr.Plan(gen=2, members=(0, 1), src=0, store_host="127.0.0.1", store_port=29500))


@hs.composite
def mutated(draw: hs.DrawFn, seed: bytes) -> bytes:
    """``seed`` with a few bytes flipped, cut or inserted."""
    data = bytearray(seed)
    for _ in range(draw(hs.integers(1, 4))):
        op = draw(hs.sampled_from(["flip", "cut", "insert"]))
        at = draw(hs.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] = draw(hs.integers(0, 255))
        elif op == "cut":
            del data[at : at + draw(hs.integers(1, 8))]
        else:
            data[at:at] = draw(hs.binary(min_size=1, max_size=8))
    return bytes(data)


def inputs(seed: bytes) -> hs.SearchStrategy[bytes]:
    return hs.one_of(hs.binary(max_size=512), mutated(seed))


@FUZZ
@given(data=inputs(JOB_FILE))
def test_a_job_file_gives_a_mapping_or_a_clear_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(data)
    try:
        spec, _ = read_job_file(str(path))
    except CommandError as exc:
        assert str(exc)
        return
    assert isinstance(spec, dict)


@FUZZ
@given(data=inputs(SNAPSHOT))
def test_a_snapshot_object_is_read_or_ignored(data: bytes) -> None:
    """What ``load_snapshot`` decodes, then the two checks of a decoded snapshot."""
    try:
        snap = msgspec.msgpack.decode(data, type=Snapshot)
    except (msgspec.DecodeError, UnicodeDecodeError):  # what Projection._load catches
        return
    state, reason = check_snapshot(snap, stream_last_seq=10**6)
    assert (state is None) == bool(reason)
    restored, reason = check_profiler_snapshot(snap, stream_last_seq=10**6, params=_profile_params())
    assert (restored is None) == bool(reason)


@FUZZ
@given(state=inputs(STATE))
def test_a_snapshots_state_bytes_are_used_or_refused(state: bytes) -> None:
    """A snapshot whose envelope decodes but whose state bytes are damaged."""
    snap = Snapshot(name="cluster", seq=2, digest="x" * 64, state=state, schema=1)
    restored, reason = check_snapshot(snap, stream_last_seq=10**6)
    assert restored is None and reason
    restored_p, reason = check_profiler_snapshot(snap, stream_last_seq=10**6, params=_profile_params())
    assert restored_p is None and reason


def _profile_params() -> Any:
    from shoal.profiling import ProfileParams

    return ProfileParams()


@FUZZ
@given(data=inputs(TO_SIDECAR))
def test_a_control_line_to_the_sidecar_decodes_or_raises_value_error(data: bytes) -> None:
    try:
        msg = pr.decode_to_sidecar(data)
    except ValueError:  # what the sidecar's control server catches
        return
    assert isinstance(msg, pr.Msg)


@FUZZ
@given(data=inputs(TO_WORKER))
def test_a_control_line_to_a_worker_decodes_or_raises_value_error(data: bytes) -> None:
    try:
        msg = pr.decode_to_worker(data)
    except ValueError:  # what the worker's reader catches
        return
    assert isinstance(msg, pr.Msg)


@FUZZ
@given(data=inputs(ORDER))
def test_an_order_line_decodes_or_raises_what_the_sidecar_catches(data: bytes) -> None:
    try:
        order, fields = parse_traced_order(data)
    except (msgspec.ValidationError, msgspec.DecodeError):  # the sidecar's loop
        return
    assert isinstance(order, ev.Reconfigure)
    assert all(isinstance(v, str) for v in fields.values())

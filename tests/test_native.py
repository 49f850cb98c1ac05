"""The optional compiled build (``shoal native``, :mod:`shoal.native`): it is used only
for the sources it was built from, and a compiled module decides as its source does."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from shoal import native

SIM = """
import json, sys
from shoal.sim.engine import SimConfig, Simulator, make_policy
from shoal.workloads import load_workload
from shoal.native import loaded
trace, name, seed, flat = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "flat"
policy = make_policy(name, seed=seed)
result = Simulator(load_workload(trace, seed=seed), policy, SimConfig(flat=flat)).run()
summary = {k: float(v).hex() for k, v in result.summary.items()}
print(json.dumps({"summary": summary, "seed": getattr(policy, "seed", None), "compiled": loaded()}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_NATIVE")}
    return {**env, **extra}


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=_env(**env), capture_output=True, text=True, timeout=300, check=False)


def _manifest(directory: Path, **fields: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"digest": native.source_digest(), "abi": native._abi(), "modules": [], "extensions": {}}
    (directory / native.MANIFEST).write_text(json.dumps({**manifest, **fields}))


def test_a_build_of_other_sources_or_another_interpreter_is_not_used(tmp_path: Path) -> None:
    stale, foreign = tmp_path / "stale", tmp_path / "foreign"
    _manifest(stale, digest="0" * 64, modules=["shoal.state"], extensions={"shoal.state": "nowhere.so"})
    _manifest(foreign, abi="cpython-00:.so")
    probe = "import shoal, shoal.native as n; print(n._state.get('finder') is None)"
    for directory, why in ((stale, "built from other sources"), (foreign, "built for another interpreter")):
        assert native.status(directory)[0].startswith(why)
        proc = _run([sys.executable, "-c", probe], SHOAL_NATIVE_DIR=str(directory))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "True"  # no finder: everything from source
        assert why in proc.stderr
    cli = _run([sys.executable, "-m", "shoal.cli", "native", "status"], SHOAL_NATIVE_DIR=str(stale))
    assert cli.returncode == 1 and "built from other sources" in cli.stdout


def test_a_build_that_others_can_write_is_not_used(tmp_path: Path) -> None:
    directory = tmp_path / "build"
    _manifest(directory)
    assert native.status(directory)[0] == "active"
    directory.chmod(0o777)
    assert "writable by other users" in native.status(directory)[0]
    directory.chmod(0o755)
    (directory / native.MANIFEST).chmod(0o666)
    assert "writable by other users" in native.status(directory)[0]


def test_the_digest_covers_every_source_file(tmp_path: Path) -> None:
    copy = tmp_path / "shoal"
    shutil.copytree(native.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "_native*"))
    before = native.source_digest(copy)
    assert before == native.source_digest()
    target = copy / "fairness" / "stride.py"
    target.write_text(target.read_text() + "\n# an edit\n")
    assert native.source_digest(copy) != before


def test_off_switch_and_clean(tmp_path: Path) -> None:
    directory = tmp_path / "build"
    _manifest(directory)
    assert native.status(directory)[0] == "active"
    off = _run(
        [sys.executable, "-m", "shoal.cli", "native", "status"],
        SHOAL_NATIVE_DIR=str(directory),
        SHOAL_NATIVE="0",
    )
    assert off.returncode == 0 and "off (SHOAL_NATIVE=0)" in off.stdout
    clean = _run([sys.executable, "-m", "shoal.cli", "native", "clean"], SHOAL_NATIVE_DIR=str(directory))
    assert clean.returncode == 0 and not directory.exists()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_compiled_policy_decides_as_its_source(tmp_path: Path) -> None:
    """Themis compiled alone, loaded by ``import shoal`` in a fresh process: the registry
    still gives it its seed (a compiled class reports positional-only parameters), and a
    simulation with topology and seed 1 (the leftover order is seeded) has the summary of
    the pure run, bit for bit."""
    directory = native.build(tmp_path / "build", modules=("shoal.policies.themis",))
    assert native.status(directory)[0] == "active"
    args = [sys.executable, "-c", SIM, "philly:2869ce:150", "themis", "1", "topology"]
    compiled = _run(args, SHOAL_NATIVE_DIR=str(directory))
    pure = _run(args, SHOAL_NATIVE_DIR=str(directory), SHOAL_NATIVE="0")
    assert compiled.returncode == 0, compiled.stderr
    assert pure.returncode == 0, pure.stderr
    fast, slow = json.loads(compiled.stdout), json.loads(pure.stdout)
    assert fast["compiled"] == ["shoal.policies.themis"]
    assert slow["compiled"] == []
    assert fast["seed"] == slow["seed"] == 1
    assert fast["summary"] == slow["summary"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_shoal_native_build_compiles_every_listed_module(tmp_path: Path) -> None:
    """The command a user runs: every module of NATIVE_MODULES built and loaded, and
    compiled policies on the compiled fold, view, checks and placement deciding as their
    sources, among them the AFS-L run that showed compiled code losing a tuple's identity
    (its kept keys; ``shoal.policies.afs._LengthKey``)."""
    directory = tmp_path / "build"
    proc = _run([sys.executable, "-m", "shoal.cli", "native", "build"], SHOAL_NATIVE_DIR=str(directory))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = _run([sys.executable, "-m", "shoal.cli", "native", "status"], SHOAL_NATIVE_DIR=str(directory))
    assert status.returncode == 0 and "active" in status.stdout
    probe = "import importlib, shoal.native as n; [importlib.import_module(m) for m in n.NATIVE_MODULES]; print(n.loaded())"
    loaded = _run([sys.executable, "-c", probe], SHOAL_NATIVE_DIR=str(directory))
    assert loaded.stdout.strip() == repr(list(native.NATIVE_MODULES)), loaded.stderr
    # The services with the build: a conformance case through the emulated stack (its
    # services start from a snapshot of the folded state and answer queries with it).
    conformance = Path(__file__).resolve().parents[1] / "benchmarks" / "conformance.py"
    case = [sys.executable, str(conformance), "--case", "philly:0e4a51:12,afs-p,1000", "--output", "-"]
    live = _run(case, SHOAL_NATIVE_DIR=str(directory))
    assert live.returncode == 0, live.stderr[-3000:]
    row = next(line for line in live.stdout.splitlines() if line.startswith("| philly:0e4a51:12"))
    assert row.endswith("| met | met |"), row
    # The command a user runs, with the build: `shoal demo` starts the services as processes.
    demo = [sys.executable, "-m", "shoal.cli", "demo", "--jobs", "5", "--time-scale", "5000"]
    demo += ["--nodes", "2", "--gpus-per-node", "2", "--tick", "0.5"]
    shown = _run(demo, SHOAL_NATIVE_DIR=str(directory))
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert re.search(r"^\s*jobs completed\s+5/5$", shown.stdout, flags=re.M), shown.stdout
    for run in (
        ("philly:0e4a51:250", "afs-l", "1", "topology"),
        ("philly:2869ce:200", "afs-p", "0", "flat"),
        ("philly:2869ce:200", "tiresias-l", "0", "flat"),
        ("philly:2869ce:100", "gandiva-fair", "0", "topology"),
    ):
        args = [sys.executable, "-c", SIM, *run]
        compiled = _run(args, SHOAL_NATIVE_DIR=str(directory))
        pure = _run(args, SHOAL_NATIVE="0")
        assert compiled.returncode == 0, compiled.stderr
        assert json.loads(compiled.stdout)["summary"] == json.loads(pure.stdout)["summary"], run


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_a_struct_that_would_decode_differently_stops_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fold compiled without the annotations decorator: mypyc writes
    ``dict[str, NodeState]`` as ``dict``, so a snapshot would decode its nodes as plain
    dicts. The build names the structs and leaves no build behind."""
    monkeypatch.setattr(native, "with_source_annotations", lambda source, module: source)
    target = tmp_path / "build"
    with pytest.raises(native.NativeBuildError, match=r"shoal\.state\.ClusterState"):
        native.build(target, modules=("shoal.state",))
    assert not target.exists() and not target.with_name("build.partial").exists()


STRUCTS = """\
\"\"\"Doc.\"\"\"

from __future__ import annotations

import msgspec
from msgspec import Struct


class Plain:
    x: int = 0


class A(Struct, kw_only=True):
    nodes: dict[str, A] = {}
    at: float | None = None


# a comment, then the blank line above the decorator

@staticmethod
class B(msgspec.Struct):
    y: list[int]


class C(A, frozen=True):
    z: tuple[int, ...] = ()
"""


def test_the_build_decorates_each_struct_with_its_source_annotations() -> None:
    out = native.with_source_annotations(STRUCTS, "m")
    lines, before = out.splitlines(), STRUCTS.splitlines()
    assert len(lines) == len(before)  # every line keeps its number
    changed = {i: line for i, line in enumerate(lines) if line != before[i]}
    assert sorted(before[i + 1].split("(")[0] for i in changed) == ["@staticmethod", "class A", "class C"]
    assert "annotated({'nodes': 'dict[str, A]', 'at': 'float | None'}, {'kw_only': True})" in out
    assert "annotated({'y': 'list[int]'}, {})" in out
    assert "annotated({'z': 'tuple[int, ...]'}, {'frozen': True})" in out
    assert "class Plain" in out and "annotated({'x'" not in out
    with pytest.raises(native.NativeBuildError, match="struct A: no blank line above it"):
        native.with_source_annotations(STRUCTS.replace("\n\nclass A", "\n# A\nclass A"), "m")


class _Node(msgspec.Struct):
    n: int = 0


class _Erased(msgspec.Struct):
    nodes: dict = {}  # ``dict[str, _Node]`` as mypyc writes it


class _Restored(msgspec.Struct):
    nodes: dict = {}


def test_annotated_gives_a_struct_the_annotations_of_its_source() -> None:
    data = b'{"nodes": {"a": {"n": 1}}}'
    assert msgspec.json.decode(data, type=_Erased).nodes == {"a": {"n": 1}}
    native.annotated({"nodes": "dict[str, _Node]"})(_Restored)
    assert msgspec.json.decode(data, type=_Restored).nodes == {"a": _Node(n=1)}


class _Frozen(msgspec.Struct):
    x: int
    y: list[int] = []  # a default factory, as msgspec makes it

    def total(self) -> int:
        return self.x + sum(self.y)


def test_annotated_creates_a_struct_again_with_its_class_keywords() -> None:
    """mypyc creates a struct without its class keywords (``frozen=True, kw_only=True``):
    the decorator makes it again with them, keeping its methods and defaults."""
    assert not _Frozen.__struct_config__.frozen
    made = native.annotated({"x": "int", "y": "list[int]"}, {"frozen": True, "kw_only": True})(_Frozen)
    assert made.__struct_config__.frozen
    assert made.__struct_fields__ == ("x", "y")
    one = made(x=1)
    assert one.y == [] and made(x=1, y=[2]).total() == 3
    with pytest.raises(TypeError):
        made(1)  # kw_only
    with pytest.raises(AttributeError):
        one.x = 2  # type: ignore[misc]


EXCEPTIONS = """\
from __future__ import annotations

import msgspec


class Stalled(RuntimeError):
    pass


class Worse(Stalled):
    pass


class NotOne(msgspec.Struct):
    pass
"""


def test_the_build_keeps_exception_classes_ordinary_python_classes() -> None:
    out = native.with_python_exceptions(EXCEPTIONS, "m")
    lines, before = out.splitlines(), EXCEPTIONS.splitlines()
    assert len(lines) == len(before)
    changed = [i for i, line in enumerate(lines) if line != before[i]]
    assert [before[i + 1] for i in changed[1:]] == ["class Stalled(RuntimeError):", "class Worse(Stalled):"]
    assert (
        lines[0]
        == "from __future__ import annotations; import mypy_extensions as _shoal_native_mypy_extensions"
    )
    assert lines[changed[1]] == "@_shoal_native_mypy_extensions.mypyc_attr(native_class=False)"
    assert native.with_python_exceptions("x = 1\n", "m") == "x = 1\n"

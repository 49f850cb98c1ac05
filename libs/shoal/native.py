"""An optional compiled build of the simulator's hot modules, from the same sources.

``shoal native build`` compiles :data:`NATIVE_MODULES` (the fold, the view, the decision
checks, placement, the simulator's metrics, log and costs, and the policies AFS-L,
AFS-P, Gandiva_fair, Themis, SRTF, Tiresias-L, Max-Min, FIFO, Optimus and Elastic
Tiresias) with mypyc, the compiler mypy ships, into :func:`native_dir`. The compiled
modules are the same source files, so the simulator, the services and every report run
the same fold, policies and placement either way, and a decision does not depend on
which form ran (``benchmarks/sim_equality.py --native`` compares the two over its 60
runs; ``tests/test_native.py`` runs simulations both ways, and the emulated services).

Two mechanical changes are made to the copy that is compiled (:func:`compiled_source`;
every line keeps its number):

* each msgspec struct class gets a decorator (:func:`annotated`), on the blank line
  above it, that gives the class the annotations and the class keywords of the source.
  mypyc drops both: a compiled ``ClusterState`` decoded a snapshot's nodes as plain
  dicts, and the allocator of the emulated stack stopped at its first decision; a
  ``frozen=True`` struct was mutable and unhashable;
* each exception class is marked ``mypyc_attr(native_class=False)``
  (:func:`with_python_exceptions`), so it stays the ordinary class of the source.

The build then checks that every struct of the package has, compiled, the
configuration, fields, constructor and JSON schema it has from source
(:func:`struct_schemas`), and fails otherwise.

A build applies only to the exact sources it was compiled from, and only when neither
its directory nor any of its files can be written by other users than their owner. Its manifest records a
digest of every ``.py`` file of the package (:func:`source_digest`) and the
interpreter's ABI; at ``import shoal`` (:func:`activate`) a build whose digest or ABI
differs is ignored as a whole, with one line on stderr, and everything runs from
source. Whole, because compiled modules call one another's functions directly, not
through the modules' attributes, and were compiled against the types of the modules
they import (compiled or not): loading some of a build and not the rest, or a build
beside changed sources, could mix two versions of the code. ``SHOAL_NATIVE=0`` turns a
build off.

Without a build (the default; the tests run so, but for ``tests/test_native.py``, which
makes its own) nothing here is active and shoal is pure Python. Building needs a C
compiler and the Python headers.

What a build changes besides speed: compiled functions check their arguments' types, so
a stand-in that is not the annotated class (a test's duck-typed double of a ``JobView``)
is refused with a ``TypeError``, and a class of one's own cannot subclass a compiled
class, a policy or the ``Simulator`` (mypyc's rule; with ``SHOAL_NATIVE=0`` it can).
Tests that use such doubles or subclasses (four of ``tests/policies``, two that
subclass the ``Simulator``) fail with a build active; the test suite runs from source.
Docstrings and constructor signatures of compiled classes are read from their source
files (:mod:`shoal.policies.registry`).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = Path(__file__).resolve().parent
MANIFEST = "manifest.json"

NATIVE_MODULES: tuple[str, ...] = (
    "shoal.state",
    "shoal.view",
    "shoal.allocation",
    "shoal.policies.base",
    "shoal.policies.common",
    "shoal.policies.afs",
    "shoal.policies.themis",
    "shoal.policies.srtf",
    "shoal.policies.tiresias",
    "shoal.policies.maxmin",
    "shoal.policies.fifo",
    "shoal.policies.optimus",
    "shoal.policies.elastic_tiresias",
    "shoal.fairness.balance",
    "shoal.fairness.hetero",
    "shoal.fairness.policy",
    "shoal.fairness.shares",
    "shoal.fairness.split_stride",
    "shoal.fairness.stride",
    "shoal.fairness.timeline",
    "shoal.fairness.trader",
    "shoal.fairness.workloads",
    "shoal.sim.engine",
    "shoal.sim.metrics",
    "shoal.sim.log",
    "shoal.sim.costs",
    "shoal.placement._cluster",
    "shoal.placement.consolidated",
    "shoal.placement.hinted",
    "shoal.placement.min_migration",
    "shoal.placement.packing",
    "shoal.placement.regulate",
    "shoal.placement.topology",
)
"""The modules a build compiles, from their sources with :func:`compiled_source`'s two
line-for-line changes; each was checked to decide bit for bit as its source does
(``benchmarks/reports/native_equality.md``).

Left out, and run from source: the policy registry (not hot) and the SideCar policies
(the SideCar module assigns a class attribute that is not a ``ClassVar``, which mypyc
refuses); the event, model and workload definitions (compiled with them, before
:func:`annotated` existed, msgspec refused a struct's field order at import: the class
keywords were lost, ``kw_only`` among them; not tried since); and the modules not tried
yet (the length-unaware wrapper, AFS for heterogeneous GPUs, the SideCar baselines,
everything the services alone use). The engine is compiled since
:func:`with_python_exceptions`: its one exception stays an ordinary class.

Ways compiled code differed from its source, each met and fixed in the source:

* a compiled module checks the annotated types at run time: ``shoal.policies.afs`` had
  one annotation wrong (``_length_key`` said the rank is an ``int``; it is a tuple), and
  the compiled AFS-L stopped with a ``TypeError``;
* a tuple whose type names each item is unboxed, so it is a new object each time it is
  boxed again and ``is`` no longer finds it: AFS-L recognised its kept keys by identity,
  compiled it took them all for stale and decided differently (the equality harness
  showed it); their type is now a plain tuple;
* a compiled class reports its constructor's parameters as positional-only, so the
  registry took Themis for a policy without a ``seed`` and built it with the default
  one; :func:`shoal.policies.registry.get_policy` now reads them as keywords.

And met in the build itself, by the two mechanical changes of :func:`compiled_source`:
mypyc drops a struct's type parameters and class keywords (:func:`annotated`), and
compiles no subclass of most built-in exceptions (:func:`with_python_exceptions`).
"""


class NativeBuildError(RuntimeError):
    """The compiler failed; the message ends with its output."""


def native_dir() -> Path:
    """Where a build lives: ``$SHOAL_NATIVE_DIR``, else ``_native`` in the package."""
    env = os.environ.get("SHOAL_NATIVE_DIR")
    return Path(env) if env else PACKAGE / "_native"


def source_digest(package: Path = PACKAGE) -> str:
    """SHA-256 of every ``.py`` file of the package (path and bytes, sorted by path)."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in ("_native",) or "__pycache__" in rel.parts:
            continue
        h.update(rel.as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _abi() -> str:
    return f"{sys.implementation.cache_tag}:{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def annotated(texts: dict[str, str], options: dict[str, Any] | None = None) -> Any:
    """Class decorator a build puts on each msgspec struct it compiles
    (:func:`with_source_annotations`), for two things mypyc does not carry over:

    * ``texts``, the text of the source annotations, become the class's
      ``__annotations__``, which is what ``from __future__ import annotations`` gives
      the class run from source. mypyc writes them without their type parameters
      (``dict[str, NodeState]`` becomes ``dict``, ``float | None`` becomes ``type``;
      mypyc issue 988), and msgspec decodes by them: a compiled ``ClusterState``
      decoded a snapshot's nodes as plain dicts. msgspec reads the types when it first
      decodes a class, so this is in time.
    * ``options``, the class keywords of the source (``frozen=True, kw_only=True``):
      mypyc creates a compiled module's classes without them, so a frozen struct was
      mutable and unhashable. The class is created again with them, from the same
      namespace (its compiled methods included) and defaults.
    """

    def decorate(cls: type) -> type:
        cls.__annotations__ = dict(texts)
        return _with_options(cls, options) if options else cls

    return decorate


def _with_options(cls: Any, options: dict[str, Any]) -> type:
    import types

    import msgspec

    fields: tuple[str, ...] = cls.__struct_fields__
    defaults = dict(
        zip(fields[len(fields) - len(cls.__struct_defaults__) :], cls.__struct_defaults__, strict=True)
    )
    encode = dict(zip(fields, cls.__struct_encode_fields__, strict=True))
    namespace: dict[str, Any] = {"__qualname__": cls.__qualname__}
    for key, value in cls.__dict__.items():
        if key in ("__slots__", "__dict__", "__weakref__"):
            continue
        if key in encode and isinstance(value, types.MemberDescriptorType):
            continue  # a field's slot: the field is declared again below
        namespace[key] = value
    for name in cls.__annotations__:
        if name not in encode:
            continue  # a ClassVar, or not this class's field
        spec: dict[str, Any] = {}
        if name in defaults:
            default = defaults[name]
            if type(default).__name__ == "Factory":
                spec["default_factory"] = default.factory
            else:
                spec["default"] = default
        if encode[name] != name:
            spec["name"] = encode[name]
        if spec:
            namespace[name] = msgspec.field(**spec)
    made: type = type(cls)(cls.__name__, cls.__bases__, namespace, **options)
    return made


def _blank_line_above(node: ast.ClassDef, lines: list[str], what: str) -> int:
    """Index in ``lines`` of the blank line above ``node`` and its decorators, where a
    build's decorator goes (so every line keeps its number)."""
    above = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 2
    if above < 0 or lines[above].strip():
        raise NativeBuildError(f"{what}: no blank line above it to put a decorator on")
    return above


def _is_struct_base(base: ast.expr, structs: set[str]) -> bool:
    if isinstance(base, ast.Name):
        return base.id == "Struct" or base.id in structs
    return isinstance(base, ast.Attribute) and base.attr == "Struct"


def with_source_annotations(source: str, module: str) -> str:
    """``source`` as a build compiles it: every msgspec struct class (a top-level class
    with a base named ``Struct`` or ``<module>.Struct``, or a struct class of the same
    module) decorated by :func:`annotated` with the text of its field annotations
    (``ast.unparse``). The decorator takes the place of the blank line above the class
    (or above its decorators), so every line keeps its number; nothing else changes.

    Raises:
        NativeBuildError: a struct class without a blank line above it.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    structs: set[str] = set()
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and any(_is_struct_base(b, structs) for b in node.bases)):
            continue
        structs.add(node.name)
        texts = {
            stmt.target.id: ast.unparse(stmt.annotation)
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        }
        try:
            options = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except ValueError as exc:
            raise NativeBuildError(
                f"{module}: struct {node.name} has a class keyword that is not a literal"
            ) from exc
        lines[_blank_line_above(node, lines, f"{module}: struct {node.name}")] = (
            f"@__import__('shoal.native', fromlist=['annotated']).annotated({texts!r}, {options!r})\n"
        )
    return "".join(lines)


def _is_exception_base(base: ast.expr, exceptions: set[str]) -> bool:
    import builtins

    if not isinstance(base, ast.Name):
        return False
    if base.id in exceptions:
        return True
    found = getattr(builtins, base.id, None)
    return isinstance(found, type) and issubclass(found, BaseException)


_MYPYC = "_shoal_native_mypy_extensions"


def with_python_exceptions(source: str, module: str) -> str:
    """``source`` as a build compiles it: every exception class (a top-level class with
    a built-in exception, or an exception class of the same module, as a base) marked
    ``@mypyc_attr(native_class=False)``, mypyc's own way of keeping a class an ordinary
    Python class inside a compiled module. (mypyc compiles only some built-in
    exceptions as bases of its native classes, ``RuntimeError`` not among them; an
    ordinary class is what the source defines anyway.) As in
    :func:`with_source_annotations`, the decorator takes the blank line above the class,
    and the import it needs joins the ``from __future__`` line: every line keeps its
    number.

    Raises:
        NativeBuildError: an exception class without a blank line above it, or a module
            with exception classes and no ``from __future__ import annotations`` line.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    exceptions: set[str] = set()
    for node in tree.body:
        if not (
            isinstance(node, ast.ClassDef) and any(_is_exception_base(b, exceptions) for b in node.bases)
        ):
            continue
        exceptions.add(node.name)
        above = _blank_line_above(node, lines, f"{module}: exception {node.name}")
        lines[above] = f"@{_MYPYC}.mypyc_attr(native_class=False)\n"
    if not exceptions:
        return source
    future = next(
        (
            n
            for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module == "__future__" and n.lineno == n.end_lineno
        ),
        None,
    )
    if future is None:
        raise NativeBuildError(f"{module}: no one-line `from __future__` import to join")
    line = lines[future.lineno - 1].rstrip("\n")
    lines[future.lineno - 1] = f"{line}; import mypy_extensions as {_MYPYC}\n"
    return "".join(lines)


def compiled_source(source: str, module: str) -> str:
    """What a build compiles of ``source``: :func:`with_source_annotations` and
    :func:`with_python_exceptions`; the same lines, with the same numbers."""
    return with_python_exceptions(with_source_annotations(source, module), module)


def build(target: Path | None = None, modules: Sequence[str] = NATIVE_MODULES) -> Path:
    """Compile ``modules`` into ``target`` (default :func:`native_dir`), replacing any
    build there. The sources are copied to a scratch directory first, so the package is
    never left with extension modules next to its ``.py`` files.

    Raises:
        NativeBuildError: mypyc or the C compiler failed.
    """
    import shutil
    import subprocess
    import tempfile

    target = target or native_dir()
    digest = source_digest()
    with tempfile.TemporaryDirectory(prefix="shoal-native-") as scratch:
        work = Path(scratch)
        shutil.copytree(
            PACKAGE, work / "shoal", ignore=shutil.ignore_patterns("__pycache__", "_native", "*.so")
        )
        files = [str(Path(*m.split(".")).with_suffix(".py")) for m in modules]
        for module, file in zip(modules, files, strict=True):
            path = work / file
            path.write_text(compiled_source(path.read_text(encoding="utf-8"), module), encoding="utf-8")
        proc = subprocess.run(
            [sys.executable, "-m", "mypyc", *files],
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NativeBuildError(
                f"mypyc failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
            )
        built = _extensions(work, exclude=work / "build")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        names: dict[str, str] = {}
        for name, path in built.items():
            rel = path.relative_to(work)
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            names[name] = rel.as_posix()
        missing = [m for m in modules if m not in names]
        if missing:
            raise NativeBuildError(f"mypyc produced no extension for {', '.join(missing)}")
        manifest = {"digest": digest, "abi": _abi(), "modules": list(modules), "extensions": names}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        try:
            _check_structs(staging, modules)
        except NativeBuildError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target


def struct_schemas() -> dict[str, Any]:
    """Every msgspec struct of the package (each module imported in turn; one that does
    not import here, for a missing optional dependency, is skipped) -> its
    configuration (``frozen``, ``eq``, ``tag``, ...), fields, encoded names, defaults,
    constructor parameters (``kw_only``) and JSON schema without descriptions and
    titles (what decoding it accepts and what it builds)."""
    import inspect
    import pkgutil

    import msgspec

    import shoal

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ("description", "title")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    out: dict[str, Any] = {}
    for info in pkgutil.walk_packages(shoal.__path__, "shoal."):
        if info.name.startswith("shoal._native"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if not (isinstance(obj, type) and issubclass(obj, msgspec.Struct)):
                continue
            if obj.__module__ != info.name:
                continue
            config = obj.__struct_config__
            described: dict[str, Any] = {
                "config": {a: repr(getattr(config, a)) for a in dir(config) if not a.startswith("_")},
                "fields": list(obj.__struct_fields__),
                "encode": list(obj.__struct_encode_fields__),
                "defaults": [repr(d) for d in obj.__struct_defaults__],
                "parameters": [(p.name, p.kind.name) for p in inspect.signature(obj).parameters.values()],
            }
            try:
                described["schema"] = strip(msgspec.json.schema(obj))
            except (TypeError, ValueError) as exc:
                described["schema"] = f"no schema: {exc}"
            out[f"{info.name}.{name}"] = described
    return out


_SCHEMAS_SCRIPT = (
    "import json, sys; from shoal import native; s = native.struct_schemas(); "
    "json.dump({'loaded': native.loaded(list(sys.modules)), 'schemas': s}, sys.stdout)"
)


def _check_structs(staging: Path, modules: Sequence[str]) -> None:
    """Fail unless the build in ``staging`` loads and every struct of the package is,
    compiled, what :func:`struct_schemas` says it is from source (two subprocesses)."""
    import subprocess

    def schemas(**env: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, "-c", _SCHEMAS_SCRIPT],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NativeBuildError(f"checking the build failed:\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    source = schemas(SHOAL_NATIVE="0")
    compiled = schemas(SHOAL_NATIVE="1", SHOAL_NATIVE_DIR=str(staging))
    not_loaded = sorted(set(modules) - set(compiled["loaded"]))
    if not_loaded:
        raise NativeBuildError(f"the build does not load: {', '.join(not_loaded)}")
    changed = sorted(
        name for name, schema in source["schemas"].items() if compiled["schemas"].get(name) != schema
    )
    if changed:
        raise NativeBuildError(
            f"compiled, these structs would decode differently from their source: {', '.join(changed)}"
        )


def _extensions(root: Path, exclude: Path) -> dict[str, Path]:
    """Module name -> file of every extension module under ``root`` (not ``exclude``)."""
    suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=len, reverse=True)
    found: dict[str, Path] = {}
    for path in root.rglob("*"):
        if exclude in path.parents or not path.is_file():
            continue
        suffix = next((s for s in suffixes if path.name.endswith(s)), None)
        if suffix is None:
            continue
        rel = path.relative_to(root)
        found[".".join((*rel.parts[:-1], rel.name[: -len(suffix)]))] = path
    return found


class _Finder:
    """Serves the modules of one build, by name, ahead of the source files."""

    def __init__(self, root: Path, extensions: dict[str, str]) -> None:
        self._paths = {name: root / rel for name, rel in extensions.items()}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        file = self._paths.get(fullname)
        if file is None:
            return None
        return importlib.util.spec_from_file_location(fullname, file)


_state: dict[str, object] = {}


def status(directory: Path | None = None) -> tuple[str, list[str]]:
    """Whether the build in ``directory`` (default :func:`native_dir`) applies to these
    sources and this interpreter: ``("active" | "none" | "off" | <why not>, modules)``."""
    directory = directory or native_dir()
    if os.environ.get("SHOAL_NATIVE", "1") == "0":
        return "off (SHOAL_NATIVE=0)", []
    file = directory / MANIFEST
    if not file.is_file():
        return "none", []
    try:
        manifest = json.loads(file.read_text())
        modules = list(manifest["modules"])
        if manifest["abi"] != _abi():
            return f"built for another interpreter ({manifest['abi']}, this is {_abi()})", modules
        if manifest["digest"] != source_digest():
            return "built from other sources (rebuild with `shoal native build`)", modules
        # What import loads is code: a build that others could have written is not used.
        for path in (directory, file, *(directory / rel for rel in manifest["extensions"].values())):
            if path.stat().st_mode & 0o022:
                return f"{path} is writable by other users than its owner", modules
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})", []
    return "active", modules


def activate(directory: Path | None = None) -> bool:
    """Put a build's modules ahead of the sources when it applies (see the module
    docstring); called by ``import shoal``. Returns whether it did."""
    directory = directory or native_dir()
    if not (directory / MANIFEST).is_file() or os.environ.get("SHOAL_NATIVE", "1") == "0":
        return False
    if _state.get("finder") is not None:
        return True
    why, _ = status(directory)
    if why != "active":
        print(f"shoal: native build in {directory} not used: {why}", file=sys.stderr)
        return False
    manifest = json.loads((directory / MANIFEST).read_text())
    finder = _Finder(directory, dict(manifest["extensions"]))
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]  # a MetaPathFinder by protocol
    _state["finder"] = finder
    return True


def loaded(names: Iterable[str] = NATIVE_MODULES) -> list[str]:
    """Those of ``names`` imported so far from a compiled build."""
    out = []
    for name in names:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None) or ""
        if any(file.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES):
            out.append(name)
    return out

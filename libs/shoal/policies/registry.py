"""The policy registry: a policy's name to the class that implements it.

Targets are ``"module:Class"`` strings imported only when a policy is asked for, so a
broken or missing module fails that policy alone (with :class:`PolicyImportError`), never
the import of this module or any other policy. The table is an immutable mapping built
once; there is no run-time registration (no module-level mutable registry).

Errors:

* an unknown name raises :class:`UnknownPolicyError` (a ``ValueError``) listing the names;
* parameters the constructor does not take, or values it rejects with ``TypeError``,
  raise :class:`PolicyParamsError` (a ``TypeError``, so
  :func:`shoal.sim.engine.make_policy` can retry without ``seed`` for policies that use
  no randomness) naming the policy and its accepted parameters.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shoal.policies.base import Policy

POLICIES: MappingProxyType[str, str] = MappingProxyType(
    {
        "afs-l": "shoal.policies.afs:AFSL",
        "afs-l-naive": "shoal.policies.afs:AFSLNaive",
        "afs-p": "shoal.policies.afs:AFSP",
        "afs-p-naive": "shoal.policies.afs:AFSPNaive",
        "afs-het": "shoal.policies.afs_hetero:HeteroAFS",
        "srtf": "shoal.policies.srtf:SRTF",
        "srsf": "shoal.policies.srtf:SRSF",
        "srtf-e": "shoal.policies.srtf:SRTFElastic",
        "srsf-e": "shoal.policies.srtf:SRSFElastic",
        "fifo": "shoal.policies.fifo:FIFO",
        "max-min": "shoal.policies.maxmin:MaxMin",
        "tiresias-l": "shoal.policies.tiresias:TiresiasL",
        "themis": "shoal.policies.themis:Themis",
        "themis-unaware": "shoal.policies.unaware:ThemisLengthUnaware",
        "optimus": "shoal.policies.optimus:Optimus",
        "optimus-perfect": "shoal.policies.optimus:OptimusPerfect",
        "elastic-tiresias": "shoal.policies.elastic_tiresias:ElasticTiresias",
        "sidecar": "shoal.policies.sidecar:SideCarAdaptive",
        "sidecar-default-k8s": "shoal.policies.sidecar_baselines:DefaultK8s",
        "sidecar-termination": "shoal.policies.sidecar_baselines:Termination",
        "gandiva-fair": "shoal.fairness.policy:GandivaFairPolicy",
    }
)
"""Policy name -> ``"module:Class"`` of its implementation."""


class UnknownPolicyError(ValueError):
    """No policy has this name."""


class PolicyImportError(ImportError):
    """The module or class behind a registered name could not be loaded."""


class PolicyParamsError(TypeError):
    """The policy's constructor does not accept the given parameters."""


def policy_names() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(POLICIES)


def _target(name: str) -> str:
    try:
        return POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; known policies: {', '.join(policy_names())}"
        ) from None


def policy_class(name: str) -> type[Any]:
    """The class registered under ``name``, imported now.

    Raises:
        UnknownPolicyError: no policy has this name.
        PolicyImportError: its module cannot be imported or lacks the class.
    """
    target = _target(name)
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure in the policy's module is that policy's failure
        raise PolicyImportError(f"policy {name!r}: cannot import {module_name} ({exc!r})") from exc
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise PolicyImportError(f"policy {name!r}: module {module_name} has no {attr}") from None
    return cls  # type: ignore[no-any-return]


def _source_classes(cls: type[Any]) -> list[ast.ClassDef]:
    """The class statements of ``cls`` and its bases, in method resolution order, read
    from their modules' source files when they were compiled (``shoal native build``:
    mypyc keeps neither docstrings nor, for some constructors, a readable signature).
    Empty for a class that was not compiled, or whose source is not shoal's."""
    if not hasattr(cls, "__mypyc_attrs__"):
        return []
    import shoal

    root = Path(shoal.__file__).resolve().parent
    out = []
    for klass in cls.__mro__:
        parts = klass.__module__.split(".")
        if parts[0] != "shoal":
            continue
        tree = _source_tree(root.joinpath(*parts[1:]).with_suffix(".py"))
        if tree is not None:
            out += [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == klass.__name__]
    return out


@functools.cache
def _source_tree(path: Path) -> ast.Module | None:
    """The parsed source file (once per process: a build applies only while the sources
    are those it was built from), or None when it cannot be read."""
    try:
        return ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None


def _source_signature(classes: list[ast.ClassDef]) -> inspect.Signature | None:
    """The parameters of the first ``__init__`` among ``classes`` (kinds and names; a
    default stands for "has one"), as the source writes them."""
    init = next(
        (f for c in classes for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"),
        None,
    )
    if init is None:
        return None
    a = init.args
    has_default = object()
    params: list[inspect.Parameter] = []
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional[1:], start=1):  # not self
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if i < len(a.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = has_default if i >= first_default else inspect.Parameter.empty
        params.append(inspect.Parameter(arg.arg, kind, default=default))
    if a.vararg is not None:
        params.append(inspect.Parameter(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        default = inspect.Parameter.empty if d is None else has_default
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, default=default))
    if a.kwarg is not None:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _signature(cls: type[Any]) -> inspect.Signature | None:
    """The constructor's signature, or None when it has none to read.

    Of a class compiled by mypyc (``shoal native build``), the one its source writes
    (:func:`_source_signature`): mypyc reports every parameter as positional-only, or
    none at all, though the constructor takes them by keyword as the source says.
    ``themis-unaware`` copies compiled Themis' reported signature; no policy's source has
    a positional-only parameter, so one is read as positional-or-keyword. Either way
    ``seed`` is seen, else :func:`shoal.sim.engine.make_policy` would build the policy
    with its default seed."""
    compiled = _source_classes(cls)
    if compiled:
        sig = _source_signature(compiled)
        if sig is not None:
            return sig
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in sig.parameters.values()):
        keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
        sig = sig.replace(
            parameters=[
                p.replace(kind=keyword) if p.kind is inspect.Parameter.POSITIONAL_ONLY else p
                for p in sig.parameters.values()
            ]
        )
    return sig


def _accepted(cls: type[Any]) -> list[str]:
    sig = _signature(cls)
    return [] if sig is None else [p for p in sig.parameters if p != "self"]


def get_policy(name: str, **params: Any) -> Policy:
    """A new instance of the policy registered under ``name``.

    Args:
        name: a name from :func:`policy_names`.
        **params: keyword arguments of the policy's constructor (``seed`` only for
            policies that use randomness).

    Returns:
        The policy.

    Raises:
        UnknownPolicyError: no policy has this name.
        PolicyImportError: its module cannot be imported.
        PolicyParamsError: the constructor does not accept ``params``.
        ValueError: the constructor rejects a parameter's value.
    """
    cls = policy_class(name)
    sig = _signature(cls)
    if sig is not None:
        try:
            sig.bind(**params)
        except TypeError as exc:
            accepted = ", ".join(_accepted(cls)) or "none"
            raise PolicyParamsError(
                f"policy {name!r} does not accept {sorted(params)}: {exc}; accepted parameters: {accepted}"
            ) from None
    try:
        return cls(**params)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise PolicyParamsError(f"policy {name!r} rejected parameters {params!r}: {exc}") from exc


def describe(name: str) -> str:
    """The first line of the docstring of the policy registered under ``name``.

    Raises:
        UnknownPolicyError: no policy has this name.
        PolicyImportError: its module cannot be imported.
    """
    cls = policy_class(name)
    doc = inspect.getdoc(cls) or next((d for c in _source_classes(cls) if (d := ast.get_docstring(c))), "")
    return doc.strip().splitlines()[0] if doc.strip() else ""

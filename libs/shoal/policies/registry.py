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

import importlib
import inspect
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


def _signature(cls: type[Any]) -> inspect.Signature | None:
    """The constructor's signature, or None when it has none to read.

    A class compiled by mypyc (``shoal native build``) reports every parameter as
    positional-only, but its constructor takes them by keyword as the source says, and
    ``themis-unaware`` copies Themis' signature. No policy's source has a positional-only
    parameter, so every one is read as positional-or-keyword: else ``seed`` would look
    unaccepted and :func:`shoal.sim.engine.make_policy` would build the policy with its
    default seed."""
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
    doc = inspect.getdoc(policy_class(name)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""

"""The registry: lazy imports, clear errors, names and descriptions."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from shoal.policies import registry
from shoal.policies.registry import (
    PolicyImportError,
    PolicyParamsError,
    UnknownPolicyError,
    describe,
    get_policy,
    policy_names,
)
from shoal.sim.engine import make_policy

EXPECTED = {
    "afs-l",
    "afs-l-naive",
    "afs-p",
    "afs-p-naive",
    "afs-het",
    "srtf",
    "srsf",
    "srtf-e",
    "srsf-e",
    "fifo",
    "max-min",
    "tiresias-l",
    "themis",
    "themis-unaware",
    "optimus",
    "optimus-perfect",
    "elastic-tiresias",
    "sidecar",
    "sidecar-default-k8s",
    "sidecar-termination",
    "gandiva-fair",
}


def test_names_are_the_issue_list_sorted() -> None:
    names = policy_names()
    assert set(names) == EXPECTED
    assert names == sorted(names)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        get_policy("no-such-policy")
    assert isinstance(info.value, ValueError)
    assert "no-such-policy" in str(info.value)
    assert "afs-l" in str(info.value) and "gandiva-fair" in str(info.value)
    with pytest.raises(ValueError):
        describe("no-such-policy")


def test_existing_policy_is_built_with_params() -> None:
    policy = get_policy("gandiva-fair", quantum_s=120.0)
    assert policy.name
    assert policy.quantum_s == 120.0  # type: ignore[attr-defined]


def test_bad_params_name_the_policy_and_what_it_accepts() -> None:
    with pytest.raises(PolicyParamsError) as info:
        get_policy("gandiva-fair", no_such_param=1)
    message = str(info.value)
    assert "gandiva-fair" in message and "no_such_param" in message and "quantum_s" in message


def test_broken_module_fails_only_that_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    table = dict(registry.POLICIES)
    table["broken"] = "shoal.policies.does_not_exist:Nope"
    table["no-class"] = "shoal.policies.base:Nope"
    monkeypatch.setattr(registry, "POLICIES", MappingProxyType(table))
    with pytest.raises(PolicyImportError, match="broken"):
        get_policy("broken")
    with pytest.raises(PolicyImportError, match="has no Nope"):
        get_policy("no-class")
    # The other policies still load.
    assert get_policy("gandiva-fair").name


@pytest.mark.parametrize("name", ["afs-l", "afs-p", "srtf", "srsf", "srtf-e", "srsf-e", "fifo", "max-min"])
def test_own_policies_load_describe_and_take_seed_only_if_random(name: str) -> None:
    policy = get_policy(name)
    assert policy.name == name
    assert describe(name)
    assert "\n" not in describe(name)
    # make_policy passes seed and retries without it when the policy uses no randomness.
    assert make_policy(name, {}, seed=3).name == name


def test_make_policy_passes_params_to_a_policy_without_seed() -> None:
    policy = make_policy("afs-p", {"unit_s": 60.0}, seed=1)
    assert policy.unit_s == 60.0  # type: ignore[attr-defined]
    with pytest.raises(PolicyParamsError, match="unit_s"):
        make_policy("afs-p", {"unit": 60.0})
    with pytest.raises(ValueError, match="unit_s"):
        get_policy("afs-p", unit_s=-1.0)

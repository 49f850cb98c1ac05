"""Settings: defaults, SHOAL_* variables, flags, and clear errors for bad values."""

from __future__ import annotations

import pytest
from shoal.settings import Settings, SettingsError, unknown_variables


def test_defaults_need_no_environment(tmp_path: object) -> None:
    s = Settings.load({})
    assert s.nats_url is None
    assert s.prefix == "shoal"
    assert s.policy == "afs-p"
    assert s.time_scale == 1.0
    assert s.log_format == "auto"
    assert s.state_dir  # the per-user state dir


def test_environment_is_parsed_and_typed() -> None:
    s = Settings.load(
        {
            "SHOAL_PREFIX": "prod.eu",
            "SHOAL_TIME_SCALE": "250",
            "SHOAL_FAKE_GPUS": "8",
            "SHOAL_NETWORK_PACKING": "off",
            "SHOAL_POLICY_PARAMS": '{"lease_s": 600, "seed": 3}',
            "SHOAL_MQTT_PORT": "",
            "SHOAL_LOG_FORMAT": "json",
            "SHOAL_STATE_DIR": "/var/lib/shoal",
            "PATH": "/usr/bin",  # other variables are ignored
        }
    )
    assert s.prefix == "prod.eu"
    assert s.time_scale == 250.0
    assert s.fake_gpus == 8
    assert s.network_packing is False
    assert s.policy_params == {"lease_s": 600, "seed": 3}
    assert s.mqtt_port is None
    assert s.log_format == "json"
    assert s.state_dir == "/var/lib/shoal"


def test_nats_url_honours_plain_nats_url() -> None:
    assert Settings.load({"NATS_URL": "nats://a:4222"}).nats_url == "nats://a:4222"
    assert Settings.load({"SHOAL_NATS_URL": "nats://b:4222"}).nats_url == "nats://b:4222"
    # Same order as the client commands' lookup: NATS_URL first.
    both = {"NATS_URL": "nats://a:4222", "SHOAL_NATS_URL": "nats://b:4222"}
    assert Settings.load(both).nats_url == "nats://a:4222"
    assert Settings.load(both, nats_url="nats://c:4222").nats_url == "nats://c:4222"


def test_flags_override_environment_and_none_means_not_given() -> None:
    env = {"SHOAL_TIME_SCALE": "10", "SHOAL_POLICY": "srtf"}
    s = Settings.load(env, time_scale=100.0, policy=None)
    assert s.time_scale == 100.0
    assert s.policy == "srtf"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"SHOAL_TIME_SCALE": "abc"}, "SHOAL_TIME_SCALE='abc': expected a number"),
        ({"SHOAL_TIME_SCALE": "0"}, "SHOAL_TIME_SCALE"),
        ({"SHOAL_TIME_SCALE": "-2"}, "> 0"),
        ({"SHOAL_FAKE_GPUS": "2.5"}, "SHOAL_FAKE_GPUS='2.5': expected an integer"),
        ({"SHOAL_FAKE_GPUS": "-1"}, "SHOAL_FAKE_GPUS"),
        ({"SHOAL_LOG_FORMAT": "xml"}, "SHOAL_LOG_FORMAT='xml': expected one of auto, json, pretty"),
        ({"SHOAL_LOG_LEVEL": "loud"}, "SHOAL_LOG_LEVEL"),
        ({"SHOAL_NETWORK_PACKING": "maybe"}, "expected a boolean"),
        ({"SHOAL_POLICY_PARAMS": "{"}, "SHOAL_POLICY_PARAMS='{': expected a JSON object"),
        ({"SHOAL_POLICY_PARAMS": "[1, 2]"}, "SHOAL_POLICY_PARAMS"),
        ({"SHOAL_NODE_ID": "a.b"}, "SHOAL_NODE_ID"),
        ({"SHOAL_PREFIX": "bad prefix"}, "SHOAL_PREFIX"),
        ({"SHOAL_PREFIX": ""}, "SHOAL_PREFIX is empty"),
        ({"SHOAL_MQTT_PORT": "70000"}, "SHOAL_MQTT_PORT"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.load(env)
    assert needle in str(info.value)


def test_bad_flag_values_name_the_flag() -> None:
    with pytest.raises(SettingsError, match="--fake-gpus=-3"):
        Settings.load({}, fake_gpus=-3)
    with pytest.raises(SettingsError, match="unknown setting"):
        Settings.load({}, not_a_setting=1)


def test_one_bad_value_among_good_ones_yields_no_settings() -> None:
    env = {"SHOAL_TIME_SCALE": "5", "SHOAL_POLICY": "srtf", "SHOAL_HEARTBEAT_S": "soon"}
    with pytest.raises(SettingsError, match="SHOAL_HEARTBEAT_S"):
        Settings.load(env)


def test_to_env_round_trips() -> None:
    s = Settings.load(
        {"SHOAL_POLICY_PARAMS": '{"a": [1, 2]}', "SHOAL_TIME_SCALE": "3.5", "SHOAL_NETWORK_PACKING": "no"},
        node_id="n7",
        clock_origin=1700000000.25,
    )
    env = s.to_env()
    assert all(k.startswith("SHOAL_") for k in env)
    assert Settings.load(env) == s


def test_unknown_variables_are_reported_not_fatal() -> None:
    env = {
        "SHOAL_TIME_SCLAE": "5",
        "SHOAL_TIME_SCALE": "7",
        "SHOAL_TRAIN_DEVICE": "cpu",  # the training worker's own settings
        "SHOAL_USER": "alice",  # the client's default user
        "HOME": "/root",
    }
    assert Settings.load(env).time_scale == 7.0
    assert unknown_variables(env) == ["SHOAL_TIME_SCLAE (did you mean SHOAL_TIME_SCALE?)"]
    assert unknown_variables({"SHOAL_POLICY": "srtf"}) == []
    # The token a node daemon hands its sidecar is not a setting, and not a typo of one.
    assert unknown_variables({"SHOAL_SIDECAR_TOKEN": "x"}) == []


def test_every_variable_the_compose_stack_substitutes_is_a_setting_or_its_own() -> None:
    """An operator exports compose's variables in the shell that also runs `shoal`:
    none of them may be reported as a misspelt setting, and a setting compose passes on
    must be one shoal reads (a typo there would be ignored with only a warning)."""
    import re
    from pathlib import Path

    compose = (Path(__file__).resolve().parents[1] / "deploy/compose/compose.yaml").read_text()
    names = set(re.findall(r"\$\{(SHOAL_[A-Z0-9_]+)", compose))
    names |= set(re.findall(r"^\s+(SHOAL_[A-Z0-9_]+):", compose, flags=re.MULTILINE))
    assert len(names) > 20
    assert unknown_variables(dict.fromkeys(names, "x")) == []


def test_replicas_and_sync_interval() -> None:
    s = Settings.load({"SHOAL_REPLICAS": "3", "SHOAL_SYNC_INTERVAL": "always"})
    assert s.replicas == 3 and s.sync_interval == "always"
    assert Settings.load({"SHOAL_SYNC_INTERVAL": "10s"}).sync_interval == "10s"
    assert Settings.load({}).replicas is None and Settings.load({}).sync_interval is None
    for env in ({"SHOAL_REPLICAS": "0"}, {"SHOAL_SYNC_INTERVAL": "often"}):
        with pytest.raises(SettingsError, match=next(iter(env))):
            Settings.load(env)


def test_a_seed_list_is_kept_whole() -> None:
    seeds = "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    assert Settings.load({"NATS_URL": seeds}).nats_url == seeds


def test_docs_settings_md_is_generated_from_the_code_and_documents_every_setting() -> None:
    """docs/settings.md is ``python -m shoal.settings_doc``'s output (it cannot drift from
    the code), and every setting has a docstring to fill its row."""
    from pathlib import Path

    import msgspec
    from shoal.settings_doc import field_docs, render

    page = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
    assert page.read_text() == render(), (
        "docs/settings.md is stale: python -m shoal.settings_doc > docs/settings.md"
    )
    fields = {f.name for f in msgspec.structs.fields(Settings)}
    assert fields - set(field_docs()) == set()

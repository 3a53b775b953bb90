"""Misspelled PROMPTSTORE_* variables are reported once, with the closest valid name."""

from __future__ import annotations

import logging

from pydantic import Field

from promptstore import config
from promptstore.config import Settings, warn_unknown_variables

from .conftest import one_line_error


def warnings_for(caplog, monkeypatch, settings=Settings, **env) -> list[str]:
    monkeypatch.setattr(config, "_warned", set())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="promptstore.config"):
        warn_unknown_variables(settings)
        warn_unknown_variables(settings)  # once per name, however often settings are read
    return [r.getMessage() for r in caplog.records]


def test_a_misspelled_variable_names_the_closest_setting(caplog, monkeypatch):
    messages = warnings_for(caplog, monkeypatch, PROMPTSTORE_HOT_BYTE="5", PROMPTSTORE_DURABILTY="sync")
    assert messages == [
        "PROMPTSTORE_DURABILTY is not a promptstore setting and is ignored; did you mean PROMPTSTORE_DURABILITY?",
        "PROMPTSTORE_HOT_BYTE is not a promptstore setting and is ignored; did you mean PROMPTSTORE_HOT_BYTES?",
    ]


def test_a_name_like_no_setting_lists_the_valid_ones(caplog, monkeypatch):
    (message,) = warnings_for(caplog, monkeypatch, PROMPTSTORE_XYZZY="1")
    assert message.startswith("PROMPTSTORE_XYZZY is not a promptstore setting and is ignored; valid: ")
    assert "PROMPTSTORE_HOME" in message and "PROMPTSTORE_HOT_BYTES" in message


def test_valid_names_are_silent_and_come_from_the_settings_fields(caplog, monkeypatch):
    class Grown(Settings):
        remote_url: str | None = Field(None, description="a setting another version adds")

    env = {"PROMPTSTORE_HOME": "/x", "PROMPTSTORE_HOT_BYTES": "1", "PROMPTSTORE_REMOTE_URL": "redis://127.0.0.1"}
    assert warnings_for(caplog, monkeypatch, Grown, **env) == []
    caplog.clear()
    (message,) = warnings_for(caplog, monkeypatch, Grown, PROMPTSTORE_REMOTE_UR="x")
    assert message.endswith("did you mean PROMPTSTORE_REMOTE_URL?")


def test_reading_settings_warns(caplog, monkeypatch):
    monkeypatch.setattr(config, "_warned", set())
    monkeypatch.setenv("PROMPTSTORE_CHECKPOINT_INTERVALS", "8")
    with caplog.at_level(logging.WARNING, logger="promptstore.config"):
        assert Settings.from_env().checkpoint_interval == Settings.model_fields["checkpoint_interval"].default
    assert "did you mean PROMPTSTORE_CHECKPOINT_INTERVAL?" in caplog.text


def test_the_command_line_warns_in_one_line(cli, tmp_path):
    proc = cli("stats", "--store", str(tmp_path / "none"), PROMPTSTORE_HOT_BYTE="5")
    warning, error = proc.stderr.strip().splitlines()
    assert warning == (
        "promptstore stats: warning: PROMPTSTORE_HOT_BYTE is not a promptstore setting and is ignored; "
        "did you mean PROMPTSTORE_HOT_BYTES?"
    )
    assert error.startswith("promptstore stats: error: no store at")
    assert proc.returncode == 1
    assert one_line_error(cli("stats", "--store", str(tmp_path / "none")))

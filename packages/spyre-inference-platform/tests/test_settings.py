"""Every plugin setting parses its default, and a bad value fails naming the variable."""

from __future__ import annotations

import pytest

from spyre_inference.platform import settings


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for s in settings.all_settings():
        monkeypatch.delenv(s.name, raising=False)
    settings.reset_cache()
    yield
    settings.reset_cache()


def test_defaults_parse() -> None:
    values = settings.validate_all()
    assert values["SPYRE_DEVICE_TARGET"] == "auto"
    assert values["SPYRE_COMPILE_GRANULARITY"] == "block"
    assert values["SPYRE_ATTN_KV_LAYOUT"] == "token_major"
    assert values["SPYRE_SETTLED_GUARDS"] is True
    assert values["SPYRE_NUM_TOKENS_BUCKETS"] == ()


@pytest.mark.parametrize("setting", [s for s in settings.all_settings() if s.choices])
def test_unknown_choice_names_variable_and_choices(setting, monkeypatch) -> None:
    monkeypatch.setenv(setting.name, "no-such-value")
    with pytest.raises(settings.SettingError) as err:
        settings.get(setting.name)
    message = str(err.value)
    assert setting.name in message
    assert all(choice in message for choice in setting.choices)


def test_case_and_whitespace_are_forgiven(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_ATTN_KV_LAYOUT", " Head_Major ")
    assert settings.get("SPYRE_ATTN_KV_LAYOUT") == "head_major"


def test_int_lists_are_sorted_and_deduplicated(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "64, 8,64,16")
    assert settings.get("SPYRE_NUM_TOKENS_BUCKETS") == (8, 16, 64)


@pytest.mark.parametrize("raw", ["8,x", "0", "-4"])
def test_bad_int_lists_fail(raw, monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", raw)
    with pytest.raises(settings.SettingError, match="SPYRE_NUM_TOKENS_BUCKETS"):
        settings.get("SPYRE_NUM_TOKENS_BUCKETS")


def test_every_setting_is_documented() -> None:
    for s in settings.all_settings():
        assert s.name.startswith("SPYRE_")
        assert len(s.doc) > 30, s.name


def test_a_misspelled_setting_is_reported_at_start_up(monkeypatch, caplog) -> None:
    """A near miss of a setting's name would be silently ignored: validate_all (run at
    start-up) warns and names the setting meant; other SPYRE_* variables (torch-spyre's,
    the tools') are left alone."""
    import logging

    monkeypatch.setenv("SPYRE_ATTN_KV_LAYOUTS", "head_major")
    monkeypatch.setenv("SPYRE_INFERENCE_CACHE", "/tmp/cache")
    assert settings.misspelled() == {"SPYRE_ATTN_KV_LAYOUTS": "SPYRE_ATTN_KV_LAYOUT"}
    settings.reset_cache()
    with caplog.at_level(logging.WARNING, logger="vllm.spyre_inference.platform.settings"):
        settings.validate_all()
    assert "SPYRE_ATTN_KV_LAYOUTS is not a spyre-inference setting" in caplog.text
    assert "did you mean SPYRE_ATTN_KV_LAYOUT?" in caplog.text
    assert "SPYRE_INFERENCE_CACHE" not in caplog.text


def test_is_set_tells_a_given_value_from_the_default(monkeypatch) -> None:
    monkeypatch.delenv("SPYRE_SETTLED_GUARDS", raising=False)
    settings.reset_cache()
    assert not settings.is_set("SPYRE_SETTLED_GUARDS")
    monkeypatch.setenv("SPYRE_SETTLED_GUARDS", "1")
    settings.reset_cache()
    assert settings.is_set("SPYRE_SETTLED_GUARDS")
    with pytest.raises(KeyError):
        settings.is_set("SPYRE_NO_SUCH_SETTING")


def test_a_package_publishes_its_settings_through_the_entry_point_group() -> None:
    """The core holds its own settings; every other comes from an installed package's
    entry point (group ``spyre_inference.settings``), so a package that is absent
    contributes none, and its variables are unknown."""
    import importlib.metadata as md

    published = {
        s.name: ep.dist.name
        for ep in md.entry_points(group=settings.ENTRY_POINT_GROUP)
        for s in ep.load()
    }
    core = [s.name for s in settings.SETTINGS]
    assert [s.name for s in settings.all_settings()] == core + list(published)
    assert not set(core) & set(published)
    installed = {d.metadata["Name"] for d in md.distributions()}
    if "spyre-inference-attention" not in installed:
        # The platform alone: the attention package's settings are not known.
        with pytest.raises(KeyError, match="SPYRE_BATCHED_DECODE is not a setting"):
            settings.get("SPYRE_BATCHED_DECODE")
    else:
        assert published["SPYRE_BATCHED_DECODE"] == "spyre-inference-attention"

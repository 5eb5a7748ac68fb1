"""`kvd config --describe` shows what an unset setting means instead of "-" wherever there is a value (issue
18, item 12): the store's defaults, the policy profile's numbers, the sizes derived from this machine."""

from __future__ import annotations

from kvd.config import describe
from kvd.policy import PolicyConfig
from kvd.store.core import DEFAULT_PAGE_TOKENS, DEFAULT_SINK_TOKENS, DEFAULT_WINDOW_TOKENS


def defaults() -> dict[str, str]:
    out, section = {}, ""
    for line in describe().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif line.startswith("  ") and not line.startswith("      "):
            key, default, _env = line.split()[0], line[25:38].strip(), line.split()[-1]
            out[f"{section}.{key}"] = default
    return out


def test_only_settings_without_any_default_show_a_dash() -> None:
    shown = defaults()
    assert len(shown) > 30
    assert sorted(k for k, v in shown.items() if v == "-") == [
        "curve.authorized_keys", "curve.client_secret_key", "curve.server_public_key", "curve.server_secret_key"]


def test_the_defaults_shown_are_the_ones_in_force() -> None:
    shown = defaults()
    policy = PolicyConfig.profile("default")
    assert shown["store.page_tokens"] == str(DEFAULT_PAGE_TOKENS)
    assert shown["store.window_tokens"] == str(DEFAULT_WINDOW_TOKENS)
    assert shown["store.sink_tokens"] == str(DEFAULT_SINK_TOKENS)
    assert shown["policy.q8_threshold"] == repr(policy.q8_threshold)
    assert shown["policy.ewma_alpha"] == repr(policy.ewma_alpha)
    assert shown["policy.max_level"] == repr(policy.max_level.tag)
    assert shown["cluster.memory_bytes"].endswith("*") and "iB" in shown["cluster.memory_bytes"]
    assert shown["store.capacity_bytes"].endswith("*")
    assert "derived from this machine" in describe().splitlines()[0]

"""Config layering and validation (no processes)."""

from __future__ import annotations

import pytest

from mooncaked.node.config import ConfigError, NodeConfig, load_config
from tests.paths import REPO


def test_defaults_file_matches_builtin_defaults():
    assert load_config(config_file=REPO / "etc" / "mooncaked.toml", env={}) == NodeConfig()


def test_precedence_file_env_set_flag(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[node]\nport = 1000\nhost = '127.0.0.2'\nlog_level = 'debug'\n"
                    "[store]\nblock_size = 32\n")
    env = {"MOONCAKED_NODE__PORT": "2000", "MOONCAKED_STORE__BLOCK_SIZE": "64", "UNRELATED": "x"}
    cfg = load_config(config_file=path, env=env, overrides=["node.port=3000"],
                      flags={"node.port": None, "node.host": None})
    assert cfg.node.port == 3000          # --set beats env beats file
    assert cfg.store.block_size == 64     # env beats file
    assert cfg.node.host == "127.0.0.2"   # file beats default
    assert cfg.node.log_level == "debug"
    cfg = load_config(config_file=path, env=env, overrides=["node.port=3000"], flags={"node.port": 4000})
    assert cfg.node.port == 4000          # flag beats everything


def test_lists_and_bools_from_strings():
    cfg = load_config(env={}, overrides=["transfer.nics=127.0.0.1,127.0.0.2", "store.prefault=off"])
    assert cfg.transfer.nics == ["127.0.0.1", "127.0.0.2"] and cfg.store.prefault is False
    cfg = load_config(env={}, overrides=['transfer.nics=["127.0.0.3"]'])
    assert cfg.transfer.nics == ["127.0.0.3"]


@pytest.mark.parametrize("override,needle", [
    ("store.block_size=8", "store.block_size"),
    ("node.role=boss", "node.role"),
    ("node.heartbeat_timeout_s=abc", "node.heartbeat_timeout_s"),
    ("node.nope=1", "node.nope"),
    ("justakey", "section.key=value"),
    ("decode.contiguous_kv_mb=-1", "decode.contiguous_kv_mb"),
    ("decode.contiguous_kv_mb=lots", "decode.contiguous_kv_mb"),
])
def test_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=[override])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_decode_contiguous_kv_mb_defaults_on_and_0_turns_it_off():
    assert NodeConfig().decode.contiguous_kv_mb == 512
    assert load_config(env={}, overrides=["decode.contiguous_kv_mb=0"]).decode.contiguous_kv_mb == 0
    cfg = load_config(env={"MOONCAKED_DECODE__CONTIGUOUS_KV_MB": "64"})
    assert cfg.decode.contiguous_kv_mb == 64


def test_redacted_hides_secrets_only():
    cfg = load_config(env={}, overrides=["node.admin_token=abc", "transfer.auth_token=def"])
    red = cfg.redacted()
    assert red["node"]["admin_token"] == "***" and red["transfer"]["auth_token"] == "***"
    assert red["conductor"]["max_prompt_tokens"] == 32768

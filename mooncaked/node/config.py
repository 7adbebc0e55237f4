"""Layered node configuration.

Precedence, lowest to highest (each layer overrides the one before):
    dataclass defaults < config file (TOML) < environment (MOONCAKED_<SECTION>__<KEY>)
    < ``--set section.key=value`` overrides < dedicated CLI flags (--host, --port, ...).

Every section is a dataclass owned by the package it configures; this module
only merges raw values, coerces strings to the field's type and lets each
dataclass validate itself.  Any problem becomes a ``ConfigError`` whose
message is one readable line naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvstore.config import StoreConfig
from mooncaked.node.sections import (ConductorSection, DecodeSection, EtcdSection, NodeSection,
                                     PrefillSection)
from model.config import RuntimeConfig as ModelSpec
from rdma.config import TransferConfig

ENV_PREFIX = "MOONCAKED_"


class ConfigError(Exception):
    """A configuration problem, phrased for the operator (one line)."""


@dataclass
class NodeConfig:
    node: NodeSection = field(default_factory=NodeSection)
    conductor: ConductorSection = field(default_factory=ConductorSection)
    store: StoreConfig = field(default_factory=StoreConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    model: ModelSpec = field(default_factory=ModelSpec)
    prefill: PrefillSection = field(default_factory=PrefillSection)
    decode: DecodeSection = field(default_factory=DecodeSection)
    etcd: EtcdSection = field(default_factory=EtcdSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def redacted(self) -> dict[str, dict[str, Any]]:
        """The config in force, with secrets blanked (for /admin/status)."""
        out = self.to_dict()
        for section in out.values():
            for key in section:
                if key.endswith("_token") and section[key]:
                    section[key] = "***"
        return out


SECTIONS: dict[str, type] = typing.get_type_hints(NodeConfig)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Coerce a raw value (from TOML, or a string from env/--set) to ``typ``."""
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""), 0)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if origin is list:
        (item_type,) = typing.get_args(typ) or (str,)
        if isinstance(value, str):
            value = _parse_literal(value) if value.strip().startswith("[") else \
                [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_type, where) for v in value]
    if origin is dict or typ is dict:
        if isinstance(value, str):
            value = _parse_literal(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        return value
    return value


def _parse_literal(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot parse {text!r}: {exc}") from None


def _apply(raw: dict[str, dict[str, Any]], section: str, key: str, value: Any, source: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} ({source}); "
                          f"known: {', '.join(SECTIONS)}")
    types = _field_types(SECTIONS[section])
    if key not in types:
        raise ConfigError(f"unknown config key '{section}.{key}' ({source})")
    raw.setdefault(section, {})[key] = _coerce(value, types[key], f"{section}.{key} ({source})")


def load_config(
    *,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: list[str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Build and validate a NodeConfig; raises ConfigError with a one-line message.

    ``flags`` maps "section.key" to values from dedicated CLI flags; ``None``
    values are ignored (flag not given).
    """
    raw: dict[str, dict[str, Any]] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"config file {path}: top-level key {section!r} must be a [section]")
            for key, value in table.items():
                _apply(raw, section, key, value, f"file {path.name}")
    env = os.environ if env is None else env
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].lower().partition("__")
        _apply(raw, section, key, value, f"env {name}")
    for item in overrides or []:
        dotted, sep, value = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not key:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        _apply(raw, section, key, value.strip(), "--set")
    for dotted, value in (flags or {}).items():
        if value is not None:
            section, _, key = dotted.partition(".")
            _apply(raw, section, key, value, "flag")
    sections = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**raw.get(name, {}))
        except ValueError as exc:
            raise ConfigError(f"invalid config: {exc}") from None
    return NodeConfig(**sections)

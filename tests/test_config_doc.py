"""docs/config.md is generated from the config dataclasses (``mooncaked config-doc``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from mooncaked import configdoc
from mooncaked.configdoc import ConfigDocError, section_keys
from mooncaked.node.config import SECTIONS


def test_docs_config_md_is_current():
    assert configdoc.DOC_PATH.read_text() == configdoc.render(), (
        "docs/config.md is stale: regenerate it with `mooncaked config-doc`")


def test_every_key_is_in_the_reference():
    text = configdoc.render()
    for section, cls in SECTIONS.items():
        assert f"\n## {section}\n" in text
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{section}.{f.name} missing from docs/config.md"


@dataclass
class _Undocumented:
    # Documented by the comment above it.
    documented: int = 1
    bare: str = ""


def test_a_field_without_a_doc_is_refused_by_name():
    with pytest.raises(ConfigDocError, match=r"config key demo\.bare has no doc"):
        section_keys("demo", _Undocumented)


@dataclass
class _WithHistory:
    # Batch this many tokens (docs/bench.md, stop 22).  More text.
    batch: int = 512


def test_a_doc_sentence_carrying_history_is_refused():
    with pytest.raises(ConfigDocError, match=r"demo\.batch.*history"):
        section_keys("demo", _WithHistory)


@dataclass
class _Sources:
    # First sentence of the block, e.g. with an abbreviation.  Since stop 25
    # this carried history, which the reference leaves out.
    above: int = 3
    trailing: float = 0.5  # Trailing comment: used when nothing is above.
    # Shared comment of a group...

    # ...is not the doc of a field after a blank line; this one is.
    after_blank: bool = True
    explicit: list[str] = field(default_factory=lambda: ["a"],
                                metadata={"doc": "Explicit doc wins."})  # not this


def test_doc_sources_and_rendering():
    keys = {k.key: k for k in section_keys("demo", _Sources)}
    assert keys["above"].doc == "First sentence of the block, e.g. with an abbreviation."
    assert keys["trailing"].doc == "Trailing comment: used when nothing is above."
    assert keys["after_blank"].doc == "...is not the doc of a field after a blank line; this one is."
    assert keys["explicit"].doc == "Explicit doc wins."
    assert (keys["above"].type, keys["above"].default) == ("int", "`3`")
    assert (keys["explicit"].type, keys["explicit"].default) == ("list[str]", '`["a"]`')
    assert keys["after_blank"].default == "`true`"


def test_check_reports_a_stale_file(tmp_path, capsys):
    out = tmp_path / "config.md"
    out.write_text("# stale\n")
    assert configdoc.main(["--check", "--output", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
    assert configdoc.main(["--output", str(out)]) == 0
    assert configdoc.main(["--check", "--output", str(out)]) == 0

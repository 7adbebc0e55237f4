"""docs/config.md, generated from the config dataclasses: ``mooncaked config-doc [--check]``.

A key's meaning is written once, beside the field: ``field(metadata={"doc": ...})``
when given, else the first sentence of the comment block directly above the
field (or of its trailing comment), so later sentences may explain and the
first must say what the key does.  A key without a doc fails generation with
the key named, so that every new key arrives documented; so does a sentence
carrying benchmark history (a bench stop, docs/bench.md, MAE or run figures),
which belongs in docs/bench.md and commit messages.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any, Iterable

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = "mooncaked config-doc"

# Text that tells how a key came to be rather than what it does.
_HISTORY = re.compile(r"\bstops?\s+\d+|docs/bench\.md|\bMAE\b|\bin (?:\w+ ){0,2}runs\b",
                      re.IGNORECASE)
# A sentence ends at . ! ? and a space (not after e.g., i.e., etc., vs.).
_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)(?<!etc\.)(?<!vs\.)\s+")


class ConfigDocError(Exception):
    """A config key whose documentation cannot be generated (the key is named)."""


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    default: str
    doc: str


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """Comment text by line number: lines holding only a comment, and trailing comments."""
    own: dict[int, str] = {}
    trailing: dict[int, str] = {}
    code_lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for tok in tokens:
        if tok.type not in skip:
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            line = tok.start[0]
            (trailing if line in code_lines else own)[line] = text
    return own, trailing


def _field_comments(cls: type) -> dict[str, str]:
    """The comment of each field of ``cls``: the block directly above it, else its trailing one."""
    source = textwrap.dedent(inspect.getsource(cls))
    own, trailing = _comments(source)
    (class_def,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    out: dict[str, str] = {}
    for stmt in class_def.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        block: list[str] = []
        line = stmt.lineno - 1
        while line in own:
            block.insert(0, own[line])
            line -= 1
        if not block:
            end = stmt.end_lineno or stmt.lineno
            block = [trailing[n] for n in range(stmt.lineno, end + 1) if n in trailing]
        out[stmt.target.id] = " ".join(part for part in block if part)
    return out


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    sentence = _SENTENCE_END.split(text, maxsplit=1)[0].strip() if text else ""
    if sentence and sentence[-1] not in ".!?":
        sentence += "."
    return sentence


def _type_name(typ: Any) -> str:
    if typing.get_origin(typ) is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(typ))
        origin = typing.get_origin(typ).__name__
        return f"{origin}[{args}]" if args else origin
    return getattr(typ, "__name__", str(typ))


def _toml(value: Any) -> str:
    """A default as it is written in the TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _size_note(value: Any) -> str:
    """" (256 MiB)" after a default that is a whole number of MiB or GiB."""
    if isinstance(value, int) and not isinstance(value, bool):
        for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB")):
            if value >= unit and value % unit == 0:
                return f" ({value // unit} {name})"
    return ""


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def section_keys(section: str, cls: type) -> list[KeyDoc]:
    """Every key of one section with its type, default and one-sentence meaning."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    keys = []
    for f in dataclasses.fields(cls):
        name = f"{section}.{f.name}"
        doc = f.metadata.get("doc") or first_sentence(comments.get(f.name, ""))
        where = f"{cls.__module__}.{cls.__qualname__}.{f.name}"
        if not doc:
            raise ConfigDocError(
                f"config key {name} has no doc: put a comment directly above the field "
                f"{where} (its first sentence is the doc) or field(metadata={{'doc': ...}})")
        if (match := _HISTORY.search(doc)) is not None:
            raise ConfigDocError(
                f"config key {name}: the doc sentence carries history ({match.group(0)!r}): "
                f"{doc!r}; say what the key does in the first sentence of {where}'s comment "
                "and leave the history to docs/bench.md")
        default = _default(f)
        shown = ("(required)" if default is dataclasses.MISSING
                 else f"`{_toml(default)}`{_size_note(default)}")
        keys.append(KeyDoc(f.name, _type_name(hints[f.name]), shown, doc))
    return keys


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped; ``<`` escaped outside code spans."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    parts = re.split(r"(`+[^`]*`+)", text)
    text = "".join(p if p.startswith("`") else p.replace("<", r"\<") for p in parts)
    return text.replace("|", r"\|")


def _flags() -> list[tuple[str, str]]:
    """(flag, section.key) for each dedicated flag of the node command.

    Read from the source of ``mooncaked/cli.py`` (parsed, not imported: the
    CLI imports this module to register its command): the ``flags={...}``
    mapping that ``node`` hands to ``load_config``, and the ``[section.key]``
    its options' help ends with.
    """
    source = (Path(__file__).resolve().parent / "cli.py").read_text()
    funcs = [f for f in ast.walk(ast.parse(source))
             if isinstance(f, ast.FunctionDef) and f.name == "node"]
    if len(funcs) != 1:
        raise ConfigDocError("cannot find the node command in mooncaked/cli.py")
    (func,) = funcs
    mappings = [kw.value for call in ast.walk(func) if isinstance(call, ast.Call)
                for kw in call.keywords if kw.arg == "flags" and isinstance(kw.value, ast.Dict)]
    if len(mappings) != 1:
        raise ConfigDocError("cannot find the one load_config(flags={...}) mapping in "
                             "mooncaked.cli.node that names the keys the dedicated flags set")
    (mapping,) = mappings
    options: dict[str, str] = {}
    helps: dict[str, str] = {}
    args = func.args.args + func.args.kwonlyargs
    defaults = [None] * (len(func.args.args) - len(func.args.defaults)) + list(func.args.defaults)
    defaults += list(func.args.kw_defaults)
    for arg, default in zip(args, defaults):
        if not (isinstance(default, ast.Call) and getattr(default.func, "attr", "") == "Option"):
            continue
        names = [a.value for a in default.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
        if names:
            options[arg.arg] = max(names, key=len)
        for kw in default.keywords:
            if kw.arg == "help" and isinstance(kw.value, ast.Constant):
                helps[arg.arg] = kw.value.value
    out = [(options[value.id], key.value) for key, value in zip(mapping.keys, mapping.values)
           if isinstance(key, ast.Constant) and isinstance(value, ast.Name) and value.id in options]
    # A flag whose value is converted first (--store-memory) names its key in its help.
    for name, flag in options.items():
        match = re.search(r"\[([a-z_]+\.[a-z_]+)[],]", helps.get(name, ""))
        if match and flag not in dict(out):
            out.append((flag, match.group(1)))
    return out


def _intro(sections: dict[str, type], flags: Iterable[tuple[str, str]]) -> list[str]:
    flag_text = ", ".join(f"`{flag}` ({key})" for flag, key in flags)
    return [
        "# Configuration reference",
        "",
        f"Generated from the config dataclasses by `{COMMAND}`; do not edit by hand. "
        f"`{COMMAND} --check` fails when this file is stale. A key's meaning is the "
        "comment above its field (or its `doc` metadata), so change it there.",
        "",
        "A node's config has the sections " + ", ".join(f"[{s}](#{s})" for s in sections)
        + ". Each key is set, lowest precedence first, by:",
        "",
        "1. the dataclass default (below);",
        "2. a TOML file, `mooncaked --config FILE`, of `[section]` tables (`etc/mooncaked.toml` "
        "is an example);",
        "3. an environment variable `MOONCAKED_<SECTION>__<KEY>`, e.g. "
        "`MOONCAKED_STORE__BLOCK_SIZE=128`;",
        "4. `--set section.key=value` (repeatable), e.g. `--set store.block_size=128`; "
        "lists are comma-separated or TOML arrays, tables are TOML inline tables;",
        f"5. the dedicated flags of the node command: {flag_text}.",
        "",
        "`mooncaked up` passes `--config` and `--set` to every node it starts. A key's unit "
        "is its suffix: `_bytes` bytes, `_mb` MiB, `_s` seconds, `_ms` milliseconds.",
    ]


def render() -> str:
    from mooncaked.node.config import SECTIONS
    lines = _intro(SECTIONS, _flags())
    for section, cls in SECTIONS.items():
        lines += ["", f"## {section}", ""]
        doc = inspect.getdoc(cls) or ""
        # (@dataclass gives a class without a docstring its signature as one.)
        summary = "" if doc.startswith(f"{cls.__name__}(") else first_sentence(doc)
        if summary:
            lines += [summary, ""]
        module = cls.__module__.replace(".", "/")
        lines += [f"Defined by `{cls.__qualname__}` in `{module}.py`.", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for key in section_keys(section, cls):
            lines.append(f"| `{key.key}` | {key.type} | {key.default} | {_cell(key.doc)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="Exit 1 if the file differs from what would be generated.")
    parser.add_argument("--output", type=Path, default=DOC_PATH,
                        help="Where to write (docs/config.md).")
    args = parser.parse_args(argv)
    try:
        text = render()
    except ConfigDocError as exc:
        print(f"{COMMAND}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            print(f"{COMMAND}: {args.output} is stale; regenerate it with `{COMMAND}`",
                  file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


def register(app: Any) -> None:
    import typer

    def config_doc(check: bool = typer.Option(
            False, "--check", help="Exit 1 if docs/config.md differs from what would be generated.")
                   ) -> None:
        """Regenerate docs/config.md from the config dataclasses."""
        code = main(["--check"] if check else [])
        if code:
            raise typer.Exit(code)

    app.command("config-doc")(config_doc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Tokenizers: byte-level (dummy models) and HF ``tokenizer.json``.

Both offer ``encode(text, add_bos)``, ``decode(ids)``,
``apply_chat_template(messages) -> ids``, ``eos_token_ids`` and
``vocab_size``; ``load_tokenizer(model)`` picks one for a ``[model]`` config.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from model.config import BYTE_VOCAB_SIZE, DUMMY_CONFIGS

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: list[int]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]: ...


def _check_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{'role': str, 'content': str}}")


class ByteTokenizer:
    """Token i < 256 is byte i; specials follow. Any text round-trips."""

    BOS, EOS, PAD, TURN = 256, 257, 258, 259  # 260..263 reserved
    SPECIALS = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>", 259: "<|turn|>"}
    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self) -> None:
        self.eos_token_ids = [self.EOS]
        self.bos_token_id = self.BOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # surrogatepass: Python strings holding lone surrogates (from JSON
        # "\ud800") still encode; decode maps them back.
        ids = list(text.encode("utf-8", errors="surrogatepass"))
        return [self.BOS] + ids if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for t in ids:
            if 0 <= t < 256:
                out.append(t)
            elif not skip_special:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(self.SPECIALS.get(t, f"<|{t}|>"))
        # Invalid UTF-8 (e.g. a sequence cut mid-character) becomes U+FFFD.
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        """<bos> (<turn> role \\n content <eos>)* <turn> assistant \\n"""
        _check_messages(messages)
        ids = [self.BOS]
        for m in messages:
            ids += [self.TURN] + self.encode(f"{m['role']}\n{m['content']}", False) + [self.EOS]
        return ids + [self.TURN] + self.encode("assistant\n", False)


def _token_str(tok: object) -> str | None:
    # tokenizer_config.json stores specials as "</s>" or {"content": "</s>", ...}.
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class HFTokenizer:
    """A checkpoint's ``tokenizer.json`` with the chat template of
    ``tokenizer_config.json`` (rendered with jinja2, as HF does)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        model_cfg = _read_json(path / "config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos: list[int] = []
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos.append(self._tok.token_to_id(self.eos_token))
        for src in (gen_cfg, model_cfg):
            v = src.get("eos_token_id")
            eos += v if isinstance(v, list) else [v] if isinstance(v, int) else []
        self.eos_token_ids = sorted(set(eos))
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              model_cfg.get("vocab_size", 0))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        self._template = _compile_template(template) if template else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """add_bos: add what the tokenizer itself adds to a plain text (its
        post-processor: <|begin_of_text|> for LLaMA 3, nothing for SmolLM2),
        as HF's ``add_special_tokens=True`` does."""
        return self._encode(text, add_bos)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it runs (encode holds it): a
        # caller that tokenizes a long prompt in a worker thread to keep an
        # event loop responsive only gets that with it.  Same ids.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        _check_messages(messages)
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(messages=list(messages), add_generation_prompt=True,
                                     bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "")
        # The template writes the specials (bos, turn markers) itself.
        return self._encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent,
                                                             ensure_ascii=False)
    return env.from_string(source)


def load_tokenizer(model: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a ``[model] model`` value: bytes for dummy configs."""
    if model in DUMMY_CONFIGS:
        return ByteTokenizer()
    return HFTokenizer(model)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas for streaming.

    Decodes only a window: the ids since the last emitted delta plus the ones
    before it as context (tokenizers may render a token differently at the
    start of a string). Text ending in U+FFFD is held back: a multi-byte
    character is not complete yet.
    """

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is context already emitted
        self._read = 0  # ids[_read:] not emitted yet

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]

    def flush(self) -> str:
        """Whatever is held back (at the end of generation)."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        text = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]

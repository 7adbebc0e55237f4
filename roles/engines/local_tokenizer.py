"""Tokenizing for an engine in the conductor, once shown to agree with it.

Routing needs a prompt's token ids; asking the engine (``POST /tokenize``)
costs a round trip through its API server, which on a busy engine is slow
and delays the first token.  vLLM's ``/v1/models`` names the checkpoint it
serves (``root``); where that directory is readable here and has a
``tokenizer.json``, the conductor loads it and asks the engine to tokenize a
few probe prompts (plain text, and a chat conversation).  It tokenizes
locally only what the probes showed to agree: plain prompts when the text
probes match, chat messages when the chat probe matches too.  Anything
with options that change the tokens (``add_special_tokens``, a chat
template, tools, ...) still goes to the engine; so does every request of an
engine whose tokenizer disagreed or could not be loaded.

A wrong local tokenization would only misprice a request (the body is
forwarded unchanged and the engine tokenizes it itself): the probes keep
routing on the keys of what the engine caches.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from model.tokenizer import HFTokenizer

log = logging.getLogger("mooncaked.engines.tokenizer")

# Text probes: words, digits, spacing, punctuation and non-ASCII, where
# tokenizers (and their normalizers and pre-tokenizers) differ.
TEXT_PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines; numbers 12345 and 3.14159 ",
    "Grüße, naïve café — 東京 🚀 ٣",
)
CHAT_PROBE = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "Hello, world! 12345"},
              {"role": "assistant", "content": "Hi."},
              {"role": "user", "content": "Grüße — 東京?"}]

# (path, body) -> the engine's token ids, or None when it could not answer.
AskEngine = Callable[[str, dict], Awaitable["list[int] | None"]]


@dataclass(frozen=True)
class LocalTokenizer:
    """A tokenizer shown to agree with an engine's own."""

    tokenizer: HFTokenizer
    chat: bool   # chat messages agree too

    def prompt_tokens(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_bos=True)

    def chat_tokens(self, messages) -> list[int] | None:
        """The messages' tokens, or None where only the engine can say
        (chat not verified, or messages beyond plain role/content text)."""
        if not self.chat:
            return None
        try:
            return self.tokenizer.apply_chat_template(messages)
        except (ValueError, TypeError, KeyError):
            return None


def load_checkpoint_tokenizer(root: object) -> HFTokenizer | None:
    """The tokenizer of the checkpoint directory ``root``, if it is one here."""
    if not isinstance(root, str) or not root:
        return None
    path = Path(root)
    if not (path / "tokenizer.json").is_file():
        return None
    return HFTokenizer(path)


async def verify(tokenizer: HFTokenizer, model: str, ask: AskEngine) -> LocalTokenizer | None:
    """``tokenizer`` if the engine tokenizes the text probes as it does
    (and whether its chat rendering agrees), else None."""
    for text in TEXT_PROBES:
        theirs = await ask("/tokenize", {"model": model, "prompt": text})
        if theirs is None or theirs != tokenizer.encode(text, add_bos=True):
            return None
    try:
        ours = tokenizer.apply_chat_template(CHAT_PROBE)
    except ValueError:   # no chat template here
        ours = None
    theirs = await ask("/tokenize", {"model": model, "messages": CHAT_PROBE}) \
        if ours is not None else None
    return LocalTokenizer(tokenizer, chat=ours is not None and theirs == ours)


class TokenizerCache:
    """Loaded tokenizers by checkpoint path (engines serving one checkpoint
    share it), loaded off the event loop."""

    def __init__(self) -> None:
        self._loaded: dict[str, HFTokenizer | None] = {}

    async def get(self, root: object) -> HFTokenizer | None:
        if not isinstance(root, str):
            return None
        if root not in self._loaded:
            try:
                self._loaded[root] = await asyncio.to_thread(load_checkpoint_tokenizer, root)
            except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint: the engine tokenizes
                log.info("cannot load the tokenizer at %s (%s: %s); the engine tokenizes",
                         root, type(exc).__name__, exc)
                self._loaded[root] = None
        return self._loaded[root]

"""Structured output (``response_format`` json_object / json_schema) with llguidance.

The front end turns a JSON schema into an llguidance grammar (a JSON string)
and checks it against the tokenizer; the grammar then travels in
``SamplingParams.grammar``.  Wherever a token is sampled (the prefill node for
the first one, the decode node for the rest) a ``GrammarMatcher`` built from
it masks the tokens the grammar does not allow, before every other logits
step (as vLLM applies its grammar bitmask before the sampler); the decode
node's matcher is fed every token of the sequence, the first one included.

llguidance is an optional dependency (``pip install llguidance``: one wheel,
no dependencies); without it a json ``response_format`` is refused.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# Compact JSON: a small model may otherwise emit whitespace until max_tokens
# (vLLM's llguidance backend allows any whitespace unless
# --disable-any-whitespace; this is that flag, always on).
_SCHEMA_DEFAULTS = {"whitespace_flexible": False}


class GrammarUnavailable(ValueError):
    """llguidance is not installed (a ValueError: a node answers such a request
    as one it cannot serve)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise GrammarUnavailable("structured output needs the llguidance package "
                                 "(pip install llguidance)") from None
    return llguidance


def grammar_from_schema(schema: dict) -> str:
    """The llguidance grammar of a JSON schema."""
    return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                            defaults=_SCHEMA_DEFAULTS)


def grammar_error(grammar: str, tokenizer: Any) -> str | None:
    """Why ``grammar`` cannot run with ``tokenizer`` (None: it can)."""
    try:
        error = _llguidance().LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    except (ValueError, TypeError) as exc:
        return str(exc)
    return error or None


class _ByteTokens:
    """ByteTokenizer as llguidance's TokenizerWrapper reads a tokenizer."""

    def __init__(self, vocab_size: int) -> None:
        specials = ByteTokenizer.SPECIALS
        self.eos_token_id = ByteTokenizer.EOS
        self.bos_token_id = ByteTokenizer.BOS
        self.tokens = [bytes([i]) for i in range(256)] + [
            specials.get(i, f"<|{i}|>").encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


# Built once per tokenizer (an HF one takes ~1 s); the tokenizer is kept so
# its id is never reused by another.
_LL_TOKENIZERS: dict[int, tuple[Any, Any]] = {}


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of one of model.tokenizer's tokenizers."""
    ll = _llguidance()
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_ll_tokenizer(tokenizer.vocab_size)
    hit = _LL_TOKENIZERS.get(id(tokenizer))
    if hit is None:
        if not isinstance(tokenizer, HFTokenizer):
            raise TypeError(f"no structured output for a {type(tokenizer).__name__}")
        # llguidance reads the tokenizers library's own JSON form of it.
        made = ll.LLTokenizer(tokenizer._tok.to_str(), n_vocab=tokenizer.vocab_size,
                              eos_token=tokenizer.eos_token_ids[0])
        hit = _LL_TOKENIZERS[id(tokenizer)] = (tokenizer, made)
    return hit[1]


@functools.cache
def _byte_ll_tokenizer(vocab_size: int) -> Any:
    ll = _llguidance()
    return ll.LLTokenizer(ll.TokenizerWrapper(_ByteTokens(vocab_size)))


@functools.cache
def _model_tokenizer(model: str) -> Any:
    return load_tokenizer(model)


class GrammarMatcher:
    """One sequence's grammar state: ``mask`` the logits of its next token,
    then ``accept`` the token sampled."""

    def __init__(self, grammar: str, tokenizer: Any) -> None:
        self._m = _llguidance().LLMatcher(ll_tokenizer(tokenizer), grammar)
        if self._m.is_error():
            raise ValueError(f"bad grammar: {self._m.get_error()}")

    @classmethod
    def for_model(cls, grammar: str, model: str) -> GrammarMatcher:
        """A node's matcher: the tokenizer of its ``[model] model``."""
        return cls(grammar, _model_tokenizer(model))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with every token the grammar forbids at -inf."""
        bits = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
        vocab = logits.shape[0]
        allowed = allowed[:vocab].bool()
        if allowed.shape[0] < vocab:  # ids past the tokenizer's: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.shape[0])])
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar did not allow it."""
        return self._m.consume_token(token)

    @property
    def failed(self) -> bool:
        return self._m.is_error()

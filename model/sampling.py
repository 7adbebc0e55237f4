"""Sampling of the next token and stop conditions.

``sample`` draws one token from one row of logits; ``StopStringChecker``
finds stop strings in streamed text without emitting any part of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # 0: no limit
    seed: int | None = None  # per-request generator seed: same seed, same tokens
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)  # besides EOS
    stop: list[str] = field(default_factory=list)  # stop strings (not included in output)
    ignore_eos: bool = False
    logprobs: bool = False  # report the logprob of each chosen token

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]  # OpenAI accepts a single string
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator | None:
        """The request's generator (None when unseeded: torch's global RNG)."""
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[int, float]:
    """(token id, its logprob) from logits [vocab] of one sequence.

    The logprob is under the model's own distribution (log_softmax of the raw
    logits, before temperature and truncation), as OpenAI-style APIs report.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be 1-D [vocab], got shape {tuple(logits.shape)}")
    logits = logits.float().cpu()
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        scaled = logits / params.temperature
        if params.top_k and params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the mass before it already reaches top_p (the
            # most likely token is always kept).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
            scaled = scaled.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    logprob = float(torch.log_softmax(logits, dim=-1)[token]) if params.logprobs else 0.0
    return token, logprob


def is_stop_token(token_id: int, params: SamplingParams, eos_token_ids: Sequence[int]) -> bool:
    return token_id in params.stop_token_ids or \
        (not params.ignore_eos and token_id in eos_token_ids)


class StopStringChecker:
    """Feed text deltas; get back the text safe to emit and whether a stop
    string was hit. Text that could be the start of a stop string is held
    back until it is ruled out; the stop string itself is never emitted."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self._stop), default=0)
        self._text = ""
        self._emitted = 0  # _text[:_emitted] has been returned
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._text += delta
        if not self._stop:
            out, self._emitted = self._text[self._emitted:], len(self._text)
            return out, False
        # A match must end in the new text, so it starts after this point.
        search_from = max(0, len(self._text) - len(delta) - self._longest + 1)
        hits = [i for s in self._stop if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            cut = min(hits)
            out = self._text[self._emitted:cut]
            self._emitted = cut
            self.stopped = True
            return out, True
        hold = self._held_back()
        safe = len(self._text) - hold
        out = self._text[self._emitted:safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation ended without a stop string."""
        if self.stopped:
            return ""
        out, self._emitted = self._text[self._emitted:], len(self._text)
        return out

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

"""Sampling of the next token and stop conditions.

``sample`` draws one token from one row of logits; ``StopStringChecker``
finds stop strings in streamed text without emitting any part of them.

The logits go through the same steps, in the same order, as vLLM's sampler
(vllm/v1/sample/sampler.py), so a request's greedy text is the one vLLM
would give for the same logits:

  0. grammar      structured output: tokens the grammar forbids at -inf
                  (vLLM applies its grammar bitmask before the sampler)
  1. min_tokens   EOS and stop_token_ids at -inf until min_tokens tokens
                  were generated
  2. logit_bias   {token: bias} added
  3. penalties    repetition (prompt and output tokens: a positive logit
                  divided by it, any other multiplied), then frequency and
                  presence (output tokens only): logit -= frequency * count
                  + presence * (count > 0)
  4. greedy: argmax here.  Otherwise temperature, then min_p (tokens whose
     probability is below min_p * the top probability dropped), then top_k,
     top_p, and a draw.

Logprobs are those of the raw logits (vLLM's default ``raw_logprobs``;
with a grammar, of the masked ones, as vLLM's sampler sees them).
Every token is sampled the same way wherever it is sampled (the prefill
node samples the first, the decode node the rest), so greedy text is the
same colocated or disaggregated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from model.structured import GrammarMatcher

# OpenAI documents logit_bias values in [-100, 100]; vLLM clamps to it.
LOGIT_BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0  # presence_penalty and frequency_penalty in [-2, 2]
# Alternatives per token a logprobs list may ask for (vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20


class Sampled(NamedTuple):
    """One sampled token: its id, its logprob (0.0 unless asked) and, when
    ``top_logprobs`` is asked, the most likely (id, logprob) pairs, most
    likely first.  Logprobs are under the model's own distribution."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # With logprobs: also the top_logprobs most likely tokens and theirs.
    top_logprobs: int = 0
    presence_penalty: float = 0.0  # over output tokens: logit -= p if the token occurred
    frequency_penalty: float = 0.0  # over output tokens: logit -= f * occurrences
    repetition_penalty: float = 1.0  # over prompt and output tokens; 1: off
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were generated
    min_p: float = 0.0  # drop tokens with prob < min_p * top prob (after temperature)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the raw logits
    # The model's EOS ids, filled by the front end (vLLM's all_stop_token_ids)
    # when min_tokens needs them: the prefill node samples the first token
    # without a tokenizer of its own.
    eos_token_ids: list[int] = field(default_factory=list)
    # Structured output: an llguidance grammar (model/structured.py); where a
    # token is sampled, the tokens it forbids are masked before step 1.
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.top_logprobs}")
        for name in ("stop_token_ids", "eos_token_ids"):
            ids = getattr(self, name)
            if any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(f"{name} must be non-negative ints, got {ids}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]  # OpenAI accepts a single string
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        bias = {}
        for token, value in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not math.isfinite(value):
                raise ValueError(f"logit_bias values must be finite, got {value}")
            bias[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
        self.logit_bias = bias

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_prompt(self) -> bool:
        """Sampling reads the prompt's token ids (the repetition penalty does)."""
        return self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Any of steps 1-3 of the module docstring is on."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1.0)

    def make_generator(self) -> torch.Generator | None:
        """The request's generator (None when unseeded: torch's global RNG)."""
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                   eos_ids: Iterable[int] = ()) -> torch.Tensor:
    """Steps 1-3 of the module docstring on float logits [vocab] (a new tensor).

    ``output_ids``: the tokens generated so far (the first one included);
    ``eos_ids``: EOS ids known where this runs, besides ``params.eos_token_ids``.
    """
    logits = logits.clone()
    vocab = logits.shape[0]
    if len(output_ids) < params.min_tokens:
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(params.eos_token_ids)
            stops.update(eos_ids)
        masked = [t for t in stops if t < vocab]
        if masked:
            logits[masked] = -math.inf
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        logits[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=logits.dtype)
    penalize_output = params.presence_penalty or params.frequency_penalty
    if params.repetition_penalty != 1.0 or penalize_output:
        out = torch.tensor(list(output_ids), dtype=torch.long)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(list(prompt_ids), dtype=torch.long)
            seen[prompt[prompt < vocab]] = True
            p = params.repetition_penalty
            scale = torch.where(logits > 0, 1.0 / p, p)
            logits = torch.where(seen, logits * scale, logits)
        if penalize_output:
            logits -= params.frequency_penalty * counts
            logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None, *, prompt_ids: Sequence[int] = (),
           output_ids: Sequence[int] = (), eos_ids: Iterable[int] = (),
           grammar: GrammarMatcher | None = None) -> tuple[int, float]:
    """(token id, its logprob): ``sample_top`` without the alternatives."""
    token, logprob, _ = sample_top(logits, params, generator, prompt_ids=prompt_ids,
                                   output_ids=output_ids, eos_ids=eos_ids, grammar=grammar)
    return token, logprob


def sample_top(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None = None, *, prompt_ids: Sequence[int] = (),
               output_ids: Sequence[int] = (), eos_ids: Iterable[int] = (),
               grammar: GrammarMatcher | None = None) -> Sampled:
    """The token sampled from logits [vocab] of one sequence, its logprob
    and (``params.top_logprobs``) the most likely tokens' logprobs.

    ``prompt_ids``/``output_ids``/``eos_ids``: see ``process_logits`` (read
    only when the params turn the penalties or min_tokens on); ``grammar``:
    the sequence's matcher when ``params.grammar`` is set (the caller
    advances it with the token).  The logprob is under the model's own
    distribution (log_softmax of the raw logits, before any processing), as
    OpenAI-style APIs and vLLM report.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be 1-D [vocab], got shape {tuple(logits.shape)}")
    raw = logits.float().cpu()
    if grammar is not None:
        raw = grammar.mask(raw)
    logits = process_logits(raw, params, prompt_ids, output_ids, eos_ids) \
        if params.processes_logits else raw
    if grammar is not None and not bool(torch.isfinite(logits).any()):
        # Nothing is left (min_tokens masks the EOS the grammar wants): the
        # grammar refuses whatever comes, and its sequence ends there.
        return Sampled(int(torch.argmax(logits.nan_to_num(neginf=0.0))), 0.0)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        scaled = logits / params.temperature
        if params.min_p > 0.0:
            probs = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
    if not params.logprobs:
        return Sampled(token, 0.0)
    logprobs = torch.log_softmax(raw, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs:
        k = min(params.top_logprobs, logprobs.shape[0])
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return Sampled(token, float(logprobs[token]), top)


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

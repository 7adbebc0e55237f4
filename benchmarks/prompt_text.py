"""Prompt text whose tokens are reusable block by block, for a text client.

aiperf synthesises a Mooncake trace's prompts per hash id from a corpus of
its own and decodes them to text; the server tokenizes that text again, and
with a small BPE tokenizer the pieces merge across block joins, so requests
that share k hash ids share far fewer than k blocks of tokens (2-6% of the
reusable prefix measured on both servers).  ``BlockText`` gives every hash id
a text of exactly ``block_tokens`` tokens that starts with a space, made of
alternating word and number pieces the tokenizer keeps whole (``" word" +
"17"``, each one token, checked against the tokenizer): a byte-level
pre-tokenizer always splits before a space and between letters and digits,
so a prompt's tokens are the concatenation of its blocks' tokens, and
requests sharing k leading hash ids share exactly ``k * block_tokens``
leading prompt tokens, as in the token-id replay (``mooncaked bench serve``).

The prompts go to aiperf as ``text_input`` lines of a Mooncake trace, which
aiperf 0.13 sends verbatim (``--custom-dataset-type mooncake_trace``).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Sequence


class BlockText:
    """Texts per hash id for the tokenizer of ``model_dir`` (``tokenizer.json``)."""

    def __init__(self, model_dir: Path, block_tokens: int) -> None:
        from tokenizers import Tokenizer

        if block_tokens < 2 or block_tokens % 2:
            raise ValueError("block_tokens must be even and >= 2 (word, number pairs)")
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.block_tokens = block_tokens
        vocab = self.tok.get_vocab()
        space_words = [" " + w[1:] for w in vocab if w[:1] in ("Ġ", "▁") and w[1:].isascii()
                       and w[1:].isalpha()]
        numbers = [n for n in vocab if n.isascii() and n.isdigit()]
        self.words = sorted(w for w in space_words if len(self.encode(w)) == 1)
        self.numbers = sorted(n for n in numbers
                              if self.words and len(self.encode(self.words[0] + n)) == 2)
        if not self.words or len(self.numbers) < 4:
            raise ValueError(f"{model_dir}: the tokenizer has no one-token ' word' pieces and "
                             "number pieces to build block-stable prompts from")
        self._cache: dict[int, list[str]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def pieces(self, hash_id: int) -> list[str]:
        """The block's ``block_tokens`` one-token pieces, a function of the id alone."""
        got = self._cache.get(hash_id)
        if got is None:
            seed = int.from_bytes(hashlib.sha256(str(hash_id).encode()).digest()[:8], "big")
            rng = random.Random(seed)
            got = []
            for _ in range(self.block_tokens // 2):
                got += [rng.choice(self.words), rng.choice(self.numbers)]
            self._cache[hash_id] = got
        return got

    def prompt(self, hash_ids: Sequence[int], n_tokens: int) -> str:
        """A prompt of ``n_tokens`` tokens: the blocks of ``hash_ids`` in order,
        the last one cut; ``n_tokens`` must be in ``((m-1)*b, m*b]``."""
        b, m = self.block_tokens, len(hash_ids)
        if not (m - 1) * b < n_tokens <= m * b:
            raise ValueError(f"{n_tokens} tokens do not fit {m} blocks of {b}")
        out: list[str] = []
        for h in hash_ids:
            out += self.pieces(h)
        return "".join(out[:n_tokens])

    def check(self, hash_ids: Sequence[int], n_tokens: int) -> None:
        """Raise unless the prompt tokenizes to its blocks' tokens, one per piece."""
        text = self.prompt(hash_ids, n_tokens)
        ids = self.encode(text)
        want = [self.encode(p)[0] for h in hash_ids for p in self.pieces(h)][:n_tokens]
        if ids != want:
            raise AssertionError(f"prompt of {hash_ids[:3]}...: {len(ids)} tokens, not the "
                                 f"{n_tokens} of its blocks")

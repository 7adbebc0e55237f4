"""Tokenizers: byte-level round trip, chat templates, incremental decoding, HF."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.tiny_tokenizer import write_tiny_tokenizer
from model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, load_tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.BOS and all(0 <= i < tok.vocab_size for i in ids)
    valid = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    assert tok.decode(ids) == valid  # == text unless it holds lone surrogates
    if all(not 0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert tok.decode(ids) == text


def test_byte_tokenizer_invalid_utf8_and_specials():
    tok = ByteTokenizer()
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # a cut 3-byte character
    assert tok.decode([104, 257, 105]) == "hi"
    assert tok.decode([104, 257, 105], skip_special=False) == "h<|eos|>i"
    assert tok.encode("a", add_bos=False) == [97]
    assert tok.eos_token_ids == [257]


def test_byte_chat_template():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hi"}])
    assert ids[0] == tok.BOS and ids.count(tok.TURN) == 3 and ids.count(tok.EOS) == 2
    assert tok.decode(ids).endswith("user\nhiassistant\n")
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30))
def test_incremental_detokenizer_streams_the_full_text(text):
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok)
    ids = tok.encode(text, add_bos=False)
    streamed = "".join(d.add(i) for i in ids) + d.flush()
    assert streamed == tok.decode(ids)
    assert "\ufffd" not in streamed or "\ufffd" in tok.decode(ids)


@pytest.fixture()
def hf_dir(tmp_path):
    return write_tiny_tokenizer(tmp_path)


def test_hf_tokenizer(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_ids == [2, 4] and tok.vocab_size == 320
    ids = tok.encode("hello world", add_bos=True)
    assert ids[0] == 1 and tok.decode(ids) == "hello world"  # the post-processor's <s>
    assert tok.encode("hello world", add_bos=False) == ids[1:]
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat[0] == 3 and 4 in chat
    assert tok.decode(chat, skip_special=False) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    d = IncrementalDetokenizer(tok)
    text = "the quick brown fox, héllo"
    ids = tok.encode(text, add_bos=False)
    assert "".join(d.add(i) for i in ids) + d.flush() == text


def test_load_tokenizer_errors(tmp_path):
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_encoding_a_long_prompt_in_a_thread_lets_other_threads_run(hf_dir):
    """The conductor tokenizes long prompts in a worker thread to keep its
    event loop serving; that only works if encoding releases the GIL.  While
    a worker encodes ~100k tokens, this thread must get to run Python again
    and again (with the GIL held throughout it could not run until the end)."""
    import threading

    tok = HFTokenizer(hf_dir)
    text = "hello world, the quick brown fox. " * 12_000
    expected = tok.encode(text)
    out: list[list[int]] = []
    worker = threading.Thread(target=lambda: out.append(tok.encode(text)))
    turns = 0
    worker.start()
    while worker.is_alive():
        turns += 1
        worker.join(0.0001)
    assert out == [expected]
    assert turns > 3, f"this thread ran {turns} time(s) while the worker encoded"

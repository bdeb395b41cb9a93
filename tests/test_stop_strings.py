"""Stop strings: the tail-window check cuts where decoding the whole completion every round would, in linear time."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from batchspec_cli.engine.stops import StopStrings
from conftest import BOS_ID, PAD_ID, make_tokenizer


def full_decode_cut(tokenizer, stops, ids: list[int], n_new: int) -> int | None:
    """The reference: decode the whole completion, then the shortest prefix among this round's that holds a stop."""
    def hit(prefix):
        text = tokenizer.decode(prefix, skip_special_tokens=True)
        return any(s in text for s in stops)

    if not hit(ids):
        return None
    for cut in range(max(1, len(ids) - n_new + 1), len(ids) + 1):
        if hit(ids[:cut]):
            return cut
    return len(ids)


def multi_char_tokenizer() -> PreTrainedTokenizerFast:
    """Tokens of 1 to 4 characters that overlap each other ("ab", "ba", "aba" ...), plus specials."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "a", "b", " ", "ab", "ba", "aba", "bb ", " a", "abba",
                                         "\n", "a\n"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.add_special_tokens(["<pad>", "<eos>"])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style words ("▁" is a space): a decode drops the space its first token starts with."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "▁a", "▁b", "a", "b", "▁", "▁ab", "ba"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(["<pad>", "<eos>"])
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte-to-character map): multi-byte characters span tokens, prefixes decode to U+FFFD."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    chars = [chr(b if b in keep else next(extra)) for b in range(256)]
    vocab = {"<pad>": 0, "<eos>": 1, **{c: 2 + b for b, c in enumerate(chars)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.add_special_tokens(["<pad>", "<eos>"])
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")


def char_stream(rng: random.Random, tokenizer, n: int) -> list[int]:
    """Characters, and special tokens (no text) in runs now and then."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "ab a"]
    out = []
    while len(out) < n:
        out += [rng.choice(ids)] if rng.random() > 0.1 else [rng.choice([PAD_ID, BOS_ID])] * rng.randint(1, 20)
    return out[:n]


def multi_char_stream(rng: random.Random, tokenizer, n: int) -> list[int]:
    return [rng.randrange(2, len(tokenizer)) if rng.random() > 0.05 else 0 for _ in range(n)]


def byte_stream(rng: random.Random, tokenizer, n: int) -> list[int]:
    """UTF-8 of random characters (1 to 4 bytes each), a stray continuation byte now and then."""
    data = bytearray()
    while len(data) < n:
        data += rng.choice(["a", " ", "é", "日", "🙂", "ab"]).encode() if rng.random() > 0.03 else b"\x80"
    return [2 + b for b in data[:n]]


CASES = [(make_tokenizer, char_stream), (multi_char_tokenizer, multi_char_stream),
         (metaspace_tokenizer, multi_char_stream), (byte_level_tokenizer, byte_stream)]


@pytest.mark.parametrize("make,stream", CASES, ids=["chars", "multi-char tokens", "metaspace", "bytes"])
def test_cuts_equal_the_full_decode_reference(make, stream):
    tokenizer = make()
    rng = random.Random(0)
    cuts = 0
    for trial in range(150):
        ids = stream(rng, tokenizer, 400)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.choice([1, 1, 2, 3])):  # substrings of the text: hits early, late and never
            length = rng.choice([1, 2, 3, 5, 8, 13, 30])
            at = rng.randrange(0, max(1, len(text) - length))
            stop = text[at: at + length].replace("\ufffd", "")
            stops.append(stop if stop and rng.random() > 0.1 else "never\u2603")
        stops = tuple(stops)
        checker = StopStrings(tokenizer, stops)
        end = 0
        while end < len(ids):
            n_new = rng.randint(1, 6)
            end = min(len(ids), end + n_new)
            prefix, n_new = ids[:end], min(n_new, end)
            expected = full_decode_cut(tokenizer, stops, prefix, n_new)
            assert checker(prefix, n_new) == expected, (trial, stops, end)
            if expected is not None:  # the engine ends the row here
                cuts += 1
                break
    assert cuts > 50  # the stops were hit, at many positions


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.all_special_ids = tokenizer, tokenizer.all_special_ids
        self.decoded: list[int] = []  # tokens passed to each decode call

    def decode(self, ids, **kw):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def decoded_tokens(length: int, n_new: int = 5) -> tuple[int, int]:
    """(total, largest per call) tokens decoded checking a completion of `length` tokens that never stops."""
    tokenizer = CountingTokenizer(make_tokenizer())
    checker = StopStrings(tokenizer, ("zzzz", "never reached"))
    letters = [tokenizer.tokenizer.convert_tokens_to_ids(c) for c in "ab a"]
    ids = [random.Random(1).choice(letters) for _ in range(length)]
    for end in range(n_new, length + 1, n_new):
        assert checker(ids[:end], n_new) is None
    return sum(tokenizer.decoded), max(tokenizer.decoded)


def test_work_per_call_is_bounded_so_a_row_costs_linear_time():
    short_total, short_max = decoded_tokens(1000)
    long_total, long_max = decoded_tokens(4000)
    window = 5 + len("never reached") + StopStrings.MARGIN_TOKENS
    assert short_max == long_max == window
    assert long_total < 4.5 * short_total  # linear: 4x; decoding the whole completion every round: 16x


def test_the_text_of_a_stopped_row_ends_before_its_first_stop_string():
    """What the output holds of a row cut by ``__call__``: its text up to the earliest of the job's and the row's
    stop strings (each of them decoded independently here)."""
    tokenizer = make_tokenizer()
    stops = StopStrings(tokenizer, ("cd",))
    ids = tokenizer.encode("ab cd ef gh", add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert stops.text(ids) == text[: text.index("cd")]
    assert stops.text(ids, ("b",)) == text[: text.index("b")]  # the row's own, earlier
    assert StopStrings(tokenizer, ()).text(ids, ("zz",)) == text  # none found: the whole text

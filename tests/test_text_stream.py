"""The reply's text as it streams (omnistage/models/text_stream.py): whole characters, stop texts,
and incremental decoding whose pieces join to exactly the whole reply's decode."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from omnistage.models import load_tokenizer, open_checkpoint
from omnistage.models.text_stream import TextStream, check_stop_texts


class CharTokenizer:
    """One token per character (ids are code points); 0xD8 starts a two-token character."""

    def __init__(self) -> None:
        self.decoded = 0  # ids decoded, all calls together

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 0xD8:  # half of "é" until its second token arrives
                if i + 1 == len(ids):
                    out.append("\ufffd")
                    break
                out.append("é")
                i += 2
                continue
            out.append(chr(ids[i]))
            i += 1
        return "".join(out)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _stream(text_pieces: list[list[int]], stop: list[str], tokenizer: Any = None) -> tuple[list[str], TextStream]:
    ts = TextStream(tokenizer or CharTokenizer(), stop)
    out = [ts.push(p) for p in text_pieces]
    out.append(ts.flush())
    return out, ts


def test_text_streams_whole_characters() -> None:
    out, ts = _stream([_ids("ab"), [0xD8], [0x01], _ids("c")], [])
    assert out == ["ab", "", "é", "c", ""] and not ts.stopped


def test_stop_text_ends_the_reply_and_is_not_sent() -> None:
    pieces = [_ids(c) for c in "Hello, END world"]
    out, ts = _stream(pieces, ["END"])
    assert "".join(out) == "Hello, " and ts.stopped
    # text that might begin a stop text is held until it cannot
    held, _ = _stream([_ids("aE"), _ids("Nx")], ["END"])
    assert held == ["a", "ENx", ""]
    # the earliest of several stop texts wins, even across pieces
    out, _ = _stream([_ids("one tw"), _ids("o three")], ["three", "two"])
    assert "".join(out) == "one "


def test_stop_text_rules() -> None:
    assert check_stop_texts(["a", "bc"]) == ["a", "bc"]
    for bad, message in ((["x"] * 17, "at most 16"), ([""], "stop[0]: empty"), (["y" * 300], "longer than")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_stop_texts(bad)


def test_each_push_decodes_only_the_new_ids() -> None:
    """Linear in the reply's length: re-decoding the whole reply each token would decode n²/2 ids."""
    tok = CharTokenizer()
    n = 2000
    out, _ = _stream([[ord("a") + i % 26] for i in range(n)], ["never"], tok)
    assert "".join(out) == "".join(chr(ord("a") + i % 26) for i in range(n))
    assert tok.decoded <= 4 * n


@pytest.fixture(scope="module", params=["qwen3_omni", "qwen2_5_omni"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    path: Path = request.getfixturevalue("tiny_dir" if request.param == "qwen3_omni" else "q25_dir")
    return load_tokenizer(open_checkpoint(path))


TEXTS = ["héllo 世界 🎉 done", "naïve café — ok", "数字 123 和 emoji 👩‍👩‍👧 end", "plain ascii only"]


def _pieces(rng: random.Random, ids: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.choice([1, 1, 1, 2, 3, 5])  # mostly one token a step, as decode sends them
        out.append(ids[i : i + k])
        i += k
    return out


def test_pieces_join_to_the_whole_decode(tokenizer: Any) -> None:
    rng = random.Random(7)
    vocab = len(tokenizer)
    cases = [tokenizer.encode(t) for t in TEXTS]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(300)]  # specials, bad bytes
    cases += [rng.sample(tokenizer.all_special_ids, 3) + tokenizer.encode(TEXTS[0]) + [tokenizer.all_special_ids[0]]]
    for ids in cases:
        out, ts = _stream(_pieces(rng, ids), [], tokenizer)
        assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True), ids
        assert ts.text == "".join(out)


def test_a_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # (one byte a token in the tiny vocabulary)
    out, _ = _stream([[i] for i in ids], [], tokenizer)
    assert out == [""] * (len(ids) - 1) + ["🎉", ""]


@pytest.mark.parametrize("per_push", [1, 2, 5, 7])
def test_invalid_bytes_then_text_join_to_the_whole_decode(tokenizer: Any, per_push: int) -> None:
    """The model's stray bytes, then characters split over ids: nothing is sent early that a later
    id would change (an earlier cap on waiting sent a half character and lost the character, and
    with it the stop text), however the ids are pushed (the gateway one a chunk, a decode role the
    handoff's history at once)."""
    stray = tokenizer.encode("é")[1]  # a lone continuation byte: invalid on its own
    ids = [stray] * 20 + tokenizer.encode("中文 🎉🎉 ok")
    pieces = [ids[i : i + per_push] for i in range(0, len(ids), per_push)]
    out, _ = _stream(pieces, [], tokenizer)
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)
    out, ts = _stream(pieces, ["中文"], tokenizer)
    assert ts.stopped and "".join(out) == tokenizer.decode([stray] * 20)


def test_stop_text_within_multibyte_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("héllo 世界 🎉 done")
    out, ts = _stream([[i] for i in ids], ["界"], tokenizer)
    assert "".join(out) == "héllo 世" and ts.stopped
    out, ts = _stream([[i] for i in ids], ["🎉 d", "one"], tokenizer)
    assert "".join(out) == "héllo 世界 " and ts.stopped

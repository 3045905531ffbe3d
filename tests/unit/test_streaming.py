"""serve_app.core.decoding.streaming.TextStream, and token streaming through GenerationRuntime.generate()."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.core.calls import SamplingParams
from serve_app.core.models import GenerationRequest
from serve_app.core.decoding.streaming import TextStream, first_stop

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _piece_decoder(pieces: list[str]):
    """A decode function over a toy vocabulary: token id i is the text pieces[i]."""
    return lambda ids: "".join(pieces[i] for i in ids)


def _run(stream: TextStream, ids: list[int]) -> list[str]:
    """Push ids until the stream stops; every delta, the final flush included."""
    deltas = []
    for i in ids:
        deltas.append(stream.push(i))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas


# --------------------------------------------------------------------------- TextStream


def test_deltas_concatenate_to_the_decoded_text():
    pieces = ["Hel", "lo", " wor", "ld", "!"]
    stream = TextStream(_piece_decoder(pieces))
    deltas = _run(stream, [0, 1, 2, 3, 4])
    assert "".join(deltas) == stream.text == "Hello world!"
    # trailing whitespace waits for the next token; everything else goes out at once
    assert deltas[:5] == ["Hel", "lo", " wor", "ld", "!"]
    assert not stream.stopped and stream.finished


def test_stop_string_across_tokens_is_never_emitted():
    pieces = ["The end", " is ", "ne", "ar", ". More"]
    stream = TextStream(_piece_decoder(pieces), stops=("near.",))
    out = [stream.push(i) for i in (0, 1)]
    assert out == ["The end", " is"]  # a trailing space waits for the next token
    assert stream.push(2) == " "  # "ne" could start "near.", so it is held back
    assert stream.push(3) == ""  # "near" still could
    assert stream.push(4) == ""  # "near." matched: the row stops before it
    assert stream.stopped
    assert stream.finish() == ""
    assert stream.text == "The end is "
    assert stream.push(1) == "" and stream.text == "The end is "  # ended: further tokens are ignored


def test_held_back_stop_prefix_is_flushed_when_it_was_not_a_stop():
    pieces = ["ab", "c", "x"]
    stream = TextStream(_piece_decoder(pieces), stops=("abcd", "zz"))
    assert stream.push(0) == ""
    assert stream.push(1) == ""
    assert stream.push(2) == "abcx"
    assert stream.finish() == "" and stream.text == "abcx"
    # ending while a prefix is held back flushes it
    stream = TextStream(_piece_decoder(pieces), stops=("abcd",))
    assert [stream.push(0), stream.push(1)] == ["", ""]
    assert stream.finish() == "abc" and not stream.stopped


def test_incomplete_utf8_is_held_back():
    raw = "é→".encode()
    byte_tokens = [raw[i:i + 1] for i in range(len(raw))]  # 2 + 3 bytes, one token each

    def decode(ids):
        return b"".join(byte_tokens[i] for i in ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    deltas = [stream.push(i) for i in range(len(byte_tokens))]
    assert deltas == ["", "é", "", "", "→"]
    assert "\ufffd" not in "".join(deltas)
    # a replacement character that stays to the end is part of the text
    stream = TextStream(decode)
    assert stream.push(0) == "" and stream.finish() == "\ufffd"


def test_space_cleanup_across_tokens_keeps_deltas_exact():
    # Like clean_up_tokenization_spaces: " ." becomes "." once the dot arrives.
    pieces = ["Hi", " ", ".", " there"]
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids).replace(" .", "."))
    deltas = _run(stream, [0, 1, 2, 3])
    assert "".join(deltas) == stream.text == "Hi. there"


_PIECES = ["a", "b", "c", " ", "ab", "ca", "\n", "bc "]


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, len(_PIECES) - 1), max_size=25),
    stops=st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), max_size=3),
)
def test_deltas_are_always_a_prefix_of_the_final_cut_text(ids, stops):
    decode = _piece_decoder(_PIECES)
    stream = TextStream(decode, stops)
    emitted = ""
    pushed = []
    for i in ids:
        pushed.append(i)
        emitted += stream.push(i)
        full = decode(pushed)
        cut = first_stop(full, stops)
        final_so_far = full if cut is None else full[:cut]
        # nothing emitted is ever taken back by a later stop string
        assert final_so_far.startswith(emitted)
        if stream.stopped:
            break
    emitted += stream.finish()
    full = decode(pushed)
    cut = first_stop(full, stops)
    assert emitted == stream.text == (full if cut is None else full[:cut])
    assert stream.stopped == (cut is not None)


# --------------------------------------------------------------------------- static engine



def _req(llm, prompt, max_tokens, stop=()):
    return GenerationRequest(prompt_ids=llm.encode_prompt(prompt), max_tokens=max_tokens, stop=tuple(stop))


class _Collector:
    def __init__(self, rows: int):
        self.deltas: list[list[str]] = [[] for _ in range(rows)]

    def __call__(self, row: int, text: str) -> None:
        assert isinstance(text, str) and text
        self.deltas[row].append(text)

    def text(self, row: int) -> str:
        return "".join(self.deltas[row])


def test_static_streaming_matches_the_plain_call(llm):
    (full,) = llm.generate([_req(llm, "Hello world", 16)], GREEDY)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    reqs = [
        _req(llm, "Hello world", 16, stop=[stop]),
        _req(llm, "Once upon a time there was a little cat", 12),
        _req(llm, "Red, green", 3),
    ]
    plain = llm.generate(reqs, GREEDY)
    sink = _Collector(len(reqs))
    streamed = llm.generate(reqs, GREEDY, on_delta=sink)
    for i, (p, s) in enumerate(zip(plain, streamed)):
        assert s.token_ids == p.token_ids and s.text == p.text and s.finish_reason == p.finish_reason
        assert sink.text(i) == s.text
        assert len(sink.deltas[i]) > 1  # it really streamed, not one blob at the end
        assert s.time_to_first_token_s is not None and s.time_to_first_token_s > 0
    assert streamed[0].finish_reason == "stop" and stop not in sink.text(0)
    assert streamed[0].text == full.text[: full.text.index(stop)]


def test_static_cancelled_row_ends_and_the_others_go_on(llm):
    reqs = [_req(llm, "Hello world", 20), _req(llm, "The sun was warm", 20)]
    plain = llm.generate(reqs, GREEDY)
    sink = _Collector(len(reqs))
    steps = {"n": 0}

    def is_cancelled(row: int) -> bool:
        if row == 0:
            steps["n"] += 1
        return row == 0 and steps["n"] > 5

    out = llm.generate(reqs, GREEDY, on_delta=sink, is_cancelled=is_cancelled)
    assert out[0].finish_reason == "cancelled"
    assert out[0].completion_tokens == 5 and out[0].token_ids == plain[0].token_ids[:5]
    assert sink.text(0) == out[0].text == llm._decode(out[0].token_ids)
    assert out[1].token_ids == plain[1].token_ids and out[1].finish_reason == "length"
    assert sink.text(1) == out[1].text


def test_static_failing_consumer_cancels_only_its_row(llm):
    reqs = [_req(llm, "Hello world", 12), _req(llm, "The sun was warm", 12)]
    plain = llm.generate(reqs, GREEDY)
    received: list[str] = []

    def on_delta(row: int, text: str) -> None:
        if row == 0:
            raise ConnectionError("client went away")
        received.append(text)

    out = llm.generate(reqs, GREEDY, on_delta=on_delta)
    assert out[0].finish_reason == "cancelled" and out[0].completion_tokens < 12
    assert out[1].token_ids == plain[1].token_ids and "".join(received) == out[1].text

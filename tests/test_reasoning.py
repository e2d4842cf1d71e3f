"""Reasoning parsers: whole replies, and streams split at every point giving the same parts."""

from __future__ import annotations

import random

import pytest

from kvcap.server.reasoning import ReasoningStream, split_reasoning

CASES = [
    ("qwen3", "<think>\nweigh it\n</think>\n\nThe answer.", ("\nweigh it\n", "The answer.")),
    ("qwen3", "The answer, no thinking.", (None, "The answer, no thinking.")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("qwen3", "a < b", (None, "a < b")),
    ("deepseek_r1", "weigh it</think>Answer", ("weigh it", "Answer")),
    ("deepseek_r1", "<think>weigh</think>\nAnswer </thi", ("weigh", "Answer </thi")),
    ("deepseek_r1", "still thinking </th", ("still thinking </th", "")),
]


@pytest.mark.parametrize("parser, text, parts", CASES)
def test_whole_replies(parser, text, parts):
    assert split_reasoning(parser, text) == parts


@pytest.mark.parametrize("parser, text, parts", CASES)
def test_stream_equals_whole_at_any_split(parser, text, parts):
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, got = ReasoningStream(parser), ["", ""]
        for k, piece in enumerate(pieces):
            r, a = stream.feed(piece, final=k == len(pieces) - 1)
            got[0] += r
            got[1] += a
            # nothing of a tag is ever sent as text
            assert "<think>" not in got[0] + got[1] and "</think>" not in got[0] + got[1]
        assert (got[0] or None, got[1]) == (parts[0] or None, parts[1]), pieces


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        split_reasoning("o1", "x")

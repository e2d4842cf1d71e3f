"""Sampling / structured-output / detokenizer bugs found by a second hunt: each test failed
before its fix."""

from __future__ import annotations

import pytest

from kvcap.errors import ConfigError
from kvcap.sampling_params import SamplingParams

# -- a lone surrogate in a value the output must spell ---------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(choice=["yes", "n\ud800"]),
    dict(json_schema={"enum": ["x\udcff", "y"]}),
    dict(json_schema={"const": "\ud800"}),
    dict(json_schema={"type": "object", "properties": {"\ud800": {"type": "integer"}}}),
    dict(json_schema={"type": "object", "propertyNames": {"enum": ["\ud800"]},
                      "additionalProperties": True}),
    dict(json_schema='{"enum": ["\\ud800"]}'),  # a JSON request's escape of one
])
def test_lone_surrogate_in_a_format_value_is_a_clear_error(kwargs):
    """A choice, enum / const value or property name holding a lone surrogate (a JSON
    request's "\\ud800", a byte of argv that is not UTF-8) was a UnicodeEncodeError traceback
    from inside the schema compiler (the server's 500): no UTF-8 output can spell it."""
    with pytest.raises(ConfigError, match="lone surrogate"):
        SamplingParams(**kwargs)


# -- huge minItems / minLength: work linear in the count --------------------------------------

class _Counted(list):
    """A list that refuses to be read more than `limit` times (a loop over a huge count)."""

    def __init__(self, items, limit: int):
        super().__init__(items)
        self.reads, self.limit = 0, limit

    def __getitem__(self, i):
        self.reads += 1
        if self.reads > self.limit:
            raise AssertionError(f"read more than {self.limit} times")
        return super().__getitem__(i)


def test_min_items_is_not_a_loop_over_every_item():
    """The finiteness check walked all minItems items: {"type": "array", "minItems": 10**12}
    compiled for hours (a server request that blocked every other)."""
    from kvcap.sampling.json_schema import _finite_node

    finite = _Counted([True, True, False], limit=100)
    assert _finite_node(("arr", 0, 10**12, None, (1,)), finite)
    assert not _finite_node(("arr", 2, 10**12, None, (1,)), finite)  # items never end
    assert not _finite_node(("arr", 0, 10**12, None, (1, 2)), finite)  # a prefix item doesn't
    assert _finite_node(("arr", 2, 1, None, (1, 2)), finite)  # only the first is needed


def test_min_length_with_a_pattern_skips_whole_periods(monkeypatch):
    """Nfa.fits stepped once per character up to minLength, at compile time and again for
    every character generated under it: a pattern with minLength 10**12 never compiled."""
    from kvcap.sampling.json_schema import compile_schema
    from kvcap.sampling.regex import Nfa

    calls = {"n": 0}
    step_any = Nfa.step_any

    def counted(self, states):
        calls["n"] += 1
        if calls["n"] > 10_000:
            raise AssertionError("stepped once per character of minLength")
        return step_any(self, states)

    monkeypatch.setattr(Nfa, "step_any", counted)
    g = compile_schema({"type": "string", "pattern": "^(?:ab|c)+$", "minLength": 10**12})
    state = g.feed(g.start, b'"abcab')
    assert state is not None and not g.complete(state)
    assert g.feed(state, b'"') is None  # far too short to end
    assert g.feed(state, b"x") is None  # not the pattern


def test_fits_with_skipped_periods_agrees_with_a_walk():
    """The skip keeps the answers of the character-by-character walk."""
    from kvcap.sampling.regex import compile_regex

    for pattern in ("(?:abc|de)+x?", "a{5}(?:bbb)*c", "(?:a{3}|b{5})*c{0,2}"):
        nfa = compile_regex(pattern)
        lengths = [n for n in range(80) if _matches_some_length(nfa, n)]
        for lo in range(50):
            for hi in (None, lo, lo + 1, lo + 2, lo + 7):
                nfa._fits.clear()
                want = any(lo <= n and (hi is None or n <= hi) for n in lengths)
                assert nfa.fits(nfa.start, lo, hi) == want, (pattern, lo, hi)


def _matches_some_length(nfa, n: int) -> bool:
    """Some string of exactly n characters matches (the sets reached, one step a character)."""
    states = nfa.start
    for _ in range(n):
        states = nfa.step_any(states)
        if not states:
            return False
    return nfa.accepts(states)


# -- the end of a complete structured output -------------------------------------------------

def test_complete_structured_output_ends_with_the_models_own_eos():
    """Once nothing but EOS may follow, the output was ended with min(eos_ids) whatever the
    model sampled: Llama 3 instruct's <|eot_id|> became <|end_of_text|> (in the token ids,
    the logprobs and an include_stop_str_in_output text). A sampled EOS is kept; another
    token gives way to the EOS the model ranks highest."""
    import torch

    from kvcap.engine.structured import StructuredOutput
    from kvcap.engine.token_bytes import TokenTexts
    from kvcap.sampling.json_schema import choice_grammar

    so = StructuredOutput(TokenTexts(None), vocab_size=16, eos_ids={5, 9})
    g = choice_grammar(["yes"])
    done = g.feed(g.start, b"yes")
    assert g.must_end(done)
    logits = torch.zeros(16)
    logits[9], logits[5], logits[3] = 2.0, 1.0, 8.0

    def never(row):
        raise AssertionError("nothing to resample: the output is complete")

    assert so.choose(g, done, 9, logits, never) == (9, done)  # the model's EOS stays
    assert so.choose(g, done, 5, logits, never) == (5, done)
    assert so.choose(g, done, 3, logits, never) == (9, done)  # the likeliest EOS
    logits[5] = 2.0
    assert so.choose(g, done, 3, logits, never) == (5, done)  # ties: the lower id
    one = StructuredOutput(TokenTexts(None), vocab_size=16, eos_ids={9})
    assert one.choose(g, done, 3, logits, never) == (9, done)


@pytest.mark.parametrize("regex", [["a"], {"a": 1}])
def test_a_regex_that_is_not_a_string_is_a_clear_error_offline_too(regex):
    """regex_grammar's cache hashed its argument before the function checked its type: a list
    was "unhashable type" from inside functools (the server now answers 400 through it too)."""
    with pytest.raises(ConfigError, match="regex must be a non-empty string"):
        SamplingParams(regex=regex).validate()

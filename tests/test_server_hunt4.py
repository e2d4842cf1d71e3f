"""Bugs found by a fourth hunt over the chat and completions paths (tools, reasoning,
streaming, logprobs), each once answered wrongly. In-process: FastAPI's TestClient over a
2-layer random Llama with the real SmolLM2 tokenizer.

- tool_choice "required" refused valid tools whose schema refers to itself by any path but
  `#/$defs/Name` (zod-to-json-schema writes `#/properties/a`; `#/$defs/A/properties/x`):
  nesting the schemas in the calls array left those references pointing nowhere;
- a tool_choice function name that is no string (a list) was a 500;
- a tool's `parameters: null` (vLLM's FunctionDefinition takes it, as no parameters) was a 400;
- completions' `text_offset` counted each token's own text, a U+FFFD for each part of a
  character split across tokens: every offset after such a character (an emoji, most CJK)
  pointed past its token in the choice's text.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_helpers import tiny_client

from kvcap import LLM
from kvcap.sampling.json_schema import compile_schema
from kvcap.server.tools import calls_schema

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=48, max_num_seqs=4)


@pytest.fixture(scope="module")
def client(llm):
    with tiny_client(llm) as c:
        yield c


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# ----------------------------------------------------------------------------- "required"
# a reference by the schema's own root (zod-to-json-schema's default), and one into a
# definition's property
ROOT_REF = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                             "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"], "additionalProperties": False}
DEEP_REF = {"type": "object", "properties": {"n": {"$ref": "#/$defs/P/properties/x"}},
            "required": ["n"], "additionalProperties": False,
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


@pytest.mark.parametrize("schema, good, bad", [
    (ROOT_REF, {"a": "x", "b": "y"}, {"a": "x", "b": 1}),
    (DEEP_REF, {"n": 3}, {"n": "3"}),
])
def test_required_calls_keep_references_by_any_path(schema, good, bad):
    """calls_schema renamed only `#`, `#/$defs/X` and `#/definitions/X`: any other pointer
    into the tool's schema pointed into the calls array instead, and compiling it failed."""
    combined = calls_schema({"f": schema}, parallel=True)
    g = compile_schema(combined)
    doc = [{"name": "f", "parameters": good}]
    jsonschema.validate(doc, combined)
    assert g.complete(g.feed(g.start, json.dumps(doc).encode()))
    wrong = json.dumps([{"name": "f", "parameters": bad}]).encode()
    assert g.feed(g.start, wrong) is None


@pytest.mark.parametrize("schema", [ROOT_REF, DEEP_REF])
def test_required_takes_the_tools_a_named_choice_takes(client, schema):
    """The same tool was served under a named tool_choice and refused (400 "does not point
    into the schema") under "required"."""
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
        r = client.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 4,
                                    "tools": [_tool(schema)], "tool_choice": choice})
        assert r.status_code == 200, (choice, r.text)


# ----------------------------------------------------------------------------- bad / null
@pytest.mark.parametrize("name", [["f"], {"n": "f"}])
def test_a_tool_choice_name_that_is_no_string_is_a_400(client, name):
    """`name not in params` hashed it: "internal error: unhashable type: 'list'", a 500."""
    r = client.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 2,
                                "tools": [_tool({"type": "object"})],
                                "tool_choice": {"type": "function", "function": {"name": name}}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("choice", ["none", "required", {"type": "function",
                                                         "function": {"name": "f"}}])
def test_parameters_null_is_a_function_without_parameters(client, choice):
    """`"parameters": null` (what clients that write every field send for a function without
    arguments; vLLM takes it) was refused: "a schema must be an object or true, got None"."""
    r = client.post(CHAT, json={"model": "tiny", "messages": MSGS, "max_tokens": 3,
                                "tools": [_tool(None)], "tool_choice": choice})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- text_offset
def _streamed_logprobs(client, body: dict) -> tuple[str, dict]:
    text, lp = "", {"tokens": [], "text_offset": []}
    with client.stream("POST", CMPL, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            for key in lp:
                lp[key] += (choice["logprobs"] or {}).get(key, [])
    return text, lp


def _assert_offsets_index_the_text(text: str, lp: dict) -> None:
    """Each whole token's text is found at its offset in the choice's text."""
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for tok, at in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert at <= len(text)
        if "\ufffd" not in tok:
            assert text[at:at + len(tok)] == tok, (tok, at, text)


def test_text_offset_after_a_character_split_across_tokens(client):
    """"héllo 😀 there": the emoji is two tokens (' \\xf0\\x9f', '\\x98\\x80'), shown as
    ' \\ufffd' and '\\ufffd'; counting those texts put ' there' at 8 instead of 7."""
    body = {"model": "tiny", "prompt": "héllo 😀 there", "max_tokens": 0, "echo": True,
            "logprobs": 1}
    choice = client.post(CMPL, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "héllo 😀 there"
    assert any("\ufffd" in t for t in lp["tokens"])  # the case: a split character
    _assert_offsets_index_the_text(choice["text"], lp)
    assert lp["text_offset"][lp["tokens"].index(" there")] == 7


def test_text_offset_of_generated_split_characters_streamed_and_not(client, llm):
    """Generated tokens that split characters (biased to the emoji's two halves and a whole
    word), across stream events: the offsets index the text, streamed as returned whole."""
    halves = llm.tokenizer.encode(" 😀", add_special_tokens=False)
    word = llm.tokenizer.encode(" there", add_special_tokens=False)
    assert len(halves) == 2 and len(word) == 1
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "seed": 0, "logprobs": 1,
            "echo": True, "logit_bias": {str(t): 100 for t in halves + word}}
    choice = client.post(CMPL, json=body).json()["choices"][0]
    lp = choice["logprobs"]
    generated = lp["tokens"][1:]
    assert "\ufffd" in "".join(generated) and " there" in generated  # the case arose
    _assert_offsets_index_the_text(choice["text"], lp)
    text, streamed = _streamed_logprobs(client, body)
    assert text == choice["text"]
    assert streamed == {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}

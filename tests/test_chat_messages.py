"""LLM.chat takes the messages the server's chat route takes (kvcap/server/protocol.py
conversation()): text content parts, the `developer` role, tool calls with JSON-string
arguments; other keys of a message reach the chat template as given."""

from __future__ import annotations

import pytest

from kvcap import LLM, SamplingParams
from kvcap.errors import ConfigError
from kvcap.models.text_prompt import chat_messages

SP = SamplingParams(max_tokens=1, temperature=0.0)

# renders what the normalisation touches and what it must leave alone
ECHO_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}|{{ m.reasoning_content }}|"
    "{{ m.custom }}|{% for c in m.tool_calls or [] %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}{% endfor %}){% endfor %}"
    "{% endfor %}")


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=64)


@pytest.fixture(scope="module")
def echo_llm(tiny_dir):
    return LLM(model=str(tiny_dir), device="cpu", num_blocks=64, chat_template=ECHO_TEMPLATE)


def _ids(llm, messages):
    return [o.prompt_token_ids for o in llm.chat(messages, SP, use_tqdm=False)]


def test_text_parts_render_as_the_joined_string(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                          {"type": "text", "text": "world"}]}]
    plain = [{"role": "user", "content": "Hello, world"}]
    assert _ids(llm, parts) == _ids(llm, plain)


def test_developer_role_is_system(llm):
    def conv(role):
        return [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]

    # (the template adds its own default system prompt when the first turn is not `system`)
    assert _ids(llm, conv("developer")) == _ids(llm, conv("system"))


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "http://x/a.png"}},
     r"chat: messages\[0\]\.content\[1\] has type 'image_url': kvcap's models read text only"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     r"messages\[0\]\.content\[1\] has type 'input_audio'"),
    ({"type": "file", "file": {}}, r"messages\[0\]\.content\[1\] has type 'file'"),
    ({"type": "text"}, r"messages\[0\]\.content\[1\]: a part of type 'text' must have a string"),
    ({"type": "text", "text": 3}, r"messages\[0\]\.content\[1\]: .* string 'text'"),
    ("plain", r"messages\[0\]\.content\[1\]: must be a .* part, got str"),
])
def test_parts_that_are_not_text_are_refused_by_place_and_type(llm, part, message):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(ConfigError, match=message):
        llm.chat(messages, SP, use_tqdm=False)


def test_a_batch_names_the_conversation(llm):
    good = [{"role": "user", "content": "hi"}]
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
    with pytest.raises(ConfigError, match=r"chat: conversation 1: messages\[0\]\.content\[0\]"):
        llm.chat([good, bad], SP, use_tqdm=False)


def test_tool_call_arguments_are_parsed_and_other_keys_kept(echo_llm):
    messages = [
        {"role": "user", "content": "weather?", "custom": "mine"},
        {"role": "assistant", "content": None, "reasoning_content": "need a tool",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get"},
    ]
    (ids,) = _ids(echo_llm, messages)
    text = echo_llm.tokenizer.decode(ids)
    assert "[user]weather?||mine|" in text
    assert "[assistant]|need a tool||get(city=Paris)" in text
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # as given


@pytest.mark.parametrize("call, message", [
    ({"function": {"name": "get", "arguments": "{broken"}},
     r"chat: messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ({"function": {"arguments": "{}"}},
     r"chat: messages\[1\]\.tool_calls\[0\]: must have function\.name"),
    ("get()", r"messages\[1\]\.tool_calls\[0\]: must have function\.name"),
])
def test_bad_tool_calls_are_refused_by_place(llm, call, message):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(ConfigError, match=message):
        llm.chat(messages, SP, use_tqdm=False)


def test_normalisation_keeps_every_other_key_as_given():
    messages = [{"role": "developer", "content": [{"type": "text", "text": "a"}], "name": "n",
                 "extra": {"k": 1}},
                {"role": "assistant", "content": None, "tool_calls": None,
                 "reasoning_content": "r"},
                {"role": "tool", "content": "x", "tool_call_id": "c1", "name": "get"}]
    assert chat_messages(messages) == [
        {"role": "system", "content": "a", "name": "n", "extra": {"k": 1}},
        {"role": "assistant", "content": None, "tool_calls": None, "reasoning_content": "r"},
        {"role": "tool", "content": "x", "tool_call_id": "c1", "name": "get"}]
    assert messages[0]["role"] == "developer"  # the caller's list is not changed

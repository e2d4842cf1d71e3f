"""Found by trying the documented commands as a newcomer.

docs/INTERFACES.md: chat messages get only what the chat template writes, and
`add_special_tokens: true` with messages is a 400. /tokenize refused it, but
/v1/chat/completions silently ignored it (200), although vLLM's chat route honours it
(it adds the tokenizer's BOS on top of the template) -- a vLLM field kvcap lacks must be
refused, never ignored."""

from __future__ import annotations

import json

import pytest

from kvcap.server import protocol as P

MESSAGES = [{"role": "user", "content": "Hi"}]


def _chat(**fields):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2, **fields}
    return P.parse_request(json.dumps(body).encode(), P.ChatCompletionRequest)


def test_chat_refuses_add_special_tokens_true():
    req = _chat(add_special_tokens=True)
    with pytest.raises(P.APIError) as e:
        req.sampling_params(2)
    assert e.value.status == 400 and e.value.param == "add_special_tokens"


@pytest.mark.parametrize("value", [False, None])
def test_chat_takes_add_special_tokens_at_its_neutral_value(value):
    assert "add_special_tokens" not in _chat(add_special_tokens=value).unsupported()
    assert "add_special_tokens" not in _chat().unsupported()

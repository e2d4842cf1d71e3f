"""Deterministic synthetic conversations: chat built from installed documents, and tool calls.

Chat conversations are made from one source document each (so they inherit its split): a stdlib
function's docstring and source become a question/answer pair; a documentation topic or license
paragraph becomes an explain/continue exchange. Tool-call conversations are generated from a
fixed tool catalogue with `random.Random(f"tool_json:{seed}:{split}:{index}")` (string seeds are
hashed with SHA-512 by `random`, so they are stable across processes). Every tool call carries
a session id with a split tag at the very start of the system prompt, so calibration and
evaluation conversations can never coincide, even when truncated to a few tokens.
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
from collections.abc import Iterator
from typing import Any

from kvcap.eval.sources import Document

Message = dict[str, str]

SYSTEM_PROMPTS = (
    "You are a helpful AI assistant.",
    "You are a concise technical assistant. Answer precisely.",
    "You are a patient teacher who explains things step by step.",
    "You are an expert Python developer and documentation writer.",
)


def _paragraphs(text: str, min_words: int = 12) -> list[str]:
    paras = [re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if len(p.split()) >= min_words]


_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\(", re.M)


def _function_block(text: str, start: int, indent: str) -> str:
    """The source of the function whose `def` line starts at `start`: following lines while they
    are blank or indented deeper than the `def` (parsing whole modules is too slow here)."""
    lines = text[start:].splitlines(keepends=True)
    end = 1
    while end < len(lines):
        line = lines[end]
        if line.strip() and not (line.startswith(indent) and len(line) - len(line.lstrip())
                                 > len(indent)) and not line.lstrip().startswith(")"):
            break
        end += 1
    return "".join(lines[:end]).rstrip()


def _documented_function(text: str, rng: random.Random, tries: int = 12
                         ) -> tuple[str, str, str] | None:
    """(name, first docstring paragraph, source) of a randomly chosen documented function."""
    defs = list(_DEF.finditer(text))
    rng.shuffle(defs)
    for m in defs[:tries]:
        block = _function_block(text, m.start(), m.group(1))
        try:
            node = ast.parse(textwrap.dedent(block)).body[0]
        except (SyntaxError, ValueError, IndexError):
            continue
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if doc and len(doc.split()) >= 5:
            return m.group(2), doc.split("\n\n")[0].strip(), textwrap.dedent(block)
    return None


def _code_chat(doc: Document, rng: random.Random) -> list[Message] | None:
    found = _documented_function(doc.text, rng)
    if found is None:
        return None
    name, summary, seg = found
    module = doc.doc_id.split(":", 1)[1].removesuffix(".py").replace("/", ".")
    ask = rng.choice((
        f"What does the function `{name}` in the `{module}` module do?",
        f"Can you explain `{module}.{name}`?",
        f"I found `{name}` while reading `{module}`. What is it for?",
    ))
    follow = rng.choice(("Show me its source code.", "How is it implemented?",
                         "Can I see the implementation?"))
    return [
        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": summary},
        {"role": "user", "content": follow},
        {"role": "assistant", "content": f"Here is `{name}`:\n\n```python\n{seg}\n```"},
    ]


def _prose_chat(doc: Document, rng: random.Random) -> list[Message] | None:
    paras = _paragraphs(doc.text)
    if len(paras) < 3:
        return None
    start = rng.randrange(len(paras) - 2)
    if doc.doc_id.startswith("pydoc:"):
        topic = doc.doc_id.split(":", 1)[1]
        first = rng.choice((f"Explain the Python topic '{topic}'.",
                            f"What does the Python reference say about {topic}?"))
    else:
        title = doc.doc_id.split(":", 1)[1]
        first = rng.choice((
            f"I am reading the {title} text. What comes after this passage?\n\n{paras[start]}",
            f"Quote the paragraph of {title} that follows this one:\n\n{paras[start]}",
        ))
    return [
        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
        {"role": "user", "content": first},
        {"role": "assistant", "content": paras[start + 1]},
        {"role": "user", "content": rng.choice(("Go on.", "And then?", "Please continue."))},
        {"role": "assistant", "content": paras[start + 2]},
    ]


def chat_conversations(docs: list[Document], seed: int) -> Iterator[tuple[list[Message], dict]]:
    """One conversation per usable document, in the given order, with its provenance."""
    for doc in docs:
        rng = random.Random(f"chat:{seed}:{doc.doc_id}")
        is_code = doc.doc_id.startswith("stdlib:")
        messages = _code_chat(doc, rng) if is_code else _prose_chat(doc, rng)
        if messages is not None:
            prov = {"generator": "chat", "seed": seed, "from": doc.doc_id,
                    "source_provenance": doc.provenance}
            yield messages, prov


# ----------------------------------------------------------------------------- tool calls
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Hanoi", "Tbilisi",
           "Valparaiso", "Accra", "Krakow", "Perth", "Quito", "Tallinn", "Bergen", "Cusco")
_CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "CAD", "INR", "BRL", "KES", "NOK")
_LANGS = ("French", "German", "Spanish", "Japanese", "Swahili", "Portuguese", "Korean")
_NAMES = ("Ada", "Brian", "Chioma", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines")
_TABLES = ("orders", "customers", "invoices", "shipments", "tickets", "sensors")
_PHRASES = ("where is the train station", "thank you for your help", "the meeting is moved",
            "please close the window", "how much does this cost")


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2024, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _tool_specs() -> list[dict[str, Any]]:
    def spec(name: str, desc: str, props: dict[str, str]) -> dict[str, Any]:
        return {"name": name, "description": desc, "parameters": {
            "type": "object", "properties": {k: {"type": t} for k, t in props.items()},
            "required": list(props)}}
    return [
        spec("get_weather", "Current weather for a city", {"city": "string", "unit": "string"}),
        spec("convert_currency", "Convert an amount between currencies",
             {"amount": "number", "from": "string", "to": "string"}),
        spec("create_event", "Create a calendar event",
             {"title": "string", "date": "string", "attendees": "array"}),
        spec("query_database", "Run a read-only SQL query", {"sql": "string", "limit": "integer"}),
        spec("translate_text", "Translate text", {"text": "string", "target_language": "string"}),
        spec("set_timer", "Start a countdown timer", {"minutes": "integer", "label": "string"}),
    ]


def _call(tool: str, rng: random.Random) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """(user request, arguments, tool result, final answer) for one call of `tool`."""
    if tool == "get_weather":
        city, unit = rng.choice(_CITIES), rng.choice(("celsius", "fahrenheit"))
        temp = rng.randint(-5, 35) if unit == "celsius" else rng.randint(23, 95)
        cond = rng.choice(("sunny", "cloudy", "light rain", "windy", "snow"))
        return (f"What's the weather like in {city} right now? Use {unit}.",
                {"city": city, "unit": unit}, {"temperature": temp, "condition": cond},
                f"It is {temp} degrees {unit} and {cond} in {city}.")
    if tool == "convert_currency":
        amt, a, b = rng.randint(5, 5000), *rng.sample(_CURRENCIES, 2)
        rate = round(rng.uniform(0.01, 150.0), 4)
        return (f"How much is {amt} {a} in {b}?", {"amount": amt, "from": a, "to": b},
                {"rate": rate, "result": round(amt * rate, 2)},
                f"{amt} {a} is about {round(amt * rate, 2)} {b} (rate {rate}).")
    if tool == "create_event":
        who, day = rng.sample(_NAMES, rng.randint(1, 3)), _date(rng)
        title = rng.choice(("Design review", "Budget sync", "Lunch", "Release planning"))
        return (f"Schedule '{title}' on {day} with {', '.join(who)}.",
                {"title": title, "date": day, "attendees": who},
                {"event_id": rng.randint(1000, 99999), "status": "created"},
                f"Done: '{title}' is on the calendar for {day}.")
    if tool == "query_database":
        table, limit = rng.choice(_TABLES), rng.choice((5, 10, 20, 50))
        col = rng.choice(("created_at", "total", "status", "region"))
        return (f"Show me the latest {limit} rows of {table} ordered by {col}.",
                {"sql": f"SELECT * FROM {table} ORDER BY {col} DESC", "limit": limit},
                {"row_count": rng.randint(0, limit), "elapsed_ms": rng.randint(1, 900)},
                f"The query on {table} finished; the rows are listed above.")
    if tool == "translate_text":
        text, lang = rng.choice(_PHRASES), rng.choice(_LANGS)
        return (f"Translate '{text}' into {lang}.", {"text": text, "target_language": lang},
                {"translation": f"<{lang.lower()}:{text}>", "confidence": round(rng.random(), 3)},
                f"Here is the {lang} translation of '{text}'.")
    minutes, label = rng.randint(1, 90), rng.choice(("tea", "pasta", "standup", "laundry"))
    return (f"Set a {minutes} minute timer for {label}.", {"minutes": minutes, "label": label},
            {"timer_id": rng.randint(1, 999), "ends_in_s": minutes * 60},
            f"Your {label} timer is running for {minutes} minutes.")


def tool_conversation(seed: int, split: str, index: int) -> tuple[list[Message], dict]:
    """One deterministic tool-calling conversation (one or two calls)."""
    rng = random.Random(f"tool_json:{seed}:{split}:{index}")
    specs = _tool_specs()
    offered = rng.sample(specs, rng.randint(2, len(specs)))
    tag = split[0]
    system = (f"Session {tag}-{index:06x}. You are an assistant that can call tools. "
              "Available tools (JSON schema):\n" + json.dumps(offered)
              + '\nTo call a tool reply only with {"name": ..., "arguments": {...}, "id": ...}.')
    messages: list[Message] = [{"role": "system", "content": system}]
    for turn in range(rng.randint(1, 2)):
        tool = rng.choice(offered)["name"]
        request, args, result, answer = _call(tool, rng)
        call = {"name": tool, "arguments": args, "id": f"call_{tag}{index:06x}_{turn}"}
        messages += [
            {"role": "user", "content": request},
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "tool", "content": json.dumps({"id": call["id"], "result": result})},
            {"role": "assistant", "content": answer},
        ]
    return messages, {"generator": "tool_json", "seed": seed, "split": split, "index": index}

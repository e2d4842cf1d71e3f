"""Tool calling on the chat route: `tools` + `tool_choice`, through structured output.

  - `tool_choice: {"type": "function", "function": {"name": F}}` (named): the output is F's
    arguments, one JSON value valid under F's `parameters` schema; the reply is one tool call
    and finish_reason "stop" (as OpenAI answers a named choice). Cut short (max_tokens: finish
    "length"; or a stop string) it is still that call, with the arguments written so far, as
    OpenAI and vLLM answer it and as it streams (no call if none of them was written).
  - `"required"`: the output is a JSON array of one or more `{"name": ..., "parameters": ...}`
    objects, each valid under its tool's schema (at most one with `parallel_tool_calls: false`);
    the reply lists them as tool calls, finish_reason "tool_calls".
  - `"none"`: plain text; the tools are still shown to the model through the chat template.
  - `"auto"` (OpenAI's default when tools are given): the model writes text or calls in its
    own syntax, parsed by the server's `--tool-call-parser` (kvcap/server/tool_parsers.py);
    without one the request is refused with a 400 that says so, rather than answered as text
    that silently ignores the tools.
The tools always reach the chat template (`tools=`), so a model trained on tool use sees them.
A "required" or "auto" output cut by max_tokens cannot be parsed: it is returned as content,
finish_reason "length" (a named call's is its truncated arguments: above).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvcap.sampling.json_schema import SchemaError, compile_schema
from kvcap.server.tool_parsers import parse_tool_calls, tool_call_start

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolRequestError(ValueError):
    """A bad tools / tool_choice field; answered as a 400 naming `param`."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "named" | "required"
    tools: list[dict[str, Any]]  # as the chat template takes them (OpenAI's form)
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # what the output must follow
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    # parallel_tool_calls: false -- "auto" keeps only the first call the model wrote (as vLLM
    # does); it was read for "required" only, and agents asking for one call got several
    parallel: bool = True

    @property
    def constrains(self) -> bool:
        return self.mode in ("named", "required")

    @property
    def finish_reason(self) -> str:
        return "stop" if self.mode == "named" else "tool_calls"

    def call_finish(self, finish: str) -> str:
        """The finish_reason of a reply answered as this plan's calls: the plan's own where
        the output ended ("stop"), else the engine's ("length": a named call cut short)."""
        return self.finish_reason if finish == "stop" else finish

    def kept(self, calls: list) -> list:
        """The calls an "auto" reply answers: all, or with `parallel_tool_calls: false` the
        first alone."""
        return calls if self.parallel else calls[:1]

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls an output spells, or None when it does not parse (cut short). A
        named function's output is its call even cut short: [] only when none of the
        arguments was written (whitespace alone)."""
        if self.mode == "named":  # the arguments as the model wrote them (as streamed)
            # not parsed: a named call cut by max_tokens was streamed as a tool call (its
            # partial arguments, ToolStream) but answered whole as content; OpenAI and vLLM
            # answer it as the call, arguments truncated, finish_reason "length"
            args = text.strip()
            pairs = [(self.name, args)] if args else []
        else:
            try:
                value = json.loads(text)
            except ValueError:
                return None
            pairs = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                     for c in value]
        return tool_call_dicts(pairs)


def tool_call_dicts(pairs) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries, a fresh id each, for (name, arguments) pairs."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in pairs]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolPlan | None:
    """Check `tools` and `tool_choice`; None when the request has neither."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolRequestError("tool_choice: needs tools", param="tool_choice")
        return None
    params: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict):
            raise ToolRequestError(f"{where}: must be {{\"type\": \"function\", \"function\": "
                                   f"{{\"name\", \"parameters\", ...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolRequestError(f"{where}.function.name: must be 1-64 letters, digits, _ or "
                                   f"-, got {name!r}", param="tools")
        if name in params:
            raise ToolRequestError(f"{where}.function.name: {name!r} is given twice",
                                   param="tools")
        schema = fn.get("parameters")
        if schema is None:  # left out, or null (clients that write every field; vLLM takes
            schema = EMPTY_PARAMETERS  # it): a function without parameters
        try:
            compile_schema(schema)
        except SchemaError as e:
            raise ToolRequestError(f"{where}.function.parameters: {e}", param="tools") from None
        for key in ("$defs", "definitions"):  # each must be a schema
            if isinstance(schema, dict) and not isinstance(schema.get(key, {}), dict):
                raise ToolRequestError(f"{where}.function.parameters: {key} must be an object "
                                       f"of schemas, got {schema[key]!r}", param="tools")
        params[name] = schema
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice, tools, parameters=params, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools, schema=calls_schema(params, parallel),
                        parameters=params)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    # (a name that is no string was looked up in `params` below: a list or an object a 500)
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            not isinstance(name, str):
        raise ToolRequestError(f"tool_choice: must be 'none', 'auto', 'required' or {{\"type\":"
                               f" \"function\", \"function\": {{\"name\": ...}}}}, got "
                               f"{tool_choice!r}", param="tool_choice")
    if name not in params:
        raise ToolRequestError(f"tool_choice: no tool named {name!r} (tools: {sorted(params)})",
                               param="tool_choice")
    return ToolPlan("named", tools, name=name, schema=params[name], parameters=params)


def calls_schema(params: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of {"name", "parameters"} calls, each under its tool's schema. Each
    tool's schema moves whole (its own $defs inside) under $defs ("tool<i>"), its references
    rebased there, so that references inside one tool still resolve once it is nested in the
    array, and never reach another tool's definitions."""
    defs: dict[str, Any] = {}
    branches = []
    for i, (name, schema) in enumerate(params.items()):
        key = f"tool{i}"
        defs[key] = _renamed(schema, key)
        if isinstance(defs[key], dict):  # its references now resolve against the array's
            defs[key].pop("$id", None)   # root (a moved $id would be refused as their base)
        branches.append({"type": "object", "properties": {
            "name": {"const": name}, "parameters": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "parameters"]})
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": {"anyOf": branches} if len(branches) > 1 else branches[0]}
    if not parallel:
        array["maxItems"] = 1
    return {"$defs": defs, **array}


def _renamed(schema: Any, key: str) -> Any:
    """`schema` with its references ("#" and every "#/<pointer>") rebased to where
    calls_schema puts it, "#/$defs/<key>". (Only "#", "#/$defs/X" and "#/definitions/X" were
    renamed: a pointer such as "#/properties/a", zod-to-json-schema's default, or
    "#/$defs/X/properties/y" then pointed into the array, and "required" refused the tool.)"""
    if isinstance(schema, list):
        return [_renamed(s, key) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str):
            if v == "#" or v.startswith("#/"):
                v = f"#/$defs/{key}{v[1:]}"
            out[k] = v
        else:
            out[k] = _renamed(v, key)
    return out


def parsed_reply(parser: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """tool_choice "auto": (content, tool calls) of a finished reply, by `parser`."""
    end, calls = parse_tool_calls(parser, text)
    if not calls:
        return text, []
    return text[:end].strip() or None, tool_call_dicts(calls)


class ToolStream:
    """One streamed choice's tool calls, as OpenAI streams them. A named function's arguments
    go out as the model writes them (the first delta carries the call's id and name); a
    "required" array is held back and sent whole with the finish (its calls are only known
    once it parses); with "auto", content goes out until a call may have begun
    (`tool_call_start`) and the rest with the finish, as calls if it parses. (The logprobs of
    held-back tokens: kvcap.server.chat_reply.ChoiceStream, its one user.)"""

    def __init__(self, plan: ToolPlan, parser: str | None = None):
        self.plan, self.parser = plan, parser
        self.text, self.call_id, self.sent = "", None, 0

    def event(self, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(delta or None to send nothing yet, finish_reason) of one event."""
        self.text += text
        return self._delta(text, finish)

    def _delta(self, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        if self.plan.mode == "named":
            # The arguments' edge whitespace is held back (the trailing part until more
            # follows): the non-streamed call strips it (`calls`), and the openai SDK's stream
            # helper partially parses a strict tool's arguments after every delta -- a
            # whitespace-only snapshot raised "EOF while parsing a value" there.
            args = self.text.lstrip()
            cut = len(args.rstrip())
            text, self.sent = args[self.sent:cut], max(self.sent, cut)
            reason = None if finish is None else self.plan.call_finish(finish)
            if not text:  # (the finishing event's own text goes out with it)
                return ({} if finish is not None else None), reason
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self.call_id is None:
                self.call_id = new_call_id()
                call.update(id=self.call_id, type="function")
                call["function"] = {"name": self.plan.name, "arguments": text}
            return {"tool_calls": [call]}, reason
        if self.plan.mode == "auto" and finish is None:
            cut = max(self.sent, tool_call_start(self.parser, self.text))
            out, self.sent = self.text[self.sent:cut], cut
            return ({"content": out} if out else None), None
        if finish is None:
            return None, None
        if self.plan.mode == "auto":
            end, calls = parse_tool_calls(self.parser, self.text) if finish == "stop" \
                else (len(self.text), [])
            found = tool_call_dicts(self.plan.kept(calls))
            reason = "tool_calls" if found else finish
        else:
            found = self.plan.calls(self.text) if finish == "stop" else None
            end = 0 if found else len(self.text)
            reason = self.plan.finish_reason if found else finish
        delta: dict[str, Any] = {}
        if self.text[self.sent:end]:
            delta["content"] = self.text[self.sent:end]
        if found:
            delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(found)]
        return delta, reason

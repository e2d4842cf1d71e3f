"""The structured-output fields of a request -> SamplingParams' json_object / json_schema /
choice, each bad value a 400 naming its field.

Accepted spellings:
  - OpenAI: `response_format: {"type": "json_object"}` and
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`
    (the schema is enforced whether or not `strict` is set);
  - vLLM: `guided_json` (a schema, or its JSON text), `guided_choice` (a list of strings),
    `guided_regex` (text the expression matches whole), and the newer
    `structured_outputs: {"json": ... | "choice": [...] | "regex": ... | "json_object": true}`.
A request gives at most one. Grammar guidance (`guided_grammar`) is refused
(`unsupported_parameter`).
"""

from __future__ import annotations

import json
from typing import Any

from kvcap.sampling.json_schema import (
    SchemaError,
    choice_grammar,
    compile_schema,
    regex_grammar,
)

SUPPORTED_STRUCTURED_KEYS = ("json", "choice", "regex", "json_object")
FORMAT_KEYS = ("json", "choice", "regex")  # values, not switches


class StructuredRequestError(ValueError):
    """A bad structured-output field; the protocol answers it as a 400 naming `param`."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def structured_request(req: Any) -> dict[str, Any]:
    """{"field": the request field, and one SamplingParams keyword}, or {} when none asked."""
    asked: list[dict[str, Any]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append({"field": "response_format", "json_object": True})
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise StructuredRequestError(
                    "response_format: type json_schema needs json_schema.schema (the JSON "
                    "Schema of the output)", param="response_format")
            asked.append({"field": "response_format", "json_schema": spec["schema"]})
        elif kind != "text":
            raise StructuredRequestError(
                f"response_format: type must be text, json_object or json_schema, got "
                f"{kind!r}", param="response_format")
    if req.guided_json is not None:
        asked.append({"field": "guided_json", "json_schema": req.guided_json})
    if req.guided_choice is not None:
        asked.append({"field": "guided_choice", "choice": req.guided_choice})
    if req.guided_regex is not None:
        asked.append({"field": "guided_regex", "regex": req.guided_regex})
    if req.structured_outputs:
        # false is a switch's neutral value, but no "none" for a format: {"json": false} (the
        # schema nothing meets) was dropped as unset and the output ran unconstrained
        so = {k: v for k, v in req.structured_outputs.items()
              if v is not None and (k in FORMAT_KEYS or v not in (None, False))}
        other = sorted(set(so) - set(SUPPORTED_STRUCTURED_KEYS))
        if other:
            raise StructuredRequestError(
                f"structured_outputs: {other} not supported by kvcap (supported: "
                f"{list(SUPPORTED_STRUCTURED_KEYS)})", param="structured_outputs",
                code="unsupported_parameter")
        for key, value in so.items():
            name = {"json": "json_schema", "choice": "choice", "regex": "regex"}.get(
                key, "json_object")
            asked.append({"field": "structured_outputs", name: value})
    tools = req.tool_structured()
    if tools is not None:
        asked.append(tools)
    if len(asked) > 1:
        fields = sorted({a["field"] for a in asked})
        raise StructuredRequestError(f"{' and '.join(fields)}: give one structured output "
                                     f"format, not {len(asked)}", param=asked[0]["field"])
    if not asked:
        return {}
    out = asked[0]
    try:
        if "json_schema" in out:
            compile_schema(out["json_schema"])
            if isinstance(out["json_schema"], str):  # guided_json may be the schema's text
                out["json_schema"] = json.loads(out["json_schema"])
        elif "choice" in out:
            choice_grammar(out["choice"])
        elif "regex" in out:
            regex_grammar(out["regex"])
        elif out.get("json_object") is not True:  # "yes" is no switch
            raise SchemaError(f"json_object must be true or false, got {out['json_object']!r}")
    except SchemaError as e:
        raise StructuredRequestError(f"{out['field']}: {e}", param=out["field"]) from None
    return out

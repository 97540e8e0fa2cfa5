"""What a request may constrain its output to: `response_format`, parsed and checked. No torch, no
grammar library: plain Python, so a bad format is refused where the row is read.

Accepted forms (a dict, or its JSON text):
  {"type": "json_schema", "json_schema": {...schema...}}   also {"json_schema": {"name": ..., "schema": {...}}}
                                                           and the schema given as JSON text
  {"type": "json_object"}                                  any JSON object
  {"type": "regex", "regex": "[A-Z]{3}-\\d+"}              the whole output matches (Rust regex syntax)
  {"type": "choice", "choice": ["yes", "no"]}              exactly one of the strings
  {"type": "grammar", "grammar": "start: ..."}             a Lark grammar in llguidance's syntax
                                                           (GBNF is converted)
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class FormatError(ValueError):
    """A response_format that cannot be used; the message says what was expected."""


@dataclass(frozen=True)
class ResponseFormat:
    """One constraint. `spec` is its text (the schema as compact JSON in the order given, which is the
    output's key order; the pattern; the choices as a JSON list; the grammar): (kind, spec) is the
    compile cache's key."""
    kind: str
    spec: str

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def schema(self) -> dict | None:
        """The JSON schema a json kind's output must validate against."""
        if self.kind == "json_schema":
            return json.loads(self.spec)
        return {"type": "object"} if self.kind == "json_object" else None

    def to_json(self) -> str:
        body = json.loads(self.spec) if self.kind in ("json_schema", "choice") else self.spec
        return json.dumps({"type": self.kind, **({} if self.kind == "json_object" else {self.kind: body})})


def parse_response_format(value) -> ResponseFormat | None:
    """A ResponseFormat from a dict or JSON text; None for None / "" / {"type": "text"}. Raises
    FormatError saying what is wrong."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, ResponseFormat):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FormatError(f"not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(value, dict):
        raise FormatError(f"expected an object with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind not in KINDS:
        raise FormatError(f"type: expected one of {', '.join(KINDS)}, got {kind!r}")
    return ResponseFormat(kind, _spec(kind, value))


def _spec(kind: str, value: dict) -> str:
    if kind == "json_object":
        return ""
    if kind not in value:
        raise FormatError(f"type {kind} needs a '{kind}' member")
    body = value[kind]
    if kind == "json_schema":
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except json.JSONDecodeError as e:
                raise FormatError(f"json_schema: not valid JSON ({e.msg} at char {e.pos})") from None
        if isinstance(body, dict) and isinstance(body.get("schema"), dict) and "type" not in body:
            body = body["schema"]                       # the {"name": ..., "schema": {...}} wrapping
        if not isinstance(body, dict):
            raise FormatError(f"json_schema: expected a JSON Schema object, got {type(body).__name__}")
        return json.dumps(body)                         # property order is the output's order: kept
    if kind == "choice":
        if (not isinstance(body, list) or not body
                or not all(isinstance(c, str) and c for c in body)):
            raise FormatError("choice: expected a non-empty list of non-empty strings")
        return json.dumps(body)
    if not isinstance(body, str) or not body:
        raise FormatError(f"{kind}: expected a non-empty string")
    return body

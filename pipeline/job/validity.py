"""Structured rows out: whether a constrained completion is what its response_format promised, and
the parsed record. The engine says whether the grammar ended the output (EOS, or a stop string where
it accepts); for JSON kinds the job also parses the text and validates it against the schema with
jsonschema, independently of the grammar library.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import jsonschema

from ..engine.core.response_format import parse_response_format

if TYPE_CHECKING:
    from ..engine import Completion


def check_record(text: str | None, response_format: str) -> tuple[bool, str | None]:
    """(valid, the parsed record as compact JSON) for an output the grammar ended; JSON kinds must
    parse and validate against their schema; other kinds are valid as the grammar ended them."""
    fmt = parse_response_format(response_format)
    if not fmt.is_json:
        return True, None
    try:
        record = json.loads(text or "")
        jsonschema.validate(record, fmt.schema())
    except (json.JSONDecodeError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False, None
    return True, json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def structured_columns(c: Completion) -> dict:
    """The completions table's response_format, valid, record and forced_tokens of one completion."""
    if c.response_format is None:
        return {"response_format": None, "valid": None, "record": None, "forced_tokens": c.num_forced}
    valid, record = check_record(c.text, c.response_format) if c.valid else (False, None)
    return {"response_format": c.response_format, "valid": valid, "record": record, "forced_tokens": c.num_forced}

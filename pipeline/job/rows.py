"""One input row -> one engine request, or a RowError with a reason code naming the field.

The input contract: a prompt string column or a messages column (list of {role, content}), an
optional id column (else a stable id from file + row index), optional per-row sampling overrides, an optional per-row response_format.
Knows the tokenizer (for the chat template) but not the engine, files or Ray.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..engine import RequestError, SamplingParams
from ..io.reader import InputConfig
from .runtime import prompt_ids

# per-row overrides of the sampling defaults and the type each must have
ROW_OVERRIDES = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
                 "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float,
                 "stop": list}


class RowError(ValueError):
    def __init__(self, reason: str, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.reason, self.field, self.message = reason, field, message


@dataclass
class RowRequest:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int


def default_id(rel: str, index: int) -> str:
    return f"{rel}:{index}"


def row_id(row: dict, index: int, rel: str, inp: InputConfig) -> str:
    """The row's id; raises RowError(missing_id) when the id column exists but the value is null."""
    if inp.id_column not in row:
        return default_id(rel, index)
    value = row[inp.id_column]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowError("missing_id", inp.id_column, f"expected a non-empty id, got {value!r}")
    return str(value)


def passthrough(row, inp: InputConfig) -> dict:
    """The configured pass-through columns of a raw input row, as strings (JSON for non-strings,
    null when missing), for every output row of that input row."""
    get = row.get if isinstance(row, dict) else (lambda name: None)
    return {name: _as_text(get(name)) for name in inp.passthrough_columns}


def _as_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def messages_of(value, field: str) -> list[dict]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise RowError("bad_messages", field, f"expected a non-empty list of {{role: str, content: str}}, "
                                              f"got {str(value)[:120]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def sampling_overrides(row: dict) -> dict:
    out = {}
    for key, kind in ROW_OVERRIDES.items():
        value = row.get(key)
        if value is None:
            continue
        if kind is list:
            value = [value] if isinstance(value, str) else value
            if not (isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)):
                raise RowError("bad_sampling", key, f"expected a string or a list of non-empty strings, got {value!r}")
            value = tuple(value)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise RowError("bad_sampling", key, f"expected {kind.__name__}, got {value!r}")
        out[key] = kind(value) if kind is not list else value
    return out


def row_request(row: dict, index: int, rel: str, inp: InputConfig, sampling: SamplingParams,
                run_seed: int, tokenizer) -> RowRequest:
    """Validate and tokenize one row. Raises RowError(reason, field, message)."""
    if "__error__" in row:
        raise RowError("bad_json", None, row["__error__"])
    rid = row_id(row, index, rel, inp)
    messages = row.get(inp.messages_column)
    if messages is not None:
        messages, prompt = messages_of(messages, inp.messages_column), None
    else:
        prompt = row.get(inp.prompt_column)
        if prompt is not None and not isinstance(prompt, str):
            raise RowError("bad_prompt_type", inp.prompt_column,
                           f"expected a string, got {type(prompt).__name__}")
        if prompt is None or not prompt.strip():
            raise RowError("empty_prompt", inp.prompt_column, f"expected a non-empty string, got {prompt!r}")
    overrides = sampling_overrides(row)
    fmt = row.get(inp.response_format_column)
    if fmt is not None:
        overrides["response_format"] = fmt
    try:
        params = replace(sampling, **overrides)
    except RequestError as e:
        where = inp.response_format_column if e.field == "response_format" and fmt is not None else e.field
        raise RowError(e.code, where, str(e).split(": ", 1)[-1]) from None
    seed = row.get("seed", None)
    if seed is None:
        seed = run_seed
    elif isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise RowError("bad_sampling", "seed", f"expected an integer >= 0, got {seed!r}")
    try:
        ids = prompt_ids(tokenizer, prompt, messages)
    except Exception as e:  # noqa: BLE001 -- a template failure is this row's problem only
        raise RowError("bad_prompt", inp.messages_column if messages else inp.prompt_column,
                       f"chat template failed: {e}") from None
    return RowRequest(rid, ids, params, int(seed))

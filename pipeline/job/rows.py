"""One input row -> one engine request, or a RowError with a reason code naming the field.

The row contract, for the job and the processor alike: a prompt string column or a messages column
(list of {role, content}), an id column (else an id the caller derives, or a digest of the row's
content), per-row sampling overrides, an optional per-row response_format. A RowColumns mapping says
where each of these lives in a row: the job's comes from InputConfig (job_columns), overrides as
top-level columns; the processor's is Ray Data LLM's shape, overrides in a `sampling_params` dict.
The checks, reason codes and messages are the same for both; only the field names differ.
Knows the tokenizer (for the chat template) but not the engine's internals, files or Ray.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

from ..engine import RequestError, SamplingParams
from ..io.reader import InputConfig

# per-row overrides of the sampling defaults and the type each must have
ROW_OVERRIDES = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
                 "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float,
                 "stop": list}
SAMPLING_KEYS = (*ROW_OVERRIDES, "stop_token_ids", "ignore_eos", "seed")   # every key a row may set
READER_ERROR = "__error__"       # the column reader.iter_rows fills for a line that is not a JSON object


class RowError(ValueError):
    def __init__(self, reason: str, field: str | None, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.reason, self.field, self.message = reason, field, message

    @classmethod
    def of(cls, e: RequestError, field: str | None = None) -> RowError:
        """The engine's refusal as a RowError: its code and message, `field` or the engine's own."""
        return cls(e.code, field or e.field, str(e).split(": ", 1)[-1])


@dataclass(frozen=True)
class RowColumns:
    """Where a row's fields live: the one thing the job's and the processor's rows differ in."""
    prompt_column: str = "prompt"                    # a plain string prompt (chat template applied)
    messages_column: str = "messages"                # or a chat: list of {role, content}
    id_column: str | None = "id"                     # None: a digest of the row's content names the row
    response_format_column: str = "response_format"  # a JSON object or its text
    sampling_column: str | None = None               # None: overrides are top-level columns; else a dict
                                                     # column (or its JSON text), keys named `<column>.<key>`
    sampling_keys: tuple[str, ...] = (*ROW_OVERRIDES, "seed")   # the override keys a row may set there
    error_column: str | None = None                  # its presence makes the row bad_json (its value is
                                                     # the message): the job's reader sets it

    def __post_init__(self):
        unknown = sorted(set(self.sampling_keys) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"sampling_keys: unknown {unknown}; expected some of {list(SAMPLING_KEYS)}")

    def field(self, key: str) -> str:
        """The name a sampling key has in errors."""
        return f"{self.sampling_column}.{key}" if self.sampling_column else key


def job_columns(inp: InputConfig) -> RowColumns:
    """The job's rows: InputConfig's column names, overrides and `seed` as top-level columns."""
    return RowColumns(prompt_column=inp.prompt_column, messages_column=inp.messages_column,
                      id_column=inp.id_column, response_format_column=inp.response_format_column,
                      error_column=READER_ERROR)


@dataclass
class RowRequest:
    id: str                  # the row's id, the caller's fallback or a content digest: names its sampling stream
    prompt_ids: list[int]
    params: SamplingParams
    seed: int


def row_request(row: dict, columns: RowColumns, defaults: SamplingParams, seed: int, tokenizer,
                fallback_id: str | None = None) -> RowRequest:
    """Validate and tokenize one row. `fallback_id` names a row that has no id column (None: that is
    missing_id). Raises RowError(reason, field, message)."""
    if columns.error_column is not None and columns.error_column in row:
        raise RowError("bad_json", None, row[columns.error_column])
    rid = _row_id(row, columns, fallback_id)
    prompt, messages = _prompt(row, columns)
    given = _sampling_given(row, columns)
    fmt = row.get(columns.response_format_column)
    params = _params(defaults, given, fmt, columns)
    row_seed = seed if given.get("seed") is None else _checked("seed", given["seed"], columns.field("seed"))
    if rid is None:
        rid = content_key(prompt, messages, given, fmt)
    try:
        ids = prompt_ids(tokenizer, prompt, messages)
    except Exception as e:  # noqa: BLE001 -- a template failure is this row's problem only
        raise RowError("bad_prompt", columns.messages_column if messages else columns.prompt_column,
                       f"chat template failed: {e}") from None
    return RowRequest(rid, ids, params, int(row_seed))


def content_key(prompt: str | None, messages: list[dict] | None, given: dict, fmt) -> str:
    """A stable name for a row without an id: a digest of its prompt, sampling keys and format."""
    text = json.dumps([prompt, messages, given, fmt], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def default_id(rel: str, index: int) -> str:
    return f"{rel}:{index}"


def _row_id(row: dict, columns: RowColumns, fallback_id: str | None) -> str | None:
    """The row's id; `fallback_id` when the row lacks the id column; None when the mapping has none."""
    name = columns.id_column
    if name is None:
        return None
    if name not in row and fallback_id is not None:
        return fallback_id
    value = row.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RowError("missing_id", name, f"expected a non-empty id, got {value!r}")
    return str(value)


def _prompt(row: dict, columns: RowColumns) -> tuple[str | None, list[dict] | None]:
    """(prompt, None) or (None, messages): the messages column wins when both are set."""
    messages = row.get(columns.messages_column)
    if messages is not None:
        return None, messages_of(messages, columns.messages_column)
    name, prompt = columns.prompt_column, row.get(columns.prompt_column)
    if prompt is not None and not isinstance(prompt, str):
        raise RowError("bad_prompt_type", name, f"expected a string, got {type(prompt).__name__}")
    if prompt is None or not prompt.strip():
        raise RowError("empty_prompt", name, f"expected a non-empty string, got {prompt!r}")
    return prompt, None


def messages_of(value, field: str) -> list[dict]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise RowError("bad_messages", field, f"expected a non-empty list of {{role: str, content: str}}, "
                                              f"got {str(value)[:120]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _sampling_given(row: dict, columns: RowColumns) -> dict:
    """The sampling keys a row sets, as given (nulls dropped: Arrow structs fill absent keys with null)."""
    if columns.sampling_column is None:
        return {k: row[k] for k in columns.sampling_keys if row.get(k) is not None}
    name, value = columns.sampling_column, row.get(columns.sampling_column)
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError("bad_sampling", name, f"expected a dict or its JSON, got {value[:80]!r}: {e}") from None
    if not isinstance(value, dict):
        raise RowError("bad_sampling", name, f"expected a dict, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(given) - set(columns.sampling_keys))
    if unknown:
        raise RowError("bad_sampling", columns.field(unknown[0]),
                       f"unknown key; expected some of {list(columns.sampling_keys)}")
    return given


def _params(defaults: SamplingParams, given: dict, fmt, columns: RowColumns) -> SamplingParams:
    """The defaults with the row's overrides and response_format; the engine's checks name the row's field."""
    overrides = {k: _checked(k, given[k], columns.field(k)) for k in columns.sampling_keys
                 if k in given and k != "seed"}
    if fmt is not None:
        overrides["response_format"] = fmt
    try:
        return replace(defaults, **overrides)
    except RequestError as e:
        field = columns.response_format_column if e.field == "response_format" else columns.field(e.field)
        raise RowError.of(e, field) from None


def _checked(key: str, value, field: str):
    """One sampling key's value in the type SamplingParams takes; RowError(bad_sampling) when it has
    the wrong type (ranges are the engine's to check)."""
    if key == "stop":
        value = [value] if isinstance(value, str) else value
        if not (isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)):
            raise _bad_sampling(field, "a string or a list of non-empty strings", value)
        return tuple(value)
    if key == "stop_token_ids":
        if not (isinstance(value, (list, tuple))
                and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise _bad_sampling(field, "a list of token ids", value)
        return tuple(value)
    if key == "ignore_eos":
        if not isinstance(value, bool):
            raise _bad_sampling(field, "true or false", value)
        return value
    if key == "seed":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _bad_sampling(field, "an integer >= 0", value)
        return value
    kind = ROW_OVERRIDES[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and isinstance(value, float) and not value.is_integer()):
        raise _bad_sampling(field, kind.__name__, value)
    return kind(value)


def _bad_sampling(field: str, expected: str, value) -> RowError:
    return RowError("bad_sampling", field, f"expected {expected}, got {value!r}")


def passthrough(row, inp: InputConfig) -> dict:
    """The configured pass-through columns of a raw input row, as strings (JSON for non-strings,
    null when missing), for every output row of that input row."""
    get = row.get if isinstance(row, dict) else (lambda name: None)
    return {name: _as_text(get(name)) for name in inp.passthrough_columns}


def _as_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def prompt_ids(tokenizer, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Token ids of a chat prompt: the tokenizer's chat template (with the generation prompt) when it
    has one, else the plain encoding."""
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer.encode("\n".join(m["content"] for m in messages))

"""The processor's row contract (Ray Data LLM's): what a row brings and the columns it gets.

In: `prompt` (a string) or `messages` (a list of {role, content}: the tokenizer's chat template is
applied), optional `sampling_params` (a dict of SamplingParams keys: max_tokens, temperature, top_p,
top_k, min_p, the penalties, stop, stop_token_ids, ignore_eos, seed; an unknown key is an error, not
ignored) and optional `response_format` (a dict or its JSON text, as in the job).
Out: every input column, then OUTPUT's columns. A bad row gets `error` ("reason: field: message",
the job's reason codes) and nulls elsewhere; a row that ran gets `error` null.

Knows the tokenizer (for the chat template) and the engine's records; knows nothing about Ray.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace

import pyarrow as pa

from ..cluster.records import acceptance
from ..engine import Completion, RequestError, SamplingParams
from ..job.rows import ROW_OVERRIDES, RowError, messages_of, sampling_overrides
from ..job.runtime import prompt_ids
from ..job.validity import structured_columns

OUTPUT = pa.schema([
    ("generated_text", pa.string()),
    ("generated_tokens", pa.list_(pa.int32())),
    ("num_generated_tokens", pa.int32()),
    ("num_input_tokens", pa.int32()),
    ("finish_reason", pa.string()),            # stop | eos | length | context
    ("rounds", pa.int32()),                    # speculative rounds (target forwards) of this row
    ("draft_tokens", pa.int32()),              # proposed
    ("accepted_tokens", pa.int32()),           # proposed and kept
    ("acceptance_rate", pa.float64()),         # accepted / draft; null when nothing was drafted
    ("mean_accepted_length", pa.float64()),    # committed tokens per round
    ("forced_tokens", pa.int32()),             # committed tokens the row's grammar forced
    ("valid", pa.bool_()),                     # constrained rows: what the response_format promised
    ("record", pa.string()),                   # JSON kinds: the parsed record (compact JSON) when valid
    ("error", pa.string()),                    # null when the row ran
])
SAMPLING_KEYS = (*ROW_OVERRIDES, "stop_token_ids", "ignore_eos", "seed")


@dataclass
class RowInput:
    key: str                 # the row's id (id_column) or a digest of its content: names its sampling stream
    prompt_ids: list[int]
    params: SamplingParams
    seed: int


def row_input(row: dict, defaults: SamplingParams, tokenizer, id_column: str | None, seed: int) -> RowInput:
    """Validate and tokenize one row. Raises RowError(reason, field, message)."""
    messages, prompt = row.get("messages"), None
    if messages is not None:
        messages = messages_of(messages, "messages")
    else:
        prompt = row.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise RowError("bad_prompt_type", "prompt", f"expected a string, got {type(prompt).__name__}")
        if prompt is None or not prompt.strip():
            raise RowError("empty_prompt", "prompt", f"expected a non-empty string, got {prompt!r}")
    sampling = _sampling_params(row.get("sampling_params"))
    try:
        overrides = sampling_overrides({k: v for k, v in sampling.items() if k in ROW_OVERRIDES})
    except RowError as e:
        raise RowError(e.reason, f"sampling_params.{e.field}", e.message) from None
    for key, kind in (("stop_token_ids", list), ("ignore_eos", bool)):
        if key in sampling:
            value = sampling[key]
            ok = (isinstance(value, bool) if kind is bool else
                  isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
            if not ok:
                raise RowError("bad_sampling", f"sampling_params.{key}",
                               f"expected {'true or false' if kind is bool else 'a list of token ids'}, got {value!r}")
            overrides[key] = tuple(value) if kind is list else value
    fmt = row.get("response_format")
    if fmt is not None:
        overrides["response_format"] = fmt
    try:
        params = replace(defaults, **overrides)
    except RequestError as e:
        field = "response_format" if e.field == "response_format" else f"sampling_params.{e.field}"
        raise RowError(e.code, field, str(e).split(": ", 1)[-1]) from None
    row_seed = sampling.get("seed", seed)
    if isinstance(row_seed, bool) or not isinstance(row_seed, int) or row_seed < 0:
        raise RowError("bad_sampling", "sampling_params.seed", f"expected an integer >= 0, got {row_seed!r}")
    if id_column is not None:
        if row.get(id_column) is None:
            raise RowError("missing_id", id_column, "expected a non-null id")
        key = str(row[id_column])
    else:
        key = hashlib.sha256(json.dumps([prompt, messages, sampling, fmt], sort_keys=True, default=str)
                             .encode()).hexdigest()[:24]
    try:
        ids = prompt_ids(tokenizer, prompt, messages)
    except Exception as e:  # noqa: BLE001 -- a template failure is this row's problem only
        raise RowError("bad_prompt", "messages" if messages else "prompt", f"chat template failed: {e}") from None
    return RowInput(key, ids, params, row_seed)


def _sampling_params(value) -> dict:
    """A row's sampling_params as a dict of the keys it sets (Arrow structs fill absent keys with null)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowError("bad_sampling", "sampling_params", f"expected a dict or its JSON, got {value[:80]!r}: {e}")
    if not isinstance(value, dict):
        raise RowError("bad_sampling", "sampling_params", f"expected a dict, got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(given) - set(SAMPLING_KEYS))
    if unknown:
        raise RowError("bad_sampling", f"sampling_params.{unknown[0]}",
                       f"unknown key; expected some of {list(SAMPLING_KEYS)}")
    return given


def output_row(c: Completion) -> dict:
    n = len(c.output_ids)
    structured = structured_columns(c)
    return {"generated_text": c.text, "generated_tokens": list(c.output_ids), "num_generated_tokens": n,
            "num_input_tokens": c.prompt_len, "finish_reason": c.finish_reason, "rounds": c.num_rounds,
            "draft_tokens": c.num_draft_tokens, "accepted_tokens": c.num_accepted, **acceptance(c),
            "forced_tokens": structured["forced_tokens"], "valid": structured["valid"],
            "record": structured["record"], "error": None}


def row_error(e: RowError | RequestError) -> RowError:
    """The engine's refusal of a row as the RowError it is (reason, field, message)."""
    return e if isinstance(e, RowError) else RowError(e.code, e.field, str(e).split(": ", 1)[-1])


def error_row(e: RowError) -> dict:
    return {**{name: None for name in OUTPUT.names}, "error": f"{e.reason}: {e}"}


def with_output(batch: pa.Table, rows: list[dict]) -> pa.Table:
    """The batch with OUTPUT's columns from `rows` (one per batch row) set, replacing same-named ones."""
    for f in OUTPUT:
        column = pa.array([r[f.name] for r in rows], type=f.type)
        i = batch.schema.get_field_index(f.name)
        batch = batch.set_column(i, f, column) if i >= 0 else batch.append_column(f, column)
    return batch

"""The processor's row contract (Ray Data LLM's): what a row brings and the columns it gets.

In: `prompt` (a string) or `messages` (a list of {role, content}: the tokenizer's chat template is
applied), optional `sampling_params` (a dict of SamplingParams keys: max_tokens, temperature, top_p,
top_k, min_p, the penalties, stop, stop_token_ids, ignore_eos, seed; an unknown key is an error, not
ignored) and optional `response_format` (a dict or its JSON text, as in the job). PROCESSOR_COLUMNS
says so to the job's validator (job/rows.py), which checks a row as it checks a job's row.
Out: every input column, then OUTPUT's columns. A bad row gets `error` ("reason: field: message",
the job's reason codes) and nulls elsewhere; a row that ran gets `error` null.

Knows the row shape and the engine's records; validating a row is job/rows.py's; knows nothing about Ray.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import pyarrow as pa

from ..cluster.records import acceptance
from ..engine.core.request import RequestError
from ..job.rows import SAMPLING_KEYS, RowColumns, RowError
from ..job.validity import structured_columns

if TYPE_CHECKING:
    from ..engine import Completion

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
# Ray Data LLM's row shape; without an id column, a digest of the row's content names its sampling stream
PROCESSOR_COLUMNS = RowColumns(prompt_column="prompt", messages_column="messages", id_column=None,
                               response_format_column="response_format", sampling_column="sampling_params",
                               sampling_keys=SAMPLING_KEYS)


def processor_columns(id_column: str | None) -> RowColumns:
    """PROCESSOR_COLUMNS with the configured id column (None: the content digest)."""
    return replace(PROCESSOR_COLUMNS, id_column=id_column)


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
    return e if isinstance(e, RowError) else RowError.of(e)


def error_row(e: RowError) -> dict:
    return {**{name: None for name in OUTPUT.names}, "error": f"{e.reason}: {e}"}


def with_output(batch: pa.Table, rows: list[dict]) -> pa.Table:
    """The batch with OUTPUT's columns from `rows` (one per batch row) set, replacing same-named ones."""
    for f in OUTPUT:
        column = pa.array([r[f.name] for r in rows], type=f.type)
        i = batch.schema.get_field_index(f.name)
        batch = batch.set_column(i, f, column) if i >= 0 else batch.append_column(f, column)
    return batch

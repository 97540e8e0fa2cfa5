"""Arrow schemas of the three outputs. Every unit writes all three files, empty ones included, with
these exact schemas (plus the run's `input.passthrough_columns`, the same for every unit), so any
subset of units concatenates and loads with pandas, pyarrow or `datasets.load_dataset("parquet", ...)`
without schema conflicts."""
from __future__ import annotations

import pyarrow as pa

COMPLETIONS = pa.schema([
    ("id", pa.string()),
    ("text", pa.string()),
    ("token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),            # stop | eos | length | context
    ("prompt_tokens", pa.int32()),
    ("completion_tokens", pa.int32()),
    ("rounds", pa.int32()),                    # speculative rounds (target forwards) of this row
    ("draft_tokens", pa.int32()),              # proposed
    ("accepted_tokens", pa.int32()),           # proposed and kept
    ("acceptance_rate", pa.float64()),         # accepted / draft; null when nothing was drafted
    ("mean_accepted_length", pa.float64()),    # committed tokens per round (accepted + recovered/bonus)
    ("seed", pa.int64()),
    ("target_model", pa.string()),
    ("draft_model", pa.string()),
    ("model_dtype", pa.string()),             # the dtype the worker ran the models in (auto resolved)
    ("drafter", pa.string()),
    ("config_hash", pa.string()),
    ("run_id", pa.string()),
    ("unit", pa.string()),
    ("source_file", pa.string()),
    ("source_row", pa.int64()),
    ("worker", pa.string()),
    ("latency_s", pa.float64()),               # queued in the engine -> finished
    ("response_format", pa.string()),          # the row's constraint as JSON; null for free text
    ("valid", pa.bool_()),                     # constrained rows: ended by the grammar and (JSON kinds)
                                               # parses and validates; null for free text
    ("record", pa.string()),                   # JSON kinds: the parsed record (compact JSON) when valid
    ("forced_tokens", pa.int32()),             # committed tokens the grammar forced (drafted for free)
])

ROUNDS = pa.schema([
    ("id", pa.string()),
    ("round", pa.int32()),
    ("draft_len", pa.int32()),                 # draft tokens verified (a token tree: its size)
    ("accepted", pa.int32()),                  # of them accepted (a tree: the depth of the accepted path)
    ("emitted", pa.int32()),
    ("accepted_mask", pa.list_(pa.bool_())),   # per draft position (a tree: on the accepted path)
    ("first_rejected", pa.int32()),            # index (a tree: depth) of the rejected draft; null if none
    ("batch_size", pa.int32()),
    ("draft_s", pa.float64()),                 # the step's draft phase
    ("verify_s", pa.float64()),                # the step's verify phase
    ("step", pa.int64()),
    ("forced", pa.int32()),                    # of draft_len: forced by the row's grammar, not drafted
    ("forced_accepted", pa.int32()),           # of accepted: forced ones
    ("paths", pa.int32()),                     # root-to-leaf paths of the draft: 1 a single path, more a tree
    ("worker", pa.string()),
    ("unit", pa.string()),
])

ERRORS = pa.schema([
    ("id", pa.string()),
    ("reason", pa.string()),                   # empty_prompt | bad_prompt_type | bad_messages |
                                               # prompt_too_long | bad_sampling | duplicate_id | missing_id |
                                               # bad_response_format
    ("field", pa.string()),
    ("message", pa.string()),
    ("source_file", pa.string()),
    ("source_row", pa.int64()),
    ("unit", pa.string()),
    ("run_id", pa.string()),
    ("config_hash", pa.string()),
])

TABLES = {"completions": COMPLETIONS, "rounds": ROUNDS, "errors": ERRORS}


def table_schema(kind: str, passthrough: list[str] | tuple = ()) -> pa.Schema:
    """The fixed schema of `kind`, then the configured pass-through input columns (strings, in
    config order: every unit of a run has the same schema)."""
    schema = TABLES[kind]
    for name in passthrough:
        schema = schema.append(pa.field(name, pa.string()))
    return schema


def to_table(kind: str, rows: list[dict], passthrough: list[str] | tuple = ()) -> pa.Table:
    """Rows (dicts with exactly the schema's keys) -> a table with the fixed schema."""
    return pa.Table.from_pylist(rows, schema=table_schema(kind, passthrough))

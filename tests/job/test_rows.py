"""One row contract for the job and the processor (pipeline/job/rows.py): the same fault in a job row
and in a processor row gives the same reason and message, each naming its own field; each side's id
and seed come from where its mapping says. Real tokenizer (the tiny model's), no engine."""
from __future__ import annotations

import hashlib
import json

import pytest

from pipeline.engine import SamplingParams
from pipeline.io.reader import InputConfig
from pipeline.job.rows import RowError, job_columns, row_request
from pipeline.processor.rows import processor_columns

DEFAULTS = SamplingParams(max_tokens=16)
JOB = job_columns(InputConfig(prompt_column="question", messages_column="chat",
                              response_format_column="schema"))
PROCESSOR = processor_columns("id")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def refusal(row: dict, columns, tokenizer) -> tuple[str, str | None, str]:
    with pytest.raises(RowError) as e:
        row_request(row, columns, DEFAULTS, 0, tokenizer)
    return e.value.reason, e.value.field, e.value.message


# (job row, processor row, job field, processor field): one fault each, in each side's shape
SAME_FAULTS = [
    ({"id": None, "question": "x"}, {"id": None, "prompt": "x"}, "id", "id"),
    ({"id": "a", "question": "  "}, {"id": "a", "prompt": "  "}, "question", "prompt"),
    ({"id": "a", "question": 5}, {"id": "a", "prompt": 5}, "question", "prompt"),
    ({"id": "a", "chat": [{"role": "user"}]}, {"id": "a", "messages": [{"role": "user"}]}, "chat", "messages"),
    ({"id": "a", "question": "x", "temperature": "hot"}, {"id": "a", "prompt": "x",
     "sampling_params": {"temperature": "hot"}}, "temperature", "sampling_params.temperature"),
    ({"id": "a", "question": "x", "top_p": 2.0}, {"id": "a", "prompt": "x", "sampling_params": {"top_p": 2.0}},
     "top_p", "sampling_params.top_p"),
    ({"id": "a", "question": "x", "seed": -1}, {"id": "a", "prompt": "x", "sampling_params": {"seed": -1}},
     "seed", "sampling_params.seed"),
    ({"id": "a", "question": "x", "schema": {"type": "regex"}}, {"id": "a", "prompt": "x",
     "response_format": {"type": "regex"}}, "schema", "response_format"),
]


@pytest.mark.parametrize("job_row, processor_row, job_field, processor_field", SAME_FAULTS)
def test_a_fault_reads_the_same_in_a_job_row_and_a_processor_row(tokenizer, job_row, processor_row,
                                                                 job_field, processor_field):
    job_reason, got_job_field, job_message = refusal(job_row, JOB, tokenizer)
    processor_reason, got_processor_field, processor_message = refusal(processor_row, PROCESSOR, tokenizer)
    assert (job_reason, job_message) == (processor_reason, processor_message)
    assert (got_job_field, got_processor_field) == (job_field, processor_field)


def test_each_side_names_and_seeds_its_rows_where_its_mapping_says(tokenizer):
    job = row_request({"question": "Hi", "seed": 7}, JOB, DEFAULTS, 0, tokenizer, fallback_id="in.jsonl:3")
    assert (job.id, job.seed) == ("in.jsonl:3", 7)                  # no id column: file + row index
    sampling = {"temperature": 0.5, "seed": 7}
    processor = row_request({"prompt": "Hi", "sampling_params": json.dumps(sampling)}, processor_columns(None),
                            DEFAULTS, 0, tokenizer)
    digest = hashlib.sha256(json.dumps(["Hi", None, sampling, None], sort_keys=True).encode()).hexdigest()[:24]
    assert (processor.id, processor.seed, processor.params.temperature) == (digest, 7, 0.5)
    assert job.prompt_ids == processor.prompt_ids
    assert refusal({"__error__": "invalid JSON"}, JOB, tokenizer) == ("bad_json", None, "invalid JSON")
    assert refusal({"id": "a", "prompt": "x", "sampling_params": {"n": 2}}, PROCESSOR, tokenizer)[:2] == \
        ("bad_sampling", "sampling_params.n")                      # a dict column refuses unknown keys

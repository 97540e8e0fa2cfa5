"""Synthetic stages: configs refused at load naming the key, a later stage's rows from an earlier stage's
kept rows with their lineage, validators on planted rows, near-duplicates on a planted set (recall and
precision at the stated threshold), judges' gates, and on Ray: a three-stage slot (task -> answer ->
judge) killed after its first stage and resumed, redoing only the missing stages; its card read by
`datasets`, its export, and a preview that writes nothing.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobs.synthetic_data import main
from pipeline.engine.core.request import SamplingParams
from pipeline.errors import ConfigError
from pipeline.synthetic.__main__ import main as synthetic_main
from pipeline.synthetic.config import (NearDuplicateConfig, StageConfig, SyntheticSection, TemplateConfig,
                                       load_synthetic_config)
from pipeline.synthetic.near_dup import NearDuplicates
from pipeline.synthetic.quality import judgment, validate
from pipeline.synthetic.stages import expand, expand_stage

REPO = Path(__file__).resolve().parents[2]
SLOT = "2026-11-30T00"
JUDGE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["score", "reason"],
                "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 9},
                               "reason": {"type": "string", "maxLength": 12}}}
JUDGE_FORMAT = {"type": "json_schema", "json_schema": JUDGE_SCHEMA}


def stages_config(**extra) -> list[dict]:
    """task -> answer -> judge. The tiny random model rarely ends a text by itself: stop strings at common
    letters end most rows early (kept, not truncated)."""
    stop = ["e", "a", "o", "i"]
    return [{"id": "task", "templates": [{"id": "new", "text": "Write a task like: {text}", "stop": stop,
                                          "max_tokens": 12}]},
            {"id": "answer", "templates": [{"id": "solve", "samples": 1, "text": "Task: {task.text}", "stop": stop,
                                            "max_tokens": 12}]},
            {"id": "quality", "kind": "judge", "min_score": 5, "templates": [
                {"id": "rubric", "temperature": 0.0, "max_tokens": 40, "response_format": JUDGE_FORMAT,
                 "text": "Task: {task.text}\nAnswer: {answer.text}\nScore the answer 1-9 as JSON."}]}, *extra.get("more", [])]


def section(stages: list[dict]) -> SyntheticSection:
    return load_synthetic_config(None, ["sampling.temperature=0.8", f"synthetic.stages={json.dumps(stages)}"]).synthetic


# ---- configs refused at load -----------------------------------------------------------------------
@pytest.mark.parametrize("change, says", [
    (lambda s: s[1].update(input="quality"), "synthetic.stages.1.input: 'quality' is not an earlier stage"),
    (lambda s: s[0].update(input="task"), "synthetic.stages.0.input: 'task' is not an earlier stage"),
    (lambda s: s[2]["templates"][0].pop("response_format"), "synthetic.stages.2.templates.0.response_format: a judge "
                                                           "needs a JSON schema with a `score`"),
    (lambda s: s[2]["templates"][0].update(response_format={"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"grade": {"type": "integer"}}, "required": ["grade"]}}),
     "the schema's required property `score` must be a number/integer or a string enum"),
    (lambda s: s[1]["templates"][0].update(text="{answer.text}"), "synthetic.stages.1.templates.0.text: "
                                                                  "{answer.text}: 'answer' is not a stage"),
    (lambda s: s[1]["templates"][0].update(text="{task.body}"), "{task.body}: unknown field 'body'"),
    (lambda s: s[1]["templates"][0].update(text="{task.record}"), "{task.record}: stage 'task' has templates without "
                                                                 "a response_format"),
    (lambda s: s[2].update(accept=["good"]), "synthetic.stages.2.accept: expected choices of the score's enum"),
    (lambda s: s[1].update(id="seed"), "synthetic.stages.1.id: expected a name of letters"),
    (lambda s: s[1].update(id="task"), "synthetic.stages.1.id: stage ids must be unique"),
    (lambda s: s[1].update(min_score=3), "synthetic.stages.1.min_score/accept: only a judge stage"),
    (lambda s: s[0]["templates"][0].update(validate="yaml"), "synthetic.stages.0.templates.0.validate: expected "
                                                             "python (every fenced code block parses)"),
    (lambda s: s[0]["templates"][0].update(validate={"regex": "("}), "synthetic.stages.0.templates.0.validate.regex"),
    (lambda s: s.insert(0, s.pop(2)), "synthetic.stages.0.kind: a judge scores an earlier stage's rows"),
])
def test_bad_stage_configs_are_refused_naming_the_key(change, says):
    stages = stages_config()
    change(stages)
    with pytest.raises(ConfigError, match=re.escape(says)):
        section(stages)


def test_an_unknown_seed_field_is_refused_before_any_work(tmp_path, capsys):
    stages = stages_config()
    stages[1]["templates"][0]["text"] = "{task.text} in the style of {author}"
    out = tmp_path / "out"
    assert main(["--config", "configs/synthetic.yaml", "--slot", SLOT, f"output.path={out}", "synthetic.templates=[]",
                 f"synthetic.stages={json.dumps(stages)}"]) == 2
    err = capsys.readouterr().err
    assert "config error: synthetic.stages.1.templates.0.text: {author} is not a column of the seed set" in err
    assert "or an earlier stage's field like {task.text}" in err and not out.exists()


def test_the_shipped_config_has_stages_and_a_judge():
    cfg = load_synthetic_config("configs/synthetic.yaml")
    kinds = [(s.id, s.kind) for s in cfg.synthetic.stage_list()]
    assert ("judge" in [k for _, k in kinds]) and len(kinds) >= 3, kinds


# ---- a later stage's rows ---------------------------------------------------------------------------
def test_a_later_stage_reads_exactly_the_kept_rows_with_their_lineage():
    sec = section(stages_config())
    seeds = [{"seed_id": "a", "text": "add two numbers"}, {"seed_id": "b", "text": "sort a list"}]
    first = expand(seeds, sec, SamplingParams(temperature=0.8), SLOT, 0)
    assert [r["id"] for r in first] == ["a/new/0", "a/new/1", "b/new/0", "b/new/1"]
    tasks = [{**r, "text": f"task {r['id']}", "is_kept": r["id"] != "a/new/1"} for r in first]
    kept = [r for r in tasks if r["is_kept"]]
    by_id = {s["seed_id"]: s for s in seeds}
    answers = expand_stage(1, sec, SamplingParams(temperature=0.8), SLOT, 0, by_id, kept, {"task": {r["id"]: r for r in tasks}})
    assert [r["id"] for r in answers] == ["a/new/0/solve/0", "b/new/0/solve/0", "b/new/1/solve/0"]
    assert [(r["parent_id"], r["task_id"], r["seed_id"]) for r in answers] == [
        ("a/new/0", "a/new/0", "a"), ("b/new/0", "b/new/0", "b"), ("b/new/1", "b/new/1", "b")]
    assert answers[0]["prompt"] == "Task: task a/new/0"
    graded = [{**r, "text": f"answer {r['id']}", "is_kept": True} for r in answers]
    judged = expand_stage(2, sec, SamplingParams(), SLOT, 0, by_id, graded,
                          {"task": {r["id"]: r for r in tasks}, "answer": {r["id"]: r for r in graded}})
    assert [(r["parent_id"], r["task_id"], r["answer_id"]) for r in judged][0] == (
        "a/new/0/solve/0", "a/new/0", "a/new/0/solve/0")
    assert judged[0]["prompt"].startswith("Task: task a/new/0\nAnswer: answer a/new/0/solve/0\n")
    assert len({r["seed"] for r in first + answers + judged}) == 10            # every row its own stream


# ---- validators, judges, near-duplicates (pure) ------------------------------------------------------
@pytest.mark.parametrize("spec, text, reason", [
    ("python", "Here:\n```python\ndef f(x):\n    return x + 1\n```\nand\n```\nprint(1)\n```", None),
    ("python", "```python\ndef f(x)\n    return x\n```", "code block 1 does not parse: line 1"),
    ("python", "```python\nok = 1\n```\n```py\nnot ok(\n```", "code block 2 does not parse"),
    ("python", "def f(): pass", "no complete fenced code block"),
    ("python", "```python\ndef f(): pass\n", "no complete fenced code block"),
    ("json", '{"a": [1, 2]}', None),
    ("json", '{"a": [1, 2}', "not JSON"),
    ({"regex": r"^\d+\.\s"}, "1. first", None),
    ({"regex": r"^\d+\.\s"}, "first", "does not match the regex"),
])
def test_validators_on_planted_rows(spec, text, reason):
    got = validate(text, TemplateConfig(id="t", text="x", validate=spec))
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got


def test_judgments_gate_by_min_score_or_choice():
    stage = StageConfig(id="q", kind="judge", min_score=5, templates=[
        TemplateConfig(id="r", text="x", response_format=JUDGE_FORMAT)])
    assert judgment(stage, '{"score":7,"reason":"fine"}') == (7.0, "fine", False)
    assert judgment(stage, '{"score":4,"reason":"weak"}') == (4.0, "weak", True)
    assert judgment(stage, None) == (None, None, True)                     # no valid record: rejected
    choice = StageConfig(id="c", kind="judge", accept=["good"], templates=[TemplateConfig(id="r", text="x", response_format={
        "type": "json_schema", "json_schema": {"type": "object", "required": ["score"],
                                               "properties": {"score": {"enum": ["good", "bad"]}}}})])
    assert judgment(choice, '{"score":"good"}') == ("good", None, False)
    assert judgment(choice, '{"score":"bad"}') == ("bad", None, True)


def planted(n: int, rng: random.Random, vocabulary: list[str]) -> tuple[list[str], list[str]]:
    """n originals of 60 words and, for each, a paraphrase with 2 of its words replaced."""
    originals = [" ".join(rng.choice(vocabulary) for _ in range(60)) for _ in range(n)]
    copies = []
    for text in originals:
        words = text.split()
        for i in rng.sample(range(60), 2):
            words[i] = rng.choice(vocabulary)
        copies.append(" ".join(words))
    return originals, copies


def test_near_duplicates_recall_and_precision_on_a_planted_set():
    """200 originals over a 2,000-word vocabulary and a paraphrase of each with 2 words of 60 changed
    (true Jaccard of 3-word shingles 0.81-0.90, checked below), at threshold 0.7: recall >= 0.95 (each
    paraphrase found as its original's) and no unrelated pair flagged (their Jaccard is ~0). Fixed seeds:
    the outcome is deterministic."""
    rng = random.Random(7)
    vocabulary = [f"w{i}" for i in range(2000)]
    originals, copies = planted(200, rng, vocabulary)
    from pipeline.synthetic.near_dup import shingles
    jaccard = [len(set(shingles(a, 3)) & set(shingles(b, 3))) / len(set(shingles(a, 3)) | set(shingles(b, 3)))
               for a, b in zip(originals, copies)]
    assert 0.8 <= min(jaccard) and max(jaccard) <= 0.91, (min(jaccard), max(jaccard))
    near = NearDuplicates(NearDuplicateConfig(threshold=0.7))
    rows = [{"id": f"o{i}", "text": t} for i, t in enumerate(originals)] + \
           [{"id": f"c{i}", "text": t} for i, t in enumerate(copies)]
    sigs = near.signatures([r["text"] for r in rows])
    found = near.check([{"id": r["id"], "signature": s} for r, s in zip(rows, sigs)])
    recall = sum(found[f"c{i}"] == (None, f"o{i}") for i in range(200)) / 200
    false = [i for i, v in found.items() if v is not None and not (i.startswith("c") and v[1] == "o" + i[1:])]
    assert recall >= 0.95 and not false, (recall, false[:5])
    # across slots: the signatures persisted with a slot find the same copies without the texts
    later = NearDuplicates(NearDuplicateConfig(threshold=0.7))
    assert later.load("2026-11-30T00", near.table())
    again = later.check([{"id": "x", "signature": later.signatures([copies[3]])[0]}])
    assert again["x"] == ("2026-11-30T00", "o3")
    assert not NearDuplicates(NearDuplicateConfig(num_perm=64)).load("2026-11-30T00", near.table())


def test_a_stage_that_kept_nothing_keeps_its_features_and_the_card_loads(tmp_path, capfd):
    """A slot whose judge rejected every answer: each config's features come from its curated schema
    whatever it kept, `dataset_info` is in the form `datasets` reads without a warning, and the default
    config is the last stage that kept rows, so `load_dataset(slot)` loads. `datasets` loads no config
    without rows (its own "corresponds to no data"): the card names that config instead."""
    import datasets
    from types import SimpleNamespace
    from pipeline.io.storage import StorageConfig
    from pipeline.synthetic.card import card
    from pipeline.synthetic.plan import SlotFolder
    from pipeline.synthetic.quality import _write_tables, judge_fields
    from pipeline.synthetic.stage_run import card_stages

    slot, storage = tmp_path / f"slot={SLOT}", StorageConfig()
    answers = pa.table({"id": ["a0", "a1", "a2"], "text": ["x", "y", "z"], "is_kept": [True, True, False]})
    judge = section(stages_config()).stage_list()[2]
    judged = pa.Table.from_pylist(
        [{"id": i, "text": t, "judge_score_quality": 1.0, "judge_reason_quality": "no",
          "is_rejected_quality": True, "is_kept": False} for i, t in (("a0", "x"), ("a1", "y"))],
        schema=pa.schema([answers.schema.field("id"), answers.schema.field("text"), *judge_fields(judge),
                          answers.schema.field("is_kept")]))
    stages, schemas = [], {}
    for stage_id, table in (("answer", answers), ("quality", judged)):
        _write_tables(SlotFolder(str(slot / f"stage={stage_id}"), storage), "u0", table, "zstd")
        stages.append(SimpleNamespace(stage=SimpleNamespace(id=stage_id), rel=f"stage={stage_id}"))
        schemas[stage_id] = pq.read_schema(slot / f"stage={stage_id}" / "curated" / "u0.parquet")
    assert not (slot / "stage=quality" / "kept").exists()
    summaries = [{"kept": 2}, {"kept": 0}]
    prov = {"models": {"target": {"source": "m"}}, "code": {"version": "0"}, "config_hash": "h",
            "stages": [{"id": s, "kind": "k", "rows": 2, "kept": k["kept"], "flagged": {}}
                       for s, k in zip(("answer", "quality"), summaries)]}
    text = card(SLOT, card_stages(SlotFolder(str(slot), storage), stages, summaries, schemas), prov)
    (slot / "README.md").write_text(text)
    header = yaml.safe_load(text.split("---")[1])
    info = {c["config_name"]: c for c in header["dataset_info"]}
    assert [f["name"] for f in info["quality"]["features"]] == judged.column_names
    assert info["quality"]["splits"] == [{"name": "train", "num_bytes": 0, "num_examples": 0}]
    assert info["answer"]["splits"][0]["num_examples"] == 2 and info["answer"]["splits"][0]["num_bytes"] > 0
    assert [c["config_name"] for c in header["configs"] if c.get("default")] == ["answer"]
    assert "Kept no rows, so `datasets` cannot load them (their features are in the header): quality." in text
    capfd.readouterr()
    for name in (None, "answer"):
        rows = datasets.load_dataset(str(slot), name)["train"]
        assert sorted(rows["id"]) == ["a0", "a1"] and rows.column_names == answers.column_names
    with pytest.raises(ValueError, match="corresponds to no data"):
        datasets.load_dataset(str(slot), "quality")
    said = capfd.readouterr()
    assert "malformed" not in said.out + said.err


# ---- on Ray: three stages, killed after the first, resumed ---------------------------------------
def write_config(tmp_path: Path, model_dir, ray_head) -> Path:
    seeds = [{"seed_id": f"s{i}", "kind": "q", "text": t} for i, t in enumerate(
        ["Name three colors.", "Describe a river in autumn.", "Add two numbers.", "Sort a list of words."])]
    pq.write_table(pa.Table.from_pylist(seeds), tmp_path / "seeds.parquet")
    cfg = {"models": {"target": str(model_dir), "dtype": "float32"},
           "drafting": {"method": "ngram", "num_speculative_tokens": 3},
           "engine": {"max_num_seqs": 8, "max_model_len": 256},
           "sampling": {"max_tokens": 8, "temperature": 0.9},
           "input": {"rows_per_unit": 4}, "output": {"path": str(tmp_path / "out")},
           "cluster": {"address": ray_head.address, "num_workers": 1, "num_cpus_per_worker": 1},
           "run": {"progress": False},
           "synthetic": {"seeds": str(tmp_path / "seeds.parquet"), "samples_per_seed": 2, "stages": stages_config()}}
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rows_of(folder: Path, kind: str = "curated") -> list[dict]:
    return [r for f in sorted(folder.glob(f"{kind}/*.parquet")) for r in pq.read_table(f).to_pylist()]


def files_state(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_three_stages_killed_after_the_first_resume_only_the_rest(tiny_model_dir, ray_head, tmp_path, capsys):
    config = write_config(tmp_path, tiny_model_dir, ray_head)
    slot = tmp_path / "out" / f"slot={SLOT}"
    proc = subprocess.Popen([sys.executable, "jobs/synthetic_data.py", "--config", str(config), "--slot", SLOT,
                             "--show", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (slot / "stage=task" / "_SUCCESS").exists() and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert not (slot / "_SUCCESS").exists() and not (slot / "stage=quality" / "_SUCCESS").exists()
    task_before = files_state(slot / "stage=task")

    assert main(["--config", str(config), "--slot", SLOT, "--show", "0"]) == 0
    said = capsys.readouterr().out
    assert "stage task: already committed by run synthetic-2026-11-30T00-task" in said
    assert files_state(slot / "stage=task") == task_before                 # the committed stage untouched
    assert f"slot {SLOT} committed by run synthetic-{SLOT}" in said

    tasks, answers, judged = (rows_of(slot / f"stage={s}") for s in ("task", "answer", "quality"))
    assert sorted(r["id"] for r in tasks) == [f"s{i}/new/{k}" for i in range(4) for k in (0, 1)]
    kept_tasks = {r["id"] for r in tasks if r["is_kept"]}
    assert kept_tasks and {r["parent_id"] for r in answers} == kept_tasks       # exactly the kept rows, once each
    assert len(answers) == len(kept_tasks) and all(r["task_id"] == r["parent_id"] for r in answers)
    for stage in ("task", "answer", "quality"):                                  # every stage's rows once
        done = [r["id"] for f in (slot / f"stage={stage}").glob("synthetic-*/completions/*.parquet")
                for r in pq.read_table(f).to_pylist()]
        assert len(done) == len(set(done)), stage
    by_task = {r["id"]: r for r in tasks}
    kept_answers = {r["id"]: r for r in answers if r["is_kept"]}
    assert sorted(r["id"] for r in judged) == sorted(kept_answers)              # a judge's rows: those it judged
    for r in judged:
        assert r["text"] == kept_answers[r["id"]]["text"] and r["task_id"] in by_task
        score = r["judge_score_quality"]
        assert r["is_rejected_quality"] == (score is None or score < 5) and r["is_kept"] == (not r["is_rejected_quality"])
        assert score is None or 1 <= score <= 9
    judge_rows = [r for f in (slot / "stage=quality").glob("synthetic-*/completions/*.parquet")
                  for r in pq.read_table(f).to_pylist()]
    assert judge_rows and all(r["forced_tokens"] > 0 for r in judge_rows)       # the schema's keys forced

    summary = json.loads((slot / "summary.json").read_text())
    assert [s["id"] for s in summary["stages"]] == ["task", "answer", "quality"]
    assert summary["stages"][1]["rows"] == len(kept_tasks) and summary["kept"] == sum(r["is_kept"] for r in judged)
    import datasets
    header = yaml.safe_load((slot / "README.md").read_text().split("---")[1])
    default = next(c for c in header["configs"] if c.get("default"))
    assert default["config_name"] == "quality" and [c["config_name"] for c in header["configs"]] == [
        "task", "answer", "quality"]
    if summary["kept"]:
        rows = datasets.load_dataset("parquet", data_files=str(slot / default["data_files"][0]["path"]))["train"]
        assert sorted(rows["id"]) == sorted(r["id"] for r in judged if r["is_kept"])
        assert "judge_score_quality" in rows.column_names
    prov = json.loads((slot / "provenance.json").read_text())
    assert [s["id"] for s in prov["stages"]] == ["task", "answer", "quality"] and prov["stages"][0]["tokens"] > 0

    # export: the kept rows of the answer stage, every committed slot, as a datasets folder
    dest = tmp_path / "export"
    assert synthetic_main(["export", str(tmp_path / "out"), str(dest), "--stage", "answer"]) == 0
    assert sorted(datasets.load_from_disk(str(dest))["id"]) == sorted(kept_answers)
    assert synthetic_main(["export", str(tmp_path / "out"), str(tmp_path / "e2"), "--stage", "nope"]) == 1
    assert "--stage 'nope': " in capsys.readouterr().err


def test_a_push_without_the_hub_fails_naming_the_repo(tmp_path, monkeypatch, capsys):
    """The export is written; the push to an unreachable hub (a closed loopback port) fails with the repo
    named and the command to push later."""
    slot = tmp_path / "out" / f"slot={SLOT}"
    (slot / "kept").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a"], "text": ["x"]}), slot / "kept" / "u.parquet")
    (slot / "summary.json").write_text(json.dumps({"stages": [{"id": ""}]}))
    (slot / "_SUCCESS").write_text("")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token")
    assert synthetic_main(["export", str(tmp_path / "out"), str(tmp_path / "dest"), "--push-to-hub", "me/data"]) == 1
    err = capsys.readouterr().err
    assert "export error: --push-to-hub me/data: the push failed (" in err and "is written" in err
    assert (tmp_path / "dest" / "dataset_info.json").exists()


def test_preview_generates_every_stage_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    seeds = [{"seed_id": "s0", "kind": "q", "text": "Name three colors."}]
    pq.write_table(pa.Table.from_pylist(seeds), tmp_path / "seeds.parquet")
    out = tmp_path / "out"
    args = ["--config", "configs/synthetic.yaml", "--slot", SLOT, "--preview", "1", f"output.path={out}",
            f"models.target={tiny_model_dir}", "models.dtype=float32", "engine.max_num_seqs=4",
            "engine.max_model_len=256", "sampling.max_tokens=8", f"synthetic.seeds={tmp_path / 'seeds.parquet'}",
            "synthetic.templates=[]", f"synthetic.stages={json.dumps(stages_config())}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    said = buf.getvalue()
    lines = said.splitlines()
    assert lines[0].split() == ["stage", "template", "prompt", "output", "flags", "score"]
    rows = [re.split(r"\s{2,}", l) for l in lines[2:] if l and not l.startswith("preview")]
    assert rows[0][:2] == ["task", "new"] and rows[0][2].startswith("Write a task like: Name three colors.")
    if rows[0][4] == "kept":                                     # a kept task feeds the answer, then the judge
        assert [r[:2] for r in rows[1:3]] == [["answer", "solve"], ["quality", "rubric"]]
    assert f"preview of slot {SLOT}:" in said and "nothing written" in said and not out.exists()


def test_near_duplicates_check_against_the_runs_earlier_committed_slots_only(tmp_path):
    """A stage's index holds the signatures of the same stage in the run's earlier committed slots: not
    of a later slot, an uncommitted one, or one made with other settings."""
    from pipeline.io.storage import StorageConfig
    from pipeline.synthetic.plan import plan_slot
    from pipeline.synthetic.stage_run import StageRunner
    cfg = load_synthetic_config("configs/synthetic.yaml", [f"output.path={tmp_path}"])
    index = NearDuplicates(cfg.synthetic.near_duplicates)
    text = "one two three four five six seven eight nine ten eleven twelve"
    index.check([{"id": "r", "signature": index.signatures([text])[0]}])
    other = NearDuplicates(NearDuplicateConfig(num_perm=64))
    other.check([{"id": "r", "signature": other.signatures([text])[0]}])
    for slot, committed, table in [("2026-11-29T00", True, index.table()), ("2026-11-29T01", False, index.table()),
                                   ("2026-11-29T02", True, other.table()), ("2026-11-30T01", True, index.table())]:
        folder = tmp_path / f"slot={slot}" / "stage=task"
        folder.mkdir(parents=True)
        pq.write_table(table, folder / "near_duplicates.parquet")
        if committed:
            (folder.parent / "_SUCCESS").write_text("")
    said = []
    runner = StageRunner(plan_slot(cfg, SLOT), StorageConfig(), None, said.append)
    near = runner._near_duplicates(runner.plan.stages[0])
    assert sorted(near.where.values()) == [("2026-11-29T00", "r")]
    assert said == ["near-duplicates: checked against 1 earlier slots (1 made with other near_duplicates settings "
                    "skipped)"]
    assert near.check([{"id": "x", "signature": near.signatures([text])[0]}])["x"] == ("2026-11-29T00", "r")

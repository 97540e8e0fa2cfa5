"""The scheduled synthetic-data job (jobs/synthetic_data.py): slots from --slot or a cron string,
deterministic expansion, failures before any work, one committed result per slot (a repeat changes
nothing; two runs started at once -> one generates, on a local disk and on moto's S3 server), the
slot in every row, and the quality columns.

The Ray tests run on the tiny random-init model (real SmolLM2 tokenizer) and the `ray start --head`
test cluster, over a crafted seed set: two seeds with the same text and a greedy 1-2 token template
(duplicates, cut by max_tokens), a template whose stop strings are every printable ASCII character
(empty texts), a sampled template, and a prompt longer than the context (an error row).
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobs.synthetic_data import main
from pipeline.errors import ConfigError
from pipeline.job.config import config_hash, hashed_tree, load_config
from pipeline.io.reader import InputError, plan_units
from pipeline.synthetic.quality import quality_flags, row_check
from pipeline.job.rows import passthrough
from pipeline.synthetic.schedule import ScheduleError, current_slot, parse_cron, parse_slot, zone
from pipeline.synthetic.config import ScheduleConfig, load_synthetic_config
from pipeline.synthetic.plan import load_seeds, plan_slot, resolve_slot
from pipeline.synthetic.stages import expand
from s3_util import BUCKET, KEY, REGION, SECRET, moto_endpoint, s3  # noqa: F401 -- fixtures

REPO = Path(__file__).resolve().parents[2]
SLOT = "2026-11-30T00"
UTC = timezone.utc
ASCII = [chr(c) for c in range(32, 127)]


# ---- schedules and slots (pure) --------------------------------------------------------------------
@pytest.mark.parametrize("cron, tz, now, slot", [
    ("0 * * * *", "UTC", datetime(2026, 11, 30, 10, 25, tzinfo=UTC), "2026-11-30T10"),   # the hour just started
    ("0 * * * *", "UTC", datetime(2026, 11, 30, 10, 0, tzinfo=UTC), "2026-11-30T10"),    # a fire time: its own slot
    ("@hourly", "Asia/Kolkata", datetime(2026, 11, 30, 10, 25, tzinfo=UTC), "2026-11-30T15"),  # +05:30, :00 local
    ("0 0 * * *", "UTC", datetime(2026, 11, 30, 23, 59, tzinfo=UTC), "2026-11-30T00"),
    ("0 0 * * *", "America/Los_Angeles", datetime(2026, 12, 1, 7, 59, tzinfo=UTC), "2026-11-30T00"),
    ("*/15 * * * *", "UTC", datetime(2026, 11, 30, 10, 29, tzinfo=UTC), "2026-11-30T10-15"),
    ("30 9 * * mon-fri", "Europe/Berlin", datetime(2026, 11, 29, 12, tzinfo=UTC), "2026-11-27T09"),  # Sun -> Fri
    ("0 0 29 2 *", "UTC", datetime(2026, 11, 30, tzinfo=UTC), "2024-02-29T00"),
    ("0 12 1,15 * 0", "UTC", datetime(2026, 11, 30, 13, tzinfo=UTC), "2026-11-29T12"),  # day fields OR-ed: Sunday
    # daylight saving, America/New_York 2026: clocks skip 02:00-03:00 on Mar 8, repeat 01:00-02:00 on Nov 1
    ("0 * * * *", "America/New_York", datetime(2026, 3, 8, 7, 10, tzinfo=UTC), "2026-03-08T03"),   # no T02 that day
    ("30 2 * * *", "America/New_York", datetime(2026, 3, 8, 7, 29, tzinfo=UTC), "2026-03-07T02"),
    ("30 2 * * *", "America/New_York", datetime(2026, 3, 8, 7, 30, tzinfo=UTC), "2026-03-08T02"),  # skipped: 03:30
    ("0 * * * *", "America/New_York", datetime(2026, 11, 1, 6, 30, tzinfo=UTC), "2026-11-01T01"),  # repeated hour
])
def test_slot_from_schedule(cron, tz, now, slot):
    assert current_slot(parse_cron(cron), zone(tz), now) == slot


def test_resolve_slot_at_a_fixed_time():
    berlin_daily = ScheduleConfig(cron="0 6 * * *", timezone="Europe/Berlin")
    assert resolve_slot(berlin_daily, None, datetime(2026, 11, 30, 4, 59, tzinfo=UTC)) == "2026-11-29T06"
    assert resolve_slot(berlin_daily, None, datetime(2026, 11, 30, 5, 0, tzinfo=UTC)) == "2026-11-30T06"
    assert resolve_slot(berlin_daily, "2026-11-01T06") == "2026-11-01T06"              # a given slot wins
    with pytest.raises(ScheduleError, match="not a fire time"):
        resolve_slot(berlin_daily, "2026-11-01T07")
    with pytest.raises(ScheduleError, match="no slot: give --slot"):
        resolve_slot(ScheduleConfig(cron=None), None)


def test_quoted_cron_overrides():
    for cron in ("@daily", "*/15 * * * *"):
        assert load_synthetic_config("configs/synthetic.yaml", [f"schedule.cron='{cron}'"]).schedule.cron == cron


def test_given_slot_is_checked_against_the_schedule():
    hourly, daily = parse_cron("0 * * * *"), parse_cron("0 0 * * *")
    assert parse_slot(SLOT, hourly) == parse_slot(SLOT, daily) == datetime(2026, 11, 30)
    assert parse_slot("2026-11-30T00-15", parse_cron("*/15 * * * *")) == datetime(2026, 11, 30, 0, 15)
    for slot, cron, says in [("2026-11-30", hourly, "expected YYYY-MM-DDTHH (e.g. 2026-11-30T00)"),
                             ("2026-11-30T00:00", hourly, "expected YYYY-MM-DDTHH"),
                             ("2026-02-30T00", hourly, "day is out of range"),
                             ("2026-11-30T05", daily, "not a fire time of schedule '0 0 * * *'"),
                             ("2026-11-30T00", parse_cron("*/15 * * * *"), "expected YYYY-MM-DDTHH-MM")]:
        with pytest.raises(ScheduleError, match=re.escape(says)):
            parse_slot(slot, cron)


@pytest.mark.parametrize("cron, says", [
    ("0 * * *", "4 fields"), ("60 * * * *", "minute field '60': 60 is outside 0-59"),
    ("0 0 31 2 *", "never fires"), ("0 0 * * funday", "day-of-week field"), ("@sometimes", "1 fields"),
    ("*/0 * * * *", "0 is outside"), ("5-1 * * * *", "runs backwards")])
def test_bad_cron_says_the_expected_format(cron, says):
    with pytest.raises(ScheduleError, match=says) as err:
        parse_cron(cron)
    assert "expected 5 fields 'minute hour day-of-month month day-of-week'" in str(err.value)


@pytest.mark.parametrize("args, says", [
    (["--slot", "2026-11-30"], "slot/schedule error: slot '2026-11-30': expected YYYY-MM-DDTHH"),
    (["--slot", "2026-11-30T00", "schedule.cron=0 25 * * *"], "config error: schedule.cron: hour field '25'"),
    (["schedule.cron=null"], "no slot: give --slot YYYY-MM-DDTHH"),
    (["schedule.timezone=Mars/Olympus"], "schedule.timezone: unknown time zone"),
    (["schedule.cron=@daily"], "config error: override 'schedule.cron=@daily' is not valid YAML"),              # unquoted @
    (["--slot", SLOT, "synthetic.id_column=nope"], "seed set error: synthetic.seeds 'data/synthetic/seeds.parquet': "
                                                    "no 'nope' column"),
    (["--slot", SLOT, "synthetic.templates.0.text=x"], "config error: Cannot merge"),
])
def test_invalid_slot_or_schedule_exits_2_before_any_work(args, says, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--config", "configs/synthetic.yaml", f"output.path={out}", *args]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


# ---- expansion -------------------------------------------------------------------------------------
def test_default_seed_set_and_deterministic_expansion():
    seeds_file = REPO / "data" / "synthetic" / "seeds.parquet"
    assert seeds_file.stat().st_size < 200_000
    cfg = load_synthetic_config("configs/synthetic.yaml")
    seeds = load_seeds(cfg.synthetic, cfg.storage)
    assert 300 <= len(seeds) <= 500 and {s["kind"] for s in seeds} == {"instruction", "code", "passage"}
    a, b = plan_slot(cfg, SLOT), plan_slot(cfg, SLOT)
    assert a.rows == b.rows and a.input_url == b.input_url                   # same slot: same rows, same file
    ids = [r["id"] for r in a.rows]
    assert len(set(ids)) == len(ids) and {r["slot"] for r in a.rows} == {SLOT}
    assert all(r["temperature"] > 0 for r in a.rows)                         # sampled by default
    assert a.job.run.run_id == f"synthetic-{SLOT}-task" and a.job.output.path.endswith(f"/slot={SLOT}/stage=task")
    assert a.input_url.startswith(f"{a.job.output.path}/_input/rows-")
    # every seed, two slots: the same ids (seed/template/sample), other per-row seeds
    full = load_synthetic_config("configs/synthetic.yaml", ["synthetic.seeds_per_slot=null"])
    one, other = (expand(seeds, full.synthetic, full.sampling, s, 0) for s in (SLOT, "2026-11-30T01"))
    assert [r["id"] for r in one] == [r["id"] for r in other]
    assert all(x["seed"] != y["seed"] for x, y in zip(one, other))
    assert one[0]["id"] == "mtbench-81/new-task/0" and one[1]["id"] == "mtbench-81/new-task/1"
    # seeds_per_slot: a fixed sample per slot, and different slots sample differently
    picked = {s: {r["seed_id"] for r in plan_slot(cfg, s).rows} for s in (SLOT, "2026-11-30T01")}
    assert len(picked[SLOT]) == 32 and picked[SLOT] != picked["2026-11-30T01"]


def test_passthrough_columns_config(tmp_path):
    with pytest.raises(ConfigError, match="input.passthrough_columns"):
        load_config(None, ["input.passthrough_columns=[text]"])
    pq.write_table(pa.Table.from_pylist([{"id": "a", "prompt": "hi", "slot": SLOT}]), tmp_path / "a.parquet")
    for columns, ok in (("[slot]", True), ("[slot,topic]", False)):
        cfg = load_config(None, [f"input.path={tmp_path}", f"input.passthrough_columns={columns}"])
        if ok:
            assert len(plan_units(cfg.input, cfg.storage)) == 1
        else:
            with pytest.raises(InputError, match=r"input.passthrough_columns \['topic'\] not found"):
                plan_units(cfg.input, cfg.storage)
    inp = load_config(None, ["input.passthrough_columns=[slot,n,m,x]"]).input
    assert passthrough({"slot": SLOT, "n": 3, "m": [1]}, inp) == {"slot": SLOT, "n": "3", "m": "[1]", "x": None}
    plain = load_config("configs/demo.yaml")
    assert "passthrough_columns" not in hashed_tree(plain)["input"]          # hashes of existing runs unchanged
    assert config_hash(plain) != config_hash(load_config("configs/demo.yaml", ["input.passthrough_columns=[x]"]))


def test_quality_flags():
    def row(i, text, reason="eos", valid=None):
        return row_check({"id": i, "source_row": int(i[1:]), "finish_reason": reason, "text": text, "valid": valid}, None)
    flags = quality_flags([row("r3", "same"), row("r1", "same"), row("r2", " \n"), row("r4", "", "length"),
                           row("r5", "cut", "length"), row("r6", "x", "context"), row("r7", "  \n", "stop")])
    assert flags["r1"] == {"is_empty": False, "is_truncated": False, "is_duplicate": False, "duplicate_of": None,
                           "is_near_duplicate": False, "near_duplicate_of": None, "near_duplicate_slot": None,
                           "is_invalid": False, "invalid_reason": None, "is_kept": True}
    assert flags["r3"]["is_duplicate"] and flags["r3"]["duplicate_of"] == "r1" and not flags["r3"]["is_kept"]
    assert flags["r2"]["is_empty"] and not flags["r7"]["is_duplicate"]        # empty texts are not duplicates
    assert flags["r4"]["is_empty"] and flags["r4"]["is_truncated"]
    assert flags["r5"]["is_truncated"] and flags["r6"]["is_truncated"]
    records = quality_flags([row("r1", "{}", valid=True), row("r2", "{\"a\"", valid=False), row("r3", "prose")])
    assert [records[r]["is_invalid"] for r in ("r1", "r2", "r3")] == [False, True, False]
    assert [records[r]["is_kept"] for r in ("r1", "r2", "r3")] == [True, False, True]
    assert records["r2"]["invalid_reason"] == "not a valid record for the template's response_format"


# ---- the job on Ray ---------------------------------------------------------------------------------
COLOR = {"type": "object", "additionalProperties": False, "required": ["color"],
         "properties": {"color": {"enum": ["red", "green", "blue"]}}}


def write_config(tmp_path: Path, model_dir, ray_head, output: str, *storage: str) -> Path:
    seeds = [{"seed_id": "s1", "kind": "q", "text": "Name three colors."},
             {"seed_id": "s2", "kind": "q", "text": "Name three colors."},
             {"seed_id": "s3", "kind": "q", "text": "Describe a river in autumn."},
             {"seed_id": "long", "kind": "long", "text": "word " * 400}]
    pq.write_table(pa.Table.from_pylist(seeds), tmp_path / "seeds.parquet")
    cfg = {"models": {"target": str(model_dir), "dtype": "float32"},
           "drafting": {"method": "ngram", "num_speculative_tokens": 3},
           "engine": {"max_num_seqs": 8, "max_model_len": 256},
           "sampling": {"max_tokens": 6, "temperature": 0.9},
           "input": {"rows_per_unit": 4}, "output": {"path": output},
           "cluster": {"address": ray_head.address, "num_workers": 1, "num_cpus_per_worker": 1},
           "run": {"progress": False},
           "synthetic": {"seeds": str(tmp_path / "seeds.parquet"), "samples_per_seed": 2, "templates": [
               {"id": "greedy", "text": "{text}", "temperature": 0.0, "samples": 1, "max_tokens": 2},
               {"id": "stopped", "kinds": ["q"], "text": "Say: {text}", "temperature": 0.0, "samples": 1,
                "stop": ASCII},
               {"id": "sampled", "kinds": ["q"], "text": "Tell me more: {text}"},
               {"id": "record", "kinds": ["q"], "text": "Pick a color: {text}", "temperature": 0.0, "samples": 1,
                "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": COLOR}},
               {"id": "cut", "kinds": ["q"], "text": "Pick: {text}", "temperature": 0.0, "samples": 1,
                "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": COLOR}}]}}
    for item in storage:
        key, value = item.split("=", 1)
        cfg.setdefault("storage", {})[key] = value
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


EXPECTED_IDS = sorted([f"{s}/{t}/0" for s in ("s1", "s2", "s3") for t in ("greedy", "stopped", "record", "cut")]
                      + [f"{s}/sampled/{k}" for s in ("s1", "s2", "s3") for k in (0, 1)])


def files_state(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}


def rows_of(files) -> list[dict]:
    return [r for f in sorted(files) for r in pq.read_table(f).to_pylist()]


@pytest.fixture(scope="module")
def local_slot(tiny_model_dir, ray_head, tmp_path_factory):
    """One slot generated in this process; (config path, output root, exit code, stdout)."""
    tmp = tmp_path_factory.mktemp("synthetic")
    config = write_config(tmp, tiny_model_dir, ray_head, str(tmp / "out"))
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--config", str(config), "--slot", SLOT])
    return config, tmp / "out", rc, buf.getvalue()


def test_slot_end_to_end(local_slot):
    config, out, rc, stdout = local_slot
    assert rc == 0, stdout
    assert f"slot {SLOT} committed by run synthetic-{SLOT}" in stdout
    assert {p.relative_to(out).parts[0] for p in out.rglob("*")} == {f"slot={SLOT}"}     # nothing else
    slot_dir, run_dir = out / f"slot={SLOT}", out / f"slot={SLOT}" / f"synthetic-{SLOT}"
    tables = {kind: rows_of((run_dir / kind).glob("*.parquet")) for kind in ("completions", "rounds", "errors")}
    for kind, rows in tables.items():
        assert rows and {r["slot"] for r in rows} == {SLOT}, kind                # the slot in every row
    assert sorted(c["id"] for c in tables["completions"]) == EXPECTED_IDS
    assert [(e["id"], e["reason"], e["seed_id"]) for e in tables["errors"]] == [
        ("long/greedy/0", "prompt_too_long", "long")]

    curated = {r["id"]: r for r in rows_of((slot_dir / "curated").glob("*.parquet"))}
    assert sorted(curated) == EXPECTED_IDS
    for r in curated.values():
        assert r["slot"] == SLOT and r["prompt"] and r["is_empty"] == (not r["text"].strip())
        assert r["is_truncated"] == (r["finish_reason"] in ("length", "context"))
        assert r["is_kept"] == (not (r["is_empty"] or r["is_truncated"] or r["is_duplicate"] or r["is_invalid"]))
        assert r["is_invalid"] == (r["valid"] is False)
    # records: the template's schema, valid (its grammar ends it in 40 tokens); cut at 2 tokens: invalid
    for s in ("s1", "s2", "s3"):
        record = curated[f"{s}/record/0"]
        assert record["valid"] and json.loads(record["record"])["color"] in ("red", "green", "blue")
        assert curated[f"{s}/cut/0"]["is_invalid"] and not curated[f"{s}/cut/0"]["is_kept"]
    # crafted: greedy twins, cut at 2 tokens; stop strings at every ASCII character; sampled rows differ
    assert curated["s2/greedy/0"]["text"] == curated["s1/greedy/0"]["text"] != ""
    assert curated["s2/greedy/0"]["is_duplicate"] and curated["s2/greedy/0"]["duplicate_of"] == "s1/greedy/0"
    assert not curated["s1/greedy/0"]["is_duplicate"] and curated["s1/greedy/0"]["is_truncated"]
    assert sum(r["is_empty"] for r in curated.values()) >= 2
    assert curated["s1/sampled/0"]["text"] != curated["s1/sampled/1"]["text"]
    assert curated["s1/sampled/0"]["prompt"] == "Tell me more: Name three colors."

    summary = json.loads((slot_dir / "summary.json").read_text())
    q = summary["quality"]
    assert (slot_dir / "_SUCCESS").exists() and summary["run_id"] == f"synthetic-{SLOT}"
    assert q == {"checked": 18, "empty": sum(r["is_empty"] for r in curated.values()),
                 "truncated": sum(r["is_truncated"] for r in curated.values()),
                 "duplicate": sum(r["is_duplicate"] for r in curated.values()),
                 "near_duplicate": sum(r["is_near_duplicate"] for r in curated.values()),
                 "invalid": sum(r["is_invalid"] for r in curated.values()),
                 "kept": sum(r["is_kept"] for r in curated.values())}
    assert q["invalid"] >= 3 and summary["rows"] == 19 and summary["errors"] == 1
    assert (f"{q['empty']} empty, {q['truncated']} truncated, {q['duplicate']} duplicates, "
            f"{q['near_duplicate']} near-duplicates, {q['invalid']} invalid") in stdout
    # the dataset card: its default config's files are the kept rows, read by `datasets`
    import datasets
    card = (slot_dir / "README.md").read_text()
    header = yaml.safe_load(card.split("---")[1])
    files = header["configs"][0]["data_files"][0]["path"]
    kept = datasets.load_dataset("parquet", data_files=str(slot_dir / files))["train"]
    assert sorted(kept["id"]) == sorted(i for i, r in curated.items() if r["is_kept"]) and len(kept) == q["kept"]
    assert header["size_categories"] == ["n<1K"] and {"name": "text", "dtype": "string"} in header["dataset_info"][0]["features"]
    features = datasets.Features._from_yaml_list(header["dataset_info"][0]["features"])   # as the hub reads a card
    assert features["token_ids"] == datasets.Sequence(datasets.Value("int32")) and set(features) == set(kept.column_names)
    prov = json.loads((slot_dir / "provenance.json").read_text())
    assert prov["config_hash"] == config_hash(load_synthetic_config(str(config))) and prov["config"]["synthetic"]["seeds"].endswith("seeds.parquet")
    assert prov["models"]["target"]["kind"] == "folder" and prov["models"]["target"]["files"]
    assert prov["seeds"]["ids"] == ["s1", "s2", "s3", "long"] and prov["code"]["git_commit"]
    assert prov["stages"][0]["kept"] == q["kept"] and prov["stages"][0]["tokens"] == summary["tokens"] > 0
    assert prov["sampling"][0]["templates"]["greedy"]["temperature"] == 0.0


def test_rerun_of_a_committed_slot_changes_nothing(local_slot, capsys):
    config, out, rc, _ = local_slot
    before = files_state(out)
    assert main(["--config", str(config), "--slot", SLOT]) == 0
    said = capsys.readouterr().out
    assert f"slot {SLOT} already committed by run synthetic-{SLOT} at 20" in said
    assert files_state(out) == before


def start(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "jobs/synthetic_data.py", "--config", str(config), "--slot", SLOT,
                             "--show", "0", *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def race(config: Path) -> list[str]:
    """Two runs of the same slot started at once; both must exit 0. Returns their outputs, the
    generating one first."""
    procs = [start(config), start(config)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    committed = [o for o in outs if f"slot {SLOT} committed by run synthetic-{SLOT}" in o]
    assert len(committed) == 1, outs
    other = [o for o in outs if o is not committed[0]][0]
    assert (f"slot {SLOT} is being generated by another run (pid" in other
            or f"slot {SLOT} already committed by run synthetic-{SLOT}" in other), other
    return [committed[0], other]


@pytest.mark.slow
def test_two_runs_at_once_local(local_slot, tiny_model_dir, ray_head, tmp_path):
    config = write_config(tmp_path, tiny_model_dir, ray_head, str(tmp_path / "out"))
    race(config)
    slot_dir = tmp_path / "out" / f"slot={SLOT}"
    run_dir = slot_dir / f"synthetic-{SLOT}"
    completions = rows_of((run_dir / "completions").glob("*.parquet"))
    assert sorted(c["id"] for c in completions) == EXPECTED_IDS                # exactly once
    assert sorted(p.name for p in slot_dir.iterdir()) == sorted(["_SUCCESS", "_input", "_lease", "curated", "kept",
                                                                  "near_duplicates.parquet", "README.md",
                                                                  "provenance.json", f"synthetic-{SLOT}", "summary.json"])
    assert len(list((slot_dir / "_input").iterdir())) == 1
    # rerunning the slot regenerates the same rows: the same texts as the first fixture's run
    first = {c["id"]: c["text"] for c in rows_of((local_slot[1] / f"slot={SLOT}" / f"synthetic-{SLOT}"
                                                   / "completions").glob("*.parquet"))}
    assert {c["id"]: c["text"] for c in completions} == first


@pytest.mark.slow
def test_two_runs_at_once_on_s3(local_slot, tiny_model_dir, ray_head, s3, moto_endpoint, tmp_path):  # noqa: F811
    config = write_config(tmp_path, tiny_model_dir, ray_head, f"s3://{BUCKET}/synth", f"endpoint_url={moto_endpoint}",
                          f"key={KEY}", f"secret={SECRET}", f"region={REGION}")
    race(config)
    slot = f"{BUCKET}/synth/slot={SLOT}"
    objects = s3.find(f"{BUCKET}/synth")
    assert all(o.startswith(slot + "/") for o in objects) and f"{slot}/_SUCCESS" in objects
    assert len([o for o in objects if "/_lease/" in o]) in (1, 2)     # 2 only if the loser claimed after the winner
    completions = []
    for path in sorted(s3.glob(f"{slot}/synthetic-{SLOT}/completions/*.parquet")):
        with s3.open(path, "rb") as f:
            completions += pq.read_table(f).to_pylist()
    assert sorted(c["id"] for c in completions) == EXPECTED_IDS and {c["slot"] for c in completions} == {SLOT}
    first = {c["id"]: c["text"] for c in rows_of((local_slot[1] / f"slot={SLOT}" / f"synthetic-{SLOT}"
                                                   / "completions").glob("*.parquet"))}
    assert {c["id"]: c["text"] for c in completions} == first               # same slot, same rows, any store
    # a repeat changes no object (ETags and modification times as listed by the store)
    before = {o: (i["ETag"], i["LastModified"]) for o, i in s3.find(f"{BUCKET}/synth", detail=True).items()}
    assert main(["--config", str(config), "--slot", SLOT]) == 0
    after = {o: (i["ETag"], i["LastModified"]) for o, i in s3.find(f"{BUCKET}/synth", detail=True).items()}
    assert after == before


@pytest.mark.slow
def test_a_run_that_died_is_resumed(local_slot, tiny_model_dir, ray_head, tmp_path, capsys):
    """The first run's worker hangs after a few engine steps (a drill), its driver is SIGKILLed once a
    unit is committed; the next run takes over the dead holder's claim at once (same host, pid gone),
    skips the committed units and commits the slot with the same rows as an uninterrupted run."""
    config = write_config(tmp_path, tiny_model_dir, ray_head, str(tmp_path / "out"))
    proc = start(config, "debug.hang_worker_after_steps=8")
    markers = tmp_path / "out" / f"slot={SLOT}" / f"synthetic-{SLOT}" / "_committed"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not list(markers.glob("*.json")) and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    committed = len(list(markers.glob("*.json")))
    assert 1 <= committed < 5 and not (tmp_path / "out" / f"slot={SLOT}" / "_SUCCESS").exists()
    # another expansion cannot finish the slot (nothing runs) ...
    assert main(["--config", str(config), "--slot", SLOT, "synthetic.samples_per_seed=3"]) == 2
    assert f"slot {SLOT} was started with another seed set/templates/samples (rows-" in capsys.readouterr().err
    assert main(["--config", str(config), "--slot", SLOT, "sampling.max_tokens=7"]) == 2
    err = capsys.readouterr().err
    assert "was started with another config" in err and "sampling.max_tokens: recorded 6, now 7" in err
    # ... the same one resumes it
    assert main(["--config", str(config), "--slot", SLOT, "debug.hang_worker_after_steps=0"]) == 0
    said = capsys.readouterr().out
    # the first run's actors may still commit a unit after its driver was killed, until Ray ends them
    skipped = re.search(r"units 5 \((\d+) already committed", said)
    assert skipped and committed <= int(skipped.group(1)) <= 5 and f"slot {SLOT} committed by run" in said, said
    run_dir = tmp_path / "out" / f"slot={SLOT}" / f"synthetic-{SLOT}"
    texts = {c["id"]: c["text"] for c in rows_of((run_dir / "completions").glob("*.parquet"))}
    first = {c["id"]: c["text"] for c in rows_of((local_slot[1] / f"slot={SLOT}" / f"synthetic-{SLOT}"
                                                   / "completions").glob("*.parquet"))}
    assert texts == first
    assert len(list((tmp_path / "out" / f"slot={SLOT}" / "_input").iterdir())) == 1     # nothing stray
    assert len(list((tmp_path / "out" / f"slot={SLOT}" / "_lease").glob("*.json"))) == 4   # 1 killed, 2 refused


@pytest.mark.slow
def test_a_slot_at_two_tensor_parallel_ranks_writes_the_greedy_rows_of_one(local_slot, tmp_path, capsys):
    """The same slot with models.tensor_parallel_size 2 (each worker 2 rank actors, gloo): it commits the
    same rows, and its greedy templates' tokens are those of the one-rank slot (fp32)."""
    config, out, rc, _ = local_slot
    assert rc == 0
    assert main(["--config", str(config), "--slot", SLOT, f"output.path={tmp_path / 'tp'}",
                 "models.tensor_parallel_size=2"]) == 0, capsys.readouterr().out
    run = f"slot={SLOT}/synthetic-{SLOT}/completions/*.parquet"
    one, two = ({r["id"]: r for r in rows_of(root.glob(run))} for root in (out, tmp_path / "tp"))
    assert sorted(two) == sorted(one) == EXPECTED_IDS
    greedy = [i for i in one if i.split("/")[1] in ("greedy", "stopped", "record", "cut")]
    assert greedy and all(two[i]["token_ids"] == one[i]["token_ids"] for i in greedy)

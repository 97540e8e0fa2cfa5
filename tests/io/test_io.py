"""The reader and writer without Ray: unit planning, streaming, schema checks, the commit protocol."""
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io.reader import InputConfig
from pipeline.io.storage import StorageConfig
from pipeline.io import reader
from pipeline.io.reader import InputError, iter_rows, plan_units
from pipeline.io.schema import to_table
from pipeline.io.writer import OutputError, RunOutput
from pipeline_util import unit_tables, prompt_rows, write_parquet

S = StorageConfig()


def _all_rows(units):
    return [(u.uid, i, r["id"]) for u in units for i, r in iter_rows(u, S)]


def test_units_are_bounded_row_ranges_covering_every_row_once(tmp_path):
    write_parquet(tmp_path / "a.parquet", prompt_rows(23, "a"), row_group_size=4)
    write_parquet(tmp_path / "sub" / "b.parquet", prompt_rows(5, "b"), row_group_size=100)
    units = plan_units(InputConfig(path=str(tmp_path), rows_per_unit=6), S)
    assert [(u.rel, u.start, u.stop) for u in units] == [
        ("a.parquet", 0, 6), ("a.parquet", 6, 12), ("a.parquet", 12, 18), ("a.parquet", 18, 23),
        ("sub/b.parquet", 0, 5)]
    rows = _all_rows(units)
    assert [r[2] for r in rows] == [f"a-{i}" for i in range(23)] + [f"b-{i}" for i in range(5)]
    assert all(int(rid.split("-")[1]) == i for _, i, rid in rows)      # row index = position in file
    assert len({u.uid for u in units}) == len(units)
    again = plan_units(InputConfig(path=str(tmp_path), rows_per_unit=6), S)
    assert [u.uid for u in again] == [u.uid for u in units]            # ids are stable


def test_glob_jsonl_limit_and_datasets_save_to_disk(tmp_path):
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps(r) for r in prompt_rows(9, "x")) + "\n\n")
    units = plan_units(InputConfig(path=str(tmp_path / "*.jsonl"), rows_per_unit=4, limit=7), S)
    assert [(u.start, u.stop) for u in units] == [(0, 4), (4, 7)]
    assert [r[2] for r in _all_rows(units)] == [f"x-{i}" for i in range(7)]
    ds = datasets.Dataset.from_list(prompt_rows(11, "d"))
    ds.save_to_disk(str(tmp_path / "hf"), max_shard_size="1KB")
    units = plan_units(InputConfig(path=str(tmp_path / "hf"), rows_per_unit=5), S)
    assert all(u.fmt == "arrow" for u in units)
    assert sorted(r[2] for r in _all_rows(units)) == sorted(f"d-{i}" for i in range(11))


def test_missing_prompt_column_fails_fast_listing_columns(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"id": "1", "text": "hi"}])
    with pytest.raises(InputError, match=r"a\.parquet.*'prompt' or 'messages'.*found \['id', 'text'\]"):
        plan_units(InputConfig(path=str(tmp_path)), S)


def test_unreadable_file_fails_fast_with_path(tmp_path):
    write_parquet(tmp_path / "good.parquet", prompt_rows(3, "g"))
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(InputError, match=r"bad\.parquet: unreadable as parquet"):
        plan_units(InputConfig(path=str(tmp_path)), S)
    with pytest.raises(InputError, match="no such file"):
        plan_units(InputConfig(path=str(tmp_path / "nope.parquet")), S)


def test_duplicate_ids_marked_after_first_occurrence_across_files(tmp_path):
    write_parquet(tmp_path / "a.parquet", [{"id": "k", "prompt": "p"}, {"id": "m", "prompt": "p"}])
    write_parquet(tmp_path / "b.parquet", [{"id": "m", "prompt": "p"}, {"id": "z", "prompt": "p"},
                                           {"id": "z", "prompt": "p"}])
    units = plan_units(InputConfig(path=str(tmp_path), rows_per_unit=10), S)
    assert [u.duplicate_rows for u in units] == [(), (0, 2)]


def test_duplicate_ids_across_units_of_one_file_read_each_file_once(tmp_path, monkeypatch):
    rows = [{"id": f"r{i % 7}", "prompt": "p"} for i in range(20)]      # every row from 7 on repeats
    write_parquet(tmp_path / "a.parquet", rows, row_group_size=4)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "r3", "prompt": "p"}, {"id": "new", "prompt": "p"}, {"prompt": "no id"})))
    opened = []
    real_ids = reader._ids
    monkeypatch.setattr(reader, "_ids", lambda span, *a: opened.append(span.rel) or real_ids(span, *a))
    units = plan_units(InputConfig(path=str(tmp_path), rows_per_unit=6), S)
    assert sorted(opened) == ["a.parquet", "b.jsonl"]                   # one id pass per file
    assert [(u.rel, u.start, u.duplicate_rows) for u in units] == [
        ("a.parquet", 0, ()), ("a.parquet", 6, (7, 8, 9, 10, 11)), ("a.parquet", 12, tuple(range(12, 18))),
        ("a.parquet", 18, (18, 19)), ("b.jsonl", 0, (0,))]


def test_streaming_reads_only_the_units_row_groups(tmp_path, monkeypatch):
    """A unit deep in a file reads its own row groups, not the file from the start."""
    write_parquet(tmp_path / "a.parquet", prompt_rows(400, "a"), row_group_size=50)
    unit = plan_units(InputConfig(path=str(tmp_path), rows_per_unit=40), S)[7]    # rows 280..320
    seen = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("row_groups"))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    assert [r["id"] for _, r in iter_rows(unit, S)] == [f"a-{i}" for i in range(280, 320)]
    assert seen == [[5, 6]]


def test_commit_protocol_crash_before_marker_leaves_nothing_visible(tmp_path):
    out = RunOutput(str(tmp_path), "r", S)

    def crash():
        raise KeyboardInterrupt("killed between data and marker")
    with pytest.raises(KeyboardInterrupt):
        out.write_unit("u1", unit_tables(3), {"rows": 3}, before_commit=crash)
    run = tmp_path / "r"
    assert out.committed() == {} and not (run / "completions").exists()
    assert list((run / "_staging" / "u1").iterdir())                 # the data was written, unseen
    with pytest.raises(FileNotFoundError):                             # readers of the folder see nothing
        pq.read_table(run / "completions")
    out.write_unit("u1", unit_tables(3), {"rows": 3})                      # the retry commits it once
    out.write_unit("u1", unit_tables(3), {"rows": 3})                      # and a second retry overwrites
    assert list(out.committed()) == ["u1"]
    assert pq.read_table(run / "completions").num_rows == 3
    assert not (run / "_staging" / "u1").exists()


def test_committed_but_unpublished_unit_is_rolled_forward(tmp_path, monkeypatch):
    out = RunOutput(str(tmp_path), "r", S)
    monkeypatch.setattr(RunOutput, "publish", lambda self, uid: None)   # crash right after the marker
    out.write_unit("u1", unit_tables(2), {"rows": 2})
    monkeypatch.undo()
    assert not (tmp_path / "r" / "completions").exists()
    assert out.roll_forward() == 1
    assert pq.read_table(tmp_path / "r" / "completions").num_rows == 2
    manifest = out.finalize({"rows": 2})
    assert (tmp_path / "r" / "_SUCCESS").exists() and len(manifest["files"]["completions"]) == 1


def test_plan_guard_refuses_another_config_or_plan(tmp_path):
    out = RunOutput(str(tmp_path), "r", S)
    units = plan_units(InputConfig(path=str(write_parquet(tmp_path / "in" / "a.parquet", prompt_rows(4, "a")))), S)
    tree = {"sampling": {"temperature": 0.0, "top_p": 1.0}, "run": {"seed": 0}}
    out.prepare(units, "hash1", {"k": 1}, tree, resume=True)
    out.prepare(units, "hash1", {"k": 1}, tree, resume=True)            # same job: fine
    changed = {"sampling": {"temperature": 0.7, "top_p": 1.0}, "run": {"seed": 0}}
    with pytest.raises(OutputError, match=r"another config \(sampling.temperature: recorded 0.0, now 0.7\)"):
        out.prepare(units, "hash2", {"k": 2}, changed, resume=True)
    with pytest.raises(OutputError, match="already holds a run"):
        out.prepare(units, "hash1", {"k": 1}, tree, resume=False)
    with pytest.raises(OutputError, match="different units"):
        out.prepare(units[:0], "hash1", {"k": 1}, tree, resume=True)


def test_empty_tables_keep_their_schema(tmp_path):
    for kind in ("completions", "rounds", "errors"):
        t = to_table(kind, [])
        pq.write_table(t, tmp_path / f"{kind}.parquet")
        assert pq.read_schema(tmp_path / f"{kind}.parquet") == t.schema
    assert isinstance(to_table("rounds", []).schema.field("accepted_mask").type, pa.ListType)

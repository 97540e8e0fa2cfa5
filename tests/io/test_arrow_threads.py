"""pyarrow must never read a Python file object from its own threads.

pyarrow wraps what it reads from a Python handle (an fsspec file) in buffers that own Python objects.
A pool thread that drops one after the interpreter has begun to exit cannot take the GIL, and the
process aborts (exit -6, "terminate called without an active exception"). CI saw it in a driver
that had finished its job. Every reader in the pipeline therefore opens local files as Arrow-native
files, and reads any other filesystem's handle on the calling thread (storage.arrow_input).

The abort itself is a race at exit and a poor test: a bare script whose last line is `pq.read_table`
on an fsspec handle aborted 4 of 10 runs here, the same read behind the pipeline's imports 0 of 12.
What the tests check instead is its precondition, deterministically: no read of a Python handle
happens on a thread Python did not start (such threads show as "Dummy-N").
"""
import io
import threading

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileOpener
from fsspec.implementations.memory import MemoryFile

from pipeline.synthetic import quality, plan as synthetic
from pipeline.synthetic.config import SyntheticSection
from pipeline.report import summary as report
from pipeline.io.reader import InputConfig
from pipeline.io.storage import StorageConfig
from pipeline.io.reader import iter_rows, plan_units
from pipeline.io.schema import to_table
from pipeline.io.writer import RunOutput
from pipeline_util import prompt_rows

S = StorageConfig()
ROWS = 600


def _seed_rows(n):
    return [{"seed_id": f"s{i}", "kind": "qa", "text": f"passage {i} " * 8} for i in range(n)]


def _parquet_bytes(rows, row_group_size=100) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=row_group_size)
    return buf.getvalue()


@pytest.fixture
def python_reads(monkeypatch):
    """The name of the thread behind every read of an fsspec local or in-memory file handle."""
    names = []
    for cls in (LocalFileOpener, MemoryFile):
        for method in [m for m in ("read", "readinto", "read1") if hasattr(cls, m)]:
            original = getattr(cls, method)

            def spy(self, *args, _original=original, **kwargs):
                names.append(threading.current_thread().name)
                return _original(self, *args, **kwargs)
            monkeypatch.setattr(cls, method, spy)
    return names


def _stores(root):
    """Inputs, seeds and a committed run under `root` (a local folder or a memory:// URL)."""
    fs, base = fsspec.core.url_to_fs(root)
    fs.makedirs(f"{base}/in", exist_ok=True)
    fs.pipe(f"{base}/in/a.parquet", _parquet_bytes(prompt_rows(ROWS, "a")))
    fs.pipe(f"{base}/seeds.parquet", _parquet_bytes(_seed_rows(ROWS)))
    fs.pipe(f"{base}/seeds.jsonl", "".join(f'{{"seed_id": "j{i}", "text": "t{i}"}}\n' for i in range(ROWS)).encode())
    comp = [{k: None for k in to_table("completions", []).schema.names} | {"id": str(i), "text": "x" * 40}
            for i in range(ROWS)]
    tables = {"completions": to_table("completions", comp), "rounds": to_table("rounds", []),
              "errors": to_table("errors", [])}
    RunOutput(f"{root}/out", "r", S).write_unit("u1", tables, {"rows": ROWS})


def _read_everything(root):
    """Every pipeline reader of Parquet/JSON, once each; returns what each read, to check."""
    units = plan_units(InputConfig(path=f"{root}/in", rows_per_unit=250), S)   # footers + the id pass
    rows = [r for u in units for _, r in iter_rows(u, S)]
    comps = report.load(f"{root}/out/r", "completions", S)
    table = quality._read(RunOutput(f"{root}/out", "r", S).committed_files("completions")[0], S, ["id"])
    seeds = synthetic.load_seeds(SyntheticSection(seeds=f"{root}/seeds.parquet"), S)
    jseeds = synthetic.load_seeds(SyntheticSection(seeds=f"{root}/seeds.jsonl"), S)
    return len(rows), comps.num_rows, table.num_rows, len(seeds), len(jseeds)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_python_file_handles_are_read_only_on_the_calling_thread(tmp_path, python_reads, where):
    root = str(tmp_path) if where == "local" else f"memory://arrow-threads-{tmp_path.name}"
    _stores(root)
    python_reads.clear()
    assert _read_everything(root) == (ROWS,) * 5
    me = threading.current_thread().name
    assert set(python_reads) <= {me}, set(python_reads) - {me}
    if where == "memory":     # the spy sees the reads of a Python handle
        assert len(python_reads) > 20, len(python_reads)
    else:                     # local Parquet and JSON open Arrow-native; markers are read by Python
        assert len(python_reads) < 20, len(python_reads)

"""Peak memory of planning and streaming every row of an input, against the input's size.

    .venv/bin/python -m bench.reader_memory --rows 20000 200000 1000000

For each size: one Parquet file of that many prompt rows (~300 bytes each, row groups of 10k rows),
then, in a fresh process each, (a) plan units + stream every row of every unit, the worker's read
path, with the duplicate-id pass off and (b) with it on (it keeps every id: memory grows with the
number of rows, by design). Reports peak RSS (ru_maxrss) and rows/s.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_file(path: Path, rows: int) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ("Summarize the following passage about river deltas, sediment, tides and the cities built "
            "on them, in three sentences, keeping every number it mentions. ") * 2
    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("prompt", pa.string())])) as w:
        for start in range(0, rows, 10_000):
            n = min(10_000, rows - start)
            w.write_table(pa.table({"id": [f"row-{i}" for i in range(start, start + n)],
                                    "prompt": [text] * n}), row_group_size=10_000)


def stream(path: str, dup_check: bool) -> dict:
    from pipeline.io.reader import InputConfig
    from pipeline.io.storage import StorageConfig
    from pipeline.io.reader import iter_rows, plan_units
    t0 = time.perf_counter()
    storage = StorageConfig()
    units = plan_units(InputConfig(path=path, rows_per_unit=256, check_duplicate_ids=dup_check), storage)
    n = sum(1 for u in units for _ in iter_rows(u, storage))
    wall = time.perf_counter() - t0
    return {"rows": n, "units": len(units), "wall_s": round(wall, 2), "rows_per_s": round(n / wall),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[20_000, 200_000, 1_000_000])
    p.add_argument("--one", nargs=2, metavar=("PATH", "DUPCHECK"))
    p.add_argument("--dir", default=str(ROOT / "bench" / "out" / "reader"))
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(stream(args.one[0], args.one[1] == "1")))
        return
    results = []
    for rows in args.rows:
        path = Path(args.dir) / f"prompts-{rows}.parquet"
        make_file(path, rows)
        for dup in ("0", "1"):
            out = subprocess.run([sys.executable, "-m", "bench.reader_memory", "--one", str(path), dup],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout
            r = {"file_rows": rows, "file_mb": round(path.stat().st_size / 2**20, 1), "dup_check": dup == "1",
                 **json.loads(out.split("RESULT ", 1)[1])}
            results.append(r)
            print(json.dumps(r), flush=True)
    (Path(args.dir) / "reader_memory.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Summaries and plots from a run's committed output (the same files a notebook reads).

`python -m pipeline.report <output.path>/<run_id> [--plots]` prints the summary and, with --plots
(needs the `plots` extra), writes acceptance PNGs next to the manifest. Knows nothing about Ray or
models.
"""
from __future__ import annotations

import argparse
import json
import posixpath

import pyarrow as pa
import pyarrow.parquet as pq

from .config import StorageConfig
from .io.reader import filesystem
from .io.schema import TABLES
from .io.writer import RunOutput


def load(run_url: str, kind: str, storage: StorageConfig = StorageConfig(), columns=None) -> pa.Table:
    """One table over the committed units' `kind` files (completions | rounds | errors)."""
    root, run_id = run_url.rstrip("/").rsplit("/", 1)
    tables = []
    for url in RunOutput(root, run_id, storage).committed_files(kind):
        fs, path = filesystem(url, storage)
        with fs.open(path, "rb") as f:
            # ParquetFile, not read_table: read_table goes through pyarrow.dataset's async scanner,
            # whose threads aborted a driver at interpreter exit (seen once under `ray job submit`)
            tables.append(pq.ParquetFile(f).read(columns=columns))
    return pa.concat_tables(tables) if tables else TABLES[kind].empty_table()


def print_summary(summary: dict, show: int = 3, storage: StorageConfig = StorageConfig()) -> None:
    run_url = summary["output"]
    if show:
        comps = load(run_url, "completions", storage, ["id", "text", "finish_reason", "completion_tokens",
                                                        "draft_tokens", "accepted_tokens"])
        for c in comps.slice(0, show).to_pylist():
            print(f"\n--- {c['id']} ({c['finish_reason']}, {c['completion_tokens']} tokens, "
                  f"{c['accepted_tokens']}/{c['draft_tokens']} drafts accepted)\n{c['text']}")
    s = summary
    print(f"\nrun {s['run_id']}: {s['rows']} rows -> {s['completions']} completions + {s['errors']} errors "
          f"{s['error_reasons'] or ''}")
    print(f"units {s['units']} ({s['units_skipped']} already committed, {s['unit_retries']} retried, "
          f"{s['worker_restarts']} worker restarts)")
    print(f"this run: {s['rows_this_run']} rows, {s['tokens_this_run']} tokens in {s['wall_s']} s end to end "
          f"({s['tokens_per_s']} tok/s, {s['rows_per_s']} rows/s; generating {s.get('generate_s')} s, "
          f"{s.get('generate_tokens_per_s')} tok/s); acceptance {s['acceptance_rate']}, "
          f"{s['tokens_per_round']} tokens/round")
    print(f"output: {run_url} (manifest.json, _SUCCESS)")


def plot(run_url: str, storage: StorageConfig = StorageConfig()) -> list[str]:
    """acceptance.png: acceptance rate per draft position, and tokens per round by batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rounds = load(run_url, "rounds", storage, ["draft_len", "accepted_mask", "emitted", "batch_size"]).to_pylist()
    by_pos: dict[int, list[int]] = {}
    by_batch: dict[int, list[int]] = {}
    for r in rounds:
        for i, ok in enumerate(r["accepted_mask"]):
            by_pos.setdefault(i, []).append(int(ok))
        by_batch.setdefault(r["batch_size"], []).append(r["emitted"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    pos = sorted(by_pos)
    a.bar([p + 1 for p in pos], [sum(by_pos[p]) / len(by_pos[p]) for p in pos])
    a.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance by draft position", ylim=(0, 1))
    bs = sorted(by_batch)
    b.plot(bs, [sum(by_batch[k]) / len(by_batch[k]) for k in bs], marker="o")
    b.set(xlabel="running batch size", ylabel="tokens per round", title="tokens committed per round")
    fig.tight_layout()
    fs, path = filesystem(run_url, storage)
    target = posixpath.join(path, "acceptance.png")
    with fs.open(target, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return [target]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", help="<output.path>/<run_id>")
    parser.add_argument("--plots", action="store_true")
    args = parser.parse_args(argv)
    fs, path = filesystem(args.run, StorageConfig())
    with fs.open(posixpath.join(path, "manifest.json")) as f:
        print_summary(json.load(f), show=0)
    if args.plots:
        print("wrote", ", ".join(plot(args.run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

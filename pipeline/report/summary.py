"""Reports from a run's committed output (the same files a notebook reads).

    python -m pipeline.report <run-url> [<run-url> | <glob> ...] [--by kind[,source]] [--plots [DIR]]

Prints each run's status (committed units vs its `_plan.json`), then rows, tokens, tokens/s,
acceptance rate, mean accepted length, per-position acceptance, finish reasons and errors by
reason, grouped by any pass-through column (`--by`) and, with several runs, by `run` (side by side
in one table). `--plots` writes the PNGs of pipeline/report/plots.py (needs the `plots` extra) to
DIR, default the run folder (several runs: the current directory). The statistics and their
definitions are in pipeline/report/stats.py; this module loads and formats.

Exit codes: 0 report printed (a partial run is reported as `partial: k/n units committed; missing:
...`, still 0); 1 a URL holds no run (no `_plan.json`) or no committed unit (the other runs are
still reported), or a glob matched nothing; 2 bad arguments (a `--by` column the output does not have). Knows nothing about Ray or models.
"""
from __future__ import annotations

import argparse
import posixpath
import sys
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

from ..io.reader import filesystem
from ..io.schema import TABLES
from ..io.storage import StorageConfig, read_parquet
from ..io.writer import KINDS, RunOutput
from . import stats as st


def load(run_url: str, kind: str, storage: StorageConfig = StorageConfig(), columns=None,
         exclude=()) -> pa.Table:
    """One table over the committed units' `kind` files (completions | rounds | errors); `exclude`
    names columns not to read (e.g. text, token_ids)."""
    tables = []
    for url in _output(run_url, storage).committed_files(kind):
        fs, path = filesystem(url, storage)
        tables.append(read_parquet(fs, path, columns or None, exclude))
    return pa.concat_tables(tables) if tables else TABLES[kind].empty_table()


def _output(run_url: str, storage: StorageConfig) -> RunOutput:
    root, run_id = posixpath.split(run_url.rstrip("/"))
    return RunOutput(root or ".", run_id, storage)


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
    if s.get("prompt_tokens"):
        print(f"prompt tokens {s['prompt_tokens']}, {s['prompt_tokens_reused']} of them copied from a slot "
              f"holding the same prefix ({100 * s['prefix_reuse_rate']:.1f}%, engine.prefix_reuse)")
    if s.get("structured"):
        print(f"records: {s['valid']} of {s['structured']} rows with a response_format are valid "
              f"({100 * s['valid'] / s['structured']:.1f}%); {s['forced_tokens']} tokens were forced by their "
              f"grammars ({100 * s['forced_tokens'] / max(1, s['tokens']):.1f}% of all tokens)")
    for line in model_lines(s.get("workers", [])) + engine_lines(s.get("workers", [])):
        print(line)
    print(f"output: {run_url} (manifest.json, _SUCCESS)")


def model_lines(workers: list[dict]) -> list[str]:
    """One line per distinct (target, draft, dtype) the workers loaded, naming the workers: with
    `models.dtype: auto` each machine chooses, so a mixed cluster shows every choice."""
    groups: dict[tuple, list[str]] = {}
    for w in workers:
        key = (w.get("target"), w.get("draft"), w.get("dtype"), w.get("dtype_reason"), w.get("draft_dtype"))
        groups.setdefault(key, []).append(str(w.get("worker")))
    return [f"models: {target}" + (f" + draft {draft}" if draft else "")
            + (f" (draft in {draft_dtype})" if draft and draft_dtype and draft_dtype != dtype else "")
            + f", dtype {dtype} ({reason}) on {', '.join(names)}"
            for (target, draft, dtype, reason, draft_dtype), names in groups.items()]


def engine_lines(workers: list[dict]) -> list[str]:
    """The running-sequence count and each model's backend plan, once per distinct choice, naming the
    workers (with `engine.max_num_seqs: auto` each worker chooses for its own memory)."""
    slots: dict[int, list[dict]] = {}
    plans: dict[tuple, list[str]] = {}
    for w in workers:
        slots.setdefault(w.get("max_num_seqs"), []).append(w)
        plans.setdefault(tuple(w.get("plan") or ()), []).append(str(w.get("worker")))
    lines = [f"max_num_seqs {n} on {', '.join(str(w.get('worker')) for w in ws)}"
             + (f" ({ws[0]['slots_reason']})" if ws[0].get("slots_reason") else "")
             for n, ws in slots.items() if n is not None]
    return (lines + [f"kernels on {', '.join(names)}: " + "; ".join(plan) for plan, names in plans.items() if plan]
            + rank_lines(workers))


def rank_lines(workers: list[dict]) -> list[str]:
    """Tensor-parallel replicas: each worker's ranks with their device, the collective backend and the
    weights each holds (nothing for replicas of one rank)."""
    return [f"replica {w.get('worker')}: {len(w['ranks'])} ranks over {w['ranks'][0]['backend']}: "
            + ", ".join(f"rank {r['rank']} on {r['device']} holds {r['weight_bytes'] / 2**20:.1f} MiB of weights"
                        for r in w["ranks"])
            for w in workers if len(w.get("ranks") or ()) > 1]


# ---- status of runs ---------------------------------------------------------------------------------
@dataclass
class RunStatus:
    url: str
    label: str
    planned: list[str] | None          # the units of _plan.json; None when there is no plan (no run)
    committed: list[str]               # committed units (markers)
    complete: bool                     # _SUCCESS written

    @property
    def missing(self) -> list[str]:
        return [u for u in self.planned or [] if u not in set(self.committed)]

    @property
    def has_data(self) -> bool:
        return self.planned is not None and bool(self.committed)

    def describe(self, show: int = 5) -> str:
        if self.planned is None:
            return f"{self.label}: no run here (no _plan.json at {self.url})"
        n, k = len(self.planned), len(self.committed)
        if not k:
            return f"{self.label}: no committed unit yet (0/{n} units)"
        if self.missing:
            more = f" (+{len(self.missing) - show} more)" if len(self.missing) > show else ""
            return (f"{self.label}: partial: {k}/{n} units committed; missing: "
                    f"{', '.join(self.missing[:show])}{more}")
        return f"{self.label}: {'complete' if self.complete else 'all units committed, not finalized'}: {k}/{n} units"


def run_status(url: str, label: str | None = None, storage: StorageConfig = StorageConfig()) -> RunStatus:
    out = _output(url, storage)
    plan = out.plan()
    committed = sorted(out.committed()) if plan is not None else []
    return RunStatus(url, label or posixpath.basename(url.rstrip("/")), plan["units"] if plan else None,
                     committed, out.is_complete())


def expand_runs(patterns: list[str], storage: StorageConfig = StorageConfig()) -> list[str]:
    """Run URLs from URLs and globs (`out/syn/slot=*/synthetic-*`); a glob matching nothing is an error."""
    urls = []
    for pattern in patterns:
        if not any(ch in pattern for ch in "*?["):
            urls.append(pattern.rstrip("/"))
            continue
        fs, path = filesystem(pattern, storage)
        proto = pattern.split("://")[0] + "://" if "://" in pattern else ""
        found = sorted(p for p in fs.glob(path) if fs.isdir(p))
        if not found:
            raise FileNotFoundError(f"{pattern}: no run folder matches")
        urls += [proto + p for p in found]
    return urls


def labels(urls: list[str]) -> list[str]:
    """Short names for runs: their paths without the common leading folders."""
    parts = [u.rstrip("/").split("/") for u in urls]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    rest = [p[common:] for p in parts]
    if len(rest) > 1 and len({r[0] for r in rest}) == len(rest):    # slot=<slot>/<run>: the slot names it
        return [r[0] for r in rest]
    return ["/".join(r) for r in rest]


# ---- tables ----------------------------------------------------------------------------------------
def load_frames(runs: list[RunStatus], storage: StorageConfig = StorageConfig()) -> dict[str, pd.DataFrame]:
    """completions (without text/token_ids), rounds, errors of the runs, each row with its `run` label."""
    out = {}
    for kind in KINDS:
        parts = [load(r.url, kind, storage, exclude=("text", "token_ids")).to_pandas().assign(run=r.label)
                 for r in runs]
        out[kind] = pd.concat(parts, ignore_index=True)
    return out


def report_text(frames: dict[str, pd.DataFrame], by: list[str]) -> str:
    """The printed report: summary, per-position acceptance, finish reasons, errors by reason."""
    c, r, e = frames["completions"], frames["rounds"], frames["errors"]
    per_pos = st.per_position(r, by)
    pos = per_pos[["unconditional", "conditional"]].unstack("position")
    pos.insert(0, ("drafts", ""), per_pos["drafts"].groupby(level=list(range(per_pos.index.nlevels - 1))).first())
    sections = [
        ("summary (mean_accepted_length = tokens per target forward, bonus included; "
         "tokens_per_s = tokens / engine_s)", st.summary(c, r, e, by)),
        ("acceptance per draft position i: unconditional = P(accepted >= i) (vLLM's per-position rate), "
         "conditional = P(i accepted | 1..i-1 accepted)", pos),
        ("draft shapes (tree: several candidate paths; draft_len = tokens verified, accepted = accepted "
         "depth)", st.by_draft_shape(r, by)),
        ("finish reasons (completions)", st.counts(c, "finish_reason", by)),
        ("structured output per response_format kind (valid_rate: ended by the grammar and, for JSON, "
         "parses and validates; forced_share: committed tokens the grammar forced; acceptance_rate: the "
         "drafter's own tokens)", st.by_format(c, r, by)),
        ("errors by reason", st.counts(e, "reason", by)),
    ]
    return "\n\n".join(f"== {title}\n{_fmt(df)}" for title, df in sections)


def _fmt(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none)"
    return df.to_string(float_format=lambda x: f"{x:.3f}")


def write_plots(rounds: pd.DataFrame, by: list[str], out_url: str, storage: StorageConfig = StorageConfig(),
                bins: int = 20) -> list[str]:
    """The PNGs of report_plots.FIGURES under out_url; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import FIGURES, plot_data, render
    data = plot_data(rounds, by, bins)
    fs, path = filesystem(out_url, storage)
    fs.makedirs(path, exist_ok=True)
    written = []
    for name in FIGURES:
        fig = render(name, data[name])
        target = posixpath.join(path, f"{name}.png")
        with fs.open(target, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        plt.close(fig)
        written.append(target)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="<output.path>/<run_id> URLs or globs (e.g. out/syn/slot=*/synthetic-*)")
    parser.add_argument("--by", action="append", default=[], help="grouping column(s), comma-separated or repeated")
    parser.add_argument("--plots", nargs="?", const="", default=None, metavar="DIR",
                        help="write PNGs to DIR (default: the run folder; several runs: the current directory)")
    parser.add_argument("--bins", type=int, default=20, help="time bins of tokens_per_s.png")
    args = parser.parse_args(argv)
    try:
        urls = expand_runs(args.runs)
    except FileNotFoundError as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    runs = [run_status(u, label) for u, label in zip(urls, labels(urls))]
    for r in runs:
        print(r.describe())
    empty = [r.url for r in runs if not r.has_data]
    runs = [r for r in runs if r.has_data]
    if empty:
        print("report: no committed run at " + ", ".join(empty), file=sys.stderr)
    if not runs:
        return 1
    by = (["run"] if len(args.runs) > 1 or len(urls) > 1 else []) + [c for b in args.by for c in b.split(",") if c]
    frames = load_frames(runs)
    missing = [c for c in by if c not in frames["completions"].columns]
    if missing:
        extra = [c for c in frames["completions"].columns if c not in TABLES["completions"].names and c != "run"]
        print(f"report: --by {missing}: not in the output; pass-through columns here: {extra}", file=sys.stderr)
        return 2
    print("\n" + report_text(frames, by))
    if args.plots is not None:
        out = args.plots or (runs[0].url if len(runs) == 1 else ".")
        print("\nwrote " + ", ".join(write_plots(frames["rounds"], by, out, bins=args.bins)))
    return 1 if empty else 0


if __name__ == "__main__":
    raise SystemExit(main())

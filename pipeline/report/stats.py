"""Acceptance statistics of a run, as pure functions of its tables (pandas DataFrames of the
completions, rounds and errors schemas, plus any pass-through or `run` column to group by).

Definitions (every function takes `by`, a list of grouping columns; none = one group, "all"):

    rows                   completions + errors (input rows)
    tokens                 completion tokens (sum of `emitted` over the rows' rounds)
    rounds                 speculative rounds = target forwards of a sequence
    acceptance_rate        accepted draft tokens / drafted tokens
    mean_accepted_length   tokens / rounds: tokens per target forward, the bonus/recovered token
                           included (vLLM's "mean acceptance length" = 1 + accepted / drafts, which
                           equals this when every round drafts and no stop cuts a round short)
    engine_s               speculative step time: draft_s + verify_s of every distinct engine step
                           (worker, step) in which the group had a round; prefill outside rounds and
                           scheduling are not counted. Steps are shared by all sequences of a batch,
                           so groups that ran together each count the whole step. A step is
                           (worker, step, draft_s, verify_s): a run resumed by a new driver restarts
                           worker names and step counters, and the step's own timings tell its
                           steps from the first driver's (equal float timings are not a collision
                           that happens).
    tokens_per_s           tokens / engine_s (throughput of the engines while they decoded the group)
    draft shape            tree (a round whose draft had several root-to-leaf paths, `paths` > 1),
                           path (one), none (no draft); for a tree `draft_len` is its size and
                           `accepted` the accepted path's depth
    per position i (1-based, over rounds that drafted >= 1 token, vLLM's `num_drafts`):
      unconditional        P(accepted >= i) = #rounds with accepted >= i / #rounds that drafted,
                           as vLLM's spec_decode_num_accepted_tokens_per_pos / num_drafts (a
                           survival curve, non-increasing by construction)
      conditional          P(position i accepted | positions 1..i-1 accepted and i drafted) =
                           #rounds with accepted >= i / #rounds with accepted >= i-1 and draft_len >= i

Knows nothing about storage, Ray or plotting.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

ALL = "all"
STEP = ["worker", "step", "draft_s", "verify_s"]   # one engine step (see engine_s above)


def grouped(df: pd.DataFrame, by) -> tuple[pd.DataFrame, list[str]]:
    """df with the grouping columns present (a constant `group` column when by is empty)."""
    by = list(by)
    if not by:
        return df.assign(group=ALL), ["group"]
    missing = [c for c in by if c not in df.columns]
    if missing:
        raise KeyError(f"grouping column(s) {missing} not in the output; columns: {list(df.columns)}")
    return df, by


def engine_seconds(rounds: pd.DataFrame, by) -> pd.Series:
    """Per group: draft_s + verify_s summed over the distinct (worker, step) steps it had rounds in."""
    df, keys = grouped(rounds, by)
    steps = df.drop_duplicates(keys + STEP)
    return (steps["draft_s"] + steps["verify_s"]).groupby([steps[k] for k in keys]).sum()


def summary(completions: pd.DataFrame, rounds: pd.DataFrame, errors: pd.DataFrame, by=()) -> pd.DataFrame:
    """One row per group: rows, completions, errors, tokens, rounds, draft/accepted tokens,
    acceptance_rate, mean_accepted_length, engine_s, tokens_per_s."""
    c, keys = grouped(completions, by)
    e, _ = grouped(errors, by)
    sums = c.groupby(keys)[["completion_tokens", "rounds", "draft_tokens", "accepted_tokens"]].sum()
    out = pd.DataFrame({"completions": c.groupby(keys).size()})
    out = out.join(pd.DataFrame({"errors": e.groupby(keys).size()}), how="outer").fillna(0).astype(int)
    out = out.join(sums.rename(columns={"completion_tokens": "tokens"})).fillna(0)
    out.insert(0, "rows", out["completions"] + out["errors"])
    out = out.astype({k: int for k in ("tokens", "rounds", "draft_tokens", "accepted_tokens")})
    out["acceptance_rate"] = out["accepted_tokens"] / out["draft_tokens"].where(out["draft_tokens"] > 0)
    out["mean_accepted_length"] = out["tokens"] / out["rounds"].where(out["rounds"] > 0)
    out["engine_s"] = engine_seconds(rounds, by).reindex(out.index).fillna(0.0)
    out["tokens_per_s"] = out["tokens"] / out["engine_s"].where(out["engine_s"] > 0)
    return out


def _position_rows(draft_len: np.ndarray, accepted: np.ndarray) -> list[dict]:
    drafted = draft_len >= 1
    d, a = draft_len[drafted], accepted[drafted]
    rows = []
    for i in range(1, int(d.max(initial=0)) + 1):
        hit = int((a >= i).sum())
        reached = int(((a >= i - 1) & (d >= i)).sum())
        rows.append({"position": i, "drafts": len(d), "drafted": int((d >= i).sum()), "reached": reached,
                     "accepted": hit, "unconditional": hit / len(d),
                     "conditional": hit / reached if reached else np.nan})
    return rows


def per_position(rounds: pd.DataFrame, by=()) -> pd.DataFrame:
    """Per group and draft position i (1-based): drafts (rounds that drafted), drafted (rounds that
    drafted >= i tokens), reached (accepted >= i-1 and drafted >= i), accepted (accepted >= i),
    unconditional = accepted / drafts, conditional = accepted / reached. Groups that never drafted
    are absent."""
    df, keys = grouped(rounds, by)
    parts = []
    for key, g in df.groupby(keys):
        rows = _position_rows(g["draft_len"].to_numpy(), g["accepted"].to_numpy())
        if rows:                      # a group that never drafted has no positions
            parts.append(pd.DataFrame(rows).assign(**dict(zip(keys, key))))
    if not parts:
        cols = ["drafts", "drafted", "reached", "accepted", "unconditional", "conditional"]
        return pd.DataFrame(columns=keys + ["position"] + cols).set_index(keys + ["position"])
    return pd.concat(parts).set_index(keys + ["position"])


def counts(df: pd.DataFrame, column: str, by=()) -> pd.DataFrame:
    """Rows per group x value of `column` (finish_reason of completions, reason of errors)."""
    d, keys = grouped(df, by)
    if d.empty:
        return pd.DataFrame(index=pd.MultiIndex.from_arrays([[]] * len(keys), names=keys))
    return pd.crosstab([d[k] for k in keys], d[column])


def by_batch_size(rounds: pd.DataFrame, by=()) -> pd.DataFrame:
    """Per group and running batch size: rounds, acceptance rate (accepted / drafted) and mean draft length."""
    df, keys = grouped(rounds, by)
    g = df.groupby(keys + ["batch_size"])
    out = g[["draft_len", "accepted"]].sum()
    return pd.DataFrame({"rounds": g.size(),
                         "acceptance_rate": out["accepted"] / out["draft_len"].where(out["draft_len"] > 0),
                         "mean_draft_len": g["draft_len"].mean()})


def accepted_length_hist(rounds: pd.DataFrame, by=()) -> pd.DataFrame:
    """Per group: the share of rounds that committed k tokens (k = emitted, bonus included)."""
    df, keys = grouped(rounds, by)
    n = df.groupby(keys + ["emitted"]).size()
    share = n / n.groupby(level=keys).transform("sum")
    return pd.DataFrame({"rounds": n, "share": share})


def draft_len_by_round(rounds: pd.DataFrame, by=()) -> pd.DataFrame:
    """Per group and round index (0-based, per sequence): mean draft length and sequences still running."""
    df, keys = grouped(rounds, by)
    g = df.groupby(keys + ["round"])
    return pd.DataFrame({"mean_draft_len": g["draft_len"].mean(), "sequences": g.size()})


def tokens_per_s_over_time(rounds: pd.DataFrame, bins: int = 20, by=()) -> pd.DataFrame:
    """Per (group, worker): emitted tokens per second of engine time, in `bins` equal bins of the
    worker's cumulative step time (draft_s + verify_s of its distinct steps, in step order; a step's
    tokens spread evenly over its duration). The x axis is engine time, not wall-clock: time between
    steps (prefill, waiting for units) is not on it."""
    df, keys = grouped(rounds, by)
    parts = []
    for key, g in df.groupby(keys + ["worker"]):
        per_step = g.groupby(STEP[1:]).agg(tokens=("emitted", "sum")).reset_index()
        duration = (per_step["draft_s"] + per_step["verify_s"]).to_numpy()
        end = duration.cumsum()
        if end.size == 0 or end[-1] <= 0:
            continue
        start = end - duration
        edges = np.linspace(0.0, end[-1], bins + 1)
        # each step's tokens spread evenly over its [start, end) interval, then summed per bin
        overlap = np.clip(np.minimum(end[:, None], edges[None, 1:]) - np.maximum(start[:, None], edges[None, :-1]),
                          0.0, None)
        share = overlap / np.maximum(end - start, 1e-12)[:, None]
        tokens = per_step["tokens"].to_numpy() @ share
        width = edges[1] - edges[0]
        parts.append(pd.DataFrame({"t_s": (edges[:-1] + edges[1:]) / 2, "tokens": tokens,
                                   "tokens_per_s": tokens / width}).assign(**dict(zip(keys + ["worker"], key))))
    cols = keys + ["worker", "t_s", "tokens", "tokens_per_s"]
    return pd.concat(parts)[cols] if parts else pd.DataFrame(columns=cols)


def by_draft_shape(rounds: pd.DataFrame, by=()) -> pd.DataFrame:
    """Per group and draft shape (`tree`: several root-to-leaf paths, `path`: one, `none`: no draft):
    rounds, their share, mean draft tokens verified (a tree's size), mean accepted depth and mean
    paths. Empty for rounds logged without the `paths` column."""
    if rounds.empty or "paths" not in rounds:
        return pd.DataFrame()
    df, keys = grouped(rounds, by)
    paths = df["paths"].fillna(1).astype(int)
    df = df.assign(shape=np.where(df["draft_len"] == 0, "none", np.where(paths > 1, "tree", "path")))
    g = df.groupby(keys + ["shape"])
    n = g.size()
    return pd.DataFrame({"rounds": n, "share": n / n.groupby(level=keys).transform("sum"),
                         "mean_draft_len": g["draft_len"].mean(), "mean_accepted": g["accepted"].mean(),
                         "mean_paths": g["paths"].mean()})


def format_kind(response_format) -> str:
    """The kind of a completions row's response_format (JSON text), or `text` for free text."""
    if response_format is None or (isinstance(response_format, float) and np.isnan(response_format)):
        return "text"
    return json.loads(response_format).get("type", "?")


def by_format(completions: pd.DataFrame, rounds: pd.DataFrame, by=()) -> pd.DataFrame:
    """Per group and response_format kind: rows, valid_rate (of constrained rows), forced_share (of
    committed tokens, forced by the grammar), acceptance_rate of the drafter's own tokens (forced
    ones apart) and of the forced ones."""
    if completions.empty or "response_format" not in completions:
        return pd.DataFrame()
    c, keys = grouped(completions, by)
    c = c.assign(format=c["response_format"].map(format_kind))
    r, _ = grouped(rounds, by)
    if "forced" not in r:
        r = r.assign(forced=0, forced_accepted=0)
    r = r.merge(c[["id", "format"] + (["run"] if "run" in c and "run" in r else [])].drop_duplicates(),
                on=["id"] + (["run"] if "run" in c and "run" in r else []), how="left")
    r["format"] = r["format"].fillna("text")
    gc, gr = c.groupby(keys + ["format"]), r.groupby(keys + ["format"])
    sums = gr[["draft_len", "accepted", "forced", "forced_accepted", "emitted"]].sum()
    own = sums["draft_len"] - sums["forced"]
    return pd.DataFrame({
        "rows": gc.size(),
        "valid_rate": gc["valid"].apply(lambda v: v.dropna().astype(float).mean() if v.notna().any() else np.nan),
        "forced_share": sums["forced_accepted"] / sums["emitted"].where(sums["emitted"] > 0),
        "acceptance_rate": (sums["accepted"] - sums["forced_accepted"]) / own.where(own > 0),
        "forced_acceptance": sums["forced_accepted"] / sums["forced"].where(sums["forced"] > 0),
    })

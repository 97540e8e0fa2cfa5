"""The report's PNG plots. `plot_data` returns, per figure, the exact series drawn (so tests assert
the numbers, not just that a file exists); `render` draws a figure from those series only.

    acceptance_by_position.png  P(accepted >= i) (vLLM's per-position rate) and P(accept i | i-1 accepted)
    accepted_length.png         share of rounds that committed k tokens (bonus included)
    batch_size.png              acceptance rate and mean draft length against the running batch size
    draft_length.png            mean draft length by round index (adaptive drafting over a sequence's life)
    tokens_per_s.png            tokens/s of engine time per worker (report_stats.tokens_per_s_over_time)

A series is keyed by its group label ("all", a `--by` value, or "value / value" for several columns).
Knows nothing about storage; needs the `plots` extra (matplotlib).
"""
from __future__ import annotations

import os
import sys

import pandas as pd

from . import stats as st

FIGURES = ("acceptance_by_position", "accepted_length", "batch_size", "draft_length", "tokens_per_s")


def _label(key) -> str:
    parts = [str(k) for k in (key if isinstance(key, tuple) else (key,))]
    return " / ".join(p for p in parts if p != st.ALL) or st.ALL


def _series(df: pd.DataFrame, x: str, ys: list[str], keys: list[str]) -> dict[str, dict[str, list]]:
    """{group label: {x: [...], y1: [...], ...}} from a frame indexed or columned by keys + x."""
    flat = df.reset_index()
    out = {}
    for key, g in flat.groupby(keys if len(keys) > 1 else keys[0], sort=True):
        g = g.sort_values(x)
        out[_label(key)] = {c: g[c].tolist() for c in [x] + ys}
    return out


def plot_data(rounds: pd.DataFrame, by=(), bins: int = 20) -> dict[str, dict]:
    """figure name -> {group label: {column: values}} for every figure in FIGURES."""
    _, keys = st.grouped(rounds, by)
    return {
        "acceptance_by_position": _series(st.per_position(rounds, by), "position",
                                          ["unconditional", "conditional", "drafts"], keys),
        "accepted_length": _series(st.accepted_length_hist(rounds, by), "emitted", ["share", "rounds"], keys),
        "batch_size": _series(st.by_batch_size(rounds, by), "batch_size",
                              ["acceptance_rate", "mean_draft_len", "rounds"], keys),
        "draft_length": _series(st.draft_len_by_round(rounds, by), "round", ["mean_draft_len", "sequences"], keys),
        "tokens_per_s": _series(st.tokens_per_s_over_time(rounds, bins, by), "t_s", ["tokens_per_s"],
                                keys + ["worker"]),
    }


def render(name: str, series: dict[str, dict]):
    """The matplotlib Figure of one entry of plot_data."""
    import matplotlib
    if "matplotlib.pyplot" not in sys.modules and "MPLBACKEND" not in os.environ:
        matplotlib.use("Agg")      # headless, unless a notebook (or the user) chose a backend
    import matplotlib.pyplot as plt
    draw = {"acceptance_by_position": _draw_positions, "accepted_length": _draw_lengths,
            "batch_size": _draw_batch, "draft_length": _draw_draft_len, "tokens_per_s": _draw_tps}[name]
    fig = draw(plt, series)
    from matplotlib.ticker import MaxNLocator
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if name in ("batch_size", "draft_length"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, names = fig.axes[0].get_legend_handles_labels()
    rows = -(-len(names) // 2)
    if len(names) > 1:      # one legend under the panels: it never hides data
        fig.legend(handles, names, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, min(0.06 * rows + 0.02, 0.5) if len(names) > 1 else 0, 1, 1))
    return fig


def _draw_positions(plt, series):
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.8 / max(len(series), 1)
    for j, (label, s) in enumerate(series.items()):
        xs = [p + (j - (len(series) - 1) / 2) * width for p in s["position"]]
        a.bar(xs, s["unconditional"], width=width, label=label)
        b.bar(xs, s["conditional"], width=width, label=label)
    a.set(xlabel="draft position i", ylabel="probability", ylim=(0, 1.05),
          title="P(accepted length >= i) per drafting round\n(vLLM's per-position acceptance rate)")
    b.set(xlabel="draft position i", title="P(position i accepted | 1..i-1 accepted, i drafted)")
    _category_ticks((a, b), series, "position")
    return fig


def _category_ticks(axes, series, x: str) -> None:
    """Integer categories as ticks (a locator shows 3.6 ... 4.4 around a single bar)."""
    ticks = sorted({v for s in series.values() for v in s[x]})
    for ax in axes:
        ax.set_xticks(ticks)


def _draw_lengths(plt, series):
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(series), 1)
    for j, (label, s) in enumerate(series.items()):
        ax.bar([k + (j - (len(series) - 1) / 2) * width for k in s["emitted"]], s["share"], width=width, label=label)
    ax.set(xlabel="tokens committed in the round (accepted drafts + 1 bonus/recovered)",
           ylabel="share of rounds", ylim=(0, 1.05), title="accepted length per round")
    _category_ticks((ax,), series, "emitted")
    return fig


def _draw_batch(plt, series):
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, s in series.items():
        a.plot(s["batch_size"], s["acceptance_rate"], marker="o", label=label)
        b.plot(s["batch_size"], s["mean_draft_len"], marker="o", label=label)
    a.set(xlabel="running batch size (sequences in the step)", ylabel="accepted / drafted tokens",
          ylim=(0, 1.05), title="acceptance rate vs batch size")
    b.set(xlabel="running batch size (sequences in the step)", ylabel="draft tokens per round",
          title="draft length vs batch size")
    b.set_ylim(bottom=0, top=max([1.0] + [v for s in series.values() for v in s["mean_draft_len"]]) * 1.1)
    return fig


def _draw_draft_len(plt, series):
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, s in series.items():
        ax.plot(s["round"], s["mean_draft_len"], marker=".", label=label)
    ax.set(xlabel="round of the sequence (0 = first target forward)", ylabel="mean draft tokens per round",
           title="draft length over a sequence's rounds")
    ax.set_ylim(bottom=0, top=max([1.0] + [v for s in series.values() for v in s["mean_draft_len"]]) * 1.1)
    return fig


def _draw_tps(plt, series):
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, s in series.items():
        ax.plot(s["t_s"], s["tokens_per_s"], marker=".", label=label)
    ax.set(xlabel="worker engine time, s (sum of draft + verify per step)", ylabel="tokens/s",
           title="tokens/s over time per worker")
    return fig

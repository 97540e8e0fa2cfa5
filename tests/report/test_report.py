"""Reports: the statistics on hand-built tables with known answers (no Ray), the figures' data, the
CLI on hand-written runs (complete, partial, none, several side by side), and the notebook run top to
bottom on a real run (slow)."""
import json
import os

import pandas as pd
import pytest

from pipeline.report import summary as report, plots as report_plots
from pipeline.report import stats as st
from pipeline.io.storage import StorageConfig
from pipeline.io.schema import to_table
from pipeline.io.writer import RunOutput

# (id, kind, draft_len, accepted, emitted, step, batch_size); one worker, steps 0..2
ROUNDS = [("x", "a", 3, 2, 3, 0, 2), ("x", "a", 3, 0, 1, 1, 2),
          ("y", "b", 3, 3, 4, 0, 2), ("y", "b", 2, 1, 2, 1, 2), ("y", "b", 0, 0, 1, 2, 1)]
STEP_S = {0: (0.1, 0.3), 1: (0.1, 0.1), 2: (0.0, 0.5)}       # step -> (draft_s, verify_s)


def _rounds(rows=ROUNDS, worker="w0", unit="u0"):
    out, seen = [], {}
    for rid, kind, d, a, e, step, bs in rows:
        k = seen[rid] = seen.get(rid, -1) + 1
        out.append({"id": rid, "round": k, "draft_len": d, "accepted": a, "emitted": e,
                    "accepted_mask": [i < a for i in range(d)], "first_rejected": a if a < d else None,
                    "batch_size": bs, "draft_s": STEP_S[step][0], "verify_s": STEP_S[step][1], "step": step,
                    "worker": worker, "unit": unit, "kind": kind})
    return out


def _completions(rounds, finish="length"):
    out = []
    for rid in dict.fromkeys(r["id"] for r in rounds):
        mine = [r for r in rounds if r["id"] == rid]
        n = sum(r["emitted"] for r in mine)
        d, a = sum(r["draft_len"] for r in mine), sum(r["accepted"] for r in mine)
        out.append({"id": rid, "text": "t", "token_ids": [1] * n, "finish_reason": finish, "prompt_tokens": 3,
                    "completion_tokens": n, "rounds": len(mine), "draft_tokens": d, "accepted_tokens": a,
                    "acceptance_rate": a / d if d else None, "mean_accepted_length": n / len(mine), "seed": 0,
                    "target_model": "m", "draft_model": None, "drafter": "ngram", "config_hash": "h",
                    "run_id": "t", "unit": mine[0]["unit"], "source_file": "f", "source_row": 0,
                    "worker": mine[0]["worker"], "latency_s": 1.0, "kind": mine[0]["kind"]})
    return out


def _errors(ids_kinds, unit="u0"):
    return [{"id": i, "reason": "empty_prompt", "field": "prompt", "message": "m", "source_file": "f",
             "source_row": 0, "unit": unit, "run_id": "t", "config_hash": "h", "kind": k} for i, k in ids_kinds]


def _frames():
    r = _rounds()
    return (pd.DataFrame(_completions(r)), pd.DataFrame(r), pd.DataFrame(_errors([("z", "b")])))


def test_per_position_unconditional_is_vllms_and_conditional():
    """Drafting rounds (d, a): (3,2) (3,0) (3,3) (2,1); the (0,0) round drafted nothing and is no draft.
    vLLM: num_accepted_tokens_per_pos = [3, 2, 1], num_drafts = 4."""
    pos = st.per_position(_frames()[1])
    assert pos["drafts"].tolist() == [4, 4, 4]
    assert pos["unconditional"].tolist() == [0.75, 0.5, 0.25]
    # position 2 reached by (3,2) (3,3) (2,1); position 3 by (3,2) (3,3): the (2,1) round never drafted it
    assert pos["reached"].tolist() == [4, 3, 2]
    assert pos["conditional"].tolist() == [0.75, pytest.approx(2 / 3), 0.5]
    by_kind = st.per_position(_frames()[1], ["kind"])
    assert by_kind.loc[("a", 1), "unconditional"] == 0.5 and by_kind.loc[("b", 3), "conditional"] == 1.0
    never = pd.DataFrame(_rounds([("q", "c", 0, 0, 1, 2, 1)]))          # a group that never drafted
    assert st.per_position(pd.concat([_frames()[1], never]), ["kind"]).index.get_level_values(0).unique().tolist() \
        == ["a", "b"]
    assert st.per_position(never).empty and "conditional" in st.per_position(never) and report_plots.plot_data(never)["acceptance_by_position"] == {}


def test_summary_by_group_and_overall():
    c, r, e = _frames()
    s = st.summary(c, r, e).loc["all"]
    assert (s["rows"], s["completions"], s["errors"], s["tokens"], s["rounds"]) == (3, 2, 1, 11, 5)
    assert s["acceptance_rate"] == 6 / 11 and s["mean_accepted_length"] == 11 / 5
    assert s["engine_s"] == pytest.approx(1.1) and s["tokens_per_s"] == pytest.approx(10.0)
    k = st.summary(c, r, e, ["kind"])
    assert k.loc["a", "rows"] == 1 and k.loc["b", "rows"] == 2 and k.loc["b", "errors"] == 1
    assert k.loc["a", "engine_s"] == pytest.approx(0.6) and k.loc["a", "tokens_per_s"] == pytest.approx(4 / 0.6)
    assert k.loc["b", "mean_accepted_length"] == 7 / 3 and k.loc["b", "acceptance_rate"] == 4 / 5
    assert st.counts(e, "reason", ["kind"]).loc["b", "empty_prompt"] == 1
    assert st.counts(c, "finish_reason").loc["all", "length"] == 2


def test_a_resumed_run_counts_both_drivers_steps():
    """A second driver restarts worker names and step counters: its steps 0..2 on w0 are other steps
    than the first driver's, told apart by their timings."""
    first = _rounds()
    second = [dict(r, id="r" + r["id"], unit="u1", draft_s=2 * r["draft_s"], verify_s=2 * r["verify_s"])
              for r in _rounds()]
    rounds = pd.DataFrame(first + second)
    s = st.summary(pd.DataFrame(_completions(first) + _completions(second)), rounds, _frames()[2]).loc["all"]
    assert s["engine_s"] == pytest.approx(1.1 + 2.2) and s["tokens_per_s"] == pytest.approx(22 / 3.3)
    over_time = st.tokens_per_s_over_time(rounds, bins=1)
    assert over_time["tokens"].sum() == pytest.approx(22) and over_time["tokens_per_s"].iloc[0] == pytest.approx(22 / 3.3)


def test_plot_data_is_what_the_tables_say():
    _, r, _ = _frames()
    d = report_plots.plot_data(r, bins=2)
    assert d["acceptance_by_position"]["all"]["unconditional"] == [0.75, 0.5, 0.25]
    assert d["accepted_length"]["all"] == {"emitted": [1, 2, 3, 4], "share": [0.4, 0.2, 0.2, 0.2],
                                           "rounds": [2, 1, 1, 1]}
    assert d["batch_size"]["all"]["batch_size"] == [1, 2]
    assert d["batch_size"]["all"]["acceptance_rate"][1] == 6 / 11
    assert d["draft_length"]["all"]["mean_draft_len"] == [3.0, 2.5, 0.0]
    # steps [0, 0.4) 7 tokens, [0.4, 0.6) 3, [0.6, 1.1) 1; bins [0, 0.55), [0.55, 1.1): 7 + 3 * 0.15/0.2, then the rest
    tps = d["tokens_per_s"]["w0"]
    assert tps["t_s"] == pytest.approx([0.275, 0.825])
    assert tps["tokens_per_s"] == pytest.approx([9.25 / 0.55, 1.75 / 0.55])
    k = report_plots.plot_data(r, ["kind"], bins=2)
    assert set(k["acceptance_by_position"]) == {"a", "b"} and set(k["tokens_per_s"]) == {"a / w0", "b / w0"}


# ---- runs on disk (no Ray) ------------------------------------------------------------------------------
def _write_run(root, run_id, planned, committed, finalize=False):
    """A run folder as the writer leaves it: plan, then the given units committed (same rows each)."""
    out = RunOutput(str(root), run_id, StorageConfig())
    out.fs.makedirs(out.path, exist_ok=True)
    (root / run_id / "_plan.json").write_text(json.dumps({"config_hash": "h", "units": planned}))
    for uid in committed:
        rounds = [{**r, "id": f"{uid}-{r['id']}", "unit": uid} for r in _rounds()]
        tables = {"rounds": to_table("rounds", rounds, ["kind"]),
                  "completions": to_table("completions", _completions(rounds), ["kind"]),
                  "errors": to_table("errors", _errors([(f"{uid}-z", "b")], uid), ["kind"])}
        out.write_unit(uid, tables, {"rows": 3})
    if finalize:
        out.finalize({})
    return str(root / run_id)


def test_cli_complete_partial_and_no_run(tmp_path, capsys):
    done = _write_run(tmp_path, "done", ["u0", "u1"], ["u0", "u1"], finalize=True)
    assert report.main([done, "--by", "kind"]) == 0
    text = capsys.readouterr().out
    assert "done: complete: 2/2 units" in text and "acceptance per draft position" in text
    partial = _write_run(tmp_path, "part", [f"u{i}" for i in range(8)], ["u1", "u4"])
    assert report.main([partial]) == 0
    assert "part: partial: 2/8 units committed; missing: u0, u2, u3, u5, u6 (+1 more)" in capsys.readouterr().out
    none = _write_run(tmp_path, "none", ["u0"], [])
    assert report.main([none]) == 1 and "no committed unit yet (0/1 units)" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 1
    assert "no run here" in capsys.readouterr().out
    assert report.main([str(tmp_path / "nothing-*")]) == 1
    assert report.main([done, none]) == 1          # the empty run is named, the other still reported
    text = capsys.readouterr().out
    assert "none: no committed unit yet" in text and "== summary" in text
    assert report.main([done, "--by", "nope"]) == 2 and "['kind']" in capsys.readouterr().err


def test_cli_slots_side_by_side_with_plots(tmp_path, capsys):
    for slot in ("2026-11-30T00", "2026-11-30T01"):
        (tmp_path / f"slot={slot}").mkdir()
        _write_run(tmp_path / f"slot={slot}", f"synthetic-{slot}", ["u0"], ["u0"], finalize=True)
    plots = tmp_path / "plots"
    rc = report.main([str(tmp_path / "slot=*" / "synthetic-*"), "--by", "kind", "--plots", str(plots), "--bins", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "slot=2026-11-30T00: complete" in text
    urls = report.expand_runs([str(tmp_path / "slot=*" / "synthetic-*")])
    frames = report.load_frames([report.run_status(u, label) for u, label in zip(urls, report.labels(urls))])
    s = st.summary(frames["completions"], frames["rounds"], frames["errors"], ["run", "kind"])
    assert len(s) == 4 and set(s["tokens"]) == {4, 7}
    for name in report_plots.FIGURES:
        assert (plots / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


# ---- the notebook on a real run (Ray, tiny model) ------------------------------------------------------
@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tiny_model_dir, ray_head, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from pipeline.cluster.driver import run_job
    from pipeline_util import job_config, prompt_rows, write_parquet
    rows = [{**r, "kind": "even" if i % 2 == 0 else "odd"} for i, r in enumerate(prompt_rows(9, "r"))]
    write_parquet(tmp_path / "in" / "a.parquet", rows)
    cfg = job_config(tiny_model_dir, str(tmp_path / "in"), str(tmp_path / "out"),
                     f"cluster.address={ray_head.address}", "input.passthrough_columns=[kind]",
                     "drafting.method=draft", f"models.draft={tiny_model_dir}")   # the target drafts: all accepted
    summary = run_job(cfg)
    assert summary["accepted_tokens"] == summary["draft_tokens"] > 0
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    nb = nbformat.read(os.path.join(repo, "notebooks", "acceptance.ipynb"), as_version=4)
    env = {"SPECPIPE_RUN": str(tmp_path / "out" / "t"),      # the kernel imports this checkout's pipeline
           "PYTHONPATH": os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:   # kernel "python3" = ipykernel's own spec: jupyter_client runs it with this interpreter
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    outputs = "".join(o.get("text", "") + json.dumps(o.get("data", {}))
                      for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert f"rows: {summary['rows']}" in outputs and f"tokens: {summary['tokens']}" in outputs
    assert "grouping by ['kind']" in outputs and "unconditional" in outputs and "even" in outputs and "odd" in outputs
    assert outputs.count("image/png") == len(report_plots.FIGURES)


def test_per_format_validity_forced_share_and_acceptance():
    """x: a json_schema row, 2 of its 6 proposed tokens forced (both accepted), 2 of its 4 own drafts
    accepted, valid; y: free text. Known answers by hand."""
    rounds = pd.DataFrame(_rounds())
    rounds["forced"] = [2, 0, 0, 0, 0]
    rounds["forced_accepted"] = [2, 0, 0, 0, 0]
    comps = pd.DataFrame(_completions(_rounds()))
    comps["response_format"] = [json.dumps({"type": "json_schema", "json_schema": {"type": "object"}}), None]
    comps["valid"] = [True, None]
    table = st.by_format(comps, rounds)
    x, y = table.loc[("all", "json_schema")], table.loc[("all", "text")]
    assert x["rows"] == 1 and x["valid_rate"] == 1.0
    assert x["forced_share"] == 2 / 4                      # 2 forced of the 3 + 1 tokens x committed
    assert x["acceptance_rate"] == (2 - 2) / (6 - 2)       # accepted 2 + 0, both of them forced
    assert x["forced_acceptance"] == 1.0
    assert y["rows"] == 1 and pd.isna(y["valid_rate"]) and y["acceptance_rate"] == 4 / 5


def test_draft_shapes_split_trees_paths_and_no_draft():
    rounds = pd.DataFrame(_rounds()).assign(paths=[3, 1, 1, 2, 0])    # x: a tree then a path; y: ...
    table = st.by_draft_shape(rounds, ["kind"])
    a_tree, a_path = table.loc[("a", "tree")], table.loc[("a", "path")]
    assert a_tree["rounds"] == 1 and a_tree["share"] == 0.5 and a_tree["mean_paths"] == 3
    assert a_path["mean_accepted"] == 0 and a_path["mean_draft_len"] == 3
    b = table.loc["b"]
    assert set(b.index) == {"tree", "path", "none"} and b.loc["none", "rounds"] == 1
    assert b.loc["tree", "mean_accepted"] == 1 and b["share"].sum() == pytest.approx(1.0)
    assert st.by_draft_shape(pd.DataFrame(_rounds())).empty          # logged without `paths`

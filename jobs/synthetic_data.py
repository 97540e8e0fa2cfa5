"""Scheduled synthetic-data job, one committed result per time slot:

    python jobs/synthetic_data.py --config configs/synthetic.yaml [--slot 2026-11-30T00] [key=value ...]
    python jobs/synthetic_data.py --config configs/synthetic.yaml --preview 2      # nothing written

Expands the seed set (synthetic.seeds) x templates x samples into rows with per-row seeds, generates
them with the same driver, workers and writer as jobs/generate.py, and commits them under
`<output.path>/slot=<slot>/` with a quality gate (curated/, kept/), stage by stage where the config has
`synthetic.stages`, then a dataset card (README.md) and provenance.json. `--preview N` generates N rows
per template and stage in this process and prints them, committing nothing. The slot is `--slot`, else the most
recent fire time of schedule.cron in schedule.timezone (hourly: the hour that just started). See
pipeline/synthetic/job.py for the layout and the exactly-once protocol.

Exit codes: 0 once the slot is committed -- by this run, or already (a repeat commits nothing and
says "slot ... already committed by run ..."), or while another live run is generating it (this
one commits nothing; the message names the holder); 2 for a bad config, schedule, slot, seed set,
model or output location (nothing ran), or a slot started with another config; 1 for a failed job
(rerunning resumes); 130 / 143 after SIGINT / SIGTERM (committed units stay; rerun to resume).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.errors import ConfigError  # noqa: E402
from pipeline.synthetic.schedule import ScheduleError  # noqa: E402
from pipeline.synthetic.config import load_synthetic_config  # noqa: E402
from pipeline.synthetic.plan import plan_slot, resolve_slot  # noqa: E402
from pipeline.synthetic.stages import SeedError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (configs/synthetic.yaml)")
    parser.add_argument("--slot", help="the slot to generate (YYYY-MM-DDTHH, or YYYY-MM-DDTHH-MM for schedules "
                                       "firing several times an hour); default: the schedule's current slot")
    parser.add_argument("--show", type=int, default=2, help="completions to print at the end")
    parser.add_argument("--preview", type=int, metavar="N", help="generate N rows per template and stage in this "
                                                                  "process and print them; nothing is written")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. synthetic.seeds_per_slot=8")
    args = parser.parse_intermixed_args(argv)      # overrides may come before and after --slot
    try:
        cfg = load_synthetic_config(args.config, args.overrides)
        slot = resolve_slot(cfg.schedule, args.slot)
        plan = plan_slot(cfg, slot)
    except (ConfigError, ScheduleError, SeedError) as e:
        kind = next(name for cls, name in ((ScheduleError, "slot/schedule"), (SeedError, "seed set"),
                                           (ConfigError, "config")) if isinstance(e, cls))
        print(f"{kind} error: {e}", file=sys.stderr)
        return 2
    if args.preview is not None:
        return show_preview(cfg, plan, args.preview)
    print(f"slot {slot}: {len(plan.rows)} rows -> {plan.url}", flush=True)
    return run(plan, args.show)


def show_preview(cfg, plan, n: int) -> int:
    from pipeline.job.runtime import build_engine
    from pipeline.synthetic.preview import preview, table
    if n < 1:
        print("config error: --preview: expected N >= 1", file=sys.stderr)
        return 2
    loaded = build_engine(cfg.models, cfg.drafting, cfg.engine, storage=cfg.storage.with_environment())
    shown = preview(cfg, plan.slot, n, plan.seeds, loaded)
    print(table(shown))
    print(f"preview of slot {plan.slot}: {len(shown)} rows, {n} per template and stage; nothing written "
          f"(the run writes {plan.url})")
    return 0


def run(plan, show: int) -> int:
    from pipeline.cli import run_job_guarded
    from pipeline.report.summary import print_summary
    from pipeline.synthetic.job import run_slot
    code, result = run_job_guarded(lambda stop: run_slot(plan, stop), "rerun the same command to resume")
    if code:
        return code
    if result.summary is not None:
        print_summary(result.summary, show=show, storage=plan.job.storage)
        for stage in result.slot_summary["stages"]:
            print(stage_line(stage))
        s = result.slot_summary
        print(f"{s['errors']} input rows failed{' ' + str(s['error_reasons']) if s['error_reasons'] else ''}; "
              f"dataset card: {plan.url}/README.md")
    print(result.message)
    return 0


def stage_line(stage: dict) -> str:
    """One stage's quality line: what it checked, flagged (not dropped) and kept."""
    name = f"stage {stage['id']}" if stage["id"] else "quality"
    q = stage["quality"]
    if stage["kind"] == "judge":
        return (f"{name}: {q['judged']} rows judged, {q['rejected']} rejected (flagged, not dropped), "
                f"{q['kept']} kept; mean score {q['mean_score']}")
    return (f"{name}: {q['checked']} completions checked: {q.get('empty', 0)} empty, {q.get('truncated', 0)} truncated, "
            f"{q.get('duplicate', 0)} duplicates, {q.get('near_duplicate', 0)} near-duplicates, {q.get('invalid', 0)} "
            f"invalid (flagged, not dropped), {q['kept']} kept")


if __name__ == "__main__":
    sys.exit(main())

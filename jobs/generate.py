"""Batch generation job: `python jobs/generate.py --config configs/demo.yaml [key=value ...]`.

Runs on the Ray cluster it is submitted to (`ray job submit ... -- python jobs/generate.py ...`),
on `cluster.address`, or else on a local Ray it starts (loopback, token auth, no dashboard). The
config, the output location, the models and the input plan are checked before any actor starts.

Exit codes: 0 once the run's manifest and _SUCCESS marker are written; 2 for a bad config, input,
model or output location (nothing ran); 3 when another live driver holds the run (nothing ran);
1 for a failed job (the message names the cause; rerunning resumes); 130 / 143 after SIGINT /
SIGTERM (committed units stay; the same command resumes).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline.errors import ConfigError
from pipeline.job.config import load_config  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (configs/*.yaml)")
    parser.add_argument("--show", type=int, default=3, help="completions to print at the end")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. engine.max_num_seqs=32")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    from pipeline.cli import run_job_guarded
    from pipeline.cluster.driver import run_job
    from pipeline.report.summary import print_summary
    code, summary = run_job_guarded(lambda stop: run_job(cfg, stop), f"resume with: {resume_command(argv)}")
    if code:
        return code
    print_summary(summary, show=args.show, storage=cfg.storage)
    return 0


def resume_command(argv) -> str:
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join([os.path.basename(sys.executable), "jobs/generate.py", *args])


if __name__ == "__main__":
    sys.exit(main())

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

from pipeline.config import ConfigError, load_config  # noqa: E402


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
    from pipeline.cluster.driver import Interrupted, JobFailed, RunBusy, StopRequest, run_job
    from pipeline.io.reader import InputError
    from pipeline.io.writer import OutputError
    from pipeline.report import print_summary
    stop = StopRequest()
    stop.install()
    try:
        summary = run_job(cfg, stop)
    except (InputError, OutputError) as e:
        print(f"input/output error: {e}", file=sys.stderr)
        return 2
    except RunBusy as e:
        print(f"not started: {e}", file=sys.stderr)
        return 3
    except JobFailed as e:
        print(f"job failed: {e}\nthe committed units stay; rerun the same command to resume", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"{e}; uncommitted units left nothing visible.\nresume with: {resume_command(argv)}", file=sys.stderr)
        return 128 + e.signum
    print_summary(summary, show=args.show, storage=cfg.storage)
    return 0


def resume_command(argv) -> str:
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join([os.path.basename(sys.executable), "jobs/generate.py", *args])


if __name__ == "__main__":
    sys.exit(main())

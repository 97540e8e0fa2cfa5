"""Batch generation job: `python jobs/generate.py --config configs/demo.yaml [key=value ...]`.

Runs on the Ray cluster it is submitted to (`ray job submit ... -- python jobs/generate.py ...`),
on `cluster.address`, or else on a local Ray it starts (loopback, token auth, no dashboard). The
config and the input plan are checked before any model loads or any actor starts. Exits 0 only
after the run's manifest and _SUCCESS marker are written; 2 on a bad config or input; 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
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
    from pipeline.cluster.driver import JobFailed, run_job
    from pipeline.io.reader import InputError
    from pipeline.io.writer import OutputError
    from pipeline.report import print_summary
    try:
        summary = run_job(cfg)
    except (InputError, OutputError) as e:
        print(f"input/output error: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"job failed: {e}", file=sys.stderr)
        return 1
    print_summary(summary, show=args.show, storage=cfg.storage)
    return 0


if __name__ == "__main__":
    sys.exit(main())

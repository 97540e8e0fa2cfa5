"""`python -m pipeline.synthetic export RUN_URL DEST [--stage ID] [--push-to-hub REPO]`: see export.py."""
from __future__ import annotations

import argparse
import sys

from .export import ExportError, export


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.synthetic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="the kept rows of every committed slot as a `datasets` folder")
    ex.add_argument("run_url", help="the synthetic job's output.path")
    ex.add_argument("dest", help="the folder Dataset.save_to_disk writes")
    ex.add_argument("--stage", help="the stage whose kept rows to export (default: the last)")
    ex.add_argument("--push-to-hub", metavar="REPO", help="then push the dataset to this hub repo")
    args = parser.parse_args(argv)
    try:
        print(export(args.run_url, args.dest, args.stage, args.push_to_hub))
    except ExportError as e:
        print(f"export error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

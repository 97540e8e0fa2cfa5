"""Batch generation job: `python jobs/generate.py --config configs/demo.yaml [key=value ...]`.

Today it runs one engine in this process (pipeline/local.py); the Ray driver will sit behind the same
command. The config is validated before any model is loaded.
"""
from __future__ import annotations

import argparse
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
    from pipeline.local import run_local
    result = run_local(cfg)
    for c in result["completions"][:args.show]:
        print(f"\n--- {c.request_id} ({c.finish_reason}, {len(c.output_ids)} tokens, "
              f"{c.num_accepted}/{c.num_draft_tokens} drafts accepted)\n{c.text}")
    for e in result["errors"]:
        print(f"error row {e['id']}: {e['message']}", file=sys.stderr)
    s = result["summary"]
    print(f"\n{s['completions']} completions, {s['errors']} errors, {s['new_tokens']} tokens in {s['wall_s']} s "
          f"({s['tokens_per_s']} tok/s), acceptance {s['acceptance_rate']}, "
          f"{s['mean_tokens_per_round']} tokens/round; outputs in {cfg.output.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""specpipe inside a Ray Data pipeline: read Parquet -> filter -> generate -> judge -> write Parquet.

    python jobs/ray_data_pipeline.py --input data/demo --output out/ray_data [--checkpoint out/ray_data_ckpt]

Input rows carry `messages` (a chat, as the demo's data/demo/mtbench_humaneval.parquet) or, with
--text-column, a text asked as one user message; rows come back with the processor's columns
(generated_text, acceptance, error, ...) and a toy "judge" column computed from them. With --checkpoint, Ray Data's checkpointing by the `id` column (the
input's `--id-column`) makes a killed run, rerun with the same command, write every id once.
Runs on `--address` (a Ray cluster: `ray job submit -- python jobs/ray_data_pipeline.py ...`) or
else on a local Ray it starts (loopback, token auth, no dashboard).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="data/demo/mtbench_humaneval.parquet", help="Parquet file(s)/folder/URL")
    parser.add_argument("--output", default="out/ray_data", help="folder/URL the Parquet output goes to")
    parser.add_argument("--checkpoint", default=None, help="folder/URL of Ray Data's checkpoint (resume by id)")
    parser.add_argument("--id-column", default="id")
    parser.add_argument("--text-column", default=None, help="ask this column as one user message")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="rows at most (after the filter)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--cpus-per-replica", type=float, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=None, help="repartition into this many blocks (output files)")
    parser.add_argument("--rounds-path", default=None, help="folder/URL for the per-round acceptance log")
    parser.add_argument("--address", default=None, help="Ray address (default: a new local Ray)")
    args = parser.parse_args(argv)

    import ray
    import ray.data

    from pipeline.cluster.driver import connect
    from pipeline.job.config import ClusterConfig
    from pipeline.errors import ConfigError
    from pipeline.processor import SpecpipeProcessorConfig, actor_cpus, build_processor
    ctx = ray.data.DataContext.get_current()
    if args.checkpoint:
        from ray.data.checkpoint import CheckpointConfig
        ctx.checkpoint_config = CheckpointConfig(id_column=args.id_column, checkpoint_path=os.path.abspath(
            args.checkpoint) if "://" not in args.checkpoint else args.checkpoint)
    started = False
    try:
        config = SpecpipeProcessorConfig(
            models={"target": args.model}, drafting={"method": "ngram", "adaptive": True},
            sampling={"max_tokens": args.max_tokens, "temperature": 0.0},
            batch_size=args.batch_size, concurrency=args.replicas, num_cpus=args.cpus_per_replica,
            id_column=args.id_column, rounds_path=args.rounds_path)
        # a local Ray gets the CPUs of the dataset's actors (the replicas and, resuming from a checkpoint, Ray
        # Data's checkpoint filter) + 1 for Ray Data's read, map and write tasks: with exactly the actors' CPUs
        # the reads would get none and the dataset would wait forever (the processor refuses such a cluster)
        started = connect(ClusterConfig(address=args.address), actor_cpus(config) + 1)
        text, max_tokens = args.text_column, args.max_tokens
        processor = build_processor(
            config,
            preprocess=(lambda row: {**row, "messages": [{"role": "user", "content": row[text]}]}) if text else None,
            postprocess=lambda row: {**row, "judged_long": (row["num_generated_tokens"] or 0) >= max_tokens})
        ds = ray.data.read_parquet(args.input if "://" in args.input else os.path.abspath(args.input))
        if text:
            ds = ds.filter(lambda row: bool(row[text] and row[text].strip()))
        if args.limit is not None:
            ds = ds.limit(args.limit)
        if args.blocks is not None:
            ds = ds.repartition(args.blocks)
        processor(ds).write_parquet(args.output if "://" in args.output else os.path.abspath(args.output))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    finally:
        if started:
            ray.shutdown()
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# A change's A/B: the same engine run (bench.run_one) from a worktree of REV and from this checkout, in
# turn, one process per run, the order swapped each pair, so the machine's drift hits both alike.
#
#     bash bench/research/ab_commits.sh REV PAIRS NAME RUN_ONE_ARGS...
#     bash bench/research/ab_commits.sh 9095d23 3 b1 --model smollm2 --drafter ngram --adaptive --batch 1 \
#         --prompts bench/out/prompts_4.json --max-tokens 128 --dtype float32
#
# Writes bench/out/ab/NAME/{base,head}_<pair>.json and prints tokens/s per run, each pair's head/base ratio
# and whether the two produced the same tokens (bench.run_one's outputs).
set -eu
cd "$(dirname "$0")/../.."
REV=${1:?usage: ab_commits.sh REV PAIRS NAME RUN_ONE_ARGS...}; PAIRS=${2:?}; NAME=${3:?}; shift 3
PY=$PWD/.venv/bin/python
OUT=$PWD/bench/out/ab/$NAME
TREE=$PWD/bench/out/ab/tree-$(git rev-parse --short "$REV")
mkdir -p "$OUT"
[ -d "$TREE" ] || git worktree add --detach -f "$TREE" "$REV" >/dev/null
args=()
for a in "$@"; do   # paths into this checkout stay valid from the worktree
    if [ -e "$a" ]; then args+=("$(realpath "$a")"); else args+=("$a"); fi
done
run() {   # run base|head PAIR: one process, from the worktree (base) or this checkout (head)
    local dir=$PWD
    [ "$1" = base ] && dir=$TREE
    (cd "$dir" && "$PY" -m bench.run_one --mode engine "${args[@]}" --out "$OUT/$1_$2.json") >/dev/null
}
for i in $(seq 1 "$PAIRS"); do
    if [ $((i % 2)) = 1 ]; then run base "$i"; run head "$i"; else run head "$i"; run base "$i"; fi
done
"$PY" - "$OUT" "$PAIRS" <<'EOF'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
runs = {(s, i): json.load(open(f"{out}/{s}_{i}.json")) for s in ("base", "head") for i in range(1, pairs + 1)}
tok = {k: r["tokens_per_s"] for k, r in runs.items()}
for s in ("base", "head"):
    values = [tok[(s, i)] for i in range(1, pairs + 1)]
    print(f"{s}: tok/s median {statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
ratios = [tok[("head", i)] / tok[("base", i)] for i in range(1, pairs + 1)]
print("head/base per pair:", " / ".join(f"{r:.3f}" for r in ratios), f"median {statistics.median(ratios):.3f}")
same = all(runs[("base", i)].get("outputs") == runs[("head", i)].get("outputs") for i in range(1, pairs + 1))
print("same tokens:", same)
EOF

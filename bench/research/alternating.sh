#!/usr/bin/env bash
# The bench/RESULTS.md tables whose runs alternate configurations: one bench.run_one process per run,
# configurations taken in turn, so the machine's drift hits every one alike.
#
#     bash bench/research/alternating.sh suffix-rules     # suffix draft rules, SmolLM2, templated, batch 4
#     bash bench/research/alternating.sh prefix-reuse     # SmolLM2 prefix reuse on / off, templated and grounded
#     bash bench/research/alternating.sh qwen-prefix      # Qwen pair, draft model + prefix reuse on / off, batch 4
#     bash bench/research/alternating.sh qwen-draft-cap   # Qwen pair, bf16 draft, adaptive, draft cap 4 / 6, batch 1
#     bash bench/research/alternating.sh adaptive-pairs   # SmolLM2 n-gram fixed / adaptive at batch 1, plain / adaptive all at once
#     bash bench/research/alternating.sh adaptive-default # SmolLM2, the auto dtype: plain / adaptive n-gram at batch 1, 64 and 240 at once
#     bash bench/research/alternating.sh adaptive-240-fp32 # SmolLM2 fp32, 240 prompts, max_num_seqs auto: adaptive n-gram / plain, order alternating
#     bash bench/research/alternating.sh adaptive-b1-fp32  # SmolLM2 fp32, 4 prompts at batch 1: adaptive n-gram / plain, order alternating, 5 pairs
#
# Prompt files are made by bench.make_prompts / bench.make_templated when missing. Each mode writes one
# JSON per run under bench/out/<mode>/ (tokens_per_s, acceptance_rate, mean_tokens_per_round, ...).
set -eu
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
mkdir -p bench/out

need() {   # need FILE COMMAND...: run COMMAND (which writes FILE) unless FILE exists
    local file=$1; shift
    [ -f "$file" ] || "$@"
}
span() {   # span A B SRC DST: prompts A .. B - 1 of SRC
    "$PY" -c "import json, sys; json.dump(json.load(open(sys.argv[3]))[int(sys.argv[1]):int(sys.argv[2])], open(sys.argv[4], 'w'))" "$1" "$2" "$3" "$4"
}
first() {  # first N SRC DST: the first N prompts of SRC
    span 0 "$1" "$2" "$3"
}
one() {    # one OUT ARGS...: one engine run
    local out=$1; shift
    echo "$out" >&2
    "$PY" -m bench.run_one --mode engine "$@" --out "$out"
}

MODE=${1:?usage: bash bench/research/alternating.sh suffix-rules|prefix-reuse|qwen-prefix|qwen-draft-cap|adaptive-pairs|adaptive-default|adaptive-240-fp32|adaptive-b1-fp32}
OUT=bench/out/$MODE
mkdir -p "$OUT"
TEMPLATED=bench/out/prompts_templated.json
templated() { need $TEMPLATED "$PY" -m bench.make_templated --seeds-per-slot 16 --samples 2 --out $TEMPLATED; }
P256=bench/out/prompts_smollm2_256.json
mixed256() { need $P256 "$PY" -m bench.make_prompts --model smollm2-135m-instruct --n 256 --out $P256; }

case $MODE in
suffix-rules)
    templated
    first 48 $TEMPLATED "$OUT/prompts_48.json"
    run() { one "$OUT/$2.json" --model smollm2 --drafter "$1" --batch 4 --prompts "$OUT/prompts_48.json" \
                --max-tokens 128 --temperature 0.7 --dtype float32 --suffix "$3"; }
    for i in 1 2; do
        run none none_$i '{}'
        run suffix default_$i '{}'
        run suffix mm1_$i '{"min_match": 1}'
        run suffix mm1_f2_$i '{"min_match": 1, "max_spec_factor": 2}'
        run suffix mm1_p05_$i '{"min_match": 1, "min_prob": 0.05}'
    done ;;
prefix-reuse)
    GROUNDED=bench/out/prompts_grounded.json
    need $GROUNDED "$PY" -m bench.make_prompts --grounded --n 32 --out $GROUNDED
    templated
    first 48 $TEMPLATED "$OUT/prompts_48.json"
    for rep in 1 2; do
        for batch in 4 48; do
            for drafter in none suffix; do
                for reuse in on off; do
                    one "$OUT/templated_${drafter}_b${batch}_${reuse}_$rep.json" --model smollm2 --drafter $drafter \
                        --batch $batch --prompts "$OUT/prompts_48.json" --max-tokens 128 --temperature 0.7 \
                        --dtype float32 --prefix-reuse $reuse
                done
            done
        done
    done
    for drafter in none suffix; do
        for reuse in on off; do
            one "$OUT/grounded_${drafter}_b4_$reuse.json" --model smollm2 --drafter $drafter --batch 4 \
                --prompts $GROUNDED --max-tokens 128 --temperature 0 --dtype float32 --prefix-reuse $reuse
        done
    done ;;
qwen-prefix)
    QT=bench/out/prompts_qwen_templated.json
    need $QT "$PY" -m bench.make_templated --model qwen2.5-coder-1.5b-instruct --seeds-per-slot 6 --samples 2 --out $QT
    first 8 $QT "$OUT/prompts_8.json"
    for rep in 1 2; do
        for reuse in on off; do
            one "$OUT/prefix_${reuse}_$rep.json" --model qwen --drafter draft --adaptive --batch 4 --max-tokens 64 \
                --dtype float32 --draft-dtype auto --prefix-reuse $reuse --prompts "$OUT/prompts_8.json"
        done
    done ;;
qwen-draft-cap)
    Q16=bench/out/prompts_qwen_16.json
    need $Q16 "$PY" -m bench.make_prompts --model qwen2.5-coder-1.5b-instruct --n 16 --out $Q16
    first 2 $Q16 "$OUT/prompts_2.json"
    for rep in 0 1; do
        for g in 4 6; do
            one "$OUT/adaptive_bf16draft_g${g}_$rep.json" --model qwen --drafter draft --batch 1 --adaptive --g $g \
                --dtype float32 --draft-dtype bfloat16 --max-tokens 128 --prompts "$OUT/prompts_2.json"
        done
        one "$OUT/none_$rep.json" --model qwen --drafter none --batch 1 --calibrate --dtype float32 \
            --max-tokens 128 --prompts "$OUT/prompts_2.json"
    done ;;
adaptive-pairs)
    mixed256
    first 4 $P256 "$OUT/prompts_4.json"
    first 64 $P256 "$OUT/prompts_64.json"
    for rep in 1 2 3; do
        one "$OUT/ngram_b1_$rep.json" --model smollm2 --drafter ngram --batch 1 --calibrate --dtype float32 \
            --max-tokens 128 --prompts "$OUT/prompts_4.json"
        one "$OUT/adaptive_ngram_b1_$rep.json" --model smollm2 --drafter ngram --batch 1 --adaptive --dtype float32 \
            --max-tokens 128 --prompts "$OUT/prompts_4.json"
    done
    for rep in 1 2; do
        one "$OUT/none_all_$rep.json" --model smollm2 --drafter none --batch 64 --calibrate --dtype float32 \
            --max-tokens 128 --prompts "$OUT/prompts_64.json"
        one "$OUT/adaptive_ngram_all_$rep.json" --model smollm2 --drafter ngram --batch 64 --adaptive --dtype float32 \
            --max-tokens 128 --prompts "$OUT/prompts_64.json"
    done ;;
adaptive-default)
    mixed256
    span 64 68 $P256 "$OUT/prompts_b1.json"
    first 64 $P256 "$OUT/prompts_64.json"
    first 240 $P256 "$OUT/prompts_240.json"
    run() { one "$OUT/$1.json" --model smollm2 --batch "$2" --prompts "$OUT/prompts_$3.json" --max-tokens 128 \
                --dtype auto "${@:4}"; }
    for rep in 1 2 3; do
        run none_b1_$rep 1 b1 --drafter none
        run adaptive_ngram_b1_$rep 1 b1 --drafter ngram --adaptive
        run none_64_$rep 64 64 --drafter none
        run adaptive_ngram_64_$rep 64 64 --drafter ngram --adaptive
    done
    for rep in 1 2; do
        run adaptive_ngram_240_$rep 128 240 --drafter ngram --adaptive
        run none_240_$rep 128 240 --drafter none
    done ;;
adaptive-240-fp32)
    mixed256
    first 240 $P256 "$OUT/prompts_240.json"
    for rep in 1 2 3; do
        order="ngram none"; [ $((rep % 2)) = 0 ] && order="none ngram"
        for d in $order; do
            extra=""; [ $d = ngram ] && extra="--adaptive"
            one "$OUT/${d}_240_$rep.json" --model smollm2 --batch auto --prompts "$OUT/prompts_240.json" \
                --max-tokens 128 --dtype float32 --drafter $d $extra
        done
    done ;;
adaptive-b1-fp32)
    mixed256
    first 4 $P256 "$OUT/prompts_4.json"
    for rep in 1 2 3 4 5; do
        order="ngram none"; [ $((rep % 2)) = 0 ] && order="none ngram"
        for d in $order; do
            extra=""; [ $d = ngram ] && extra="--adaptive"
            one "$OUT/${d}_b1_$rep.json" --model smollm2 --batch 1 --prompts "$OUT/prompts_4.json" \
                --max-tokens 128 --dtype float32 --drafter $d $extra
        done
    done ;;
*)
    echo "unknown mode $MODE" >&2; exit 2 ;;
esac

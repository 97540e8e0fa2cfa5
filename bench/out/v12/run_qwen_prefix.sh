#!/usr/bin/env bash
# Draft-model prefix reuse on the real Qwen pair (engine.prefix_reuse on vs off), templated prompts
# (bench.make_templated --model qwen2.5-coder-1.5b-instruct --seeds-per-slot 6 --samples 2, first 8),
# batch 4, greedy, 64 new tokens, fp32 target, draft_dtype auto (bf16 where the CPU has avx512_bf16; fp32 on session 12's AVX2 box), adaptive; 2 rounds alternating.
set -eu
cd "$(dirname "$0")/../../.."
OUT=bench/out/v12
PROMPTS=bench/out/prompts_qwen_templated_8.json
if [ ! -f $PROMPTS ]; then
  .venv/bin/python -m bench.make_templated --model qwen2.5-coder-1.5b-instruct --seeds-per-slot 6 --samples 2 \
    --out bench/out/prompts_qwen_templated.json
  .venv/bin/python -c "import json; json.dump(json.load(open('bench/out/prompts_qwen_templated.json'))[:8], open('$PROMPTS', 'w'))"
fi
for rep in 1 2; do
  for pr in on off; do
    .venv/bin/python -m bench.run_one --mode engine --model qwen --drafter draft --adaptive --batch 4 \
      --max-tokens 64 --dtype float32 --draft-dtype auto --prefix-reuse $pr \
      --prompts $PROMPTS --out $OUT/qwen_prefix_${pr}_$rep.json
  done
done

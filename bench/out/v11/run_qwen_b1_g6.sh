cd $(git rev-parse --show-toplevel)
# the bf16 draft is cheap: does a longer draft cap (num_speculative_tokens 6) pay at batch 1?
date > bench/out/v11/qwen_b1_g6.times
P=bench/out/v11/qwen_b1_pairs/prompts_2.json
for rep in 0 1; do
  for g in 4 6; do
    .venv/bin/python -m bench.run_one --model qwen --mode engine --drafter draft --batch 1 --adaptive --g $g --dtype float32 --draft-dtype bfloat16 \
      --max-tokens 128 --prompts $P --out bench/out/v11/qwen_b1_g6/adaptive_bf16_g${g}_${rep}.json 2>> bench/out/v11/qwen_b1_g6.log
  done
  .venv/bin/python -m bench.run_one --model qwen --mode engine --drafter none --batch 1 --calibrate --dtype float32 \
      --max-tokens 128 --prompts $P --out bench/out/v11/qwen_b1_g6/none_${rep}.json 2>> bench/out/v11/qwen_b1_g6.log
done
date >> bench/out/v11/qwen_b1_g6.times
echo done > bench/out/v11/qwen_b1_g6.done

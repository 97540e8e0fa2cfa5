cd $(git rev-parse --show-toplevel)
date > bench/out/v11/qwen_all.times
.venv/bin/python -m bench.bench --model qwen --prompts bench/out/prompts_qwen_16.json --n-all 8 --n-b1 2 --max-tokens 128 --repeats 2 --dtype float32 \
  --out bench/out/v11/qwen_all.json --only ours_none_all ours_adaptive_draft_all ours_adaptive_draft_bf16draft_all > bench/out/v11/qwen_all.log 2>&1
date >> bench/out/v11/qwen_all.times
echo done > bench/out/v11/qwen_all.done

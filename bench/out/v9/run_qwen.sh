cd $(git rev-parse --show-toplevel)
date > bench/out/v9/qwen.times
[ -f bench/out/prompts_qwen_16.json ] || .venv/bin/python -m bench.make_prompts --model qwen2.5-coder-1.5b-instruct --n 16 --out bench/out/prompts_qwen_16.json > bench/out/v9/qwen_prompts.log 2>&1
.venv/bin/python -m bench.bench --model qwen --prompts bench/out/prompts_qwen_16.json --n-all 8 --n-b1 2 --max-tokens 128 --repeats 1 --dtype float32 \
  --out bench/out/v9/qwen.json --only ours_none_all ours_none_b1 ours_adaptive_draft_b1 vllm_plain_all vllm_plain_b1 vllm_draft_b1 > bench/out/v9/qwen.log 2>&1
date >> bench/out/v9/qwen.times
echo done > bench/out/v9/qwen.done

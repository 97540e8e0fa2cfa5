cd $(git rev-parse --show-toplevel)
date > bench/out/v11/qwen_b1.times
.venv/bin/python -m bench.bench --model qwen --prompts bench/out/prompts_qwen_16.json --n-all 8 --n-b1 2 --max-tokens 128 --repeats 2 --dtype float32 \
  --out bench/out/v11/qwen_b1.json --only ours_none_b1 ours_draft_b1 ours_adaptive_draft_b1 ours_draft_bf16draft_b1 ours_adaptive_draft_bf16draft_b1 vllm_plain_b1 vllm_draft_b1 > bench/out/v11/qwen_b1.log 2>&1
date >> bench/out/v11/qwen_b1.times
echo done > bench/out/v11/qwen_b1.done

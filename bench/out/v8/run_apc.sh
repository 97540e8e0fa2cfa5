cd /tmp/wt8
export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
for pc in "" "--prefix-caching"; do
  tag=${pc:+apc_on}; tag=${tag:-apc_off}
  bench/.venv-vllm/bin/python bench/vllm_runner.py --model-dir /root/.cache/specpipe/models/SmolLM2-135M-Instruct.Q4_1-747cb1f0195582d0 --prompts-json bench/out/v8/prompts_smollm2_64.json     --max-tokens 128 --dtype float32 --mode plain --batch all --repeats 2 --max-num-batched-tokens 4096 $pc     --out bench/out/v8/vllm_plain_all_$tag.json > bench/out/v8/vllm_plain_all_$tag.log 2>&1
done
for rep in 3 4; do
.venv/bin/python -m bench.run_one --model smollm2 --mode engine --drafter none --batch 64 --prompts bench/out/v8/prompts_smollm2_64.json   --out bench/out/v8/mixed64_none_all_on_r$rep.json --max-tokens 128 --temperature 0 --dtype float32 --prefix-reuse on > /dev/null 2>&1
done
echo done > bench/out/v8/apc.done

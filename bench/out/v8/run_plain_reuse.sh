cd /tmp/wt8
for rep in 1 2; do for reuse in off on; do
.venv/bin/python -m bench.run_one --model smollm2 --mode engine --drafter none --batch 64 --prompts bench/out/v8/prompts_smollm2_64.json \
  --out bench/out/v8/mixed64_none_all_${reuse}_r${rep}.json --max-tokens 128 --temperature 0 --dtype float32 --prefix-reuse $reuse > /dev/null 2>&1
done; done
echo done > bench/out/v8/plain_reuse.done

cd $(git rev-parse --show-toplevel)
P=bench/out/prompts_smollm2_256.json
C="--model smollm2 --prompts $P --n-all 64 --n-b1 4 --all-seqs 64 --max-tokens 128 --repeats 2"
ONLY="ours_none_b1 ours_ngram_b1 ours_adaptive_ngram_b1 vllm_plain_b1 vllm_ngram_b1 ours_none_all ours_adaptive_ngram_all vllm_plain_all vllm_ngram_all"
date > bench/out/v9/side.times
.venv/bin/python -m bench.bench $C --dtype float32 --out bench/out/v9/side_fp32.json --only $ONLY > bench/out/v9/side_fp32.log 2>&1
date >> bench/out/v9/side.times
.venv/bin/python -m bench.bench $C --dtype float32 --prefix-cache off --out bench/out/v9/side_fp32_nocache.json --only ours_none_all vllm_plain_all > bench/out/v9/side_fp32_nocache.log 2>&1
date >> bench/out/v9/side.times
.venv/bin/python -m bench.bench $C --dtype bfloat16 --out bench/out/v9/side_bf16.json --only ours_none_b1 ours_ngram_b1 vllm_plain_b1 vllm_ngram_b1 ours_none_all vllm_plain_all > bench/out/v9/side_bf16.log 2>&1
date >> bench/out/v9/side.times
echo done > bench/out/v9/side.done

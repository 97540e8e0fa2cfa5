cd /tmp/wt8
P=bench/out/prompts_smollm2_256.json
ONLY="ours_none_b1 ours_ngram_b1 ours_adaptive_ngram_b1 vllm_plain_b1 vllm_ngram_b1 ours_none_all ours_adaptive_ngram_all vllm_plain_all vllm_ngram_all"
C="--model smollm2 --prompts $P --n-all 64 --n-b1 4 --all-seqs 64 --max-tokens 128 --repeats 2"
.venv/bin/python -m bench.bench $C --dtype float32 --out bench/out/v8/side_fp32.json --only $ONLY > bench/out/v8/side_fp32.log 2>&1
echo done > bench/out/v8/side.done

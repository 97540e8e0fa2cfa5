cd /tmp/wt8
P=bench/out/v8/templated_b4/prompts_templated_48.json
G=bench/out/prompts_grounded.json
for rep in 1 2; do
  for batch in 4 48; do
    for drafter in none suffix; do
      for reuse in on off; do
        .venv/bin/python -m bench.run_one --model smollm2 --mode engine --drafter $drafter --batch $batch --prompts $P \
          --out bench/out/v8/reuse_templated_${drafter}_b${batch}_${reuse}_r${rep}.json --max-tokens 128 --temperature 0.7 \
          --dtype float32 --prefix-reuse $reuse > /dev/null 2>&1
      done
    done
  done
done
for drafter in none suffix; do
  for reuse in on off; do
    .venv/bin/python -m bench.run_one --model smollm2 --mode engine --drafter $drafter --batch 4 --prompts $G \
      --out bench/out/v8/reuse_grounded_${drafter}_b4_${reuse}.json --max-tokens 128 --temperature 0 \
      --dtype float32 --prefix-reuse $reuse > /dev/null 2>&1
  done
done
echo done > bench/out/v8/reuse.done

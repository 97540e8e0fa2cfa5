cd $(git rev-parse --show-toplevel)
date > bench/out/v10/b4.times
.venv/bin/python -m bench.drafter_workloads --n 48 --max-tokens 128 --workloads templated --batches b4 \
    --drafters none,ngram,suffix,suffix+adaptive --repeats 2 --out bench/out/v10/templated_b4.json > bench/out/v10/templated_b4.log 2>&1
.venv/bin/python -m bench.drafter_workloads --n 48 --max-tokens 128 --workloads templated --batches b4 \
    --drafters none,suffix --suffix '{"sample_method": "greedy"}' --repeats 2 --out bench/out/v10/templated_b4_greedy.json > bench/out/v10/templated_b4_greedy.log 2>&1
date >> bench/out/v10/b4.times
echo done > bench/out/v10/b4.done

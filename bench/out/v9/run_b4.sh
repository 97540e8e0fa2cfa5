cd $(git rev-parse --show-toplevel)
.venv/bin/python -m bench.drafter_workloads --n 48 --max-tokens 128 --workloads templated --batches b4 \
    --drafters none,ngram,suffix,suffix+adaptive --repeats 2 --out bench/out/v9/templated_b4.json > bench/out/v9/templated_b4.log 2>&1
.venv/bin/python -m bench.drafter_workloads --n 32 --max-tokens 128 --workloads grounded --batches b4 \
    --drafters none,ngram,suffix,suffix+adaptive --repeats 2 --out bench/out/v9/grounded_b4.json > bench/out/v9/grounded_b4.log 2>&1
echo done > bench/out/v9/b4.done

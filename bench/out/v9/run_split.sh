cd $(git rev-parse --show-toplevel)
.venv/bin/python -m bench.step_split --dtypes float32,bfloat16 --shapes 1x1,4x1,4x3,32x5,64x1,8x256@0 --fused auto --decoder auto,off --repeats 9 > bench/out/v9/step_split.md 2>&1
echo done > bench/out/v9/split.done

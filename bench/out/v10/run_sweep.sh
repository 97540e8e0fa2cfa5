# The suffix draft-rule sweep (templated, batch 4, T 0.7), alternating configurations, 2 rounds.
cd $(git rev-parse --show-toplevel)
python3 -c "import json; json.dump(json.load(open('bench/out/prompts_templated.json'))[:48], open('bench/out/v10/sweep/p48.json', 'w'))"
run() { .venv/bin/python -m bench.run_one --model smollm2 --mode engine --drafter $1 --batch 4 --prompts bench/out/v10/sweep/p48.json \
  --out bench/out/v10/sweep/$2.json --max-tokens 128 --temperature 0.7 --dtype float32 --suffix "$3" > bench/out/v10/sweep/$2.log 2>&1; }
for i in 1 2; do
run none none_$i '{}'
run suffix def_$i '{}'
run suffix mm1_$i '{"min_match":1}'
run suffix mm1f2_$i '{"min_match":1,"max_spec_factor":2}'
run suffix mm1p05_$i '{"min_match":1,"min_prob":0.05}'
done

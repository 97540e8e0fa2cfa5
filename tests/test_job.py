"""The job entrypoint: config validation fails fast naming the key; the demo path runs a real model
over real prompts, and bad rows become error records while the others complete."""
import json

import pyarrow.parquet as pq
import pytest

from jobs.generate import main
from pipeline.config import ConfigError, config_hash, load_config


@pytest.mark.parametrize("override, key", [
    ("engine.max_num_seqs=0", "engine.max_num_seqs"),
    ("engine.no_such_key=1", "engine.no_such_key"),
    ("models.drafter=magic", "models.drafter"),
    ("models.dtype=fp8", "models.dtype"),
    ("models.drafter=draft", "models.draft"),
    ("sampling.top_p=1.5", "sampling.top_p"),
    ("sampling.temperature=-1", "sampling.temperature"),
    ("engine.max_num_seqs=abc", "engine.max_num_seqs"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/demo.yaml", [override])


def test_bad_config_fails_before_any_work(capsys, tmp_path):
    assert main(["--config", "configs/demo.yaml", "engine.max_num_seqs=0", f"output.path={tmp_path}"]) == 2
    assert "engine.max_num_seqs" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_config_hash_is_stable_and_sensitive():
    a, b = load_config("configs/demo.yaml"), load_config("configs/demo.yaml")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config("configs/demo.yaml", ["engine.max_num_seqs=3"]))


@pytest.mark.slow
def test_demo_job_on_real_model(tmp_path):
    rows = [json.loads(line) for line in open("data/demo_prompts.jsonl")][:3]
    rows += [{"id": "empty", "prompt": ""}, {"id": "badtemp", "prompt": "Hi", "temperature": -1.0}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    assert main(["--config", "configs/demo.yaml", f"input.path={src}", f"output.path={out}",
                 "sampling.max_tokens=12", "run.progress=false"]) == 0
    comps = pq.read_table(out / "completions.parquet").to_pylist()
    errors = pq.read_table(out / "errors.parquet").to_pylist()
    assert sorted(c["request_id"] for c in comps) == sorted(r["id"] for r in rows[:3])
    assert {e["id"]: e["field"] for e in errors} == {"empty": "prompt", "badtemp": "temperature"}
    assert all(0 < len(c["output_ids"]) <= 12 and c["text"] for c in comps)
    rounds = pq.read_table(out / "rounds.parquet").to_pylist()
    for c in comps:   # rounds are consistent with each completion's counts
        mine = [r for r in rounds if r["request_id"] == c["request_id"]]
        assert sum(r["emitted"] for r in mine) == len(c["output_ids"])
        assert sum(r["accepted"] for r in mine) == c["num_accepted"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completions"] == 3 and summary["errors"] == 2

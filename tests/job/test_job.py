"""The job entrypoint: config validation fails fast naming the key; the demo path runs a real model
over real prompts, and bad rows become error records while the others complete."""
import json
import shutil

import pyarrow.parquet as pq
import pytest

from jobs.generate import main
from pipeline.errors import ConfigError
from pipeline.job.config import config_hash, hashed_tree, load_config, redacted
from pipeline.loading.hardware import resolve_dtype


@pytest.mark.parametrize("override, key", [
    ("engine.max_num_seqs=0", "engine.max_num_seqs"),
    ("engine.no_such_key=1", "engine.no_such_key"),
    ("drafting.method=magic", "drafting.method"),
    ("models.dtype=fp8", "models.dtype"),
    ("drafting.method=draft", "models.draft"),
    ("sampling.top_p=1.5", "sampling.top_p"),
    ("sampling.temperature=-1", "sampling.temperature"),
    ("engine.max_num_seqs=abc", "engine.max_num_seqs"),
    ("cluster.num_workers=0", "cluster.num_workers"),
    ("cluster.max_unit_attempts=0", "cluster.max_unit_attempts"),
    ("input.rows_per_unit=0", "input.rows_per_unit"),
    ("input.format=csv", "input.format"),
    ("output.compression=lz77", "output.compression"),
    ("models.device=cuda", "cluster.num_gpus_per_worker"),
    ("run.run_id=a/b", "run.run_id"),
    ("storage.password=x", "storage.password"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/demo.yaml", [override])


@pytest.mark.parametrize("old, new", [
    ("engine.num_speculative_tokens=3", "engine.num_speculative_tokens moved to drafting.num_speculative_tokens"),
    ("engine.adaptive=true", "engine.adaptive moved to drafting.adaptive"),
    ("models.drafter=ngram", "models.drafter moved to drafting.method"),
    ("models.suffix.min_prob=0.2", "models.suffix moved to drafting.suffix"),
    ("engine.cpu_decoder=off", "engine.cpu_decoder was replaced by engine.kernels"),
])
def test_an_old_key_names_its_new_place(tmp_path, old, new):
    with pytest.raises(ConfigError, match=new):
        load_config("configs/demo.yaml", [old])
    key, value = old.split("=")
    section, name = key.split(".", 1)
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {name.split('.')[0]}: " + ("{min_prob: 0.2}" if "." in name else value) + "\n")
    with pytest.raises(ConfigError, match=new):
        load_config(str(path))


def test_bad_config_fails_before_any_work(capsys, tmp_path):
    assert main(["--config", "configs/demo.yaml", "engine.max_num_seqs=0", f"output.path={tmp_path}"]) == 2
    assert "engine.max_num_seqs" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_config_hash_is_stable_and_sensitive():
    a, b = load_config("configs/demo.yaml"), load_config("configs/demo.yaml")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config("configs/demo.yaml", ["engine.max_num_seqs=3"]))
    # where and how the job runs does not change what it computes: resume across them is allowed
    moved = load_config("configs/demo.yaml", ["cluster.num_workers=4", "storage.secret=s", "run.progress=false",
                                              "engine.kernels=torch", "engine.compile=on"])   # kernels: same tokens
    assert config_hash(a) == config_hash(moved)
    # `auto` itself is hashed (each worker resolves it): the same config is the same run on any hardware
    assert a.models.dtype == "auto" and hashed_tree(a)["models"]["dtype"] == "auto"
    assert config_hash(a) != config_hash(load_config("configs/demo.yaml", ["models.dtype=float32"]))


def test_stored_config_redacts_credentials():
    cfg = load_config("configs/demo.yaml", ["storage.key=AKIA123", "storage.secret=hunter2"])
    tree = redacted(cfg)
    assert tree["storage"]["key"] == tree["storage"]["secret"] == "<redacted>"
    assert "hunter2" not in json.dumps(tree)


@pytest.mark.slow
def test_demo_job_on_real_model_and_local_ray(tmp_path, capsys):
    """The README's demo path: no cluster address, so the job starts its own local Ray (token auth
    on), runs the shipped SmolLM2 over a real prompt shard and commits the run."""
    src = tmp_path / "in"
    src.mkdir()
    rows = [json.loads(line) for line in open("data/demo/grounded.jsonl")][:3]
    rows += [{"id": "empty", "prompt": ""}, {"id": "badtemp", "prompt": "Hi", "temperature": -1.0}]
    (src / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    shutil.copy("data/demo/mtbench_humaneval.parquet", src / "b.parquet")
    out = tmp_path / "out"
    assert main(["--config", "configs/demo.yaml", f"input.path={src}", f"output.path={out}", "input.limit=7",
                 "sampling.max_tokens=12", "run.progress=false", "cluster.num_cpus_per_worker=1"]) == 0
    run = out / "demo"
    comps = [r for f in sorted((run / "completions").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    errors = [r for f in sorted((run / "errors").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert sorted(c["id"] for c in comps) == sorted([r["id"] for r in rows[:3]] + ["mtbench/81", "mtbench/91"])
    assert {e["id"]: (e["reason"], e["field"]) for e in errors} == {
        "empty": ("empty_prompt", "prompt"), "badtemp": ("bad_sampling", "temperature")}
    assert all(0 < c["completion_tokens"] <= 12 and c["text"] for c in comps)
    assert {c["target_model"] for c in comps} == {"smollm2-135m-instruct"}
    chosen = resolve_dtype("auto", "cpu")                  # the demo config says dtype: auto
    assert {c["model_dtype"] for c in comps} == {chosen.dtype}
    manifest = json.loads((run / "manifest.json").read_text())
    assert {(w["dtype"], w["dtype_reason"]) for w in manifest["workers"]} == {(chosen.dtype, chosen.reason)}
    assert f"dtype {chosen.describe()} on w" in capsys.readouterr().out
    assert manifest["completions"] == 5 and manifest["errors"] == 2 and (run / "_SUCCESS").exists()
    stored = (run / "config.yaml").read_text()
    assert "smollm2-135m-instruct" in stored and manifest["config_hash"] == comps[0]["config_hash"]

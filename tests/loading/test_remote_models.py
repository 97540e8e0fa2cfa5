"""Models from where teams keep them (pipeline/loading/remote.py): a folder in object storage, copied
once per node into the model cache against the real S3 protocol server (moto on loopback), checked,
never half-loaded; and hub ids through huggingface_hub's own cache and offline mode (the hub itself
cannot be reached here: the offline cache and the error for an id that is not cached are tested)."""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.job.config import ModelsConfig
from pipeline.job.runtime import build_engine
from pipeline.engine import DraftingConfig, EngineConfig
from pipeline.io.storage import StorageConfig
from pipeline.loading import remote
from pipeline.loading.models import ModelSpec, load_model, model_id
from s3_util import BUCKET, KEY, REGION, SECRET, moto_endpoint, s3  # noqa: F401 -- fixtures

ROOT = Path(__file__).resolve().parents[2]


def upload(fs, local: Path, url: str, extra: dict[str, bytes] = {}) -> None:
    for f in local.iterdir():
        fs.put_file(str(f), f"{url}/{f.name}")
    for name, data in extra.items():
        fs.pipe_file(f"{url}/{name}", data)


def options(endpoint: str) -> dict:
    return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
            "use_listings_cache": False}


def test_s3_folder_is_copied_once_checked_and_loads(tiny_model_dir, s3, moto_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    url = f"s3://{BUCKET}/models/tiny"
    upload(s3, tiny_model_dir, url, {"pytorch_model.bin": b"a pickle, never copied"})
    spec = ModelSpec(url, "float32", storage_options=options(moto_endpoint))
    model, tokenizer = load_model(spec)
    local, _ = load_model(ModelSpec(str(tiny_model_dir), "float32"))
    ids = torch.tensor([tokenizer.encode("Hello there")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, local(ids).logits)
    copies = list((tmp_path / "cache" / "remote").glob("tiny-*"))
    assert len(copies) == 1 and not (copies[0] / "pytorch_model.bin").exists()
    manifest = json.loads((copies[0] / remote.MANIFEST).read_text())
    assert manifest["url"] == url and all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    stamp = (copies[0] / "model.safetensors").stat().st_mtime_ns
    assert remote.fetch_folder(url, tmp_path / "cache", options(moto_endpoint)) == copies[0]
    assert (copies[0] / "model.safetensors").stat().st_mtime_ns == stamp          # not copied again
    assert model_id(spec) == "tiny"
    # a changed folder (a new weights file) is a new copy, the old one stays for runs that use it
    s3.pipe_file(f"{url}/extra.json", b"{}")
    assert remote.fetch_folder(url, tmp_path / "cache", options(moto_endpoint)) != copies[0]


def test_job_engine_loads_a_model_from_s3(tiny_model_dir, s3, moto_endpoint, tmp_path, monkeypatch):
    """build_engine (workers and processor replicas) takes the store's access from the storage config."""
    monkeypatch.setenv("SPECPIPE_CACHE", str(tmp_path / "cache"))
    upload(s3, tiny_model_dir, f"s3://{BUCKET}/m")
    loaded = build_engine(ModelsConfig(target=f"s3://{BUCKET}/m", dtype="float32"), DraftingConfig(method="none"),
                          EngineConfig(max_num_seqs=2, max_model_len=64),
                          storage=StorageConfig(endpoint_url=moto_endpoint, key=KEY, secret=SECRET, region=REGION))
    assert loaded.target_id == "m" and loaded.engine.target.num_slots == 2


def _fetch(url, cache, opts, out):
    out.put(str(remote.fetch_folder(url, Path(cache), opts)))


@pytest.mark.slow
def test_actors_on_one_node_copy_once(tiny_model_dir, s3, moto_endpoint, tmp_path):
    """Four processes asking at once: one copies (the lock), all get the same folder, no temporary
    copy is left behind."""
    url = f"s3://{BUCKET}/models/tiny"
    upload(s3, tiny_model_dir, url)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fetch, args=(url, str(tmp_path), options(moto_endpoint), out)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    got = {out.get(timeout=5) for _ in procs}
    assert len(got) == 1 and all(p.exitcode == 0 for p in procs)
    assert [p.name for p in (tmp_path / "remote").iterdir() if not p.name.endswith(".lock")] == [Path(got.pop()).name]


def test_a_bad_copy_is_never_published(tiny_model_dir, s3, moto_endpoint, tmp_path, monkeypatch):
    """A file whose bytes do not match the listing (size, or the ETag's MD5) fails the copy; the cache
    holds no folder afterwards, so nothing half-written is ever loaded."""
    url = f"s3://{BUCKET}/models/tiny"
    upload(s3, tiny_model_dir, url)
    import fsspec
    fs, _ = fsspec.core.url_to_fs(url, **options(moto_endpoint))          # the instance fetch_folder gets
    find = fs.find

    def find_lying(p, detail=False, **k):
        found = find(p, detail=True, **k)
        name = next(n for n in found if n.endswith("model.safetensors"))
        found[name] = {**found[name], "ETag": '"0123456789abcdef0123456789abcdef"'}
        return found
    monkeypatch.setattr(fs, "find", find_lying)
    with pytest.raises(IOError, match="MD5"):
        remote.fetch_folder(url, tmp_path, options(moto_endpoint))
    assert [p.name for p in (tmp_path / "remote").iterdir() if not p.name.startswith(".")] == []


def test_a_folder_without_safetensors_is_refused(s3, moto_endpoint, tmp_path):
    url = f"s3://{BUCKET}/models/pickled"
    s3.pipe_file(f"{url}/pytorch_model.bin", b"pickle")
    s3.pipe_file(f"{url}/config.json", b"{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*pytorch_model.bin"):
        remote.fetch_folder(url, tmp_path, options(moto_endpoint))


# ---- the hub: its cache and offline mode -----------------------------------------------------------
def fill_hub_cache(cache: Path, repo: str, model_dir: Path, commit: str = "a" * 40) -> None:
    """huggingface_hub's cache layout for `repo` at `commit` (what `huggingface-cli download` leaves)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, folder / "snapshots" / commit)


LOAD = ("import sys; from pipeline.loading.models import ModelSpec, load_model\n"
        "try:\n    m, t = load_model(ModelSpec(sys.argv[1], 'float32')); print('loaded', m.config.num_hidden_layers)\n"
        "except FileNotFoundError as e:\n    print('error:', e)\n")


def run_load(source: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-c", LOAD, source], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_hub_id_from_the_offline_cache(tiny_model_dir, tmp_path):
    fill_hub_cache(tmp_path / "hub", "acme/tiny-chat", tiny_model_dir)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    assert "loaded 2" in run_load("acme/tiny-chat", env)
    assert "loaded 2" in run_load("acme/tiny-chat@main", env)
    assert remote.is_hub_id("acme/tiny-chat") and not remote.is_hub_id(str(tiny_model_dir))


def test_hub_id_not_cached_is_a_clear_error(tmp_path):
    """Offline, and online with the hub unreachable (a closed port on loopback): the error names the
    id, the cache and how to fill it."""
    for env, why in (({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
                     ({"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"},
                      "the hub cannot be reached")):
        out = run_load("acme/not-there", {"HF_HUB_CACHE": str(tmp_path / "hub"), **env})
        assert out.startswith("error: hub model 'acme/not-there' is not in the local hub cache"), out
        assert why in out and str(tmp_path / "hub") in out and "huggingface-cli download acme/not-there" in out

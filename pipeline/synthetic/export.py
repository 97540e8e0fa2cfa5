"""A run's kept rows as one `datasets` folder:

    python -m pipeline.synthetic export RUN_URL DEST [--stage ID] [--push-to-hub REPO]

RUN_URL is the synthetic job's output.path (local, s3://, any fsspec URL; credentials from the
environment). Every committed slot (its `_SUCCESS`) contributes the kept rows of one stage (default:
the last, the card's default config), in slot order; DEST gets `Dataset.save_to_disk`. With
`--push-to-hub`, the dataset is then pushed with `datasets`' push_to_hub; where that fails (no network,
no token) the error says so, and DEST is already written.
"""
from __future__ import annotations

import json
import posixpath

import pyarrow as pa

from ..io.reader import filesystem
from ..io.storage import StorageConfig, read_parquet


class ExportError(RuntimeError):
    """Nothing to export, an unknown stage, or a failed push; the message says which."""


def kept_table(run_url: str, stage: str | None, storage: StorageConfig) -> tuple[pa.Table, list[str]]:
    """The kept rows of `stage` (None: each slot's last) over the committed slots; and those slots."""
    fs, root = filesystem(run_url, storage)
    slots = sorted(posixpath.dirname(p) for p in fs.glob(posixpath.join(root, "slot=*/_SUCCESS")))
    if not slots:
        raise ExportError(f"{run_url}: no committed slot (slot=*/_SUCCESS) to export")
    tables = []
    for slot_dir in slots:
        stages = json.loads(fs.cat_file(posixpath.join(slot_dir, "summary.json")))["stages"]
        ids = [s["id"] for s in stages]
        chosen = ids[-1] if stage is None else stage
        if chosen not in ids:
            raise ExportError(f"--stage {stage!r}: {slot_dir} has stages {ids}")
        rel = f"stage={chosen}/kept" if chosen else "kept"
        tables += [read_parquet(fs, f) for f in sorted(fs.glob(posixpath.join(slot_dir, rel, "*.parquet")))]
    if not tables:
        raise ExportError(f"{run_url}: the committed slots {[posixpath.basename(s) for s in slots]} kept no rows")
    return pa.concat_tables(tables, promote_options="default"), [posixpath.basename(s) for s in slots]


def export(run_url: str, dest: str, stage: str | None = None, push_to_hub: str | None = None,
           storage: StorageConfig | None = None) -> str:
    """Write DEST; push it where asked. Returns a one-line account."""
    import datasets
    table, slots = kept_table(run_url, stage, (storage or StorageConfig()).with_environment())
    dataset = datasets.Dataset(table)
    dataset.save_to_disk(dest)
    said = f"exported {dataset.num_rows} kept rows of {len(slots)} committed slots to {dest}"
    if push_to_hub:
        try:
            dataset.push_to_hub(push_to_hub)
        except Exception as e:  # noqa: BLE001 -- any hub failure is this command's error, named
            raise ExportError(f"--push-to-hub {push_to_hub}: the push failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); {dest} is written; push it from a "
                              f"machine that reaches the hub with a token: datasets.load_from_disk({dest!r})"
                              f".push_to_hub({push_to_hub!r})") from None
        said += f"; pushed to {push_to_hub}"
    return said

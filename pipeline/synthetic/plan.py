"""A slot's plan and folder: the seed set read and checked, the first stage's rows expanded, each
stage's folder, run id and job config (what run_job runs), and the slot's or a stage's folder on its
store. No writes at plan time; SeedError/ConfigError name the file or key.
"""
from __future__ import annotations

import dataclasses
import io
import json
import posixpath
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ..io.reader import filesystem
from ..io.storage import (
    StorageConfig,
    arrow_input,
    arrow_owned,
    create_exclusive,
    put_atomic,
    read_parquet,
    retrying,
)
from ..job.config import JobConfig
from .config import TEMPLATE_ID, ScheduleConfig, StageConfig, SyntheticJobConfig, SyntheticSection, stage_sampling
from .schedule import ScheduleError, current_slot, parse_cron, parse_slot, zone
from .stages import PASSTHROUGH, SeedError, check_seed_fields, expand, input_digest, lineage_columns


def resolve_slot(cfg: ScheduleConfig, given: str | None, now: datetime | None = None) -> str:
    """The slot to run: `given` (checked against the schedule), else the schedule's at `now`."""
    cron = parse_cron(cfg.cron) if cfg.cron is not None else None
    if given is not None:
        parse_slot(given, cron)
        return given
    if cron is None:
        raise ScheduleError("no slot: give --slot YYYY-MM-DDTHH (e.g. 2026-11-30T00) or set schedule.cron")
    return current_slot(cron, zone(cfg.timezone), now)


def load_seeds(section: SyntheticSection, storage: StorageConfig) -> list[dict]:
    """The seed items as dicts, in file order; SeedError names the file and the problem."""
    fs, path = filesystem(section.seeds, storage)
    try:
        if path.endswith((".jsonl", ".json")):
            with arrow_input(fs, path) as (f, threaded):
                table = pa_json.read_json(f if threaded else pa.BufferReader(arrow_owned(f.read())))
        else:
            table = read_parquet(fs, path)
    except Exception as e:  # noqa: BLE001 -- any reader failure is reported with its path
        raise SeedError(f"synthetic.seeds {section.seeds!r}: unreadable: {type(e).__name__}: {e}") from None
    if section.id_column not in table.column_names:
        raise SeedError(f"synthetic.seeds {section.seeds!r}: no {section.id_column!r} column "
                        f"(synthetic.id_column); found {table.column_names}")
    seeds = table.to_pylist()
    ids = [s[section.id_column] for s in seeds]
    bad = [i for i in ids if not isinstance(i, str) or not TEMPLATE_ID.fullmatch(i)]
    if bad or len(set(ids)) != len(ids) or not seeds:
        raise SeedError(f"synthetic.seeds {section.seeds!r}: expected unique non-empty ids (letters, digits, "
                        f"'.', '_', '-'), {len(seeds)} seeds; bad: {bad[:5]}, repeated: "
                        f"{sorted({i for i in ids if ids.count(i) > 1})[:5]}")
    return seeds


def input_bytes(rows: list[dict], schema: pa.Schema) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf, compression="zstd")
    return buf.getvalue()


# ---- the slot ------------------------------------------------------------------------------------
@dataclass
class StagePlan:
    index: int
    stage: StageConfig
    url: str                                # the stage's folder: the slot's, or <slot>/stage=<id>
    rel: str                                # that folder relative to the slot ("" for the slot's own)
    run_id: str
    marker: bool                            # the stage commits with its own _SUCCESS (staged slots)


@dataclass
class SlotPlan:
    slot: str
    url: str                                # <output.path>/slot=<slot>
    run_id: str
    rows: list[dict]                        # the first stage's input rows
    cfg: SyntheticJobConfig
    seeds: list[dict]                       # the slot's seeds, all of them by id for later stages
    stages: list[StagePlan]

    @property
    def job(self) -> JobConfig:
        """The first stage's job config (what check_models and the output check see)."""
        return stage_job(self, self.stages[0], self.input_url)

    @property
    def input_url(self) -> str:
        return input_url(self.stages[0], self.rows)


def plan_slot(cfg: SyntheticJobConfig, slot: str) -> SlotPlan:
    """Seeds -> the first stage's rows -> the slot's stages. No writes; SeedError/ConfigError on bad
    input (a template's {field} that is not a seed column is named by its key)."""
    seeds = load_seeds(cfg.synthetic, cfg.storage)
    check_seed_fields(cfg.synthetic, sorted({k for s in seeds for k in s}))
    rows = expand(seeds, cfg.synthetic, cfg.sampling, slot, cfg.run.seed)
    url = f"{cfg.output.path.rstrip('/')}/slot={slot}"
    staged = cfg.synthetic.staged
    stages = [StagePlan(i, s, f"{url}/stage={s.id}" if staged else url, f"stage={s.id}" if staged else "",
                        f"synthetic-{slot}-{s.id}" if staged else f"synthetic-{slot}", staged)
              for i, s in enumerate(cfg.synthetic.stage_list())]
    return SlotPlan(slot, url, f"synthetic-{slot}", rows, cfg, seeds, stages)


def input_url(sp: StagePlan, rows: list[dict]) -> str:
    return f"{sp.url}/_input/rows-{input_digest(rows)}.parquet"


def stage_job(plan: SlotPlan, sp: StagePlan, url: str) -> JobConfig:
    """The job run_job runs for one stage: its input file, folder, run id, lineage passthrough and
    the stage's sampling section."""
    cfg = plan.cfg
    stages = cfg.synthetic.stage_list()
    return JobConfig(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(JobConfig)},
                        "input": dataclasses.replace(cfg.input, path=url, passthrough_columns=[
                            *PASSTHROUGH, *lineage_columns(sp.index, stages)]),
                        "output": dataclasses.replace(cfg.output, path=sp.url),
                        "sampling": stage_sampling(cfg.sampling, sp.stage),
                        "run": dataclasses.replace(cfg.run, run_id=sp.run_id)})


class SlotFolder:
    """A slot's or stage's folder on its store: small JSON objects, markers and tables."""

    def __init__(self, url: str, storage: StorageConfig):
        self.url, self.storage, self.retry = url, storage, storage.retry_policy()
        self.fs, self.path = filesystem(url, storage)

    def p(self, rel: str) -> str:
        return posixpath.join(self.path, rel)

    def io(self, what: str, op):
        return retrying(self.retry, f"{what} {self.url}", op)

    def committed(self) -> dict | None:
        """summary.json of a committed slot or stage (its _SUCCESS exists), else None."""
        if not self.io("check _SUCCESS", lambda: self.fs.exists(self.p("_SUCCESS"))):
            return None
        return json.loads(self.io("read summary.json", lambda: self.fs.cat_file(self.p("summary.json"))))

    def put(self, rel: str, data: bytes) -> None:
        self.io("create", lambda: self.fs.makedirs(posixpath.dirname(self.p(rel)), exist_ok=True))
        self.io(f"write {rel} in", lambda: put_atomic(self.fs, self.p(rel), data))

    def create_once(self, rel: str, data: bytes) -> bool:
        self.io("create", lambda: self.fs.makedirs(posixpath.dirname(self.p(rel)), exist_ok=True))
        return self.io(f"create {rel} in", lambda: create_exclusive(self.fs, self.p(rel), data))

    def tables(self, rel: str) -> list[str]:
        """The Parquet files under `rel`, sorted."""
        return sorted(self.io(f"list {rel} in", lambda: self.fs.glob(self.p(f"{rel}/*.parquet"))))

    def size(self, rel: str) -> int:
        """Bytes of the Parquet files under `rel`."""
        return sum(self.io(f"size {path} in", lambda: self.fs.size(path)) for path in self.tables(rel))

    def schema(self, path: str) -> pa.Schema:
        """A Parquet file's schema, from its footer."""
        def read():
            with self.fs.open(path, "rb") as f:
                return pq.read_schema(f)
        return self.io(f"read the schema of {path} in", read)

    def rows(self, rel: str) -> list[dict]:
        return [r for f in self.tables(rel) for r in read_parquet(self.fs, f).to_pylist()]

"""The scheduled synthetic-data job: a seed set x templates x samples, generated once per time slot
by the same driver, workers and writer as jobs/generate.py.

The slot (schedule.py) comes from `--slot` or the schedule's clock. For one slot:

1. Expand (pure, no I/O): the seeds chosen for the slot (all, or `seeds_per_slot` picked by a hash
   of (slot, seed id)) x the templates that apply to each seed's kind x `samples` per template ->
   one input row each: id `<seed_id>/<template>/<sample>` (the same in every slot), the rendered
   `prompt`, a per-row `seed` = hash(run.seed, slot, id), the template's temperature/max_tokens/
   stop overrides, and `slot`, `seed_id`, `template`, `sample`. Sampled generation by default
   (temperature > 0): each row draws from its own generator seeded by (seed, id), so rerunning a
   slot regenerates the same rows, and other slots draw other samples of the same prompts.
2. A committed slot (its `_SUCCESS` exists) ends here, before any write or model check. Else the
   models and output location are checked, then the slot is claimed: the slot lease
   `<slot>/_lease/` (pipeline/io/lease.py, reused; `_SUCCESS` is checked again once it is held).
   Why a slot lease beside run_job's run lease: run_job, called on a complete run, finalizes it
   again (rewrites manifest.json and _SUCCESS), so "is the slot done?" and the run must happen
   under one claim for a late second run to change nothing. Its first generation is
   an atomic create -- a hard link on local disks, a PUT with `If-None-Match: *` on S3 (AWS, MinIO,
   moto); on stores or S3 servers without conditional writes, storage.create_exclusive's fallback
   (exists-check, write, read-back after a settle delay: two claims within that delay can both
   pass). Of two runs started at once exactly one wins; the other commits nothing and exits 0
   naming the holder. A holder that died (its pid gone on this host, or no heartbeat for
   run.lease_ttl_s) is taken over: the new run resumes the committed units of the first.
3. Write the expanded rows once to `<slot>/_input/rows-<digest>.parquet` (exclusive create). The
   digest of the rows is in the name: an uncommitted slot whose `_input/` holds another expansion
   (seed set, templates, samples) is refused before anything is written, and another config with
   the same rows is refused by run_job's plan guard, naming the keys; two expansions never mix.
4. run_job (pipeline/cluster/driver.py) with input.path = that file, output.path = the slot
   folder, run.run_id = `synthetic-<slot>` and input.passthrough_columns = slot, seed_id, template:
   every completions/rounds/errors row carries its slot. run_job's own run lease, plan guard,
   resume and manifest apply unchanged.
5. Quality gate (quality.py): `curated/` and `kept/` beside the run, then the dataset card and
   provenance (card.py), `summary.json`, then `_SUCCESS` in the slot folder, last. A slot is committed once its `_SUCCESS` exists; a later run
   for it, whatever its config, reads summary.json, changes nothing and exits 0 ("already committed
   by run ..."). An uncommitted slot started with another config or expansion is refused (exit 2).

Stages (`synthetic.stages`): steps 3-5 run once per stage, in order, each in its own folder
`stage=<id>/` with its own run (`synthetic-<slot>-<id>`), curated/ and kept/ tables, summary.json and
`_SUCCESS`: a stage commits once, and a rerun after a crash skips the committed stages (their
kept rows are the next stage's input, read back) and redoes only the rest. A later stage's rows
are expanded from the kept rows of its input stage (stages.py); a judge stage's curated rows are
the rows it judged with its score columns (quality.curate_judged). The slot's `_SUCCESS` comes
after the last stage, the dataset card and provenance.

Layout under `<output.path>/slot=<slot>/` (hive-style: `slot=` and `stage=` folders):

    _lease/                                   the slot's claim (hidden: "_" prefix)
    _input/rows-<digest>.parquet              a stage's expanded input
    synthetic-<slot>/                         a stage's run, as jobs/generate.py writes it
    curated/<unit>.parquet                    completions + prompt, sample and quality columns
    kept/<unit>.parquet                       the kept rows (what the card points at)
    near_duplicates.parquet                   the rows' MinHash signatures (later slots check against them)
    README.md, provenance.json                the dataset card and what made it (card.py)
    summary.json, _SUCCESS                    the slot's counts; written last

With stages, the five stage entries above live under `stage=<id>/` (runs `synthetic-<slot>-<id>`),
each with its own summary.json and `_SUCCESS`; the card, provenance, summary and `_SUCCESS` of the
slot stay at its top.

Knows the seed set, templates, slots and the output layout; knows nothing about models or tensors
(run_job does the generating).
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

from ..io.lease import LeaseHeld, acquire, describe_holder, owner_info
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
from ..io.writer import RunOutput
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


@dataclass
class SlotResult:
    status: str                             # committed | already_committed | busy
    message: str
    summary: dict | None = None             # the last stage's run_job summary (committed by this run only)
    slot_summary: dict | None = None        # summary.json


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
        if "/" in rel:
            self.io("create", lambda: self.fs.makedirs(posixpath.dirname(self.p(rel)), exist_ok=True))
        self.io(f"write {rel} in", lambda: put_atomic(self.fs, self.p(rel), data))

    def create_once(self, rel: str, data: bytes) -> bool:
        self.io("create", lambda: self.fs.makedirs(posixpath.dirname(self.p(rel)), exist_ok=True))
        return self.io(f"create {rel} in", lambda: create_exclusive(self.fs, self.p(rel), data))

    def tables(self, rel: str) -> list[str]:
        """The Parquet files under `rel`, sorted."""
        return sorted(self.io(f"list {rel} in", lambda: self.fs.glob(self.p(f"{rel}/*.parquet"))))

    def rows(self, rel: str) -> list[dict]:
        return [r for f in self.tables(rel) for r in read_parquet(self.fs, f).to_pylist()]


def already_message(slot: str, done: dict) -> str:
    return (f"slot {slot} already committed by run {done['run_id']} at {done['committed_at']} "
            f"(pid {done['committed_by'].get('pid')} on {done['committed_by'].get('host')}); "
            f"nothing to do: {done['output']}")


def busy_message(slot: str, holder: str) -> str:
    return (f"slot {slot} is being generated by another run ({holder}); this run commits nothing: the "
            f"holder commits the slot, or, if it dies, the next run for the slot resumes its committed units")


def run_slot(plan: SlotPlan, stop=None, say=print) -> SlotResult:
    """Generate and commit one slot, exactly once, stage by stage (see the module docstring). Raises
    what run_job raises (InputError, OutputError before any work; JobFailed, Interrupted after)."""
    from ..cluster.driver import JobFailed, check_models
    storage = plan.cfg.storage.with_environment()
    folder = SlotFolder(plan.url, storage)
    done = folder.committed()                      # the common repeat: no write at all
    if done is not None:
        return SlotResult("already_committed", already_message(plan.slot, done), slot_summary=done)
    check_models(plan.job)
    RunOutput(plan.url, plan.run_id, storage).check_location()
    owner = owner_info(slot=plan.slot, run_id=plan.run_id)
    try:
        lease = acquire(folder.fs, folder.p("_lease"), owner, plan.cfg.run.lease_ttl_s, folder.retry)
    except LeaseHeld as e:
        return SlotResult("busy", busy_message(plan.slot, describe_holder(e.holder)))
    try:
        lease.start_heartbeats()
        done = folder.committed()                  # committed while we were claiming it
        if done is not None:
            return SlotResult("already_committed", already_message(plan.slot, done), slot_summary=done)
        from .stage_run import StageRunner
        runner = StageRunner(plan, storage, stop, say)
        for sp in plan.stages:
            if runner.run(sp) is None:
                return SlotResult("busy", busy_message(plan.slot, runner.busy))
        if lease.lost.is_set():
            raise JobFailed(f"the slot lease was lost ({lease.lost_reason}); slot {plan.slot} not marked "
                            f"committed; rerun to finish it")
        slot_summary = runner.commit_slot(folder, owner)
    finally:
        lease.release()
    return SlotResult("committed", f"slot {plan.slot} committed by run {plan.run_id}: {plan.url}",
                      runner.last_run, slot_summary)

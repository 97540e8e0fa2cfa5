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
5. Quality gate (quality.py): `curated/` beside the run, then `summary.json`, then
   `_SUCCESS` in the slot folder, last. A slot is committed once its `_SUCCESS` exists; a later run
   for it, whatever its config, reads summary.json, changes nothing and exits 0 ("already committed
   by run ..."). An uncommitted slot started with another config or expansion is refused (exit 2).

Layout under `<output.path>/slot=<slot>/` (hive-style: `slot=` folders):

    _lease/, _input/rows-<digest>.parquet     claim and expanded input (hidden: "_" prefix)
    synthetic-<slot>/                         the run, as jobs/generate.py writes it
    curated/<unit>.parquet                    completions + prompt, sample and quality columns
    summary.json, _SUCCESS                    the slot's counts and provenance; written last

Knows the seed set, templates, slots and the output layout; knows nothing about models or tensors
(run_job does the generating).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import posixpath
import re
import string
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ..errors import ConfigError
from ..io.lease import LeaseHeld, acquire, describe_holder, owner_info
from ..io.reader import InputConfig, filesystem
from ..io.storage import (
    StorageConfig,
    arrow_input,
    arrow_owned,
    create_exclusive,
    put_atomic,
    read_parquet,
    retrying,
)
from ..io.writer import OutputError, RunOutput
from ..engine.core.request import RequestError, SamplingParams
from ..engine.core.response_format import FormatError, parse_response_format
from ..engine.grammar.library import check_format
from ..job.config import JobConfig, RunConfig, load_config
from .schedule import ScheduleError, current_slot, parse_cron, parse_slot, zone

TEMPLATE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PASSTHROUGH = ["slot", "seed_id", "template"]
INPUT_SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("temperature", pa.float64()),
    ("max_tokens", pa.int64()), ("stop", pa.list_(pa.string())), ("slot", pa.string()),
    ("seed_id", pa.string()), ("template", pa.string()), ("sample", pa.int64()),
    ("response_format", pa.string())])
INPUT_FIELDS_SET_BY_JOB = ("path", "format", "prompt_column", "messages_column", "id_column", "passthrough_columns")


class SeedError(ValueError):
    """The seed set cannot be read or expanded as configured; names the file, seed or template."""


@dataclass
class TemplateConfig:
    id: str = ""                            # short name; part of every row id (letters, digits, . _ -)
    text: str = ""                          # the user turn; {name} = the seed's column `name` ({text},
                                            # {category}, {question}...), {{ and }} = literal braces
    kinds: list[str] = field(default_factory=list)   # seed kinds it applies to; empty = every seed
    samples: Optional[int] = None           # samples per seed; null = synthetic.samples_per_seed
    temperature: Optional[float] = None     # per-row sampling overrides; null = the sampling section
    max_tokens: Optional[int] = None
    stop: Optional[list[str]] = None
    response_format: Any = None             # the records' shape (a response_format object, e.g.
                                            # {type: json_schema, json_schema: {...}}); null = free text;
                                            # the quality gate flags rows that are not valid records

    def fields(self) -> list[str]:
        return [name for _, name, _, _ in string.Formatter().parse(self.text) if name is not None]

    def check(self, key: str) -> None:
        if not TEMPLATE_ID.fullmatch(self.id or ""):
            raise ConfigError(f"{key}.id: expected 1-64 letters, digits, '.', '_' or '-', got {self.id!r}")
        if not self.text.strip():
            raise ConfigError(f"{key}.text: required")
        try:
            names = self.fields()
        except ValueError as e:
            raise ConfigError(f"{key}.text: {e} (use {{{{ and }}}} for literal braces)") from None
        if any(not n.isidentifier() for n in names):
            raise ConfigError(f"{key}.text: placeholders must be plain column names like {{text}}, got {names}")
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"{key}.samples: expected >= 1 or null, got {self.samples}")
        if self.response_format is not None:
            try:
                fmt = parse_response_format(self.response_format)
                if fmt is not None:
                    check_format(fmt)
            except FormatError as e:
                raise ConfigError(f"{key}.response_format: {e}") from None
            except RequestError as e:
                raise ConfigError(f"{key}.{e}") from None

    def format_json(self) -> str | None:
        """The response_format as JSON text (the input rows' column), or None."""
        fmt = parse_response_format(self.response_format)
        return None if fmt is None else fmt.to_json()


@dataclass
class SyntheticSection:
    seeds: str = "data/synthetic/seeds.parquet"  # Parquet or JSONL seed items (file or URL)
    id_column: str = "seed_id"              # unique, non-empty id of each seed item
    kind_column: str = "kind"               # selects templates (TemplateConfig.kinds); may be absent
    seeds_per_slot: Optional[int] = None    # null = every seed; N = N seeds per slot, picked by a hash
                                            # of (slot, seed id): slots rotate through the seed set
    samples_per_seed: int = 2               # samples of each (seed, template); per-row seeds differ
    templates: list[TemplateConfig] = field(default_factory=list)

    def check(self, sampling: SamplingParams) -> None:
        if not self.templates:
            raise ConfigError("synthetic.templates: at least one template is required")
        if self.samples_per_seed < 1 or (self.seeds_per_slot is not None and self.seeds_per_slot < 1):
            raise ConfigError("synthetic.samples_per_seed/seeds_per_slot: expected >= 1")
        ids = [t.id for t in self.templates]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"synthetic.templates: template ids must be unique, got {ids}")
        for i, t in enumerate(self.templates):
            t.check(f"synthetic.templates.{i}")
            temperature = sampling.temperature if t.temperature is None else t.temperature
            if temperature == 0 and self.samples(t) > 1:
                raise ConfigError(f"synthetic.templates.{i}: {self.samples(t)} samples at temperature 0 would "
                                  f"repeat one greedy completion; set samples: 1 or a temperature > 0")

    def samples(self, t: TemplateConfig) -> int:
        return self.samples_per_seed if t.samples is None else t.samples


@dataclass
class ScheduleConfig:
    cron: Optional[str] = "0 * * * *"       # 5-field cron (or @hourly, @daily...); null = --slot required
    timezone: str = "UTC"                   # IANA zone the cron and the slot names are read in

    def __post_init__(self):
        try:
            if self.cron is not None:
                parse_cron(self.cron)
        except ScheduleError as e:
            raise ConfigError(f"schedule.cron: {e}") from None
        try:
            zone(self.timezone)
        except ScheduleError as e:
            raise ConfigError(f"schedule.timezone: {e}") from None


@dataclass
class SyntheticJobConfig(JobConfig):
    synthetic: SyntheticSection = field(default_factory=SyntheticSection)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def __post_init__(self):
        super().__post_init__()
        default = InputConfig()
        for key in INPUT_FIELDS_SET_BY_JOB:
            if getattr(self.input, key) != getattr(default, key):
                raise ConfigError(f"input.{key}: set by the synthetic job (the slot's expanded rows); "
                                  f"give the seed set as synthetic.seeds")
        if self.run.run_id != RunConfig().run_id:
            raise ConfigError("run.run_id: set by the synthetic job (synthetic-<slot>); do not set it")
        self.synthetic.check(self.sampling)


def load_synthetic_config(path: str | None, overrides: list[str] = ()) -> SyntheticJobConfig:
    try:
        return load_config(path, overrides, schema=SyntheticJobConfig)
    except TypeError as e:          # omegaconf: `list.N.key=...` on a list (e.g. synthetic.templates)
        raise ConfigError(f"{e}: a list (synthetic.templates, sampling.stop) is replaced whole from the "
                          f"command line, e.g. 'synthetic.templates=[{{id: a, text: \"{{text}}\"}}]'") from None


def resolve_slot(cfg: ScheduleConfig, given: str | None, now: datetime | None = None) -> str:
    """The slot to run: `given` (checked against the schedule), else the schedule's at `now`."""
    cron = parse_cron(cfg.cron) if cfg.cron is not None else None
    if given is not None:
        parse_slot(given, cron)
        return given
    if cron is None:
        raise ScheduleError("no slot: give --slot YYYY-MM-DDTHH (e.g. 2026-11-30T00) or set schedule.cron")
    return current_slot(cron, zone(cfg.timezone), now)


# ---- seeds and expansion (pure) ------------------------------------------------------------------
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


def choose_seeds(seeds: list[dict], section: SyntheticSection, slot: str) -> list[dict]:
    """All seeds, or `seeds_per_slot` of them picked by a hash of (slot, id), in file order."""
    if section.seeds_per_slot is None or section.seeds_per_slot >= len(seeds):
        return seeds
    rank = sorted(range(len(seeds)), key=lambda i: _digest(f"{slot}|{seeds[i][section.id_column]}"))
    return [seeds[i] for i in sorted(rank[:section.seeds_per_slot])]


def row_seed(run_seed: int, slot: str, row_id: str) -> int:
    """The row's sampling seed: fixed by (run seed, slot, id); in [0, 2^63)."""
    return int(_digest(f"{run_seed}|{slot}|{row_id}")[:16], 16) & ((1 << 63) - 1)


def expand(seeds: list[dict], section: SyntheticSection, sampling: SamplingParams, slot: str,
           run_seed: int) -> list[dict]:
    """The slot's input rows (INPUT_SCHEMA), in order seed -> template -> sample."""
    rows = []
    for seed in choose_seeds(seeds, section, slot):
        sid = seed[section.id_column]
        for t in section.templates:
            if t.kinds and seed.get(section.kind_column) not in t.kinds:
                continue
            prompt = render(t, seed, sid)
            for k in range(section.samples(t)):
                rid = f"{sid}/{t.id}/{k}"
                rows.append({"id": rid, "prompt": prompt, "seed": row_seed(run_seed, slot, rid),
                             "temperature": sampling.temperature if t.temperature is None else t.temperature,
                             "max_tokens": t.max_tokens, "stop": t.stop, "slot": slot, "seed_id": sid,
                             "template": t.id, "sample": k, "response_format": t.format_json()})
    if not rows:
        raise SeedError(f"no rows: no template applies to the {len(seeds)} seeds (template kinds "
                        f"{[t.kinds for t in section.templates]}, seed column {section.kind_column!r})")
    return rows


def render(t: TemplateConfig, seed: dict, sid: str) -> str:
    values = {}
    for name in t.fields():
        value = seed.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise SeedError(f"template {t.id!r} needs {{{name}}}, seed {sid!r} has none")
        values[name] = value
    return t.text.format_map(values)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def input_digest(rows: list[dict]) -> str:
    return _digest(json.dumps(rows, sort_keys=True, ensure_ascii=False))[:16]


def input_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=INPUT_SCHEMA), buf, compression="zstd")
    return buf.getvalue()


# ---- the slot ------------------------------------------------------------------------------------
@dataclass
class SlotPlan:
    slot: str
    url: str                                # <output.path>/slot=<slot>
    run_id: str
    input_url: str
    rows: list[dict]
    job: JobConfig                          # what run_job runs
    provenance: dict                        # synthetic + schedule sections, for summary.json


def plan_slot(cfg: SyntheticJobConfig, slot: str) -> SlotPlan:
    """Seeds -> rows -> the slot's job config. No writes; SeedError/ConfigError on bad input."""
    rows = expand(load_seeds(cfg.synthetic, cfg.storage), cfg.synthetic, cfg.sampling, slot, cfg.run.seed)
    url = f"{cfg.output.path.rstrip('/')}/slot={slot}"
    input_url = f"{url}/_input/rows-{input_digest(rows)}.parquet"
    run_id = f"synthetic-{slot}"
    job = JobConfig(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(JobConfig)},
                       "input": dataclasses.replace(cfg.input, path=input_url, passthrough_columns=list(PASSTHROUGH)),
                       "output": dataclasses.replace(cfg.output, path=url),
                       "run": dataclasses.replace(cfg.run, run_id=run_id)})
    provenance = {"synthetic": dataclasses.asdict(cfg.synthetic), "schedule": dataclasses.asdict(cfg.schedule)}
    return SlotPlan(slot, url, run_id, input_url, rows, job, provenance)


@dataclass
class SlotResult:
    status: str                             # committed | already_committed | busy
    message: str
    summary: dict | None = None             # run_job's summary (committed by this run only)
    slot_summary: dict | None = None        # summary.json


class SlotFolder:
    """The slot folder on its store: small JSON objects, markers and the expanded input."""

    def __init__(self, url: str, storage: StorageConfig):
        self.url, self.retry = url, storage.retry_policy()
        self.fs, self.path = filesystem(url, storage)

    def p(self, rel: str) -> str:
        return posixpath.join(self.path, rel)

    def io(self, what: str, op):
        return retrying(self.retry, f"{what} {self.url}", op)

    def committed(self) -> dict | None:
        """summary.json of a committed slot (its _SUCCESS exists), else None."""
        if not self.io("check _SUCCESS", lambda: self.fs.exists(self.p("_SUCCESS"))):
            return None
        return json.loads(self.io("read summary.json", lambda: self.fs.cat_file(self.p("summary.json"))))

    def put(self, rel: str, data: bytes) -> None:
        self.io(f"write {rel} in", lambda: put_atomic(self.fs, self.p(rel), data))

    def create_once(self, rel: str, data: bytes) -> bool:
        self.io("create", lambda: self.fs.makedirs(posixpath.dirname(self.p(rel)), exist_ok=True))
        return self.io(f"create {rel} in", lambda: create_exclusive(self.fs, self.p(rel), data))


def already_message(slot: str, done: dict) -> str:
    return (f"slot {slot} already committed by run {done['run_id']} at {done['committed_at']} "
            f"(pid {done['committed_by'].get('pid')} on {done['committed_by'].get('host')}); "
            f"nothing to do: {done['output']}")


def busy_message(slot: str, holder: str) -> str:
    return (f"slot {slot} is being generated by another run ({holder}); this run commits nothing: the "
            f"holder commits the slot, or, if it dies, the next run for the slot resumes its committed units")


def run_slot(plan: SlotPlan, stop=None) -> SlotResult:
    """Generate and commit one slot, exactly once (see the module docstring). Raises what run_job
    raises (InputError, OutputError before any work; JobFailed, Interrupted after)."""
    from ..cluster.driver import JobFailed, RunBusy, check_models, run_job
    from .quality import curate
    storage = plan.job.storage.with_environment()
    folder = SlotFolder(plan.url, storage)
    done = folder.committed()                      # the common repeat: no write at all
    if done is not None:
        return SlotResult("already_committed", already_message(plan.slot, done), slot_summary=done)
    check_models(plan.job)
    RunOutput(plan.url, plan.run_id, storage).check_location()
    owner = owner_info(slot=plan.slot, run_id=plan.run_id)
    try:
        lease = acquire(folder.fs, folder.p("_lease"), owner, plan.job.run.lease_ttl_s, folder.retry)
    except LeaseHeld as e:
        return SlotResult("busy", busy_message(plan.slot, describe_holder(e.holder)))
    try:
        lease.start_heartbeats()
        done = folder.committed()                  # committed while we were claiming it
        if done is not None:
            return SlotResult("already_committed", already_message(plan.slot, done), slot_summary=done)
        _check_same_input(folder, plan)
        folder.create_once(posixpath.relpath(plan.input_url, plan.url), input_bytes(plan.rows))
        try:
            summary = run_job(plan.job, stop)
        except RunBusy as e:
            return SlotResult("busy", busy_message(plan.slot, str(e)))
        except OutputError as e:
            raise OutputError(f"slot {plan.slot} was started with another config; rerun with that config to "
                              f"finish it, or remove {plan.url} to regenerate it: {e}") from None
        quality = curate(RunOutput(plan.url, plan.run_id, storage), folder, plan.input_url, storage)
        if lease.lost.is_set():
            raise JobFailed(f"the slot lease was lost ({lease.lost_reason}); slot {plan.slot} not marked "
                            f"committed; rerun to finish it")
        slot_summary = _slot_summary(plan, summary, quality, owner)
        folder.put("summary.json", json.dumps(slot_summary, indent=2).encode())
        folder.put("_SUCCESS", b"")
    finally:
        lease.release()
    return SlotResult("committed", f"slot {plan.slot} committed by run {plan.run_id}: {plan.url}",
                      summary, slot_summary)


def _check_same_input(folder: SlotFolder, plan: SlotPlan) -> None:
    """An uncommitted slot holding another expansion (seeds, templates, samples) is not finished
    with this one: the two would mix in one slot."""
    ours = posixpath.basename(plan.input_url)
    found = folder.io("list _input in", lambda: folder.fs.glob(folder.p("_input/rows-*.parquet")))
    others = sorted(posixpath.basename(f) for f in found if posixpath.basename(f) != ours)
    if others:
        raise OutputError(f"slot {plan.slot} was started with another seed set/templates/samples ({others[0]}, "
                          f"now {ours}); rerun with that config to finish it, or remove {plan.url} to regenerate it")


def _slot_summary(plan: SlotPlan, summary: dict, quality: dict, owner: dict) -> dict:
    keys = ("rows", "completions", "errors", "error_reasons", "tokens", "config_hash", "units")
    return {"slot": plan.slot, "run_id": plan.run_id, "output": plan.url, "run": summary["output"],
            "committed_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "committed_by": {"host": owner["host"], "pid": owner["pid"]}, "input": plan.input_url,
            **{k: summary[k] for k in keys}, "quality": quality, "wall_s": round(time.time() - owner["started_at"], 2),
            **plan.provenance}

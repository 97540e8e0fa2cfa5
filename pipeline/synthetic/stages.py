"""A stage's input rows (pure: no files, no models): seeds or an earlier stage's kept rows x the
stage's templates x samples, each rendered, seeded and carrying its lineage.

    first stage   one row per (seed, template that fits the seed's kind, sample):
                  id `<seed_id>/<template>/<sample>`
    later stage   one row per (kept row of its input, template, sample): id `<input row id>/<template>/<sample>`,
                  `parent_id` = the input row's id, `<stage>_id` = the row of every earlier generation it
                  descends from (a judge passes its input's rows on, so it adds none)
    a judge       one row per kept input row (samples: 1); its curated rows are the rows it judged

A template's `{name}` is the seed's column, `{stage.field}` that stage's row of the lineage (`text`,
`record`, `prompt`...; a judge's `score`, `reason`). Rows carry `seed` = hash(run seed, slot, id), so
a rerun of a slot regenerates the same rows and another slot draws other samples.
"""
from __future__ import annotations

import hashlib
import json
import string

import pyarrow as pa

from ..engine.core.request import SamplingParams
from ..errors import ConfigError
from .config import (StageConfig, SyntheticSection, TemplateConfig, ancestors, generation_ancestors, input_of,
                     stage_sampling)

PASSTHROUGH = ["slot", "seed_id", "template"]
INPUT_SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("temperature", pa.float64()),
    ("max_tokens", pa.int64()), ("stop", pa.list_(pa.string())), ("slot", pa.string()),
    ("seed_id", pa.string()), ("template", pa.string()), ("sample", pa.int64()),
    ("response_format", pa.string())])


class SeedError(ValueError):
    """The seed set cannot be read or expanded as configured; names the file, seed or template."""


def lineage_columns(index: int, stages: list[StageConfig]) -> list[str]:
    """The lineage columns a stage's rows carry beyond PASSTHROUGH: parent_id and `<stage>_id`s."""
    if index == 0:
        return []
    return ["parent_id", *[f"{s.id}_id" for s in reversed(generation_ancestors(index, stages))]]


def input_schema(index: int, stages: list[StageConfig]) -> pa.Schema:
    schema = INPUT_SCHEMA
    for name in lineage_columns(index, stages):
        schema = schema.append(pa.field(name, pa.string()))
    return schema


def check_seed_fields(section: SyntheticSection, columns: list[str]) -> None:
    """Every `{name}` of every template is a column of the seed set; ConfigError names the key."""
    for i, stage in enumerate(section.stage_list()):
        key = f"synthetic.stages.{i}" if section.staged else "synthetic"
        for j, t in enumerate(stage.templates):
            unknown = [n for n in t.seed_fields() if n not in columns]
            if unknown:
                stages = [s.id for s in section.stage_list()[:i]]
                hint = f", or an earlier stage's field like {{{stages[-1]}.text}}" if stages else ""
                raise ConfigError(f"{key}.templates.{j}.text: {{{unknown[0]}}} is not a column of the seed set "
                                  f"{section.seeds!r} ({columns}){hint}")


def row_seed(run_seed: int, slot: str, row_id: str) -> int:
    """The row's sampling seed: fixed by (run seed, slot, id); in [0, 2^63)."""
    return int(_digest(f"{run_seed}|{slot}|{row_id}")[:16], 16) & ((1 << 63) - 1)


def choose_seeds(seeds: list[dict], section: SyntheticSection, slot: str) -> list[dict]:
    """All seeds, or `seeds_per_slot` of them picked by a hash of (slot, id), in file order."""
    if section.seeds_per_slot is None or section.seeds_per_slot >= len(seeds):
        return seeds
    rank = sorted(range(len(seeds)), key=lambda i: _digest(f"{slot}|{seeds[i][section.id_column]}"))
    return [seeds[i] for i in sorted(rank[:section.seeds_per_slot])]


def expand(seeds: list[dict], section: SyntheticSection, sampling: SamplingParams, slot: str,
           run_seed: int) -> list[dict]:
    """The first stage's input rows (INPUT_SCHEMA), in order seed -> template -> sample."""
    stage = section.stage_list()[0]
    rows = []
    for seed in choose_seeds(seeds, section, slot):
        sid = seed[section.id_column]
        rows += _rows(section, stage, sampling, slot, run_seed, seed, sid, {}, base_id=sid, extra={})
    if not rows:
        raise SeedError(f"no rows: no template applies to the {len(seeds)} seeds (template kinds "
                        f"{[t.kinds for t in stage.templates]}, seed column {section.kind_column!r})")
    return rows


def expand_stage(index: int, section: SyntheticSection, sampling: SamplingParams, slot: str, run_seed: int,
                 seeds: dict[str, dict], inputs: list[dict], earlier: dict[str, dict[str, dict]]) -> list[dict]:
    """A later stage's input rows: its input stage's kept rows `inputs` (in their order) x templates x
    samples. `earlier[stage id]` = that stage's curated rows by id (a judge's: by the judged row's id),
    for `{stage.field}` placeholders and lineage."""
    stages = section.stage_list()
    stage, parent = stages[index], input_of(stages[index], index, stages)
    nearest = _nearest_generation(stages, parent)
    rows = []
    for r in inputs:
        ids = {g.id: r[f"{g.id}_id"] for g in generation_ancestors(stages.index(nearest), stages)}
        ids[nearest.id] = r["id"]
        lineage = {s.id: earlier[s.id][ids[_nearest_generation(stages, s).id]] for s in ancestors(index, stages)}
        extra = {"parent_id": r["id"], **{f"{g}_id": i for g, i in ids.items()}}
        rows += _rows(section, stage, sampling, slot, run_seed, seeds[r["seed_id"]], r["seed_id"], lineage,
                      base_id=r["id"], extra=extra)
    return rows


def _nearest_generation(stages: list[StageConfig], stage: StageConfig) -> StageConfig:
    """The stage itself if it generates, else the generation its judge chain reads."""
    while stage.kind != "generate":
        i = stages.index(stage)
        stage = input_of(stage, i, stages)
    return stage


def _rows(section: SyntheticSection, stage: StageConfig, sampling: SamplingParams, slot: str, run_seed: int,
          seed: dict, sid: str, lineage: dict, base_id: str, extra: dict) -> list[dict]:
    rows = []
    defaults = stage_sampling(sampling, stage)
    for t in stage.templates:
        if t.kinds and seed.get(section.kind_column) not in t.kinds:
            continue
        prompt = render(t, seed, sid, lineage, base_id)
        for k in range(section.samples(t, stage)):
            rid = f"{base_id}/{t.id}/{k}"
            rows.append({"id": rid, "prompt": prompt, "seed": row_seed(run_seed, slot, rid),
                         "temperature": defaults.temperature if t.temperature is None else t.temperature,
                         "max_tokens": t.max_tokens, "stop": t.stop, "slot": slot, "seed_id": sid,
                         "template": t.id, "sample": k, "response_format": t.format_json(), **extra})
    return rows


def render(t: TemplateConfig, seed: dict, sid: str, lineage: dict | None = None, row_id: str | None = None) -> str:
    """The template's text with the seed's columns and the lineage's `{stage.field}` values."""
    parts = []
    for literal, name, spec, conversion in string.Formatter().parse(t.text):
        parts.append(literal)
        if name is None:
            continue
        if "." in name:
            stage, fld = name.split(".")
            value = stage_field((lineage or {})[stage], stage, fld)
            where = f"row {row_id!r}'s {stage} row"
        else:
            value, where = seed.get(name), f"seed {sid!r}"
        if value is None or (isinstance(value, str) and not value.strip()):
            raise SeedError(f"template {t.id!r} needs {{{name}}}, {where} has none")
        parts.append(format(value, spec) if conversion is None else format(repr(value), spec))
    return "".join(parts)


def stage_field(row: dict, stage: str, fld: str):
    """A `{stage.field}` value of a curated row; a judge's score and reason are its judge_* columns."""
    if fld in ("score", "reason"):
        return row.get(f"judge_{fld}_{stage}")
    if fld == "record" and row.get("record") is not None:
        return json.dumps(json.loads(row["record"]), ensure_ascii=False)
    return row.get(fld)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def input_digest(rows: list[dict]) -> str:
    return _digest(json.dumps(rows, sort_keys=True, ensure_ascii=False))[:16]

"""The synthetic job's config: seeds, templates, stages, judges, validators, near-duplicates, schedule.

A slot runs `synthetic.templates` as one generation (the single-stage form), or `synthetic.stages` in
order. A stage's templates render each of its input rows: the seed's columns by name (`{text}`),
an earlier stage's row by `{stage.field}` (`{task.text}`). The first stage's input is the seed set;
a later stage's is the kept rows of `input` (default: the stage before). A `judge` stage scores its
input's rows with one rubric template whose response_format has a `score` (a number, or a string
enum: a choice) and optionally a `reason`; `min_score` / `accept` gate them (flagged, never dropped).
Everything that can be checked without the seed file is checked here, naming the key.

Knows no files, models or Ray.
"""
from __future__ import annotations

import dataclasses
import re
import string
from dataclasses import dataclass, field
from typing import Any, Optional

from ..engine.core.request import RequestError, SamplingParams
from ..engine.core.response_format import FormatError, parse_response_format
from ..errors import ConfigError
from ..io.reader import InputConfig
from ..job.config import JobConfig, RunConfig, load_config
from .schedule import ScheduleError, parse_cron, zone

TEMPLATE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
STAGE_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")
STAGE_FIELDS = ("text", "record", "prompt", "id", "template", "sample")   # {stage.field} of a generation row
JUDGE_FIELDS = ("score", "reason")                                       # ... and of a judge stage's row
RESERVED_STAGES = ("seed", "slot", "parent", "judge")                    # `<stage>_id` and judge_* columns
KINDS = ("generate", "judge")
VALIDATORS = "python (every fenced code block parses), json (the text parses as JSON) or {regex: PATTERN}"
INPUT_FIELDS_SET_BY_JOB = ("path", "format", "prompt_column", "messages_column", "id_column", "passthrough_columns")


@dataclass
class TemplateConfig:
    id: str = ""                            # short name; part of every row id (letters, digits, . _ -)
    text: str = ""                          # the user turn; {name} = the seed's column `name` ({text},
                                            # {category}, {question}...), {stage.field} = an earlier
                                            # stage's row ({task.text}); {{ and }} = literal braces
    kinds: list[str] = field(default_factory=list)   # seed kinds it applies to; empty = every seed
    samples: Optional[int] = None           # samples per input row; null = synthetic.samples_per_seed
    temperature: Optional[float] = None     # per-row sampling overrides; null = the sampling section
    max_tokens: Optional[int] = None
    stop: Optional[list[str]] = None
    response_format: Any = None             # the records' shape (a response_format object, e.g.
                                            # {type: json_schema, json_schema: {...}}); null = free text;
                                            # the quality gate flags rows that are not valid records
    validate: Any = None                    # python | json | {regex: PATTERN}: rows failing it are
                                            # flagged is_invalid with invalid_reason

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
        if any(not all(p.isidentifier() for p in n.split(".")) or n.count(".") > 1 for n in names):
            raise ConfigError(f"{key}.text: placeholders must be a seed column like {{text}} or an earlier "
                              f"stage's field like {{task.text}}, got {names}")
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"{key}.samples: expected >= 1 or null, got {self.samples}")
        if self.response_format is not None:
            from ..engine.grammar.library import check_format    # llguidance: only where a format is set
            try:
                fmt = parse_response_format(self.response_format)
                if fmt is not None:
                    check_format(fmt)
            except FormatError as e:
                raise ConfigError(f"{key}.response_format: {e}") from None
            except RequestError as e:
                raise ConfigError(f"{key}.{e}") from None
        try:
            self.validator()
        except ConfigError as e:
            raise ConfigError(f"{key}.{e}") from None

    def validator(self) -> tuple[str, str | None] | None:
        """(kind, regex pattern) of `validate`, or None; ConfigError for anything else."""
        v = self.validate
        if v is None:
            return None
        if v in ("python", "json"):
            return v, None
        if isinstance(v, dict) and list(v) == ["regex"] and isinstance(v["regex"], str):
            try:
                re.compile(v["regex"])
            except re.error as e:
                raise ConfigError(f"validate.regex: {e}") from None
            return "regex", v["regex"]
        raise ConfigError(f"validate: expected {VALIDATORS}, got {v!r}")

    def format_json(self) -> str | None:
        """The response_format as JSON text (the input rows' column), or None."""
        fmt = parse_response_format(self.response_format)
        return None if fmt is None else fmt.to_json()

    def references(self) -> list[tuple[str, str]]:
        """(stage, field) of every {stage.field} placeholder."""
        return [tuple(n.split(".")) for n in self.fields() if "." in n]

    def seed_fields(self) -> list[str]:
        return [n for n in self.fields() if "." not in n]


@dataclass
class StageConfig:
    id: str = ""                            # a name: letters, digits, _ (rows carry `<id>_id`)
    kind: str = "generate"                  # generate | judge
    input: Optional[str] = None             # the stage whose kept rows it reads; null = the stage
                                            # before (the first stage reads the seed set)
    templates: list[TemplateConfig] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)   # this stage's sampling section over the job's (top_p...)
    min_score: Optional[float] = None       # judge, numeric score: rows scored below are flagged
    accept: Optional[list[str]] = None      # judge, a choice: the choices that pass

    def judge_score(self) -> dict:
        """The judge's score property (its JSON schema), checked: a number, or a string enum."""
        fmt = parse_response_format(self.templates[0].response_format)
        schema = fmt.schema() if fmt is not None and fmt.is_json else None
        score = (schema or {}).get("properties", {}).get("score") if isinstance(schema, dict) else None
        return score if isinstance(score, dict) else {}

    def is_choice(self) -> bool:
        return "enum" in self.judge_score()


@dataclass
class NearDuplicateConfig:
    enabled: bool = True                    # MinHash over word shingles with LSH (near_dup.py)
    threshold: float = 0.7                  # estimated Jaccard similarity of shingle sets at which a row
                                            # is a near-duplicate of an earlier one
    shingle_words: int = 3                  # words per shingle
    num_perm: int = 128                     # MinHash permutations (signature size)
    across_slots: bool = True               # also check against the run's earlier committed slots

    def check(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"synthetic.near_duplicates.threshold: expected in (0, 1], got {self.threshold}")
        if self.shingle_words < 1 or self.num_perm < 16:
            raise ConfigError("synthetic.near_duplicates: expected shingle_words >= 1 and num_perm >= 16")


@dataclass
class SyntheticSection:
    seeds: str = "data/synthetic/seeds.parquet"  # Parquet or JSONL seed items (file or URL)
    id_column: str = "seed_id"              # unique, non-empty id of each seed item
    kind_column: str = "kind"               # selects templates (TemplateConfig.kinds); may be absent
    seeds_per_slot: Optional[int] = None    # null = every seed; N = N seeds per slot, picked by a hash
                                            # of (slot, seed id): slots rotate through the seed set
    samples_per_seed: int = 2               # samples of each (input row, template); per-row seeds differ
    templates: list[TemplateConfig] = field(default_factory=list)   # one generation (no stages)
    stages: list[StageConfig] = field(default_factory=list)         # or: stages, in order
    near_duplicates: NearDuplicateConfig = field(default_factory=NearDuplicateConfig)

    @property
    def staged(self) -> bool:
        return bool(self.stages)

    def stage_list(self) -> list[StageConfig]:
        """The stages in order; the single-stage form is one unnamed generation stage."""
        return self.stages if self.stages else [StageConfig(id="", templates=self.templates)]

    def check(self, sampling: SamplingParams) -> None:
        if self.templates and self.stages:
            raise ConfigError("synthetic.templates, synthetic.stages: give one (templates: one generation; "
                              "stages: generations and judges in order)")
        if not self.templates and not self.stages:
            raise ConfigError("synthetic.templates: at least one template is required (or synthetic.stages)")
        if self.samples_per_seed < 1 or (self.seeds_per_slot is not None and self.seeds_per_slot < 1):
            raise ConfigError("synthetic.samples_per_seed/seeds_per_slot: expected >= 1")
        self.near_duplicates.check()
        stages = self.stage_list()
        for i, stage in enumerate(stages):
            key = f"synthetic.stages.{i}" if self.staged else "synthetic"
            _check_stage(stage, i, stages[:i], key, self.staged)
            for j, t in enumerate(stage.templates):
                temperature = stage_sampling(sampling, stage).temperature if t.temperature is None else t.temperature
                if temperature == 0 and self.samples(t, stage) > 1:
                    raise ConfigError(f"{key}.templates.{j}: {self.samples(t, stage)} samples at temperature 0 "
                                      f"would repeat one greedy completion; set samples: 1 or a temperature > 0")

    def samples(self, t: TemplateConfig, stage: StageConfig | None = None) -> int:
        if stage is not None and stage.kind == "judge":
            return 1
        return self.samples_per_seed if t.samples is None else t.samples


def stage_sampling(sampling: SamplingParams, stage: StageConfig) -> SamplingParams:
    """The job's sampling section with the stage's own keys over it."""
    return dataclasses.replace(sampling, **stage.sampling) if stage.sampling else sampling


def input_of(stage: StageConfig, index: int, stages: list[StageConfig]) -> StageConfig | None:
    """The stage whose kept rows feed `stage` (None: the seed set)."""
    if index == 0:
        return None
    if stage.input is None:
        return stages[index - 1]
    return next(s for s in stages if s.id == stage.input)


def ancestors(index: int, stages: list[StageConfig]) -> list[StageConfig]:
    """The stages a stage's rows descend from, nearest first (its input, that one's input, ...)."""
    out, i = [], index
    while (parent := input_of(stages[i], i, stages)) is not None:
        out.append(parent)
        i = stages.index(parent)
    return out


def generation_ancestors(index: int, stages: list[StageConfig]) -> list[StageConfig]:
    """Ancestors that generate rows (a judge passes its input's rows on): each is a `<id>_id` column."""
    return [s for s in ancestors(index, stages) if s.kind == "generate"]


def _check_stage(stage: StageConfig, i: int, earlier: list[StageConfig], key: str, staged: bool) -> None:
    if staged:
        if not STAGE_ID.fullmatch(stage.id or "") or stage.id in RESERVED_STAGES:
            raise ConfigError(f"{key}.id: expected a name of letters, digits and '_' (not "
                              f"{', '.join(RESERVED_STAGES)}), got {stage.id!r}")
        if stage.id in [s.id for s in earlier]:
            raise ConfigError(f"{key}.id: stage ids must be unique, {stage.id!r} repeats")
    if stage.kind not in KINDS:
        raise ConfigError(f"{key}.kind: expected one of {KINDS}, got {stage.kind!r}")
    if not stage.templates:
        raise ConfigError(f"{key}.templates: at least one template is required")
    ids = [t.id for t in stage.templates]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{key}.templates: template ids must be unique, got {ids}")
    for j, t in enumerate(stage.templates):
        t.check(f"{key}.templates.{j}")
    if stage.sampling:
        try:
            SamplingParams(**stage.sampling)
        except TypeError as e:
            raise ConfigError(f"{key}.sampling: {e}") from None
        except RequestError as e:
            raise ConfigError(f"{key}.sampling.{e}") from None
    if stage.input is not None and stage.input not in [s.id for s in earlier]:
        raise ConfigError(f"{key}.input: {stage.input!r} is not an earlier stage ({[s.id for s in earlier]}); a "
                          f"stage reads the kept rows of a stage before it, so a cycle or a later stage cannot "
                          f"feed it")
    if i == 0 and stage.kind == "judge":
        raise ConfigError(f"{key}.kind: a judge scores an earlier stage's rows; the first stage generates")
    _check_references(stage, i, earlier, key)
    if stage.kind == "judge":
        _check_judge(stage, key)
    elif stage.min_score is not None or stage.accept is not None:
        raise ConfigError(f"{key}.min_score/accept: only a judge stage (kind: judge) gates rows")


def _check_references(stage: StageConfig, i: int, earlier: list[StageConfig], key: str) -> None:
    stages = [*earlier, stage]
    lineage = {s.id: s for s in ancestors(i, stages)}
    for j, t in enumerate(stage.templates):
        for name, fld in t.references():
            source = lineage.get(name)
            if source is None:
                raise ConfigError(f"{key}.templates.{j}.text: {{{name}.{fld}}}: {name!r} is not a stage this "
                                  f"stage's rows descend from ({sorted(lineage) or 'none: it reads the seeds'})")
            allowed = STAGE_FIELDS + (JUDGE_FIELDS if source.kind == "judge" else ())
            if fld not in allowed:
                raise ConfigError(f"{key}.templates.{j}.text: {{{name}.{fld}}}: unknown field {fld!r}; a stage's "
                                  f"rows have {', '.join(allowed)}")
            if fld == "record" and source.kind == "generate" and any(t.response_format is None for t in source.templates):
                raise ConfigError(f"{key}.templates.{j}.text: {{{name}.record}}: stage {name!r} has templates without "
                                  f"a response_format, whose rows have no record; use {{{name}.text}}")


def _check_judge(stage: StageConfig, key: str) -> None:
    if len(stage.templates) != 1:
        raise ConfigError(f"{key}.templates: a judge has one rubric template, got {len(stage.templates)}")
    t = stage.templates[0]
    fmt = parse_response_format(t.response_format)
    if fmt is None or not fmt.is_json or not isinstance(fmt.schema(), dict):
        raise ConfigError(f"{key}.templates.0.response_format: a judge needs a JSON schema with a `score` "
                          f"(number or string enum) and optionally a `reason` (string), got {t.response_format!r}")
    score = stage.judge_score()
    required = fmt.schema().get("required", [])
    numeric = score.get("type") in ("number", "integer")
    if not (numeric or "enum" in score) or "score" not in required:
        raise ConfigError(f"{key}.templates.0.response_format: the schema's required property `score` must be a "
                          f"number/integer or a string enum, got {score or 'none'}")
    if stage.min_score is not None and not numeric:
        raise ConfigError(f"{key}.min_score: the score is a choice ({score.get('enum')}); gate it with accept")
    if stage.accept is not None and (numeric or not set(stage.accept) <= set(score["enum"])):
        raise ConfigError(f"{key}.accept: expected choices of the score's enum {score.get('enum')}, "
                          f"got {stage.accept}")


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

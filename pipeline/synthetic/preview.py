"""A preview of a synthetic config: N rows per template and stage, generated in this process, checked
by the same gate, printed as a table; nothing is written anywhere.

Each stage takes the first N rows of each of its templates (a later stage: from the previewed kept
rows of its input stage), generates them with one in-process engine (the config's models, drafting
and engine sections; no Ray), and flags them as the job would (validators, records, exact and near
duplicates within the preview; a judge's score and gate). A person reads the table before the first
scheduled run: the rendered prompt's head, the output's head, the flags, the judge's score.
"""
from __future__ import annotations

from ..io.reader import InputConfig
from ..job.rows import RowError, job_columns, row_request
from ..job.validity import structured_columns
from .config import SyntheticJobConfig, ancestors, input_of, stage_sampling
from .near_dup import NearDuplicates
from .quality import FLAGS, add_signatures, judged_row, quality_flags, row_check
from .stages import check_seed_fields, expand, expand_stage


def first_per_template(rows: list[dict], n: int) -> list[dict]:
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if seen.get(r["template"], 0) < n:
            seen[r["template"]] = seen.get(r["template"], 0) + 1
            out.append(r)
    return out


def generate(loaded, rows: list[dict], sampling) -> dict[str, dict]:
    """id -> {text, finish_reason, valid, record, error} of each row, from one in-process engine."""
    columns = job_columns(InputConfig(path="preview"))
    out = {}
    for row in rows:
        try:
            req = row_request(row, columns, sampling, row["seed"], loaded.tokenizer)
            loaded.engine.add_request(req.id, req.prompt_ids, req.params, req.seed)
        except (RowError, ValueError) as e:
            out[row["id"]] = {"text": None, "finish_reason": "error", "valid": None, "record": None, "error": str(e)}
    for c in loaded.engine.run():
        out[c.request_id] = {"text": c.text, "finish_reason": c.finish_reason, **structured_columns(c), "error": None}
    return out


def preview(cfg: SyntheticJobConfig, slot: str, n: int, seeds: list[dict], loaded) -> list[dict]:
    """The previewed rows of every stage, in order: {stage, id, template, prompt, text, flags...}."""
    section = cfg.synthetic
    check_seed_fields(section, sorted({k for s in seeds for k in s}))
    stages = section.stage_list()
    by_id = {s[section.id_column]: s for s in seeds}
    curated: dict[str, list[dict]] = {}
    shown = []
    for i, stage in enumerate(stages):
        if i == 0:
            rows = expand(seeds, section, cfg.sampling, slot, cfg.run.seed)
        else:
            parent = input_of(stage, i, stages)
            earlier = {s.id: {r["id"]: r for r in curated[s.id]} for s in ancestors(i, stages)}
            rows = expand_stage(i, section, cfg.sampling, slot, cfg.run.seed, by_id,
                                [r for r in curated[parent.id] if r["is_kept"]], earlier)
        rows = first_per_template(rows, n)
        done = generate(loaded, rows, stage_sampling(cfg.sampling, stage))
        if stage.kind == "judge":
            parent = input_of(stage, i, stages)
            judged = {r["id"]: r for r in curated[parent.id]}
            curated[stage.id] = []
            for r in rows:
                row, score, rejected = judged_row(stage, judged[r["parent_id"]], done[r["id"]])
                curated[stage.id].append(row)
                shown.append({"stage": stage.id, "template": r["template"], "id": r["parent_id"],
                              "prompt": r["prompt"], "text": done[r["id"]]["text"],
                              "flags": "rejected" if rejected else "", "score": score})
            continue
        templates = {t.id: t for t in stage.templates}
        checked = [row_check({**done[r["id"]], "id": r["id"], "source_row": k}, templates[r["template"]])
                   for k, r in enumerate(rows)]
        near = NearDuplicates(section.near_duplicates) if section.near_duplicates.enabled else None
        if near is not None:
            add_signatures(checked, [done[r["id"]]["text"] for r in rows], near)
        flags = quality_flags(checked, near)
        curated[stage.id] = [{**r, **done[r["id"]], **flags[r["id"]]} for r in rows]
        for r in curated[stage.id]:
            said = [f for f in FLAGS if r[f"is_{f}"]] + (["error: " + r["error"]] if r["error"] else [])
            shown.append({"stage": stage.id, "template": r["template"], "id": r["id"], "prompt": r["prompt"],
                          "text": r["text"], "flags": ", ".join(said) or "kept", "score": None})
    return shown


def head(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def table(shown: list[dict], width: int = 48) -> str:
    """The preview as a plain-text table: stage, template, prompt head, output head, flags, score."""
    header = ("stage", "template", "prompt", "output", "flags", "score")
    lines = [[r["stage"] or "-", r["template"], head(r["prompt"], width), head(r["text"], width), r["flags"],
              "" if r["score"] is None else str(r["score"])] for r in shown]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*l) for l in lines])


"""A structured workload: extraction into JSON schemas of 5-20 fields from short factual passages,
classification with `choice`, and a regex-shaped answer. Deterministic from a seed.

    .venv/bin/python -m bench.structured --n 64 --out bench/out/structured_64.jsonl

Each line is a row of the generation job's input: `prompt` (chat-formatted by the job) and
`response_format` (the row's constraint as JSON text).
"""
from __future__ import annotations

import argparse
import json
import random

_FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken"]
_LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Backus", "Perlman", "Thompson"]
_CITY = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Quebec", "Tallinn", "Perth", "Accra", "Bergen"]
_FIELD = ["chemistry", "astronomy", "linguistics", "geology", "botany", "economics", "optics", "genetics"]
_ORG = ["the Royal Institute", "Northfield University", "the Harbor Observatory", "Meridian Labs",
        "the Lakeside Museum", "Crescent College"]

_FIELD_TYPES = [
    ("name", {"type": "string"}), ("birth_year", {"type": "integer"}), ("city", {"type": "string"}),
    ("field", {"type": "string"}), ("institution", {"type": "string"}),
    ("award_year", {"type": "integer"}), ("is_living", {"type": "boolean"}),
    ("students", {"type": "integer"}), ("papers", {"type": "integer"}),
    ("role", {"enum": ["professor", "researcher", "director", "curator"]}),
    ("coauthor", {"type": "string"}), ("country_code", {"type": "string", "pattern": "^[A-Z]{2}$"}),
    ("h_index", {"type": "integer"}), ("funding_musd", {"type": "number"}),
    ("topics", {"type": "array", "items": {"type": "string"}, "maxItems": 3}),
    ("first_paper_year", {"type": "integer"}), ("email", {"type": "string"}),
    ("languages", {"type": "array", "items": {"type": "string"}, "maxItems": 3}),
    ("mentor", {"type": "string"}), ("retired", {"type": "boolean"}),
]


def nested_schema(num_fields: int) -> dict:
    """An object schema of `num_fields` required fields (5-20); past 8 fields, the rest nest in an
    `details` object, and past 14 a `details.career` object."""
    fields = _FIELD_TYPES[:num_fields]

    def obj(items):
        return {"type": "object", "properties": dict(items), "required": [k for k, _ in items],
                "additionalProperties": False}
    top, rest = fields[:8], fields[8:]
    if rest:
        inner, career = rest[:6], rest[6:]
        details = obj(inner + ([("career", obj(career))] if career else []))
        top = top + [("details", details)]
    return obj(top)


def sample_record(schema: dict, seed: int) -> dict:
    """A record valid under `schema` (the kinds nested_schema uses)."""
    rng = random.Random(seed)

    def value(s):
        if "enum" in s:
            return rng.choice(s["enum"])
        t = s["type"]
        if t == "object":
            return {k: value(v) for k, v in s["properties"].items()}
        if t == "integer":
            return rng.randint(1900, 2020)
        if t == "number":
            return round(rng.uniform(0, 50), 2)
        if t == "boolean":
            return rng.random() < 0.5
        if t == "array":
            return [rng.choice(_FIELD) for _ in range(rng.randint(1, 3))]
        if s.get("pattern") == "^[A-Z]{2}$":
            return rng.choice(["PT", "NO", "KE", "PE", "JP", "CA"])
        return rng.choice(_FIRST) + " " + rng.choice(_LAST)
    return value(schema)


def passage(rng: random.Random) -> tuple[str, dict]:
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    born, award = rng.randint(1920, 1985), rng.randint(1990, 2020)
    facts = {"name": name, "birth_year": born, "city": rng.choice(_CITY), "field": rng.choice(_FIELD),
             "institution": rng.choice(_ORG), "award_year": award, "students": rng.randint(3, 40),
             "papers": rng.randint(20, 300)}
    text = (f"{name} was born in {facts['city']} in {born}. After studying {facts['field']}, "
            f"{name.split()[0]} joined {facts['institution']}, supervised {facts['students']} doctoral "
            f"students and published {facts['papers']} papers. The society's medal followed in {award}.")
    return text, facts


def rows(n: int, seed: int = 0) -> list[dict]:
    """n rows cycling extraction (5, 8, 12, 20 fields), classification and a regex answer."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text, facts = passage(rng)
        kind = i % 6
        if kind < 4:
            num = (5, 8, 12, 20)[kind]
            prompt = (f"Passage: {text}\n\nExtract the facts about the person as JSON with the fields "
                      f"of the schema; unknown values are your best guess.")
            fmt = {"type": "json_schema", "json_schema": nested_schema(num)}
        elif kind == 4:
            prompt = f"Passage: {text}\n\nWhich field of science is this passage about? Answer with one word."
            fmt = {"type": "choice", "choice": sorted(set(_FIELD))}
        else:
            prompt = f"Passage: {text}\n\nIn which year was the person born, and where? Answer as 'YYYY, City'."
            fmt = {"type": "regex", "regex": r"(19|20)\d\d, [A-Z][a-z]+"}
        out.append({"id": f"s{i}", "prompt": prompt, "response_format": json.dumps(fmt)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for r in rows(args.n, args.seed):
            f.write(json.dumps(r) + "\n")
    print(f"wrote {args.n} rows to {args.out}")


if __name__ == "__main__":
    main()

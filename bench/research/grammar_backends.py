"""The grammar library, chosen by measurement: llguidance vs xgrammar on one tokenizer.

For each library: cold compile time of a 20-field nested JSON schema and of a regex, the same
compile again (its cache), and mask time per decoding step at 1 / 32 / 64 rows, each row a matcher
walking a valid record token by token (mask, then consume). Prints one table; medians over repeats.

    .venv/bin/python -m bench.research.grammar_backends --model smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time

import torch

from bench.structured import nested_schema, sample_record


def _median_ms(xs):
    return f"{statistics.median(xs) * 1e3:.3f}"


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab = self.tok.vocab_size
        self.cache = {}
        self.version = importlib.metadata.version("llguidance")

    def compile(self, kind, text):
        key = (kind, text)
        if key not in self.cache:
            g = (self.llg.LLMatcher.grammar_from_json_schema(text) if kind == "json"
                 else self.llg.LLMatcher.grammar_from_regex(text))
            err = self.llg.LLMatcher.validate_grammar(g, self.tok)
            assert not err, err
            self.cache[key] = g
            self.llg.LLMatcher(self.tok, g, log_level=0)      # builds the lexer: part of compiling
        return self.cache[key]

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def bitmask(self, rows):
        return self.lt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, mask, i):
        self.lt.fill_next_token_bitmask(m, mask, i)

    def consume(self, m, t):
        assert m.consume_token(t), m.get_error()


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        self.vocab = self.info.vocab_size
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=True)
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, kind, text):
        return (self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":")) if kind == "json"
                else self.compiler.compile_regex(text))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar, max_rollback_tokens=16)

    def bitmask(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, mask, i):
        m.fill_next_token_bitmask(mask, i)

    def consume(self, m, t):
        assert m.accept_token(t)


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def mask_step_times(lib, grammar, records, rows, steps):
    """Seconds per step to fill `rows` masks (one per matcher), each matcher then consuming its
    record's next token."""
    matchers = [lib.matcher(grammar) for _ in range(rows)]
    mask = lib.bitmask(rows)
    out = []
    for s in range(steps):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            lib.fill(m, mask, i)
        out.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            lib.consume(m, records[i % len(records)][s])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from pipeline.loading.models import resolve_hf_dir
    tokenizer = AutoTokenizer.from_pretrained(resolve_hf_dir(args.model), local_files_only=True)
    schema = json.dumps(nested_schema(20))
    records = [tokenizer.encode(json.dumps(sample_record(nested_schema(20), seed), separators=(",", ":")),
                                add_special_tokens=False) for seed in range(8)]
    steps = min(args.steps, min(len(r) for r in records))
    print(f"model tokenizer: {args.model}; schema: 20 fields, nested ({len(schema)} chars); "
          f"records {min(map(len, records))}-{max(map(len, records))} tokens; {steps} steps")
    print("| library | version | compile schema cold ms | again ms | compile regex ms | "
          "mask ms/step 1 row | 32 rows | 64 rows |")
    print("|---|---|---|---|---|---|---|---|")
    for cls in (Llg, Xgr):
        lib = cls(tokenizer)
        cold = timed(lambda: lib.compile("json", schema), 1)
        again = timed(lambda: lib.compile("json", schema), args.repeats)
        rx = timed(lambda: lib.compile("regex", r"[A-Z][a-z]+ \d{4}-\d{2}-\d{2}"), 1)
        grammar = lib.compile("json", schema)
        per_rows = []
        for rows in (1, 32, 64):
            per_rows.append(_median_ms(mask_step_times(lib, grammar, records, rows, steps)))
        print(f"| {lib.name} | {lib.version} | {cold[0] * 1e3:.1f} | {_median_ms(again)} | {rx[0] * 1e3:.1f} | "
              + " | ".join(per_rows) + " |")


if __name__ == "__main__":
    main()

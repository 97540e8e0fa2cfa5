"""Structured output (response_format), greedy: the engine's output equals Hugging Face `generate`
with the same grammar as a logits processor (llguidance's matcher driven directly, token by token),
for every drafter, at batch 1 and 32, over JSON schemas, any JSON object, a choice, a regex and a Lark
grammar. Where tokens differ, the first difference must sit on a near-tie of the masked target's
top-2 logits. Also: forced tokens are proposed and accepted, a bad format is an error for its request
only, stop strings end a row only where its grammar accepts, and a row cut by max_tokens is not valid.

The model is a random-init 2-layer Llama over the real SmolLM2 tokenizer (its 49,152 tokens), so the
grammar, not the weights, gives the outputs their shape."""
import json

import jsonschema
import llguidance
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from conftest import NEAR_TIE, make_engine, noisy_copy, tiny_llama
from pipeline.engine import RequestError, SamplingParams, TreeParams
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.core.response_format import parse_response_format
from pipeline.engine.grammar.library import Grammars, grammar_text
from pipeline.loading.models import resolve_hf_dir

VOCAB, EOS, MAX_NEW = 49152, 2, 40
DRAFTERS = ["none", "ngram", "suffix", "draft-greedy", "draft-prob", "hybrid", "ngram+tree", "suffix+tree"]
TREE = TreeParams(max_tokens=12, max_branches=3)     # "+tree": token trees under the forced tokens

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["red", "green", "blue"]}},
                         "ok": {"type": "boolean"}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "owner", "level"],
          "properties": {"id": {"type": "integer"}, "level": {"enum": ["low", "high"]},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["first", "admin"],
                                   "properties": {"first": {"type": "string", "maxLength": 6},
                                                  "admin": {"type": "boolean"}}}}}
FORMATS = [
    {"type": "json_schema", "json_schema": PERSON},
    {"type": "json_schema", "json_schema": {"name": "nested", "schema": NESTED}},
    {"type": "json_object"},
    {"type": "choice", "choice": ["positive", "negative", "neutral"]},
    {"type": "regex", "regex": r"[0-9]{3}-[a-z]{2,5}"},
    {"type": "grammar", "grammar": 'start: "SELECT " COL " FROM " TABLE\nCOL: "id" | "name" | "age"\n'
                                   'TABLE: /[a-z]{1,8}/'},
]
TEXTS = ["Describe the person as JSON.", "Classify: the movie was long.", "A code please:",
         "Write SQL for the users table.", "Return a record.", "The weather today is"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_hf_dir("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(vocab=VOCAB, seed=3, layers=2, hidden=64)
    return target, noisy_copy(target, noise=0.02, seed=4)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars.from_hf(tokenizer, VOCAB, [EOS])


def cases(tokenizer, n):
    """n (prompt ids, format) pairs cycling the formats and texts."""
    return [(tokenizer.encode(f"{TEXTS[i % len(TEXTS)]} ({i})"), FORMATS[i % len(FORMATS)]) for i in range(n)]


class GrammarProcessor(LogitsProcessor):
    """The reference constraint: llguidance's matcher fed each generated token, its mask applied."""

    def __init__(self, grammars: Grammars, fmt: dict, prompt_len: int):
        self.matcher = llguidance.LLMatcher(grammars.tokenizer, grammar_text(parse_response_format(fmt)), log_level=0)
        self.prompt_len, self.consumed = prompt_len, 0

    def allowed(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(VOCAB, dtype=bool)
        out[:min(VOCAB, len(bits))] = bits[:VOCAB].astype(bool)
        return torch.from_numpy(out)

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_len + self.consumed:].tolist()
        assert all(self.matcher.consume_token(t) for t in new), self.matcher.get_error()
        self.consumed += len(new)
        return scores.masked_fill(~self.allowed(), float("-inf"))


@torch.no_grad()
def reference(model, grammars, prompt, fmt):
    ids = torch.tensor([prompt])
    processor = GrammarProcessor(grammars, fmt, len(prompt))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0, logits_processor=LogitsProcessorList([processor]))
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def masked_top2_gap(model, grammars, prompt, fmt, generated) -> float:
    processor = GrammarProcessor(grammars, fmt, len(prompt))
    ids = torch.tensor([prompt + generated])
    logits = model(input_ids=ids).logits[0, -1].double()
    processor(ids, logits[None])                   # advances the matcher through `generated`
    top = logits.masked_fill(~processor.allowed(), float("-inf")).topk(2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module")
def references(models, grammars, tokenizer):
    return [reference(models[0], grammars, p, f) for p, f in cases(tokenizer, 40)]


def check_valid(text: str, fmt: dict) -> None:
    """An output that finished by its grammar is what the format promises."""
    parsed = parse_response_format(fmt)
    if parsed.is_json:
        jsonschema.validate(json.loads(text), parsed.schema())
    elif parsed.kind == "choice":
        assert text in fmt["choice"]
    elif parsed.kind == "regex":
        import re
        assert re.fullmatch(fmt["regex"], text), text


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 32])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_identity_with_grammar(models, grammars, tokenizer, references, kind, batch_size):
    target, draft = models
    n = 12 if batch_size == 1 else 40
    kind, _, tree = kind.partition("+")
    engine = make_engine(target, kind, draft, max_num_seqs=batch_size, max_model_len=160, g=4, eos=[EOS],
                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), grammars=grammars,
                         tree=TREE if tree else TreeParams())
    todo = cases(tokenizer, n)
    proposed_trees = [0]
    if tree:
        propose = engine.drafter.propose

        def counted(*args):
            found = propose(*args)
            proposed_trees[0] += found.is_tree
            return found
        engine.drafter.propose = counted
    for i, (prompt, fmt) in enumerate(todo):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_NEW, response_format=fmt))
    rounds, done = [], {}
    while engine.has_unfinished():
        out = engine.step()
        rounds += out.rounds
        done.update({c.request_id: c for c in out.finished})
    mismatches = 0
    for i, (prompt, fmt) in enumerate(todo):
        c, ref = done[str(i)], references[i]
        if c.output_ids != ref:
            mismatches += 1
            j = next((j for j, (a, b) in enumerate(zip(c.output_ids, ref)) if a != b), min(len(ref), len(c.output_ids)))
            gap = masked_top2_gap(target, grammars, prompt, fmt, ref[:j])
            assert gap < NEAR_TIE, f"row {i} ({fmt['type']}): first difference at {j}, top-2 gap {gap:.2e}"
            continue
        assert c.valid == (c.finish_reason == "eos") and c.finish_reason in ("eos", "length")
        if c.valid:
            check_valid(c.text, fmt)
    assert mismatches <= 1, f"{mismatches} near-tie mismatches out of {n}"
    assert sum(c.valid for c in done.values()) >= n // 2, "most rows must finish by their grammar"
    forced = sum(r.forced for r in rounds)
    assert forced > 0 and sum(r.forced_accepted for r in rounds) > 0.5 * forced
    if kind != "none":
        drafted = sum(r.draft_len - r.forced for r in rounds)
        assert drafted > 0, "the drafter's own tokens must be exercised"
    if tree:            # the grammar prunes trees; n-gram lookup on 12 rows of a random model finds few branches
        assert proposed_trees[0] > 0, "the drafter must propose trees under the grammar"
        if kind == "suffix" or batch_size > 1:
            assert any(r.paths > 1 and r.forced for r in rounds), "trees must hang under forced tokens"
    assert max(r.batch_size for r in rounds) >= batch_size * 3 // 4   # short rows finish while others wait


@pytest.mark.parametrize("kind", ["none", "ngram"])
def test_forced_tokens_change_nothing_but_the_rounds(models, grammars, tokenizer, kind):
    """The same greedy output with forced tokens on and off, in fewer rounds with them on."""
    outs = {}
    for forced in (True, False):
        engine = make_engine(models[0], kind, None, max_num_seqs=8, max_model_len=160, eos=[EOS],
                             grammars=grammars, forced_tokens=forced)
        for i, (prompt, fmt) in enumerate(cases(tokenizer, 8)):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_NEW, response_format=fmt))
        done = engine.run()
        outs[forced] = ({c.request_id: c.output_ids for c in done}, sum(c.num_rounds for c in done),
                        sum(c.num_forced for c in done))
    assert outs[True][0] == outs[False][0]
    assert outs[True][1] < outs[False][1] and outs[True][2] > 0 and outs[False][2] == 0


def test_bad_formats_are_refused_alone(models, grammars, tokenizer):
    engine = make_engine(models[0], "ngram", None, max_num_seqs=4, max_model_len=128, eos=[EOS], grammars=grammars)
    prompt = tokenizer.encode("Hello")
    bad = [({"type": "regex", "regex": "[a-"}, "regex does not compile"),
           ({"type": "json_schema", "json_schema": {"type": "wat"}}, "json_schema does not compile"),
           ('{"type": "choice", "choice": []}', "choice: expected a non-empty list"),
           ('{"type": "json_schema", "json_schema": ', "not valid JSON"),
           ({"type": "xml"}, "type: expected one of")]
    for i, (fmt, message) in enumerate(bad):
        with pytest.raises(RequestError, match=message) as err:
            engine.add_request(f"bad{i}", prompt, SamplingParams(max_tokens=8, response_format=fmt))
        assert err.value.field == "response_format" and err.value.code == "bad_response_format"
    engine.add_request("good", prompt, SamplingParams(max_tokens=30, response_format=FORMATS[3]))
    [done] = engine.run()
    assert done.valid and done.request_id == "good"


def test_stop_strings_only_where_the_grammar_accepts(models, grammars, tokenizer):
    """A stop string that occurs inside the record does not cut it; the record ends by its grammar."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    engine = make_engine(models[0], "ngram", None, max_num_seqs=4, max_model_len=160, eos=[EOS], decode=decode,
                         grammars=grammars)
    for i, (prompt, fmt) in enumerate(cases(tokenizer, 2)):      # two JSON schema rows: ", " inside
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=120, stop=(", ",), response_format=fmt))
    for c in engine.run():
        assert ", " in c.text and c.finish_reason == "eos" and c.valid
        json.loads(c.text)


def test_max_tokens_first_is_not_valid(models, grammars, tokenizer):
    engine = make_engine(models[0], "ngram", None, max_num_seqs=2, max_model_len=128, eos=[EOS], grammars=grammars)
    engine.add_request("short", tokenizer.encode("Record:"), SamplingParams(max_tokens=5, response_format=FORMATS[0]))
    [c] = engine.run()
    assert c.finish_reason == "length" and c.valid is False and len(c.output_ids) == 5


def test_no_grammars_no_format(models, tokenizer):
    engine = make_engine(models[0], "none", None, max_num_seqs=2, max_model_len=64)
    with pytest.raises(RequestError, match="no grammar support"):
        engine.add_request("x", [1, 2], SamplingParams(response_format=FORMATS[3]))


@pytest.mark.parametrize("vocab", [64, 70, 49152])
def test_bitmask_kernel_equals_its_definition(vocab):
    """The compiled kernel (or its fallback) sets exactly the tokens whose bit is 0 to -inf, tokens
    past the mask's words included."""
    from pipeline.engine.core.sampling import _apply_bitmask_torch, apply_bitmask_, bitmask_to_bool
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (min(vocab, 64) + 31) // 32 if vocab == 70 else (vocab + 31) // 32     # 70: two words short
    bits = torch.randint(-2**31, 2**31 - 1, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[0] = -1
    bits[1] = 0
    fast, slow = logits.clone(), logits.clone()
    apply_bitmask_(fast, bits)
    _apply_bitmask_torch(slow, bits)
    allowed = bitmask_to_bool(bits, vocab)
    assert torch.equal(fast, slow) and torch.equal(torch.isinf(fast), ~allowed)
    assert torch.equal(fast[allowed], logits[allowed])
    assert not torch.isinf(fast[0]).any() if vocab <= 32 * words else torch.isinf(fast[0, 32 * words:]).all()


@pytest.mark.parametrize("kind", ["ngram", "draft-prob"])
def test_verification_inside_the_graph_under_grammars(models, grammars, tokenizer, kind):
    """Sampled rows under grammars, with forced tokens: the engine verifying inside the graph's step
    (core/verify_step.py, the grammar masks among its inputs) emits what it emits verifying after the
    graph's forward, seed for seed."""
    target, draft = models
    outputs = []
    for inside in (True, False):
        engine = make_engine(target, kind, draft, max_num_seqs=4, max_model_len=160, g=4, eos=[EOS],
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), grammars=grammars,
                             cpu_attention="off", cuda_graphs=UNCAPTURED)
        engine.target.graphs.tails_enabled = inside
        for i, (prompt, fmt) in enumerate(cases(tokenizer, 8)):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95,
                                                              response_format=fmt), seed=i)
        done, forced = {}, 0
        while engine.has_unfinished():
            out = engine.step()
            done.update({c.request_id: c.output_ids for c in out.finished})
            forced += sum(r.forced for r in out.rounds)
        outputs.append(done)
        assert (engine.target.graphs.num_tails > 0) == inside and forced > 0
    assert outputs[0] == outputs[1]

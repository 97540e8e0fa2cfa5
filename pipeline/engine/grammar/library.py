"""The grammar library behind response_format: llguidance (MIT; chosen by measurement, see README
"Structured output"). This module is the only one that imports it.

  Grammars  one per tokenizer: compiles a ResponseFormat to llguidance's grammar text, once per
            distinct constraint (an LRU cache keyed by (kind, spec)), and makes a Guide per sequence
  Guide     one sequence's grammar state: the token mask at the current position, how many of a list
            of tokens the grammar allows, consume, rollback (cost proportional to the tokens undone),
            the forced tokens (the grammar admits exactly one continuation of bytes), accepting

JSON kinds compile with fixed separators (", " and ": ") and no free whitespace: the output is one
line of JSON, and keys, quotes and separators become forced tokens.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance

from ..core.request import RequestError
from ..core.response_format import ResponseFormat

if TYPE_CHECKING:
    import torch

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(fmt: ResponseFormat) -> str:
    """llguidance's grammar for a format (not yet checked). Raises RequestError for a schema the
    compiler refuses outright."""
    try:
        if fmt.is_json:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(fmt.schema()), defaults=JSON_OPTIONS)
        if fmt.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(fmt.spec)
        if fmt.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(fmt.spec)))
        return llguidance.grammar_from("grammar", fmt.spec)
    except ValueError as e:
        raise _error(fmt, str(e)) from None


def _error(fmt: ResponseFormat, message: str) -> RequestError:
    first = " ".join(message.strip().split())[:300]
    return RequestError("response_format", f"{fmt.kind} does not compile: {first}", "bad_response_format")


def check_format(fmt: ResponseFormat) -> None:
    """Compile without a tokenizer: raises RequestError naming the problem (a job-wide format is
    checked this way before any work)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(fmt))
    if error:
        raise _error(fmt, error)


class Grammars:
    """Compiled grammars for one tokenizer. `vocab_size` is the model's logits width (may exceed the
    tokenizer's); masks cover it, tokens past the tokenizer's never allowed."""

    def __init__(self, tokenizer: "llguidance.LLTokenizer", vocab_size: int, cache_size: int = 512):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self.words = (vocab_size + 31) // 32            # int32 words per mask
        self._cache: OrderedDict[tuple[str, str], tuple[str, llguidance.LLMatcher]] = OrderedDict()
        self.eos_ids = set(tokenizer.eos_tokens)
        import torch             # here, not at the top: check_format (a driver's config check) needs no torch
        self.eos_only = torch.zeros(self.words, dtype=torch.int32)     # the mask past an EOS: EOS alone
        for t in self.eos_ids:
            self.eos_only[t >> 5] |= torch.tensor(1 << (t & 31)).to(torch.int32)
        self.num_compiled = 0

    @classmethod
    def from_hf(cls, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> "Grammars":
        """For a Hugging Face fast tokenizer; the engine's EOS ids are the grammar's end."""
        import llguidance.hf
        eos = [int(t) for t in eos_token_ids] or None
        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos), vocab_size)

    def compile(self, fmt: ResponseFormat) -> str:
        """The checked grammar text; RequestError (field response_format) when it does not compile."""
        return self._compiled(fmt)[0]

    def _compiled(self, fmt: ResponseFormat) -> tuple[str, "llguidance.LLMatcher"]:
        """The grammar text and a matcher at its start, built once per format (a matcher parses its
        grammar, ~0.6 ms; a copy of a built one costs ~1 us) and kept for the last `cache_size` formats."""
        key = (fmt.kind, fmt.spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        text = grammar_text(fmt)
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise _error(fmt, error)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise _error(fmt, matcher.get_error())
        self._cache[key] = text, matcher
        self.num_compiled += 1
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return text, matcher

    def guide(self, fmt: ResponseFormat) -> "Guide":
        """A sequence's own grammar state: a copy of the format's matcher at its start (never advanced)."""
        return Guide(self._compiled(fmt)[1].deep_copy(), self.eos_ids, self.eos_only)


class Guide:
    """One sequence's grammar state, at its committed tokens plus whatever a round walked past them.

    EOS ends the grammar: the matcher allows it only where the grammar accepts, and an EOS walked
    past is kept here, not in the matcher (which does not count it as a token it can roll back); past
    it only EOS is allowed."""

    def __init__(self, matcher: "llguidance.LLMatcher", eos_ids: set[int], eos_only: torch.Tensor):
        self.matcher, self.eos_ids, self._eos_only = matcher, eos_ids, eos_only   # eos_only: Grammars', shared
        self.num_eos = 0                     # EOS tokens walked past the matcher's last token

    def fill_mask(self, out: torch.Tensor) -> None:
        """The allowed tokens at the current position into `out` (a contiguous CPU int32 [words] row:
        bit t % 32 of word t // 32). A matcher in an error state allows EOS only."""
        if self.num_eos:
            out.copy_(self._eos_only)
        else:
            self.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def consume(self, tokens: list[int]) -> None:
        for token in tokens:
            if token in self.eos_ids and (self.num_eos or self.matcher.is_accepting()):
                self.num_eos += 1
            elif self.num_eos or not self.matcher.consume_token(token):
                raise RuntimeError(f"grammar refused token {token}: {self.matcher.get_error()[:200]}")

    def rollback(self, n: int) -> None:
        undo_eos = min(n, self.num_eos)
        self.num_eos -= undo_eos
        if n > undo_eos and not self.matcher.rollback(n - undo_eos):
            raise RuntimeError(f"grammar rollback of {n - undo_eos} tokens failed: {self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here: the only continuation of bytes it admits, as the
        tokenizer spells it, then EOS where the grammar has ended. Where another spelling of the same
        bytes exists, the mask allows it too: the verifier weighs both (these are drafts, not
        commitments)."""
        if self.num_eos or (self.matcher.is_stopped() and not self.matcher.is_error()):
            return [min(self.eos_ids)] if self.eos_ids else []
        return self.matcher.compute_ff_tokens()

    @property
    def is_accepting(self) -> bool:
        return bool(self.num_eos) or self.matcher.is_accepting()

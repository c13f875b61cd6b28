"""Structured outputs: a grammar per choice, applied as a token bitmask to the logits on the device.

``StructuredOutputs`` is vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema,
dict or text), ``json_object`` (any JSON object), ``regex``, ``choice`` (a list of strings),
``grammar`` (Lark or GBNF / EBNF) or ``lark`` (llguidance's Lark, with ``%json {...}`` and
special tokens). JSON leaves no free whitespace unless ``disable_any_whitespace=False`` (vLLM's
flag; the default here is True), so even an untrained model closes its object.

The grammar library is llguidance (package index, no dependencies). ``GrammarBackend`` holds the
engine's tokenizer as llguidance sees it and compiles each distinct grammar once; every choice of a
request gets its own matcher, which consumes the choice's tokens as they are drawn (``advance``: the
matcher always stands at the row's generated tokens, whatever appended them, so preemption,
recompute and prefix caching change nothing). The engine and ``generate(...,
structured_outputs=...)`` share it. Each step, the rows with a grammar fill one int32 bitmask (B,
⌈V/32⌉) on the host (llguidance, in Rust, in parallel), which travels to the device as such and is
unpacked there (``allowed``): the scores of disallowed tokens become -inf before the penalty and the
warpers, so greedy, HF's processors and the seeded sampler all choose among the allowed tokens.
Every rank of a multi-rank engine runs its own matchers on the same tokens: they mask alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
NEG_INF = float("-inf")


@dataclass
class StructuredOutputs:
    """One request's constraint (vLLM's ``StructuredOutputsParams`` names); exactly one kind is set."""

    json: Optional[Any] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    lark: Optional[str] = None
    disable_any_whitespace: bool = True

    def __post_init__(self):
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise TypeError(f"structured_outputs.json must be a JSON schema (object or text), got {self.json!r}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        for name in ("regex", "grammar", "lark"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) for c in self.choice):
                raise TypeError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            value = self.disable_any_whitespace
            raise TypeError(f"structured_outputs.disable_any_whitespace must be a bool, got {value!r}")

    @classmethod
    def of(cls, value) -> Optional["StructuredOutputs"]:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {sorted(unknown)}; known: {', '.join(KINDS)}")
            return cls(**value)
        raise TypeError(f"structured_outputs must be a StructuredOutputs or a dict, got {type(value).__name__}")

    def key(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True)

    def to_llguidance(self) -> str:
        """The llguidance grammar (its JSON text); compiled and checked by ``GrammarBackend.compile``."""
        import llguidance

        options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.disable_any_whitespace:
            options["item_separator"], options["key_separator"] = ",", ":"
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if schema is True:
                schema = {}
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(self.choice))
        if self.lark is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.lark)
        return llguidance.grammar_from("grammar", self.grammar)


def _tokenizer_json(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None and hasattr(tokenizer, "to_str"):
        backend = tokenizer
    if backend is None:
        raise ValueError(
            f"structured_outputs needs a fast (tokenizers-based) tokenizer; this engine has {type(tokenizer).__name__}"
        )
    import copy

    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class _TokenBytes:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer it cannot load from JSON: each id's bytes
    (its text alone), the special ids, EOS, and an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos):
        self._tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.special_token_ids = sorted(t for t in special if t < vocab_size)
        self.tokens = [
            (tokenizer.convert_ids_to_tokens(i) or "").encode() if i in special else tokenizer.decode([i]).encode()
            for i in range(vocab_size)
        ]
        self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarBackend:
    """The engine's tokenizer for llguidance, the compiled grammars, and the device unpacking of masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import llguidance

        self.vocab_size = int(vocab_size)
        eos = [int(t) for t in eos_token_ids or ()]
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = [int(tokenizer.eos_token_id)]
        try:
            self.tokenizer = llguidance.LLTokenizer(
                _tokenizer_json(tokenizer), n_vocab=self.vocab_size, eos_token=eos or None
            )
        except ValueError:  # a decoder llguidance cannot read (e.g. a character-level "Fuse"): each token's bytes
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_TokenBytes(tokenizer, self.vocab_size, eos)), n_vocab=self.vocab_size
            )
        self.executor = llguidance.LLExecutor()
        self.words = (self.vocab_size + 31) // 32
        self._compiled: Dict[str, Any] = {}  # key -> a fresh matcher to deep_copy
        self._unpack: Dict[Any, tuple] = {}  # ops name -> (word index, bit divisor) device tensors

    def compile(self, spec: StructuredOutputs):
        """A matcher at the grammar's start (cached per grammar); ``ValueError`` for a grammar llguidance rejects."""
        import llguidance

        key = spec.key()
        found = self._compiled.get(key)
        if found is None:
            try:
                text = spec.to_llguidance()
            except Exception as exc:
                raise ValueError(f"structured_outputs: the grammar library rejects it: {exc}") from None
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs: the grammar library rejects it: {matcher.get_error()}")
            if len(self._compiled) > 256:
                self._compiled.clear()
            found = self._compiled[key] = matcher
        return found.deep_copy()

    def advance(self, state, spec: StructuredOutputs, tokens):
        """``state`` ([matcher, tokens consumed], or None before the first draw) moved to stand at ``tokens``
        (a row's generated ids so far): it consumes what was appended, and rolls back what a preemption
        took away, whoever appended or removed them."""
        if state is None:
            state = [self.compile(spec), 0]
        matcher, consumed = state
        if consumed > len(tokens):
            matcher.rollback(consumed - len(tokens))
            consumed = len(tokens)
        if consumed < len(tokens):
            matcher.consume_tokens([int(t) for t in tokens[consumed:]])
            consumed = len(tokens)
        state[1] = consumed
        return state

    def mask(self, ops, scores, matchers):
        """``scores`` (B, V) with -inf at the tokens each ``(matcher, row)`` pair's grammar disallows in its row."""
        from llguidance.numpy import fill_next_token_bitmask_par

        batch, width = int(scores.shape[0]), int(scores.shape[-1])
        bitmask = np.full((batch, self.words), -1, dtype=np.int32)
        fill_next_token_bitmask_par(self.executor, list(matchers), bitmask)
        allowed = self.allowed(ops, bitmask, width)
        return ops.where(allowed, scores, NEG_INF)

    def allowed(self, ops, bitmask: np.ndarray, width: int):
        """(B, width) device bool from the (B, W) int32 bitmask, unpacked on the device: byte t >> 3 of the
        row, bit t & 7 (a take, an integer division and a remainder; tokens past the mask: disallowed)."""
        key = (ops.name, width)
        if key not in self._unpack:
            tokens = np.arange(width)
            column = np.minimum(tokens >> 3, self.words * 4 - 1)
            divisor = (1 << (tokens & 7)).astype(np.int32)[None, :]
            inside = (tokens < self.vocab_size)[None, :]
            index = ops.asarray(column, "int32")  # (a device tensor: ``take`` uses it as is every step)
            self._unpack[key] = (index, ops.asarray(divisor, "int32"), ops.asarray(inside, "bool"))
        column, divisor, inside = self._unpack[key]
        data = ops.asarray(bitmask.view(np.uint8).astype(np.int32), "int32")  # (B, 4W): little-endian bytes
        bits = ops.take(data, column, 1)
        return ((bits // divisor) % 2 == 1) & inside


class RowGrammars:
    """``generate(..., structured_outputs=...)``: one grammar per output row (a spec for every row, or one per
    prompt, repeated for its ``num_return_sequences``), masked into each step's scores for the rows still
    running and advanced by the tokens they draw."""

    def __init__(self, backend: GrammarBackend, specs: List[Optional[StructuredOutputs]]):
        self.backend, self.specs = backend, specs
        self.states: List[Optional[list]] = [None] * len(specs)
        self.tokens: List[List[int]] = [[] for _ in specs]
        for spec in specs:  # a grammar the library rejects: ValueError before any forward
            if spec is not None:
                backend.compile(spec)

    @classmethod
    def build(cls, value, tokenizer, vocab_size: int, eos_token_ids, prompts: int, rows) -> "RowGrammars":
        """``value``: a ``StructuredOutputs`` / its dict for every prompt, or a list of them (None: free) per prompt;
        ``rows``: the prompt of each output row."""
        if tokenizer is None:
            raise ValueError("structured_outputs needs the tokenizer= argument (the grammar is over its tokens)")
        if isinstance(value, (list, tuple)):
            if len(value) != prompts:
                raise ValueError(f"structured_outputs has {len(value)} entries for {prompts} prompts")
            per_prompt = [StructuredOutputs.of(v) for v in value]
        else:
            per_prompt = [StructuredOutputs.of(value)] * prompts
        backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids)
        return cls(backend, [per_prompt[int(r)] for r in rows])

    def mask(self, ops, scores, running: np.ndarray):
        """``scores`` (B, V) with the running constrained rows' grammars applied."""
        pairs = []
        for row, spec in enumerate(self.specs):
            if spec is not None and running[row]:
                self.states[row] = self.backend.advance(self.states[row], spec, self.tokens[row])
                pairs.append((self.states[row][0], row))
        return self.backend.mask(ops, scores, pairs) if pairs else scores

    def observe(self, tokens: np.ndarray, running: np.ndarray) -> None:
        """The tokens the running rows drew this step."""
        for row in np.flatnonzero(running):
            self.tokens[row].append(int(tokens[row]))


__all__ = ["StructuredOutputs", "GrammarBackend", "RowGrammars", "KINDS"]

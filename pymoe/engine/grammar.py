"""Constrained decoding: a grammar turned into a mask over the vocabulary at every step, so the output parses.

    g = Grammar.from_request("json_schema", {"type": "object", ...})   # or "json_object", "gbnf", "lark", "regex"
    c = g.constraint(tokenizer)           # one per sequence: it follows what was generated so far
    allowed = c.allowed()                 # bool [V]: the tokens that keep the output a prefix of the language
    c.accept(token)                       # after the draw; c.finished once the grammar admits nothing but the end

What this is: a thin layer over llguidance (Microsoft's Rust grammar engine, maintained, a CPU-only wheel with no
torch). It was chosen over xgrammar (its wheel pulls torch in) and outlines-core (JSON schema and regex only, no
GBNF): llguidance takes JSON schemas, llama.cpp's GBNF (through its `gbnf_to_lark`), Lark and regexes, and computes
a mask in well under a millisecond for these vocabularies. The sampler (sampler.py) sets the logits of tokens outside
the mask to -inf before anything else, so every later step (penalties, top-k/p, temperature, logprobs) sees only
tokens that the grammar allows.
What this is not: tool-call parsing, or JSON validation of the result (the grammar makes it valid by construction;
the tests check that with an independent parser).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pymoe.errors import PymoeError

KINDS = ("json_object", "json_schema", "gbnf", "lark", "regex")
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object: any JSON object, as OpenAI's JSON mode
# JSON is written compactly ({"a":1,"b":[2]}): with free whitespace allowed, a weak model can spend its whole
# max_tokens on blanks between two tokens of an unfinished object. A schema's own "x-guidance" can say otherwise.
JSON_OPTIONS = {"whitespace_flexible": False}


# --- a JSON schema that no finite value satisfies --------------------------------------------------------------------

def _pointer(schema: dict, ref: str):
    """A local $ref ("#", "#/$defs/a", "#/definitions/a~1b") -> the node it names, or None (not local, or absent)."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _local_refs(node, out: set) -> set:
    """Every local "$ref" string anywhere in the schema."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out.add(ref)
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return out


def admits_a_value(schema: dict) -> bool:
    """Whether some finite JSON value can satisfy the schema, as far as its $refs decide it: the least fixpoint of
    "this node has a finite value", a $ref being finite only once its target is shown to be. Every kind of value
    counts as finite except an object with a required property that is not, an array that needs an item (minItems,
    prefixItems) that is not, a $ref to a node that is not, allOf with a part that is not, and anyOf / oneOf with no
    part that is. So {"properties": {"next": {"$ref": "#"}}, "required": ["next"], "type": "object"} admits none
    (every value would hold another), and without "required" it does ({}). What this is not: a full satisfiability
    check (contradicting keywords, enum against type, ...): those are the grammar compiler's."""
    refs = sorted(_local_refs(schema, set()))
    finite: dict = {}

    def has_value(node) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not finite.get(ref, False):
            return False
        if any(not has_value(part) for part in node.get("allOf", ())):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] and not any(has_value(part) for part in node[key]):
                return False
        types = node.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is not None and not any(has_type(node, t) for t in types):
            return False
        return True

    def has_type(node, kind) -> bool:
        if kind == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            return all(has_value(props.get(name, True)) for name in node.get("required", ()) if isinstance(name, str))
        if kind == "array":
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            need = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
            if not all(has_value(p) for p in prefix[:need]):
                return False
            return need <= len(prefix) or has_value(node.get("items", True))
        return True

    for _ in range(len(refs) + 1):  # each round shows at least one more $ref finite, or nothing changes
        changed = False
        for ref in refs:
            target = _pointer(schema, ref)
            ok = True if target is None else has_value(target)  # a $ref that names nothing: the compiler's to say
            if ok and not finite.get(ref, False):
                finite[ref], changed = True, True
        if not changed:
            break
    return has_value(schema)


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as e:
        raise PymoeError("constrained decoding needs llguidance (pip install -e . installs it)") from e
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar in llguidance's own form (`text`), and what it came from (`kind`, for messages)."""
    kind: str
    text: str

    @classmethod
    def from_request(cls, kind: str, source: Any) -> "Grammar":
        """kind in KINDS; source: a JSON schema (dict or JSON text) for json_schema, None for json_object, the
        grammar's text otherwise. A grammar that does not compile -> PymoeError saying why."""
        llg = _llguidance()
        try:
            if kind == "json_object":
                text = llg.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
            elif kind == "json_schema":
                schema = json.loads(source) if isinstance(source, str) else source
                if not isinstance(schema, dict):
                    raise PymoeError(f"invalid {kind}: a JSON schema is an object")
                if not admits_a_value(schema):
                    raise PymoeError(f"invalid {kind}: the schema admits no value (a part every value must have "
                                     "has none: a $ref recursion with no base case, or a false schema)")
                text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif kind == "gbnf":
                text = llg.grammar_from("lark", llg.gbnf_to_lark.gbnf_to_lark(source))
            elif kind == "lark":
                text = llg.LLMatcher.grammar_from_lark(source)
            elif kind == "regex":
                text = llg.LLMatcher.grammar_from_regex(source)
            else:
                raise PymoeError(f"unknown grammar kind {kind!r} (pymoe knows: {', '.join(KINDS)})")
        except PymoeError:
            raise
        except Exception as e:  # noqa: BLE001  the user's text met the compilers (json, gbnf_to_lark: plain Exception)
            raise PymoeError(f"invalid {kind}: {first_line(str(e)) or type(e).__name__}") from None
        error = llg.LLMatcher.validate_grammar(text)
        if error and not error.startswith("WARNING"):
            raise PymoeError(f"invalid {kind}: {first_line(error)}")
        return cls(kind, text)

    def constraint(self, tokenizer) -> "Constraint":
        return Constraint(self, ll_tokenizer(tokenizer), tokenizer.n_vocab)


def ll_tokenizer(tokenizer):
    """llguidance's view of a pymoe Tokenizer: every token's bytes, control tokens marked with a leading 0xFF (as
    llguidance's own llama.cpp adapter marks them, so a grammar's text can never produce them), the end-of-generation
    tokens as its EOS set. Built once per tokenizer (a pass over the vocabulary) and kept on it."""
    cached = getattr(tokenizer, "_ll_tokenizer", None)
    if cached is not None:
        return cached
    llg = _llguidance()
    from pymoe.engine.tokenizer import SPECIAL_TYPES

    class _Vocab:  # the duck type llguidance.TokenizerWrapper reads
        eos_token_id = min(tokenizer.eog_ids) if tokenizer.eog_ids else tokenizer.eos_id
        bos_token_id = tokenizer.bos_id
        tokens = [(b"\xff" + tokenizer.tokens[i].encode()) if tokenizer.types[i] in SPECIAL_TYPES
                  else tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]

        def __call__(self, text: str) -> list:
            return tokenizer.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"),
                                    add_bos=False, special=False)

    eos = sorted(tokenizer.eog_ids) or [tokenizer.eos_id]
    tokenizer._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=tokenizer.n_vocab,
                                              eos_token=eos)
    return tokenizer._ll_tokenizer


def first_line(error: str) -> str:
    """A compiler's message about the user's grammar, without the engine's state dump that may follow it."""
    return error.split("<state>")[0].strip().splitlines()[0] if error.strip() else ""


class Constraint:
    """One sequence's position in a grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, grammar: Grammar, ll_tok, n_vocab: int):
        llg = _llguidance()
        self.grammar, self.n_vocab = grammar, n_vocab
        self.matcher = llg.LLMatcher(ll_tok, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise PymoeError(f"invalid {grammar.kind}: {first_line(self.matcher.get_error())}")
        self._bits = llg.numpy.allocate_token_bitmask(1, n_vocab)  # int32 [1, ceil(V / 32)]

    def allowed(self) -> np.ndarray:
        """bool [V]: True where the token keeps the output inside the grammar (the EOG tokens once it is complete)."""
        _llguidance().numpy.fill_next_token_bitmask(self.matcher, self._bits)
        bits = self._bits[0].view(np.uint32)  # [ceil(V / 32)] bit j of word w: token 32 w + j
        return ((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).reshape(-1)[:self.n_vocab]

    def accept(self, token: int) -> None:
        """Move on by one drawn token. The mask allowed it, so a refusal is the engine giving up (its item limit, on
        a grammar too complex for it at this point): one line saying so, not the engine's state."""
        if not self.matcher.consume_token(int(token)):
            why = ("the grammar engine's work limit was reached (the grammar is too complex at this point)"
                   if "too many items" in self.matcher.get_error().lower() else "the grammar engine refused it")
            raise PymoeError(f"the {self.grammar.kind} grammar stopped at token {token}: {why}")

    def forced(self) -> list:
        """The tokens the grammar forces next, whatever is sampled (its fixed text: a JSON key, a tool call's marker;
        llguidance's compute_ff_tokens, which stops where a longer token could still start): [] when none."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more (the next token can only end the generation)."""
        return self.matcher.is_stopped()

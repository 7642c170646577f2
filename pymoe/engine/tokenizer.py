"""GGUF vocabulary -> text <-> token ids, the way llama.cpp does it; plus the chat template.

What this is: `Tokenizer`, built only from a file's `tokenizer.*` metadata, producing the same ids as llama.cpp's
`llama_tokenize` (the definition users' GGUF files are tokenized by; the tests compare against it), and
`apply_chat_template`, which renders the file's Jinja chat template in a sandbox.
What this is not: a trainer, a reader of `tokenizer.json`, or a tokenizer for vocab types other than the two MoE
files use: "gpt2" (byte-level BPE: Qwen, OLMoE, DeepSeek, Llama-3 style) and "llama" (SentencePiece BPE: Mixtral).

How one `encode` works (each step mirrors a function of llama.cpp's src/llama-vocab.cpp):
  1. split out special tokens (`tokenizer_st_partition`): every CONTROL / USER_DEFINED / UNKNOWN token's text is
     cut out of the raw text, longest token first, and becomes its id directly; it is never split into pieces.
     With `special=False` only USER_DEFINED tokens are cut out (llama.cpp, and HF, still treat those as atomic).
  2. each remaining text fragment goes through the BPE model of the `tokenizers` library, set up as follows:
       - gpt2:  pre-tokenizer regexes named by `tokenizer.ggml.pre` (table PRE_TOKENIZERS, strings copied from
                llama-vocab.cpp) -> GPT-2 byte-to-unicode mapping -> BPE with the file's ranked merges;
       - llama: " " -> "▁", a "▁" prefix at the start and after each special token (`add_space_prefix`) ->
                BPE whose merges are derived from the token scores (below), bytes missing from the vocab fall
                back to the <0xNN> tokens.
  3. bos is prepended when asked, or when the file says so (`tokenizer.ggml.add_bos_token`).

Why the special tokens are split here and not by `tokenizers`' added-token matcher: llama.cpp's rule (longest token
first over the whole text, then the next) differs from a leftmost-match scan when specials overlap, and a SentencePiece
vocab puts the "▁" prefix back after every special token; both are a few lines to write down, and then exact.

Why SentencePiece scores become BPE merges: llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose
concatenation is a vocab token with the highest score (ties: leftmost). A BPE whose merge list holds every split
(a, b) of every token t = a + b, ranked by t's score, makes the same choices. (Two splits of one token get distinct
ranks here where llama.cpp ties them; they only disagree if both occur in one fragment, which real vocabs, whose
scores are distinct, do not produce differently.)
"""
from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from gguf import TokenType

from pymoe.errors import PymoeError
from pymoe.gguf.config import checked

# --- pre-tokenizers (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe) ----------------------------------------------
# llama.cpp applies a pre-tokenizer's regexes one after the other; each splits every piece of the previous one into
# matches and the gaps between them ("isolated" splitting). Strings are copied verbatim from llama-vocab.cpp, which
# already rewrote the case-insensitive group `(?i:'s|'t|...)` of the HF originals into explicit [sS] classes.

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 differs from Llama-3 in one place: digits are split one by one (\p{N} instead of \p{N}{1,3}).
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: letter runs also take combining marks (\p{M}).
QWEN35_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a pre-token that is itself a vocab token is taken whole, before any merging
    add_bos: bool = False  # llama.cpp's default for `add_bos_token` when the file does not say


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = PreTokenizer((GPT2_REGEX,))
_LLAMA3 = PreTokenizer((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_REGEX,))
_STARCODER = PreTokenizer((r"\p{N}", GPT2_REGEX))

# `tokenizer.ggml.pre` -> pre-tokenizer. The names are llama.cpp's (llama_vocab::impl::load); a name missing here is
# refused rather than guessed, because a wrong split silently changes every id.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,  # also used when the key is absent (llama.cpp warns: quality degraded)
    # Llama-3 family
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "dbrx": PreTokenizer((LLAMA3_REGEX,)), "smaug-bpe": PreTokenizer((LLAMA3_REGEX,)),
    # GPT-2 regex. OLMo / OLMoE files say "olmo"; note llama.cpp spells GPT-2 itself "gpt-2" ("gpt2" is refused).
    "gpt-2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2, "exaone4": _GPT2,
    "starcoder": _STARCODER, "refact": _STARCODER, "smollm": _STARCODER, "codeshell": _STARCODER,
    "exaone": _STARCODER, "command-r": _STARCODER,
    # Qwen family: Qwen1.5/2/2.5/3 (and their MoEs), DeepSeek-R1 distills of Qwen, StableLM-2
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2, "stablelm2": _QWEN2,
    "qwen35": PreTokenizer((QWEN35_REGEX,)),
}

# --- special-token bookkeeping (llama_vocab::impl::load) ------------------------------------------------------------
# llama.cpp ends generation on these texts whatever their declared type, and forces them to CONTROL, so they are
# matched as whole tokens too ("<|im_end|>" is NORMAL in some converted files).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# Without `tokenizer.ggml.eot_token_id`, the end-of-turn token is found by one of these texts.
EOT_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                       "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"})
# Fill-in-the-middle markers are forced to CONTROL as well; pad/repo/file-separator ones also end generation.
FIM_TEXTS = frozenset({
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
})
FIM_EOG_TEXTS = frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
                           "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"})

SPECIAL_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Used when a file has no `tokenizer.chat_template` (ChatML, what Qwen and OLMoE instruct models use).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: byte-level BPE vocabularies spell every byte as one of these.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, ...) to U+0100 onwards, so that
    " " is "Ġ" and "\\n" is "Ċ" in the vocab.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_GPT2_BYTE_OF = {c: b for b, c in gpt2_bytes_to_unicode().items()}
_SPM_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

Metadata = Callable[[str, Any], Any]


class Tokenizer:
    """Text <-> ids for one GGUF file, equal to llama.cpp's `llama_tokenize(text, add_special, parse_special)`.

    `source` is a `GGUFModel` (anything with `.metadata(key, default)`), a dict of metadata, or a getter
    `get(key, default)`.
    """

    def __init__(self, source: Union[Any, Metadata]):
        if hasattr(source, "metadata"):
            get: Metadata = source.metadata
        elif isinstance(source, Mapping):
            get = source.get
        else:
            get = source
        where = f"{source.path}: " if hasattr(source, "path") else ""
        get = _typed_getter(get, where)
        self.model = get("tokenizer.ggml.model", None, "text")
        tokens = get("tokenizer.ggml.tokens", None, "list", "text")
        if self.model is None or tokens is None:
            raise PymoeError(f"{where}no tokenizer in the file (missing tokenizer.ggml.model or tokenizer.ggml.tokens)")
        # llama.cpp renames empty tokens so that every id has a distinct, non-empty text.
        self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = get("tokenizer.ggml.token_type", None, "list", "int") or [TokenType.NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise PymoeError(f"{where}tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        self.types: list[TokenType] = [_token_type(t) for t in types]
        self.n_vocab = len(self.tokens)
        self.id_of = {t: i for i, t in enumerate(self.tokens)}  # duplicates: the last id wins, as in llama.cpp

        self.warnings: list[str] = []  # what the loader prints as "warning: ..." lines (api.load)

        def special_id(key):
            i = get(f"tokenizer.ggml.{key}_token_id", None, "int")
            if i is not None and not 0 <= int(i) < self.n_vocab:  # llama.cpp: "bad special token", then ignored
                self.warnings.append(f"{where}tokenizer.ggml.{key}_token_id {int(i)} is not a token of the "
                                     f"{self.n_vocab}-token vocabulary: ignored, as llama.cpp does"
                                     + (" (generation then stops only at -n, a stop string or another "
                                        "end-of-generation token)" if key == "eos" else ""))
                return None
            return None if i is None else int(i)

        for key in ("padding", "unknown", "seperator", "cls", "mask"):  # not used here, but named when broken
            special_id(key)

        if self.model == "gpt2":
            pre_name = get("tokenizer.ggml.pre", None, "text") or "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise PymoeError(f"{where}unsupported pre-tokenizer tokenizer.ggml.pre={pre_name!r} "
                                 f"(pymoe knows: {', '.join(sorted(PRE_TOKENIZERS))})")
            self.pre_name = pre_name
            self.add_space_prefix = bool(get("tokenizer.ggml.add_space_prefix", False, "flag"))
            default_add_bos = pre.add_bos
            merges = get("tokenizer.ggml.merges", None, "list", "text")
            if merges is None:
                raise PymoeError(f"{where}byte-level BPE vocab without tokenizer.ggml.merges")
            self._bpe = _byte_level_bpe(self.id_of, merges, pre, where)
        elif self.model == "llama":
            self.pre_name = "default"  # llama.cpp ignores tokenizer.ggml.pre for SentencePiece vocabs
            self.add_space_prefix = bool(get("tokenizer.ggml.add_space_prefix", True, "flag"))
            default_add_bos = True
            scores = get("tokenizer.ggml.scores", None, "list", "real") or [0.0] * self.n_vocab
            if len(scores) != self.n_vocab:
                raise PymoeError(f"{where}tokenizer.ggml.scores has {len(scores)} entries for {self.n_vocab} tokens")
            self._bpe = _sentencepiece_bpe(self.tokens, self.types, [float(s) for s in scores], self.id_of)
        else:
            raise PymoeError(f"{where}unsupported tokenizer tokenizer.ggml.model={self.model!r} "
                             f"(pymoe knows 'gpt2' and 'llama')")

        self.bos_id = special_id("bos")
        self.eos_id = special_id("eos")
        self.eot_id = special_id("eot")
        self.eom_id = special_id("eom")
        self.add_bos = bool(get("tokenizer.ggml.add_bos_token", default_add_bos, "flag"))
        self.add_eos = bool(get("tokenizer.ggml.add_eos_token", False, "flag"))  # true only for some encoder-style vocabs
        if self.eot_id is None:  # llama.cpp finds the end-of-turn token by its text when the key is absent
            self.eot_id = next((i for i, t in enumerate(self.tokens) if t in EOT_TEXTS), None)
        for i, t in enumerate(self.tokens):  # texts that look like control tokens are control tokens
            if t in EOG_TEXTS or t in FIM_TEXTS or t in FIM_EOG_TEXTS:
                if self.types[i] not in SPECIAL_TYPES:
                    self.types[i] = TokenType.CONTROL
        self.eog_ids = frozenset(
            [i for i, t in enumerate(self.tokens) if t in EOG_TEXTS or t in FIM_EOG_TEXTS]
            + [i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None])
        self._harmony_tokens()

        # Special tokens, longest (in UTF-8 bytes) first: the order llama.cpp cuts them out of the text.
        self._specials = sorted((i for i, ty in enumerate(self.types) if ty in SPECIAL_TYPES),
                                key=lambda i: (-len(self.tokens[i].encode()), i))
        self._piece_cache: dict[int, bytes] = {}
        self.chat_template: Optional[str] = get("tokenizer.chat_template", None, "text")

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        from pymoe.gguf.loader import load_gguf
        return cls(load_gguf(path))

    def _harmony_tokens(self) -> None:
        """gpt-oss's harmony vocabulary, as llama.cpp's llama_vocab::impl::load patches it: the message markers
        <|channel|>, <|message|>, <|start|>, <|constrain|> become USER_DEFINED (always in the decoded text, so a
        server can read an answer's channels back: serve/tools.py), and where both <|return|> and <|call|> end a
        generation, <|end|> (which closes an analysis message in the middle of an answer) no longer does."""
        for i, t in enumerate(self.tokens):
            if t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
                self.types[i] = TokenType.USER_DEFINED
        eog = {self.tokens[i]: i for i in self.eog_ids}
        if "<|return|>" in eog and "<|call|>" in eog and "<|end|>" in eog:
            self.types[eog["<|end|>"]] = TokenType.USER_DEFINED
            self.eog_ids = self.eog_ids - {eog["<|end|>"]}

    # --- encode -------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: Optional[bool] = None, special: bool = True) -> list[int]:
        """Token ids of `text`. `add_bos=None` uses the file's `tokenizer.ggml.add_bos_token` (llama.cpp's default
        for the vocab type when absent). `special=True` matches control-token texts such as "<|im_start|>" as those
        tokens (what a rendered chat prompt needs); `special=False` tokenizes them as plain text (user input), except
        USER_DEFINED tokens, which llama.cpp keeps whole either way.
        A file with `tokenizer.ggml.add_eos_token` also gets eos appended unless add_bos=False (llama.cpp's
        `add_special` switches both)."""
        ids: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise PymoeError("add_bos requested but the file has no tokenizer.ggml.bos_token_id")
            ids.append(self.bos_id)
        add_eos = self.add_eos and add_bos is not False and self.eos_id is not None
        prev_special = True  # SentencePiece: the text start counts as "after a special token"
        for piece in self.split_special(text, special):
            if isinstance(piece, int):
                ids.append(piece)
                prev_special = True
            else:
                ids.extend(self._encode_fragment(piece, prefix_space=prev_special))
                prev_special = False
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def split_special(self, text: str, special: bool = True) -> list[Union[str, int]]:
        """`text` cut into plain-text fragments (str) and special tokens (int id), llama.cpp's way: for each special
        token, longest first, every occurrence in every remaining text fragment is cut out."""
        parts: list[Union[str, int]] = [text] if text else []
        for tid in self._specials:
            if not special and self.types[tid] != TokenType.USER_DEFINED:
                continue
            needle = self.tokens[tid]
            if not any(isinstance(p, str) and needle in p for p in parts):
                continue
            out: list[Union[str, int]] = []
            for p in parts:
                if isinstance(p, int) or needle not in p:
                    out.append(p)
                    continue
                for k, chunk in enumerate(p.split(needle)):
                    if k:
                        out.append(tid)
                    if chunk:
                        out.append(chunk)
            parts = out
        return parts

    def _encode_fragment(self, text: str, prefix_space: bool) -> list[int]:
        if self.model == "llama":
            # SentencePiece sees spaces as "▁" and a word boundary before the first word of each fragment.
            if self.add_space_prefix and prefix_space:
                text = " " + text
            text = text.replace(" ", SPM_SPACE)
        # add_special_tokens=False: bos/eos are handled in `encode`, and `_bpe` has no post-processor anyway.
        # encode_batch of one text, not encode: the same ids, but it lets go of the GIL while the Rust code runs;
        # encode (tokenizers 0.23) held it, from its second call on, for the whole call (4.6 s for 3 MB of text,
        # during which no other Python thread ran: a server's event loop, its engine thread).
        return self._bpe.encode_batch([text], add_special_tokens=False)[0].ids

    # --- decode -------------------------------------------------------------------------------------------------
    def token_bytes(self, tid: int, special: bool = True) -> bytes:
        """The bytes one token stands for (llama.cpp's `token_to_piece`). Control tokens give their text when
        `special`, else nothing. Bytes, not str: one byte-level token can hold part of a UTF-8 character."""
        ty = self.types[tid]
        if ty in (TokenType.CONTROL, TokenType.UNKNOWN):
            return self.tokens[tid].encode() if special else b""
        if tid not in self._piece_cache:
            self._piece_cache[tid] = self._piece(tid)
        return self._piece_cache[tid]

    def _piece(self, tid: int) -> bytes:
        text, ty = self.tokens[tid], self.types[tid]
        if ty == TokenType.USER_DEFINED:
            return text.encode()
        if self.model == "llama":
            m = _SPM_BYTE_TOKEN.fullmatch(text)
            if ty == TokenType.BYTE and m:
                return bytes([int(m.group(1), 16)])
            return text.replace(SPM_SPACE, " ").encode()
        # A character outside GPT-2's byte alphabet cannot come from the BPE; keep it as its own UTF-8.
        return b"".join(bytes([_GPT2_BYTE_OF[c]]) if c in _GPT2_BYTE_OF else c.encode() for c in text)

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """Text of `ids`; incomplete or invalid UTF-8 becomes U+FFFD instead of an error. No space clean-up, so
        `decode(encode(s)) == s`. SentencePiece: the "▁" that `encode` put before a fragment is removed again."""
        out = bytearray()
        strip_next = self.model == "llama" and self.add_space_prefix
        for tid in ids:
            tid = int(tid)
            if self.types[tid] in SPECIAL_TYPES:
                out += self.token_bytes(tid, special)
                strip_next = self.model == "llama" and self.add_space_prefix
                continue
            piece = self.token_bytes(tid, special)
            if strip_next and piece.startswith(b" "):
                piece = piece[1:]
            strip_next = False  # only the first token of a fragment carries the prefix
            out += piece
        return out.decode("utf-8", errors="replace")

    def decode_stream(self, special: bool = False, preserved: frozenset = frozenset()) -> "DecodeStream":
        """An incremental detokenizer for printing tokens as they are generated (see `DecodeStream`); `preserved`:
        control token ids whose text is shown even without `special`."""
        return DecodeStream(self, special, preserved)

    def is_eog(self, tid: int) -> bool:
        """End of generation: eos, eot, eom, and the end-of-turn tokens llama.cpp recognises by text."""
        return tid in self.eog_ids

    # --- chat template ------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render `tokenizer.chat_template` (or ChatML when the file has none) for `messages` [{role, content}].

        The template comes from a downloaded file, so it is untrusted code: it runs in jinja2's
        ImmutableSandboxedEnvironment, within budgets of work, time and output size (engine/chat_template.py).
        The names a template sees are those of HF `apply_chat_template`: messages, add_generation_prompt,
        bos_token, eos_token, raise_exception(), strftime_now(); `extra` adds more (tools=..., ...).
        Any failure, including the template's own raise_exception() and a budget it exceeds, is a one-line
        PymoeError.
        """
        from pymoe.engine.chat_template import render

        context = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self._text_of(self.bos_id), eos_token=self._text_of(self.eos_id), **extra)
        try:
            return render(self.chat_template or CHATML_TEMPLATE, context)
        except Exception as e:  # untrusted template: whatever it raises is a bad-input error, not a pymoe bug
            msg = " ".join(str(e).split()) or type(e).__name__
            raise PymoeError(f"chat template: {type(e).__name__}: {msg}") from None

    def _text_of(self, tid: Optional[int]) -> str:
        return self.tokens[tid] if tid is not None else ""


class DecodeStream:
    """Token ids in, printable text out, one token at a time.

    A byte-level token can end in the middle of a UTF-8 character (an emoji is often 2-4 tokens), so bytes are fed
    to an incremental UTF-8 decoder that returns text only once a character is complete: `put` returns "" until
    then, and never a broken character. `flush` ends the stream (a dangling partial character becomes U+FFFD).
    No SentencePiece prefix-space stripping here: generated text continues a prompt, so its spaces are real.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False, preserved: frozenset = frozenset()):
        self.tokenizer = tokenizer
        self.special = special
        self.preserved = preserved  # control tokens shown all the same (llama.cpp's preserved_tokens: a tool-call
        #                             format's markers, which the server must see to read the calls back)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def put(self, tid: int) -> str:
        tid = int(tid)
        return self._utf8.decode(self.tokenizer.token_bytes(tid, self.special or tid in self.preserved))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    def __call__(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the non-empty text pieces of `ids`, then what `flush` returns."""
        for tid in ids:
            text = self.put(tid)
            if text:
                yield text
        text = self.flush()
        if text:
            yield text


# --- building the `tokenizers` models ---------------------------------------------------------------------------------

UNDEFINED = 0  # llama.h's LLAMA_TOKEN_TYPE_UNDEFINED (gguf-py's TokenType has no member for it)


def _token_type(value) -> TokenType:
    try:
        return TokenType(int(value))
    except ValueError:
        return UNDEFINED  # llama.cpp gives unknown type numbers the UNDEFINED attribute too: a plain, non-special id


def _typed_getter(get: Metadata, where: str):
    """get(key, default, kind[, item kind]) -> the value, or one line naming the key when it has another type (a
    fuzzed file's token list may be an array of numbers, its bos id a string): gguf/config.checked's rules."""
    def typed(key, default, kind, item=None):
        value = get(key, default)
        return value if value is default else checked(key, value, kind, item, where)
    return typed


def _byte_level_bpe(vocab: dict[str, int], merges: list[str], pre: PreTokenizer, where: str):
    """A `tokenizers.Tokenizer`: regex splits -> GPT-2 byte mapping -> BPE with the file's merges, in rank order."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    pairs = []
    for m in merges:
        # llama.cpp splits a merge at the first space after position 0; GPT-2 vocabularies have no raw spaces.
        cut = m.find(" ", 1)
        if cut < 0:
            raise PymoeError(f"{where}bad merge {m!r} in tokenizer.ggml.merges (expected 'left right')")
        pairs.append((m[:cut], m[cut + 1:]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    except Exception as e:
        raise PymoeError(f"{where}inconsistent tokenizer.ggml.merges ({e})") from None
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _sentencepiece_bpe(tokens: list[str], types: list[TokenType], scores: list[float], vocab: dict[str, int]):
    """A `tokenizers.Tokenizer` reproducing llama.cpp's SentencePiece-BPE (`llm_tokenizer_spm_session`).

    llama.cpp merges, among adjacent symbols, the pair whose concatenation is a vocab token of highest score. So the
    merge list is every split (a, b) of every token t = a + b with both halves in the vocab, ranked by t's score
    (higher first; equal scores by id). Single characters not in the vocab become <0xNN> byte tokens.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    ranked = []
    for tid, t in enumerate(tokens):
        if vocab.get(t) != tid:  # a duplicate text; llama.cpp's text->id map keeps the last one
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                ranked.append((-scores[tid], tid, t[:k], t[k:]))
    ranked.sort()
    has_bytes = any(ty == TokenType.BYTE for ty in types)
    unk = next((t for t, ty in zip(tokens, types) if ty == TokenType.UNKNOWN), None)
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked], unk_token=unk, byte_fallback=has_bytes)
    return HFTokenizer(bpe)

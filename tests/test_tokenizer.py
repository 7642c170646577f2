"""Tokenizer: ids equal to llama.cpp's (`Llama(..., vocab_only=True).tokenize`), round trips, streaming, chat template.

The oracle is llama.cpp through llama-cpp-python on the very same file. Besides the tiny models of conftest (byte-level
BPE, pre-tokenizer "qwen2"), this file writes vocab-only GGUFs (no tensors; llama.cpp's vocab_only load needs only
the hparams of a small dense "llama") to cover the other pre-tokenizers and a hand-made SentencePiece vocab.
"""
import json

import pytest
from gguf import GGUFWriter, TokenType

from pymoe.errors import PymoeError
from pymoe.demo.tinymodel import CHAT_TEMPLATE, SPECIAL_TOKENS, TOKENIZER_CORPUS
from pymoe.engine.tokenizer import SPM_SPACE, Tokenizer

from oracle import require_llama_cpp

TRICKY = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    # scripts
    "混合专家模型只激活少数专家。缓存命中率",
    "日本語のテキスト、漢字とかな",
    "Смесь экспертов: кэш в видеопамяти",
    "العربية نص، مرحبا بالعالم",
    "हिन्दी पाठ और देवनागरी",
    "Ελληνικά κείμενα",
    "café naïve résumé Ünïcödé",
    # emoji: multi-codepoint, ZWJ sequences, flags, variation selectors, skin tones
    "emoji: 🚀 🧠 ✨",
    "👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈",
    "🇯🇵🇺🇸🇩🇪",
    "❤️ 👍🏽 😀😀😀",
    # whitespace
    "  two leading spaces",
    "trailing spaces   ",
    "a\tb\t\tc",
    "\n\n\n",
    "line one\nline two\r\nline three",
    "   \n   \n",
    " ",
    "    indented    text with   runs of spaces",
    "\u00a0nbsp\u3000ideographic space",
    # digits (qwen2 splits every digit, llama-3 groups of three)
    "12345678901234567890",
    "3.14159 1e-6 0x1F 2026-11-29 1,000,000",
    # contractions and case
    "don't won't it's we're they've I'LL I'D",
    "'s 'S 'Re '",
    # code and markup
    'def forward(self, x):\n    return x @ w.T  # [T, D]\n',
    '{"role": "user", "content": "hi"} <tag attr="x">t</tag>',
    "a+b=c; x<=y || z>>=2 && !q ~~ $$ ^^ `code`",
    # special tokens inside text
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start",
    "a <think>b</think> <think",
    "",
]


@pytest.fixture(scope="module")
def qwen_tok(tiny_model):
    """pymoe's tokenizer of the tiny qwen3moe file (no oracle needed)."""
    from pymoe.gguf.loader import load_gguf

    return Tokenizer(load_gguf(tiny_model("qwen3moe", "f32")))


@pytest.fixture(scope="module")
def qwen(qwen_tok, tiny_model):
    """(pymoe's tokenizer, llama.cpp's vocab) of the same file: for the tests that compare with the oracle."""
    return qwen_tok, llama_vocab(tiny_model("qwen3moe", "f32"))


def llama_vocab(path):
    return require_llama_cpp().Llama(model_path=str(path), vocab_only=True, verbose=False)


def llama_ids(ll, text, special=True, add_bos=False):
    return ll.tokenize(text.encode(), add_bos=add_bos, special=special)


# --- vocab-only GGUF files -------------------------------------------------------------------------------------------

def write_vocab_gguf(path, meta: dict) -> str:
    """A GGUF holding only tokenizer metadata (+ the hparams llama.cpp reads before the vocab)."""
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(16)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.add_bos_token" in meta:
        w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def byte_level_vocab():
    """A byte-level BPE trained *without* any pre-tokenizer split, on the corpus and the test strings, so that its
    merges cross spaces, digits, punctuation and script boundaries: then every boundary the pre-tokenizer regex draws
    (or fails to draw) changes the ids, which is what the comparison with llama.cpp should be sensitive to."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(TOKENIZER_CORPUS.splitlines(keepends=True) + TRICKY * 3, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    types = [int(TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    # A USER_DEFINED token (as converters write for e.g. "<think>"): atomic even with special=False.
    tokens.append("<think>")
    types.append(int(TokenType.USER_DEFINED))
    eos = tokens.index("<|endoftext|>")
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": eos, "tokenizer.ggml.eos_token_id": eos,
            "tokenizer.ggml.add_bos_token": False}


def spm_vocab():
    """A small SentencePiece-style (Mixtral-like) vocab: <unk> <s> </s>, 256 <0xNN> byte tokens, then pieces with
    "▁" for spaces, scored so that later merges score lower (as SentencePiece BPE does). The corpus leaves out CJK
    and emoji lines, so those characters are missing from the vocab and must fall back to byte tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    corpus = [line for line in TOKENIZER_CORPUS.splitlines() if not any(ord(c) > 0x2FFF for c in line)]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, prepend_scheme="always")
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    merged = []
    for a, b in merges:
        if a + b not in merged:
            merged.append(a + b)
    chars = sorted(t for t in model["vocab"] if len(t) == 1)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for i, t in enumerate(merged):
        tokens.append(t)
        types.append(TokenType.NORMAL)
        scores.append(-float(i))
    for i, c in enumerate(chars):
        if c not in tokens:
            tokens.append(c)
            types.append(TokenType.NORMAL)
            scores.append(-1e4 - i)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}


# --- ids equal llama.cpp's -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("special", [True, False])
def test_ids_match_llama_cpp_qwen2(qwen, special):
    tok, ll = qwen
    assert tok.pre_name == "qwen2"
    for text in TRICKY:
        assert tok.encode(text, add_bos=False, special=special) == llama_ids(ll, text, special), repr(text)


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe"])
def test_ids_match_llama_cpp_other_tiny_models(tiny_model, arch):
    from pymoe.gguf.loader import load_gguf

    path = tiny_model(arch, "f32")
    tok, ll = Tokenizer(load_gguf(path)), llama_vocab(path)
    for text in TRICKY:
        assert tok.encode(text) == llama_ids(ll, text), repr(text)


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "olmo", "default", "starcoder"])
def test_ids_match_llama_cpp_pre_tokenizers(tmp_path, byte_level_vocab, pre):
    meta = dict(byte_level_vocab, **{"tokenizer.ggml.pre": pre})
    tok = Tokenizer(meta.get)
    ll = llama_vocab(write_vocab_gguf(tmp_path / f"vocab-{pre}.gguf", meta))
    for special in (True, False):
        for text in TRICKY:
            assert tok.encode(text, special=special) == llama_ids(ll, text, special), (pre, special, repr(text))
    assert tok.encode("hi", add_bos=True)[0] == meta["tokenizer.ggml.bos_token_id"]


def test_user_defined_tokens_stay_whole_without_special(byte_level_vocab):
    tok = Tokenizer(dict(byte_level_vocab, **{"tokenizer.ggml.pre": "qwen2"}).get)
    think, im_start = tok.id_of["<think>"], tok.id_of["<|im_start|>"]
    assert think in tok.encode("x<think>y", special=False)
    assert im_start not in tok.encode("x<|im_start|>y", special=False)
    assert im_start in tok.encode("x<|im_start|>y", special=True)


def test_llama3_adds_bos_by_default(tmp_path, byte_level_vocab):
    meta = dict(byte_level_vocab, **{"tokenizer.ggml.pre": "llama-bpe"})
    del meta["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer(meta.get)
    ll = llama_vocab(write_vocab_gguf(tmp_path / "vocab-llama3.gguf", meta))
    assert tok.add_bos
    assert tok.encode("Hello") == ll.tokenize(b"Hello", add_bos=True, special=True)


def test_ids_match_llama_cpp_sentencepiece(tmp_path):
    meta = spm_vocab()
    tok = Tokenizer(meta.get)
    ll = llama_vocab(write_vocab_gguf(tmp_path / "vocab-spm.gguf", meta))
    extra = ["<s>[INST] hi [/INST] ok</s>", "a<s>b</s> c", "<unk>", "▁already▁escaped"]
    for text in TRICKY + extra:
        for special in (True, False):
            assert tok.encode(text, add_bos=False, special=special) == llama_ids(ll, text, special), \
                (special, repr(text))
        assert tok.encode(text) == llama_ids(ll, text, add_bos=True), repr(text)  # SPM adds bos by default
    # the CJK / emoji characters are not in this vocab: they must have come out as byte tokens
    byte_ids = {i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == TokenType.BYTE}
    assert set(tok.encode("专家 🚀")) & byte_ids


# --- decode ----------------------------------------------------------------------------------------------------------

def test_round_trip(qwen_tok):
    tok = qwen_tok
    for text in TRICKY:
        for special in (True, False):
            assert tok.decode(tok.encode(text, special=special)) == text, repr(text)


def test_round_trip_sentencepiece():
    tok = Tokenizer(spm_vocab().get)
    for text in TRICKY + ["a<s>b</s> c"]:
        assert tok.decode(tok.encode(text, add_bos=False)) == text, repr(text)
    assert tok.decode(tok.encode("Hello world")) == "<s>Hello world"  # bos added by default, rendered as text
    assert tok.decode(tok.encode("Hello world"), special=False) == "Hello world"


def test_decode_matches_llama_cpp_pieces(qwen):
    tok, ll = qwen
    ids = tok.encode("👩‍💻 hi<|im_end|>")
    assert b"".join(tok.token_bytes(i) for i in ids) == ll.detokenize(ids, special=True)
    assert tok.decode(ids, special=False) == ll.detokenize(ids, special=False).decode()


def test_decode_incomplete_utf8_does_not_crash(qwen_tok):
    tok = qwen_tok
    ids = tok.encode("🚀")
    assert len(ids) > 1, "the test needs an emoji split over several tokens"
    assert tok.decode(ids[:-1]).endswith("\ufffd")


def test_stream_yields_emoji_once(qwen_tok):
    tok = qwen_tok
    ids = tok.encode("ok 🧠👩‍💻!")
    stream = tok.decode_stream()
    pieces = [stream.put(i) for i in ids]
    assert "".join(pieces) + stream.flush() == "ok 🧠👩‍💻!"
    assert all("\ufffd" not in p for p in pieces)
    assert sum(p.count("🧠") for p in pieces) == 1
    assert any(p == "" for p in pieces), "some token ended mid-character and must have produced no text yet"
    assert "".join(tok.decode_stream()(ids)) == "ok 🧠👩‍💻!"


def test_eog(qwen):
    tok, ll = qwen
    vocab = ll._model.vocab
    assert [i for i in range(tok.n_vocab) if tok.is_eog(i)] == \
        [i for i in range(ll.n_vocab()) if require_llama_cpp().llama_vocab_is_eog(vocab, i)]
    assert tok.n_vocab == ll.n_vocab()
    im_end = tok.encode("<|im_end|>")[0]
    assert tok.is_eog(tok.eos_id) and tok.is_eog(im_end)
    assert not tok.is_eog(tok.encode("<|im_start|>")[0])
    assert not tok.is_eog(tok.encode("a")[0])


# --- chat template ---------------------------------------------------------------------------------------------------

def test_chat_template_chatml(qwen_tok):
    tok = qwen_tok
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected[:-len("<|im_start|>assistant\n")]
    ids = tok.encode(expected)
    assert ids[0] == tok.id_of["<|im_start|>"]


def test_chat_template_fallback_and_names(byte_level_vocab):
    tok = Tokenizer(dict(byte_level_vocab, **{"tokenizer.ggml.pre": "qwen2"}).get)
    assert tok.chat_template is None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    tok.chat_template = "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}"
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '<|endoftext|>|<|endoftext|>|[{"role": "user", "content": "é"}]'


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% set _ = messages.append(1) %}",
    "{{ raise_exception('roles must alternate\nuser/assistant') }}",
    "{% for %}",
])
def test_chat_template_errors_are_one_line(qwen_tok, template):
    tok = qwen_tok
    saved = tok.chat_template
    tok.chat_template = template
    try:
        with pytest.raises(PymoeError) as e:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        tok.chat_template = saved
    assert len(str(e.value).splitlines()) == 1
    assert str(e.value).startswith("chat template:")


# --- bad metadata ----------------------------------------------------------------------------------------------------

def test_unknown_pre_tokenizer(byte_level_vocab):
    with pytest.raises(PymoeError, match=r"tokenizer\.ggml\.pre='no-such-pre'"):
        Tokenizer(dict(byte_level_vocab, **{"tokenizer.ggml.pre": "no-such-pre"}).get)


def test_unknown_tokenizer_model(byte_level_vocab):
    with pytest.raises(PymoeError, match=r"tokenizer\.ggml\.model='bert'"):
        Tokenizer(dict(byte_level_vocab, **{"tokenizer.ggml.model": "bert"}).get)

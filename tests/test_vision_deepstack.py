"""Qwen3-VL-MoE: the `qwen3vlmoe` language model (qwen3moe + IMRoPE + deepstack layers) and its tower's deepstack
mergers, against llama.cpp on the tiny pair (pymoe/demo/tinymodel.py arch qwen3vlmoe, pymoe/demo/tinyvision.py
TINY_DEEPSTACK):
  - text only: the logits of a prompt (llama.cpp's qwen3vlmoe graph: M-RoPE with one position per token);
  - the tower: clip.cpp's embeddings, main rows and the two deepstack mergers' rows side by side;
  - the logits after a prompt with an image, with llama.cpp's own image embeddings placed by pymoe: the deepstack
    parts added after layers 0 and 1 (llama.cpp src/models/qwen3vlmoe.cpp).
"""
import numpy as np
import pytest

from mtmd_oracle import Mtmd, media_prompt
from oracle import require_llama_cpp
from pymoe.demo.tinyvision import TINY_DEEPSTACK, write_mmproj
from pymoe.engine.multimodal import ImageEmbeddings, PromptMedia
from pymoe.errors import PymoeError
from pymoe.vision.encoder import encode
from pymoe.vision.mmproj import load_mmproj
from pymoe.vision.preprocess import preprocess
from pymoe.vision.testimages import png_bytes, picture

SHAPES = [(160, 96), (128, 128)]  # width x height: 3 x 5 and 4 x 4 image tokens; no resize
TEXT = b"hello <__media__> world and more"
PAD = 7  # any id: the pad rows are replaced by the image's embeddings


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    import pymoe
    model = tiny_model("qwen3vlmoe", "f32")
    mmproj = str(tmp_path_factory.mktemp("mm") / "mmproj-tiny-deepstack.gguf")
    write_mmproj(mmproj, shape=TINY_DEEPSTACK)
    eng = pymoe.load(model, backend="cpu", n_ctx=512)
    return Mtmd(model, mmproj), load_mmproj(mmproj, 256, model, eng.config.n_deepstack), eng


def test_config(pair):
    _, mm, eng = pair
    c = eng.config
    assert (c.arch, c.rope_sections, c.n_deepstack, c.n_layers) == ("qwen3vlmoe", (12, 10, 10, 0), 2, 3)
    assert mm.config.deepstack == (0, 1)


def test_text_logits_match_llamacpp(pair):
    # tests/test_model_vs_llamacpp.py's bound and reason: both engines sum float32 products in their own order; 1e-5
    # of the logit scale (measured 2.4e-7 of a scale of 4.5; the other archs 2.4e-7 to 8.1e-7).
    oracle, _, eng = pair
    ids = np.random.default_rng(0).integers(0, eng.config.n_vocab, 50)
    ours = eng.model.prefill(ids, eng.model.new_kv(512))
    llm = require_llama_cpp().Llama(model_path=eng.file.path, n_ctx=128, n_threads=2, n_batch=128, verbose=False,
                                    logits_all=True, type_k=0, type_v=0, seed=0)
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[:50])
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-5 * scale


@pytest.mark.parametrize("shape", SHAPES)
def test_deepstack_tower_matches_clip_cpp(pair, shape):
    # tests/test_vision_llamacpp.py's bound (5e-3: clip.cpp's im2col rounds pixels to F16); the deepstack rows pass
    # the same F16-rounded patches through one and two blocks. Measured 1.3e-3 .. 1.9e-3 on values up to 2.8, the
    # same for the main rows and each merger's.
    oracle, mm, _ = pair
    ref = oracle.image_embeddings(picture(*shape))
    ours = encode(preprocess(png_bytes(*shape), mm.config), mm)
    assert ours.shape == ref.shape == (ref.shape[0], 256 * 3)
    assert np.abs(ours - ref).max() < 5e-3
    for part in range(3):  # each part is there (a missing merger would leave zeros or the main rows twice)
        assert np.abs(ours[:, 256 * part:256 * (part + 1)]).max() > 0.1


def prompt(oracle, shape):
    """llama.cpp's chunks -> (pymoe tokens with PAD runs, PromptMedia over llama.cpp's own image embeddings)."""
    return media_prompt(oracle, TEXT, picture(*shape), PAD)


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_after_an_image_match_llamacpp(pair, shape):
    # Float paths on the same embeddings: bound 1e-5 of the logit scale (tests/test_vision_llamacpp.py's); measured
    # 3.4e-7 and 4.1e-7 of a scale of 3.2. Without the deepstack parts the logits move by 0.14 .. 0.15 of the scale
    # (checked below at 1e-3), so the bound tells them apart.
    oracle, _, eng = pair
    tokens, media = prompt(oracle, shape)
    ref, _ = oracle.logits(TEXT, picture(*shape))
    ours = eng.model.prefill(tokens, eng.model.new_kv(512), media)[-1]
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-5 * scale
    img = media.images[0]
    flat = ImageEmbeddings(np.concatenate([img.embeddings[:, :256], np.zeros_like(img.embeddings[:, 256:])], 1),
                           img.rows, img.cols, "k")
    without = eng.model.prefill(tokens, eng.model.new_kv(512), PromptMedia(tokens, PAD, [flat]))[-1]
    assert np.abs(without - ref).max() > 1e-3 * scale


def test_a_model_quantized_by_llama_cpp_with_its_mmproj(pair, tmp_path):
    """The pair as users get it: the language model quantized by llama.cpp's own quantizer (Q4_K_M), the mmproj
    beside it. pymoe's float path (reference backend) on the quantized file against llama.cpp on an F32 copy of it
    (the same weights in float math, docs/testing.md's oracle for quantized files), both after the same image with
    llama.cpp's embeddings placed: test_logits_after_an_image_match_llamacpp's bound, 1e-5 of the scale. The file
    must really be quantized (K-quant experts), and its logits differ from the F32 model's."""
    import pymoe
    from llama_quantize import llama_quantize
    from pymoe.demo.tinymodel import write_f32_copy
    from pymoe.gguf.loader import load_gguf

    oracle, mm, eng = pair
    qpath, copy = str(tmp_path / "model-Q4_K_M.gguf"), str(tmp_path / "model-Q4_K_M-as-f32.gguf")
    llama_quantize(eng.file.path, qpath, "Q4_K_M")
    write_f32_copy(qpath, copy)
    assert {t.qtype.name for t in load_gguf(qpath).tensors.values()} & {"Q4_K", "Q5_K", "Q6_K"}
    shape = SHAPES[0]
    tokens, media = prompt(oracle, shape)  # llama.cpp's own image embeddings, placed as it places them
    ref, _ = Mtmd(copy, mm.path).logits(TEXT, picture(*shape))
    quantized = pymoe.load(qpath, backend="reference", n_ctx=512).model
    ours = quantized.prefill(tokens, quantized.new_kv(512), media)[-1]
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-5 * scale
    f32 = eng.model.prefill(tokens, eng.model.new_kv(512), media)[-1]
    assert np.abs(f32 - ref).max() > 1e-3 * scale  # quantizing moved the logits: the comparison is of the file


def test_an_mmproj_without_deepstack_is_refused(pair, tmp_path):
    _, _, eng = pair
    path = str(tmp_path / "mmproj-plain.gguf")
    write_mmproj(path)
    with pytest.raises(PymoeError, match=r"mmproj-plain.gguf: clip.vision.is_deepstack_layers marks 0 deepstack "
                                         r"layers but .* has n_deepstack_layers 2"):
        eng.attach_mmproj(path)


# --- against transformers (tests/data/deepstack_oracle.npz, made by tools/make-deepstack-oracle) ---------------------

ORACLE = __import__("os").path.join(__import__("os").path.dirname(__file__), "data", "deepstack_oracle.npz")
HF_IMAGES = {"wide160x96": (160, 96), "tall96x160": (96, 160)}


@pytest.mark.parametrize("name", sorted(HF_IMAGES))
def test_logits_with_an_image_match_transformers(pair, name):
    # The whole path in pymoe (preprocess, the NumPy tower with its deepstack mergers, placement, M-RoPE, deepstack
    # injection, the qwen3vlmoe layers) against transformers' Qwen3VLMoeForConditionalGeneration in F32 on the
    # converter's checkpoint of the same weights (the script checked the converter's GGUFs equal the tiny writers'),
    # every position's logits. Both sides are float32 with their own summation order: the tower alone differs by
    # 2.3e-6 on values up to 2.8 (tests/test_vision.py), and 3 layers of width 256 carry such rounding to the
    # logits: measured 1.3e-6 and 9.0e-7 of a logit scale of 4.5 and 4.2 (absolute 5.7e-6, 3.8e-6). Bound 1e-5 of
    # the scale, as against llama.cpp (8x the worst measured). Without the deepstack parts the logits move by 0.68 and
    # 0.78 of the scale (checked below at 1e-2), with sequential positions instead of M-RoPE by 0.32 .. 0.49.
    _, mm, eng = pair
    o = np.load(ORACLE)
    ids, ref = o[name + "/ids"], o[name + "/logits"]
    pixels = preprocess(png_bytes(*HF_IMAGES[name]), mm.config)
    rows, cols = pixels.shape[1] // 32, pixels.shape[2] // 32
    assert (1, 2 * rows, 2 * cols) == tuple(o[name + "/grid"])
    img = ImageEmbeddings(encode(pixels, mm), rows, cols, "k")
    pad = int(o["image_token_id"])
    ours = eng.model.prefill(ids, eng.model.new_kv(512), PromptMedia(ids, pad, [img]))
    scale = np.abs(ref).max()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-5 * scale
    flat = ImageEmbeddings(np.concatenate([img.embeddings[:, :256], np.zeros_like(img.embeddings[:, 256:])], 1),
                           rows, cols, "k")
    without = eng.model.prefill(ids, eng.model.new_kv(512), PromptMedia(ids, pad, [flat]))
    assert np.abs(without - ref).max() > 1e-2 * scale


@pytest.mark.parametrize("key, value, message", [
    ("qwen3vlmoe.rope.dimension_sections", [0, 0, 0, 32], r"x.gguf: qwen3vlmoe.rope.dimension_sections \[0, 0, 0, 32\] "
                                                          r"has no t, h or w section"),
    ("qwen3vlmoe.n_deepstack_layers", 4, r"x.gguf: qwen3vlmoe.n_deepstack_layers \(4\) is more than the 3 layers"),
])
def test_bad_mrope_metadata_is_one_line(tiny_model, key, value, message):
    from pymoe.gguf.config import REQUIRED, ModelConfig
    from pymoe.gguf.loader import load_gguf

    m = load_gguf(tiny_model("qwen3vlmoe", "f32"))
    base = m.metadata_getter("x.gguf: ")
    get = lambda k, default=REQUIRED: value if k == key else base(k, default)  # noqa: E731
    with pytest.raises(PymoeError, match=message):
        ModelConfig.from_gguf(get, n_vocab=m.config.n_vocab, tied_output=False, where="x.gguf: ")


def test_engine_with_a_deepstack_pair_answers_as_its_prefill(pair):
    # The Engine path (attach_mmproj with the model's deepstack count, the NumPy tower's [T, 3 x 256] rows, markers,
    # placement) gives the same first token as the model's prefill over the same ids and media.
    import pymoe
    _, mm, eng = pair
    e = pymoe.load(eng.file.path, backend="cpu", n_ctx=256)
    e.attach_mmproj(mm.path)
    data = png_bytes(160, 96)
    ids = e.encode_prompt("a <__media__> b", images=[data])
    assert ids.media.images[0].embeddings.shape == (15, 256 * 3)
    first = next(iter(e.generate("a <__media__> b", max_tokens=1, images=[data])))
    logits = e.model.prefill(np.asarray(ids), e.model.new_kv(256), ids.media)[-1]
    assert first == int(np.argmax(logits))

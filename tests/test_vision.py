"""The vision tower (pymoe/vision/): the mmproj loader's validation, preprocessing and the qwen3vl encoder against
transformers' Qwen3.5 vision tower on the same weights (tests/data/vision_oracle.npz, made by
tools/make-vision-oracle, which also checked that tinyvision.write_mmproj's file equals what llama.cpp's converter
writes from that checkpoint)."""
import os

import numpy as np
import pytest

from pymoe.demo.tinyvision import TINY, write_mmproj
from pymoe.errors import PymoeError
from pymoe.vision.encoder import encode, patchify
from pymoe.vision.mmproj import find_mmproj, load_mmproj
from pymoe.vision.preprocess import preprocess, smart_resize
from pymoe.vision.testimages import png_bytes

ORACLE = os.path.join(os.path.dirname(__file__), "data", "vision_oracle.npz")
IMAGES = {"square128": (128, 128), "wide160x96": (160, 96), "odd150x110": (150, 110)}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vision") / "mmproj-tiny.gguf")
    write_mmproj(path)
    return load_mmproj(path, TINY["n_out"])


def test_config_from_the_file(mmproj):
    c = mmproj.config
    assert (c.projector, c.n_embd, c.n_head, c.head_dim, c.n_layers, c.patch_size, c.merge, c.n_out,
            c.n_pos_side) == ("qwen3vl_merger", 32, 2, 16, 2, 16, 2, 256, 8)


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_pixels_equal_transformers_processor(mmproj, name):
    # Pillow decodes and resizes (bicubic) as transformers' PIL processor does; both scale and normalise in float32.
    o = np.load(ORACLE)
    px = preprocess(png_bytes(*IMAGES[name]), mmproj.config)
    assert tuple(o[name + "/grid"]) == (1, px.shape[1] // 16, px.shape[2] // 16)
    assert np.array_equal(patchify(px, mmproj.config), o[name + "/pixels"])


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_embeddings_match_transformers(mmproj, name):
    # Same float32 pixels, same weights; the tower is float32 on both sides. Observed max |diff| 2.3e-6 on values up
    # to 2.8: float32 rounding through 2 blocks and the merger (erf: A&S 7.1.26, error 1.5e-7). Bound 2e-5: ten
    # times that, far below what a wrong RoPE axis, patch order or GELU form moves (1e-2 and up).
    o = np.load(ORACLE)
    e = encode(preprocess(png_bytes(*IMAGES[name]), mmproj.config), mmproj)
    ref = o[name + "/embeddings"]
    assert e.shape == ref.shape == (int(np.prod(o[name + "/grid"])) // 4, 256)  # one token per 2x2 patches
    assert np.abs(e - ref).max() < 2e-5


def test_smart_resize_bounds():
    assert smart_resize(448, 448, 32, 8 * 1024, 4096 * 1024) == (448, 448)
    assert smart_resize(10, 20, 32, 8 * 1024, 4096 * 1024) == (64, 128)  # raised to >= 8 tokens
    h, w = smart_resize(4000, 6000, 32, 8 * 1024, 4096 * 1024)
    assert h * w <= 4096 * 1024 and h % 32 == 0 and w % 32 == 0


def test_wrong_model_width_is_one_line(mmproj):
    with pytest.raises(PymoeError, match=r"mmproj-tiny.gguf: clip.vision.projection_dim is 256 but m.gguf has "
                                         r"embedding width 128"):
        load_mmproj(mmproj.path, 128, "m.gguf")


def test_not_an_mmproj(tmp_path):
    from pymoe.demo.tinymodel import write_model
    model = str(tmp_path / "m.gguf")
    write_model(model, arch="qwen35moe", preset="micro")
    with pytest.raises(PymoeError, match="not an mmproj file"):
        load_mmproj(model)


def test_missing_tensor(tmp_path, monkeypatch):
    import pymoe.demo.tinyvision as tv
    real = tv.vision_weights
    monkeypatch.setattr(tv, "vision_weights", lambda *a: {k: v for k, v in real(*a).items() if k != "mm.2.bias"})
    path = str(tmp_path / "mmproj.gguf")
    tv.write_mmproj(path)
    with pytest.raises(PymoeError, match=r"mmproj.gguf: missing tensor mm.2.bias"):
        load_mmproj(path)


def test_bad_image_is_one_line(mmproj):
    with pytest.raises(PymoeError, match="not an image Pillow can read"):
        preprocess(b"not a png", mmproj.config)


def test_find_mmproj(tmp_path):
    model = tmp_path / "Model-Q4_K_M.gguf"
    model.write_bytes(b"")
    assert find_mmproj(model) is None
    (tmp_path / "mmproj-Model-F16.gguf").write_bytes(b"")
    assert find_mmproj(model) == str(tmp_path / "mmproj-Model-F16.gguf")
    (tmp_path / "mmproj-Model-F32.gguf").write_bytes(b"")
    with pytest.raises(PymoeError, match="2 mmproj.*gguf files beside the model.*--mmproj"):
        find_mmproj(model)


@pytest.fixture(scope="module")
def pair_dir(tiny_model, tmp_path_factory):
    """A folder as users have it: the model and mmproj-*.gguf side by side, and a picture."""
    import shutil
    d = tmp_path_factory.mktemp("pair")
    shutil.copy(tiny_model("qwen35moe", "f32"), d / "Tiny-Qwen35MoE.gguf")
    write_mmproj(str(d / "mmproj-Tiny-Qwen35MoE-F32.gguf"))
    (d / "pic.png").write_bytes(png_bytes(160, 96))
    return d


def test_run_with_an_image_finds_the_mmproj_beside_the_model(pair_dir):
    from click.testing import CliRunner
    from pymoe.cli import cli
    r = CliRunner().invoke(cli, ["run", str(pair_dir / "Tiny-Qwen35MoE.gguf"), "-p", "look: <__media__> ok", "-n", "3",
                                 "--image", str(pair_dir / "pic.png"), "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert "mmproj-Tiny-Qwen35MoE-F32.gguf: qwen3vl_merger" in r.output
    assert "pic.png: 3 x 5 tokens" in r.output
    from pymoe.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_file(str(pair_dir / "Tiny-Qwen35MoE.gguf"))
    n = sum(len(tok.encode(t, add_bos=False)) for t in ("<|vision_start|>", "<|vision_end|>", " ok"))
    n += len(tok.encode("look: ")) + 15  # the vision markers are text in the tiny vocabulary; 3 x 5 image tokens
    assert f"prompt {n} tokens" in r.output


def _pymoe(capsys, *argv):
    from pymoe.cli import main
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_run_image_errors_are_one_line(pair_dir, tiny_model, capsys):
    code, err = _pymoe(capsys, "run", str(pair_dir / "Tiny-Qwen35MoE.gguf"), "-p", "x", "-n", "1",
                       "--image", str(pair_dir / "nope.png"))
    assert code == 2 and err.strip().endswith("nope.png: No such file or directory") and err.count("\n") == 1
    code, err = _pymoe(capsys, "run", tiny_model("qwen35moe", "f32"), "-p", "x", "-n", "1",
                       "--image", str(pair_dir / "pic.png"))
    assert code == 2 and "images need the model's mmproj file: pass --mmproj FILE" in err
    code, err = _pymoe(capsys, "run", tiny_model("qwen3moe", "f32"), "-p", "x", "-n", "1",
                       "--mmproj", str(pair_dir / "mmproj-Tiny-Qwen35MoE-F32.gguf"), "--image", str(pair_dir / "pic.png"))
    assert code == 2 and "has no rope.dimension_sections (M-RoPE)" in err


def test_generate_with_images_is_the_prefill_with_media(pair_dir):
    # The Engine path (template-free prompt, markers, encoder) gives the same first token as the model's prefill
    # over the same ids and media, and an image prompt's ids carry its images.
    import pymoe
    eng = pymoe.load(str(pair_dir / "Tiny-Qwen35MoE.gguf"), backend="cpu", n_ctx=256)
    eng.attach_mmproj()
    data = (pair_dir / "pic.png").read_bytes()
    ids = eng.encode_prompt("a <__media__> b", images=[data])
    assert len(ids.media.images) == 1 and ids.media.images[0].key == __import__("hashlib").sha256(data).hexdigest()
    first = next(iter(eng.generate("a <__media__> b", max_tokens=1, images=[data])))
    logits = eng.model.prefill(np.asarray(ids), eng.model.new_kv(256), ids.media)[-1]
    assert first == int(np.argmax(logits))


def test_chat_image_command(pair_dir):
    from click.testing import CliRunner
    from pymoe.cli import cli
    r = CliRunner().invoke(cli, ["chat", str(pair_dir / "Tiny-Qwen35MoE.gguf"), "-n", "2", "--threads", "1"],
                           input=f"/image {pair_dir / 'nope.png'}\n/image {pair_dir / 'pic.png'}\nwhat is it\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "nope.png: No such file or directory" in r.output  # an error in the chat keeps the chat
    assert "pic.png: 3 x 5 tokens, for your next message" in r.output


def test_an_mmproj_given_as_the_model_is_named(mmproj):
    from pymoe.gguf.loader import load_gguf
    with pytest.raises(PymoeError, match=r"mmproj-tiny.gguf: an mmproj file \(a multimodal model's vision tower\), "
                                         r"not a model: pass the model, and this file as --mmproj"):
        load_gguf(mmproj.path)

"""Images through the server: OpenAI image_url parts (data: URLs) and Anthropic base64 image blocks, with the
official clients, give the answer the engine gives for the same prompt and image; a URL the server would have to
fetch is a 400; prefix reuse tells images apart by their bytes."""
import base64

import anthropic
import numpy as np
import openai
import pytest

import pymoe
from pymoe.demo.tinyvision import write_mmproj
from pymoe.serve.app import BackgroundServer, create_app
from pymoe.serve.scheduler import cache_keys, common_prefix
from pymoe.vision.testimages import png_bytes

CTX = 256
PNG = png_bytes(160, 96)
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    mmproj = str(tmp_path_factory.mktemp("mm") / "mmproj-tiny.gguf")
    write_mmproj(mmproj)
    return tiny_model("qwen35moe", "f32"), mmproj


@pytest.fixture(scope="module")
def reference(pair):
    eng = pymoe.load(pair[0], n_ctx=CTX, backend="cpu")
    eng.attach_mmproj(pair[1])
    return eng


@pytest.fixture(scope="module")
def server(pair):
    engine = pymoe.load(pair[0], n_ctx=CTX, backend="cpu")
    engine.attach_mmproj(pair[1])
    with BackgroundServer(create_app(engine, parallel=1, kv="f32", max_body_bytes=1 << 20)) as srv:
        yield srv


def expected(reference) -> str:
    return "".join(reference.stream("describe <__media__>", max_tokens=6, chat=True, images=[PNG]))


def test_openai_image_url_part(server, reference):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe "}, {"type": "image_url", "image_url": {"url": URL}}]}])
    assert r.choices[0].message.content == expected(reference)
    assert r.usage.prompt_tokens > 15  # the image's 3 x 5 tokens are in the prompt


def test_anthropic_image_block(server, reference):
    c = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    r = c.messages.create(model="tiny", max_tokens=6, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "text", "text": "describe "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(PNG).decode()}}]}])
    assert "".join(b.text for b in r.content if b.type == "text") == expected(reference)


def test_urls_are_a_400(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="pymoe does not fetch URLs; send the image inline as a data: "
                                                      "URL") as e:
        c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert e.value.body["param"] == "messages[0]"
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}])
    with pytest.raises(openai.BadRequestError, match="not an image Pillow can read"):
        c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}])
    a = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="pymoe does not fetch URLs"):
        a.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])


def test_a_model_without_mmproj_says_so(tiny_model):
    with BackgroundServer(create_app(pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=CTX))) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="takes no images \\(start it with --mmproj FILE\\)"):
            c.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": URL}}]}])


def test_prefix_reuse_keys_images_by_their_bytes(reference):
    # The pad tokens of two different images are the same ids; their cache keys are not, so a slot holding one
    # image's KV shares only the text before it with a prompt that has the other image there.
    a = reference.encode_prompt("look <__media__> now", images=[PNG])
    b = reference.encode_prompt("look <__media__> now", images=[png_bytes(96, 160)])
    same = reference.encode_prompt("look <__media__> now", images=[PNG])
    start = a.media.start_rows[0]
    assert list(np.asarray(a)[:start]) == list(np.asarray(b)[:start])
    assert common_prefix(cache_keys(a), cache_keys(b)) == start
    assert common_prefix(cache_keys(a), cache_keys(same)) == len(a)
    assert min(cache_keys(a)) < 0 and cache_keys("x y".split()) == ["x", "y"]

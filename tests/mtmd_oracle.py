"""llama.cpp's multimodal library (libmtmd, shipped in llama-cpp-python) as an oracle: the image embeddings its
clip.cpp computes from an mmproj file, and the logits of a prompt with an image in it (mtmd_helper_eval_chunks:
M-RoPE positions and the embeddings placed as llama.cpp places them). Imported inside tests; see oracle.py."""
import ctypes

import numpy as np

from oracle import require_llama_cpp


class Mtmd:
    """Llama(model) + mtmd context(mmproj): `.image_embeddings(rgb)`, `.logits(text_with_marker, rgb)`."""

    def __init__(self, model: str, mmproj: str, n_ctx: int = 512):
        llama_cpp = require_llama_cpp()
        from llama_cpp import mtmd_cpp as m
        self.lib, self.m = llama_cpp, m
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=2, n_batch=512, verbose=False,
                                   type_k=0, type_v=0)  # F32 KV cache: oracle.py's rule
        p = m.mtmd_context_params_default()
        p.use_gpu, p.n_threads, p.warmup, p.print_timings = False, 2, False, False
        self.ctx = m.mtmd_init_from_file(mmproj.encode(), self.llm.model, p)
        assert self.ctx, f"libmtmd refused {mmproj}"
        self.marker = m.mtmd_default_marker()

    def _chunks(self, text: bytes, rgb: np.ndarray):
        m = self.m
        h, w, _ = rgb.shape
        data = np.ascontiguousarray(rgb, dtype=np.uint8)
        bitmap = m.mtmd_bitmap_init(w, h, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = m.mtmd_input_chunks_init()
        inp = m.mtmd_input_text(text=text, text_len=len(text), add_special=False, parse_special=True)
        bitmaps = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0
        m.mtmd_bitmap_free(bitmap)
        return chunks

    def image_embeddings(self, rgb: np.ndarray) -> np.ndarray:
        """uint8 [H, W, 3] -> float32 [T, n_embd_inp], clip.cpp's encoder output (its own resize when one is needed;
        with deepstack layers n_embd_inp = n_embd (1 + n_deepstack_layers): the main rows, then each merger's)."""
        m = self.m
        chunks = self._chunks(self.marker, rgb)
        try:
            for i in range(m.mtmd_input_chunks_size(chunks)):
                c = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(c) == m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    assert m.mtmd_encode_chunk(self.ctx, c) == 0
                    n = m.mtmd_input_chunk_get_n_tokens(c)
                    d = self.lib.llama_cpp.llama_model_n_embd_inp(self.llm.model)
                    return np.ctypeslib.as_array(m.mtmd_get_output_embd(self.ctx), shape=(n * d,)).reshape(n, d).copy()
        finally:
            m.mtmd_input_chunks_free(chunks)
        raise AssertionError("no image chunk")

    def logits(self, text: bytes, rgb: np.ndarray) -> tuple:
        """-> (logits float32 [V] after the whole prompt, n_past): text holds mtmd's marker where the image goes."""
        m, lib = self.m, self.lib.llama_cpp
        chunks = self._chunks(text, rgb)
        try:
            lib.llama_memory_clear(lib.llama_get_memory(self.llm.ctx), True)
            new_n_past = lib.llama_pos(0)
            assert m.mtmd_helper_eval_chunks(self.ctx, self.llm.ctx, chunks, 0, 0, 512, True,
                                             ctypes.byref(new_n_past)) == 0
            v = self.llm.n_vocab()
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(v,)).copy()
            return logits, new_n_past.value
        finally:
            m.mtmd_input_chunks_free(chunks)


def chunk_tokens(o: "Mtmd", text: bytes, rgb: np.ndarray) -> list:
    """The chunks mtmd makes of `text` with one image: ("text", [ids]) and ("image", (rows, cols)), in order."""
    m = o.m
    chunks = o._chunks(text, rgb)
    out = []
    try:
        for i in range(m.mtmd_input_chunks_size(chunks)):
            c = m.mtmd_input_chunks_get(chunks, i)
            if m.mtmd_input_chunk_get_type(c) == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                ptr = m.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                out.append(("text", [ptr[k] for k in range(n.value)]))
            else:
                img = m.mtmd_input_chunk_get_tokens_image(c)
                out.append(("image", (m.mtmd_image_tokens_get_ny(img), m.mtmd_image_tokens_get_nx(img))))
    finally:
        m.mtmd_input_chunks_free(chunks)
    return out


def media_prompt(o: "Mtmd", text: bytes, rgb: np.ndarray, pad: int) -> tuple:
    """llama.cpp's chunks of text with rgb -> (pymoe's token ids with a run of `pad` per image, PromptMedia over
    llama.cpp's own image embeddings): pymoe's placement and positions, fed the oracle's pixels-to-embeddings."""
    from pymoe.engine.multimodal import ImageEmbeddings, PromptMedia

    tokens, images = [], []
    for kind, value in chunk_tokens(o, text, rgb):
        if kind == "text":
            tokens += value
        else:
            rows, cols = value
            tokens += [pad] * (rows * cols)
            images.append(ImageEmbeddings(o.image_embeddings(rgb), rows, cols, "k"))
    return np.asarray(tokens), PromptMedia(np.asarray(tokens), pad, images)

"""The one exception type users see. The CLI prints it as a single line and exits with status 2; no traceback.

A message always names what it is about first (usually the file), then what is wrong:
    `model.gguf: missing tensor blk.3.attn_q.weight`
"""


class PymoeError(Exception):
    """A user-facing error: bad input, bad option, unsupported model. Never a bug in pymoe."""


def file_error(path, what: str) -> PymoeError:
    return PymoeError(f"{path}: {what}")

"""The one exception type users see. The CLI prints it as a single line and exits with status 2; no traceback.

A message always names what it is about first (usually the file), then what is wrong:
    `model.gguf: missing tensor blk.3.attn_q.weight`
"""


class PymoeError(Exception):
    """A user-facing error: bad input, bad option, unsupported model. Never a bug in pymoe.

    The message is made one line here, whatever it quotes: a newline or a terminal escape inside a token text, a key
    or a file name read from a (possibly hostile) file is written as its escape (`\\n`, `\\x1b`)."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(str(message)))


def one_line(text: str) -> str:
    """`text` with every non-printable character (newlines, tabs, ESC, ...) written as its Python escape."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def file_error(path, what: str) -> PymoeError:
    return PymoeError(f"{path}: {what}")

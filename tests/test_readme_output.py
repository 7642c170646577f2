"""README.md's expected-output block is what its first command's `pymoe run` prints on stderr: the same lines in the
same order, the numbers aside (times and rates differ by machine) and the checkout's path written `<checkout>`."""
import os
import re

from conftest import ROOT, run_pymoe


def _shape(line: str) -> str:
    """A telemetry line with its numbers as N and the path of the checkout as <checkout>."""
    line = line.replace(ROOT, "<checkout>")
    return re.sub(r"\d+(\.\d+)?", "N", line.rstrip())


def test_the_readme_shows_what_pymoe_run_prints():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = f.read().split("```")
    shown = [_shape(line) for line in blocks[3].strip("\n").splitlines()]  # blocks: text, bash, text, output, ...
    assert shown and all(line.startswith("pymoe run: ") for line in shown), blocks[3]
    proc = run_pymoe("run", timeout=600)  # no model: the embedded demo, as the README's first line runs it
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = [_shape(line) for line in proc.stderr.splitlines() if line.startswith("pymoe run: ")]
    assert printed == shown, "\n".join(printed)
    assert proc.stdout.strip()  # the continuation itself went to stdout

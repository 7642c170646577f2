"""Rendering a chat template, which is untrusted code, inside a sandbox and within budgets of work and size.

A chat template comes from a downloaded GGUF file (or `--chat-template`): code someone else wrote, run on every chat
request. jinja2's ImmutableSandboxedEnvironment refuses `__class__`-style attribute walks and mutation of our
objects, and caps one `range()` at 100,000 items; it bounds neither the work of nested loops nor the size of what is
rendered, so one template could freeze a server (`range(100000)` inside `range(100000)`) or exhaust its memory
(200 MB of output). `render` adds three bounds:

    work    every line of the template's compiled code that runs counts as one step (a `for` body is at least
            one line per iteration, whether it outputs anything or not), counted by a trace function on the
            template's own frames (sys.settrace: this thread only, the previous tracer restored after); past
            MAX_STEPS steps or MAX_SECONDS of wall time the render stops
    output  the text is produced chunk by chunk (Template.generate), its running length bounded by MAX_CHARS
    values  one expression cannot allocate past MAX_CHARS either: `*` (string / list repetition) and `**` are
            checked before they run, and no call, filter or namespace attribute takes an integer above MAX_CHARS
            or a string longer than it ("x"|center(10**9), a macro doubling a string as it recurses)

A breach is a TemplateBudgetError (a jinja2 TemplateError) with a one-line message; engine/tokenizer.py turns it,
and whatever else a template raises (its own raise_exception() included), into a PymoeError: the CLI's one line,
the server's 400.
Not covered: a format width inside a format string ("%999999999d" % 1) allocates what it asks for, once.
What this is not: the names a template sees (tokenizer.apply_chat_template, HF's conventions), or tokenization.
"""
from __future__ import annotations

import functools
import json
import sys
import time
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Budgets of one render. The real templates (tests/data/templates: gpt-oss, GLM-4.6, Qwen3/3.5, DeepSeek-V3.1) take
# 15-37 steps per message, so 4,000,000 steps is a conversation of some 100,000 messages (about what a 4 MiB request
# body holds), rendered in 2-5 s on one core with the counting on (0.2-0.8 s without it: the trace function costs
# about 1 us per line and per Python call; a 10-message chat renders in about a millisecond either way);
# 16 Mi characters is some 4 M tokens, beyond any model's context.
MAX_STEPS = 4_000_000
MAX_SECONDS = 10.0
MAX_CHARS = 16 << 20
TEMPLATE_FILE = "<template>"  # the co_filename of the code jinja2 compiles from a string


class TemplateBudgetError(TemplateError):
    """The template went past a budget of work, time or size."""


def _check_values(*values) -> None:
    for v in values:
        if isinstance(v, int) and abs(v) > MAX_CHARS:
            raise TemplateBudgetError(f"an integer argument of {v} is over the limit of {MAX_CHARS}")
        if isinstance(v, str) and len(v) > MAX_CHARS:
            raise TemplateBudgetError(f"a string of {len(v)} characters is over the limit of {MAX_CHARS}")


class BoundedNamespace(Namespace):
    """namespace(): the one object a template can accumulate into across loop iterations; its values are bounded."""

    def __setitem__(self, name, value):
        _check_values(value)
        super().__setitem__(name, value)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose calls, filters and `*` / `**` cannot take or make values past MAX_CHARS."""

    intercepted_binops = frozenset({"*", "**"})  # also keeps them from being folded at compile time

    def __init__(self, **options):
        super().__init__(**options)
        self.filters = {name: self._bounded(f) for name, f in self.filters.items()}
        self.globals["namespace"] = BoundedNamespace

    @staticmethod
    def _bounded(f):
        @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def bounded(*args, **kwargs):
            _check_values(*args, *kwargs.values())
            return f(*args, **kwargs)
        return bounded

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_values(*args, *kwargs.values())
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                raise TemplateBudgetError(f"a repetition of {len(seq)} x {n} is over the limit of {MAX_CHARS}")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() * abs(right) > 8 * MAX_CHARS:
            raise TemplateBudgetError(f"{left} ** {right} is over the size limit")
        return super().call_binop(context, operator, left, right)


class _Steps:
    """The work budget: a trace function counting the lines the template's frames run, and a deadline."""

    def __init__(self, max_steps: int, seconds: float):
        self.max_steps, self.seconds = max_steps, seconds
        self.left, self.deadline = max_steps, time.monotonic() + seconds

    def on_call(self, frame, event, arg):  # sys.settrace's global function: is the new frame the template's?
        return self.on_line if frame.f_code.co_filename == TEMPLATE_FILE else None

    def on_line(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise TemplateBudgetError(f"the template ran past its budget of {self.max_steps} steps")
            if time.monotonic() > self.deadline:
                raise TemplateBudgetError(f"the template ran past its budget of {self.seconds:g} s")
        return self.on_line


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's override of jinja's tojson: keeps non-ASCII text readable and follows json.dumps' arguments."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """The template's source -> a jinja2 Template in a BoundedSandbox, with HF's helper functions (cached: a
    server renders the same template on every chat request)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = BoundedSandbox._bounded(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(source: str, context: dict) -> str:
    """Render the template `source` with `context` within the budgets above -> the text; TemplateError (or whatever
    the template raised) otherwise."""
    template = compile_template(source)
    steps, previous = _Steps(MAX_STEPS, MAX_SECONDS), sys.gettrace()
    out, size = [], 0
    sys.settrace(steps.on_call)
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > MAX_CHARS:
                raise TemplateBudgetError(f"the template's output is over the limit of {MAX_CHARS} characters")
            out.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(out)

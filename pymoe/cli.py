"""The `pymoe` command: a thin click group. No math here; each command calls into the package and prints.

Errors users can cause (bad file, bad option) are `PymoeError`s: printed as one line `pymoe: error: ...`, exit 2.
"""
from __future__ import annotations

import sys

import click

from .experts import plan as plan_defaults  # the planner's defaults, shown in `pymoe plan --help`
from .errors import PymoeError
from .experts.policies import DEFAULT_POLICY, ENGINE_POLICIES, POLICIES


class Ints(click.IntRange):
    """An integer option with its range checked when parsed: a bad value is one line naming the option."""
    name = "integer"  # click's own says "integer range" in "'x' is not a valid ..."


class Floats(click.FloatRange):
    """A number option with its range checked when parsed (as Ints)."""
    name = "number"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="pymoe")
def cli():
    """pymoe: Mixture-of-Experts LLMs from GGUF files, with an expert slot cache."""


@cli.command("inspect")
@click.argument("model")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor (name, type, shape, bytes).")
def inspect_cmd(model, show_tensors):
    """Print a model's config, tensor types and counts, and the bytes of one expert (the cache slot size)."""
    from .gguf.inspect import describe_model

    click.echo(describe_model(model, show_tensors=show_tensors))


@cli.command("probe")
@click.argument("model")
@click.option("--backend", default="auto", show_default=True, help="cuda, cpu, or auto (cuda when present).")
@click.option("--threads", default=None, type=Ints(min=1), help="CPU threads (default: all cores).")
@click.option("--repeats", default=4, show_default=True, type=Ints(min=1),
              help="Measurements of each rate; the best is used.")
def probe_cmd(model, backend, threads, repeats):
    """Measure host->device (PCIe) bandwidth and the CPU's expert rate on MODEL; print the pcie_frac that
    balances them (the share of cache misses to read over PCIe; the rest are computed on the CPU)."""
    from .backends import get_backend
    from .gguf.loader import load_gguf
    from .experts.probe import probe

    file = load_gguf(model)
    result = probe(file, get_backend(backend, threads=threads), repeats=repeats)
    click.echo(result.cpu_line())
    click.echo(result.line())


def engine_options(f):
    """Options of the engine every model-running command shares (run, serve, bench): threads, backend, cache."""
    options = [
        click.option("-t", "--threads", default=None, type=Ints(min=1),
                     help="CPU threads for the kernels (default: all cores)."),
        click.option("--backend", default="auto", show_default=True,
                     help="Where to compute: cpu, cuda, auto (cuda when a CUDA GPU is present, else cpu), or reference "
                          "(plain NumPy: slow, the readable twin the others are tested against)."),
        click.option("--cache", "cache", default="auto", show_default=True, type=click.Choice(["auto", "none"]),
                     help="Expert slot pool: auto sizes it from the GPU's free memory (on the CPU backend: no pool, "
                          "every expert read in place from the memory map); none: no pool."),
        click.option("--cache-slots", default=None, type=Ints(min=1),
                     help="Expert slot pool of exactly N slots."),
        click.option("--cache-gib", default=None, type=Floats(min=0, min_open=True),
                     help="Expert slot pool of this many GiB."),
        click.option("--reserve-mib", default=700.0, show_default=True, type=Floats(min=0),
                     help="Device memory left free by --cache auto, besides the KV cache and activations."),
        click.option("--policy", default=DEFAULT_POLICY, show_default=True,
                     help=f"Slot cache policy: {', '.join(ENGINE_POLICIES)}."),
        click.option("--profile", default=None, help="Expert profile to pre-fill the slot pool from."),
        click.option("--admit", default="all", show_default=True, type=click.Choice(["all", "second-miss"]),
                     help="Slot pool admission: every decode miss may take a slot, or only a key's second miss."),
        click.option("--max-inserts", default=0, show_default=True, type=Ints(min=0),
                     help="Slot insertions per layer per decode step (0: no cap)."),
        click.option("--warm-set", default=0, show_default=True, type=Ints(min=0),
                     help="Warm decode set: once a prompt is read, copy the experts of its last N tokens into the "
                          "slot pool (0: off; prefill otherwise inserts nothing)."),
        click.option("--warm-inserts", default=0, show_default=True, type=Ints(min=0),
                     help="At most this many warm-set copies per prompt (0: as many as the pool holds)."),
        click.option("--pcie-frac", default=None, type=Floats(0, 1),
                     help="Share of decode cache misses read over PCIe (spill); the rest are computed on the CPU "
                          "[default: measured by the PCIe probe on cuda; 0 on cpu, as the probe says with no GPU]."),
        click.option("--act-bits", default=None, type=click.Choice(["8", "15", "16", "auto", "0"]),
                     help="CPU backend: the activations' width on its integer path (default: 15 when every routed "
                          "expert matrix has 8-row tiles, else 16; both within ~1e-4 of float math): 16, 8 (llama.cpp's choice, about twice as fast per weight, and Q2_K-Q6_K, Q8_0, "
                          "MXFP4 and IQ4_XS weights repacked 8 rows at a time, unless PYMOE_REPACK=0, the experts' "
                          "copies up to half the available memory, PYMOE_REPACK_MIB; IQ1-IQ3 experts "
                          "decoded into 8-row tiles in prefill, unless PYMOE_DECODE=0; coarser), 15 (x to 15 bits as "
                          "two 8-bit planes through the 8-bit dots and repacked rows: 16's accuracy), auto (8 bits for "
                          "the routed experts, 16 for attention, shared expert and output head), 0 (float kernels)."),
        click.option("--devices", default=None,
                     help="The cuda backend on several devices: indices (0,1) or a count (2). Layers are split in "
                          "contiguous ranges by each device's free memory, as `pymoe plan --devices` plans; each "
                          "device holds its layers' dense weights, KV cache and its own expert slot pool. In the CUDA "
                          "simulator the devices are separate budgets of PYMOE_SIM_DEVICE_GIB (one size, or one per "
                          "device: 8,4)."),
        click.option("--chunk", default=512, show_default=True, type=Ints(min=1),
                     help="Prompt tokens per forward call; each expert missing from the cache is streamed once "
                          "per chunk."),
    ]
    options += [click.option(*names, default=None, expose_value=False, hidden=True, callback=_offload_flag)
                for names in (("-ngl", "--n-gpu-layers", "--gpu-layers"), ("--n-cpu-moe",), ("-ot", "--override-tensor"),
                              ("--cpu-moe",))]
    for option in reversed(options):
        f = option(f)
    return f


def telemetry_options(f):
    """run's and serve's --telemetry FILE: a JSON line per request (experts/telemetry.py, docs/telemetry.md)."""
    f = click.option("--telemetry-interval", default=10.0, show_default=True,
                     help="Seconds between the resource samples (CPU %, RSS, GPU through NVML) in --telemetry "
                          "(0: none).")(f)
    return click.option("--telemetry", default=None,
                        help="Append a JSON line per request (tokens, tok/s, TTFT, hits, misses by path, slots) to "
                             "this file, for `pymoe report`.")(f)


def _telemetry(engine, path, interval, source):
    """The telemetry writer of --telemetry PATH, or None."""
    from .experts.telemetry import TelemetryWriter, engine_facts

    return TelemetryWriter(path, engine_facts(engine, source), interval=interval) if path else None


def _offload_flag(ctx, param, value):
    """llama.cpp's layer and tensor offload flags: pymoe places weights by another rule, and says which one."""
    if value is not None:
        raise PymoeError(f"{param.opts[0]} is llama.cpp's: pymoe puts every dense weight on the GPU and keeps the "
                         "experts in host memory behind a slot cache; size it with --cache-slots N or --cache-gib X "
                         "(--cache auto: from free VRAM), and split misses with --pcie-frac F")
    return value


def model_options(f):
    """The model and context options of run, chat and serve, with llama.cpp's names as aliases."""
    options = [
        click.option("-m", "--model", "model_opt", default=None, help="MODEL as an option (llama.cpp's -m)."),
        click.option("-c", "--ctx", "--ctx-size", "ctx", default=None, type=Ints(min=1),
                     help="Context size in tokens (default: the model's)."),
        click.option("--chat-template", default=None,
                     help="A Jinja chat template (a file, or the template text) instead of the model's own."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def sampling_options(f):
    options = [
        click.option("--temp", default=None, type=Floats(min=0),
                     help="Temperature; 0 is greedy [default: 0; demo: 0.7]."),
        click.option("--top-k", default=40, show_default=True, type=Ints(min=0),
                     help="Top-k filter (0: off)."),
        click.option("--top-p", default=0.95, show_default=True, type=Floats(0, 1, min_open=True),
                     help="Top-p (nucleus) filter (1: off)."),
        click.option("--min-p", default=0.05, show_default=True, type=Floats(0, 1),
                     help="Min-p filter (0: off)."),
        click.option("--repeat-penalty", default=None, type=Floats(min=0, min_open=True),
                     help="Repetition penalty, 1 is off [default: 1; demo: 1.1]."),
        click.option("--seed", default=None, type=int, help="Random seed for sampling [default: random; demo: 0]."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


SERVER_SAMPLING = (("--temp", "temperature", float), ("--top-k", "top_k", int), ("--top-p", "top_p", float),
                   ("--min-p", "min_p", float), ("--repeat-penalty", "repeat_penalty", float), ("--seed", "seed", int))


def server_sampling_options(f):
    """`serve`'s sampling flags (llama.cpp's server has them): the values of requests that leave a field out."""
    for flag, field, kind in reversed(SERVER_SAMPLING):
        f = click.option(flag, f"default_{field}", default=None, type=kind,
                         help=f"{field} for requests that do not set it (default: the API's).")(f)
    return f


def _stdin_prompt(wait_s: float = 1.0):
    """The prompt piped on standard input, or None: a terminal is never read (that is `pymoe chat`), and neither is
    a pipe that says nothing within `wait_s` (a harness that leaves stdin open must not hang the command)."""
    import select

    try:
        if sys.stdin is None or sys.stdin.isatty() or not select.select([sys.stdin], [], [], wait_s)[0]:
            return None
        text = sys.stdin.read()
    except (OSError, ValueError):  # no usable stdin (closed, or not selectable)
        return None
    return text if text.strip() else None


def _pick_model(model, model_opt):
    """MODEL or -m MODEL (not two different ones); a missing file is named before anything else is read."""
    import os

    if model is not None and model_opt is not None and model != model_opt:
        raise PymoeError(f"two models given: {model} and -m {model_opt}")
    path = model if model is not None else model_opt
    if path is not None and not os.path.exists(path):
        raise PymoeError(f"{path}: no such file")
    return path


def _demo_sampling(temp, repeat_penalty, seed, engine_opts):
    """The demo model's defaults: a small model repeats itself under greedy decoding, so it samples, reproducibly,
    unless told otherwise; with a slot pool, its profile pre-fills it."""
    from . import demo
    from .backends.cuda import cuda_available

    pool = engine_opts.get("cache_slots") or engine_opts.get("cache_gib") or (
        engine_opts.get("cache") == "auto" and engine_opts.get("backend") in ("auto", "cuda") and cuda_available())
    if pool and engine_opts.get("profile") is None:
        engine_opts["profile"] = demo.demo_profile()
    return (0.7 if temp is None else temp, 1.1 if repeat_penalty is None else repeat_penalty, 0 if seed is None else seed)


def _load(model, ctx, chat_template, log, **engine_opts):
    from .api import load

    engine = load(model, n_ctx=ctx, progress=True, log=log, **engine_opts)
    if chat_template is not None:
        engine.use_chat_template(chat_template)
    return engine


def _output_grammar(grammar, grammar_file, json_schema, json_schema_file):
    """run's --grammar / --grammar-file / --json-schema / --json-schema-file (at most one) -> a Grammar, or None."""
    from .engine.grammar import Grammar

    given = [(flag, value) for flag, value in (("--grammar", grammar), ("--grammar-file", grammar_file),
             ("--json-schema", json_schema), ("--json-schema-file", json_schema_file)) if value is not None]
    if len(given) > 1:
        raise PymoeError(f"{given[0][0]} and {given[1][0]} both constrain the output: give one")
    if not given:
        return None
    flag, value = given[0]
    if flag.endswith("-file"):
        try:
            value = open(value, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise PymoeError(f"{flag} {value}: {e.strerror if isinstance(e, OSError) else 'not UTF-8 text'}") from None
    try:
        return Grammar.from_request("gbnf" if flag.startswith("--grammar") else "json_schema", value)
    except PymoeError as e:
        raise PymoeError(f"{flag}: {e}") from None


@cli.command("run")
@click.argument("model", required=False)
@click.option("-p", "--prompt", default=None,
              help="The prompt text [default: -f FILE, or standard input when it is not a terminal].")
@click.option("-f", "--file", "prompt_file", default=None, help="Read the prompt from this file.")
@click.option("-n", "--n-predict", default=128, show_default=True, type=Ints(min=0),
              help="Tokens to generate at most.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("-i", "--interactive", is_flag=True, help="Chat in turns instead (the same as `pymoe chat`).")
@sampling_options
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@model_options
@click.option("--trace", "trace_path", default=None,
              help="Record the routing of every token to this trace file (appended to if it exists).")
@click.option("--spec", default=None,
              help="Speculative decoding: ngram (prompt lookup), mtp (the file's own MTP/nextn block, else the "
                   "companion MODEL.mtp.gguf beside it), mtp:FILE (the block from a companion GGUF) or "
                   "draft:FILE (a smaller GGUF with the same vocabulary, run on the CPU); same output when greedy, "
                   "same distribution when sampling.")
@click.option("--spec-k", default=4, show_default=True, type=Ints(min=1),
              help="Tokens drafted per verification step.")
@click.option("--lookahead", default=0, show_default=True, type=Ints(min=0),
              help="Router lookahead: predict N experts per token of each next MoE layer one layer early, report "
                   "precision/recall, madvise them WILLNEED, and with a slot pool copy up to N of them into slots "
                   "before the layer runs (decode; --max-inserts caps it too) (0: off).")
@click.option("--grammar", default=None, help="Constrain the output to this GBNF grammar (llama.cpp's).")
@click.option("--grammar-file", default=None, help="... read from this file.")
@click.option("-j", "--json-schema", default=None, help="Constrain the output to JSON following this JSON schema.")
@click.option("--json-schema-file", default=None, help="... read from this file.")
@click.option("--image", "images", multiple=True,
              help="An image file (PNG, JPEG...) for the prompt (repeatable): placed at each <__media__> in the "
                   "prompt, else before it. Needs the model's mmproj file.")
@click.option("--mmproj", default=None,
              help="The model's multimodal projector GGUF (default: the one mmproj*.gguf beside the model).")
@telemetry_options
@engine_options
def run_cmd(model, prompt, prompt_file, n_predict, chat, interactive, temp, top_k, top_p, min_p, repeat_penalty, seed,
            stop, model_opt, ctx, chat_template, trace_path, spec, spec_k, lookahead, grammar, grammar_file,
            json_schema, json_schema_file, images, mmproj, telemetry, telemetry_interval, **engine_opts):
    """Generate text from MODEL (a GGUF file) for a prompt; tokens stream to stdout, telemetry to stderr.

    With no MODEL, runs the embedded demo model (trained on Python's standard library) on a Python prompt."""
    import os
    import time

    from . import demo

    model = _pick_model(model, model_opt)
    if interactive:
        return _chat(model, None, n_predict, temp, top_k, top_p, min_p, repeat_penalty, seed, ctx, chat_template,
                     engine_opts, "pymoe run", mmproj)

    def log(line):
        click.echo(f"pymoe run: {line}", err=True)

    if prompt is None and prompt_file is not None:
        try:
            prompt = open(prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise PymoeError(f"-f {prompt_file}: {e.strerror if isinstance(e, OSError) else 'not UTF-8 text'}") from None
    elif prompt is None:
        prompt = _stdin_prompt()
    if model is None:
        model = demo.demo_model()
        prompt = demo.DEMO_PROMPT if prompt is None else prompt
        log(f"no model given: running the demo model {model}")
        temp, repeat_penalty, seed = _demo_sampling(temp, repeat_penalty, seed, engine_opts)
    if prompt is None:
        raise PymoeError("give a prompt with -p PROMPT, -f FILE or on standard input (or chat: pymoe chat MODEL)")
    temp = 0.0 if temp is None else temp
    repeat_penalty = 1.0 if repeat_penalty is None else repeat_penalty
    output_grammar = _output_grammar(grammar, grammar_file, json_schema, json_schema_file)
    if output_grammar is not None and spec:
        raise PymoeError("--spec does not take a grammar (a draft would move its position): use one of them")

    if spec:
        from .engine.speculative import parse_spec

        parse_spec(spec)  # a bad --spec is refused before the model loads
        if spec_k < 1:
            raise PymoeError(f"--spec-k must be >= 1, got {spec_k}")
    image_bytes = [_read_image(path) for path in images]  # before the model loads: a bad path fails fast
    if image_bytes and spec:
        raise PymoeError("--spec does not take images (its drafter reads token ids only): use one of them")
    engine = _load(model, ctx, chat_template, log, speculation=bool(spec), **engine_opts)
    if image_bytes or mmproj:
        engine.attach_mmproj(mmproj, log)
        for path, data in zip(images, image_bytes):
            t0 = time.perf_counter()
            img = engine.encode_image(data, path)
            log(f"image {path}: {img.rows} x {img.cols} tokens, encoded in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    speculator = None
    if spec:
        speculator = engine.speculator(spec, spec_k, threads=engine_opts.get("threads"),
                                       backend="cpu" if engine.backend.name == "cuda" else engine.backend.name)
    if lookahead < 0:
        raise PymoeError(f"--lookahead must be >= 0 (0: off), got {lookahead}")
    if lookahead:
        from .experts.prefetch import Lookahead

        engine.model.lookahead = Lookahead(engine.model, k=lookahead)
    recorder = engine.record_trace() if trace_path else None
    writer, t_start = _telemetry(engine, telemetry, telemetry_interval, "run"), time.time()
    pieces = engine.stream(prompt, max_tokens=n_predict, chat=chat, stop=stop, temperature=temp, top_k=top_k,
                           top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, spec=speculator,
                           grammar=output_grammar, images=image_bytes)
    if not chat:
        click.echo(prompt, nl=False)  # like llama.cpp: the continuation reads on from the prompt
    for piece in pieces:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    stats = engine.last_stats
    if writer is not None:
        writer.request(stats, t_start=t_start, t_end=time.time(), spec=speculator.stats if speculator else None)
        writer.close()
    log(stats.prompt_line())
    log(stats.cache_line())
    if getattr(engine.cache, "warm", None) is not None:
        w = engine.cache.warmed
        log(f"warm decode set ({engine.cache.warm_rule}): {w['copied']} experts copied into slots at the prompt's end, "
            f"{w['evicted']} evicted")
    if speculator is not None:
        log(speculator.stats.line(spec, spec_k))
    if engine.model.lookahead is not None:
        log(engine.model.lookahead.line())
    if stats.device is not None:  # last: the device's cost per decoded token (CUDA)
        log(stats.device_line())
    if recorder is not None:
        appended = os.path.exists(trace_path)
        recorder.save(trace_path, append=appended)
        log(f"trace {trace_path}: {recorder.n_tokens} tokens {'appended' if appended else 'written'}")


def _read_image(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PymoeError(f"--image {path}: {e.strerror}") from None


@cli.command("chat")
@click.argument("model", required=False)
@click.option("-s", "--system", default=None, help="A system message to start the conversation with.")
@click.option("-n", "--n-predict", default=512, show_default=True, type=Ints(min=1),
              help="Tokens per reply at most.")
@click.option("--mmproj", default=None,
              help="The model's multimodal projector GGUF, for /image (default: the one mmproj*.gguf beside the model).")
@sampling_options
@model_options
@engine_options
def chat_cmd(model, system, n_predict, mmproj, temp, top_k, top_p, min_p, repeat_penalty, seed, model_opt, ctx,
             chat_template, **engine_opts):
    """Chat with MODEL in turns on its chat template (with no MODEL: the demo model). Replies stream; Ctrl-C stops a
    reply, Ctrl-D (or /quit) ends. Commands: /system TEXT, /image FILE, /reset, /stats, /help, /quit."""
    _chat(_pick_model(model, model_opt), system, n_predict, temp, top_k, top_p, min_p, repeat_penalty, seed, ctx,
          chat_template, engine_opts, "pymoe chat", mmproj)


CHAT_HELP = ("commands: /system TEXT (set the system message and start over), /image FILE (an image for your next "
             "message), /reset (forget the conversation), /stats (the last reply's telemetry), /help, /quit; "
             "Ctrl-C stops a reply, Ctrl-D ends")


def _chat(model, system, n_predict, temp, top_k, top_p, min_p, repeat_penalty, seed, ctx, chat_template, engine_opts,
          who, mmproj=None):
    """The chat loop: each turn renders the whole conversation through the chat template and generates the reply
    (the conversation is read again each turn: no KV cache is kept between turns)."""
    from . import demo
    from .engine.multimodal import MEDIA_MARKER

    def log(line):
        click.echo(f"{who}: {line}", err=True)

    if model is None:
        model = demo.demo_model()
        log(f"no model given: chatting with the demo model {model} (it was trained on Python code, not dialogue)")
        temp, repeat_penalty, seed = _demo_sampling(temp, repeat_penalty, seed, engine_opts)
    temp, repeat_penalty = (0.0 if temp is None else temp), (1.0 if repeat_penalty is None else repeat_penalty)
    engine = _load(model, ctx, chat_template, log, **engine_opts)
    sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty)
    messages = [{"role": "system", "content": system}] if system else []
    log(CHAT_HELP)
    turn, last = 0, None
    images, pending = [], []  # the conversation's images, in order; those for the next message
    while True:
        try:
            line = input("> ")
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            log("(Ctrl-D or /quit ends the chat)")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd == "/quit":
                return
            if cmd == "/reset":
                messages = [m for m in messages if m["role"] == "system"]
                images, pending = [], []
                log("conversation forgotten")
            elif cmd == "/image":
                try:
                    if engine.vision is None:
                        engine.attach_mmproj(mmproj, log)
                    data = _read_image(arg.strip())
                    img = engine.encode_image(data, arg.strip())
                    pending.append(data)
                    log(f"image {arg.strip()}: {img.rows} x {img.cols} tokens, for your next message")
                except PymoeError as e:
                    log(f"error: {e}")
            elif cmd == "/system":
                messages = [{"role": "system", "content": arg.strip()}] if arg.strip() else []
                log("system message set; conversation started over" if arg.strip() else "system message removed")
            elif cmd == "/stats":
                log("no reply yet" if last is None else f"{last.prompt_line()}\n{who}: {last.cache_line()}")
            else:
                log(CHAT_HELP)
            continue
        messages.append({"role": "user", "content": MEDIA_MARKER * len(pending) + text})
        n_new, images, pending = len(pending), images + pending, []
        reply, pieces = [], None
        try:
            rendered = engine.tokenizer.apply_chat_template(messages)
            ids = engine.prompt_with_images(rendered, images) if images else engine.tokenizer.encode(rendered)
            pieces = engine.stream(ids, max_tokens=n_predict, seed=None if seed is None else seed + turn, **sampling)
            for piece in pieces:
                reply.append(piece)
                click.echo(piece, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt:
            if pieces is not None:
                pieces.close()
            click.echo(" [stopped]", nl=False)
        except PymoeError as e:  # e.g. the conversation outgrew the context: say so, keep the chat
            messages.pop()
            images = images[:len(images) - n_new]
            click.echo()
            log(f"error: {e} (/reset starts over)")
            continue
        click.echo()
        messages.append({"role": "assistant", "content": "".join(reply)})
        last, turn = engine.last_stats, turn + 1


@cli.command("plan")
@click.argument("model")
@click.option("--vram", default=plan_defaults.DEFAULT_VRAM, show_default=True,
              help="Card sizes to plan for, comma-separated; entries without a unit take the list's unit.")
@click.option("--free", default=None,
              help="Plan one row for this many free bytes (e.g. 26.01GiB; 'auto' probes the CUDA device) "
                   "instead of the --vram table.")
@click.option("--reserve", default=plan_defaults.DEFAULT_RESERVE, show_default=True, help="VRAM kept free beside the cache.")
@click.option("--extra-reserve", default="0", show_default=True,
              help="More VRAM kept free, e.g. 184MiB for a draft head (the article's MTP head).")
@click.option("--overhead", default="auto", show_default=True,
              help="VRAM used before the cache is sized; auto = dense weights + KV cache at --ctx + --runtime.")
@click.option("--runtime", default=plan_defaults.DEFAULT_RUNTIME, show_default=True,
              help="CUDA context and workspace (for --overhead auto).")
@click.option("--ctx", "n_ctx", default=plan_defaults.DEFAULT_CTX, show_default=True, help="KV cache positions (for --overhead auto).")
@click.option("-np", "--parallel", default=1, show_default=True, type=int,
              help="Sequences decoded at once (pymoe serve -np): one KV cache of --ctx positions each (for --overhead "
                   "auto), as the cuda backend allocates them before the slot pool.")
@click.option("--device-bw", default=plan_defaults.DEFAULT_DEVICE_BW_GBS, show_default=True, help="Device memory bandwidth, GB/s (RTX 5090).")
@click.option("--pcie", default=plan_defaults.DEFAULT_PCIE_GBS, show_default=True, help="Host->device bandwidth a miss is read at, GB/s.")
@click.option("--fixed-ms", default=plan_defaults.DEFAULT_FIXED_MS, show_default=True,
              help="Fixed time per decoded token, ms (fitted to the article's two measured points).")
@click.option("--target", "targets", multiple=True, type=float,
              help="Also print the VRAM needed for this decode tok/s (repeatable).")
@click.option("--trace", "trace_path", default=None, help="Predict hit rates by simulating this routing trace.")
@click.option("--profile", "profile_path", default=None,
              help="Predict hit rates as this expert profile's static bound (.bin, heat .json, trace .npz).")
@click.option("--plot", "plot_path", default=None,
              help="Draw hit rate and predicted tok/s against VRAM to this image, the --vram sizes marked.")
@click.option("--devices", default=None,
              help="Several cards in one box at once, in pipeline order (e.g. 24GiB,16GiB): layers split over them, "
                   "one slot pool each; one line per card and the whole model (docs/scaling-out.md).")
@click.option("--hop-us", default=None, type=Floats(min=0),
              help="With --devices: latency of one card-to-card hop of the residual stream, us [default: 10].")
@click.option("--spec", "speculation", is_flag=True,
              help="Plan for speculative decoding (pymoe run --spec): a hybrid's (qwen3next, qwen35moe) recurrent "
                   "state counted twice per sequence, the state and the device snapshot a rollback goes back to "
                   "(for --overhead auto).")
def plan_cmd(model, vram, free, reserve, extra_reserve, overhead, runtime, n_ctx, parallel, device_bw, pcie, fixed_ms,
             targets, trace_path, profile_path, plot_path, devices, hop_us, speculation):
    """Capacity plan for MODEL: VRAM -> slots -> coverage -> hit rate -> spill -> predicted decode tok/s, and back.

    Formulas and the reference article's numbers worked through: docs/planning.md."""
    from .experts.plan import plan_report

    if devices is not None:  # several cards at once (experts/multi.py)
        from .experts.multi import devices_plan_report

        if free is not None or targets or plot_path is not None:
            raise PymoeError("--devices plans the cards given; leave out --free, --target and --plot")
        click.echo(devices_plan_report(model, devices, hop_us, reserve=reserve, extra_reserve=extra_reserve,
                                       device_bw_gbs=device_bw, pcie_gbs=pcie, fixed_ms=fixed_ms, overhead=overhead,
                                       runtime=runtime, n_ctx=n_ctx, trace_path=trace_path,
                                       profile_path=profile_path))
        return
    click.echo(plan_report(model, vram=vram, free=free, reserve=reserve, extra_reserve=extra_reserve,
                           device_bw_gbs=device_bw, pcie_gbs=pcie, fixed_ms=fixed_ms, overhead=overhead,
                           runtime=runtime, n_ctx=n_ctx, targets=targets, trace_path=trace_path,
                           profile_path=profile_path, plot_path=plot_path, parallel=parallel,
                           speculation=speculation))


@cli.command("simulate")
@click.argument("trace")
@click.option("--policy", "policies", default=",".join(POLICIES), show_default=True,
              help="Cache policies to replay, comma-separated (belady: the offline optimum, simulation only).")
@click.option("--slots", default=None, help="Slot counts to simulate, comma-separated (instead of --coverage).")
@click.option("--coverage", default=None,
              help="Coverages in percent of all experts, comma-separated [default: 10,20,...,90].")
@click.option("--pool", default="both", show_default=True, type=click.Choice(["both", "per-layer", "global"]),
              help="One pool per layer (slots split evenly), one global pool, or both.")
@click.option("--profile", "profile_path", default=None,
              help="Expert profile (.bin, routing-heat .json or trace .npz) for static/pinned-lru and the pre-fill "
                   "[default: built from TRACE itself, in-sample].")
@click.option("--phase", default="all", show_default=True, type=click.Choice(["all", "decode", "prefill", "verify"]),
              help="Which lookups count (the cache still sees all of them, in order).")
@click.option("--plot", "plot_path", default=None, help="Draw hit rate against coverage to this image (matplotlib).")
@click.option("--admit", default="all", show_default=True, type=click.Choice(["all", "second-miss"]),
              help="Admission control: every miss may take a slot, or only a key's second miss.")
@click.option("--max-inserts", default=0, show_default=True, help="Insertions per layer per step (0: no cap).")
@click.option("--warm-set", default=0, show_default=True,
              help="Warm decode set: at each prompt's end, place the experts of its last N tokens (0: off).")
@click.option("--warm-inserts", default=0, show_default=True, help="At most this many warm-set copies (0: no cap).")
@click.option("--prefetch", is_flag=True,
              help="Replay the router lookahead's prefetch the trace recorded (`pymoe run --lookahead N --trace`); "
                   "belady is left out.")
@click.option("--devices", default=None,
              help="One pool per card: N equal cards, or sizes (24GiB,16GiB) sharing layers and slots; per-card and "
                   "total hit rates (--slots / --coverage are totals).")
def simulate_cmd(trace, policies, slots, coverage, pool, profile_path, phase, plot_path, admit, max_inserts,
                 warm_set, warm_inserts, prefetch, devices):
    """Replay a routing TRACE (from `pymoe run --trace`) through the cache policies: hit rate and misses per token.

    Definitions (pools, coverage, knee, pre-fill): pymoe/experts/simulate.py and docs/trace-files.md."""
    from .experts.simulate import report

    if devices is not None:
        from .experts.multi import simulate_report

        if (pool, admit, max_inserts, warm_set, warm_inserts, prefetch, plot_path) != ("both", "all", 0, 0, 0, False,
                                                                                       None):
            raise PymoeError("--devices replays one global pool per card with the default admission; leave out "
                             "--pool, --admit, --max-inserts, --warm-set, --warm-inserts, --prefetch and --plot")

        click.echo(simulate_report(trace, devices, policies=policies, slots=slots, coverage=coverage,
                                   profile_path=profile_path, phase=phase), nl=False)
        return
    click.echo(report(trace, policies=policies, slots=slots, coverage=coverage, pool=pool, profile_path=profile_path,
                      phase=phase, plot_path=plot_path, progress=True, admit=admit, max_inserts=max_inserts,
                      warm_set=warm_set, warm_inserts=warm_inserts, prefetch=prefetch), nl=False)


@cli.command("report")
@click.argument("files", nargs=-1, required=True)
@click.option("-o", "--out", default=None, help="Write to this .md (plots beside it as PNG) or .html (plots inside) "
              "file [default: Markdown on stdout, no plots].")
@click.option("--group-by", default="file", show_default=True,
              help="What a round is: a file, or a request field (slots, cache_bytes, backend, model, source...).")
@click.option("--device-bw", default=plan_defaults.DEFAULT_DEVICE_BW_GBS, show_default=True,
              help="Device memory bandwidth, GB/s, for the capacity table's calibrated cost model.")
def report_cmd(files, out, group_by, device_bw):
    """The reference article's analysis of telemetry FILES (`pymoe run/serve --telemetry`): hit-rate and spill
    buckets with the cliff, correlation, tok/s on cache GiB across rounds, efficiency, concurrency, overload,
    capacity. Definitions: docs/telemetry.md."""
    from .experts.report import report

    click.echo(report(list(files), out=out, group_by=group_by, device_bw_gbs=device_bw))


@cli.command("placement")
@click.argument("sources", nargs=-1, required=True)
@click.option("--gpus", required=True, type=Ints(min=1), help="GPUs the experts are spread over (the EP size).")
@click.option("--redundant", default=0, show_default=True, type=Ints(min=0),
              help="Extra physical experts per layer, replicas of the hottest (SGLang's --ep-num-redundant-experts).")
@click.option("--nodes", default=1, show_default=True, type=Ints(min=1), help="Machines the GPUs are in.")
@click.option("--groups", default=1, show_default=True, type=Ints(min=1),
              help="Expert groups (DeepSeek's n_group): with --nodes dividing it, groups stay on one node.")
@click.option("-o", "--out", default=None, help="Write the placement to this JSON file (SGLang --init-expert-location).")
@click.option("--format", "form", default="mapping", show_default=True, type=click.Choice(["mapping", "counts"]),
              help="physical_to_logical_map (this placement), or logical_count (SGLang balances at start).")
@click.option("--placement", "which", default="pymoe", show_default=True,
              type=click.Choice(["pymoe", "eplb", "uniform"]), help="Which placement --format mapping writes.")
@click.option("--batch", default=None, type=Ints(min=1),
              help="Measure the imbalance per batch of this many consecutive tokens (traces only).")
@click.option("--phase", default="decode", show_default=True, type=click.Choice(["all", "decode", "prefill"]),
              help="Which traced tokens count.")
def placement_cmd(sources, gpus, redundant, nodes, groups, out, form, which, batch, phase):
    """Expert placement over GPUs for expert parallelism (vLLM / SGLang), from routing TRACEs, profiles or heat.

    Prints the predicted load imbalance of a uniform placement, DeepSeek's EPLB and pymoe's (EPLB + swaps);
    docs/scaling-out.md, "When you outgrow one machine"."""
    from .experts.placement import report

    click.echo(report(sources, gpus, redundant, out=out, groups=groups, nodes=nodes, form=form, batch=batch,
                      phase=phase, which=which))


def serve_options(f):
    """The options of the server `pymoe serve` runs (shared with `pymoe bench`, which starts one)."""
    options = [
        click.option("-c", "--ctx", "--ctx-size", "ctx", default=None, type=Ints(min=1),
                     help="Context size per slot in tokens (default: the model's)."),
        click.option("--kv", default="f16", show_default=True, type=click.Choice(["f32", "f16", "int8"]),
                     help="KV cache storage: f32 (exact), f16, or int8 with a float16 scale per 32 values."),
        click.option("-np", "--parallel", default=None, type=Ints(min=1),
                     help="Slots: sequences decoded together per step (default: 4 on the cpu backend and on cuda "
                          "with every expert in slots, 1 on cuda with a partial expert cache; fewer when their KV "
                          "would not fit; printed at start with why)."),
        click.option("--max-queue", default=16, show_default=True,
                     help="Requests that may wait for a slot; beyond that the server answers 429."),
        click.option("--spec", default=None,
                     help="Speculative decoding, every busy slot verified in one forward: ngram, mtp, mtp:FILE or "
                          "draft:FILE (docs/speculative.md)."),
        click.option("--spec-k", default=4, show_default=True, help="Tokens drafted per verification step."),
        click.option("--prefill-chunk", default=512, show_default=True,
                     help="Prompt tokens prefilled per engine step, between the other slots' decode steps "
                          "(0: a whole prompt at once)."),
    ]
    for option in reversed(options):
        f = option(f)
    return engine_options(f)


@cli.command("serve")
@click.argument("model", required=False)
@click.option("-m", "--model", "model_opt", default=None, help="MODEL as an option (llama.cpp's -m).")
@click.option("--chat-template", default=None,
              help="A Jinja chat template (a file, or the template text) instead of the model's own.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", default=8080, show_default=True, help="TCP port.")
@click.option("--api-key", default=None, envvar="PYMOE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health (env PYMOE_API_KEY).")
@click.option("--max-body-mib", default=4.0, show_default=True, help="Largest request body accepted (else 413).")
@click.option("--request-timeout", default=600.0, show_default=True,
              help="Seconds from a request's arrival to its end: a generation still running then stops as if at "
                   "max_tokens (finish_reason length); a body not received by then is a 408.")
@click.option("--cors-origin", "cors_origins", multiple=True, default=("localhost",), show_default=True,
              help="Origins whose pages may read the answers (repeat, or a comma list): scheme://host[:port], "
                   "'localhost' (any port on this machine), '*' (any: llama.cpp's default), or 'none'.")
@click.option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]),
              help="The access log's lines on stderr (one per request): text or JSON.")
@click.option("--reasoning-format", default="deepseek", show_default=True, type=click.Choice(["none", "deepseek"]),
              help="deepseek: a chat answer's <think> block (gpt-oss: its analysis channel) goes to reasoning_content; "
                   "none: left in the content.")
@click.option("--mmproj", default=None,
              help="The model's multimodal projector GGUF, for image inputs (default: the one mmproj*.gguf beside "
                   "a model that can place images).")
@server_sampling_options
@telemetry_options
@serve_options
def serve_cmd(model, model_opt, chat_template, host, port, api_key, max_body_mib, request_timeout, cors_origins,
              log_format, reasoning_format, mmproj, ctx, kv, parallel, max_queue, spec, spec_k, prefill_chunk,
              telemetry, telemetry_interval, **engine_options):
    """Serve MODEL (a GGUF file) over OpenAI- and Anthropic-compatible HTTP APIs: /v1/chat/completions,
    /v1/completions, /v1/messages, /v1/models, /v1/status, /metrics, /health, and the monitor page at /.
    With no MODEL, serves the embedded demo model (trained on Python's standard library)."""
    from . import demo
    from .serve.app import serve
    from .serve.middleware import parse_origins

    def log(line):
        click.echo(f"pymoe serve: {line}", err=True)

    model = _pick_model(model, model_opt)
    if model is None:
        model = demo.demo_model()
        log(f"no model given: serving the demo model {model} (a small MoE trained on Python code)")
    defaults = {field: engine_options.pop(f"default_{field}") for _, field, _ in SERVER_SAMPLING}
    serve(model, host=host, port=port, api_key=api_key, parallel=parallel, max_queue=max_queue, kv=kv,
          max_body_bytes=int(max_body_mib * 2**20), n_ctx=ctx, log=log, spec=spec, spec_k=spec_k,
          prefill_chunk=prefill_chunk, chat_template=chat_template, request_timeout=request_timeout,
          sampling_defaults={k: v for k, v in defaults.items() if v is not None},
          cors_origins=parse_origins(cors_origins), log_format=log_format, reasoning_format=reasoning_format,
          telemetry=telemetry, telemetry_interval=telemetry_interval, mmproj=mmproj, **engine_options)


@cli.command("bench")
@click.argument("model", required=False)
@click.option("--url", default=None, help="Benchmark this running server (default: start `pymoe serve MODEL`).")
@click.option("--api-key", default=None, envvar="PYMOE_API_KEY", help="API key of the server at --url.")
@click.option("--gen", default=128, show_default=True, help="Tokens generated per request (fixed: EOS ignored).")
@click.option("--requests", default=2, show_default=True,
              help="Requests per single-stream prompt, and per client at each concurrency level.")
@click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="Concurrency sweep (comma-separated).")
@click.option("--overload", default=32, show_default=True, help="Concurrent clients of the overload step (0: skip).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds one request may take.")
@click.option("--out", default="bench.json", show_default=True, help="Where to write the JSON report.")
@click.option("--stall-prompt", default=0, show_default=True,
              help="Also measure the stall: streams decode, then one prompt of this many tokens arrives; their worst "
                   "and p99 inter-token gap while it is read, against a stretch without it (0: skip).")
@click.option("--stall-streams", default=4, show_default=True, help="Streaming clients of the stall measurement.")
@click.option("--stall-only", is_flag=True, help="Run only the stall measurement (with --stall-prompt).")
@click.option("--protocol", default="default", show_default=True, type=click.Choice(["default", "article"]),
              help="article: the protocol once per slot pool of --pools, each server writing telemetry, then "
                   "`pymoe report` of them all (docs/telemetry.md).")
@click.option("--pools", default="10,25,50,100", show_default=True,
              help="--protocol article: slot pools, in percent of the model's experts.")
@click.option("--out-dir", default="bench-article", show_default=True,
              help="--protocol article: where the telemetry, the JSON reports and report.md go.")
@serve_options
def bench_cmd(model, url, api_key, gen, requests, concurrency, overload, timeout, out, stall_prompt, stall_streams,
              stall_only, protocol, pools, out_dir, ctx, **server_options):
    """Run the load protocol (short / ~4K / ~16K prompts, concurrency sweep, overload; optionally the long-prompt
    stall) against MODEL's server (with no MODEL: the demo model)."""
    from . import demo
    from .serve.benchmark import bench

    if model is None:
        model = demo.demo_model()
        if protocol == "article" and server_options.get("profile") is None:  # as `pymoe run` pre-fills its pools
            server_options["profile"] = demo.demo_profile()
    if stall_only and not stall_prompt:
        raise PymoeError("--stall-only needs --stall-prompt N")

    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
    except ValueError:
        raise PymoeError(f"--concurrency must be comma-separated integers, got '{concurrency}'") from None
    serve_args = [f"--{k.replace('_', '-')}={v}" for k, v in server_options.items() if v is not None]
    serve_args += [f"--ctx={ctx}"] if ctx else []
    if protocol == "article":
        from .serve.benchmark import bench_article

        if url or stall_prompt:
            raise PymoeError("--protocol article starts its own servers, one per slot pool: no --url, no --stall-prompt")
        bench_article(model, out_dir, pools, serve_args=serve_args, n_ctx=ctx, log=click.echo, gen=gen,
                      requests=requests, concurrency=levels, overload=overload, api_key=api_key, timeout=timeout)
        return
    bench(model, url=url, serve_args=serve_args, n_ctx=ctx, out=out, log=click.echo, gen=gen, requests=requests,
          concurrency=levels, overload=overload, api_key=api_key, timeout=timeout, stall_prompt=stall_prompt,
          stall_streams=stall_streams, stall_only=stall_only)


def usage_line(e: click.ClickException) -> str:
    """Click's message for a usage error as one line (click itself prints the usage block, a hint and the
    message), with the command's help named."""
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    return f"{message} (see '{ctx.command_path} --help')" if ctx is not None else message


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="pymoe", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("pymoe: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:  # a usage error (a bad value, an unknown option): one line naming it
        click.echo(f"pymoe: error: {usage_line(e)}", err=True)
        sys.exit(2 if isinstance(e, click.UsageError) else e.exit_code)
    except PymoeError as e:
        click.echo(f"pymoe: error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("pymoe: interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()

"""The `pymoe` command: a thin click group. No math here; each command calls into the package and prints.

Errors users can cause (bad file, bad option) are `PymoeError`s: printed as one line `pymoe: error: ...`, exit 2.
"""
from __future__ import annotations

import sys

import click

from .errors import PymoeError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="pymoe")
def cli():
    """pymoe: Mixture-of-Experts LLMs from GGUF files, with an expert slot cache."""


@cli.command("inspect")
@click.argument("model")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor (name, type, shape, bytes).")
def inspect_cmd(model, show_tensors):
    """Print a model's config, tensor types and counts, and the bytes of one expert (the cache slot size)."""
    from .inspect import describe_model

    click.echo(describe_model(model, show_tensors=show_tensors))


@cli.command("run")
@click.argument("model")
@click.option("-p", "--prompt", required=True, help="The prompt text.")
@click.option("-n", "--n-predict", default=128, show_default=True, help="Tokens to generate at most.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--temp", default=0.0, show_default=True, help="Temperature; 0 is greedy.")
@click.option("--top-k", default=40, show_default=True, help="Top-k filter (0: off).")
@click.option("--top-p", default=0.95, show_default=True, help="Top-p (nucleus) filter (1: off).")
@click.option("--min-p", default=0.05, show_default=True, help="Min-p filter (0: off).")
@click.option("--repeat-penalty", default=1.0, show_default=True, help="Repetition penalty (1: off).")
@click.option("--seed", default=None, type=int, help="Random seed for sampling (default: random).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ctx", default=None, type=int, help="Context size in tokens (default: the model's).")
@click.option("--threads", default=None, type=int, help="CPU threads for the kernels (default: all cores).")
@click.option("--backend", default="cpu", show_default=True, help="Where to compute: cpu.")
def run_cmd(model, prompt, n_predict, chat, temp, top_k, top_p, min_p, repeat_penalty, seed, stop, ctx, threads,
            backend):
    """Generate text from MODEL (a GGUF file) for a prompt; tokens stream to stdout, telemetry to stderr."""
    from .api import load

    engine = load(model, backend=backend, threads=threads, n_ctx=ctx, progress=True)
    pieces = engine.stream(prompt, max_tokens=n_predict, chat=chat, stop=stop, temperature=temp, top_k=top_k,
                           top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)
    for piece in pieces:
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()
    stats = engine.last_stats
    click.echo(f"pymoe run: {stats.prompt_line()}", err=True)
    click.echo(f"pymoe run: {stats.cache_line()}", err=True)


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="pymoe", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("pymoe: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
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

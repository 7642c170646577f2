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

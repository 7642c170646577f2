"""`python -m pymoe ...` is the same as the `pymoe` command."""
from .cli import main

main()

"""The ``autotune`` console script and ``python -m autotune``: checks that the command's install
extra is present (exit 2 naming it, before Typer, itself in an extra, is imported), then runs
the CLI."""

import sys

from autotune.extras import missing_extra


def main() -> None:
    problem = missing_extra(sys.argv[1:])
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(2)
    from autotune.cli import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()

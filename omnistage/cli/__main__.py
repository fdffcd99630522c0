"""`python -m omnistage.cli`: how `omnistage serve` starts its children (by exec, or forked:
the forker calls `main` as this file's own run does)."""

import sys


def main() -> None:
    try:
        from omnistage.cli.main import run
        from omnistage.cli.serve import die_with_parent_if_asked
    except KeyboardInterrupt:  # Ctrl-C while still importing: stop quietly
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    die_with_parent_if_asked()
    run()


if __name__ == "__main__":
    main()

"""The `omnistage` process: the console script, and `python -m omnistage.cli`, how `omnistage
serve` starts its children (by exec, or forked: the forker calls `main` as this file's own run
does). It ends without the interpreter's teardown (`fast_exit`); `cli.main.run` is the same
command line for a caller that goes on."""

import sys


def main() -> None:
    try:
        from omnistage.cli.main import run
        from omnistage.cli.serve import die_with_parent_if_asked
    except KeyboardInterrupt:  # Ctrl-C while still importing: stop quietly
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    from omnistage.server.fast_exit import fast_exit

    die_with_parent_if_asked()
    try:
        run()
    except SystemExit as e:
        fast_exit(e.code)
    fast_exit(0)


if __name__ == "__main__":
    main()

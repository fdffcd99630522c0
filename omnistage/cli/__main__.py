"""The `omnistage` process: the console script, and `python -m omnistage.cli`, how `omnistage
serve` starts its children (by exec, or forked: the forker calls `main` as this file's own run
does). It ends without the interpreter's teardown (`fast_exit`); `cli.main.run` is the same
command line for a caller that goes on."""

import sys


def main(die_with_parent: bool = True) -> None:
    try:
        from omnistage.cli.main import run
        from omnistage.cli.serve import die_with_parent_if_asked
    except KeyboardInterrupt:  # Ctrl-C while still importing: stop quietly
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    from omnistage.server.fast_exit import fast_exit

    if die_with_parent:
        die_with_parent_if_asked()
    try:
        run()
    except SystemExit as e:
        fast_exit(e.code)
    fast_exit(0)


def console() -> None:
    """The `omnistage` console script: `main`, but never a child of `serve` (it does not read
    $OMNISTAGE_PARENT_PID)."""
    main(die_with_parent=False)


if __name__ == "__main__":
    main()

"""`python -m omnistage.cli`: how `omnistage serve` starts its children."""

import sys

try:
    from omnistage.cli.main import run
    from omnistage.cli.serve import die_with_parent_if_asked
except KeyboardInterrupt:  # Ctrl-C while still importing: stop quietly
    print("interrupted", file=sys.stderr)
    sys.exit(130)

die_with_parent_if_asked()
run()

"""`python -m omnistage.cli`: how `omnistage serve` starts its children."""

from omnistage.cli.main import run
from omnistage.cli.serve import die_with_parent_if_asked

die_with_parent_if_asked()
run()

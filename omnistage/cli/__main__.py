"""`python -m omnistage.cli`: how `omnistage serve` starts its children."""

from omnistage.cli.main import app
from omnistage.cli.serve import die_with_parent_if_asked

die_with_parent_if_asked()
app()

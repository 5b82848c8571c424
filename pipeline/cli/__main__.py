"""`python -m pipeline.cli ...`: the `rollstream` command without its installed script."""

from pipeline.cli.commands import main

main()

"""The `sailor` command line: one module per command group, registered in sailor_cli.main."""

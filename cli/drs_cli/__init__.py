"""The ``drs`` command line: one entry point, subcommands loaded on demand."""

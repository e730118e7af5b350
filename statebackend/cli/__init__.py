"""The ``ckpt`` command line: one module per group of subcommands, ``app`` holds the
parser, the global options and the exit-code table."""

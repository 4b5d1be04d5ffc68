"""The ``kvspec`` command line: one module per subcommand, dispatched by ``main``."""

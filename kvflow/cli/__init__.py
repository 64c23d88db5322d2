"""Command-line interface: `kvflow <command>`; one module per command group."""

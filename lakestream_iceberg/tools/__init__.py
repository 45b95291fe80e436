"""Tools on top of the facade: the ``lakestream`` command line (cli), the multi-process demo (demo) and the catalog the
command line talks to (config)."""

"""Tools on top of the facade: the ``lakestream`` command line (cli) and how it prints (output), the multi-process demo
(demo) and the catalog the command line talks to (config)."""

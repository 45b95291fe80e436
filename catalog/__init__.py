"""Real catalog and object-store services for lakestream_iceberg tests and local runs (see ``catalog.services``)."""

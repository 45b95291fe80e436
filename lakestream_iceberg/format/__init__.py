"""How a stream lies in Iceberg: table layout and properties, the snapshot summary, manifests and their Avro writers,
snapshot expiry, the step index, checkpoint tags, and :class:`~lakestream_iceberg.format.table.StreamTable` (the handle
every part below the facade works on). Pure format knowledge: no commit policy, no retries."""

"""How a published step is read back: by a trainer rank (reader, follow, dataset, tensors) and by a person (history's
DuckDB views). Reading never imports the write path."""

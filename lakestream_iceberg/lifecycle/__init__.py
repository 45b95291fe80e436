"""What a stream keeps and what it collects: checkpoints as tags and forks as branches (checkpoint), lifecycle garbage
collection (gc)."""

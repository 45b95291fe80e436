"""How a global batch is written and published: shard files (writer), staged intents for group commit (staging), the
producer's exactly-once commit (producer), the compare-and-swap loop (commit) and its pacing policy (dac)."""

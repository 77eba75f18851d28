"""Model artifacts: GGUF manifests, layer-range planning, slices, and the shard swarm."""

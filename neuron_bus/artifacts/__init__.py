"""Model artifacts: reading GGUFs, where they may be cut, the work of their layers, manifests,
layer-range plans, slices, and the shard swarm.

Modules, one role each:
- gguf_model.py  a GGUF (one file or a gguf-split set) as metadata + tensors grouped by layer
- cuts.py        each layer's kind, and the layer ranges llama.cpp cannot load as a slice
- work.py        owned layer work: the weights a token multiplies in a range (reward and balance unit)
- slicing.py     a loadable GGUF of a layer range
- manifest.py    content-addressed manifests: files -> pieces -> tensors -> layers
- plan.py        which pieces a layer range needs
- verify.py      proofs by hash of a file or slice against its manifest
- swarm.py       the shard swarm on JetStream Object Store: publish, fetch, resolve a range
"""

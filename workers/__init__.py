"""Execution backends (llama.cpp layer ranges, llama.cpp full model, torch layer ranges, no-op).

This package owns the interface between the bus and execution (protocol.py: `Backend`,
`Capability`; errors.py: what a backend refuses and why) and imports nothing from neuron_bus,
nor nats: the bus reaches it only through neuron_bus/execution.py, which hands every backend
exactly the layers it runs (a slice file, or the whole model) and their place in the model.

Modules: protocol.py (the interface and shared bookkeeping), registry.py (open a backend by
kind), llama_cpp_common.py (the llama.cpp context, batches, the boundary tap),
llama_cpp_range.py / llama_cpp_full.py (llama.cpp), torch_model.py / torch_backend.py (torch,
read straight from the GGUF), noop_backend.py (the bus alone), tokenizer.py (the model's own),
files.py (files written whole; the bus's own files use it too).
"""

"""Execution backends (llama.cpp layer ranges, llama.cpp full model, torch layer ranges).

Nothing in this package imports nats: backends are driven by neuron_bus's worker service loop.
"""

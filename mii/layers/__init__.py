"""Shared model layers: linears that load (and shard) their own weights, norms, rotary embeddings, paged
attention, embeddings and the LM head, dense and mixture-of-experts MLPs. Model files compose these; they hold no math of their own beyond wiring.
"""

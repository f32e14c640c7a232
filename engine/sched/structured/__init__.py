"""Structured outputs: grammars (llguidance) that constrain what a request may sample.

backend.py wraps llguidance (imported only once a request brings a grammar), compiler.py runs
compilations off the busy loop, tokenizer.py gives llguidance the vocabulary's exact bytes.
"""

"""Structured outputs: grammars (llguidance) that constrain what a request may sample."""

from engine.structured.backend import Grammar, GrammarError, Masker, Matcher
from engine.structured.compiler import GrammarCompiler, GrammarStats, PendingGrammar
from engine.structured.tokenizer import build_lltokenizer

__all__ = ["Grammar", "GrammarCompiler", "GrammarError", "GrammarStats", "Masker", "Matcher",
           "PendingGrammar", "build_lltokenizer"]

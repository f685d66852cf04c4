"""Structured output (JSON Schema, regex, choice, EBNF) through xgrammar; see manager.py."""

from deepinfer.sample.structured.backend import validate
from deepinfer.sample.structured.grammar import GrammarState, RequestGrammar
from deepinfer.sample.structured.manager import StructuredOutputManager

__all__ = ["GrammarState", "RequestGrammar", "StructuredOutputManager", "validate"]

"""The error every model-loading step raises, in a module of its own: the loader, the GGUF and HF
readers and the tokenizer all raise it, and the loader imports the tokenizer, so the tokenizer
cannot import it from the loader without an import cycle (tests/unit/test_import_cycles.py)."""


class ModelLoadError(ValueError):
    """A model file is missing, corrupt, or of a kind deepinfer cannot read. Names the file."""

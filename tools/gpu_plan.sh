#!/usr/bin/env bash
# The GPU plan: the figures docs/benchmarks.md records on a GPU, in three parts that each fit one
# device call of at most 10 minutes (each part's step limits sum to <= 540 s; docs/gpu.md gives the
# expected times and which part to run first when device time is short).
#
#   bash tools/gpu_plan.sh OUT_DIR part1     # kernels: tests, tuning, our attention vs SDPA, every op; host counts
#   bash tools/gpu_plan.sh OUT_DIR part2     # MoE kernels, GPT-2 with CUDA graphs, llama3-1b and llama-1b MFU
#   bash tools/gpu_plan.sh OUT_DIR part3     # the compiled transformers loop, the planner, a profile, an MoE step
#   bash tools/gpu_plan.sh OUT_DIR STEP ...  # named steps (parts and steps mix)
#   bash tools/gpu_plan.sh --list            # the parts, their steps and time limits; runs nothing
#
# Each step runs under its own time limit (one slow step cannot eat the rest) and writes
# OUT_DIR/STEP.txt (a training step also OUT_DIR/STEP.jsonl, its metrics); then its GOAL lines are
# printed and appended to OUT_DIR/goals.txt: `GOAL <step> <what>: <goal> | measured <figure> |
# met / NOT met / -` (tools/gpu_goals.py reads them from the step's output; a step that failed or
# timed out prints `NOT measured`). OUT_DIR/plan.txt says how each step ended, OUT_DIR/env.txt the
# GPU, driver and versions. Later parts use what part1 tuned into the same OUT_DIR when it is there.
# Runs from the source tree: megalite/kernels is linked to kernels/ and PYTHONPATH set, so a machine
# that cannot `pip install -e .` (no registry) runs it as is.
set -u
part_steps() {  # the steps of a part (one line each: tests/tools/test_gpu_goals.py reads them), or the name itself
    case $1 in
        part1) steps="kernel_tests tune_attention tune_norms bench_attention bench_kernels host_overhead" ;;
        part2) steps="bench_moe_kernels bench_train bench_train_graph profile_gpt2_graph train_gpt2_graph train_llama3 train_llama1b" ;;
        part3) steps="compile_baseline step_time profile_llama3 train_moe" ;;
        *) steps=$1 ;;
    esac
    echo "$steps"
}
listing=
if [[ ${1:-} == --list ]]; then
    listing=1 out=/nonexistent selected=" $(part_steps part1) $(part_steps part2) $(part_steps part3) "
else
    out=${1:?usage: bash tools/gpu_plan.sh OUT_DIR [part1|part2|part3|STEP ...] (or --list)}
    shift
    selected=" "
    for arg in "${@:-part1 part2 part3}"; do for name in $arg; do selected+="$(part_steps "$name") "; done; done
    mkdir -p "$out"
    ln -sfn ../kernels megalite/kernels
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
      python -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__,
                 torch.version.cuda, torch.cuda.get_device_name())"; } > "$out/env.txt" 2>&1
fi
declare -A goal_flags=([train_llama3]="--mfu 0.5" [train_llama1b]="--mfu 0.5")

step() {  # step NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ $selected == *" $name "* ]] || return 0
    if [[ -n $listing ]]; then echo "  $name (limit $limit s): $*"; return 0; fi
    local started=$SECONDS
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "$name: exit $? after $((SECONDS - started)) s (limit $limit s): $*" | tee -a "$out/plan.txt"
    python tools/gpu_goals.py "$name" "$out" ${goal_flags[$name]:-} | tee -a "$out/goals.txt"
}
tables() {  # the tables part1's tuning wrote (all, or those matching $1), for --tables
    ls "$out"/${1:-*}_tables.json 2>/dev/null | tr '\n' ' '
}
if [[ -n $listing ]]; then
    for part in part1 part2 part3; do
        total=0
        for name in $(part_steps $part); do total=$((total + $(grep -oP "^step $name \K\d+" "$0"))); done
        echo "$part: $(part_steps $part) (limits sum to $total s)"
    done
    echo "steps:"
fi
workers=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
train="python examples/pretrain_gpt.py --mock-data --bf16 --log-interval 1 --eval-iters 0"

# part1: kernels (issue 36 goal 1: our attention >= 1.0x SDPA fwd+bwd at d 64/128, s 1k-16k)
step kernel_tests 120 python -m pytest -q $workers tests/kernels
step tune_attention 100 python tools/tune_attention.py --json "$out/attention_tables.json"
step tune_norms 60 python tools/tune_norms.py --json "$out/norm_tables.json"
step bench_attention 90 python tools/bench_attention.py --json "$out/bench_attention.json" \
    $(tables attention | sed 's/^\(.\)/--tables \1/')
step bench_kernels 120 python tools/bench_kernels.py --quick --no-correctness --csv "$out/bench_kernels.csv" \
    $(tables | sed 's/^\(.\)/--tables \1/')
# issue 26's per-step host counts on this machine's torch and triton (CPU work: 2 min on a loaded 2-core VM)
step host_overhead 50 python tools/bench_host_overhead.py --steps 3

# part2: MoE kernels (goal 4), GPT-2 small with CUDA graphs (goal 3: >= 1.5x the plain loop, wall within
# 10% of the kernels, tokens/s beside llm.c's), real-vocabulary MFU (goal 2: >= 50%)
step bench_moe_kernels 150 python tools/bench_kernels.py --ops grouped_mm,moe_permute --no-correctness \
    --csv "$out/bench_moe_kernels.csv"
step bench_train 50 python tools/bench_train.py --model gpt2-124m --micro-batch-size 8 --seq-length 1024 --bf16
step bench_train_graph 50 python tools/bench_train.py --model gpt2-124m --micro-batch-size 8 --seq-length 1024 \
    --bf16 --cuda-graph --goal 1.5
step profile_gpt2_graph 75 python tools/profile_step.py --model gpt2-124m --micro-batch-size 8 --seq-length 1024 \
    --bf16 --cuda-graph --top 15
step train_gpt2_graph 60 $train --model gpt2-124m --micro-batch-size 8 --train-iters 20 --cuda-graph \
    --metrics-file "$out/train_gpt2_graph.jsonl"
step train_llama3 75 $train --model llama3-1b --micro-batch-size 4 --seq-length 2048 --train-iters 20 \
    --metrics-file "$out/train_llama3.jsonl"
step train_llama1b 75 $train --model llama-1b --micro-batch-size 4 --seq-length 2048 --train-iters 20 \
    --metrics-file "$out/train_llama1b.jsonl"

# part3: goal 2's >= 1.25x the transformers + torch.compile loop (one system at a time: both at once
# need ~75 GB), goal 5's planner within 15%, where llama3-1b's step goes (the 128k output layer and
# cross entropy), goal 4's 2-layer Mixtral-width step in MFU of active parameters
step compile_baseline 190 python tools/bench_train.py --model llama3-1b --micro-batch-size 4 --seq-length 2048 \
    --bf16 --compile-baseline --goal 1.25 --steps 5 --one-at-a-time
step step_time 230 python tools/bench_step_time.py --h200 --measure --iters 15 --out "$out/step_time"
step profile_llama3 60 python tools/profile_step.py --model llama3-1b --micro-batch-size 4 --seq-length 2048 \
    --bf16 --top 25
step train_moe 60 $train --model mixtral-8x7b --num-layers 2 --micro-batch-size 2 --seq-length 4096 \
    --train-iters 12 --metrics-file "$out/train_moe.jsonl"

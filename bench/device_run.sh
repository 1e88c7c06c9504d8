#!/usr/bin/env bash
# One device call that checks and measures what a session changed (run it through the `device` tool from
# the repository root). Each step has its own time limit, so one stuck step cannot eat the whole call;
# results land in $OUT (the device tool brings them back), named with the commit given here.
#
#   bash bench/device_run.sh <commit> [tests] [pi05] [rmuscle] [trace] [trace_cached] [rmuscle7b] [load] [pi05-7b] [vision_mlp] [attention] [overlap] [library] [ffn_kernels] [tune_geglu] [ncu_gate_up] [policy] [node] [node_setup] [node_tests] [node_soak] [node_soak_ab] [node_stacks] [preprocess] [first_rebuild] [call_timeline] [rmuscle_bar] [rmuscle_alone] [episode_read] [overlap_first_step] [export_f32] [export_bf16] [lost_gpu]
#   (default: the first four, ~7 min; rmuscle7b: the same at pi05-7b, ρ 0.4/0.5 only, ~5 min;
#   pi05-7b: bench_pi05 at pi05-7b, without the serial-launch engine, which would not fit;
#   load: bench/probe_load_inputs.py, what loading the inputs adds to a call, overlapped or not, ~2 min;
#   vision_mlp: bench/probe_vision_mlp.py, the most a Context Cache in SigLIP's MLPs could save, ~1 min;
#   attention: bench/probe_prefill_attention.py, the prefill attention's kernels and configs, ~30 s;
#   overlap: bench/probe_rebuild_overlap.py, live graphs alongside rebuild graphs, ~3 min;
#   trace_cached: the stage traces with the cached graphs at ρ 0.4/0.5, the denoise by layer-step position, ~1 min;
#   library: bench_rmuscle at ρ 0.4/0.5, first / fallback / cached calls by library size, ~2 min;
#   ffn_kernels: bench/probe_ffn_kernels.py, the denoise's FFN kernels alone, weights hot and cold, ~1 min;
#   tune_geglu: bench/tune_in_graph.py, the gathered gate/up's configurations in the cached denoise graph, ~2 min;
#   policy: bench/bench_policy.py, Policy.infer by cache mode (a recorded dense episode, its cached repeat), ~1.5 min;
#   node: the node's demo on the GPU (pi05, graph, rMuscle) over DDS with the replayed bags, ~2.5 min; needs the
#   ROS wheels for the device's Python carried in .whl/cp312 (scripts/ros_wheels_for_python.sh 3.12 .whl/cp312);
#   node_setup: only that installation, for a script run after it in the same call (~1 min);
#   node_tests: the node's GPU tests (test_node_cache, test_node_lifecycle: the graph backend, tiny model), ~3 min;
#   node_soak: the demo as a shift, a warm-up and 7 repeats of 15 s at full size, ~4 min; the recorded chunks
#   (latency, cache mode per chunk) come back in $OUT/node_soak_<commit>/action_chunks;
#   node_soak_ab: shorter shifts (a warm-up and 2 repeats of 15 s), alternated: the node as it is, and with
#   Python's switch interval kept at its default (bench/ab/no_wake_switch), two of each, ~8 min;
#   node_stacks: bench/probe_node_stacks.py, the demo at full size with slow preprocessing calls' thread
#   stacks sampled, ~3 min; preprocess: bench/bench_preprocess.py with 4 threads (the node's on a GPU), ~1 min;
#   first_rebuild: bench/probe_first_rebuild.py (tiny, graph), the rebuild parts after a reset timed in pieces,
#   not yet run on a GPU (<1 min expected); call_timeline: bench/probe_call_timeline.py (pi05, 0.4 / 0.5 ramp),
#   a dense and a cached call split into the host's steps before the first launch and the stages, ~1 min;
#   rmuscle_bar: bench_rmuscle at ρ 0.4/0.5 (ramp) and 1/1 without the interference rows (issue #4's bar), ~2.5 min;
#   rmuscle_alone: bench_rmuscle at ρ 1/0.5 (the Action Cache alone: no window FFN states, no rebuilds) and
#   0.4/0.5, both ramp, without the interference rows: speed, engine cache memory and GPU peak per row, ~2.5 min;
#   lost_gpu: bench/probe_lost_gpu.py, a CUDA fault and a process that lets its policy go, ~1 min;
#   episode_read: bench/bench_episode_read.py, a rebuild's library read
#   (one call's rows against the whole episode, pi05 shapes) on the device host's disk, <1 min;
#   overlap_first_step: bench/probe_overlap_first_step.py, the tail graph with the first denoising step
#   alongside the prefill against after it, dense and cached, bit-identity checked, ~2 min;
#   export_f32 / export_bf16: bench/check_export.py at full size (the tensorrt backend's ONNX export: float32
#   through ONNX Runtime against eager float32, bfloat16 through ONNX's checker); needs onnx, onnxruntime and
#   onnxscript wheels for the device's Python carried in .whl/onnx312, ~5-9 min each;
#   ncu_gate_up: Nsight Compute on the gathered (32 and 16 columns per program) and dense gate/up kernels,
#   bench/ncu_gate_up.py, raw reports in $OUT, ~1 min; Firecracker leases only, where ncu reads counters)
#
# <commit>: `git rev-parse --short HEAD` on the developer's machine (the device copy's git may differ).
set -u
commit=${1:?usage: bench/device_run.sh <commit> [step ...], the steps listed at the top of this file}
shift
steps=${*:-tests pi05 rmuscle trace}
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
# The card in result names ("h200", "h100"; bench.gpu_tag, as the benchmarks' own names): a lease may be
# either, and a file named for the other misleads.
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
card=$([[ -n $gpu_name ]] && python3 -c 'import sys; from bench import gpu_tag; print(gpu_tag(sys.argv[1]))' "$gpu_name")
card=${card:-gpu}
quiet() { grep -v -i "warn"; }
# A probe script's step: its time limit (s), its name in bench/, the lines of its output worth showing.
probe() { timeout "$1" python3 "bench/$2.py" --commit "$commit" --out "$out" 2>&1 | quiet | grep "$3"; }
for step in $steps; do
    echo "=== $step ($(date -u +%T))"
    case $step in
        tests)
            timeout 300 python3 -m pytest -q -m gpu test/test_engine_gpu.py test/test_rmuscle_runtime.py test/test_transforms.py test/test_checkpoint.py \
                test/test_rmuscle_engine.py test/test_policy.py 2>&1 | quiet | tail -15 ;;
        pi05)
            timeout 300 python3 bench/bench_pi05.py --commit "$commit" --name "pi05_${card}_$commit" \
                --out "$out" 2>&1 | quiet | grep "^| \|graph\|Medians" ;;
        pi05-7b)
            timeout 540 python3 bench/bench_pi05.py --preset pi05-7b --no-serial --iters 20 --eager-iters 4 \
                --rounds 2 --commit "$commit" --name "pi05-7b_${card}_$commit" --out "$out" 2>&1 | quiet \
                | grep "^| \|graph\|Medians\|accuracy\|Error" ;;
        rmuscle)
            timeout 300 python3 bench/bench_rmuscle.py --commit "$commit" \
                --name "rmuscle_pi05_${card}_$commit" --out "$out" 2>&1 | quiet | grep "end to end\|^| rmuscle\|Error" ;;
        library)
            timeout 300 python3 bench/bench_rmuscle.py --rho 0.4,0.5 --no-interference --library-episodes 1 64 256 \
                --commit "$commit" --name "rmuscle_library_${card}_$commit" --out "$out" 2>&1 | quiet \
                | grep "end to end\|library of\|^| \|Error" ;;
        rmuscle_bar)  # issue #4's bar: ρ 0.4/0.5 (ramp) against ρ 1/1, the dense graph and eager, ~2.5 min
            timeout 400 python3 bench/bench_rmuscle.py --rho 0.4,0.5,ramp --rho 1,1 --no-interference \
                --commit "$commit" --name "rmuscle_pi05_${card}_$commit" --out "$out" 2>&1 | quiet \
                | grep "end to end\|^| rmuscle\|Error" ;;
        rmuscle_alone)  # the Action Cache alone (ρp = 1) against the default, same run
            timeout 400 python3 bench/bench_rmuscle.py --rho 1,0.5,ramp --rho 0.4,0.5,ramp --no-interference \
                --commit "$commit" --name "rmuscle_alone_pi05_${card}_$commit" --out "$out" 2>&1 | quiet \
                | grep "end to end\|^| rmuscle\|Error\|memory" ;;
        rmuscle7b)
            timeout 400 python3 bench/bench_rmuscle.py --preset pi05-7b --rho 0.4,0.5 --iters 10 --no-interference \
                --commit "$commit" --name "rmuscle_pi05-7b_${card}_$commit" --out "$out" 2>&1 | quiet \
                | grep "end to end\|^| rmuscle\|Error\|eager\|memory" ;;
        load) probe 240 probe_load_inputs "^\[probe\]\|Error" ;;
        vision_mlp) probe 200 probe_vision_mlp "^\[probe\]\|^| \|Error" ;;
        attention) probe 200 probe_prefill_attention "^| \|Error" ;;
        overlap_first_step) probe 300 probe_overlap_first_step "^| \|Dense\|Error\|NO" ;;
        overlap) probe 500 probe_rebuild_overlap "^\[probe\]\|Error" ;;
        ffn_kernels) probe 200 probe_ffn_kernels "^\[probe\]\|Error" ;;
        tune_geglu)
            timeout 300 python3 bench/tune_in_graph.py --cache 0.4 0.5 --only gathered_geglu --commit "$commit" \
                --out "$out" 2>&1 | quiet | grep "default\|gathered_geglu\|Error" ;;
        ncu_gate_up)
            sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats"
            sections="$sections --section SchedulerStats --section Occupancy --section LaunchStats"
            for launch in 3:gathered_bn32 8:dense_bn32 13:gathered_bn16; do
                timeout 200 ncu --clock-control none --cache-control none --kernel-name regex:skinny \
                    --launch-skip "${launch%%:*}" --launch-count 1 $sections python3 bench/ncu_gate_up.py \
                    > "$out/ncu_gate_up_${card}_${commit}_${launch#*:}.txt" 2>&1
                grep "Duration\|SM Active Cycles\|Elapsed Cycles\|L1/TEX Cache Throughput\|L2 Cache Throughput" \
                    "$out/ncu_gate_up_${card}_${commit}_${launch#*:}.txt"
            done ;;
        trace)
            timeout 200 python3 bench/trace_graphs.py --commit "$commit" --order prefill --out "$out" 2>&1 \
                | quiet | grep "^## " ;;
        trace_cached)
            timeout 200 python3 bench/trace_graphs.py --commit "$commit" --cache 0.4 0.5 --out "$out" 2>&1 \
                | quiet | grep "^## \|^| [0-9]" ;;
        preprocess)  # bench/bench_preprocess.py with the node's 4 threads on a GPU host
            timeout 200 python3 bench/bench_preprocess.py --threads 4 --commit "$commit" --out "$out" 2>&1 \
                | quiet | grep "^| " ;;
        first_rebuild)  # bench/probe_first_rebuild.py: the rebuild parts after a reset, timed in pieces (tiny)
            timeout 200 python3 bench/probe_first_rebuild.py --commit "$commit" --out "$out" 2>&1 | quiet | grep "^|\|Error" ;;
        call_timeline)  # bench/probe_call_timeline.py: the host's steps and the stages of dense and cached calls
            timeout 300 python3 bench/probe_call_timeline.py --commit "$commit" \
                --name "probe_call_timeline_pi05_${card}_$commit" --out "$out" 2>&1 | quiet | grep "^|\|Error" ;;
        lost_gpu)  # bench/probe_lost_gpu.py: a lost CUDA context, and a process that lets its policy go, ~1 min
            probe 300 probe_lost_gpu "^[a-z_]* {" ;;
        episode_read)  # bench/bench_episode_read.py: one call's rows against the whole episode, on this host
            timeout 200 python3 bench/bench_episode_read.py --commit "$commit" --name "episode_read_${card}_$commit" \
                --out "$out" 2>&1 | quiet | grep "^|\|Error" ;;
        policy) timeout 400 python3 bench/bench_policy.py --commit "$commit" --out "$out" 2>&1 | quiet | grep "^|\|Error" ;;
        node|node_setup|node_tests|node_soak|node_soak_ab|node_stacks)  # ROS 2 from the wheels carried in .whl/cp312, into the machine's Python
            if [[ ! -d .whl/cp312 ]]; then
                echo "no .whl/cp312: run scripts/ros_wheels_for_python.sh 3.12 .whl/cp312 and carry .whl/cp312"
                continue
            fi
            prefix=$(dirname "$(dirname "$(command -v python3)")")
            if ! AMENT_PREFIX_PATH=$prefix python3 -c "import rclpy, rmuscle_ros.msg, rosbags, simplejpeg" 2>/dev/null; then
                (export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl/cp312 PIP_DISABLE_PIP_VERSION_CHECK=1
                 python3 -m pip install -q -e . --no-deps --no-build-isolation --config-settings editable_mode=compat &&
                    python3 -m pip install -q rosbags simplejpeg && timeout 200 bash scripts/setup_ros_venv.sh "$prefix") \
                    > "$out/node_setup.log" 2>&1 || { tail -20 "$out/node_setup.log"; continue; }
            fi
            case $step in
                node_setup) echo "ROS 2 installed: AMENT_PREFIX_PATH=$prefix" ;;
                node)
                    AMENT_PREFIX_PATH=$prefix timeout 300 python3 -m rmuscle_ros.demo --seconds 10 --out "$out/node_demo_$commit" \
                        --param model.preset=pi05 --param model.random_weights=true --param model.device=cuda --param model.backend=graph --param cpu_threads=0 \
                        2>&1 | quiet | grep "^\[demo\]\|Error" | tee "$out/node_demo_$commit.txt"
                    rm -rf "$out/node_demo_$commit"/aloha_episode* ;;
                node_tests)  # the node's tests on the graph backend on this GPU (tiny model), over DDS
                    AMENT_PREFIX_PATH=$prefix timeout 420 python3 -m pytest -q -m gpu -rs -p no:cacheprovider \
                        test/test_node_cache.py test/test_node_lifecycle.py > "$out/node_tests_$commit.log" 2>&1
                    grep -E "^(FAILED|ERROR)|^E  |[0-9]+ (passed|failed)" "$out/node_tests_$commit.log" | head -30 ;;
                node_stacks)  # bench/probe_node_stacks.py: slow preprocessing, with every thread's stack
                    AMENT_PREFIX_PATH=$prefix timeout 420 python3 bench/probe_node_stacks.py --seconds 15 --episodes 6 \
                        --param model.preset=pi05 --param model.random_weights=true --param model.device=cuda --param model.backend=graph \
                        --param cpu_threads=0 --gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
                        --commit "$commit" --out "$out" 2>&1 | quiet | grep "^#\|^- call\|preprocessing calls\|Error"
                    rm -rf "$out/probe_node_stacks_${commit}_run"/aloha_episode* ;;
                node_soak)  # a shift: the warm-up and 7 repeats of 15 s, the node at full size on the GPU
                    AMENT_PREFIX_PATH=$prefix timeout 420 python3 -m rmuscle_ros.demo --seconds 15 --episodes 8 \
                        --out "$out/node_soak_$commit" --param model.preset=pi05 --param model.random_weights=true --param model.device=cuda \
                        --param model.backend=graph --param cpu_threads=0 \
                        2>&1 | quiet | grep "^\[demo\]\|Error" | tee "$out/node_soak_$commit.txt"
                    rm -rf "$out/node_soak_$commit"/aloha_episode* ;;
                node_soak_ab)  # the wake after a tick, as it is (wake) and without (default), alternated
                    for run in wake_1 default_1 wake_2 default_2; do
                        path=.
                        [[ $run == default_* ]] && path=.:bench/ab/no_wake_switch
                        echo "--- $run"
                        PYTHONPATH=$path AMENT_PREFIX_PATH=$prefix timeout 200 python3 -m rmuscle_ros.demo \
                            --seconds 15 --episodes 3 --out "$out/node_soak_ab_${commit}_$run" \
                            --param model.preset=pi05 --param model.random_weights=true --param model.device=cuda --param model.backend=graph \
                            --param cpu_threads=0 2>&1 | quiet | grep "^\[demo\]\|Error" \
                            | tee "$out/node_soak_ab_${commit}_$run.txt" | grep "p50\|tick\|motion\|Error"
                        rm -rf "$out/node_soak_ab_${commit}_$run"/aloha_episode*
                    done ;;
            esac ;;
        export_f32|export_bf16)  # bench/check_export.py at full size; onnx wheels carried in .whl/onnx312
            if [[ ! -d .whl/onnx312 ]]; then
                echo "no .whl/onnx312: download onnx, onnxruntime, onnxscript (+ deps) for cp312 and carry it"
                continue
            fi
            python3 -c "import onnxruntime, onnxscript" 2>/dev/null || PIP_DISABLE_PIP_VERSION_CHECK=1 \
                python3 -m pip install -q --no-index --find-links .whl/onnx312 onnx onnxruntime onnxscript 2>&1 | tail -2
            dtype=$([[ $step == export_f32 ]] && echo float32 || echo bfloat16)
            timeout 560 python3 bench/check_export.py --preset pi05 --dtype "$dtype" --workdir "/tmp/export_$dtype" \
                --commit "$commit" --out "$out" 2>&1 | quiet | grep -v "^\[torch.onnx\]\|rename_mapping\|program = "
            rm -rf "/tmp/export_$dtype" ;;
        *) echo "unknown step $step (tests, pi05, rmuscle, trace, trace_cached, rmuscle7b, load, pi05-7b, vision_mlp, attention, overlap, library, ffn_kernels, tune_geglu, ncu_gate_up, policy, node, node_setup, node_tests, node_soak, node_soak_ab, node_stacks, preprocess, first_rebuild, call_timeline, episode_read, overlap_first_step, export_f32, export_bf16)" ;;
    esac
done

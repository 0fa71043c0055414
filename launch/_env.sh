# Sourced by the launchers: one place for the environment every run starts with.
# Sets: ROOT, PYTHONSAFEPATH, PY (the Python that runs scale_llm), gpus (the node's: nvidia-smi's
# count, else torch's), visible_gpus (those CUDA_VISIBLE_DEVICES leaves), NGPU, OMP_NUM_THREADS,
# PYTORCH_CUDA_ALLOC_CONF (unless it or PYTORCH_ALLOC_CONF is set), DS_ACCELERATOR (no visible
# GPU), TORCHRUN (the torchrun command), and
# the functions run_prepare, require_config, run_job, tell_workers and end_run (how a run stops).

unset CDPATH  # (an exported one sends `cd DIR` elsewhere, and prints where)
ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
# A relative SCALE_LLM_VENV or SCALE_LLM_PYTHON names a place from the folder the launcher was
# started in, as for setup.sh (the probes below run from /).
# (a SCALE_LLM_PYTHON without a / is a command's name, looked up on PATH)
if [[ -n "${SCALE_LLM_VENV:-}" && "$SCALE_LLM_VENV" != /* ]]; then
  export SCALE_LLM_VENV="$PWD/$SCALE_LLM_VENV"
fi
if [[ "${SCALE_LLM_PYTHON:-}" == */* && "$SCALE_LLM_PYTHON" != /* ]]; then
  export SCALE_LLM_PYTHON="$PWD/$SCALE_LLM_PYTHON"
fi
# `python -m` and `-c` put the working folder first on sys.path: a yaml.py there would be
# imported. Python 3.11+ leaves it out with this (every process below inherits it).
export PYTHONSAFEPATH=1
# An empty entry of PYTHONPATH (`export PYTHONPATH=$X:$PYTHONPATH` while it was unset) is the
# working folder to Python, which PYTHONSAFEPATH leaves in: empty entries are dropped.
if [[ -n "${PYTHONPATH+set}" ]]; then
  kept_path=""
  IFS=: read -ra path_entries <<< "$PYTHONPATH"
  for path_entry in ${path_entries[@]+"${path_entries[@]}"}; do
    if [[ -n "$path_entry" ]]; then kept_path+="${kept_path:+:}$path_entry"; fi
  done
  if [[ -n "$kept_path" ]]; then export PYTHONPATH="$kept_path"; else unset PYTHONPATH; fi
fi
# One start of a Python answers what the launchers ask of it, from / (so that a scale_llm
# folder in the current directory proves nothing): it imports scale_llm's CLI, pyyaml's loader
# and torch; whether torch is 2.13 or newer (the allocator setting below); with argument 1
# (no nvidia-smi count), the GPUs torch counts on the node (CUDA_VISIBLE_DEVICES unset).
# One line: "probe NEW GPUS".
read -r -d '' PROBE <<'PY' || true
import os, sys
os.environ.pop("CUDA_VISIBLE_DEVICES", None)
import scale_llm.cli, torch
from yaml import safe_load  # (without pyyaml, a checkout's yaml/ imports as an empty package)
try:
    new = tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 13)
except ValueError:  # (a version this cannot read: the setting torch had before 2.13)
    new = False
gpus = 0
if sys.argv[1:] == ["1"]:
    try:
        gpus = torch.cuda.device_count()
    except Exception:  # (no usable CUDA: none)
        pass
print("probe", int(new), gpus)
PY
gpus=0  # the node's GPUs: nvidia-smi's count (gpu-check.sh reports it), else torch's
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
fi
# Containers started with NVIDIA_DRIVER_CAPABILITIES=compute have CUDA but no nvidia-smi: there
# the probe counts them.
count_in_torch=$(( gpus == 0 ? 1 : 0 ))
probe=""
# probe_with CMD...: sets probe to the answer of the Python CMD starts (empty: none).
probe_with() {
  probe=$(cd / && "$@" -c "$PROBE" "$count_in_torch" 2>/dev/null | tail -n 1) || probe=""
  [[ "$probe" =~ ^probe\ [01]\ [0-9]+$ ]] || probe=""
  [[ -n "$probe" ]]
}
# The Python to run: $SCALE_LLM_PYTHON if set; else the active python when it can import
# scale_llm (an activated venv, a conda env, a wheel install); else the checkout's .venv.
if [[ -n "${SCALE_LLM_PYTHON:-}" ]]; then
  PY="$SCALE_LLM_PYTHON"
  probe_with "$PY" || true
else
  PY=""
  for candidate in python python3; do
    if command -v "$candidate" >/dev/null 2>&1 && probe_with "$candidate" -I; then
      PY="$(command -v "$candidate")"
      break
    fi
  done
  venv="${SCALE_LLM_VENV:-$ROOT/.venv}"  # (setup.sh's venv)
  if [[ -z "$PY" && -x "$venv/bin/python" ]]; then
    PY="$venv/bin/python"
    probe_with "$PY" || true
  fi
  # Last, a python3 that has torch and the other dependencies but not scale_llm (a GPU image
  # with no network, handed this checkout): run the checkout itself, through PYTHONPATH.
  if [[ -z "$PY" && -d "$ROOT/scale_llm" ]] && command -v python3 >/dev/null 2>&1 \
      && probe_with env PYTHONPATH="$ROOT" python3; then
    PY="$(command -v python3)"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
if [[ -z "$probe" && -n "${SCALE_LLM_PYTHON:-}" ]]; then
  echo "launch: no Python that can import scale_llm: SCALE_LLM_PYTHON=$SCALE_LLM_PYTHON does not" \
    "run, or cannot import scale_llm, its dependencies and torch; point SCALE_LLM_PYTHON at one" \
    "that can, or unset it to use the active python or this checkout's .venv" >&2
  exit 2
fi
if [[ -z "$probe" ]]; then
  echo "launch: no Python that can import scale_llm (tried the active python," \
    "${venv:-$ROOT/.venv}, python3 with this checkout on PYTHONPATH); in a checkout run" \
    "'bash launch/setup.sh' first, or install a built wheel ('pip install" \
    "scale_llm-VERSION-py3-none-any.whl', README: Installing as a package)" >&2
  exit 2
fi
read -r _ torch_2_13 torch_gpus <<< "$probe"
if [[ "$gpus" -eq 0 ]]; then
  gpus="$torch_gpus"  # (counted only where nvidia-smi listed none)
fi

# Expandable segments let the CUDA caching allocator grow blocks instead of fragmenting; and
# pinned host blocks over 1 MiB keep their size (torch >= 2.13; by default each is rounded up to
# a power of two: an optimizer offload's 25 GiB fp32 partition would take 32 GiB of host). Not
# where the user set either name torch reads: with both set, torch 2.13 reads only
# PYTORCH_CUDA_ALLOC_CONF, so a default under that name would replace a PYTORCH_ALLOC_CONF.
if [[ -z "${PYTORCH_CUDA_ALLOC_CONF+set}" && -z "${PYTORCH_ALLOC_CONF+set}" ]]; then
  PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
  if [[ "$torch_2_13" == 1 ]]; then
    PYTORCH_CUDA_ALLOC_CONF+=",pinned_max_round_threshold_mb:1"
  fi
fi
if [[ -n "${PYTORCH_CUDA_ALLOC_CONF+set}" ]]; then export PYTORCH_CUDA_ALLOC_CONF; fi
# After forwarding a SIGTERM, torchrun kills the workers that have not exited within this many
# seconds (its default, 30, is less than a large model's last steps and checkpoint can take).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
if ! [[ "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" =~ ^(0|[1-9][0-9]{0,6})$ ]]; then
  echo "launch: TORCH_ELASTIC_SHUTDOWN_TIMEOUT='${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:0:60}' is not a" \
    "whole number of seconds (torchrun stops with a traceback after the data is prepared); set" \
    "e.g. 300, or unset it" >&2
  exit 2
fi

# The GPUs this run may use: CUDA_VISIBLE_DEVICES narrows the node's list when it is set, with
# CUDA's meaning (its entries up to the first negative one; set and empty: none), so a job
# given GPUs 2,3 of a shared node starts two processes, not one per GPU of the node.
visible_gpus="$gpus"
visible_ids=()  # CUDA_VISIBLE_DEVICES's entries, when it is set on a machine with GPUs
if [[ "$gpus" -gt 0 && -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  IFS=, read -ra listed_ids <<< "$CUDA_VISIBLE_DEVICES"
  for listed_id in ${listed_ids[@]+"${listed_ids[@]}"}; do
    if [[ "$listed_id" == -* ]]; then break; fi
    for seen_id in ${visible_ids[@]+"${visible_ids[@]}"}; do
      if [[ "$seen_id" == "$listed_id" ]]; then
        echo "launch: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES lists GPU $listed_id twice," \
          "and one process a GPU is the layout; list each GPU once" >&2
        exit 2
      fi
    done
    if [[ -n "$listed_id" ]]; then visible_ids+=("$listed_id"); fi
  done
  visible_gpus=${#visible_ids[@]}
fi
if [[ "$visible_gpus" -eq 0 ]]; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"  # DeepSpeed's CPU accelerator (gloo)
fi
# Processes per node: every visible GPU, or 2 CPU processes on a machine without GPUs.
user_ngpu="${NGPU:-}"  # (deepspeed.sh with a hostfile: its slots decide)
NGPU="${NGPU:-$([[ "$visible_gpus" -gt 0 ]] && echo "$visible_gpus" || echo 2)}"
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch: NGPU=$NGPU: NGPU is the number of processes to start on this node and must be" \
    "1 or more; unset it to start one per visible GPU (2 on a machine without GPUs)" >&2
  exit 2
fi
# Split the cores between the local processes instead of letting each take all of them.
cores=$(nproc)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / NGPU > 0 ? cores / NGPU : 1 ))}"
if ! [[ "$OMP_NUM_THREADS" =~ ^[1-9][0-9]{0,4}(,[1-9][0-9]{0,4})*$ ]]; then  # (levels: 8,4)
  echo "launch: OMP_NUM_THREADS='${OMP_NUM_THREADS:0:60}' is not a number of threads (each" \
    "process would take every core); set 1 or more, or unset it to split $cores cores between" \
    "the $NGPU processes" >&2
  exit 2
fi

# Prepare the data (a no-op when it is up to date) before training starts, from the same
# arguments as `train` (so its flags are accepted, and checked before any data work). In
# multi-node jobs only node 0 prepares; the others wait for it in the rendezvous.
# SKIP_PREPARE=1 skips it. launch_world (where the launcher knows how many processes it starts):
# the run's layout is checked for that world first (a tensor-parallel degree it does not divide).
# It runs as a job of its own, as the workers do (run_job): a stop signal to the launcher is
# passed on to it (it keeps what it wrote), not left running without the launcher.
run_prepare() {
  if [[ "${SKIP_PREPARE:-0}" == "1" || "${NODE_RANK:-0}" != "0" ]]; then return; fi
  local prep="" status=0 got=""
  # (a signal between the start and `prep=$!` finds prep empty: passed on just below)
  trap 'got=TERM; [[ -z "$prep" ]] || kill -s TERM -- "-$prep" 2>/dev/null || true' TERM
  trap 'got=HUP; [[ -z "$prep" ]] || kill -s TERM -- "-$prep" 2>/dev/null || true' HUP
  trap 'got=INT; [[ -z "$prep" ]] || kill -s INT -- "-$prep" 2>/dev/null || true' INT
  set -m
  SCALE_LLM_LAUNCH_WORLD="${launch_world:-}" "$PY" -m scale_llm prepare --as-train "$@" \
    < /dev/null &
  prep=$!
  set +m
  if [[ -n "$got" ]]; then
    kill -s "$([[ "$got" == INT ]] && echo INT || echo TERM)" -- "-$prep" 2>/dev/null || true
  fi
  wait "$prep" || status=$?
  while [[ -n "$got" ]] && kill -0 "$prep" 2>/dev/null; do  # (a signal ended `wait` early)
    status=0
    wait "$prep" || status=$?
  done
  trap - TERM HUP INT
  if [[ -n "$got" ]]; then exit $(( 128 + $(kill -l "$got") )); fi
  if [[ "$status" -ne 0 ]]; then exit "$status"; fi
}

# check_master_port [NAME]: MASTER_PORT, where set, is a TCP port (torchrun and DeepSpeed take
# any value, then stop with a traceback); NAME: the launcher the message names.
check_master_port() {
  if [[ -n "${MASTER_PORT:-}" ]] && ! [[ "$MASTER_PORT" =~ ^[1-9][0-9]{0,4}$ &&
    "$MASTER_PORT" -le 65535 ]]; then
    echo "${1:-$(basename "$0")}: MASTER_PORT='${MASTER_PORT:0:60}' is not a TCP port; set it to a" \
      "free port from 1 to 65535, the same on every node, or unset it for the default" >&2
    exit 2
  fi
}

refuse_more_ranks_than_gpus() {  # (two ranks on one GPU)
  if [[ "$visible_gpus" -gt 0 && "$NGPU" -gt "$visible_gpus" ]]; then
    echo "$(basename "$0"): NGPU=$NGPU but this node leaves $visible_gpus GPU(s) visible; set" \
      "NGPU to $visible_gpus or less, or unset it (one process per visible GPU)" >&2
    exit 2
  fi
}

require_config() {
  if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: bash $0 CONFIG.yaml [scale-llm train args...]" >&2
    exit 2
  fi
}

# refuse_node_settings WHY: for a launcher that starts the whole run from this node, a NODE_RANK
# (it would skip prepare) or NNODES left in the environment is refused.
refuse_node_settings() {
  local name
  for name in NODE_RANK NNODES; do
    if [[ -n "${!name:-}" && "${!name}" != "$([[ $name == NNODES ]] && echo 1 || echo 0)" ]]; then
      echo "$(basename "$0"): $name=${!name:0:60} is set, but $1; unset $name" >&2
      exit 2
    fi
  done
}

# check_master_addr: MASTER_ADDR, where set, is a host name or address (torchrun and DeepSpeed
# read one starting with - as an option, after the data is prepared).
check_master_addr() {
  if [[ "${MASTER_ADDR:-}" == -* || "${MASTER_ADDR:-}" =~ [[:space:]] ]]; then
    echo "$(basename "$0"): MASTER_ADDR='${MASTER_ADDR:0:60}' is not a host name or address;" \
      "set it to node 0's (e.g. node0 or 10.0.0.1)" >&2
    exit 2
  fi
}

# ----------------------------------------------------------------------------- stopping
# SIGTERM, SIGINT or SIGHUP to a launcher stops the run the way the trainer stops on SIGTERM /
# SIGINT: every rank finishes its step and saves a checkpoint. The launcher then ends with one
# line naming that checkpoint and the command that continues the run, and exit code 128 + the
# signal's number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP), the same under every
# launcher (docs/backends.md, Stopping).

# torchrun, quiet when it is signalled itself (as Slurm signals every process of a job step): it
# passes the signal on to its workers, waits for them, then raises SignalException (~25 lines of
# traceback, exit 1). Here that ends it with 128 + the signal's number instead. Workers that all
# stopped with exit 2 (a refusal: each said why in one paragraph) end it with 2, not torchrun's
# traceback and 1.
read -r -d '' TORCHRUN_QUIET <<'PY' || true
import signal, sys
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main()
except SignalException as e:
    sys.exit(128 + int(e.sigval))
except KeyboardInterrupt:  # a SIGINT before it handles signals (during its rendezvous)
    sys.exit(128 + signal.SIGINT)
except ChildFailedError as e:
    if {f.exitcode for f in e.failures.values()} != {2}:
        raise
    sys.exit(2)
PY
TORCHRUN=("$PY" -c "$TORCHRUN_QUIET")

job=""          # the process run_job started (torchrun, DeepSpeed's runner)
stop_signal=""  # the last stop signal the launcher received: TERM, INT or HUP
interrupted=""  # a signal came since the last `wait` began
pass_on=""      # the launcher's function that tells the run of a stop signal

# run_job PASS_ON CMD...: run CMD as a job of its own (a process group, so that a terminal's
# Ctrl-C reaches the launcher alone; stdin from /dev/null, as for any background job) and wait
# for it; each stop signal calls PASS_ON with the signal's name. Sets job_status to CMD's code.
run_job() {
  pass_on="$1"
  shift
  trap 'on_stop TERM' TERM
  trap 'on_stop INT' INT
  trap 'on_stop HUP' HUP  # a closed terminal: the run stops with a checkpoint
  set -m
  "$@" < /dev/null &
  job=$!
  set +m
  job_status=0
  wait "$job" || job_status=$?
  # A signal ends `wait` early (status 128 + its number): wait again, for the job's own code
  # (127: it had been collected already, and $job_status is its own).
  local again
  while [[ -n "$interrupted" ]]; do
    interrupted=""
    again=0
    wait "$job" 2>/dev/null || again=$?
    if [[ "$again" -ne 127 ]]; then job_status="$again"; fi
  done
}

on_stop() {
  stop_signal="$1"
  interrupted=1
  if [[ -z "$job" ]]; then exit $(( 128 + $(kill -l "$1") )); fi
  "$pass_on" "$1"
}

# The processes whose parent is $1 (read from /proc: no ps needed).
children_of() {
  local stat fields
  for stat in /proc/[0-9]*/stat; do
    { read -r fields < "$stat"; } 2>/dev/null || continue
    fields="${fields##*) }"  # after the command name, which may hold spaces and parentheses
    fields="${fields#* }"    # after the state: the parent's id comes first
    if [[ "${fields%% *}" == "$1" ]]; then
      stat="${stat#/proc/}"
      echo "${stat%/stat}"
    fi
  done
}

# PASS_ON for torchrun: its workers run in sessions of their own, and the signal goes to each
# worker's process group (as torchrun's own shutdown sends it), not to torchrun, which then sees
# its workers checkpoint and exit 0, and exits 0. Before it has started them (rendezvous),
# torchrun itself gets the signal. SIGHUP reaches the workers as SIGTERM (the trainer's stop).
tell_workers() {
  local sig="$1" worker told=""
  if [[ "$sig" == HUP ]]; then sig=TERM; fi
  for worker in $(children_of "$job"); do
    told=1
    kill -s "$sig" -- "-$worker" 2>/dev/null || kill -s "$sig" "$worker" 2>/dev/null || true
  done
  if [[ -z "$told" ]]; then kill -s "$sig" "$job" 2>/dev/null || true; fi
}

# The stop line: the newest complete checkpoint of the run the train arguments describe, and the
# command that continues it (argv: SIGNAL, the launcher as a shell command, the train arguments).
read -r -d '' STOP_LINE <<'PY' || true
import shlex, sys
from scale_llm.cli import config_from_args, parse_args
from scale_llm.train.guards import stop_line
signal_name, launcher, *args = sys.argv[1:]
cfg = config_from_args(parse_args(["train", *args]))
print(stop_line(signal_name, cfg.run_dir, cfg.train.max_steps, f"{launcher} {shlex.join(args)}"))
PY

# end_run TRAIN_ARGS...: after run_job, exit with the job's code; after a stop signal, when the
# job ended as a stopped run ends (0; 128 + a stop signal's number: torchrun signalled itself;
# any code with stop_any_code=1, as DeepSpeed's runner's code says nothing about its workers'),
# print the stop line (node 0 only) and exit 128 + the signal's number. How to continue:
# SCALE_LLM_CONTINUE (slurm.sbatch sets it), else this script as it was started.
end_run() {
  if [[ -z "$stop_signal" ]] \
      || ! [[ -n "${stop_any_code:-}" || "$job_status" =~ ^(0|129|130|143)$ ]]; then
    exit "$job_status"
  fi
  local launcher="${SCALE_LLM_CONTINUE:-bash $(printf '%q' "$0")}" line=""
  if [[ "${NODE_RANK:-0}" == "0" ]]; then
    line=$("$PY" -c "$STOP_LINE" "SIG$stop_signal" "$launcher" "$@" 2>/dev/null | tail -n 1) \
      || true
    if [[ "$line" != stopped* ]]; then  # (no Python answer: the line without the checkpoint)
      line="stopped by SIG$stop_signal; continue with: $launcher$(printf ' %q' "$@")"
    fi
    echo "$line" || true  # (after SIGHUP the terminal may be gone)
  fi
  exit $(( 128 + $(kill -l "$stop_signal") ))
}

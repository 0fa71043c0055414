#!/usr/bin/env bash
# The deepspeed launcher, for configs with parallel.backend: deepspeed.
#   bash launch/deepspeed.sh yaml/400m-zero3-offload.yaml [args]        # this node, NGPU processes
#   HOSTFILE=hosts bash launch/deepspeed.sh CONFIG [args]               # nodes listed in a hostfile
# A hostfile has one line per node: "node0 slots=8". MASTER_ADDR / MASTER_PORT are optional.
# With HOSTFILE, run it once, on one node: DeepSpeed starts every node's processes over
# passwordless ssh (pdsh), in this directory and with this Python, so the paths must be the same
# on every node. SIGTERM / SIGINT to this script reach every process of the run, which saves a
# checkpoint and stops; the script then prints where it is and how to continue, and exits 128 +
# the signal's number (143 / 130), as every launcher does.
set -euo pipefail
user_ds_accelerator="${DS_ACCELERATOR:-}"  # (_env.sh sets it on this machine when it has no GPU)
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
require_config "$@"

# On one node, the GPUs CUDA_VISIBLE_DEVICES leaves, by index: given --num_gpus N, DeepSpeed's
# runner drops CUDA_VISIBLE_DEVICES and takes GPUs 0..N-1, whoever they belong to. With
# --include it checks the indices against all the GPUs (so CUDA_VISIBLE_DEVICES is unset for it)
# and hands each worker its own.
visible_include() {
  local id
  for id in "${visible_ids[@]}"; do
    if ! [[ "$id" =~ ^[0-9]+$ ]]; then
      echo "deepspeed.sh: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: DeepSpeed's launcher takes" \
        "GPU indices, not '$id'; list the GPUs by index (the numbers 'nvidia-smi -L' shows)" >&2
      exit 2
    fi
  done
  if [[ "$NGPU" -gt "${#visible_ids[@]}" ]]; then
    echo "deepspeed.sh: NGPU=$NGPU but CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES leaves" \
      "${#visible_ids[@]} GPU(s); set NGPU to ${#visible_ids[@]} or less, or unset it" >&2
    exit 2
  fi
  local IFS=,
  echo "localhost:${visible_ids[*]:0:NGPU}"
}

# pdsh starts the other nodes' processes with ssh's bare environment: DeepSpeed's runner passes on
# only variables named NCCL*, PYTHON*, UCX*, MLFLOW* and MV2*, plus those in the file DS_ENV_FILE
# names (else ~/.deepspeed_env and ./.deepspeed_env), which it reads on this node and turns into
# exports on the pdsh command line. It gets one file: what this launcher set and the SCALE_LLM_*
# settings, then the user's own file's lines (the last line for a name wins; ./.deepspeed_env
# only when DS_ENV_FILE names it: a folder one runs in may be someone else's). The runner writes
# each as `export NAME="VALUE";` into a shell command run on every node: a line that would run
# there as code (a name that is not a variable name; in a value, a $ other than $VAR or ${VAR},
# a `, ", \ or a control character) stops it.
write_env_file() {
  local var line own name="${DS_ENV_FILE:-.deepspeed_env}"
  local owns=("$HOME/$name" "./$name")
  if [[ "$name" == /* ]]; then owns=("$name"); fi
  for var in PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF; do  # (the one set, or both)
    if [[ -n "${!var+set}" ]]; then env_line "the environment" "$var=${!var}" || exit 2; fi
  done
  env_line "the environment" "OMP_NUM_THREADS=$OMP_NUM_THREADS" || exit 2
  # the runner puts its working folder first on the other nodes' PYTHONPATH (a module there would
  # be imported): they get this launcher's own instead (its checkout, or none)
  env_line "the environment" "PYTHONPATH=${PYTHONPATH:-}" || exit 2
  if [[ -n "$user_ds_accelerator" ]]; then
    env_line "the environment" "DS_ACCELERATOR=$user_ds_accelerator" || exit 2
  fi
  while read -r var; do
    if [[ "$var" == SCALE_LLM_* ]]; then env_line "the environment" "$var=${!var}" || exit 2; fi
  done < <(compgen -e)
  for own in "${owns[@]}"; do
    if [[ -f "$own" && "$own" == ./* && -z "${DS_ENV_FILE:-}" && ! "$own" -ef "$HOME/$name" ]]; then
      echo "deepspeed.sh: $PWD/$name would set every node's environment, where a variable" \
        "such as LD_PRELOAD or PYTHONPATH loads code; a file in the working folder is read only" \
        "when named: DS_ENV_FILE=$name (this folder's and ~/$name)" >&2
      exit 2
    fi
    if [[ -f "$own" ]]; then
      while IFS= read -r line || [[ -n "$line" ]]; do
        if [[ -n "${line//[[:space:]]/}" ]]; then env_line "$own" "$line" || exit 2; fi
      done < "$own"
    fi
  done
}

env_line() {  # print NAME=VALUE if the runner's shell command takes it as data
  local line="${2%$'\r'}" ref='\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)'
  local name="${line%%=*}" rest="${line#*=}"
  name="${name#"${name%%[![:space:]]*}"}"
  name="${name%"${name##*[![:space:]]}"}"
  while [[ "$rest" =~ $ref ]]; do rest="${rest/"${BASH_REMATCH[0]}"/}"; done  # $VAR, ${VAR}: fine
  # (the runner reads lines as Python does: a carriage return ends one too, as a newline does)
  if [[ "$line" == *=* && "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ && "$rest" != *[\$\`\"\\]* &&
    "$line" != *[[:cntrl:]]* ]]
  then
    printf '%s\n' "$line"
    return 0
  fi
  echo "deepspeed.sh: $1 sets ${name:0:60}: DeepSpeed's multi-node runner puts each NAME=VALUE" \
    "into a shell command it runs on every node, where this line would run as code: a NAME" \
    "must be a variable name, and a VALUE may name variables (\$NAME, \${NAME}) but hold no" \
    "other \$, no \`, \", \\ or control character. Fix it, or set it in each node's environment" \
    "$([[ "$1" == "the environment" ]] && echo "(and unset it here: the runner passes it on)")" >&2
  return 1
}

# The runner also joins the train arguments into that command, in "..." only those holding a
# space (where $, ` and \ still act), and cds to this folder (its real path) and names
# MASTER_ADDR unquoted; pdsh then replaces %h, %n, ... anywhere in it: each must arrive as
# written. Its own exports of NCCL*, PYTHON*, UCX*, MLFLOW* and MV2* follow env_line's rule.
check_node_command() {
  local arg var plain="[\$\`\\\"';&|<>(){}*?#%[:cntrl:]]" quoted='[$`\\%[:cntrl:]]'
  local folder='[^A-Za-z0-9_./@+,:=-]' here
  here="$(pwd -P)"
  for arg in "$@"; do
    if [[ -z "$arg" || ( "$arg" == *" "* && "$arg" =~ $quoted ) ||
      ( "$arg" != *" "* && "$arg" =~ $plain ) ]]
    then
      echo "deepspeed.sh: with HOSTFILE, DeepSpeed's runner hands the train arguments to every" \
        "node inside a shell command, where '${arg:0:60}' would not arrive as written (an empty" \
        "one vanishes; \$, \`, \\ and % act there, and without a space quotes and" \
        ";&|<>(){}*?#): set it in the YAML config" >&2
      exit 2
    fi
  done
  if [[ "$here" =~ $folder ]]; then
    echo "deepspeed.sh: with HOSTFILE, DeepSpeed's runner starts every node with an unquoted" \
      "'cd $here;', which that folder's name would break or extend: run from a folder whose" \
      "path holds only letters, digits and _./@+,:=-" >&2
    exit 2
  fi
  local node_py  # (the runner's sys.executable: a bare name is found on PATH)
  node_py="$("$PY" -c 'import sys; print(sys.executable)' 2>/dev/null | tail -n 1)" || true
  node_py="${node_py:-$PY}"
  if [[ "$node_py" =~ $folder ]]; then
    echo "deepspeed.sh: with HOSTFILE, DeepSpeed's runner starts every node's processes with" \
      "this Python's path unquoted ($node_py), which its name would break or extend: use a" \
      "Python (venv) whose path holds only letters, digits and _./@+,:=-" >&2
    exit 2
  fi
  if [[ -n "${MASTER_ADDR:-}" && ! "$MASTER_ADDR" =~ ^[A-Za-z0-9_:][A-Za-z0-9._:-]*$ ]]; then
    echo "deepspeed.sh: MASTER_ADDR='${MASTER_ADDR:0:60}' is not a host name or address, and" \
      "DeepSpeed's runner puts it unquoted into the command every node runs: give the first" \
      "node's host name or IP address" >&2
    exit 2
  fi
  while read -r var; do
    if [[ "$var" =~ ^(NCCL|PYTHON|UCX|MLFLOW|MV2) ]]; then
      env_line "the environment" "$var=${!var}" > /dev/null || exit 2
    fi
  done < <(compgen -e)
}

# The hostfile as DeepSpeed's runner reads it (lines split at \n, \r\n or \r; "#" lines and blank
# ones skipped; each other line "HOST slots=N ...", each host once), checked before prepare: a
# line it cannot read was a traceback after prepare's work, and each host name goes to ssh and
# pdsh, where one starting with "-" is an option (ssh's -oProxyCommand=... runs a command here).
check_hostfile() {
  local line number=0 host slots hosts=" " blank='[[:blank:]]' lines
  # HOST: [USER@]NAME, NAME not starting with "-" (an option to ssh) nor a pdsh module's "ssh:"
  local entry="^$blank*(([A-Za-z0-9_][A-Za-z0-9._-]*@)?[A-Za-z0-9_:][A-Za-z0-9._:%-]*)"
  entry+="$blank+slots=([0-9]+)"
  if [[ "$(tr -d '\000' < "$HOSTFILE" | wc -c)" != "$(wc -c < "$HOSTFILE")" ]] ||
    ! "$PY" -c 'import sys  # the hostfile as UTF-8, as the runner opens it
open(sys.argv[1], encoding="utf-8").read()' "$HOSTFILE" 2>/dev/null
  then
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE is not UTF-8 text (a NUL byte, or bytes DeepSpeed's" \
      "runner cannot decode); write it as plain text, one 'HOST slots=N' line per node" >&2
    exit 2
  fi
  if ! lines="$(sed 's/\r$//' < "$HOSTFILE" | tr '\r' '\n')"; then
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE could not be read; check the file and its disk" >&2
    exit 2
  fi
  while IFS= read -r line || [[ -n "$line" ]]; do
    number=$((number + 1))
    if [[ "${line//$'\t'/}" != *[[:cntrl:]]* && ( -z "${line//[[:blank:]]/}" ||
      "${line#"${line%%[![:blank:]]*}"}" == "#"* ) ]]
    then
      continue
    fi
    host=""
    if [[ "${line//$'\t'/}" != *[[:cntrl:]]* && "$line" =~ $entry ]]; then
      host="${BASH_REMATCH[1]}" slots="${BASH_REMATCH[3]}"
      slots="${slots#"${slots%%[!0]*}"}"  # (leading zeros: the runner reads a number)
      if [[ -z "$slots" || ${#slots} -gt 6 || "$hosts" == *" $host "* ||
        "${host,,}" =~ (^|@)(exec|ssh|rsh|mrsh|krb4|qsh|mqsh|xcpu|rcmd): ]]
      then
        host=""
      fi
    fi
    if [[ -z "$host" ]]; then
      line="${line//[[:cntrl:]]/?}"
      echo "deepspeed.sh: HOSTFILE=$HOSTFILE line $number ('${line:0:60}'): DeepSpeed's runner" \
        "reads each line as 'HOST slots=N' (a host name or address of letters, digits and" \
        "._:%-, not starting with '-', after an optional USER@; N processes, 1 to 999999)," \
        "each host once, and skips blank lines and those starting with #: fix that line" >&2
      exit 2
    fi
    hosts+="$host "
  done <<< "$lines"
  if [[ "$hosts" == " " ]]; then
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE lists no node; write one line per node, e.g." \
      "\"node0 slots=8\", or unset HOSTFILE for a one-node run" >&2
    exit 2
  fi
  local listed
  read -ra listed <<< "$hosts"
  if [[ ${#listed[@]} -gt 1 ]] && ! command -v pdsh >/dev/null 2>&1; then  # (its default)
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE lists ${#listed[@]} nodes, which DeepSpeed's runner" \
      "starts with pdsh, not installed on this node; install it (e.g. apt install pdsh), or" \
      "start each node with launch/torchrun.sh (NNODES, NODE_RANK, MASTER_ADDR)" >&2
    exit 2
  fi
}

# DS_ACCELERATOR, against the names this DeepSpeed takes (read from its source, without importing
# it): another name was a traceback from the runner, after prepare.
read -r -d '' ACCELERATORS <<'PY' || true
import ast, os
from importlib.util import find_spec
spec = find_spec("deepspeed")
path = os.path.join(os.path.dirname(spec.origin), "accelerator", "real_accelerator.py")
with open(path) as f:
    for node in ast.parse(f.read()).body:
        if isinstance(node, ast.Assign) and "SUPPORTED_ACCELERATOR_LIST" in ast.unparse(node.targets[0]):
            print(*ast.literal_eval(node.value))
PY
check_accelerator() {
  local known
  if [[ -z "${DS_ACCELERATOR:-}" ]]; then return; fi
  known="$("$PY" -c "$ACCELERATORS" 2>/dev/null | tail -n 1)" || true
  if [[ -n "$known" && " $known " != *" $DS_ACCELERATOR "* ]]; then
    echo "deepspeed.sh: DS_ACCELERATOR=${DS_ACCELERATOR:0:60} is not one of DeepSpeed's" \
      "accelerators (${known// /, }): set one of them (cpu on a machine without a GPU), or unset it" \
      "and DeepSpeed picks the machine's" >&2
    exit 2
  fi
}

# A port nothing listens on, for a one-node run without MASTER_PORT (DeepSpeed's default, 29500,
# is every run's: a second run on the node failed to start), as torchrun --standalone picks one.
free_port() {
  local port
  port=$("$PY" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' 2>/dev/null | tail -n 1)
  if [[ "$port" =~ ^[0-9]+$ ]]; then echo "$port"; fi
}

# DeepSpeed compiles some C++ ops the first time a process needs them, into torch's extension
# cache, and the run is silent meanwhile: on the CPU its shared-memory collectives
# (deepspeed_shm_comm) at every start, and CPUAdam (cpu_adam) for an optimizer offload. Each took
# about 3 minutes on 2 CPU cores (2026-12-03, DeepSpeed 0.19.8). Prints "OPS... CACHE_DIR" for
# the ops this run needs that are not built for this Python yet (nothing for a config train will
# refuse). A cached op counts as built when torch would reuse it: its build.ninja (which torch
# writes again and ninja compares) names this torch's and this Python's headers and this
# DeepSpeed's sources, and its library is newer than those; another venv's or checkout's build
# of the same op, in the same cache, is built again.
read -r -d '' UNBUILT_OPS <<'PY' || true
import os, sys, sysconfig  # which torch_extensions this run still has to build
from importlib.util import find_spec
import torch
from torch.utils.cpp_extension import get_default_build_root, include_paths
from scale_llm.cli import config_from_args, parse_args
cfg = config_from_args(parse_args(["train", *sys.argv[1:]]))
ops = ["deepspeed_shm_comm"] if os.environ.get("DS_ACCELERATOR") == "cpu" else []
if cfg.parallel.deepspeed.offload_optimizer != "none":
    ops.append("cpu_adam")
root = os.environ.get("TORCH_EXTENSIONS_DIR")
if not root:  # torch's own choice (torch.utils.cpp_extension._get_build_directory)
    cuda = torch.version.cuda
    device = "cu" + cuda.replace(".", "") if cuda else "cpu"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    root = os.path.join(get_default_build_root(), f"{tag}_{device}")
spec = find_spec("deepspeed")
deepspeed_dir = os.path.dirname(spec.origin) + os.sep if spec and spec.origin else None
headers = [include_paths()[0], sysconfig.get_paths()["include"]]
def built(op):
    try:
        with open(os.path.join(root, op, "build.ninja")) as f:
            lines = [line.split() for line in f]
        made = os.path.getmtime(os.path.join(root, op, op + ".so"))
    except (OSError, UnicodeDecodeError):
        return False
    words = [w for line in lines for w in line]
    sources = [w[3] for w in lines if len(w) > 3 and w[0] == "build" and w[2] == "compile"]
    inputs = [*sources, os.path.join(headers[0], "torch", "extension.h")]
    return (
        all(h in words for h in headers)
        and bool(sources)
        and all(s.startswith(deepspeed_dir) for s in sources)
        and all(os.path.isfile(s) and os.path.getmtime(s) <= made for s in inputs)
    )
todo = [op for op in ops if deepspeed_dir and not built(op)]
if todo:
    print(*todo, root)
PY
unbuilt_ops() {
  "$PY" -c "$UNBUILT_OPS" "$@" 2>/dev/null | tail -n 1 || true
}

announce_op_builds() {
  local words
  read -ra words <<< "$(unbuilt_ops "$@")"
  if [[ ${#words[@]} -lt 2 ]]; then return; fi
  local cache="${words[-1]}" ops="${words[*]:0:${#words[@]}-1}"
  echo "deepspeed.sh: DeepSpeed builds its C++ op(s) ${ops// /, } on first use, into $cache:" \
    "about 3 minutes each on 2 CPU cores, while the run prints nothing (once for this venv;" \
    "a build there by another venv or checkout is replaced: TORCH_EXTENSIONS_DIR gives each" \
    "its own cache)" >&2
}

launcher=("$PY" -m deepspeed.launcher.runner --no_local_rank)
env_file=""
include=""
if [[ -n "${HOSTFILE:-}" ]]; then
  if [[ ! -f "$HOSTFILE" ]]; then
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE is not a file (DeepSpeed would quietly run on this" \
      "node alone); point HOSTFILE at a file with one line per node, e.g. \"node0 slots=8\"," \
      "or unset it for a one-node run" >&2
    exit 2
  fi
  if [[ ! -r "$HOSTFILE" ]]; then
    echo "deepspeed.sh: HOSTFILE=$HOSTFILE cannot be read by this user; make it readable" \
      "(chmod u+r), or point HOSTFILE at a copy" >&2
    exit 2
  fi
  if [[ -n "$user_ngpu" ]]; then
    echo "deepspeed.sh: NGPU=$user_ngpu is set, but with HOSTFILE each line's slots=N decide" \
      "the processes of that node; set the slots in $HOSTFILE and unset NGPU" >&2
    exit 2
  fi
  check_hostfile
  check_node_command "$@"
  launcher+=(--hostfile="$HOSTFILE")  # (one form: a name starting with - is no option)
  [[ -n "${MASTER_ADDR:-}" ]] && launcher+=(--master_addr "$MASTER_ADDR")
  if ! env_file="$(mktemp "${TMPDIR:-/tmp}/scale_llm-deepspeed_env.XXXXXX" 2>/dev/null)"; then
    echo "deepspeed.sh: cannot write the other nodes' environment file into" \
      "TMPDIR=${TMPDIR:-/tmp} (not a folder this user can write): set TMPDIR to one, or unset" \
      "it for /tmp" >&2
    exit 2
  fi
  [[ "$env_file" == /* ]] || env_file="$PWD/$env_file"
  trap 'rm -f "$env_file"' EXIT
  write_env_file > "$env_file"
elif [[ ${#visible_ids[@]} -gt 0 ]]; then
  include="$(visible_include)"
  launcher+=(--include "$include")
elif [[ "$gpus" -gt 0 && "$visible_gpus" -eq 0 ]]; then
  echo "deepspeed.sh: CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU, but" \
    "DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES for its workers itself, so they would see" \
    "the GPUs again; list the GPUs to use by index, or run on the CPU with launch/torchrun.sh" >&2
  exit 2
else
  refuse_more_ranks_than_gpus
  launcher+=(--num_gpus "$NGPU")
fi
if [[ -z "${HOSTFILE:-}" ]]; then
  # one node, whatever DeepSpeed's default hostfile (/job/hostfile) lists: it would start other
  # machines over ssh, with the working folder's .deepspeed_env (not a file (/dev/null): none)
  launcher+=(--hostfile /dev/null)
fi
check_master_port
check_master_addr
check_accelerator
refuse_node_settings "deepspeed.sh starts every node from this one, as HOSTFILE lists them"
if [[ -n "${MASTER_PORT:-}" ]]; then
  launcher+=(--master_port "$MASTER_PORT")
elif [[ -z "${HOSTFILE:-}" ]]; then
  port="$(free_port)"
  if [[ -n "$port" ]]; then launcher+=(--master_port "$port"); fi
fi
if [[ -z "${HOSTFILE:-}" ]]; then launch_world="$NGPU"; fi  # (a hostfile's: DeepSpeed counts)
run_prepare "$@"
announce_op_builds "$@"

# Not exec: on one node DeepSpeed's runner passes no signal on, so a SIGTERM to it would end the
# runner and leave the workers training. The runner runs as a job of its own (run_job), and a stop
# signal to this script goes to that whole process group as SIGTERM: every worker gets it (the
# trainer checkpoints and stops), as under torchrun; DeepSpeed's `launch` and, on several nodes,
# the runner's own handler (which stops the other nodes' processes) stop on it too, where a
# SIGINT would end the one-node runner with a KeyboardInterrupt traceback.
tell_group() {
  kill -s TERM -- "-$job" 2>/dev/null || true
}
# Whether a process of the runner's group still runs (exited ones wait, as zombies, for whoever
# adopted them to collect them; without ps, they count as running).
group_running() {
  if command -v ps >/dev/null 2>&1; then
    ps -e -o pgid= -o stat= | awk -v group="$job" '$1 == group && $2 !~ /^Z/ { found = 1 }
      END { exit !found }'
  else
    kill -0 -- "-$job" 2>/dev/null
  fi
}
if [[ -n "$env_file" ]]; then export DS_ENV_FILE="$env_file"; fi
if [[ -n "$include" ]]; then unset CUDA_VISIBLE_DEVICES; fi
stop_any_code=1  # (after a stop signal the runner's code says nothing about the workers')
run_job tell_group "${launcher[@]}" --module scale_llm train "$@"
if [[ -n "$stop_signal" ]]; then  # the workers may outlive the runner while they checkpoint
  # (at most 2 minutes: DeepSpeed's launch kills its workers 30 s after the signal, and without
  # ps an unreaped worker would count as running for ever)
  for (( tick = 0; tick < 600; tick++ )); do group_running || break; sleep 0.2; done
fi
end_run "$@"  # the runner's code; after a stop signal, the stop line and 128 + its number

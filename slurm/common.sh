# shellcheck shell=bash
# Shared by every job script in slurm/: cluster profile, defaults, checks, and a launcher that
# checkpoints and requeues the job when Slurm asks it to stop. Sourced, never run by itself.
#
# Everything a job reads is an environment variable with a default, so the same script runs on
# Alps, on another cluster and on a CPU-only test cluster. Set them on the command line:
#
#   COURSE_CLUSTER=alps COURSE_EPOCHS=5 sbatch --account=<project> slurm/ddp_1node.sbatch
#
# COURSE_CLUSTER     cluster profile, slurm/clusters/<name>.sh            [generic]
# COURSE_DATASET     digits | cifar10 | synthetic                          [cifar10]
# COURSE_DATA_DIR    where cifar10 was downloaded (on the login node)      [$SCRATCH/course-data]
# COURSE_MODEL       digits_cnn | cifar_cnn | resnet18                     [resnet18]
# COURSE_EPOCHS, COURSE_GLOBAL_BATCH, COURSE_LR                            [10, 512, 0.003]
# COURSE_RESULTS     metrics (one JSON line per epoch), checkpoints       [results/slurm]
# COURSE_RUN_NAME    names the metrics file and checkpoint folder        [<job name>-<job id>]
# COURSE_EXTRA_ARGS  more flags for python -m course_lib.train             []
# COURSE_PYTHON      the Python to use                                     [.venv/bin/python, else python3]
# COURSE_MAX_REQUEUES  give up after this many requeues                    [3]
# COURSE_PREFLIGHT   1: the all-reduce check before training, 0: skip it  [1 on several nodes]
# COURSE_NCCL_PLUGIN_FROM, COURSE_EDF  where NCCL's network plugin comes from (see clusters/alps.sh)
#
# Before any GPU time is spent the job checks, and stops with one line naming the fix: the
# profile, the account, that every process gets a GPU of its own, that NCCL's network plugin is
# where the profile says, and the training flags (course_lib.train --dry-run); on several nodes,
# a tiny all-reduce on every rank then proves the network (course_lib.tools.jobcheck preflight).
set -euo pipefail

fail() {  # one clear line in the job's output file, a non-zero exit, before any GPU time is spent
  echo "error: $*" >&2
  exit 2
}

COURSE_ROOT=${COURSE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[ -f "$COURSE_ROOT/course_lib/train/cli.py" ] \
  || fail "$COURSE_ROOT is not the course repository: submit from its root (cd <repo> && sbatch slurm/...) or set COURSE_ROOT"

COURSE_CLUSTER=${COURSE_CLUSTER:-generic}
profile="$COURSE_ROOT/slurm/clusters/$COURSE_CLUSTER.sh"
if [ ! -f "$profile" ]; then
  known=$(cd "$COURSE_ROOT/slurm/clusters" && ls -- *.sh | sed 's/\.sh$//' | tr '\n' ' ')
  fail "cluster profile '$COURSE_CLUSTER' does not exist: set COURSE_CLUSTER to one of: $known(or add slurm/clusters/$COURSE_CLUSTER.sh)"
fi
# shellcheck source=/dev/null
source "$profile"

if [ "${COURSE_NEEDS_ACCOUNT:-0}" = 1 ] && { [ -z "${SLURM_JOB_ACCOUNT:-}" ] || [ "${SLURM_JOB_ACCOUNT}" = "(null)" ]; }; then
  fail "cluster $COURSE_CLUSTER charges every job to a project: submit with sbatch --account=<project> (or export SBATCH_ACCOUNT=<project>)"
fi

COURSE_DATASET=${COURSE_DATASET:-cifar10}
COURSE_DATA_DIR=${COURSE_DATA_DIR:-${SCRATCH:-$HOME}/course-data}
COURSE_MODEL=${COURSE_MODEL:-resnet18}
COURSE_EPOCHS=${COURSE_EPOCHS:-10}
COURSE_GLOBAL_BATCH=${COURSE_GLOBAL_BATCH:-512}
COURSE_LR=${COURSE_LR:-0.003}
COURSE_RESULTS=${COURSE_RESULTS:-$COURSE_ROOT/results/slurm}
COURSE_RUN_NAME=${COURSE_RUN_NAME:-${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-0}}
COURSE_EXTRA_ARGS=${COURSE_EXTRA_ARGS:-}
COURSE_MAX_REQUEUES=${COURSE_MAX_REQUEUES:-3}
# Every job step runs through COURSE_SRUN: in the container of COURSE_EDF when the plugin comes
# from the container engine (CSCS's --environment), else on the nodes themselves.
COURSE_SRUN=(srun)
COURSE_HERE=()  # how the batch shell runs one Python that needs torch (in the container, if any)
if [ "${COURSE_NCCL_PLUGIN_FROM:-none}" = container ]; then
  COURSE_SRUN=(srun --environment="${COURSE_EDF:-}")
  COURSE_HERE=(srun --nodes=1 --ntasks=1 --environment="${COURSE_EDF:-}")
  COURSE_PYTHON=${COURSE_PYTHON:-python}
fi
if [ -z "${COURSE_PYTHON:-}" ]; then
  if [ -x "$COURSE_ROOT/.venv/bin/python" ]; then COURSE_PYTHON=$COURSE_ROOT/.venv/bin/python; else COURSE_PYTHON=python3; fi
fi
export PYTHONPATH="$COURSE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$COURSE_RESULTS"

# The flags every job passes to the training command (after its own --sharding).
# shellcheck disable=SC2206
COURSE_TRAIN_ARGS=(--dataset "$COURSE_DATASET" --data-dir "$COURSE_DATA_DIR" --model "$COURSE_MODEL"
  --epochs "$COURSE_EPOCHS" --global-batch-size "$COURSE_GLOBAL_BATCH" --lr "$COURSE_LR"
  --metrics "$COURSE_RESULTS/$COURSE_RUN_NAME.jsonl" --checkpoint-dir "$COURSE_RESULTS/ckpt/$COURSE_RUN_NAME"
  --resume latest --no-progress $COURSE_EXTRA_ARGS)

echo "job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) on ${SLURM_JOB_NODELIST:-?}, restart ${SLURM_RESTART_COUNT:-0}," \
     "cluster profile $COURSE_CLUSTER, results in $COURSE_RESULTS/$COURSE_RUN_NAME.jsonl"

course_refuse() {  # the check above printed its one "error: <what to change>" line: record it and stop
  echo 2 >"$COURSE_RESULTS/$COURSE_RUN_NAME.status"
  echo "$1 (exit status 2)"
  exit 2
}

course_check_resources() {  # GPUs, network plugin, CPU threads: every mistake found now, exit 2
  # COURSE_PROCS_PER_TASK: processes each Slurm task starts (1 under srun; torchrun's workers).
  local per_task=${COURSE_PROCS_PER_TASK:-1} needs_gpus=()
  [ "${COURSE_NEEDS_GPUS:-0}" = 1 ] && needs_gpus=(--needs-gpus)
  # The checks that need no torch run on the batch node's Python, even for a container job.
  local checker=python3
  [ -x "$COURSE_PYTHON" ] && checker=$COURSE_PYTHON
  "$checker" -m course_lib.tools.jobcheck gpus --processes-per-task "$per_task" "${needs_gpus[@]}" \
    || course_refuse "job stopped by the GPU check above: nothing was started"
  "$checker" -m course_lib.tools.jobcheck plugin || course_refuse "job stopped by the plugin check above: nothing was started"
  # Threads per process = the cores the process was given: a task's cores shared by its processes.
  local cores=${SLURM_CPUS_PER_TASK:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / per_task > 0 ? cores / per_task : 1 ))}
  echo "CPU threads per process: OMP_NUM_THREADS=$OMP_NUM_THREADS ($cores core(s) a task, $per_task process(es) a task)"
}

course_check() {  # course_check NPROCS --sharding ...: every mistake found now, in one line, exit 2
  local nprocs=$1
  shift
  course_check_resources
  WORLD_SIZE=$nprocs RANK=0 LOCAL_RANK=0 MASTER_ADDR=localhost MASTER_PORT=1 "${COURSE_HERE[@]}" "$COURSE_PYTHON" -m course_lib.train "$@" "${COURSE_TRAIN_ARGS[@]}" --dry-run \
    || course_refuse "job stopped by the configuration check above: nothing was started"
}

course_preflight() {  # course_preflight LAUNCHER...: one all-reduce on every rank before training
  if [ "${COURSE_PREFLIGHT:-$([ "${SLURM_NNODES:-1}" -gt 1 ] && echo 1 || echo 0)}" != 1 ]; then
    return 0
  fi
  # A port of its own: the training's rendezvous comes right after, on the job's usual port
  # (12000 + id % 8000, course_lib/distributed/environment.py). Both stay below the kernel's ephemeral range
  # (32768 and up), where any program's outgoing connection may be holding the port.
  MASTER_PORT=$(( 20000 + ${SLURM_JOB_ID:-0} % 8000 )) "$@" -m course_lib.tools.jobcheck preflight \
    || course_refuse "job stopped by the preflight above: nothing was trained"
}

course_run() {  # course_run LAUNCHER... : run training, forward a stop request, requeue on preemption
  local status=0 pid
  stop_requested=0
  # Slurm signals the batch shell (--signal=B:USR1@...); the training processes are what must
  # hear it: pass it on to every step of the job (not to this shell).
  trap 'stop_requested=1; echo "stop requested: asking training to checkpoint and stop"; scancel --signal="${COURSE_STOP_SIGNAL:-USR1}" "$SLURM_JOB_ID"' USR1 TERM
  "$@" "${COURSE_TRAIN_ARGS[@]}" &
  pid=$!
  while :; do  # a trapped signal interrupts wait: wait again until training really ended
    status=0
    wait "$pid" || status=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - USR1 TERM
  echo "training exited with status $status"
  if [ "$status" = 3 ] || { [ "$stop_requested" = 1 ] && [ "$status" != 0 ]; }; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$COURSE_MAX_REQUEUES" ]; then
      echo "error: stopped again after $COURSE_MAX_REQUEUES requeues; giving up (raise COURSE_MAX_REQUEUES or --time)" >&2
      exit 1
    fi
    echo "requeueing job $SLURM_JOB_ID: it will resume from the newest checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  if [ "$status" = 4 ]; then  # the loss became NaN: a requeue would replay the same steps and diverge again
    echo "error: training diverged (exit status 4, its line is above): not requeued; change the run and resume" >&2
  fi
  echo "$status" >"$COURSE_RESULTS/$COURSE_RUN_NAME.status"
  exit "$status"
}

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
set -euo pipefail

fail() {  # one clear line in the job's output file, a non-zero exit, before any GPU time is spent
  echo "error: $*" >&2
  exit 2
}

COURSE_ROOT=${COURSE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[ -f "$COURSE_ROOT/course_lib/train.py" ] \
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
if [ -z "${COURSE_PYTHON:-}" ]; then
  if [ -x "$COURSE_ROOT/.venv/bin/python" ]; then COURSE_PYTHON=$COURSE_ROOT/.venv/bin/python; else COURSE_PYTHON=python3; fi
fi
# One CPU thread per core the task was given (a profile may choose otherwise).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export PYTHONPATH="$COURSE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$COURSE_RESULTS"

# The flags every job passes to the training command (after its own --strategy).
# shellcheck disable=SC2206
COURSE_TRAIN_ARGS=(--dataset "$COURSE_DATASET" --data-dir "$COURSE_DATA_DIR" --model "$COURSE_MODEL"
  --epochs "$COURSE_EPOCHS" --global-batch-size "$COURSE_GLOBAL_BATCH" --lr "$COURSE_LR"
  --metrics "$COURSE_RESULTS/$COURSE_RUN_NAME.jsonl" --checkpoint-dir "$COURSE_RESULTS/ckpt/$COURSE_RUN_NAME"
  --resume latest --no-progress $COURSE_EXTRA_ARGS)

echo "job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) on ${SLURM_JOB_NODELIST:-?}, restart ${SLURM_RESTART_COUNT:-0}," \
     "cluster profile $COURSE_CLUSTER, results in $COURSE_RESULTS/$COURSE_RUN_NAME.jsonl"

course_check() {  # course_check NPROCS --strategy ...: every mistake found now, in one line, exit 2
  local nprocs=$1; shift
  WORLD_SIZE=$nprocs RANK=0 LOCAL_RANK=0 MASTER_ADDR=localhost MASTER_PORT=1 "$COURSE_PYTHON" -m course_lib.train "$@" "${COURSE_TRAIN_ARGS[@]}" --dry-run \
    || { echo 2 >"$COURSE_RESULTS/$COURSE_RUN_NAME.status"; fail "the configuration above was refused; nothing was started"; }
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

# shellcheck shell=bash
# CSCS Alps (GH200 nodes: 4 GPUs, 288 Arm cores, Slingshot 11 network with one 25 GB/s NIC per GPU).
# Every job is charged to a project: submit with sbatch --account=<project>.
#
# NCCL reaches Slingshot only through the aws-ofi-nccl (libfabric) plugin, which a pip virtual
# environment does not have. Two supported ways to get it (COURSE_NCCL_PLUGIN_FROM):
#   uenv       a CSCS uenv whose view carries it: sbatch --uenv=prgenv-gnu/<version> --view=default ...
#              (the job checks that libnccl-net.so is on LD_LIBRARY_PATH before it starts)
#   container  the container engine with its aws_ofi_nccl hook: COURSE_EDF=<file.toml>, an EDF file
#              like slurm/clusters/alps-container.toml; every srun then runs in that container
# The variables below are those of CSCS's NCCL page, https://docs.cscs.ch/software/communication/nccl/
# (the container hook sets the same ones); check that page when NCCL or libfabric change.
COURSE_NEEDS_ACCOUNT=1
COURSE_NEEDS_GPUS=1
COURSE_LINK_GBPS=${COURSE_LINK_GBPS:-25}  # one Slingshot NIC per GPU: 200 Gb/s
export COURSE_NCCL_PLUGIN_FROM=${COURSE_NCCL_PLUGIN_FROM:-uenv}
# One line each on why; the page above gives the measurements behind them.
# #region nccl-variables
export NCCL_NET="AWS Libfabric"       # the plugin, or fail at start-up: never fall back to TCP
export NCCL_NET_GDR_LEVEL=PHB         # GPUDirect RDMA: each GH200's GPU and NIC share a NUMA node
export NCCL_CROSS_NIC=1               # rings and trees may leave and enter by different NICs
export NCCL_PROTO=^LL128              # LL128 (on since NCCL 2.27) corrupted data over Slingshot
export NCCL_NCHANNELS_PER_NET_PEER=4  # faster send/recv (pipelines), collectives unharmed
export FI_CXI_DEFAULT_CQ_SIZE=131072  # libfabric's CXI queues: CSCS's best across applications
export FI_CXI_DEFAULT_TX_SIZE=16384   # the most libfabric accepts; above, it falls back to 1024
export FI_CXI_DISABLE_HOST_REGISTER=1 # NCCL registers its own buffers
export FI_CXI_RX_MATCH_MODE=software  # match messages in software: no hardware-list overflow
export FI_MR_CACHE_MONITOR=userfaultfd # watch freed memory without hooking malloc
export MPICH_GPU_SUPPORT_ENABLED=0    # GPU-aware MPI beside NCCL can deadlock; none is used here
# #endregion nccl-variables
# If NCCL hangs or its watchdog times out (CSCS's page lists this as still under investigation),
# disable Slingshot's eager messages: COURSE_NCCL_NO_EAGER=1 sbatch ...
if [ "${COURSE_NCCL_NO_EAGER:-0}" = 1 ]; then
  export FI_CXI_RDZV_GET_MIN=0 FI_CXI_RDZV_THRESHOLD=0 FI_CXI_RDZV_EAGER_SIZE=0
fi

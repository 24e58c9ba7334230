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
# Use the plugin, and fail at start-up if it is missing instead of falling back to TCP sockets.
export NCCL_NET="AWS Libfabric"
# GPUDirect RDMA when the GPU and the NIC share a NUMA node (each GH200 module has its own NIC).
export NCCL_NET_GDR_LEVEL=PHB
# Let rings and trees use different NICs on each side (Slingshot's NICs are all on one fabric).
export NCCL_CROSS_NIC=1
# LL128, on by default since NCCL 2.27 (torch 2.14 ships 2.27+), corrupted data over Slingshot.
export NCCL_PROTO=^LL128
# More channels per peer speeds up send/recv (pipeline parallelism) without slowing collectives.
export NCCL_NCHANNELS_PER_NET_PEER=4
# libfabric's CXI provider: queue sizes CSCS measured best across applications. 16384 is the
# largest transmit queue libfabric accepts: a larger value falls back to its default of 1024.
export FI_CXI_DEFAULT_CQ_SIZE=131072
export FI_CXI_DEFAULT_TX_SIZE=16384
# NCCL registers its own buffers: libfabric must not register host memory behind its back.
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_CXI_RX_MATCH_MODE=software
export FI_MR_CACHE_MONITOR=userfaultfd
# GPU-aware MPI beside NCCL can deadlock; nothing here uses MPI.
export MPICH_GPU_SUPPORT_ENABLED=0
# If NCCL hangs or its watchdog times out (CSCS's page lists this as still under investigation),
# disable Slingshot's eager messages: COURSE_NCCL_NO_EAGER=1 sbatch ...
if [ "${COURSE_NCCL_NO_EAGER:-0}" = 1 ]; then
  export FI_CXI_RDZV_GET_MIN=0 FI_CXI_RDZV_THRESHOLD=0 FI_CXI_RDZV_EAGER_SIZE=0
fi

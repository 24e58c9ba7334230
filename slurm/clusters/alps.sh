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
# Which NCCL and libfabric variables, and who sets them (re-read both sources when NCCL, libfabric
# or the container engine change):
#   container  the aws_ofi_nccl hook sets its own, tuned by CSCS (Daint changelog, 2026-06-17:
#              NCCL_CROSS_NIC=0, NCCL_PXN_DISABLE=1, NCCL_PROTO=^LL128, the FI_CXI_RDZV_* set,
#              https://docs.cscs.ch/clusters/daint/): the profile exports none, so as not to undo them;
#   uenv       nothing sets them: the profile exports those of CSCS's NCCL page,
#              https://docs.cscs.ch/software/communication/nccl/ , each with the page's reason.
# Two of them are correctness settings before speed ones. NCCL_PROTO=^LL128: LL128 (default since
# NCCL 2.27) has silently corrupted data between GH200 nodes on Slingshot ("occasional #wrong
# transfers", NVIDIA/nccl#2001; the fix proposed in NVIDIA/nccl#2053 disables it on that path), and
# CSCS's page adds it "typically performs worse on Slingshot". The zero FI_CXI_RDZV_* thresholds
# (COURSE_NCCL_NO_EAGER=1): CSCS's workaround for hangs, and HPE's for a data corruption through
# GDRCopy (HewlettPackard/shs-ccl-docs#21). network_check.sbatch counts wrong values, as nccl-tests do.
COURSE_NEEDS_ACCOUNT=1
COURSE_NEEDS_GPUS=1
COURSE_LINK_GBPS=${COURSE_LINK_GBPS:-25}  # one Slingshot NIC per GPU: 200 Gb/s
export COURSE_NCCL_PLUGIN_FROM=${COURSE_NCCL_PLUGIN_FROM:-uenv}
# The network NCCL must use, which the job checks before training (not NCCL_NET: in a container
# the hook sets that one itself)
export COURSE_NCCL_NETWORK="AWS Libfabric"
# #region nccl-variables
if [ "$COURSE_NCCL_PLUGIN_FROM" = uenv ]; then
  export NCCL_NET="AWS Libfabric"        # the plugin, or fail at start-up: never fall back to TCP
  export NCCL_NET_GDR_LEVEL=PHB          # GPUDirect RDMA when GPU and NIC share a NUMA node
  export NCCL_CROSS_NIC=1                # as the page's list gives it (the hook now sets 0)
  export NCCL_PROTO=^LL128               # correctness first: LL128 corrupted data here (see the top)
  export FI_CXI_DEFAULT_CQ_SIZE=131072   # the FI_ values: "the best performance on the Alps
  export FI_CXI_DEFAULT_TX_SIZE=16384    #   network across a wide range of applications"
  export FI_CXI_DISABLE_HOST_REGISTER=1
  export FI_CXI_RX_MATCH_MODE=software
  export FI_MR_CACHE_MONITOR=userfaultfd
  export NCCL_NCHANNELS_PER_NET_PEER=4   # faster send/recv (pipelines) without hurting collectives
  # If NCCL hangs or its watchdog times out, or network_check finds wrong values, the workaround
  # disables Slingshot's eager messages: COURSE_NCCL_NO_EAGER=1 sbatch ... (the hook sets these)
  if [ "${COURSE_NCCL_NO_EAGER:-0}" = 1 ]; then
    export FI_CXI_RDZV_GET_MIN=0 FI_CXI_RDZV_THRESHOLD=0 FI_CXI_RDZV_EAGER_SIZE=0
  fi
fi
export MPICH_GPU_SUPPORT_ENABLED=0       # GPU-aware MPI beside NCCL "can easily lead to deadlocks"
# #endregion nccl-variables

"""The Alps profile exports what CSCS documents for each way of getting NCCL's network plugin.

A container job gets its NCCL and libfabric variables from the container engine's aws_ofi_nccl
hook (CSCS's Daint changelog, 2026-06-17, lists them): the profile must export none of them, or
it would undo CSCS's tuning (``NCCL_CROSS_NIC=1`` against the hook's 0). A uenv job has no hook:
the profile exports the list of CSCS's NCCL page.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

PROFILE = Path(__file__).resolve().parents[1] / "slurm" / "clusters" / "alps.sh"
HOOK_SETS = (  # the aws_ofi_nccl hook's variables, as the changelog lists them
    "NCCL_CROSS_NIC NCCL_PXN_DISABLE NCCL_P2P_LEVEL NCCL_NET_GDR_C2C NCCL_NET_GDR_READ NCCL_PROTO "
    "NCCL_NCHANNELS_PER_NET_PEER FI_CXI_RDZV_PROTO FI_CXI_RDZV_EAGER_SIZE FI_CXI_RDZV_GET_MIN "
    "FI_CXI_RDZV_THRESHOLD FI_MR_CACHE_MAX_SIZE FI_MR_CACHE_MAX_COUNT FI_CXI_SAFE_DEVMEM_COPY_THRESHOLD "
    "CUDA_CACHE_DISABLE"
).split()
NCCL_PAGE = {  # https://docs.cscs.ch/software/communication/nccl/, for uenv jobs
    "NCCL_NET": "AWS Libfabric",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_CROSS_NIC": "1",
    "NCCL_PROTO": "^LL128",
    "FI_CXI_DEFAULT_CQ_SIZE": "131072",
    "FI_CXI_DEFAULT_TX_SIZE": "16384",
    "FI_CXI_DISABLE_HOST_REGISTER": "1",
    "FI_CXI_RX_MATCH_MODE": "software",
    "FI_MR_CACHE_MONITOR": "userfaultfd",
    "NCCL_NCHANNELS_PER_NET_PEER": "4",
    "MPICH_GPU_SUPPORT_ENABLED": "0",
}


def _exported(**settings: str) -> dict[str, str]:
    """The variables a job has after sourcing the profile, in a clean environment plus ``settings``."""
    env = {"PATH": "/usr/bin:/bin", **settings}
    printed = subprocess.run(
        ["bash", "-c", f'source "{PROFILE}" && env -0'], env=env, capture_output=True, check=True
    ).stdout
    return dict(entry.split("=", 1) for entry in printed.decode().split("\0") if "=" in entry)


def test_a_container_job_leaves_every_nccl_and_libfabric_variable_to_the_hook():
    exported = _exported(COURSE_NCCL_PLUGIN_FROM="container", COURSE_NCCL_NO_EAGER="1")
    assert not [name for name in exported if name in HOOK_SETS or name.startswith(("NCCL_", "FI_"))]
    assert exported["COURSE_NCCL_NETWORK"] == "AWS Libfabric"  # what the job's checks expect NCCL to use


def test_the_jobs_check_the_plugin_and_the_network_in_a_container_too(monkeypatch, tmp_path):
    from course_lib.tools import jobcheck

    monkeypatch.delenv("NCCL_NET", raising=False)
    monkeypatch.setenv("COURSE_NCCL_NETWORK", "AWS Libfabric")
    assert jobcheck.expected_network() == "AWS Libfabric"
    plain = tmp_path / "plain.toml"
    plain.write_text('image = "x"\n')
    problem, _ = jobcheck.plugin_problem(
        source="container", nccl_net=jobcheck.expected_network(), library_path="", edf=str(plain)
    )
    assert problem.startswith(f"{plain} does not enable the plugin hook")


@pytest.mark.parametrize("plugin_from", [None, "uenv"])
def test_a_uenv_job_gets_the_variables_of_the_cscs_nccl_page(plugin_from):
    exported = _exported(**({"COURSE_NCCL_PLUGIN_FROM": plugin_from} if plugin_from else {}))
    assert {name: exported.get(name) for name in NCCL_PAGE} == NCCL_PAGE
    assert "FI_CXI_RDZV_EAGER_SIZE" not in exported  # the eager workaround only on request
    assert _exported(COURSE_NCCL_NO_EAGER="1")["FI_CXI_RDZV_EAGER_SIZE"] == "0"

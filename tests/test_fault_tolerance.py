"""PyTorch's fault-tolerance suite (torch >= 2.14's reconfigure API) passes on the hpct backend
as it does on Gloo: ft_suite.py builds the class; the torch tier (ci/torch_tier.sh) runs it."""

from __future__ import annotations

import pytest

import ft_suite

if not ft_suite.HAS_API:
    pytest.skip("torch before 2.14 has no reconfigure API (the torch tier runs this on torch 2.15)",
                allow_module_level=True)
if ft_suite.FOLDER is None:
    pytest.skip(f"PyTorch's {ft_suite.SUITE} is not here: it is read from $HPCT_NCCL_SOURCES/pytorch "
                "(.ci/run sets HPCT_NCCL_SOURCES to ../shared/sources)", allow_module_level=True)

HpctFaultToleranceTest = pytest.mark.multiprocess(ft_suite.HpctFaultToleranceTest)

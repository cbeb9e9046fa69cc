"""Every row of ``hpct doctor``, in order: the doctor's own (doctor.py), the c10d patches
(doctor_c10d.py) and NCCL's (doctor_nccl.py)."""

from __future__ import annotations

import dataclasses

from .doctor import (Probe, Row, check_config, check_dependencies, check_extension, check_free_ports,
                     check_kernel_ports, check_python, check_torch, check_torch_backends)
from .doctor_c10d import check_c10d_patches, expected_torch_series
from .doctor_nccl import check_nccl, check_nccl_for_hpct, check_nccl_wheel


def run_checks(probe: Probe | None = None) -> list[Row]:
    from .ports import PortPlan
    probe = Probe() if probe is None else probe
    if probe.torch_series is None:
        probe = dataclasses.replace(probe, torch_series=expected_torch_series)
    torch_row, torch = check_torch(probe)
    config_row, config = check_config(probe)
    rows = [check_python(probe), torch_row, check_dependencies(probe), *check_extension(probe), check_torch_backends(probe, torch),
            check_c10d_patches(probe, torch), check_nccl(probe, torch, config), check_nccl_for_hpct(probe, torch),
            *check_nccl_wheel(probe), config_row]
    if config is None:
        rows += [Row("kernel port ranges", "skip", "the configuration is invalid"),
                 Row("free ports", "skip", "the configuration is invalid")]
    else:
        plan = PortPlan.from_config(config)
        rows += [check_kernel_ports(probe, plan), check_free_ports(probe, config, plan)]
    return rows

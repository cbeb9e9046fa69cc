# hpct training-cluster image, CPU variant (docs/container.md; ci/image.sh builds it without a
# Docker daemon and runs `hpct doctor` and `hpct demo` inside it).
#
# Two stages.  `build` has the toolchain: ci/setup.sh installs it, `hpct-build wheel` fetches and
# verifies the pinned Gloo, patches it and builds it and the hpct wheel.  The runtime stage starts
# again from BASE and receives one virtual environment, /opt/hpct, holding torch, its dependencies
# and the hpct wheel: no compiler, no sources, no build-only Python packages.
#
# BASE: a Debian bookworm image with Python 3.11 and its venv module.  The default is the
# official image pinned by digest (the multi-platform index digest that docker-library/repo-info
# records for python:3.11-slim-bookworm, repos/python/remote/3.11-slim-bookworm.md); ci/image.sh
# passes a local debootstrap image instead, as no registry is reachable from CI.
ARG BASE=docker.io/library/python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

FROM ${BASE} AS build
# The CPU build of torch.  The pin carries the local label: PyPI's plain `torch==2.13.0` for
# Linux is the CUDA build, which `+cpu` can never match.  A wheel put in .whl/ of the build
# context is used first (ci/image.sh stages one there); TORCH_INDEX is where pip looks otherwise
# (empty: PyPI only).  The GPU variant changes these two and EXTRA_REQUIREMENTS (docs/container.md).
ARG TORCH_VERSION=2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRA_REQUIREMENTS=""
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY . /src
# /opt/hpct is the runtime environment.  ci/setup.sh and the wheel build run in a second one,
# /opt/build, that sees /opt/hpct's packages through a .pth file: setup.sh then finds the pinned
# CPU torch already there (it would otherwise ask PyPI for one) while its build tools stay out
# of /opt/hpct.  Only `hpct-build wheel` runs: the PyTorch and NCCL sources are not fetched.
# The extension compiles against Python.h: Debian's python3 ships it in python3-dev (the official
# python images have it already), and ci/setup.sh does not install it.
# Where the network passes a TLS-inspecting proxy, pip needs its CA: the secret `pip-ca`
# (`--secret id=pip-ca,src=BUNDLE`; ci/image.sh passes the bundle pip trusts on the build
# machine) is mounted for this step only and never lands in a layer.
RUN --mount=type=secret,id=pip-ca set -eu; \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    python3 -m venv /opt/hpct; \
    /opt/hpct/bin/pip install --find-links /src/.whl ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
        "torch==${TORCH_VERSION}" ${EXTRA_REQUIREMENTS}; \
    python3 -m venv /opt/build; \
    purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }; \
    purelib /opt/hpct/bin/python > "$(purelib /opt/build/bin/python)/hpct-runtime.pth"; \
    python3 -c 'import os, sys, sysconfig; \
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-dev >/dev/null; }; \
    PYTHON=/opt/build/bin/python bash ci/setup.sh; \
    /opt/build/bin/python -m hpct.builder wheel; \
    /opt/hpct/bin/pip install --no-index --no-deps --find-links dist hpct

FROM ${BASE}
ARG BASE
# Not HPCT_*: an ARG is an environment variable in RUN steps, and doctor refuses unknown HPCT_ names.
ARG USER_UID=1000
LABEL org.opencontainers.image.title="hpct" \
      org.opencontainers.image.description="rootless, TCPStore-less, recoverable PyTorch process groups" \
      org.opencontainers.image.licenses="BSD-3-Clause" \
      org.opencontainers.image.base.name="${BASE}"
ENV PATH=/opt/hpct/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    VIRTUAL_ENV=/opt/hpct PYTHONDONTWRITEBYTECODE=1
RUN useradd --uid "${USER_UID}" --create-home --no-log-init --shell /bin/bash hpct
# Owned by root: the training user can run the environment but not change it.
COPY --from=build /opt/hpct /opt/hpct
USER hpct
WORKDIR /home/hpct
# The build-time doctor: every row that describes the image (Python, torch, the extension and
# its Gloo series, the backends, the default configuration) must pass.  The node's rows (kernel
# port ranges, free ports) describe the build machine, not the node the image will run on:
# shown, not judged.  `hpct doctor` exits non-zero on any failing row, so the JSON decides.
RUN hpct doctor --json > /tmp/doctor.json || true && \
    python -c 'import json, sys; node = {"kernel port ranges", "free ports"}; \
rows = json.load(open("/tmp/doctor.json"))["checks"]; \
print("\n".join("doctor: %-5s %s: %s" % (r["status"], r["check"], r["detail"]) for r in rows)); \
bad = [r["check"] for r in rows if r["status"] == "fail" and r["check"] not in node]; \
sys.exit("hpct doctor in the image: failing: " + ", ".join(bad) if bad else 0)' && \
    rm -f /tmp/doctor.json

# The kernel's port range is per network namespace: apply it in the pod (`hpct ports apply` in a
# privileged init container, or sysctls in the pod spec).  At run time doctor judges the node too.
ENTRYPOINT ["hpct"]
CMD ["doctor"]

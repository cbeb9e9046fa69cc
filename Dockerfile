# hpct training-cluster image (first version).
#
# Builds what ci/main.sh builds: the pinned, patched Gloo and the hpct wheel on
# top of PyTorch, then checks the result with `hpct doctor`.  A later version
# starts from a CUDA base and adds the patched NCCL and PyTorch wheels, which
# need their sources handed over (see README: NCCL is not downloadable from CI).
FROM python:3.11-bookworm

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
WORKDIR /opt/hpct
COPY . /opt/hpct

# ci/setup.sh adds the deb-src entry, the toolchain and the Python packages;
# `hpct-build all` fetches, verifies, patches and builds, then installs the wheel.
RUN bash ci/setup.sh \
 && python3 -m hpct.build all \
 && rm -rf third_party/src third_party/patched build

# The kernel's port range is per network namespace: apply it in the pod
# (`hpct ports apply`, privileged init container or sysctls in the pod spec).
ENTRYPOINT ["hpct"]
CMD ["doctor"]

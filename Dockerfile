# One image per process, each installing the project's wheel with its own extra (pyproject.toml)
# alone, so the operator and the node agents carry no torch; every distribution's version comes
# from the extra's constraints file (constraints/, written by `tessera-dev lock`).
# Build: docker build --target operator -t tessera:0.1.0 .
#        docker build --target power-agent -t tessera-power-agent:0.1.0 .
#        docker build --target trainer -t tessera-trainer:0.1.0 .
# The node's health agent runs in the power-agent image (`tessera health-agent`, the DaemonSet's
# second container). `tessera-dev image-sizes` measures what each target installs.
# The Debian release is named so the trainer's C compiler does not change under a rebuild.
FROM python:3.11-slim-bookworm AS base
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN useradd --uid 65532 --create-home tessera
WORKDIR /opt/tessera
# Each process's direct dependencies, read from pyproject.toml alone: they install, with the
# extra's constraints, in layers that a change to the source leaves cached.
COPY pyproject.toml ./
RUN for extra in operator agent trainer; do \
      python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(*p["dependencies"], *p["optional-dependencies"][sys.argv[1]], sep="\n")' "$extra" > "requirements-$extra.txt"; \
    done

FROM base AS wheel
# the shared packages (src/), each process's own folder, and the CRDs the contracts carry
COPY src/ src/
COPY operator/ operator/
COPY power_controller/ power_controller/
COPY trainer_image/ trainer_image/
COPY crds/ crds/
RUN pip wheel --no-deps -w /wheels .

FROM base AS operator
COPY constraints/operator.txt constraints/
RUN pip install -r requirements-operator.txt -c constraints/operator.txt
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-deps /wheels/*.whl
USER 65532
ENTRYPOINT ["tessera"]

# NVML needs the driver's utility capability; the NVIDIA container runtime (runtimeClassName
# nvidia in the DaemonSet) injects the devices, and root + SYS_ADMIN is what setting limits needs.
# The health container runs this image as uid 65532 with its own command.
FROM base AS power-agent
ENV NVIDIA_DRIVER_CAPABILITIES=utility NVIDIA_VISIBLE_DEVICES=all
COPY constraints/agent.txt constraints/
RUN pip install -r requirements-agent.txt -c constraints/agent.txt
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-deps /wheels/*.whl
ENTRYPOINT ["tessera", "power-agent"]

# CUDA-capable without an nvidia/cuda base: PyTorch's wheels bring the CUDA runtime, cuBLAS,
# cuDNN, NCCL, NVRTC and nvJitLink as pip packages (nvidia-*, pinned in constraints/trainer.txt),
# and Triton's wheel its own ptxas, cuobjdump and CUDA headers. The driver (libcuda.so.1) is the
# host's, injected by the NVIDIA container runtime with the compute capability and registered
# with ldconfig, where Triton looks for it (/sbin/ldconfig -p). What Triton needs besides at run
# time is a C compiler for the launcher stub it builds per kernel signature (gcc, libc6-dev) and
# Python's headers, which this base ships (/usr/local/include/python3.11). An nvidia/cuda base
# would add a second copy of the CUDA libraries torch does not load and an Ubuntu without
# Python 3.11. Triton caches the kernels it compiles under the user's home (~/.triton).
FROM base AS trainer
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility NVIDIA_VISIBLE_DEVICES=all
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY constraints/trainer.txt constraints/
RUN pip install -r requirements-trainer.txt -c constraints/trainer.txt
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-deps /wheels/*.whl
USER 65532
# the pod's node agent: one ntp.train rank per GPU of its node, following the job's generations
ENTRYPOINT ["python", "-m", "ntp.nodeagent"]

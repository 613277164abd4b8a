# One image per process, each installing the project's wheel with its own extra (pyproject.toml)
# alone, so the operator and the node agents carry no torch.
# Build: docker build --target operator -t tessera:0.1.0 .
#        docker build --target power-agent -t tessera-power-agent:0.1.0 .
#        docker build --target trainer -t tessera-trainer:0.1.0 .
# The node's health agent runs in the power-agent image (`tessera health-agent`, the DaemonSet's
# second container).
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN useradd --uid 65532 --create-home tessera
WORKDIR /opt/tessera
# Each process's pinned dependencies, read from pyproject.toml alone: they install in layers that
# a change to the source leaves cached.
COPY pyproject.toml ./
RUN for extra in operator agent trainer; do \
      python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(*p["dependencies"], *p["optional-dependencies"][sys.argv[1]], sep="\n")' "$extra" > "requirements-$extra.txt"; \
    done

FROM base AS wheel
COPY src/ src/
RUN pip wheel --no-deps -w /wheels .

FROM base AS operator
RUN pip install -r requirements-operator.txt
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-deps /wheels/*.whl
USER 65532
ENTRYPOINT ["tessera"]

# NVML needs the driver's utility capability; the NVIDIA container runtime (runtimeClassName
# nvidia in the DaemonSet) injects the devices, and root + SYS_ADMIN is what setting limits needs.
# The health container runs this image as uid 65532 with its own command.
FROM base AS power-agent
ENV NVIDIA_DRIVER_CAPABILITIES=utility NVIDIA_VISIBLE_DEVICES=all
RUN pip install -r requirements-agent.txt
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-deps /wheels/*.whl
ENTRYPOINT ["tessera", "power-agent"]

# CUDA comes with PyTorch's wheels (the CUDA runtime, cuDNN and NCCL as pip packages) and the
# host's driver through the NVIDIA container runtime; Triton compiles its kernel launchers with
# the C compiler at run time.
FROM base AS trainer
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility NVIDIA_VISIBLE_DEVICES=all
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install -r requirements-trainer.txt
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-deps /wheels/*.whl
USER 65532
# the pod's node agent: one ntp.train rank per GPU of its node, following the job's generations
ENTRYPOINT ["python", "-m", "ntp.nodeagent"]

# One image, three entry points: the operator, the node power agent and the NTP trainer.
# Build: docker build --target operator -t tessera:0.1.0 . (likewise --target power-agent -t
# tessera-power-agent:0.1.0, --target trainer -t tessera-trainer:0.1.0)
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/tessera
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY tessera_agents/ tessera_agents/
COPY trainer_image/ trainer_image/
COPY crds/ crds/
RUN pip install -e .
RUN useradd --uid 65532 --create-home tessera

FROM base AS operator
USER 65532
ENTRYPOINT ["tessera"]

# NVML needs the driver's utility capability; the NVIDIA container runtime (runtimeClassName
# nvidia in the DaemonSet) injects the devices, and root + SYS_ADMIN is what setting limits needs.
FROM base AS power-agent
ENV NVIDIA_DRIVER_CAPABILITIES=utility NVIDIA_VISIBLE_DEVICES=all
ENTRYPOINT ["tessera", "power-agent"]

FROM base AS trainer
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility NVIDIA_VISIBLE_DEVICES=all
USER 65532
# the pod's node agent: one ntp.train rank per GPU of its node, following the job's generations
ENTRYPOINT ["python", "-m", "ntp.nodeagent"]
